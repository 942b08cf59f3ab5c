// RingEngine: the cross-host part of a ring collective, over any Transport. It executes a
// schedule (ring_schedule.h: per step, the segment sent, the segment received, and the primitive
// applied to each) chunk by chunk: allreduce is the reduce-scatter schedule followed by the
// allgather one, reduce_scatter and allgather are each one of them, broadcast and reduce are
// chains of the allgather's and the reduce-scatter's primitives over one segment (the buffer).
//
// The host's contribution (reduced over its local ranks as the ring first touches it) lies in a
// registered data region, local rank 0's slot. The op's segments are cut into chunks; chunks are
// pipelined: while chunk j of step s is on the wire, chunk j-1 is being reduced and chunk j+1 is
// being sent. Reduce-scatter receives land in a registered staging area (chunk slots, reused:
// `depth` of the largest chunk, or as many smaller ones as fit there) and are reduced with the
// data region's contribution in place, in their slot, and forwarded from it (the slot is free
// once that send is done; a receive keeps its slot only while another one is free, else its
// partial goes through the data region). So the data region is only read in the reduce-scatter,
// but for the last step's result, and the send copies from memory the reduction just wrote.
// Allgather receives land straight in the data region's output. reduce_scatter uses its input
// range as the allreduce uses its buffer: it may hold partial results afterwards (the output
// range holds the result).
//
// avg (reduce.h): every contribution is scaled by 2^-K where the ring first touches it (2^K >=
// 2 x avg_divisor), so that no partial sum overflows, and the result by 2^K/avg_divisor in the
// last reduce-scatter step; both fused into reductions that run anyway, but for one case: with
// one local rank on a host among hosts with more, its own segment is scaled in place before its
// step-0 send (1/n of the data, in cache). When every host has one rank (avg_divisor == hosts),
// step 0 carries raw values and the receiver scales them.
//
// f16/bf16 sums and averages travel in f32 in the reduce-scatter (partial_dtype, proto/types.h)
// and are rounded once, in its last step; the allgather carries the rounded result in the dtype.
// Their partial sums live in an f32 work area (registered, after the staging slots; see
// work_bytes()); an op larger than it runs as several passes of the ring over windows that fit:
// for allreduce a range of the buffer, for reduce_scatter the same sub-range of every rank's block
// (so that every host has its share of every window).
//
// Several local ranks: their buffers (`locals`, besides the data region, which is local rank
// 0's) are folded in chunk by chunk where the ring first touches a chunk — before a step-0 send,
// or in the reduction of a received chunk — and each chunk's final value is written to them as
// soon as it is known (the last reduce-scatter step, or an allgather receive), so that neither
// the local reduction nor the copy-out is a pass of its own. An allgather gathers its local
// ranks' inputs the same way, chunk by chunk before its step-0 send.
//
// Both ends of a link post its messages in the same canonical order (step-major, then chunk), so
// a transport may rely on in-order arrival for flow control, and nothing can deadlock.
//
// Sends from the data region go by reference where the transport can (post_send_stable: TCP
// sends a trainer's memfd slot with sendfile, one copy per byte instead of two), in ops of
// kConfirmBytes or more on links whose SendDone does not mean delivered. The ring itself keeps
// those bytes unchanged until the next host has them: a segment is sent only after its last
// write of the op (a reduce-scatter sends a segment the step after it received it and never
// receives it again; in allreduce its next write is the allgather receive of the same segment,
// whose value the next host's reduction of what it received went into; an allgather sends
// segments that nothing writes again in the op). What the ring cannot see is the next host's
// reading of its last messages, so such an op ends with a delivery marker: each host, once it
// has received all of the op, sends an empty message back to the previous host, and its own op
// ends only when the next host's marker is in. Until then the trainer does not get its buffer
// back. One hop of latency, on ops of 32 MiB and more (below that it costs more time than the
// copy: docs/perf.md); every host decides it from the op's size and the transport, which all
// hosts share.
//
// Compressed wire (op.wire, wire.h; allreduce, reduce_scatter and reduce of f32/bf16 sum/avg):
// every partial is f32 — for f32 data in the data region, as exact f32 keeps its partials; for
// bf16 in the work area, in windows, as f16/bf16 sums do — and what travels is its encoding. A
// host encodes a partial once, when it is complete (its own contribution at step 0, or its
// contribution plus what it received, decoded and accumulated in f32), in place (the encoding
// takes at most the f32's bytes), and sends it from there. A reduce-scatter receive lands encoded
// in a staging slot, which is free again as soon as it is decoded. The last reduce-scatter step
// of a reduce_scatter or reduce delivers the f32 sum rounded to the dtype (no encoding);
// allreduce's encodes the sum once more, and that encoding is what the allgather forwards
// unchanged: every host, the sum's own included, delivers its decoding, so that every rank ends
// with the same values. Allgather receives land where the chunk's partial was (after the
// reduce-scatter's send of it is done) and are forwarded from there; in the data region a chunk is
// decoded over its encoding only once that forward is out. Each value is thus encoded at most
// once per host in the reduce-scatter and once more for the allgather. With error feedback
// (op.residual), every encoding adds the value's residual from the previous op and keeps what it
// lost of it. Sends go by copy, never by reference, so no delivery marker. A chunk of one value
// may take more bytes encoded (fp16/int8: its block's scale) than as an f32: in the data region a
// piece's last value joins the chunk before it (an op with a piece of one value runs in the work
// area), and work-area offsets leave one spare element after each piece.
//
// The messages of allreduce are those of peer protocol 1's ring (tests/unit/test_ring_golden.cpp
// pins them): tags, sizes, order and bytes.
//
// Called on the progress thread. After a failed run the links must not be reused: receives may
// still be posted into the caller's memory (the daemon aborts the ring generation).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "daemon/engine/ring_schedule.h"
#include "daemon/transport/transport.h"
#include "proto/types.h"

