#include "proto/frame.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <string_view>

#include "proto/le.h"
#include "proto/types.h"

namespace ringd::proto {
namespace {

Error bad(std::string msg) { return make_error(-EPROTO, std::move(msg)); }

bool peer_type(uint16_t t) { return t >= static_cast<uint16_t>(FrameType::PeerHello); }

bool known_type(uint16_t t) {
    return (t >= static_cast<uint16_t>(FrameType::Hello) && t <= static_cast<uint16_t>(FrameType::HelloShared)) ||
           (t >= static_cast<uint16_t>(FrameType::PeerHello) && t <= static_cast<uint16_t>(FrameType::ControlResume));
}

Result<Ok> expect_size(std::span<const uint8_t> payload, size_t want, const char *what) {
    if (payload.size() != want)
        return bad(std::string(what) + " payload is " + std::to_string(payload.size()) + " bytes, expected " +
                   std::to_string(want));
    return Ok{};
}

}  // namespace

void put_frame_header(uint8_t *at, FrameType type, uint32_t length) {
    le::put<uint32_t>(at, kFrameMagic);
    le::put<uint16_t>(at + 4, peer_type(static_cast<uint16_t>(type)) ? kPeerBaseVersion : kProtocolVersion);
    le::put<uint16_t>(at + 6, static_cast<uint16_t>(type));
    le::put<uint32_t>(at + 8, length);
    le::put<uint32_t>(at + 12, 0);
}

Bytes encode_frame(FrameType type, std::span<const uint8_t> payload) {
    Bytes out(kFrameHeaderBytes + payload.size());
    put_frame_header(out.data(), type, static_cast<uint32_t>(payload.size()));
    if (!payload.empty()) std::memcpy(&out[kFrameHeaderBytes], payload.data(), payload.size());
    return out;
}

Result<FrameHeader> decode_frame_header(std::span<const uint8_t> h, uint32_t max_payload) {
    if (h.size() != kFrameHeaderBytes) return bad("frame header is " + std::to_string(h.size()) + " bytes, expected 16");
    const auto magic = le::get<uint32_t>(&h[0]);
    if (magic != kFrameMagic) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "bad frame magic 0x%08x (expected 0x%08x)", magic, kFrameMagic);
        return bad(buf);
    }
    const auto version = le::get<uint16_t>(&h[4]);
    const auto type = le::get<uint16_t>(&h[6]);
    // Every peer frame but the handshake's says the layout version it has kept since 6; a hello
    // says the version its connection is to run at, which must be one this ringd speaks.
    const uint16_t lowest = type == static_cast<uint16_t>(FrameType::PeerHello) ? kPeerProtocolOldest : kPeerBaseVersion;
    if (peer_type(type) && (version < lowest || version > kPeerProtocolVersion))
        return make_error(-EPROTONOSUPPORT, "peer protocol version " + std::to_string(version) +
                                                " is not supported (this ringd speaks " + std::to_string(kPeerProtocolOldest) +
                                                " to " + std::to_string(kPeerProtocolVersion) +
                                                "): a ring's releases may differ by one at most (upgrade host by host)");
    if (!peer_type(type) && version != kProtocolVersion)
        return make_error(-EPROTONOSUPPORT, "protocol version " + std::to_string(version) + " is not supported (ringd speaks " +
                                                std::to_string(kProtocolVersion) + ")");
    if (!known_type(type)) return bad("unknown frame type " + std::to_string(type));
    const auto length = le::get<uint32_t>(&h[8]);
    if (length > max_payload)
        return make_error(-EMSGSIZE, "frame length " + std::to_string(length) + " exceeds the limit of " +
                                         std::to_string(max_payload) + " bytes");
    if (le::get<uint32_t>(&h[12]) != 0) return bad("reserved frame header field is not zero");
    return FrameHeader{static_cast<FrameType>(type), length, version};
}

std::string check_group_name(std::string_view name) {
    if (name.empty()) return "group name is empty";
    if (name.size() >= kGroupNameBytes)
        return "group name is " + std::to_string(name.size()) + " bytes, at most " + std::to_string(kGroupNameBytes - 1);
    for (char c : name) {
        const bool okc = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                         c == '_' || c == '-';
        if (!okc) return "group name may contain only letters, digits, '.', '_' and '-'";
    }
    return {};
}

