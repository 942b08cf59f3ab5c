#include "daemon/exchange/direct_exchange.h"

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
    : self_(self), n_(static_cast<uint32_t>(hosts.size())), hosts_(std::move(hosts)), send_(std::move(send)),
      queued_(std::move(queued)), peer_bytes_(n_, 0) {}

std::string DirectExchange::send_over_bound(const proto::OpReport &r, DType dtype, ReduceOp op, Algorithm algorithm) const {
    const uint64_t ps = dtype_size(partial_dtype(dtype, op));
    for (uint32_t h = 0; h < n_; ++h) {
        if (h == self_) continue;
        const uint64_t elems = algorithm == Algorithm::OneShot ? r.count : seg_begin(r.count, n_, h + 1) - seg_begin(r.count, n_, h);
        const uint64_t queued = queued_(h);
        if (queued + elems * ps > kMaxSendBacklog)
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
    const size_t es = dtype_size(op.run.dtype);
    srcs_.clear();
    for (size_t i = 0; i < op.slots.size(); ++i) srcs_.push_back(op.slots[i]->data() + op.run.offsets[i] + begin * es);
    if (srcs_.size() == 1 && op.run.op != ReduceOp::Avg && partial_dtype(op.run.dtype, op.run.op) == op.run.dtype) {
        std::memcpy(dst, srcs_[0], elems * es);
        return;
    }
    ReduceArgs a{op.run.dtype, op.run.op, srcs_.data(), srcs_.size(), nullptr, 0, elems, 1};
    a.partial_out = dst;
    a.avg_shift = avg_shift(n_);
    reduce(a);
}

// One-shot: this host's contribution goes to every other host. Two-shot: segment j of it goes
// to host j.
void DirectExchange::contribute(const HostOp &op, const proto::OpReport &r) {
    const size_t ps = dtype_size(partial_dtype(op.run.dtype, op.run.op));  // contributions are partial results
    const uint64_t count = op.run.count;
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
            send_(h, part);
        }
    }
    // This host's own part: the whole contribution (one-shot), or its segment, which stays in
    // the local slots (two-shot).
    add(self_, r, std::move(own), proto::op_data_offset());
}

bool DirectExchange::take_part(uint32_t host, const proto::OpData &d, proto::Bytes payload, std::string &over_bound) {
    const proto::OpReport &r = d.report;
    const uint64_t ps = dtype_size(partial_dtype(static_cast<DType>(r.dtype), static_cast<ReduceOp>(r.op)));
    if (d.kind == proto::OpDataKind::TwoShotPart &&
        d.data.size() != (seg_begin(r.count, n_, self_ + 1) - seg_begin(r.count, n_, self_)) * ps) {
        spdlog::warn("host {}: two-shot part of group {} op {} has {} bytes, not this host's segment", hosts_[host],
                     r.group, r.seq, d.data.size());
        return false;
    }
    auto it = ops_.find(Key{r.generation, r.group, r.incarnation, r.seq});
    if (it == ops_.end() || !it->second.parts[self_]) {
        // Data of an op this host has not reached: within its bounds, or the op fails by name.
        auto g = group_bytes_.find(r.group);
        const uint64_t size = payload.size(), group_bytes = g == group_bytes_.end() ? 0 : g->second;
        const bool peer_over = peer_bytes_[host] + size > kMaxPeerBacklog;
        if (peer_over || group_bytes + size > kMaxGroupBacklog) {
            over_bound = "group " + r.group + " op " + std::to_string(r.seq) + ": host " + hosts_[self_] +
                         " holds more one-/two-shot data of ops it has not reached than its bound of " +
                         std::to_string((peer_over ? kMaxPeerBacklog : kMaxGroupBacklog) >> 20) + " MiB " +
                         (peer_over ? "per peer" : "per group") + " (host " + hosts_[host] + " is that far ahead)";
            return false;
        }
    }
    add(host, r, std::move(payload), proto::kOpDataHeaderBytes);
    return true;
}

void DirectExchange::take_result(uint32_t host, uint64_t generation, const OpKey &key, const HostOp &op,
                                 const proto::OpReport &r, std::span<const uint8_t> data) {
    auto it = ops_.find(key_of(generation, key));
    if (it == ops_.end()) return;  // ended here
    const size_t es = dtype_size(op.run.dtype);
    const uint64_t b = seg_begin(op.run.count, n_, host), e = seg_begin(op.run.count, n_, host + 1);
    if (r.count != op.run.count || r.dtype != static_cast<uint32_t>(op.run.dtype) || data.size() != (e - b) * es ||
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
    const size_t es = dtype_size(op.run.dtype);
    const bool two_shot = op.algorithm == Algorithm::TwoShot;
    if (!st.reduced) {
        uint32_t total = 0;
        for (const auto &c : st.parts) {
            // A part that does not match is left to the coordinator, which sees the same reports
            // and answers with OpFail.
            if (!c) return false;
            if (c->report.count != op.run.count || c->report.dtype != static_cast<uint32_t>(op.run.dtype) ||
                c->report.op != static_cast<uint32_t>(op.run.op) || c->report.algorithm != static_cast<uint32_t>(op.algorithm))
                return false;
            total += c->report.local_size;
        }
        // Every host's part is in: reduce them in ring order (one-shot: the same bits on every
        // host). Two-shot: this host's ranks in place, then the other hosts' parts.
        const uint64_t b = two_shot ? seg_begin(op.run.count, n_, self_) : 0;
        const uint64_t e = two_shot ? seg_begin(op.run.count, n_, self_ + 1) : op.run.count;
        srcs_.clear();  // the hosts' parts: partial results
        dsts_.clear();
        for (size_t i = 0; i < op.slots.size(); ++i) dsts_.push_back(op.slots[i]->data() + op.run.offsets[i] + b * es);
        for (uint32_t h = 0; h < n_; ++h)
            if (!two_shot || h != self_) srcs_.push_back(st.parts[h]->buf.data() + st.parts[h]->offset);
        ReduceArgs a{op.run.dtype, op.run.op, two_shot ? dsts_.data() : nullptr, two_shot ? dsts_.size() : 0,
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
    ops_.erase(it);
}

}  // namespace ringd
