// GroupTable: matching of submissions across local ranks, mismatches, timeouts, departures.
#include <catch2/catch.hpp>

#include <algorithm>

#include "daemon/engine/group_table.h"
#include "proto/peer.h"

using namespace ringd;
using std::chrono::milliseconds;

namespace {

proto::Submission sub(uint64_t seq, uint64_t count = 16, DType t = DType::F32, ReduceOp op = ReduceOp::Sum,
                      uint64_t offset = 0) {
    proto::Submission s;
    s.seq = seq;
    s.desc = OpDesc{Collective::Allreduce, t, op, count, 0};
    s.offset = s.out_offset = offset;
    s.bytes = s.out_bytes = count * dtype_size(t);
    return s;
}

struct Fixture {
    GroupTable table{"h0", milliseconds(1000)};
    std::vector<Completion> out;
    std::vector<OpRun> ready;
    Clock::time_point t0 = Clock::now();
};

}  // namespace

TEST_CASE_METHOD(Fixture, "an op starts when every local rank submitted it", "[group]") {
    REQUIRE(table.join(1, "g", 0, 3, 0).ok());
    REQUIRE(table.join(2, "g", 1, 3, 0).ok());
    REQUIRE(table.join(3, "g", 2, 3, 0).ok());
    table.submit(1, sub(1, 16, DType::F32, ReduceOp::Sum, 0), t0, out, ready);
    table.submit(3, sub(1, 16, DType::F32, ReduceOp::Sum, 128), t0, out, ready);
    CHECK(ready.empty());
    table.submit(2, sub(1, 16, DType::F32, ReduceOp::Sum, 64), t0, out, ready);
    REQUIRE(ready.size() == 1);
    CHECK(out.empty());
    CHECK(ready[0].members == std::vector<MemberId>{1, 2, 3});
    CHECK(ready[0].offsets == std::vector<uint64_t>{0, 64, 128});
    table.finished(ready[0].op_id, 0, "", out);
    REQUIRE(out.size() == 3);
    for (const auto &c : out) CHECK(c.status == 0);
    CHECK(table.totals().ops_completed == 1);
    CHECK(table.totals().bytes_reduced == 64);
}

TEST_CASE_METHOD(Fixture, "joins are checked", "[group]") {
    REQUIRE(table.join(1, "g", 0, 2, 0).ok());
    CHECK(table.join(2, "g", 0, 2, 0).error().code == -EADDRINUSE);
    CHECK_THAT(table.join(2, "g", 1, 3, 0).error().message, Catch::Contains("local_size 2"));
    CHECK(table.join(1, "h", 0, 1, 0).error().code == -EALREADY);
    CHECK(table.join(2, "g", 1, 2, 0).ok());
}

TEST_CASE_METHOD(Fixture, "a mismatch fails every rank with a message naming it", "[group]") {
    REQUIRE(table.join(1, "g", 0, 3, 0).ok());
    REQUIRE(table.join(2, "g", 1, 3, 0).ok());
    REQUIRE(table.join(3, "g", 2, 3, 0).ok());
    table.submit(1, sub(1, 16), t0, out, ready);
    table.submit(2, sub(1, 17), t0, out, ready);
    REQUIRE(out.size() == 2);
    CHECK_THAT(out[0].message, Catch::Contains("local rank 0 submitted 16 x float sum, local rank 1 submitted 17 x float sum"));
    CHECK(out[0].status == -EINVAL);
    out.clear();
    table.submit(3, sub(1, 16), t0, out, ready);  // the late rank gets the same error
    REQUIRE(out.size() == 1);
    CHECK(out[0].member == 3);
    CHECK_THAT(out[0].message, Catch::Contains("mismatch"));
    CHECK(ready.empty());
    // The next op works.
    out.clear();
    for (MemberId m : {1u, 2u, 3u}) table.submit(m, sub(2), t0, out, ready);
    CHECK(ready.size() == 1);
    CHECK(out.empty());
}

TEST_CASE_METHOD(Fixture, "dtype and op mismatches are named too", "[group]") {
    REQUIRE(table.join(1, "g", 0, 2, 0).ok());
    REQUIRE(table.join(2, "g", 1, 2, 0).ok());
    table.submit(1, sub(1, 16, DType::F32, ReduceOp::Sum), t0, out, ready);
    table.submit(2, sub(1, 16, DType::F32, ReduceOp::Max), t0, out, ready);
    REQUIRE(out.size() == 2);
    CHECK_THAT(out[1].message, Catch::Contains("float max"));
    out.clear();
    table.submit(1, sub(2, 8, DType::F16), t0, out, ready);
    table.submit(2, sub(2, 8, DType::BF16), t0, out, ready);
    REQUIRE(out.size() == 2);
    CHECK_THAT(out[1].message, Catch::Contains("bfloat16"));
}

