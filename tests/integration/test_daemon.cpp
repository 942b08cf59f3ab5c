// A real ringd and real trainers (libringd-client): allreduce results, error paths, shutdown.
#include <catch2/catch.hpp>

#include <grp.h>
#include <poll.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench/bench_data.h"
#include "common/status_client.h"
#include "ringd/ringd.hpp"
#include "tests/support/harness.h"
#include "tests/support/skip.h"
#include "proto/frame.h"
#include "tests/support/unprivileged.h"

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

// Runs the allreduces `specs` on n clients of one group, submitting all ranks before waiting,
// with each rank's data at its own non-zero offset between guard bytes; checks every element and
// every guard byte on every rank. Returns the bytes the ops covered (for the status counters).
uint64_t run_ops(std::vector<std::unique_ptr<Client>> &clients, const std::vector<OpSpec> &specs, uint64_t seed) {
    const size_t n = clients.size();
    std::mt19937_64 rng(seed);
    uint64_t bytes = 0;
    for (size_t k = 0; k < specs.size(); ++k) {
        const OpSpec &s = specs[k];
        std::vector<bench::GuardedRange> g(n);
        for (size_t r = 0; r < n; ++r) {
            // Past a full guard, aligned for every dtype, different for each rank.
            g[r] = {bench::kGuardBytes + (rng() % 1024) * 8, s.count, clients[r]->slot().size(), s.dtype,
                    seed * 4096 + k * 8 + r};
            g[r].prepare(clients[r]->slot().data(), r);
        }
        std::vector<uint64_t> tickets(n);
        for (size_t r = 0; r < n; ++r)
            tickets[r] = clients[r]->submit(g[r].offset, s.count, static_cast<ringd_dtype>(s.dtype), static_cast<ringd_op>(s.op));
        for (size_t r = 0; r < n; ++r) clients[r]->wait(tickets[r], 10000);
        for (size_t r = 0; r < n; ++r) {
            INFO("op " << k << " rank " << r << " " << dtype_name(s.dtype) << " " << reduce_op_name(s.op) << " count "
                       << s.count << " offset " << g[r].offset);
            const auto v = g[r].check(clients[r]->slot().data(), s.op, n);
            CHECK(v.wrong == 0);
            CHECK(v.guard == 0);
        }
        bytes += g[0].bytes();
    }
    return bytes;
}

uint64_t run_random_ops(std::vector<std::unique_ptr<Client>> &clients, int ops, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<OpSpec> specs;
    for (int k = 0; k < ops; ++k) specs.push_back(random_op(rng, 256 << 10));
    return run_ops(clients, specs, seed);
}

json group_status(const Daemon &d, const std::string &name) {
    const json all = status(d);
    for (const json &g : all["groups"])
        if (g["name"] == name) return g;
    FAIL("group " << name << " is not in ringctl status");
    return {};
}

}  // namespace

TEST_CASE("1 to 4 local ranks allreduce random sizes, dtypes and ops exactly", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    for (int n = 1; n <= 4; ++n) {
        auto clients = connect_group(d, "g" + std::to_string(n), n);
        const uint64_t bytes = run_random_ops(clients, 40, 1000 + static_cast<uint64_t>(n));
        // One rank's result is its input: the data cannot show that the op ran (and on one host
        // the daemon rightly leaves it alone). Every wait returned the daemon's completion with
        // status 0; the group's counters show that the daemon ran exactly these ops.
        const json g = group_status(d, "g" + std::to_string(n));
        CHECK(g["ops_completed"] == 40);
        CHECK(g["ops_failed"] == 0);
        CHECK(g["bytes_reduced"] == bytes);
        CHECK(g["pending_ops"] == 0);
        CHECK(g["running_ops"] == 0);
    }
    const json j = status(d);
    CHECK(j["ops"]["failed"] == 0);
    CHECK(j["ops"]["completed"] == 160);
}

TEST_CASE("every dtype x op with 2 and 3 local ranks, small (inline) and large (progress thread): exact",
          "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    for (int n : {2, 3}) {
        std::vector<OpSpec> specs;
        for (uint32_t t = 0; t < kDTypeCount; ++t)
            for (uint32_t o = 0; o < kReduceOpCount; ++o) {
                const auto dt = static_cast<DType>(t);
                const auto op = static_cast<ReduceOp>(o);
                if (op == ReduceOp::Avg && dtype_is_integer(dt)) continue;
                // 1 and 13 elements stay on the control thread; 200 KiB goes to the progress thread.
                for (size_t count : {size_t{1}, size_t{13}, (size_t{200} << 10) / dtype_size(dt) + 3})
                    specs.push_back({dt, op, count});
            }
        auto clients = connect_group(d, "every" + std::to_string(n), n);
        run_ops(clients, specs, 77 + static_cast<uint64_t>(n));
        CHECK(group_status(d, "every" + std::to_string(n))["ops_completed"] == specs.size());
    }
}

TEST_CASE("several ops in flight per trainer complete in order", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    auto clients = connect_group(d, "pipe", 3);
    const size_t count = 4096;
    const size_t stride = count * 4 + 2 * bench::kGuardBytes;  // each op's guards stay clear of the next op
    std::vector<std::vector<bench::GuardedRange>> g(3);
    std::vector<std::vector<uint64_t>> tickets(3);
    for (size_t k = 0; k < 16; ++k)
        for (size_t r = 0; r < 3; ++r) {
            const bench::GuardedRange gr{bench::kGuardBytes + k * stride + r * 64, count, clients[r]->slot().size(),
                                         DType::I32, 77 + k * 3 + r};
            gr.prepare(clients[r]->slot().data(), r);
            g[r].push_back(gr);
            tickets[r].push_back(clients[r]->submit(gr.offset, count, RINGD_I32, RINGD_SUM));
        }
    for (size_t r = 0; r < 3; ++r)
        for (int k = 15; k >= 0; --k) clients[r]->wait(tickets[r][k], 10000);  // any order of waiting
    for (size_t r = 0; r < 3; ++r)
        for (size_t k = 0; k < 16; ++k) {
            INFO("rank " << r << " op " << k);
            const auto v = g[r][k].check(clients[r]->slot().data(), ReduceOp::Sum, 3);
            CHECK(v.wrong == 0);
            CHECK(v.guard == 0);
        }
}

