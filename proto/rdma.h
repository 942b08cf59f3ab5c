// What crosses between two daemons for an ibverbs link (daemon/transport/ibverbs/).
//
// Bring-up, on the link's authenticated data connection (after the peer handshake of
// proto/peer.h), both ends at once:
//   RdmaLinkInfo  {version, QPs, FIFO entries, LID, path MTU, GID, FIFO address + rkey,
//                  per QP: qpn and first PSN}
//   RdmaLinkReady {}   sent once this end's QPs are in RTS with their receives posted
// The connection then stays open, silent: its EOF tells that the peer is gone.
//
// On the data path nothing but RDMA: the receiver of a message writes a ClearToSend entry
// (where the message goes: address, rkey, length, tag) into the sender's FIFO with RDMA
// WRITE_WITH_IMM; the sender answers with an RDMA WRITE_WITH_IMM of the message itself into that
// address. Immediates: bit 31 set = ClearToSend number (seq mod 2^31), clear = message number.
#pragma once

#include <array>
#include <cstdint>
#include <span>

#include "proto/frame.h"

namespace ringd::proto {

inline constexpr uint32_t kRdmaLinkVersion = 1;
inline constexpr uint32_t kMaxRdmaQps = 8;
inline constexpr uint32_t kRdmaImmCts = 1u << 31;

struct RdmaLinkInfo {
    uint32_t qps = 1;
    uint32_t fifo_entries = 0;
    uint16_t lid = 0;
    uint8_t mtu = 0;  // enum ibv_mtu
    std::array<uint8_t, 16> gid{};
    uint64_t fifo_addr = 0;
    uint32_t fifo_rkey = 0;
    std::array<uint32_t, kMaxRdmaQps> qpn{};  // the first `qps` are used
    std::array<uint32_t, kMaxRdmaQps> psn{};
};
inline constexpr size_t kRdmaLinkInfoBytes = 48 + 8 * kMaxRdmaQps;

Bytes encode_rdma_link_info(const RdmaLinkInfo &i);
// Validates every field (version, QP count, 24-bit QPNs and PSNs, MTU, a non-zero FIFO).
Result<RdmaLinkInfo> decode_rdma_link_info(std::span<const uint8_t> payload);
Bytes encode_rdma_link_ready();

// One FIFO entry, written by the receiver into the sender's memory. Fixed little-endian layout;
// `seq` last, so that an entry is complete when its seq is (the write lands in order anyway).
struct ClearToSend {
    uint64_t addr;
    uint32_t rkey;
    uint32_t bytes;
    uint64_t tag;
    uint64_t seq;
};
static_assert(sizeof(ClearToSend) == 32);

}  // namespace ringd::proto
