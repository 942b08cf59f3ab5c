// Faults across hosts, each with the mechanism that must catch it and when: a host killed
// (EOF on its control connection, within a second) or stopped (three missed heartbeats) in the
// middle of a large ring op that every host submitted, over TCP and ibverbs; the coordinating
// host killed and restarted; a data connection reset under a ring (a data-link error, carried
// to the other hosts by RingAbort); a host whose trainer never submits (the op timeout);
// SIGTERM. After each: the daemon writes nothing into a trainer's slot once it reported the
// failure, the ring re-forms as a new generation, and the same trainers go on with exact
// results. Other groups are not affected by one group's failure.
#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "tests/support/cluster.h"
#include "tests/support/skip.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;

namespace {

// A large ring op: 128 MiB of float per rank, long enough on loopback that a fault lands while
// its data moves.
constexpr size_t kBigCount = size_t{32} << 20;
constexpr size_t kBigSlot = (kBigCount * 4) + (64 << 10);
const char *const kBigSlotLimit = "160MiB";
// What a trainer writes over its whole slot right after its op failed: one byte value, so that
// it takes a few milliseconds (a late write from the daemon lands after it, not under it), and
// no sum of the ones the big op adds up.
constexpr unsigned char kReuseByte = 0xa5;

// Every rank submits kBigCount floats (all ones: partial and final sums differ from the input)
// at offset 0; returns the tickets once the op runs and data reached rank `watch`.
std::vector<uint64_t> start_big_op(Clients &cl, size_t watch) {
    for (auto &x : cl) std::fill_n(reinterpret_cast<float *>(x->slot().data()), kBigCount, 1.0f);
    SlotWatch w(*cl[watch], 0, kBigCount);
    std::vector<uint64_t> t;
    for (auto &x : cl) t.push_back(x->submit(0, kBigCount, RINGD_F32, RINGD_SUM));
    const double moved = wait_data_moving(w);
    INFO("fraction of rank " << watch << "'s samples written when the fault comes: " << moved);
    REQUIRE(moved > 0);
    REQUIRE(moved < 0.5);  // well before the end
    return t;
}

struct Failure {
    int rc = 0;
    std::string message;
    double after_s = 0;  // since the fault
};

// Waits for rank g's ticket (bounded); on failure writes kReuseByte over its whole slot at once,
// as a trainer that reuses its buffer right after the error would.
Failure wait_failed(Client &cl, uint64_t ticket, Clock::time_point fault, int timeout_ms = 15000) {
    Failure f;
    f.rc = ringd_wait(cl.get(), ticket, timeout_ms);
    f.after_s = seconds_since(fault);
    if (f.rc != 0) {
        f.message = ringd_last_error(cl.get());
        std::memset(cl.slot().data(), kReuseByte, cl.slot().size());
    }
    return f;
}

// Bytes of the slot that changed since wait_failed wrote kReuseByte.
uint64_t reuse_damage(const Client &cl) {
    const auto s = cl.slot();
    return static_cast<uint64_t>(std::count_if(s.begin(), s.end(), [](std::byte b) { return b != std::byte{kReuseByte}; }));
}

ClusterOptions options(const std::string &op_timeout, const std::string &heartbeat, const std::string &extra_yaml = "",
                       const std::string &slot_bytes = "64MiB") {
    return ClusterOptions{op_timeout, heartbeat, extra_yaml, slot_bytes};
}

bool log_has(TestCluster &c, uint32_t h, const std::string &what) { return c.d[h]->log().find(what) != std::string::npos; }

// Starts the big op on every rank (data watched arriving at rank `watch`), sends `sig` to host
// `victim`'s daemon and waits for every other rank's failure. Returns the failures by rank (the
// victim's left empty) and the tickets.
struct MidOpFault {
    std::vector<uint64_t> tickets;
    std::vector<Failure> failures;
    Clock::time_point fault;
};
MidOpFault fault_mid_op(TestCluster &c, Clients &cl, uint32_t victim, int sig, size_t watch) {
    MidOpFault m;
    m.tickets = start_big_op(cl, watch);
    m.fault = Clock::now();
    ::kill(c.d[victim]->pid(), sig);
    m.failures.resize(cl.size());
    for (uint32_t g = 0; g < cl.size(); ++g)
        if (g != victim) m.failures[g] = wait_failed(*cl[g], m.tickets[g], m.fault);
    return m;
}

// Once a late write from the ended op would have landed: nothing changed these ranks' slots
// since wait_failed overwrote them.
void check_untouched(const Clients &cl, std::initializer_list<uint32_t> ranks) {
    std::this_thread::sleep_for(200ms);
    for (uint32_t g : ranks) {
        INFO("rank " << g);
        CHECK(reuse_damage(*cl[g]) == 0);
    }
}

// The next ops of ranks 0 and 1 (a direct one, then a ring one) while host 2 cannot take part:
// each fails with ECONNABORTED within `limit` seconds, its message matching `why`.
template <typename Matcher>
void next_ops_fail(Clients &cl, const Matcher &why, double limit) {
    for (const size_t count : {size_t{5000}, size_t{200000}}) {
        const auto t0 = cl[0]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM);
        const auto t1 = cl[1]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM);
        const auto submitted = Clock::now();
        for (auto [cli, t] : {std::pair{cl[0].get(), t0}, {cl[1].get(), t1}}) {
            const Failure f = wait_failed(*cli, t, submitted);
            INFO(f.message << " after " << f.after_s << " s (count " << count << ")");
            CHECK(f.rc == -ECONNABORTED);
            CHECK_THAT(f.message, why);
            CHECK(f.after_s < limit);
        }
    }
}

}  // namespace

