// Element types and reduction operators. The numeric values are part of the C ABI
// (client/include/ringd/ringd.h) and of the submit descriptor; never renumber.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ringd {

enum class DType : uint32_t { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5 };
enum class ReduceOp : uint32_t { Sum = 0, Avg = 1, Min = 2, Max = 3 };

// What an op computes (the submit descriptor's `collective`, the C ABI's ringd_collective):
//   allreduce       every rank's buffer becomes the reduction of every rank's buffer
//   reduce_scatter  the input is one block per rank (in the group's rank order), the output one
//                   block: rank r's output is the reduction of every rank's block r
//   allgather       the input is one block, the output one block per rank: block r of every
//                   rank's output is rank r's input
//   broadcast       one buffer, in place: every rank's becomes the root rank's
//   reduce          one buffer, in place: the root rank's becomes the reduction of every rank's
//                   (the other ranks' may hold partial results afterwards, as a reduce_scatter's
//                   input does)
//   barrier         no data: ends on every rank once every rank of the group submitted it
//   all_to_all      the input is one block per rank, the output one block per rank: block j of
//                   rank i's input is block i of rank j's output (blocks of `count` elements, or
//                   of each rank's split sizes: Submission::splits)
enum class Collective : uint32_t {
    Allreduce = 0,
    ReduceScatter = 1,
    Allgather = 2,
    Broadcast = 3,
    Reduce = 4,
    Barrier = 5,
    AllToAll = 6
};
inline constexpr uint32_t kCollectiveCount = 7;
// The collectives of peer protocol 10 (reduce_scatter, allgather) and of 11 (broadcast, reduce,
// barrier): a ring with an older host refuses them by name.
constexpr bool collective_is_rooted(Collective c) { return c == Collective::Broadcast || c == Collective::Reduce; }
// The most ranks a group may have (the blocks of a reduce_scatter's input or an allgather's output).
inline constexpr uint32_t kMaxGroupRanks = 1u << 20;

inline constexpr uint32_t kDTypeCount = 6;
inline constexpr uint32_t kReduceOpCount = 4;

constexpr size_t dtype_size(DType t) {
    switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    }
    return 0;
}

constexpr bool dtype_is_integer(DType t) { return t == DType::I32 || t == DType::I64; }

constexpr std::string_view dtype_name(DType t) {
    switch (t) {
    case DType::F32: return "float";
    case DType::F64: return "double";
    case DType::F16: return "half";
    case DType::BF16: return "bfloat16";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    }
    return "?";
}

constexpr std::string_view collective_name(Collective c) {
    switch (c) {
    case Collective::Allreduce: return "allreduce";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::Allgather: return "allgather";
    case Collective::Broadcast: return "broadcast";
    case Collective::Reduce: return "reduce";
    case Collective::Barrier: return "barrier";
    case Collective::AllToAll: return "all_to_all";
    }
    return "?";
}

// Whether the collective combines values (and so has a reduction op and partial results).
constexpr bool collective_reduces(Collective c) {
    return c == Collective::Allreduce || c == Collective::ReduceScatter || c == Collective::Reduce;
}
// Whether its buffer is one block per rank on one side (reduce_scatter's input, allgather's output).
constexpr bool collective_blocked(Collective c) { return c == Collective::ReduceScatter || c == Collective::Allgather; }

constexpr std::string_view reduce_op_name(ReduceOp o) {
    switch (o) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
    }
    return "?";
}

// The element type of an op's partial results (the reduce-scatter messages of the ring, one-shot
// contributions, two-shot parts) between hosts: f16 and bf16 sums and averages travel in f32, so
// that they are rounded to their type once, at the end; every other op travels in its own type.
// Final results (the ring's allgather, two-shot results) are always in the op's type.
constexpr DType partial_dtype(DType t, ReduceOp op) {
    const bool narrow = t == DType::F16 || t == DType::BF16;
    return narrow && (op == ReduceOp::Sum || op == ReduceOp::Avg) ? DType::F32 : t;
}

// How an op's values travel between hosts (daemon/engine/wire.h, docs/design.md "Wire formats"):
// exact, or compressed — bf16, fp16 scaled per block, int8 block-scaled — for the sums and
// averages of f32 and bf16 data of the collectives that reduce (allreduce, reduce_scatter, reduce),
// always accumulated in f32.
enum class WireFormat : uint8_t { Exact = 0, BF16 = 1, FP16 = 2, Int8 = 3 };
inline constexpr uint32_t kWireFormatCount = 4;

constexpr std::string_view wire_format_name(WireFormat f) {
    switch (f) {
    case WireFormat::Exact: return "exact";
    case WireFormat::BF16: return "bf16";
    case WireFormat::FP16: return "fp16";
    case WireFormat::Int8: return "int8";
    }
    return "?";
}
std::optional<WireFormat> parse_wire_format(std::string_view name);

// Whether a compressed wire can carry the op: sum or avg of f32 or bf16 by a collective that reduces.
constexpr bool wire_applies(Collective c, DType t, ReduceOp op) {
    return collective_reduces(c) && (t == DType::F32 || t == DType::BF16) && (op == ReduceOp::Sum || op == ReduceOp::Avg);
}

// What an op computes, the one description every layer carries from the submission to the engine
// (the ranks' buffers are not part of it: each local rank has its own input and output range).
// Every rank of a group submits the same OpDesc for the same seq; hosts compare it across the ring.
struct OpDesc {
    Collective collective = Collective::Allreduce;
    DType dtype = DType::F32;
    ReduceOp op = ReduceOp::Sum;  // allgather: always Sum (it combines nothing)
    // Allreduce, broadcast, reduce: the buffer's elements. reduce_scatter: the output's (one rank's
    // block; the input has `ranks` blocks). allgather: the input's (the output has `ranks`
    // blocks). barrier: 0.
    uint64_t count = 0;
    // The group's ranks as the caller counts them (every collective but allreduce); 0 for
    // allreduce, whose meaning does not depend on them.
    uint32_t ranks = 0;
    uint32_t root = 0;  // broadcast, reduce: the root rank (< ranks); 0 otherwise
    // Compressed only where wire_applies (the daemon resolves a group's default to exact elsewhere).
    WireFormat wire = WireFormat::Exact;

    bool operator==(const OpDesc &) const = default;
    // Elements of the input and of the output range of one rank.
    // (all_to_all: `count` per block both ways; 0 with split sizes, whose ranges Submission has.)
    uint64_t in_count() const {
        return collective == Collective::ReduceScatter || collective == Collective::AllToAll ? count * ranks : count;
    }
    uint64_t out_count() const {
        return collective == Collective::Allgather || collective == Collective::AllToAll ? count * ranks : count;
    }
    // The larger of the two: the buffer with a block per rank (allreduce: its buffer).
    uint64_t full_count() const {
        return collective_blocked(collective) || collective == Collective::AllToAll ? count * ranks : count;
    }
};

// "1000 x float sum" (allreduce, as every release wrote it), "reduce_scatter of 1000 x float sum
// over 8 ranks", "allgather of 1000 x float over 8 ranks", "broadcast of 1000 x float from rank 3
// over 8 ranks", "barrier over 8 ranks": for error messages.
std::string describe(const OpDesc &d);

// Accepts the names above and the short forms f32 f64 f16 bf16 i32 i64.
std::optional<DType> parse_dtype(std::string_view s);
std::optional<ReduceOp> parse_reduce_op(std::string_view s);
std::optional<Collective> parse_collective(std::string_view s);

}  // namespace ringd
