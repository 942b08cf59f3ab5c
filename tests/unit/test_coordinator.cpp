// Coordinator: cross-host matching of group ops.
#include <catch2/catch.hpp>

#include "daemon/engine/coordinator.h"
#include "proto/types.h"

using namespace ringd;
using namespace std::chrono_literals;

namespace {

proto::OpReport ready(const std::string &g, uint64_t k, uint64_t count = 100, DType t = DType::F32,
                      ReduceOp op = ReduceOp::Sum, uint32_t local = 2) {
    return {7, g, k, count, static_cast<uint32_t>(t), static_cast<uint32_t>(op), local, 0, ""};
}

}  // namespace

TEST_CASE("an op starts once every host reported it, with the total rank count", "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    Coordinator::Decisions d;
    const auto t0 = Clock::now();
    c.report(0, ready("g", 0, 100, DType::F32, ReduceOp::Sum, 2), t0, d);
    c.report(2, ready("g", 0, 100, DType::F32, ReduceOp::Sum, 1), t0, d);
    CHECK(d.starts.empty());
    c.report(1, ready("g", 0, 100, DType::F32, ReduceOp::Sum, 3), t0, d);
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].total_ranks == 6);
    CHECK(d.starts[0].op_id == 1);
    CHECK(d.starts[0].generation == 7);
    c.report(0, ready("g", 1), t0, d);
    c.report(1, ready("g", 1), t0, d);
    c.report(2, ready("g", 1), t0, d);
    REQUIRE(d.starts.size() == 2);
    CHECK(d.starts[1].op_id == 2);
    CHECK(d.fails.empty());
    CHECK(c.pending() == 0);
}

TEST_CASE("a mismatch between hosts fails the op naming both", "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    Coordinator::Decisions d;
    c.report(0, ready("g", 0, 100), Clock::now(), d);
    c.report(1, ready("g", 0, 101), Clock::now(), d);
    REQUIRE(d.fails.size() == 1);
    CHECK(d.fails[0].code == -EINVAL);
    CHECK_THAT(d.fails[0].message, Catch::Contains("host a submitted 100 x float sum") &&
                                       Catch::Contains("host b submitted 101 x float sum"));
    c.report(1, ready("g", 0, 101), Clock::now(), d);  // late duplicate: nothing more
    CHECK(d.fails.size() == 1);
    CHECK(d.starts.empty());
}

TEST_CASE("a host's local failure fails the op everywhere with its message", "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    Coordinator::Decisions d;
    c.report(0, ready("g", 0), Clock::now(), d);
    proto::OpReport f = ready("g", 0);
    f.status = -ECONNABORTED;
    f.message = "group g op 0: host b local rank 1 left";
    c.report(1, f, Clock::now(), d);
    REQUIRE(d.fails.size() == 1);
    CHECK(d.fails[0].message == "group g op 0: host b local rank 1 left");
}

TEST_CASE("hosts that do not report are named when the op times out", "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    Coordinator::Decisions d;
    const auto t0 = Clock::now();
    c.report(1, ready("g", 0), t0, d);
    c.expire(t0 + 999ms, d);
    CHECK(d.fails.empty());
    c.expire(t0 + 1000ms, d);
    REQUIRE(d.fails.size() == 1);
    CHECK(d.fails[0].code == -ETIMEDOUT);
    CHECK_THAT(d.fails[0].message, Catch::Contains("host(s) a, c did not submit it"));
}

TEST_CASE("reports from another generation are ignored; reset forgets pending ops", "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    Coordinator::Decisions d;
    c.report(0, ready("g", 0), Clock::now(), d);
    CHECK(c.pending() == 1);
    c.reset(8);
    CHECK(c.pending() == 0);
    c.report(1, ready("g", 0), Clock::now(), d);  // generation 7: stale
    CHECK(c.pending() == 0);
    auto r = ready("g", 0);
    r.generation = 8;
    c.report(0, r, Clock::now(), d);
    c.report(1, r, Clock::now(), d);
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].generation == 8);
    CHECK(d.starts[0].op_id == 1);
}

TEST_CASE("one-/two-shot ops are decided without a start; hosts on different algorithms fail the op",
          "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    Coordinator::Decisions d;
    auto direct = [](uint64_t k) {
        auto r = ready("g", k);
        r.algorithm = 1;
        return r;
    };
    for (uint32_t h = 0; h < 3; ++h) c.report(h, direct(0), Clock::now(), d);
    CHECK(d.starts.empty());
    CHECK(d.fails.empty());
    CHECK(c.pending() == 0);
    // Ring ops keep their own op ids: the direct op took none.
    for (uint32_t h = 0; h < 3; ++h) c.report(h, ready("g", 1), Clock::now(), d);
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].op_id == 1);
    // Hosts whose tuning differs pick different algorithms for the same op: it fails, named.
    c.report(0, direct(2), Clock::now(), d);
    c.report(1, ready("g", 2), Clock::now(), d);
    REQUIRE(d.fails.size() == 1);
    CHECK_THAT(d.fails[0].message, Catch::Contains("hosts a and b chose different algorithms"));
    // A host that does not send its data is named when the op times out.
    c.report(0, direct(3), Clock::now(), d);
    c.report(2, direct(3), Clock::now(), d);
    c.expire(Clock::now() + 2s, d);
    REQUIRE(d.fails.size() == 2);
    CHECK_THAT(d.fails[1].message, Catch::Contains("host(s) b did not submit it"));
}
