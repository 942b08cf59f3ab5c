// RingDomain (ring_domain.h): solo lanes, whose ring ops every host starts by itself in the
// group's order, and the ring work handed to a lane's progress thread.
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

bool RingDomain::solo_lanes() const {
    return generation_protocol_ >= kLogAlgorithmsProtocol && lanes_.size() >= 2 && lanes_[0]->transport &&
           lanes_[0]->transport->name() == "tcp";
}

uint32_t RingDomain::solo_op_tag(uint32_t epoch, uint64_t seq, const OpRun *op) {
    uint32_t digest = 0;
    if (op) {
        // The op's description folded to a byte: hosts whose ops differ send messages that no
        // receive of the others matches. (An allreduce's digest is what it was before collectives.)
        const OpDesc &d = op->desc;
        uint64_t h = d.count * 0x9e3779b97f4a7c15ull ^ (uint64_t{static_cast<uint32_t>(d.dtype)} << 8 | static_cast<uint32_t>(d.op));
        if (d.collective != Collective::Allreduce)
            h ^= (uint64_t{static_cast<uint32_t>(d.collective)} << 40 | d.ranks | uint64_t{d.root} << 20) * 0xd6e8feb86659fd93ull;
        h ^= h >> 29;
        h *= 0xbf58476d1ce4e5b9ull;
        h ^= h >> 32;
        digest = static_cast<uint32_t>(h & 0xff);
    }
    return kSoloTag | ((epoch & 0x7f) << 24) | (digest << 16) | static_cast<uint32_t>(seq & 0xffff);
}

// A ring op for the progress thread (its slots move into it).
EngineWork RingDomain::ring_work(HostOp &op, const GroupRun &run, uint32_t total_ranks, uint32_t op_tag) const {
    EngineWork w;
    w.op_id = op.run.op_id;
    w.desc = op.run.desc;
    w.avg_divisor = total_ranks;
    w.offsets = op.run.offsets;
    w.out_offsets = op.run.out_offsets;
    if (op.run.desc.collective != Collective::Allreduce) w.host_ranks = run.host_ranks;
    w.slots = std::move(op.slots);
    w.ring = true;
    w.generation = local_generation_;
    w.op_tag = op_tag;
    return w;
}

// A solo lane's ring op goes to its lane's progress thread at once: every host starts it by
// itself, in the group's order, and the coordinator hears of it only if it stalls here.
void RingDomain::start_solo(GroupRun &run, HostOp op) {
    const OpKey key{op.run.group, run.agreed, op.run.seq};
    ++ops_ring_;
    ++ops_solo_;
    sh_.groups->set_algorithm(op.run.op_id, algorithm_name(Algorithm::Ring));
    SoloOp so;
    so.key = key;
    so.lane = run.lane % static_cast<uint32_t>(lanes_.size());
    so.op_tag = solo_op_tag(run.solo_epoch, op.run.seq, &op.run);
    so.desc = op.run.desc;
    so.local_size = static_cast<uint32_t>(op.run.members.size());
    so.deadline = op.deadline;
    so.posted = Clock::now();
    EngineWork w = ring_work(op, run, run.total_ranks, so.op_tag);
    // The coordinator's decision (at the earliest deadline of the hosts that reported it) comes
    // before the ring's own timeout, which would end the generation.
    w.deadline = op.deadline + HostOps::kDecisionGrace;
    ops_.running(w.op_id, local_generation_, w.deadline, key, op.run.submitted);
    solo_ops_[w.op_id] = std::move(so);
    lanes_[run.lane % lanes_.size()]->engine->post(std::move(w));
}

void RingDomain::tell_solo(SoloOp &s, uint32_t flags) {
    if (s.told && !(flags & proto::kReportDone)) return;
    s.told = true;
    ++deferred_reports_;
    proto::OpReport r = op_report(s.key, s.desc, s.local_size, s.deadline);
    r.flags = proto::kReportDeferred | flags;
    send_to_coordinator(proto::encode_op_report(r));
}

}  // namespace ringd
