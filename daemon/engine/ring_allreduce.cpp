#include "daemon/engine/ring_allreduce.h"

#include <cstring>

#include "common/fd_io.h"
#include "daemon/engine/reduce.h"

namespace ringd {
namespace {

constexpr uint32_t kMaxChunks = 1u << 20;
constexpr uint32_t kMaxSteps = 1u << 11;

// Every turn of a wait: an aborted generation ends the op; else the progress thread's heartbeat.
Status wait_turn(const RingOp &op) {
    if (op.aborted_generation && op.aborted_generation->load(std::memory_order_acquire) >= op.generation)
        return make_error(-ECONNABORTED, "ring generation " + std::to_string(op.generation) + " was aborted");
    if (op.cancelled && op.cancelled->load(std::memory_order_acquire)) return make_error(-ECANCELED, "the op was cancelled");
    if (op.beat_ns)
        op.beat_ns->store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now().time_since_epoch()).count(),
                          std::memory_order_relaxed);
    return Ok{};
}

uint64_t seg_begin(uint64_t count, uint32_t n, uint32_t k) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(count) * k) / n);
}

}  // namespace

void RingAllreduce::plan(const RingPosition &pos, uint64_t count, uint64_t chunk_elems, uint32_t slots) {
    const uint32_t n = pos.size, r = pos.rank;
    steps_ = n - 1;
    sends_.clear();
    recvs_.clear();
    send_base_.assign(2 * steps_, 0);
    recv_base_.assign(2 * steps_, 0);
    auto add = [&](std::vector<Msg> &list, std::vector<size_t> &base, Phase p, uint32_t s, uint32_t seg) {
        base[p * steps_ + s] = list.size();
        const uint64_t b = seg_begin(count, n, seg), e = seg_begin(count, n, seg + 1);
        uint32_t j = 0;
        for (uint64_t at = b; at < e; at += chunk_elems, ++j)
            list.push_back({p, s, j, at, std::min(chunk_elems, e - at), false, false, -1, false});
    };
    for (Phase p : {kReduceScatter, kAllgather}) {
        for (uint32_t s = 0; s < steps_; ++s) {
            const uint32_t send_seg = p == kReduceScatter ? (r + n - s) % n : (r + 1 + n - s) % n;
            const uint32_t recv_seg = p == kReduceScatter ? (r + 2 * n - s - 1) % n : (r + n - s) % n;
            add(sends_, send_base_, p, s, send_seg);
            add(recvs_, recv_base_, p, s, recv_seg);
        }
    }
    free_slots_.clear();
    for (uint32_t i = 0; i < slots; ++i) free_slots_.push_back(static_cast<int32_t>(slots - 1 - i));
}

Status RingAllreduce::run(const RingPosition &pos, const RingOp &op, std::chrono::steady_clock::time_point deadline) {
    const size_t es = dtype_size(op.dtype);
    const size_t ps = dtype_size(partial_dtype(op.dtype, op.op));
    const bool widened = ps != es;
    if (op.data_offset > op.data.bytes || op.count > (op.data.bytes - op.data_offset) / es)
        return make_error(-ERANGE, "ring op outside its data region");
    if (pos.size <= 1) {
        // One host: the local ranks' reduction, written to all of them.
        std::byte *data = op.data.base + op.data_offset;
        srcs_.assign(1, data);
        dsts_.assign(1, data);
        for (std::byte *l : op.locals) {
            srcs_.push_back(l);
            dsts_.push_back(l);
        }
        if (op.count > 0 && (srcs_.size() > 1 || op.op == ReduceOp::Avg))
            reduce(ReduceArgs{op.dtype, op.op, srcs_.data(), srcs_.size(), dsts_.data(), dsts_.size(), op.count,
                              op.avg_divisor});
        return Ok{};
    }
    if (pos.size > kMaxSteps) return make_error(-E2BIG, "ring of more than 2048 hosts");
    const uint64_t work = widened ? work_bytes(opt_) : 0;
    if (op.staging.bytes < opt_.chunk_bytes * opt_.depth + work) return make_error(-EINVAL, "ring staging area is too small");
    if (widened && work < opt_.chunk_bytes) return make_error(-EINVAL, "ring work area is smaller than a chunk");
    // Widened ops run in windows that fit the work area; the others in one.
    const uint64_t window = widened ? work / ps : std::max<uint64_t>(op.count, 1);
    // The delivery marker (ring_allreduce.h): from the op's size and the links' kind, which
    // every host shares.
    const bool confirm = op.count * es >= kConfirmBytes;
    const bool tell_prev = confirm && !pos.prev->delivered_at_send_done();
    const bool wait_next = confirm && !pos.next->delivered_at_send_done();
    stable_ = wait_next;
    chunk_base_ = 0;
    for (uint64_t begin = 0; begin < op.count; begin += window) {
        const uint64_t count = std::min(window, op.count - begin);
        const uint64_t chunk = chunk_for(opt_, (count / pos.size + 1) * ps);
        const uint64_t chunk_elems = std::max<uint64_t>(1, chunk / ps);
        const uint64_t chunks = count / pos.size / chunk_elems + 1;  // at least the most of any segment
        if (chunk_base_ + chunks >= kMaxChunks)
            return make_error(-E2BIG, "ring op has too many chunks; raise the chunk size");
        if (auto s = run_window(pos, op, begin, count, chunk, deadline); !s) return s;
        chunk_base_ += static_cast<uint32_t>(chunks);
    }
    if (tell_prev || wait_next) return confirm_delivery(pos, op, tell_prev, wait_next, deadline);
    return Ok{};
}

