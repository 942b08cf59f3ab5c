// Rings of real ringd processes on 127.0.0.1 (one port each) with real trainers: results across
// 3 and 4 hosts x 1-2 local ranks, every value checked; a host killed, a host stopped, the ring
// coming back as a new generation for the survivors' trainers; mismatches between hosts; a
// trainer that dies on one host.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench/bench_data.h"
#include "common/status_client.h"
#include "ringd/ringd.hpp"
#include "tests/support/harness.h"
#include "tests/support/net.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

struct TestCluster {
    uint32_t n;
    std::vector<std::unique_ptr<Daemon>> d;

    TestCluster(uint32_t hosts, const std::string &op_timeout = "5s", const std::string &extra_yaml = "") : n(hosts) {
        const int base = 10000 + static_cast<int>((::getpid() * 17) % 20000);  // below the ephemeral range
        std::string yaml = "hosts:\n";
        for (uint32_t i = 0; i < n; ++i)
            yaml += "  - {name: node" + std::to_string(i) + ", address: 127.0.0.1, port: " + std::to_string(base + static_cast<int>(i)) + "}\n";
        for (uint32_t i = 0; i < n; ++i) {
            DaemonOptions o;
            o.host = "node" + std::to_string(i);
            o.hosts_yaml = yaml;
            o.op_timeout = op_timeout;
            o.extra_yaml = "tcp: {streams: 2}\n" + extra_yaml;
            d.push_back(std::make_unique<Daemon>(o));
            REQUIRE(d.back()->ready());
        }
    }
    json status(uint32_t i) {
        auto s = fetch_status(d[i]->socket());
        return s ? json::parse(*s) : json{};
    }
    // Waits until daemon i took an op of `group` (all its local ranks submitted it): running, or
    // already ended.
    bool wait_taken(uint32_t i, const std::string &group, std::chrono::milliseconds limit = 10s) {
        const auto deadline = Clock::now() + limit;
        int polls = 0, empty = 0;
        while (Clock::now() < deadline) {
            ++polls;
            const json st = status(i);
            if (st.empty()) ++empty;
            for (const auto &g : st["groups"])
                if (g["name"] == group &&
                    g["running_ops"].get<int>() + g["ops_failed"].get<int>() + g["ops_completed"].get<int>() > 0)
                    return true;
            std::this_thread::sleep_for(5ms);
        }
        UNSCOPED_INFO("host " << i << " polls " << polls << " empty " << empty << " status: " << status(i).dump());
        return false;
    }
    // Waits until daemon i reports (sd_notify STATUS, on the NOTIFY_SOCKET the harness owns) that
    // its ring is up as generation min_generation or later.
    bool wait_ring(uint32_t i, uint64_t min_generation, std::chrono::milliseconds limit = 15s) {
        const auto deadline = Clock::now() + limit;
        const std::string key = "STATUS=ring generation ";
        while (Clock::now() < deadline) {
            const std::string m = d[i]->notify().next(std::chrono::milliseconds(ms_until(deadline)));
            const auto at = m.find(key);
            if (at == std::string::npos || m.find(" up (", at) == std::string::npos) continue;
            if (std::stoull(m.substr(at + key.size())) >= min_generation) return true;
        }
        return false;
    }
    // Every daemon's ring is up, as generation min_generation[i] (default 1) or later.
    bool wait_up(std::vector<uint64_t> min_generation = {}) {
        min_generation.resize(n, 1);
        for (uint32_t i = 0; i < n; ++i)
            if (!wait_ring(i, min_generation[i])) return false;
        return true;
    }
};

using Clients = std::vector<std::unique_ptr<Client>>;  // index = host * L + local rank

Clients connect_all(TestCluster &c, const std::string &group, uint32_t local) {
    Clients v;
    for (uint32_t h = 0; h < c.n; ++h)
        for (uint32_t r = 0; r < local; ++r)
            v.push_back(std::make_unique<Client>(c.d[h]->socket(), group, static_cast<int>(r), static_cast<int>(local), 1 << 20));
    return v;
}

