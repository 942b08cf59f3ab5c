#include "daemon/engine/coordinator.h"

#include <algorithm>

#include "proto/types.h"

namespace ringd {
namespace {

constexpr size_t kDecidedMemory = 4096;
constexpr size_t kIncarnationMemory = 4096;

std::string describe(const proto::OpReport &r) {
    const auto c = static_cast<Collective>(r.collective);
    std::string s = std::to_string(r.count) + " x " + std::string(dtype_name(static_cast<DType>(r.dtype)));
    if (c == Collective::Barrier) return "barrier";
    if (collective_reduces(c)) s += " " + std::string(reduce_op_name(static_cast<ReduceOp>(r.op)));
    if (r.wire != 0) s += " over a " + std::string(wire_format_name(static_cast<WireFormat>(r.wire))) + " wire";
    if (collective_is_rooted(c)) s += (c == Collective::Broadcast ? " from rank " : " to rank ") + std::to_string(r.root);
    return c == Collective::Allreduce ? s : std::string(collective_name(c)) + " of " + s;
}

std::string at(const std::string &group, uint64_t seq) { return "group " + group + " op " + std::to_string(seq) + ": "; }

}  // namespace

void Coordinator::reset(uint64_t generation, std::vector<uint64_t> instances, bool solo) {
    generation_ = generation;
    solo_ = solo && lanes_ >= 2;
    // An incarnation that goes on in a generation without solo lanes has its ops started here.
    if (!solo_)
        for (auto &[id, inc] : incarnations_) inc.solo_epoch = 0;
    instances_ = std::move(instances);
    instances_.resize(hosts_.size(), 0);
    for (auto &[id, inc] : incarnations_) {
        // An end spares ops only in its generation: its solo lane is nobody's in the next (place).
        if (inc.end_code != 0) inc.ended_at = Clock::time_point{};
        if (inc.end_code != 0) continue;
        for (uint32_t h = 0; h < inc.instances.size() && h < hosts_.size(); ++h) {
            if (inc.instances[h] == 0 || instances_[h] == 0 || inc.instances[h] == instances_[h]) continue;
            inc.end_code = -ECONNABORTED;
            inc.end_message = "group " + inc.group + ": the ringd of host " + hosts_[h] +
                              " restarted since this run of the group began (its ranks there are gone); every rank of "
                              "the job must restart";
            break;
        }
    }
    next_op_id_ = 1;
    pending_.clear();
    decided_.clear();
    decided_order_.clear();
    for (auto &[name, run] : groups_) run.joins.clear();
    for (auto &[id, inc] : incarnations_) inc.max_seq.assign(hosts_.size(), 0);
}

Coordinator::Incarnation *Coordinator::find(uint64_t incarnation) {
    auto it = incarnations_.find(incarnation);
    return it == incarnations_.end() ? nullptr : &it->second;
}

void Coordinator::refuse(uint32_t host, const std::string &group, uint64_t local_id, const std::string &why,
                         Decisions &out) {
    out.groups.push_back({host, {generation_, group, local_id, 0, -ECONNABORTED, why}});
}

void Coordinator::join(uint32_t host, const proto::GroupJoin &j, Decisions &out) {
    if (j.generation != generation_ || host >= hosts_.size()) return;
    const uint32_t n = static_cast<uint32_t>(hosts_.size());
    GroupRun &run = groups_[j.group];
    run.joins.resize(n);
    if (j.previous == proto::kIncarnationEnds) {
        // Its ranks left before it was agreed: forgotten, or, agreed meanwhile, ended.
        if (run.joins[host] && run.joins[host]->local_id == j.local_id) run.joins[host].reset();
        if (Incarnation *cur = find(run.current); cur && cur->end_code == 0 && cur->local_ids[host] == j.local_id)
            end(run.current, -ECONNABORTED, "group " + j.group + ": the ranks of host " + hosts_[host] + " left", out);
        return;
    }
    if (Incarnation *cur = find(run.current); cur && cur->end_code == 0) {
        if (cur->local_ids[host] == j.local_id) {
            // Part of it already (a repeat, or a new ring generation of the same coordinator):
            // the same incarnation goes on, in the same lane.
            out.groups.push_back({host, answer(host, j.group, j.local_id, run.current)});
            return;
        }
        if (cur->local_ids[host] != j.local_id)
            end(run.current, -ECONNABORTED,
                "group " + j.group + ": host " + hosts_[host] +
                    " started it anew (its ranks restarted); every rank of the job must restart",
                out);
    }
    if (j.previous != 0) {
        if (const Incarnation *prev = find(j.previous); prev && prev->end_code != 0)
            return refuse(host, j.group, j.local_id, prev->end_message, out);
    }
    run.joins[host] = Join{j.local_id, j.previous, j.local_size, j.group_ranks, j.ranks};
    // All fresh, or all going on with the same incarnation; a host that goes on while another
    // started afresh still runs what the others left.
    std::optional<uint32_t> fresh;
    for (uint32_t h = 0; h < n; ++h)
        if (run.joins[h] && run.joins[h]->previous == 0) fresh = h;
    for (uint32_t h = 0; h < n; ++h) {
        if (!run.joins[h] || run.joins[h]->previous == 0) continue;
        const bool differs = run.joins[host]->previous != 0 && run.joins[host]->previous != run.joins[h]->previous;
        if (!fresh && !differs) continue;
        refuse(h, j.group, run.joins[h]->local_id,
               "group " + j.group + ": " +
                   (fresh ? "host " + hosts_[*fresh] + " started a new incarnation of the group (its ranks restarted)"
                          : std::string("the hosts ran different incarnations of the group")) +
                   " while this host's ranks still run an earlier one; every rank of the job must restart",
               out);
        run.joins[h].reset();
    }
    for (const auto &jn : run.joins)
        if (!jn) return;
    // Ranks two hosts both claim, or a group size they disagree on: the job is wrong everywhere.
    auto [host_ranks, disagree] = rank_map(j.group, run);
    if (!disagree.empty()) {
        for (uint32_t h = 0; h < n; ++h) refuse(h, j.group, run.joins[h]->local_id, disagree, out);
        run.joins.assign(n, std::nullopt);
        return;
    }
    // Every host joined alike: the agreed incarnation, unique in the cluster (generations only grow).
    const uint64_t id = (generation_ << 24) | (next_incarnation_++ & 0xffffff);
    Incarnation inc;
    inc.group = j.group;
    inc.max_seq.assign(n, 0);
    inc.instances = instances_;
    bool sizes_known = true;
    for (uint32_t h = 0; h < n; ++h) {
        inc.local_ids.push_back(run.joins[h]->local_id);
        inc.total_ranks += run.joins[h]->local_size;
        sizes_known &= run.joins[h]->local_size != 0;
    }
    if (!sizes_known) inc.total_ranks = 0;
    inc.host_ranks = std::move(host_ranks);
    place(inc, j.group);
    run.current = id;
    incarnations_[id] = std::move(inc);
    for (uint32_t h = 0; h < n; ++h) out.groups.push_back({h, answer(h, j.group, run.joins[h]->local_id, id)});
    run.joins.assign(n, std::nullopt);
    incarnation_order_.push_back(id);
    while (incarnation_order_.size() > kIncarnationMemory) {
        const uint64_t old = incarnation_order_.front();
        incarnation_order_.pop_front();
        auto it = incarnations_.find(old);
        if (it == incarnations_.end()) continue;
        if (auto g = groups_.find(it->second.group); g != groups_.end() && g->second.current == old) groups_.erase(g);
        incarnations_.erase(it);
    }
}

void Coordinator::place(Incarnation &inc, const std::string &group) {
    // What the other groups' running incarnations use.
    std::vector<uint32_t> use(lanes_, 0);
    std::vector<bool> solo_taken(lanes_, false);
    for (const auto &[name, g] : groups_) {
        if (name == group || !g.current) continue;
        const Incarnation *other = find(g.current);
        if (!other) continue;
        if (other->end_code != 0) {
            // Ended, but hosts may still post the ops its end spared on its solo lane: the lane
            // is not granted again until every host ended it too, or timeouts.op passed.
            const bool all = other->ended_by.size() == hosts_.size() &&
                             std::all_of(other->ended_by.begin(), other->ended_by.end(), [](bool b) { return b; });
            const auto hold = timeout_of_ ? timeout_of_(other->group) : op_timeout_;  // (the group's timeouts.op)
            if (other->solo_epoch && other->end_after > 0 && !all && other->ended_at != Clock::time_point{} &&
                Clock::now() < other->ended_at + hold)
                solo_taken[other->lane % lanes_] = true;
            continue;
        }
        ++use[other->lane % lanes_];
        if (other->solo_epoch) solo_taken[other->lane % lanes_] = true;
    }
    inc.solo_epoch = 0;
    if (solo_ && inc.total_ranks) {
        for (uint32_t l = 0; l + 1 < lanes_; ++l) {
            if (solo_taken[l] || use[l]) continue;
            inc.lane = l;
            solo_epoch_.resize(lanes_, 0);
            solo_epoch_[l] = solo_epoch_[l] % 127 + 1;
            inc.solo_epoch = solo_epoch_[l];
            return;
        }
    }
    // Shared: the lane the fewest of them use (the lowest of those), never one that an
    // incarnation has alone; with solo lanes, the last lane.
    uint32_t best = solo_ ? lanes_ - 1 : 0;
    if (!solo_)
        for (uint32_t l = 1; l < lanes_; ++l)
            if (use[l] < use[best]) best = l;
    inc.lane = best;
}

proto::GroupIncarnation Coordinator::answer(uint32_t host, const std::string &group, uint64_t local_id, uint64_t id) const {
    (void)host;
    proto::GroupIncarnation g{generation_, group, local_id, id, 0, {}};
    auto it = incarnations_.find(id);
    if (it == incarnations_.end()) return g;
    if (it->second.solo_epoch) {
        g.lane = it->second.lane;
        g.solo_epoch = it->second.solo_epoch;
        g.total_ranks = it->second.total_ranks;
    }
    g.host_ranks = it->second.host_ranks;
    return g;
}

std::pair<std::vector<std::vector<uint32_t>>, std::string> Coordinator::rank_map(const std::string &group,
                                                                                 const GroupRun &run) const {
    std::vector<std::vector<uint32_t>> map;
    for (const auto &jn : run.joins)
        if (jn->ranks.empty()) return {};  // not said everywhere: allreduce only
    const uint32_t size = run.joins[0]->group_ranks;
    std::vector<int64_t> where(size, -1);  // the host of each rank
    uint64_t total = 0;
    for (uint32_t h = 0; h < run.joins.size(); ++h) {
        const Join &jn = *run.joins[h];
        if (jn.group_ranks != size)
            return {{}, "group " + group + ": host " + hosts_[0] + "'s trainers say a group of " + std::to_string(size) +
                            " ranks, host " + hosts_[h] + "'s of " + std::to_string(jn.group_ranks) +
                            "; every rank of the job must say the same group size"};
        for (uint32_t r : jn.ranks) {
            if (r >= size) return {{}, "group " + group + ": host " + hosts_[h] + " says rank " + std::to_string(r) +
                                           " of a group of " + std::to_string(size)};
            if (where[r] >= 0)
                return {{}, "group " + group + ": rank " + std::to_string(r) + " is said by trainers on host " +
                                hosts_[static_cast<size_t>(where[r])] + " and on host " + hosts_[h] +
                                "; each rank of the job must be one trainer"};
            where[r] = h;
        }
        total += jn.ranks.size();
        map.push_back(jn.ranks);
    }
    if (total != size) {
        uint32_t missing = 0;
        while (missing < size && where[missing] >= 0) ++missing;
        return {{}, "group " + group + ": its trainers say a group of " + std::to_string(size) + " ranks, but its hosts have " +
                        std::to_string(total) + " (rank " + std::to_string(missing) + " is on none of them)"};
    }
    return {std::move(map), {}};
}

void Coordinator::decide(const Key &k, std::optional<std::pair<int32_t, std::string>> failure) {
    pending_.erase(k);
    decided_[k] = std::move(failure);
    decided_order_.push_back(k);
    while (decided_order_.size() > kDecidedMemory) {
        decided_.erase(decided_order_.front());
        decided_order_.pop_front();
    }
}

// Every host hears of the failure: those that did not report the op yet keep it for when
// they get there (a one- or two-shot op must not complete there with the data that came in
// meanwhile), and one that reports it later gets it again.
void Coordinator::fail(const Key &k, int32_t code, const std::string &message, Decisions &out) {
    const auto &[group, incarnation, seq] = k;
    for (uint32_t h = 0; h < hosts_.size(); ++h) out.fails.push_back({h, {generation_, group, seq, code, message, incarnation}});
    decide(k, std::pair{code, message});
}

void Coordinator::end(uint64_t incarnation, int32_t code, const std::string &message, Decisions &out, uint64_t after,
                      int host) {
    Incarnation *inc = find(incarnation);
    if (!inc) return;
    if (host >= 0 && static_cast<size_t>(host) < hosts_.size()) {
        inc->ended_by.resize(hosts_.size(), false);
        inc->ended_by[static_cast<size_t>(host)] = true;
    }
    if (inc->end_code != 0 && after >= inc->end_after) return;
    if (inc->end_code == 0) inc->ended_at = Clock::now();
    // The latest end that fails ops names its host: they fail because of it (the first end spared
    // them), and so do the later ones, which it fails too.
    inc->end_code = code;
    inc->end_message = message;
    inc->end_after = after;
    const std::string group = inc->group;
    auto lo = pending_.lower_bound(Key{group, incarnation, after + 1});
    std::vector<Key> doomed;
    for (auto it = lo; it != pending_.end() && std::get<0>(it->first) == group && std::get<1>(it->first) == incarnation; ++it)
        doomed.push_back(it->first);
    for (const Key &k : doomed) fail(k, code, message, out);
    // A solo lane's hosts start its ops without reporting them: every host hears of the end at once
    // (an OpFail of seq kIncarnationEnds, again when a later end spares fewer), and cancels what it
    // runs of it past `after`.
    if (inc->solo_epoch)
        for (uint32_t h = 0; h < hosts_.size(); ++h) {
            proto::OpFail f{generation_, group, proto::kIncarnationEnds, code, message, incarnation};
            f.after = after;
            out.fails.push_back({h, std::move(f)});
        }
}

// Ops of the incarnation that a host is past (it reported a later seq, so it failed them
// before the coordinator heard of them: in an earlier generation) cannot complete.
void Coordinator::fail_skipped(const Key &k, Decisions &out) {
    const auto &[group, incarnation, seq] = k;
    const Incarnation *inc = find(incarnation);
    if (!inc) return;
    std::vector<std::pair<Key, uint32_t>> doomed;
    for (auto it = pending_.lower_bound(Key{group, incarnation, 0});
         it != pending_.end() && std::get<0>(it->first) == group && std::get<1>(it->first) == incarnation; ++it) {
        if (it->second.deferred) continue;  // the hosts that did not report it may have completed it
        for (uint32_t h = 0; h < hosts_.size(); ++h) {
            if (it->second.by_host[h] || inc->max_seq[h] <= std::get<2>(it->first)) continue;
            doomed.emplace_back(it->first, h);
            break;
        }
    }
    for (const auto &[d, h] : doomed)
        fail(d, -ECONNABORTED,
             at(group, std::get<2>(d)) + "host " + hosts_[h] +
                 " is past it (the op failed there before this ring generation)",
             out);
}

void Coordinator::report(uint32_t host, const proto::OpReport &r, Clock::time_point now, Decisions &out) {
    if (r.generation != generation_ || host >= hosts_.size()) return;  // from a generation that is over
    Incarnation *inc = find(r.incarnation);
    if (!inc || inc->group != r.group || inc->local_ids.size() != hosts_.size()) return;  // never agreed: stale
    const Key k{r.group, r.incarnation, r.seq};
    if (r.seq == proto::kIncarnationEnds) {
        if (r.status != 0) end(r.incarnation, r.status, r.message, out, r.count ? r.count - 1 : 0, static_cast<int>(host));
        return;
    }
    auto fail_to_host = [&](int32_t code, const std::string &message) {
        out.fails.push_back({host, {generation_, r.group, r.seq, code, message, r.incarnation}});
    };
    if (auto d = decided_.find(k); d != decided_.end()) {
        if (d->second) fail_to_host(d->second->first, d->second->second);
        return;
    }
    if (inc->end_code != 0 && r.seq > inc->end_after) {
        fail_to_host(inc->end_code, at(r.group, r.seq) + inc->end_message);
        decide(k, std::pair{inc->end_code, at(r.group, r.seq) + inc->end_message});
        return;
    }
    if (r.flags & proto::kReportAhead) {
        // A bound on the reporting host failed an op it has not reached: every host hears of it,
        // but its progress (max_seq) is not this seq.
        pending_.erase(k);
        fail(k, r.status, r.message, out);
        return;
    }
    const bool deferred = (r.flags & proto::kReportDeferred) != 0;
    if (r.flags & proto::kReportDone) {
        // A doubling/halving-doubling op completed on a host: every host contributed to it.
        pending_.erase(k);
        decide(k, std::nullopt);
        return;
    }
    // A deferred report says nothing of how far the hosts that sent none got (they may be past
    // the op, having completed it): it is not the reporting host's progress either, since that
    // host reported none of the ops before it that completed.
    if (r.seq > inc->max_seq[host] && !deferred) inc->max_seq[host] = r.seq;
    if (r.status != 0) {
        auto [it, fresh] = pending_.try_emplace(k);
        if (fresh) it->second.by_host.resize(hosts_.size());
        it->second.by_host[host] = r;
        fail(k, r.status, r.message, out);
        fail_skipped(k, out);
        return;
    }
    auto [it, fresh] = pending_.try_emplace(k);
    Pending &p = it->second;
    if (fresh) {
        p.by_host.resize(hosts_.size());
        p.deadline = now + op_timeout_;
    }
    p.deferred |= deferred;
    if (p.by_host[host]) return;  // duplicate
    // Decided by the earliest deadline of the hosts that submitted it.
    p.deadline = std::min(p.deadline, now + std::chrono::milliseconds(r.remaining_ms));
    for (size_t h = 0; h < hosts_.size(); ++h) {
        if (!p.by_host[h]) continue;
        // Named in ring order, whichever came first.
        const bool first = h < host;
        const proto::OpReport &a = first ? *p.by_host[h] : r, &b = first ? r : *p.by_host[h];
        const std::string &an = hosts_[first ? h : host], &bn = hosts_[first ? host : h];
        if (a.count != b.count || a.dtype != b.dtype || a.op != b.op || a.collective != b.collective || a.root != b.root ||
            a.wire != b.wire)
            return fail(k, -EINVAL,
                        at(r.group, r.seq) + "mismatch: host " + an + " submitted " + describe(a) + ", host " + bn +
                            " submitted " + describe(b),
                        out);
        if (a.algorithm != b.algorithm)  // same op, different tuning.* on the two hosts
            return fail(k, -EINVAL,
                        at(r.group, r.seq) + "hosts " + an + " and " + bn +
                            " chose different algorithms (their tuning settings differ)",
                        out);
        break;
    }
    p.by_host[host] = r;
    fail_skipped(k, out);
    auto again = pending_.find(k);
    if (again == pending_.end()) return;  // a host is past it
    uint32_t total = 0;
    for (const auto &b : again->second.by_host) {
        if (!b) return;
        total += b->local_size;
    }
    // A one- or two-shot op completes on every host by itself; a ring op starts now, in this order.
    // A solo lane's op that stalls on every host stays pending: it fails at its deadline (every
    // host cancels it), unless a host says it completed.
    if (r.algorithm == 0 && again->second.deferred) return;
    if (r.algorithm == 0) {
        const Incarnation *inc = find(r.incarnation);
        out.starts.push_back({generation_, r.group, r.seq, next_op_id_++, total, r.incarnation, inc ? inc->lane : 0});
    }
    decide(k, std::nullopt);
}

void Coordinator::expire(Clock::time_point now, Decisions &out) {
    std::vector<Key> late;
    for (const auto &[k, p] : pending_)
        if (p.deadline <= now) late.push_back(k);
    for (const Key &k : late) {
        std::string missing;
        for (size_t h = 0; h < hosts_.size(); ++h)
            if (!pending_[k].by_host[h]) missing += (missing.empty() ? "" : ", ") + hosts_[h];
        fail(k, -ETIMEDOUT,
             "group " + std::get<0>(k) + " op " + std::to_string(std::get<2>(k)) + " timed out after " +
                 std::to_string((timeout_of_ ? timeout_of_(std::get<0>(k)) : op_timeout_).count()) + " ms: " +
                 (missing.empty() ? std::string("every host ran it, and its data stopped moving")
                                  : "host(s) " + missing + " did not submit it"),
             out);
    }
}

std::vector<Coordinator::PendingView> Coordinator::pending_view(Clock::time_point now) const {
    std::vector<PendingView> v;
    for (const auto &[key, p] : pending_) {
        PendingView pv{std::get<0>(key), std::get<1>(key), std::get<2>(key), {}, {},
                       std::chrono::duration<double>(p.deadline - now).count()};
        for (uint32_t h = 0; h < p.by_host.size(); ++h) (p.by_host[h] ? pv.reported : pv.missing).push_back(h);
        v.push_back(std::move(pv));
    }
    return v;
}

std::vector<Coordinator::JoinView> Coordinator::joins_view() const {
    std::vector<JoinView> v;
    for (const auto &[group, run] : groups_) {
        JoinView jv{group, {}, {}};
        for (uint32_t h = 0; h < run.joins.size(); ++h) (run.joins[h] ? jv.joined : jv.missing).push_back(h);
        if (!jv.joined.empty() && !jv.missing.empty()) v.push_back(std::move(jv));
    }
    return v;
}

}  // namespace ringd