Status RingAllreduce::confirm_delivery(const RingPosition &pos, const RingOp &op, bool tell_prev, bool wait_next,
                                       std::chrono::steady_clock::time_point deadline) {
    // A tag no data message has: chunk numbers stay below kMaxChunks - 1 (run()).
    const uint64_t marker = (uint64_t{op.op_tag} << 32) | (uint64_t{kAllgather} << 31) |
                            (uint64_t{kMaxSteps - 1} << 20) | (kMaxChunks - 1);
    bool sent = !tell_prev, got = !wait_next;
    if (wait_next)
        if (auto s = pos.next->post_recv(op.staging, 0, 0, marker); !s) return s;
    if (tell_prev)
        if (auto s = pos.prev->post_send(op.staging, 0, 0, marker); !s) return s;
    while (!sent || !got) {
        if (auto s = wait_turn(op); !s) return s;
        const int wait_ms = ms_until(deadline);
        if (wait_ms == 0)
            return make_error(-ETIMEDOUT, "ring allreduce timed out: waiting for " +
                                              (!got ? "host " + pos.next->peer() + " to confirm it has the data"
                                                    : "host " + pos.prev->peer() + " to take the delivery marker"));
        events_.clear();
        if (auto s = t_.poll(events_, std::min(wait_ms, 100)); !s) return s;
        for (const LinkEvent &e : events_) {
            if (e.kind == LinkEvent::Kind::Failed) {
                if (e.link == pos.next || e.link == pos.prev) return e.error;
                continue;
            }
            if (e.tag != marker) continue;
            if (e.kind == LinkEvent::Kind::SendDone && e.link == pos.prev) sent = true;
            if (e.kind == LinkEvent::Kind::RecvDone && e.link == pos.next) got = true;
        }
    }
    return Ok{};
}

