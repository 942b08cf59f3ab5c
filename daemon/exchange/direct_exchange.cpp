#include "daemon/exchange/direct_exchange.h"

#include "daemon/engine/all_to_all.h"

#include <cstring>

#include <spdlog/spdlog.h>

#include "daemon/engine/reduce.h"
#include "daemon/ipc/slot.h"

namespace ringd {
namespace {

uint64_t seg_begin(uint64_t count, uint32_t n, uint32_t k) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(count) * k) / n);
}

// avg by direct exchange: contributions go out before this host knows how many ranks the others
// have, so they are scaled by 2^-K for the most there can be (every host with kMaxLocalSize
// ranks); every host uses the same K. The result is divided by the real count (reduce.h).
uint32_t avg_shift(uint32_t hosts) { return avg_shift_for(uint64_t{hosts} * proto::kMaxLocalSize); }

}  // namespace

DirectExchange::DirectExchange(uint32_t self, std::vector<std::string> hosts, Send send, Queued queued)
    : self_(self), n_(static_cast<uint32_t>(hosts.size())), sched_(schedule_of(self, n_)), hosts_(std::move(hosts)),
      send_(std::move(send)), queued_(std::move(queued)), peer_bytes_(n_, 0) {}

DirectExchange::Schedule DirectExchange::schedule_of(uint32_t self, uint32_t n) {
    Schedule s;
    s.p = power_of_two_below(std::max<uint32_t>(n, 1));
    while ((1u << s.steps) < s.p) ++s.steps;
    const uint32_t extra = n - s.p;
    if (self < 2 * extra) {
        if (self % 2 == 1) {
            s.folds_into = self - 1;
        } else {
            s.folded_from = self + 1;
            s.v = self / 2;
        }
    } else {
        s.v = self - extra;
    }
    return s;
}

uint32_t DirectExchange::host_of(uint32_t v) const {
    const uint32_t extra = n_ - sched_.p;
    return v < extra ? 2 * v : v + extra;
}

uint32_t DirectExchange::sender_of(proto::OpDataKind kind, uint32_t step) const {
    using K = proto::OpDataKind;
    if (kind == K::FoldIn) return step == 0 && sched_.folded_from != UINT32_MAX ? sched_.folded_from : n_;
    if (kind == K::FoldOut) return step == 0 && sched_.folds_into != UINT32_MAX ? sched_.folds_into : n_;
    if (sched_.folds_into != UINT32_MAX || step >= sched_.steps) return n_;  // an extra host takes no step
    // Doubling and the allgather pair up at distance 2^k, the halving at p / 2^(k+1).
    const uint32_t dist = kind == K::Halving ? sched_.p >> (step + 1) : 1u << step;
    return host_of(sched_.v ^ dist);
}

uint64_t DirectExchange::collective_part_bytes(const OpDesc &d, std::span<const std::vector<uint32_t>> host_ranks,
                                               uint32_t from, uint32_t to) {
    // reduce_scatter: the blocks of the receiver's ranks, partial results; allgather: the
    // sender's ranks' blocks, in the dtype.
    // broadcast: the root's buffer from its host to every other; reduce: a partial result from
    // every other host to the root's; barrier: nothing.
    if (collective_is_rooted(d.collective)) {
        const uint32_t root = root_host(d, host_ranks);
        if (d.collective == Collective::Broadcast) return from == root && to != root ? d.count * dtype_size(d.dtype) : 0;
        return to == root && from != root ? d.count * dtype_size(partial_dtype(d.dtype, d.op)) : 0;
    }
    if (d.collective == Collective::Barrier || d.collective == Collective::AllToAll) return 0;  // (all_to_all: a2a_message_bytes)
    const bool rs = d.collective == Collective::ReduceScatter;
    const uint32_t h = rs ? to : from;
    const uint64_t blocks = h < host_ranks.size() ? host_ranks[h].size() : 0;
    return blocks * d.count * dtype_size(rs ? partial_dtype(d.dtype, d.op) : d.dtype);
}

uint32_t DirectExchange::root_host(const OpDesc &d, std::span<const std::vector<uint32_t>> host_ranks, uint32_t *local) {
    for (size_t h = 0; h < host_ranks.size(); ++h)
        for (size_t l = 0; l < host_ranks[h].size(); ++l)
            if (host_ranks[h][l] == d.root) {
                if (local) *local = static_cast<uint32_t>(l);
                return static_cast<uint32_t>(h);
            }
    return UINT32_MAX;
}

// Whether host `from` sends host `to` a message of this broadcast, reduce or barrier.
static bool rooted_sends(Collective c, uint32_t root, uint32_t from, uint32_t to) {
    if (c == Collective::Broadcast) return from == root && to != root;
    if (c == Collective::Reduce) return to == root && from != root;
    return from != to;  // barrier
}

std::string DirectExchange::send_over_bound(const proto::OpReport &r, const OpDesc &desc, Algorithm algorithm,
                                            std::span<const std::vector<uint32_t>> host_ranks,
                                            std::span<const std::shared_ptr<const std::vector<uint64_t>>> splits) const {
    const uint64_t ps = dtype_size(partial_dtype(desc.dtype, desc.op));
    std::vector<AllToAllLayout> lay;
    if (desc.collective == Collective::AllToAll && host_ranks.size() == n_)
        for (size_t l = 0; l < host_ranks[self_].size(); ++l) lay.emplace_back(desc, l < splits.size() ? splits[l] : nullptr);
    for (uint32_t h = 0; h < n_; ++h) {
        if (h == self_) continue;
        // One-shot, doubling and halving-doubling send a peer up to the whole op (doubling to each
        // partner, halving half of it at first), two-shot segment h; reduce_scatter and allgather
        // their message to h.
        const uint64_t bytes = desc.collective == Collective::AllToAll
                                   ? (lay.empty() ? 0 : a2a_message_bytes(desc, lay, host_ranks[h]))
                               : desc.collective != Collective::Allreduce ? collective_part_bytes(desc, host_ranks, self_, h)
                               : algorithm == Algorithm::TwoShot ? (seg_begin(r.count, n_, h + 1) - seg_begin(r.count, n_, h)) * ps
                                                                 : r.count * ps;
        const uint64_t queued = queued_(h);
        if (desc.collective == Collective::AllToAll && bytes > kMaxAllToAllMessage)
            return "group " + r.group + " op " + std::to_string(r.seq) + ": an all_to_all message of " +
                   std::to_string(bytes >> 20) + " MiB from host " + hosts_[self_] + " to host " + hosts_[h] +
                   " is over the " + std::to_string(kMaxAllToAllMessage >> 20) +
                   " MiB a pair of hosts carries in one op (split it into several all_to_alls)";
        // (An all_to_all's message goes a window at a time.)
        if (queued + (desc.collective == Collective::AllToAll ? std::min(bytes, kAllToAllWindow) : bytes) > kMaxSendBacklog)
            return "group " + r.group + " op " + std::to_string(r.seq) + ": host " + hosts_[self_] + "'s queue to host " +
                   hosts_[h] + " holds " + std::to_string(queued >> 20) + " MiB, over its bound of " +
                   std::to_string(kMaxSendBacklog >> 20) + " MiB (host " + hosts_[h] +
                   " is not taking one-/two-shot data as fast as it comes)";
    }
    return {};
}

