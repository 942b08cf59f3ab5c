// Coordinator: agreement on group incarnations and cross-host matching of group ops.
#include <catch2/catch.hpp>

#include "daemon/engine/coordinator.h"
#include "proto/types.h"

using namespace ringd;
using namespace std::chrono_literals;

namespace {

// Every host joins group g with local incarnation (host + 1) * 100 + run; returns the agreed one.
uint64_t agree(Coordinator &c, uint32_t hosts, const std::string &g = "g", uint64_t run = 0, uint64_t previous = 0) {
    Coordinator::Decisions d;
    for (uint32_t h = 0; h < hosts; ++h) c.join(h, {c.generation(), g, (h + 1) * 100 + run, previous}, d);
    REQUIRE(d.groups.size() == hosts);
    for (uint32_t h = 0; h < hosts; ++h) {
        CHECK(d.groups[h].first == h);
        CHECK(d.groups[h].second.code == 0);
        CHECK(d.groups[h].second.local_id == (h + 1) * 100 + run);
        CHECK(d.groups[h].second.incarnation == d.groups[0].second.incarnation);
    }
    return d.groups[0].second.incarnation;
}

proto::OpReport ready(uint64_t inc, uint64_t seq, uint64_t count = 100, DType t = DType::F32,
                      ReduceOp op = ReduceOp::Sum, uint32_t local = 2, const std::string &g = "g") {
    return {7, g, seq, count, static_cast<uint32_t>(t), static_cast<uint32_t>(op), local, 0, "", 0, inc, 1000};
}

proto::OpReport failed(uint64_t inc, uint64_t seq, const std::string &why, const std::string &g = "g") {
    proto::OpReport r = ready(inc, seq, 100, DType::F32, ReduceOp::Sum, 2, g);
    r.status = -ECONNABORTED;
    r.message = why;
    if (seq == proto::kIncarnationEnds) r.count = 0;  // an end that says nothing of what ended on its host
    return r;
}

}  // namespace

TEST_CASE("an op starts once every host reported it, with the total rank count", "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 3);
    Coordinator::Decisions d;
    const auto t0 = Clock::now();
    c.report(0, ready(inc, 1, 100, DType::F32, ReduceOp::Sum, 2), t0, d);
    c.report(2, ready(inc, 1, 100, DType::F32, ReduceOp::Sum, 1), t0, d);
    CHECK(d.starts.empty());
    c.report(1, ready(inc, 1, 100, DType::F32, ReduceOp::Sum, 3), t0, d);
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].total_ranks == 6);
    CHECK(d.starts[0].op_id == 1);
    CHECK(d.starts[0].generation == 7);
    CHECK(d.starts[0].incarnation == inc);
    CHECK(d.starts[0].seq == 1);
    for (uint32_t h = 0; h < 3; ++h) c.report(h, ready(inc, 2), t0, d);
    REQUIRE(d.starts.size() == 2);
    CHECK(d.starts[1].op_id == 2);
    CHECK(d.fails.empty());
    CHECK(c.pending() == 0);
}

TEST_CASE("reports of an incarnation that was never agreed are dropped", "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    Coordinator::Decisions d;
    c.join(0, {7, "g", 100, 0}, d);
    CHECK(d.groups.empty());  // until every host joined
    c.report(0, ready(12345, 1), Clock::now(), d);
    CHECK(c.pending() == 0);
}

TEST_CASE("a mismatch between hosts fails the op naming both, for every host that reported it", "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 2);
    Coordinator::Decisions d;
    c.report(0, ready(inc, 1, 100), Clock::now(), d);
    c.report(1, ready(inc, 1, 101), Clock::now(), d);
    REQUIRE(d.fails.size() == 2);  // to both hosts
    for (const auto &[h, f] : d.fails) {
        CHECK(f.code == -EINVAL);
        CHECK(f.incarnation == inc);
        CHECK_THAT(f.message, Catch::Contains("host a submitted 100 x float sum") &&
                                  Catch::Contains("host b submitted 101 x float sum"));
    }
    c.report(1, ready(inc, 1, 101), Clock::now(), d);  // a late duplicate gets the same answer
    REQUIRE(d.fails.size() == 3);
    CHECK(d.fails[2].first == 1);
    CHECK(d.starts.empty());
}

