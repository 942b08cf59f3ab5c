// Tuner: which algorithm an allreduce of S bytes over n hosts takes. A cost model in the manner
// of NCCL's tuner — a hop latency a, a host's cost per message it sends or takes m, and a link
// rate B from the configuration; p is the largest power of two <= n, L = log2 p, and f = 1 when
// n is not a power of two (the extra hosts fold in before the steps and get the result after):
//   one-shot          a + (n-1)(m + S/B)                   every host sends its whole
//                                                          contribution to every host
//   two-shot          2a + 2(n-1) m + 2(n-1)/n S/B         direct reduce-scatter, then allgather
//   doubling          (L + 2f)(a + m + S/B)                recursive doubling: L swaps of the whole
//                                                          partial result
//   halving-doubling  (2L + 2f)(a + m) + 2(p-1)/p S/B      recursive halving, then doubling: the
//                       + 2f S/B                           ring's bytes in 2L steps
//   ring              2n a + 2(n-1)/n S/B                  2(n-1) ring steps plus the
//                                                          coordinator's report and start
// One-/two-shot, doubling and halving-doubling run on the control thread over the control
// connections and hold the whole op in memory, so they are used only up to
// tuning.direct_max_bytes; above it the ring runs on the data path (registered memory, pipelined
// chunks). Doubling and halving-doubling need every host of the ring domain to speak peer protocol
// 8. Every host computes the same answer from the same configuration, op and protocol; below
// protocol 8 the model is the one the releases of protocol 7 use (no message term), so that a ring
// in a rolling upgrade chooses alike on its old and new hosts.
// tuning.algorithm forces one (within those limits: over the cap or below protocol 8 the model
// chooses among the others).
//
// reduce_scatter and allgather (S = the buffer with a block per rank: the reduce_scatter's input,
// the allgather's output) have two: the ring's n-1 steps, or one-shot, where every host sends each
// other host in one message what it needs of it (reduce_scatter: the blocks of that host's ranks,
// its own ranks reduced; allgather: its own ranks' blocks), the same bytes in one hop:
//   one-shot          a + (n-1)(m + S/(nB))
//   ring              (n+1) a + (n-1)/n S/B                 n-1 ring steps plus the report and start
// Doubling's log2 n steps would only add hops to one-shot's one at the same bytes. A forced
// algorithm other than one-shot or the ring leaves them to the model.
#pragma once

#include <cmath>
#include <cstdint>

#include "daemon/config.h"
#include "proto/types.h"

