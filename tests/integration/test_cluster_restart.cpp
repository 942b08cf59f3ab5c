// Jobs that restart with the same group name, as torchrun does: after a trainer died the whole
// job starts again and every op of the new run must pair with the same op on every host — never
// with a leftover of the old run (which, with the same shapes every step, would be a silent wrong
// result). A job restarted on some hosts only fails clearly on both sides and works as soon as
// the whole job restarts.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include <csignal>
#include <thread>

#include "tests/support/cluster.h"
#include "tests/support/netns.h"
#include "tests/support/skip.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;

namespace {

constexpr size_t kSlot = 4 << 20;

struct Outcome {
    int rc = 0;
    std::string message;
};

Outcome wait_outcome(Client &cl, uint64_t ticket, int timeout_ms = 20000) {
    Outcome o;
    o.rc = ringd_wait(cl.get(), ticket, timeout_ms);
    if (o.rc != 0) o.message = ringd_last_error(cl.get());
    return o;
}

// A few ops of different shapes, every value checked; run by a job right after it (re)started.
void run_steps(Clients &cl, uint64_t seed) {
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, seed);
    allreduce_checked(cl, DType::BF16, ReduceOp::Min, 2, seed + 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 2, seed + 2);
    allreduce_checked(cl, DType::I32, ReduceOp::Max, 600000, seed + 3);  // the ring
    allreduce_checked(cl, DType::F16, ReduceOp::Sum, 5000, seed + 4);
}

// Waits until daemon `h` says of `group` what `pred` wants (its summary, null when it has none).
template <class Pred>
bool wait_group(TestCluster &c, uint32_t h, const std::string &group, Pred pred) {
    for (const auto until = Clock::now() + 5s; Clock::now() < until; std::this_thread::sleep_for(5ms))
        if (pred(c.group(h, group))) return true;
    return false;
}

}  // namespace

TEST_CASE("a job restarted with the same group name after a trainer died starts clean on every host",
          "[cluster][restart]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    TestCluster c(3, "5s", transport);
    REQUIRE(c.wait_up());
    for (int run = 0; run < 3; ++run) {
        INFO("run " << run);
        auto cl = connect_all(c, "job", 1, kSlot);
        run_steps(cl, 100 * run + 1);
        // The trainer of node1 dies while rank 0 is two ops ahead and rank 2 one: the hosts have
        // taken different numbers of the old run's ops when the job restarts.
        const uint64_t a = cl[0]->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM);
        const uint64_t b = cl[0]->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM);
        const uint64_t d = cl[2]->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM);
        REQUIRE(c.wait_taken(0, "job"));
        cl[1].reset();
        for (auto [g, t] : {std::pair{0, a}, {0, b}, {2, d}}) {
            const Outcome o = wait_outcome(*cl[g], t);
            INFO("rank " << g << ": " << o.message);
            CHECK(o.rc != 0);
        }
        cl.clear();  // the whole job exits ...
    }
    // ... and every restart ran clean (checked in run_steps).
    auto cl = connect_all(c, "job", 1, kSlot);
    run_steps(cl, 999);
}