TEST_CASE("a mismatch is caught whichever host reported first, and named in ring order", "[coordinator]") {
    for (const uint32_t first : {0u, 1u, 2u}) {
        INFO("first reporter: host " << first);
        Coordinator c({"a", "b", "c"}, 1000ms);
        c.reset(7);
        const uint64_t inc = agree(c, 3);
        Coordinator::Decisions d;
        // a and c submit 100 elements, b 101; b's report comes first, second or last.
        std::vector<uint32_t> order = {0, 2};
        order.insert(order.begin() + first, 1);
        for (uint32_t h : order) c.report(h, ready(inc, 1, h == 1 ? 101 : 100), Clock::now(), d);
        CHECK(d.starts.empty());
        REQUIRE(d.fails.size() >= 3);  // to every host; again to one that reports after the decision
        CHECK_THAT(d.fails[0].second.message, Catch::Contains("submitted 101 x float sum") &&
                                                  Catch::Contains("host b submitted 101"));
        CHECK_THAT(d.fails[0].second.message, Catch::Contains("mismatch: host a submitted 100 x float sum, host b") ||
                                                  Catch::Contains("mismatch: host b submitted 101 x float sum, host c"));
    }
}

TEST_CASE("a host's local failure fails the op with its message; a host that reports it later hears it too",
          "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 3);
    Coordinator::Decisions d;
    c.report(0, ready(inc, 1), Clock::now(), d);
    c.report(1, failed(inc, 1, "group g op 1: host b local rank 1 timed out"), Clock::now(), d);
    REQUIRE(d.fails.size() == 3);  // every host, also c, which has not reported it
    for (uint32_t h = 0; h < 3; ++h) {
        CHECK(d.fails[h].first == h);
        CHECK(d.fails[h].second.message == "group g op 1: host b local rank 1 timed out");
    }
    c.report(2, ready(inc, 1), Clock::now(), d);
    REQUIRE(d.fails.size() == 4);
    CHECK(d.fails[3].first == 2);
    CHECK(d.fails[3].second.message == "group g op 1: host b local rank 1 timed out");
}

TEST_CASE("hosts that do not report are named when the op times out", "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 3);
    Coordinator::Decisions d;
    const auto t0 = Clock::now();
    c.report(1, ready(inc, 1), t0, d);
    c.expire(t0 + 999ms, d);
    CHECK(d.fails.empty());
    c.expire(t0 + 1000ms, d);
    REQUIRE(d.fails.size() == 3);
    CHECK(d.fails[0].second.code == -ETIMEDOUT);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("host(s) a, c did not submit it"));
}

TEST_CASE("an op is decided by the earliest deadline of the hosts that reported it", "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 3);
    Coordinator::Decisions d;
    const auto t0 = Clock::now();
    auto r = ready(inc, 1);
    c.report(0, r, t0, d);
    r.remaining_ms = 300;  // b submitted it 700 ms before it reported it
    c.report(1, r, t0, d);
    c.expire(t0 + 299ms, d);
    CHECK(d.fails.empty());
    c.expire(t0 + 300ms, d);
    REQUIRE(d.fails.size() == 3);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("host(s) c did not submit it"));
}

