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

Result<std::string> refusal(const SubmitDesc &d, uint64_t data_bytes) {
    const std::string at = "op " + std::to_string(d.seq) + ": ";
    if (d.flags != kSubmitRefused || d.collective >= kCollectiveCount || d.dtype != 0 || d.op != 0 || d.offset != 0 ||
        d.out_offset != 0 || d.ranks != 0 || d.root != 0 || d.buffer_kind != 0 || d.splits_offset != 0 || d.wire != 0 ||
        d.feedback_tag != 0 || d.cuda_reg != 0 || d.cuda_offset != 0 || d.cuda_ready_seq != 0 || d.cuda_out_reg != 0 ||
        d.cuda_out_offset != 0 || d.cuda_block != 0 || d.cuda_part != 0)
        return make_error(-EINVAL, at + "a refusal with fields other than its collective and the bytes it needed");
    const std::string what(collective_name(static_cast<Collective>(d.collective)));
    if (d.count == 0) return "it could not submit its " + what;
    return "its " + what + " needs " + std::to_string(d.count) + " bytes of its slot, which has " + std::to_string(data_bytes);
}

Result<Submission> validate_submit(const SubmitDesc &d, uint64_t data_bytes, bool cuda_supported, WireFormat default_wire) {
    const std::string at = "op " + std::to_string(d.seq) + ": ";
    if (d.collective >= kCollectiveCount) return make_error(-EINVAL, at + "unknown collective " + std::to_string(d.collective));
    if (d.dtype >= kDTypeCount) return make_error(-EINVAL, at + "unknown dtype " + std::to_string(d.dtype));
    if (d.op >= kReduceOpCount) return make_error(-EINVAL, at + "unknown reduce op " + std::to_string(d.op));
    if ((d.flags & ~(kSubmitSplits | kSubmitFeedback)) != 0) return make_error(-EINVAL, at + "unknown flags " + std::to_string(d.flags));
    if ((d.wire & ~(kWireRequired | 0xffu)) != 0 || (d.wire & 0xff) > kWireFormatCount)
        return make_error(-EINVAL, at + "unknown wire format " + std::to_string(d.wire));
    if ((d.flags & kSubmitSplits) && d.collective != static_cast<uint32_t>(Collective::AllToAll))
        return make_error(-EINVAL, at + "split sizes for an op that is not an all_to_all");
    Submission s;
    s.seq = d.seq;
    s.desc.collective = static_cast<Collective>(d.collective);
    s.desc.count = d.count;
    s.desc.dtype = static_cast<DType>(d.dtype);
    s.desc.op = collective_reduces(s.desc.collective) ? static_cast<ReduceOp>(d.op) : ReduceOp::Sum;
    s.offset = d.offset;
    const std::string cname(collective_name(s.desc.collective));
    if (s.desc.collective == Collective::Allreduce) {
        if (d.ranks != 0 || d.out_offset != 0)
            return make_error(-EINVAL, at + "an allreduce (in place) with ranks or out_offset set");
    } else {
        if (d.ranks == 0 || d.ranks > kMaxGroupRanks)
            return make_error(-EINVAL, at + cname + " over " + std::to_string(d.ranks) + " ranks (1 to " +
                                           std::to_string(kMaxGroupRanks) + ")");
        s.desc.ranks = d.ranks;
    }
    if (collective_is_rooted(s.desc.collective)) {
        if (d.root >= d.ranks)
            return make_error(-EINVAL, at + cname + " with root rank " + std::to_string(d.root) + " of " +
                                           std::to_string(d.ranks) + " ranks");
        if (d.out_offset != d.offset)
            return make_error(-EINVAL, at + "a " + cname + " runs in place: out_offset " + std::to_string(d.out_offset) +
                                           " is not its offset " + std::to_string(d.offset));
        s.desc.root = d.root;
    } else if (d.root != 0) {
        return make_error(-EINVAL, at + cname + " with a root rank set (only broadcast and reduce have one)");
    }
    if (d.flags & kSubmitSplits) {
        // The table (2 x ranks uint64) inside the data area; take_splits reads it.
        uint64_t table = 0, end = 0;
        if (d.count != 0) return make_error(-EINVAL, at + "an all_to_all with split sizes and a count");
        if (d.splits_offset % 8 != 0 || mul_overflows(uint64_t{d.ranks}, 16, &table) ||
            add_overflows(d.splits_offset, table, &end) || end > data_bytes)
            return make_error(-ERANGE, at + "split sizes [" + std::to_string(d.splits_offset) + ", +" +
                                           std::to_string(uint64_t{d.ranks} * 16) + ") do not lie 8-aligned in the " +
                                           std::to_string(data_bytes) + "-byte slot");
        s.splits_pending = true;
        s.splits_offset = d.splits_offset;
    }
    if (s.desc.collective == Collective::Barrier) {
        // No data: whatever dtype and op it names, every rank's barrier is the same op.
        if (d.count != 0 || d.offset != 0 || d.out_offset != 0)
            return make_error(-EINVAL, at + "a barrier with count, offset or out_offset set");
        s.desc.dtype = DType::F32;
        s.desc.op = ReduceOp::Sum;
    }
    if (s.desc.op == ReduceOp::Avg && dtype_is_integer(s.desc.dtype))
        return make_error(-EINVAL, at + "avg is not defined for integer dtype " + std::string(dtype_name(s.desc.dtype)));
    {
        // The wire: the op's own where it names one (refused where it cannot apply), else the
        // group's default where it applies; exact everywhere else.
        const bool applies = wire_applies(s.desc.collective, s.desc.dtype, s.desc.op);
        if (d.wire & 0xff) {
            const auto f = static_cast<WireFormat>((d.wire & 0xff) - 1);
            if (f != WireFormat::Exact && !applies && (d.wire & kWireRequired))
                return make_error(-EINVAL, at + "a " + std::string(wire_format_name(f)) + " wire carries sums and averages of f32 "
                                               "and bf16 by allreduce, reduce_scatter and reduce, not a " + describe(s.desc));
            s.desc.wire = applies ? f : WireFormat::Exact;
        } else {
            s.desc.wire = applies ? default_wire : WireFormat::Exact;
        }
        if (d.flags & kSubmitFeedback) {
            s.feedback = s.desc.wire != WireFormat::Exact;  // (nothing to keep for an exact op)
            s.feedback_tag = d.feedback_tag;
        }
    }
    if (d.buffer_kind == static_cast<uint32_t>(BufferKind::Cuda)) {
        if (!cuda_supported) return make_error(-ENOTSUP, at + "this ringd has no CUDA (built without it)");
        s.cuda = true;
        // Device buffers: allreduce, broadcast and reduce in place on one buffer, reduce_scatter
        // and allgather by blocks; the rest on slot buffers only.
        const bool in_place = s.desc.collective == Collective::Allreduce || collective_is_rooted(s.desc.collective);
        // (an all_to_all: staged by blocks on both sides, or with split sizes whole in one part)
        const bool a2a = s.desc.collective == Collective::AllToAll;
        const bool splits = a2a && (d.flags & kSubmitSplits);
        if (!collective_blocked(s.desc.collective) && !in_place && !a2a)
            return make_error(-EINVAL, at + "a " + cname + " of device buffers (ringd runs it on slot buffers only)");
        if (in_place) {
            if (d.cuda_out_reg != 0 || d.cuda_out_offset != 0 || d.cuda_block != 0 || d.cuda_part != 0)
                return make_error(-EINVAL, at + "a device " + cname + " with cuda_out_reg, cuda_out_offset, cuda_block or cuda_part set");
        } else if (splits) {
            // The whole input and output, as many elements as the split sizes say (take_splits).
            if (d.cuda_block != 0 || d.cuda_part != 0)
                return make_error(-EINVAL, at + "a device all_to_all with split sizes and cuda_block or cuda_part set "
                                               "(it runs whole, in one part)");
            s.cuda_out_reg = d.cuda_out_reg;
            s.cuda_out_offset = d.cuda_out_offset;
        } else {
            // The part lies inside the device op's blocks; the device ranges (a block per rank on
            // one side) are the CUDA registry's to check against the registrations.
            uint64_t part_end = 0, whole = 0;
            if (add_overflows(d.cuda_part, d.count, &part_end) || part_end > d.cuda_block)
                return make_error(-EINVAL, at + "part [" + std::to_string(d.cuda_part) + ", +" + std::to_string(d.count) +
                                               ") lies outside the device " + cname + "'s block of " +
                                               std::to_string(d.cuda_block) + " elements");
            if (mul_overflows(d.cuda_block, uint64_t{d.ranks} * dtype_size(s.desc.dtype), &whole))
                return make_error(-EOVERFLOW, at + "cuda_block " + std::to_string(d.cuda_block) + " overflows");
            s.cuda_out_reg = d.cuda_out_reg;
            s.cuda_out_offset = d.cuda_out_offset;
            s.cuda_block = d.cuda_block;
            s.cuda_part = d.cuda_part;
        }
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
    } else if (d.cuda_reg != 0 || d.cuda_offset != 0 || d.cuda_ready_seq != 0 || d.cuda_out_reg != 0 ||
               d.cuda_out_offset != 0 || d.cuda_block != 0 || d.cuda_part != 0) {
        return make_error(-EINVAL, at + "a slot buffer with CUDA fields set");
    }
    const uint64_t esize = dtype_size(s.desc.dtype);
    // A range of `count` elements at `offset`, inside the data area.
    auto range = [&](const char *what, uint64_t offset, uint64_t count, uint64_t *bytes) -> Status {
        if (mul_overflows(count, esize, bytes))
            return make_error(-EOVERFLOW, at + "count " + std::to_string(count) + " overflows");
        if (offset % esize != 0)
            return make_error(-EINVAL, at + what + "offset " + std::to_string(offset) + " is not a multiple of the " +
                                           std::to_string(esize) + "-byte element size");
        uint64_t end = 0;
        if (add_overflows(offset, *bytes, &end) || end > data_bytes)
            return make_error(-ERANGE, at + what + "buffer [" + std::to_string(offset) + ", +" + std::to_string(*bytes) +
                                           ") lies outside the " + std::to_string(data_bytes) + "-byte slot");
        return Ok{};
    };
    uint64_t in_count = 0, out_count = 0;
    if (mul_overflows(d.count, std::max<uint64_t>(s.desc.ranks, 1), &in_count))
        return make_error(-EOVERFLOW, at + "count " + std::to_string(d.count) + " overflows");
    in_count = s.desc.in_count();
    out_count = s.desc.out_count();
    if (auto r = range(s.desc.collective == Collective::Allreduce ? "" : "input ", d.offset, in_count, &s.bytes); !r)
        return r.error();
    if (!collective_blocked(s.desc.collective) && s.desc.collective != Collective::AllToAll) {  // in place
        s.out_offset = s.offset;
        s.out_bytes = s.bytes;
    } else {
        s.out_offset = d.out_offset;
        if (auto r = range("output ", d.out_offset, out_count, &s.out_bytes); !r) return r.error();
    }
    return s;
}