TEST_CASE("after every host restarted, the ring's generations go on from where they were (the state "
          "directory), and a job runs exact",
          "[cluster][restart]") {
    TestCluster c(3, "5s");
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "before", 1, kSlot);
    run_steps(cl, 1);
    cl.clear();
    // The ring re-forms a few times (a host restarted alone), so generations are past 1.
    for (uint64_t h : {1u, 2u}) {
        REQUIRE(c.d[h]->stop() == 0);
        c.d[h]->start();
        REQUIRE(c.d[h]->ready());
        REQUIRE(c.wait_up({h + 1, h + 1, h + 1}));
    }
    const uint64_t before = c.status(0)["ring"]["generation"].get<uint64_t>();
    REQUIRE(before >= 3);
    // Every host stops, then all start again: nobody remembers the old ring but the state files.
    for (uint32_t h = 0; h < c.n; ++h) REQUIRE(c.d[h]->stop() == 0);
    for (uint32_t h = 0; h < c.n; ++h) {
        c.d[h]->start();
        REQUIRE(c.d[h]->ready());
    }
    REQUIRE(c.wait_up({before + 1, before + 1, before + 1}));
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        CHECK(c.status(h)["ring"]["generation"].get<uint64_t>() == before + 1);
        CHECK_THAT(c.d[h]->log(), Catch::Contains("the newest ring generation before this start was " + std::to_string(before)));
    }
    cl = connect_all(c, "after", 1, kSlot);
    run_steps(cl, 7);
    // A state file that does not hold a generation (here one that would wrap the counter) is
    // said so and ignored: the ring forms as ever.
    cl.clear();
    REQUIRE(c.d[1]->stop() == 0);
    std::ofstream(c.d[1]->dir() + "/state/generation", std::ios::trunc) << "18446744073709551615\n";
    c.d[1]->start();
    REQUIRE(c.d[1]->ready());
    REQUIRE(c.wait_up({before + 2, before + 2, before + 2}));
    CHECK_THAT(c.d[1]->log(), Catch::Contains("not a generation number (0 to 2^40); ring generations start afresh"));
    cl = connect_all(c, "again", 1, kSlot);
    run_steps(cl, 9);
}

TEST_CASE("a job restarted on one host only fails clearly on every host and works once the whole job restarted",
          "[cluster][restart]") {
    TestCluster c(3, "3s");
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "job", 1, kSlot);
    run_steps(cl, 1);
    // node1's trainer restarts alone; the others go on with the old run's next op.
    cl[1].reset();
    cl[1] = std::make_unique<Client>(c.d[1]->socket(), "job", 0, 1, kSlot);
    std::vector<uint64_t> t;
    for (auto &x : cl) t.push_back(x->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM));
    const auto start = Clock::now();
    for (int g : {0, 2}) {
        const Outcome o = wait_outcome(*cl[g], t[g]);
        INFO("rank " << g << ": " << o.message << " after " << seconds_since(start) << " s");
        CHECK(o.rc == -ECONNABORTED);
        CHECK_THAT(o.message, Catch::Contains("host node1 local rank 0 left"));
        CHECK(seconds_since(start) < 1.0);  // at once, not at the op timeout
    }
    {
        const Outcome o = wait_outcome(*cl[1], t[1]);
        INFO("rank 1: " << o.message);
        CHECK(o.rc != 0);
        CHECK_THAT(o.message, Catch::Contains("incarnation"));
    }
    // The whole job restarts: clean again.
    cl.clear();
    cl = connect_all(c, "job", 1, kSlot);
    run_steps(cl, 50);
}

