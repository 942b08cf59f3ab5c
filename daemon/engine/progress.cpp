#include "daemon/engine/progress.h"


#include <poll.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "common/fd_io.h"
#include "daemon/engine/all_to_all.h"
#include "daemon/engine/reduce.h"
#include "daemon/ipc/slot.h"
#include "daemon/topology/topology.h"
#include "daemon/transport/transport.h"
#include "proto/frame.h"

namespace ringd {

namespace {
// Bringing the links of a new ring generation up (the peers do the same at the same time).
constexpr auto kLinkSetupTimeout = std::chrono::seconds(10);
}  // namespace

Result<std::unique_ptr<ProgressEngine>> ProgressEngine::start(NetworkTransport *transport, RegionHandle staging,
                                                              RingOptions ring_options, std::chrono::milliseconds op_timeout) {
    std::unique_ptr<ProgressEngine> e(new ProgressEngine());
    e->result_fd_ = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    e->wake_fd_ = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!e->result_fd_ || !e->wake_fd_) return make_error(-errno, "eventfd: " + errno_string(errno));
    e->transport_ = transport;
    e->staging_ = staging;
    e->ring_options_ = ring_options;
    e->op_timeout_ = op_timeout;
    if (transport) {
        e->ring_ = std::make_unique<RingEngine>(*transport, ring_options);
        e->a2a_ = std::make_unique<AllToAllEngine>(*transport, ring_options.spin_us);
        e->exchange_ = std::make_unique<ExchangeEngine>(*transport, ring_options.spin_us);
    }
    try {
        e->thread_ = std::thread([p = e.get()] { p->run(); });
    } catch (const std::system_error &err) {
        return make_error(-EAGAIN, std::string("cannot start the progress thread: ") + err.what());
    }
    return e;
}

ProgressEngine::~ProgressEngine() { stop(); }

namespace {
int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }
}  // namespace

Clock::duration ProgressEngine::stalled_for(Clock::time_point now) const {
    if (in_flight_ == 0) return Clock::duration::zero();
    const Clock::time_point beat{std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(beat_ns_.load(std::memory_order_relaxed)))};
    const Clock::time_point since = std::max(beat, last_post_);
    return now > since ? now - since : Clock::duration::zero();
}

void ProgressEngine::set_name(const std::string &name) {
    if (thread_.joinable()) ::pthread_setname_np(thread_.native_handle(), name.substr(0, 15).c_str());
}

Status ProgressEngine::pin(const std::vector<uint32_t> &cpus) { return topology::pin_thread(thread_, cpus); }

std::vector<uint32_t> ProgressEngine::cpus() const {
    return topology::thread_cpus(const_cast<std::thread &>(thread_));  // (native_handle is not const)
}

void ProgressEngine::enqueue(Item item) {
    {
        std::lock_guard lock(mu_);
        items_.push_back(std::move(item));
    }
    const uint64_t one = 1;
    (void)!::write(wake_fd_.get(), &one, sizeof one);
}

void ProgressEngine::post(EngineWork work) {
    if (in_flight_ == 0) last_post_ = Clock::now();  // the stall clock starts with the first op of a busy spell
    ++in_flight_;
    Item i;
    i.kind = Item::Kind::Work;
    i.work = std::move(work);
    enqueue(std::move(i));
}

void ProgressEngine::ring_up(RingLinks links) {
    Item i;
    i.kind = Item::Kind::Up;
    i.generation = links.generation;
    i.links = std::move(links);
    enqueue(std::move(i));
}

void ProgressEngine::ring_down(uint64_t generation) {
    aborted_generation_.store(generation, std::memory_order_release);
    Item i;
    i.kind = Item::Kind::Down;
    i.generation = generation;
    enqueue(std::move(i));
}

