#include "proto/slot.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace ringd::proto {
namespace {

bool add_overflows(uint64_t a, uint64_t b, uint64_t *out) { return __builtin_add_overflow(a, b, out); }
bool mul_overflows(uint64_t a, uint64_t b, uint64_t *out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

Result<SlotGeometry> slot_geometry(uint64_t data_bytes, uint32_t sq_depth, uint32_t cq_depth) {
    if (data_bytes == 0) return make_error(-EINVAL, "slot data size is 0");
    if (sq_depth == 0 || cq_depth == 0) return make_error(-EINVAL, "queue depth is 0");
    SlotGeometry g;
    g.sq_depth = sq_depth;
    g.cq_depth = cq_depth;
    g.sq_offset = kSlotHeaderBytes;
    g.cq_offset = g.sq_offset + uint64_t{sq_depth} * sizeof(SubmitDesc);
    const uint64_t queues_end = g.cq_offset + uint64_t{cq_depth} * sizeof(CompletionDesc);
    g.data_offset = (queues_end + kSlotDataAlign - 1) / kSlotDataAlign * kSlotDataAlign;
    g.data_bytes = data_bytes;
    uint64_t padded = 0;
    if (add_overflows(data_bytes, kSlotDataAlign - 1, &padded) ||
        add_overflows(g.data_offset, padded / kSlotDataAlign * kSlotDataAlign, &g.map_bytes))
        return make_error(-EOVERFLOW, "slot size " + std::to_string(data_bytes) + " overflows");
    return g;
}

Result<Submission> validate_submit(const SubmitDesc &d, uint64_t data_bytes, bool cuda_supported) {
    const std::string at = "op " + std::to_string(d.seq) + ": ";
    if (d.dtype >= kDTypeCount) return make_error(-EINVAL, at + "unknown dtype " + std::to_string(d.dtype));
    if (d.op >= kReduceOpCount) return make_error(-EINVAL, at + "unknown reduce op " + std::to_string(d.op));
    if (d.flags != 0) return make_error(-EINVAL, at + "flags must be 0");
    Submission s;
    s.seq = d.seq;
    s.count = d.count;
    s.dtype = static_cast<DType>(d.dtype);
    s.op = static_cast<ReduceOp>(d.op);
    s.offset = d.offset;
    if (s.op == ReduceOp::Avg && dtype_is_integer(s.dtype))
        return make_error(-EINVAL, at + "avg is not defined for integer dtype " + std::string(dtype_name(s.dtype)));
    if (d.buffer_kind == static_cast<uint32_t>(BufferKind::Cuda)) {
        if (!cuda_supported) return make_error(-ENOTSUP, at + "this ringd has no CUDA (built without it)");
        s.cuda = true;
        s.cuda_reg = d.cuda_reg;
        s.cuda_offset = d.cuda_offset;
        s.ready_seq = d.cuda_ready_seq == 0 ? d.seq : d.cuda_ready_seq;
        // The words hold a seq's low 32 bits and compare wrapping: the op's word must lie ahead
        // of its own seq by less than half that range.
        if (s.ready_seq < d.seq || s.ready_seq - d.seq >= (uint64_t{1} << 31))
            return make_error(-EINVAL, at + "cuda_ready_seq " + std::to_string(d.cuda_ready_seq) +
                                           " is not within 2^31 at or after the op's seq");
    } else if (d.buffer_kind != static_cast<uint32_t>(BufferKind::Slot)) {
        return make_error(-EINVAL, at + "unknown buffer kind " + std::to_string(d.buffer_kind));
    } else if (d.cuda_reg != 0 || d.cuda_offset != 0 || d.cuda_ready_seq != 0) {
        return make_error(-EINVAL, at + "a slot buffer with CUDA fields set");
    }
    const uint64_t esize = dtype_size(s.dtype);
    if (mul_overflows(d.count, esize, &s.bytes))
        return make_error(-EOVERFLOW, at + "count " + std::to_string(d.count) + " overflows");
    if (d.offset % esize != 0)
        return make_error(-EINVAL, at + "offset " + std::to_string(d.offset) + " is not a multiple of the " +
                                       std::to_string(esize) + "-byte element size");
    uint64_t end = 0;
    if (add_overflows(d.offset, s.bytes, &end) || end > data_bytes)
        return make_error(-ERANGE, at + "buffer [" + std::to_string(d.offset) + ", +" + std::to_string(s.bytes) +
                                       ") lies outside the " + std::to_string(data_bytes) + "-byte slot");
    return s;
}

void fill_completion(CompletionDesc &c, uint64_t seq, int32_t status, std::string_view message) {
    std::memset(&c, 0, sizeof c);
    c.seq = seq;
    c.status = status;
    const size_t n = std::min(message.size(), kCompletionMessageBytes);
    c.message_len = static_cast<uint32_t>(n);
    std::memcpy(c.message, message.data(), n);
}

}  // namespace ringd::proto