// A run of the job that ends on one host before the hosts agreed on it (the others' ranks were not
// there yet) must not be agreed afterwards with the job's next run: the coordinator would pair the
// next run's ops with a run that is over, and its end would fail them. Seen in bench/chaos: every
// restart of the job failed at its first op with the previous run's error for half a minute.
TEST_CASE("a run that ended on one host before the hosts agreed on it does not fail the job's next run",
          "[cluster][restart]") {
    TestCluster c(2, "2s");
    REQUIRE(c.wait_up());
    SECTION("one of its ranks left, the other a moment later") {
        auto r0 = std::make_unique<Client>(c.d[1]->socket(), "job", 0, 2, kSlot);
        auto r1 = std::make_unique<Client>(c.d[1]->socket(), "job", 1, 2, kSlot);
        const uint64_t t0 = r0->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM);
        (void)r1->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM);
        REQUIRE(c.wait_taken(1, "job"));  // waiting for node0's ranks
        r1.reset();
        const Outcome o = wait_outcome(*r0, t0);
        INFO(o.message);
        CHECK(o.rc == -ECONNABORTED);
        CHECK_THAT(o.message, Catch::Contains("local rank 1 left"));
        std::this_thread::sleep_for(300ms);  // rank 0 stays: its ringd goes on with the group a while
        r0.reset();
    }
    SECTION("its op timed out waiting for a local rank that never came, then its rank left") {
        auto r0 = std::make_unique<Client>(c.d[1]->socket(), "job", 0, 2, kSlot);
        const uint64_t t0 = r0->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM);
        const Outcome o = wait_outcome(*r0, t0);
        INFO(o.message);
        CHECK(o.rc == -ETIMEDOUT);
        CHECK_THAT(o.message, Catch::Contains("local ranks 1 of host node1 did not submit it"));
        r0.reset();
    }
    SECTION("one of its ranks left while the ring was down; the other stayed until the ring was back") {
        const uint64_t gen = c.status(1)["ring"]["generation"].get<uint64_t>();
        REQUIRE(c.d[0]->stop() == 0);
        auto r0 = std::make_unique<Client>(c.d[1]->socket(), "job", 0, 2, kSlot);
        auto r1 = std::make_unique<Client>(c.d[1]->socket(), "job", 1, 2, kSlot);
        r1.reset();
        REQUIRE(wait_group(c, 1, "job", [](const json &g) { return !g.is_null() && g["state"] == "broken"; }));
        c.d[0]->start();
        REQUIRE(c.d[0]->ready());
        REQUIRE(c.wait_up({gen + 1, gen + 1}));
        std::this_thread::sleep_for(300ms);  // node1 goes on with the group a while, the ring up
        r0.reset();
    }
    // Once node1 let the run go (its ranks' departures handled), the whole job starts again,
    // node0 first: every op exact, none failed.
    REQUIRE(wait_group(c, 1, "job", [](const json &g) { return g.is_null(); }));
    auto cl = connect_all(c, "job", 2, kSlot);
    run_steps(cl, 77);
    for (uint32_t h = 0; h < c.n; ++h) CHECK(c.group(h, "job")["ops_failed"].get<int>() == 0);
}

// A run the hosts agreed on, whose trainer on one host leaves while that host is cut off (its
// link down: the ring is down there, its peers count as down, its queued reports are dropped):
// once the link and the ring are back, that host tells the coordinator the run ended there, and
// the other hosts' trainers fail at once naming it, instead of waiting their op timeout for it to
// join again.
TEST_CASE("a trainer that left while its host was cut off ends its run for the others once the ring is back",
          "[cluster][restart]") {
    if (!NetnsHosts::available()) RINGD_SKIP("network namespaces are needed to take a host's link down");
    NetnsHosts hosts(3);
    ClusterOptions o;
    o.op_timeout = "20s";
    o.heartbeat = "300ms";
    o.netns = &hosts;
    TestCluster c(3, o);
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "job", 1, kSlot);
    run_steps(cl, 3);
    const uint64_t gen = c.status(0)["ring"]["generation"].get<uint64_t>();
    REQUIRE(run_command("ip -n " + hosts.ns(1) + " link set eth0 down").exit_code == 0);
    const auto deadline = Clock::now() + 5s;
    while (c.status(1)["ring"]["state"] == "up" && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
    REQUIRE(c.status(1)["ring"]["state"] == "forming");
    cl[1].reset();  // node1's trainer leaves
    REQUIRE(wait_group(c, 1, "job", [](const json &g) { return g.is_null(); }));
    // Its queued failures fail with the ring once its dials fail (its peers are down as it sees
    // them): nothing is left queued there.
    const auto drained = Clock::now() + 5s;
    while (c.status(1)["op_states"]["queued"].get<int>() != 0 && Clock::now() < drained) std::this_thread::sleep_for(5ms);
    REQUIRE(c.status(1)["op_states"]["queued"].get<int>() == 0);
    REQUIRE(run_command("ip -n " + hosts.ns(1) + " link set eth0 up").exit_code == 0);
    REQUIRE(c.wait_up({gen + 1, gen + 1, gen + 1}));
    const auto start = Clock::now();
    for (int g : {0, 2}) {
        const Outcome o2 = wait_outcome(*cl[g], cl[g]->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM));
        INFO("rank " << g << ": " << o2.message << " after " << seconds_since(start) << " s");
        CHECK(o2.rc == -ECONNABORTED);
        CHECK_THAT(o2.message, Catch::Contains("host node1"));
        CHECK(seconds_since(start) < 2.0);  // at once, not at the op timeout
    }
    cl.clear();
    cl = connect_all(c, "job", 1, kSlot);
    run_steps(cl, 30);
}

