// The Daemon's part in rings of several hosts (control thread): the control plane's callbacks,
// the op reports to the coordinator and its decisions, and what a generation's end fails.
//
// An op of a group goes: ready on this host (all local ranks submitted it) -> once the hosts
// agreed on the group's incarnation in this generation (GroupJoin / GroupIncarnation, see
// proto/peer.h), reported to the coordinator as (group, incarnation, seq) -> OpStart (run it in
// the ring, in the coordinator's order) or OpFail (every rank gets the coordinator's message).
// Ops that fail on this host before they are ready are reported too, and so is the end of a
// local incarnation (its ranks left), so that the other hosts' ranks fail at once. When a
// generation ends, every op that is ready here fails with the reason and the incarnations are
// agreed again in the next one (a job that goes on keeps its incarnation; one that restarted
// everywhere gets a new one; one that restarted on some hosts only is refused).
//
// Small ops (daemon/engine/tuner.h) go by direct exchange instead: the report travels to every
// host with this host's contribution (OpData), and each host completes the op itself once every
// host's contribution is in, reducing them in ring order (so every host gets the same bits). The
// coordinator sees the same reports and fails the op with OpFail when something is wrong.
#include <systemd/sd-daemon.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "daemon/daemon.h"
#include "daemon/engine/reduce.h"
#include "daemon/engine/tuner.h"
#include "daemon/ipc/slot.h"