void ProgressEngine::cancel(uint64_t op_id) {
    std::lock_guard lock(mu_);
    if (running_op_ == op_id) {
        cancel_running_.store(true, std::memory_order_release);
        return;
    }
    if (std::find(cancelled_.begin(), cancelled_.end(), op_id) == cancelled_.end()) {
        cancelled_.push_back(op_id);
        if (cancelled_.size() > kMaxCancelled) cancelled_.pop_front();
    }
}

void ProgressEngine::skip_to(uint32_t op_tag) {
    Item i;
    i.kind = Item::Kind::Floor;
    i.floor = op_tag;
    enqueue(std::move(i));
}

std::vector<EngineResult> ProgressEngine::take_results() {
    uint64_t drained;
    (void)!::read(result_fd_.get(), &drained, sizeof drained);
    std::lock_guard lock(mu_);
    std::vector<EngineResult> out(std::make_move_iterator(results_.begin()), std::make_move_iterator(results_.end()));
    results_.clear();
    for (const auto &r : out) in_flight_ -= r.op_id != 0;
    return out;
}

void ProgressEngine::stop() {
    {
        std::lock_guard lock(mu_);
        stopping_ = true;
    }
    const uint64_t one = 1;
    if (wake_fd_) (void)!::write(wake_fd_.get(), &one, sizeof one);
    if (thread_.joinable()) thread_.join();
}

void ProgressEngine::push_result(EngineResult r) {
    {
        std::lock_guard lock(mu_);
        results_.push_back(std::move(r));
    }
    const uint64_t one = 1;
    (void)!::write(result_fd_.get(), &one, sizeof one);
}

void ProgressEngine::count_resent() {
    uint64_t m = resent_messages_before_, b = resent_bytes_before_, h = held_before_;
    auto add = [&](const Link *l) {
        if (l) {
            m += l->messages_resent();
            b += l->bytes_resent();
            h += l->messages_held();
        }
    };
    add(next_);
    add(prev_ != next_ ? prev_ : nullptr);
    for (const Link *l : mesh_) add(l);
    resent_messages_.store(m, std::memory_order_relaxed);
    resent_bytes_.store(b, std::memory_order_relaxed);
    held_messages_.store(h, std::memory_order_relaxed);
}

void ProgressEngine::drop_links() {
    count_resent();
    resent_messages_before_ = resent_messages_.load();
    resent_bytes_before_ = resent_bytes_.load();
    held_before_ = held_messages_.load();
    if (next_) transport_->remove_link(next_);
    if (prev_ && prev_ != next_) transport_->remove_link(prev_);
    for (Link *l : mesh_)
        if (l) transport_->remove_link(l);
    mesh_.clear();
    peers_.clear();
    mesh_up_.store(0);
    next_ = prev_ = nullptr;
    links_generation_.store(0);
    next_rails_.store(0);
    prev_rails_.store(0);
}

Status ProgressEngine::offer_rail_streams(uint64_t generation, bool to_next, uint32_t rail, std::vector<UniqueFd> fds,
                                          std::vector<SessionKeys> keys) {
    if (!transport_) return make_error(-ENOTSUP, "no network transport");
    return transport_->offer_rail_streams(link_key(generation, to_next), rail, std::move(fds), std::move(keys));
}

// Between ops the links are still watched, so that a neighbour that goes away is noticed (and
// the generation ends) before the next op needs it.
void ProgressEngine::report_broken_links() {
    if (link_failure_reported_ || !next_ || aborted_generation_.load(std::memory_order_acquire) >= generation_) return;
    auto broken = [&](const Link *l) {
        const auto &e = l ? l->error() : std::nullopt;
        if (!e) return false;
        link_failure_reported_ = true;
        push_result(EngineResult{0, e->code, e->message, true, generation_, {}});
        return true;
    };
    if (broken(next_) || broken(prev_)) return;
    for (const Link *l : mesh_)
        if (broken(l)) return;
}

