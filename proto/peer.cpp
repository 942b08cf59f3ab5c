#include "proto/peer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "proto/le.h"
#include "proto/types.h"

namespace ringd::proto {
namespace {

Error bad(std::string msg) { return make_error(-EPROTO, std::move(msg)); }

void put_name(uint8_t *p, const std::string &s) {
    std::memset(p, 0, kNameBytes);
    std::memcpy(p, s.data(), std::min(s.size(), kNameBytes - 1));
}

Result<std::string> get_name(const uint8_t *p, const char *what) {
    size_t len = 0;
    while (len < kNameBytes && p[len] != 0) ++len;
    if (len == kNameBytes) return bad(std::string(what) + " is not NUL-terminated");
    for (size_t i = len; i < kNameBytes; ++i)
        if (p[i] != 0) return bad(std::string("bytes after the ") + what + "'s NUL are not zero");
    std::string s(reinterpret_cast<const char *>(p), len);
    if (auto why = check_name(what, s); !why.empty()) return bad(why);
    return s;
}

Result<Ok> expect_size(std::span<const uint8_t> p, size_t want, const char *what) {
    if (p.size() != want)
        return bad(std::string(what) + " payload is " + std::to_string(p.size()) + " bytes, expected " + std::to_string(want));
    return Ok{};
}

}  // namespace

std::string check_name(std::string_view what, std::string_view name) {
    if (name.empty()) return std::string(what) + " is empty";
    if (name.size() >= kNameBytes) return std::string(what) + " is longer than 63 bytes";
    for (char c : name)
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
            return std::string(what) + " '" + std::string(name) + "' may contain only letters, digits, '.', '_' and '-'";
    return {};
}

Bytes encode_peer_hello(const PeerHello &h) {
    uint8_t p[kPeerHelloBytes];
    put_name(&p[0], h.cluster);
    put_name(&p[kNameBytes], h.from);
    put_name(&p[2 * kNameBytes], h.to);
    le::put<uint32_t>(&p[3 * kNameBytes], static_cast<uint32_t>(h.kind));
    le::put<uint32_t>(&p[3 * kNameBytes + 4], h.stream);
    le::put<uint64_t>(&p[3 * kNameBytes + 8], h.generation);
    std::memcpy(&p[3 * kNameBytes + 16], h.nonce.data(), kNonceBytes);
    std::vector<uint8_t> v(p, p + kPeerHelloBytes);
    if (h.version >= 7) {
        uint8_t x[kPeerHelloV7Bytes] = {};
        std::memcpy(x, h.hosts.data(), kDigestBytes);
        std::memcpy(x + kDigestBytes, h.config_version.data(), std::min(h.config_version.size(), kConfigVersionBytes - 1));
        std::memcpy(x + kDigestBytes + kConfigVersionBytes, h.key.data(), kKeyIdBytes);
        std::memcpy(x + kDigestBytes + kConfigVersionBytes + kKeyIdBytes, h.previous_key.data(), kKeyIdBytes);
        le::put<uint64_t>(x + kDigestBytes + kConfigVersionBytes + 2 * kKeyIdBytes, h.instance);
        v.insert(v.end(), x, x + kPeerHelloV7Bytes);
    }
    v.insert(v.end(), h.domain.begin(), h.domain.begin() + static_cast<std::ptrdiff_t>(std::min(h.domain.size(), kMaxDomainBytes)));
    Bytes f = encode_frame(FrameType::PeerHello, v);
    le::put<uint16_t>(&f[4], h.version);
    return f;
}

namespace {

// A config version: printable ASCII, NUL-padded.
Result<std::string> get_config_version(const uint8_t *p) {
    std::string s(reinterpret_cast<const char *>(p), strnlen(reinterpret_cast<const char *>(p), kConfigVersionBytes));
    if (s.size() == kConfigVersionBytes) return bad("config version without its NUL");
    for (size_t i = s.size(); i < kConfigVersionBytes; ++i)
        if (p[i] != 0) return bad("bytes after the config version's NUL");
    for (char c : s)
        if (c < 0x21 || c > 0x7e) return bad("config version with a byte that is not printable");
    return s;
}

}  // namespace

Result<PeerHello> decode_peer_hello(std::span<const uint8_t> p, uint16_t version) {
    // The layouts from 6 on (a hello of 6 is refused before this, by its frame header: no ringd
    // of 6 is spoken to any more).
    if (version < kPeerBaseVersion || version > kPeerProtocolVersion)
        return make_error(-EPROTONOSUPPORT, "peer hello of version " + std::to_string(version));
    const size_t fixed = kPeerHelloBytes + (version >= 7 ? kPeerHelloV7Bytes : 0);
    if (p.size() < fixed || p.size() > fixed + kMaxDomainBytes)
        return bad("peer hello payload is " + std::to_string(p.size()) + " bytes, expected " + std::to_string(fixed) +
                   ".." + std::to_string(fixed + kMaxDomainBytes));
    PeerHello h;
    h.version = version;
    auto cluster = get_name(&p[0], "cluster");
    if (!cluster) return cluster.error();
    auto from = get_name(&p[kNameBytes], "host name");
    if (!from) return from.error();
    auto to = get_name(&p[2 * kNameBytes], "host name");
    if (!to) return to.error();
    h.cluster = *cluster;
    h.from = *from;
    h.to = *to;
    const auto kind = le::get<uint32_t>(&p[3 * kNameBytes]);
    if (kind > static_cast<uint32_t>(ConnKind::Mesh)) return bad("unknown connection kind " + std::to_string(kind));
    h.kind = static_cast<ConnKind>(kind);
    if (h.kind == ConnKind::Mesh && version < kMeshProtocol)
        return bad("mesh data stream in a hello of protocol " + std::to_string(version) + " (from " + std::to_string(kMeshProtocol) + ")");
    h.stream = le::get<uint32_t>(&p[3 * kNameBytes + 4]);
    // A control connection's stream field is its rail (several NICs per host: it moves to another
    // rail when its own fails); 0 with one.
    if (h.kind == ConnKind::Control && h.stream >= kMaxControlRails)
        return bad("control connection on rail " + std::to_string(h.stream) + " (at most " + std::to_string(kMaxControlRails) + ")");
    h.generation = le::get<uint64_t>(&p[3 * kNameBytes + 8]);
    if (h.generation > kMaxGeneration) return bad("hello announces generation " + std::to_string(h.generation) + ", beyond 2^40");
    std::memcpy(h.nonce.data(), &p[3 * kNameBytes + 16], kNonceBytes);
    if (version >= 7) {
        const uint8_t *x = &p[kPeerHelloBytes];
        std::memcpy(h.hosts.data(), x, kDigestBytes);
        auto cv = get_config_version(x + kDigestBytes);
        if (!cv) return cv.error();
        h.config_version = *cv;
        std::memcpy(h.key.data(), x + kDigestBytes + kConfigVersionBytes, kKeyIdBytes);
        std::memcpy(h.previous_key.data(), x + kDigestBytes + kConfigVersionBytes + kKeyIdBytes, kKeyIdBytes);
        h.instance = le::get<uint64_t>(x + kDigestBytes + kConfigVersionBytes + 2 * kKeyIdBytes);
    }
    h.domain.assign(reinterpret_cast<const char *>(p.data()) + fixed, p.size() - fixed);
    // Host names (each checked by whoever maps them to hosts), comma-separated.
    size_t at = 0;
    while (at < h.domain.size()) {
        const size_t end = std::min(h.domain.find(',', at), h.domain.size());
        if (auto why = check_name("domain host name", std::string_view(h.domain).substr(at, end - at)); !why.empty())
            return bad(why);
        at = end + 1;
        if (end < h.domain.size() && at == h.domain.size()) return bad("domain host list ends with ','");
    }
    return h;
}

Bytes encode_peer_challenge(const PeerChallenge &c) {
    uint8_t p[kNonceBytes + kMacBytes];
    std::memcpy(p, c.nonce.data(), kNonceBytes);
    std::memcpy(p + kNonceBytes, c.mac.data(), kMacBytes);
    return encode_frame(FrameType::PeerChallenge, p);
}

Result<PeerChallenge> decode_peer_challenge(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, kNonceBytes + kMacBytes, "peer challenge"); !s) return s.error();
    PeerChallenge c;
    std::memcpy(c.nonce.data(), p.data(), kNonceBytes);
    std::memcpy(c.mac.data(), p.data() + kNonceBytes, kMacBytes);
    return c;
}