namespace ringd {

struct RingPosition {
    uint32_t rank = 0;  // this host's index in ring order
    uint32_t size = 1;  // hosts
    Link *next = nullptr;  // to rank + 1 (we send)
    Link *prev = nullptr;  // from rank - 1 (we receive); the same link when size == 2
};

struct RingOptions {
    // The ring's messages: chunk_bytes for large ops; an op whose segments would have fewer than
    // 8 of them halves its chunk while that stays at least 512 KiB (chunk_for()), so that
    // mid-sized ops keep their pipeline. The staging slots are as many chunks as fit in
    // chunk_bytes x depth, so the bytes in flight are the same for every chunk.
    uint64_t chunk_bytes = 2 << 20;
    uint32_t depth = 4;  // reduce-scatter receives of chunk_bytes in flight (staging slots)
    // How the progress thread waits for the transport during an op (config `poll`): -1 = busy
    // (never block), 0 = event (block at once), > 0 = adaptive (spin this long after the last
    // progress, then block).
    int spin_us = 50;
    // The f32 work area for f16/bf16 sum/avg (bytes; 0: 64 chunks of up to 512 KiB — 32 MiB —
    // or 16 chunks where they are larger, at most 256 MiB). An op of more than work_bytes/4
    // elements runs in windows of that many; their chunks are chosen per window.
    uint64_t work_bytes = 0;
};

struct RingOp {
    Collective collective = Collective::Allreduce;
    DType dtype = DType::F32;
    ReduceOp op = ReduceOp::Sum;  // not used by allgather
    // Allreduce: the buffer's elements. reduce_scatter and allgather: one rank's block (the
    // output, resp. the input); the other buffer has a block per rank of the group.
    uint64_t count = 0;
    uint32_t avg_divisor = 1;  // contributions in total (all ranks of all hosts)
    uint32_t root = 0;         // broadcast, reduce: the root rank (in the group's numbering)
    // How partials and results travel (wire_applies(collective, dtype, op) for anything but exact).
    WireFormat wire = WireFormat::Exact;
    // Error feedback for a compressed op: a residual per element of the buffer with a block per
    // rank (allreduce: the buffer; full_count() values), added to what this host encodes of each
    // element and replaced by what that encoding lost. Null: none.
    float *residual = nullptr;
    RegionHandle data;         // local rank 0's input and output
    uint64_t data_offset = 0;  // the input (allreduce: in/out)
    uint64_t out_offset = 0;   // reduce_scatter, allgather: the output (may be inside the input)
    RegionHandle staging;      // staging_bytes(): chunk_bytes x depth of slots, then the f32 work area
    // The other local ranks' buffers (not registered: only read and written here): their inputs
    // (allreduce: in/out), and for reduce_scatter and allgather their outputs. Their
    // contributions are summed in; the result lands in them too.
    std::span<std::byte *const> locals;
    std::span<std::byte *const> local_outputs;
    // Every collective but allreduce: the group's ranks on each host of the ring (index: ring
    // position), each host's in local-rank order; block b of the buffer with a block per rank is
    // rank b's (reduce_scatter, allgather), and the root rank's host leads a chain (broadcast,
    // reduce). Every host has the same.
    std::span<const std::vector<uint32_t>> host_ranks;
    uint32_t op_tag = 0;       // distinguishes this op's messages from any other's
    // Set by another thread when the ring generation is over: run() returns promptly.
    const std::atomic<uint64_t> *aborted_generation = nullptr;
    // Set by the progress thread when the control thread cancels this op (a solo lane's op that
    // not every host will run): run() returns -ECANCELED promptly, its sends still queued.
    const std::atomic<bool> *cancelled = nullptr;
    // Stored (steady clock, ns) whenever a message of the op is sent or received: it moves.
    std::atomic<int64_t> *progress_ns = nullptr;
    // Stored (steady clock, ns) on every turn of the wait: the progress thread is alive.
    std::atomic<int64_t> *beat_ns = nullptr;
    uint64_t generation = 0;

