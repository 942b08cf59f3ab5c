#include "daemon/engine/coordinator.h"

#include "proto/types.h"

namespace ringd {
namespace {

constexpr size_t kDecidedMemory = 4096;

std::string describe(const proto::OpReport &r) {
    return std::to_string(r.count) + " x " + std::string(dtype_name(static_cast<DType>(r.dtype))) + " " +
           std::string(reduce_op_name(static_cast<ReduceOp>(r.op)));
}

}  // namespace

void Coordinator::reset(uint64_t generation) {
    generation_ = generation;
    next_op_id_ = 1;
    pending_.clear();
    decided_.clear();
    decided_order_.clear();
}

void Coordinator::decide(const Key &k) {
    pending_.erase(k);
    decided_.insert(k);
    decided_order_.push_back(k);
    while (decided_order_.size() > kDecidedMemory) {
        decided_.erase(decided_order_.front());
        decided_order_.pop_front();
    }
}

void Coordinator::report(uint32_t host, const proto::OpReport &r, Clock::time_point now, Decisions &out) {
    if (r.generation != generation_ || host >= hosts_.size()) return;  // from a generation that is over
    const Key k{r.group, r.ordinal};
    if (decided_.count(k)) return;
    const std::string at = "group " + r.group + " op " + std::to_string(r.ordinal) + ": ";
    if (r.status != 0) {
        out.fails.push_back({generation_, r.group, r.ordinal, r.status, r.message});
        decide(k);
        return;
    }
    auto [it, fresh] = pending_.try_emplace(k);
    Pending &p = it->second;
    if (fresh) {
        p.by_host.resize(hosts_.size());
        p.deadline = now + op_timeout_;
    }
    if (p.by_host[host]) return;  // duplicate
    for (size_t h = 0; h < hosts_.size(); ++h) {
        if (!p.by_host[h]) continue;
        const auto &o = *p.by_host[h];
        if (o.count != r.count || o.dtype != r.dtype || o.op != r.op) {
            out.fails.push_back({generation_, r.group, r.ordinal, -EINVAL,
                                 at + "mismatch: host " + hosts_[h] + " submitted " + describe(o) + ", host " +
                                     hosts_[host] + " submitted " + describe(r)});
            decide(k);
            return;
        }
        if (o.algorithm != r.algorithm) {  // same op, different tuning.* on the two hosts
            out.fails.push_back({generation_, r.group, r.ordinal, -EINVAL,
                                 at + "hosts " + hosts_[h] + " and " + hosts_[host] +
                                     " chose different algorithms (their tuning settings differ)"});
            decide(k);
            return;
        }
        break;
    }
    p.by_host[host] = r;
    uint32_t total = 0;
    for (const auto &b : p.by_host) {
        if (!b) return;
        total += b->local_size;
    }
    // A one- or two-shot op completes on every host by itself; a ring op starts now, in this order.
    if (r.algorithm == 0) out.starts.push_back({generation_, r.group, r.ordinal, next_op_id_++, total});
    decide(k);
}

void Coordinator::expire(Clock::time_point now, Decisions &out) {
    std::vector<Key> late;
    for (const auto &[k, p] : pending_)
        if (p.deadline <= now) late.push_back(k);
    for (const Key &k : late) {
        std::string missing;
        for (size_t h = 0; h < hosts_.size(); ++h)
            if (!pending_[k].by_host[h]) missing += (missing.empty() ? "" : ", ") + hosts_[h];
        out.fails.push_back({generation_, k.first, k.second, -ETIMEDOUT,
                             "group " + k.first + " op " + std::to_string(k.second) + " timed out after " +
                                 std::to_string(op_timeout_.count()) + " ms: host(s) " + missing + " did not submit it"});
        decide(k);
    }
}

}  // namespace ringd
