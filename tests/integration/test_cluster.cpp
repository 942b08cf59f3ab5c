// Rings of real ringd processes on 127.0.0.1 (one port each) with real trainers: every dtype x
// op on each algorithm and transport with 1 and 2 local ranks, every value and the guard bytes
// around every rank's range checked here; mismatches between hosts (count, dtype, op), a trainer
// that dies on one host, the peer port's authentication, and what stops ringd at start.
// Faults while data moves are in test_cluster_faults.cpp.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include <cmath>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/support/cluster.h"
#include "tests/support/netns.h"
#include "tests/support/skip.h"
#include "tests/support/net.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;

namespace {

struct Algo {
    const char *name;
    const char *tuning;
    const char *counter;  // the status counter of ring.* that counts its ops
};
// Each forced (tuning.algorithm, daemon/engine/tuner.h) on 3 hosts: doubling and halving-doubling
// with host 2 folded into host 0 (3 is not a power of two).
const Algo kAlgos[] = {
    {"one-shot", "tuning: {direct_max_bytes: 16MiB, algorithm: one-shot}\n", "ops_one_shot"},
    {"two-shot", "tuning: {direct_max_bytes: 16MiB, algorithm: two-shot}\n", "ops_two_shot"},
    {"doubling", "tuning: {direct_max_bytes: 16MiB, algorithm: doubling}\n", "ops_doubling"},
    {"halving-doubling", "tuning: {direct_max_bytes: 16MiB, algorithm: halving-doubling}\n", "ops_halving_doubling"},
    {"ring", "tuning: {direct_max_bytes: 0}\n", "ops_ring"},
};

bool machine_has_rdma_devices() {
    std::error_code ec;
    return std::filesystem::exists("/sys/class/infiniband", ec) && !std::filesystem::is_empty("/sys/class/infiniband", ec);
}

// Starts ringd for host a of a two-host config with `extra` keys; it must stop at once (< 5 s)
// with an error. Returns what it printed.
std::string ringd_start_failure(const std::string &extra) {
    const std::string dir = make_temp_dir();
    std::ofstream(dir + "/c.yaml") << "cluster: c\nhosts:\n  - {name: a, address: 127.0.0.1, port: 7400}\n"
                                      "  - {name: b, address: 127.0.0.1, port: 7401}\n"
                                   << (extra.find("auth:") == std::string::npos ? secret_yaml() : "") << extra
                                   << "socket: " << dir << "/s.sock\n";
    const auto start = Clock::now();
    const auto r = run_command(env_or("RINGD_BIN", "build/daemon/ringd") + " --config " + dir + "/c.yaml --host a 2>&1");
    CHECK(r.exit_code != 0);
    CHECK(Clock::now() - start < 5s);
    return r.output;
}

}  // namespace

TEST_CASE("every dtype x op on each algorithm and transport, 1 and 2 local ranks: every value and guard byte exact",
          "[cluster]") {
    const bool ibverbs = GENERATE(false, true);
    const size_t a = GENERATE(0, 1, 2, 3, 4);
    const Algo &algo = kAlgos[a];
    // Doubling and halving-doubling go over the control connections (TCP) like one-/two-shot,
    // which the ibverbs run covers already.
    if (ibverbs && (a == 2 || a == 3)) return;
    INFO((ibverbs ? "ibverbs" : "tcp") << ", " << algo.name);
    TestCluster c(3, "10s", std::string(ibverbs ? kIbverbsYaml : "") + algo.tuning);
    REQUIRE(c.wait_up());
    const bool ring = std::string(algo.name) == "ring";
    uint64_t ops = 0, seed = 1;
    for (uint32_t local : {1u, 2u}) {
        auto cl = connect_all(c, "cov" + std::to_string(local), local, 4 << 20);
        for (uint32_t t = 0; t < kDTypeCount; ++t) {
            const auto dt = static_cast<DType>(t);
            uint32_t pair = 0;  // the dtype's op number
            for (uint32_t o = 0; o < kReduceOpCount; ++o) {
                const auto op = static_cast<ReduceOp>(o);
                if (op == ReduceOp::Avg && dtype_is_integer(dt)) continue;
                // 1 element: every host but one has an empty segment; 5003: a prime, uneven segments.
                std::vector<size_t> counts{1, 5003};
                // The ring over several 512 KiB chunks per segment, one op of each dtype (another op
                // each local size).
                if (ring && pair++ == (t + local) % (dtype_is_integer(dt) ? 3 : 4))
                    counts.push_back((size_t{3} << 20) / dtype_size(dt) + 1);
                for (size_t count : counts) {
                    allreduce_checked(cl, dt, op, count, seed++);
                    ++ops;
                }
            }
        }
    }
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const auto j = c.status(h);
        CHECK(j["transport"] == (ibverbs ? "ibverbs" : "tcp"));
        CHECK(j["ring"]["generation"] == 1);
        CHECK(j["ops"]["failed"] == 0);
        CHECK(j["ops"]["completed"] == ops);  // per op on this host, whatever its local size
        for (const char *counter : {"ops_one_shot", "ops_two_shot", "ops_doubling", "ops_halving_doubling", "ops_ring"})
            CHECK(j["ring"][counter].get<uint64_t>() == (std::string(counter) == algo.counter ? ops : 0));
        CHECK(j["memory"]["registrations"].get<int>() <= 4);  // 3 slots + the ring's staging, never per op
        if (ibverbs)
            CHECK_THAT(j["transport_detail"].get<std::string>(), Catch::Contains("ringd_emu0") && Catch::Contains("RoCE v2"));
    }
}

