#include "daemon/engine/ring_engine.h"

#include <cstring>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/engine/op_wait.h"
#include "daemon/engine/reduce.h"
#include "daemon/engine/wire.h"

namespace ringd {
namespace {

constexpr uint32_t kMaxChunks = 1u << 20;
constexpr uint32_t kMaxSteps = 1u << 11;

// Receives that reduce land in a staging slot; the others in the data region.
bool lands_in_staging(Prim p) { return p == Prim::RecvReduceSend || p == Prim::RecvReduceCopy || p == Prim::RecvReduceCopySend; }

uint64_t seg_begin(uint64_t count, uint32_t n, uint32_t k) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(count) * k) / n);
}

}  // namespace

uint64_t RingOp::ranks() const {
    uint64_t n = 0;
    for (const auto &h : host_ranks) n += h.size();
    return n;
}

bool RingOp::find_root(uint32_t *host, uint32_t *local) const {
    for (size_t h = 0; h < host_ranks.size(); ++h)
        for (size_t l = 0; l < host_ranks[h].size(); ++l)
            if (host_ranks[h][l] == root) {
                *host = static_cast<uint32_t>(h);
                *local = static_cast<uint32_t>(l);
                return true;
            }
    return false;
}

bool RingOp::by_reference() const { return !compressed() && full_count() * dtype_size(dtype) >= RingEngine::kConfirmBytes; }

void RingEngine::segments(const RingPosition &pos, const RingOp &op, Window w) {
    const uint32_t n = pos.size;
    const uint64_t pad = op.compressed() && !wire_in_data_ ? 1 : 0;  // (ring_engine.h: a spare element after each piece)
    seg_pieces_.clear();
    seg_base_.assign(n + 1, 0);
    for (uint32_t k = 0; k < n; ++k) {
        seg_base_[k] = seg_pieces_.size();
        if (collective_is_rooted(op.collective)) {
            // A chain: the whole window is segment 0; the root's local rank is the one whose
            // input leaves (broadcast) or whose output gets the result (reduce).
            if (k == 0)
                seg_pieces_.push_back({w.begin, w.count, 0, w.begin,
                                       pos.rank == root_host_ ? static_cast<int32_t>(root_local_) : -1});
            continue;
        }
        if (op.collective == Collective::Allreduce) {
            // One n-th of the window, each: the ring of peer protocol 1.
            const uint64_t b = seg_begin(w.count, n, k), e = seg_begin(w.count, n, k + 1);
            seg_pieces_.push_back({w.begin + b, e - b, b + k * pad, 0, -1});
            continue;
        }
        // The window's part of the blocks of host k's ranks, in its local-rank order; their
        // partials are in the work area by rank.
        const auto &ranks = op.host_ranks[k];
        for (size_t l = 0; l < ranks.size(); ++l) {
            const uint64_t b = ranks[l];
            seg_pieces_.push_back({b * op.count + w.begin, w.count, b * (w.count + pad), w.begin,
                                   k == pos.rank ? static_cast<int32_t>(l) : -1});
        }
    }
    seg_base_[n] = seg_pieces_.size();
}

uint64_t RingEngine::most_chunks(const RingPosition &pos, const RingOp &op, Window w, uint64_t chunk_elems) const {
    // Allreduce: the bound of peer protocol 1 (its tags number chunks from it).
    if (op.collective == Collective::Allreduce) return w.count / pos.size / chunk_elems + 1;
    if (collective_is_rooted(op.collective)) return w.count / chunk_elems + 1;
    uint64_t most = 0;
    for (const auto &h : op.host_ranks) most = std::max<uint64_t>(most, h.size() * ((w.count + chunk_elems - 1) / chunk_elems));
    return most + 1;
}

