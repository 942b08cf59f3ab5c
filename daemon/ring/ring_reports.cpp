// RingDomain (ring_domain.h): this host's ops and failures reported to the coordinator, in local
// order per group, once the group's incarnation is agreed (GroupJoin / GroupIncarnation).
#include <systemd/sd-daemon.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "daemon/ring/ring_domain.h"

#include <nlohmann/json.hpp>

#include "daemon/gateway/client_gateway.h"
#include "daemon/engine/reduce.h"
#include "daemon/engine/tuner.h"
#include "daemon/ipc/slot.h"

namespace ringd {

// This host's local failures and the ops every local rank submitted, queued for reporting in
// local order.
void RingDomain::take_failure(const LocalFailure &f) {
    if (f.seq == proto::kIncarnationEnds) {
        // A rank left: this local incarnation is over, whatever its other ranks still do. Asked
        // for but not agreed yet, it is withdrawn at once (and never asks again: join_groups),
        // so that the coordinator does not agree on it with the others' next run, whose first op
        // its end would fail. (The gateway hands failures over before it welcomes a new trainer,
        // so this goes out before a new run of the group here can be agreed.)
        auto run = runs_.find(f.group);
        if (run != runs_.end() && run->second.local_id == f.local_id && run->second.join_sent && !run->second.agreed &&
            coord_known_) {
            run->second.join_sent = false;
            send_to_coordinator(proto::encode_group_join({coord_generation_, f.group, f.local_id, proto::kIncarnationEnds}));
        }
    }
    HostOp op;
    op.run.group = f.group;
    op.run.local_id = f.local_id;
    op.run.seq = f.seq;
    op.run.submitted = Clock::now();  // its age in status: since it failed here
    op.status = f.code;
    op.message = "host " + sh_.host + ": " + f.message;
    op.deadline = Clock::now() + config_.timeouts.op;
    ops_.queue(std::move(op));
}

void RingDomain::take_ready(OpRun run) {
    HostOp op;
    if (!sh_.gateway->slots_of(run, op.slots)) {
        sh_.groups->finished(run.op_id, -ECONNRESET, run_left(run), *sh_.done);
        return;
    }
    op.deadline = run.deadline;  // from the first local submission, whatever comes next
    op.run = std::move(run);
    ops_.queue(std::move(op));
}

// Every group there is here asks the coordinator to agree on its incarnation as soon as it
// exists (and again in each ring generation), before its first op. Returns whether it sent any.
// A run agreed in an earlier ring generation, not agreed again in this one, and over here (its
// ranks left, or one did): the coordinator hears it once, which ends it for the other hosts, whose
// ranks then fail at once naming this host instead of waiting for it to join. Kept until then
// (forget_gone_runs), also while the ring is down.
bool RingDomain::tell_ended_runs() {
    bool sent = false;
    for (auto &[group, run] : runs_) {
        if (run.agreed || run.previous == 0 || run.end_told || run.refused_code != 0) continue;
        if (sh_.groups->local_id(group) == run.local_id && !sh_.groups->broken(group)) continue;  // goes on
        run.end_told = true;
        run.join_sent = true;  // it never asks again
        sent = true;
        send_to_coordinator(proto::encode_group_join({coord_generation_, group, run.local_id, proto::kIncarnationEnds}));
    }
    return sent;
}

bool RingDomain::join_groups() {
    bool sent = tell_ended_runs();
    sh_.groups->for_each_local_id([&](const std::string &group, uint64_t local_id) {
        if (sh_.domain_of(group) != this) return;  // another domain's group
        const HostOp *next = ops_.next_queued(group);
        if (next && next->run.local_id != local_id) return;  // an earlier incarnation's reports first
        GroupRun &run = runs_[group];
        if (run.local_id != local_id) {
            run = GroupRun{};
            run.local_id = local_id;
        }
        // A local incarnation a rank left never asks: it is over here (take_failure).
        if (run.agreed || run.join_sent || run.refused_code != 0 || sh_.groups->broken(group)) return;
        // A group whose trainers say their ranks joins once every local rank is here (its ops
        // cannot start before that either).
        if (generation_protocol_ >= proto::kCollectivesProtocol && sh_.groups->awaiting_ranks(group)) return;
        run.join_sent = true;
        sent = true;
        send_to_coordinator(group_join(group, run));
    });
    return sent;
}

// Reports what is ready or failed here, in local order per group, once the group's incarnation
// is agreed; asks for the agreement first. Returns whether anything moved.
bool RingDomain::flush_reports_now() {
    bool moved = join_groups();
    if (!ops_.any_queued()) {  // the usual case between ops: nothing to report
        forget_gone_runs();
        return moved;
    }
    for (const std::string &group : ops_.queued_groups()) {
        while (const HostOp *next = ops_.next_queued(group)) {
            GroupRun &run = runs_[group];
            if (run.local_id != next->run.local_id) {  // a new local incarnation
                run = GroupRun{};
                run.local_id = next->run.local_id;
            }
            // Every local rank of it is gone (none is there, or a newer local incarnation), or one
            // left: it never asks for an agreement again.
            const uint64_t now_local = sh_.groups->local_id(group);
            const bool over = now_local != run.local_id || sh_.groups->broken(group);
            // (An end spares ops only in the generation it came in: in the next one the
            // coordinator refuses the ended incarnation outright.)
            const bool refused = run.refused_code != 0 && (next->run.seq > run.end_after || !run.agreed);
            if (refused || (!run.agreed && (over || (!run.join_sent && next->run.seq == proto::kIncarnationEnds)))) {
                // Refused by the coordinator, or ended (past the ops it spared): its ops fail
                // here. Not agreed in this generation and over here: nobody else runs any of it in
                // this generation (agreed in an earlier one, the coordinator was told it ended:
                // tell_ended_runs).
                if (refused) end_solo_lane(run, true);  // (nothing more of it is posted here)
                HostOp op = ops_.take_queued(group);
                moved = true;
                if (op.status != 0) {
                    // This host's own end, after another host's: told still, with what ended
                    // here, so that the ops the first end spared and this host never ran fail
                    // on the others now, not at their deadline.
                    if (refused && run.agreed && op.run.seq == proto::kIncarnationEnds &&
                        generation_protocol_ >= proto::kRootedProtocol)
                        send_to_coordinator(proto::encode_op_report(end_report(group, run, op)));
                    continue;
                }
                sh_.groups->finished(op.run.op_id, run.refused_code != 0 ? run.refused_code : -ECONNABORTED,
                                 "group " + group + " op " + std::to_string(op.run.seq) + ": " +
                                     (run.refused_code != 0 ? run.refused : "its local ranks left"),
                                 *sh_.done);
                continue;
            }
            if (!run.agreed) {
                if (!run.join_sent) {
                    run.join_sent = true;
                    moved = true;
                    send_to_coordinator(group_join(group, run));
                }
                break;  // until GroupIncarnation comes
            }
            HostOp op = ops_.take_queued(group);
            moved = true;
            if (op.run.seq != proto::kIncarnationEnds) run.last_seq = std::max(run.last_seq, op.run.seq);
            // A solo lane's op that does not run here is skipped there in its order, so that the
            // previous host's messages of it are dropped; the end of the incarnation here skips
            // the rest of its grant.
            auto skip_solo = [&] {
                if (!run.solo_epoch) return;
                lanes_[run.lane % lanes_.size()]->engine->skip_to(
                    op.run.seq == proto::kIncarnationEnds ? kSoloTag | (((run.solo_epoch + 1) & 0x7f) << 24)
                                                          : solo_tag_next(solo_op_tag(run.solo_epoch, op.run.seq, nullptr)));
            };
            if (auto ahead = failed_ahead_.find(OpKey{group, run.agreed, op.run.seq}); ahead != failed_ahead_.end()) {
                // The coordinator failed it already: no report is needed.
                if (op.status == 0) sh_.groups->finished(op.run.op_id, ahead->second.first, ahead->second.second, *sh_.done);
                failed_ahead_.erase(ahead);
                skip_solo();
                continue;
            }
            if (run.solo_epoch && op.status == 0 && op.run.seq != proto::kIncarnationEnds && op.run.seq <= run.skipped) {
                // Its lane is past it already (failed by the coordinator; the failure was forgotten).
                sh_.groups->finished(op.run.op_id, -ECONNABORTED,
                                     "group " + group + " op " + std::to_string(op.run.seq) + ": the coordinator failed it before this host got to it",
                                     *sh_.done);
                continue;
            }
            if (op.status == 0 && op.run.seq != proto::kIncarnationEnds) {
                // A reduce_scatter or allgather this generation cannot run fails here, and its
                // report fails it on every host, naming why.
                if (std::string why = collectives_refused(run, op.run); !why.empty()) {
                    op.status = -EPROTONOSUPPORT;
                    op.message = "group " + group + " op " + std::to_string(op.run.seq) + ": " + why;
                    sh_.groups->finished(op.run.op_id, op.status, op.message, *sh_.done);
                }
            }
            // (reduce_scatter and allgather: by the size of the buffer with a block per rank.)
            const uint64_t bytes = op.run.desc.full_count() * dtype_size(op.run.desc.dtype);
            const Algorithm algorithm = choose_algorithm(bytes, static_cast<uint32_t>(config_.hosts.size()), config_.tuning,
                                                         generation_protocol_, op.run.desc.collective, mesh_links());
            if (run.solo_epoch && op.status == 0 && op.run.seq != proto::kIncarnationEnds && algorithm == Algorithm::Ring) {
                start_solo(run, std::move(op));
                continue;
            }
            if (op.status != 0) skip_solo();
            proto::OpReport r = op.run.seq == proto::kIncarnationEnds
                                    ? end_report(group, run, op)
                                    : op_report({group, run.agreed, op.run.seq}, op.run.desc,
                                                static_cast<uint32_t>(op.run.members.size()), op.deadline);
            r.status = op.status;
            r.message = op.message;
            if (op.status == 0) sh_.groups->set_algorithm(op.run.op_id, algorithm_name(algorithm));
            if (op.status == 0 && algorithm != Algorithm::Ring) {
                // Peers' data of the op is here already and their deadline has passed: this host
                // got there too late. It fails here and is reported as this host's failure, without
                // its data, so that no host completes the op (the coordinator fails it everywhere,
                // if it has not already, rather than waiting for a decision that crosses the data
                // still queued to this host).
                const auto late = exchange_->earliest_deadline(coord_generation_, OpKey{group, r.incarnation, r.seq});
                if (late && late->first <= Clock::now()) {
                    const std::string why = "group " + group + " op " + std::to_string(op.run.seq) + " timed out after " +
                                            std::to_string(sh_.groups->op_timeout(group).count()) + " ms: host(s) " +
                                            config_.hosts[self_index_].name + " did not submit it by host " +
                                            config_.hosts[late->second].name + "'s deadline (it got there later)";
                    sh_.groups->finished(op.run.op_id, -ETIMEDOUT, why, *sh_.done);
                    exchange_->drop(coord_generation_, OpKey{group, r.incarnation, r.seq});
                    r.status = -ETIMEDOUT;
                    r.message = why;
                    send_to_coordinator(proto::encode_op_report(r));
                    continue;
                }
                if (std::string why = exchange_->send_over_bound(r, op.run.desc, algorithm, run.host_ranks, op.run.splits); !why.empty()) {
                    // Reported as this host's failure: it fails on every host, named.
                    sh_.groups->finished(op.run.op_id, -ENOBUFS, why, *sh_.done);
                    r.status = -ENOBUFS;
                    r.message = why;
                    send_to_coordinator(proto::encode_op_report(r));
                    continue;
                }
                report_direct(std::move(op), std::move(r), algorithm);
                continue;
            }
            if (op.status == 0) ops_.reported(OpKey{group, r.incarnation, r.seq}, std::move(op));
            send_to_coordinator(proto::encode_op_report(r));
        }
        // An ended solo lane whose ops that go on are all posted now skips the rest (in order
        // after them).
        if (auto run = runs_.find(group); run != runs_.end()) end_solo_lane(run->second);
    }
    forget_gone_runs();
    return moved;
}

// The report of this host's end of an agreed incarnation (`op`: its local failure of seq
// kIncarnationEnds): from protocol 11 its count says through which op every op of it ended here
// (completed, or failed and reported; the lowest still held, reported or running, bounds it), so
// that the others' ops up to it go on (proto/peer.h).
proto::OpReport RingDomain::end_report(const std::string &group, const GroupRun &run, const HostOp &op) const {
    proto::OpReport r = op_report({group, run.agreed, op.run.seq}, op.run.desc,
                                  static_cast<uint32_t>(op.run.members.size()), op.deadline);
    r.status = op.status;
    r.message = op.message;
    if (generation_protocol_ >= proto::kRootedProtocol) {
        const uint64_t held = ops_.lowest_held(group, run.agreed);
        r.count = std::min(run.last_seq, held == UINT64_MAX ? run.last_seq : held - 1) + 1;
    }
    return r;
}

// A group gone here with nothing left to report is forgotten.
void RingDomain::forget_gone_runs() {
    for (auto run = runs_.begin(); run != runs_.end();) {
        const GroupRun &r = run->second;
        const bool untold = !r.agreed && r.previous != 0 && !r.end_told && r.refused_code == 0;  // tell_ended_runs
        if (!ops_.has_queued(run->first) && sh_.groups->local_id(run->first) != r.local_id && !untold) run = runs_.erase(run);
        else ++run;
    }
}

void RingDomain::on_group_incarnation(const proto::GroupIncarnation &g) {
    if (!coord_known_ || g.generation != coord_generation_) return;
    auto it = runs_.find(g.group);
    if (it == runs_.end() || it->second.local_id != g.local_id) return;  // an incarnation that ended here
    GroupRun &run = it->second;
    if (g.code != 0) {
        spdlog::warn("{}", g.message);
        record_error(g.message);
        run.refused_code = g.code;
        run.refused = g.message;
    } else {
        run.agreed = g.incarnation;
        run.lane = g.lane;
        run.solo_epoch = solo_lanes() && g.lane < lanes_.size() ? g.solo_epoch : 0;
        run.total_ranks = g.total_ranks;
        run.host_ranks = g.host_ranks;
    }
}

proto::Bytes RingDomain::group_join(const std::string &group, const GroupRun &run) const {
    proto::GroupJoin j{coord_generation_, group, run.local_id, run.previous,
                       generation_protocol_ >= kLogAlgorithmsProtocol ? sh_.groups->local_size(group) : 0};
    uint32_t ranks = 0;
    if (const auto *mine = sh_.groups->group_ranks(group, &ranks); mine && generation_protocol_ >= proto::kCollectivesProtocol) {
        j.group_ranks = ranks;
        j.ranks = *mine;
    }
    return proto::encode_group_join(j);
}

std::string RingDomain::collectives_refused(const GroupRun &run, const OpRun &op) const {
    if (op.desc.wire != WireFormat::Exact && generation_protocol_ < proto::kWireProtocol) {
        std::string old;
        for (const auto &p : control_->status())
            if (!p.self && p.protocol != 0 && p.protocol < proto::kWireProtocol)
                old += (old.empty() ? "" : ", ") + p.name + " (peer protocol " + std::to_string(p.protocol) + ")";
        return "a " + std::string(wire_format_name(op.desc.wire)) + " wire needs peer protocol " +
               std::to_string(proto::kWireProtocol) + " on every host of the group, and " +
               (old.empty() ? "a host of its ring" : "host " + old) + " runs an older ringd; the exact wire still runs";
    }
    if (op.desc.collective == Collective::Allreduce) return {};
    const std::string what(collective_name(op.desc.collective));
    const uint16_t needs = collective_blocked(op.desc.collective) ? proto::kCollectivesProtocol : proto::kRootedProtocol;
    if (generation_protocol_ < needs) {
        std::string old;
        for (const auto &p : control_->status())
            if (!p.self && p.protocol != 0 && p.protocol < needs)
                old += (old.empty() ? "" : ", ") + p.name + " (peer protocol " + std::to_string(p.protocol) + ")";
        return "a " + what + " needs peer protocol " + std::to_string(needs) +
               " on every host of the group, and " + (old.empty() ? "a host of its ring" : "host " + old) +
               " runs an older ringd; allreduce still runs";
    }
    if (run.host_ranks.empty())
        return "a " + what + " needs every trainer of the group to say its rank when it connects, and the trainers of "
               "some host did not (ringd_options.rank and .ranks)";
    if (run.host_ranks.size() != config_.hosts.size())  // (the coordinator gives one list per host of the ring)
        return "a " + what + " needs the rank map of the ring's " + std::to_string(config_.hosts.size()) +
               " hosts, and the one agreed names " + std::to_string(run.host_ranks.size());
    uint64_t n = 0;
    for (const auto &h : run.host_ranks) n += h.size();
    if (n != op.desc.ranks)
        return "a " + what + " over " + std::to_string(op.desc.ranks) + " ranks in a group of " + std::to_string(n);
    return {};
}

proto::OpReport RingDomain::op_report(const OpKey &key, const OpDesc &desc, uint32_t local_size,
                                      Clock::time_point deadline) const {
    proto::OpReport r;
    r.generation = coord_generation_;
    r.group = std::get<0>(key);
    r.incarnation = std::get<1>(key);
    r.seq = std::get<2>(key);
    r.count = desc.count;
    r.dtype = static_cast<uint32_t>(desc.dtype);
    r.op = static_cast<uint32_t>(desc.op);
    // (Not in a generation before protocol 10, whose coordinator refuses the bits: such an op
    // fails here, collectives_refused.)
    r.collective = generation_protocol_ >= proto::kCollectivesProtocol ? static_cast<uint32_t>(desc.collective) : 0;
    r.root = desc.root;
    r.wire = generation_protocol_ >= proto::kWireProtocol ? static_cast<uint32_t>(desc.wire) : 0;
    r.local_size = local_size;
    r.remaining_ms = static_cast<uint32_t>(std::clamp<int64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count(), 0, UINT32_MAX));
    return r;
}

proto::OpReport RingDomain::failure_report(const proto::OpReport &data, int32_t code, std::string why) {
    proto::OpReport r;
    r.generation = data.generation;
    r.group = data.group;
    r.incarnation = data.incarnation;
    r.seq = data.seq;
    r.status = code;
    r.message = std::move(why);
    return r;
}

}  // namespace ringd