Bytes encode_hello(const Hello &h) {
    uint8_t p[kHelloBytes] = {};
    le::put<uint32_t>(&p[0], h.local_rank);
    le::put<uint32_t>(&p[4], h.local_size);
    le::put<uint64_t>(&p[8], h.slot_bytes);
    std::memcpy(&p[16], h.group.data(), std::min(h.group.size(), kGroupNameBytes - 1));
    if (h.hosts.empty() && h.share_with == 0 && h.op_timeout_ms == 0 && h.ranks == 0) return encode_frame(FrameType::Hello, p);
    std::vector<uint8_t> v;
    if (h.share_with != 0) {
        v.resize(4);
        le::put<uint32_t>(v.data(), h.share_with);
    }
    v.insert(v.end(), p, p + kHelloBytes);
    v.insert(v.end(), h.hosts.begin(), h.hosts.begin() + static_cast<std::ptrdiff_t>(std::min(h.hosts.size(), kMaxHelloHostsBytes)));
    if (h.op_timeout_ms != 0 || h.ranks != 0) {
        uint8_t t[kHelloRanksBytes] = {};
        le::put<uint32_t>(&t[1], h.op_timeout_ms);
        le::put<uint32_t>(&t[5], h.rank);
        le::put<uint32_t>(&t[9], h.ranks);
        v.insert(v.end(), t, t + (h.ranks != 0 ? kHelloRanksBytes : kHelloTimeoutBytes));
    }
    return encode_frame(h.share_with != 0 ? FrameType::HelloShared : FrameType::Hello, v);
}

Result<Hello> decode_hello_shared(std::span<const uint8_t> p) {
    if (p.size() < 4) return bad("shared hello has " + std::to_string(p.size()) + " bytes");
    const uint32_t with = le::get<uint32_t>(p.data());
    if (with == 0) return make_error(-EINVAL, "shared hello names client 0");
    auto h = decode_hello(p.subspan(4));
    if (h) h->share_with = with;
    return h;
}

Result<Hello> decode_hello(std::span<const uint8_t> p) {
    if (p.size() < kHelloBytes || p.size() > kHelloBytes + kMaxHelloHostsBytes + kHelloRanksBytes)
        return bad("hello has " + std::to_string(p.size()) + " bytes, expected " + std::to_string(kHelloBytes) + " to " +
                   std::to_string(kHelloBytes + kMaxHelloHostsBytes + kHelloRanksBytes));
    Hello h;
    size_t hosts_end = p.size();
    for (size_t i = kHelloBytes; i < p.size(); ++i)
        if (p[i] == 0) {
            hosts_end = i;
            break;
        }
    if (const size_t trailer = p.size() - hosts_end; trailer == kHelloTimeoutBytes) {
        h.op_timeout_ms = le::get<uint32_t>(&p[hosts_end + 1]);
        if (h.op_timeout_ms == 0) return make_error(-EINVAL, "the hello's op timeout is 0 ms (leave it out for ringd's timeouts.op)");
    } else if (trailer == kHelloRanksBytes) {
        h.op_timeout_ms = le::get<uint32_t>(&p[hosts_end + 1]);
        h.rank = le::get<uint32_t>(&p[hosts_end + 5]);
        h.ranks = le::get<uint32_t>(&p[hosts_end + 9]);
        if (h.ranks == 0 || h.ranks > kMaxGroupRanks || h.rank >= h.ranks)
            return make_error(-EINVAL, "the hello's rank " + std::to_string(h.rank) + " of " + std::to_string(h.ranks) +
                                           " ranks is not a rank of a group of 1 to " + std::to_string(kMaxGroupRanks));
    } else if (trailer != 0) {
        return bad("the hello's trailer after the hosts has " + std::to_string(trailer) + " bytes, expected " +
                   std::to_string(kHelloTimeoutBytes) + " or " + std::to_string(kHelloRanksBytes));
    }
    if (hosts_end - kHelloBytes > kMaxHelloHostsBytes)
        return bad("the hello's hosts list is longer than " + std::to_string(kMaxHelloHostsBytes) + " bytes");
    h.hosts.assign(reinterpret_cast<const char *>(p.data()) + kHelloBytes, hosts_end - kHelloBytes);
    for (char ch : h.hosts)
        if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-' || ch == ',' || ch == ' '))
            return make_error(-EINVAL, "the hosts list may contain only host names (letters, digits, '.', '_', '-'), "
                                       "commas and spaces");
    h.local_rank = le::get<uint32_t>(&p[0]);
    h.local_size = le::get<uint32_t>(&p[4]);
    h.slot_bytes = le::get<uint64_t>(&p[8]);
    const auto *g = reinterpret_cast<const char *>(&p[16]);
    size_t len = 0;
    while (len < kGroupNameBytes && g[len] != '\0') ++len;
    if (len == kGroupNameBytes) return bad("group name is not NUL-terminated");
    for (size_t i = len; i < kGroupNameBytes; ++i)
        if (g[i] != '\0') return bad("bytes after the group name's NUL are not zero");
    h.group.assign(g, len);
    if (auto why = check_group_name(h.group); !why.empty()) return make_error(-EINVAL, why);
    if (h.local_size == 0 || h.local_size > kMaxLocalSize)
        return make_error(-EINVAL, "local_size " + std::to_string(h.local_size) + " is outside [1, " +
                                       std::to_string(kMaxLocalSize) + "]");
    if (h.local_rank >= h.local_size)
        return make_error(-EINVAL, "local_rank " + std::to_string(h.local_rank) + " is not below local_size " +
                                       std::to_string(h.local_size));
    if (h.slot_bytes == 0) return make_error(-EINVAL, "slot_bytes is 0");
    return h;
}