// Solo lanes (docs/design.md, Ring domains): the first group agreed over these hosts has a lane
// to itself and every host starts its ring ops there without the coordinator. An op there that
// not every host runs is cancelled on the hosts that started it, on live links: the others' ops
// and the ring generation go on.
TEST_CASE("a solo lane's ring op that not every host runs fails at once, named; the generation and another group's ops "
          "go on; the lane carries the next ops exact",
          "[cluster][restart][solo]") {
    TestCluster c(3, "5s", "tuning: {direct_max_bytes: 64KiB}\n");
    REQUIRE(c.wait_up());
    constexpr size_t kBig = 8 << 20;
    auto a = connect_all(c, "a", 1, kBig);
    allreduce_checked(a, DType::F32, ReduceOp::Sum, 200000, 1);  // agreed first: the solo lane
    for (uint32_t h = 0; h < 3; ++h) CHECK(c.status(h)["ring"]["ops_ring_solo"] == 1);
    // Another group over the same hosts, looping on the shared lane (its ring ops started by the
    // coordinator) all along.
    LoopingJob job(connect_all(c, "b", 1, kBig));
    REQUIRE(job_moves(job));
    const uint64_t generation = c.status(0)["ring"]["generation"].get<uint64_t>();
    const size_t count = 1 << 20;  // 4 MiB: more than the links' socket buffers hold
    SECTION("a trainer leaves before the op: the others' op fails at once, naming its host; the job restarts exact") {
        const auto s = Clock::now();
        const uint64_t t0 = a[0]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM);
        const uint64_t t2 = a[2]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM);
        REQUIRE(c.wait_taken(0, "a"));
        REQUIRE(c.wait_taken(2, "a"));
        a[1].reset();
        for (auto [g, t] : {std::pair{0, t0}, {2, t2}}) {
            const Outcome o = wait_outcome(*a[g], t);
            INFO("rank " << g << ": " << o.message);
            CHECK(o.rc == -ECONNABORTED);
            CHECK_THAT(o.message, Catch::Contains("node1") && Catch::Contains("left"));
        }
        CHECK(Clock::now() - s < 3s);  // not the op timeout (5 s)
        a.clear();
        a = connect_all(c, "a", 1, kBig);
    }
    SECTION("one host's op differs: every host fails it as a mismatch naming the hosts; the group goes on") {
        const uint64_t t0 = a[0]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM);
        const uint64_t t1 = a[1]->submit(bench::kGuardBytes, count / 2, RINGD_F32, RINGD_SUM);
        const uint64_t t2 = a[2]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM);
        for (auto [g, t] : {std::pair{0, t0}, {1, t1}, {2, t2}}) {
            const Outcome o = wait_outcome(*a[g], t);
            INFO("rank " << g << ": " << o.message);
            CHECK(o.rc == -EINVAL);
            CHECK_THAT(o.message, Catch::Contains("mismatch") && Catch::Contains("host node1 submitted 524288 x float sum"));
        }
    }
    // The lane's next ops, on the same links: every value and guard byte exact.
    for (uint64_t seed = 10; seed < 14; ++seed)
        allreduce_checked(a, seed % 2 ? DType::F64 : DType::I32, seed % 2 ? ReduceOp::Avg : ReduceOp::Max,
                          300000 + seed, seed);
    CHECK(c.status(0)["ring"]["generation"].get<uint64_t>() == generation);  // no ring generation ended
    REQUIRE(job_moves(job));
    check_clean(job.stop());
}