TEST_CASE("avg of values near the largest finite one on each algorithm never overflows: f16 and bf16 exactly the mean, "
          "f32 and f64 within the documented bound",
          "[cluster][avg]") {
    const Algo &algo = kAlgos[GENERATE(0, 1, 2, 3, 4)];
    const bool ibverbs = GENERATE(false, true);
    const bool ring = std::string(algo.name) == "ring";
    if (ibverbs && !ring) return;  // direct exchange goes over the control connections: TCP either way
    INFO((ibverbs ? "ibverbs" : "tcp") << ", " << algo.name);
    TestCluster c(3, "20s", std::string(ibverbs ? kIbverbsYaml : "") + algo.tuning);
    REQUIRE(c.wait_up());
    uint64_t ops = 0, seed = 1;
    for (uint32_t local : {1u, 2u}) {
        auto cl = connect_all(c, "near-max" + std::to_string(local), local, 8 << 20);
        const size_t n = cl.size();
        for (DType t : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
            // The ring: a million f16 elements (several chunks per segment); direct: a prime.
            const size_t count = ring ? (t == DType::F16 ? 1000003 : 300007) : 5003;
            std::vector<bench::GuardedRange> range(n);
            for (size_t g = 0; g < n; ++g) {
                range[g] = rank_range(*cl[g], g, t, count, seed);
                REQUIRE(range[g].offset + range[g].bytes() + bench::kGuardBytes <= cl[g]->slot().size());
                range[g].prepare(cl[g]->slot().data(), g);  // the guards (and values overwritten below)
                for (size_t i = 0; i < count; ++i)
                    bench::store(cl[g]->slot().data() + range[g].offset, i, t, bench::near_max_value(t, n, g, i));
            }
            std::vector<uint64_t> tickets(n);
            for (size_t g = 0; g < n; ++g)
                tickets[g] = cl[g]->submit(range[g].offset, count, static_cast<ringd_dtype>(t), RINGD_AVG);
            for (size_t g = 0; g < n; ++g) {
                const int rc = ringd_wait(cl[g]->get(), tickets[g], 20000);
                INFO("rank " << g << ": " << (rc == 0 ? "" : ringd_last_error(cl[g]->get())));
                REQUIRE(rc == 0);
            }
            ++ops;
            double worst = 0;
            for (size_t g = 0; g < n; ++g) {
                INFO("rank " << g << " of " << n << ", " << dtype_name(t) << " avg of " << count << " near the largest");
                const std::byte *p = cl[g]->slot().data() + range[g].offset;
                uint64_t wrong = 0, nonfinite = 0;
                std::string first;
                for (size_t i = 0; i < count; ++i) {
                    const double want = bench::near_max_mean(t, n, i), got = bench::load(p, i, t);
                    nonfinite += !std::isfinite(got);
                    const double dev = std::fabs(got - want);
                    if (!(dev <= bench::near_max_bound(t, n, want)) && !wrong++)
                        first = "element " + std::to_string(i) + " is " + std::to_string(got) + ", not " + std::to_string(want);
                    if (std::isfinite(dev)) worst = std::max(worst, dev / bench::near_max_ulp(t));
                }
                INFO(first);
                CHECK(nonfinite == 0);
                CHECK(wrong == 0);
                CHECK(bench::guard_damage(cl[g]->slot().data(), range[g].guard_begin(), range[g].offset, range[g].salt) == 0);
                CHECK(bench::guard_damage(cl[g]->slot().data(), range[g].offset + range[g].bytes(), range[g].guard_end(),
                                          range[g].salt) == 0);
            }
            UNSCOPED_INFO(algo.name << " " << dtype_name(t) << " avg, " << local << " local: largest deviation " << worst << " ulp");
            ++seed;
        }
    }
    const auto j = c.status(0);
    CHECK(j["ring"][algo.counter].get<uint64_t>() == ops);
    CHECK(j["ops"]["failed"] == 0);
}

TEST_CASE("4 hosts, ring and one-shot ops interleaved in one group: every value and guard byte exact", "[cluster]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    TestCluster c(4, "10s", transport + "tuning: {direct_max_bytes: 64KiB}\n");
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "mix", 2, 2 << 20);
    uint64_t seed = 100;
    for (const size_t count : {size_t{3}, size_t{200000}, size_t{1000}, size_t{65537}, size_t{7}, size_t{262145}})
        allreduce_checked(cl, DType::F32, ReduceOp::Avg, count, seed++);
    const auto j = c.status(0);
    CHECK(j["ring"]["ops_ring"] == 3);
    CHECK(j["ring"]["ops_one_shot"] == 3);
    CHECK(j["ops"]["failed"] == 0);
}

TEST_CASE("transport: ibverbs with no such RDMA device stops ringd at start with what to do", "[cluster][ibverbs]") {
    if (!machine_has_rdma_devices()) {
        CHECK_THAT(ringd_start_failure("transport: ibverbs\n"),
                   Catch::Contains("no RDMA device found") && Catch::Contains("ibv_devices") && Catch::Contains("transport: tcp"));
    } else {
        // The same error path with a device name that is not there.
        CHECK_THAT(ringd_start_failure("transport: ibverbs\nibverbs: {device: ringd_no_such_dev}\n"),
                   Catch::Contains("no RDMA device"));
    }
    // Whatever the machine has: the software device is there, a name that is not is refused.
    CHECK_THAT(ringd_start_failure("transport: ibverbs\nibverbs: {provider: emulated, device: ringd_no_such_dev}\n"),
               Catch::Contains("ibverbs.device: no RDMA device 'ringd_no_such_dev' (found: ringd_emu0)"));
}