TEST_CASE("a host SIGKILLed while a large ring op moves data: the others fail within a second on its "
          "connection's EOF, write nothing into the slots after, and the restarted job runs when it is back",
          "[cluster][faults]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    // Heartbeats at 1 s (three missed: 3 s) and a 30 s op timeout: only the EOF can be this fast.
    TestCluster c(3, options("30s", "1s", transport, kBigSlotLimit));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "kill", 1, kBigSlot);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, 1);
    const MidOpFault m = fault_mid_op(c, cl, 2, SIGKILL, 0);
    for (uint32_t g : {0u, 1u}) {
        const Failure &f = m.failures[g];
        INFO("rank " << g << ": " << f.message << " after " << f.after_s << " s");
        CHECK(f.rc == -ECONNABORTED);
        CHECK_THAT(f.message, Catch::Contains("ring generation 1 aborted: host node2: connection closed"));
        CHECK(f.after_s < 1.0);
        CHECK(log_has(c, g, "host node2: connection closed"));
        CHECK_FALSE(log_has(c, g, "no heartbeat"));
        CHECK_FALSE(log_has(c, g, "ring allreduce timed out"));
        CHECK(c.group(g, "kill")["ops_failed"] == 1);  // the op this host ran, not one it never took
    }
    // node2 comes back; until the ring is up again nothing may touch the survivors' slots.
    c.d[2]->start();
    REQUIRE(c.d[2]->ready());
    REQUIRE(c.wait_up({2, 2, 1}));  // the restarted daemon counts its own generations
    check_untouched(cl, {0, 1});
    CHECK(c.status(0)["ring"]["generation"] == 2);
    // Its trainer lost its ringd: the job restarts on every host and runs exact ops.
    cl.clear();
    cl = connect_all(c, "kill", 1, kBigSlot);
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 777777, 5);
    allreduce_checked(cl, DType::BF16, ReduceOp::Sum, 4099, 6);
}

TEST_CASE("a host SIGSTOPped while a large ring op moves data is named after about three heartbeats; the "
          "ring re-forms when it continues",
          "[cluster][faults]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    // Heartbeats every 300 ms and a 30 s op timeout: only the heartbeat can fire.
    TestCluster c(3, options("30s", "300ms", transport, kBigSlotLimit));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "stop", 1, kBigSlot);
    allreduce_checked(cl, DType::F64, ReduceOp::Max, 333, 2);
    const MidOpFault m = fault_mid_op(c, cl, 1, SIGSTOP, 0);
    for (uint32_t g : {0u, 2u}) {
        const Failure &f = m.failures[g];
        INFO("rank " << g << ": " << f.message << " after " << f.after_s << " s");
        CHECK(f.rc == -ECONNABORTED);
        CHECK_THAT(f.message, Catch::Contains("host node1: no heartbeat for 900 ms (hung or unreachable)"));
        // Three periods of silence: 0.9 s after the last heartbeat heard, which left at most a
        // period, a 100 ms tick and some scheduling before the stop (the message names the
        // mechanism; the bounds leave room for a loaded machine). At most about eight periods.
        CHECK(f.after_s >= 0.1);
        CHECK(f.after_s <= 2.5);
        CHECK_FALSE(log_has(c, g, "connection closed"));
        CHECK_FALSE(log_has(c, g, "ring allreduce timed out"));
    }
    ::kill(c.d[1]->pid(), SIGCONT);
    // node1's own op fails when it continues (its peers are gone); then everyone goes on.
    CHECK(ringd_wait(cl[1]->get(), m.tickets[1], 15000) != 0);
    REQUIRE(c.wait_up({2, 2, 2}));
    check_untouched(cl, {0, 2});
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 300001, 3);
    allreduce_checked(cl, DType::I32, ReduceOp::Min, 17, 4);
}