TEST_CASE("reports from another generation are ignored; reset forgets pending ops; a job that goes on keeps "
          "its incarnation",
          "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 2);
    Coordinator::Decisions d;
    c.report(0, ready(inc, 1), Clock::now(), d);
    CHECK(c.pending() == 1);
    c.reset(8);
    CHECK(c.pending() == 0);
    c.report(1, ready(inc, 1), Clock::now(), d);  // generation 7: stale
    CHECK(c.pending() == 0);
    // The same local incarnations join again: the same incarnation goes on.
    CHECK(agree(c, 2, "g", 0, inc) == inc);
    auto r = ready(inc, 2);
    r.generation = 8;
    c.report(0, r, Clock::now(), d);
    c.report(1, r, Clock::now(), d);
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].generation == 8);
    CHECK(d.starts[0].op_id == 1);
}

TEST_CASE("a host that is past an op (it failed there in an earlier generation) fails it at once", "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 2);
    Coordinator::Decisions d;
    c.report(1, ready(inc, 5), Clock::now(), d);
    c.report(0, ready(inc, 6), Clock::now(), d);  // a is past 5
    REQUIRE(d.fails.size() == 2);
    CHECK(d.fails[1].first == 1);
    CHECK(d.fails[0].second.seq == 5);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("host a is past it"));
    c.report(1, ready(inc, 6), Clock::now(), d);
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].seq == 6);
}

TEST_CASE("a failure reported for an op ahead fails it everywhere but does not make the host past earlier ops",
          "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 2);
    Coordinator::Decisions d;
    c.report(0, ready(inc, 5), Clock::now(), d);
    proto::OpReport r = failed(inc, 9, "group g op 9: host b holds more ... than its bound");
    r.status = -ENOBUFS;
    r.flags = proto::kReportAhead;
    c.report(1, r, Clock::now(), d);  // b has not reached 5 yet; its bound failed 9
    REQUIRE(d.fails.size() == 2);
    for (uint32_t h = 0; h < 2; ++h) {
        CHECK(d.fails[h].first == h);
        CHECK(d.fails[h].second.seq == 9);
        CHECK(d.fails[h].second.code == -ENOBUFS);
    }
    c.report(1, ready(inc, 5), Clock::now(), d);  // 5 still runs: b was not past it
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].seq == 5);
    CHECK(d.fails.size() == 2);
    c.report(0, ready(inc, 9), Clock::now(), d);  // a gets there: told at once
    REQUIRE(d.fails.size() == 3);
    CHECK(d.fails[2].first == 0);
    CHECK(d.fails[2].second.code == -ENOBUFS);
}

TEST_CASE("a restarted job gets a new incarnation; nothing of the old one pairs with it", "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t old = agree(c, 3, "g", 0);
    Coordinator::Decisions d;
    // b's ranks left: the incarnation ends; a's pending op fails with b's reason, c's later one too.
    c.report(0, ready(old, 9), Clock::now(), d);
    c.report(1, failed(old, proto::kIncarnationEnds, "group g: host b local rank 0 left"), Clock::now(), d);
    REQUIRE(d.fails.size() == 3);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("host b local rank 0 left"));
    c.report(2, ready(old, 9), Clock::now(), d);
    REQUIRE(d.fails.size() == 4);
    CHECK(d.fails[3].first == 2);
    c.report(0, ready(old, 10), Clock::now(), d);  // later ops of it fail on the host that reports them
    REQUIRE(d.fails.size() == 5);
    CHECK(d.fails[4].first == 0);
    CHECK_THAT(d.fails[4].second.message, Catch::Contains("group g op 10: group g: host b local rank 0 left"));
    CHECK(c.pending() == 0);
    // The whole job restarts: a new incarnation, whose op 1 starts.
    const uint64_t fresh = agree(c, 3, "g", 1);
    CHECK(fresh != old);
    for (uint32_t h = 0; h < 3; ++h) c.report(h, ready(fresh, 1), Clock::now(), d);
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].incarnation == fresh);
}