TEST_CASE_METHOD(Fixture, "a pending op times out naming the missing ranks", "[group]") {
    REQUIRE(table.join(1, "g", 0, 3, 0).ok());
    REQUIRE(table.join(2, "g", 1, 3, 0).ok());
    REQUIRE(table.join(3, "g", 2, 3, 0).ok());
    table.submit(2, sub(1), t0, out, ready);
    REQUIRE(table.next_deadline().has_value());
    table.expire(t0 + milliseconds(999), out);
    CHECK(out.empty());
    table.expire(t0 + milliseconds(1000), out);
    REQUIRE(out.size() == 1);
    CHECK(out[0].member == 2);
    CHECK(out[0].status == -ETIMEDOUT);
    CHECK_THAT(out[0].message, Catch::Contains("local ranks 0,2 of host h0 did not submit"));
    CHECK_FALSE(table.next_deadline().has_value());
}

TEST_CASE_METHOD(Fixture, "a rank that leaves fails pending and running ops and breaks the group", "[group]") {
    REQUIRE(table.join(1, "g", 0, 2, 0).ok());
    REQUIRE(table.join(2, "g", 1, 2, 0).ok());
    table.submit(1, sub(1), t0, out, ready);
    table.submit(2, sub(1), t0, out, ready);
    REQUIRE(ready.size() == 1);
    table.submit(1, sub(2), t0, out, ready);  // pending: rank 1 has not submitted op 2
    table.leave(2, out);
    REQUIRE(out.size() == 1);
    CHECK(out[0].member == 1);
    CHECK(out[0].seq == 2);
    CHECK_THAT(out[0].message, Catch::Contains("host h0 local rank 1 left"));
    out.clear();
    table.finished(ready[0].op_id, 0, "", out);  // the running op ends in an error too
    REQUIRE(out.size() == 2);
    CHECK(out[0].status != 0);
    CHECK_THAT(out[0].message, Catch::Contains("local rank 1 left"));
    out.clear();
    table.submit(1, sub(3), t0, out, ready);
    REQUIRE(out.size() == 1);
    CHECK(out[0].status == -ECONNABORTED);
    CHECK(table.join(3, "g", 1, 2, 0).error().code == -EBUSY);
    table.leave(1, out);
    CHECK(table.summaries().empty());  // all gone: the name is free again
    CHECK(table.join(3, "g", 0, 1, 0).ok());
}

TEST_CASE_METHOD(Fixture, "an invalid submission fails the op for the whole group", "[group]") {
    REQUIRE(table.join(1, "g", 0, 2, 0).ok());
    REQUIRE(table.join(2, "g", 1, 2, 0).ok());
    table.submit(2, sub(1), t0, out, ready);
    table.reject(1, 1, -ERANGE, "outside the slot", out);
    REQUIRE(out.size() == 2);
    CHECK(out[0].member == 1);
    CHECK(out[0].message == "outside the slot");
    CHECK(out[1].member == 2);
    CHECK_THAT(out[1].message, Catch::Contains("local rank 0 submitted an invalid op (outside the slot)"));
}

TEST_CASE_METHOD(Fixture, "a refused op fails on every rank, naming the rank that refused it and why; the group goes on",
                 "[group]") {
    REQUIRE(table.join(1, "g", 0, 3, 0).ok());
    REQUIRE(table.join(2, "g", 1, 3, 0).ok());
    REQUIRE(table.join(3, "g", 2, 3, 0).ok());
    table.submit(2, sub(1), t0, out, ready);  // before the refusal, and (rank 2) after it
    table.reject(1, 1, -E2BIG, "its all_to_all needs 99 bytes of its slot, which has 64", out, true);
    table.submit(3, sub(1), t0, out, ready);
    REQUIRE(out.size() == 3);
    for (const auto &c : out) {
        CHECK(c.status == -E2BIG);
        CHECK_THAT(c.message, Catch::Contains("group g op 1: host ") && Catch::Contains(" local rank 0 refused it: its "
                                                                                        "all_to_all needs 99 bytes"));
    }
    CHECK(out[0].member == 1);
    CHECK(out[1].member == 2);
    CHECK(out[2].member == 3);
    CHECK(ready.empty());
    out.clear();
    for (MemberId m : {1, 2, 3}) table.submit(m, sub(2), t0, out, ready);
    CHECK(out.empty());
    REQUIRE(ready.size() == 1);
    CHECK(ready[0].seq == 2);
}