namespace {

// The coordinating host (node0) SIGKILLed while a large ring op moves data, then restarted:
// the others fail within a second naming it, write nothing into their trainers' slots after,
// and the ring comes up again. Returns with node0 back and a new trainer there.
void kill_and_restart_coordinator(TestCluster &c, Clients &cl) {
    allreduce_checked(cl, DType::F16, ReduceOp::Avg, 5000, 1);
    const MidOpFault m = fault_mid_op(c, cl, 0, SIGKILL, 1);
    for (uint32_t g : {1u, 2u}) {
        const Failure &f = m.failures[g];
        INFO("rank " << g << ": " << f.message << " after " << f.after_s << " s");
        CHECK(f.rc == -ECONNABORTED);
        CHECK_THAT(f.message, Catch::Contains("ring generation 1 aborted: host node0: connection closed"));
        CHECK(f.after_s < 1.0);
        CHECK_FALSE(log_has(c, g, "no heartbeat"));
    }
    c.d[0]->start();
    REQUIRE(c.d[0]->ready());
    REQUIRE(c.wait_up({2, 2, 2}));  // the restarted coordinator's ring is newer than generation 1
    check_untouched(cl, {1, 2});
    CHECK(c.status(1)["ring"]["generation"] == 2);
    cl[0] = std::make_unique<Client>(c.d[0]->socket(), "coord", 0, 1, kBigSlot);
}

}  // namespace

TEST_CASE("the coordinating host killed while a large ring op moves data: the others fail within a second "
          "naming it, touch no slot after, and the ring re-forms when it is restarted",
          "[cluster][faults]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    TestCluster c(3, options("30s", "1s", transport, kBigSlotLimit));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "coord", 1, kBigSlot);
    kill_and_restart_coordinator(c, cl);
}

// A restarted coordinator counts its generations from 0 again; the ring it forms must still be
// newer than the generations the others used, or they would never report an op to it again.
// Its trainer rejoined afresh: the trainers that go on with the old run are told to restart,
// and once the job restarted everywhere it runs exact ops.
TEST_CASE("after the coordinating host was restarted, trainers that go on alone fail clearly; the restarted "
          "job runs exact results",
          "[cluster][faults]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    TestCluster c(3, options("30s", "1s", transport, kBigSlotLimit));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "coord", 1, kBigSlot);
    kill_and_restart_coordinator(c, cl);
    for (uint32_t g : {1u, 2u}) {
        const auto start = Clock::now();
        const auto t = cl[g]->submit(0, 1000, RINGD_F32, RINGD_SUM);
        const Failure f = wait_failed(*cl[g], t, start);
        INFO("rank " << g << ": " << f.message << " after " << f.after_s << " s");
        CHECK(f.rc == -ECONNABORTED);
        CHECK_THAT(f.message, Catch::Contains("host node0 started a new incarnation of the group") &&
                                  Catch::Contains("every rank of the job must restart"));
        CHECK(f.after_s < 1.0);
    }
    cl.clear();
    cl = connect_all(c, "coord", 1, kBigSlot);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1 << 20, 2);  // the ring
    allreduce_checked(cl, DType::I64, ReduceOp::Max, 999, 3);       // direct exchange
}

TEST_CASE("a host killed before its trainer submitted: the others fail within a second on the EOF", "[cluster][faults]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    TestCluster c(3, options("30s", "1s", transport));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "k", 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, 1);
    // Ranks 0 and 1 submit (direct exchange, then the ring); node2 is killed before its rank does.
    for (const size_t count : {size_t{5000}, size_t{200000}}) {
        const auto t0 = cl[0]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM);
        const auto t1 = cl[1]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM);
        REQUIRE(c.wait_taken(0, "k"));
        REQUIRE(c.wait_taken(1, "k"));
        const auto fault = Clock::now();
        ::kill(c.d[2]->pid(), SIGKILL);
        for (auto [cli, t] : {std::pair{cl[0].get(), t0}, {cl[1].get(), t1}}) {
            const Failure f = wait_failed(*cli, t, fault);
            INFO(f.message << " after " << f.after_s << " s");
            CHECK(f.rc == -ECONNABORTED);
            CHECK_THAT(f.message, Catch::Contains("aborted: host node2: connection closed"));
            CHECK(f.after_s < 1.0);
        }
        // Restart node2 and the job on every host.
        c.d[2]->start();
        REQUIRE(c.d[2]->ready());
        const uint64_t gen = c.status(0)["ring"]["generation"].get<uint64_t>();
        REQUIRE(c.wait_up({gen + 1, gen + 1, 1}));
        cl.clear();
        cl = connect_all(c, "k", 1);
        allreduce_checked(cl, DType::F32, ReduceOp::Avg, 77777, 5);
    }
}

