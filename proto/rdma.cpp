#include "proto/rdma.h"

#include <cstring>
#include <string>

#include "proto/le.h"

namespace ringd::proto {
namespace {

Error bad(std::string msg) { return make_error(-EPROTO, "RDMA link info: " + std::move(msg)); }

}  // namespace

Bytes encode_rdma_link_info(const RdmaLinkInfo &i) {
    uint8_t p[kRdmaLinkInfoBytes] = {};
    le::put<uint32_t>(&p[0], kRdmaLinkVersion);
    le::put<uint32_t>(&p[4], i.qps);
    le::put<uint32_t>(&p[8], i.fifo_entries);
    le::put<uint16_t>(&p[12], i.lid);
    p[14] = i.mtu;
    std::memcpy(&p[16], i.gid.data(), 16);
    le::put<uint64_t>(&p[32], i.fifo_addr);
    le::put<uint32_t>(&p[40], i.fifo_rkey);
    for (uint32_t q = 0; q < kMaxRdmaQps; ++q) {
        le::put<uint32_t>(&p[48 + 8 * q], i.qpn[q]);
        le::put<uint32_t>(&p[52 + 8 * q], i.psn[q]);
    }
    return encode_frame(FrameType::RdmaLinkInfo, p);
}

Result<RdmaLinkInfo> decode_rdma_link_info(std::span<const uint8_t> p) {
    if (p.size() != kRdmaLinkInfoBytes)
        return bad("payload is " + std::to_string(p.size()) + " bytes, expected " + std::to_string(kRdmaLinkInfoBytes));
    if (const auto v = le::get<uint32_t>(&p[0]); v != kRdmaLinkVersion)
        return bad("version " + std::to_string(v) + ", this ringd speaks " + std::to_string(kRdmaLinkVersion));
    RdmaLinkInfo i;
    i.qps = le::get<uint32_t>(&p[4]);
    if (i.qps < 1 || i.qps > kMaxRdmaQps) return bad(std::to_string(i.qps) + " QPs (1.." + std::to_string(kMaxRdmaQps) + ")");
    i.fifo_entries = le::get<uint32_t>(&p[8]);
    if (i.fifo_entries < 1 || i.fifo_entries > 4096) return bad("FIFO of " + std::to_string(i.fifo_entries) + " entries");
    i.lid = le::get<uint16_t>(&p[12]);
    i.mtu = p[14];
    if (i.mtu < 1 || i.mtu > 5) return bad("path MTU code " + std::to_string(i.mtu));
    if (p[15] != 0) return bad("reserved byte is not zero");
    std::memcpy(i.gid.data(), &p[16], 16);
    i.fifo_addr = le::get<uint64_t>(&p[32]);
    i.fifo_rkey = le::get<uint32_t>(&p[40]);
    if (i.fifo_addr == 0) return bad("no FIFO address");
    if (le::get<uint32_t>(&p[44]) != 0) return bad("reserved bytes are not zero");
    for (uint32_t q = 0; q < kMaxRdmaQps; ++q) {
        i.qpn[q] = le::get<uint32_t>(&p[48 + 8 * q]);
        i.psn[q] = le::get<uint32_t>(&p[52 + 8 * q]);
        if (q < i.qps && (i.qpn[q] == 0 || i.qpn[q] > 0xffffff || i.psn[q] > 0xffffff))
            return bad("QP " + std::to_string(q) + ": qpn " + std::to_string(i.qpn[q]) + " psn " + std::to_string(i.psn[q]) +
                       " (24-bit, qpn non-zero)");
        if (q >= i.qps && (i.qpn[q] != 0 || i.psn[q] != 0)) return bad("unused QP entries are not zero");
    }
    return i;
}

Bytes encode_rdma_link_ready() { return encode_frame(FrameType::RdmaLinkReady, {}); }

}  // namespace ringd::proto