Status RingAllreduce::run_window(const RingPosition &pos, const RingOp &op, uint64_t begin, uint64_t count,
                                 uint64_t chunk_bytes, std::chrono::steady_clock::time_point deadline) {
    const size_t es = dtype_size(op.dtype);
    const size_t ps = dtype_size(partial_dtype(op.dtype, op.op));
    const bool widened = ps != es;
    const bool avg = op.op == ReduceOp::Avg;
    // The window's elements: in the data region and the local ranks' buffers (the dtype), and for
    // widened ops their partial sums in the work area (f32, from the window's start).
    std::byte *data = op.data.base + op.data_offset + begin * es;
    const uint64_t data_offset = op.data_offset + begin * es;
    const uint64_t work_offset = opt_.chunk_bytes * opt_.depth;
    std::byte *work = op.staging.base + work_offset;
    // Every host has one rank: step 0 carries raw values (no pass over the own segment to scale
    // it), scaled by the receiver. Every host computes the same answer.
    const bool raw_step0 = avg && !widened && op.avg_divisor == pos.size && op.locals.empty();
    // The reductions, over the data region and the other local ranks' buffers (the contributions,
    // scaled for avg where they first meet), and a received chunk (a partial result, or at step 0
    // raw values). Not final: the partial result goes to `out` (the received chunk's own slot, in
    // place, when it is forwarded from there), else to the work area (widened) or the data region
    // in place; final: rounded to the dtype, out to every local rank.
    auto fold = [&](uint64_t at, uint64_t elems, const std::byte *received, uint32_t step, bool final,
                    std::byte *out = nullptr) {
        std::byte *d = data + at * es;
        srcs_.assign(1, d);
        for (std::byte *l : op.locals) srcs_.push_back(l + (begin + at) * es);
        partials_.clear();
        if (received && raw_step0 && step == 0) srcs_.push_back(received);
        else if (received) partials_.push_back(received);
        ReduceArgs a{op.dtype, op.op, srcs_.data(), srcs_.size(), nullptr, 0, elems, op.avg_divisor};
        a.partials = partials_.data();
        a.npartial = partials_.size();
        if (final) {
            dsts_.assign(1, d);
            for (std::byte *l : op.locals) dsts_.push_back(l + (begin + at) * es);
            a.dsts = dsts_.data();
            a.ndst = dsts_.size();
        } else {
            a.partial_out = out ? static_cast<void *>(out) : widened ? static_cast<void *>(work + at * ps) : static_cast<void *>(d);
        }
        reduce(a);
    };
    // A send from the data region: by reference where the op confirms delivery (run()).
    auto send_data = [&](const Msg &m) {
        const uint64_t at = data_offset + m.elem_begin * es, bytes = m.elems * es, t = tag(op, m.phase, m.step, m.chunk);
        return stable_ ? pos.next->post_send_stable(op.data, at, bytes, t) : pos.next->post_send(op.data, at, bytes, t);
    };
    auto copy_out = [&](uint64_t at, uint64_t elems) {
        for (std::byte *l : op.locals) std::memcpy(l + (begin + at) * es, data + at * es, elems * es);
    };
    // The staging slots: as many of this window's chunks as fit where depth full ones do.
    plan(pos, count, std::max<uint64_t>(1, chunk_bytes / ps),
         static_cast<uint32_t>(opt_.chunk_bytes * opt_.depth / chunk_bytes));

    const uint32_t last = steps_ - 1;
    size_t next_send = 0, next_recv = 0, sends_done = 0, recvs_done = 0;
    auto last_progress = std::chrono::steady_clock::now();
    bool spin_pays = true;  // adaptive polling: whether spinning has been catching events
    auto ready_to_send = [&](const Msg &m) {
        if (m.phase == kReduceScatter)
            return m.step == 0 || recvs_[index(recv_base_, kReduceScatter, m.step - 1, m.chunk)].done;
        if (m.step == 0) return recvs_[index(recv_base_, kReduceScatter, last, m.chunk)].done;
        return recvs_[index(recv_base_, kAllgather, m.step - 1, m.chunk)].done;
    };
    for (;;) {
        // Receives in canonical order: reduce-scatter ones need a staging slot, allgather ones
        // land in memory that must not still be on its way out (or still to be read).
        while (next_recv < recvs_.size()) {
            Msg &m = recvs_[next_recv];
            Status s = Ok{};
            if (m.phase == kReduceScatter) {
                if (free_slots_.empty()) break;
                m.slot = free_slots_.back();
                free_slots_.pop_back();
                s = pos.prev->post_recv(op.staging, static_cast<uint64_t>(m.slot) * chunk_bytes, m.elems * ps,
                                        tag(op, m.phase, m.step, m.chunk));
            } else {
                if (!sends_[index(send_base_, kReduceScatter, m.step, m.chunk)].done) break;
                s = pos.prev->post_recv(op.data, data_offset + m.elem_begin * es, m.elems * es,
                                        tag(op, m.phase, m.step, m.chunk));
            }
            if (!s) return s;
            m.posted = true;
            ++next_recv;
        }
        // Sends in canonical order, each once its data is final for this step.
        while (next_send < sends_.size() && ready_to_send(sends_[next_send])) {
            Msg &m = sends_[next_send];
            Status s = Ok{};
            if (m.phase == kReduceScatter) {
                // This host's own segment leaves at step 0: its local ranks are summed in first
                // (and avg's contributions scaled, widened ones converted to f32).
                if (m.step == 0 && (widened || !op.locals.empty() || (avg && !raw_step0)))
                    fold(m.elem_begin, m.elems, nullptr, 0, false);
                const Msg *from = m.step > 0 ? &recvs_[index(recv_base_, kReduceScatter, m.step - 1, m.chunk)] : nullptr;
                if (from && from->forward) {
                    m.slot = from->slot;  // the partial result stayed in its slot: freed when this is done
                    s = pos.next->post_send(op.staging, static_cast<uint64_t>(m.slot) * chunk_bytes, m.elems * ps,
                                            tag(op, m.phase, m.step, m.chunk));
                } else {
                    s = widened ? pos.next->post_send(op.staging, work_offset + m.elem_begin * ps, m.elems * ps,
                                                      tag(op, m.phase, m.step, m.chunk))
                                : send_data(m);
                }
            } else {
                s = send_data(m);
            }
            if (!s) return s;
            m.posted = true;
            ++next_send;
        }
        if (sends_done == sends_.size() && recvs_done == recvs_.size()) return Ok{};
        if (auto s = wait_turn(op); !s) return s;
        const int wait_ms = ms_until(deadline);
        if (wait_ms == 0)
            return make_error(-ETIMEDOUT, "ring allreduce timed out: waiting for " +
                                              (recvs_done < recvs_.size() ? "data from " + pos.prev->peer()
                                                                          : "host " + pos.next->peer() + " to take data"));
        events_.clear();
        // busy: never block; adaptive: spin for a while after the last progress, then block;
        // event: block at once. Blocking is bounded so that aborts are seen promptly.
        // adaptive spins only while it pays: a spin that ran out without an event stops the
        // spinning, and a block that an event ended within the spin time starts it again — an op
        // whose events are further apart than that (a link slower than the host) blocks between
        // them rather than burning a core on every gap; one whose events come close together
        // (latency-bound, or links faster than the host) spins as before.
        const auto now = std::chrono::steady_clock::now();
        const auto spin_for = std::chrono::microseconds(opt_.spin_us);
        bool spin = opt_.spin_us < 0;
        if (opt_.spin_us > 0 && spin_pays) {
            spin = now - last_progress < spin_for;
            if (!spin) spin_pays = false;  // ran out: block, and until a block ends quickly
        }
        if (auto s = t_.poll(events_, spin ? 0 : std::min(wait_ms, 100)); !s) return s;
        if (!events_.empty()) {
            last_progress = std::chrono::steady_clock::now();
            if (!spin && last_progress - now < spin_for) spin_pays = true;
        }
        for (const LinkEvent &e : events_) {
            if (e.kind == LinkEvent::Kind::Failed) {
                if (e.link == pos.next || e.link == pos.prev) return e.error;
                continue;
            }
            if ((e.tag >> 32) != op.op_tag) continue;  // not this op's (cannot happen on a fresh ring)
            const auto p = static_cast<Phase>((e.tag >> 31) & 1);
            const auto step = static_cast<uint32_t>((e.tag >> 20) & (kMaxSteps - 1));
            const auto number = static_cast<uint32_t>(e.tag & (kMaxChunks - 1));
            if (number < chunk_base_) continue;  // an earlier window's (cannot happen: it ended first)
            const uint32_t chunk = number - chunk_base_;
            if (op.progress_ns)
                op.progress_ns->store(std::chrono::duration_cast<std::chrono::nanoseconds>(last_progress.time_since_epoch()).count(),
                                      std::memory_order_relaxed);
            if (e.kind == LinkEvent::Kind::SendDone && e.link == pos.next) {
                Msg &m = sends_[index(send_base_, p, step, chunk)];
                if (m.done) continue;
                ++sends_done;
                m.done = true;
                if (m.slot >= 0) free_slots_.push_back(m.slot);
            } else if (e.kind == LinkEvent::Kind::RecvDone && e.link == pos.prev) {
                Msg &m = recvs_[index(recv_base_, p, step, chunk)];
                if (m.done) continue;
                if (p == kReduceScatter) {
                    // Reduce while the chunk is hot, the local ranks' contributions with it (this
                    // is the first time the ring touches the chunk); the last step's result is
                    // final: avg's scaling, rounding to the dtype, and out to every local rank.
                    // A partial result is written over the received chunk in its slot and sent on
                    // from there: the data region is only read (no write-back of a partial that
                    // nobody reads again) and the send copies from memory that is still hot. The
                    // slot is kept only while another one stays free for the receives, so that
                    // the receives in canonical order always progress (slots held by sends wait
                    // on the next host, which has a free slot of its own for the same reason).
                    std::byte *slot = op.staging.base + static_cast<uint64_t>(m.slot) * chunk_bytes;
                    m.forward = step != last && !free_slots_.empty();
                    fold(m.elem_begin, m.elems, slot, step, step == last, m.forward ? slot : nullptr);
                    if (!m.forward) free_slots_.push_back(m.slot);
                } else {
                    copy_out(m.elem_begin, m.elems);
                }
                m.done = true;
                ++recvs_done;
            }
        }
    }
}

}  // namespace ringd