void RingEngine::plan(const RingPosition &pos, const RingOp &op, Window w, uint64_t chunk_elems, uint32_t slots) {
    schedule_ = schedule::ring(op.collective, pos.rank, pos.size, root_host_);
    segments(pos, op, w);
    // A receive into the data region waits for an earlier send of the same segment to be done
    // (allreduce's allgather, over what its reduce-scatter sent).
    recv_after_send_.assign(schedule_.size(), -1);
    last_send_.assign(pos.size, -1);
    for (size_t i = 0; i < schedule_.size(); ++i) {
        if (schedule_[i].recv != Prim::None && !lands_in_staging(schedule_[i].recv))
            recv_after_send_[i] = last_send_[schedule_[i].recv_seg];
        if (schedule_[i].send != Prim::None) last_send_[schedule_[i].send_seg] = static_cast<int32_t>(i);
    }
    sends_.clear();
    recvs_.clear();
    send_base_.assign(schedule_.size(), 0);
    recv_base_.assign(schedule_.size(), 0);
    auto add = [&](std::vector<Msg> &list, std::vector<size_t> &base, uint32_t entry, uint32_t seg, Prim p) {
        base[entry] = list.size();
        if (p == Prim::None) return;  // (a chain's step this host takes no part in)
        uint32_t j = 0;
        for (size_t p = seg_base_[seg]; p < seg_base_[seg + 1]; ++p) {
            const Piece &pc = seg_pieces_[p];
            for (uint64_t at = 0, len = 0; at < pc.elems; at += len, ++j) {
                len = std::min(chunk_elems, pc.elems - at);
                if (wire_in_data_ && pc.elems - at - len == 1) ++len;  // (no chunk of one value: ring_engine.h)
                list.push_back({entry, j, pc.elem + at, len, pc.work + at, pc.in_block + at, pc.owner, false, false, -1, false});
            }
        }
    };
    for (uint32_t i = 0; i < schedule_.size(); ++i) {
        add(sends_, send_base_, i, schedule_[i].send_seg, schedule_[i].send);
        add(recvs_, recv_base_, i, schedule_[i].recv_seg, schedule_[i].recv);
    }
    free_slots_.clear();
    for (uint32_t i = 0; i < slots; ++i) free_slots_.push_back(static_cast<int32_t>(slots - 1 - i));
}

void RingEngine::run_local(const RingOp &op) {
    const size_t es = dtype_size(op.dtype);
    std::byte *in = op.data.base + op.data_offset;
    std::byte *out = op.data.base + op.out_offset;
    auto input = [&](size_t l) { return l == 0 ? in : op.locals[l - 1]; };
    auto output = [&](size_t l) { return l == 0 ? out : op.local_outputs[l - 1]; };
    const size_t locals = op.locals.size() + 1;
    std::vector<const void *> srcs;
    std::vector<void *> dsts;
    switch (op.collective) {
    case Collective::Allreduce:
        // The local ranks' reduction, written to all of them.
        srcs.assign(1, in);
        dsts.assign(1, in);
        for (std::byte *l : op.locals) {
            srcs.push_back(l);
            dsts.push_back(l);
        }
        if (op.count > 0 && (srcs.size() > 1 || op.op == ReduceOp::Avg))
            reduce(ReduceArgs{op.dtype, op.op, srcs.data(), srcs.size(), dsts.data(), dsts.size(), op.count,
                              op.avg_divisor});
        return;
    case Collective::ReduceScatter:
        // Rank b's block of every local rank's input, reduced into rank b's output.
        for (size_t l = 0; l < locals && op.count > 0; ++l) {
            const uint64_t b = op.host_ranks[0][l];
            srcs.clear();
            for (size_t q = 0; q < locals; ++q) srcs.push_back(input(q) + b * op.count * es);
            dsts.assign(1, output(l));
            reduce(ReduceArgs{op.dtype, op.op, srcs.data(), srcs.size(), dsts.data(), 1, op.count, op.avg_divisor});
        }
        return;
    case Collective::Allgather:
        // Every local rank's input into its block of every local rank's output.
        for (size_t q = 0; q < locals && op.count > 0; ++q)
            for (size_t l = 0; l < locals; ++l) {
                std::byte *to = output(l) + op.host_ranks[0][q] * op.count * es;
                if (to != input(q)) std::memmove(to, input(q), op.count * es);
            }
        return;
    case Collective::Broadcast:
    case Collective::Reduce: {
        uint32_t host = 0, root = 0;
        if (!op.find_root(&host, &root) || op.count == 0) return;  // (run() refuses a root the map lacks)
        if (op.collective == Collective::Broadcast) {
            for (size_t l = 0; l < locals; ++l)
                if (l != root) std::memcpy(output(l), input(root), op.count * es);
            return;
        }
        // Every local rank's buffer reduced into the root's (avg: one pass, divided there).
        for (size_t q = 0; q < locals; ++q) srcs.push_back(input(q));
        dsts.assign(1, output(root));
        reduce(ReduceArgs{op.dtype, op.op, srcs.data(), srcs.size(), dsts.data(), 1, op.count, op.avg_divisor});
        return;
    }
    case Collective::Barrier: return;
    case Collective::AllToAll: return;  // (ProgressEngine::execute runs a host's all_to_all: its split sizes)
    }
}

