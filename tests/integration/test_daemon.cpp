// A real ringd and real trainers (libringd-client): allreduce results, error paths, shutdown.
#include <catch2/catch.hpp>

#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

#include "bench/bench_data.h"
#include "common/status_client.h"
#include "ringd/ringd.hpp"
#include "tests/support/harness.h"

using namespace ringd;
using namespace ringd::test;
using nlohmann::json;

namespace {

json status(const Daemon &d) {
    auto s = fetch_status(d.socket());
    REQUIRE(s.ok());
    return json::parse(*s);
}

std::vector<std::unique_ptr<Client>> connect_group(const Daemon &d, const std::string &group, int n,
                                                   size_t slot_bytes = 1 << 20) {
    std::vector<std::unique_ptr<Client>> v;
    for (int r = 0; r < n; ++r) v.push_back(std::make_unique<Client>(d.socket(), group, r, n, slot_bytes));
    return v;
}

struct OpSpec {
    DType dtype;
    ReduceOp op;
    size_t count;
};

OpSpec random_op(std::mt19937_64 &rng, size_t max_bytes) {
    const auto t = static_cast<DType>(rng() % kDTypeCount);
    auto op = static_cast<ReduceOp>(rng() % kReduceOpCount);
    if (op == ReduceOp::Avg && dtype_is_integer(t)) op = ReduceOp::Sum;
    const size_t max_count = max_bytes / dtype_size(t);
    size_t count;
    switch (rng() % 4) {
    case 0: count = rng() % 8; break;  // 0..7, including empty ops
    case 1: count = rng() % 2048 + 1; break;
    default: count = rng() % max_count + 1; break;
    }
    return {t, op, count};
}

// Runs `ops` random allreduces on n clients of one group, submitting all ranks before waiting,
// with each rank's data at a different offset; checks every element on every rank.
void run_random_ops(std::vector<std::unique_ptr<Client>> &clients, int ops, uint64_t seed) {
    const size_t n = clients.size();
    std::mt19937_64 rng(seed);
    for (int k = 0; k < ops; ++k) {
        const OpSpec s = random_op(rng, 256 << 10);
        std::vector<size_t> offsets(n);
        for (size_t r = 0; r < n; ++r) {
            offsets[r] = (rng() % 1024) * 8;  // aligned for every dtype
            bench::fill(clients[r]->slot().data() + offsets[r], s.count, s.dtype, r);
        }
        std::vector<uint64_t> tickets(n);
        for (size_t r = 0; r < n; ++r)
            tickets[r] = clients[r]->submit(offsets[r], s.count, static_cast<ringd_dtype>(s.dtype), static_cast<ringd_op>(s.op));
        for (size_t r = 0; r < n; ++r) clients[r]->wait(tickets[r], 10000);
        for (size_t r = 0; r < n; ++r) {
            INFO("op " << k << " rank " << r << " " << dtype_name(s.dtype) << " " << reduce_op_name(s.op) << " count "
                       << s.count);
            CHECK(bench::count_wrong(clients[r]->slot().data() + offsets[r], s.count, s.dtype, s.op, n) == 0);
        }
    }
}

}  // namespace

TEST_CASE("1 to 4 local ranks allreduce random sizes, dtypes and ops exactly", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    for (int n = 1; n <= 4; ++n) {
        auto clients = connect_group(d, "g" + std::to_string(n), n);
        run_random_ops(clients, 40, 1000 + static_cast<uint64_t>(n));
    }
    const json j = status(d);
    CHECK(j["ops"]["failed"] == 0);
    CHECK(j["ops"]["completed"] == 160);
}

TEST_CASE("several ops in flight per trainer complete in order", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    auto clients = connect_group(d, "pipe", 3);
    const size_t count = 4096;
    std::vector<std::vector<uint64_t>> tickets(3);
    for (int k = 0; k < 16; ++k)
        for (size_t r = 0; r < 3; ++r) {
            bench::fill(clients[r]->slot().data() + k * count * 4, count, DType::I32, r);
            tickets[r].push_back(clients[r]->submit(k * count * 4, count, RINGD_I32, RINGD_SUM));
        }
    for (size_t r = 0; r < 3; ++r)
        for (int k = 15; k >= 0; --k) clients[r]->wait(tickets[r][k], 10000);  // any order of waiting
    for (size_t r = 0; r < 3; ++r)
        for (int k = 0; k < 16; ++k)
            CHECK(bench::count_wrong(clients[r]->slot().data() + k * count * 4, count, DType::I32, ReduceOp::Sum, 3) == 0);
}