TEST_CASE("a solo lane whose rank on one host never submits: each op the others queued fails at its deadline naming "
          "the host, on live links; the late rank's ops fail at once; then the group runs exact",
          "[cluster][restart][solo]") {
    TestCluster c(3, "1s", "tuning: {direct_max_bytes: 64KiB}\n");
    REQUIRE(c.wait_up());
    constexpr size_t kBig = 56 << 20;
    auto a = connect_all(c, "a", 1, kBig);
    allreduce_checked(a, DType::F32, ReduceOp::Sum, 200000, 1);  // agreed first: the solo lane
    LoopingJob job(connect_all(c, "b", 1, kBig));
    REQUIRE(job_moves(job));
    const uint64_t generation = c.status(0)["ring"]["generation"].get<uint64_t>();
    // node0 and node2 run three 24 MiB ops (more than the links' socket buffers hold), each after
    // the last one failed, and one pair more queued together; node1's rank is there but submits
    // nothing. Each op starts and sends on node0 and node2, while node1 is ever further behind.
    const size_t count = 6 << 20;
    for (int k = 0; k < 4; ++k) {
        std::vector<std::pair<int, uint64_t>> tickets;
        for (int j = k; j < (k < 3 ? k + 1 : k + 2); ++j)
            for (int g : {0, 2})
                tickets.emplace_back(g, a[g]->submit(bench::kGuardBytes + 4 * count * (j % 2), count, RINGD_F32, RINGD_SUM));
        for (auto [g, t] : tickets) {
            const Outcome o = wait_outcome(*a[g], t);
            INFO("op " << k << ", rank " << g << ": " << o.message);
            CHECK(o.rc == -ETIMEDOUT);
            CHECK_THAT(o.message, Catch::Contains("host(s) node1 did not submit it"));
        }
    }
    // node1's rank gets there: decided already, they fail at once.
    for (int k = 0; k < 5; ++k) {
        const auto s = Clock::now();
        const Outcome o = wait_outcome(*a[1], a[1]->submit(bench::kGuardBytes, count, RINGD_F32, RINGD_SUM));
        INFO("node1 op " << k << ": " << o.message);
        CHECK(o.rc == -ETIMEDOUT);
        CHECK(Clock::now() - s < 500ms);
    }
    for (uint64_t seed = 20; seed < 23; ++seed) allreduce_checked(a, DType::F32, ReduceOp::Avg, 700001 + seed, seed);
    allreduce_checked(a, DType::F32, ReduceOp::Sum, count, 30);
    CHECK(c.status(0)["ring"]["generation"].get<uint64_t>() == generation);  // no ring generation ended
    REQUIRE(job_moves(job));
    check_clean(job.stop());
}

namespace {

// Every host's ring is up at one protocol: its generation's, the same on every host, with every
// control connection at it too (this build on every host: the newest it speaks).
void check_one_protocol(TestCluster &c) {
    const json s0 = c.status(0);
    uint64_t newest = 0;
    for (const auto &m : s0["ring"]["members"])
        if (m["self"].get<bool>()) newest = m["protocol"].get<uint64_t>();
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const json s = c.status(h);
        CHECK(s["ring"]["state"] == "up");
        CHECK(s["ring"]["protocol"].get<uint64_t>() == newest);
        for (const auto &m : s["ring"]["members"]) {
            INFO("member " << m["name"]);
            CHECK(m["protocol"].get<uint64_t>() == newest);
        }
    }
}