Bytes encode_welcome(const Welcome &w) {
    uint8_t p[kWelcomeBytes] = {};
    le::put<uint32_t>(&p[0], w.client_id);
    le::put<uint32_t>(&p[4], w.sq_depth);
    le::put<uint32_t>(&p[8], w.cq_depth);
    le::put<uint32_t>(&p[12], w.op_timeout_ms);
    le::put<uint64_t>(&p[16], w.map_bytes);
    le::put<uint64_t>(&p[24], w.data_offset);
    le::put<uint64_t>(&p[32], w.data_bytes);
    le::put<uint64_t>(&p[40], 0);
    return encode_frame(FrameType::Welcome, p);
}

Result<Welcome> decode_welcome(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, kWelcomeBytes, "welcome"); !s) return s.error();
    Welcome w;
    w.client_id = le::get<uint32_t>(&p[0]);
    w.sq_depth = le::get<uint32_t>(&p[4]);
    w.cq_depth = le::get<uint32_t>(&p[8]);
    w.op_timeout_ms = le::get<uint32_t>(&p[12]);
    w.map_bytes = le::get<uint64_t>(&p[16]);
    w.data_offset = le::get<uint64_t>(&p[24]);
    w.data_bytes = le::get<uint64_t>(&p[32]);
    if (le::get<uint64_t>(&p[40]) != 0) return bad("reserved welcome field is not zero");
    if (w.sq_depth == 0 || w.cq_depth == 0) return bad("welcome has an empty queue");
    if (w.data_offset > w.map_bytes || w.map_bytes - w.data_offset < w.data_bytes)
        return bad("welcome data area lies outside the slot");
    return w;
}

Bytes encode_cuda_register(const CudaRegister &r) {
    uint8_t p[kCudaRegisterBytes] = {};
    le::put<uint32_t>(&p[0], static_cast<uint32_t>(r.kind));
    le::put<uint32_t>(&p[4], 0);
    std::memcpy(&p[8], r.device_uuid, 16);
    le::put<uint64_t>(&p[24], r.alloc_bytes);
    le::put<uint64_t>(&p[32], r.offset);
    le::put<uint64_t>(&p[40], r.bytes);
    le::put<uint64_t>(&p[48], r.client_ptr);
    std::memcpy(&p[56], r.ipc_handle, kCudaIpcHandleBytes);
    // [120, 128) reserved, zero
    return encode_frame(FrameType::CudaRegister, p);
}

Result<CudaRegister> decode_cuda_register(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, kCudaRegisterBytes, "CUDA register"); !s) return s.error();
    CudaRegister r;
    const auto kind = le::get<uint32_t>(&p[0]);
    if (kind != static_cast<uint32_t>(CudaMemoryKind::Vmm) && kind != static_cast<uint32_t>(CudaMemoryKind::LegacyIpc))
        return bad("CUDA register: unknown memory kind " + std::to_string(kind));
    r.kind = static_cast<CudaMemoryKind>(kind);
    if (le::get<uint32_t>(&p[4]) != 0 || le::get<uint64_t>(&p[120]) != 0) return bad("CUDA register: reserved bytes are not zero");
    std::memcpy(r.device_uuid, &p[8], 16);
    r.alloc_bytes = le::get<uint64_t>(&p[24]);
    r.offset = le::get<uint64_t>(&p[32]);
    r.bytes = le::get<uint64_t>(&p[40]);
    r.client_ptr = le::get<uint64_t>(&p[48]);
    std::memcpy(r.ipc_handle, &p[56], kCudaIpcHandleBytes);
    uint64_t end = 0;
    if (r.bytes == 0) return bad("CUDA register: an empty range");
    if (__builtin_add_overflow(r.offset, r.bytes, &end) || end > r.alloc_bytes)
        return bad("CUDA register: range [" + std::to_string(r.offset) + ", +" + std::to_string(r.bytes) +
                   ") lies outside its " + std::to_string(r.alloc_bytes) + "-byte allocation");
    return r;
}