TEST_CASE("memory is registered once per slot, never per op", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    auto clients = connect_group(d, "reg", 4);
    const json before = status(d);
    CHECK(before["memory"]["registrations"] == 4);
    CHECK(before["memory"]["live_regions"] == 4);
    run_random_ops(clients, 100, 7);
    const json after = status(d);
    CHECK(after["memory"]["registrations"] == 4);
    CHECK(after["ops"]["completed"] == 100);
    clients.clear();
    // Regions go away with their clients, once the daemon has seen the disconnects (each status
    // query is a round trip through its event loop).
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (status(d)["memory"]["live_regions"] != 0 && Clock::now() < deadline) {
    }
    CHECK(status(d)["memory"]["live_regions"] == 0);
    CHECK(status(d)["memory"]["registered_bytes"] == 0);
}

TEST_CASE("a count, dtype or op mismatch fails every rank with a message, not a hang", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    auto c = connect_group(d, "mm", 2);
    const auto t0 = c[0]->submit(0, 100, RINGD_F32, RINGD_SUM);
    const auto t1 = c[1]->submit(0, 101, RINGD_F32, RINGD_SUM);
    const auto start = Clock::now();
    CHECK(ringd_wait(c[0]->get(), t0, 3000) == -EINVAL);
    CHECK_THAT(ringd_last_error(c[0]->get()), Catch::Contains("mismatch") && Catch::Contains("100 x float sum") &&
                                                  Catch::Contains("101 x float sum"));
    CHECK(ringd_wait(c[1]->get(), t1, 3000) == -EINVAL);
    CHECK(Clock::now() - start < std::chrono::seconds(2));  // not the op timeout
    // dtype and op mismatches, then the group keeps working.
    const auto t2 = c[0]->submit(0, 8, RINGD_F32, RINGD_MAX);
    const auto t3 = c[1]->submit(0, 8, RINGD_F64, RINGD_MAX);
    CHECK(ringd_wait(c[0]->get(), t2, 3000) == -EINVAL);
    CHECK(ringd_wait(c[1]->get(), t3, 3000) == -EINVAL);
    CHECK_THAT(ringd_last_error(c[1]->get()), Catch::Contains("double"));
    run_random_ops(c, 5, 3);
}

TEST_CASE("a rank that never submits gets the others a timeout error naming it", "[daemon]") {
    DaemonOptions o;
    o.op_timeout = "1s";
    Daemon d(o);
    REQUIRE(d.ready());
    auto c = connect_group(d, "late", 3);
    const auto t = c[1]->submit(0, 16, RINGD_F32, RINGD_SUM);
    const auto start = Clock::now();
    CHECK(ringd_wait(c[1]->get(), t, 5000) == -ETIMEDOUT);
    CHECK(Clock::now() - start < std::chrono::milliseconds(2500));
    CHECK_THAT(ringd_last_error(c[1]->get()), Catch::Contains("local ranks 0,2 of host node0 did not submit"));
}

