#include "daemon/engine/exchange_engine.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/engine/op_wait.h"
#include "daemon/engine/reduce.h"
#include "daemon/engine/wire.h"

namespace ringd {
namespace {

constexpr uint64_t kGather = uint64_t{1} << 31;
constexpr uint64_t kLeastPiece = 4096, kMostPiece = 256 << 10;
constexpr size_t kMostSlots = 256;

// Allreduce: shard s of the buffer, [at(s), at(s + 1)), cut on blocks of kWireBlock values.
struct Shards {
    uint64_t count;
    uint32_t hosts;
    uint64_t at(uint32_t s) const {
        const uint64_t blocks = (count + kWireBlock - 1) / kWireBlock;
        return std::min(count, blocks * s / hosts * kWireBlock);
    }
};

uint64_t slot_bytes(WireFormat wire, uint64_t piece) { return (wire_bytes(wire, piece) + 63) / 64 * 64; }

}  // namespace

uint64_t ExchangeEngine::piece_values(uint64_t count, uint32_t hosts) {
    const uint64_t shard = (count + hosts - 1) / std::max<uint32_t>(hosts, 1);
    const uint64_t eighth = (shard / 8 + kWireBlock - 1) / kWireBlock * kWireBlock;
    return std::clamp(eighth, kLeastPiece, kMostPiece);
}

uint64_t ExchangeEngine::staging_needed(WireFormat wire, uint64_t count, uint32_t hosts) {
    return 4 * slot_bytes(wire, piece_values(count, hosts));
}

uint64_t ExchangeEngine::staging_bound() {
    uint64_t most = 0;
    for (WireFormat f : {WireFormat::BF16, WireFormat::FP16, WireFormat::Int8}) most = std::max(most, slot_bytes(f, kMostPiece));
    return 16 * most;
}

Status ExchangeEngine::run(const ExchangeOp &op, std::chrono::steady_clock::time_point deadline) {
    const uint32_t hosts = static_cast<uint32_t>(op.links.size());
    if (hosts < 2 || op.self >= hosts) return make_error(-EINVAL, "exchange: a ring of " + std::to_string(hosts) + " hosts");
    if (op.wire == WireFormat::Exact || static_cast<uint32_t>(op.wire) >= kWireFormatCount ||
        (op.op != ReduceOp::Sum && op.op != ReduceOp::Avg) || (op.dtype != DType::F32 && op.dtype != DType::BF16))
        return make_error(-EINVAL, "exchange: f32 and bf16 sums and averages over a compressed wire only");
    const bool rs = op.collective == Collective::ReduceScatter;
    if (!rs && op.collective != Collective::Allreduce) return make_error(-EINVAL, "exchange: allreduce and reduce_scatter only");
    if (rs && op.host_ranks.size() != hosts) return make_error(-EINVAL, "exchange: the rank map and the links differ");
    uint64_t ranks = 0;
    for (const auto &h : op.host_ranks) ranks += h.size();
    if (rs && op.host_ranks[op.self].size() != op.locals.size() + 1)
        return make_error(-EINVAL, "exchange: the rank map has " + std::to_string(op.host_ranks[op.self].size()) +
                                       " ranks on this host, which runs " + std::to_string(op.locals.size() + 1));
    if (op.count > (uint64_t{1} << 58) / std::max<uint64_t>(ranks, 1))
        return make_error(-EINVAL, "exchange: " + std::to_string(op.count) + " values a rank is too many");
    const uint64_t full = rs ? op.count * ranks : op.count;
    if (rs)
        for (const auto &h : op.host_ranks)
            for (uint32_t r : h)
                if (r >= ranks) return make_error(-EINVAL, "exchange: rank " + std::to_string(r) + " of " + std::to_string(ranks));
    const uint64_t piece = piece_values(full, hosts), sb = slot_bytes(op.wire, piece);
    const size_t nslots = std::min<uint64_t>(op.staging.bytes / sb, kMostSlots);
    if (nslots < 4)
        return make_error(-ENOBUFS, "exchange: " + std::to_string(staging_needed(op.wire, full, hosts)) +
                                        " bytes of staging needed, the lane has " + std::to_string(op.staging.bytes));
    const uint64_t es = dtype_size(op.dtype);
    const bool f32 = op.dtype == DType::F32;
    if (op.data_offset + full * es > op.data.bytes || (rs && op.out_offset + op.count * es > op.data.bytes))
        return make_error(-EINVAL, "exchange: the buffer is outside the slot");
    if (rs && op.local_outputs.size() != op.locals.size())
        return make_error(-EINVAL, "exchange: the local ranks' inputs and outputs differ");
    // The local ranks' buffers (in op.dtype), rank 0's first.
    std::byte *const in0 = op.data.base + op.data_offset;
    auto input = [&](size_t l, uint64_t b) { return (l == 0 ? in0 : op.locals[l - 1]) + b * es; };
    // f32: the sums are accumulated in rank 0's buffer (its input is folded in first). bf16: in
    // acc_, our shard's part of a window of the buffer at a time (below).
    float *const data = reinterpret_cast<float *>(in0);
    // reduce_scatter: where a local rank's result goes.
    auto output = [&](int32_t l) { return l == 0 ? op.data.base + op.out_offset : op.local_outputs[static_cast<size_t>(l - 1)]; };
    // bf16: windows of the buffer (allreduce; reduce_scatter: of each rank's block) whose shard of
    // our pieces fits acc_ (kAccValues), run one after the other, each a whole exchange; pieces of
    // at most `pw` values. f32: one window of the whole buffer.
    uint64_t most_local = 1;
    for (const auto &h : op.host_ranks) most_local = std::max<uint64_t>(most_local, h.size());
    const uint64_t share = std::max<uint64_t>(kWireBlock, acc_values_ / most_local / kWireBlock * kWireBlock);
    // (bf16 allreduce: a window's shard in 32 pieces, 8 for int8, measured: each window starts and
    // drains its pipeline, shorter with smaller pieces, but int8's are CPU-bound by the message)
    const uint64_t cuts = op.wire == WireFormat::Int8 ? 8 : 32;
    const uint64_t pw = f32 ? piece : std::min(piece, rs ? share : std::max(kLeastPiece, acc_values_ / cuts / kWireBlock * kWireBlock));
    const uint64_t block_window = share / pw * pw;  // (whole pieces: every rank's fit acc_)
    const uint64_t shard_window = std::max<uint64_t>(1, acc_values_ / pw) * pw;  // (allreduce: whole pieces, at least one)
    const uint64_t window = f32 ? std::max<uint64_t>(op.count, 1) : rs ? block_window : uint64_t{hosts} * shard_window;
    if (!f32) {
        tmp_.resize(pw);
        acc_.resize(rs ? most_local * block_window : shard_window);
    }
    slots_.assign(nslots, Slot{});
    free_send_.clear();
    free_recv_.clear();
    for (size_t i = 0; i < nslots; ++i) (i < nslots / 2 ? free_send_ : free_recv_).push_back(static_cast<int32_t>(i));
    peers_.resize(hosts - 1);
    for (uint32_t p = 0, i = 0; p < hosts; ++p) {
        if (p == op.self) continue;
        if (!op.links[p]) return make_error(-ENOTCONN, "exchange: no data link to the host at ring position " + std::to_string(p));
        peers_[i++].link = op.links[p];
    }
    const float mean = op.op == ReduceOp::Avg
                           ? std::ldexp(1.0f / static_cast<float>(op.avg_divisor), static_cast<int>(avg_shift_for(op.avg_divisor)))
                           : 1.0f;
    auto slot_at = [&](int32_t s) { return uint64_t(s) * sb; };
    std::array<const void *, proto::kMaxLocalSize> srcs;
    std::array<void *, proto::kMaxLocalSize> dsts;
    // The local ranks' values [b, b + n), reduced into `to` in f32 (avg: scaled by 2^-K, reduce.h);
    // f32, to == data + b: in place.
    auto fold = [&](float *to, uint64_t b, uint64_t n) {
        if (f32 && to == data + b && op.locals.empty() && op.op == ReduceOp::Sum) return;
        size_t ns = 0;
        for (size_t l = 0; l <= op.locals.size() && ns < srcs.size(); ++l) srcs[ns++] = input(l, b);
        ReduceArgs a;
        a.dtype = op.dtype;
        a.op = op.op;
        a.srcs = srcs.data();
        a.nsrc = ns;
        a.count = n;
        a.avg_divisor = op.avg_divisor;
        a.partial_out = to;
        reduce(a);
    };
    // f32 values (a decoded result, the mean scaled) into bf16 buffers, rounded once.
    auto round_into = [&](const float *from, void *const *to, size_t nto, uint64_t n) {
        const void *partial = from;
        ReduceArgs a;
        a.dtype = op.dtype;
        a.op = ReduceOp::Sum;
        a.dsts = to;
        a.ndst = nto;
        a.count = n;
        a.partials = &partial;
        a.npartial = 1;
        reduce(a);
    };
    // What every host decodes of a finished piece [b, b + n): every local rank's result.
    auto deliver = [&](const void *encoded, uint64_t b, uint64_t n) {
        if (f32) {
            wire_decode(op.wire, encoded, n, data + b);
            for (size_t l = 1; l <= op.locals.size(); ++l) std::memcpy(input(l, b), data + b, n * sizeof(float));
            return;
        }
        wire_decode(op.wire, encoded, n, tmp_.data());
        size_t nd = 0;
        for (size_t l = 0; l <= op.locals.size() && nd < dsts.size(); ++l) dsts[nd++] = input(l, b);
        round_into(tmp_.data(), dsts.data(), nd, n);
    };

    uint64_t base = 0;  // the window's first piece number in the op's tags
    auto run_window = [&](uint64_t lo, uint64_t hi) -> Status {
        // Each host's pieces, in the order both ends post them: allreduce, its shard's; reduce_scatter,
        // its ranks' blocks (local-rank order), each cut alike.
        segs_.resize(hosts);
        const Shards shards{hi - lo, hosts};
        uint64_t window_pieces = 0;
        for (uint32_t s = 0; s < hosts; ++s) {
            auto &v = segs_[s];
            v.clear();
            auto cut = [&](uint64_t b, uint64_t e, int32_t owner) {
                for (; b < e; b += pw) v.push_back(Seg{b, std::min(pw, e - b), owner});
            };
            if (!rs) cut(lo + shards.at(s), lo + shards.at(s + 1), -1);
            else
                for (size_t l = 0; l < op.host_ranks[s].size(); ++l)
                    cut(op.host_ranks[s][l] * op.count + lo, op.host_ranks[s][l] * op.count + hi, static_cast<int32_t>(l));
            window_pieces = std::max<uint64_t>(window_pieces, v.size());
        }
        if (base + window_pieces > kGather) return make_error(-EINVAL, "exchange: more pieces than a tag numbers");
        const uint64_t mine = segs_[op.self].size();
        auto piece_of = [&](uint32_t s, uint64_t k, uint64_t *elems) {
            *elems = segs_[s][k].elems;
            return segs_[s][k].begin;
        };
        // Where our shard's piece k (at b) is summed: f32, rank 0's buffer; bf16, acc_.
        auto acc_at = [&](uint64_t k, uint64_t b) { return f32 ? data + b : acc_.data() + k * pw; };
        for (uint32_t p = 0, i = 0; p < hosts; ++p) {
            if (p == op.self) continue;
            Peer &q = peers_[i++];
            q.reset(q.link, p);
            q.scatter_send.assign(segs_[p].size(), -1);
            q.scatter_recv.assign(mine, -1);
            q.gather_recv.assign(rs ? 0 : segs_[p].size(), -1);  // (reduce_scatter: no gather)
            q.gather_done.assign(mine, 0);
        }
        gather_send_.assign(mine, -1);
        arrived_.assign(mine, 0);
        folded_.assign(mine, 0);
        uint64_t final_next = 0;  // our shard's next piece to finish

        auto tag = [&](bool gather, uint64_t k) { return (uint64_t{op.op_tag} << 32) | (gather ? kGather : 0) | (base + k); };

        // Posts what can be posted: scatter sends round the peers, then (once every scatter send
        // is out) our shard's finished pieces to every peer; receives the same way. One round of
        // scatter sends a call (a piece to each peer), so that the links are polled between
        // encodings: `encoding` says more are waiting for the next turn, which then does not block.
        bool encoding = false;
        auto post = [&]() -> Status {
            encoding = false;
            for (size_t i = 0; i < peers_.size() && !free_send_.empty(); ++i) {
                Peer &q = peers_[i];
                if (q.scatter_posted == q.scatter_send.size()) continue;
                const int32_t s = free_send_.back();
                free_send_.pop_back();
                uint64_t n;
                const uint64_t b = piece_of(q.p, q.scatter_posted, &n);
                float *sum = f32 ? data + b : tmp_.data();
                fold(sum, b, n);
                wire_encode(op.wire, sum, n, op.staging.base + slot_at(s), op.residual ? op.residual + b : nullptr);
                if (auto st = q.link->post_send(op.staging, slot_at(s), wire_bytes(op.wire, n), tag(false, q.scatter_posted)); !st)
                    return st;
                slots_[s].users = 1;
                q.scatter_send[q.scatter_posted++] = s;
                ++q.sends_out;
                encoding = encoding || q.scatter_posted < q.scatter_send.size();
            }
            encoding = encoding && !free_send_.empty();
            // reduce_scatter: a piece of our ranks' blocks with every host's contribution is the
            // result (f32, no encoding), the mean scaled, in its rank's output.
            while (rs && final_next < mine && arrived_[final_next] == peers_.size()) {
                const Seg &g = segs_[op.self][final_next];
                float *sum = acc_at(final_next++, g.begin);
                std::byte *out = output(g.owner) + (g.begin - op.host_ranks[op.self][static_cast<size_t>(g.owner)] * op.count) * es;
                if (f32) {
                    for (uint64_t j = 0; j < g.elems; ++j) reinterpret_cast<float *>(out)[j] = sum[j] * mean;
                    continue;
                }
                if (mean != 1.0f)
                    for (uint64_t j = 0; j < g.elems; ++j) sum[j] *= mean;
                void *const to = out;
                round_into(sum, &to, 1, g.elems);
            }
            bool scatter_out = true;
            for (const Peer &q : peers_)
                if (q.scatter_posted < q.scatter_send.size()) scatter_out = false;
            while (!rs && scatter_out && final_next < mine && arrived_[final_next] == peers_.size() && !free_send_.empty()) {
                const int32_t s = free_send_.back();
                free_send_.pop_back();
                uint64_t n;
                const uint64_t b = piece_of(op.self, final_next, &n);
                float *sum = acc_at(final_next, b);
                if (mean != 1.0f)
                    for (uint64_t j = 0; j < n; ++j) sum[j] *= mean;
                std::byte *enc = op.staging.base + slot_at(s);
                wire_encode(op.wire, sum, n, enc, op.residual ? op.residual + b : nullptr);
                deliver(enc, b, n);  // (what every other host will decode)
                for (Peer &q : peers_) {
                    if (auto st = q.link->post_send(op.staging, slot_at(s), wire_bytes(op.wire, n), tag(true, final_next)); !st) return st;
                    ++q.gather_posted;
                    ++q.sends_out;
                }
                slots_[s].users = static_cast<uint32_t>(peers_.size());
                gather_send_[final_next++] = s;
            }
            bool scatter_in = true;
            for (const Peer &q : peers_)
                if (q.scatter_recv_posted < mine) scatter_in = false;
            for (bool more = true; more && !free_recv_.empty();) {
                more = false;
                for (size_t i = 0; i < peers_.size() && !free_recv_.empty(); ++i) {
                    Peer &q = peers_[i];
                    // Scatter: pieces of our shard from q; gather (once every scatter receive is
                    // posted): pieces of q's shard.
                    const bool gather = scatter_in;
                    uint64_t &posted = gather ? q.gather_recv_posted : q.scatter_recv_posted;
                    std::vector<int32_t> &slots = gather ? q.gather_recv : q.scatter_recv;
                    if (posted == slots.size()) continue;
                    const int32_t s = free_recv_.back();
                    uint64_t n;
                    piece_of(gather ? q.p : op.self, posted, &n);
                    if (auto st = q.link->post_recv(op.staging, slot_at(s), wire_bytes(op.wire, n), tag(gather, posted)); !st)
                        return st;
                    free_recv_.pop_back();
                    slots[posted++] = s;
                    more = true;
                }
                if (!scatter_in) {
                    scatter_in = true;
                    for (const Peer &q : peers_)
                        if (q.scatter_recv_posted < mine) scatter_in = false;
                    if (scatter_in) more = true;
                }
            }
            return Ok{};
        };
        auto complete = [&] {
            if (final_next < mine) return false;
            for (const Peer &q : peers_) {
                if (q.scatter_posted < q.scatter_send.size() || q.sends_out || q.scatter_recvd < mine || q.gather_recvd < q.gather_recv.size())
                    return false;
            }
            return true;
        };

        if (auto st = post(); !st) return st;
        LinkPoll poll(spin_us_);
        while (!complete()) {
            if (auto st = wait_turn(op); !st) return st;
            const int wait_ms = ms_until(deadline);
            if (wait_ms == 0) {
                // The first thing missing in the op's order: a host's contribution to our shard (the
                // others' finished pieces wait on theirs from it too), its finished shard, its taking
                // what we sent.
                std::string waiting;
                for (int stage = 0; stage < 3 && waiting.empty(); ++stage)
                    for (size_t i = 0; i < peers_.size() && waiting.empty(); ++i) {
                        const Peer &q = peers_[i];
                        if (stage == 0 && q.scatter_recvd < mine) waiting = "data from " + q.link->peer();
                        if (stage == 1 && q.gather_recvd < q.gather_recv.size()) waiting = "data from " + q.link->peer();
                        if (stage == 2 && (q.sends_out || q.scatter_posted < q.scatter_send.size()))
                            waiting = "host " + q.link->peer() + " to take data";
                    }
                if (waiting.empty()) waiting = "the links";
                spdlog::warn("exchange op {:#x} timed out: our shard's pieces finished {}/{}", op.op_tag, final_next, mine);
                for (size_t i = 0; i < peers_.size(); ++i) {
                    const Peer &q = peers_[i];
                    spdlog::warn("  host {}: scatter sent {}/{} (out {}), received {}/{}; gather sent {}/{}, received {}/{}; link: {}",
                                 q.link->peer(), q.scatter_posted, q.scatter_send.size(), q.sends_out, q.scatter_recvd, mine,
                                 q.gather_posted, mine, q.gather_recvd, q.gather_recv.size(), q.link->describe());
                }
                return make_error(-ETIMEDOUT, std::string(collective_name(op.collective)) + " (exchange) timed out: waiting for " + waiting);
            }
            if (auto st = poll.poll(t_, events_, wait_ms, encoding); !st) return st;
            if (!events_.empty() && op.progress_ns) op.progress_ns->store(poll.last_progress_ns(), std::memory_order_relaxed);
            for (const LinkEvent &e : events_) {
                size_t i = peers_.size();
                for (size_t j = 0; j < peers_.size(); ++j)
                    if (peers_[j].link == e.link) i = j;
                if (e.kind == LinkEvent::Kind::Failed) {
                    if (i < peers_.size()) return e.error;
                    continue;
                }
                if (i == peers_.size() || (e.tag >> 32) != op.op_tag) continue;  // not this op's
                Peer &q = peers_[i];
                const bool gather = e.tag & kGather;
                const uint64_t number = e.tag & (kGather - 1);
                if (number < base) continue;  // (an earlier window's: cannot happen, each ends first)
                const uint64_t k = number - base;
                if (e.kind == LinkEvent::Kind::SendDone) {
                    const int32_t s = gather ? (k < gather_send_.size() && !q.gather_done[k] ? gather_send_[k] : -1)
                                             : (k < q.scatter_send.size() ? q.scatter_send[k] : -1);
                    if (s < 0 || slots_[s].users == 0 || q.sends_out == 0)
                        return make_error(-EPROTO, "exchange: a send of piece " + std::to_string(k) + " to " + q.link->peer() +
                                                       " done that was not out");
                    if (--slots_[s].users == 0) free_send_.push_back(s);
                    if (gather) q.gather_done[k] = 1;  // (its slot is shared: users count the peers)
                    else q.scatter_send[k] = -1;
                    --q.sends_out;
                    continue;
                }
                uint64_t n;
                if (!gather) {
                    // Piece k of our shard from q: added, in f32, to our local ranks' reduction of it.
                    if (k >= mine || q.scatter_recv[k] < 0)
                        return make_error(-EPROTO, "exchange: host " + q.link->peer() + " sent piece " + std::to_string(k) + " of our shard unasked");
                    const uint64_t b = piece_of(op.self, k, &n);
                    float *sum = acc_at(k, b);
                    if (!folded_[k]) {
                        fold(sum, b, n);
                        folded_[k] = 1;
                    }
                    const int32_t s = q.scatter_recv[k];
                    wire_accumulate(op.wire, op.staging.base + slot_at(s), n, sum);
                    free_recv_.push_back(s);
                    q.scatter_recv[k] = -1;  // (a second completion of it is refused)
                    ++arrived_[k];
                    ++q.scatter_recvd;
                } else {
                    // Piece k of q's shard, finished there: every local rank's result.
                    if (k >= q.gather_recv.size() || q.gather_recv[k] < 0)
                        return make_error(-EPROTO, "exchange: host " + q.link->peer() + " sent piece " + std::to_string(k) + " of its shard unasked");
                    const uint64_t b = piece_of(q.p, k, &n);
                    const int32_t s = q.gather_recv[k];
                    deliver(op.staging.base + slot_at(s), b, n);
                    free_recv_.push_back(s);
                    q.gather_recv[k] = -1;
                    ++q.gather_recvd;
                }
            }
            if (auto st = post(); !st) return st;
        }
        base += window_pieces;
        return Ok{};
    };

    for (uint64_t lo = 0; lo < std::max<uint64_t>(op.count, 1); lo += window)
        if (auto st = run_window(lo, std::min(op.count, lo + window)); !st) return st;
    return Ok{};
}

}  // namespace ringd
