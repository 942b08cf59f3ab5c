// DirectExchange: the data of the ops that skip the ring (small ops, daemon/engine/tuner.h)
// between the hosts of a ring, on the control thread. One-shot: every host sends its contribution
// (its local ranks reduced) to every other host and reduces them all itself, in ring order, so
// every host gets the same bits. Two-shot: host j gets segment j of every contribution, reduces it
// and sends the result to every other host, straight into their slots. Doubling and
// halving-doubling (proto/peer.h): log2 n steps with one partner each, the extra hosts of a count
// that is not a power of two folded in first; partners combine in the same order (the lower
// host's first), so every host gets the same bits too.
//
// reduce_scatter and allgather run one-shot (proto/peer.h): every host sends each other host in one
// message what it needs of it — reduce_scatter the blocks of that host's ranks (the group's rank
// map, GroupRun::host_ranks), its own ranks reduced; allgather its own ranks' blocks — and, once
// every host's message is in, reduces each of its ranks' blocks into that rank's output, or copies
// every block into every local rank's output. broadcast, reduce and barrier too: the root's host
// sends its root rank's buffer to every other host, every other host its ranks reduced to the
// root's host, every host an empty message to every other one.
//
// Contributions of peers that are ahead of this host are kept, within bounds per peer and per
// group; this host's own data goes out only while its queue to each peer is under a bound. Over
// a bound the caller fails the op on every host by name. Which ops exist and when they end is the
// caller's (HostOps, the coordinator); this is the data, keyed by (coordinator generation, group,
// incarnation, seq).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "daemon/engine/all_to_all.h"
#include "daemon/ops/host_ops.h"
#include "proto/peer.h"

namespace ringd {

class DirectExchange {
public:
    // Beyond these the op fails everywhere with ENOBUFS and a message naming the bound. Honest
    // peers stay far below: a group is at most local_size x the completion-queue depth ops ahead.
    static constexpr uint64_t kMaxPeerBacklog = 512ull << 20;   // peers' data kept, per peer
    static constexpr uint64_t kMaxGroupBacklog = 256ull << 20;  // peers' data kept, per group
    static constexpr uint64_t kMaxSendBacklog = 128ull << 20;   // this host's queue to a peer
    // An all_to_all's message to one host goes a part at a time (pump()): at most this much of it
    // waits in the queue to that host, and a host that has not reached the op (none of its parts
    // is here yet) gets no more than this of it (it keeps what comes ahead of it: kMaxGroupBacklog).
    static constexpr uint64_t kAllToAllWindow = 2 * proto::kAllToAllPartBytes;
    // The most parts a message has (the part number's 16 bits, proto/peer.h): 256 GiB.
    static constexpr uint64_t kMaxAllToAllMessage = 0xffffull * proto::kAllToAllPartBytes;

    // (A frame is the sender's to seal and queue as it is: one sent once goes with std::move.)
    using Send = std::function<void(uint32_t host, proto::Bytes frame)>;
    using Queued = std::function<uint64_t(uint32_t host)>;  // bytes waiting in the queue to host
    DirectExchange(uint32_t self, std::vector<std::string> hosts, Send send, Queued queued);

    // Why this host cannot send its data of op `r` now (a peer's queue is over its bound), or "".
    // `host_ranks`: the group's ranks on each host (reduce_scatter, allgather; see above).
    std::string send_over_bound(const proto::OpReport &r, const OpDesc &desc, Algorithm algorithm,
                                std::span<const std::vector<uint32_t>> host_ranks,
                                std::span<const std::shared_ptr<const std::vector<uint64_t>>> splits = {}) const;
    // Sends this host's contribution of `op` (reported here as `r`, r.algorithm set) and keeps its
    // own part; the local ranks are reduced straight into the frames.
    void contribute(const HostOp &op, const proto::OpReport &r, std::span<const std::vector<uint32_t>> host_ranks = {});
    // all_to_all: the next parts of this host's messages, while the queue to each host is under
    // kAllToAllWindow (and beyond the first window only to a host whose message of the op came:
    // it reached the op), one part to each host in turn, ops in order. `find` gives a key's op
    // (nullptr: it ended here, nothing more of it goes). Whether any part went; `finished` gets the
    // ops whose messages are all out (their slots are free to complete: progress()).
    bool pump(uint64_t generation, const std::function<const HostOp *(const OpKey &)> &find, std::vector<OpKey> &finished);
    bool sending() const { return !sending_.empty(); }
    // A peer's one-shot contribution or two-shot part. Kept (true), dropped because it is not
    // what this host can use (false, logged), or over a bound (false, `over_bound` says why).
    bool take_part(uint32_t host, const proto::OpData &d, proto::Bytes payload, std::string &over_bound);
    // A peer's reduced segment of two-shot op `op`: into every local slot.
    void take_result(uint32_t host, uint64_t generation, const OpKey &key, const HostOp &op, const proto::OpReport &r,
                     std::span<const uint8_t> data);
    // Moves op `op` (reported here, one-/two-shot) on: reduces once every part is in (two-shot:
    // and sends this host's segment to the others). True when the op is complete on this host.
    bool progress(uint64_t generation, const OpKey &key, const HostOp &op);

