// RingDomain (ring_domain.h): the direct algorithms (one-/two-shot, doubling, halving-doubling):
// this host's data with its report, the peers' data, and their completion here.
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

// One-/two-shot (DirectExchange): this host's data goes to the others with its report; the
// coordinator gets the report (on its own host, through the inbox).
// Doubling and halving-doubling: nobody hears of the op but this host's partners, unless it has
// not completed within kStallReport, or a partner's data does not match (tell_coordinator).
void RingDomain::report_direct(HostOp op, proto::OpReport r, Algorithm algorithm) {
    r.algorithm = static_cast<uint32_t>(algorithm);
    op.algorithm = algorithm;
    const OpKey key{r.group, r.incarnation, r.seq};
    const bool deferred = this->deferred(algorithm);
    if (deferred) op.stall_at = Clock::now() + std::min<Clock::duration>(kStallReport, (op.deadline - Clock::now()) / 4);
    auto run = runs_.find(r.group);  // (reduce_scatter, allgather: its rank map, which they need to run)
    exchange_->contribute(ops_.reported(key, std::move(op)), r,
                          run != runs_.end() ? std::span<const std::vector<uint32_t>>(run->second.host_ranks)
                                             : std::span<const std::vector<uint32_t>>{});
    if (!deferred && self_index_ == kCoordinator) self_inbox_.push_back({Frame{}, r});  // in order with the other frames
    try_progress_direct(key);
}

// A doubling or halving-doubling op's report, sent when it is needed: the op stalls here, a
// partner's data does not match it, or (kReportDone) it completed after this host reported it.
void RingDomain::tell_coordinator(const OpKey &key, HostOp &op, uint32_t flags) {
    // (Below protocol 8, one-/two-shot ops were reported with their data: the coordinator sees
    // any difference.)
    if (!deferred(op.algorithm) || (op.told_coordinator && !(flags & proto::kReportDone))) return;
    op.told_coordinator = true;
    ++deferred_reports_;
    proto::OpReport r = op_report(key, op.run.desc, static_cast<uint32_t>(op.run.members.size()),
                                  op.deadline);
    r.algorithm = static_cast<uint32_t>(op.algorithm);
    r.flags = proto::kReportDeferred | flags;
    send_to_coordinator(proto::encode_op_report(r));
}

// This host cannot keep a peer's data of an op it has not reached: the op fails on every host
// with `why`, through the coordinator, which takes the report as one for an op ahead (it says
// nothing of how far this host got).
void RingDomain::fail_ahead(const proto::OpReport &data, int32_t code, const std::string &why) {
    spdlog::warn("{}", why);
    record_error(why);
    proto::OpReport r = failure_report(data, code, why);
    r.flags = proto::kReportAhead;
    send_to_coordinator(proto::encode_op_report(r));
}

// A partner runs a doubling/halving-doubling op that ended here already (this host's trainers
// failed it in an earlier ring generation, say, and went on): nobody will send it this host's
// part, so it fails on every host now, through the coordinator, naming this host (the deferred
// reports of the others say nothing of how far this host got).
void RingDomain::past_it(uint32_t host, const proto::OpReport &data) {
    const OpKey key{data.group, data.incarnation, data.seq};
    if (!past_told_.insert(key).second) return;
    if (past_told_.size() > kMaxFailedAhead) past_told_.erase(past_told_.begin());
    proto::OpReport r = failure_report(data, -ECONNABORTED,
                                       "group " + data.group + " op " + std::to_string(data.seq) + ": host " +
                                           config_.hosts[self_index_].name + " is past it (the op ended there before host " +
                                           config_.hosts[host].name + " got to it)");
    send_to_coordinator(proto::encode_op_report(r));
}

void RingDomain::on_op_data(uint32_t host, Frame &frame) {
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
                            report.seq <= run->second.last_seq && !ops_.find_reported(key) && !solo_running(key);
    bool keep = !((coord_known_ && report.generation < coord_generation_) ||
                  (!coord_known_ && report.generation <= coord_generation_used_)) &&
                !failed_ahead_.count(key) && !ended_here;
    // (Deferred ops' data is no report: the coordinator would not hear that this host is past it.)
    const bool data_deferred = d->kind >= proto::OpDataKind::Doubling || generation_protocol_ >= kLogAlgorithmsProtocol;
    if (ended_here && data_deferred && coord_known_ && report.generation == coord_generation_) past_it(host, report);
    if (keep) {
        std::string over_bound;
        keep = exchange_->take_part(host, *d, std::move(frame.payload), over_bound);
        if (!over_bound.empty()) fail_ahead(report, -ENOBUFS, over_bound);
    }
    // Below protocol 8, one-/two-shot data is the sender's report, checked like any (an OpFail
    // drops the data again).
    if (coordinator_ && !data_deferred) on_report(host, report);
    if (coord_known_ && report.generation == coord_generation_) try_progress_direct(key);
}

// all_to_all: this host's messages go a part at a time as the control connections take them (the
// queues drained since the last step, or a peer's first part came); an op whose last part went
// out may complete.
bool RingDomain::pump_all_to_all() {
    if (!coord_known_ || !exchange_->sending()) return false;
    std::vector<OpKey> finished;
    const bool moved = exchange_->pump(coord_generation_, [this](const OpKey &k) { return ops_.find_reported(k); }, finished);
    for (const OpKey &k : finished) try_progress_direct(k);
    return moved || !finished.empty();
}

// Completes a one- or two-shot op here once this host reported it and every part it needs is in.
void RingDomain::try_progress_direct(const OpKey &key) {
    HostOp *op = ops_.find_reported(key);
    if (!op || op->algorithm == Algorithm::Ring) return;
    if (!exchange_->progress(coord_generation_, key, *op)) {
        if (!exchange_->mismatched(coord_generation_, key)) return;
        // A peer's message that its report and the rank map do not account for: the op fails on
        // every host, naming it (once). Otherwise a partner's data does not match this host's op:
        // the coordinator decides (a mismatch naming both hosts).
        if (std::string why = exchange_->malformed(coord_generation_, key); !why.empty()) {
            if (op->failed_malformed) return;
            op->failed_malformed = true;
            record_error(why);
            proto::OpReport r = failure_report(op_report(key, op->run.desc, 0, op->deadline), -EPROTO, why);
            r.flags = proto::kReportDeferred;  // (not this host's progress)
            send_to_coordinator(proto::encode_op_report(r));
            return;
        }
        tell_coordinator(key, *op, 0);
        return;
    }
    switch (op->algorithm) {
    case Algorithm::OneShot: ++ops_one_shot_; break;
    case Algorithm::TwoShot: ++ops_two_shot_; break;
    case Algorithm::Doubling: ++ops_doubling_; break;
    default: ++ops_halving_doubling_; break;
    }
    if (op->told_coordinator) tell_coordinator(key, *op, proto::kReportDone);  // it may forget the op
    sh_.groups->finished(op->run.op_id, 0, {}, *sh_.done);
    (void)ops_.take_reported(key);
    exchange_->drop(coord_generation_, key);
}

}  // namespace ringd