namespace ringd {

enum class Algorithm : uint32_t { Ring = 0, OneShot = 1, TwoShot = 2, Doubling = 3, HalvingDoubling = 4 };
inline constexpr uint32_t kAlgorithms = 5;
inline constexpr uint16_t kLogAlgorithmsProtocol = 8;  // the peer protocol doubling and halving-doubling need

// Those whose hosts report an op to the coordinator only when it stalls (proto::kReportDeferred).
inline bool deferred_reports(Algorithm a) { return a == Algorithm::Doubling || a == Algorithm::HalvingDoubling; }

struct AlgorithmCost {
    double ring_us = 0, one_shot_us = 0, two_shot_us = 0, doubling_us = 0, halving_doubling_us = 0;
    double of(Algorithm a) const {
        switch (a) {
        case Algorithm::OneShot: return one_shot_us;
        case Algorithm::TwoShot: return two_shot_us;
        case Algorithm::Doubling: return doubling_us;
        case Algorithm::HalvingDoubling: return halving_doubling_us;
        default: return ring_us;
        }
    }
};

// The largest power of two <= n (n >= 1).
inline uint32_t power_of_two_below(uint32_t n) {
    uint32_t p = 1;
    while (p * 2 <= n) p *= 2;
    return p;
}

inline AlgorithmCost algorithm_cost(uint64_t bytes, uint32_t hosts, const Config::Tuning &t,
                                    uint16_t protocol = kLogAlgorithmsProtocol) {
    const double n = hosts, a = t.hop_latency_us, s = static_cast<double>(bytes);
    const double m = protocol >= kLogAlgorithmsProtocol ? t.message_us : 0;
    const double us_per_byte = 8.0 / static_cast<double>(t.link_mbit);  // Mbit/s = bit/us
    const double sb = s * us_per_byte;
    const double p = power_of_two_below(hosts), L = std::log2(p), f = hosts == p ? 0 : 1;
    AlgorithmCost c;
    c.one_shot_us = a + (n - 1) * (m + sb);
    c.two_shot_us = 2 * a + 2 * (n - 1) * m + 2 * (n - 1) / n * sb;
    c.doubling_us = (L + 2 * f) * (a + m + sb);
    c.halving_doubling_us = (2 * L + 2 * f) * (a + m) + 2 * (p - 1) / p * sb + 2 * f * sb;
    c.ring_us = 2 * n * a + 2 * (n - 1) / n * sb;
    return c;
}

// reduce_scatter's and allgather's (see above): `bytes` is S.
inline AlgorithmCost collective_cost(uint64_t bytes, uint32_t hosts, const Config::Tuning &t) {
    const double n = hosts, a = t.hop_latency_us, m = t.message_us;
    const double sb = static_cast<double>(bytes) * 8.0 / static_cast<double>(t.link_mbit);
    AlgorithmCost c;
    c.one_shot_us = a + (n - 1) * (m + sb / n);
    c.ring_us = (n + 1) * a + (n - 1) / n * sb;
    c.two_shot_us = c.doubling_us = c.halving_doubling_us = HUGE_VAL;  // not theirs
    return c;
}

// broadcast's and reduce's (S: the buffer): one-shot sends (or receives) S to (from) every other
// host over the root's link in one hop; the chain moves S over every link once, pipelined, one
// hop per host (with a chunk each, which the hop latency stands for).
inline AlgorithmCost rooted_cost(uint64_t bytes, uint32_t hosts, const Config::Tuning &t) {
    const double n = hosts, a = t.hop_latency_us, m = t.message_us;
    const double sb = static_cast<double>(bytes) * 8.0 / static_cast<double>(t.link_mbit);
    AlgorithmCost c;
    c.one_shot_us = a + (n - 1) * (m + sb);
    c.ring_us = n * (a + m) + sb;
    c.two_shot_us = c.doubling_us = c.halving_doubling_us = HUGE_VAL;  // not theirs
    return c;
}

// `protocol`: the oldest peer protocol among the ring domain's hosts. `bytes`: allreduce's,
// broadcast's and reduce's buffer, reduce_scatter's input, allgather's output. A barrier (no data)
// is one-shot on any ring of more than one host.
// `mesh`: the ring's lanes have data links to every host (peer protocol 12, TCP).
inline Algorithm choose_algorithm(uint64_t bytes, uint32_t hosts, const Config::Tuning &t,
                                  uint16_t protocol = kLogAlgorithmsProtocol, Collective collective = Collective::Allreduce,
                                  bool mesh = false) {
    // An all_to_all goes over the data links to every host (AllToAllEngine; "ring" stands for the
    // lane's engine) where the lanes have them, but for equal blocks of at most direct_max_bytes
    // per rank, which go one-shot with the op's report (no wait for the coordinator's start). With
    // split sizes (count 0: every host knows only its own ranks' sizes) it always takes the links.
    if (collective == Collective::AllToAll && mesh && hosts >= 2 && (bytes == 0 || bytes > t.direct_max_bytes))
        return Algorithm::Ring;
    // A barrier, and an all_to_all without those links (every host's message to every other,
    // whatever its size, over the control connections), are one-shot.
    if (collective == Collective::Barrier || collective == Collective::AllToAll)
        return hosts < 2 ? Algorithm::Ring : Algorithm::OneShot;
    if (hosts < 2 || bytes > t.direct_max_bytes) return Algorithm::Ring;
    if (collective != Collective::Allreduce) {
        const auto forced = static_cast<Algorithm>(t.algorithm);
        if (t.algorithm != Config::Tuning::kAuto && (forced == Algorithm::OneShot || forced == Algorithm::Ring)) return forced;
        const AlgorithmCost c = collective_is_rooted(collective) ? rooted_cost(bytes, hosts, t) : collective_cost(bytes, hosts, t);
        return c.one_shot_us <= c.ring_us ? Algorithm::OneShot : Algorithm::Ring;
    }
    const bool log_ok = protocol >= kLogAlgorithmsProtocol;
    if (t.algorithm != Config::Tuning::kAuto) {
        const auto forced = static_cast<Algorithm>(t.algorithm);
        if (log_ok || !deferred_reports(forced)) return forced;
    }
    const AlgorithmCost c = algorithm_cost(bytes, hosts, t, protocol);
    // Ties go to the one listed first (on two hosts doubling is one-shot: the same frames).
    Algorithm best = Algorithm::OneShot;
    for (Algorithm a : {Algorithm::TwoShot, Algorithm::Doubling, Algorithm::HalvingDoubling, Algorithm::Ring}) {
        if (deferred_reports(a) && !log_ok) continue;
        if (c.of(a) < c.of(best)) best = a;
    }
    return best;
}

inline const char *algorithm_name(Algorithm a) {
    switch (a) {
    case Algorithm::OneShot: return "one-shot";
    case Algorithm::TwoShot: return "two-shot";
    case Algorithm::Doubling: return "doubling";
    case Algorithm::HalvingDoubling: return "halving-doubling";
    default: return "ring";
    }
}

}  // namespace ringd