TEST_CASE("a TCP congestion control the kernel lacks stops ringd at start naming the key and the fix", "[cluster]") {
    CHECK_THAT(ringd_start_failure("tcp: {congestion: nosuchcc}\n"),
               Catch::Contains("tcp.congestion: TCP congestion control 'nosuchcc' is not in this kernel") &&
                   Catch::Contains("tcp.congestion: system"));
}

TEST_CASE("a count/dtype/op mismatch between hosts fails every rank naming both hosts (the cost model's "
          "algorithms, two-shot, doubling, halving-doubling)",
          "[cluster]") {
    // Every direct algorithm is deferred (kReportDeferred): the hosts that see a peer's data differ
    // report it, the others when they stall. One-shot (the model's, 3 hosts): every host sees
    // node1's data. Two-shot: each segment's owner sees node1's part. Doubling and
    // halving-doubling on 3 hosts: node1 folds into node0, which sees its data differ.
    const char *tuning = GENERATE("", "tuning: {algorithm: two-shot}\n", "tuning: {algorithm: doubling}\n",
                                  "tuning: {algorithm: halving-doubling}\n");
    INFO(tuning);
    struct Case {
        const char *what;
        size_t count;  // node0's and node2's; node1 differs in one thing
        ringd_dtype t1;
        ringd_op o1;
        int extra;  // node1's count is count + extra
        const char *node1_says;
    };
    const Case cases[] = {
        {"count", 100, RINGD_F32, RINGD_SUM, 1, "host node1 submitted 101 x float sum"},
        {"dtype", 100, RINGD_F64, RINGD_SUM, 0, "host node1 submitted 100 x double sum"},
        {"op", 100, RINGD_F32, RINGD_MAX, 0, "host node1 submitted 100 x float max"},
        {"count (ring)", 200000, RINGD_F32, RINGD_SUM, 1, "host node1 submitted 200001 x float sum"},
        {"dtype (ring)", 200000, RINGD_F64, RINGD_SUM, 0, "host node1 submitted 200000 x double sum"},
        {"op (ring)", 200000, RINGD_F32, RINGD_MIN, 0, "host node1 submitted 200000 x float min"},
    };
    TestCluster c(3, "5s", tuning);
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "m", 1, 4 << 20);
    uint64_t seed = 9;
    for (const Case &k : cases) {
        INFO(k.what);
        if (*tuning && k.count > 1000) continue;  // the ring: the same either way
        const auto a = cl[0]->submit(0, k.count, RINGD_F32, RINGD_SUM);
        const auto b = cl[1]->submit(0, k.count + static_cast<size_t>(k.extra), k.t1, k.o1);
        const auto d = cl[2]->submit(0, k.count, RINGD_F32, RINGD_SUM);
        for (auto [cli, t] : {std::pair{cl[0].get(), a}, {cl[1].get(), b}, {cl[2].get(), d}}) {
            CHECK(ringd_wait(cli->get(), t, 10000) == -EINVAL);
            // node1 and a host that agrees with the others: node0 or node2, whichever report
            // the coordinator had first.
            const std::string agrees = " submitted " + std::to_string(k.count) + " x float sum";
            CHECK_THAT(ringd_last_error(cli->get()),
                       Catch::Contains("mismatch: host ") && Catch::Contains(k.node1_says) &&
                           (Catch::Contains("host node0" + agrees) || Catch::Contains("host node2" + agrees)));
        }
        allreduce_checked(cl, DType::I64, ReduceOp::Sum, k.count, seed++);  // the group goes on
    }
    CHECK(c.status(0)["ring"]["generation"] == 1);
}

TEST_CASE("a host that submits after the coordinator failed the op gets the failure at once (the cost model's "
          "algorithms, doubling)",
          "[cluster]") {
    const char *tuning = GENERATE("", "tuning: {algorithm: doubling}\n");
    INFO(tuning);
    TestCluster c(3, "20s", tuning);
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "late", 1);
    for (const size_t count : {size_t{100}, size_t{200000}}) {  // direct exchange, then the ring
        if (*tuning && count > 1000) continue;
        const auto a = cl[0]->submit(0, count, RINGD_F32, RINGD_SUM);
        const auto b = cl[1]->submit(0, count + 1, RINGD_F32, RINGD_SUM);
        for (auto [cli, t] : {std::pair{cl[0].get(), a}, {cl[1].get(), b}}) {
            CHECK(ringd_wait(cli->get(), t, 10000) == -EINVAL);
            CHECK_THAT(ringd_last_error(cli->get()), Catch::Contains("mismatch"));
        }
        // Host 2 gets there only now: the decision waits for it, well before the op timeout.
        const auto start = Clock::now();
        const auto d = cl[2]->submit(0, count, RINGD_F32, RINGD_SUM);
        CHECK(ringd_wait(cl[2]->get(), d, 10000) == -EINVAL);
        CHECK_THAT(ringd_last_error(cl[2]->get()), Catch::Contains("mismatch") && Catch::Contains("host node1"));
        CHECK(Clock::now() - start < 2s);
    }
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 1000, 3);  // the group goes on
}

