// Tuner: which algorithm an allreduce of S bytes over n hosts takes — the ring (bandwidth-
// optimal: 2(n-1)/n S per link, 2(n-1) message steps plus the coordinator's two) or direct
// exchange (latency-optimal: one step, (n-1) S per link). A cost model in the manner of NCCL's
// tuner, fed the configured hop latency and link rate; every host computes the same answer from
// the same configuration and op.
#pragma once

#include <cstdint>

#include "daemon/config.h"

namespace ringd {

enum class Algorithm { Ring, Direct };

struct AlgorithmCost {
    double ring_us = 0, direct_us = 0;
};

inline AlgorithmCost algorithm_cost(uint64_t bytes, uint32_t hosts, const Config::Tuning &t) {
    const double n = hosts, alpha = t.hop_latency_us;
    const double us_per_byte = 8.0 / static_cast<double>(t.link_mbit);  // Mbit/s = bit/us
    AlgorithmCost c;
    c.direct_us = alpha + (n - 1) * static_cast<double>(bytes) * us_per_byte;
    c.ring_us = 2 * n * alpha + 2 * (n - 1) / n * static_cast<double>(bytes) * us_per_byte;
    return c;
}

inline Algorithm choose_algorithm(uint64_t bytes, uint32_t hosts, const Config::Tuning &t) {
    if (hosts < 2 || bytes > t.direct_max_bytes) return Algorithm::Ring;
    const AlgorithmCost c = algorithm_cost(bytes, hosts, t);
    return c.direct_us <= c.ring_us ? Algorithm::Direct : Algorithm::Ring;
}

}  // namespace ringd