TEST_CASE_METHOD(Fixture, "a local failure goes to the other hosts only once no earlier op of its group waits here",
                 "[group]") {
    REQUIRE(table.join(1, "g", 0, 2, 0).ok());
    REQUIRE(table.join(2, "g", 1, 2, 0).ok());
    table.submit(1, sub(1), t0, out, ready);  // op 1 waits for local rank 1
    table.reject(1, 2, -E2BIG, "its all_to_all needs 99 bytes of its slot, which has 64", out, true);
    CHECK(table.take_failures().empty());  // held behind op 1
    auto seqs = [](const std::vector<LocalFailure> &v) {
        std::vector<uint64_t> s;
        for (const auto &f : v) s.push_back(f.seq);
        std::sort(s.begin(), s.end());
        return s;
    };
    SECTION("op 1 becomes ready: the failure follows it") {
        table.submit(2, sub(1), t0, out, ready);
        REQUIRE(ready.size() == 1);
        const auto f = table.take_failures();
        REQUIRE(f.size() == 1);
        CHECK(f[0].seq == 2);
        CHECK(f[0].code == -E2BIG);
        CHECK_THAT(f[0].message, Catch::Contains("local rank 0 refused it"));
    }
    SECTION("op 1 times out here: both go") {
        table.expire(t0 + milliseconds(1000), out);
        CHECK(seqs(table.take_failures()) == std::vector<uint64_t>{1, 2});
    }
    SECTION("local rank 1 leaves: both go, and the incarnation's end") {
        table.leave(2, out);
        CHECK(seqs(table.take_failures()) == std::vector<uint64_t>{1, 2, proto::kIncarnationEnds});
    }
    CHECK(table.take_failures().empty());
}

TEST_CASE_METHOD(Fixture, "shutdown fails everything", "[group]") {
    REQUIRE(table.join(1, "g", 0, 2, 0).ok());
    REQUIRE(table.join(2, "g", 1, 2, 0).ok());
    table.submit(1, sub(1), t0, out, ready);
    table.submit(2, sub(1), t0, out, ready);
    table.submit(1, sub(2), t0, out, ready);
    table.fail_everything("ringd is shutting down", out);
    REQUIRE(out.size() == 3);
    for (const auto &c : out) CHECK(c.message == "ringd is shutting down");
}

TEST_CASE_METHOD(Fixture, "every op that ends is counted for the metrics by group and algorithm, and timed", "[group][metrics]") {
    REQUIRE(table.join(1, "g", 0, 1, 0).ok());
    // A ring op that takes 30 ms from its submission, a local one that fails after 3 s, and one
    // that fails while matching (a mismatch cannot happen with one rank: a timeout does).
    table.submit(1, sub(1, 16), t0, out, ready);
    REQUIRE(ready.size() == 1);
    table.set_algorithm(ready[0].op_id, "ring");
    table.finished(ready[0].op_id, 0, "", out, t0 + milliseconds(30));
    table.submit(1, sub(2, 16), t0, out, ready);
    REQUIRE(ready.size() == 2);
    table.set_algorithm(ready[1].op_id, "local");
    table.finished(ready[1].op_id, -EIO, "boom", out, t0 + milliseconds(3000));
    const OpMetrics &m = table.op_metrics();
    CHECK(m.series("g", "ring")->completed == 1);
    CHECK(m.series("g", "ring")->bytes == 64);
    CHECK(m.series("g", "local")->failed == 1);
    CHECK(m.series("g", "local")->bytes == 0);
    const auto &ring = m.durations().at("ring");
    CHECK(ring.count == 1);
    CHECK(ring.sum == Approx(0.030));
    // 30 ms lands in the (0.025, 0.05] bucket.
    const size_t at = static_cast<size_t>(std::find(OpMetrics::kBuckets.begin(), OpMetrics::kBuckets.end(), 0.05) -
                                          OpMetrics::kBuckets.begin());
    CHECK(ring.counts[at] == 1);
    CHECK(m.durations().at("local").counts[OpMetrics::kBuckets.size() - 2] == 1);  // (2.5, 10]

    // An op an unsubmitted rank holds up fails when its deadline passes: "none" (no path taken),
    // counted, not timed.
    REQUIRE(table.join(2, "h", 0, 2, 0).ok());
    table.submit(2, sub(1, 16), t0, out, ready);
    table.expire(t0 + milliseconds(1500), out);
    CHECK(m.series("h", "none")->failed == 1);
    CHECK_FALSE(m.durations().count("none"));
    CHECK(m.totals().at("ring").completed == 1);
}