// One allreduce on every client (submitted on all, then waited on all); checks every value.
void allreduce_checked(Clients &cl, DType t, ReduceOp op, size_t count, uint64_t offset_seed) {
    const size_t n = cl.size();
    std::vector<size_t> off(n);
    for (size_t g = 0; g < n; ++g) {
        off[g] = ((offset_seed + g * 7) % 64) * 8;
        bench::fill(cl[g]->slot().data() + off[g], count, t, g);
    }
    std::vector<uint64_t> tickets(n);
    for (size_t g = 0; g < n; ++g)
        tickets[g] = cl[g]->submit(off[g], count, static_cast<ringd_dtype>(t), static_cast<ringd_op>(op));
    for (size_t g = 0; g < n; ++g) cl[g]->wait(tickets[g], 20000);
    for (size_t g = 0; g < n; ++g) {
        INFO("rank " << g << " of " << n << " " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count);
        CHECK(bench::count_wrong(cl[g]->slot().data() + off[g], count, t, op, n) == 0);
    }
}

}  // namespace

TEST_CASE("3 and 4 hosts x 1-2 local ranks, every algorithm: random dtypes, ops and sizes, every value exact",
          "[cluster]") {
    std::mt19937_64 rng(2024);
    struct Setup {
        uint32_t hosts;
        const char *tuning;
        const char *expect;  // the algorithms that must have run
    };
    const Setup setups[] = {
        {3, "tuning: {direct_max_bytes: 0}\n", "ring"},                        // every op on the ring
        {4, "tuning: {direct_max_bytes: 64KiB}\n", "ring one-shot"},           // interleaved in one group
        {4, "tuning: {direct_max_bytes: 16MiB, hop_latency_us: 1, link_mbit: 1}\n", "two-shot"},  // all two-shot
    };
    for (const Setup &setup : setups) {
        const uint32_t hosts = setup.hosts;
        INFO(setup.tuning);
        TestCluster c(hosts, "5s", setup.tuning);
        REQUIRE(c.wait_up());
        for (uint32_t local : {1u, 2u}) {
            auto cl = connect_all(c, "g" + std::to_string(local), local);
            for (int k = 0; k < 8; ++k) {
                const auto t = static_cast<DType>(rng() % kDTypeCount);
                auto op = static_cast<ReduceOp>(rng() % kReduceOpCount);
                if (op == ReduceOp::Avg && dtype_is_integer(t)) op = ReduceOp::Min;
                const size_t sizes[] = {1, hosts - 1, 13, 997, 65537, (size_t{200} << 10) / dtype_size(t)};
                allreduce_checked(cl, t, op, sizes[rng() % 6], rng());
            }
        }
        const auto j = c.status(0);
        CHECK(j["ring"]["generation"] == 1);
        CHECK(j["ops"]["failed"] == 0);
        const std::string expect = setup.expect;
        CHECK((j["ring"]["ops_ring"].get<int>() > 0) == (expect.find("ring") != std::string::npos));
        CHECK((j["ring"]["ops_one_shot"].get<int>() > 0) == (expect.find("one-shot") != std::string::npos));
        CHECK((j["ring"]["ops_two_shot"].get<int>() > 0) == (expect.find("two-shot") != std::string::npos));
        CHECK(j["memory"]["registrations"].get<int>() <= 4);  // 3 slots + the ring's staging, never per op
    }
}

namespace {
const char *const kIbverbsYaml = "transport: ibverbs\nibverbs: {provider: emulated}\n";

bool machine_has_rdma_devices() {
    std::error_code ec;
    return std::filesystem::exists("/sys/class/infiniband", ec) && !std::filesystem::is_empty("/sys/class/infiniband", ec);
}
}  // namespace

TEST_CASE("over ibverbs on the software RDMA device: 3 and 4 hosts x 1-2 ranks, every dtype x op, every value exact",
          "[cluster][ibverbs]") {
    for (uint32_t hosts : {3u, 4u}) {
        // 3 hosts: every op on the RDMA ring; 4: small ops by direct exchange in between.
        TestCluster c(hosts, "10s", std::string(kIbverbsYaml) + (hosts == 3 ? "tuning: {direct_max_bytes: 0}\n" : ""));
        REQUIRE(c.wait_up());
        uint64_t seed = 1;
        for (uint32_t local : {1u, 2u}) {
            auto cl = connect_all(c, "v" + std::to_string(local), local);
            for (uint32_t t = 0; t < kDTypeCount; ++t)
                for (uint32_t o = 0; o < kReduceOpCount; ++o) {
                    const auto dt = static_cast<DType>(t);
                    const auto op = static_cast<ReduceOp>(o);
                    if (op == ReduceOp::Avg && dtype_is_integer(dt)) continue;
                    const size_t sizes[] = {hosts - 1, 997, 65537, (size_t{300} << 10) / dtype_size(dt)};
                    allreduce_checked(cl, dt, op, sizes[seed % 4], seed);
                    ++seed;
                }
        }
        const auto j = c.status(0);
        CHECK(j["transport"] == "ibverbs");
        CHECK_THAT(j["transport_detail"].get<std::string>(), Catch::Contains("ringd_emu0") && Catch::Contains("RoCE v2"));
        CHECK(j["ops"]["failed"] == 0);
        CHECK(j["ring"]["ops_ring"].get<int>() > 0);
        CHECK(j["memory"]["registrations"].get<int>() <= 4);  // 3 slots + the ring's staging, never per op
    }
}

