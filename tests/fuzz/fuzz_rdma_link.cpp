// libFuzzer: an ibverbs link's bring-up as the transport reads it from the peer's data
// connection (daemon/transport/ibverbs/ibverbs_transport.cpp): a frame header checked against
// the RdmaLinkInfo cap, then the payload through decode_rdma_link_info. Whatever is accepted
// re-encodes to the same bytes, with QPNs and PSNs in 24 bits, a known MTU, 1..kMaxRdmaQps QPs
// and a FIFO of 1..4096 entries that exists.
#include <cstdint>
#include <cstring>

#include "proto/rdma.h"

using namespace ringd::proto;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < kFrameHeaderBytes) return 0;
    auto h = decode_frame_header(std::span(data, kFrameHeaderBytes), kRdmaLinkInfoBytes);
    if (!h) return 0;
    if (h->length > kRdmaLinkInfoBytes) __builtin_trap();  // the cap held
    const std::span<const uint8_t> payload(data + kFrameHeaderBytes, std::min<size_t>(size - kFrameHeaderBytes, h->length));
    auto i = decode_rdma_link_info(payload);
    if (!i) return 0;
    if (i->qps == 0 || i->qps > kMaxRdmaQps || i->fifo_addr == 0 || i->fifo_entries == 0 || i->fifo_entries > 4096 ||
        i->mtu < 1 || i->mtu > 5)
        __builtin_trap();
    for (uint32_t q = 0; q < i->qps; ++q)
        if (i->qpn[q] >= (1u << 24) || i->psn[q] >= (1u << 24)) __builtin_trap();
    const Bytes again = encode_rdma_link_info(*i);
    if (again.size() != kFrameHeaderBytes + payload.size() ||
        std::memcmp(again.data() + kFrameHeaderBytes, payload.data(), payload.size()) != 0)
        __builtin_trap();
    return 0;
}