TEST_CASE("an event loop: ringd_fd polls readable when results may be in, ringd_test looks without waiting",
          "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    auto clients = connect_group(d, "loop", 2);
    ringd_client *c0 = clients[0]->get();
    const int fd = ringd_fd(c0);
    REQUIRE(fd >= 0);
    CHECK(ringd_fd(c0) == fd);  // one fd per client
    const size_t count = 2048;
    const size_t stride = count * 4 + 2 * bench::kGuardBytes;
    constexpr int kOps = 8;
    std::vector<std::vector<bench::GuardedRange>> g(2);
    // Rank r's kOps ops, each between its own guard bytes; their tickets.
    auto submit_all = [&](size_t r) {
        std::vector<uint64_t> tickets;
        for (int k = 0; k < kOps; ++k) {
            const bench::GuardedRange gr{bench::kGuardBytes + k * stride, count, clients[r]->slot().size(), DType::F32,
                                         500 + 100 * r + static_cast<uint64_t>(k)};
            gr.prepare(clients[r]->slot().data(), r);
            g[r].push_back(gr);
            tickets.push_back(clients[r]->submit(gr.offset, count, RINGD_F32, RINGD_AVG));
        }
        return tickets;
    };
    const std::vector<uint64_t> t0 = submit_all(0);
    // Rank 1 has not submitted: nothing is ready, and looking does not wait or give a ticket up.
    pollfd p{fd, POLLIN, 0};
    CHECK(::poll(&p, 1, 50) == 0);
    for (uint64_t t : t0) CHECK(ringd_test(c0, t) == -EINPROGRESS);
    // A thread blocks on the fd while this one goes on calling into the client (rank 1's ops).
    std::atomic<bool> woke{false};
    std::vector<uint64_t> t1;
    std::thread poller([&] {
        pollfd q{fd, POLLIN, 0};
        woke = ::poll(&q, 1, 10000) == 1 && (q.revents & POLLIN);
    });
    // This thread calls into rank 0's client while the poller sleeps on its fd.
    for (uint64_t t : t0) CHECK(ringd_test(c0, t) == -EINPROGRESS);
    t1 = submit_all(1);
    poller.join();
    CHECK(woke);
    // The loop: poll, then test what is in flight, in any order, until every ticket is done.
    std::vector<uint64_t> pending(t0.rbegin(), t0.rend());
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (!pending.empty() && Clock::now() < deadline) {
        // Sleeps on the fd alone: a result already drained by another ticket's look must keep
        // it readable (else this waits the full 5 s and the test fails on time).
        REQUIRE(::poll(&p, 1, 5000) == 1);
        for (auto it = pending.begin(); it != pending.end();) {
            const int rc = ringd_test(c0, *it);
            if (rc == -EINPROGRESS) {
                ++it;
                continue;
            }
            CHECK(rc == 0);
            it = pending.erase(it);
        }
    }
    REQUIRE(pending.empty());
    CHECK(ringd_test(c0, t0[0]) == -EINVAL);  // done: no longer in flight
    for (uint64_t t : t1) clients[1]->wait(t, 10000);
    for (size_t r = 0; r < 2; ++r)
        for (int k = 0; k < kOps; ++k) {
            INFO("rank " << r << " op " << k);
            const auto v = g[r][k].check(clients[r]->slot().data(), ReduceOp::Avg, 2);
            CHECK(v.wrong == 0);
            CHECK(v.guard == 0);
        }
    SECTION("a failed op is done with its error; a dead ringd makes the fd readable and every test fail") {
        uint64_t a = 0, b = 0;
        REQUIRE(ringd_submit(c0, 0, 16, RINGD_F32, RINGD_SUM, &a) == 0);
        REQUIRE(ringd_submit(clients[1]->get(), 0, 16, RINGD_I32, RINGD_SUM, &b) == 0);  // mismatch
        int rc = -EINPROGRESS;
        for (auto until = Clock::now() + std::chrono::seconds(10); rc == -EINPROGRESS && Clock::now() < until;) {
            (void)::poll(&p, 1, 100);
            rc = ringd_test(c0, a);
        }
        CHECK(rc == -EINVAL);
        CHECK_THAT(std::string(ringd_last_error(c0)), Catch::Contains("mismatch"));
        CHECK(ringd_wait(clients[1]->get(), b, 10000) == -EINVAL);
    }
    SECTION("ringd goes away") {
        uint64_t a = 0;
        REQUIRE(ringd_submit(c0, 0, 16, RINGD_F32, RINGD_SUM, &a) == 0);  // rank 1 never joins in
        ::kill(d.pid(), SIGKILL);
        CHECK(::poll(&p, 1, 5000) == 1);
        CHECK(ringd_test(c0, a) == -ECONNRESET);
        CHECK_THAT(std::string(ringd_last_error(c0)), Catch::Contains("ringd closed the connection"));
    }
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

TEST_CASE("a ticket ringd_allreduce gave up on holds its slot only until its result, and may be waited again",
          "[daemon]") {
    DaemonOptions o;
    o.op_timeout = "1s";
    Daemon d(o);
    REQUIRE(d.ready());
    auto c = connect_group(d, "gaveup", 2, 1 << 16);
    ringd_client *r0 = c[0]->get(), *r1 = c[1]->get();
    for (float &x : c[0]->slot_as<float>(0, 16)) x = 1.0f;
    const auto start = Clock::now();
    // Rank 1 does not submit op 1: ringd fails it after 1 s; rank 0 stops waiting after 50 ms.
    CHECK(ringd_allreduce(r0, 0, 16, RINGD_F32, RINGD_SUM, 50) == -ETIMEDOUT);
    CHECK(std::string(ringd_last_error(r0)) == "op 1 did not complete within 50 ms");
    // Tickets 2..64 take the rest of the 64-entry table; ticket 65 would take op 1's entry, still
    // held while ringd owes op 1's result.
    uint64_t t = 0;
    for (uint64_t k = 2; k <= 64; ++k) {
        REQUIRE(ringd_submit(r0, 0, 16, RINGD_F32, RINGD_SUM, &t) == 0);
        REQUIRE(t == k);
    }
    CHECK(ringd_submit(r0, 0, 16, RINGD_F32, RINGD_SUM, &t) == -EAGAIN);
    CHECK(std::string(ringd_last_error(r0)) == "too many ops in flight: wait for ticket 1 first");
    // The ticket the caller gave up on is still its own: waiting for it gets ringd's verdict.
    CHECK(ringd_wait(r0, 1, -1) == -ETIMEDOUT);
    const auto took = Clock::now() - start;
    CHECK(std::string(ringd_last_error(r0)) ==
          "group gaveup op 1 timed out after 1000 ms: local ranks 1 of host node0 did not submit it");
    CHECK(took >= std::chrono::milliseconds(1000));  // ringd's verdict, not a client deadline
    CHECK(took < std::chrono::milliseconds(2500));
    // Consumed: its entry is free for ticket 65.
    CHECK(ringd_wait(r0, 1, 0) == -EINVAL);
    CHECK(std::string(ringd_last_error(r0)) == "ticket 1 is not in flight");
    CHECK(ringd_submit(r0, 0, 16, RINGD_F32, RINGD_SUM, &t) == 0);
    CHECK(t == 65);
    for (uint64_t k = 2; k <= 64; ++k) {
        INFO("op " << k);
        CHECK(ringd_wait(r0, k, 5000) == -ETIMEDOUT);
        CHECK(std::string(ringd_last_error(r0)) ==
              "group gaveup op " + std::to_string(k) + " timed out after 1000 ms: local ranks 1 of host node0 did not submit it");
    }
    // Rank 1 catches up: ops 1..64 fail at once with their reason, op 65 runs with rank 0's.
    for (uint64_t k = 1; k <= 64; ++k) {
        INFO("rank 1 op " << k);
        REQUIRE(ringd_submit(r1, 0, 16, RINGD_F32, RINGD_SUM, &t) == 0);
        CHECK(t == k);
        CHECK(ringd_wait(r1, k, 5000) == -EIO);
        CHECK_THAT(ringd_last_error(r1), Catch::StartsWith("group gaveup op " + std::to_string(k) + " timed out"));
    }
    for (float &x : c[1]->slot_as<float>(0, 16)) x = 2.0f;
    REQUIRE(ringd_submit(r1, 0, 16, RINGD_F32, RINGD_SUM, &t) == 0);
    CHECK(t == 65);
    CHECK(ringd_wait(r1, 65, 5000) == 0);
    CHECK(ringd_wait(r0, 65, 5000) == 0);
    for (int r = 0; r < 2; ++r)
        for (float x : c[r]->slot_as<float>(0, 16)) CHECK(x == 3.0f);
}

TEST_CASE("a trainer killed mid-op fails the others, and the daemon keeps serving", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    int ready_pipe[2];
    REQUIRE(::pipe(ready_pipe) == 0);
    UniqueFd ready_r(ready_pipe[0]), ready_w(ready_pipe[1]);
    const std::string sock = d.socket();
    // Both ranks check op 1 themselves: values and the guard bytes around their own ranges.
    const bench::GuardedRange g0{512, 64, 1 << 20, DType::F32, 5}, g1{1024 + 40, 64, 1 << 20, DType::F32, 6};
    const pid_t victim = spawn([&] {
        Client c(sock, "kill", 1, 2, 1 << 20);
        // Rank 1 takes part in op 1, then dies before submitting op 2.
        g1.prepare(c.slot().data(), 1);
        c.allreduce(g1.offset, 64, RINGD_F32, RINGD_SUM, 10000);
        (void)!::write(ready_pipe[1], g1.check(c.slot().data(), ReduceOp::Sum, 2).ok() ? "x" : "w", 1);
        ::pause();
        return 0;
    });
    const Reaper reaper{victim};
    Client c0(sock, "kill", 0, 2, 1 << 20);
    g0.prepare(c0.slot().data(), 0);
    c0.allreduce(g0.offset, 64, RINGD_F32, RINGD_SUM, 10000);
    const auto v0 = g0.check(c0.slot().data(), ReduceOp::Sum, 2);
    CHECK(v0.wrong == 0);
    CHECK(v0.guard == 0);
    ready_w.reset();  // a victim that fails before its verdict closes the pipe: read() returns 0
    char x = 0;
    pollfd p{ready_r.get(), POLLIN, 0};
    REQUIRE(::poll(&p, 1, 10000) == 1);
    REQUIRE(::read(ready_r.get(), &x, 1) == 1);
    CHECK(x == 'x');  // rank 1's own verdict
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

TEST_CASE("SIGHUP reloads the config: the log level at once, the rest by name; bad files change nothing", "[daemon]") {
    Daemon d;
    REQUIRE(d.ready());
    auto c = connect_group(d, "reloaded", 2);
    run_random_ops(c, 2, 17);
    const std::string path = d.dir() + "/ringd.yaml";
    const std::string original = read_file(path);
    auto config = [&] { return json::parse(*fetch_status(d.socket()))["config"]; };
    const std::string v0 = config()["version"];
    CHECK(v0.size() == 12);
    // Until the status shows a reload newer than `before`.
    auto reload = [&](const std::string &text) {
        const std::string before = config()["last_reload"];
        std::ofstream(path) << text;
        REQUIRE(::kill(d.pid(), SIGHUP) == 0);
        for (int i = 0; i < 500 && config()["last_reload"] == before; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return config();
    };
    auto with = [&](const std::string &from, const std::string &to) {
        std::string t = original;
        const auto at = t.find(from);
        REQUIRE(at != std::string::npos);
        return t.replace(at, from.size(), to);
    };
    SECTION("the log level is applied; other keys wait for a restart, named") {
        auto j = reload(with("log: {level: debug}", "log: {level: warn}") + "limits: {slots_per_uid: 3}\n");
        CHECK_THAT(j["last_reload"].get<std::string>(), Catch::Contains("applied: log.level"));
        CHECK(j["pending_restart"] == json::array({"limits"}));
        CHECK(j["version"] != v0);
        const std::string human = run_command(env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + d.socket() + " status").output;
        CHECK_THAT(human, Catch::Contains("applied at the next restart: limits"));
        // Back to the file ringd started with: nothing waits any more.
        j = reload(original);
        CHECK(j["pending_restart"].empty());
        CHECK(j["version"] == v0);
    }
    SECTION("a host's rails wait for a restart, named") {
        auto j = reload(with("address: 127.0.0.1,", "address: [127.0.0.1, 127.0.0.5],"));
        CHECK(j["pending_restart"] == json::array({"hosts (rails changed: NICs are set up when ringd starts)"}));
        CHECK_THAT(j["last_reload"].get<std::string>(), Catch::Contains("applied: nothing"));
        j = reload(original);
        CHECK(j["pending_restart"].empty());
    }
    SECTION("what cannot change at run time is refused by key; the running config stays") {
        auto j = reload(with("socket: " + d.socket(), "socket: " + d.dir() + "/other.sock"));
        CHECK_THAT(j["last_reload"].get<std::string>(), Catch::Contains("refused: socket cannot change") &&
                                                            Catch::Contains("version " + v0 + ") stays"));
        CHECK(j["version"] == v0);
        j = reload(with("slot_bytes: 64MiB", "slot_bytes: 12XB"));
        CHECK_THAT(j["last_reload"].get<std::string>(), Catch::Contains("refused") && Catch::Contains("slot_bytes"));
        j = reload(with("node0", "node9"));
        CHECK_THAT(j["last_reload"].get<std::string>(), Catch::Contains("this host, node0, is not in it"));
        CHECK_THAT(d.log(), Catch::Contains("reload: ") && Catch::Contains("refused"));
    }
    SECTION("ringctl reload does what SIGHUP does and says how it went; a refusal fails it") {
        const std::string ringctl = env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + d.socket();
        std::ofstream(path) << with("log: {level: debug}", "log: {level: info}");
        auto r = run_command(ringctl + " reload 2>&1");
        CHECK(r.exit_code == 0);
        CHECK_THAT(r.output, Catch::Contains("reload on host node0: ") && Catch::Contains("applied: log.level"));
        CHECK(config()["version"] != v0);
        std::ofstream(path) << with("socket: " + d.socket(), "socket: " + d.dir() + "/other.sock");
        r = run_command(ringctl + " reload 2>&1");
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.output, Catch::Contains("ringctl: reload on host node0: ") && Catch::Contains("refused: socket cannot change"));
        CHECK_THAT(d.log(), Catch::Contains("ringctl reload"));
    }
    // Whatever the reload did, ringd runs on: its socket, its groups.
    CHECK(d.alive());
    struct stat st{};
    CHECK(::stat(d.socket().c_str(), &st) == 0);
    run_random_ops(c, 2, 18);
}

TEST_CASE("ringctl drain: no new groups, running ones go on; drain --wait returns once they ended; undrain", "[daemon]") {
    DaemonOptions o;
    o.extra_yaml = "socket_group: nogroup\n";  // nobody may open the socket (to be refused the drain)
    Daemon d(o);
    REQUIRE(d.ready());
    REQUIRE(::chmod(d.dir().c_str(), 0711) == 0);
    const std::string ringctl = env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + d.socket();
    auto status = [&] { return json::parse(*fetch_status(d.socket())); };
    auto a = connect_group(d, "running", 2);
    run_random_ops(a, 2, 31);
    auto r = run_command(ringctl + " drain 2>&1");
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.output, Catch::Contains("host node0 drained"));
    CHECK(status()["drained"] == true);
    CHECK_THAT(run_command(ringctl + " status").output, Catch::Contains("DRAINED"));
    // A new group is refused, naming the drain; the running one goes on.
    char err[256] = "";
    CHECK(ringd_connect(d.socket().c_str(), "new-job", 0, 1, 4096, err, sizeof err) == nullptr);
    CHECK_THAT(err, Catch::Contains("host node0 is drained (ringctl drain)") && Catch::Contains("new-job"));
    run_random_ops(a, 3, 32);
    // Only root or ringd's own user may drain.
    auto as_nobody = run_as(Identity{65534, 65534, {}}, [&]() -> std::string {
        auto s = fetch_status(d.socket(), 2000, proto::kStatusUndrain);
        return s ? "undrained" : s.error().message;
    });
    if (as_nobody) CHECK_THAT(*as_nobody, Catch::Contains("only root or ringd's own user may undrain"));
    CHECK(status()["drained"] == true);
    // drain --wait: returns once the last group here ended.
    const auto t0 = Clock::now();
    std::thread leaver([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(600));
        a.clear();
    });
    auto w = run_command(ringctl + " drain --wait --timeout 20 2>&1");
    leaver.join();
    CHECK(w.exit_code == 0);
    CHECK_THAT(w.output, Catch::Contains("no group runs here any more"));
    CHECK(Clock::now() - t0 >= std::chrono::milliseconds(500));
    // undrain: new groups again; a drain --wait that runs out of time names what still runs.
    CHECK(run_command(ringctl + " undrain").exit_code == 0);
    CHECK(status()["drained"] == false);
    auto b = connect_group(d, "later", 1);
    run_random_ops(b, 2, 33);
    auto late = run_command(ringctl + " drain --wait --timeout 1 2>&1");
    CHECK(late.exit_code != 0);
    CHECK_THAT(late.output, Catch::Contains("groups still running here after 1 s: later"));
    run_random_ops(b, 1, 34);
}

