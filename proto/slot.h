// Shared-memory layout of a client slot (one sealed memfd per client).
//
//   [0, 4096)                      SlotHeader: geometry + queue indices (one cache line each)
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
#include <cstddef>
#include <cstdint>

#include "proto/result.h"
#include "proto/types.h"

namespace ringd::proto {

inline constexpr uint32_t kSlotMagic = 0x4C534752;  // bytes 'R' 'G' 'S' 'L'
inline constexpr uint16_t kSlotVersion = 1;
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
    uint16_t reserved0;
    uint32_t sq_depth;
    uint32_t cq_depth;
    uint64_t data_offset;
    uint64_t data_bytes;
    uint8_t pad0[64 - 32];
    CacheLineIndex sq_tail;  // written by the client
    CacheLineIndex sq_head;  // written by the daemon (informational for the client)
    CacheLineIndex cq_tail;  // written by the daemon
    CacheLineIndex cq_head;  // written by the client
    uint8_t pad1[kSlotHeaderBytes - 5 * 64];
};
static_assert(sizeof(SlotHeader) == kSlotHeaderBytes);
static_assert(offsetof(SlotHeader, sq_tail) == 64);
static_assert(offsetof(SlotHeader, cq_head) == 256);

enum class BufferKind : uint32_t {
    Slot = 0,     // `offset` is a byte offset into this client's slot data area
    CudaIpc = 1,  // cuda_mem_handle + cuda_event_handle, `offset` into that allocation
};

inline constexpr size_t kCudaIpcHandleBytes = 64;  // cudaIpcMemHandle_t / cudaIpcEventHandle_t

struct SubmitDesc {
    uint64_t seq;        // 1, 2, 3, ... per client; ranks of a group submit the same sequence
    uint64_t count;      // elements
    uint32_t dtype;      // DType
    uint32_t op;         // ReduceOp
    uint32_t buffer_kind;  // BufferKind
    uint32_t flags;      // reserved, 0
    uint64_t offset;     // bytes
    uint8_t cuda_mem_handle[kCudaIpcHandleBytes];
    uint8_t cuda_event_handle[kCudaIpcHandleBytes];
    uint8_t reserved[256 - 40 - 2 * kCudaIpcHandleBytes];
};
static_assert(sizeof(SubmitDesc) == 256);
static_assert(offsetof(SubmitDesc, offset) == 32);
static_assert(offsetof(SubmitDesc, cuda_mem_handle) == 40);

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
    uint64_t count = 0;
    DType dtype = DType::F32;
    ReduceOp op = ReduceOp::Sum;
    uint64_t offset = 0;  // into the data area
    uint64_t bytes = 0;   // count * dtype_size
};

// Validates a copied descriptor against the slot's data area: dtype/op/kind known, avg only for
// floating types, count*size and offset+bytes without overflow and inside `data_bytes`, offset
// aligned to the element size. `cuda_supported` says whether this ringd handles CudaIpc buffers.
Result<Submission> validate_submit(const SubmitDesc &d, uint64_t data_bytes, bool cuda_supported);

// Fills a completion; the message is truncated to kCompletionMessageBytes.
void fill_completion(CompletionDesc &c, uint64_t seq, int32_t status, std::string_view message);

}  // namespace ringd::proto
