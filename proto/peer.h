// Frames between ringd daemons (same 16-byte header as proto/frame.h).
//
// Every connection between daemons — control or data stream — starts with this handshake,
// before any buffer address, key or data is exchanged:
//   dialer   -> PeerHello     {cluster, from, to, kind, stream, generation, nonce_d, domain}
//   listener -> PeerChallenge {nonce_l, mac_l = HMAC(secret, "ringd listener" | hello | nonce_l)}
//   dialer   -> PeerAuth      {mac_d = HMAC(secret, "ringd dialer" | hello | nonce_l)}
//   listener -> PeerAccept    {generation}
// Both MACs cover both nonces (nonce_d is inside the hello) and every hello field, so neither
// side can be impersonated or replayed. Without auth.secret_file the MACs are all zero and a
// peer that sends non-zero MACs (it has a secret) is refused, and the other way round.
//
// Versions (proto/frame.h). The dialer sends its hello at the newest version it speaks for that
// peer; a listener that speaks it answers in it, and the connection runs at it. A listener that
// does not refuses with an Error frame: the dialer then dials again one version lower, down to
// kPeerProtocolOldest, and keeps to that version for the host until a connection to it fails or
// its control connection ends (the host may come back upgraded). Only that Error frame lowers it:
// a close or reset at the hello is a host that died or restarted, an ordinary failed dial. Version 7 adds
// to the hello and the accept what each host runs: a digest of its host list, its config version
// (ringctl status), its ringd instance (a restart shows: the coordinator ends the runs of groups
// that had ranks on a ringd that restarted), and in the hello the key ids of the dialer's secrets — the one it uses and
// the one it accepted before a rotation (auth.rotation_grace) — so that the listener proves itself
// with a secret the dialer has.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "proto/frame.h"

