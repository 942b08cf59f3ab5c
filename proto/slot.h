// Shared-memory layout of a client slot (one sealed memfd per client).
//
//   [0, 4096)                      SlotHeader: geometry + queue indices (one cache line each) +
//                                  the CUDA sync words (ready/done per queue entry)
//   [4096, +sq_depth*256)          submission queue: SubmitDesc[sq_depth]   client -> daemon
//   [.., +cq_depth*256)            completion queue: CompletionDesc[cq_depth] daemon -> client
//   [data_offset, +data_bytes)     data area (tensors), data_offset page aligned
//
// Each queue is single-producer/single-consumer with free-running 64-bit indices: the producer
// writes entry [tail % depth] then stores tail with release; the consumer loads tail with acquire.
// The daemon never trusts the indices or entries in shared memory: it keeps its own copy of the
// indices, copies each descriptor out once and validates the copy (validate_submit).
#pragma once

#include <atomic>
#include <memory>
#include <vector>
#include <cstddef>
#include <cstdint>

#include "proto/result.h"
#include "proto/types.h"

namespace ringd::proto {

inline constexpr uint32_t kSlotMagic = 0x4C534752;  // bytes 'R' 'G' 'S' 'L'
inline constexpr uint16_t kSlotVersion = 2;  // 2: CUDA sync words
// SlotHeader::features: what this ringd understands beyond kSlotVersion (a client checks before
// it relies on one; an older ringd leaves the field 0).
inline constexpr uint16_t kSlotFeatureCudaReadySeq = 1;  // SubmitDesc::cuda_ready_seq
// SubmitDesc::collective, ranks and out_offset: reduce_scatter and allgather. A client never sends
// them to a ringd without it (an older ringd ignores the reserved bytes and would run an allreduce).
inline constexpr uint16_t kSlotFeatureCollectives = 2;
// SubmitDesc::cuda_out_reg, cuda_out_offset, cuda_block and cuda_part: reduce_scatter and allgather
// of device buffers (a ringd without it refuses them: ENOTSUP).
inline constexpr uint16_t kSlotFeatureCudaCollectives = 4;
// SubmitDesc::root and collectives 3-5: broadcast, reduce and barrier (a ringd without it refuses
// the collective by number: EINVAL).
inline constexpr uint16_t kSlotFeatureRootedCollectives = 8;
// Collective 6, all_to_all, with SubmitDesc::splits_offset (flags kSubmitSplits).
inline constexpr uint16_t kSlotFeatureAllToAll = 32;
// SlotHeader::copied_in, copied_out: counted in ringd's status.
inline constexpr uint16_t kSlotFeatureCopyCounters = 16;
// SubmitDesc::wire and feedback_tag (flags kSubmitFeedback): compressed wires, error feedback (an
// older ringd ignores the reserved bytes and would run the op exact: a client never sends them
// to one).
inline constexpr uint16_t kSlotFeatureWire = 64;
// Broadcast and reduce of device buffers (SubmitDesc::root with BufferKind::Cuda; a ringd without
// it refuses them: EINVAL).
inline constexpr uint16_t kSlotFeatureCudaRooted = 128;
// all_to_all of device buffers, equal blocks (cuda_block elements each; no split sizes), staged as
// a reduce_scatter's input and an allgather's output are (a ringd without it refuses it: EINVAL).
inline constexpr uint16_t kSlotFeatureCudaAllToAll = 256;
// A refusal (flags kSubmitRefused): the rank cannot run its next op, which ringd fails on every rank
// of the group, naming it (a ringd without it refuses the flag: EINVAL, the op's seq taken alike).
inline constexpr uint16_t kSlotFeatureRefuse = 512;
// all_to_all of device buffers with split sizes (flags kSubmitSplits, BufferKind::Cuda): one op,
// the whole input staged in at `offset` and the whole output out from `out_offset` (a ringd
// without it refuses it: EINVAL).
inline constexpr uint16_t kSlotFeatureCudaAllToAllSplits = 1024;
inline constexpr size_t kSlotHeaderBytes = 4096;
inline constexpr size_t kSlotDataAlign = 4096;
inline constexpr uint32_t kQueueDepth = 64;
inline constexpr size_t kCompletionMessageBytes = 232;

using QueueIndex = std::atomic<uint64_t>;
static_assert(QueueIndex::is_always_lock_free, "queue indices must be lock-free to live in shared memory");

struct alignas(64) CacheLineIndex {
    QueueIndex value;
    uint8_t pad[64 - sizeof(QueueIndex)];
};
static_assert(sizeof(CacheLineIndex) == 64);

struct SlotHeader {
    uint32_t magic;
    uint16_t version;
    uint16_t features;  // kSlotFeature* bits
    uint32_t sq_depth;
    uint32_t cq_depth;
    uint64_t data_offset;
    uint64_t data_bytes;
    uint8_t pad0[64 - 32];
    CacheLineIndex sq_tail;  // written by the client
    CacheLineIndex sq_head;  // written by the daemon (informational for the client)
    CacheLineIndex cq_tail;  // written by the daemon
    CacheLineIndex cq_head;  // written by the client
    uint8_t pad1[512 - 5 * 64];
    // Stream order of device-buffer ops (ringd_submit_cuda), one word each per queue entry
    // (seq % kQueueDepth), holding the low 32 bits of an op's seq. The trainer's stream writes
    // cuda_ready = seq once the buffer is produced, and ringd's stream waits for it (>=, wrapping)
    // before copying; ringd's stream writes cuda_done = seq once the result is back in the buffer,
    // and ringd_stream_wait makes the trainer's stream wait for that. Whoever finds an op failed or
    // the other side gone writes the word from the host instead, so no stream waits for ever.
    // Written by both sides; read by the daemon only as a wait condition, never trusted otherwise.
    std::atomic<uint32_t> cuda_ready[kQueueDepth];
    std::atomic<uint32_t> cuda_done[kQueueDepth];
    std::atomic<uint32_t> cuda_probe;  // the client's stream writes here once, to learn whether it can
    uint8_t pad2[1088 - 1028];
    // kSlotFeatureCopyCounters: the bytes this client copied into and out of its slot for ops
    // (ringd_note_copies: what a framework copies to hand its tensors over, and back), added by
    // the client only; ringd's status sums them over its clients. Informational, never trusted.
    std::atomic<uint64_t> copied_in;
    std::atomic<uint64_t> copied_out;
    uint8_t pad3[kSlotHeaderBytes - 1104];
};
static_assert(sizeof(SlotHeader) == kSlotHeaderBytes);
static_assert(offsetof(SlotHeader, sq_tail) == 64);
static_assert(offsetof(SlotHeader, cq_head) == 256);
static_assert(offsetof(SlotHeader, cuda_ready) == 512 && offsetof(SlotHeader, cuda_done) == 768);
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4);
static_assert(offsetof(SlotHeader, copied_in) == 1088 && offsetof(SlotHeader, copied_out) == 1096);
static_assert(std::atomic<uint64_t>::is_always_lock_free && sizeof(std::atomic<uint64_t>) == 8);