TEST_CASE("a ring of one host says at start what a larger ring would trip over", "[daemon]") {
    auto start = [](const std::string &address, int port, const std::string &extra) {
        DaemonOptions o;
        o.hosts_yaml = "hosts:\n  - {name: node0, address: " + address + ", port: " + std::to_string(port) + "}\n";
        o.extra_yaml = extra;
        auto d = std::make_unique<Daemon>(o);
        REQUIRE(d->ready());  // it runs: alone, none of this stops it
        return d;
    };
    auto a = start("10.254.254.1", 7400, "");
    CHECK_THAT(a->log(), Catch::Contains("hosts: node0's address 10.254.254.1 port 7400 cannot be bound") &&
                             Catch::Contains("not an address of this machine"));
    // A port another program listens on.
    UniqueFd l(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in in{};
    in.sin_family = AF_INET;
    in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(l.get(), reinterpret_cast<sockaddr *>(&in), sizeof in) == 0);
    REQUIRE(::listen(l.get(), 1) == 0);
    socklen_t len = sizeof in;
    REQUIRE(::getsockname(l.get(), reinterpret_cast<sockaddr *>(&in), &len) == 0);
    auto b = start("127.0.0.1", ntohs(in.sin_port), "");
    CHECK_THAT(b->log(), Catch::Contains("another program listens there"));
    auto c = start("127.0.0.1", 7400, "auth: {secret_file: /nonexistent/ringd-secret}\n");
    CHECK_THAT(c->log(), Catch::Contains("auth.secret_file") && Catch::Contains("/nonexistent/ringd-secret"));
    const json j = json::parse(*fetch_status(c->socket()));
    CHECK_THAT(j.dump(), Catch::Contains("auth.secret_file"));  // in recent_errors too
    // A sound one says nothing of the kind.
    auto ok = start("127.0.0.1", 7431, "");
    CHECK_THAT(ok->log(), !Catch::Contains("a ring with more hosts would not form"));
}