namespace ringd::proto {

inline constexpr size_t kNameBytes = 64;  // cluster and host names, NUL-padded
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
inline constexpr uint32_t kMaxPeerPayload = 4096;

using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;
inline constexpr size_t kDigestBytes = 8;
inline constexpr size_t kConfigVersionBytes = 16;  // NUL-padded text
inline constexpr size_t kKeyIdBytes = 8;
using HostsDigest = std::array<uint8_t, kDigestBytes>;
using KeyId = std::array<uint8_t, kKeyIdBytes>;

// Mesh (protocol 12): a data stream between two hosts that are not ring neighbours, dialed by the
// one earlier in ring order; with the ring's own links it gives every pair of hosts a data link
// (all_to_all: daemon/engine/all_to_all_engine.h).
enum class ConnKind : uint32_t { Control = 0, Data = 1, Mesh = 2 };

struct PeerHello {
    std::string cluster;
    std::string from;  // the dialer's host name
    std::string to;    // the listener's host name, as the dialer knows it
    ConnKind kind = ConnKind::Control;
    uint32_t stream = 0;  // data stream index (< tcp.streams); kRejoinStream: see there; control: its rail (0 with one)
    uint64_t generation = 0;
    Nonce nonce{};
    // The ring domain the connection belongs to (after the fixed part, protocol v4): the names
    // of its hosts in ring order, comma-separated; empty = every configured host. A group over
    // part of the ring runs in the domain of its hosts, with connections of its own.
    std::string domain;
    // Version 7 (between the fixed part and the domain): what the dialer runs.
    uint16_t version = kPeerProtocolVersion;  // the frame's; the layout follows it
    HostsDigest hosts{};                      // of its whole host list (names, addresses, ports)
    std::string config_version{};             // its config file's (at most kConfigVersionBytes - 1)
    KeyId key{}, previous_key{};              // its secret's id and the one it still accepts (0: none)
    uint64_t instance = 0;                    // its ringd process's (random at start): a restart shows
};
// A data stream's index with this bit: a new connection for a rail that failed in the running
// generation (its hello's generation), replacing one of that rail's (several rails, TCP); it
// does not re-form the ring.
inline constexpr uint32_t kRejoinStream = 1u << 31;
// A control connection's "stream" is the rail it runs on, below this (config: kMaxRails).
inline constexpr uint32_t kMaxControlRails = 16;
inline constexpr size_t kPeerHelloBytes = 3 * kNameBytes + 16 + kNonceBytes;  // the fixed part
inline constexpr size_t kPeerHelloV7Bytes = kDigestBytes + kConfigVersionBytes + 2 * kKeyIdBytes + 8;  // then this
inline constexpr size_t kMaxDomainBytes = 3072;
// The largest ring generation a host may announce (hello, accept, RingReady, RingStart): a
// generation counts ring formations, and agreed incarnations are generation << 24 | counter.
// Beyond it the frame is refused (a corrupt state file or a forged value would otherwise wrap
// the counter, and a ring could never form again).
inline constexpr uint64_t kMaxGeneration = uint64_t{1} << 40;

// The listener's answer: the generation it has seen, and from version 7 what it runs, under a
// MAC: HMAC(secret, "ringd accept" | hello | the fields before the MAC | nonce_l) (zero without a
// secret), so that nothing in it can be changed on the way (version 6's accept has none).
struct PeerAccept {
    uint64_t generation = 0;
    uint16_t version = kPeerProtocolVersion;
    HostsDigest hosts{};
    std::string config_version;
    uint64_t instance = 0;
    Mac mac{};
};
// What the accept's MAC covers of it (version 7): its fields before the MAC, as sent.
Bytes peer_accept_fields(const PeerAccept &a);

struct PeerChallenge {
    Nonce nonce{};
    Mac mac{};
};

struct Heartbeat {
    uint64_t generation = 0;
    uint64_t seq = 0;
};

// Op negotiation. Ops are paired across hosts by (group, incarnation, seq): seq is the
// trainers' own op number (every local rank of a group submits the same seq), and the
// incarnation is what the hosts agreed a group's run is. A group whose local ranks all left and
// joined again is a new local incarnation on its host (a fresh `local_id`); before its first op
// in a ring generation a host sends GroupJoin to the coordinator (the first host in ring order),
// which agrees on an incarnation once every host joined — fresh on every host (a restarted job),
// or the same earlier incarnation on every host (a job that goes on after a ring generation
// ended) — and answers each host with GroupIncarnation. A job restarted on some hosts only is
// refused on the hosts that still run the earlier incarnation. The coordinator matches the hosts'
// reports and answers every host that reported an op with OpStart or OpFail; OpStarts go out in
// one order that every host's progress thread follows.
struct GroupJoin {
    uint64_t generation = 0;  // the coordinator's generation the host reports in
    std::string group;
    uint64_t local_id = 0;  // this host's incarnation of the group (unique on the host)
    uint64_t previous = 0;  // the agreed incarnation it ran as in an earlier generation; 0: fresh
                            // kIncarnationEnds: withdrawn, its ranks left before it was agreed
    // Its local ranks (0: not said). Sent, after the fields above, only in a ring generation whose
    // every host speaks protocol 8: the coordinator needs every host's to give an incarnation a
    // solo lane (GroupIncarnation::solo_epoch), whose ops need no OpStart to learn avg's divisor.
    uint32_t local_size = 0;
    // Protocol 10, after local_size, when the group's trainers said their ranks (Hello::ranks):
    // the group's ranks and the rank of each local rank (index: local rank). Empty: not said.
    uint32_t group_ranks = 0;
    std::vector<uint32_t> ranks{};
};
struct GroupIncarnation {
    uint64_t generation = 0;
    std::string group;
    uint64_t local_id = 0;     // the recipient's, from its GroupJoin
    uint64_t incarnation = 0;  // agreed, unique in the cluster; 0 when refused
    int32_t code = 0;          // 0, or a negative errno: this local incarnation cannot run
    std::string message;
    // A solo lane (protocol 8; after the message, only when solo_epoch != 0): the incarnation has
    // lane `lane` alone and every host starts its ring ops there by itself, in seq order, without
    // reporting them (daemon/transport/transport.h, solo op tags; the epoch, 1-127, is the lane's
    // grant, in those tags). total_ranks: avg's divisor, every host's local ranks.
    uint32_t lane = 0;
    uint32_t solo_epoch = 0;
    uint32_t total_ranks = 0;
    // Protocol 10, at the end, when every host's join said its ranks: the agreed rank map, each
    // host's ranks (index: the host's position in the domain's ring order, then local rank).
    std::vector<std::vector<uint32_t>> host_ranks{};
};
// seq of an OpReport with a non-zero status that ends the incarnation here (its local ranks
// left): every op of the incarnation that is pending or reported later fails with its message,
// but for the ops it says this host ended already: its `count`, when not 0, is 1 + the seq through
// which every op of the incarnation has ended here (completed, or failed and reported), so that an
// op whose data this host sent before its ranks left still completes on the others (a reduce's
// ranks off the root's host, whose op ends once sent, that exit at once). Sent only in a
// generation of protocol 11 (before it the count is 0, and every pending op fails).
inline constexpr uint64_t kIncarnationEnds = UINT64_MAX;
struct OpReport {
    uint64_t generation = 0;  // the coordinator's generation the host reports in
    std::string group;
    uint64_t seq = 0;
    uint64_t count = 0;
    uint32_t dtype = 0;
    uint32_t op = 0;
    uint32_t local_size = 0;
    int32_t status = 0;   // 0: ready; negative errno: the op failed on this host
    std::string message;  // why, when status != 0 (at most kMaxErrorMessage bytes)
    // How the op runs (0 = ring; else the OpData kind it came with, see below): on the wire only
    // in a deferred report (bits 8-15 of the flags word).
    uint32_t algorithm = 0;
    uint64_t incarnation = 0;  // agreed (GroupIncarnation)
    // Milliseconds left until the op's deadline on this host (its first local submission +
    // timeouts.op): the coordinator decides by the earliest deadline of the hosts that reported.
    uint32_t remaining_ms = 0;
    // kReportAhead: the reporting host has not reached this op; one of its bounds failed it (its
    // backlog of the op's data from hosts that are ahead). The op fails everywhere, but the report
    // says nothing of how far the host got.
    // kReportDeferred (protocol 8): an op of a direct algorithm (one-/two-shot, recursive doubling
    // or halving-doubling: the algorithm in bits 8-15), which hosts report only when it has not
    // completed after a while here, or when a peer's data does not match this host's op: the
    // coordinator then decides it like any other (mismatch, timeout naming the hosts that did not
    // report), but the report says nothing of the progress of hosts that did not send one (they
    // may be past the op, having completed it).
    // kReportDone (protocol 8): a deferred op this host reported has completed here (status 0): every
    // host contributed, and the coordinator forgets it.
    uint32_t flags = 0;
    // Collective (protocol 10: bits 16-23 of the flags word; 0, allreduce, is the layout before).
    uint32_t collective = 0;
    // Broadcast, reduce (protocol 11): the root rank, in bits 8-31 of the op word (the op in bits
    // 0-7; every other collective's op word is the op alone).
    uint32_t root = 0;
    // The op's WireFormat (protocol 11): bits 8-15 of the dtype word (0, exact, is the layout before).
    uint32_t wire = 0;
};
inline constexpr uint32_t kReportAhead = 1;
inline constexpr uint32_t kReportDeferred = 2;
inline constexpr uint32_t kReportDone = 4;
struct OpStart {
    uint64_t generation = 0;
    std::string group;
    uint64_t seq = 0;
    uint64_t op_id = 0;        // unique within the generation: tags the op's messages
    uint32_t total_ranks = 0;  // avg divides by this
    uint64_t incarnation = 0;
    // The lane it runs in (tuning.lanes): each lane of a ring domain has its own data links and
    // progress thread, and runs its ops in this order; the coordinator gives each incarnation one.
    uint32_t lane = 0;
};
struct OpFail {
    uint64_t generation = 0;
    std::string group;
    uint64_t seq = 0;
    int32_t code = 0;
    std::string message;
    uint64_t incarnation = 0;
    // seq kIncarnationEnds (the incarnation ended on a host): its ops up to this seq go on, those
    // after it fail (OpReport's count above, less one). On the wire after the message, 8 bytes,
    // only in a generation of protocol 11 (encode_op_fail's `with_after`); absent: 0.
    uint64_t after = 0;
};

// Small ops skip the ring and travel on the control connections as OpData: the op's report, a
// kind, and data. Two algorithms (daemon/engine/tuner.h):
//   one-shot  every host sends its contribution (its local ranks already reduced, count elements
//             of partial_dtype: f32 for f16/bf16 sum/avg, else the dtype) to every other host,
//             and each reduces the n contributions in ring order itself: one hop.
//   two-shot  every host sends segment j of its contribution to host j (kind TwoShotPart);
//             host j reduces segment j and sends the result, in the dtype, to every other host
//             (TwoShotResult): two hops, and 2(n-1)/n S bytes on each link like the ring (f16/bf16
//             sum/avg: parts in f32, 1.5x).
// Segments are the ring's: [count * j / n, count * (j + 1) / n). The coordinator gets every
// host's OneShot or TwoShotPart frame as its report; it stays the one that fails an op
// (mismatch, a host's local failure, a host that does not report in time) with OpFail, and
// otherwise decides it without a message.
//
// Protocol 8 adds two algorithms whose step count grows like log2 n (daemon/exchange/), with p the
// largest power of two <= n; the first 2(n - p) hosts pair up and the odd one of each pair folds
// its contribution into the even one first (FoldIn) and gets the result back at the end
// (FoldOut), so that p hosts run the steps:
//   doubling          log2 p steps; in step k a host and the host 2^k away (among the p) swap their
//                     whole partial results (Doubling) and combine them, the lower host's first, so
//                     that both hold the same bits.
//   halving-doubling  a reduce-scatter by recursive halving (Halving: in step k half of what is left
//                     to the host 2^(log2 p - 1 - k) away) leaves host j of the p with the reduced
//                     block j; an allgather by recursive doubling (Gather, in the dtype) spreads it.
// Their OpData carries the step and the algorithm in the field that is reserved for kinds 1-3
// (step in the low 16 bits, the algorithm, 3 or 4, in the high 16), their local_size is the ranks
// the data holds (every rank of the hosts folded into it so far: avg divides by their sum), and
// their reports go to the coordinator only when needed (kReportDeferred). Doubling, Halving and FoldIn data are partial
// results; Gather and FoldOut data are in the dtype.
//
// Protocol 10: a reduce_scatter's or allgather's OpData (the report's collective set; count = one
// rank's block) is OneShot, whole blocks: a reduce_scatter's to host j the blocks of j's ranks, in
// j's local-rank order, partial results; an allgather's the sender's ranks' blocks, in its
// local-rank order, in the dtype. The receiver checks how many against the group's rank map.
//
// Protocol 11: a broadcast's, reduce's or barrier's OpData is OneShot with exactly the op's data:
// a broadcast's from the root rank's host to every other host, its root's buffer (the dtype); a
// reduce's from every other host to the root's, its local ranks reduced (a partial result); a
// barrier's from every host to every other, empty (a host's barrier ends once every other host's
// message is in). An all_to_all's is OneShot too, one message from each host to each other host
// in parts of at most kAllToAllPartBytes, whose `step` word is (parts << 16 | part): the message is
// the sender's local ranks x the receiver's ranks' element counts (uint64, the sender's local-rank
// order, then the receiver's), then those blocks in the same order, in the dtype.
// (4 MiB: the first part of each message is on the wire, and a receiver delivers each part into
// its ranks' outputs, while the rest is still being copied and sent.)
inline constexpr uint64_t kAllToAllPartBytes = 4 << 20;
enum class OpDataKind : uint32_t {
    OneShot = 1,
    TwoShotPart = 2,
    TwoShotResult = 3,
    Doubling = 4,
    Halving = 5,
    Gather = 6,
    FoldIn = 7,
    FoldOut = 8
};
inline constexpr uint32_t kOpDataKinds = 8;
inline constexpr size_t kOpDataHeaderBytes = 120 + 8;  // the OpReport fields, kind, step/algorithm
struct OpData {
    OpReport report;                // status 0, algorithm = 1 (one-shot) ... 4 (halving-doubling)
    OpDataKind kind = OpDataKind::OneShot;
    uint32_t step = 0;              // kinds 4-8
    std::span<const uint8_t> data;  // into the decoded payload
};
// A whole OpData frame with `data_bytes` zero bytes of data at op_data_offset(), to be filled
// in place (the local ranks are reduced straight into the frame).
// Kinds 4-8 carry `step` and r.algorithm.
Bytes encode_op_data(const OpReport &r, OpDataKind kind, uint64_t data_bytes, uint32_t step = 0);
// The same frame up to op_data_offset() only, its length saying `data_bytes`: the caller appends
// exactly that much (no pass over the data to zero it first). Both reserve the data's room and
// kFrameSealRoom past it.
Bytes begin_op_data(const OpReport &r, OpDataKind kind, uint64_t data_bytes, uint32_t step = 0);
// Room an encoder leaves past a large frame, so that a connection's MAC tag (16 bytes) is
// appended in place.
inline constexpr size_t kFrameSealRoom = 16;
inline constexpr size_t op_data_offset() { return kFrameHeaderBytes + kOpDataHeaderBytes; }
// Checks the report and that the data is no longer than count elements (of partial_dtype for
// OneShot, TwoShotPart, Doubling, Halving and FoldIn, of the dtype for TwoShotResult, Gather and
// FoldOut; exactly count for OneShot, Doubling, FoldIn and FoldOut); the receiver checks a
// segment's exact length.
Result<OpData> decode_op_data(std::span<const uint8_t> payload);

// Ring generations are agreed: a host whose links of the next ring (control connections to
// every peer, data connections to its next and from its previous host) are up says so to the
// coordinator (RingReady, repeated while it waits, and again with ready = 0 when a link drops);
// once every host is ready the coordinator starts the ring as a generation newer than any a
// host has seen (RingStart, to every host), and every host hands its links to its progress
// thread as that generation. A host whose links are no longer up when RingStart comes ends that
// generation at once (RingAbort). So every host runs the same generation number, and a host
// never waits in a ring the others are not in.
//
// From protocol 9 on the generation's protocol is agreed the same way: a host's RingReady says the
// oldest version of its control connections (what it can run the generation at), the coordinator
// takes the oldest of every host's and its own, and RingStart says it. Every host then chooses
// algorithms, solo lanes and frame layouts by that one value. The field trails version 6's layout,
// and only on a connection of 9 or later (0 = not said: a ringd of 8 sends none and reads none).
// RingReady's and RingStart's flags (protocol 13 on, bits 16-31 of the protocol word): this host's
// wire.schedule is ring; the generation runs compressed allreduces on the ring.
inline constexpr uint16_t kGenerationRingOnly = 1;
struct RingReady {
    uint64_t generation = 0;  // the newest generation this host has seen
    bool ready = false;
    uint16_t protocol = 0;    // the oldest version of this host's control connections; 0 = not said
    uint16_t flags = 0;       // kGenerationRingOnly (protocol 13 on)
};
Bytes encode_ring_ready(const RingReady &r);
Result<RingReady> decode_ring_ready(std::span<const uint8_t> payload);
struct RingStart {
    uint64_t generation = 0;
    uint16_t protocol = 0;  // the generation's protocol; 0 = not said (a coordinator of 8)
    uint16_t flags = 0;     // kGenerationRingOnly (protocol 13 on)
};
Bytes encode_ring_start(const RingStart &s);
Result<RingStart> decode_ring_start(std::span<const uint8_t> payload);

// Sent to every peer by a host that ends the ring generation, before its data links close, so
// that every host fails its ops with the reason that names the culprit host.
struct RingAbort {
    uint64_t generation = 0;
    std::string reason;
};
Bytes encode_ring_abort(const RingAbort &a);
Result<RingAbort> decode_ring_abort(std::span<const uint8_t> payload);

Bytes encode_group_join(const GroupJoin &j);
Result<GroupJoin> decode_group_join(std::span<const uint8_t> payload);
Bytes encode_group_incarnation(const GroupIncarnation &g);
Result<GroupIncarnation> decode_group_incarnation(std::span<const uint8_t> payload);
Bytes encode_op_report(const OpReport &r);
Result<OpReport> decode_op_report(std::span<const uint8_t> payload);
Bytes encode_op_start(const OpStart &s);
Result<OpStart> decode_op_start(std::span<const uint8_t> payload);
Bytes encode_op_fail(const OpFail &f, bool with_after = false);
Result<OpFail> decode_op_fail(std::span<const uint8_t> payload);

// In h.version's layout (6 or 7); decoding takes the frame header's version.
Bytes encode_peer_hello(const PeerHello &h);
Result<PeerHello> decode_peer_hello(std::span<const uint8_t> payload, uint16_t version = kPeerProtocolVersion);
Bytes encode_peer_challenge(const PeerChallenge &c);
Result<PeerChallenge> decode_peer_challenge(std::span<const uint8_t> payload);
Bytes encode_peer_auth(const Mac &mac);
Result<Mac> decode_peer_auth(std::span<const uint8_t> payload);
Bytes encode_peer_accept(uint64_t generation);  // version 6's
Bytes encode_peer_accept(const PeerAccept &a);
Result<PeerAccept> decode_peer_accept(std::span<const uint8_t> payload, uint16_t version = kPeerBaseVersion);
Bytes encode_heartbeat(const Heartbeat &h);
Result<Heartbeat> decode_heartbeat(std::span<const uint8_t> payload);
// Several rails: the first frame on a control connection that replaces one whose rail failed
// (same ringd process at both ends): how many frames this host read from the old one, so that
// the other sends again exactly those it read not (ControlPlane::salvage).
struct ControlResume {
    uint64_t frames = 0;
};
Bytes encode_control_resume(const ControlResume &r);
Result<ControlResume> decode_control_resume(std::span<const uint8_t> payload);

// Cluster and host names: 1..63 bytes of [A-Za-z0-9._-]; empty string when valid.
std::string check_name(std::string_view what, std::string_view name);

}  // namespace ringd::proto