void ProgressEngine::watch_idle_links() {
    std::vector<LinkEvent> events;
    (void)transport_->poll(events, 0);
    count_resent();
    report_broken_links();
    for (const auto &e : events) {
        if (e.kind != LinkEvent::Kind::Failed || link_failure_reported_) continue;
        if (e.link != next_ && e.link != prev_ && std::find(mesh_.begin(), mesh_.end(), e.link) == mesh_.end()) continue;
        link_failure_reported_ = true;
        push_result(EngineResult{0, e.error.code, e.error.message, true, generation_, {}});
    }
}

void ProgressEngine::run() {
    for (;;) {
        beat_ns_.store(now_ns(), std::memory_order_relaxed);
        Item item;
        bool have = false;
        {
            std::lock_guard lock(mu_);
            if (stopping_) return;
            if (!items_.empty()) {
                item = std::move(items_.front());
                items_.pop_front();
                have = true;
            }
        }
        if (!have) {
            pollfd p[2] = {{wake_fd_.get(), POLLIN, 0}, {transport_ && next_ ? transport_->fd() : -1, POLLIN, 0}};
            ::poll(p, 2, -1);  // woken by an item, by stop(), or by link activity
            uint64_t v;
            if (p[0].revents) (void)!::read(wake_fd_.get(), &v, sizeof v);
            if (p[1].revents) watch_idle_links();
            continue;
        }
        switch (item.kind) {
        case Item::Kind::Work:
            push_result(item.work.ring ? execute_ring(item.work) : execute(item.work, &beat_ns_));
            if (item.work.ring) report_broken_links();
            break;
        case Item::Kind::Up: {
            drop_links();
            RingLinks &l = item.links;
            generation_ = l.generation;
            link_failure_reported_ = false;
            // Both links at once: a transport that exchanges something (ibverbs) writes on both
            // before it reads, so the ring of hosts cannot wait on itself.
            std::vector<LinkSetup> setups;
            setups.emplace_back(l.next_name, std::move(l.to_next), std::move(l.to_next_keys));
            setups.back().rails = std::move(l.to_next_rails);
            setups.back().weights = std::move(l.to_next_weights);
            setups.back().key = link_key(l.generation, true);
            setups.back().rail_state = &next_rails_;
            setups.emplace_back(l.prev_name, std::move(l.from_prev), std::move(l.from_prev_keys));
            setups.back().rails = std::move(l.from_prev_rails);
            setups.back().weights = std::move(l.from_prev_weights);
            setups.back().key = link_key(l.generation, false);
            setups.back().rail_state = &prev_rails_;
            for (RingLinks::Mesh &m : l.mesh) {
                setups.emplace_back(m.name, std::move(m.fds), std::move(m.keys));
                setups.back().rails = std::move(m.rails);
                setups.back().weights = std::move(m.weights);
                setups.back().key = link_key(l.generation, true) | (uint64_t{m.peer + 1} << 56);
            }
            auto links = transport_->add_links(std::move(setups), Clock::now() + kLinkSetupTimeout);
            if (!links) {
                link_failure_reported_ = true;
                push_result(EngineResult{0, links.error().code, links.error().message, true, generation_, {}});
                break;
            }
            next_ = (*links)[0];
            prev_ = (*links)[1];
            mesh_.assign(l.size, nullptr);
            for (size_t k = 0; k < l.mesh.size(); ++k)
                if (l.mesh[k].peer < l.size) mesh_[l.mesh[k].peer] = (*links)[2 + k];
            mesh_up_.store(static_cast<uint32_t>(l.mesh.size()));
            // (Two hosts: two links join them, this host's to the next and the one from it; both
            // use the first host's to the next, so that what one sends the other receives.)
            peers_ = mesh_;
            peers_[(l.rank + l.size - 1) % l.size] = prev_;
            if (l.size > 2 || l.rank == 0) peers_[(l.rank + 1) % l.size] = next_;
            links_generation_.store(l.generation);
            self_name_ = l.self_name;
            pos_ = RingPosition{l.rank, l.size, next_, prev_};
            break;
        }
        case Item::Kind::Down:
            if (item.generation >= generation_) drop_links();
            break;
        case Item::Kind::Floor:
            for (Link *l : links()) l->set_floor(item.floor);
            break;
        }
    }
}