TEST_CASE("one-/two-shot data of a host far ahead is bounded: the op that would go over fails on every host, "
          "named, at once",
          "[cluster]") {
    // 12 MiB ops go by direct exchange here (tuning.direct_max_bytes). node0's trainer submits 60
    // of them at once (its credits allow 64) while node1's submits none yet. Two bounds can stop
    // node0's data, whichever comes first: node0's queue to node1 (128 MiB; node1 reads slower
    // than node0 reduces), or what node1 keeps of ops it has not reached (256 MiB per group).
    TestCluster c(2, ClusterOptions{"6s", "", "tuning: {direct_max_bytes: 16MiB}\n", "32MiB"});
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "far", 1, 16 << 20);
    constexpr size_t kCount = size_t{3} << 20;  // 12 MiB of float
    constexpr int kOps = 60;
    std::vector<uint64_t> t;
    const auto start = Clock::now();
    for (int k = 0; k < kOps; ++k) t.push_back(cl[0]->submit(0, kCount, RINGD_F32, RINGD_SUM));
    // (Catch's || keeps references: the matchers it combines must outlive it.)
    const auto send_bound = Catch::Contains("over its bound of 128 MiB (host node1 is not taking one-/two-shot data");
    const auto keep_bound = Catch::Contains("host node1 holds more one-/two-shot data of ops it has not reached than "
                                            "its bound of 256 MiB per group (host node0 is that far ahead)");
    const auto bound = send_bound || keep_bound;
    // The ops over a bound fail at once, long before the op timeout (the last one, say); the
    // ones before the first of them wait for node1 (and time out); none succeeds.
    CHECK(ringd_wait(cl[0]->get(), t.back(), 20000) == -ENOBUFS);
    CHECK_THAT(std::string(ringd_last_error(cl[0]->get())),
               Catch::StartsWith("group far op " + std::to_string(kOps) + ": ") && bound);
    CHECK(Clock::now() - start < 4s);  // not the op timeout (6 s)
    int over = -1;
    for (int k = 0; k + 1 < kOps; ++k) {
        const int rc = ringd_wait(cl[0]->get(), t[k], 20000);
        const std::string msg = ringd_last_error(cl[0]->get());
        INFO("op " << k + 1 << ": " << rc << " " << msg);
        REQUIRE(rc != 0);
        if (rc == -ENOBUFS && over < 0) {
            over = k;
            CHECK_THAT(msg, Catch::StartsWith("group far op " + std::to_string(k + 1) + ": ") && bound);
        }
    }
    INFO("the first op over a bound: " << over + 1);
    REQUIRE(over > 0);
    // node1's trainer gets there: the ops fail there too, at once, the one over the bound with
    // the same message; the group goes on once both are past the ops node0 ran alone.
    for (int k = 0; k < kOps; ++k) {
        const auto s = Clock::now();
        const uint64_t u = cl[1]->submit(0, kCount, RINGD_F32, RINGD_SUM);
        const int rc = ringd_wait(cl[1]->get(), u, 20000);
        INFO("node1 op " << k + 1 << ": " << ringd_last_error(cl[1]->get()));
        CHECK(rc != 0);
        CHECK(Clock::now() - s < 2s);  // decided already
        if (k == over) {
            CHECK(rc == -ENOBUFS);
            CHECK_THAT(std::string(ringd_last_error(cl[1]->get())), bound);
        }
    }
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, kCount, 7);
}

TEST_CASE("a host whose op is too large for direct exchange while the others' is small: mismatch, named",
          "[cluster]") {
    TestCluster c(3);
    REQUIRE(c.wait_up());
    Clients cl;
    for (uint32_t h = 0; h < 3; ++h) cl.push_back(std::make_unique<Client>(c.d[h]->socket(), "x", 0, 1, 8 << 20));
    const auto a = cl[0]->submit(0, 64, RINGD_F32, RINGD_AVG);
    const auto b = cl[1]->submit(0, 1 << 20, RINGD_F32, RINGD_AVG);  // 4 MiB: over direct_max_bytes
    const auto d = cl[2]->submit(0, 64, RINGD_F32, RINGD_AVG);
    for (auto [cli, t] : {std::pair{cl[0].get(), a}, {cl[1].get(), b}, {cl[2].get(), d}}) {
        CHECK(ringd_wait(cli->get(), t, 10000) == -EINVAL);
        CHECK_THAT(ringd_last_error(cli->get()), Catch::Contains("mismatch") && Catch::Contains("host node1"));
    }
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 64, 1);  // the group goes on, both ways
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 1 << 20, 2);
}

TEST_CASE("a trainer that dies on one host fails the group's op on every host", "[cluster]") {
    TestCluster c(3);
    REQUIRE(c.wait_up());
    const std::string sock1 = c.d[1]->socket();
    int ready_pipe[2];
    REQUIRE(::pipe(ready_pipe) == 0);
    // The job runs one op on all three hosts (so the hosts have agreed on its incarnation: a
    // trainer that dies before that withdraws its host from the agreement, and the others' ops
    // time out instead); node1's trainer dies while the others wait in the second.
    Client a(c.d[0]->socket(), "t", 0, 1, 1 << 20), b(c.d[2]->socket(), "t", 0, 1, 1 << 20);
    const pid_t victim = spawn([&] {
        Client me(sock1, "t", 0, 1, 1 << 20);
        if (ringd_allreduce(me.get(), 0, 100, RINGD_F32, RINGD_SUM, 10000) != 0) return 1;
        (void)!::write(ready_pipe[1], "x", 1);
        ::pause();
        return 0;
    });
    Reaper reaper{victim};
    ::close(ready_pipe[1]);  // a victim that dies before it is ready closes the pipe: EOF, not a hang
    const auto a1 = a.submit(0, 100, RINGD_F32, RINGD_SUM), b1 = b.submit(0, 100, RINGD_F32, RINGD_SUM);
    REQUIRE(ringd_wait(a.get(), a1, 10000) == 0);
    REQUIRE(ringd_wait(b.get(), b1, 10000) == 0);
    pollfd p{ready_pipe[0], POLLIN, 0};
    REQUIRE(::poll(&p, 1, 10000) == 1);
    char x;
    REQUIRE(::read(ready_pipe[0], &x, 1) == 1);
    ::close(ready_pipe[0]);
    const auto ta = a.submit(0, 100, RINGD_F32, RINGD_SUM);
    const auto tb = b.submit(0, 100, RINGD_F32, RINGD_SUM);
    ::kill(victim, SIGKILL);
    join(victim);
    for (auto [cli, t] : {std::pair{&a, ta}, {&b, tb}}) {
        CHECK(ringd_wait(cli->get(), t, 10000) != 0);
        CHECK_THAT(ringd_last_error(cli->get()), Catch::Contains("host node1 local rank 0 left"));
    }
}