// This host's local ranks reduced over [begin, begin + elems) into dst, a partial result in
// partial_dtype (f32 for f16/bf16 sum/avg; avg's contributions scaled by 2^-avg_shift(), divided
// once, where the hosts' contributions meet).
void DirectExchange::local_reduce_into(const HostOp &op, void *dst, uint64_t begin, uint64_t elems) {
    if (elems == 0) return;
    const size_t es = dtype_size(op.run.desc.dtype);
    srcs_.clear();
    for (size_t i = 0; i < op.slots.size(); ++i) srcs_.push_back(op.slots[i]->data() + op.run.offsets[i] + begin * es);
    if (srcs_.size() == 1 && op.run.desc.op != ReduceOp::Avg && partial_dtype(op.run.desc.dtype, op.run.desc.op) == op.run.desc.dtype) {
        std::memcpy(dst, srcs_[0], elems * es);
        return;
    }
    ReduceArgs a{op.run.desc.dtype, op.run.desc.op, srcs_.data(), srcs_.size(), nullptr, 0, elems, 1};
    a.partial_out = dst;
    a.avg_shift = avg_shift(n_);
    reduce(a);
}

// One-shot: this host's contribution goes to every other host. Two-shot: segment j of it goes
// to host j.
void DirectExchange::contribute(const HostOp &op, const proto::OpReport &r, std::span<const std::vector<uint32_t>> host_ranks) {
    const size_t ps = dtype_size(partial_dtype(op.run.desc.dtype, op.run.desc.op));  // contributions are partial results
    const uint64_t count = op.run.desc.count;
    if (op.run.desc.collective != Collective::Allreduce) {
        // One-shot reduce_scatter: to host h the blocks of h's ranks, this host's ranks reduced;
        // allgather: this host's ranks' blocks to every host. Its own part stays in the slots.
        const size_t es = dtype_size(op.run.desc.dtype);
        const bool rs = op.run.desc.collective == Collective::ReduceScatter;
        State &st = ops_[Key{r.generation, r.group, r.incarnation, r.seq}];
        if (host_ranks.size() != n_ || host_ranks[self_].size() != op.slots.size()) {
            // (The domain refuses these collectives without a rank map of every host; never sent.)
            malformed_part(st, "group " + r.group + " op " + std::to_string(r.seq) + ": host " + hosts_[self_] +
                                   " has no rank map of every host of the ring for its " +
                                   std::string(collective_name(op.run.desc.collective)));
            add(self_, r, {}, 0);
            return;
        }
        st.host_ranks.assign(host_ranks.begin(), host_ranks.end());
        if (collective_is_rooted(op.run.desc.collective) || op.run.desc.collective == Collective::Barrier) {
            contribute_rooted(st, op, r);
            return;
        }
        if (op.run.desc.collective == Collective::AllToAll) {
            contribute_a2a(st, op, r);
            return;
        }
        proto::Bytes own;
        if (!rs) {
            own = proto::encode_op_data(r, proto::OpDataKind::OneShot, op.slots.size() * count * es);
            for (size_t j = 0; j < op.slots.size(); ++j)
                if (count) std::memcpy(own.data() + proto::op_data_offset() + j * count * es, op.slots[j]->data() + op.run.offsets[j], count * es);
        }
        for (uint32_t h = 0; h < n_; ++h) {
            if (h == self_) continue;
            if (!rs) {
                send_(h, own);
                continue;
            }
            const auto &ranks = host_ranks[h];
            proto::Bytes part = proto::encode_op_data(r, proto::OpDataKind::OneShot, ranks.size() * count * ps);
            for (size_t j = 0; j < ranks.size(); ++j)
                local_reduce_into(op, part.data() + proto::op_data_offset() + j * count * ps, uint64_t{ranks[j]} * count, count);
            send_(h, std::move(part));
        }
        add(self_, r, {}, 0);
        return;
    }
    if (deferred_reports(op.algorithm)) {
        // Doubling, halving-doubling: this host's partial result, sent step by step (progress).
        State &st = ops_[Key{r.generation, r.group, r.incarnation, r.seq}];
        st.contributed = true;
        st.report = r;
        st.ranks = r.local_size;
        st.work.resize(count * ps);
        local_reduce_into(op, st.work.data(), 0, count);
        return;
    }
    const bool one_shot = op.algorithm == Algorithm::OneShot;
    proto::Bytes own;
    if (one_shot) {
        own = proto::encode_op_data(r, proto::OpDataKind::OneShot, count * ps);
        local_reduce_into(op, own.data() + proto::op_data_offset(), 0, count);
    }
    for (uint32_t h = 0; h < n_; ++h) {
        if (h == self_) continue;
        if (one_shot) {
            send_(h, own);
        } else {
            const uint64_t b = seg_begin(count, n_, h), e = seg_begin(count, n_, h + 1);
            proto::Bytes part = proto::encode_op_data(r, proto::OpDataKind::TwoShotPart, (e - b) * ps);
            local_reduce_into(op, part.data() + proto::op_data_offset(), b, e - b);
            send_(h, std::move(part));
        }
    }
    // This host's own part: the whole contribution (one-shot), or its segment, which stays in
    // the local slots (two-shot).
    add(self_, r, std::move(own), proto::op_data_offset());
}

// Why this host cannot keep `size` more bytes of host `host`'s data of op `r`, which it has not
// reached, or "".
std::string DirectExchange::over_bound(uint32_t host, const proto::OpReport &r, uint64_t size) const {
    auto g = group_bytes_.find(r.group);
    const uint64_t group_bytes = g == group_bytes_.end() ? 0 : g->second;
    const bool peer_over = peer_bytes_[host] + size > kMaxPeerBacklog;
    if (!peer_over && group_bytes + size <= kMaxGroupBacklog) return {};
    return "group " + r.group + " op " + std::to_string(r.seq) + ": host " + hosts_[self_] +
           " holds more one-/two-shot data of ops it has not reached than its bound of " +
           std::to_string((peer_over ? kMaxPeerBacklog : kMaxGroupBacklog) >> 20) + " MiB " +
           (peer_over ? "per peer" : "per group") + " (host " + hosts_[host] + " is that far ahead)";
}

bool DirectExchange::take_part(uint32_t host, const proto::OpData &d, proto::Bytes payload, std::string &over_bound_why) {
    if (d.kind >= proto::OpDataKind::Doubling) return take_step(host, d, std::move(payload), over_bound_why);
    if (d.report.collective == static_cast<uint32_t>(Collective::AllToAll)) return take_a2a(host, d, std::move(payload), over_bound_why);
    const proto::OpReport &r = d.report;
    const uint64_t ps = dtype_size(partial_dtype(static_cast<DType>(r.dtype), static_cast<ReduceOp>(r.op)));
    if (d.kind == proto::OpDataKind::TwoShotPart &&
        d.data.size() != (seg_begin(r.count, n_, self_ + 1) - seg_begin(r.count, n_, self_)) * ps) {
        spdlog::warn("host {}: two-shot part of group {} op {} has {} bytes, not this host's segment", hosts_[host],
                     r.group, r.seq, d.data.size());
        return false;
    }
    auto it = ops_.find(Key{r.generation, r.group, r.incarnation, r.seq});
    if (it != ops_.end() && it->second.contributed) {
        // This host runs the op by doubling or halving-doubling: the algorithms differ.
        it->second.mismatch = true;
        return false;
    }
    if (it == ops_.end() || it->second.parts.size() <= self_ || !it->second.parts[self_]) {
        // Data of an op this host has not reached: within its bounds, or the op fails by name.
        over_bound_why = over_bound(host, r, payload.size());
        if (!over_bound_why.empty()) return false;
    }
    add(host, r, std::move(payload), proto::kOpDataHeaderBytes);
    return true;
}