EngineResult ProgressEngine::execute(EngineWork &w, std::atomic<int64_t> *beat) {
    const size_t n = w.slots.size();
    if (w.desc.collective == Collective::AllToAll) {
        // The local ranks' blocks to each other: rank a's block for rank b into b's output, at
        // a's place; each pair's sizes as both ranks say them.
        const size_t es = dtype_size(w.desc.dtype);
        std::vector<AllToAllLayout> lay;
        for (size_t r = 0; r < n; ++r) lay.emplace_back(w.desc, r < w.splits.size() ? w.splits[r] : nullptr);
        const auto &g = w.host_ranks[0];
        for (size_t a = 0; a < n; ++a)
            for (size_t b = 0; b < n; ++b)
                if (lay[a].send_count(g[b]) != lay[b].recv_count(g[a]))
                    return EngineResult{w.op_id, -EINVAL,
                                        "all_to_all: rank " + std::to_string(g[a]) + " sends rank " + std::to_string(g[b]) + " " +
                                            std::to_string(lay[a].send_count(g[b])) + " elements, and rank " +
                                            std::to_string(g[b]) + " expects " + std::to_string(lay[b].recv_count(g[a])),
                                        false, 0, std::move(w.slots)};
        for (size_t a = 0; a < n; ++a)
            for (size_t b = 0; b < n; ++b)
                if (const uint64_t k = lay[a].send_count(g[b]))
                    std::memcpy(w.slots[b]->data() + w.out_offsets[b] + lay[b].recv_at(g[a]) * es,
                                w.slots[a]->data() + w.offsets[a] + lay[a].send_at(g[b]) * es, k * es);
        if (beat) beat->store(now_ns(), std::memory_order_relaxed);
        return EngineResult{w.op_id, 0, {}, false, 0, std::move(w.slots)};
    }
    if (w.desc.collective != Collective::Allreduce) {
        // The local ranks' reduce_scatter or gather (RingEngine's, for a ring of one host).
        std::vector<std::byte *> locals, outputs;
        for (size_t r = 1; r < n; ++r) {
            locals.push_back(w.slots[r]->data() + w.offsets[r]);
            outputs.push_back(w.slots[r]->data() + w.out_offsets[r]);
        }
        RingOp op;
        op.collective = w.desc.collective;
        op.dtype = w.desc.dtype;
        op.op = w.desc.op;
        op.count = w.desc.count;
        op.avg_divisor = w.avg_divisor;
        op.root = w.desc.root;
        op.data.base = w.slots[0]->data();
        op.data.bytes = w.slots[0]->data_bytes();
        op.data_offset = w.offsets[0];
        op.out_offset = w.out_offsets[0];
        op.locals = locals;
        op.local_outputs = outputs;
        op.host_ranks = w.host_ranks;
        RingEngine::run_local(op);
        if (beat) beat->store(now_ns(), std::memory_order_relaxed);
        return EngineResult{w.op_id, 0, {}, false, 0, std::move(w.slots)};
    }
    // One local rank: the input already is the result (avg over one contribution included).
    const uint64_t count = w.desc.count;
    if (n > 1 && count > 0) {
        const size_t es = dtype_size(w.desc.dtype);
        const size_t slice = beat ? std::max<size_t>(1, (16u << 20) / es) : count;
        std::array<void *, proto::kMaxLocalSize> bufs;
        for (size_t at = 0; at < count; at += slice) {
            for (size_t r = 0; r < n; ++r) bufs[r] = w.slots[r]->data() + w.offsets[r] + at * es;
            reduce(ReduceArgs{w.desc.dtype, w.desc.op, bufs.data(), n, bufs.data(), n, std::min(slice, count - at),
                              w.avg_divisor});
            if (beat) beat->store(now_ns(), std::memory_order_relaxed);
        }
    }
    return EngineResult{w.op_id, 0, {}, false, 0, std::move(w.slots)};
}