TEST_CASE("ops submitted while a host of their ring is down fail within about a second naming it, not at the op "
          "timeout; the job runs again once the host is back",
          "[cluster][faults]") {
    TestCluster c(3, options("30s", "1s", ""));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "down", 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, 1);
    // node2's ringd dies between two ops: the ring ends; the next op of the others needs it.
    ::kill(c.d[2]->pid(), SIGKILL);
    // Until both other hosts saw the ring end (an op one of them takes while its ring is still up
    // fails with the generation's end instead).
    for (int i = 0; i < 500 && (c.status(0)["ring"]["state"] == "up" || c.status(1)["ring"]["state"] == "up"); ++i)
        std::this_thread::sleep_for(10ms);
    // The host, what its redials found, and how the ring ended; ControlPlane::kDownAfter and a
    // tick, not timeouts.op (30 s).
    // (Catch's && keeps references: the matchers it combines must outlive it.)
    const auto named = Catch::Contains("the ring is not up: host node2 is down (connect to 127.0.0.1:");
    const auto redials = Catch::Contains("Connection refused); ring generation");
    const auto ended = Catch::Contains("aborted: host node2: connection closed");
    const auto down = named && redials && ended;
    next_ops_fail(cl, down, 2.5);
    c.d[2]->start();
    REQUIRE(c.d[2]->ready());
    const uint64_t gen = c.status(0)["ring"]["generation"].get<uint64_t>();
    REQUIRE(c.wait_up({gen + 1, gen + 1, 1}));
    cl.clear();
    cl = connect_all(c, "down", 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 77777, 5);
}

TEST_CASE("a host's ringd SIGKILLed and restarted before the others' next op: that op fails at once naming the "
          "restart, not at the op timeout",
          "[cluster][faults]") {
    TestCluster c(3, options("30s", "1s", ""));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "quick", 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, 1);
    const uint64_t gen = c.status(0)["ring"]["generation"].get<uint64_t>();
    ::kill(c.d[2]->pid(), SIGKILL);
    c.d[2]->start();  // back at once: the ring re-forms before the others submit again
    REQUIRE(c.d[2]->ready());
    REQUIRE(c.wait_up({gen + 1, gen + 1, 1}));
    // node2's trainer went with its ringd; the others' next op cannot pair with anything.
    next_ops_fail(cl, Catch::Contains("the ringd of host node2 restarted since this run of the group began"), 2.0);
    // The job restarts on every host and runs exact.
    cl.clear();
    cl = connect_all(c, "quick", 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 77777, 5);
}

TEST_CASE("a host hung before its trainer submitted is named after about three heartbeats; the ring "
          "re-forms when it continues",
          "[cluster][faults]") {
    TestCluster c(3, options("30s", "300ms"));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "h", 1);
    allreduce_checked(cl, DType::F64, ReduceOp::Max, 333, 2);
    ::kill(c.d[1]->pid(), SIGSTOP);
    const auto fault = Clock::now();
    const auto t0 = cl[0]->submit(0, 1000, RINGD_F32, RINGD_SUM);
    const auto t2 = cl[2]->submit(0, 1000, RINGD_F32, RINGD_SUM);
    for (auto [cli, t] : {std::pair{cl[0].get(), t0}, {cl[2].get(), t2}}) {
        const Failure f = wait_failed(*cli, t, fault);
        INFO(f.message << " after " << f.after_s << " s");
        CHECK(f.rc == -ECONNABORTED);
        CHECK_THAT(f.message, Catch::Contains("host node1: no heartbeat for 900 ms (hung or unreachable)"));
        CHECK(f.after_s >= 0.4);  // as above
        CHECK(f.after_s <= 1.8);
    }
    ::kill(c.d[1]->pid(), SIGCONT);
    REQUIRE(c.wait_up({2, 2, 2}));
    // Every rank goes on; ops pair by the trainers' op numbers. node1's trainer never submitted
    // the op the others failed: when it does, it fails as soon as the others are past it, and
    // its next op pairs with theirs.
    const auto missed = cl[1]->submit(0, 1000, RINGD_F32, RINGD_SUM);
    allreduce_checked(cl, DType::BF16, ReduceOp::Sum, 4099, 3);
    // Its failure may reach node1's trainer just after the next op's result (both come from the
    // coordinator's verdicts): a short wait, not a look without waiting.
    CHECK(ringd_wait(cl[1]->get(), missed, 2000) == -ECONNABORTED);
    CHECK_THAT(ringd_last_error(cl[1]->get()), Catch::Contains("is past it"));
}