void DirectExchange::take_result(uint32_t host, uint64_t generation, const OpKey &key, const HostOp &op,
                                 const proto::OpReport &r, std::span<const uint8_t> data) {
    auto it = ops_.find(key_of(generation, key));
    if (it == ops_.end()) return;  // ended here
    const size_t es = dtype_size(op.run.desc.dtype);
    const uint64_t b = seg_begin(op.run.desc.count, n_, host), e = seg_begin(op.run.desc.count, n_, host + 1);
    if (r.count != op.run.desc.count || r.dtype != static_cast<uint32_t>(op.run.desc.dtype) || data.size() != (e - b) * es ||
        it->second.got_result.size() != n_ || it->second.got_result[host]) {
        spdlog::warn("host {}: unexpected two-shot result for group {} op {}", hosts_[host], r.group, r.seq);
        return;
    }
    for (size_t i = 0; i < op.slots.size(); ++i)
        std::memcpy(op.slots[i]->data() + op.run.offsets[i] + b * es, data.data(), data.size());
    it->second.got_result[host] = 1;
    ++it->second.results;
}

bool DirectExchange::progress(uint64_t generation, const OpKey &key, const HostOp &op) {
    auto it = ops_.find(key_of(generation, key));
    if (it == ops_.end()) return false;
    State &st = it->second;
    if (deferred_reports(op.algorithm)) return st.contributed && progress_log(st, op);
    if (op.run.desc.collective != Collective::Allreduce) return progress_collective(st, op);
    const size_t es = dtype_size(op.run.desc.dtype);
    const bool two_shot = op.algorithm == Algorithm::TwoShot;
    if (!st.reduced) {
        if (st.mismatch) return false;
        uint32_t total = 0;
        for (const auto &c : st.parts) {
            // A part that does not match stops the op here, for the coordinator to decide (it
            // sees the reports: as data below protocol 8, from the hosts that tell it above).
            if (!c) return false;
            if (c->report.count != op.run.desc.count || c->report.dtype != static_cast<uint32_t>(op.run.desc.dtype) ||
                c->report.op != static_cast<uint32_t>(op.run.desc.op) || c->report.algorithm != static_cast<uint32_t>(op.algorithm) ||
                c->report.collective != static_cast<uint32_t>(Collective::Allreduce)) {
                st.mismatch = true;
                return false;
            }
            total += c->report.local_size;
        }
        // (Two-shot parts were checked against this host's segment as they came.)
        for (uint32_t h = 0; h < n_ && !two_shot; ++h) {
            const uint64_t have = st.parts[h]->buf.size() - st.parts[h]->offset, want = op.run.desc.count * dtype_size(partial_dtype(op.run.desc.dtype, op.run.desc.op));
            if (h != self_ && have != want) {
                malformed_part(st, "group " + op.run.group + " op " + std::to_string(st.parts[h]->report.seq) + ": host " + hosts_[h] +
                                       " sent a one-shot contribution of " + std::to_string(have) + " bytes, not " +
                                       std::to_string(want));
                return false;
            }
        }
        // Every host's part is in: reduce them in ring order (one-shot: the same bits on every
        // host). Two-shot: this host's ranks in place, then the other hosts' parts.
        const uint64_t b = two_shot ? seg_begin(op.run.desc.count, n_, self_) : 0;
        const uint64_t e = two_shot ? seg_begin(op.run.desc.count, n_, self_ + 1) : op.run.desc.count;
        srcs_.clear();  // the hosts' parts: partial results
        dsts_.clear();
        for (size_t i = 0; i < op.slots.size(); ++i) dsts_.push_back(op.slots[i]->data() + op.run.offsets[i] + b * es);
        for (uint32_t h = 0; h < n_; ++h)
            if (!two_shot || h != self_) srcs_.push_back(st.parts[h]->buf.data() + st.parts[h]->offset);
        ReduceArgs a{op.run.desc.dtype, op.run.desc.op, two_shot ? dsts_.data() : nullptr, two_shot ? dsts_.size() : 0,
                     dsts_.data(), dsts_.size(), e - b, total};
        a.partials = srcs_.data();
        a.npartial = srcs_.size();
        a.avg_shift = avg_shift(n_);
        if (e > b) reduce(a);
        st.reduced = true;
        for (uint32_t h = 0; h < n_; ++h) release(std::get<0>(key), h, *st.parts[h]);  // used up
        if (two_shot) {
            // This host's segment is final: to every other host.
            proto::Bytes result = proto::encode_op_data(st.parts[self_]->report, proto::OpDataKind::TwoShotResult, (e - b) * es);
            if (e > b) std::memcpy(result.data() + proto::op_data_offset(), dsts_[0], (e - b) * es);
            st.got_result[self_] = 1;
            ++st.results;
            for (uint32_t h = 0; h < n_; ++h)
                if (h != self_) send_(h, result);
        }
    }
    return !two_shot || st.results == n_;
}

uint64_t DirectExchange::a2a_message_bytes(const OpDesc &d, const std::vector<AllToAllLayout> &layouts,
                                           std::span<const uint32_t> to_ranks) {
    uint64_t elems = 0;
    for (const auto &l : layouts)
        for (uint32_t b : to_ranks) elems += b < l.ranks() ? l.send_count(b) : 0;
    return 8 * layouts.size() * to_ranks.size() + elems * dtype_size(d.dtype);
}