Bytes encode_cuda_unregister(uint64_t reg) {
    uint8_t p[kCudaUnregisterBytes];
    le::put<uint64_t>(&p[0], reg);
    return encode_frame(FrameType::CudaUnregister, p);
}

Result<uint64_t> decode_cuda_unregister(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, kCudaUnregisterBytes, "CUDA unregister"); !s) return s.error();
    return le::get<uint64_t>(&p[0]);
}

Bytes encode_cuda_reply(const CudaReply &r) {
    const size_t len = std::min<size_t>(r.message.size(), kMaxErrorMessage);
    Bytes p(16 + len);
    le::put<int32_t>(&p[0], r.status);
    le::put<uint32_t>(&p[4], static_cast<uint32_t>(len));
    le::put<uint64_t>(&p[8], r.reg);
    std::memcpy(p.data() + 16, r.message.data(), len);
    return encode_frame(FrameType::CudaReply, p);
}

Result<CudaReply> decode_cuda_reply(std::span<const uint8_t> p) {
    if (p.size() < 16) return bad("CUDA reply payload is " + std::to_string(p.size()) + " bytes, expected at least 16");
    CudaReply r;
    r.status = le::get<int32_t>(&p[0]);
    const auto len = le::get<uint32_t>(&p[4]);
    r.reg = le::get<uint64_t>(&p[8]);
    if (r.status > 0) return bad("CUDA reply status " + std::to_string(r.status) + " is positive");
    if (len > kMaxErrorMessage || p.size() != 16 + len) return bad("CUDA reply message length does not match");
    r.message.assign(reinterpret_cast<const char *>(p.data()) + 16, len);
    return r;
}

Bytes encode_error(const ErrorFrame &e) {
    const size_t len = std::min<size_t>(e.message.size(), kMaxErrorMessage);
    Bytes p(8 + len);
    le::put<int32_t>(&p[0], e.code);
    le::put<uint32_t>(&p[4], static_cast<uint32_t>(len));
    std::memcpy(p.data() + 8, e.message.data(), len);
    return encode_frame(FrameType::Error, p);
}

Result<ErrorFrame> decode_error(std::span<const uint8_t> p) {
    if (p.size() < 8) return bad("error payload is shorter than 8 bytes");
    ErrorFrame e;
    e.code = le::get<int32_t>(&p[0]);
    const auto len = le::get<uint32_t>(&p[4]);
    if (len > kMaxErrorMessage) return bad("error message length " + std::to_string(len) + " exceeds 1024");
    if (p.size() - 8 != len) return bad("error message length does not match the payload");
    if (e.code >= 0) return bad("error code " + std::to_string(e.code) + " is not a negative errno");
    e.message.assign(reinterpret_cast<const char *>(p.data() + 8), len);
    return e;
}

Bytes encode_status_request(const StatusRequest &r) {
    uint8_t p[kStatusRequestBytes];
    le::put<uint32_t>(&p[0], r.flags);
    return encode_frame(FrameType::StatusRequest, p);
}

Result<StatusRequest> decode_status_request(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, kStatusRequestBytes, "status request"); !s) return s.error();
    StatusRequest r{le::get<uint32_t>(&p[0])};
    if (r.flags != 0 && r.flags != kStatusDrain && r.flags != kStatusUndrain && r.flags != kStatusReload)
        return bad("status request flags must be 0, " + std::to_string(kStatusDrain) + " (drain), " +
                   std::to_string(kStatusUndrain) + " (undrain) or " + std::to_string(kStatusReload) + " (reload), not " +
                   std::to_string(r.flags));
    return r;
}

Bytes encode_status_reply(std::string_view json) {
    return encode_frame(FrameType::StatusReply,
                        std::span(reinterpret_cast<const uint8_t *>(json.data()), json.size()));
}

Result<std::string> decode_status_reply(std::span<const uint8_t> p) {
    return std::string(reinterpret_cast<const char *>(p.data()), p.size());
}

}  // namespace ringd::proto