TEST_CASE("a peer that stays down costs a few log lines, not two a second", "[daemon]") {
    DaemonOptions o;
    o.hosts_yaml = "hosts:\n  - {name: node0, address: 127.0.0.1, port: 7400}\n"
                   "  - {name: node1, address: 127.0.0.1, port: 7401}\n";  // node1 never starts
    o.extra_yaml = secret_yaml();
    Daemon d(o);
    REQUIRE(d.ready());
    std::this_thread::sleep_for(std::chrono::seconds(4));  // about 8 redials of node1
    const std::string log = d.log();
    auto count = [&](const std::string &what) {
        size_t n = 0;
        std::istringstream in(log);
        for (std::string line; std::getline(in, line);)
            if (line.find(what) != std::string::npos && line.find("node1") != std::string::npos &&
                line.find("[debug]") == std::string::npos)
                ++n;
        return n;
    };
    INFO(log);
    CHECK(count("link to node1") == 0);  // connecting <-> failed is not news
    CHECK(count("connection to node1") <= 2);  // the failure itself: once per repeat window
    CHECK(count("connection to node1") >= 1);
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
    CHECK(j["transport_detail"] == "congestion control cubic, zero-copy sends");  // the default, root may set it
    CHECK(j["ring"]["members"].size() == 1);
    CHECK(j["groups"][0]["name"] == "shown");
    CHECK(j["groups"][0]["joined_ranks"] == json::array({0, 1}));
    CHECK(j["ops"]["completed"] == 3);
    CHECK(j["memory"]["registrations"] == 2);
    const std::string human = run("status");
    CHECK_THAT(human, Catch::Contains("generation 1") && Catch::Contains("shown") &&
                          Catch::Contains("memory registered"));
    // Without --socket: $RINGD_SOCKET, as for trainers.
    auto by_env = run_command("RINGD_SOCKET=" + d.socket() + " " + ringctl + " status --json");
    CHECK(by_env.exit_code == 0);
    CHECK(json::parse(by_env.output)["host"] == "node0");
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
    // A config that cannot run exits with EX_CONFIG (78), which ringd.service does not restart
    // (RestartPreventExitStatus=78): the shipped example config on a host it does not name.
    auto [rc1, out1] = start(base, "zz");
    CHECK(rc1 == 78);
    CHECK_THAT(out1, Catch::Contains("host 'zz' is not in hosts"));
    auto [rc2, out2] = start(base + "memroy: {}\n", "a");
    CHECK(rc2 == 78);
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

namespace {

// Lines from a forked trainer to the test over a pipe, each read with a deadline (a trainer that
// hangs shows up as a missing line, never as a hung test).
class ChildLines {
public:
    ChildLines() {
        int fds[2];
        REQUIRE(::pipe(fds) == 0);
        r_ = UniqueFd(fds[0]);
        w_ = UniqueFd(fds[1]);
    }
    // In the child.
    void put(const std::string &line) const { (void)!::write(w_.get(), (line + "\n").data(), line.size() + 1); }
    // In the parent, once the child is forked: its exit then ends the stream.
    void close_write() { w_.reset(); }
    std::optional<std::string> get(std::chrono::milliseconds timeout) {
        const auto deadline = Clock::now() + timeout;
        for (;;) {
            if (const size_t nl = buf_.find('\n'); nl != std::string::npos) {
                std::string line = buf_.substr(0, nl);
                buf_.erase(0, nl + 1);
                return line;
            }
            pollfd p{r_.get(), POLLIN, 0};
            if (::poll(&p, 1, ms_until(deadline)) <= 0) return std::nullopt;
            char b[512];
            const ssize_t n = ::read(r_.get(), b, sizeof b);
            if (n <= 0) return std::nullopt;
            buf_.append(b, static_cast<size_t>(n));
        }
    }

private:
    UniqueFd r_, w_;
    std::string buf_;
};

// A call's outcome as one line: "rc ms last_error".
std::string outcome(int rc, Clock::time_point start, ringd_client *c) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    return std::to_string(rc) + " " + std::to_string(ms) + " " + ringd_last_error(c);
}

struct Outcome {
    int rc = 1;
    long ms = -1;
    std::string error;
};

Outcome parse_outcome(const std::string &line) {
    Outcome o;
    std::istringstream in(line);
    in >> o.rc >> o.ms;
    std::getline(in >> std::ws, o.error);
    return o;
}

// True once `pid` sits in poll/ppoll (the trainer blocked in ringd_wait), within the timeout.
bool blocked_in_poll(pid_t pid, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
        const std::string sc = read_file("/proc/" + std::to_string(pid) + "/syscall");
        const std::string nr = sc.substr(0, sc.find(' '));
        if (nr == std::to_string(SYS_poll) || nr == std::to_string(SYS_ppoll)) return true;
        pollfd none{-1, 0, 0};
        ::poll(&none, 1, 5);  // the trainer is a few instructions away: look again shortly
    }
    return false;
}

}  // namespace