EngineResult ProgressEngine::execute_ring(EngineWork &w) {
    EngineResult res{w.op_id, 0, {}, false, w.generation, {}};
    auto done = [&](int code, std::string msg, bool link) {
        res.status = code;
        res.message = std::move(msg);
        res.link_failed = link;
        res.slots = std::move(w.slots);
        return std::move(res);
    };
    if (!next_ || w.generation != generation_ || aborted_generation_.load() >= w.generation)
        return done(-ECONNABORTED, "ring generation " + std::to_string(w.generation) + " is over", false);
    // Local rank 0's slot is the ring's data region; the other local ranks' buffers are folded in
    // and written out by the ring itself, chunk by chunk.
    locals_.clear();
    local_outputs_.clear();
    for (size_t r = 1; r < w.slots.size(); ++r) {
        locals_.push_back(w.slots[r]->data() + w.offsets[r]);
        if (w.desc.collective != Collective::Allreduce) local_outputs_.push_back(w.slots[r]->data() + w.out_offsets[r]);
    }
    const bool solo = solo_tag(w.op_tag);
    if (solo) {
        std::lock_guard lock(mu_);
        if (auto it = std::find(cancelled_.begin(), cancelled_.end(), w.op_id); it != cancelled_.end()) {
            cancelled_.erase(it);
            for (Link *l : links()) l->set_floor(solo_tag_next(w.op_tag));
            return done(-ECANCELED, "the op was cancelled", false);
        }
        running_op_ = w.op_id;
        cancel_running_.store(false, std::memory_order_relaxed);
    }
    struct NotRunning {
        ProgressEngine *e;
        bool solo;
        ~NotRunning() {
            if (!solo) return;
            std::lock_guard lock(e->mu_);
            e->running_op_ = 0;
        }
    } not_running{this, solo};
    // Whatever the hosts still send of the solo ops before this one ended here (the previous
    // host's data, the next host's delivery markers, an all_to_all's from every host).
    if (solo)
        for (Link *l : links()) l->set_floor(w.op_tag);
    if (w.desc.collective == Collective::AllToAll) return execute_all_to_all(w, solo);
    RingOp op;
    op.collective = w.desc.collective;
    op.dtype = w.desc.dtype;
    op.op = w.desc.op;
    op.count = w.desc.count;
    op.avg_divisor = w.avg_divisor;
    op.root = w.desc.root;
    op.wire = w.desc.wire;
    op.data = w.slots[0]->region();
    op.data_offset = w.offsets[0];
    op.out_offset = w.desc.collective == Collective::Allreduce ? w.offsets[0] : w.out_offsets[0];
    op.staging = staging_;
    op.locals = locals_;
    op.local_outputs = local_outputs_;
    op.host_ranks = w.host_ranks;
    std::unique_lock<std::mutex> residual_lock;
    if (w.residual && op.compressed()) residual_lock = std::unique_lock(w.residual->mu, std::try_to_lock);
    if (residual_lock.owns_lock()) {
        // (a tag's first op, or one of another size: it starts over; the engine's count of the
        // buffer with a block per rank, from the rank map it runs with)
        // A residual of the other schedule, or of another place in the ring, means something else
        // (the ring's: partial sums this host forwarded; the exchange's: its contributions and
        // its shard's sums): it starts over too.
        std::vector<float> &r = w.residual->values;
        const uint64_t want = op.full_count();
        const uint64_t kind = (w.exchange ? 1ull << 63 : 0) | uint64_t{pos_.size} << 32 | pos_.rank;
        if (r.size() != want || w.residual->kind != kind) r.assign(want, 0.0f);
        w.residual->kind = kind;
        op.residual = r.data();
    }
    op.op_tag = w.op_tag;
    op.aborted_generation = &aborted_generation_;
    op.generation = w.generation;
    op.beat_ns = &beat_ns_;
    op.cancelled = solo ? &cancel_running_ : nullptr;
    op.progress_ns = &progress_ns_;
    progress_ns_.store(now_ns(), std::memory_order_relaxed);
    if (w.exchange) return execute_exchange(w, op, solo);
    const uint64_t sent0 = next_->bytes_sent(), recv0 = prev_->bytes_received(), ref0 = next_->bytes_sent_by_reference();
    std::array<uint64_t, kMaxRailsPerLink> rail0;
    for (uint32_t r = 0; r < kMaxRailsPerLink; ++r) rail0[r] = next_->bytes_sent_on_rail(r);
    Status s = ring_->run(pos_, op, w.deadline != std::chrono::steady_clock::time_point{} ? w.deadline : Clock::now() + op_timeout_);
    bytes_to_next_ += next_->bytes_sent() - sent0;
    bytes_from_prev_ += prev_->bytes_received() - recv0;
    bytes_by_reference_ += next_->bytes_sent_by_reference() - ref0;
    for (uint32_t r = 0; r < kMaxRailsPerLink; ++r)
        if (const uint64_t d = next_->bytes_sent_on_rail(r) - rail0[r]) rail_bytes_to_next_[r] += d;
    count_resent();
    if (!s && s.error().code == -ECANCELED && solo) {
        // (An op this large may have sent from the trainer's slot by reference: ring_engine.h.)
        const bool by_reference = op.by_reference() && !next_->delivered_at_send_done();
        if (drain_cancelled(w.op_tag, by_reference ? std::vector<Link *>{next_} : std::vector<Link *>{}))
            return done(-ECANCELED, s.error().message, false);
        const std::string peer = next_->peer();  // (the link goes with drop_links)
        link_failure_reported_ = true;
        drop_links();
        return done(-ECANCELED, "the cancelled op's messages did not leave within " +
                                    std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kCancelDrain).count()) +
                                    " s: the link to " + peer + " is treated as broken", true);
    }
    if (!s) {
        // The ring returns -ECONNABORTED when the control thread aborted the generation; a link
        // can fail with the same code (a socket aborted by the kernel), and that is a link failure.
        const bool aborted = s.error().code == -ECONNABORTED && aborted_generation_.load() >= w.generation;
        const bool link = !aborted;
        if (link) link_failure_reported_ = true;
        // A failed op ends the generation. Drop its links now, not when the control thread's
        // ring_down arrives: receives of this op may still be posted into the trainer's slot
        // (with RDMA the peer's NIC writes there on its own), and the trainer gets its slot back
        // with the result.
        drop_links();
        return done(s.error().code, s.error().message, link);
    }
    return done(0, {}, false);
}