TEST_CASE("hosts may run different numbers of local ranks in one group", "[cluster]") {
    TestCluster c(3);
    REQUIRE(c.wait_up());
    Clients cl;  // host 0: 1 rank, host 1: 3 ranks, host 2: 2 ranks
    const uint32_t local[] = {1, 3, 2};
    for (uint32_t h = 0; h < 3; ++h)
        for (uint32_t r = 0; r < local[h]; ++r)
            cl.push_back(std::make_unique<Client>(c.d[h]->socket(), "mixed", static_cast<int>(r), static_cast<int>(local[h]), 1 << 20));
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 10007, 4);
    allreduce_checked(cl, DType::I32, ReduceOp::Sum, 3, 5);
    allreduce_checked(cl, DType::F16, ReduceOp::Max, 65536, 6);
}

TEST_CASE("a host with the wrong secret is refused and the reason shows in status", "[cluster]") {
    const std::string dir = make_temp_dir();
    std::ofstream(dir + "/good") << "0123456789abcdef0123456789abcdef\n";
    std::ofstream(dir + "/bad") << "fedcba9876543210fedcba9876543210\n";
    ::chmod((dir + "/good").c_str(), 0600);
    ::chmod((dir + "/bad").c_str(), 0600);
    const int base = 10000 + static_cast<int>((::getpid() * 11) % 20000);
    const std::string yaml = "hosts:\n  - {name: node0, address: 127.0.0.1, port: " + std::to_string(base) +
                             "}\n  - {name: node1, address: 127.0.0.1, port: " + std::to_string(base + 1) + "}\n";
    DaemonOptions a, b;
    a.hosts_yaml = b.hosts_yaml = yaml;
    b.host = "node1";
    a.extra_yaml = "auth: {secret_file: " + dir + "/good}\n";
    b.extra_yaml = "auth: {secret_file: " + dir + "/bad}\n";
    Daemon d0(a), d1(b);
    REQUIRE(d0.ready());
    REQUIRE(d1.ready());
    // node0 dials node1 and fails to prove itself; wait (bounded) for the reason to show.
    std::string err;
    const auto deadline = Clock::now() + 10s;
    while (err.find("authentication failed") == std::string::npos && Clock::now() < deadline) {
        auto s = fetch_status(d0.socket());
        REQUIRE(s.ok());
        err = json::parse(*s)["ring"]["members"][1]["last_error"].get<std::string>();
        d0.notify().next(100ms);
    }
    CHECK_THAT(err, Catch::Contains("authentication failed"));
    CHECK(json::parse(*fetch_status(d1.socket()))["ring"]["state"] == "forming");
    CHECK_THAT(d1.log(), Catch::Contains("authentication failed"));
}

TEST_CASE("several hosts without a secret: ringd refuses to start unless auth.insecure is set", "[cluster]") {
    CHECK_THAT(ringd_start_failure("auth: {}\n"),
               Catch::Contains("auth.secret_file: missing") && Catch::Contains("auth.insecure: true"));
    CHECK_THAT(ringd_start_failure("auth: {insecure: maybe}\n"), Catch::Contains("auth.insecure: 'maybe' is not true or false"));
    // The opt-out: the ring forms without authentication, ringd says so at start and in status.
    TestCluster c(2, "10s", "auth: {insecure: true}\n");
    REQUIRE(c.wait_up());
    CHECK(c.status(0)["ring"]["auth"] == "none (auth.insecure)");
    CHECK_THAT(c.d[1]->log(), Catch::Contains("auth.insecure: daemons of this ring do not authenticate each other"));
    auto cl = connect_all(c, "insecure", 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1001, 1);
}

TEST_CASE("3 hosts with the same secret form the ring and run exact ops", "[cluster]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    const std::string dir = make_temp_dir();
    std::ofstream(dir + "/secret") << "0123456789abcdef0123456789abcdef\n";
    REQUIRE(::chmod((dir + "/secret").c_str(), 0600) == 0);
    TestCluster c(3, "10s", transport + "auth: {secret_file: " + dir + "/secret}\n");
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "auth", 2, 2 << 20);
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 1001, 1);     // direct exchange
    allreduce_checked(cl, DType::I32, ReduceOp::Sum, 300001, 2);   // the ring
    for (uint32_t h = 0; h < 3; ++h) {
        INFO("host " << h);
        CHECK_FALSE(c.d[h]->log().find("do not authenticate") != std::string::npos);
        CHECK_FALSE(c.d[h]->log().find("authentication failed") != std::string::npos);
        CHECK(c.status(h)["ring"]["generation"] == 1);
        CHECK(c.status(h)["ring"]["auth"] == (transport.empty() ? "hmac-sha256; control frames MACed, data not (auth.data: none)"
                                                                : "hmac-sha256; control frames MACed (RDMA data: not)"));
    }
}