TEST_CASE("a trainer waiting on an op notices a SIGKILLed ringd at once; so does one that submits after", "[daemon]") {
    DaemonOptions o;
    o.op_timeout = "60s";  // the daemon itself would never time the op out during this test
    Daemon d(o);
    REQUIRE(d.ready());
    const std::string sock = d.socket();
    ChildLines lines;
    const pid_t trainer = spawn([&] {
        Client c0(sock, "gone", 0, 2, 1 << 16), c1(sock, "gone", 1, 2, 1 << 16);
        uint64_t t = 0;
        if (ringd_submit(c0.get(), 256, 64, RINGD_F32, RINGD_SUM, &t) != 0) return 2;  // rank 1 never joins in
        lines.put("waiting");
        auto start = Clock::now();
        int rc = ringd_wait(c0.get(), t, 60000);
        lines.put(outcome(rc, start, c0.get()));
        // Rank 1 never waited, so it has not seen the daemon go: it submits, then waits.
        start = Clock::now();
        rc = ringd_submit(c1.get(), 256, 64, RINGD_F32, RINGD_SUM, &t);
        if (rc == 0) rc = ringd_wait(c1.get(), t, 60000);
        lines.put(outcome(rc, start, c1.get()));
        // And rank 0 again, through ringd_allreduce.
        start = Clock::now();
        rc = ringd_allreduce(c0.get(), 256, 64, RINGD_F32, RINGD_SUM, 60000);
        lines.put(outcome(rc, start, c0.get()));
        return 0;
    });
    const Reaper reaper{trainer};
    lines.close_write();
    REQUIRE(lines.get(std::chrono::seconds(10)) == "waiting");
    REQUIRE(blocked_in_poll(trainer, std::chrono::seconds(5)));
    ::kill(d.pid(), SIGKILL);
    const auto killed = Clock::now();
    const auto waited = lines.get(std::chrono::seconds(5));
    const auto noticed = Clock::now() - killed;
    REQUIRE(waited.has_value());  // not the 60 s of the wait: the socket's EOF woke it
    CHECK(noticed < std::chrono::seconds(2));
    const Outcome w = parse_outcome(*waited);
    CHECK(w.rc == -ECONNRESET);
    CHECK_THAT(w.error, Catch::Contains("ringd closed the connection"));
    for (const char *who : {"rank 1 submitting after the daemon died", "rank 0 calling ringd_allreduce again"}) {
        INFO(who);
        const auto line = lines.get(std::chrono::seconds(5));
        REQUIRE(line.has_value());
        const Outcome a = parse_outcome(*line);
        CHECK(a.rc == -ECONNRESET);
        CHECK(a.ms < 2000);
        CHECK_THAT(a.error, Catch::Contains("ringd closed the connection"));
    }
    CHECK(join(trainer, std::chrono::seconds(5)) == 0);
}

TEST_CASE("timeout_ms < 0 waits for the daemon's timeouts.op plus 10 s, then declares the connection dead",
          "[daemon]") {
    DaemonOptions o;
    o.op_timeout = "500ms";
    Daemon d(o);
    REQUIRE(d.ready());
    auto c = connect_group(d, "neg", 2);
    SECTION("a live daemon's op timeout comes first: the wait returns its error") {
        const auto t = c[0]->submit(256, 16, RINGD_F32, RINGD_SUM);  // rank 1 never submits
        const auto start = Clock::now();
        CHECK(ringd_wait(c[0]->get(), t, -1) == -ETIMEDOUT);
        const auto took = Clock::now() - start;
        CHECK(took > std::chrono::milliseconds(400));
        CHECK(took < std::chrono::seconds(3));
        CHECK_THAT(ringd_last_error(c[0]->get()), Catch::Contains("local ranks 1 of host node0 did not submit"));
    }
    SECTION("a stopped daemon never answers: the wait ends at 500 ms + 10 s with the breach") {
        // The waiter is a forked copy of this process (the client's mapping and fds are shared),
        // so that a wait without a deadline fails the test instead of hanging it.
        REQUIRE(::kill(d.pid(), SIGSTOP) == 0);
        ChildLines lines;
        const pid_t trainer = spawn([&] {
            uint64_t t0 = 0, t1 = 0;
            if (ringd_submit(c[0]->get(), 256, 16, RINGD_F32, RINGD_SUM, &t0) != 0 ||
                ringd_submit(c[1]->get(), 512, 16, RINGD_F32, RINGD_SUM, &t1) != 0)
                return 2;
            const auto start = Clock::now();
            const int rc = ringd_wait(c[0]->get(), t0, -1);
            lines.put(outcome(rc, start, c[0]->get()));
            return 0;
        });
        const Reaper reaper{trainer};
        lines.close_write();
        const auto line = lines.get(std::chrono::seconds(16));
        ::kill(d.pid(), SIGCONT);
        REQUIRE(line.has_value());
        const Outcome w = parse_outcome(*line);
        CHECK(w.rc == -EPROTO);
        CHECK(w.ms >= 10450);
        CHECK(w.ms < 13000);
        CHECK(w.error == "ringd did not complete op 1 within its op timeout + margin (500 + 10000 ms after its "
                         "submission); this connection is unusable, reconnect");
        CHECK(join(trainer, std::chrono::seconds(5)) == 0);
    }
}

