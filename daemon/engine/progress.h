// ProgressEngine: the progress thread. It executes ops handed over by the control thread and
// hands results back; the threads share nothing but queues (and the slots the work items keep
// alive, and one atomic: the generation the control thread declared aborted).
//
// One host: an op is the reduction of the local ranks' slots, written to every slot.
// Several hosts: the ring allreduce across hosts (RingEngine over the transport's links to the
// next and previous host) on local rank 0's slot, folding the other local ranks' slots in and
// writing the result to them chunk by chunk. Ring ops arrive in the coordinator's order.
//
// Contract: every public method is called by the control thread. result_fd() is an eventfd
// readable while results wait. Slots referenced by a work item travel back in its result, so the
// last reference to a slot is dropped on the control thread (which owns registration).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/engine/all_to_all_engine.h"
#include "daemon/engine/exchange_engine.h"
#include "daemon/engine/ring_engine.h"
#include "proto/result.h"
#include "proto/types.h"

namespace ringd {

class Slot;
class NetworkTransport;

// An error-feedback residual (RingOp::residual): kept by the group's run on the control thread,
// sized and written by the progress thread running the group's op, under `mu` (an op of the group
// still ending on another lane's thread after a new generation keeps it: the next runs without).
struct WireResidual {
    std::mutex mu;
    std::vector<float> values;
    uint64_t kind = 0;  // what the values are of: the schedule, the ring's size and this host's place
};

struct EngineWork {
    uint64_t op_id = 0;
    OpDesc desc;
    uint32_t avg_divisor = 1;  // all contributions of the op (local ranks x hosts)
    std::vector<std::shared_ptr<Slot>> slots;  // index = local rank
    std::vector<uint64_t> offsets;             // byte offsets into each slot's data area: the inputs
    std::vector<uint64_t> out_offsets;         // the outputs (allreduce: the inputs; may be empty then)
    // reduce_scatter, allgather: the group's ranks on each host, by ring position (one host: its
    // local ranks' ranks), each in local-rank order.
    std::vector<std::vector<uint32_t>> host_ranks;
    // all_to_all with split sizes: each local rank's (OpRun::splits).
    std::vector<std::shared_ptr<const std::vector<uint64_t>>> splits;
    // A compressed op's error feedback (null: none).
    std::shared_ptr<WireResidual> residual;
    // Cross-host ops.
    bool ring = false;
    // A compressed f32 allreduce that runs as the exchange of shards over the links to every
    // host (ExchangeEngine), not the ring.
    bool exchange = false;
    uint64_t generation = 0;
    uint32_t op_tag = 0;
    // When the op must be over (its submission + timeouts.op); unset: op_timeout from its start.
    std::chrono::steady_clock::time_point deadline{};
};

struct EngineResult {
    uint64_t op_id = 0;  // 0: not an op, a link of the ring failed while idle
    int32_t status = 0;
    std::string message;
    bool link_failed = false;  // the ring generation is over
    uint64_t generation = 0;
    std::vector<std::shared_ptr<Slot>> slots;  // returned for release on the control thread
};

struct RingLinks {
    uint64_t generation = 0;
    uint32_t rank = 0, size = 1;
    std::string next_name, prev_name, self_name;
    std::vector<UniqueFd> to_next, from_prev;
    std::vector<SessionKeys> to_next_keys, from_prev_keys;  // one per connection
    // Several rails: each connection's rail and its weight (LinkSetup::rails, weights).
    std::vector<uint32_t> to_next_rails, from_prev_rails;
    std::vector<double> to_next_weights, from_prev_weights;
    // Mesh data streams (protocol 12, TCP): to each host that is not a ring neighbour, so that
    // the lane has a data link to every host (all_to_all).
    struct Mesh {
        uint32_t peer = 0;  // ring position
        std::string name;
        std::vector<UniqueFd> fds;
        std::vector<SessionKeys> keys;
        std::vector<uint32_t> rails;
        std::vector<double> weights;
    };
    std::vector<Mesh> mesh;
};

class ProgressEngine {
public:
    // `transport` and `staging` (registered, RingEngine::staging_bytes()) for rings of hosts.
    static Result<std::unique_ptr<ProgressEngine>> start(NetworkTransport *transport = nullptr, RegionHandle staging = {},
                                                         RingOptions ring_options = {},
                                                         std::chrono::milliseconds op_timeout = std::chrono::seconds(30));
    ~ProgressEngine();