TEST_CASE("garbage and strangers on the peer port are refused; the ring is unaffected", "[cluster]") {
    TestCluster c(2);
    REQUIRE(c.wait_up());
    const int port = c.status(0)["ring"]["members"][0]["port"].get<int>();
    for (const char *src : {"127.0.0.1", "127.0.0.9"}) {
        UniqueFd s = connect_from(src, static_cast<uint16_t>(port));
        const std::string junk(4096, '\x7f');
        (void)!::send(s.get(), junk.data(), junk.size(), MSG_NOSIGNAL);
        CHECK(closed_by_peer(s.get(), 5s));
    }
    CHECK_THAT(c.d[0]->log(), Catch::Contains("not the address of any host") && Catch::Contains("magic"));
    auto cl = connect_all(c, "after", 1);
    allreduce_checked(cl, DType::F64, ReduceOp::Sum, 1000, 1);
    CHECK(c.status(0)["ring"]["generation"] == 1);
}

TEST_CASE("a ring of four lanes forms without the handshake cap closing any of its own connections", "[cluster]") {
    // 1 control + 2 streams x 4 lanes = 9 connections dialed at once from the peer's address.
    TestCluster c(2, "20s", "tuning: {lanes: 4}\n");
    REQUIRE(c.wait_up());
    for (uint32_t h = 0; h < 2; ++h) CHECK(c.status(h)["ring"]["handshakes_refused"].get<int>() == 0);
    CHECK(c.status(0)["ring"]["generation"] == 1);
    auto cl = connect_all(c, "lanes4", 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 100000, 1);
}

TEST_CASE("a flood of idle connections on the peer port is capped and cannot keep a peer out", "[cluster]") {
    TestCluster c(2);
    REQUIRE(c.wait_up());
    const int port = c.status(0)["ring"]["members"][0]["port"].get<int>();
    // 2 hosts, 2 streams, 2 lanes: at most 2 x (1 + 2 x 2) = 10 handshakes from the peer's address
    // at once (twice what the peer dials: its control connection and its lanes' data streams).
    std::vector<UniqueFd> flood;
    for (int i = 0; i < 40; ++i) flood.push_back(connect_from("127.0.0.1", static_cast<uint16_t>(port)));
    // Until ringd has taken all of them (closing the oldest as it went), bounded.
    for (const auto until = Clock::now() + 5s;
         c.status(0)["ring"]["handshakes_refused"].get<int>() < 30 && Clock::now() < until;)
        c.d[0]->notify().next(20ms);
    int closed = 0, open = 0;
    for (const auto &fd : flood) {
        char buf[4096];
        ssize_t k;
        while ((k = ::recv(fd.get(), buf, sizeof buf, MSG_DONTWAIT)) > 0) {
        }
        (k == 0 ? closed : open) += 1;
    }
    CHECK(open <= 10);
    CHECK(closed >= 30);
    CHECK(c.status(0)["ring"]["handshakes_refused"].get<int>() >= 30);
    CHECK_THAT(c.d[0]->log(), Catch::Contains("are still in their handshake; closed the oldest"));
    // While the flood's last connections still idle in their handshake (5 s), the peer restarts:
    // its connections push them out, and the ring re-forms at once.
    const auto restart = Clock::now();
    REQUIRE(c.d[1]->stop() != -1);
    c.d[1]->start();
    REQUIRE(c.d[1]->ready());
    CHECK(c.wait_ring(0, 2, 3s));
    CHECK(Clock::now() - restart < 3s);
    // Established connections are not handshakes: the ring goes on.
    auto cl = connect_all(c, "flooded", 1, 2 << 20);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, 1);       // direct exchange
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1 << 18, 2);    // the ring
}

TEST_CASE("ringd_connect_opts: the group's hosts, checked on join; every host's trainers declaring them all run exact",
          "[cluster]") {
    TestCluster c(2);
    REQUIRE(c.wait_up());
    auto join = [&](uint32_t host, const char *group, int rank, int size, const char *hosts, std::string &err) {
        return join_opts(c, host, group, rank, size, hosts, err, 1 << 20);
    };
    std::string err;
    const std::pair<const char *, const char *> refused[] = {
        {"node1", "group g's hosts are node1: host node0 is not one of them"},
        {"node0,nodeX", "'nodeX', which is not a host of this ring (node0,node1)"},
        {"node0,node0", "names 'node0' twice"},
        {"node0,,node1", "has an empty name"},
        {"node0;node1", "may contain only host names"},
    };
    for (const auto &[hosts, why] : refused) {
        INFO("hosts " << hosts);
        CHECK_FALSE(join(0, "g", 0, 1, hosts, err));
        CHECK_THAT(err, Catch::Contains(why));
    }
    // A struct from a caller that knows less than the first version.
    ringd_options old{};
    old.struct_size = offsetof(ringd_options, hosts);
    char e[256] = "";
    CHECK(ringd_connect_opts(&old, e, sizeof e) == nullptr);
    CHECK_THAT(e, Catch::Contains("struct_size") && Catch::Contains("sizeof(ringd_options)"));
    // Any order, spaces ignored; local ranks that disagree are refused, naming both lists.
    auto a0 = join(0, "both", 0, 2, "node1, node0", err);
    REQUIRE(a0);
    CHECK_FALSE(join(0, "both", 1, 2, "node0", err));
    CHECK_THAT(err, Catch::Contains("group both's trainers on host node0 declare different hosts: node0,node1 (the first "
                                    "one), this one node0"));
    CHECK(c.group(0, "both")["hosts"] == json::array({"node0", "node1"}));
    a0.reset();
    // Declared on every trainer, NULL socket_path from RINGD_SOCKET: exact ops on both paths.
    auto cl = connect_all(c, "declared", 2, 2 << 20, "node0,node1");
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 1001, 1);
    allreduce_checked(cl, DType::I64, ReduceOp::Sum, 100001, 2);
    ::setenv("RINGD_SOCKET", c.d[1]->socket().c_str(), 1);
    ringd_options env{};
    env.struct_size = sizeof env;
    env.group = "viaenv";
    env.local_size = 1;
    env.slot_bytes = 4096;
    ringd_client *via = ringd_connect_opts(&env, e, sizeof e);
    ::unsetenv("RINGD_SOCKET");
    CHECK(via != nullptr);
    CHECK_FALSE(c.group(1, "viaenv").is_null());
    ringd_close(via);
}