TEST_CASE("a gone group's metrics series are dropped after 10 minutes, a live one's never", "[metrics]") {
    OpMetrics m;
    const auto t0 = OpMetrics::Clock::now();
    m.ended("live", "ring", true, 8, 0.001, t0);
    m.ended("gone", "ring", true, 8, 0.001, t0);
    m.forget_gone({"live"}, t0 + std::chrono::minutes(9));
    CHECK(m.series("gone", "ring") != nullptr);
    m.forget_gone({"live"}, t0 + std::chrono::minutes(11));
    CHECK(m.series("gone", "ring") == nullptr);
    CHECK(m.series("live", "ring") != nullptr);
    CHECK(m.totals().at("ring").completed == 2);  // the totals keep every op
    // Past kMaxGroups the longest-idle gone groups go first, whatever their age.
    for (size_t i = 0; i < OpMetrics::kMaxGroups + 10; ++i)
        m.ended("job" + std::to_string(i), "ring", true, 8, 0.001, t0 + std::chrono::minutes(11) + std::chrono::seconds(i));
    m.forget_gone({"live"}, t0 + std::chrono::minutes(11) + std::chrono::seconds(OpMetrics::kMaxGroups + 10));  // none 10 min old
    CHECK(m.groups().size() == OpMetrics::kMaxGroups);
    CHECK(m.series("live", "ring") != nullptr);
    CHECK(m.series("job0", "ring") == nullptr);
    CHECK(m.series("job10", "ring") == nullptr);
    CHECK(m.series("job11", "ring") != nullptr);
    CHECK(m.series("job" + std::to_string(OpMetrics::kMaxGroups + 9), "ring") != nullptr);
}

TEST_CASE_METHOD(Fixture, "a started op that ends without a path is counted as 'none' and not timed", "[group][metrics]") {
    REQUIRE(table.join(1, "g", 0, 1, 0).ok());
    table.submit(1, sub(1, 16), t0, out, ready);
    REQUIRE(ready.size() == 1);
    table.finished(ready[0].op_id, -EIO, "no ring domain", out, t0 + milliseconds(5));  // no set_algorithm
    CHECK(table.op_metrics().series("g", "none")->failed == 1);
    CHECK_FALSE(table.op_metrics().durations().count("none"));
}

TEST_CASE_METHOD(Fixture, "a reload's host list: groups' hosts remapped, a gone host dropped; an ended group fails its "
                          "pending and running ops with the reason and refuses new ones until its ranks reconnect",
                 "[group]") {
    REQUIRE(table.join(1, "kept", 0, 1, 0, {1, 3}).ok());
    REQUIRE(table.join(2, "ended", 0, 2, 0, {1, 2}).ok());
    REQUIRE(table.join(3, "ended", 1, 2, 0, {1, 2}).ok());
    // A running op (both ranks submitted) and a pending one (one rank).
    table.submit(2, sub(1), t0, out, ready);
    table.submit(3, sub(1, 16, DType::F32, ReduceOp::Sum, 64), t0, out, ready);
    REQUIRE(ready.size() == 1);
    table.submit(2, sub(2), t0, out, ready);
    table.remap_hosts({0, 1, UINT32_MAX, 2});  // host 2 left, host 3 is now 2
    CHECK(*table.hosts_of("kept") == std::vector<uint32_t>{1, 2});
    CHECK(*table.hosts_of("ended") == std::vector<uint32_t>{1});
    table.end_group("ended", "the host list changed: host c left the host list", out);
    // Op 1 on both ranks, op 2 on the rank that submitted it.
    REQUIRE(out.size() == 3);
    for (const auto &c : out) {
        CHECK(c.status == -ECONNABORTED);
        CHECK_THAT(c.message, Catch::Contains("the host list changed: host c left the host list"));
    }
    out.clear();
    table.submit(3, sub(2, 16, DType::F32, ReduceOp::Sum, 64), t0, out, ready);
    REQUIRE(out.size() == 1);
    CHECK_THAT(out[0].message, Catch::Contains("the host list changed") && Catch::Contains("every rank of the group must reconnect"));
    table.finished(ready[0].op_id, 0, "", out);  // its domain is gone: a late result changes nothing
    CHECK(table.summaries().size() == 2);
}
