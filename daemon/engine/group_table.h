// GroupTable: which local ranks form which group, and the matching of their submissions.
// An op of a group starts when every local rank submitted the same sequence number with the
// same count, dtype and op; anything else ends in an error delivered to every rank involved.
//
// Pure bookkeeping: no I/O, no clock of its own (the caller passes `now`), so it is unit-tested
// directly. Called by the control thread only. Outputs are appended to the caller's vectors:
// Completion = "tell member M that its op `seq` ended with status/message"; OpRun = "start this".
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/status/op_metrics.h"
#include "proto/result.h"
#include "proto/slot.h"

namespace ringd {

using MemberId = uint32_t;
using Clock = std::chrono::steady_clock;

struct Completion {
    MemberId member = 0;
    uint64_t seq = 0;
    int32_t status = 0;
    std::string message;
};

struct OpRun {
    uint64_t op_id = 0;
    std::string group;
    uint64_t local_id = 0;  // the group's incarnation on this host (GroupTable::local_id)
    uint64_t seq = 0;
    OpDesc desc;
    std::vector<MemberId> members;  // index = local rank
    std::vector<uint64_t> offsets;  // index = local rank: the input (allreduce: in and out)
    std::vector<uint64_t> out_offsets;  // index = local rank: the output
    // reduce_scatter, allgather: each local rank's rank in the group (as its trainer numbered it).
    std::vector<uint32_t> ranks;
    // all_to_all with split sizes: each local rank's (Submission::splits); empty otherwise.
    std::vector<std::shared_ptr<const std::vector<uint64_t>>> splits;
    // Error feedback for a compressed op: the residual's key (the lowest local rank's that asked).
    bool feedback = false;
    uint64_t feedback_tag = 0;
    Clock::time_point deadline;     // the first local rank's submission + timeouts.op
    Clock::time_point submitted;    // the first local rank's submission
};

// An op of a group that ended on this host before it could start (mismatch between local
// ranks, timeout, an invalid submission, a rank that left, a refused op of a broken group).
// Across hosts every such op still takes its place in the group's sequence of ops.
struct LocalFailure {
    std::string group;
    uint64_t local_id = 0;
    uint64_t seq = 0;  // proto::kIncarnationEnds: every later op of this incarnation fails too
    int32_t code = 0;
    std::string message;
    std::vector<uint32_t> hosts;  // the incarnation's hosts (its ring domain), as hosts_of() gave them
};

// An op waiting for this host's local ranks (what `ringctl status` shows of a stall).
struct MatchingOp {
    std::string group;
    uint64_t seq = 0;
    double age_s = 0;  // since its first local submission
    uint32_t local_size = 0;
    std::vector<uint32_t> missing_ranks;  // local ranks that have not submitted it
};

// A trainer's rank in its group as the caller numbers them (torch's rank in its process group);
// ranks 0: not said (the group then runs allreduce only).
struct GroupRank {
    uint32_t rank = 0;
    uint32_t ranks = 0;
};

struct GroupSummary {
    std::string name;
    uint32_t local_size = 0;
    std::vector<uint32_t> joined_ranks;
    uint32_t owner_uid = 0;  // the uid of its first member
    uint64_t op_timeout_ms = 0;  // its ops' deadline from their first submission here
    std::vector<uint32_t> hosts;  // config indices, ring order; empty: every host
    std::string broken;  // why the group refuses ops, empty when healthy
    uint64_t ops_completed = 0;
    uint64_t ops_failed = 0;
    uint64_t bytes_reduced = 0;
    size_t pending_ops = 0;
    size_t running_ops = 0;
};

class GroupTable {
public:
    // Local incarnations are numbered from `first_local_id` (random per daemon start, so that a
    // restarted daemon never reuses one).
    explicit GroupTable(std::string host, std::chrono::milliseconds op_timeout, uint64_t first_local_id = 1)
        : host_(std::move(host)), op_timeout_(op_timeout), next_local_id_(first_local_id | 1) {}