TEST_CASE("a trainer killed mid-op fails the others, and the daemon keeps serving", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    int ready_pipe[2];
    REQUIRE(::pipe(ready_pipe) == 0);
    const std::string sock = d.socket();
    const pid_t victim = spawn([&] {
        Client c(sock, "kill", 1, 2, 1 << 20);
        // Rank 1 takes part in op 1, then dies before submitting op 2.
        bench::fill(c.slot().data(), 64, DType::F32, 1);
        c.allreduce(0, 64, RINGD_F32, RINGD_SUM, 10000);
        (void)!::write(ready_pipe[1], "x", 1);
        ::pause();
        return 0;
    });
    Client c0(sock, "kill", 0, 2, 1 << 20);
    bench::fill(c0.slot().data(), 64, DType::F32, 0);
    c0.allreduce(0, 64, RINGD_F32, RINGD_SUM, 10000);
    CHECK(bench::count_wrong(c0.slot().data(), 64, DType::F32, ReduceOp::Sum, 2) == 0);
    char x;
    REQUIRE(::read(ready_pipe[0], &x, 1) == 1);
    const auto t = c0.submit(0, 64, RINGD_F32, RINGD_SUM);
    ::kill(victim, SIGKILL);
    CHECK(join(victim) == -1);  // killed
    CHECK(ringd_wait(c0.get(), t, 5000) == -ECONNABORTED);
    CHECK_THAT(ringd_last_error(c0.get()), Catch::Contains("host node0 local rank 1 left"));
    // The survivor's next op is refused with the reason, not hung.
    CHECK(ringd_allreduce(c0.get(), 0, 64, RINGD_F32, RINGD_SUM, 5000) == -ECONNABORTED);
    CHECK_THAT(ringd_last_error(c0.get()), Catch::Contains("must reconnect"));
    // New trainers are served.
    auto fresh = connect_group(d, "fresh", 2);
    run_random_ops(fresh, 5, 11);
    CHECK(d.alive());
    CHECK(status(d)["ops"]["failed"].get<int>() >= 2);
}

TEST_CASE("SIGTERM fails in-flight ops with 'ringd is shutting down' and exits 0", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    auto c = connect_group(d, "term", 2);
    const auto t = c[0]->submit(0, 16, RINGD_F32, RINGD_SUM);
    const int st = d.stop();
    REQUIRE(st != -1);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
    CHECK(ringd_wait(c[0]->get(), t, 5000) == -ESHUTDOWN);
    CHECK_THAT(ringd_last_error(c[0]->get()), Catch::Contains("ringd is shutting down"));
    // Later calls fail fast instead of hanging.
    CHECK(ringd_allreduce(c[1]->get(), 0, 16, RINGD_F32, RINGD_SUM, 5000) != 0);
}

TEST_CASE("the client library reports bad arguments and refusals without aborting", "[daemon]") {
    DaemonOptions o;
    o.slot_bytes = "1MiB";
    o.max_slots = 2;
    Daemon d(o);
    REQUIRE(d.ready());
    char err[256];
    CHECK(ringd_connect("/nonexistent/ringd.sock", "g", 0, 1, 4096, err, sizeof err) == nullptr);
    CHECK_THAT(err, Catch::Contains("is ringd running"));
    CHECK(ringd_connect(d.socket().c_str(), "bad/name", 0, 1, 4096, err, sizeof err) == nullptr);
    CHECK(ringd_connect(d.socket().c_str(), "g", 0, 1, 2 << 20, err, sizeof err) == nullptr);
    CHECK_THAT(err, Catch::Contains("exceeds memory.slot_bytes"));
    CHECK(ringd_connect(d.socket().c_str(), "g", 3, 2, 4096, err, sizeof err) == nullptr);
    CHECK_THAT(err, Catch::Contains("local_rank 3"));
    Client a(d.socket(), "g", 0, 2, 4096);
    CHECK(ringd_connect(d.socket().c_str(), "g", 0, 2, 4096, err, sizeof err) == nullptr);
    CHECK_THAT(err, Catch::Contains("already joined"));
    CHECK(ringd_connect(d.socket().c_str(), "g", 1, 3, 4096, err, sizeof err) == nullptr);
    CHECK_THAT(err, Catch::Contains("local_size 2"));
    Client b(d.socket(), "other", 0, 1, 4096);
    CHECK(ringd_connect(d.socket().c_str(), "third", 0, 1, 4096, err, sizeof err) == nullptr);
    CHECK_THAT(err, Catch::Contains("slots are in use"));

    uint64_t t;
    CHECK(ringd_submit(a.get(), 4000, 100, RINGD_F32, RINGD_SUM, &t) == -ERANGE);
    CHECK(ringd_submit(a.get(), 0, 1, RINGD_I32, RINGD_AVG, &t) == -EINVAL);
    CHECK(ringd_submit(a.get(), 2, 1, RINGD_F32, RINGD_SUM, &t) == -EINVAL);
    CHECK(ringd_submit(a.get(), 0, 1, static_cast<ringd_dtype>(42), RINGD_SUM, &t) == -EINVAL);
    CHECK(ringd_wait(a.get(), 12345, 10) == -EINVAL);
    CHECK(ringd_submit(nullptr, 0, 1, RINGD_F32, RINGD_SUM, &t) == -EINVAL);
    CHECK(ringd_slot(nullptr, nullptr) == nullptr);
    ringd_close(nullptr);
    // 64 unwaited ops fill the ticket table; the next submit says so.
    for (int i = 0; i < 64; ++i) REQUIRE(ringd_submit(b.get(), 0, 1, RINGD_F32, RINGD_SUM, &t) == 0);
    CHECK(ringd_submit(b.get(), 0, 1, RINGD_F32, RINGD_SUM, &t) == -EAGAIN);
    CHECK(ringd_wait(b.get(), 1, 5000) == 0);
    CHECK(ringd_submit(b.get(), 0, 1, RINGD_F32, RINGD_SUM, &t) == 0);
}