    int result_fd() const { return result_fd_.get(); }
    void post(EngineWork work);
    void ring_up(RingLinks links);
    // Effective at once for the op in progress (it fails), then the links are dropped.
    void ring_down(uint64_t generation);
    // Solo lanes (transport.h, solo op tags): the op `op_id` (posted here) will not run on every
    // host. If it runs it ends with -ECANCELED once its sends are out (the next host drops them),
    // its receives withdrawn; if it is still queued it ends so without running. Either way the
    // previous host's messages of it are dropped. The link stays up for the ops after it.
    void cancel(uint64_t op_id);
    // In order with the ops posted: messages from the previous host of solo ops before `op_tag`
    // are dropped from here on (ops this host skips: failed here, or of an incarnation over here).
    void skip_to(uint32_t op_tag);
    std::vector<EngineResult> take_results();
    // Finishes the op in progress (if any), drops queued work, joins the thread.
    void stop();
    // Ops posted and not yet taken back with take_results().
    size_t in_flight() const { return in_flight_; }
    // How long the thread has had work (an op posted and not given back) without coming round
    // its loop: it beats when it takes an item, finishes one, and on every turn of a ring op's
    // wait (at most 100 ms apart). Zero while it has no work. Over kStuckAfter the thread is stuck
    // (the daemon's watchdog stops; docs/design.md, Threads): no wait of its own is that long (a
    // ring's link set-up is bounded by 10 s).
    static constexpr auto kStuckAfter = std::chrono::seconds(15);
    std::chrono::steady_clock::duration stalled_for(std::chrono::steady_clock::time_point now) const;
    // When a ring op last moved here (a message of it sent or received, or an op started).
    std::chrono::steady_clock::time_point last_progress() const {
        return std::chrono::steady_clock::time_point{std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::nanoseconds(progress_ns_.load(std::memory_order_relaxed)))};
    }
    // Names the thread (pthread_setname_np, at most 15 characters), for ps, top and gdb.
    void set_name(const std::string &name);
    // Runs the thread on these CPUs only (daemon/topology/topology.h; empty: anywhere).
    Status pin(const std::vector<uint32_t> &cpus);
    // The CPUs the thread may run on now (read back from the kernel).
    std::vector<uint32_t> cpus() const;
    uint64_t bytes_to_next() const { return bytes_to_next_.load(std::memory_order_relaxed); }
    // Of bytes_to_next(): sent by reference (TCP sendfile from a trainer's slot), not copied.
    uint64_t bytes_by_reference_to_next() const { return bytes_by_reference_.load(std::memory_order_relaxed); }
    uint64_t bytes_from_prev() const { return bytes_from_prev_.load(std::memory_order_relaxed); }
    // all_to_all over the lane's links to every host: bytes sent and received (on every link).
    uint64_t a2a_bytes_sent() const { return a2a_sent_.load(std::memory_order_relaxed); }
    uint64_t a2a_bytes_received() const { return a2a_received_.load(std::memory_order_relaxed); }
    uint64_t a2a_bytes_by_reference() const { return a2a_by_reference_.load(std::memory_order_relaxed); }  // of sent
    // Compressed allreduces and reduce_scatters run as the exchange of shards, and their bytes sent and received.
    uint64_t exchange_ops() const { return exchange_ops_.load(std::memory_order_relaxed); }
    uint64_t exchange_bytes_sent() const { return exchange_sent_.load(std::memory_order_relaxed); }
    uint64_t exchange_bytes_received() const { return exchange_received_.load(std::memory_order_relaxed); }
    // Mesh links up now (links to hosts that are not ring neighbours).
    uint32_t mesh_links() const { return mesh_up_.load(std::memory_order_relaxed); }
    // Of bytes_to_next(): sent on rail r (several rails; one rail: all on rail 0).
    uint64_t bytes_to_next_on_rail(uint32_t r) const {
        return r < kMaxRailsPerLink ? rail_bytes_to_next_[r].load(std::memory_order_relaxed) : 0;
    }
    // Several rails: the state of the links' rails (transport.h, rails_down_of / rails_resynced_of)
    // to the next host and from the previous one, and the generation those links are of (0: none).
    uint64_t next_rails() const { return next_rails_.load(); }
    uint64_t prev_rails() const { return prev_rails_.load(); }
    uint64_t links_generation() const { return links_generation_.load(); }
    // Messages (and bytes) its links sent again on another rail since start: theirs failed before
    // the peer had them.
    uint64_t messages_resent() const { return resent_messages_.load(std::memory_order_relaxed); }
    uint64_t bytes_resent() const { return resent_bytes_.load(std::memory_order_relaxed); }
    uint64_t messages_held() const { return held_messages_.load(std::memory_order_relaxed); }
    // New connections for rail `rail` of the link of `generation` to the next host (to_next) or
    // from the previous one, taken by the transport even in the middle of an op. Any thread.
    Status offer_rail_streams(uint64_t generation, bool to_next, uint32_t rail, std::vector<UniqueFd> fds,
                              std::vector<SessionKeys> keys);

