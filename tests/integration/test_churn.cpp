// Trainers joining and leaving while ring ops run: two real ringds over ibverbs (the software
// RDMA device) on 127.0.0.1. Each join registers a slot with the transport on ringd's control
// thread and each leave deregisters it, while the progress thread posts the ring's writes — the
// data path must not share the transport's registrations with the control thread. Every op's
// values and guard bytes are checked here; in the ThreadSanitizer build (./dev tsan) each
// daemon's log must also be free of race reports.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <deque>
#include <memory>
#include <thread>

#include "tests/support/cluster.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;

TEST_CASE("trainers join and leave while ring ops run over ibverbs: every op exact, ringd race-free",
          "[cluster][ibverbs][churn]") {
    // Every op on the ring (direct exchange off), several chunks per segment.
    TestCluster c(2, "20s", std::string(kIbverbsYaml) + "tuning: {direct_max_bytes: 0, chunk_bytes: 128KiB}\n");
    REQUIRE(c.wait_up());
    // A daemon that TSan stopped (halt_on_error) fails the ops below; its report is in its log,
    // which goes with the temp dir: show it however the case ends.
    struct ShowRaces {
        TestCluster &c;
        ~ShowRaces() {
            for (uint32_t h = 0; h < c.n; ++h) {
                const std::string log = c.d[h]->log();
                const auto at = log.find("WARNING: ThreadSanitizer");
                if (at != std::string::npos)
                    std::fprintf(stderr, "host %u's ringd:\n%s\n", h, log.substr(at, 8000).c_str());
            }
        }
    } show_races{c};
    auto ring = connect_all(c, "ring", 1, 4 << 20);

    std::atomic<bool> stop{false};
    std::atomic<uint64_t> joins{0};
    std::string churn_error;  // read after join
    std::thread churn([&] {
        // Trainers of another group come and go on both hosts: one join and one leave a turn,
        // up to 3 of them connected at a time on each host.
        std::deque<std::unique_ptr<Client>> live;
        for (uint64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
            try {
                live.push_back(std::make_unique<Client>(c.d[k % 2]->socket(), "churn" + std::to_string(k % 5), 0, 1,
                                                        256 << 10));
            } catch (const std::exception &e) {
                churn_error = e.what();
                return;
            }
            if (live.size() > 6) live.pop_front();
            joins.fetch_add(1, std::memory_order_relaxed);
        }
    });
    struct StopAndJoin {  // also when a REQUIRE below ends the test case early
        std::atomic<bool> &stop;
        std::thread &t;
        ~StopAndJoin() {
            stop = true;
            if (t.joinable()) t.join();
        }
    } stop_and_join{stop, churn};

    uint64_t ops = 0;
    const auto deadline = Clock::now() + 60s;
    for (; (ops < 20 || joins.load() < 40) && Clock::now() < deadline; ++ops)
        allreduce_checked(ring, ops % 2 ? DType::F32 : DType::I32, ReduceOp::Sum, 200000 + ops * 17, ops + 1);
    stop = true;
    churn.join();
    CHECK(churn_error.empty());
    INFO(ops << " ring ops, " << joins.load() << " trainers joined and left");
    CHECK(ops >= 20);
    CHECK(joins.load() >= 40);  // the churn overlapped the ops
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        CHECK(c.d[h]->alive());
        const auto j = c.status(h);
        CHECK(j["ring"]["ops_ring"].get<uint64_t>() == ops);
        CHECK(j["ops"]["failed"] == 0);
        CHECK(c.d[h]->log().find("ThreadSanitizer") == std::string::npos);  // shown by show_races
    }
}