    // Doubling and halving-doubling: a partner's data of the op does not match this host's op
    // (count, dtype, op or algorithm): it stops here, for the coordinator to decide.
    bool mismatched(uint64_t generation, const OpKey &key) const;
    // A mismatch that the reports cannot show (one-shot: a peer's message that is not the size
    // its report and the rank map say, or a rank map this host cannot run the op on): why, naming
    // the host, for the caller to fail the op with on every host; "" otherwise.
    std::string malformed(uint64_t generation, const OpKey &key) const;
    // The earliest deadline of the peers whose data of the op is here (their first submission +
    // timeouts.op, from the remaining_ms their data carried), and whose it is; nullopt: none here.
    std::optional<std::pair<Clock::time_point, uint32_t>> earliest_deadline(uint64_t generation, const OpKey &key) const;

    bool has(uint64_t generation, const OpKey &key) const;
    void drop(uint64_t generation, const OpKey &key);
    void drop_before(uint64_t generation);  // everything of generations before this one
    uint64_t backlog(uint32_t host) const { return peer_bytes_[host]; }

private:
    using Key = std::tuple<uint64_t, std::string, uint64_t, uint64_t>;  // generation, group, incarnation, seq
    struct Part {
        proto::OpReport report;
        proto::Bytes buf;
        size_t offset = 0;  // of the data in buf
    };
    struct State {
        std::vector<std::optional<Part>> parts;  // by host
        bool reduced = false;
        std::vector<uint8_t> got_result;  // two-shot, by host
        uint32_t results = 0;
        // Doubling and halving-doubling.
        std::map<uint32_t, Part> steps;  // peers' data by (kind << 16 | step)
        bool contributed = false;
        proto::OpReport report;          // this host's
        std::vector<uint8_t> work;       // this host's partial result, the whole op (partial dtype)
        uint32_t ranks = 0;              // the ranks in it
        std::vector<std::vector<uint32_t>> host_ranks;  // reduce_scatter, allgather: the rank map
        uint32_t phase = 0, sent = UINT32_MAX;  // where this host is in the schedule
        bool mismatch = false, done = false;
        std::string why;                   // a mismatch the reports cannot show (malformed())
        // all_to_all: each peer's message, the parts here by number (only those that came: memory
        // in proportion to what was sent), and how many parts it said it has.
        std::vector<std::map<uint32_t, Part>> a2a;
        std::vector<uint32_t> a2a_parts;
        std::vector<uint64_t> a2a_expect;  // all_to_all, once this host contributed: each peer's message bytes
        std::vector<std::vector<uint64_t>> a2a_counts;  // and the counts its message must start with
        std::vector<uint8_t> a2a_done;  // each peer's message delivered into the outputs (and released)
        // Each peer's message is delivered part by part, in order: the next part, and where its
        // bytes go (the block of the message, the bytes of it delivered).
        std::vector<uint32_t> a2a_next;
        std::vector<std::pair<uint64_t, uint64_t>> a2a_at;
        // This host's message to each other host: its counts, then its pieces (a local rank's slot
        // range; rank UINT32_MAX: the counts), sent a part at a time (pump()).
        struct A2aPiece {
            uint32_t rank;
            uint64_t offset, bytes;
        };
        struct A2aOut {
            uint32_t host;
            uint64_t total, parts, next = 0;
            std::vector<uint64_t> counts;
            std::vector<A2aPiece> pieces;
            size_t piece = 0;
            uint64_t at = 0;  // bytes of pieces[piece] sent
        };
        std::vector<A2aOut> a2a_out;
        size_t a2a_unsent = 0;  // messages with parts to send
        Clock::time_point earliest{};      // the earliest deadline of the peers' data here
        uint32_t earliest_host = UINT32_MAX;
    };
    // This host's place in doubling and halving-doubling: p = the largest power of two <= n hosts
    // run the steps as virtual hosts 0..p-1; of the first 2(n - p) hosts each odd one folds into
    // the even one before it.
    struct Schedule {
        uint32_t p = 1, steps = 0;       // steps = log2 p
        uint32_t v = 0;                  // this host's virtual index (kept hosts)
        uint32_t folds_into = UINT32_MAX;   // this host is an extra one: the host it folds into
        uint32_t folded_from = UINT32_MAX;  // the extra host that folds into this one
    };
    static Schedule schedule_of(uint32_t self, uint32_t n);
    uint32_t host_of(uint32_t v) const;  // virtual -> real
    // The host that sends this host data of `kind` at `step`, or n_ when none does.
    uint32_t sender_of(proto::OpDataKind kind, uint32_t step) const;
    // Halving-doubling's blocks [lo, hi) of virtual hosts -> elements.
    uint64_t block_begin(uint64_t count, uint32_t b) const { return static_cast<uint64_t>((static_cast<unsigned __int128>(count) * b) / sched_.p); }
    bool take_step(uint32_t host, const proto::OpData &d, proto::Bytes payload, std::string &over_bound);
    void note_deadline(State &st, uint32_t host, const proto::OpReport &r);
    std::string over_bound(uint32_t host, const proto::OpReport &r, uint64_t size) const;
    bool progress_log(State &st, const HostOp &op);
    // reduce_scatter, allgather: the op's result here once every host's message is in.
    bool progress_collective(State &st, const HostOp &op);
    // all_to_all: this host's message to every other host (and its local ranks' blocks to each
    // other), a peer's part, and the op's end here (every peer's whole message in).
    void contribute_a2a(State &st, const HostOp &op, const proto::OpReport &r);
    bool take_a2a(uint32_t host, const proto::OpData &d, proto::Bytes payload, std::string &over_bound);
    bool progress_a2a(State &st, const HostOp &op);
    // Sends op `op`'s next parts (pump()); whether any went.
    bool pump_a2a(State &st, const HostOp &op);
    // Whether `parts` is the number of parts of host `host`'s message (State::a2a_expect).
    static bool a2a_parts_fit(const State &st, uint32_t host, uint64_t parts);
    // Bytes of host `from`'s all_to_all message to host `to` (`layouts`: `from`'s local ranks').
    static uint64_t a2a_message_bytes(const OpDesc &d, const std::vector<AllToAllLayout> &layouts,
                                      std::span<const uint32_t> to_ranks);
    // broadcast, reduce, barrier: this host's message(s), and the op's end here.
    void contribute_rooted(State &st, const HostOp &op, const proto::OpReport &r);
    bool progress_rooted(State &st, const HostOp &op);
    bool part_fits(State &st, const HostOp &op, uint32_t host);  // (see the .cpp)
    // broadcast, reduce: the root rank's host (ring position) and local rank; UINT32_MAX: not in
    // the map.
    static uint32_t root_host(const OpDesc &d, std::span<const std::vector<uint32_t>> host_ranks, uint32_t *local = nullptr);
    // Marks the op mismatched because of `why` (the first reason stays), logged once.
    void malformed_part(State &st, std::string why);
    // Bytes of a one-shot reduce_scatter's or allgather's message from `from` to `to`.
    static uint64_t collective_part_bytes(const OpDesc &d, std::span<const std::vector<uint32_t>> host_ranks, uint32_t from,
                                          uint32_t to);
    void send_step(State &st, proto::OpDataKind kind, uint32_t step, uint32_t to, const void *data, uint64_t bytes);
    static Key key_of(uint64_t generation, const OpKey &k) {
        return {generation, std::get<0>(k), std::get<1>(k), std::get<2>(k)};
    }
    void add(uint32_t host, const proto::OpReport &r, proto::Bytes buf, size_t offset);
    void release(const std::string &group, uint32_t host, Part &p);
    void erase(std::map<Key, State>::iterator it);
    void local_reduce_into(const HostOp &op, void *dst, uint64_t begin, uint64_t elems);

    uint32_t self_, n_;
    Schedule sched_;
    std::vector<std::string> hosts_;
    Send send_;
    Queued queued_;
    std::map<Key, State> ops_;
    std::set<Key> sending_;  // all_to_alls with parts to send, in op order
    std::vector<uint64_t> peer_bytes_;               // kept, by host
    std::map<std::string, uint64_t> group_bytes_;    // kept, by group
    std::vector<const void *> srcs_, partials_;
    std::vector<void *> dsts_;
};

}  // namespace ringd