Bytes encode_peer_auth(const Mac &mac) { return encode_frame(FrameType::PeerAuth, mac); }

Result<Mac> decode_peer_auth(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, kMacBytes, "peer auth"); !s) return s.error();
    Mac m;
    std::memcpy(m.data(), p.data(), kMacBytes);
    return m;
}

Bytes encode_peer_accept(uint64_t generation) {
    uint8_t p[8];
    le::put<uint64_t>(p, generation);
    return encode_frame(FrameType::PeerAccept, p);
}

Bytes peer_accept_fields(const PeerAccept &a) {
    Bytes p(8 + kDigestBytes + kConfigVersionBytes + 8, 0);
    le::put<uint64_t>(p.data(), a.generation);
    std::memcpy(p.data() + 8, a.hosts.data(), kDigestBytes);
    std::memcpy(p.data() + 8 + kDigestBytes, a.config_version.data(), std::min(a.config_version.size(), kConfigVersionBytes - 1));
    le::put<uint64_t>(p.data() + 8 + kDigestBytes + kConfigVersionBytes, a.instance);
    return p;
}

Bytes encode_peer_accept(const PeerAccept &a) {
    if (a.version < 7) return encode_peer_accept(a.generation);
    Bytes p = peer_accept_fields(a);
    p.insert(p.end(), a.mac.begin(), a.mac.end());
    Bytes f = encode_frame(FrameType::PeerAccept, p);
    le::put<uint16_t>(&f[4], a.version);
    return f;
}