Status take_splits(Submission &s, const std::byte *data, uint64_t data_bytes, bool has_table) {
    if (!s.splits_pending) return Ok{};
    const std::string at = "op " + std::to_string(s.seq) + ": ";
    if (!has_table) return make_error(-EINVAL, at + "split sizes cannot be read here");
    const uint32_t n = s.desc.ranks;
    auto table = std::make_shared<std::vector<uint64_t>>(2 * size_t{n});
    std::memcpy(table->data(), data + s.splits_offset, table->size() * sizeof(uint64_t));  // (once: the client may change it)
    const uint64_t es = dtype_size(s.desc.dtype);
    uint64_t sums[2] = {0, 0};
    for (int side = 0; side < 2; ++side)
        for (uint32_t r = 0; r < n; ++r)
            if (add_overflows(sums[side], (*table)[side * size_t{n} + r], &sums[side]))
                return make_error(-EOVERFLOW, at + "split sizes overflow");
    uint64_t in_end = 0, out_end = 0;
    if (mul_overflows(sums[0], es, &s.bytes) || mul_overflows(sums[1], es, &s.out_bytes) ||
        add_overflows(s.offset, s.bytes, &in_end) || add_overflows(s.out_offset, s.out_bytes, &out_end) ||
        in_end > data_bytes || out_end > data_bytes)
        return make_error(-ERANGE, at + "all_to_all of " + std::to_string(sums[0]) + " elements out, " + std::to_string(sums[1]) +
                                       " in: its input at " + std::to_string(s.offset) + " or output at " +
                                       std::to_string(s.out_offset) + " does not lie in the " + std::to_string(data_bytes) +
                                       "-byte slot");
    s.splits = std::move(table);
    s.splits_pending = false;
    return Ok{};
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
