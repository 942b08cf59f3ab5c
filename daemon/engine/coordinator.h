// Coordinator: agrees on group incarnations and matches the op reports of every host of the ring
// (it runs on the first host in ring order).
//
// Incarnations: each host joins a group's run with its local incarnation (GroupJoin: a fresh one,
// or the agreed incarnation it ran as before this ring generation). Once every host joined — all
// fresh (a job that started or restarted everywhere) or all with the same earlier incarnation (a
// job that goes on after the ring re-formed) — the coordinator gives the run a cluster-unique
// incarnation and tells every host. A host that still runs an earlier incarnation while another
// started afresh (a job restarted on some hosts only) is refused; a host that starts a new
// incarnation while one is agreed ends that one. Nothing of one incarnation pairs with another.
//
// Ops: reports are matched by (group, incarnation, seq) and decided OpStart (all hosts ready,
// same count/dtype/op) or OpFail (a host's local failure, a mismatch naming both hosts, hosts
// that did not report within timeouts.op, named, a host that is past the op, an incarnation that
// ended). Starts go to every host in one order, which is the order every host's progress thread
// runs ring ops in — so no two hosts ever wait on each other's different ops. Fails go to every
// host, and again to one that reports the op later. Each agreed incarnation gets a lane
// (OpStart::lane), the least used by the groups' current incarnations: lanes run side by side on
// every host, each in this order. With solo lanes (reset) the first lanes - 1 incarnations running
// at once get one each to themselves (GroupIncarnation::solo_epoch): their ring ops are started by
// every host on its own and reported only when they stall (deferred, algorithm 0), and no OpStart
// goes out for them. Ops that skip the ring (reports
// with an `algorithm`: one-shot or two-shot) need no start: when all hosts reported them alike
// they are decided silently. Doubling and halving-doubling ops (protocol 8) are reported only by
// hosts where they stall or meet a partner's data that does not match (kReportDeferred): most never
// reach the coordinator; one that does is failed like any (mismatch, timeout naming the hosts
// that did not report), or forgotten when a host says it completed (kReportDone).
//
// Pure bookkeeping (no I/O, the caller passes `now`), called by the control thread.
#pragma once

#include <chrono>
#include <functional>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/fd_io.h"
#include "proto/peer.h"

namespace ringd {

class Coordinator {
public:
    // `lanes` (tuning.lanes): each agreed incarnation runs its ring ops in one of them, the one
    // fewest running incarnations use, so that groups of the same hosts run side by side.
    // `op_timeout`: the longest an op waits for every host's report (timeouts.op_max): each
    // report carries what is left of its host's deadline (the group's op timeout from its first
    // submission there), and the earliest decides. `timeout_of` names a group's op timeout in the
    // timeout's message (none: op_timeout).
    using TimeoutOf = std::function<std::chrono::milliseconds(const std::string &group)>;
    Coordinator(std::vector<std::string> hosts, std::chrono::milliseconds op_timeout, uint32_t lanes = 1,
                TimeoutOf timeout_of = {})
        : hosts_(std::move(hosts)), op_timeout_(op_timeout), lanes_(std::max<uint32_t>(1, lanes)),
          timeout_of_(std::move(timeout_of)) {}

    struct Decisions {
        std::vector<proto::OpStart> starts;                                  // to every host
        std::vector<std::pair<uint32_t, proto::OpFail>> fails;               // to one host each
        std::vector<std::pair<uint32_t, proto::GroupIncarnation>> groups;    // to one host each
    };

    // A new ring generation: pending joins and ops are forgotten (every host failed its ops
    // already and joins again); which incarnations ended is kept. `instances`: each host's ringd
    // instance (its handshake's, 0: unknown) in this generation. A running incarnation agreed
    // while a host ran another instance ends here: that ringd restarted, and the group's ranks
    // there went with it, so the others' joins are refused at once (they would wait for ranks
    // that are gone until timeouts.op).
    // `solo`: the generation's hosts can run solo lanes (every one speaks protocol 8, and the
    // transport cancels one op on a live link): the first tuning.lanes - 1 incarnations that are
    // running at once get a lane each to themselves (GroupIncarnation::solo_epoch), whose ring ops
    // every host starts by itself; the last lane stays shared, its ops started here, in order.
    void reset(uint64_t generation, std::vector<uint64_t> instances = {}, bool solo = false);
    uint64_t generation() const { return generation_; }

    void join(uint32_t host, const proto::GroupJoin &j, Decisions &out);
    void report(uint32_t host, const proto::OpReport &r, Clock::time_point now, Decisions &out);
    void expire(Clock::time_point now, Decisions &out);
    size_t pending() const { return pending_.size(); }