Result<PeerAccept> decode_peer_accept(std::span<const uint8_t> p, uint16_t version) {
    PeerAccept a;
    a.version = version;
    if (version < 7) {
        if (auto s = expect_size(p, 8, "peer accept"); !s) return s.error();
        a.generation = le::get<uint64_t>(p.data());
        if (a.generation > kMaxGeneration) return bad("peer accept announces a generation beyond 2^40");
        return a;
    }
    if (auto s = expect_size(p, 8 + kDigestBytes + kConfigVersionBytes + 8 + kMacBytes, "peer accept"); !s) return s.error();
    a.generation = le::get<uint64_t>(p.data());
    if (a.generation > kMaxGeneration) return bad("peer accept announces a generation beyond 2^40");
    std::memcpy(a.hosts.data(), p.data() + 8, kDigestBytes);
    auto cv = get_config_version(p.data() + 8 + kDigestBytes);
    if (!cv) return cv.error();
    a.config_version = *cv;
    a.instance = le::get<uint64_t>(p.data() + 8 + kDigestBytes + kConfigVersionBytes);
    std::memcpy(a.mac.data(), p.data() + 8 + kDigestBytes + kConfigVersionBytes + 8, kMacBytes);
    return a;
}

Bytes encode_heartbeat(const Heartbeat &h) {
    uint8_t p[16];
    le::put<uint64_t>(&p[0], h.generation);
    le::put<uint64_t>(&p[8], h.seq);
    return encode_frame(FrameType::Heartbeat, p);
}

Result<Heartbeat> decode_heartbeat(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, 16, "heartbeat"); !s) return s.error();
    return Heartbeat{le::get<uint64_t>(&p[0]), le::get<uint64_t>(&p[8])};
}

Bytes encode_control_resume(const ControlResume &r) {
    uint8_t p[8];
    le::put<uint64_t>(&p[0], r.frames);
    return encode_frame(FrameType::ControlResume, p);
}

Result<ControlResume> decode_control_resume(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, 8, "control resume"); !s) return s.error();
    return ControlResume{le::get<uint64_t>(&p[0])};
}

Bytes encode_ring_ready(const RingReady &r) {
    uint8_t p[20] = {};
    le::put<uint64_t>(&p[0], r.generation);
    le::put<uint32_t>(&p[8], r.ready ? 1 : 0);
    le::put<uint32_t>(&p[16], r.protocol | uint32_t{r.flags} << 16);
    return encode_frame(FrameType::RingReady, std::span<const uint8_t>(p, r.protocol ? 20 : 16));
}

namespace {

// A generation's protocol as RingReady and RingStart say it (after version 6's layout, 9 on), and
// their flags (bits 16-31, 13 on): {protocol, flags}.
Result<std::pair<uint16_t, uint16_t>> trailing_protocol(std::span<const uint8_t> p, size_t at, const char *what) {
    if (p.size() == at) return std::pair<uint16_t, uint16_t>{0, 0};
    if (p.size() != at + 4) return bad(std::string(what) + " of " + std::to_string(p.size()) + " bytes");
    const uint32_t word = le::get<uint32_t>(&p[at]);
    const uint32_t v = word & 0xffff, flags = word >> 16;
    if (v < kPeerProtocolOldest || v > kPeerProtocolVersion)
        return bad(std::string(what) + " says protocol " + std::to_string(v) + " (this ringd speaks " +
                   std::to_string(kPeerProtocolOldest) + " to " + std::to_string(kPeerProtocolVersion) + ")");
    if (flags & ~uint32_t{kGenerationRingOnly} || (flags && v < kExchangeProtocol))
        return bad(std::string(what) + " says flags " + std::to_string(flags) + " at protocol " + std::to_string(v));
    return std::pair<uint16_t, uint16_t>{static_cast<uint16_t>(v), static_cast<uint16_t>(flags)};
}

}  // namespace

Result<RingReady> decode_ring_ready(std::span<const uint8_t> p) {
    if (p.size() < 16) return bad("ring ready of " + std::to_string(p.size()) + " bytes");
    const uint32_t ready = le::get<uint32_t>(&p[8]);
    if (ready > 1 || le::get<uint32_t>(&p[12]) != 0) return bad("ring ready has bad flags");
    if (le::get<uint64_t>(&p[0]) > kMaxGeneration) return bad("ring ready announces a generation beyond 2^40");
    auto v = trailing_protocol(p, 16, "ring ready");
    if (!v) return v.error();
    return RingReady{le::get<uint64_t>(&p[0]), ready == 1, v->first, v->second};
}

Bytes encode_ring_start(const RingStart &s) {
    uint8_t p[12] = {};
    le::put<uint64_t>(&p[0], s.generation);
    le::put<uint32_t>(&p[8], s.protocol | uint32_t{s.flags} << 16);
    return encode_frame(FrameType::RingStart, std::span<const uint8_t>(p, s.protocol ? 12 : 8));
}

Result<RingStart> decode_ring_start(std::span<const uint8_t> p) {
    if (p.size() < 8) return bad("ring start of " + std::to_string(p.size()) + " bytes");
    const uint64_t g = le::get<uint64_t>(&p[0]);
    if (g == 0) return bad("ring start with generation 0");
    if (g > kMaxGeneration) return bad("ring start with a generation beyond 2^40");
    auto v = trailing_protocol(p, 8, "ring start");
    if (!v) return v.error();
    return RingStart{g, v->first, v->second};
}