TEST_CASE("a data connection reset ends the generation everywhere, by RingAbort; control links stay up",
          "[cluster][faults]") {
    if (run_command("ss -V 2>&1").exit_code != 0) RINGD_SKIP("ss (iproute2) is needed to reset a data connection");
    // 4 hosts: node1 and node2 are on neither end of the link node3 -> node0. Only node3's data
    // streams go to node0's port (control connections are dialed towards later hosts), so
    // `ss -K` with that destination resets exactly them.
    TestCluster c(4, options("30s", "1s", "", kBigSlotLimit));
    REQUIRE(c.wait_up());
    const std::string reset = "ss -K -t dst 127.0.0.1:" + std::to_string(c.port(0)) + " 2>&1";
    auto cl = connect_all(c, "link", 1, kBigSlot);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 100000, 1);
    // Either end of the link, named from the other end.
    const auto link_abort = [](const std::string &m) {
        return m.rfind("ring generation 1 aborted: link to node3: ", 0) == 0 ||
               m.rfind("ring generation 1 aborted: link to node0: ", 0) == 0;
    };

    SECTION("between ops: one reason on every host, from an end of the link") {
        const auto r = run_command(reset);
        INFO(r.output);
        REQUIRE(r.output.find("ESTAB") != std::string::npos);
        REQUIRE(c.wait_up({2, 2, 2, 2}));
        // node0 and node3 each see their end fail and abort 300-400 ms later; node1 and node2
        // see nothing themselves (nobody closes a data link before the RingAbort is out) and
        // take the reason of whichever end aborted first.
        std::vector<std::string> why;
        for (uint32_t h = 0; h < 4; ++h) why.push_back(c.status(h)["ring"]["last_abort"].get<std::string>());
        for (uint32_t h = 0; h < 4; ++h) {
            INFO("host " << h << ": " << why[h]);
            CHECK(link_abort(why[h]));
            CHECK((why[h] == why[0] || why[h] == why[3]));
        }
    }
    SECTION("while a large ring op moves data: every rank's op fails naming a link") {
        const auto t = start_big_op(cl, 1);
        const auto fault = Clock::now();
        const auto r = run_command(reset);
        INFO(r.output);
        REQUIRE(r.output.find("ESTAB") != std::string::npos);
        for (uint32_t g = 0; g < 4; ++g) {
            const Failure f = wait_failed(*cl[g], t[g], fault);
            INFO("rank " << g << ": " << f.message << " after " << f.after_s << " s");
            CHECK(f.rc == -ECONNABORTED);
            // The link error waits 300 ms (up to a 100 ms tick more) for a better reason, then
            // ends the generation. Which link the reason names depends on which host's tick
            // comes first: a failed op drops its links at once, so the neighbours of node0 and
            // node3 see theirs fail too.
            CHECK_THAT(f.message, Catch::StartsWith("ring generation 1 aborted: link to node"));
            CHECK(f.after_s < 1.5);
        }
        REQUIRE(c.wait_up({2, 2, 2, 2}));
        std::this_thread::sleep_for(200ms);
        for (uint32_t g = 0; g < 4; ++g) {
            INFO("rank " << g);
            CHECK(reuse_damage(*cl[g]) == 0);
        }
    }
    for (uint32_t h = 0; h < 4; ++h) {
        INFO("host " << h);
        const auto j = c.status(h);
        CHECK(j["ring"]["generation"] == 2);
        for (const auto &m : j["ring"]["members"]) CHECK((m["link"] == "up" || m["link"] == "self"));
        CHECK_FALSE(log_has(c, h, "connection closed\n"));  // how a control connection's EOF ends
        CHECK_FALSE(log_has(c, h, "no heartbeat"));
    }
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 300000, 2);
    allreduce_checked(cl, DType::I32, ReduceOp::Sum, 50, 3);
}

TEST_CASE("a host whose trainer never submits: the others fail at the op timeout naming it; when it "
          "submits late it gets that failure at once and the group goes on (the cost model's algorithms, "
          "two-shot, halving-doubling: their hosts report the op only once it stalls)",
          "[cluster][faults]") {
    const char *tuning = GENERATE("", "tuning: {algorithm: two-shot}\n", "tuning: {algorithm: halving-doubling}\n");
    INFO(tuning);
    TestCluster c(3, options("2s", "", tuning));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "quiet", 1);
    for (const size_t count : {size_t{1000}, size_t{200000}}) {  // direct exchange, then the ring
        INFO("count " << count);
        if (*tuning && count > 1000) continue;
        const auto start = Clock::now();
        const auto a = cl[0]->submit(0, count, RINGD_F32, RINGD_SUM);
        const auto b = cl[1]->submit(0, count, RINGD_F32, RINGD_SUM);
        for (auto [cli, t] : {std::pair{cl[0].get(), a}, {cl[1].get(), b}}) {
            const Failure f = wait_failed(*cli, t, start);
            INFO(f.message << " after " << f.after_s << " s");
            CHECK(f.rc == -ETIMEDOUT);
            CHECK_THAT(f.message, Catch::Contains("timed out after 2000 ms: host(s) node2 did not submit it"));
            CHECK(f.after_s >= 1.9);
            CHECK(f.after_s < 3.5);
        }
        const auto late = Clock::now();
        const auto d = cl[2]->submit(0, count, RINGD_F32, RINGD_SUM);
        CHECK(ringd_wait(cl[2]->get(), d, 10000) == -ETIMEDOUT);
        CHECK_THAT(ringd_last_error(cl[2]->get()), Catch::Contains("node2 did not submit it"));
        CHECK(seconds_since(late) < 1.0);
        allreduce_checked(cl, DType::F32, ReduceOp::Avg, count, 7);  // the group goes on
    }
    CHECK(c.status(0)["ring"]["generation"] == 1);  // an op timeout does not end the ring
}

