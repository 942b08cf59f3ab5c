// HostOps: every op of a multi-host group on this host, from the moment all its local ranks
// submitted it (GroupTable matched them) until its completion goes to the trainers. Each op is in
// exactly one state, each state has a deadline, and every way out of a state is a method here:
//
//   Queued     ready here (or failed here: a local failure still takes its place in the group's
//              sequence), in local order per group; waits for the group's incarnation to be agreed
//              and for its turn to be reported.               deadline: the op's (first submission
//                                                             + timeouts.op), then it fails here
//   Reported   the coordinator has this host's report; waits for OpStart (ring), every host's data
//              (one-/two-shot) or OpFail.                     deadline: the op's + kDecisionGrace
//   Running    a ring op on the progress thread.              deadline: the op's + kReleaseGrace,
//                                                             then its links are torn down
//   Releasing  its ring generation ended while it ran: it fails when the progress thread gives
//              it back, and not before (until then the engine or a peer's NIC may write its slots).
//
// Completed and failed ops leave the table; GroupTable::finished tells their trainers. Pure
// bookkeeping on the control thread: no I/O, the caller passes `now`; the daemon does the sending.
#pragma once

#include <functional>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "daemon/engine/group_table.h"
#include "daemon/engine/tuner.h"

namespace ringd {

class Slot;

using OpKey = std::tuple<std::string, uint64_t, uint64_t>;  // group, agreed incarnation, seq

enum class OpState { Queued, Reported, Running, Releasing };
const char *op_state_name(OpState s);

struct HostOp {
    OpRun run;
    std::vector<std::shared_ptr<Slot>> slots;
    int32_t status = 0;  // non-zero: failed on this host, queued only to be reported
    std::string message;
    Clock::time_point deadline;
    Algorithm algorithm = Algorithm::Ring;  // one-/two-shot, doubling, halving-doubling: completes here, by OpData
    OpState state = OpState::Queued;
    // Doubling, halving-doubling (reported to the coordinator only when needed): when this host
    // reports it if it has not completed by then, and whether it did.
    Clock::time_point stall_at{};
    bool told_coordinator = false;
    bool failed_malformed = false;  // a peer's one-shot message did not fit: this host failed the op
};

class HostOps {
public:
    // How long past its deadline a reported op waits for the coordinator's decision before this
    // host fails it itself (a coordinator that is gone or cut off), and a running ring op for the
    // progress thread before its links are torn down.
    static constexpr auto kDecisionGrace = std::chrono::seconds(1);
    static constexpr auto kReleaseGrace = std::chrono::seconds(2);

    HostOps(GroupTable &groups, std::vector<Completion> &done) : groups_(groups), done_(done) {}

    // -> Queued, in seq order within its group.
    void queue(HostOp op);
    // The groups with queued ops, and each one's next op to report (nullptr: none).
    std::vector<std::string> queued_groups() const;
    bool any_queued() const { return !queued_.empty(); }
    HostOp *next_queued(const std::string &group);
    // Queued -> out of the table (the caller reports or fails it).
    HostOp take_queued(const std::string &group);
    bool has_queued(const std::string &group) const;
    size_t queued_size(const std::string &group) const;

    // Queued -> Reported.
    HostOp &reported(const OpKey &key, HostOp op);
    HostOp *find_reported(const OpKey &key);
    template <typename F>
    void for_each_reported(F f) {
        for (auto &[key, op] : reported_) f(key, op);
    }
    // The lowest seq of incarnation `incarnation` of `group` that is Reported, Running or
    // Releasing here (not ended yet); UINT64_MAX: none.
    uint64_t lowest_held(const std::string &group, uint64_t incarnation) const;
    // Reported -> out of the table (started, decided, or completed by direct exchange).
    std::optional<HostOp> take_reported(const OpKey &key);

    // Reported -> Running: the ring op `key` (local op id `op_id`, first submitted at `submitted`)
    // went to the progress thread in ring generation `generation`.
    void running(uint64_t op_id, uint64_t generation, Clock::time_point deadline, const OpKey &key = {},
                 Clock::time_point submitted = {});
    // The progress thread gave a ring op back. `link_ended_ring`: it ended because its link
    // broke in the current generation (the generation's end will fail it naming the host at
    // fault, so it stays until then). Otherwise the op ends here with its result, or with the
    // reason of the generation that ended while it ran.
    void returned(uint64_t op_id, int32_t status, const std::string &message, bool link_ended_ring);

    // The ring generation ended with `reason`: Queued (ready) and Reported ops fail, Running ones
    // become Releasing (those given back already fail now).
    void generation_ended(const std::string &reason);

    // Every Queued op fails now with `why(op)` (the ring cannot form: a host of it is down).
    // Returns how many there were.
    size_t fail_queued(int32_t code, const std::function<std::string(const HostOp &)> &why);

    // Ops past their state's deadline. Queued and Reported ones fail with the message
    // `why(op, state)` gives; returns the Running ones overdue for release (the caller tears their
    // links down) and the keys of the Reported ones that failed (their exchange data goes).
    struct Expired {
        std::vector<uint64_t> overdue_running;
        std::vector<OpKey> reported;
    };
    template <typename Why>
    Expired expire(Clock::time_point now, Why why);

    struct Counts {
        size_t queued = 0, reported = 0, running = 0, releasing = 0;
    };
    Counts counts() const;
    // Every op in the table with its state and age (since its first local submission), for
    // `ringctl status`.
    struct View {
        std::string group;
        uint64_t incarnation = 0;  // agreed; 0 while queued
        uint64_t seq = 0;
        OpState state = OpState::Queued;
        Algorithm algorithm = Algorithm::Ring;
        double age_s = 0;
        bool failed_here = false;  // queued only to be reported as this host's failure
    };
    std::vector<View> view(Clock::time_point now) const;

private:
    struct Ring {
        uint64_t generation = 0;
        Clock::time_point deadline;
        OpState state = OpState::Running;
        bool held = false;       // back from the progress thread, waiting for its generation's end
        std::string end_reason;  // Releasing
        OpKey key;               // for view()
        Clock::time_point submitted;
    };

    GroupTable &groups_;
    std::vector<Completion> &done_;
    std::map<std::string, std::deque<HostOp>> queued_;  // by group, in local order
    std::map<OpKey, HostOp> reported_;
    std::map<uint64_t, Ring> ring_;  // Running and Releasing, by local op id
};

template <typename Why>
HostOps::Expired HostOps::expire(Clock::time_point now, Why why) {
    Expired out;
    for (auto it = reported_.begin(); it != reported_.end();) {
        if (it->second.deadline + kDecisionGrace > now) {
            ++it;
            continue;
        }
        groups_.finished(it->second.run.op_id, -ETIMEDOUT, why(it->second), done_);
        out.reported.push_back(it->first);
        it = reported_.erase(it);
    }
    for (auto it = queued_.begin(); it != queued_.end();) {
        auto &q = it->second;
        while (!q.empty() && q.front().deadline <= now) {
            if (q.front().status == 0) groups_.finished(q.front().run.op_id, -ETIMEDOUT, why(q.front()), done_);
            q.pop_front();
        }
        it = q.empty() ? queued_.erase(it) : std::next(it);
    }
    for (const auto &[op_id, r] : ring_)
        if (r.state == OpState::Running && !r.held && r.deadline + kReleaseGrace <= now) out.overdue_running.push_back(op_id);
    return out;
}

}  // namespace ringd