// all_to_all: to each other host one message (in parts) of this host's ranks' blocks for that host's
// ranks, with their counts ahead; the blocks between this host's own ranks are copied here, their
// counts checked against both ranks' split sizes.
void DirectExchange::contribute_a2a(State &st, const HostOp &op, const proto::OpReport &r) {
    const OpDesc &d = op.run.desc;
    const size_t es = dtype_size(d.dtype);
    const auto &mine = st.host_ranks[self_];
    std::vector<AllToAllLayout> lay;
    for (size_t l = 0; l < op.slots.size(); ++l) lay.emplace_back(d, l < op.run.splits.size() ? op.run.splits[l] : nullptr);
    const std::string at = "group " + r.group + " op " + std::to_string(r.seq) + ": ";
    for (size_t a = 0; a < mine.size(); ++a)
        for (size_t b = 0; b < mine.size(); ++b)
            if (lay[a].send_count(mine[b]) != lay[b].recv_count(mine[a])) {
                malformed_part(st, at + "all_to_all: rank " + std::to_string(mine[a]) + " sends rank " + std::to_string(mine[b]) +
                                       " " + std::to_string(lay[a].send_count(mine[b])) + " elements, and rank " +
                                       std::to_string(mine[b]) + " expects " + std::to_string(lay[b].recv_count(mine[a])));
                add(self_, r, {}, 0);
                return;
            }
    for (size_t a = 0; a < mine.size(); ++a)
        for (size_t b = 0; b < mine.size(); ++b)
            if (const uint64_t k = lay[a].send_count(mine[b]))
                std::memcpy(op.slots[b]->data() + op.run.out_offsets[b] + lay[b].recv_at(mine[a]) * es,
                            op.slots[a]->data() + op.run.offsets[a] + lay[a].send_at(mine[b]) * es, k * es);
    // What each peer's message must hold, as this host's ranks expect it (its parts are checked
    // against it as they come: no peer makes this host keep more than that).
    st.a2a_expect.assign(n_, 0);
    st.a2a_counts.assign(n_, {});
    for (uint32_t h = 0; h < n_; ++h) {
        if (h == self_) continue;
        uint64_t bytes = 8 * st.host_ranks[h].size() * mine.size();
        for (uint32_t a : st.host_ranks[h])
            for (size_t b = 0; b < mine.size(); ++b) {
                st.a2a_counts[h].push_back(lay[b].recv_count(a));
                bytes += lay[b].recv_count(a) * es;
            }
        st.a2a_expect[h] = bytes;
    }
    // Parts that came before: what no expected message has is dropped now.
    for (uint32_t h = 0; h < st.a2a.size(); ++h)
        if (h != self_ && st.a2a_parts[h] != 0 && !a2a_parts_fit(st, h, st.a2a_parts[h])) {
            for (auto &[k, part] : st.a2a[h]) release(r.group, h, part);
            malformed_part(st, at + "host " + hosts_[h] + " sent an all_to_all message of " + std::to_string(st.a2a_parts[h]) +
                                   " part(s), not the " + std::to_string(st.a2a_expect[h]) + " bytes its ranks' counts say");
        }
    // Each message as its counts, then the slots' blocks for that host's ranks, sent a part at a
    // time as the connection to that host takes them (pump_a2a).
    st.report = r;
    for (uint32_t i = 1; i < n_; ++i) {
        const uint32_t h = (self_ + i) % n_;  // the next host first: every host is some sender's first
        const auto &theirs = st.host_ranks[h];
        State::A2aOut &m = st.a2a_out.emplace_back();
        m.host = h;
        m.total = a2a_message_bytes(d, lay, theirs);
        m.parts = std::max<uint64_t>(1, (m.total + proto::kAllToAllPartBytes - 1) / proto::kAllToAllPartBytes);
        for (size_t a = 0; a < mine.size(); ++a)
            for (uint32_t b : theirs) m.counts.push_back(lay[a].send_count(b));  // (little-endian hosts: proto/le.h)
        m.pieces.push_back({UINT32_MAX, 0, 8 * m.counts.size()});
        for (size_t a = 0; a < mine.size(); ++a)
            for (uint32_t b : theirs)
                if (const uint64_t k = lay[a].send_count(b))
                    m.pieces.push_back({static_cast<uint32_t>(a), op.run.offsets[a] + lay[a].send_at(b) * es, k * es});
    }
    st.a2a_unsent = st.a2a_out.size();
    if (st.a2a_unsent) sending_.insert(Key{r.generation, r.group, r.incarnation, r.seq});
    (void)pump_a2a(st, op);
    add(self_, r, {}, 0);
}

// Each part: its header, then the message's bytes appended straight from the slots (one pass, no
// zeroing). A part goes to a host while the queue to it is under the window, and beyond the first
// window only once that host's own message of the op is coming (it has reached the op: what it
// is sent is delivered as it comes, not kept), so that neither this host's queues nor what a host
// behind keeps for it grow with the op's size.
bool DirectExchange::pump_a2a(State &st, const HostOp &op) {
    const proto::OpReport &r = st.report;
    constexpr uint64_t kFirstParts = kAllToAllWindow / proto::kAllToAllPartBytes;
    bool any = false;
    for (bool more = true; more && st.a2a_unsent;) {
        more = false;
        for (State::A2aOut &m : st.a2a_out) {
            if (m.next == m.parts || queued_(m.host) >= kAllToAllWindow) continue;
            if (m.next >= kFirstParts && (m.host >= st.a2a_parts.size() || st.a2a_parts[m.host] == 0)) continue;
            const uint64_t bytes = std::min<uint64_t>(proto::kAllToAllPartBytes, m.total - m.next * proto::kAllToAllPartBytes);
            proto::Bytes frame = proto::begin_op_data(r, proto::OpDataKind::OneShot, bytes, static_cast<uint32_t>(m.parts << 16 | m.next));
            for (uint64_t room = bytes; room > 0 && m.piece < m.pieces.size();) {
                const State::A2aPiece &pc = m.pieces[m.piece];
                const uint8_t *p = pc.rank == UINT32_MAX ? reinterpret_cast<const uint8_t *>(m.counts.data())
                                                         : reinterpret_cast<const uint8_t *>(op.slots[pc.rank]->data() + pc.offset);
                const uint64_t take = std::min(room, pc.bytes - m.at);
                frame.insert(frame.end(), p + m.at, p + m.at + take);
                room -= take;
                if ((m.at += take) == pc.bytes) ++m.piece, m.at = 0;
            }
            send_(m.host, std::move(frame));
            any = true;
            if (++m.next == m.parts) --st.a2a_unsent;
            more = true;
        }
    }
    return any;
}

bool DirectExchange::pump(uint64_t generation, const std::function<const HostOp *(const OpKey &)> &find,
                          std::vector<OpKey> &finished) {
    bool any = false;
    for (auto k = sending_.begin(); k != sending_.end();) {
        const OpKey key{std::get<1>(*k), std::get<2>(*k), std::get<3>(*k)};
        auto it = ops_.find(*k);
        const HostOp *op = std::get<0>(*k) == generation ? find(key) : nullptr;
        if (it == ops_.end() || !op) {
            k = sending_.erase(k);  // the op ended here: nothing more of it goes
            continue;
        }
        any |= pump_a2a(it->second, *op);
        if (it->second.a2a_unsent == 0) {
            finished.push_back(key);
            k = sending_.erase(k);
        } else {
            ++k;
        }
    }
    return any;
}

bool DirectExchange::take_a2a(uint32_t host, const proto::OpData &d, proto::Bytes payload, std::string &over_bound_why) {
    const proto::OpReport &r = d.report;
    const uint32_t parts = d.step >> 16, part = d.step & 0xffff;
    State &st = ops_[Key{r.generation, r.group, r.incarnation, r.seq}];
    st.parts.resize(n_);
    st.got_result.resize(n_, 0);
    if (!st.parts[self_]) {
        // Data of an op this host has not reached: within its bounds, or the op fails by name.
        over_bound_why = over_bound(host, r, payload.size());
        if (!over_bound_why.empty()) return false;
    } else if (st.a2a_expect.size() != n_) {
        return false;  // this host found its own ranks' op malformed: it fails, nothing more is kept
    }
    st.a2a.resize(n_);
    st.a2a_parts.resize(n_, 0);
    auto &v = st.a2a[host];
    if (st.a2a_parts[host] == 0) st.a2a_parts[host] = parts;
    if (st.a2a_parts[host] != parts) {
        malformed_part(st, "group " + r.group + " op " + std::to_string(r.seq) + ": host " + hosts_[host] +
                               " sent all_to_all parts of " + std::to_string(st.a2a_parts[host]) + " and of " + std::to_string(parts));
        return false;
    }
    if (v.count(part)) return false;  // a duplicate
    if (!st.a2a_expect.empty()) {
        // This host contributed: the message is what its ranks expect, part by part.
        const uint64_t size = payload.size() - proto::kOpDataHeaderBytes;
        const uint64_t want = std::min<uint64_t>(proto::kAllToAllPartBytes,
                                                 st.a2a_expect[host] - std::min(st.a2a_expect[host], uint64_t{part} * proto::kAllToAllPartBytes));
        if (!a2a_parts_fit(st, host, parts) || size != want) {
            // Most likely two ranks disagree on a pair's size: name them where the counts show it.
            const auto &expect = st.a2a_counts[host];
            const auto &theirs = st.host_ranks[host], &mine = st.host_ranks[self_];
            if (part == 0 && size >= 8 * expect.size())
                for (size_t i = 0; i < expect.size(); ++i) {
                    uint64_t k = 0;
                    std::memcpy(&k, payload.data() + proto::kOpDataHeaderBytes + 8 * i, 8);
                    if (k == expect[i]) continue;
                    const uint32_t a = theirs[i / mine.size()], b = mine[i % mine.size()];
                    malformed_part(st, "group " + r.group + " op " + std::to_string(r.seq) + ": all_to_all: rank " +
                                           std::to_string(a) + " (host " + hosts_[host] + ") sends rank " + std::to_string(b) +
                                           " " + std::to_string(k) + " elements, and rank " + std::to_string(b) + " (host " +
                                           hosts_[self_] + ") expects " + std::to_string(expect[i]));
                    return false;
                }
            malformed_part(st, "group " + r.group + " op " + std::to_string(r.seq) + ": host " + hosts_[host] +
                                   " sent all_to_all part " + std::to_string(part) + " of " + std::to_string(parts) + " with " +
                                   std::to_string(size) + " bytes of a message this host expects to hold " +
                                   std::to_string(st.a2a_expect[host]) + " bytes");
            return false;
        }
    }
    peer_bytes_[host] += payload.size();
    group_bytes_[r.group] += payload.size();
    note_deadline(st, host, r);
    v.emplace(part, Part{r, std::move(payload), proto::kOpDataHeaderBytes});
    return true;
}