TEST_CASE("an op fails within timeouts.op of its first submission, however late its other local ranks "
          "submit it",
          "[cluster][faults]") {
    TestCluster c(2, options("3s", ""));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "late", 2);  // host 0: ranks 0 and 1; host 1: ranks 2 and 3
    for (const size_t count : {size_t{1000}, size_t{200000}}) {  // direct exchange, then the ring
        INFO("count " << count);
        const auto start = Clock::now();
        const auto a = cl[0]->submit(0, count, RINGD_F32, RINGD_SUM);
        std::this_thread::sleep_for(1500ms);  // host 0's second rank is late; host 1's never submit
        const auto b = cl[1]->submit(0, count, RINGD_F32, RINGD_SUM);
        for (auto [cli, t] : {std::pair{cl[0].get(), a}, {cl[1].get(), b}}) {
            const Failure f = wait_failed(*cli, t, start);
            INFO(f.message << " after " << f.after_s << " s");
            CHECK(f.rc == -ETIMEDOUT);
            CHECK_THAT(f.message, Catch::Contains("host(s) node1 did not submit it"));
            CHECK(f.after_s >= 2.9);
            CHECK(f.after_s < 3.6);  // the deadline runs from rank 0's submission, not from rank 1's
        }
        // Host 1's ranks submit late: told at once, and the group goes on.
        const auto late = Clock::now();
        const auto t2 = cl[2]->submit(0, count, RINGD_F32, RINGD_SUM), t3 = cl[3]->submit(0, count, RINGD_F32, RINGD_SUM);
        for (auto [cli, t] : {std::pair{cl[2].get(), t2}, {cl[3].get(), t3}}) {
            CHECK(ringd_wait(cli->get(), t, 10000) == -ETIMEDOUT);
            CHECK_THAT(ringd_last_error(cli->get()), Catch::Contains("host(s) node1 did not submit it"));
        }
        CHECK(seconds_since(late) < 1.0);
        allreduce_checked(cl, DType::F32, ReduceOp::Sum, count, 11);
    }
}

// The op was submitted by every rank, so the ring may finish it: the other hosts' ranks get its
// result, or the departure if it came first; the departed trainer's local peer is told of the
// departure only once the progress thread gave the op back.
TEST_CASE("a trainer that leaves while a large ring op moves data: its local peer is told only when nothing "
          "writes its slot any more; the restarted job runs exact",
          "[cluster][faults]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    TestCluster c(3, options("30s", "1s", transport, kBigSlotLimit));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "leave", 2, kBigSlot);  // host 0: ranks 0 and 1
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, 1);
    const auto t = start_big_op(cl, 0);
    const auto fault = Clock::now();
    cl[1].reset();  // host 0's second trainer goes away mid-op
    const Failure f0 = wait_failed(*cl[0], t[0], fault);
    INFO("rank 0: " << f0.message << " after " << f0.after_s << " s");
    CHECK(f0.rc == -ECONNABORTED);
    CHECK_THAT(f0.message, Catch::Contains("host node0 local rank 1 left"));
    for (uint32_t g = 2; g < cl.size(); ++g) {
        const Failure f = wait_failed(*cl[g], t[g], fault);
        INFO("rank " << g << ": " << f.message << " after " << f.after_s << " s");
        CHECK((f.rc == 0 || f.message.find("host node0 local rank 1 left") != std::string::npos));
        CHECK(f.after_s < 5.0);
    }
    check_untouched(cl, {0});
    cl.clear();
    cl = connect_all(c, "leave", 2, kBigSlot);
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 777777, 2);
}

TEST_CASE("other groups are not affected while one group's op waits and fails", "[cluster][faults]") {
    TestCluster c(3, options("5s", ""));
    REQUIRE(c.wait_up());
    auto a = connect_all(c, "a", 1);
    auto b = connect_all(c, "b", 2, 2 << 20);
    // Group a: node2's trainer never submits; its op waits for the timeout.
    const auto start = Clock::now();
    const auto ta0 = a[0]->submit(0, 100000, RINGD_F32, RINGD_SUM);
    const auto ta1 = a[1]->submit(0, 100000, RINGD_F32, RINGD_SUM);
    REQUIRE(c.wait_taken(0, "a"));
    // Group b runs while it waits: direct exchange and the ring, every value exact.
    uint64_t seed = 1;
    for (int k = 0; k < 3; ++k)
        for (const size_t count : {size_t{10}, size_t{4097}, size_t{300000}})
            allreduce_checked(b, DType::F32, ReduceOp::Sum, count, seed++);
    CHECK(seconds_since(start) < 4.0);  // all of it before group a's op timed out
    CHECK(c.group(0, "a")["running_ops"] == 1);
    for (auto [cli, t] : {std::pair{a[0].get(), ta0}, {a[1].get(), ta1}}) {
        CHECK(ringd_wait(cli->get(), t, 10000) == -ETIMEDOUT);
        CHECK_THAT(ringd_last_error(cli->get()), Catch::Contains("node2 did not submit it"));
    }
    allreduce_checked(b, DType::BF16, ReduceOp::Max, 262145, seed++);
    for (uint32_t h = 0; h < 3; ++h) {
        INFO("host " << h);
        const json g = c.group(h, "b");
        CHECK(g["ops_completed"] == 10);
        CHECK(g["ops_failed"] == 0);
        CHECK(g["state"] == "ok");
    }
    CHECK(c.status(0)["ring"]["generation"] == 1);
}

