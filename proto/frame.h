// Client <-> daemon frames on the Unix socket.
//
// Every frame is a 16-byte header followed by `length` payload bytes, all little-endian:
//   u32 magic "RNGD" | u16 version | u16 type | u32 length | u32 reserved (0)
// Decoders validate every field and return an Error naming what is wrong; lengths are checked
// against a per-direction cap before anything is allocated. tests/unit/test_frame.cpp pins the
// exact bytes of each frame.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "proto/result.h"

namespace ringd::proto {

using Bytes = std::vector<uint8_t>;

inline constexpr uint32_t kFrameMagic = 0x44474E52;  // bytes 'R' 'N' 'G' 'D'
inline constexpr uint16_t kProtocolVersion = 1;      // frames between trainers/ringctl and ringd
// Frames between daemons (PeerHello and above). A ringd speaks kPeerProtocolVersion and the
// versions down to kPeerProtocolOldest, so that a ring can be upgraded host by host: a connection
// runs at the newest version both of its hosts speak (proto/peer.h, the handshake). A frame's header carries the version that defined
// its layout: the PeerHello and PeerAccept of a version-7 handshake say 7, every other peer frame
// says 6 (their layout is version 6's), so a ringd of 6 reads them all.
//   6: TCP ring ops of 32 MiB and more end with the delivery marker (daemon/engine/ring_engine.h).
//   7: the handshake carries each host's host-list digest, config version and secret key ids
//      (secrets rotate with a grace period; hosts whose host lists differ say so).
//   8: small ops by recursive doubling and recursive halving-doubling (OpData kinds 4-8), whose
//      hosts report an op to the coordinator only when it stalls or its partners' data does not
//      match (OpReport flags kReportDeferred, kReportDone). Solo lanes over TCP: GroupJoin says the
//      host's local ranks and GroupIncarnation the lane, grant epoch and total ranks (each after
//      version 6's fields), and a solo lane's ring ops are reported deferred (algorithm 0). A ring
//      domain uses them only while every one of its hosts speaks 8; without them the frames are
//      version 6's, byte for byte.
//   9: the generation's protocol is agreed: RingReady says the oldest version of the sender's
//      control connections, RingStart the oldest of all, which every host of the generation uses
//      (proto/peer.h). Both after version 6's fields, only on connections of 9.
//  10: reduce_scatter and allgather: GroupJoin says the group ranks of the host's local ranks,
//      GroupIncarnation every host's (the rank map every host of the run agreed), OpReport the
//      collective (bits 16-23 of its flags). Sent only in a generation of 10; an allreduce's frames
//      are 9's, byte for byte.
//  11: broadcast, reduce and barrier (OpReport collectives 3-5; a broadcast's or reduce's root rank
//      in bits 8-31 of the op word), their one-shot OpData (proto/peer.h); an incarnation's end
//      says through which seq its ops go on (the end OpReport's count, the end OpFail's `after`
//      after its message). Compressed wires: an OpReport's (and OpData's) wire format in bits
//      8-15 of its dtype word. Sent only in a generation of 11; every other op's frames are 10's,
//      byte for byte.
//  12: mesh data streams (PeerHello kind 2) between hosts that are not ring neighbours, so that
//      every pair of hosts has a data link; an all_to_all runs over the data links (one message
//      per block, daemon/engine/all_to_all_engine.h) instead of the control connections' OpData.
//      Only in a generation of 12; every frame's layout is 11's.
//  13: a compressed f32 allreduce on 3 hosts or more runs as the exchange of shards over the data
//      links (daemon/engine/exchange_engine.h) unless a host's wire.schedule says ring: RingReady
//      says that (kGenerationRingOnly, bits 16-31 of its protocol word) and RingStart what the
//      generation does, so that every host runs the same. Only in a generation of 13; every
//      frame's layout is 12's.
//  14: the exchange of shards runs compressed bf16 allreduces and reduce_scatters too (summed in
//      f32 a window of the buffer at a time). Only in a generation of 14; every frame's layout is
//      13's.
// A ringd of 6 (before 0.2.0) is no longer spoken to: it closed the connection at a hello it could
// not read, which a dialer cannot tell from a host that died. Every release since refuses with an
// Error frame, and only that refusal makes a dialer try an older version.
inline constexpr uint16_t kPeerProtocolVersion = 14;
inline constexpr uint16_t kPeerProtocolOldest = 7;
inline constexpr uint16_t kGenerationProtocolVersion = 9;  // RingReady / RingStart carry the protocol
inline constexpr uint16_t kCollectivesProtocol = 10;  // reduce_scatter and allgather across hosts
inline constexpr uint16_t kRootedProtocol = 11;       // broadcast, reduce and barrier across hosts
inline constexpr uint16_t kWireProtocol = 11;         // compressed wires (an op report's wire: its dtype word's bits 8-15)
inline constexpr uint16_t kMeshProtocol = 12;         // mesh data streams; all_to_all over the data links
inline constexpr uint16_t kExchangeProtocol = 13;     // compressed allreduce as the exchange of shards
inline constexpr uint16_t kExchangeBf16Protocol = 14;  // ... of bf16 data too
inline constexpr uint16_t kPeerBaseVersion = 6;  // the layout version of every peer frame but the handshake's
inline constexpr size_t kFrameHeaderBytes = 16;

// Largest payload the daemon accepts from a client (hello, status request, error).
inline constexpr uint32_t kMaxClientPayload = 4096;
// Largest payload a client accepts from the daemon (the status JSON is the big one).
inline constexpr uint32_t kMaxDaemonPayload = 1u << 20;
inline constexpr uint32_t kMaxErrorMessage = 1024;
inline constexpr size_t kGroupNameBytes = 64;  // including the terminating NUL
inline constexpr uint32_t kMaxLocalSize = 64;    // trainers of one group on one host
// File descriptors that travel with a Welcome: slot memfd, submit doorbell, completion eventfd.
inline constexpr int kWelcomeFds = 3;

enum class FrameType : uint16_t {
    Hello = 1,          // client -> daemon: join a group, ask for a slot
    Welcome = 2,        // daemon -> client: slot geometry (+ kWelcomeFds fds)
    Error = 3,          // either way: code and message; the sender closes afterwards
    StatusRequest = 4,  // ringctl -> daemon
    StatusReply = 5,    // daemon -> ringctl: JSON document
    CudaRegister = 6,   // client -> daemon, joined: map this device memory (+ 1 fd for a VMM allocation)
    CudaUnregister = 7, // client -> daemon, joined: a registration is no longer needed
    CudaReply = 8,      // daemon -> client: the answer to either (status, registration id)
    HelloShared = 9,    // client -> daemon: join a group with the slot data area of another client of
                        // the same process (u32 client id, then a Hello's payload)
    // Between daemons (proto/peer.h).
    PeerHello = 16,      // dialer -> listener: who, for which cluster, which connection, nonce
    PeerChallenge = 17,  // listener -> dialer: its nonce and its proof of the secret
    PeerAuth = 18,       // dialer -> listener: the dialer's proof of the secret
    PeerAccept = 19,     // listener -> dialer: the connection is up
    Heartbeat = 20,      // either way, every timeouts.heartbeat on control connections
    OpReport = 21,       // host -> coordinator: a group's next op is ready here (or failed here)
    OpStart = 22,        // coordinator -> every host: run it now, as ring op `op_id`
    OpFail = 23,         // coordinator -> every host: it failed; the message names the host(s)
    RingAbort = 24,      // either way: this host ended the ring generation, and why
    OpData = 25,         // host -> every host: a small op's report with this host's contribution
    RdmaLinkInfo = 26,   // either way on a data connection: QPs and FIFO of an ibverbs link (proto/rdma.h)
    RdmaLinkReady = 27,  // either way: this end's QPs are ready to receive
    GroupJoin = 28,         // host -> coordinator: this host's incarnation of a group (proto/peer.h)
    GroupIncarnation = 29,  // coordinator -> host: the agreed incarnation, or why it cannot run
    RingReady = 30,         // host -> coordinator: this host's links of the next ring are up (or not)
    RingStart = 31,         // coordinator -> every host: the ring is up as this generation
    ControlResume = 32,     // either way, first on a control connection that moved to another rail:
                            // the frames this host read from the one it replaces
};

struct FrameHeader {
    FrameType type{};
    uint32_t length = 0;
    uint16_t version = 0;
};

struct Hello {
    std::string group;
    uint32_t local_rank = 0;
    uint32_t local_size = 0;
    uint64_t slot_bytes = 0;  // data bytes the client wants in its slot
    // The group's hosts, comma-separated config names in any order; "" = every host of the ring.
    // On the wire after the fixed part (a hello of exactly kHelloBytes has none).
    std::string hosts;
    // Non-zero: the client id (its Welcome's) of a joined client of the same process whose slot
    // data area this one uses too (HelloShared); slot_bytes is then not used.
    uint32_t share_with = 0;
    // Non-zero: the op timeout this trainer's group asks for (ms; ringd clamps it to
    // timeouts.op_max), else ringd's timeouts.op. On the wire after the hosts: a NUL, then a u32
    // (a hello without it is the layout before, byte for byte).
    uint32_t op_timeout_ms = 0;
    // The trainer's rank in its group and the group's ranks, as the caller numbers them (torch's
    // rank in its process group); ranks 0: not said (the group then runs allreduce only). On the
    // wire after the timeout (0 there: ringd's timeouts.op), a trailer of 13 bytes instead of 5.
    uint32_t rank = 0;
    uint32_t ranks = 0;
};
inline constexpr size_t kHelloBytes = 16 + kGroupNameBytes;
inline constexpr size_t kMaxHelloHostsBytes = 3072;
// After the hosts (which hold no NUL), a trailer from the first NUL on: the NUL and the u32
// timeout, then with the ranks, u32 rank and u32 ranks.
inline constexpr size_t kHelloTimeoutBytes = 5;
inline constexpr size_t kHelloRanksBytes = 13;

struct Welcome {
    uint32_t client_id = 0;
    uint32_t sq_depth = 0;
    uint32_t cq_depth = 0;
    uint32_t op_timeout_ms = 0;  // the daemon's timeouts.op, so clients can bound their waits
    uint64_t map_bytes = 0;      // size of the slot memfd (header + queues + data)
    uint64_t data_offset = 0;    // where the data area starts inside the memfd
    uint64_t data_bytes = 0;
};
inline constexpr size_t kWelcomeBytes = 48;

struct ErrorFrame {
    int32_t code = -EINVAL;  // negative errno
    std::string message;
};

struct StatusRequest {
    uint32_t flags = 0;  // 0 (status only), or one of kStatus* below, then the status
};
// What an operator asks through the status request (ringctl drain / undrain / reload); root or
// ringd's own user only. A ringd older than these refuses the request (flags must be 0).
inline constexpr uint32_t kStatusDrain = 1;    // take no new groups; running ones go on
inline constexpr uint32_t kStatusUndrain = 2;  // take new groups again
inline constexpr uint32_t kStatusReload = 4;   // read the config file again (as SIGHUP), then the status
inline constexpr size_t kStatusRequestBytes = 4;

// Device memory handed to ringd once (ringd_cuda_alloc, ringd_register_cuda). A VMM allocation
// travels as a POSIX fd (SCM_RIGHTS, one, with this frame); a cudaMalloc-family buffer as the
// legacy IPC handle of its allocation plus where the registered range starts in it. The GPU is
// named by UUID: ordinals differ between processes (CUDA_VISIBLE_DEVICES).
enum class CudaMemoryKind : uint32_t { Vmm = 1, LegacyIpc = 2 };
inline constexpr size_t kCudaIpcHandleBytes = 64;  // CUipcMemHandle
struct CudaRegister {
    CudaMemoryKind kind = CudaMemoryKind::Vmm;
    uint8_t device_uuid[16] = {};
    uint64_t alloc_bytes = 0;  // the whole allocation (what is mapped)
    uint64_t offset = 0;       // where the registered range starts in it
    uint64_t bytes = 0;        // the registered range
    uint64_t client_ptr = 0;   // its address in the client (for messages only)
    uint8_t ipc_handle[kCudaIpcHandleBytes] = {};  // LegacyIpc only
};
inline constexpr size_t kCudaRegisterBytes = 128;
inline constexpr size_t kCudaUnregisterBytes = 8;
struct CudaReply {
    int32_t status = 0;  // 0 or negative errno
    uint64_t reg = 0;    // the registration (CudaRegister), or the one released (CudaUnregister)
    std::string message;
};

// Header.
Bytes encode_frame(FrameType type, std::span<const uint8_t> payload);
// Writes a frame header for `length` payload bytes at `at` (kFrameHeaderBytes long), for frames
// whose payload is filled in place.
void put_frame_header(uint8_t *at, FrameType type, uint32_t length);
// `max_payload` is the cap for this direction; an unknown type, bad magic/version or a length
// over the cap is an error.
Result<FrameHeader> decode_frame_header(std::span<const uint8_t> header, uint32_t max_payload);

// Payloads (encode returns the whole frame, header included).
Bytes encode_hello(const Hello &h);
Result<Hello> decode_hello(std::span<const uint8_t> payload);
// HelloShared's payload: the client id to share with, then a Hello's.
Result<Hello> decode_hello_shared(std::span<const uint8_t> payload);
Bytes encode_welcome(const Welcome &w);
Result<Welcome> decode_welcome(std::span<const uint8_t> payload);
Bytes encode_error(const ErrorFrame &e);
Result<ErrorFrame> decode_error(std::span<const uint8_t> payload);
Bytes encode_status_request(const StatusRequest &r);
Result<StatusRequest> decode_status_request(std::span<const uint8_t> payload);
Bytes encode_status_reply(std::string_view json);
Result<std::string> decode_status_reply(std::span<const uint8_t> payload);

Bytes encode_cuda_register(const CudaRegister &r);
Result<CudaRegister> decode_cuda_register(std::span<const uint8_t> payload);
Bytes encode_cuda_unregister(uint64_t reg);
Result<uint64_t> decode_cuda_unregister(std::span<const uint8_t> payload);
Bytes encode_cuda_reply(const CudaReply &r);
Result<CudaReply> decode_cuda_reply(std::span<const uint8_t> payload);

// Group names: 1..63 bytes of [A-Za-z0-9._-]. Returns an empty string when valid, else why not.
std::string check_group_name(std::string_view name);

}  // namespace ringd::proto