    // What the coordinator waits for, for `ringctl status`: ops some hosts reported and others
    // not yet (host indices), and groups whose next incarnation waits for hosts to join.
    struct PendingView {
        std::string group;
        uint64_t incarnation = 0, seq = 0;
        std::vector<uint32_t> reported, missing;
        double fails_in_s = 0;  // until the missing hosts are failed for it
    };
    std::vector<PendingView> pending_view(Clock::time_point now) const;
    struct JoinView {
        std::string group;
        std::vector<uint32_t> joined, missing;
    };
    std::vector<JoinView> joins_view() const;

private:
    using Key = std::tuple<std::string, uint64_t, uint64_t>;  // group, incarnation, seq
    struct Pending {
        std::vector<std::optional<proto::OpReport>> by_host;
        Clock::time_point deadline;
        bool deferred = false;  // reported by hosts where it stalled (doubling, halving-doubling)
    };
    struct Incarnation {
        std::string group;
        std::vector<uint64_t> local_ids;  // by host
        std::vector<uint64_t> max_seq;    // by host: the highest seq it reported in this generation
        int32_t end_code = 0;             // non-zero once it ended; later ops fail with end_message
        std::string end_message;
        uint64_t end_after = 0;           // ... the ops after this seq (those up to it ended on the hosts that ended it)
        // When it ended, and the hosts whose end came: a solo lane whose end spared ops (end_after)
        // stays its own until every host ended it, the group's timeouts.op passed or the ring
        // generation ended (place, reset): hosts may still post the spared ops on it, and another
        // grant's first op there would drop their messages.
        Clock::time_point ended_at{};
        std::vector<bool> ended_by;
        uint32_t lane = 0;
        uint32_t solo_epoch = 0;   // non-zero: it has its lane alone (a solo lane)
        uint32_t total_ranks = 0;  // every host's local ranks (0: not known)
        std::vector<std::vector<uint32_t>> host_ranks;  // the agreed rank map (empty: not every host said it)
        std::vector<uint64_t> instances;  // by host: the ringd instances it was agreed with
    };
    struct Join {
        uint64_t local_id = 0;
        uint64_t previous = 0;
        uint32_t local_size = 0;
        uint32_t group_ranks = 0;     // protocol 10: the group's size its trainers said (0: not said)
        std::vector<uint32_t> ranks;  // and their ranks, by local rank
    };
    // The lane of a newly agreed incarnation: a solo lane when one is free, else the least used of
    // the shared ones. Sets inc.lane and inc.solo_epoch.
    void place(Incarnation &inc, const std::string &group);
    proto::GroupIncarnation answer(uint32_t host, const std::string &group, uint64_t local_id, uint64_t id) const;
    struct GroupRun {
        uint64_t current = 0;  // the agreed incarnation, 0 before the first agreement
        std::vector<std::optional<Join>> joins;  // by host, towards the next agreement
    };
    // The agreed rank map of the joins (every host said its ranks), or why they disagree (second).
    std::pair<std::vector<std::vector<uint32_t>>, std::string> rank_map(const std::string &group, const GroupRun &run) const;

    void refuse(uint32_t host, const std::string &group, uint64_t local_id, const std::string &why, Decisions &out);
    // `after`: the seq through which the ending host's ops ended there (OpReport kIncarnationEnds);
    // the ops up to it go on. Another host's end may spare fewer.
    // `host`: the host whose end it is (-1: none in particular).
    void end(uint64_t incarnation, int32_t code, const std::string &message, Decisions &out, uint64_t after = 0,
             int host = -1);
    void fail(const Key &k, int32_t code, const std::string &message, Decisions &out);
    void fail_skipped(const Key &k, Decisions &out);
    void decide(const Key &k, std::optional<std::pair<int32_t, std::string>> failure);
    Incarnation *find(uint64_t incarnation);

    std::vector<std::string> hosts_;
    std::chrono::milliseconds op_timeout_;
    uint32_t lanes_ = 1;
    TimeoutOf timeout_of_;
    bool solo_ = false;
    // The last epoch given per lane (1-127, round): a link compares a lane's epochs modulo 128,
    // so consecutive grants of a lane differ by one.
    std::vector<uint32_t> solo_epoch_;
    uint64_t generation_ = 0;
    std::vector<uint64_t> instances_;  // by host, this generation's (0: unknown)
    uint64_t next_op_id_ = 1;
    uint64_t next_incarnation_ = 1;
    std::map<std::string, GroupRun> groups_;
    std::map<uint64_t, Incarnation> incarnations_;
    std::deque<uint64_t> incarnation_order_;
    std::map<Key, Pending> pending_;
    // Decided ops, remembered for late reports: nullopt = started or completed silently (a late
    // report is a duplicate), else the failure, which a late reporter gets too.
    std::map<Key, std::optional<std::pair<int32_t, std::string>>> decided_;
    std::deque<Key> decided_order_;
};

}  // namespace ringd
