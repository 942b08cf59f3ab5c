// A rolling upgrade (docs/operations.md, Upgrading): a ring of the previous release's ringd (its
// tag, built by ./dev build into build-previous/) is restarted host by host on this build. The
// two speak protocol 8 with each other (this build speaks 12 down to 7; the dialer falls back when
// the older host refuses its hello in an Error frame), so a ring of both forms and runs, its
// generation at 8 on every host (the coordinator decides it for all from protocol 9 on) until
// every host has been upgraded. reduce_scatter and allgather need protocol 10 (broadcast, reduce
// and barrier 11) on every host of a group: in the mixed ring they fail at once on every rank,
// naming the older hosts, and the group's allreduce stays exact. Jobs over the hosts that are
// not being restarted loop through every restart without one failed op, every value checked; the
// job over every host fails only while a host of it restarts, and runs exact once it is back.
// Skips (77) when the previous release was not built (a clone without the tag).
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <thread>

#include "proto/frame.h"
#include "tests/support/cluster.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;

namespace {

constexpr size_t kSlot = 4 << 20;

// A step of a job: the ring (a large op) and direct exchange (small ones: one-shot, and 200 KB,
// which both releases' models send by two-shot below protocol 8), every value checked.
void step(Clients &cl, uint64_t seed) {
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 600000, seed);
    allreduce_checked(cl, DType::BF16, ReduceOp::Avg, 777, seed + 1);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 50000, seed + 2);
}

std::string pair_of(uint32_t a, uint32_t b) { return "node" + std::to_string(a) + ",node" + std::to_string(b); }

}  // namespace

