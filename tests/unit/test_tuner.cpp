// The tuner's cost model: direct exchange for latency-bound ops, the ring for bandwidth-bound
// ones, never direct above tuning.direct_max_bytes or on one host.
#include <catch2/catch.hpp>

#include "daemon/engine/tuner.h"

using namespace ringd;

TEST_CASE("small ops go by direct exchange, large ones by ring; the crossover follows latency and link rate",
          "[tuner]") {
    Config::Tuning t;  // 1 MiB cap, 100 us, 10 Gbit/s
    CHECK(choose_algorithm(4, 4, t) == Algorithm::Direct);
    CHECK(choose_algorithm(4096, 4, t) == Algorithm::Direct);
    CHECK(choose_algorithm(256u << 20, 4, t) == Algorithm::Ring);
    CHECK(choose_algorithm(4, 1, t) == Algorithm::Ring);  // one host: no exchange at all

    // The crossover of  a + (n-1) S/B  and  2n a + 2(n-1)/n S/B:  S = (2n-1) a B / ((n-1)(1 - 2/n)).
    auto crossover = [&](uint32_t n) {
        uint64_t lo = 1, hi = 64u << 20;
        Config::Tuning open = t;
        open.direct_max_bytes = hi;
        while (lo + 1 < hi) {
            const uint64_t mid = (lo + hi) / 2;
            (choose_algorithm(mid, n, open) == Algorithm::Direct ? lo : hi) = mid;
        }
        return lo;
    };
    const double B = 10'000e6 / 8 / 1e6;  // bytes per us
    CHECK(static_cast<double>(crossover(4)) == Approx(7 * 100 * B / (3 * 0.5)).epsilon(0.001));
    CHECK(crossover(8) < crossover(4));  // more hosts: direct sends more, sooner worth the ring
    Config::Tuning slow = t;
    slow.link_mbit = 1000;
    slow.direct_max_bytes = 64u << 20;
    CHECK(choose_algorithm(100'000, 4, slow) == Algorithm::Ring);  // 10x slower link: 10x lower crossover
    CHECK(choose_algorithm(20'000, 4, slow) == Algorithm::Direct);

    Config::Tuning capped = t;
    capped.direct_max_bytes = 0;  // ring only
    CHECK(choose_algorithm(4, 4, capped) == Algorithm::Ring);
    capped.direct_max_bytes = 1024;
    CHECK(choose_algorithm(1024, 4, capped) == Algorithm::Direct);
    CHECK(choose_algorithm(1025, 4, capped) == Algorithm::Ring);
}