// all_to_all over the links to every host (AllToAllEngine), from and into the local ranks' slots.
// Counts that differ fail the op here and leave the links as they were; a failed run ends the
// generation like a ring op's.
EngineResult ProgressEngine::execute_all_to_all(EngineWork &w, bool solo) {
    EngineResult res{w.op_id, 0, {}, false, w.generation, {}};
    auto done = [&](int code, std::string msg, bool link) {
        res.status = code;
        res.message = std::move(msg);
        res.link_failed = link;
        res.slots = std::move(w.slots);
        return std::move(res);
    };
    a2a_regions_.clear();
    a2a_layouts_.clear();
    for (size_t r = 0; r < w.slots.size(); ++r) {
        a2a_regions_.push_back(w.slots[r]->region());
        a2a_layouts_.emplace_back(w.desc, r < w.splits.size() ? w.splits[r] : nullptr);
    }
    AllToAllOp op;
    op.dtype = w.desc.dtype;
    op.self = pos_.rank;
    op.self_name = self_name_;
    op.host_ranks = w.host_ranks;
    op.layouts = a2a_layouts_;
    op.regions = a2a_regions_;
    op.in_offsets = w.offsets;
    op.out_offsets = w.out_offsets;
    op.links = peers_;
    op.staging = staging_;
    op.op_tag = w.op_tag;
    op.aborted_generation = &aborted_generation_;
    op.generation = w.generation;
    op.progress_ns = &progress_ns_;
    op.beat_ns = &beat_ns_;
    op.cancelled = solo ? &cancel_running_ : nullptr;
    progress_ns_.store(now_ns(), std::memory_order_relaxed);
    const std::vector<Link *> links = this->links();
    uint64_t sent0 = 0, recv0 = 0, ref0 = 0;
    for (Link *l : links) sent0 += l->bytes_sent(), recv0 += l->bytes_received(), ref0 += l->bytes_sent_by_reference();
    std::string op_error;
    Status s = op.host_ranks.size() != peers_.size()
                   ? Status(make_error(-EINVAL, "all_to_all: the rank map has " + std::to_string(op.host_ranks.size()) +
                                                    " hosts, the ring " + std::to_string(peers_.size())))
                   : a2a_->run(op, w.deadline != std::chrono::steady_clock::time_point{} ? w.deadline : Clock::now() + op_timeout_,
                               &op_error);
    uint64_t sent = 0, recv = 0, ref = 0;
    for (Link *l : links) sent += l->bytes_sent(), recv += l->bytes_received(), ref += l->bytes_sent_by_reference();
    a2a_sent_ += sent - sent0;
    a2a_by_reference_ += ref - ref0;
    a2a_received_ += recv - recv0;
    count_resent();
    std::vector<Link *> by_reference;  // (the ways its blocks went by reference)
    if (!s && s.error().code == -ECANCELED && solo)
        for (Link *l : links)
            if (a2a_->sent_by_reference(l)) by_reference.push_back(l);
    if (!s) return end_failed_mesh_op(w, s, solo, by_reference, "all_to_all");
    if (!op_error.empty()) return done(-EPROTO, op_error, false);
    return done(0, {}, false);
}