TEST_CASE("a rolling upgrade from the previous release: a ring of both runs at protocol 8, jobs on other hosts "
          "never fail, every value exact",
          "[upgrade]") {
    const std::string previous = env_or("RINGD_PREVIOUS_BIN", "build-previous/build/daemon/ringd");
    struct stat st{};
    if (::stat(previous.c_str(), &st) != 0) {
        WARN("no previous release's ringd at " << previous << " (./dev build makes it from the tag): skipped");
        std::exit(77);
    }
    const std::string current = env_or("RINGD_BIN", "build/daemon/ringd");
    ClusterOptions o{"10s", "", "", "64MiB"};
    o.bin = previous;
    // Namespace hosts where this machine allows them (root), else 127.0.0.1 with a port each.
    std::unique_ptr<NetnsHosts> hosts;
    if (NetnsHosts::available()) hosts = std::make_unique<NetnsHosts>(3);
    else WARN("no network namespaces here (not root?): hosts on 127.0.0.1");
    o.netns = hosts.get();
    TestCluster c(3, o);
    REQUIRE(c.wait_up());
    CHECK(c.status(0)["version"] == "0.3.0");
    uint64_t seed = 1;
    auto all = connect_all(c, "all", 1, kSlot);
    step(all, seed += 10);

    uint64_t generation = 1;
    for (uint32_t h : {2u, 0u, 1u}) {  // the last host first, then the coordinator, then the one between
        INFO("upgrading node" << h);
        const uint32_t a = (h + 1) % 3, b = (h + 2) % 3;
        const std::string group = "pair-" + std::to_string(h);
        // The job over the two other hosts loops on its own thread before, while and after h
        // restarts.
        LoopingJob pair(connect_on(c, group, {std::min(a, b), std::max(a, b)}, {1, 1},
                                   pair_of(std::min(a, b), std::max(a, b)), kSlot));
        REQUIRE(job_moves(pair));
        all.clear();  // h's trainer goes with its ringd; the job over every host restarts after
        REQUIRE(c.d[h]->stop() == 0);
        REQUIRE(job_moves(pair));
        c.d[h]->set_bin(current);
        c.d[h]->start();
        REQUIRE(c.d[h]->ready());
        ++generation;
        REQUIRE(c.wait_up({generation, generation, generation}));
        REQUIRE(job_moves(pair));
        check_clean(pair.stop());
        for (uint32_t x : {a, b}) CHECK(c.group(x, group)["ops_failed"] == 0);
        all = connect_all(c, "all", 1, kSlot);
        step(all, seed += 10);
        // Every host runs the generation at the oldest version of its hosts: 8 until the last,
        // the same on every host whichever of them coordinates.
        for (uint32_t x = 0; x < c.n; ++x) {
            INFO("host " << x);
            CHECK(c.status(x)["ring"]["protocol"] == (h == 1 ? proto::kPeerProtocolVersion : 8));
        }
        CHECK(c.status(h)["version"] == "0.4.0");
        // It found an older peer by the hello it refused (node1 last: no older peer was left).
        const bool found = c.d[h]->log().find("does not speak protocol " + std::to_string(proto::kPeerProtocolVersion)) != std::string::npos;
        CHECK(found == (h != 1));
        if (h == 2) {
            // node2 runs this build, node0 and node1 the previous release: node2's trainer (rank 2
            // of 3) submits a reduce_scatter, the others (whose ringd has none) an allreduce of the
            // same seq. It fails at once on every rank, node2's naming both older hosts, and the
            // group's next op, an allreduce, is exact.
            Clients mixed;
            for (uint32_t x = 0; x < 3; ++x)
                mixed.push_back(std::make_unique<Client>(c.d[x]->socket(), "mixed", 0, 1, kSlot, "", 0, x == 2 ? 2 : 0,
                                                         x == 2 ? 3 : 0));
            std::vector<uint64_t> tickets(3);
            for (uint32_t x = 0; x < 2; ++x) tickets[x] = mixed[x]->submit(0, 48, RINGD_F32, RINGD_SUM);
            tickets[2] = mixed[2]->submit(RINGD_REDUCE_SCATTER, 16, RINGD_F32, RINGD_SUM, 0, 4096);
            const auto t0 = std::chrono::steady_clock::now();
            for (uint32_t x = 0; x < 3; ++x) {
                INFO("node" << x << ": " << ringd_last_error(mixed[x]->get()));
                CHECK(ringd_wait(mixed[x]->get(), tickets[x], 20000) != 0);
            }
            CHECK(std::chrono::steady_clock::now() - t0 < 5s);  // at once, not at the op timeout (10 s)
            const std::string why = ringd_last_error(mixed[2]->get());
            CHECK_THAT(why, Catch::Contains("needs peer protocol 10") && Catch::Contains("node0 (peer protocol 8)") &&
                                Catch::Contains("node1 (peer protocol 8)") && Catch::Contains("allreduce still runs"));
            allreduce_checked(mixed, DType::F32, ReduceOp::Sum, 600000, seed += 10);
            // A broadcast (protocol 11) the same way, named likewise; allreduce goes on.
            for (uint32_t x = 0; x < 2; ++x) tickets[x] = mixed[x]->submit(0, 48, RINGD_F32, RINGD_SUM);
            tickets[2] = mixed[2]->submit(RINGD_BROADCAST, 48, RINGD_F32, RINGD_SUM, 0, 0, 1);
            for (uint32_t x = 0; x < 3; ++x) {
                INFO("node" << x << ": " << ringd_last_error(mixed[x]->get()));
                CHECK(ringd_wait(mixed[x]->get(), tickets[x], 20000) != 0);
            }
            CHECK_THAT(ringd_last_error(mixed[2]->get()),
                       Catch::Contains("a broadcast needs peer protocol 11") && Catch::Contains("node0 (peer protocol 8)") &&
                           Catch::Contains("node1 (peer protocol 8)"));
            allreduce_checked(mixed, DType::F32, ReduceOp::Sum, 600000, seed += 10);
        }
    }
    // Every host runs this build now: its protocol, and the handshakes carry what each host runs.
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const json s = c.status(h);
        CHECK(s["ring"]["protocol"] == proto::kPeerProtocolVersion);
        CHECK(s["ring"]["hosts_differ"].empty());
        for (const auto &m : s["ring"]["members"]) CHECK(m["config_version"].get<std::string>().size() == 12);
    }
    step(all, seed += 10);
    auto pair = connect_on(c, "after", {0, 2}, {1, 1}, "node0,node2", kSlot);
    step(pair, seed += 10);
}