TEST_CASE("an end that says through which op its host ended them spares those ops; a later end that says less "
          "fails them after all",
          "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 3, "g", 0);
    Coordinator::Decisions d;
    // b sent its data of ops 8 and 9 (one-shot: reported with it), they completed there, and its
    // ranks left: its end says every op through 9 ended on b. a is slower.
    c.report(1, ready(inc, 8), Clock::now(), d);
    c.report(1, ready(inc, 9), Clock::now(), d);
    c.report(2, ready(inc, 8), Clock::now(), d);
    proto::OpReport end = failed(inc, proto::kIncarnationEnds, "group g: host b local rank 0 left");
    end.count = 10;  // 1 + 9
    c.report(1, end, Clock::now(), d);
    CHECK(d.fails.empty());
    c.report(0, ready(inc, 8), Clock::now(), d);  // op 8: every host reported it: it starts
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].seq == 8);
    c.report(0, ready(inc, 10), Clock::now(), d);  // op 10 was not b's: it fails, naming b's reason
    REQUIRE(d.fails.size() == 1);
    CHECK(d.fails[0].first == 0);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("group g op 10: group g: host b local rank 0 left"));
    // c's ranks leave too, having ended only op 8 there: op 9, pending, fails now on every host.
    proto::OpReport end_c = failed(inc, proto::kIncarnationEnds, "group g: host c local rank 0 left");
    end_c.count = 9;
    c.report(2, end_c, Clock::now(), d);
    REQUIRE(d.fails.size() == 4);
    for (size_t i = 1; i < 4; ++i) {
        CHECK(d.fails[i].second.seq == 9);
        CHECK_THAT(d.fails[i].second.message, Catch::Contains("host c local rank 0 left"));  // (b ran it)
    }
    CHECK(c.pending() == 0);
}

TEST_CASE("a solo lane whose end spared ops is not granted again until every host ended it", "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms, 2);
    c.reset(7, {}, true);
    auto join = [&](const std::string &g, uint64_t run) {
        Coordinator::Decisions d;
        for (uint32_t h = 0; h < 3; ++h) c.join(h, {c.generation(), g, (h + 1) * 100 + run, 0, 1}, d);
        REQUIRE(d.groups.size() == 3);
        return d.groups[0].second;
    };
    const auto g1 = join("g1", 1);
    REQUIRE(g1.solo_epoch == 1);
    Coordinator::Decisions d;
    // b's ranks leave having ended every op through 4 there: a and c may still post ops 1-4 on
    // lane 0, so a new group gets the shared lane, not lane 0.
    c.report(1, {7, "g1", proto::kIncarnationEnds, 5, 0, 0, 0, -ECONNABORTED, "host b: local rank 0 left", 0, g1.incarnation, 0},
             Clock::now(), d);
    const auto g2 = join("g2", 2);
    CHECK(g2.solo_epoch == 0);  // (the shared lane: its ops started by the coordinator)
    SECTION("once every host ended it, lane 0 is free again for the next group") {
        c.report(0, {7, "g1", proto::kIncarnationEnds, 5, 0, 0, 0, -ECONNABORTED, "host a: local rank 0 left", 0, g1.incarnation, 0},
                 Clock::now(), d);
        c.report(2, {7, "g1", proto::kIncarnationEnds, 5, 0, 0, 0, -ECONNABORTED, "host c: local rank 0 left", 0, g1.incarnation, 0},
                 Clock::now(), d);
    }
    SECTION("a later end that spares nothing frees it") {
        c.report(2, {7, "g1", proto::kIncarnationEnds, 1, 0, 0, 0, -ECONNABORTED, "host c: local rank 0 left", 0, g1.incarnation, 0},
                 Clock::now(), d);
    }
    SECTION("in the next ring generation it is free (an end spares ops only in its own)") {
        c.reset(8, {}, true);
    }
    const auto g3 = join("g3", 3);
    CHECK(g3.lane == 0);
    CHECK(g3.solo_epoch == 2);
}