bool DirectExchange::a2a_parts_fit(const State &st, uint32_t host, uint64_t parts) {
    const uint64_t want = std::max<uint64_t>(1, (st.a2a_expect[host] + proto::kAllToAllPartBytes - 1) / proto::kAllToAllPartBytes);
    return parts == want;
}

bool DirectExchange::progress_a2a(State &st, const HostOp &op) {
    const OpDesc &d = op.run.desc;
    const size_t es = dtype_size(d.dtype);
    const auto &mine = st.host_ranks[self_];
    if (st.a2a.size() != n_ || st.a2a_expect.size() != n_) return false;
    st.a2a_done.resize(n_, 0);
    st.a2a_next.resize(n_, 0);
    st.a2a_at.resize(n_, {0, 0});
    std::vector<AllToAllLayout> lay;
    for (size_t l = 0; l < op.slots.size(); ++l) lay.emplace_back(d, l < op.run.splits.size() ? op.run.splits[l] : nullptr);
    // Each peer's message part by part as its parts come (in order: one TCP stream carries them),
    // while the rest of it and the others' are still on the wire: the first part's counts against
    // this host's ranks' (before anything of it is read as data), each part's size against what
    // they make of the message, then its bytes into this host's outputs; a part's memory is given
    // back once it is delivered (its entry stays: a duplicate is still one).
    bool all = true;
    for (uint32_t h = 0; h < n_; ++h) {
        if (h == self_ || st.a2a_done[h]) continue;
        const auto &theirs = st.host_ranks[h];
        auto at = [&] { return "group " + op.run.group + " op " + std::to_string(op.run.seq) + ": host " + hosts_[h]; };  // (errors only)
        auto &parts = st.a2a[h];
        for (auto it = parts.find(st.a2a_next[h]); it != parts.end(); it = parts.find(st.a2a_next[h])) {
            Part &part = it->second;
            const uint32_t k = it->first;
            const auto &c = part.report;
            if (c.count != d.count || c.dtype != static_cast<uint32_t>(d.dtype) ||
                c.algorithm != static_cast<uint32_t>(op.algorithm) || c.collective != static_cast<uint32_t>(d.collective)) {
                st.mismatch = true;  // the reports differ: the coordinator names both hosts
                return false;
            }
            const uint8_t *p = part.buf.data() + part.offset;
            uint64_t n = part.buf.size() - part.offset;
            const uint64_t total = st.a2a_expect[h];  // what this host's ranks' counts make of the message
            if (k == 0) {
                if (c.local_size != theirs.size()) {
                    malformed_part(st, at() + " says it has " + std::to_string(c.local_size) + " rank(s), the group's rank map " +
                                           std::to_string(theirs.size()));
                    return false;
                }
                const uint64_t header = 8 * theirs.size() * mine.size();
                if (n < header) {
                    malformed_part(st, at() + " sent an all_to_all message of " + std::to_string(n) + " bytes, shorter than its counts");
                    return false;
                }
                for (size_t a = 0; a < theirs.size(); ++a)
                    for (size_t b = 0; b < mine.size(); ++b) {
                        uint64_t count = 0;
                        std::memcpy(&count, p + 8 * (a * mine.size() + b), 8);  // (little-endian hosts: proto/le.h)
                        if (count != lay[b].recv_count(theirs[a])) {
                            malformed_part(st, "group " + op.run.group + " op " + std::to_string(op.run.seq) + ": all_to_all: rank " +
                                                   std::to_string(theirs[a]) + " (host " + hosts_[h] + ") sends rank " +
                                                   std::to_string(mine[b]) + " " + std::to_string(count) + " elements, and rank " +
                                                   std::to_string(mine[b]) + " (host " + hosts_[self_] + ") expects " +
                                                   std::to_string(lay[b].recv_count(theirs[a])));
                            return false;
                        }
                    }
                // The counts are this host's ranks' own: the message is `total` bytes, in as many parts.
                const uint64_t want_parts = std::max<uint64_t>(1, (total + proto::kAllToAllPartBytes - 1) / proto::kAllToAllPartBytes);
                if (st.a2a_parts[h] != want_parts || (want_parts == 1 && n != total)) {
                    malformed_part(st, at() + " sent an all_to_all message of " +
                                           (want_parts == 1 ? std::to_string(n) + " bytes" : std::to_string(st.a2a_parts[h]) + " part(s)") +
                                           ", not the " + std::to_string(total) + " its counts say");
                    return false;
                }
                p += header;
                n -= header;
            }
            const uint64_t want = std::min<uint64_t>(proto::kAllToAllPartBytes, total - std::min(total, uint64_t{k} * proto::kAllToAllPartBytes));
            if (part.buf.size() - part.offset != want) {
                malformed_part(st, at() + " sent all_to_all part " + std::to_string(k) + " of " + std::to_string(st.a2a_parts[h]) +
                                       " with " + std::to_string(part.buf.size() - part.offset) + " bytes of a message this host expects to hold " +
                                       std::to_string(total) + " bytes");
                return false;
            }
            // Its bytes, block by block (their ranks' in order, each to this host's ranks in order).
            auto &[block, done] = st.a2a_at[h];
            while (n > 0 && block < theirs.size() * mine.size()) {
                const size_t a = block / mine.size(), b = block % mine.size();
                const uint64_t bytes = lay[b].recv_count(theirs[a]) * es;
                const uint64_t take = std::min(n, bytes - done);
                std::memcpy(op.slots[b]->data() + op.run.out_offsets[b] + lay[b].recv_at(theirs[a]) * es + done, p, take);
                p += take, n -= take, done += take;
                if (done == bytes) ++block, done = 0;
            }
            release(op.run.group, h, part);  // delivered
            ++st.a2a_next[h];
        }
        if (st.a2a_parts[h] != 0 && st.a2a_next[h] == st.a2a_parts[h]) st.a2a_done[h] = 1;
        else all = false;
    }
    if (!all || st.a2a_unsent) return false;  // (its slots are read until its last part is out)
    st.reduced = true;
    release(op.run.group, self_, *st.parts[self_]);
    return true;
}