    // A group belongs to the uid of its first member while it has members: another uid's join
    // is refused (EACCES, naming the owner); root (uid 0) may join any group.
    // `hosts`: the group's hosts (config indices in ring order) its first member declared; the
    // caller checks later members against hosts_of(). Empty: every host.
    // `op_timeout`: the group's (0: the table's default, timeouts.op), the same for every local
    // rank: every op of the group fails within it of its first local submission.
    // `every_host`: the first member named no hosts (every host of the ring then): a reload that
    // adds hosts leaves the group's hosts as they were (its run was agreed over them), and a
    // later member that names none joins it there (every_host()).
    // `group_rank`: the trainer's rank in the group; every local rank says it or none does, each a
    // rank of its own, all of a group of the same size.
    Status join(MemberId id, const std::string &group, uint32_t local_rank, uint32_t local_size, uint32_t uid,
                std::vector<uint32_t> hosts = {}, std::chrono::milliseconds op_timeout = {}, bool every_host = false,
                GroupRank group_rank = {});
    // The group's ranks of its local ranks (index: local rank) and the group's size, once every
    // local rank joined and said its rank; null otherwise.
    // The member's rank in its group as its trainer said it (0 where it said none, or is no member).
    uint32_t member_rank(MemberId id) const;
    const std::vector<uint32_t> *group_ranks(const std::string &group, uint32_t *ranks) const;
    // Whether the group's trainers say their ranks and some of its local ranks have not joined
    // yet: its hosts' agreement waits for them (the rank map needs every one).
    bool awaiting_ranks(const std::string &group) const;
    // Why a reduce_scatter or allgather cannot run in member `id`'s group as described (the group
    // said no ranks, or another count of them), or "": what submit() checks first. The gateway
    // asks before it stages a device op in, whose copies are one per rank.
    std::string collective_refused(MemberId id, const proto::Submission &s) const;
    bool every_host(const std::string &group) const;
    // The group's op timeout here (the default when there is no such group).
    std::chrono::milliseconds op_timeout(const std::string &group) const;
    // The hosts the group's first member declared, or null when there is no such group here.
    const std::vector<uint32_t> *hosts_of(const std::string &group) const;
    void submit(MemberId id, const proto::Submission &s, Clock::time_point now, std::vector<Completion> &out,
                std::vector<OpRun> &ready);
    // The member's submission of `seq` was invalid (it gets `why`), or (`refused`) the member
    // refused the op, `why` saying why (it gets the group's message); the group's other ranks get
    // an error naming it for that seq (now, or when they submit it), and so do the other hosts'
    // (take_failures).
    void reject(MemberId id, uint64_t seq, int32_t code, const std::string &why, std::vector<Completion> &out,
                bool refused = false);
    // The member disconnected: every pending or running op of its group fails with
    // "host H local rank R left", and the group refuses new ops until all its ranks are gone.
    // Then the name is free at once: the next join starts a new incarnation, while the old one's
    // running ops finish on their own.
    void leave(MemberId id, std::vector<Completion> &out);
    // Pending ops whose deadline passed fail on every rank that submitted them.
    void expire(Clock::time_point now, std::vector<Completion> &out);
    // Earliest deadline of any pending op, for the caller's timer.
    std::optional<Clock::time_point> next_deadline() const;
    // The engine finished op_id. Success is reported only if the group did not break meanwhile.
    // `now` times the op for the metrics (its first local submission to now).
    void finished(uint64_t op_id, int32_t status, const std::string &message, std::vector<Completion> &out,
                  Clock::time_point now = Clock::now());
    // The path a running op takes ("local", "ring", "one-shot", "two-shot"), for the metrics; an
    // op that ends without one counts as "none".
    void set_algorithm(uint64_t op_id, const char *algorithm);
    const OpMetrics &op_metrics() const { return metrics_; }
    // Shutdown: every pending and running op fails with `message`.
    void fail_everything(const std::string &message, std::vector<Completion> &out);
    // A reload changed the host list (Daemon::apply_hosts). remap_hosts: every group's hosts as
    // indices into the new list (`to[i]`: old index i's new one, UINT32_MAX: gone, dropped from
    // the group's hosts; the caller ends the groups that had one). end_group: the group's pending and running ops (their ring
    // domain is gone, its progress thread stopped) fail with `message`, and it refuses new ops
    // until its ranks reconnect, as after a departure.
    void remap_hosts(const std::vector<uint32_t> &to);
    void end_group(const std::string &group, const std::string &message, std::vector<Completion> &out);
    // Every group here with its hosts (config indices; empty: every host).
    std::vector<std::pair<std::string, std::vector<uint32_t>>> group_hosts() const;