TEST_CASE("an address that cannot be bound stops ringd at start with a clear error", "[cluster]") {
    const std::string dir = make_temp_dir();
    std::ofstream(dir + "/c.yaml") << "cluster: c\nhosts:\n  - {name: a, address: 192.0.2.1, port: 7400}\n"
                                      "  - {name: b, address: 127.0.0.1, port: 7401}\nsocket: " << dir << "/s.sock\n"
                                   << secret_yaml();
    const auto r = run_command(env_or("RINGD_BIN", "build/daemon/ringd") + " --config " + dir + "/c.yaml --host a 2>&1");
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains("cannot listen on 192.0.2.1:7400") && Catch::Contains("configured on this machine"));
}

TEST_CASE("solo lane: a group's ring ops start on every host without the coordinator, which handles none of them; "
          "a second group runs beside it on the shared lane, each exact",
          "[cluster][solo]") {
    TestCluster c(3, "10s", "tuning: {direct_max_bytes: 64KiB}\n");
    REQUIRE(c.wait_up());
    auto a = connect_all(c, "a", 2, 4 << 20);
    allreduce_checked(a, DType::F32, ReduceOp::Avg, 200000, 1);  // agreed first: the solo lane
    auto b = connect_all(c, "b", 1, 4 << 20);
    allreduce_checked(b, DType::F32, ReduceOp::Sum, 200000, 2);  // the shared lane
    const auto reports = [&] { return c.status(0)["ring"]["coordinator_reports"].get<uint64_t>(); };
    const uint64_t before = reports();
    const DType types[] = {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64, DType::F16};
    const ReduceOp ops[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};
    uint64_t seed = 10;
    for (int k = 0; k < 24; ++k, ++seed) {
        INFO("op " << k);
        const DType t = types[k % 6];
        const bool integer = t == DType::I32 || t == DType::I64;
        const ReduceOp op = integer && ops[(k / 6) % 4] == ReduceOp::Avg ? ReduceOp::Sum : ops[(k / 6) % 4];
        auto x = submit_checked(a, t, op, 100000 + 4099 * k, seed);
        if (k % 4 == 0) {  // b's op beside it, on its own lane
            auto y = submit_checked(b, DType::F32, ReduceOp::Sum, 150001, seed + 1000);
            wait_checked(b, y);
        }
        wait_checked(a, x);
    }
    // Only b's ring ops were reported: one report per host and op.
    CHECK(reports() - before == 3 * 6);
    for (uint32_t h = 0; h < 3; ++h) {
        const auto j = c.status(h);
        CHECK(j["ring"]["ops_ring_solo"] == 25);
        CHECK(j["ring"]["ops_ring"] == 25 + 7);
        CHECK(j["ops"]["failed"] == 0);
    }
}

TEST_CASE("rails: each host's NICs carry the ring's data in proportion to their weights, every value exact", "[cluster][rails]") {
    if (!NetnsHosts::available()) RINGD_SKIP("network namespaces are needed for hosts with two NICs");
    NetnsHosts hosts(3, 2);
    const bool weighted = GENERATE(false, true);
    INFO((weighted ? "rails of 300 and 100 Mbit/s, weights 3:1" : "rails of 200 Mbit/s each"));
    for (uint32_t h = 0; h < 3; ++h) {  // the rails are what limits the ring, as a cluster's NICs do
        hosts.limit(h, 0, weighted ? "300mbit" : "200mbit");
        hosts.limit(h, 1, weighted ? "100mbit" : "200mbit");
    }
    ClusterOptions o;
    o.netns = &hosts;
    o.op_timeout = "20s";
    o.host_yaml = weighted ? ", weights: [3, 1]" : "";
    TestCluster c(3, o);
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "railed", 2, 64 << 20);
    std::vector<std::array<uint64_t, 2>> before(3);
    for (uint32_t h = 0; h < 3; ++h) before[h] = {hosts.tx_bytes(h, 0), hosts.tx_bytes(h, 1)};
    uint64_t seed = 1;
    for (int k = 0; k < 2; ++k) allreduce_checked(cl, DType::F32, ReduceOp::Sum, 4'000'003, seed++);  // the ring
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 1001, seed++);                                  // direct exchange
    allreduce_checked(cl, DType::BF16, ReduceOp::Max, 1'000'001, seed++);
    for (uint32_t h = 0; h < 3; ++h) {
        const double r0 = static_cast<double>(hosts.tx_bytes(h, 0) - before[h][0]);
        const double r1 = static_cast<double>(hosts.tx_bytes(h, 1) - before[h][1]);
        INFO("host " << h << ": rail 0 sent " << r0 << " bytes, rail 1 " << r1);
        CHECK(r0 + r1 > 2 * 2 * 2.0 / 3 * 16e6);  // the ring's bytes went out
        if (weighted) {
            CHECK(r0 / r1 > 2.4);
            CHECK(r0 / r1 < 3.6);
        } else {
            CHECK(r0 / (r0 + r1) > 0.42);
            CHECK(r0 / (r0 + r1) < 0.58);
        }
        // ringd's own count per rail (status, metrics): the ring's data, within the NICs' totals.
        const json rails = c.status(h)["ring"]["rails"];
        REQUIRE(rails.size() == 2);
        const double s0 = rails[0]["bytes_out"].get<double>(), s1 = rails[1]["bytes_out"].get<double>();
        CHECK(rails[1]["address"] == hosts.address(h, 1));
        CHECK(s0 + s1 > 2 * 2 * 2.0 / 3 * 16e6);
        CHECK(s0 <= r0);
        CHECK(s1 <= r1);
        CHECK(s0 / (s0 + s1) == Approx(r0 / (r0 + r1)).margin(0.05));
    }
    CHECK(c.status(0)["ops"]["failed"] == 0);
}