namespace {

// Appends a u32 length and the bytes of `m` (capped at kMaxErrorMessage).
void put_message(Bytes &p, const std::string &m) {
    const size_t len = std::min<size_t>(m.size(), kMaxErrorMessage);
    const size_t at = p.size();
    p.resize(at + 4 + len);
    le::put<uint32_t>(&p[at], static_cast<uint32_t>(len));
    std::memcpy(&p[at + 4], m.data(), len);
}

Result<std::string> get_message(std::span<const uint8_t> rest) {
    if (rest.size() < 4) return bad("message length missing");
    const auto len = le::get<uint32_t>(rest.data());
    if (len > kMaxErrorMessage || rest.size() - 4 != len) return bad("message length does not match the payload");
    return std::string(reinterpret_cast<const char *>(rest.data() + 4), len);
}

Result<std::string> get_group(const uint8_t *p) {
    size_t len = 0;
    while (len < kGroupNameBytes && p[len] != 0) ++len;
    if (len == kGroupNameBytes) return bad("group name is not NUL-terminated");
    for (size_t i = len; i < kGroupNameBytes; ++i)
        if (p[i] != 0) return bad("bytes after the group name's NUL are not zero");
    std::string g(reinterpret_cast<const char *>(p), len);
    if (auto why = check_group_name(g); !why.empty()) return bad(why);
    return g;
}

constexpr size_t kOpReportFixed = 8 + kGroupNameBytes + 8 + 8 + 4 + 4 + 4 + 4 + 8 + 4 + 4;
constexpr size_t kOpStartBytes = 8 + kGroupNameBytes + 8 + 8 + 4 + 4 + 8;
constexpr size_t kOpFailFixed = 8 + kGroupNameBytes + 8 + 4 + 4 + 8;
constexpr size_t kGroupJoinBytes = 8 + kGroupNameBytes + 8 + 8;
constexpr size_t kGroupIncarnationFixed = 8 + kGroupNameBytes + 8 + 8 + 4 + 4;
constexpr size_t kSoloLaneBytes = 12;  // lane, solo_epoch, total_ranks
// Ends a GroupIncarnation's rank map (protocol 10): bytes no message or solo lane ends with (a
// message is text; a solo lane's total_ranks is below 2^24).
constexpr uint32_t kRankMapMarker = 0xFE4B4E52;

size_t ranks_block_bytes(const std::vector<std::vector<uint32_t>> &host_ranks) {
    size_t n = 0;
    for (const auto &h : host_ranks) n += 4 + 4 * h.size();
    return n;
}

// The fixed fields of a report (OpReport and OpData share them), and their checks.
void put_report_fixed(uint8_t *p, const OpReport &r) {
    le::put<uint64_t>(&p[0], r.generation);
    put_name(&p[8], r.group);
    le::put<uint64_t>(&p[72], r.seq);
    le::put<uint64_t>(&p[80], r.count);
    le::put<uint32_t>(&p[88], r.dtype | (r.wire & 0xff) << 8);
    le::put<uint32_t>(&p[92], collective_is_rooted(static_cast<Collective>(r.collective)) ? (r.op & 0xff) | r.root << 8 : r.op);
    le::put<uint32_t>(&p[96], r.local_size);
    le::put<int32_t>(&p[100], r.status);
    le::put<uint64_t>(&p[104], r.incarnation);
    le::put<uint32_t>(&p[112], r.remaining_ms);
    // A deferred report names its algorithm (bits 8-15 of the flags word).
    le::put<uint32_t>(&p[116], r.flags | ((r.flags & kReportDeferred) ? (r.algorithm & 0xff) << 8 : 0) |
                                   (r.collective & 0xff) << 16);
}

Result<OpReport> get_report_fixed(std::span<const uint8_t> p, uint32_t max_ranks = kMaxLocalSize) {
    if (p.size() < kOpReportFixed) return bad("op report is too short");
    OpReport r;
    r.generation = le::get<uint64_t>(&p[0]);
    auto g = get_group(&p[8]);
    if (!g) return g.error();
    r.group = *g;
    r.seq = le::get<uint64_t>(&p[72]);
    r.count = le::get<uint64_t>(&p[80]);
    r.dtype = le::get<uint32_t>(&p[88]);
    r.wire = (r.dtype >> 8) & 0xff;
    if ((r.dtype >> 16) != 0 || r.wire >= kWireFormatCount) return bad("op report has an unknown dtype word " + std::to_string(r.dtype));
    r.dtype &= 0xff;
    r.op = le::get<uint32_t>(&p[92]);
    r.local_size = le::get<uint32_t>(&p[96]);
    r.status = le::get<int32_t>(&p[100]);
    r.incarnation = le::get<uint64_t>(&p[104]);
    r.remaining_ms = le::get<uint32_t>(&p[112]);
    r.flags = le::get<uint32_t>(&p[116]);
    r.collective = (r.flags >> 16) & 0xff;
    r.flags &= ~0xff0000u;
    if (r.collective >= kCollectiveCount) return bad("op report names collective " + std::to_string(r.collective));
    if (collective_is_rooted(static_cast<Collective>(r.collective))) {
        r.root = r.op >> 8;
        r.op &= 0xff;
        if (r.root >= kMaxGroupRanks) return bad("op report names root rank " + std::to_string(r.root));
    }
    if (r.flags & kReportDeferred) {
        r.algorithm = (r.flags >> 8) & 0xff;
        r.flags &= ~0xff00u;
        // One-/two-shot (1, 2) from protocol 8 on, doubling and halving-doubling (3, 4), and the
        // ring (0) in a solo lane.
        if (r.algorithm > 4) return bad("a deferred op report names algorithm " + std::to_string(r.algorithm));
    }
    if ((r.flags & ~(kReportAhead | kReportDeferred | kReportDone)) != 0) return bad("op report has unknown flags");
    if ((r.flags & kReportDone) && (r.status != 0 || !(r.flags & kReportDeferred)))
        return bad("a done report must be a deferred report of status 0");
    if ((r.flags & kReportAhead) && r.status == 0) return bad("an op report for an op ahead must be a failure");
    if (r.incarnation == 0) return bad("op report without an incarnation");
    if (r.status > 0) return bad("op report status must be 0 or a negative errno");
    if (r.status == 0) {
        if (r.dtype >= kDTypeCount || r.op >= kReduceOpCount) return bad("op report has an unknown dtype or op");
        if (r.local_size == 0 || r.local_size > max_ranks) return bad("op report has a bad local_size");
    }
    return r;
}

}  // namespace