// broadcast: the root's host sends its root rank's buffer to every other host; reduce: every other
// host sends its local ranks reduced to the root's; barrier: an empty message to every other host.
void DirectExchange::contribute_rooted(State &st, const HostOp &op, const proto::OpReport &r) {
    const OpDesc &d = op.run.desc;
    uint32_t local = 0;
    const uint32_t root = d.collective == Collective::Barrier ? 0 : root_host(d, st.host_ranks, &local);
    if (root == UINT32_MAX) {  // (the domain checked the rank map: never sent)
        malformed_part(st, "group " + r.group + " op " + std::to_string(r.seq) + ": root rank " + std::to_string(d.root) +
                               " is not in the group's rank map");
        add(self_, r, {}, 0);
        return;
    }
    proto::Bytes frame;
    if (d.collective == Collective::Broadcast && self_ == root) {
        frame = proto::encode_op_data(r, proto::OpDataKind::OneShot, d.count * dtype_size(d.dtype));
        if (d.count)
            std::memcpy(frame.data() + proto::op_data_offset(), op.slots[local]->data() + op.run.offsets[local],
                        d.count * dtype_size(d.dtype));
    } else if (d.collective == Collective::Reduce && self_ != root) {
        frame = proto::encode_op_data(r, proto::OpDataKind::OneShot, d.count * dtype_size(partial_dtype(d.dtype, d.op)));
        local_reduce_into(op, frame.data() + proto::op_data_offset(), 0, d.count);
    } else if (d.collective == Collective::Barrier) {
        frame = proto::encode_op_data(r, proto::OpDataKind::OneShot, 0);
    }
    for (uint32_t h = 0; h < n_; ++h)
        if (rooted_sends(d.collective, root, self_, h)) send_(h, frame);
    add(self_, r, {}, 0);
}

// broadcast: done once the root's buffer is in every local rank's (on the root's host at once); reduce: done off the root's host once sent, on it once every other host's partial result
// is reduced with its local ranks' into the root rank's buffer; barrier: once every host's
// message is in.
// Host h's one-shot message of a reduce_scatter, allgather, broadcast, reduce or barrier is here and
// is the one this host's op needs: the same description (else a mismatch for the coordinator,
// which names both hosts), the rank count and size the rank map says (else no honest peer's:
// malformed, named).
bool DirectExchange::part_fits(State &st, const HostOp &op, uint32_t h) {
    const OpDesc &d = op.run.desc;
    const auto &c = st.parts[h];
    if (!c) return false;
    if (c->report.count != d.count || c->report.dtype != static_cast<uint32_t>(d.dtype) ||
        c->report.op != static_cast<uint32_t>(d.op) || c->report.algorithm != static_cast<uint32_t>(op.algorithm) ||
        c->report.collective != static_cast<uint32_t>(d.collective) || c->report.root != d.root) {
        st.mismatch = true;
        return false;
    }
    const std::string at = "group " + op.run.group + " op " + std::to_string(c->report.seq) + ": host " + hosts_[h];
    if (c->report.local_size != st.host_ranks[h].size()) {
        malformed_part(st, at + " says it has " + std::to_string(c->report.local_size) + " rank(s), the group's rank map " +
                               std::to_string(st.host_ranks[h].size()));
        return false;
    }
    const uint64_t have = c->buf.size() - c->offset, want = collective_part_bytes(d, st.host_ranks, h, self_);
    if (h != self_ && have != want) {
        malformed_part(st, at + " sent a " + std::string(collective_name(d.collective)) + " message of " + std::to_string(have) +
                               " bytes, not the " + std::to_string(want) + " the rank map says");
        return false;
    }
    return true;
}

bool DirectExchange::progress_rooted(State &st, const HostOp &op) {
    const OpDesc &d = op.run.desc;
    uint32_t local = 0;
    const uint32_t root = d.collective == Collective::Barrier ? 0 : root_host(d, st.host_ranks, &local);
    if (root == UINT32_MAX) return false;
    uint32_t total = 0;
    for (uint32_t h = 0; h < n_; ++h) {
        if (h != self_ && !rooted_sends(d.collective, root, h, self_)) {
            total += static_cast<uint32_t>(st.host_ranks[h].size());
            continue;
        }
        if (!part_fits(st, op, h)) return false;
        total += st.parts[h]->report.local_size;
    }
    const size_t es = dtype_size(d.dtype);
    if (d.collective == Collective::Broadcast && d.count) {
        // The root's buffer into every local rank's (on the root's host: into its other ranks').
        const std::byte *src = self_ == root ? op.slots[local]->data() + op.run.offsets[local]
                                             : reinterpret_cast<const std::byte *>(st.parts[root]->buf.data() + st.parts[root]->offset);
        for (size_t i = 0; i < op.slots.size(); ++i)
            if (op.slots[i]->data() + op.run.offsets[i] != src) std::memcpy(op.slots[i]->data() + op.run.offsets[i], src, d.count * es);
    } else if (d.collective == Collective::Reduce && self_ == root && d.count) {
        // This host's ranks, then the other hosts' partial results in ring order, into the root's.
        srcs_.clear();
        partials_.clear();
        for (size_t i = 0; i < op.slots.size(); ++i) srcs_.push_back(op.slots[i]->data() + op.run.offsets[i]);
        for (uint32_t h = 0; h < n_; ++h)
            if (h != self_) partials_.push_back(st.parts[h]->buf.data() + st.parts[h]->offset);
        void *dst = op.slots[local]->data() + op.run.offsets[local];
        ReduceArgs a{d.dtype, d.op, srcs_.data(), srcs_.size(), &dst, 1, d.count, total};
        a.partials = partials_.data();
        a.npartial = partials_.size();
        a.avg_shift = avg_shift(n_);
        reduce(a);
    }
    st.reduced = true;
    for (uint32_t h = 0; h < n_; ++h)
        if (st.parts[h]) release(op.run.group, h, *st.parts[h]);  // used up
    return true;
}

bool DirectExchange::progress_collective(State &st, const HostOp &op) {
    if (st.reduced) return true;
    if (st.mismatch) return false;
    const OpDesc &d = op.run.desc;
    if (collective_is_rooted(d.collective) || d.collective == Collective::Barrier) {
        if (st.parts.size() != n_ || st.host_ranks.size() != n_ || !st.parts[self_]) return false;
        return progress_rooted(st, op);
    }
    if (d.collective == Collective::AllToAll) {
        if (st.parts.size() != n_ || st.host_ranks.size() != n_ || !st.parts[self_]) return false;
        return progress_a2a(st, op);
    }
    const bool rs = d.collective == Collective::ReduceScatter;
    const uint32_t self = self_;
    if (st.parts.size() != n_ || st.host_ranks.size() != n_ || !st.parts[self]) return false;
    uint32_t total = 0;
    for (uint32_t h = 0; h < n_; ++h) {
        if (!part_fits(st, op, h)) return false;
        total += st.parts[h]->report.local_size;
    }
    const auto &mine = st.host_ranks[self];
    const size_t es = dtype_size(d.dtype), ps = dtype_size(partial_dtype(d.dtype, d.op));
    const uint64_t count = d.count, block = count * es;
    if (rs) {
        // Each local rank's block: this host's ranks' inputs of it, then the other hosts' parts
        // of it in ring order, into that rank's output.
        for (size_t j = 0; j < mine.size() && count; ++j) {
            srcs_.clear();
            partials_.clear();
            for (size_t i = 0; i < op.slots.size(); ++i)
                srcs_.push_back(op.slots[i]->data() + op.run.offsets[i] + uint64_t{mine[j]} * block);
            for (uint32_t h = 0; h < n_; ++h)
                if (h != self) partials_.push_back(st.parts[h]->buf.data() + st.parts[h]->offset + j * count * ps);
            void *dst = op.slots[j]->data() + op.run.out_offsets[j];
            ReduceArgs a{d.dtype, d.op, srcs_.data(), srcs_.size(), &dst, 1, count, total};
            a.partials = partials_.data();
            a.npartial = partials_.size();
            a.avg_shift = avg_shift(n_);
            reduce(a);
        }
    } else {
        // Every host's blocks into every local rank's output, at their ranks' places.
        for (uint32_t h = 0; h < n_ && count; ++h) {
            const auto &ranks = st.host_ranks[h];
            for (size_t j = 0; j < ranks.size(); ++j) {
                const std::byte *src = h == self ? op.slots[j]->data() + op.run.offsets[j]
                                                 : reinterpret_cast<const std::byte *>(st.parts[h]->buf.data() + st.parts[h]->offset) + j * block;
                for (size_t i = 0; i < op.slots.size(); ++i) {
                    std::byte *dst = op.slots[i]->data() + op.run.out_offsets[i] + uint64_t{ranks[j]} * block;
                    if (dst != src) std::memcpy(dst, src, block);  // (a rank's own block, in place)
                }
            }
        }
    }
    st.reduced = true;
    for (uint32_t h = 0; h < n_; ++h) release(op.run.group, h, *st.parts[h]);  // used up
    return true;
}