TEST_CASE("rails: a NIC that goes down mid-job costs no op: its messages go on the other rail, the ring keeps its "
          "generation, and the rail carries data again once it is back",
          "[cluster][rails]") {
    if (!NetnsHosts::available()) RINGD_SKIP("network namespaces are needed for hosts with two NICs");
    // Rail 0 carries the hosts' control connections too: they move to rail 1.
    const uint32_t nic = GENERATE(1u, 0u);
    INFO("host 1's NIC of rail " << nic << " goes down");
    NetnsHosts hosts(3, 2);
    for (uint32_t h = 0; h < 3; ++h)
        for (uint32_t r = 0; r < 2; ++r) hosts.limit(h, r, "200mbit");
    ClusterOptions o;
    o.netns = &hosts;
    o.op_timeout = "20s";
    TestCluster c(3, o);
    REQUIRE(c.wait_up());
    const uint64_t generation = c.status(0)["ring"]["generation"].get<uint64_t>();
    auto rail = [&](uint32_t h) { return c.status(h)["ring"]["rails"][nic]; };
    auto wait_for = [](auto done, std::chrono::seconds limit) {
        const auto until = std::chrono::steady_clock::now() + limit;
        while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(50ms);
        return done();
    };
    LoopingJob job(connect_all(c, "failover", 2, 8 << 20));
    REQUIRE(wait_for([&] { return job.ops() >= 4; }, 20s));

    // Host 1's second NIC goes: its links to host 0 and host 2 lose that rail, both ways.
    hosts.set_link(1, nic, false);
    CHECK(wait_for([&] { return rail(1)["to_next"] == "down" && rail(1)["from_prev"] == "down"; }, 10s));
    CHECK(wait_for([&] { return rail(0)["to_next"] == "down" && rail(2)["from_prev"] == "down"; }, 10s));
    const uint64_t at_down = job.ops();
    CHECK(wait_for([&] { return job.ops() >= at_down + 6; }, 20s));  // the job goes on, on rail 0
    const json down = c.status(1);
    CHECK(down["ring"]["generation"] == generation);
    CHECK(down["ring"]["state"] == "up");

    // Back: the control plane dials the rail anew and the links take it.
    hosts.set_link(1, nic, true);
    CHECK(wait_for(
        [&] {
            for (uint32_t h = 0; h < 3; ++h)
                if (rail(h)["to_next"] != "up" || rail(h)["from_prev"] != "up") return false;
            return true;
        },
        10s));
    std::array<uint64_t, 3> before{};
    for (uint32_t h = 0; h < 3; ++h) before[h] = rail(h)["bytes_out"].get<uint64_t>();
    const uint64_t at_up = job.ops();
    CHECK(wait_for([&] { return job.ops() >= at_up + 6; }, 20s));
    const auto counts = job.stop();
    INFO("last error: " << counts.last_error);
    CHECK(counts.ops > at_up);
    CHECK(counts.failed == 0);
    CHECK(counts.wrong == 0);
    CHECK(counts.guard == 0);
    for (uint32_t h = 0; h < 3; ++h) {
        INFO("host " << h);
        const json j = c.status(h);
        CHECK(j["ring"]["generation"] == generation);  // no op failed, no new generation
        CHECK(j["ops"]["failed"] == 0);
        CHECK(j["ring"]["rails"][nic]["bytes_out"].get<uint64_t>() > before[h]);  // the rail carries data again
    }
}

TEST_CASE("rails: a rail address the host does not have, or lists of different lengths, stop ringd at start", "[cluster][rails]") {
    const std::string dir = make_temp_dir();
    auto start = [&](const std::string &hosts) {
        std::ofstream(dir + "/c.yaml") << "cluster: c\nhosts:\n" << hosts << "socket: " << dir << "/s.sock\nauth: {insecure: true}\n";
        return run_command("timeout 10 " + env_or("RINGD_BIN", "build/daemon/ringd") + " --config " + dir + "/c.yaml --host a 2>&1");
    };
    auto r = start("  - {name: a, address: [127.0.0.1, 192.0.2.9], port: 7400}\n  - {name: b, address: [127.0.0.2, 192.0.2.10], port: 7400}\n");
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains("hosts[0].address[1]: 192.0.2.9 is not an address of this machine"));
    r = start("  - {name: a, address: [127.0.0.1, 127.0.0.3], port: 7400}\n  - {name: b, address: 127.0.0.2, port: 7400}\n");
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains("every host lists as many addresses (rails): a has 2, b 1"));
    r = start("  - {name: a, address: [127.0.0.1, 127.0.0.3], port: 7400, weights: [1]}\n");
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains("hosts[0].weights: one weight per address (2)"));
}