Bytes encode_group_join(const GroupJoin &j) {
    Bytes p(kGroupJoinBytes + (j.local_size ? 4 : 0) + (j.ranks.empty() ? 0 : 4 + 4 * j.ranks.size()), 0);
    le::put<uint64_t>(&p[0], j.generation);
    put_name(&p[8], j.group);
    le::put<uint64_t>(&p[72], j.local_id);
    le::put<uint64_t>(&p[80], j.previous);
    if (j.local_size) le::put<uint32_t>(&p[kGroupJoinBytes], j.local_size);
    if (!j.ranks.empty()) {
        le::put<uint32_t>(&p[kGroupJoinBytes + 4], j.group_ranks);
        for (size_t i = 0; i < j.ranks.size(); ++i) le::put<uint32_t>(&p[kGroupJoinBytes + 8 + 4 * i], j.ranks[i]);
    }
    return encode_frame(FrameType::GroupJoin, p);
}

Result<GroupJoin> decode_group_join(std::span<const uint8_t> p) {
    if (p.size() != kGroupJoinBytes + 4 && p.size() < kGroupJoinBytes + 12)
        if (auto s = expect_size(p, kGroupJoinBytes, "group join"); !s) return s.error();
    GroupJoin j;
    j.generation = le::get<uint64_t>(&p[0]);
    auto g = get_group(&p[8]);
    if (!g) return g.error();
    j.group = *g;
    j.local_id = le::get<uint64_t>(&p[72]);
    j.previous = le::get<uint64_t>(&p[80]);
    if (p.size() > kGroupJoinBytes) j.local_size = le::get<uint32_t>(&p[kGroupJoinBytes]);
    if (j.local_size > kMaxLocalSize) return bad("group join says " + std::to_string(j.local_size) + " local ranks");
    if (j.local_id == 0) return bad("group join without a local incarnation");
    if (p.size() > kGroupJoinBytes + 4) {
        // Protocol 10: the group's ranks, then one rank per local rank.
        if (p.size() != kGroupJoinBytes + 8 + 4 * size_t{j.local_size})
            return bad("group join has " + std::to_string(p.size()) + " bytes for " + std::to_string(j.local_size) +
                       " local ranks");
        j.group_ranks = le::get<uint32_t>(&p[kGroupJoinBytes + 4]);
        if (j.group_ranks == 0 || j.group_ranks > kMaxGroupRanks) return bad("group join says a group of " + std::to_string(j.group_ranks) + " ranks");
        for (uint32_t i = 0; i < j.local_size; ++i) {
            j.ranks.push_back(le::get<uint32_t>(&p[kGroupJoinBytes + 8 + 4 * i]));
            if (j.ranks.back() >= j.group_ranks) return bad("group join says rank " + std::to_string(j.ranks.back()) +
                                                            " of a group of " + std::to_string(j.group_ranks));
        }
    }
    return j;
}

Bytes encode_group_incarnation(const GroupIncarnation &g) {
    Bytes p(kGroupIncarnationFixed, 0);
    le::put<uint64_t>(&p[0], g.generation);
    put_name(&p[8], g.group);
    le::put<uint64_t>(&p[72], g.local_id);
    le::put<uint64_t>(&p[80], g.incarnation);
    le::put<int32_t>(&p[88], g.code);
    put_message(p, g.message);
    if (g.solo_epoch != 0) {
        const size_t at = p.size();
        p.resize(at + kSoloLaneBytes);
        le::put<uint32_t>(&p[at], g.lane);
        le::put<uint32_t>(&p[at + 4], g.solo_epoch);
        le::put<uint32_t>(&p[at + 8], g.total_ranks);
    }
    if (!g.host_ranks.empty()) {
        // Protocol 10: every host's ranks, then their hosts' count and a marker, read from the end.
        for (const auto &h : g.host_ranks) {
            const size_t at = p.size();
            p.resize(at + 4 + 4 * h.size());
            le::put<uint32_t>(&p[at], static_cast<uint32_t>(h.size()));
            for (size_t i = 0; i < h.size(); ++i) le::put<uint32_t>(&p[at + 4 + 4 * i], h[i]);
        }
        const size_t at = p.size();
        p.resize(at + 12);
        le::put<uint32_t>(&p[at], static_cast<uint32_t>(g.host_ranks.size()));
        le::put<uint32_t>(&p[at + 4], static_cast<uint32_t>(ranks_block_bytes(g.host_ranks)));
        le::put<uint32_t>(&p[at + 8], kRankMapMarker);
    }
    return encode_frame(FrameType::GroupIncarnation, p);
}

