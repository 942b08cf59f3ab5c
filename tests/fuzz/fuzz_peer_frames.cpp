// libFuzzer: what a peer may send on a control or data connection, frame after frame, through
// the header check and every peer decoder (handshake, heartbeats, op negotiation, op data, RDMA
// link info). An accepted frame must encode back to one that decodes the same; accepted op data
// is no larger than its collective allows.
#include <cstdint>
#include <span>

#include "proto/frame.h"
#include "proto/peer.h"
#include "proto/rdma.h"
#include "proto/types.h"

using namespace ringd;
using namespace ringd::proto;

namespace {

void must(bool ok) {
    if (!ok) __builtin_trap();
}

std::span<const uint8_t> payload_of(const Bytes &f) { return std::span<const uint8_t>(f).subspan(kFrameHeaderBytes); }

void one(FrameType type, std::span<const uint8_t> p) {
    switch (type) {
    case FrameType::PeerHello:
        if (auto h = decode_peer_hello(p)) {
            auto again = decode_peer_hello(payload_of(encode_peer_hello(*h)));
            must(again.ok() && again->from == h->from && again->to == h->to && again->domain == h->domain);
        }
        break;
    case FrameType::PeerChallenge: (void)decode_peer_challenge(p); break;
    case FrameType::PeerAuth: (void)decode_peer_auth(p); break;
    case FrameType::PeerAccept: (void)decode_peer_accept(p); break;
    case FrameType::Heartbeat: (void)decode_heartbeat(p); break;
    case FrameType::OpReport:
        if (auto r = decode_op_report(p)) {
            auto again = decode_op_report(payload_of(encode_op_report(*r)));
            must(again.ok() && again->group == r->group && again->count == r->count && again->message == r->message);
        }
        break;
    case FrameType::OpStart: (void)decode_op_start(p); break;
    case FrameType::OpFail:
        if (auto f = decode_op_fail(p)) {
            const auto again = decode_op_fail(payload_of(encode_op_fail(*f, f->after != 0)));
            must(again->message == f->message && again->after == f->after);
        }
        break;
    case FrameType::RingAbort: (void)decode_ring_abort(p); break;
    case FrameType::OpData:
        if (auto d = decode_op_data(p)) {
            if (d->report.collective == static_cast<uint32_t>(Collective::AllToAll)) {
                // A part of a message (its counts inside): at most a part's bytes, a part number
                // below the parts it says.
                must(d->data.size() <= kAllToAllPartBytes && (d->step >> 16) >= 1 && (d->step & 0xffff) < (d->step >> 16));
                break;
            }
            const auto coll = static_cast<Collective>(d->report.collective);
            const auto dt = static_cast<DType>(d->report.dtype);
            const uint64_t es = dtype_size(dt), ps = dtype_size(partial_dtype(dt, static_cast<ReduceOp>(d->report.op)));
            if (collective_blocked(coll)) {
                // Whole blocks of count elements (an allgather's in the dtype), at most one per rank.
                const uint64_t block = d->report.count * (coll == Collective::Allgather ? es : ps);
                must(block == 0 ? d->data.empty() : d->data.size() % block == 0 && d->data.size() / block <= kMaxGroupRanks);
                break;
            }
            if (collective_is_rooted(coll) || coll == Collective::Barrier) {
                // Exactly the op's data: a broadcast's in the dtype, a reduce's partial results.
                const uint64_t want = coll == Collective::Barrier ? 0 : d->report.count * (coll == Collective::Broadcast ? es : ps);
                must(d->data.size() == want);
                break;
            }
            // At most count elements, f16/bf16 contributions travelling as f32.
            uint64_t most = 0;
            if (!__builtin_mul_overflow(d->report.count, 2 * es, &most)) must(d->data.size() <= most);
        }
        break;
    case FrameType::RdmaLinkInfo:
        if (auto i = decode_rdma_link_info(p)) {
            auto again = decode_rdma_link_info(payload_of(encode_rdma_link_info(*i)));
            must(again.ok() && again->qps == i->qps && again->qpn == i->qpn && again->fifo_addr == i->fifo_addr);
        }
        break;
    case FrameType::GroupJoin: (void)decode_group_join(p); break;
    case FrameType::GroupIncarnation:
        if (auto g = decode_group_incarnation(p))
            must(decode_group_incarnation(payload_of(encode_group_incarnation(*g)))->message == g->message);
        break;
    case FrameType::RingReady: (void)decode_ring_ready(p); break;
    case FrameType::RingStart: (void)decode_ring_start(p); break;
    case FrameType::ControlResume:
        if (auto r = decode_control_resume(p)) must(decode_control_resume(payload_of(encode_control_resume(*r)))->frames == r->frames);
        break;
    default: break;
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    std::span<const uint8_t> in(data, size);
    while (in.size() >= kFrameHeaderBytes) {
        auto h = decode_frame_header(in.first(kFrameHeaderBytes), kMaxPeerPayload);
        if (!h) return 0;
        must(h->length <= kMaxPeerPayload);
        in = in.subspan(kFrameHeaderBytes);
        if (in.size() < h->length) return 0;
        one(h->type, in.first(h->length));
        in = in.subspan(h->length);
    }
    return 0;
}