    // The ranks of the group (reduce_scatter, allgather), and the elements of the buffer with a
    // block per rank (allreduce: its buffer).
    uint64_t ranks() const;
    uint64_t full_count() const { return collective_blocked(collective) ? count * ranks() : count; }
    // broadcast, reduce: the root rank's host (ring position) and local rank; false when the rank
    // map does not have it.
    bool find_root(uint32_t *host, uint32_t *local) const;
    bool compressed() const { return wire != WireFormat::Exact; }
    // Whether the op's sends from the data region may go by reference on links whose SendDone
    // does not mean delivered (it then ends with the delivery marker).
    bool by_reference() const;
};

class RingEngine {
public:
    RingEngine(Transport &transport, RingOptions options) : t_(transport), opt_(options) {}

    // The f32 work area's bytes, and the staging bytes run() needs: the chunk slots and the work
    // area (ops that do not widen need only the slots).
    static uint64_t work_bytes(const RingOptions &o) {
        if (o.work_bytes) return o.work_bytes;
        const uint64_t small = 64 * std::min<uint64_t>(o.chunk_bytes, 512 << 10);
        return std::min<uint64_t>(std::max<uint64_t>(small, 16 * o.chunk_bytes), uint64_t{256} << 20);
    }
    // The chunk (bytes) of a window whose segments hold `segment_bytes` (partials) on average: every host
    // computes the same from the same options.
    static uint64_t chunk_for(const RingOptions &o, uint64_t segment_bytes) {
        constexpr uint64_t kLeast = 512 << 10, kPerSegment = 8;
        uint64_t c = o.chunk_bytes;
        while (c / 2 >= kLeast && segment_bytes < kPerSegment * c) c /= 2;
        return c;
    }
    // A chain's chunk (broadcast, reduce over `bytes`): each hop past the first holds the op back
    // by one chunk while the pipeline fills, so chains cut finer — halved from chunk_bytes while
    // the op has fewer than 64 of them, down to 64 KiB.
    static uint64_t chain_chunk_for(const RingOptions &o, uint64_t bytes) {
        constexpr uint64_t kLeast = 64 << 10, kPerOp = 64;
        uint64_t c = o.chunk_bytes;
        while (c / 2 >= kLeast && bytes < kPerOp * c) c /= 2;
        return c;
    }
    static uint64_t staging_bytes(const RingOptions &o) { return o.chunk_bytes * o.depth + work_bytes(o); }
    uint64_t staging_bytes() const { return staging_bytes(opt_); }
    // Ops of at least this many bytes end with the delivery marker where a link's SendDone does
    // not mean delivered (TCP), and send from the data region by reference.
    static constexpr uint64_t kConfirmBytes = 32 << 20;

    // The local ranks' reduction or gather, for a ring of one host (also a group on one host: no
    // transport, no staging). Every buffer is in place and large enough.
    static void run_local(const RingOp &op);