Result<GroupIncarnation> decode_group_incarnation(std::span<const uint8_t> p) {
    if (p.size() < kGroupIncarnationFixed) return bad("group incarnation is too short");
    GroupIncarnation g;
    g.generation = le::get<uint64_t>(&p[0]);
    auto name = get_group(&p[8]);
    if (!name) return name.error();
    g.group = *name;
    g.local_id = le::get<uint64_t>(&p[72]);
    g.incarnation = le::get<uint64_t>(&p[80]);
    g.code = le::get<int32_t>(&p[88]);
    if (g.code > 0) return bad("group incarnation code must be 0 or a negative errno");
    if ((g.code == 0) != (g.incarnation != 0)) return bad("group incarnation must carry an incarnation or an error");
    auto rest = p.subspan(kGroupIncarnationFixed);
    // Protocol 10's rank map at the end: the hosts' ranks, their count, the block's bytes, the marker.
    if (rest.size() >= 12 && le::get<uint32_t>(rest.data() + rest.size() - 4) == kRankMapMarker) {
        const uint32_t hosts = le::get<uint32_t>(rest.data() + rest.size() - 12);
        const uint32_t bytes = le::get<uint32_t>(rest.data() + rest.size() - 8);
        if (hosts == 0 || bytes > rest.size() - 12) return bad("group incarnation has a bad rank map");
        auto block = rest.subspan(rest.size() - 12 - bytes, bytes);
        size_t at = 0, total = 0;
        for (uint32_t h = 0; h < hosts; ++h) {
            if (block.size() - at < 4) return bad("group incarnation's rank map is cut short");
            const uint32_t n = le::get<uint32_t>(&block[at]);
            if (n > kMaxLocalSize || block.size() - at - 4 < 4 * size_t{n}) return bad("group incarnation's rank map is cut short");
            auto &ranks = g.host_ranks.emplace_back();
            for (uint32_t i = 0; i < n; ++i) ranks.push_back(le::get<uint32_t>(&block[at + 4 + 4 * i]));
            at += 4 + 4 * size_t{n};
            total += n;
        }
        if (at != block.size()) return bad("group incarnation's rank map has bytes left over");
        // A permutation of 0 .. total - 1.
        std::vector<bool> seen(total, false);
        for (const auto &h : g.host_ranks)
            for (uint32_t r : h) {
                if (r >= total || seen[r]) return bad("group incarnation's rank map is not a permutation of its ranks");
                seen[r] = true;
            }
        rest = rest.first(rest.size() - 12 - bytes);
    }
    // The message, then a solo lane's fields when there is one.
    if (rest.size() >= 4 + kSoloLaneBytes && le::get<uint32_t>(rest.data()) == rest.size() - 4 - kSoloLaneBytes) {
        const uint8_t *x = rest.data() + rest.size() - kSoloLaneBytes;
        g.lane = le::get<uint32_t>(x);
        g.solo_epoch = le::get<uint32_t>(x + 4);
        g.total_ranks = le::get<uint32_t>(x + 8);
        if (g.solo_epoch == 0 || g.solo_epoch > 127 || g.total_ranks == 0 || g.total_ranks > (1u << 24) || g.incarnation == 0)
            return bad("group incarnation has a solo lane without an epoch (1-127), its ranks or an incarnation");
        rest = rest.first(rest.size() - kSoloLaneBytes);
    }
    auto m = get_message(rest);
    if (!m) return m.error();
    g.message = *m;
    return g;
}

Bytes encode_op_report(const OpReport &r) {
    Bytes p(kOpReportFixed, 0);
    put_report_fixed(p.data(), r);
    put_message(p, r.message);
    return encode_frame(FrameType::OpReport, p);
}

Result<OpReport> decode_op_report(std::span<const uint8_t> p) {
    auto r = get_report_fixed(p);
    if (!r) return r.error();
    auto m = get_message(p.subspan(kOpReportFixed));
    if (!m) return m.error();
    r->message = *m;
    return r;
}

static_assert(kOpDataHeaderBytes == kOpReportFixed + 8);

Bytes encode_op_data(const OpReport &r, OpDataKind kind, uint64_t data_bytes, uint32_t step) {
    Bytes frame = begin_op_data(r, kind, data_bytes, step);
    frame.resize(kFrameHeaderBytes + kOpDataHeaderBytes + data_bytes);  // (zeros, within the reserved room)
    return frame;
}

