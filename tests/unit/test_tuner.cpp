// The tuner's cost model: one-shot for latency-bound ops, two-shot in between, the ring above
// tuning.direct_max_bytes; never anything but the ring on one host.
#include <catch2/catch.hpp>

#include "daemon/engine/tuner.h"

using namespace ringd;

TEST_CASE("one-shot for the smallest ops, then doubling or two-shot up to the cap, the ring above; crossovers "
          "follow the model",
          "[tuner]") {
    Config::Tuning t;  // 256 KiB cap, 100 us, 40 us a message, 10 Gbit/s
    CHECK(choose_algorithm(4, 4, t) == Algorithm::OneShot);
    CHECK(choose_algorithm(4096, 4, t) == Algorithm::OneShot);
    // one-shot vs doubling on 4 hosts: a + 3(m + S/B) = 2(a + m + S/B)  at  S = (a - m) B.
    CHECK(choose_algorithm(74999, 4, t) == Algorithm::OneShot);
    CHECK(choose_algorithm(75001, 4, t) == Algorithm::Doubling);
    CHECK(choose_algorithm(256 << 10, 4, t) == Algorithm::Doubling);
    CHECK(choose_algorithm(256 << 10, 4, t, 7) == Algorithm::TwoShot);  // a ring of protocol 7
    CHECK(choose_algorithm((256 << 10) + 1, 4, t) == Algorithm::Ring);  // over the cap
    CHECK(choose_algorithm(256u << 20, 4, t) == Algorithm::Ring);
    CHECK(choose_algorithm(4, 1, t) == Algorithm::Ring);  // one host: no exchange at all

    // one-shot vs two-shot (protocol 7: no doubling, and protocol 7's model, without m):
    //   a + (n-1) S/B = 2a + 2(n-1)/n S/B  at  S = a B / ((n-1)(1 - 2/n)).
    auto crossover = [&](uint32_t n, Config::Tuning tt) {
        uint64_t lo = 1, hi = 64u << 20;
        tt.direct_max_bytes = hi;
        while (lo + 1 < hi) {
            const uint64_t mid = (lo + hi) / 2;
            (choose_algorithm(mid, n, tt, 7) == Algorithm::OneShot ? lo : hi) = mid;
        }
        return lo;
    };
    const double B = 10'000e6 / 8 / 1e6;  // bytes per us
    CHECK(static_cast<double>(crossover(4, t)) == Approx(100 * B / (3 * 0.5)).epsilon(0.001));
    CHECK(crossover(8, t) < crossover(4, t));  // more hosts: one-shot sends more, two-shot sooner
    Config::Tuning slow = t;
    slow.link_mbit = 1000;
    CHECK(static_cast<double>(crossover(4, slow)) == Approx(crossover(4, t) / 10.0).epsilon(0.001));
    CHECK(choose_algorithm(2, 2, t) == Algorithm::OneShot);  // two hosts: the same bytes, one hop fewer
    CHECK(choose_algorithm(256 << 10, 2, t) == Algorithm::OneShot);

    // The model itself: two-shot never loses to the ring (same bytes, fewer hops).
    for (uint64_t s : {uint64_t{1}, uint64_t{1} << 20, uint64_t{1} << 30}) {
        const auto c = algorithm_cost(s, 4, t);
        CHECK(c.two_shot_us < c.ring_us);
    }

    Config::Tuning capped = t;
    capped.direct_max_bytes = 0;  // ring only
    CHECK(choose_algorithm(4, 4, capped) == Algorithm::Ring);
    capped.direct_max_bytes = 1024;
    CHECK(choose_algorithm(1024, 4, capped) == Algorithm::OneShot);
    CHECK(choose_algorithm(1025, 4, capped) == Algorithm::Ring);
}