namespace {

// Starts ringd for host a of a two-host config with `extra` keys; it must stop at once (< 5 s)
// with an error. Returns what it printed.
std::string ringd_start_failure(const std::string &extra) {
    const std::string dir = make_temp_dir();
    std::ofstream(dir + "/c.yaml") << "cluster: c\nhosts:\n  - {name: a, address: 127.0.0.1, port: 7400}\n"
                                      "  - {name: b, address: 127.0.0.1, port: 7401}\n"
                                   << extra << "socket: " << dir << "/s.sock\n";
    const auto start = Clock::now();
    const auto r = run_command(env_or("RINGD_BIN", "build/daemon/ringd") + " --config " + dir + "/c.yaml --host a 2>&1");
    CHECK(r.exit_code != 0);
    CHECK(Clock::now() - start < 5s);
    return r.output;
}

}  // namespace

TEST_CASE("transport: ibverbs without an RDMA device stops ringd at start with what to do", "[cluster][ibverbs]") {
    if (machine_has_rdma_devices()) {
        WARN("this machine has RDMA devices: nothing to check");
        return;
    }
    CHECK_THAT(ringd_start_failure("transport: ibverbs\n"),
               Catch::Contains("no RDMA device found") && Catch::Contains("ibv_devices") && Catch::Contains("transport: tcp"));
}

TEST_CASE("a TCP congestion control the kernel lacks stops ringd at start naming the key and the fix", "[cluster]") {
    CHECK_THAT(ringd_start_failure("tcp: {congestion: nosuchcc}\n"),
               Catch::Contains("tcp.congestion: TCP congestion control 'nosuchcc' is not in this kernel") &&
                   Catch::Contains("tcp.congestion: system"));
}

TEST_CASE("a host killed mid-op fails every other trainer naming it; the ring re-forms for the survivors", "[cluster]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    TestCluster c(3, "5s", transport);
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "k", 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 1000, 1);
    // Ranks 0 and 1 submit; node2 is killed before its rank does.
    const auto t0 = cl[0]->submit(0, 50000, RINGD_F32, RINGD_SUM);
    const auto t1 = cl[1]->submit(0, 50000, RINGD_F32, RINGD_SUM);
    const auto start = Clock::now();
    ::kill(c.d[2]->pid(), SIGKILL);
    for (auto [cli, t] : {std::pair{cl[0].get(), t0}, {cl[1].get(), t1}}) {
        CHECK(ringd_wait(cli->get(), t, 10000) != 0);
        CHECK_THAT(ringd_last_error(cli->get()), Catch::Contains("node2"));
    }
    CHECK(Clock::now() - start < 7s);  // timeouts.op + 2 s
    // Restart node2: the same survivors' trainers go on with a new trainer there.
    c.d[2]->start();
    REQUIRE(c.d[2]->ready());
    REQUIRE(c.wait_up({2, 2, 1}));  // the restarted daemon counts its own generations
    CHECK(c.status(0)["ring"]["generation"] == 2);
    cl[2] = std::make_unique<Client>(c.d[2]->socket(), "k", 0, 1, 1 << 20);
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 77777, 5);
}

