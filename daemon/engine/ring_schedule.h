// Ring schedules: each collective on a ring of n hosts, written as what host r does at each step
// with the segment it sends and the one it receives, in the primitives of NCCL's device code
// (prims_simple.h): the engine (ring_engine.h) executes any schedule chunk by chunk, pipelined.
//
// A segment is the part of the op's buffer one host ends with (reduce-scatter) or starts with
// (allgather): for allreduce one n-th of the buffer; for reduce_scatter and allgather the blocks of
// that host's ranks, in the group's rank order (so the ranks need not be contiguous per host, and
// hosts may have different numbers of them). Both ends of every link compute the same schedule.
//
// broadcast and reduce are chains along the ring: one segment (segment 0, the whole buffer) goes
// from the root rank's host around the ring (broadcast: each host receives it at one step and
// forwards it at the next, chunk by chunk), or from the host after the root's around to it
// (reduce: each host adds its contribution and forwards the partial). Every link carries the
// buffer once, so the op takes S at the link's rate plus one chunk per hop.
#pragma once

#include <cstdint>
#include <vector>

#include "proto/types.h"

namespace ringd {

// What a host does with one chunk of a step.
enum class Prim : uint8_t {
    None,  // nothing at this step (a chain's hosts send or receive at one step each)
    // Sending side.
    Send,      // step 0 of a reduce-scatter: the local ranks' contributions folded, then sent
    CopySend,  // step 0 of an allgather: the local ranks' inputs gathered into the output, then sent
    Forward,   // any later step: what the previous step's receive left, sent on
    // Receiving side.
    RecvReduceSend,      // reduced with this host's contribution; the partial is sent next step
    RecvReduceCopy,      // the last reduce-scatter step: final, delivered to the block's owner
    RecvReduceCopySend,  // allreduce's last reduce-scatter step: final, to every local rank, and
                         // sent at the allgather's step 0
    RecvCopySend,        // lands in the output, delivered to every local rank, sent on
    RecvCopy,            // the last allgather step: lands in the output, delivered
};

// The two halves of a ring collective; the value is part of a message's tag.
enum RingPhase : uint32_t { kReduceScatter = 0, kAllgather = 1 };

struct RingStep {
    RingPhase phase;
    uint32_t step;      // within the phase
    uint32_t send_seg;  // segment sent to the next host
    uint32_t recv_seg;  // segment received from the previous host
    Prim send, recv;
};

namespace schedule {

inline uint32_t mod(int64_t x, uint32_t n) { return static_cast<uint32_t>(((x % n) + n) % n); }

// Ring reduce-scatter: host r ends with the whole reduction of segment `end`. At step s it sends
// the partial of segment end-s-1 and receives that of end-s-2, which it reduces with its own.
inline void reduce_scatter(std::vector<RingStep> &out, uint32_t n, uint32_t end, Prim last) {
    for (uint32_t s = 0; s + 1 < n; ++s)
        out.push_back({kReduceScatter, s, mod(int64_t{end} - s - 1, n), mod(int64_t{end} - s - 2, n),
                       s == 0 ? Prim::Send : Prim::Forward, s + 2 < n ? Prim::RecvReduceSend : last});
}

// Ring allgather: host r starts with segment `start`. At step s it sends segment start-s and
// receives start-s-1. `first`: how step 0's data is ready (gathered here, or left by a
// reduce-scatter that ended with this segment).
inline void allgather(std::vector<RingStep> &out, uint32_t n, uint32_t start, Prim first) {
    for (uint32_t s = 0; s + 1 < n; ++s)
        out.push_back({kAllgather, s, mod(int64_t{start} - s, n), mod(int64_t{start} - s - 1, n),
                       s == 0 ? first : Prim::Forward, s + 2 < n ? Prim::RecvCopySend : Prim::RecvCopy});
}

// Broadcast from host `root` along the ring: host r, `d` hops after the root, receives the
// buffer at step d - 1 and forwards it at step d (the last host only receives). Every step is
// in the allgather's phase (the result, in the dtype).
inline void chain_broadcast(std::vector<RingStep> &out, uint32_t n, uint32_t r, uint32_t root) {
    const uint32_t d = mod(int64_t{r} - root, n);
    for (uint32_t s = 0; s + 1 < n; ++s) {
        const Prim send = s != d ? Prim::None : d == 0 ? Prim::CopySend : Prim::Forward;
        const Prim recv = s + 1 != d ? Prim::None : d + 1 < n ? Prim::RecvCopySend : Prim::RecvCopy;
        out.push_back({kAllgather, s, 0, 0, send, recv});
    }
}

// Reduce to host `root` along the ring: the host after the root starts (its contribution, at
// step 0); host r, `e` hops before the root, receives the partial at step n - 2 - e, adds its own
// and forwards it at step n - 1 - e; the root's host ends with the result. The reduce-scatter's
// phase (partial results).
inline void chain_reduce(std::vector<RingStep> &out, uint32_t n, uint32_t r, uint32_t root) {
    const uint32_t e = mod(int64_t{root} - r, n);
    for (uint32_t s = 0; s + 1 < n; ++s) {
        const Prim send = e == 0 || s != n - 1 - e ? Prim::None : s == 0 ? Prim::Send : Prim::Forward;
        const Prim recv = e + 1 >= n || s != n - 2 - e ? Prim::None : e == 0 ? Prim::RecvReduceCopy : Prim::RecvReduceSend;
        out.push_back({kReduceScatter, s, 0, 0, send, recv});
    }
}

// The collectives, for host r of n. Allreduce is the reduce-scatter that leaves segment r+1 on
// host r (the order of peer protocol 1, which every release keeps), then the allgather of it;
// reduce_scatter leaves the segment of host r's ranks on host r, and allgather starts with it.
// broadcast and reduce: `root` is the root rank's host. barrier and all_to_all have no ring
// schedule (the direct exchange runs them).
inline std::vector<RingStep> ring(Collective c, uint32_t r, uint32_t n, uint32_t root = 0) {
    std::vector<RingStep> v;
    switch (c) {
    case Collective::Broadcast: chain_broadcast(v, n, r, root); break;
    case Collective::Reduce: chain_reduce(v, n, r, root); break;
    case Collective::Barrier:
    case Collective::AllToAll: break;
    case Collective::Allreduce:
        reduce_scatter(v, n, (r + 1) % n, Prim::RecvReduceCopySend);
        allgather(v, n, (r + 1) % n, Prim::Forward);
        break;
    case Collective::ReduceScatter: reduce_scatter(v, n, r, Prim::RecvReduceCopy); break;
    case Collective::Allgather: allgather(v, n, r, Prim::CopySend); break;
    }
    return v;
}

}  // namespace schedule
}  // namespace ringd