    std::vector<GroupSummary> summaries() const;
    std::vector<MatchingOp> matching(Clock::time_point now) const;
    // Started ops that take `algorithm` (e.g. "local": on this host's progress thread), with
    // their age, for status and the metrics.
    std::vector<MatchingOp> running_on(const char *algorithm, Clock::time_point now) const;
    struct Totals {
        uint64_t ops_completed = 0, ops_failed = 0, bytes_reduced = 0;
    };
    const Totals &totals() const { return totals_; }
    // Whether join() would accept this member, without joining.
    Status check_join(const std::string &group, uint32_t local_rank, uint32_t local_size, uint32_t uid,
                      std::chrono::milliseconds op_timeout = {}, GroupRank group_rank = {}) const;
    size_t running_ops() const;
    // The local incarnation of a group with this name now; 0 when there is none.
    uint64_t local_id(const std::string &group) const;
    // Whether a rank of the group's local incarnation left (it refuses ops until all are gone).
    bool broken(const std::string &group) const;
    // Calls f(name, local incarnation) for every group there is now (f must not change the table).
    // The local ranks a group has on this host (0: no such group).
    uint32_t local_size(const std::string &group) const {
        auto it = groups_.find(group);
        return it == groups_.end() ? 0 : it->second.local_size;
    }
    template <class F>
    void for_each_local_id(F &&f) const {
        for (const auto &[name, g] : groups_) f(name, g.local_id);
    }
    // Ops that failed locally since the last call, in the order they failed — each once no lower
    // seq of its incarnation waits for a local rank here any more (it became ready or failed
    // here), so that the other hosts hear of it after this host's earlier ops: a failure reported
    // first would put this host past them (the coordinator then fails them as skipped, a solo
    // lane raises its floor over them). Held ones come at a later call.
    std::vector<LocalFailure> take_failures();

private:
    struct Pending {
        std::vector<std::optional<proto::Submission>> by_rank;
        uint32_t submitted = 0;
        Clock::time_point deadline;
    };
    struct Running {
        uint64_t seq = 0;
        uint64_t bytes = 0;
        std::vector<MemberId> members;
        std::string failure;  // set when the group broke while the op ran
        std::string group;               // set when it drains (its group is gone then)
        const char *algorithm = "none";  // set_algorithm()
        Clock::time_point submitted;     // its first local submission
    };
    // An op that already failed; ranks that submit it late get the same error.
    struct Failed {
        std::string message;
        std::vector<bool> told;  // by rank
        int32_t code = -EIO;     // what the ranks that submit it later get (EIO for a timed-out op)
    };
    struct Group {
        std::string name;
        uint64_t local_id = 0;
        uint32_t local_size = 0;
        uint32_t owner_uid = 0;
        std::chrono::milliseconds op_timeout{};
        std::vector<uint32_t> hosts;
        bool every_host = false;
        std::vector<std::optional<MemberId>> members;  // by rank
        uint32_t group_ranks = 0;                      // the group's size as its trainers said it; 0: not said
        std::vector<uint32_t> ranks;                   // by local rank: its group rank (group_ranks != 0)
        std::string broken;
        std::map<uint64_t, Pending> pending;  // by seq
        std::map<uint64_t, Running> running;  // by op id
        std::map<uint64_t, Failed> failed;    // by seq
        std::deque<uint64_t> failed_order;
        uint64_t ops_completed = 0, ops_failed = 0, bytes_reduced = 0;
        uint64_t last_refused_seq = 0;  // a broken group's refusals count once per seq
        size_t joined() const;
    };
    struct MemberInfo {
        std::string group;
        uint32_t local_rank = 0;
    };

    static std::string ranks_refused(const Group &g, const OpDesc &d);
    void fail_seq(Group &g, uint64_t seq, int32_t code, const std::string &message, std::vector<Completion> &out);
    void count_failed_unstarted(const Group &g) { metrics_.ended(g.name, "none", false, 0, -1, Clock::now()); }
    void count_ended(const std::string &group, const Running &r, bool ok, Clock::time_point now);
    std::string who(uint32_t rank) const { return "host " + host_ + " local rank " + std::to_string(rank); }

    std::string host_;
    std::chrono::milliseconds op_timeout_;
    std::map<std::string, Group> groups_;
    // Running ops of incarnations whose ranks all left (by op id): they end as the engine or
    // the cluster finishes them, as failures.
    std::map<uint64_t, Running> draining_;
    std::map<MemberId, MemberInfo> members_;
    uint64_t next_op_id_ = 1;
    uint64_t next_local_id_ = 1;
    Totals totals_;
    OpMetrics metrics_;
    std::vector<LocalFailure> failures_;
};

}  // namespace ringd