TEST_CASE("a hung host is detected by heartbeats and named; the ring re-forms when it continues", "[cluster]") {
    TestCluster c(3);
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "h", 1);
    allreduce_checked(cl, DType::F64, ReduceOp::Max, 333, 2);
    ::kill(c.d[1]->pid(), SIGSTOP);
    const auto start = Clock::now();
    const auto t0 = cl[0]->submit(0, 1000, RINGD_F32, RINGD_SUM);
    const auto t2 = cl[2]->submit(0, 1000, RINGD_F32, RINGD_SUM);
    CHECK(ringd_wait(cl[0]->get(), t0, 10000) != 0);
    CHECK_THAT(ringd_last_error(cl[0]->get()), Catch::Contains("node1"));
    CHECK(ringd_wait(cl[2]->get(), t2, 10000) != 0);
    CHECK_THAT(ringd_last_error(cl[2]->get()), Catch::Contains("node1"));
    CHECK(Clock::now() - start < 7s);
    ::kill(c.d[1]->pid(), SIGCONT);
    REQUIRE(c.wait_up({2, 2, 2}));
    // Every rank goes on; ops are matched by their place in the new generation.
    allreduce_checked(cl, DType::BF16, ReduceOp::Sum, 4099, 3);
}

TEST_CASE("a count mismatch between hosts fails every rank naming both hosts", "[cluster]") {
    TestCluster c(3);
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "m", 1);
    const auto a = cl[0]->submit(0, 100, RINGD_F32, RINGD_SUM);
    const auto b = cl[1]->submit(0, 101, RINGD_F32, RINGD_SUM);
    const auto d = cl[2]->submit(0, 100, RINGD_F32, RINGD_SUM);
    for (auto [cli, t] : {std::pair{cl[0].get(), a}, {cl[1].get(), b}, {cl[2].get(), d}}) {
        CHECK(ringd_wait(cli->get(), t, 10000) == -EINVAL);
        CHECK_THAT(ringd_last_error(cli->get()), Catch::Contains("mismatch") && Catch::Contains("host node0") &&
                                                     Catch::Contains("host node1"));
    }
    allreduce_checked(cl, DType::I64, ReduceOp::Sum, 5000, 9);  // the group goes on
}

TEST_CASE("a host that submits after the coordinator failed the op gets the failure at once", "[cluster]") {
    TestCluster c(3, "20s");
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "late", 1);
    for (const size_t count : {size_t{100}, size_t{200000}}) {  // direct exchange, then the ring
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
    const pid_t victim = spawn([&] {
        Client me(sock1, "t", 0, 1, 1 << 20);
        (void)!::write(ready_pipe[1], "x", 1);
        ::pause();
        return 0;
    });
    char x;
    REQUIRE(::read(ready_pipe[0], &x, 1) == 1);
    Client a(c.d[0]->socket(), "t", 0, 1, 1 << 20), b(c.d[2]->socket(), "t", 0, 1, 1 << 20);
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

TEST_CASE("an address that cannot be bound stops ringd at start with a clear error", "[cluster]") {
    const std::string dir = make_temp_dir();
    std::ofstream(dir + "/c.yaml") << "cluster: c\nhosts:\n  - {name: a, address: 192.0.2.1, port: 7400}\n"
                                      "  - {name: b, address: 127.0.0.1, port: 7401}\nsocket: " << dir << "/s.sock\n";
    const auto r = run_command(env_or("RINGD_BIN", "build/daemon/ringd") + " --config " + dir + "/c.yaml --host a 2>&1");
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains("cannot listen on 192.0.2.1:7400") && Catch::Contains("configured on this machine"));
}

TEST_CASE("SIGTERM on one host ends its ring op at once; the others are told it is gone", "[cluster]") {
    TestCluster c(3, "20s");
    REQUIRE(c.wait_up());
    auto cl = connect_all(c, "term", 1);
    // Hosts 0 and 2 start a big op; host 1's trainer never submits, so the op waits in the ring.
    const auto t0 = cl[0]->submit(0, 200000, RINGD_F32, RINGD_SUM);
    const auto t2 = cl[2]->submit(0, 200000, RINGD_F32, RINGD_SUM);
    REQUIRE(c.wait_taken(0, "term"));  // the op is under way on hosts 0 and 2 before host 1 stops
    REQUIRE(c.wait_taken(2, "term"));
    const auto start = Clock::now();
    const int st = c.d[1]->stop(10s);
    REQUIRE(st != -1);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
    CHECK(Clock::now() - start < 3s);
    for (auto [cli, t] : {std::pair{cl[0].get(), t0}, {cl[2].get(), t2}}) {
        CHECK(ringd_wait(cli->get(), t, 10000) != 0);
        CHECK_THAT(ringd_last_error(cli->get()), Catch::Contains("node1"));
    }
}