Bytes begin_op_data(const OpReport &r, OpDataKind kind, uint64_t data_bytes, uint32_t step) {
    Bytes frame;
    frame.reserve(kFrameHeaderBytes + kOpDataHeaderBytes + data_bytes + kFrameSealRoom);
    frame.resize(kFrameHeaderBytes + kOpDataHeaderBytes, 0);
    put_frame_header(frame.data(), FrameType::OpData, static_cast<uint32_t>(kOpDataHeaderBytes + data_bytes));
    OpReport ready = r;  // (the message does not come along)
    ready.status = 0;
    ready.flags = 0;
    put_report_fixed(&frame[kFrameHeaderBytes], ready);
    le::put<uint32_t>(&frame[kFrameHeaderBytes + kOpReportFixed], static_cast<uint32_t>(kind));
    if (kind >= OpDataKind::Doubling)
        le::put<uint32_t>(&frame[kFrameHeaderBytes + kOpReportFixed + 4], (r.algorithm << 16) | (step & 0xffff));
    else if (r.collective == static_cast<uint32_t>(Collective::AllToAll))
        le::put<uint32_t>(&frame[kFrameHeaderBytes + kOpReportFixed + 4], step);  // (parts << 16 | part)
    return frame;
}

Result<OpData> decode_op_data(std::span<const uint8_t> p) {
    if (p.size() < kOpDataHeaderBytes) return bad("op data is too short");
    // Kinds 4-8 carry in local_size the ranks their partial result or result holds (hosts' folded
    // together).
    const bool log_kind = le::get<uint32_t>(&p[kOpReportFixed]) >= static_cast<uint32_t>(OpDataKind::Doubling);
    auto r = get_report_fixed(p, log_kind ? kMaxLocalSize << 20 : kMaxLocalSize);
    if (!r) return r.error();
    if (r->status != 0) return bad("op data must carry status 0");
    r->flags = 0;  // (never set by a sender)
    const auto kind = le::get<uint32_t>(&p[kOpReportFixed]);
    if (kind < 1 || kind > kOpDataKinds) return bad("op data has an unknown kind " + std::to_string(kind));
    const auto k = static_cast<OpDataKind>(kind);
    const uint32_t word = le::get<uint32_t>(&p[kOpReportFixed + 4]);
    uint32_t step = 0;
    if (k < OpDataKind::Doubling) {
        // (all_to_all: its part number there, below)
        if (word != 0 && r->collective != static_cast<uint32_t>(Collective::AllToAll))
            return bad("op data's reserved field is not zero");
        r->algorithm = k == OpDataKind::OneShot ? 1 : 2;
    } else {
        r->algorithm = word >> 16;
        step = word & 0xffff;
        const bool doubling = k == OpDataKind::Doubling, halving = k == OpDataKind::Halving || k == OpDataKind::Gather;
        if (r->algorithm != 3 && r->algorithm != 4) return bad("op data has an unknown algorithm " + std::to_string(r->algorithm));
        if ((doubling && r->algorithm != 3) || (halving && r->algorithm != 4))
            return bad("op data of kind " + std::to_string(kind) + " is not of algorithm " + std::to_string(r->algorithm));
        if (step >= 64) return bad("op data has step " + std::to_string(step));
    }
    const uint64_t have = p.size() - kOpDataHeaderBytes;
    // Contributions and parts are partial results (f32 for f16/bf16 sum/avg), results the dtype.
    const auto dtype = static_cast<DType>(r->dtype);
    const bool result = k == OpDataKind::TwoShotResult || k == OpDataKind::Gather || k == OpDataKind::FoldOut;
    const uint64_t es = result ? dtype_size(dtype) : dtype_size(partial_dtype(dtype, static_cast<ReduceOp>(r->op)));
    const auto coll = static_cast<Collective>(r->collective);
    if (coll == Collective::AllToAll) {
        // all_to_all (protocol 11): one-shot, the sender's message to this host in parts of at
        // most kAllToAllPartBytes (the receiver checks the counts it carries against its ranks').
        if (k != OpDataKind::OneShot) return bad("op data of kind " + std::to_string(kind) + " for an all_to_all");
        const uint32_t word = le::get<uint32_t>(&p[kOpReportFixed + 4]);
        const uint32_t parts = word >> 16, part = word & 0xffff;
        if (parts == 0 || part >= parts || have > kAllToAllPartBytes)
            return bad("all_to_all op data is part " + std::to_string(part) + " of " + std::to_string(parts) + " with " +
                       std::to_string(have) + " bytes");
        return OpData{std::move(*r), k, word, p.subspan(kOpDataHeaderBytes)};
    }
    if (collective_is_rooted(coll) || coll == Collective::Barrier) {
        // broadcast, reduce, barrier (protocol 11): one-shot only, exactly the op's data (a
        // broadcast's in the dtype, a reduce's a partial result, a barrier's none).
        if (k != OpDataKind::OneShot) return bad("op data of kind " + std::to_string(kind) + " for a " + std::string(collective_name(coll)));
        const uint64_t want = coll == Collective::Barrier ? 0 : r->count * (coll == Collective::Broadcast ? dtype_size(dtype) : es);
        if (r->count > (uint64_t{1} << 40) || have != want)
            return bad("op data has " + std::to_string(have) + " data bytes for a " + std::string(collective_name(coll)) + " of " +
                       std::to_string(r->count) + " elements");
        return OpData{std::move(*r), k, step, p.subspan(kOpDataHeaderBytes)};
    }
    if (r->collective != static_cast<uint32_t>(Collective::Allreduce)) {
        // reduce_scatter, allgather (protocol 10): one-shot only, whole blocks of count elements
        // (reduce_scatter: partial results; allgather: the dtype); the receiver checks how many
        // against the group's rank map.
        if (k != OpDataKind::OneShot) return bad("op data of kind " + std::to_string(kind) + " for a reduce_scatter or allgather");
        const uint64_t block = r->count * (r->collective == static_cast<uint32_t>(Collective::Allgather) ? dtype_size(dtype) : es);
        if (r->count > (uint64_t{1} << 40) || (block == 0 ? have != 0 : have % block != 0 || have / block > kMaxGroupRanks))
            return bad("op data has " + std::to_string(have) + " data bytes, not whole blocks of " + std::to_string(r->count) +
                       " elements");
        return OpData{std::move(*r), k, step, p.subspan(kOpDataHeaderBytes)};
    }
    const uint64_t whole = r->count * es;
    const bool exact = k == OpDataKind::OneShot || k == OpDataKind::Doubling || k == OpDataKind::FoldIn || k == OpDataKind::FoldOut;
    if (r->count > (uint64_t{1} << 40) || have > whole || (exact && have != whole))
        return bad("op data has " + std::to_string(have) + " data bytes for " + std::to_string(r->count) + " elements");
    return OpData{std::move(*r), k, step, p.subspan(kOpDataHeaderBytes)};
}