TEST_CASE("a job restarted on one host only: the hosts that go on are refused, the restarted one waits",
          "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t old = agree(c, 3, "g", 0);
    c.reset(8);  // a new ring generation: every host joins again
    Coordinator::Decisions d;
    c.join(1, {8, "g", 201, 0}, d);   // b restarted its ranks
    c.join(0, {8, "g", 100, old}, d);  // a goes on
    REQUIRE(d.groups.size() == 1);
    CHECK(d.groups[0].first == 0);
    CHECK(d.groups[0].second.code == -ECONNABORTED);
    CHECK(d.groups[0].second.incarnation == 0);
    CHECK_THAT(d.groups[0].second.message, Catch::Contains("host b started it anew"));
    // Once a and c restarted too, the job runs again.
    c.join(0, {8, "g", 101, 0}, d);
    c.join(2, {8, "g", 301, 0}, d);
    REQUIRE(d.groups.size() == 4);
    const uint64_t fresh = d.groups[1].second.incarnation;
    CHECK(fresh != 0);
    CHECK(fresh != old);

    // A host that restarts while an incarnation is agreed ends it.
    c.join(1, {8, "g", 202, 0}, d);
    proto::OpReport r = ready(fresh, 1);
    r.generation = 8;
    c.report(0, r, Clock::now(), d);
    REQUIRE_FALSE(d.fails.empty());
    CHECK_THAT(d.fails.back().second.message, Catch::Contains("host b started it anew"));
}

TEST_CASE("a join withdrawn before the agreement is forgotten; withdrawn after it, the incarnation ends",
          "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms);
    c.reset(7);
    Coordinator::Decisions d;
    c.join(1, {7, "g", 201, 0}, d);
    c.join(1, {7, "g", 201, proto::kIncarnationEnds}, d);  // its ranks left
    c.join(0, {7, "g", 101, 0}, d);
    CHECK(d.groups.empty());  // not agreed with the withdrawn one
    c.join(1, {7, "g", 202, 0}, d);
    REQUIRE(d.groups.size() == 2);
    const uint64_t inc = d.groups[0].second.incarnation;
    c.join(1, {7, "g", 202, proto::kIncarnationEnds}, d);  // agreed, then withdrawn: it ends
    c.report(0, ready(inc, 1), Clock::now(), d);
    REQUIRE_FALSE(d.fails.empty());
    CHECK_THAT(d.fails.back().second.message, Catch::Contains("the ranks of host b left"));
}

TEST_CASE("one-/two-shot ops are decided without a start; hosts on different algorithms fail the op",
          "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 3);
    Coordinator::Decisions d;
    auto direct = [&](uint64_t k) {
        auto r = ready(inc, k);
        r.algorithm = 1;
        return r;
    };
    for (uint32_t h = 0; h < 3; ++h) c.report(h, direct(1), Clock::now(), d);
    CHECK(d.starts.empty());
    CHECK(d.fails.empty());
    CHECK(c.pending() == 0);
    // Ring ops keep their own op ids: the direct op took none.
    for (uint32_t h = 0; h < 3; ++h) c.report(h, ready(inc, 2), Clock::now(), d);
    REQUIRE(d.starts.size() == 1);
    CHECK(d.starts[0].op_id == 1);
    // Hosts whose tuning differs pick different algorithms for the same op: it fails, named.
    c.report(0, direct(3), Clock::now(), d);
    c.report(1, ready(inc, 3), Clock::now(), d);
    REQUIRE(d.fails.size() == 3);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("hosts a and b chose different algorithms"));
    // A host that does not send its data is named when the op times out.
    c.report(0, direct(4), Clock::now(), d);
    c.report(2, direct(4), Clock::now(), d);
    c.expire(Clock::now() + 2s, d);
    REQUIRE(d.fails.size() == 6);
    CHECK_THAT(d.fails[5].second.message, Catch::Contains("host(s) b did not submit it"));
}