// Accepts every connection to `address`:7400 in network namespace `ns` for `how_long`, reads the
// first bytes of each hello and resets the connection (SO_LINGER 0): a host that dies in the
// middle of a handshake, again and again. Returns how many it reset.
int reset_hellos(const std::string &ns, const std::string &address, std::chrono::milliseconds how_long) {
    int resets = -1;
    std::thread t([&] {
        const int nsfd = ::open(("/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
        if (nsfd < 0 || ::setns(nsfd, CLONE_NEWNET) != 0) return;  // this thread only
        ::close(nsfd);
        UniqueFd l(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        const int one = 1;
        ::setsockopt(l.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(7400);
        ::inet_pton(AF_INET, address.c_str(), &a.sin_addr);
        if (::bind(l.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || ::listen(l.get(), 16) != 0) return;
        resets = 0;
        for (const auto until = Clock::now() + how_long; Clock::now() < until;) {
            pollfd p{l.get(), POLLIN, 0};
            if (::poll(&p, 1, 50) <= 0) continue;
            UniqueFd s(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
            if (!s) continue;
            pollfd q{s.get(), POLLIN, 0};
            uint8_t part[20];
            if (::poll(&q, 1, 1000) == 1) (void)::recv(s.get(), part, sizeof part, 0);  // half a hello at most
            const linger rst{1, 0};
            ::setsockopt(s.get(), SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
            ++resets;
        }
    });
    t.join();
    return resets;
}

}  // namespace

// A hung ringd that an operator kills and starts again: while it was stopped its peers' dials
// queued in its listen backlog, and its kill reset them all in the middle of their hellos. A reset
// says nothing of a peer's version: no host may take it for an older release's refusal, and the
// generation's protocol is one value, decided by the coordinator for every host, so the hosts
// never choose algorithms by different protocols.
TEST_CASE("a host that hung and was killed and restarted, or reset its peers' hellos, leaves every host on one "
          "protocol, the ring back and exact within 3 s",
          "[cluster][restart][protocol]") {
    if (!NetnsHosts::available()) RINGD_SKIP("network namespaces are needed for hosts of their own");
    NetnsHosts hosts(3);
    ClusterOptions o;
    o.op_timeout = "10s";
    o.netns = &hosts;
    TestCluster c(3, o);
    REQUIRE(c.wait_up());
    check_one_protocol(c);
    uint64_t seed = 1;
    auto back_within = [&](const char *what) {
        INFO(what);
        const auto t0 = Clock::now();
        // Up on every host, and a new job's ops exact (small ones by the protocol's algorithms,
        // one on the ring).
        const auto deadline = t0 + 3s;
        bool up = false;
        while (!up && Clock::now() < deadline) {
            up = true;
            for (uint32_t h = 0; h < c.n; ++h) up = up && c.status(h)["ring"]["state"] == "up";
            if (!up) std::this_thread::sleep_for(10ms);
        }
        REQUIRE(up);
        auto cl = connect_all(c, std::string("after-") + std::to_string(seed), 1, kSlot);
        run_steps(cl, seed += 10);
        const double took = seconds_since(t0);
        INFO("back and exact after " << took << " s");
        CHECK(took < 3.0);
        check_one_protocol(c);
        for (uint32_t h = 0; h < c.n; ++h) {
            INFO("host " << h);
            const std::string log = c.d[h]->log();
            const size_t at = log.find("does not speak protocol");
            CHECK((at == std::string::npos ? "" : log.substr(at, std::min<size_t>(log.find('\n', at) - at, 120))) == "");
        }
    };
    for (int round = 0; round < 2; ++round) {
        INFO("round " << round);
        // node1 hangs: every other host ends the ring naming it (missed heartbeats) and keeps
        // dialing it, its dials queued in the stopped ringd's listen backlog.
        auto job = connect_all(c, "job" + std::to_string(round), 1, kSlot);
        run_steps(job, seed += 10);
        c.d[1]->signal(SIGSTOP);
        for (uint32_t h : {0u, 2u}) {
            INFO("host " << h);
            const auto until = Clock::now() + 10s;
            while (c.status(h)["ring"]["last_abort"].get<std::string>().find("node1") == std::string::npos &&
                   Clock::now() < until)
                std::this_thread::sleep_for(50ms);
            CHECK_THAT(c.status(h)["ring"]["last_abort"].get<std::string>(), Catch::Contains("node1"));
        }
        std::this_thread::sleep_for(1500ms);  // more dials queue
        job.clear();
        c.d[1]->signal(SIGCONT);
        c.d[1]->kill();
        c.d[1]->start();
        REQUIRE(c.d[1]->ready());
        back_within("node1 hung, was killed and restarted");
    }
    // node1's address answers every dial and resets it in the middle of the hello for 2 s (a
    // host that dies as it is dialed, again and again), then node1's ringd starts there again.
    REQUIRE(c.d[1]->stop() == 0);
    const int resets = reset_hellos(hosts.ns(1), hosts.address(1), 2s);
    CHECK(resets >= 2);
    c.d[1]->start();
    REQUIRE(c.d[1]->ready());
    back_within("node1's address reset every hello for 2 s");
}
