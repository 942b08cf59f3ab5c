// The tuner's cost model: one-shot for latency-bound ops, two-shot in between, the ring above
// tuning.direct_max_bytes; never anything but the ring on one host.
#include <catch2/catch.hpp>

#include "daemon/engine/tuner.h"

using namespace ringd;

TEST_CASE("one-shot for the smallest ops, two-shot up to the cap, the ring above; crossovers follow the model",
          "[tuner]") {
    Config::Tuning t;  // 256 KiB cap, 100 us, 10 Gbit/s
    CHECK(choose_algorithm(4, 4, t) == Algorithm::OneShot);
    CHECK(choose_algorithm(4096, 4, t) == Algorithm::OneShot);
    CHECK(choose_algorithm(256 << 10, 4, t) == Algorithm::TwoShot);
    CHECK(choose_algorithm((256 << 10) + 1, 4, t) == Algorithm::Ring);  // over the cap
    CHECK(choose_algorithm(256u << 20, 4, t) == Algorithm::Ring);
    CHECK(choose_algorithm(4, 1, t) == Algorithm::Ring);  // one host: no exchange at all

    // one-shot vs two-shot:  a + (n-1) S/B = 2a + 2(n-1)/n S/B  at  S = a B / ((n-1)(1 - 2/n)).
    auto crossover = [&](uint32_t n, Config::Tuning tt) {
        uint64_t lo = 1, hi = 64u << 20;
        tt.direct_max_bytes = hi;
        while (lo + 1 < hi) {
            const uint64_t mid = (lo + hi) / 2;
            (choose_algorithm(mid, n, tt) == Algorithm::OneShot ? lo : hi) = mid;
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
