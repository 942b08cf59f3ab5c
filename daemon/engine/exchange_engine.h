// ExchangeEngine: a compressed allreduce or reduce_scatter of f32 data (sum, avg) as an exchange
// of shards over the lane's links to every host (AllToAllEngine's: the ring's own to the next and
// previous host and the mesh links; TCP, a generation of peer protocol 13), so that each host's contribution is encoded once and
// every sum is accumulated in f32 where it is owned:
//
//   scatter  the buffer is cut into one shard per host (ring position; shard bounds on blocks of
//            kWireBlock values, so that int8's and fp16's blocks are the sender's); for each
//            other host's shard this host reduces its local ranks (f32, avg scaled by 2^-K),
//            encodes that once (with its error feedback residual) and sends it there. Every
//            other host's encoding of this host's shard is decoded and added in f32 to this
//            host's own local reduction of it.
//   gather   once a piece of the shard has every host's contribution, it is encoded once (avg
//            scaled to the mean first; with the residual), decoded here into the local ranks'
//            buffers, and the same encoding is sent to every other host, which decodes it into
//            its local ranks' buffers: every rank of the group ends with the same values.
//
// A value is thus encoded twice in all, whatever the number of hosts H: the error of a sum is at
// most two encodings' of its contributions' magnitudes (docs/wire.md), where the ring's grows
// with H (each host encodes the partial sum it forwards, ring_engine.h). The bytes each host's
// NIC carries are the ring's: (H - 1)/H of the buffer encoded out and in, each way.
//
// reduce_scatter: a host's shard is its ranks' blocks (local-rank order; each cut into pieces
// alike), and the scatter is all of it: a block's piece with every host's contribution is the
// result, in f32 (avg scaled to the mean), written to its rank's output. One encoding per value.
//
// f32 data is summed in local rank 0's buffer. bf16 data (protocol 14) has no room for f32 sums
// there: they go to acc_ (acc_values, 8 MiB), and the op runs as windows of the buffer
// (allreduce; reduce_scatter: of every rank's block) whose shard fits it, one after the other,
// each a whole exchange as above with piece numbers of its own; results are rounded to bf16 once.
//
// Each shard is cut into pieces of piece_values() values (of the buffer with a block per rank); on
// the link to host p, each way:
//   tag (op tag << 32) | k            scatter: piece k of the receiver's shard (wire_bytes)
//   tag (op tag << 32) | 1 << 31 | k  gather: piece k of the sender's shard, encoded once
// every scatter message of a way before its gather messages. Messages are encoded into and
// received into staging slots (sends by copy); no receive waits on a send of its own host, and
// no gather receive is posted while a scatter receive is not, so nothing can wait on itself.
//
// Called on the progress thread; a failed run leaves receives posted into the staging: the
// caller drops the links (the generation ends), as after a failed ring op.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "daemon/transport/transport.h"
#include "proto/types.h"

namespace ringd {

struct ExchangeOp {
    Collective collective = Collective::Allreduce;  // or reduce_scatter
    ReduceOp op = ReduceOp::Sum;  // sum or avg
    DType dtype = DType::F32;     // or bf16 (summed in f32 all the same)
    WireFormat wire = WireFormat::BF16;
    uint64_t count = 0;             // values of the buffer (reduce_scatter: of one rank's block)
    uint32_t avg_divisor = 1;       // contributions in total (all ranks of all hosts)
    float *residual = nullptr;      // error feedback: one per value (null: none)
    RegionHandle data;              // local rank 0's slot
    uint64_t data_offset = 0;       // its buffer (in and out; reduce_scatter: in, a block per rank)
    std::span<std::byte *const> locals;  // the other local ranks' buffers (in and out; reduce_scatter: in)
    // reduce_scatter: the group's ranks on each host (by ring position, each in local-rank
    // order: block b of the input is rank b's), local rank 0's output and the others'.
    std::span<const std::vector<uint32_t>> host_ranks;
    uint64_t out_offset = 0;
    std::span<std::byte *const> local_outputs;
    RegionHandle staging;           // the lane's staging: the slots
    uint32_t self = 0;              // this host's ring position
    std::span<Link *const> links;   // by ring position: the link to that host (self: unused)
    uint32_t op_tag = 0;
    const std::atomic<uint64_t> *aborted_generation = nullptr;
    uint64_t generation = 0;
    const std::atomic<bool> *cancelled = nullptr;  // a solo lane's op that not every host runs
    std::atomic<int64_t> *progress_ns = nullptr;    // stored whenever a message of the op moves
    std::atomic<int64_t> *beat_ns = nullptr;        // stored on every turn of the wait
};

class ExchangeEngine {
public:
    // acc_values: bf16's sums of our shard per window (every host of an op must use the same:
    // the daemon's default; tests make windows small).
    static constexpr uint64_t kAccValues = 2 << 20;
    ExchangeEngine(Transport &transport, int spin_us, uint64_t acc_values = kAccValues)
        : t_(transport), spin_us_(spin_us), acc_values_(acc_values) {}