    // Runs one single-host op on the calling thread (the progress thread, or the control thread
    // for ops so small that a thread hop would cost more than the reduction).
    // `beat` (the progress thread's): stored between slices of 16 MiB per rank, so that a long
    // local reduction is not taken for a stuck thread.
    static EngineResult execute(EngineWork &w, std::atomic<int64_t> *beat = nullptr);

private:
    struct Item {
        enum class Kind { Work, Up, Down, Floor } kind = Kind::Work;
        EngineWork work;
        RingLinks links;
        uint64_t generation = 0;
        uint32_t floor = 0;  // Floor
    };
    ProgressEngine() = default;
    // A cancelled op's sends are out (the next host drops them) and its receives are withdrawn;
    // false: not within kCancelDrain (the link is then treated as broken).
    // `fence`: the links the op sent by reference on (their peers must have read or dropped it).
    bool drain_cancelled(uint32_t op_tag, const std::vector<Link *> &fence);
    // A link of the lane that failed while an op ran on others (its Failed event went to that
    // op's wait): the generation ends, as for a failure seen while idle.
    void report_broken_links();
    // The lane's links, each once: to the next host, from the previous one, the mesh's.
    std::vector<Link *> links() const;
    static constexpr auto kCancelDrain = std::chrono::seconds(5);
    static constexpr size_t kMaxCancelled = 4096;
    void run();
    void enqueue(Item item);
    void push_result(EngineResult r);
    EngineResult execute_ring(EngineWork &w);
    void drop_links();
    void watch_idle_links();

    UniqueFd result_fd_;
    UniqueFd wake_fd_;  // eventfd: items queued
    std::mutex mu_;
    std::deque<Item> items_;
    std::deque<EngineResult> results_;
    bool stopping_ = false;
    size_t in_flight_ = 0;  // control thread only
    std::chrono::steady_clock::time_point last_post_{};  // control thread only
    std::atomic<int64_t> beat_ns_{0};  // the progress thread's last beat (steady clock)
    std::atomic<int64_t> progress_ns_{0};  // last_progress()
    std::atomic<uint64_t> aborted_generation_{0};
    // Cancelled solo ops by local op id (under mu_, bounded; op ids never repeat), the solo op
    // running now (0: none) and whether it is cancelled (RingOp::cancelled).
    std::deque<uint64_t> cancelled_;
    uint64_t running_op_ = 0;
    std::atomic<bool> cancel_running_{false};
    std::atomic<uint64_t> bytes_to_next_{0}, bytes_from_prev_{0}, bytes_by_reference_{0};
    std::array<std::atomic<uint64_t>, kMaxRailsPerLink> rail_bytes_to_next_{};
    std::atomic<uint64_t> next_rails_{0}, prev_rails_{0}, links_generation_{0};
    std::atomic<uint64_t> resent_messages_{0}, resent_bytes_{0}, held_messages_{0};
    std::atomic<uint64_t> a2a_sent_{0}, a2a_received_{0}, a2a_by_reference_{0};
    std::atomic<uint64_t> exchange_ops_{0}, exchange_sent_{0}, exchange_received_{0};
    std::atomic<uint32_t> mesh_up_{0};
    uint64_t resent_messages_before_ = 0, resent_bytes_before_ = 0, held_before_ = 0;  // of links dropped (progress thread)
    void count_resent();  // from the links now, and those dropped
    static uint64_t link_key(uint64_t generation, bool to_next) { return generation * 2 + (to_next ? 0 : 1); }

    // Progress thread only.
    NetworkTransport *transport_ = nullptr;
    RegionHandle staging_;
    RingOptions ring_options_;
    std::chrono::milliseconds op_timeout_{30000};
    std::unique_ptr<RingEngine> ring_;
    std::unique_ptr<AllToAllEngine> a2a_;
    std::unique_ptr<ExchangeEngine> exchange_;
    std::vector<std::byte *> locals_, local_outputs_;
    RingPosition pos_;
    std::string self_name_;
    uint64_t generation_ = 0;       // of the links below
    bool link_failure_reported_ = false;
    Link *next_ = nullptr, *prev_ = nullptr;
    // The mesh links by ring position (null: none; protocol 12, TCP), and every link of the lane
    // by ring position (the next and previous host's, the mesh's): all_to_all's.
    std::vector<Link *> mesh_, peers_;
    std::vector<RegionHandle> a2a_regions_;
    std::vector<AllToAllLayout> a2a_layouts_;
    EngineResult execute_all_to_all(EngineWork &w, bool solo);
    EngineResult execute_exchange(EngineWork &w, const RingOp &ring_op, bool solo);
    EngineResult end_failed_mesh_op(EngineWork &w, const Status &s, bool solo, const std::vector<Link *> &fence,
                                    std::string_view what);

    std::thread thread_;  // last: started after everything it uses exists
};

}  // namespace ringd
