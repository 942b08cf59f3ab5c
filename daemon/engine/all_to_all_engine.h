// AllToAllEngine: all_to_all across hosts over the lane's data links, one to every other host of
// the ring (the ring's own to the next and previous host, used both ways, and the mesh links to
// the others: peer protocol 12, daemon/control/control_plane.h). Each block a local rank sends to
// a rank on another host goes as messages of at most kPieceBytes straight from the sender's slot
// into the receiver's (no staging, no copy by ringd; TCP sends a MiB or more to one host by
// reference from the trainer's memfd), every pair of hosts at once, both ways: each host's NIC carries its ranks'
// blocks for the other hosts once, the floor of an all_to_all. The host's own ranks' blocks to
// each other are copied locally while the network runs.
//
// On each link, each way, an op's messages are, in order (tag: op tag << 32 | number):
//   0            flags (u64: bit 0, the blocks go by reference), then the counts: for each of the
//                sender's local ranks (local-rank order), the elements it sends each of the
//                receiver's (u64, little-endian hosts); 8 + 8 x L_s x L_r bytes
//   1, 2, ...    the blocks, sender's local rank major, then receiver's, each cut into pieces of
//                kPieceBytes (the last one shorter); an empty block has none
//   kDone        (the other way; only when the flags say by reference: TCP sends the slot's pages
//                of a MiB or more to a host so) empty, sent once everything from the peer is
//                in: the peer's slot is read no more, and its op may end. Smaller blocks are copied
//                into the socket, and the op ends without waiting on the peer's reading.
// The receiver posts the blocks' receives once the counts are in and match its own ranks' (both
// ends then cut alike). Counts that differ fail the op on the receiving host, naming both ranks,
// after their messages were read into staging and dropped: the links stay in step and the ring
// runs on (no other op or group is touched). A rank's two local ranks whose counts differ fail it
// the same way.
//
// Called on the progress thread; a failed run (Status) leaves receives posted into the slots: the
// caller drops the links (the generation ends), as after a failed ring op.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "daemon/engine/all_to_all.h"
#include "daemon/transport/transport.h"
#include "proto/frame.h"
#include "proto/types.h"

namespace ringd {

struct AllToAllOp {
    DType dtype = DType::F32;
    uint32_t self = 0;  // this host's ring position
    std::string_view self_name;  // its host name (errors)
    // The group's ranks on each host (by ring position), each host's in local-rank order.
    std::span<const std::vector<uint32_t>> host_ranks;
    std::span<const AllToAllLayout> layouts;  // this host's local ranks'
    std::span<const RegionHandle> regions;    // each local rank's slot data area
    std::span<const uint64_t> in_offsets, out_offsets;  // bytes into each local rank's region
    std::span<Link *const> links;  // by ring position: the link to that host (null: none, or self)
    RegionHandle staging;          // the counts both ways, and dropped pieces (staging_bytes())
    uint32_t op_tag = 0;
    const std::atomic<uint64_t> *aborted_generation = nullptr;
    uint64_t generation = 0;
    // A solo lane's op that not every host will run: run() returns -ECANCELED promptly, its
    // sends still queued (ProgressEngine::drain_cancelled).
    const std::atomic<bool> *cancelled = nullptr;
    std::atomic<int64_t> *progress_ns = nullptr;  // stored whenever a message of the op moves
    std::atomic<int64_t> *beat_ns = nullptr;      // stored on every turn of the wait
};

class AllToAllEngine {
public:
    static constexpr uint64_t kPieceBytes = 1 << 20;
    static constexpr uint32_t kDone = 0xffffffffu;
    // Pieces of each peer's blocks posted at a time, each way (the rest as they complete).
    static constexpr uint32_t kWindow = 16;
    // Blocks to one host of at least this many bytes in all go by reference (and are confirmed).
    // Unlike the ring's (RingEngine::kConfirmBytes, 32 MiB), where the marker makes an op end one
    // hop later, every host of an all_to_all waits for its peers' blocks anyway, and their done
    // messages come about as those do: from a piece on, the copy saved outweighs the wait
    // (docs/perf.md, "all_to_all by reference"). Each sender decides and its flags say it, so
    // hosts of another threshold pair.
    static constexpr uint64_t kByReferenceBytes = kPieceBytes;

    AllToAllEngine(Transport &transport, int spin_us) : t_(transport), spin_us_(spin_us) {}

    // The staging an op needs: both ways' counts and one piece to drop into; and the most any op
    // of a ring of `hosts` needs (each host's local ranks at most proto::kMaxLocalSize).
    static uint64_t staging_bytes(std::span<const std::vector<uint32_t>> host_ranks, uint32_t self);
    static uint64_t staging_bound(uint32_t hosts) {
        return kPieceBytes + 2 * uint64_t{hosts} * (8 + 8 * uint64_t{proto::kMaxLocalSize} * proto::kMaxLocalSize);
    }

    // Until every block is in place and every peer has everything this host sent (Ok), a link
    // fails or the deadline passes (error, naming the host). Counts that differ (this host's
    // ranks' with a peer's, or with each other) complete the op's messages and set *op_error.
    Status run(const AllToAllOp &op, std::chrono::steady_clock::time_point deadline, std::string *op_error);
    // After run(): whether the op sent its blocks to the host of `link` by reference.
    bool sent_by_reference(const Link *link) const {
        for (const Way &w : out_)
            if (w.link == link && w.by_reference) return true;
        return false;
    }

private:
    // One direction with one peer: its blocks as (region, offset, bytes) in order, walked piece by
    // piece; dropped: every piece into the staging's drop area instead.
    struct Block {
        const RegionHandle *region;
        uint64_t offset, bytes;
    };
    struct Way {
        Link *link = nullptr;
        std::vector<Block> blocks;
        size_t block = 0;
        uint64_t at = 0;          // within blocks[block]
        uint32_t next_tag = 1;    // the next piece's number
        uint32_t posted = 0, done = 0;  // pieces
        uint32_t total = 0;       // pieces in all
        bool ready = false;       // receives: the counts are in (the blocks are known)
        bool header_done = false, marker_done = false;
        // Out: this host sends by reference and waits for the peer's done message; in: the peer
        // does, and this host answers once everything from it is in.
        bool by_reference = false;
    };
    Status post_pieces(const AllToAllOp &op, Way &w, bool send);
    void log_ways(const AllToAllOp &op, const std::string &stage) const;

    Transport &t_;
    int spin_us_;
    std::vector<Way> out_, in_;  // by ring position
    std::vector<LinkEvent> events_;
    std::vector<uint64_t> header_at_;  // by ring position: its counts' offset in the staging (out, then in)
};

}  // namespace ringd