    // Blocks until the result is in place, a link fails (error names the peer), or the deadline
    // passes (error names the peer we were waiting for).
    Status run(const RingPosition &pos, const RingOp &op, std::chrono::steady_clock::time_point deadline);

private:
    // One message of the op's schedule, sent or received.
    struct Msg {
        uint32_t entry;  // its step in schedule_
        uint32_t chunk;  // within the step's segment
        uint64_t elem;   // into the buffer with a block per rank (allreduce: the buffer)
        uint64_t elems;
        uint64_t work;      // widened: where its partials are in the work area (elements)
        uint64_t in_block;  // reduce_scatter, allgather: its offset within its rank's block
        int32_t owner;      // this host's segment: the local rank whose block it is (else -1)
        bool posted, done;
        // Reduce-scatter: the staging slot a receive lands in; a receive whose partial result is
        // forwarded from that slot keeps it (`forward`) until the send of the next step, which
        // names it in its own `slot`, is done. -1: none.
        int32_t slot;
        bool forward;
    };
    // A pass of the ring over part of the op: allreduce, elements [begin, begin + count) of the
    // buffer; reduce_scatter and allgather, the same elements of every rank's block.
    struct Window {
        uint64_t begin, count;
    };

    Status run_window(const RingPosition &pos, const RingOp &op, Window w, uint64_t chunk_bytes,
                      std::chrono::steady_clock::time_point deadline);
    // The window's segments as pieces of contiguous elements, and the schedule's messages.
    void segments(const RingPosition &pos, const RingOp &op, Window w);
    void plan(const RingPosition &pos, const RingOp &op, Window w, uint64_t chunk_elems, uint32_t slots);
    // The most chunks a segment of the window has (every host computes the same).
    uint64_t most_chunks(const RingPosition &pos, const RingOp &op, Window w, uint64_t chunk_elems) const;
    // An op timed out: what it had done and what its links hold and wait on, to the log.
    void log_links(const RingPosition &pos, const std::string &stage) const;
    // The delivery marker: an empty message to the previous host (tell_prev: all of the op is
    // in) and the next host's (wait_next: it has all we sent), both before the deadline.
    Status confirm_delivery(const RingPosition &pos, const RingOp &op, bool tell_prev, bool wait_next,
                            std::chrono::steady_clock::time_point deadline);
    size_t index(const std::vector<size_t> &base, uint32_t entry, uint32_t chunk) const { return base[entry] + chunk; }
    uint64_t tag(const RingOp &op, uint32_t entry, uint32_t chunk) const {
        const RingStep &e = schedule_[entry];
        return (uint64_t{op.op_tag} << 32) | (uint64_t{e.phase} << 31) | (uint64_t{e.step} << 20) | (chunk_base_ + chunk);
    }

    struct Piece {
        uint64_t elem, elems, work, in_block;
        int32_t owner;
    };

    Transport &t_;
    RingOptions opt_;
    uint32_t chunk_base_ = 0;  // the window's first chunk number in tags (unique in the op)
    uint32_t root_host_ = 0, root_local_ = 0;  // broadcast, reduce (find_root)
    bool stable_ = false;      // the op's sends from the data region may go by reference
    bool wire_in_data_ = false;  // a compressed op's partials and encodings in the data region (run())
    // Reused from op to op (capacity stays): the schedule, the window's segments (pieces of
    // segment k: seg_pieces_[seg_base_[k] .. seg_base_[k + 1])), its messages sent and received.
    std::vector<RingStep> schedule_;
    // Per step: the earlier step whose send of the segment its receive writes must be done first.
    std::vector<int32_t> recv_after_send_, last_send_;
    std::vector<Piece> seg_pieces_;
    std::vector<size_t> seg_base_;
    std::vector<Msg> sends_, recvs_;
    std::vector<size_t> send_base_, recv_base_;  // first message of each step
    std::vector<int32_t> free_slots_;
    std::vector<LinkEvent> events_;
    std::vector<const void *> srcs_;
    std::vector<void *> dsts_;
    std::vector<const void *> partials_;
    // Compressed ops: a decoded chunk.
    std::vector<float> decoded_;
};

}  // namespace ringd
