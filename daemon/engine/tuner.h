// Tuner: which algorithm an allreduce of S bytes over n hosts takes. A cost model in the manner
// of NCCL's tuner — a hop latency a and a link rate B from the configuration:
//   one-shot  a + (n-1) S / B          every host sends its whole contribution to every host
//   two-shot  2a + 2(n-1)/n S / B      direct reduce-scatter, then direct allgather
//   ring      2n a + 2(n-1)/n S / B    2(n-1) ring steps plus the coordinator's report and start
// One- and two-shot run on the control thread over the control connections and hold the whole
// op in memory, so they are used only up to tuning.direct_max_bytes; above it the ring runs on
// the data path (registered memory, pipelined chunks). Every host computes the same answer from
// the same configuration and op.
#pragma once

#include <cstdint>

#include "daemon/config.h"

namespace ringd {

enum class Algorithm : uint32_t { Ring = 0, OneShot = 1, TwoShot = 2 };

struct AlgorithmCost {
    double ring_us = 0, one_shot_us = 0, two_shot_us = 0;
};

inline AlgorithmCost algorithm_cost(uint64_t bytes, uint32_t hosts, const Config::Tuning &t) {
    const double n = hosts, alpha = t.hop_latency_us, s = static_cast<double>(bytes);
    const double us_per_byte = 8.0 / static_cast<double>(t.link_mbit);  // Mbit/s = bit/us
    AlgorithmCost c;
    c.one_shot_us = alpha + (n - 1) * s * us_per_byte;
    c.two_shot_us = 2 * alpha + 2 * (n - 1) / n * s * us_per_byte;
    c.ring_us = 2 * n * alpha + 2 * (n - 1) / n * s * us_per_byte;
    return c;
}

inline Algorithm choose_algorithm(uint64_t bytes, uint32_t hosts, const Config::Tuning &t) {
    if (hosts < 2 || bytes > t.direct_max_bytes) return Algorithm::Ring;
    const AlgorithmCost c = algorithm_cost(bytes, hosts, t);
    if (c.one_shot_us <= c.two_shot_us && c.one_shot_us <= c.ring_us) return Algorithm::OneShot;
    return c.two_shot_us <= c.ring_us ? Algorithm::TwoShot : Algorithm::Ring;
}

inline const char *algorithm_name(Algorithm a) {
    return a == Algorithm::OneShot ? "one-shot" : a == Algorithm::TwoShot ? "two-shot" : "ring";
}

}  // namespace ringd
