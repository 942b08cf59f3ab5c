#include "daemon/engine/group_table.h"

#include <set>
#include <string_view>

#include "proto/peer.h"

#include <algorithm>

namespace ringd {
namespace {

constexpr size_t kFailedMemory = 256;  // failed seqs remembered per group for late submitters

std::string describe(const proto::Submission &s) { return ringd::describe(s.desc); }

// Whether [a, a + an) and [b, b + bn) share a byte.
bool overlap(uint64_t a, uint64_t an, uint64_t b, uint64_t bn) { return an && bn && a < b + bn && b < a + an; }

}  // namespace

size_t GroupTable::Group::joined() const {
    return static_cast<size_t>(std::count_if(members.begin(), members.end(), [](const auto &m) { return m.has_value(); }));
}

Status GroupTable::check_join(const std::string &name, uint32_t rank, uint32_t size, uint32_t uid,
                              std::chrono::milliseconds op_timeout, GroupRank group_rank) const {
    if (group_rank.ranks != 0 && (group_rank.rank >= group_rank.ranks || size > group_rank.ranks))
        return make_error(-EINVAL, "group " + name + ": rank " + std::to_string(group_rank.rank) + " of " +
                                       std::to_string(group_rank.ranks) + " ranks with " + std::to_string(size) +
                                       " local ranks on this host");
    auto it = groups_.find(name);
    if (it == groups_.end()) return Ok{};
    const Group &g = it->second;
    if (uid != 0 && uid != g.owner_uid)
        return make_error(-EACCES, "group " + name + " belongs to uid " + std::to_string(g.owner_uid) +
                                       " (its first trainer's); uid " + std::to_string(uid) + " may not join it");
    if (!g.broken.empty())
        return make_error(-EBUSY, "group " + name + " is closing after an error (" + g.broken +
                                      "); rejoin once its remaining ranks have disconnected");
    if (g.local_size != size)
        return make_error(-EINVAL, "group " + name + " has local_size " + std::to_string(g.local_size) +
                                       ", this trainer asked for " + std::to_string(size));
    if (g.members[rank])
        return make_error(-EADDRINUSE, "group " + name + " local rank " + std::to_string(rank) + " is already joined");
    if (const auto t = op_timeout.count() ? op_timeout : op_timeout_; t != g.op_timeout)
        return make_error(-EINVAL, "group " + name + "'s trainers on host " + host_ + " ask for different op timeouts: " +
                                       std::to_string(g.op_timeout.count()) + " ms (the first one), this one " +
                                       std::to_string(t.count()) + " ms; every rank of a group passes the same timeout");
    if (g.joined() > 0 && group_rank.ranks != g.group_ranks) {
        auto said = [](uint32_t n) { return n ? "a group of " + std::to_string(n) + " ranks" : std::string("no rank"); };
        return make_error(-EINVAL, "group " + name + "'s trainers on host " + host_ + " say different group sizes: " +
                                       said(g.group_ranks) + " (the first one), this one " + said(group_rank.ranks) +
                                       "; every rank of a group says its rank in a group of the same size, or none does");
    }
    if (group_rank.ranks != 0)
        for (uint32_t r = 0; r < g.local_size; ++r)
            if (g.members[r] && g.ranks[r] == group_rank.rank)
                return make_error(-EADDRINUSE, "group " + name + " rank " + std::to_string(group_rank.rank) +
                                                   " is already local rank " + std::to_string(r) + " on host " + host_);
    return Ok{};
}

bool GroupTable::awaiting_ranks(const std::string &group) const {
    auto it = groups_.find(group);
    return it != groups_.end() && it->second.group_ranks != 0 && it->second.joined() != it->second.local_size;
}

std::string GroupTable::ranks_refused(const Group &g, const OpDesc &d) {
    if (d.collective == Collective::Allreduce) return {};
    if (g.group_ranks == 0)
        return "a " + std::string(collective_name(d.collective)) +
               " needs the group's ranks: every trainer of the group says its rank when it connects "
               "(ringd_options.rank and .ranks)";
    if (d.ranks != g.group_ranks)
        return "a " + std::string(collective_name(d.collective)) + " over " + std::to_string(d.ranks) +
               " ranks in a group of " + std::to_string(g.group_ranks);
    return {};
}

std::string GroupTable::collective_refused(MemberId id, const proto::Submission &s) const {
    auto mit = members_.find(id);
    if (mit == members_.end()) return {};  // (submit says why)
    const Group &g = groups_.at(mit->second.group);
    std::string why = ranks_refused(g, s.desc);
    return why.empty() ? why : "group " + g.name + " op " + std::to_string(s.seq) + ": " + why;
}

uint32_t GroupTable::member_rank(MemberId id) const {
    auto mit = members_.find(id);
    if (mit == members_.end()) return 0;
    const Group &g = groups_.at(mit->second.group);
    return mit->second.local_rank < g.ranks.size() ? g.ranks[mit->second.local_rank] : 0;
}

const std::vector<uint32_t> *GroupTable::group_ranks(const std::string &group, uint32_t *ranks) const {
    auto it = groups_.find(group);
    if (it == groups_.end() || it->second.group_ranks == 0 || it->second.joined() != it->second.local_size) return nullptr;
    if (ranks) *ranks = it->second.group_ranks;
    return &it->second.ranks;
}

std::chrono::milliseconds GroupTable::op_timeout(const std::string &group) const {
    auto it = groups_.find(group);
    return it == groups_.end() ? op_timeout_ : it->second.op_timeout;
}

bool GroupTable::every_host(const std::string &group) const {
    auto it = groups_.find(group);
    return it != groups_.end() && it->second.every_host;
}

const std::vector<uint32_t> *GroupTable::hosts_of(const std::string &group) const {
    auto it = groups_.find(group);
    return it == groups_.end() ? nullptr : &it->second.hosts;
}

Status GroupTable::join(MemberId id, const std::string &name, uint32_t rank, uint32_t size, uint32_t uid,
                        std::vector<uint32_t> hosts, std::chrono::milliseconds op_timeout, bool every_host,
                        GroupRank group_rank) {
    if (members_.count(id)) return make_error(-EALREADY, "this connection already joined a group");
    if (auto ok = check_join(name, rank, size, uid, op_timeout, group_rank); !ok) return ok;
    auto it = groups_.find(name);
    if (it == groups_.end()) {
        Group g;
        g.name = name;
        g.local_id = next_local_id_;
        next_local_id_ += 2;  // odd, never 0
        g.local_size = size;
        g.owner_uid = uid;
        g.op_timeout = op_timeout.count() ? op_timeout : op_timeout_;
        g.hosts = std::move(hosts);
        g.every_host = every_host;
        g.members.resize(size);
        g.ranks.resize(size);
        it = groups_.emplace(name, std::move(g)).first;
    }
    Group &g = it->second;
    if (g.joined() == 0) g.group_ranks = group_rank.ranks;
    g.ranks[rank] = group_rank.rank;
    g.members[rank] = id;
    members_[id] = MemberInfo{name, rank};
    return Ok{};
}

void GroupTable::fail_seq(Group &g, uint64_t seq, int32_t code, const std::string &message,
                          std::vector<Completion> &out) {
    auto pit = g.pending.find(seq);
    // (Ranks that submit it later did not time out: the op failed before they came.)
    Failed f{message, std::vector<bool>(g.local_size, false), code == -ETIMEDOUT ? -EIO : code};
    if (pit != g.pending.end()) {
        for (uint32_t r = 0; r < g.local_size; ++r) {
            if (!pit->second.by_rank[r]) continue;
            f.told[r] = true;
            if (g.members[r]) out.push_back({*g.members[r], seq, code, message});
        }
        g.pending.erase(pit);
    }
    ++g.ops_failed;
    ++totals_.ops_failed;
    count_failed_unstarted(g);
    failures_.push_back({g.name, g.local_id, seq, code, message, g.hosts});
    if (std::count(f.told.begin(), f.told.end(), true) == static_cast<long>(g.local_size)) return;
    g.failed[seq] = std::move(f);
    g.failed_order.push_back(seq);
    while (g.failed_order.size() > kFailedMemory) {
        g.failed.erase(g.failed_order.front());
        g.failed_order.pop_front();
    }
}

void GroupTable::submit(MemberId id, const proto::Submission &s, Clock::time_point now, std::vector<Completion> &out,
                        std::vector<OpRun> &ready) {
    auto mit = members_.find(id);
    if (mit == members_.end()) {
        out.push_back({id, s.seq, -ENOTCONN, "this connection has not joined a group"});
        return;
    }
    Group &g = groups_.at(mit->second.group);
    const uint32_t rank = mit->second.local_rank;
    const std::string at = "group " + g.name + " op " + std::to_string(s.seq) + ": ";
    if (!g.broken.empty()) {
        out.push_back({id, s.seq, -ECONNABORTED, at + g.broken});
        if (s.seq > g.last_refused_seq) {
            g.last_refused_seq = s.seq;
            ++g.ops_failed;
            ++totals_.ops_failed;
            count_failed_unstarted(g);
            failures_.push_back({g.name, g.local_id, s.seq, -ECONNABORTED, at + g.broken, g.hosts});
        }
        return;
    }
    if (auto fit = g.failed.find(s.seq); fit != g.failed.end()) {
        out.push_back({id, s.seq, fit->second.code, fit->second.message});
        fit->second.told[rank] = true;
        return;
    }
    auto [pit, fresh] = g.pending.try_emplace(s.seq);
    Pending &p = pit->second;
    if (fresh) {
        p.by_rank.resize(g.local_size);
        p.deadline = now + g.op_timeout;
    }
    if (p.by_rank[rank]) {
        out.push_back({id, s.seq, -EINVAL, at + "submitted twice by local rank " + std::to_string(rank)});
        return;
    }
    if (s.desc.collective != Collective::Allreduce) {
        // Its blocks are the group's ranks, numbered as the trainers numbered them.
        std::string why = ranks_refused(g, s.desc);
        if (why.empty() && s.desc.collective == Collective::AllToAll && overlap(s.offset, s.bytes, s.out_offset, s.out_bytes))
            why = "an all_to_all's output [" + std::to_string(s.out_offset) + ", +" + std::to_string(s.out_bytes) +
                  ") overlaps its input [" + std::to_string(s.offset) + ", +" + std::to_string(s.bytes) + ")";
        if (why.empty() && collective_blocked(s.desc.collective) && overlap(s.offset, s.bytes, s.out_offset, s.out_bytes)) {
            // In place: the output is the rank's own block of the input (reduce_scatter) or the
            // input is its block of the output (allgather); any other overlap is refused.
            const uint64_t block = s.desc.collective == Collective::ReduceScatter ? s.out_bytes : s.bytes;
            const uint64_t mine = uint64_t{g.ranks[rank]} * block;
            const bool in_place = s.desc.collective == Collective::ReduceScatter ? s.out_offset == s.offset + mine
                                                                                : s.offset == s.out_offset + mine;
            if (!in_place)
                why = "the output [" + std::to_string(s.out_offset) + ", +" + std::to_string(s.out_bytes) +
                      ") overlaps the input [" + std::to_string(s.offset) + ", +" + std::to_string(s.bytes) +
                      ") other than as rank " + std::to_string(g.ranks[rank]) + "'s block (in place)";
        }
        if (!why.empty()) {
            reject(id, s.seq, -EINVAL, at + why, out);
            return;
        }
    }
    // Compare with the first rank that submitted this seq.
    for (uint32_t r = 0; r < g.local_size; ++r) {
        if (!p.by_rank[r]) continue;
        const auto &o = *p.by_rank[r];
        if (o.desc != s.desc) {
            p.by_rank[rank] = s;
            fail_seq(g, s.seq, -EINVAL,
                     at + "mismatch: local rank " + std::to_string(r) + " submitted " + describe(o) + ", local rank " +
                         std::to_string(rank) + " submitted " + describe(s),
                     out);
            return;
        }
        break;
    }
    p.by_rank[rank] = s;
    if (++p.submitted < g.local_size) return;

    OpRun run;
    run.op_id = next_op_id_++;
    run.group = g.name;
    run.local_id = g.local_id;
    run.seq = s.seq;
    run.desc = s.desc;
    run.deadline = p.deadline;
    run.submitted = p.deadline - g.op_timeout;
    for (uint32_t r = 0; r < g.local_size; ++r) {
        run.members.push_back(*g.members[r]);
        run.offsets.push_back(p.by_rank[r]->offset);
        run.out_offsets.push_back(p.by_rank[r]->out_offset);
        if (p.by_rank[r]->splits) run.splits.resize(g.local_size), run.splits[r] = p.by_rank[r]->splits;
        if (p.by_rank[r]->feedback && !run.feedback) run.feedback = true, run.feedback_tag = p.by_rank[r]->feedback_tag;
    }
    if (s.desc.collective != Collective::Allreduce) run.ranks = g.ranks;
    g.running[run.op_id] = Running{s.seq, s.bytes, run.members, {}, {}, "none", run.submitted};
    g.pending.erase(pit);
    ready.push_back(std::move(run));
}

std::vector<LocalFailure> GroupTable::take_failures() {
    std::vector<LocalFailure> out, held;
    for (auto &f : failures_) {
        auto it = groups_.find(f.group);
        const bool waits = f.seq != proto::kIncarnationEnds && it != groups_.end() && it->second.local_id == f.local_id &&
                           !it->second.pending.empty() && it->second.pending.begin()->first < f.seq;
        (waits ? held : out).push_back(std::move(f));
    }
    failures_ = std::move(held);
    return out;
}

void GroupTable::reject(MemberId id, uint64_t seq, int32_t code, const std::string &why, std::vector<Completion> &out,
                        bool refused) {
    auto mit = members_.find(id);
    if (mit == members_.end()) {
        out.push_back({id, seq, code, why});
        return;
    }
    Group &g = groups_.at(mit->second.group);
    const uint32_t rank = mit->second.local_rank;
    const std::string message = "group " + g.name + " op " + std::to_string(seq) + ": " + who(rank) +
                                (refused ? " refused it: " + why : " submitted an invalid op (" + why + ")");
    out.push_back({id, seq, code, refused ? message : why});
    if (!g.broken.empty() || g.failed.count(seq)) return;
    auto [pit, fresh] = g.pending.try_emplace(seq);
    if (fresh) pit->second.by_rank.resize(g.local_size);
    if (pit->second.by_rank[rank]) return;  // duplicate seq; the client was told, the op stays
    fail_seq(g, seq, code, message, out);
    if (auto fit = g.failed.find(seq); fit != g.failed.end()) fit->second.told[rank] = true;
}

void GroupTable::leave(MemberId id, std::vector<Completion> &out) {
    auto mit = members_.find(id);
    if (mit == members_.end()) return;
    auto git = groups_.find(mit->second.group);
    const uint32_t rank = mit->second.local_rank;
    members_.erase(mit);
    Group &g = git->second;
    g.members[rank].reset();
    const std::string why = who(rank) + " left";
    const bool first_departure = g.broken.empty();
    if (first_departure) g.broken = why + "; every rank of the group must reconnect";
    while (!g.pending.empty()) {
        const uint64_t seq = g.pending.begin()->first;
        fail_seq(g, seq, -ECONNABORTED, "group " + g.name + " op " + std::to_string(seq) + ": " + why, out);
    }
    // Every later op of this incarnation (which the other hosts' ranks may be waiting in) fails
    // with the reason too.
    if (first_departure) failures_.push_back({g.name, g.local_id, proto::kIncarnationEnds, -ECONNABORTED, "group " + g.name + ": " + why, g.hosts});
    for (auto &[op_id, r] : g.running)
        if (r.failure.empty()) r.failure = "group " + g.name + " op " + std::to_string(r.seq) + ": " + why;
    if (g.joined() == 0) {
        for (auto &[id, r] : g.running) r.group = g.name;  // named once drained, for the metrics
        draining_.merge(g.running);
        groups_.erase(git);
    }
}

void GroupTable::expire(Clock::time_point now, std::vector<Completion> &out) {
    for (auto &[name, g] : groups_) {
        std::vector<uint64_t> late;
        for (const auto &[seq, p] : g.pending)
            if (p.deadline <= now) late.push_back(seq);
        for (uint64_t seq : late) {
            std::string missing;
            for (uint32_t r = 0; r < g.local_size; ++r)
                if (!g.pending[seq].by_rank[r]) missing += (missing.empty() ? "" : ",") + std::to_string(r);
            fail_seq(g, seq, -ETIMEDOUT,
                     "group " + name + " op " + std::to_string(seq) + " timed out after " +
                         std::to_string(g.op_timeout.count()) + " ms: local ranks " + missing + " of host " + host_ +
                         " did not submit it",
                     out);
        }
    }
    std::set<std::string> live;
    for (const auto &[name, g] : groups_) live.insert(name);
    metrics_.forget_gone(live, now);
}

std::optional<Clock::time_point> GroupTable::next_deadline() const {
    std::optional<Clock::time_point> best;
    for (const auto &[name, g] : groups_)
        for (const auto &[seq, p] : g.pending)
            if (!best || p.deadline < *best) best = p.deadline;
    return best;
}

void GroupTable::count_ended(const std::string &group, const Running &r, bool ok, Clock::time_point now) {
    // An op that never took a path (failed before one was chosen) is counted, not timed.
    const bool timed = std::string_view(r.algorithm) != "none";
    metrics_.ended(group, r.algorithm, ok, r.bytes, timed ? std::chrono::duration<double>(now - r.submitted).count() : -1.0,
                   now);
}

void GroupTable::set_algorithm(uint64_t op_id, const char *algorithm) {
    if (auto d = draining_.find(op_id); d != draining_.end()) {
        d->second.algorithm = algorithm;
        return;
    }
    for (auto &[name, g] : groups_)
        if (auto it = g.running.find(op_id); it != g.running.end()) {
            it->second.algorithm = algorithm;
            return;
        }
}

void GroupTable::finished(uint64_t op_id, int32_t status, const std::string &message, std::vector<Completion> &out,
                          Clock::time_point now) {
    if (auto d = draining_.find(op_id); d != draining_.end()) {  // its ranks are gone: nobody to tell
        ++totals_.ops_failed;
        count_ended(d->second.group, d->second, false, now);
        draining_.erase(d);
        return;
    }
    for (auto git = groups_.begin(); git != groups_.end(); ++git) {
        Group &g = git->second;
        auto rit = g.running.find(op_id);
        if (rit == g.running.end()) continue;
        const Running &r = rit->second;
        const bool ok = status == 0 && r.failure.empty();
        const std::string msg = !r.failure.empty() ? r.failure : message;
        const int32_t code = ok ? 0 : (status != 0 ? status : -ECONNABORTED);
        for (MemberId m : r.members) out.push_back({m, r.seq, code, ok ? std::string() : msg});
        count_ended(git->first, r, ok, now);
        if (ok) {
            ++g.ops_completed;
            g.bytes_reduced += r.bytes;
            ++totals_.ops_completed;
            totals_.bytes_reduced += r.bytes;
        } else {
            ++g.ops_failed;
            ++totals_.ops_failed;
        }
        g.running.erase(rit);
        if (g.joined() == 0 && g.running.empty()) groups_.erase(git);
        return;
    }
}

void GroupTable::remap_hosts(const std::vector<uint32_t> &to) {
    auto remap = [&](std::vector<uint32_t> &v) {
        std::vector<uint32_t> hosts;
        for (uint32_t h : v)  // a host gone (an ended group's) is dropped
            if (h < to.size() && to[h] != UINT32_MAX) hosts.push_back(to[h]);
        v = std::move(hosts);
    };
    for (auto &[name, g] : groups_) remap(g.hosts);
    for (auto &f : failures_) remap(f.hosts);  // (held ones: take_failures)
}

void GroupTable::end_group(const std::string &group, const std::string &message, std::vector<Completion> &out) {
    auto git = groups_.find(group);
    if (git == groups_.end()) return;
    Group &g = git->second;
    while (!g.pending.empty()) {
        const uint64_t seq = g.pending.begin()->first;
        fail_seq(g, seq, -ECONNABORTED, "group " + g.name + " op " + std::to_string(seq) + ": " + message, out);
    }
    for (auto &[op_id, r] : g.running) {
        for (MemberId m : r.members) out.push_back({m, r.seq, -ECONNABORTED, "group " + g.name + " op " + std::to_string(r.seq) + ": " + message});
        ++g.ops_failed;
        ++totals_.ops_failed;
    }
    g.running.clear();
    if (g.broken.empty()) g.broken = message + "; every rank of the group must reconnect";
}

std::vector<std::pair<std::string, std::vector<uint32_t>>> GroupTable::group_hosts() const {
    std::vector<std::pair<std::string, std::vector<uint32_t>>> v;
    for (const auto &[name, g] : groups_) v.emplace_back(name, g.hosts);
    return v;
}

void GroupTable::fail_everything(const std::string &message, std::vector<Completion> &out) {
    for (auto &[name, g] : groups_) {
        while (!g.pending.empty()) fail_seq(g, g.pending.begin()->first, -ESHUTDOWN, message, out);
        for (auto &[op_id, r] : g.running) {
            for (MemberId m : r.members) out.push_back({m, r.seq, -ESHUTDOWN, message});
            ++g.ops_failed;
            ++totals_.ops_failed;
        }
        g.running.clear();
        if (g.broken.empty()) g.broken = message;
    }
    totals_.ops_failed += draining_.size();
    draining_.clear();
}

std::vector<MatchingOp> GroupTable::matching(Clock::time_point now) const {
    std::vector<MatchingOp> v;
    for (const auto &[name, g] : groups_)
        for (const auto &[seq, p] : g.pending) {
            MatchingOp m{name, seq, std::chrono::duration<double>(now - (p.deadline - g.op_timeout)).count(), g.local_size, {}};
            for (uint32_t r = 0; r < g.local_size; ++r)
                if (!p.by_rank[r]) m.missing_ranks.push_back(r);
            v.push_back(std::move(m));
        }
    return v;
}

std::vector<MatchingOp> GroupTable::running_on(const char *algorithm, Clock::time_point now) const {
    std::vector<MatchingOp> v;
    auto add = [&](const std::string &group, const Running &r) {
        if (std::string_view(r.algorithm) == algorithm)
            v.push_back({group, r.seq, std::chrono::duration<double>(now - r.submitted).count(), 0, {}});
    };
    for (const auto &[name, g] : groups_)
        for (const auto &[id, r] : g.running) add(name, r);
    for (const auto &[id, r] : draining_) add(r.group, r);
    return v;
}

std::vector<GroupSummary> GroupTable::summaries() const {
    std::vector<GroupSummary> v;
    for (const auto &[name, g] : groups_) {
        GroupSummary s;
        s.name = name;
        s.local_size = g.local_size;
        for (uint32_t r = 0; r < g.local_size; ++r)
            if (g.members[r]) s.joined_ranks.push_back(r);
        s.owner_uid = g.owner_uid;
        s.op_timeout_ms = static_cast<uint64_t>(g.op_timeout.count());
        s.hosts = g.hosts;
        s.broken = g.broken;
        s.ops_completed = g.ops_completed;
        s.ops_failed = g.ops_failed;
        s.bytes_reduced = g.bytes_reduced;
        s.pending_ops = g.pending.size();
        s.running_ops = g.running.size();
        v.push_back(std::move(s));
    }
    return v;
}

uint64_t GroupTable::local_id(const std::string &group) const {
    auto it = groups_.find(group);
    return it == groups_.end() ? 0 : it->second.local_id;
}

bool GroupTable::broken(const std::string &group) const {
    auto it = groups_.find(group);
    return it != groups_.end() && !it->second.broken.empty();
}

size_t GroupTable::running_ops() const {
    size_t n = draining_.size();
    for (const auto &[name, g] : groups_) n += g.running.size();
    return n;
}

}  // namespace ringd
