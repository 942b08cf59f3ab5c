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

bool RingDomain::exchange_schedule() const {
    return generation_exchange_ && mesh_links() && config_.hosts.size() >= 3;
}

bool RingDomain::mesh_links() const {
    return generation_protocol_ >= proto::kMeshProtocol && !lanes_.empty() && lanes_[0]->transport &&
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
        if (d.wire != WireFormat::Exact) h ^= uint64_t{static_cast<uint32_t>(d.wire)} * 0x94d049bb133111ebull;
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
    w.splits = op.run.splits;
    w.slots = std::move(op.slots);
    w.ring = true;
    // A compressed f32 allreduce or reduce_scatter on 3 hosts or more: the exchange of shards where the generation
    // runs it (protocol 13, no host's wire.schedule says ring: its RingStart) and every host has
    // the data links to every other; bf16 ones too in a generation of 14. Every host of the
    // generation decides alike.
    const OpDesc &d = op.run.desc;
    w.exchange = exchange_schedule() && (d.collective == Collective::Allreduce || d.collective == Collective::ReduceScatter) &&
                 (d.dtype == DType::F32 || (d.dtype == DType::BF16 && generation_protocol_ >= proto::kExchangeBf16Protocol)) &&
                 d.wire != WireFormat::Exact;
    w.generation = local_generation_;
    w.op_tag = op_tag;
    return w;
}

std::shared_ptr<WireResidual> RingDomain::feedback_for(GroupRun &run, const OpRun &op) {
    ++wire_ops_[static_cast<size_t>(op.desc.wire) % kWireFormatCount];
    if (!op.feedback || op.desc.wire == WireFormat::Exact) return nullptr;
    const uint64_t bytes = op.desc.full_count() * sizeof(float), limit = config_.wire.feedback_max_bytes;
    if (bytes > limit) {
        if (feedback_refused_++ == 0)
            spdlog::warn("group {} op {}: error feedback needs {} bytes, more than wire.feedback_max_bytes ({}): it runs "
                         "without (counted in status)", op.group, op.seq, bytes, limit);
        return nullptr;
    }
    GroupRun::Feedback &f = run.feedback[op.feedback_tag];
    run.feedback_bytes += bytes - f.bytes;
    f.bytes = bytes;
    f.used = ++run.feedback_clock;
    if (!f.residual) f.residual = std::make_shared<WireResidual>();
    auto mine = f.residual;
    while (run.feedback_bytes > limit) {  // the least recently used other tag goes (an op still using it keeps it)
        auto lru = run.feedback.end();
        for (auto it = run.feedback.begin(); it != run.feedback.end(); ++it)
            if (it->first != op.feedback_tag && (lru == run.feedback.end() || it->second.used < lru->second.used)) lru = it;
        if (lru == run.feedback.end()) break;
        run.feedback_bytes -= lru->second.bytes;
        run.feedback.erase(lru);
        ++feedback_evicted_;
    }
    return mine;
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
    w.residual = feedback_for(run, op.run);
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