namespace ringd {
namespace {

constexpr uint32_t kCoordinator = 0;  // the first host in ring order
// OpFails for ops this host has not reached yet, kept at most this many.
constexpr size_t kMaxFailedAhead = 4096;

}  // namespace

Status Daemon::setup_ring() {
    if (!config_.secret_file.empty()) {
        auto s = PeerSecret::load(config_.secret_file);
        if (!s) return s.error();
        secret_ = std::move(*s);
    } else {
        spdlog::warn("auth.insecure: daemons of this ring do not authenticate each other; anyone who reaches "
                     "a ring port can join the ring and read or change gradients (set auth.secret_file)");
    }
    ControlPlane::Callbacks cb;
    cb.ring_up = [this](uint64_t g, std::vector<UniqueFd> to_next, std::vector<UniqueFd> from_prev) {
        on_ring_up(g, std::move(to_next), std::move(from_prev));
    };
    cb.ring_down = [this](const std::string &why) { on_ring_down(why); };
    cb.message = [this](uint32_t host, Frame &f) { on_peer_message(host, f); };
    auto cp = ControlPlane::create(config_, self_index_, &secret_, std::move(cb));
    if (!cp) return cp.error();
    control_ = std::move(*cp);
    if (self_index_ == kCoordinator) {
        std::vector<std::string> names;
        for (const auto &h : config_.hosts) names.push_back(h.name);
        coordinator_.emplace(std::move(names), config_.timeouts.op);
    }
    std::vector<std::string> names;
    for (const auto &h : config_.hosts) names.push_back(h.name);
    exchange_ = std::make_unique<DirectExchange>(
        self_index_, std::move(names), [this](uint32_t h, const proto::Bytes &f) { (void)control_->send(h, f); },
        [this](uint32_t h) { return control_->queued_bytes(h); });
    return Ok{};
}

void Daemon::on_ring_up(uint64_t generation, std::vector<UniqueFd> to_next, std::vector<UniqueFd> from_prev) {
    local_generation_ = generation;
    const uint32_t n = static_cast<uint32_t>(config_.hosts.size());
    RingLinks l;
    l.generation = generation;
    l.rank = self_index_;
    l.size = n;
    l.next_name = config_.hosts[(self_index_ + 1) % n].name;
    l.prev_name = config_.hosts[(self_index_ + n - 1) % n].name;
    l.to_next = std::move(to_next);
    l.from_prev = std::move(from_prev);
    engine_->ring_up(std::move(l));
    // The generation is agreed: every host reports ops in it from now on.
    coord_generation_ = generation;
    coord_known_ = true;
    if (coordinator_) coordinator_->reset(generation);
    control_->heartbeat_now(generation);
    spdlog::info("ring generation {} is up ({} hosts)", generation, n);
    // For `systemctl status ringd` (and tests, which wait for it on their NOTIFY_SOCKET).
    ::sd_notifyf(0, "STATUS=ring generation %llu up (%u hosts)", static_cast<unsigned long long>(generation), n);
}

void Daemon::on_ring_down(const std::string &why) {
    engine_->ring_down(local_generation_);
    ring_down_reason_ = "ring generation " + std::to_string(local_generation_) + " aborted: " + why;
    record_error(ring_down_reason_);
    last_abort_ = ring_down_reason_;
    ::sd_notifyf(0, "STATUS=%s", ring_down_reason_.c_str());
    coord_known_ = false;
    coord_generation_used_ = coord_generation_;
    self_inbox_.clear();  // frames of the generation that ended
    ops_.generation_ended(ring_down_reason_);
    failed_ahead_.clear();
    for (auto &[group, run] : runs_) {  // agreed again in the next generation
        if (run.agreed) run.previous = run.agreed;
        run.agreed = 0;
        run.join_sent = false;
    }
    exchange_->drop_before(coord_generation_used_ + 1);
}

// This host's local failures and the ops every local rank submitted, queued for reporting in
// local order. Returns whether there were any.
bool Daemon::queue_host_ops() {
    std::vector<LocalFailure> failures = groups_.take_failures();
    if (failures.empty() && ready_.empty()) return false;
    const auto deadline = Clock::now() + config_.timeouts.op;
    for (auto &f : failures) {
        if (f.seq == proto::kIncarnationEnds) {
            // Its ranks left while the hosts were agreeing on it: withdrawn at once, so that the
            // coordinator does not agree on it with the others' next run.
            auto run = runs_.find(f.group);
            if (run != runs_.end() && run->second.local_id == f.local_id && run->second.join_sent &&
                !run->second.agreed && coord_known_) {
                run->second.join_sent = false;
                send_to_coordinator(
                    proto::encode_group_join({coord_generation_, f.group, f.local_id, proto::kIncarnationEnds}));
            }
        }
        HostOp op;
        op.run.group = f.group;
        op.run.local_id = f.local_id;
        op.run.seq = f.seq;
        op.status = f.code;
        op.message = "host " + host_ + ": " + f.message;
        op.deadline = deadline;
        ops_.queue(std::move(op));
    }
    for (auto &run : std::exchange(ready_, {})) {
        HostOp op;
        if (!gateway_->slots_of(run, op.slots)) {
            groups_.finished(run.op_id, -ECONNRESET, run_left(run), done_);
            continue;
        }
        op.deadline = run.deadline;  // from the first local submission, whatever comes next
        op.run = std::move(run);
        ops_.queue(std::move(op));
    }
    return true;
}

// To the coordinator; on the coordinating host itself, through the inbox that settle() empties
// (deliver_self_frames), like a frame from a peer.
void Daemon::send_to_coordinator(const proto::Bytes &frame) {
    if (self_index_ != kCoordinator) {
        (void)control_->send(kCoordinator, frame);
        return;
    }
    Frame f;
    f.type = static_cast<proto::FrameType>(frame[6] | (frame[7] << 8));
    f.payload.assign(frame.begin() + proto::kFrameHeaderBytes, frame.end());
    self_inbox_.push_back({std::move(f), std::nullopt});
}

bool Daemon::deliver_self_frames() {
    if (self_inbox_.empty()) return false;
    for (auto &m : std::exchange(self_inbox_, {})) {
        if (m.direct_report) on_report(self_index_, *m.direct_report);
        else on_peer_message(self_index_, m.frame);
    }
    return true;
}

// Every group there is here asks the coordinator to agree on its incarnation as soon as it
// exists (and again in each ring generation), before its first op. Returns whether it sent any.
bool Daemon::join_groups() {
    bool sent = false;
    groups_.for_each_local_id([&](const std::string &group, uint64_t local_id) {
        const HostOp *next = ops_.next_queued(group);
        if (next && next->run.local_id != local_id) return;  // an earlier incarnation's reports first
        GroupRun &run = runs_[group];
        if (run.local_id != local_id) run = GroupRun{local_id, 0, 0, false, 0, 0, {}};
        if (run.agreed || run.join_sent || run.refused_code != 0) return;
        run.join_sent = true;
        sent = true;
        send_to_coordinator(proto::encode_group_join({coord_generation_, group, run.local_id, run.previous}));
    });
    return sent;
}

// Reports what is ready or failed here, in local order per group, once the group's incarnation
// is agreed; asks for the agreement first. Returns whether anything moved.
bool Daemon::flush_reports_now() {
    bool moved = join_groups();
    if (!ops_.any_queued()) {  // the usual case between ops: nothing to report
        forget_gone_runs();
        return moved;
    }
    for (const std::string &group : ops_.queued_groups()) {
        while (const HostOp *next = ops_.next_queued(group)) {
            GroupRun &run = runs_[group];
            if (run.local_id != next->run.local_id) run = GroupRun{next->run.local_id, 0, 0, false, 0, 0, {}};  // a new local incarnation
            // A newer local incarnation is there: this one's ranks all left.
            const uint64_t now_local = groups_.local_id(group);
            const bool superseded = now_local != 0 && now_local != run.local_id;
            if (run.refused_code != 0 ||
                (!run.agreed && (superseded || (!run.join_sent && next->run.seq == proto::kIncarnationEnds)))) {
                // Refused by the coordinator: its ops fail here. Never agreed and superseded
                // (or ended before this host asked for an agreement in this generation): nobody
                // else ran any of it, and the newer one's GroupJoin ends it at the coordinator.
                HostOp op = ops_.take_queued(group);
                moved = true;
                if (op.status != 0) continue;
                groups_.finished(op.run.op_id, run.refused_code != 0 ? run.refused_code : -ECONNABORTED,
                                 "group " + group + " op " + std::to_string(op.run.seq) + ": " +
                                     (run.refused_code != 0 ? run.refused : "its local ranks left"),
                                 done_);
                continue;
            }
            if (!run.agreed) {
                if (!run.join_sent) {
                    run.join_sent = true;
                    moved = true;
                    send_to_coordinator(proto::encode_group_join({coord_generation_, group, run.local_id, run.previous}));
                }
                break;  // until GroupIncarnation comes
            }
            HostOp op = ops_.take_queued(group);
            moved = true;
            if (op.run.seq != proto::kIncarnationEnds) run.last_seq = std::max(run.last_seq, op.run.seq);
            if (auto ahead = failed_ahead_.find(OpKey{group, run.agreed, op.run.seq}); ahead != failed_ahead_.end()) {
                // The coordinator failed it already: no report is needed.
                if (op.status == 0) groups_.finished(op.run.op_id, ahead->second.first, ahead->second.second, done_);
                failed_ahead_.erase(ahead);
                continue;
            }
            proto::OpReport r;
            r.generation = coord_generation_;
            r.group = group;
            r.incarnation = run.agreed;
            r.seq = op.run.seq;
            r.count = op.run.count;
            r.dtype = static_cast<uint32_t>(op.run.dtype);
            r.op = static_cast<uint32_t>(op.run.op);
            r.local_size = static_cast<uint32_t>(op.run.members.size());
            r.status = op.status;
            r.message = op.message;
            r.remaining_ms = static_cast<uint32_t>(std::clamp<int64_t>(
                std::chrono::duration_cast<std::chrono::milliseconds>(op.deadline - Clock::now()).count(), 0, UINT32_MAX));
            const uint64_t bytes = op.run.count * dtype_size(op.run.dtype);
            const Algorithm algorithm =
                choose_algorithm(bytes, static_cast<uint32_t>(config_.hosts.size()), config_.tuning);
            if (op.status == 0 && algorithm != Algorithm::Ring) {
                if (std::string why = exchange_->send_over_bound(r, op.run.dtype, op.run.op, algorithm); !why.empty()) {
                    // Reported as this host's failure: it fails on every host, named.
                    groups_.finished(op.run.op_id, -ENOBUFS, why, done_);
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
    }
    forget_gone_runs();
    return moved;
}

// A group gone here with nothing left to report is forgotten.
void Daemon::forget_gone_runs() {
    for (auto run = runs_.begin(); run != runs_.end();) {
        if (!ops_.has_queued(run->first) && groups_.local_id(run->first) != run->second.local_id) run = runs_.erase(run);
        else ++run;
    }
}

void Daemon::on_group_incarnation(const proto::GroupIncarnation &g) {
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
    }
}

// One-/two-shot (DirectExchange): this host's data goes to the others with its report; the
// coordinator gets the report (on its own host, through the inbox).
void Daemon::report_direct(HostOp op, proto::OpReport r, Algorithm algorithm) {
    r.algorithm = static_cast<uint32_t>(algorithm);
    op.algorithm = algorithm;
    const OpKey key{r.group, r.incarnation, r.seq};
    exchange_->contribute(ops_.reported(key, std::move(op)), r);
    if (self_index_ == kCoordinator) self_inbox_.push_back({Frame{}, r});  // in order with the other frames
    try_progress_direct(key);
}

// This host cannot keep a peer's data of an op it has not reached: the op fails on every host
// with `why`, through the coordinator, which takes the report as one for an op ahead (it says
// nothing of how far this host got).
void Daemon::fail_ahead(const proto::OpReport &data, int32_t code, const std::string &why) {
    spdlog::warn("{}", why);
    record_error(why);
    proto::OpReport r;
    r.generation = data.generation;
    r.group = data.group;
    r.incarnation = data.incarnation;
    r.seq = data.seq;
    r.status = code;
    r.message = why;
    r.flags = proto::kReportAhead;
    send_to_coordinator(proto::encode_op_report(r));
}

void Daemon::on_op_data(uint32_t host, Frame &frame) {
    auto d = proto::decode_op_data(frame.payload);
    if (!d) {
        spdlog::warn("host {}: bad op data: {}", config_.hosts[host].name, d.error().message);
        return;
    }
    const proto::OpReport report = d->report;
    const OpKey key{report.group, report.incarnation, report.seq};
    if (d->kind == proto::OpDataKind::TwoShotResult) {
        // Host `host`'s reduced segment of a two-shot op: straight into every local slot.
        if (!coord_known_ || report.generation != coord_generation_) return;
        const HostOp *op = ops_.find_reported(key);
        if (!op || op->algorithm != Algorithm::TwoShot) return;  // ended here
        exchange_->take_result(host, report.generation, key, *op, report, d->data);
        try_progress_direct(key);
        return;
    }
    // Kept unless stale (a generation that is over here), decided already, not this host's part
    // or over a bound (the op fails everywhere, named).
    auto run = runs_.find(report.group);
    const bool ended_here = run != runs_.end() && run->second.agreed == report.incarnation &&
                            report.seq <= run->second.last_seq && !ops_.find_reported(key);
    bool keep = !((coord_known_ && report.generation < coord_generation_) ||
                  (!coord_known_ && report.generation <= coord_generation_used_)) &&
                !failed_ahead_.count(key) && !ended_here;
    if (keep) {
        std::string over_bound;
        keep = exchange_->take_part(host, *d, std::move(frame.payload), over_bound);
        if (!over_bound.empty()) fail_ahead(report, -ENOBUFS, over_bound);
    }
    if (coordinator_) on_report(host, report);  // checked like any report (an OpFail drops the data again)
    if (keep && coord_known_ && report.generation == coord_generation_) try_progress_direct(key);
}

// Completes a one- or two-shot op here once this host reported it and every part it needs is in.
void Daemon::try_progress_direct(const OpKey &key) {
    const HostOp *op = ops_.find_reported(key);
    if (!op || op->algorithm == Algorithm::Ring || !exchange_->progress(coord_generation_, key, *op)) return;
    ++(op->algorithm == Algorithm::OneShot ? ops_one_shot_ : ops_two_shot_);
    groups_.finished(op->run.op_id, 0, {}, done_);
    (void)ops_.take_reported(key);
    exchange_->drop(coord_generation_, key);
}

void Daemon::on_peer_message(uint32_t host, Frame &frame) {
    switch (frame.type) {
    case proto::FrameType::Heartbeat: return;
    case proto::FrameType::OpReport: {
        auto r = proto::decode_op_report(frame.payload);
        if (!r || !coordinator_) {
            spdlog::warn("host {}: bad op report: {}", config_.hosts[host].name, r ? "this host is not the coordinator" : r.error().message);
            return;
        }
        on_report(host, *r);
        return;
    }
    case proto::FrameType::GroupJoin: {
        auto j = proto::decode_group_join(frame.payload);
        if (!j || !coordinator_) {
            spdlog::warn("host {}: bad group join: {}", config_.hosts[host].name, j ? "this host is not the coordinator" : j.error().message);
            return;
        }
        Coordinator::Decisions d;
        coordinator_->join(host, *j, d);
        broadcast(d);
        return;
    }
    case proto::FrameType::GroupIncarnation:
        if (host != kCoordinator) break;
        if (auto g = proto::decode_group_incarnation(frame.payload)) on_group_incarnation(*g);
        return;
    case proto::FrameType::OpStart:
        if (host != kCoordinator) break;
        if (auto s = proto::decode_op_start(frame.payload)) on_start(*s);
        return;
    case proto::FrameType::OpData:
        on_op_data(host, frame);
        return;
    case proto::FrameType::OpFail:
        if (host != kCoordinator) break;
        if (auto f = proto::decode_op_fail(frame.payload)) on_fail(*f);
        return;
    default: break;
    }
    spdlog::warn("host {}: unexpected control frame type {}", config_.hosts[host].name, static_cast<int>(frame.type));
}

void Daemon::on_report(uint32_t host, const proto::OpReport &r) {
    Coordinator::Decisions d;
    coordinator_->report(host, r, Clock::now(), d);
    broadcast(d);
}

void Daemon::broadcast(const Coordinator::Decisions &d) {
    for (const auto &s : d.starts) {
        const proto::Bytes frame = proto::encode_op_start(s);
        for (uint32_t h = 0; h < config_.hosts.size(); ++h)
            if (h != self_index_) (void)control_->send(h, frame);
        on_start(s);
    }
    for (const auto &[h, f] : d.fails) {
        if (h == self_index_) on_fail(f);
        else (void)control_->send(h, proto::encode_op_fail(f));
    }
    for (const auto &[h, g] : d.groups) {
        if (h == self_index_) on_group_incarnation(g);
        else (void)control_->send(h, proto::encode_group_incarnation(g));
    }
}

void Daemon::on_start(const proto::OpStart &s) {
    if (!coord_known_ || s.generation != coord_generation_) return;
    const OpKey key{s.group, s.incarnation, s.seq};
    const HostOp *rep = ops_.find_reported(key);
    if (!rep) {
        spdlog::warn("op start for group {} op {} that this host did not report", s.group, s.seq);
        return;
    }
    if (rep->algorithm != Algorithm::Ring) {
        spdlog::warn("op start for group {} op {}, which goes by {}", s.group, s.seq, algorithm_name(rep->algorithm));
        return;
    }
    HostOp op = std::move(*ops_.take_reported(key));
    ++ops_ring_;
    EngineWork w;
    w.op_id = op.run.op_id;
    w.dtype = op.run.dtype;
    w.op = op.run.op;
    w.count = op.run.count;
    w.avg_divisor = s.total_ranks;
    w.offsets = op.run.offsets;
    w.slots = std::move(op.slots);
    w.ring = true;
    w.generation = local_generation_;
    w.op_tag = static_cast<uint32_t>(s.op_id);
    w.deadline = op.deadline;
    ops_.running(w.op_id, local_generation_, w.deadline);
    engine_->post(std::move(w));
}

void Daemon::on_fail(const proto::OpFail &f) {
    if (!coord_known_ || f.generation != coord_generation_) return;
    exchange_->drop(f.generation, OpKey{f.group, f.incarnation, f.seq});
    auto op = ops_.take_reported(OpKey{f.group, f.incarnation, f.seq});
    if (!op) {
        // Decided before this host got that far (a mismatch between two other hosts, say):
        // kept for when its ranks get there. Ops it reported already ended here.
        auto run = runs_.find(f.group);
        if (run != runs_.end() && run->second.agreed == f.incarnation && f.seq > run->second.last_seq) {
            if (failed_ahead_.size() >= kMaxFailedAhead) failed_ahead_.erase(failed_ahead_.begin());
            failed_ahead_[OpKey{f.group, f.incarnation, f.seq}] = {f.code, f.message};
        }
        return;
    }
    groups_.finished(op->run.op_id, f.code, f.message, done_);
}

void Daemon::expire_host_ops(Clock::time_point now) {
    if (coordinator_ && coord_known_) {
        Coordinator::Decisions d;
        coordinator_->expire(now, d);
        broadcast(d);
    }
    // Every op of this host past its state's deadline (daemon/ops/host_ops.h).
    const auto e = ops_.expire(now, [&](const HostOp &op) {
        const std::string head = "group " + op.run.group + " op " + std::to_string(op.run.seq) + " timed out after " +
                                 std::to_string(config_.timeouts.op.count()) + " ms: ";
        if (op.state == OpState::Reported)
            return head + "no decision from the coordinating host " + config_.hosts[kCoordinator].name;
        return head + (coord_known_ ? "not every host joined this incarnation of the group (a job must start or "
                                      "restart on every host)"
                                    : "the ring is not up (" + ring_down_reason_ + ")");
    });
    for (const OpKey &k : e.reported) exchange_->drop(coord_generation_, k);
    if (!e.overdue_running.empty() && control_->ring_up()) {
        // The progress thread did not give a ring op back by its deadline: the links it may
        // still write through are torn down (the generation ends; the op fails once it is back).
        control_->data_link_failed("ring op " + std::to_string(e.overdue_running.front()) + " of this host did not end within " +
                                   std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(HostOps::kReleaseGrace).count()) +
                                   " ms of its deadline");
    }
}

}  // namespace ringd