TEST_CASE("doubling for small ops on many hosts, halving-doubling for larger ones; neither below protocol 8; "
          "tuning.algorithm forces one within the cap",
          "[tuner]") {
    Config::Tuning t;  // 100 us a hop, 40 us a message, 10 Gbit/s
    // Few hosts: one-shot's n - 1 messages are still cheaper than log2 n hops.
    CHECK(choose_algorithm(4096, 2, t) == Algorithm::OneShot);  // two hosts: doubling is one-shot (a tie)
    CHECK(choose_algorithm(4096, 4, t) == Algorithm::OneShot);
    // 16 hosts: 4 hops of doubling beat 15 messages per host; at 500 Mbit/s halving-doubling's
    // fewer bytes win sooner.
    CHECK(choose_algorithm(4096, 16, t) == Algorithm::Doubling);
    Config::Tuning slow = t;
    slow.link_mbit = 500;
    CHECK(choose_algorithm(4096, 16, slow) == Algorithm::Doubling);
    CHECK(choose_algorithm(64 << 10, 16, slow) == Algorithm::HalvingDoubling);
    CHECK(choose_algorithm(256 << 10, 64, slow) == Algorithm::HalvingDoubling);
    CHECK(choose_algorithm(4096, 1024, t) == Algorithm::Doubling);
    // Below protocol 8 the model is protocol 7's (a rolling upgrade: old and new hosts choose
    // alike): on 3 hosts 200 KB is two-shot there, one-shot with the message term.
    CHECK(choose_algorithm(200000, 3, t, 7) == Algorithm::TwoShot);
    CHECK(choose_algorithm(200000, 3, t) == Algorithm::OneShot);
    // Every host must speak protocol 8 for them.
    CHECK(choose_algorithm(4096, 16, t, 7) == Algorithm::OneShot);
    CHECK(choose_algorithm(256 << 10, 16, t, 7) != Algorithm::HalvingDoubling);
    // The model: doubling's steps grow like log2 n, one-shot's messages like n.
    const auto c16 = algorithm_cost(4096, 16, t), c1024 = algorithm_cost(4096, 1024, t);
    CHECK(c1024.doubling_us == Approx(c16.doubling_us * 10 / 4));
    CHECK(c1024.one_shot_us > 50 * c16.one_shot_us);
    // Not a power of two: the extra hosts fold in and out, two steps more.
    CHECK(algorithm_cost(4096, 24, t).doubling_us == Approx(c16.doubling_us * 6 / 4));

    Config::Tuning forced = t;
    forced.algorithm = static_cast<uint32_t>(Algorithm::HalvingDoubling);
    CHECK(choose_algorithm(4, 2, forced) == Algorithm::HalvingDoubling);
    CHECK(choose_algorithm((256 << 10) + 1, 4, forced) == Algorithm::Ring);  // over the cap
    CHECK(choose_algorithm(4, 4, forced, 7) == Algorithm::OneShot);           // below protocol 8: the model
    CHECK(choose_algorithm(4, 1, forced) == Algorithm::Ring);
}

TEST_CASE("reduce_scatter and allgather: one-shot up to the cap (one hop, the ring's bytes), the ring above; a "
          "forced algorithm they do not have leaves them to the model",
          "[tuner]") {
    Config::Tuning t;  // 256 KiB cap, 100 us, 40 us a message, 10 Gbit/s
    for (Collective c : {Collective::ReduceScatter, Collective::Allgather}) {
        for (uint32_t n : {2u, 3u, 8u, 16u}) {
            CHECK(choose_algorithm(4, n, t, 10, c) == Algorithm::OneShot);
            CHECK(choose_algorithm(256 << 10, n, t, 10, c) == Algorithm::OneShot);
            CHECK(choose_algorithm((256 << 10) + 1, n, t, 10, c) == Algorithm::Ring);
        }
        CHECK(choose_algorithm(4, 1, t, 10, c) == Algorithm::Ring);
        // Where messages cost more than hops, the ring's n-1 hops win: (n-1) m > n a.
        Config::Tuning slow = t;
        slow.message_us = 200;
        CHECK(choose_algorithm(4096, 8, slow, 10, c) == Algorithm::Ring);
        CHECK(collective_cost(4096, 8, slow).one_shot_us > collective_cost(4096, 8, slow).ring_us);
        for (auto forced : {Algorithm::Doubling, Algorithm::HalvingDoubling, Algorithm::TwoShot}) {
            Config::Tuning f = t;
            f.algorithm = static_cast<uint32_t>(forced);
            CHECK(choose_algorithm(4096, 4, f, 10, c) == Algorithm::OneShot);
        }
        Config::Tuning ring = t;
        ring.algorithm = static_cast<uint32_t>(Algorithm::Ring);
        CHECK(choose_algorithm(4096, 4, ring, 10, c) == Algorithm::Ring);
    }
}