    // Values per message: an eighth of a shard (so that mid-sized ops keep a pipeline), at least
    // 4 Ki and at most 256 Ki, a multiple of kWireBlock. Every host computes the same.
    static uint64_t piece_values(uint64_t count, uint32_t hosts);
    // The staging an op needs at least: two slots each way; and what a lane's staging has at
    // least (eight slots each way of the largest piece in any format: 8 MiB).
    static uint64_t staging_needed(WireFormat wire, uint64_t count, uint32_t hosts);
    static uint64_t staging_bound();

    // Until every rank's buffer holds the result and every peer has taken what this host sent
    // (Ok), a link fails or the deadline passes (error, naming the host).
    Status run(const ExchangeOp &op, std::chrono::steady_clock::time_point deadline);

private:
    struct Slot {
        uint32_t users = 0;  // sends still out from it (a receive: 1 while posted)
    };
    struct Peer {
        Link *link = nullptr;
        uint32_t p = 0;  // ring position
        uint64_t scatter_posted = 0;  // pieces of its shard
        uint64_t gather_posted = 0;                     // pieces of our shard
        uint64_t sends_out = 0;                         // posted, not done
        uint64_t scatter_recv_posted = 0, scatter_recvd = 0;  // pieces of our shard
        uint64_t gather_recv_posted = 0, gather_recvd = 0;    // pieces of its shard
        // By piece: the slot each message is in (-1: none, or done), by phase and way; our
        // shard's pieces whose gather send to it is done. Sized per op, kept from op to op.
        std::vector<int32_t> scatter_send, scatter_recv, gather_recv;
        std::vector<uint8_t> gather_done;

        void reset(Link *l, uint32_t position) {
            link = l;
            p = position;
            scatter_posted = gather_posted = sends_out = 0;
            scatter_recv_posted = scatter_recvd = gather_recv_posted = gather_recvd = 0;
        }
    };

    Transport &t_;
    int spin_us_;
    uint64_t acc_values_;
    struct Seg {
        uint64_t begin, elems;  // values of the buffer with a block per rank (allreduce: the buffer)
        int32_t owner;          // reduce_scatter: the local rank whose block it is (its host's)
    };
    std::vector<std::vector<Seg>> segs_;  // by host: its pieces
    std::vector<Peer> peers_;
    std::vector<Slot> slots_;
    std::vector<int32_t> free_send_, free_recv_;
    std::vector<uint32_t> arrived_;  // our shard's pieces: contributions added
    std::vector<uint8_t> folded_;    // our shard's pieces: the local ranks reduced
    std::vector<int32_t> gather_send_;  // our shard's pieces: the slot of its encoding (-1: not yet)
    std::vector<float> acc_;  // bf16: our shard's sums, a window at a time (8 MiB, at least a block per local rank)
    std::vector<float> tmp_;  // bf16: one piece in f32 (a contribution to encode, a result to round)
    std::vector<LinkEvent> events_;
};

}  // namespace ringd