TEST_CASE("SIGTERM on one host while a large ring op moves data: its trainer is told it shuts down, the others "
          "that it is gone, and nothing is written into a slot after",
          "[cluster][faults]") {
    TestCluster c(3, options("30s", "1s", "", kBigSlotLimit));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "termbig", 1, kBigSlot);
    MidOpFault m = fault_mid_op(c, cl, 1, SIGTERM, 0);
    std::vector<Failure> &f = m.failures;
    f[1] = wait_failed(*cl[1], m.tickets[1], m.fault);  // its own trainer
    for (uint32_t g = 0; g < 3; ++g) {
        INFO("rank " << g << ": " << f[g].message << " after " << f[g].after_s << " s");
        CHECK(f[g].after_s < 3.0);
        if (g == 1) {
            CHECK(f[g].rc != 0);
            CHECK_THAT(f[g].message, Catch::Contains("ringd is shutting down"));
        } else {
            CHECK(f[g].rc == -ECONNABORTED);
            CHECK_THAT(f[g].message, Catch::Contains("aborted: host node1: connection closed"));
        }
    }
    const int st = c.d[1]->stop(10s);  // it exits by itself; this reaps it
    REQUIRE(st != -1);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
    check_untouched(cl, {0, 1, 2});
}

TEST_CASE("SIGTERM on one host while the others wait on a ring op it never joined: its daemon exits at once; "
          "the others are told it is gone",
          "[cluster][faults]") {
    TestCluster c(3, options("30s", "1s"));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "term", 1);
    // Hosts 0 and 2 start a big op; host 1's trainer never submits, so the op waits in the ring.
    const auto t0 = cl[0]->submit(0, 200000, RINGD_F32, RINGD_SUM);
    const auto t2 = cl[2]->submit(0, 200000, RINGD_F32, RINGD_SUM);
    REQUIRE(c.wait_taken(0, "term"));  // the op is under way on hosts 0 and 2 before host 1 stops
    REQUIRE(c.wait_taken(2, "term"));
    const auto fault = Clock::now();
    const int st = c.d[1]->stop(10s);
    REQUIRE(st != -1);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
    CHECK(seconds_since(fault) < 3.0);
    for (auto [cli, t] : {std::pair{cl[0].get(), t0}, {cl[2].get(), t2}}) {
        const Failure f = wait_failed(*cli, t, fault);
        INFO(f.message << " after " << f.after_s << " s");
        CHECK(f.rc == -ECONNABORTED);
        CHECK_THAT(f.message, Catch::Contains("aborted: host node1: connection closed"));
        CHECK(f.after_s < 3.0);
    }
    CHECK_THAT(c.d[1]->log(), Catch::Contains("shutting down"));
}

TEST_CASE("a host that gets to a direct op after the deadline its peer's data carries fails it there without "
          "its data, even before the coordinator's decision arrives; the op fails on every host",
          "[cluster][faults]") {
    // node0 (the coordinator) submits and sends its data, then stops before its deadline passes:
    // its OpFail cannot come. node1's trainer submits after that deadline: with node0's data here
    // it could complete the op alone, while node0 fails it once it runs again.
    TestCluster c(2, options("1s", "1s"));
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "late", 1);
    const uint64_t before = c.status(1)["ring"]["frames"]["data_received"].get<uint64_t>();
    const auto t0 = Clock::now();
    const auto a = cl[0]->submit(0, 1000, RINGD_F32, RINGD_SUM);
    // node0's data is at node1 (its op-data frames counted there), then node0 stops.
    while (c.status(1)["ring"]["frames"]["data_received"].get<uint64_t>() == before && seconds_since(t0) < 0.8)
        std::this_thread::sleep_for(5ms);
    REQUIRE(c.status(1)["ring"]["frames"]["data_received"].get<uint64_t>() > before);
    REQUIRE(::kill(c.d[0]->pid(), SIGSTOP) == 0);
    // Past node0's deadline (t0 + 1 s), well within three heartbeats: a clock, nothing to wait on.
    std::this_thread::sleep_until(t0 + 1300ms);
    const auto late = Clock::now();
    const auto b = cl[1]->submit(0, 1000, RINGD_F32, RINGD_SUM);
    const Failure f = wait_failed(*cl[1], b, late, 5000);
    REQUIRE(::kill(c.d[0]->pid(), SIGCONT) == 0);
    INFO(f.message << " after " << f.after_s << " s");
    CHECK(f.rc == -ETIMEDOUT);
    CHECK_THAT(f.message, Catch::Contains("host(s) node1 did not submit it by host node0's deadline"));
    CHECK(f.after_s < 0.5);
    const Failure g = wait_failed(*cl[0], a, t0, 10000);
    INFO("node0: " << g.message);
    CHECK(g.rc == -ETIMEDOUT);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, 5);  // the group goes on
}

