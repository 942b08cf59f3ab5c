#include "daemon/ops/host_ops.h"

#include <cerrno>

#include "daemon/ipc/slot.h"

namespace ringd {

const char *op_state_name(OpState s) {
    switch (s) {
    case OpState::Queued: return "queued";
    case OpState::Reported: return "reported";
    case OpState::Running: return "running";
    case OpState::Releasing: return "releasing";
    }
    return "?";
}

void HostOps::queue(HostOp op) {
    op.state = OpState::Queued;
    auto &q = queued_[op.run.group];
    auto at = q.end();
    while (at != q.begin() && std::prev(at)->run.seq > op.run.seq) --at;  // local order = seq order
    q.insert(at, std::move(op));
}

std::vector<std::string> HostOps::queued_groups() const {
    std::vector<std::string> v;
    for (const auto &[group, q] : queued_) v.push_back(group);
    return v;
}

HostOp *HostOps::next_queued(const std::string &group) {
    auto it = queued_.find(group);
    return it == queued_.end() || it->second.empty() ? nullptr : &it->second.front();
}

HostOp HostOps::take_queued(const std::string &group) {
    auto it = queued_.find(group);
    HostOp op = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) queued_.erase(it);
    return op;
}

bool HostOps::has_queued(const std::string &group) const { return queued_size(group) != 0; }

size_t HostOps::queued_size(const std::string &group) const {
    auto it = queued_.find(group);
    return it == queued_.end() ? 0 : it->second.size();
}

HostOp &HostOps::reported(const OpKey &key, HostOp op) {
    op.state = OpState::Reported;
    return reported_[key] = std::move(op);
}

HostOp *HostOps::find_reported(const OpKey &key) {
    auto it = reported_.find(key);
    return it == reported_.end() ? nullptr : &it->second;
}

std::optional<HostOp> HostOps::take_reported(const OpKey &key) {
    auto node = reported_.extract(key);
    if (node.empty()) return std::nullopt;
    return std::move(node.mapped());
}

void HostOps::running(uint64_t op_id, uint64_t generation, Clock::time_point deadline, const OpKey &key,
                      Clock::time_point submitted) {
    ring_[op_id] = Ring{generation, deadline, OpState::Running, false, {}, key, submitted};
}

void HostOps::returned(uint64_t op_id, int32_t status, const std::string &message, bool link_ended_ring) {
    auto it = ring_.find(op_id);
    if (it == ring_.end()) {
        groups_.finished(op_id, status, message, done_);  // not a ring op of a generation (cannot happen)
        return;
    }
    if (it->second.state == OpState::Releasing) {
        // Its generation ended while it ran: its trainers hear of it only now that the progress
        // thread is done with their slots.
        groups_.finished(op_id, -ECONNABORTED, it->second.end_reason, done_);
        ring_.erase(it);
    } else if (link_ended_ring) {
        it->second.held = true;
    } else {
        groups_.finished(op_id, status, message, done_);
        ring_.erase(it);
    }
}

void HostOps::generation_ended(const std::string &reason) {
    // Everything that is ready here fails, so that no host carries an op into the next
    // generation that the others failed.
    for (auto &[key, op] : reported_) groups_.finished(op.run.op_id, -ECONNABORTED, reason, done_);
    reported_.clear();
    for (auto &[group, q] : queued_)
        for (auto &op : q)
            if (op.status == 0) groups_.finished(op.run.op_id, -ECONNABORTED, reason, done_);
    queued_.clear();
    for (auto it = ring_.begin(); it != ring_.end();) {
        if (it->second.held) {
            groups_.finished(it->first, -ECONNABORTED, reason, done_);
            it = ring_.erase(it);
            continue;
        }
        if (it->second.state == OpState::Running) {
            it->second.state = OpState::Releasing;  // fails when the progress thread gives it back
            it->second.end_reason = reason;
        }
        ++it;
    }
}

size_t HostOps::fail_queued(int32_t code, const std::function<std::string(const HostOp &)> &why) {
    size_t n = 0;
    for (auto &[group, q] : queued_)
        for (auto &op : q)
            if (op.status == 0) {  // a local failure's report has told its ranks already
                groups_.finished(op.run.op_id, code, why(op), done_);
                ++n;
            }
    queued_.clear();
    return n;
}

uint64_t HostOps::lowest_held(const std::string &group, uint64_t incarnation) const {
    uint64_t low = UINT64_MAX;
    if (auto it = reported_.lower_bound(OpKey{group, incarnation, 0});
        it != reported_.end() && std::get<0>(it->first) == group && std::get<1>(it->first) == incarnation)
        low = std::get<2>(it->first);
    for (const auto &[id, r] : ring_)
        if (std::get<0>(r.key) == group && std::get<1>(r.key) == incarnation) low = std::min(low, std::get<2>(r.key));
    return low;
}

HostOps::Counts HostOps::counts() const {
    Counts c;
    for (const auto &[group, q] : queued_) c.queued += q.size();
    c.reported = reported_.size();
    for (const auto &[id, r] : ring_) ++(r.state == OpState::Running ? c.running : c.releasing);
    return c;
}

std::vector<HostOps::View> HostOps::view(Clock::time_point now) const {
    auto age = [&](Clock::time_point t) { return std::chrono::duration<double>(now - t).count(); };
    std::vector<View> v;
    for (const auto &[group, q] : queued_)
        for (const auto &op : q)
            v.push_back({group, 0, op.run.seq, OpState::Queued, op.algorithm, age(op.run.submitted), op.status != 0});
    for (const auto &[key, op] : reported_)
        v.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key), OpState::Reported, op.algorithm,
                     age(op.run.submitted), false});
    for (const auto &[id, r] : ring_)
        v.push_back({std::get<0>(r.key), std::get<1>(r.key), std::get<2>(r.key), r.state, Algorithm::Ring, age(r.submitted), false});
    return v;
}

}  // namespace ringd