TEST_CASE("ringctl status shows the daemon, its groups and memory; --json is valid JSON", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    auto c = connect_group(d, "shown", 2);
    run_random_ops(c, 3, 5);
    const std::string ringctl = env_or("RINGCTL_BIN", "build/client/ringctl");
    auto run = [&](const std::string &args) {
        auto r = run_command(ringctl + " --socket " + d.socket() + " " + args);
        CHECK(r.exit_code == 0);
        return r.output;
    };
    const json j = json::parse(run("status --json"));
    CHECK(j["host"] == "node0");
    CHECK(j["transport"] == "tcp");
    CHECK(j["transport_detail"] == "congestion control cubic");  // the default, root may set it
    CHECK(j["ring"]["members"].size() == 1);
    CHECK(j["groups"][0]["name"] == "shown");
    CHECK(j["groups"][0]["joined_ranks"] == json::array({0, 1}));
    CHECK(j["ops"]["completed"] == 3);
    CHECK(j["memory"]["registrations"] == 2);
    const std::string human = run("status");
    CHECK_THAT(human, Catch::Contains("generation 1") && Catch::Contains("shown") &&
                          Catch::Contains("memory registered"));
    auto missing = run_command(ringctl + " --socket /nonexistent.sock status 2>&1");
    CHECK(missing.exit_code != 0);
    CHECK_THAT(missing.output, Catch::Contains("cannot connect to ringd at /nonexistent.sock"));
}

TEST_CASE("ringd refuses to start with a clear error", "[daemon]") {
    const std::string bin = env_or("RINGD_BIN", "build/daemon/ringd");
    const std::string dir = make_temp_dir();
    auto start = [&](const std::string &yaml, const std::string &host) {
        std::ofstream(dir + "/c.yaml") << yaml;
        auto r = run_command(bin + " --config " + dir + "/c.yaml --host " + host + " 2>&1");
        return std::pair{r.exit_code, r.output};
    };
    const std::string base = "cluster: c\nhosts:\n  - {name: a, address: 127.0.0.1}\nsocket: " + dir + "/s.sock\n";
    auto [rc1, out1] = start(base, "zz");
    CHECK(rc1 != 0);
    CHECK_THAT(out1, Catch::Contains("host 'zz' is not in hosts"));
    auto [rc2, out2] = start(base + "memroy: {}\n", "a");
    CHECK(rc2 != 0);
    CHECK_THAT(out2, Catch::Contains("memroy: unknown key"));
    auto [rc3, out3] = start(base + "socket_group: no-such-group-xyz\n", "a");
    CHECK(rc3 != 0);
    CHECK_THAT(out3, Catch::Contains("socket_group"));
    auto [rc4, out4] = start(base + "transport: ibverbs\n", "a");
    CHECK(rc4 != 0);
    CHECK_THAT(out4, Catch::Contains("transport: tcp"));
    Daemon d;
    REQUIRE(d.ready());
    auto [rc5, out5] = start("cluster: c\nhosts:\n  - {name: a, address: 127.0.0.1}\nsocket: " + d.socket() + "\n", "a");
    CHECK(rc5 != 0);
    CHECK_THAT(out5, Catch::Contains("already listening"));
    CHECK(d.alive());
}