Status RingEngine::run(const RingPosition &pos, const RingOp &op, std::chrono::steady_clock::time_point deadline) {
    const size_t es = dtype_size(op.dtype);
    const bool reduces = collective_reduces(op.collective);
    const size_t ps = reduces ? dtype_size(partial_dtype(op.dtype, op.op)) : es;
    const bool compressed = op.compressed();
    // A compressed op of f32 keeps its partials and encodings in the data region, where they fit,
    // as long as no piece of it is a single value (its encoding may take more than 4 bytes);
    // the others in the work area.
    const uint64_t fewest = op.collective == Collective::Allreduce ? op.count / pos.size : op.count;
    wire_in_data_ = compressed && ps == es && fewest >= 2;
    const bool in_work = ps != es || (compressed && !wire_in_data_);  // partials in the f32 work area
    if (compressed && (static_cast<uint32_t>(op.wire) >= kWireFormatCount || !wire_applies(op.collective, op.dtype, op.op)))
        return make_error(-EINVAL, "ring op: a " + std::string(wire_format_name(op.wire)) + " wire carries sums and averages of "
                                   "f32 and bf16 only");
    if (op.collective != Collective::Allreduce && op.count && op.ranks() > UINT64_MAX / op.count / es)
        return make_error(-E2BIG, "ring op: its buffer's size overflows");
    const uint64_t full = op.full_count();
    const uint64_t in_count = op.collective == Collective::Allgather ? op.count : full;
    const uint64_t out_count = op.collective == Collective::ReduceScatter ? op.count : full;
    if (op.collective != Collective::Allreduce) {
        if (op.host_ranks.size() != pos.size) return make_error(-EINVAL, "ring op: the group's ranks name another ring");
        if (op.host_ranks[pos.rank].size() != op.locals.size() + 1 || op.local_outputs.size() != op.locals.size())
            return make_error(-EINVAL, "ring op: the group's ranks on this host are not its local ranks");
    }
    if (collective_is_rooted(op.collective) && !op.find_root(&root_host_, &root_local_))
        return make_error(-EINVAL, "ring op: root rank " + std::to_string(op.root) + " is not in the group's rank map");
    if (op.data_offset > op.data.bytes || in_count > (op.data.bytes - op.data_offset) / es)
        return make_error(-ERANGE, "ring op outside its data region");
    if (op.collective != Collective::Allreduce &&
        (op.out_offset > op.data.bytes || out_count > (op.data.bytes - op.out_offset) / es))
        return make_error(-ERANGE, "ring op's output outside its data region");
    if (pos.size <= 1) {
        run_local(op);
        return Ok{};
    }
    if (op.collective == Collective::Barrier || op.collective == Collective::AllToAll)  // (the direct exchange runs them)
        return make_error(-EINVAL, "ring op: a " + std::string(collective_name(op.collective)) + " has no ring schedule");
    if (pos.size > kMaxSteps) return make_error(-E2BIG, "ring of more than 2048 hosts");
    const uint64_t work = in_work ? work_bytes(opt_) : 0;
    if (op.staging.bytes < opt_.chunk_bytes * opt_.depth + work) return make_error(-EINVAL, "ring staging area is too small");
    if (in_work && work < opt_.chunk_bytes) return make_error(-EINVAL, "ring work area is smaller than a chunk");
    // Ops with partials in the work area run in windows whose partials fit it (compressed ones
    // with a spare element after each piece: segments()); the others in one. A reduce_scatter's
    // window is a sub-range of every block.
    const uint64_t blocks = collective_blocked(op.collective) ? std::max<uint64_t>(op.ranks(), 1) : 1;
    const uint64_t pad = compressed && in_work ? (op.collective == Collective::Allreduce ? pos.size : 1) : 0;
    const uint64_t fits = work / ps / blocks;
    const uint64_t window = in_work ? std::max<uint64_t>(fits > pad ? fits - pad : 1, 1) : std::max<uint64_t>(op.count, 1);
    if (compressed) decoded_.resize(opt_.chunk_bytes / ps + 2);  // (the largest chunk, and a merged last value)
    // The delivery marker (ring_engine.h): from the op's size and the links' kind, which every
    // host shares.
    const bool confirm = op.by_reference();
    const bool tell_prev = confirm && !pos.prev->delivered_at_send_done();
    const bool wait_next = confirm && !pos.next->delivered_at_send_done();
    stable_ = wait_next;
    chunk_base_ = 0;
    for (uint64_t begin = 0; begin < op.count; begin += window) {
        const Window w{begin, std::min(window, op.count - begin)};
        const uint64_t chunk = collective_is_rooted(op.collective) ? chain_chunk_for(opt_, (w.count + 1) * ps)
                                                                   : chunk_for(opt_, (w.count * blocks / pos.size + 1) * ps);
        const uint64_t chunk_elems = std::max<uint64_t>(1, chunk / ps);
        const uint64_t chunks = most_chunks(pos, op, w, chunk_elems);
        if (chunk_base_ + chunks >= kMaxChunks)
            return make_error(-E2BIG, "ring op has too many chunks; raise the chunk size");
        if (auto s = run_window(pos, op, w, chunk, deadline); !s) return s;
        chunk_base_ += static_cast<uint32_t>(chunks);
    }
    if (tell_prev || wait_next) return confirm_delivery(pos, op, tell_prev, wait_next, deadline);
    return Ok{};
}