// An op over the links to every host that failed: a cancelled solo op drains its sends (`fence`:
// the links it sent by reference to), else, or when they do not leave in time, the generation
// ends (receives may still be posted into the trainers' slots or the staging).
EngineResult ProgressEngine::end_failed_mesh_op(EngineWork &w, const Status &s, bool solo, const std::vector<Link *> &fence,
                                                std::string_view what) {
    EngineResult res{w.op_id, s.error().code, s.error().message, false, w.generation, std::move(w.slots)};
    if (s.error().code == -ECANCELED && solo) {
        if (drain_cancelled(w.op_tag, fence)) return res;
        res.message = "the cancelled " + std::string(what) + "'s messages did not leave within " +
                      std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kCancelDrain).count()) +
                      " s: the lane's links are treated as broken";
        res.link_failed = link_failure_reported_ = true;
        drop_links();
        return res;
    }
    const bool aborted = s.error().code == -ECONNABORTED && aborted_generation_.load() >= w.generation;
    res.link_failed = !aborted;
    if (!aborted) link_failure_reported_ = true;
    drop_links();
    return res;
}

// A compressed allreduce or reduce_scatter (f32, bf16) as the exchange of shards (ExchangeEngine)
// over the links to every host, from and into the local ranks' slots; a failed run ends the
// generation like a ring op's.
EngineResult ProgressEngine::execute_exchange(EngineWork &w, const RingOp &ring_op, bool solo) {
    EngineResult res{w.op_id, 0, {}, false, w.generation, {}};
    auto done = [&](int code, std::string msg, bool link) {
        res.status = code;
        res.message = std::move(msg);
        res.link_failed = link;
        res.slots = std::move(w.slots);
        return std::move(res);
    };
    ExchangeOp op;
    op.collective = ring_op.collective;
    op.host_ranks = ring_op.host_ranks;
    op.out_offset = ring_op.out_offset;
    op.local_outputs = ring_op.local_outputs;
    op.op = ring_op.op;
    op.dtype = ring_op.dtype;
    op.wire = ring_op.wire;
    op.count = ring_op.count;
    op.avg_divisor = ring_op.avg_divisor;
    op.residual = ring_op.residual;
    op.data = ring_op.data;
    op.data_offset = ring_op.data_offset;
    op.locals = ring_op.locals;
    op.staging = staging_;
    op.self = pos_.rank;
    op.links = peers_;
    op.op_tag = w.op_tag;
    op.aborted_generation = &aborted_generation_;
    op.generation = w.generation;
    op.cancelled = ring_op.cancelled;
    op.progress_ns = &progress_ns_;
    op.beat_ns = &beat_ns_;
    const std::vector<Link *> links = this->links();
    uint64_t sent0 = 0, recv0 = 0;
    for (Link *l : links) sent0 += l->bytes_sent(), recv0 += l->bytes_received();
    // (what goes to the next host and comes from the previous one counts as the ring's does, in
    // the members' and rails' figures)
    const uint64_t next0 = next_->bytes_sent(), prev0 = prev_->bytes_received();
    std::array<uint64_t, kMaxRailsPerLink> rail0;
    for (uint32_t r = 0; r < kMaxRailsPerLink; ++r) rail0[r] = next_->bytes_sent_on_rail(r);
    Status s = exchange_->run(op, w.deadline != std::chrono::steady_clock::time_point{} ? w.deadline : Clock::now() + op_timeout_);
    uint64_t sent = 0, recv = 0;
    for (Link *l : links) sent += l->bytes_sent(), recv += l->bytes_received();
    exchange_sent_ += sent - sent0;
    exchange_received_ += recv - recv0;
    bytes_to_next_ += next_->bytes_sent() - next0;
    bytes_from_prev_ += prev_->bytes_received() - prev0;
    for (uint32_t r = 0; r < kMaxRailsPerLink; ++r)
        if (const uint64_t d = next_->bytes_sent_on_rail(r) - rail0[r]) rail_bytes_to_next_[r] += d;
    exchange_ops_ += s.ok() ? 1 : 0;
    count_resent();
    if (!s) return end_failed_mesh_op(w, s, solo, {}, collective_name(w.desc.collective));  // (sends are copies: no fence)
    return done(0, {}, false);
}