TEST_CASE("each agreed incarnation runs in the lane its groups use least; a lane freed by a job's end is "
          "used again",
          "[coordinator]") {
    Coordinator c({"a", "b"}, 1000ms, 2);
    c.reset(7);
    const auto t0 = Clock::now();
    auto lane_of = [&](uint64_t inc, const std::string &g, uint64_t seq) {
        Coordinator::Decisions d;
        for (uint32_t h = 0; h < 2; ++h) c.report(h, ready(inc, seq, 100, DType::F32, ReduceOp::Sum, 1, g), t0, d);
        REQUIRE(d.starts.size() == 1);
        return d.starts[0].lane;
    };
    const uint64_t a = agree(c, 2, "a"), b = agree(c, 2, "b"), x = agree(c, 2, "x");
    CHECK(lane_of(a, "a", 1) == 0);
    CHECK(lane_of(b, "b", 1) == 1);  // beside a
    CHECK(lane_of(x, "x", 1) == 0);  // both used once: the lowest
    CHECK(lane_of(a, "a", 2) == 0);  // a group stays in its lane
    // b's job ends (its ranks left on a host): the next group gets its lane.
    Coordinator::Decisions d;
    c.report(0, failed(b, proto::kIncarnationEnds, "host a local rank 0 left", "b"), t0, d);
    const uint64_t y = agree(c, 2, "y");
    CHECK(lane_of(y, "y", 1) == 1);
}

TEST_CASE("a run agreed with a ringd that has restarted since ends at the next generation: the others' joins "
          "are refused at once naming it; a network blip (the same instances) goes on",
          "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7, {11, 22, 33});
    const uint64_t inc = agree(c, 3);
    // A new generation with the same ringds: the run goes on.
    c.reset(8, {11, 22, 33});
    Coordinator::Decisions d;
    for (uint32_t h = 0; h < 3; ++h) c.join(h, {8, "g", (h + 1) * 100, inc}, d);
    REQUIRE(d.groups.size() == 3);
    for (const auto &[h, g] : d.groups) CHECK(g.incarnation == inc);
    // Host c's ringd restarted (another instance): a and b, going on, are refused at once.
    c.reset(9, {11, 22, 44});
    d = {};
    for (uint32_t h = 0; h < 2; ++h) c.join(h, {9, "g", (h + 1) * 100, inc}, d);
    REQUIRE(d.groups.size() == 2);
    for (const auto &[h, g] : d.groups) {
        CHECK(g.code == -ECONNABORTED);
        CHECK(g.incarnation == 0);
        CHECK(g.message == "group g: the ringd of host c restarted since this run of the group began (its ranks there "
                           "are gone); every rank of the job must restart");
    }
    // The job restarted everywhere: a fresh run.
    const uint64_t fresh = agree(c, 3, "g", 1);
    CHECK(fresh != inc);
    // Unknown instances (a ringd of 6 says none) end nothing.
    c.reset(10, {11, 0, 44});
    d = {};
    for (uint32_t h = 0; h < 3; ++h) c.join(h, {10, "g", (h + 1) * 100 + 1, fresh}, d);
    for (const auto &[h, g] : d.groups) CHECK(g.incarnation == fresh);
}

namespace {

// A doubling op's report from a host where it stalled (proto::kReportDeferred).
proto::OpReport deferred(uint64_t inc, uint64_t seq, uint64_t count = 100, uint32_t flags = 0) {
    proto::OpReport r = ready(inc, seq, count);
    r.algorithm = 3;
    r.flags = proto::kReportDeferred | flags;
    return r;
}

}  // namespace

