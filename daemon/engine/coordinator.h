// Coordinator: matches the op reports of every host of the ring (it runs on the first host in
// ring order) and decides, for each group op, OpStart (all hosts ready, same count/dtype/op) or
// OpFail (a host reported a local failure, a count/dtype/op mismatch naming both hosts, or
// hosts that did not report within timeouts.op, named). Decisions go to every host in one
// order, which is the order every host's progress thread runs ring ops in — so no two hosts
// ever wait on each other's different ops. Ops that skip the ring (reports with an
// `algorithm`: one-shot or two-shot) need no start: when all hosts reported them alike they are decided silently.
//
// Pure bookkeeping (no I/O, the caller passes `now`), called by the control thread.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/fd_io.h"
#include "proto/peer.h"

namespace ringd {

class Coordinator {
public:
    Coordinator(std::vector<std::string> hosts, std::chrono::milliseconds op_timeout)
        : hosts_(std::move(hosts)), op_timeout_(op_timeout) {}

    struct Decisions {
        std::vector<proto::OpStart> starts;
        std::vector<proto::OpFail> fails;
    };

    // A new ring generation: everything pending is forgotten (every host failed it already).
    void reset(uint64_t generation);
    uint64_t generation() const { return generation_; }

    void report(uint32_t host, const proto::OpReport &r, Clock::time_point now, Decisions &out);
    void expire(Clock::time_point now, Decisions &out);
    size_t pending() const { return pending_.size(); }

private:
    using Key = std::pair<std::string, uint64_t>;  // group, ordinal
    struct Pending {
        std::vector<std::optional<proto::OpReport>> by_host;
        Clock::time_point deadline;
    };
    void decide(const Key &k);

    std::vector<std::string> hosts_;
    std::chrono::milliseconds op_timeout_;
    uint64_t generation_ = 0;
    uint64_t next_op_id_ = 1;
    std::map<Key, Pending> pending_;
    std::set<Key> decided_;  // late reports of decided ops are dropped
    std::deque<Key> decided_order_;
};

}  // namespace ringd