// A rank that is alive but late (a checkpoint, an evaluation, a compilation on rank 0) must not
// kill the job: an op's deadline is its group's op timeout (ringd_options.op_timeout_ms; the
// process group's timeout through ringd.torch), timeouts.op only the default and timeouts.op_max
// the ceiling. A dead or hung host is still found by heartbeats within seconds.
TEST_CASE("a group's op timeout: a rank late by more than timeouts.op runs clean within it, fails naming the "
          "host past it, is clamped to timeouts.op_max; a host killed during a long wait is named within the "
          "heartbeat bound",
          "[cluster][faults][timeout]") {
    TestCluster c(2, options("1s, op_max: 4s", ""));
    REQUIRE(c.wait_up());
    // node0's rank is 2 s late every step (twice timeouts.op), inside the group's 3 s.
    auto patient = connect_all(c, "patient", 1, 4 << 20, "", 3000);
    CHECK(c.group(0, "patient")["op_timeout_ms"] == 3000);
    for (const size_t count : {size_t{1000}, size_t{300000}}) {  // direct exchange, then the ring
        for (uint64_t step = 0; step < 2; ++step) {
            INFO("count " << count << " step " << step);
            CheckedOp o = prepare_checked(patient, DType::F32, ReduceOp::Sum, count, 40 + step);
            for (size_t g : {1u, 0u}) {
                if (g == 0) std::this_thread::sleep_for(2s);
                o.tickets[g] = patient[g]->submit(o.range[g].offset, o.count, RINGD_F32, RINGD_SUM);
            }
            wait_checked(patient, o);
        }
    }
    for (uint32_t h = 0; h < c.n; ++h) CHECK(c.group(h, "patient")["ops_failed"] == 0);
    patient.clear();

    // The same lateness with a group timeout below it: the op fails at the group's deadline,
    // naming the host whose rank did not submit it.
    auto hasty = connect_all(c, "hasty", 1, 4 << 20, "", 1500);
    {
        const auto start = Clock::now();
        const auto t = hasty[1]->submit(0, 1000, RINGD_F32, RINGD_SUM);
        const Failure f = wait_failed(*hasty[1], t, start);
        INFO(f.message << " after " << f.after_s << " s");
        CHECK(f.rc == -ETIMEDOUT);
        CHECK_THAT(f.message, Catch::Contains("timed out after 1500 ms: host(s) node0 did not submit it"));
        CHECK(f.after_s >= 1.4);
        CHECK(f.after_s < 2.5);
    }
    hasty.clear();

    // Above timeouts.op_max: clamped to it, said once in the log (however many ranks ask).
    auto greedy = connect_all(c, "greedy", 1, 4 << 20, "", 600000);
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        CHECK(c.group(h, "greedy")["op_timeout_ms"] == 4000);
        const std::string log = c.d[h]->log();
        const std::string said = "group greedy asks for an op timeout of 600000 ms, more than timeouts.op_max: its ops run with 4000 ms";
        const size_t at = log.find(said);
        CHECK(at != std::string::npos);
        CHECK(log.find(said, at + 1) == std::string::npos);
    }
    allreduce_checked(greedy, DType::F32, ReduceOp::Avg, 1000, 5);
    // Every local rank of a group passes the same timeout: another is refused, naming both.
    {
        auto first = std::make_unique<Client>(c.d[0]->socket(), "mixed", 0, 2, 1 << 20, "", 2000);
        CHECK_THROWS_WITH(Client(c.d[0]->socket(), "mixed", 1, 2, 1 << 20, "", 3000),
                          Catch::Contains("ask for different op timeouts: 2000 ms (the first one), this one 3000 ms"));
    }

    // A host killed while the other's rank waits in a long op: named by the heartbeats within
    // seconds, not at the group's deadline.
    const auto t = greedy[0]->submit(0, 300000, RINGD_F32, RINGD_SUM);
    std::this_thread::sleep_for(300ms);
    const auto killed = Clock::now();
    c.d[1]->kill();
    const Failure f = wait_failed(*greedy[0], t, killed);
    INFO(f.message << " after " << f.after_s << " s");
    CHECK(f.rc != 0);
    CHECK_THAT(f.message, Catch::Contains("node1"));
    CHECK(f.after_s < 3.5);  // the group's deadline was 4 s after the submission
}