// A partner's step of a doubling or halving-doubling op: kept once, from the one host that sends
// this host that step.
bool DirectExchange::take_step(uint32_t host, const proto::OpData &d, proto::Bytes payload, std::string &over_bound_why) {
    const proto::OpReport &r = d.report;
    if (sender_of(d.kind, d.step) != host) {
        spdlog::warn("host {}: group {} op {}: data of kind {} step {} that host {} does not get from it", hosts_[host], r.group,
                     r.seq, static_cast<uint32_t>(d.kind), d.step, hosts_[self_]);
        return false;
    }
    const uint64_t ps = dtype_size(partial_dtype(static_cast<DType>(r.dtype), static_cast<ReduceOp>(r.op)));
    const uint64_t es = dtype_size(static_cast<DType>(r.dtype));
    if (d.kind == proto::OpDataKind::Halving || d.kind == proto::OpDataKind::Gather) {
        // The partner's half of what is left to this host (halving), or the blocks the partner
        // holds (gather), by the sender's own count.
        const uint32_t k = d.step, v = sched_.v;
        uint64_t lo, hi;
        if (d.kind == proto::OpDataKind::Halving) {
            const uint32_t span = sched_.p >> (k + 1);  // this host keeps the `span` blocks around v
            lo = v & ~(span - 1);
            hi = lo + span;
        } else {
            const uint32_t span = 1u << k;  // the partner's blocks
            lo = (v ^ span) & ~(span - 1);
            hi = lo + span;
        }
        const uint64_t want = (block_begin(r.count, static_cast<uint32_t>(hi)) - block_begin(r.count, static_cast<uint32_t>(lo))) *
                              (d.kind == proto::OpDataKind::Halving ? ps : es);
        if (d.data.size() != want) {
            spdlog::warn("host {}: group {} op {}: step {} has {} bytes, not {}", hosts_[host], r.group, r.seq, d.step,
                         d.data.size(), want);
            return false;
        }
    }
    const Key key{r.generation, r.group, r.incarnation, r.seq};
    auto it = ops_.find(key);
    // Reached here: this host runs the op (by this algorithm, or by another: its own part is in).
    const bool reached = it != ops_.end() && (it->second.contributed ||
                                              (it->second.parts.size() > self_ && it->second.parts[self_]));
    if (!reached) {
        over_bound_why = over_bound(host, r, payload.size());
        if (!over_bound_why.empty()) return false;
    }
    State &st = it != ops_.end() ? it->second : ops_[key];
    if (!st.contributed && st.parts.size() > self_ && st.parts[self_]) st.mismatch = true;  // it runs another algorithm here
    const uint32_t id = static_cast<uint32_t>(d.kind) << 16 | d.step;
    if (st.steps.count(id)) return false;  // a duplicate
    peer_bytes_[host] += payload.size();
    group_bytes_[r.group] += payload.size();
    note_deadline(st, host, r);
    st.steps.emplace(id, Part{r, std::move(payload), proto::kOpDataHeaderBytes});
    return true;
}

void DirectExchange::send_step(State &st, proto::OpDataKind kind, uint32_t step, uint32_t to, const void *data, uint64_t bytes) {
    proto::OpReport r = st.report;
    r.local_size = st.ranks;
    proto::Bytes f = proto::encode_op_data(r, kind, bytes, step);
    if (bytes) std::memcpy(f.data() + proto::op_data_offset(), data, bytes);
    send_(to, std::move(f));
}