TEST_CASE("deferred reports (doubling, halving-doubling): decided like any when they differ or a host never "
          "reports; a done report forgets the op; they are not a host's progress",
          "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms);
    c.reset(7);
    const uint64_t inc = agree(c, 3);
    const auto t0 = Clock::now();
    Coordinator::Decisions d;

    // Two hosts stalled on op 1 with different counts: a mismatch naming both, at once.
    c.report(0, deferred(inc, 1, 100), t0, d);
    c.report(1, deferred(inc, 1, 101), t0, d);
    REQUIRE(d.fails.size() == 3);
    CHECK(d.fails[0].second.code == -EINVAL);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("mismatch: host a submitted 100") &&
                                              Catch::Contains("host b submitted 101"));

    // Op 2 stalled on a and b; c reported a later ring op (3) before its own doubling op 2, which
    // it completed without a word: c is not taken for a host past op 2.
    d = {};
    c.report(0, deferred(inc, 2), t0, d);
    c.report(1, deferred(inc, 2), t0, d);
    c.report(2, ready(inc, 3), t0, d);
    CHECK(d.fails.empty());
    CHECK(c.pending() == 2);
    // A done report: every host contributed; the coordinator forgets it, and a late report of it
    // is a duplicate.
    c.report(1, deferred(inc, 2, 100, proto::kReportDone), t0, d);
    CHECK(c.pending() == 1);  // op 3
    c.report(2, deferred(inc, 2), t0, d);
    CHECK(d.fails.empty());
    c.expire(t0 + 2s, d);  // op 3 (a ring op) times out; op 2 is gone
    REQUIRE(d.fails.size() == 3);
    CHECK(d.fails[0].second.seq == 3);

    // Op 4 stalled on a and b, never submitted on c: at the deadline it fails naming c.
    d = {};
    c.report(0, deferred(inc, 4), t0 + 2s, d);
    c.report(1, deferred(inc, 4), t0 + 2s, d);
    c.expire(t0 + 4s, d);
    REQUIRE(d.fails.size() == 3);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("host(s) c did not submit it"));

    // Op 5 stalled on a; b says it is past it (its trainers failed op 5 and went on): every host
    // fails it now, naming b.
    d = {};
    c.report(0, deferred(inc, 5), t0 + 4s, d);
    proto::OpReport past = failed(inc, 5, "group g op 5: host b is past it (the op ended there before host a got to it)");
    c.report(1, past, t0 + 4s, d);
    REQUIRE(d.fails.size() == 3);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("host b is past it"));
    CHECK(c.pending() == 0);
}