Bytes encode_ring_abort(const RingAbort &a) {
    Bytes p(8, 0);
    le::put<uint64_t>(&p[0], a.generation);
    put_message(p, a.reason);
    return encode_frame(FrameType::RingAbort, p);
}

Result<RingAbort> decode_ring_abort(std::span<const uint8_t> p) {
    if (p.size() < 8) return bad("ring abort is too short");
    RingAbort a;
    a.generation = le::get<uint64_t>(&p[0]);
    auto m = get_message(p.subspan(8));
    if (!m) return m.error();
    a.reason = *m;
    return a;
}

Bytes encode_op_start(const OpStart &s) {
    uint8_t p[kOpStartBytes] = {};
    le::put<uint64_t>(&p[0], s.generation);
    put_name(&p[8], s.group);
    le::put<uint64_t>(&p[72], s.seq);
    le::put<uint64_t>(&p[80], s.op_id);
    le::put<uint32_t>(&p[88], s.total_ranks);
    le::put<uint32_t>(&p[92], s.lane);
    le::put<uint64_t>(&p[96], s.incarnation);
    return encode_frame(FrameType::OpStart, p);
}

Result<OpStart> decode_op_start(std::span<const uint8_t> p) {
    if (auto s = expect_size(p, kOpStartBytes, "op start"); !s) return s.error();
    OpStart s;
    s.generation = le::get<uint64_t>(&p[0]);
    auto g = get_group(&p[8]);
    if (!g) return g.error();
    s.group = *g;
    s.seq = le::get<uint64_t>(&p[72]);
    s.op_id = le::get<uint64_t>(&p[80]);
    s.total_ranks = le::get<uint32_t>(&p[88]);
    s.lane = le::get<uint32_t>(&p[92]);
    s.incarnation = le::get<uint64_t>(&p[96]);
    if (s.total_ranks == 0) return bad("op start with no ranks");
    if (s.incarnation == 0) return bad("op start without an incarnation");
    return s;
}

Bytes encode_op_fail(const OpFail &f, bool with_after) {
    Bytes p(kOpFailFixed, 0);
    le::put<uint64_t>(&p[0], f.generation);
    put_name(&p[8], f.group);
    le::put<uint64_t>(&p[72], f.seq);
    le::put<int32_t>(&p[80], f.code);
    le::put<uint64_t>(&p[88], f.incarnation);
    put_message(p, f.message);
    if (with_after) {
        const size_t at = p.size();
        p.resize(at + 8);
        le::put<uint64_t>(&p[at], f.after);
    }
    return encode_frame(FrameType::OpFail, p);
}

Result<OpFail> decode_op_fail(std::span<const uint8_t> p) {
    if (p.size() < kOpFailFixed) return bad("op fail is too short");
    OpFail f;
    f.generation = le::get<uint64_t>(&p[0]);
    auto g = get_group(&p[8]);
    if (!g) return g.error();
    f.group = *g;
    f.seq = le::get<uint64_t>(&p[72]);
    f.code = le::get<int32_t>(&p[80]);
    f.incarnation = le::get<uint64_t>(&p[88]);
    if (f.code >= 0) return bad("op fail code must be a negative errno");
    if (f.incarnation == 0) return bad("op fail without an incarnation");
    auto rest = p.subspan(kOpFailFixed);
    if (rest.size() >= 4 && rest.size() - 4 == static_cast<size_t>(le::get<uint32_t>(rest.data())) + 8) {
        // (protocol 11: `after`, following the message)
        f.after = le::get<uint64_t>(rest.data() + rest.size() - 8);
        rest = rest.first(rest.size() - 8);
    }
    auto m = get_message(rest);
    if (!m) return m.error();
    f.message = *m;
    return f;
}

}  // namespace ringd::proto