enum class BufferKind : uint32_t {
    Slot = 0,     // `offset` is a byte offset into this client's slot data area
    // Device memory: the tensor is at `cuda_offset` in CUDA registration `cuda_reg` (a CudaReply's
    // reg), and ringd stages it at `offset` in the slot data area, which the op holds until it ends.
    Cuda = 1,
};

struct SubmitDesc {
    uint64_t seq;        // 1, 2, 3, ... per client; ranks of a group submit the same sequence
    uint64_t count;      // elements
    uint32_t dtype;      // DType
    uint32_t op;         // ReduceOp
    uint32_t buffer_kind;  // BufferKind
    uint32_t flags;      // reserved, 0
    uint64_t offset;     // bytes into the slot data area
    uint64_t cuda_reg;     // Cuda: the registration
    uint64_t cuda_offset;  // Cuda: bytes into the registration
    // Cuda: the seq whose ready word says the buffer is produced (0: this op's own). The parts of
    // a device op larger than its staging window all wait for the word of the op's last part,
    // which the trainer's stream writes once, when the op is submitted.
    uint64_t cuda_ready_seq;
    // kSlotFeatureCollectives (0 in all three: an allreduce in place, as before them).
    uint32_t collective;  // Collective
    uint32_t ranks;       // reduce_scatter, allgather: the group's ranks (the blocks of the larger range)
    uint64_t out_offset;  // reduce_scatter, allgather: the output's bytes into the slot data area
    // kSlotFeatureCudaCollectives, a device reduce_scatter or allgather (kSlotFeatureCudaAllToAll:
    // all_to_all, `ranks` blocks of cuda_block elements on both sides; kSlotFeatureCudaAllToAllSplits:
    // with split sizes, cuda_block and cuda_part 0, the whole op in one part; 0 otherwise). Its input
    // starts cuda_offset bytes into registration cuda_reg (reduce_scatter: `ranks` blocks of
    // cuda_block elements; allgather: one block), its output cuda_out_offset bytes into
    // cuda_out_reg (one block, resp. `ranks`). This op is the part [cuda_part, cuda_part + count)
    // of every block: staged in at `offset` (reduce_scatter: `ranks` blocks of count elements,
    // allgather: one) and out from `out_offset` (one block, resp. `ranks`).
    uint64_t cuda_out_reg;
    uint64_t cuda_out_offset;
    uint64_t cuda_block;
    uint64_t cuda_part;
    // kSlotFeatureRootedCollectives: a broadcast's or reduce's root rank (< ranks); 0 otherwise.
    uint32_t root;
    uint32_t reserved0;
    // An all_to_all with split sizes (flags kSubmitSplits; count 0): `ranks` elements to send to
    // each rank, then `ranks` elements to receive from each, as uint64 at this byte offset into the
    // slot data area (8-aligned). Copied once when ringd takes the descriptor.
    uint64_t splits_offset;
    // kSlotFeatureWire: the op's wire format, bits 0-7 its WireFormat + 1 (0: the group's default,
    // ringd's config `wire.default`, applied only where it can apply: wire_applies), bit 8
    // kWireRequired: this op's own choice, refused where it cannot apply.
    uint32_t wire;
    uint32_t reserved1;
    // Error feedback (flags kSubmitFeedback): the key of the residual ringd keeps for this op's
    // values (DDP's bucket index, FSDP's parameter group), in the group's run.
    uint64_t feedback_tag;
    uint8_t reserved[256 - 144];
};
static_assert(sizeof(SubmitDesc) == 256);
static_assert(offsetof(SubmitDesc, wire) == 128 && offsetof(SubmitDesc, feedback_tag) == 136);
static_assert(offsetof(SubmitDesc, root) == 112 && offsetof(SubmitDesc, splits_offset) == 120);
inline constexpr uint32_t kSubmitSplits = 1;  // SubmitDesc::flags: splits_offset holds split sizes
inline constexpr uint32_t kSubmitFeedback = 2;  // SubmitDesc::flags: error feedback under feedback_tag
// SubmitDesc::flags: this rank refuses the op of its seq (the others submit it): `collective` says
// which, `count` the slot bytes it needed (0: not said); every other field 0 (proto::refusal).
inline constexpr uint32_t kSubmitRefused = 4;
inline constexpr uint32_t kWireRequired = 0x100;  // SubmitDesc::wire: refused where it cannot apply
static_assert(offsetof(SubmitDesc, collective) == 64 && offsetof(SubmitDesc, out_offset) == 72);
static_assert(offsetof(SubmitDesc, cuda_out_reg) == 80 && offsetof(SubmitDesc, cuda_part) == 104);
static_assert(offsetof(SubmitDesc, offset) == 32);
static_assert(offsetof(SubmitDesc, cuda_reg) == 40);
static_assert(offsetof(SubmitDesc, cuda_ready_seq) == 56);