std::vector<Link *> ProgressEngine::links() const {
    std::vector<Link *> v;
    for (Link *l : {next_, prev_})
        if (l && std::find(v.begin(), v.end(), l) == v.end()) v.push_back(l);
    for (Link *l : mesh_)
        if (l) v.push_back(l);
    return v;
}

bool ProgressEngine::drain_cancelled(uint32_t op_tag, const std::vector<Link *> &fence) {
    // Receives from every host: the previous host's data and the next host's delivery marker (a
    // ring op), every host's data and markers (all_to_all).
    const std::vector<Link *> all = links();
    for (Link *l : all) {
        l->cancel_receives(op_tag);
        l->set_floor(solo_tag_next(op_tag));
        // Pages sent by reference stay the trainer's until the peer has read them (or dropped
        // them): a fence behind them comes back once it has. (A ring op sends them to the next
        // host only; an all_to_all to each host it sent a MiB or more.)
        if (std::find(fence.begin(), fence.end(), l) != fence.end()) l->fence(op_tag);
    }
    const auto until = Clock::now() + kCancelDrain;
    std::vector<LinkEvent> events;
    auto sending = [&] {
        for (Link *l : all)
            if (l->sending(op_tag)) return true;
        return false;
    };
    auto failed = [&] {
        for (Link *l : all)
            if (l->error()) return true;
        return false;
    };
    while (sending()) {
        if (failed() || Clock::now() >= until) return false;
        if (aborted_generation_.load(std::memory_order_acquire) >= generation_) return false;
        beat_ns_.store(now_ns(), std::memory_order_relaxed);
        events.clear();
        if (!transport_->poll(events, 10)) return false;
    }
    return !failed();
}

}  // namespace ringd