TEST_CASE("solo lanes: the first lanes - 1 running incarnations get one each with their total ranks; the rest share "
          "the last; a solo op is reported only when it stalls, never started; an end reaches every host",
          "[coordinator]") {
    Coordinator c({"a", "b", "c"}, 1000ms, 3);
    c.reset(7, {}, true);
    auto join = [&](const std::string &g, uint64_t run, uint32_t local) {
        Coordinator::Decisions d;
        for (uint32_t h = 0; h < 3; ++h) c.join(h, {c.generation(), g, (h + 1) * 100 + run, 0, local + h}, d);
        REQUIRE(d.groups.size() == 3);
        return d.groups;
    };
    const auto g1 = join("g1", 1, 1), g2 = join("g2", 2, 2), g3 = join("g3", 3, 1);
    for (const auto &[h, gi] : g1) {
        CHECK(gi.lane == 0);
        CHECK(gi.solo_epoch == 1);
        CHECK(gi.total_ranks == 1 + 2 + 3);
    }
    for (const auto &[h, gi] : g2) {
        CHECK(gi.lane == 1);
        CHECK(gi.solo_epoch == 1);  // per lane
        CHECK(gi.total_ranks == 2 + 3 + 4);
    }
    for (const auto &[h, gi] : g3) CHECK(gi.solo_epoch == 0);
    {  // the shared lane: its ops started here, in lane 2
        Coordinator::Decisions d;
        for (uint32_t h = 0; h < 3; ++h) c.report(h, ready(g3[0].second.incarnation, 1, 100, DType::F32, ReduceOp::Sum, 1, "g3"), Clock::now(), d);
        REQUIRE(d.starts.size() == 1);
        CHECK(d.starts[0].lane == 2);
    }
    // A solo op stalled on every host: pending, never started; done on one host: forgotten.
    const uint64_t inc1 = g1[0].second.incarnation;
    Coordinator::Decisions d;
    const auto t0 = Clock::now();
    for (uint32_t h = 0; h < 3; ++h) {
        proto::OpReport r = ready(inc1, 5, 100, DType::F32, ReduceOp::Sum, 1, "g1");
        r.flags = proto::kReportDeferred;
        c.report(h, r, t0, d);
    }
    CHECK(d.starts.empty());
    CHECK(c.pending() == 1);
    proto::OpReport done = ready(inc1, 5, 100, DType::F32, ReduceOp::Sum, 1, "g1");
    done.flags = proto::kReportDeferred | proto::kReportDone;
    c.report(1, done, t0, d);
    CHECK(c.pending() == 0);
    CHECK(d.fails.empty());
    // Stalled everywhere and never done: it fails at its deadline, saying the data stopped moving.
    for (uint32_t h = 0; h < 3; ++h) {
        proto::OpReport r = ready(inc1, 6, 100, DType::F32, ReduceOp::Sum, 1, "g1");
        r.flags = proto::kReportDeferred;
        c.report(h, r, t0, d);
    }
    c.expire(t0 + 2s, d);
    REQUIRE(d.fails.size() == 3);
    CHECK_THAT(d.fails[0].second.message, Catch::Contains("every host ran it, and its data stopped moving"));
    // Its ranks leave on host b, every op through 9 ended there: every host hears that the
    // incarnation ended (seq kIncarnationEnds), its ops up to 9 going on.
    d = {};
    c.report(1, {7, "g1", proto::kIncarnationEnds, 10, 0, 0, 0, -ECONNABORTED, "host b: local rank 0 left", 0, inc1, 0}, t0, d);
    REQUIRE(d.fails.size() == 3);
    for (uint32_t h = 0; h < 3; ++h) {
        CHECK(d.fails[h].first == h);
        CHECK(d.fails[h].second.seq == proto::kIncarnationEnds);
        CHECK(d.fails[h].second.incarnation == inc1);
        CHECK(d.fails[h].second.after == 9);
    }
    // Host c's ranks leave too, through op 7 only: every host hears it again, sparing fewer; an
    // end that spares no fewer says nothing.
    d = {};
    c.report(2, {7, "g1", proto::kIncarnationEnds, 8, 0, 0, 0, -ECONNABORTED, "host c: local rank 0 left", 0, inc1, 0}, t0, d);
    REQUIRE(d.fails.size() == 3);
    for (const auto &[h, f] : d.fails) {
        CHECK(f.after == 7);
        CHECK_THAT(f.message, Catch::Contains("host c: local rank 0 left"));  // (the end that fails ops 8 and 9)
    }
    d = {};
    c.report(0, {7, "g1", proto::kIncarnationEnds, 9, 0, 0, 0, -ECONNABORTED, "host a: local rank 0 left", 0, inc1, 0}, t0, d);
    CHECK(d.fails.empty());
    // Its lane is free again: the next solo grant of lane 0 is epoch 2.
    const auto g4 = join("g4", 4, 1);
    CHECK(g4[0].second.lane == 0);
    CHECK(g4[0].second.solo_epoch == 2);
    // A generation without solo lanes (a host of protocol 7): every incarnation is started here.
    c.reset(8, {}, false);
    Coordinator::Decisions d2;
    for (uint32_t h = 0; h < 3; ++h) c.join(h, {c.generation(), "g2", (h + 1) * 100 + 2, 0, 1}, d2);
    REQUIRE(d2.groups.size() == 3);
    CHECK(d2.groups[0].second.solo_epoch == 0);
    // A host that did not say its local ranks (host a says 0): no solo lane, avg's divisor unknown.
    c.reset(9, {}, true);
    const auto g5 = join("g5", 5, 0);
    CHECK(g5[0].second.solo_epoch == 0);
}