// Doubling and halving-doubling, as far as the partners' data allows:
//   an extra host: FoldIn to its partner, then FoldOut back into the slots;
//   the others: FoldIn from the extra host (if any), the steps (doubling: swap the whole partial
//   result; halving: keep half of what is left, send the other half), the result into the slots
//   (halving-doubling: this host's block, then the allgather's steps), FoldOut to the extra host.
bool DirectExchange::progress_log(State &st, const HostOp &op) {
    using K = proto::OpDataKind;
    if (st.done) return true;
    if (st.mismatch) return false;
    const DType dtype = op.run.desc.dtype;
    const ReduceOp rop = op.run.desc.op;
    const size_t ps = dtype_size(partial_dtype(dtype, rop)), es = dtype_size(dtype);
    const uint64_t count = op.run.desc.count;
    const bool halving = op.algorithm == Algorithm::HalvingDoubling;
    const uint32_t L = sched_.steps, v = sched_.v;
    auto slot_at = [&](size_t i, uint64_t elem) { return op.slots[i]->data() + op.run.offsets[i] + elem * es; };
    // The partner's data of (kind, step) if it came and matches this host's op; else nullptr.
    auto input = [&](K kind, uint32_t step) -> Part * {
        auto it = st.steps.find(static_cast<uint32_t>(kind) << 16 | step);
        if (it == st.steps.end()) return nullptr;
        const proto::OpReport &r = it->second.report;
        if (r.count != count || r.dtype != static_cast<uint32_t>(dtype) || r.op != static_cast<uint32_t>(rop) ||
            r.algorithm != static_cast<uint32_t>(op.algorithm)) {
            st.mismatch = true;
            return nullptr;
        }
        return &it->second;
    };
    auto used = [&](K kind, uint32_t step) {
        auto it = st.steps.find(static_cast<uint32_t>(kind) << 16 | step);
        release(op.run.group, sender_of(kind, step), it->second);
    };
    // dst = lower (op) higher over `elems` partial elements, the lower host's first.
    auto combine = [&](void *dst, const void *lower, const void *higher, uint64_t elems) {
        if (elems == 0) return;
        const void *in[2] = {lower, higher};
        ReduceArgs a{dtype, rop, nullptr, 0, nullptr, 0, elems, 1};
        a.partials = in;
        a.npartial = 2;
        a.partial_out = dst;
        a.avg_shift = avg_shift(n_);
        reduce(a);
    };
    // The partial result over [b, e) into every local slot, final (avg: divided by every rank).
    auto finish = [&](uint64_t b, uint64_t e) {
        if (e == b) return;
        dsts_.clear();
        for (size_t i = 0; i < op.slots.size(); ++i) dsts_.push_back(slot_at(i, b));
        const void *in = st.work.data() + b * ps;
        ReduceArgs a{dtype, rop, nullptr, 0, dsts_.data(), dsts_.size(), e - b, st.ranks};
        a.partials = &in;
        a.npartial = 1;
        a.avg_shift = avg_shift(n_);
        reduce(a);
    };
    auto copy_in = [&](uint64_t b, uint64_t e, const uint8_t *data) {
        if (e > b)
            for (size_t i = 0; i < op.slots.size(); ++i) std::memcpy(slot_at(i, b), data, (e - b) * es);
    };

    if (sched_.folds_into != UINT32_MAX) {  // an extra host
        if (st.sent != 0) {
            send_step(st, K::FoldIn, 0, sched_.folds_into, st.work.data(), count * ps);
            st.sent = 0;
        }
        Part *in = input(K::FoldOut, 0);
        if (!in) return false;
        copy_in(0, count, in->buf.data() + in->offset);
        used(K::FoldOut, 0);
        return st.done = true;
    }
    for (;;) {
        const uint32_t phase = st.phase;
        if (phase == 0) {  // the extra host's contribution (it is the higher one)
            if (sched_.folded_from != UINT32_MAX) {
                Part *in = input(K::FoldIn, 0);
                if (!in) return false;
                combine(st.work.data(), st.work.data(), in->buf.data() + in->offset, count);
                st.ranks += in->report.local_size;
                used(K::FoldIn, 0);
            }
            st.phase = 1;
        } else if (phase <= L) {  // reduce steps
            const uint32_t k = phase - 1;
            const K kind = halving ? K::Halving : K::Doubling;
            uint64_t keep_b = 0, keep_e = count;  // what this host combines in this step
            if (halving) {
                const uint32_t span = sched_.p >> (k + 1), lo = v & ~(span - 1);
                const uint32_t plo = (v ^ span) & ~(span - 1);  // the blocks the partner keeps
                keep_b = block_begin(count, lo);
                keep_e = block_begin(count, lo + span);
                const uint64_t sb = block_begin(count, plo), se = block_begin(count, plo + span);
                if (st.sent != phase) send_step(st, kind, k, sender_of(kind, k), st.work.data() + sb * ps, (se - sb) * ps);
            } else if (st.sent != phase) {
                send_step(st, kind, k, sender_of(kind, k), st.work.data(), count * ps);
            }
            st.sent = phase;
            Part *in = input(kind, k);
            if (!in) return false;
            const uint32_t partner_v = halving ? v ^ (sched_.p >> (k + 1)) : v ^ (1u << k);
            uint8_t *mine = st.work.data() + keep_b * ps;
            const uint8_t *theirs = in->buf.data() + in->offset;
            if (v < partner_v) combine(mine, mine, theirs, keep_e - keep_b);
            else combine(mine, theirs, mine, keep_e - keep_b);
            st.ranks += in->report.local_size;
            used(kind, k);
            st.phase = phase + 1;
        } else if (phase == L + 1) {  // the result: the whole op, or this host's block
            if (halving) finish(block_begin(count, v), block_begin(count, v + 1));
            else finish(0, count);
            st.work = {};
            st.phase = halving ? L + 2 : 2 * L + 2;
        } else if (phase < 2 * L + 2) {  // halving-doubling's allgather
            const uint32_t k = phase - (L + 2), span = 1u << k;
            const uint32_t lo = v & ~(span - 1), plo = (v ^ span) & ~(span - 1);
            if (st.sent != phase) {
                const uint64_t b = block_begin(count, lo), e = block_begin(count, lo + span);
                send_step(st, K::Gather, k, sender_of(K::Gather, k), slot_at(0, b), (e - b) * es);
                st.sent = phase;
            }
            Part *in = input(K::Gather, k);
            if (!in) return false;
            copy_in(block_begin(count, plo), block_begin(count, plo + span), in->buf.data() + in->offset);
            used(K::Gather, k);
            st.phase = phase + 1;
        } else {
            if (sched_.folded_from != UINT32_MAX) send_step(st, K::FoldOut, 0, sched_.folded_from, slot_at(0, 0), count * es);
            return st.done = true;
        }
    }
}

// A peer's data says how long its host had left (remaining_ms when it sent it): the op's deadline
// there, as seen here (a little later than the true one, by the transit).
void DirectExchange::note_deadline(State &st, uint32_t host, const proto::OpReport &r) {
    const Clock::time_point d = Clock::now() + std::chrono::milliseconds(r.remaining_ms);
    if (st.earliest_host == UINT32_MAX || d < st.earliest) {
        st.earliest = d;
        st.earliest_host = host;
    }
}

std::optional<std::pair<Clock::time_point, uint32_t>> DirectExchange::earliest_deadline(uint64_t generation,
                                                                                         const OpKey &key) const {
    auto it = ops_.find(key_of(generation, key));
    if (it == ops_.end() || it->second.earliest_host == UINT32_MAX) return std::nullopt;
    return std::pair{it->second.earliest, it->second.earliest_host};
}

bool DirectExchange::mismatched(uint64_t generation, const OpKey &key) const {
    auto it = ops_.find(key_of(generation, key));
    return it != ops_.end() && it->second.mismatch;
}

std::string DirectExchange::malformed(uint64_t generation, const OpKey &key) const {
    auto it = ops_.find(key_of(generation, key));
    return it != ops_.end() && it->second.mismatch ? it->second.why : std::string{};
}

void DirectExchange::malformed_part(State &st, std::string why) {
    if (st.mismatch && !st.why.empty()) return;
    spdlog::warn("{}", why);
    st.mismatch = true;
    st.why = std::move(why);
}

bool DirectExchange::has(uint64_t generation, const OpKey &key) const { return ops_.count(key_of(generation, key)) != 0; }

void DirectExchange::drop(uint64_t generation, const OpKey &key) {
    if (auto it = ops_.find(key_of(generation, key)); it != ops_.end()) erase(it);
}

void DirectExchange::drop_before(uint64_t generation) {
    while (!ops_.empty() && std::get<0>(ops_.begin()->first) < generation) erase(ops_.begin());
}

void DirectExchange::add(uint32_t host, const proto::OpReport &r, proto::Bytes buf, size_t offset) {
    State &st = ops_[Key{r.generation, r.group, r.incarnation, r.seq}];
    st.parts.resize(n_);
    st.got_result.resize(n_, 0);
    if (st.parts[host]) return;  // a duplicate
    if (host != self_) {  // the bounds count peers' data
        peer_bytes_[host] += buf.size();
        group_bytes_[r.group] += buf.size();
        note_deadline(st, host, r);
    }
    st.parts[host] = Part{r, std::move(buf), offset};
}

// The data of a part is used up (reduced) or dropped.
void DirectExchange::release(const std::string &group, uint32_t host, Part &p) {
    if (host == self_) {
        p.buf = {};
        return;
    }
    peer_bytes_[host] -= p.buf.size();
    auto g = group_bytes_.find(group);
    if (g != group_bytes_.end() && (g->second -= p.buf.size()) == 0) group_bytes_.erase(g);
    p.buf = {};
}

void DirectExchange::erase(std::map<Key, State>::iterator it) {
    for (uint32_t h = 0; h < it->second.parts.size(); ++h)
        if (it->second.parts[h]) release(std::get<1>(it->first), h, *it->second.parts[h]);
    for (auto &[id, part] : it->second.steps)
        release(std::get<1>(it->first), sender_of(static_cast<proto::OpDataKind>(id >> 16), id & 0xffff), part);
    for (uint32_t h = 0; h < it->second.a2a.size(); ++h)
        for (auto &[k, part] : it->second.a2a[h]) release(std::get<1>(it->first), h, part);
    sending_.erase(it->first);
    ops_.erase(it);
}

}  // namespace ringd
