// HostOps: the states of a multi-host op on this host after local matching, and a deadline in
// every one of them.
#include <catch2/catch.hpp>

#include "daemon/ops/host_ops.h"

using namespace ringd;
using namespace std::chrono_literals;

namespace {

proto::Submission sub(uint64_t seq) {
    proto::Submission s;
    s.seq = seq;
    s.desc.count = 16;
    s.bytes = s.out_bytes = 64;
    return s;
}

struct Fixture {
    GroupTable table{"h0", 1000ms};
    std::vector<Completion> done;
    HostOps ops{table, done};
    Clock::time_point t0 = Clock::now();

    // Member 1 alone in group g submits seq; the matched op, queued with deadline t0 + 1 s.
    HostOp matched(uint64_t seq) {
        std::vector<OpRun> ready;
        table.submit(1, sub(seq), t0, done, ready);
        REQUIRE(ready.size() == 1);
        HostOp op;
        op.run = ready[0];
        op.deadline = t0 + 1000ms;
        return op;
    }
    std::string why_of(const HostOp &op) { return std::string(op_state_name(op.state)) + " " + std::to_string(op.run.seq); }
};

}  // namespace

TEST_CASE_METHOD(Fixture, "queued ops come out in seq order per group; reported ones are found by key", "[hostops]") {
    REQUIRE(table.join(1, "g", 0, 1, 0).ok());
    HostOp a = matched(1), b = matched(2);
    ops.queue(std::move(b));
    ops.queue(std::move(a));
    REQUIRE(ops.next_queued("g"));
    CHECK(ops.next_queued("g")->run.seq == 1);
    CHECK(ops.next_queued("g")->state == OpState::Queued);
    HostOp first = ops.take_queued("g");
    const OpKey k{"g", 77, 1};
    HostOp &r = ops.reported(k, std::move(first));
    CHECK(r.state == OpState::Reported);
    CHECK(ops.find_reported(k) == &r);
    CHECK(ops.counts().queued == 1);
    CHECK(ops.counts().reported == 1);
    auto taken = ops.take_reported(k);
    REQUIRE(taken);
    CHECK(taken->run.seq == 1);
    CHECK_FALSE(ops.take_reported(k));
    CHECK(ops.queued_groups() == std::vector<std::string>{"g"});
    (void)ops.take_queued("g");
    CHECK(ops.queued_groups().empty());
    CHECK_FALSE(ops.has_queued("g"));
}

TEST_CASE_METHOD(Fixture, "every state has a deadline: queued at the op's, reported a grace later, running ones are "
                          "reported overdue",
                 "[hostops]") {
    REQUIRE(table.join(1, "g", 0, 1, 0).ok());
    HostOp q = matched(1), r = matched(2), run = matched(3);
    const uint64_t running_id = run.run.op_id;
    ops.queue(std::move(q));
    ops.reported(OpKey{"g", 5, 2}, std::move(r));
    ops.running(running_id, 1, t0 + 1000ms);
    auto why = [&](const HostOp &op) { return why_of(op); };
    auto e = ops.expire(t0 + 999ms, why);
    CHECK(e.reported.empty());
    CHECK(e.overdue_running.empty());
    CHECK(done.empty());
    e = ops.expire(t0 + 1000ms, why);  // the queued op's deadline
    REQUIRE(done.size() == 1);
    CHECK(done[0].seq == 1);
    CHECK(done[0].status == -ETIMEDOUT);
    CHECK(done[0].message == "queued 1");
    e = ops.expire(t0 + 1000ms + HostOps::kDecisionGrace, why);  // the reported op's
    REQUIRE(done.size() == 2);
    CHECK(done[1].seq == 2);
    CHECK(done[1].message == "reported 2");
    REQUIRE(e.reported.size() == 1);
    CHECK(std::get<2>(e.reported[0]) == 2);
    CHECK(e.overdue_running.empty());
    e = ops.expire(t0 + 1000ms + HostOps::kReleaseGrace, why);  // the running op is overdue, not failed
    CHECK(e.overdue_running == std::vector<uint64_t>{running_id});
    CHECK(done.size() == 2);
    CHECK(ops.counts().running == 1);
}

TEST_CASE_METHOD(Fixture, "a generation's end fails what is ready here at once and a running ring op only when it "
                          "is back",
                 "[hostops]") {
    REQUIRE(table.join(1, "g", 0, 1, 0).ok());
    HostOp q = matched(1), r = matched(2), run = matched(3), held = matched(4);
    const uint64_t run_id = run.run.op_id, held_id = held.run.op_id;
    ops.queue(std::move(q));
    ops.reported(OpKey{"g", 5, 2}, std::move(r));
    ops.running(run_id, 1, t0 + 1000ms);
    ops.running(held_id, 1, t0 + 1000ms);
    ops.returned(held_id, -ECONNRESET, "link to h1: reset", true);  // waits for the generation's end
    CHECK(done.empty());
    ops.generation_ended("ring generation 1 aborted: host h1: connection closed");
    REQUIRE(done.size() == 3);  // queued 1, reported 2, held 4
    for (const auto &c : done) {
        CHECK(c.status == -ECONNABORTED);
        CHECK(c.message == "ring generation 1 aborted: host h1: connection closed");
        CHECK(c.seq != 3);
    }
    CHECK(ops.counts().releasing == 1);
    ops.returned(run_id, 0, "", false);  // succeeded on the progress thread, but its generation ended
    REQUIRE(done.size() == 4);
    CHECK(done[3].seq == 3);
    CHECK(done[3].status == -ECONNABORTED);
    CHECK(done[3].message == "ring generation 1 aborted: host h1: connection closed");
    CHECK(ops.counts().releasing == 0);
}

TEST_CASE_METHOD(Fixture, "a ring op given back in its generation ends with its own result", "[hostops]") {
    REQUIRE(table.join(1, "g", 0, 1, 0).ok());
    HostOp run = matched(1);
    ops.running(run.run.op_id, 1, t0 + 1000ms);
    ops.returned(run.run.op_id, 0, "", false);
    REQUIRE(done.size() == 1);
    CHECK(done[0].status == 0);
    CHECK(ops.counts().running == 0);
}