TEST_CASE("a ringd that owes a result past timeouts.op + the margin makes the client fail with EPROTO, not wedge",
          "[daemon]") {
    DaemonOptions o;
    o.op_timeout = "1s";
    Daemon d(o);
    REQUIRE(d.ready());
    const std::string sock = d.socket();
    const pid_t ringd = d.pid();
    // The trainer is a forked copy of this process, so that a hang fails the test instead of
    // hanging it; it reports each call as "rc ms error".
    ChildLines lines;
    const pid_t trainer = spawn([&] {
        char err[256] = "";
        ::setenv("RINGD_WAIT_MARGIN_MS", "2s", 1);
        ringd_client *bad = ringd_connect(sock.c_str(), "breach", 0, 2, 1 << 16, err, sizeof err);
        lines.put(bad ? "connected" : err);
        ringd_close(bad);
        ::setenv("RINGD_WAIT_MARGIN_MS", "500", 1);  // below the floor: 2000
        Client c0(sock, "breach", 0, 2, 1 << 16), c1(sock, "breach", 1, 2, 1 << 16), c2(sock, "solo", 0, 1, 1 << 16);
        // Stopped before any op reaches it: ringd owes every op below a result it cannot give.
        if (::kill(ringd, SIGSTOP) != 0) return 2;
        // 1. c0: an explicit timeout before the contract's deadline is an ordinary -ETIMEDOUT; the
        // ticket is given up. Tickets 2..64 fill the table; the next one would take op 1's entry.
        auto start = Clock::now();
        lines.put(outcome(ringd_allreduce(c0.get(), 0, 16, RINGD_F32, RINGD_SUM, 1000), start, c0.get()));
        uint64_t t = 0;
        for (uint64_t k = 2; k <= 64; ++k)
            if (ringd_submit(c0.get(), 0, 16, RINGD_F32, RINGD_SUM, &t) != 0 || t != k) return 3;
        start = Clock::now();
        lines.put(outcome(ringd_submit(c0.get(), 0, 16, RINGD_F32, RINGD_SUM, &t), start, c0.get()));
        // c1 and c2 submit 1 s after c0's op 1: their deadlines come 1000 + 2000 ms from now.
        // (Timed from before c1's submission, the start of its contract: a submit that lost the
        // core for a moment must not make the wait look short.)
        uint64_t t1 = 0, t2 = 0;
        const auto submitted = Clock::now();
        if (ringd_submit(c1.get(), 0, 16, RINGD_F32, RINGD_SUM, &t1) != 0 ||
            ringd_submit(c2.get(), 0, 16, RINGD_F32, RINGD_SUM, &t2) != 0)
            return 4;
        // 2. A wait longer than the deadline is cut there.
        lines.put(outcome(ringd_wait(c1.get(), t1, 60000), submitted, c1.get()));
        // 3. timeout_ms < 0 counts from the submission: starting late does not extend it.
        start = Clock::now();
        lines.put(outcome(ringd_wait(c2.get(), t2, -1), start, c2.get()));
        // 4. c0 never waits again: its submit finds op 1 (given up, 1 s past its deadline) in the way.
        start = Clock::now();
        lines.put(outcome(ringd_submit(c0.get(), 0, 16, RINGD_F32, RINGD_SUM, &t), start, c0.get()));
        // 5. Every later call on a dead client says so at once.
        start = Clock::now();
        lines.put(outcome(ringd_wait(c0.get(), 1, 5000), start, c0.get()));
        start = Clock::now();
        lines.put(outcome(ringd_wait(c0.get(), 12345, 5000), start, c0.get()));
        start = Clock::now();
        lines.put(outcome(ringd_allreduce(c0.get(), 0, 16, RINGD_F32, RINGD_SUM, 5000), start, c0.get()));
        // 6. ringd continues and completes op 1 of both groups: too late, not taken.
        ::kill(ringd, SIGCONT);
        int completed = 0;
        for (const auto until = Clock::now() + std::chrono::seconds(5); completed < 2 && Clock::now() < until;) {
            auto s = fetch_status(sock);
            if (!s.ok()) continue;
            const json j = json::parse(*s);
            completed = 0;
            for (const json &g : j["groups"])
                if ((g["name"] == "breach" || g["name"] == "solo") && g["ops_completed"] == 1) ++completed;
        }
        lines.put(completed == 2 ? "completed" : "not completed");
        start = Clock::now();
        lines.put(outcome(ringd_wait(c1.get(), t1, 5000), start, c1.get()));
        start = Clock::now();
        lines.put(outcome(ringd_wait(c2.get(), t2, 5000), start, c2.get()));
        return 0;
    });
    const Reaper reaper{trainer};
    lines.close_write();
    auto next = [&] {
        auto line = lines.get(std::chrono::seconds(10));
        REQUIRE(line.has_value());
        return parse_outcome(*line);
    };
    const std::string breach = "ringd did not complete op 1 within its op timeout + margin (1000 + 2000 ms after its "
                               "submission); this connection is unusable, reconnect";
    CHECK(lines.get(std::chrono::seconds(10)) == "RINGD_WAIT_MARGIN_MS=2s is not a number of milliseconds");
    {
        INFO("1. c0's allreduce with timeout_ms 1000");
        const Outcome w = next();
        CHECK(w.rc == -ETIMEDOUT);
        CHECK(w.error == "op 1 did not complete within 1000 ms");
        CHECK(w.ms >= 1000);
        CHECK(w.ms < 1500);
    }
    {
        INFO("c0's submit of ticket 65, before op 1's deadline");
        const Outcome w = next();
        CHECK(w.rc == -EAGAIN);
        CHECK(w.error == "too many ops in flight: wait for ticket 1 first");
    }
    {
        INFO("2. c1's wait with timeout_ms 60000, from the submission");
        const Outcome w = next();
        CHECK(w.rc == -EPROTO);
        CHECK(w.error == breach);
        CHECK(w.ms >= 3000);
        CHECK(w.ms < 3500);
    }
    {
        INFO("3. c2's wait with timeout_ms -1, started at the deadline");
        const Outcome w = next();
        CHECK(w.rc == -EPROTO);
        CHECK(w.error == breach);
        CHECK(w.ms < 100);
    }
    for (const char *call :
         {"4. c0's submit", "5. c0's wait for the given-up ticket", "c0's wait for an unknown ticket", "c0's allreduce"}) {
        INFO(call);
        const Outcome w = next();
        CHECK(w.rc == -EPROTO);
        CHECK(w.error == breach);
        CHECK(w.ms < 100);
    }
    CHECK(lines.get(std::chrono::seconds(10)) == "completed");
    for (const char *who : {"6. c1", "c2"}) {
        INFO(who);
        const Outcome w = next();
        CHECK(w.rc == -EPROTO);
        CHECK(w.error == breach);
        CHECK(w.ms < 100);
    }
    ::kill(ringd, SIGCONT);  // whatever the trainer did
    CHECK(join(trainer, std::chrono::seconds(10)) == 0);
    // ringd itself goes on serving.
    auto fresh = connect_group(d, "after", 2);
    run_random_ops(fresh, 3, 21);
    CHECK(d.alive());
}

namespace {

// The gid of an existing group, or -1.
long group_id(const char *name) {
    const group *g = ::getgrnam(name);
    return g ? static_cast<long>(g->gr_gid) : -1;
}

// Connects as two local ranks of a group (in this process) and allreduces once with guards;
// "" when that worked, else what went wrong. Runs in a child that changed identity.
std::string connect_and_allreduce(const std::string &sock) {
    char err[256] = "";
    ringd_client *a = ringd_connect(sock.c_str(), "who", 0, 2, 1 << 16, err, sizeof err);
    if (!a) return err;
    ringd_client *b = ringd_connect(sock.c_str(), "who", 1, 2, 1 << 16, err, sizeof err);
    if (!b) {
        ringd_close(a);
        return std::string("rank 1: ") + err;
    }
    const bench::GuardedRange ga{512, 1000, 1 << 16, DType::F32, 31}, gb{1280, 1000, 1 << 16, DType::F32, 32};
    ga.prepare(ringd_slot(a, nullptr), 0);
    gb.prepare(ringd_slot(b, nullptr), 1);
    uint64_t ta = 0, tb = 0;
    std::string out;
    if (ringd_submit(a, ga.offset, ga.count, RINGD_F32, RINGD_SUM, &ta) != 0 ||
        ringd_submit(b, gb.offset, gb.count, RINGD_F32, RINGD_SUM, &tb) != 0 || ringd_wait(a, ta, 5000) != 0 ||
        ringd_wait(b, tb, 5000) != 0)
        out = std::string("allreduce: ") + ringd_last_error(a) + " / " + ringd_last_error(b);
    else if (!ga.check(ringd_slot(a, nullptr), ReduceOp::Sum, 2).ok() || !gb.check(ringd_slot(b, nullptr), ReduceOp::Sum, 2).ok())
        out = "allreduce: wrong values or guard bytes";
    ringd_close(a);
    ringd_close(b);
    return out;
}

}  // namespace