struct CompletionDesc {
    uint64_t seq;
    int32_t status;  // 0 or negative errno
    uint32_t message_len;
    uint8_t reserved[8];
    char message[kCompletionMessageBytes];  // not NUL-terminated; message_len bytes
};
static_assert(sizeof(CompletionDesc) == 256);

struct SlotGeometry {
    uint32_t sq_depth = kQueueDepth;
    uint32_t cq_depth = kQueueDepth;
    uint64_t sq_offset = 0;
    uint64_t cq_offset = 0;
    uint64_t data_offset = 0;
    uint64_t data_bytes = 0;
    uint64_t map_bytes = 0;
};

// Layout for a slot with `data_bytes` of data; fails on overflow or zero.
Result<SlotGeometry> slot_geometry(uint64_t data_bytes, uint32_t sq_depth = kQueueDepth,
                                   uint32_t cq_depth = kQueueDepth);

// A submission after validation: the daemon acts only on this copy.
struct Submission {
    uint64_t seq = 0;
    OpDesc desc;
    uint64_t offset = 0;  // the input, into the data area (device buffers: where they are staged)
    uint64_t bytes = 0;   // the input's bytes (desc.in_count() elements)
    // The output: allreduce, the input itself; reduce_scatter and allgather, its own range, which
    // is either apart from the input or the rank's block of it (in place: GroupTable checks that,
    // knowing the rank).
    uint64_t out_offset = 0;
    uint64_t out_bytes = 0;
    bool cuda = false;    // a device buffer (BufferKind::Cuda), checked against its registration later
    uint64_t cuda_reg = 0;
    uint64_t cuda_offset = 0;
    uint64_t ready_seq = 0;  // cuda: the seq whose ready word marks the buffer produced (>= seq)
    // cuda reduce_scatter, allgather: the output's registration and offset, the device op's
    // elements per block and this part's first element of each (SubmitDesc).
    uint64_t cuda_out_reg = 0;
    uint64_t cuda_out_offset = 0;
    uint64_t cuda_block = 0;
    uint64_t cuda_part = 0;
    // all_to_all with split sizes: the elements to send to each rank, then to receive from each
    // (2 x ranks), copied out of the slot (take_splits); null: `count` per block both ways.
    std::shared_ptr<const std::vector<uint64_t>> splits;
    bool splits_pending = false;  // validate_submit: the table at splits_offset is still to be taken
    uint64_t splits_offset = 0;
    // Error feedback for a compressed op (desc.wire): the residual's key in the group's run.
    bool feedback = false;
    uint64_t feedback_tag = 0;
};