void RingEngine::log_links(const RingPosition &pos, const std::string &stage) const {
    spdlog::warn("ring op timed out {}", stage);
    if (pos.prev) spdlog::warn("  link from {}: {}", pos.prev->peer(), pos.prev->describe());
    if (pos.next && pos.next != pos.prev) spdlog::warn("  link to {}: {}", pos.next->peer(), pos.next->describe());
}

Status RingEngine::confirm_delivery(const RingPosition &pos, const RingOp &op, bool tell_prev, bool wait_next,
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
        if (wait_ms == 0) {
            log_links(pos, "at the delivery marker");
            return make_error(-ETIMEDOUT, "ring " + std::string(collective_name(op.collective)) + " timed out: waiting for " +
                                              (!got ? "host " + pos.next->peer() + " to confirm it has the data"
                                                    : "host " + pos.prev->peer() + " to take the delivery marker"));
        }
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

Status RingEngine::run_window(const RingPosition &pos, const RingOp &op, Window w, uint64_t chunk_bytes,
                              std::chrono::steady_clock::time_point deadline) {
    const size_t es = dtype_size(op.dtype);
    const bool reduces = collective_reduces(op.collective);
    const size_t ps = reduces ? dtype_size(partial_dtype(op.dtype, op.op)) : es;
    const bool compressed = op.compressed();
    const bool in_data = wire_in_data_;                // compressed: partials and encodings in the data region
    const bool widened = ps != es || (compressed && !in_data);  // partials in the work area (f32)
    const bool avg = reduces && op.op == ReduceOp::Avg;
    const bool allreduce = op.collective == Collective::Allreduce;
    // The buffer with a block per rank (allreduce: its buffer) in the data region: the input of
    // a reduce_scatter, the output of an allgather; and the local ranks' buffers of the same
    // shape (their inputs, resp. outputs).
    const uint64_t full_offset = op.collective == Collective::Allgather ? op.out_offset : op.data_offset;
    std::byte *full = op.data.base + full_offset;
    auto local_full = [&](size_t l) { return op.collective == Collective::Allgather ? op.local_outputs[l] : op.locals[l]; };
    // (broadcast and reduce run in place: their buffer is `full`, their local ranks' `locals`.)
    // The other end's buffers: a reduce_scatter's outputs, an allgather's inputs (one block).
    std::byte *in = op.data.base + op.data_offset;
    std::byte *out = op.data.base + op.out_offset;
    const uint64_t work_offset = opt_.chunk_bytes * opt_.depth;
    std::byte *work = op.staging.base + work_offset;
    const size_t nlocal = op.locals.size();
    // Every host has one rank: step 0 carries raw values (no pass over the own segment to scale
    // it), scaled by the receiver. Every host computes the same answer.
    const bool raw_step0 = avg && !widened && op.avg_divisor == pos.size && op.locals.empty();
    // The reductions, over the data region and the other local ranks' buffers (the contributions,
    // scaled for avg where they first meet), and a received chunk (a partial result, or at step 0
    // raw values). Not final: the partial result goes to `out_to` (the received chunk's own slot,
    // in place, when it is forwarded from there), else to the work area (widened) or the data
    // region in place; final: rounded to the dtype, out to every local rank (allreduce) or to the
    // block's owner (reduce_scatter).
    auto fold = [&](const Msg &m, const std::byte *received, bool final, std::byte *out_to = nullptr) {
        std::byte *d = full + m.elem * es;
        srcs_.assign(1, d);
        for (size_t l = 0; l < nlocal; ++l) srcs_.push_back(op.locals[l] + m.elem * es);
        partials_.clear();
        const bool step0 = schedule_[m.entry].step == 0;
        if (received && raw_step0 && step0) srcs_.push_back(received);
        else if (received) partials_.push_back(received);
        ReduceArgs a{op.dtype, op.op, srcs_.data(), srcs_.size(), nullptr, 0, m.elems, op.avg_divisor};
        a.partials = partials_.data();
        a.npartial = partials_.size();
        if (final && allreduce) {
            dsts_.assign(1, d);
            for (std::byte *l : op.locals) dsts_.push_back(l + m.elem * es);
            a.dsts = dsts_.data();
            a.ndst = dsts_.size();
        } else if (final) {
            dsts_.assign(1, (m.owner == 0 ? out : op.local_outputs[m.owner - 1]) + m.in_block * es);
            a.dsts = dsts_.data();
            a.ndst = 1;
        } else {
            a.partial_out = out_to ? static_cast<void *>(out_to)
                                   : widened ? static_cast<void *>(work + m.work * ps) : static_cast<void *>(d);
        }
        reduce(a);
    };
    // An allgather's step 0: the block's local rank's input into the output, its own and every
    // other local rank's.
    auto gather = [&](const Msg &m) {
        const std::byte *src = (m.owner == 0 ? in : op.locals[m.owner - 1]) + m.in_block * es;
        if (full + m.elem * es != src) std::memmove(full + m.elem * es, src, m.elems * es);
        for (size_t l = 0; l < nlocal; ++l)
            if (local_full(l) + m.elem * es != src) std::memmove(local_full(l) + m.elem * es, src, m.elems * es);
    };
    // A send from the data region: by reference where the op confirms delivery (run()).
    auto send_data = [&](const Msg &m) {
        const uint64_t at = full_offset + m.elem * es, bytes = m.elems * es, t = tag(op, m.entry, m.chunk);
        return stable_ ? pos.next->post_send_stable(op.data, at, bytes, t) : pos.next->post_send(op.data, at, bytes, t);
    };
    auto copy_out = [&](const Msg &m) {
        for (size_t l = 0; l < nlocal; ++l) std::memcpy(local_full(l) + m.elem * es, full + m.elem * es, m.elems * es);
    };
    // Compressed: a message's bytes; its partial (f32) in the work area encoded in place (with its
    // residual), and a result's encoding there decoded and delivered to every local rank
    // (allreduce: avg's scaling, rounding to the dtype).
    auto msg_bytes = [&](const Msg &m) { return compressed ? wire_bytes(op.wire, m.elems) : m.elems * ps; };
    auto partial_at = [&](const Msg &m) { return in_data ? full + m.elem * es : work + m.work * ps; };
    auto encode_in_work = [&](const Msg &m) {
        wire_encode(op.wire, reinterpret_cast<const float *>(partial_at(m)), m.elems, partial_at(m),
                    op.residual ? op.residual + m.elem : nullptr);
    };
    auto deliver = [&](const Msg &m) {
        if (!in_data && op.dtype == DType::F32 && op.op == ReduceOp::Sum) {  // (nothing to scale or round)
            wire_decode(op.wire, work + m.work * ps, m.elems, reinterpret_cast<float *>(full + m.elem * es));
            copy_out(m);
            return;
        }
        wire_decode(op.wire, partial_at(m), m.elems, decoded_.data());
        partials_.assign(1, decoded_.data());
        dsts_.assign(1, full + m.elem * es);
        for (size_t l = 0; l < nlocal; ++l) dsts_.push_back(local_full(l) + m.elem * es);
        ReduceArgs a{op.dtype, op.op, nullptr, 0, dsts_.data(), dsts_.size(), m.elems, op.avg_divisor};
        a.partials = partials_.data();
        a.npartial = 1;
        reduce(a);
    };
    auto send_work = [&](const Msg &m) {
        return in_data ? pos.next->post_send(op.data, full_offset + m.elem * es, msg_bytes(m), tag(op, m.entry, m.chunk))
                       : pos.next->post_send(op.staging, work_offset + m.work * ps, msg_bytes(m), tag(op, m.entry, m.chunk));
    };
    // The staging slots: as many of this window's chunks as fit where depth full ones do.
    plan(pos, op, w, std::max<uint64_t>(1, chunk_bytes / ps), static_cast<uint32_t>(opt_.chunk_bytes * opt_.depth / chunk_bytes));

    size_t next_send = 0, next_recv = 0, sends_done = 0, recvs_done = 0;
    LinkPoll poll(opt_.spin_us);
    auto ready_to_send = [&](const Msg &m) {
        const Prim p = schedule_[m.entry].send;
        return p != Prim::Forward || recvs_[index(recv_base_, m.entry - 1, m.chunk)].done;
    };
    for (;;) {
        // Receives in canonical order: reducing ones need a staging slot, the others land in
        // memory that must not still be on its way out (or still to be read).
        while (next_recv < recvs_.size()) {
            Msg &m = recvs_[next_recv];
            Status s = Ok{};
            if (lands_in_staging(schedule_[m.entry].recv)) {
                if (free_slots_.empty()) break;
                m.slot = free_slots_.back();
                free_slots_.pop_back();
                s = pos.prev->post_recv(op.staging, static_cast<uint64_t>(m.slot) * chunk_bytes, msg_bytes(m),
                                        tag(op, m.entry, m.chunk));
            } else {
                const int32_t after = recv_after_send_[m.entry];
                if (after >= 0 && !sends_[index(send_base_, static_cast<uint32_t>(after), m.chunk)].done) break;
                s = compressed && !in_data
                        ? pos.prev->post_recv(op.staging, work_offset + m.work * ps, msg_bytes(m), tag(op, m.entry, m.chunk))
                        : pos.prev->post_recv(op.data, full_offset + m.elem * es, compressed ? msg_bytes(m) : m.elems * es,
                                              tag(op, m.entry, m.chunk));
            }
            if (!s) return s;
            m.posted = true;
            ++next_recv;
        }
        // Sends in canonical order, each once its data is final for this step.
        while (next_send < sends_.size() && ready_to_send(sends_[next_send])) {
            Msg &m = sends_[next_send];
            const Prim p = schedule_[m.entry].send;
            Status s = Ok{};
            if (p == Prim::Send) {
                // This host's own contribution leaves at step 0: its local ranks are summed in
                // first (and avg's contributions scaled, widened ones converted to f32).
                if (widened || !op.locals.empty() || (avg && !raw_step0)) fold(m, nullptr, false);
                if (compressed) encode_in_work(m);
                s = compressed || widened ? send_work(m) : send_data(m);
            } else if (p == Prim::CopySend) {
                gather(m);
                s = send_data(m);
            } else if (schedule_[m.entry - 1].recv == Prim::RecvReduceSend) {
                // A partial result: from its staging slot, or where the reduction left it.
                const Msg &from = recvs_[index(recv_base_, m.entry - 1, m.chunk)];
                if (from.forward) {
                    m.slot = from.slot;  // the partial result stayed in its slot: freed when this is done
                    s = pos.next->post_send(op.staging, static_cast<uint64_t>(m.slot) * chunk_bytes, m.elems * ps,
                                            tag(op, m.entry, m.chunk));
                } else {
                    s = compressed || widened ? send_work(m) : send_data(m);
                }
            } else {
                s = compressed ? send_work(m) : send_data(m);  // a final value (compressed: its encoding in the work area)
            }
            if (!s) return s;
            m.posted = true;
            ++next_send;
        }
        if (sends_done == sends_.size() && recvs_done == recvs_.size()) return Ok{};
        if (auto s = wait_turn(op); !s) return s;
        const int wait_ms = ms_until(deadline);
        if (wait_ms == 0) {
            log_links(pos, "after " + std::to_string(recvs_done) + " of " + std::to_string(recvs_.size()) + " receives and " +
                               std::to_string(sends_done) + " of " + std::to_string(sends_.size()) + " sends");
            return make_error(-ETIMEDOUT, "ring " + std::string(collective_name(op.collective)) + " timed out: waiting for " +
                                              (recvs_done < recvs_.size() ? "data from " + pos.prev->peer()
                                                                          : "host " + pos.next->peer() + " to take data"));
        }
        if (auto s = poll.poll(t_, events_, wait_ms); !s) return s;
        for (const LinkEvent &e : events_) {
            if (e.kind == LinkEvent::Kind::Failed) {
                if (e.link == pos.next || e.link == pos.prev) return e.error;
                continue;
            }
            if ((e.tag >> 32) != op.op_tag) continue;  // not this op's (cannot happen on a fresh ring)
            const auto phase = static_cast<RingPhase>((e.tag >> 31) & 1);
            const auto step = static_cast<uint32_t>((e.tag >> 20) & (kMaxSteps - 1));
            const auto number = static_cast<uint32_t>(e.tag & (kMaxChunks - 1));
            if (number < chunk_base_) continue;  // an earlier window's (cannot happen: it ended first)
            const uint32_t chunk = number - chunk_base_;
            // The step in the schedule: the phases' steps follow each other.
            const uint32_t entry = (phase == kAllgather && allreduce ? pos.size - 1 : 0) + step;
            if (entry >= schedule_.size() || schedule_[entry].phase != phase) continue;  // not a message of this op
            if (op.progress_ns)
                op.progress_ns->store(poll.last_progress_ns(), std::memory_order_relaxed);
            if (e.kind == LinkEvent::Kind::SendDone && e.link == pos.next) {
                Msg &m = sends_[index(send_base_, entry, chunk)];
                if (m.done) continue;
                ++sends_done;
                m.done = true;
                if (m.slot >= 0) free_slots_.push_back(m.slot);
                // Compressed in the data region: an allgather chunk's encoding, forwarded, is
                // decoded over itself now that it is out.
                if (in_data && schedule_[entry].phase == kAllgather) deliver(m);
            } else if (e.kind == LinkEvent::Kind::RecvDone && e.link == pos.prev) {
                Msg &m = recvs_[index(recv_base_, entry, chunk)];
                if (m.done) continue;
                const Prim p = schedule_[entry].recv;
                if (lands_in_staging(p) && compressed) {
                    // Decoded into the work area (the slot is free again at once), reduced there
                    // with this host's contribution: final (reduce_scatter, reduce: to the
                    // block's owner), or the partial encoded in place to be sent on; allreduce's
                    // sum is also delivered here as every host will decode it.
                    float *acc = in_data ? decoded_.data() : reinterpret_cast<float *>(work + m.work * ps);
                    wire_decode(op.wire, op.staging.base + static_cast<uint64_t>(m.slot) * chunk_bytes, m.elems, acc);
                    free_slots_.push_back(m.slot);
                    if (p == Prim::RecvReduceCopy) {
                        fold(m, reinterpret_cast<const std::byte *>(acc), true);
                    } else {
                        fold(m, reinterpret_cast<const std::byte *>(acc), false, partial_at(m));
                        encode_in_work(m);
                        // (in the data region: once the allgather's first send of it is out)
                        if (p == Prim::RecvReduceCopySend && !in_data) deliver(m);
                    }
                } else if (compressed) {
                    // An allgather receive: the encoded result, forwarded from where it is (in the
                    // data region decoded once the forward is out, or now when it is the last step).
                    if (!in_data || p == Prim::RecvCopy) deliver(m);
                } else if (lands_in_staging(p)) {
                    // Reduce while the chunk is hot, the local ranks' contributions with it (this
                    // is the first time the ring touches the chunk); the last step's result is
                    // final: avg's scaling, rounding to the dtype, and out to the local ranks.
                    // A partial result is written over the received chunk in its slot and sent on
                    // from there: the data region is only read (no write-back of a partial that
                    // nobody reads again) and the send copies from memory that is still hot. The
                    // slot is kept only while another one stays free for the receives, so that
                    // the receives in canonical order always progress (slots held by sends wait
                    // on the next host, which has a free slot of its own for the same reason).
                    std::byte *slot = op.staging.base + static_cast<uint64_t>(m.slot) * chunk_bytes;
                    m.forward = p == Prim::RecvReduceSend && !free_slots_.empty();
                    fold(m, slot, p != Prim::RecvReduceSend, m.forward ? slot : nullptr);
                    if (!m.forward) free_slots_.push_back(m.slot);
                } else {
                    copy_out(m);
                }
                m.done = true;
                ++recvs_done;
            }
        }
    }
}

}  // namespace ringd