TEST_CASE("the socket is 0660 with socket_group; allow_uids/allow_gids refuse others with a reason", "[daemon]") {
    const long nogroup = group_id("nogroup"), daemon_gid = group_id("daemon");
    REQUIRE(nogroup == 65534);
    REQUIRE(daemon_gid > 0);
    const Identity nobody{65534, 65534, {}};
    const Identity nobody_in_daemon{65534, 65534, {static_cast<gid_t>(daemon_gid)}};
    // A daemon whose socket directory others may traverse (temp dirs are 0700).
    auto start = [](const std::string &yaml) {
        DaemonOptions o;
        o.extra_yaml = yaml;
        auto d = std::make_unique<Daemon>(o);
        REQUIRE(d->ready());
        REQUIRE(::chmod(d->dir().c_str(), 0711) == 0);
        return d;
    };
    auto as = [](const Identity &who, const std::string &sock) {
        auto r = run_as(who, [&] { return connect_and_allreduce(sock); });
        return r;
    };
    if (!as(nobody, "/nonexistent").has_value()) RINGD_SKIP("needs root to run a trainer as another user");

    SECTION("socket_group gets the socket, mode 0660: its members connect, others get EACCES") {
        auto d = start("socket_group: daemon\n");
        struct stat st{};
        REQUIRE(::stat(d->socket().c_str(), &st) == 0);
        CHECK((st.st_mode & 07777) == 0660);
        CHECK(st.st_gid == static_cast<gid_t>(daemon_gid));
        CHECK(st.st_uid == 0);
        CHECK(as(nobody_in_daemon, d->socket()) == "");
        CHECK_THAT(*as(nobody, d->socket()), Catch::Contains("cannot connect to ringd") &&
                                                 Catch::Contains(std::strerror(EACCES)));
        // Without socket_group the socket keeps the daemon's group (root): nobody is outside it.
        auto plain = start("");
        REQUIRE(::stat(plain->socket().c_str(), &st) == 0);
        CHECK((st.st_mode & 07777) == 0660);
        CHECK(st.st_gid == 0);
        CHECK_THAT(*as(nobody_in_daemon, plain->socket()), Catch::Contains(std::strerror(EACCES)));
    }
    SECTION("allow_uids") {
        auto only_root = start("socket_group: nogroup\nallow_uids: [0]\n");
        CHECK_THAT(*as(nobody, only_root->socket()),
                   Catch::Contains("ringd refused: uid 65534 gid 65534 is not in allow_uids/allow_gids"));
        CHECK_THAT(only_root->log(), Catch::Contains("refused pid") && Catch::Contains("uid 65534 gid 65534"));
        // ringctl (the status request) gets ringd's reason too, not the broken pipe of a
        // connection ringd closed before the request went.
        // Both orders: the request sent before ringd refused, and after (ringd has closed: the
        // request cannot go).
        for (bool late : {false, true}) {
            auto st = run_as(nobody, [&]() -> std::string {
                if (!late) {
                    auto s = fetch_status(only_root->socket(), 2000);
                    return s ? "status came" : s.error().message;
                }
                UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
                sockaddr_un addr{};
                addr.sun_family = AF_UNIX;
                std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", only_root->socket().c_str());
                if (::connect(fd.get(), reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0) return "connect failed";
                pollfd p{fd.get(), POLLRDHUP, 0};
                if (::poll(&p, 1, 2000) != 1) return "ringd did not close the connection";
                auto s = fetch_status_over(fd.get(), 2000);
                return s ? "status came" : s.error().message;
            });
            REQUIRE(st.has_value());
            INFO((late ? "the request after ringd closed the connection" : "the request at once"));
            CHECK_THAT(*st, Catch::Contains("ringd refused: uid 65534 gid 65534 is not in allow_uids/allow_gids"));
        }
        auto clients = connect_group(*only_root, "root", 2);  // root is listed
        run_random_ops(clients, 2, 91);
        CHECK(only_root->alive());

        auto both = start("socket_group: nogroup\nallow_uids: [0, 65534]\n");
        CHECK(as(nobody, both->socket()) == "");

        // Root is not special: not listed, refused like anyone.
        auto only_nobody = start("socket_group: nogroup\nallow_uids: [65534]\n");
        CHECK(as(nobody, only_nobody->socket()) == "");
        char err[256] = "";
        CHECK(ringd_connect(only_nobody->socket().c_str(), "r", 0, 1, 4096, err, sizeof err) == nullptr);
        CHECK_THAT(err, Catch::Contains("uid 0 gid 0 is not in allow_uids/allow_gids"));
    }
    SECTION("allow_gids: the primary gid") {
        auto by_gid = start("socket_group: nogroup\nallow_uids: [0]\nallow_gids: [65534]\n");
        CHECK(as(nobody, by_gid->socket()) == "");
        auto other_gid = start("socket_group: nogroup\nallow_uids: [0]\nallow_gids: [" + std::to_string(daemon_gid) + "]\n");
        CHECK_THAT(*as(nobody, other_gid->socket()), Catch::Contains("is not in allow_uids/allow_gids"));
        CHECK(as(Identity{65534, static_cast<gid_t>(daemon_gid), {65534}}, other_gid->socket()) == "");
    }
}

TEST_CASE("a group belongs to its first trainer's uid; per-uid limits on slots and connections", "[daemon]") {
    DaemonOptions o;
    o.extra_yaml = "socket_group: nogroup\nlimits: {slots_per_uid: 1, connections_per_uid: 3}\n";
    Daemon d(o);
    REQUIRE(d.ready());
    REQUIRE(::chmod(d.dir().c_str(), 0711) == 0);
    const std::string sock = d.socket();
    // One child, real uid root, switching its effective identity between connects (SO_PEERCRED
    // reports the identity in effect at connect()). It lists what went wrong.
    auto r = run_as(Identity{0, 0, {}}, [&]() -> std::string {
        std::string out, e;
        auto as = [&](uid_t uid, auto f) {
            if (::setegid(65534) != 0 || ::seteuid(uid) != 0) out += "cannot become uid " + std::to_string(uid) + "\n";
            auto v = f();
            (void)!::seteuid(0);
            (void)!::setegid(0);
            return v;
        };
        auto join = [&](const char *group, int rank, int size) {
            char err[256] = "";
            ringd_client *c = ringd_connect(sock.c_str(), group, rank, size, 4096, err, sizeof err);
            e = err;
            return c;
        };
        auto expect_refused = [&](ringd_client *c, const std::string &what, const std::string &text) {
            if (c) out += what + ": joined\n";
            else if (e.find(text) == std::string::npos) out += what + ": '" + e + "' does not say '" + text + "'\n";
        };
        ringd_client *root0 = join("owned", 0, 2);  // root's group
        if (!root0) return "root's join: " + e;
        expect_refused(as(65534, [&] { return join("owned", 1, 2); }), "nobody into root's group",
                       "group owned belongs to uid 0 (its first trainer's); uid 65534 may not join it");
        ringd_client *mine0 = as(65534, [&] { return join("mine", 0, 2); });
        if (!mine0) return out + "nobody's own group: " + e;
        expect_refused(as(65533, [&] { return join("mine", 1, 2); }), "uid 65533 into nobody's group",
                       "group mine belongs to uid 65534");
        ringd_client *mine1 = join("mine", 1, 2);  // root may join any group
        if (!mine1) return out + "root into nobody's group: " + e;
        // An op of the group of two uids.
        uint64_t t0 = 0, t1 = 0;
        static_cast<float *>(ringd_slot(mine0, nullptr))[0] = 1.5f;
        static_cast<float *>(ringd_slot(mine1, nullptr))[0] = 2.0f;
        if (ringd_submit(mine0, 0, 1, RINGD_F32, RINGD_SUM, &t0) != 0 || ringd_submit(mine1, 0, 1, RINGD_F32, RINGD_SUM, &t1) != 0 ||
            ringd_wait(mine0, t0, 5000) != 0 || ringd_wait(mine1, t1, 5000) != 0 ||
            static_cast<float *>(ringd_slot(mine0, nullptr))[0] != 3.5f)
            out += "the op of the two-uid group failed\n";
        // Per uid: nobody holds one slot, its limit; two idle connections reach its connection limit.
        expect_refused(as(65534, [&] { return join("other", 0, 1); }), "nobody's second slot",
                       "uid 65534 holds 1 slots, its limit (limits.slots_per_uid)");
        // Another uid sees its own groups only (root's "owned" is left out).
        auto theirs = as(65534, [&] { return fetch_status(sock); });
        if (!theirs) return out + "status as nobody: " + theirs.error().message;
        const nlohmann::json seen = nlohmann::json::parse(*theirs);
        if (seen["groups"].size() != 1 || seen["groups"][0]["name"] != "mine" || seen["groups_of_other_uids"] != 1)
            out += "nobody sees " + seen["groups"].dump() + ", " + seen["groups_of_other_uids"].dump() + " hidden\n";
        auto raw = [&] {
            UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
            sockaddr_un a{};
            a.sun_family = AF_UNIX;
            std::snprintf(a.sun_path, sizeof a.sun_path, "%s", sock.c_str());
            if (::connect(fd.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) out += "raw connect failed\n";
            return fd;
        };
        UniqueFd idle1 = as(65534, raw), idle2 = as(65534, raw);
        expect_refused(as(65534, [&] { return join("other", 0, 1); }), "nobody's fourth connection",
                       "uid 65534 has 3 connections to ringd, its limit (limits.connections_per_uid)");
        // Root is not limited per uid.
        ringd_client *root_more = join("more", 0, 1);
        if (!root_more) out += "root's third slot: " + e + "\n";
        // Status shows each group's owner.
        auto st = fetch_status(sock);
        if (!st) return out + "status: " + st.error().message;
        const nlohmann::json status = nlohmann::json::parse(*st);
        for (const auto &g : status["groups"]) {
            const uint32_t want = g["name"] == "mine" ? 65534 : 0;
            if (g["owner_uid"] != want) out += "owner of group " + g.dump() + "\n";
        }
        if (status["groups"].size() != 3) out += "root sees " + status["groups"].dump() + "\n";

        // Once its trainers are gone the name is free for anyone.
        ringd_close(mine0);
        ringd_close(mine1);
        idle1.reset();
        idle2.reset();
        ringd_client *again = nullptr;
        for (int i = 0; i < 1000 && !again; ++i) {  // up to 10 s
            again = as(65533, [&] { return join("mine", 0, 1); });
            if (!again) ::usleep(10000);
        }
        if (!again) out += "uid 65533 after the group ended: " + e + "\n";
        ringd_close(again);
        // A slot shared by a second group is still the uid's one slot, also once the client that
        // made it has gone (share_slot_of).
        auto join_sharing = [&](const char *group, ringd_client *base) {
            char err[256] = "";
            ringd_options opts{sizeof(ringd_options), sock.c_str(), group, 0, 1, 4096, nullptr, base, 0, 0, 0};
            ringd_client *c = ringd_connect_opts(&opts, err, sizeof err);
            e = err;
            return c;
        };
        ringd_client *base = nullptr;
        for (int i = 0; i < 1000 && !base; ++i) {  // the 65533 client's slot goes once ringd saw it leave
            base = as(65534, [&] { return join("share-base", 0, 1); });
            if (!base) ::usleep(10000);
        }
        if (!base) return out + "nobody's slot for sharing: " + e + "\n";
        ringd_client *sharer = as(65534, [&] { return join_sharing("share-more", base); });
        if (!sharer) out += "nobody's second group on its slot: " + e + "\n";
        ringd_close(base);
        expect_refused(as(65534, [&] { return join("other", 0, 1); }), "nobody's second slot while its shared one lives",
                       "uid 65534 holds 1 slots, its limit (limits.slots_per_uid)");
        ringd_close(sharer);
        ringd_close(root_more);
        ringd_close(root0);
        return out;
    });
    if (!r) RINGD_SKIP("needs root to run a trainer as another user");
    CHECK(*r == "");
    CHECK(d.alive());
}

TEST_CASE("a process's clients of several groups share its slot: one of memory.max_slots, the same memory, their own ops",
          "[daemon]") {
    DaemonOptions o;
    o.max_slots = 2;
    Daemon d(o);
    REQUIRE(d.ready());
    char err[256] = "";
    auto connect = [&](const char *group, int rank, ringd_client *share) {
        ringd_options opts{sizeof(ringd_options), d.socket().c_str(), group, rank, 2, 1 << 20, nullptr, share, 0, 0, 0};
        return ringd_connect_opts(&opts, err, sizeof err);
    };
    // Group a: two ranks, each with its own slot: the host's two.
    ringd_client *a[2] = {connect("share-a", 0, nullptr), connect("share-a", 1, nullptr)};
    REQUIRE((a[0] && a[1]));
    CHECK(connect("share-b", 0, nullptr) == nullptr);
    CHECK_THAT(err, Catch::Contains("all 2 slots are in use"));
    // Group b: each rank on its process's slot of group a.
    ringd_client *b[2] = {connect("share-b", 0, a[0]), connect("share-b", 1, a[1])};
    REQUIRE((b[0] && b[1]));
    const json st = status(d);
    CHECK(st["clients"]["joined"] == 2);
    CHECK(st["memory"]["registrations"] == 2);
    for (int r = 0; r < 2; ++r) {
        size_t na = 0, nb = 0;
        CHECK(ringd_slot(a[r], &na) == ringd_slot(b[r], &nb));
        CHECK((na == size_t{1} << 20 && nb == na));
    }
    // Each group's op on its own range of the same memory; the other's range is untouched.
    constexpr size_t kN = 1000, kB = 4096;  // group a at float 0, group b at float kB
    auto fill = [&](int r) {
        auto *f = static_cast<float *>(ringd_slot(a[r], nullptr));
        for (size_t i = 0; i < kN; ++i) {
            f[i] = static_cast<float>(i + r);
            f[kB + i] = static_cast<float>(3 * i + r);
        }
    };
    auto allreduce = [&](ringd_client **c, size_t offset) {
        uint64_t t[2];
        for (int r = 0; r < 2; ++r) REQUIRE(ringd_submit(c[r], offset * sizeof(float), kN, RINGD_F32, RINGD_SUM, &t[r]) == 0);
        for (int r = 0; r < 2; ++r) CHECK(ringd_wait(c[r], t[r], 10000) == 0);
    };
    fill(0);
    fill(1);
    allreduce(b, kB);
    for (int r = 0; r < 2; ++r) {
        const auto *f = static_cast<const float *>(ringd_slot(a[r], nullptr));
        size_t wrong = 0;
        for (size_t i = 0; i < kN; ++i) wrong += f[kB + i] != static_cast<float>(6 * i + 1) || f[i] != static_cast<float>(i + r);
        CHECK(wrong == 0);
    }
    allreduce(a, 0);
    CHECK(static_cast<const float *>(ringd_slot(a[1], nullptr))[kN - 1] == static_cast<float>(2 * (kN - 1) + 1));
    // Another process cannot name this one's client.
    const pid_t child = ::fork();
    if (child == 0) {
        ringd_client *c = connect("share-c", 0, a[0]);
        ::_exit(c == nullptr && std::strstr(err, "not a joined client of this process") ? 0 : 1);
    }
    int wst = 0;
    REQUIRE(::waitpid(child, &wst, 0) == child);
    CHECK((WIFEXITED(wst) && WEXITSTATUS(wst) == 0));
    // The slot stays while a client uses it: rank 0 of group a leaves, group b goes on over its memory.
    ringd_close(a[0]);
    allreduce(b, kB);
    CHECK(static_cast<const float *>(ringd_slot(b[0], nullptr))[kB + 1] == 14.0f);  // 2 x (6 x 1 + 1)
    CHECK(connect("share-d", 0, nullptr) == nullptr);  // still two slots held
    ringd_close(b[0]);
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (status(d)["clients"]["joined"] != 1 && Clock::now() < deadline) {
    }
    ringd_client *e = connect("share-d", 0, nullptr);  // now there is room
    CHECK(e != nullptr);
    for (ringd_client *c : {a[1], b[1], e})
        if (c) ringd_close(c);
}