// Validates a copied descriptor against the slot's data area: collective/dtype/op/kind known, avg
// only for floating types, both ranges' sizes and ends without overflow and inside `data_bytes`,
// offsets aligned to the element size (for device buffers: the staging range; the device range is the
// CUDA registry's to check). `cuda_supported` says whether this ringd handles device buffers. The
// wire format: the op's own (refused where it cannot apply), else `default_wire` where it applies.
Result<Submission> validate_submit(const SubmitDesc &d, uint64_t data_bytes, bool cuda_supported,
                                   WireFormat default_wire = WireFormat::Exact);

// An all_to_all with split sizes (Submission::splits_offset, validated by validate_submit): copies
// its table out of the data area `data` once and sets the input's and output's byte counts from
// it, both checked against the data area. Anything else: nothing to do.
Status take_splits(Submission &s, const std::byte *data, uint64_t data_bytes, bool has_table);

// A refusal (flags kSubmitRefused): why the rank refused its op, in words, for every rank of its
// group (`data_bytes`: its slot's); an error where the descriptor is not a well-formed refusal.
Result<std::string> refusal(const SubmitDesc &d, uint64_t data_bytes);

// Fills a completion; the message is truncated to kCompletionMessageBytes.
void fill_completion(CompletionDesc &c, uint64_t seq, int32_t status, std::string_view message);

}  // namespace ringd::proto
