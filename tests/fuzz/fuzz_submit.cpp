// libFuzzer: a submit descriptor as a client may write it into its slot (256 bytes, any value),
// checked against a slot of any data size, as the daemon checks each copied descriptor. Whatever
// it accepts lies inside the slot, aligned, with both ranges' byte counts exact, a device
// reduce_scatter/allgather's part inside its block, a broadcast or reduce in place from or to one
// of its ranks, and an all_to_all's ranges those of its split sizes (a device one whole: no block,
// no part); a refusal is only that. An
// input of odd size checks as a ringd with CUDA.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "proto/slot.h"

using namespace ringd;
using namespace ringd::proto;

namespace {

// A range of `count` elements of `esize` bytes at `offset` with `bytes` its exact size, inside
// `data_bytes` and aligned.
bool range_ok(uint64_t offset, uint64_t bytes, uint64_t count, uint64_t esize, uint64_t data_bytes) {
    return bytes == count * esize && bytes / esize == count && offset % esize == 0 && offset <= data_bytes &&
           data_bytes - offset >= bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    SubmitDesc d{};
    std::memcpy(&d, data, std::min(size, sizeof d));
    uint64_t data_bytes = 1 << 20;
    if (size > sizeof d) std::memcpy(&data_bytes, data + sizeof d, std::min<size_t>(size - sizeof d, 8));
    // A refusal (read before any validation, as the gateway does) is one of a known collective and
    // nothing else; as a submission it is never accepted.
    if (auto r = refusal(d, data_bytes); r && (d.flags != kSubmitRefused || d.collective >= kCollectiveCount || r->empty()))
        __builtin_trap();
    auto s = validate_submit(d, data_bytes, (size & 1) != 0);
    if (!s) return 0;
    if (d.flags & kSubmitRefused) __builtin_trap();
    // (Device buffers have split sizes only in an all_to_all, which then runs whole.)
    if (s->cuda && s->splits_pending &&
        (s->desc.collective != Collective::AllToAll || s->cuda_block != 0 || s->cuda_part != 0))
        __builtin_trap();
    if (s->splits_pending) {
        // An all_to_all's split sizes, read from a slot whose bytes are the rest of the input:
        // whatever take_splits accepts lies inside the slot, its byte counts the tables' sums.
        if (data_bytes > (1u << 20)) return 0;
        std::vector<std::byte> slot(data_bytes);
        const size_t rest = size > sizeof d + 8 ? size - sizeof d - 8 : 0;
        if (rest) std::memcpy(slot.data(), data + sizeof d + 8, std::min<size_t>(rest, slot.size()));
        if (!take_splits(*s, slot.data(), slot.size(), true)) return 0;
        uint64_t in = 0, out = 0;
        for (uint32_t r = 0; r < s->desc.ranks; ++r) in += (*s->splits)[r], out += (*s->splits)[s->desc.ranks + r];
        const uint64_t es = dtype_size(s->desc.dtype);
        if (s->splits_pending || !range_ok(s->offset, s->bytes, in, es, data_bytes) || !range_ok(s->out_offset, s->out_bytes, out, es, data_bytes))
            __builtin_trap();
        return 0;
    }
    const OpDesc &desc = s->desc;
    const uint64_t esize = dtype_size(desc.dtype);
    const bool allreduce = desc.collective == Collective::Allreduce;
    if (!range_ok(s->offset, s->bytes, desc.in_count(), esize, data_bytes) ||
        !range_ok(s->out_offset, s->out_bytes, desc.out_count(), esize, data_bytes) ||
        (allreduce && (desc.ranks != 0 || s->out_offset != s->offset)) ||
        (!allreduce && (desc.ranks == 0 || desc.ranks > kMaxGroupRanks)) ||
        s->cuda != (d.buffer_kind == 1))
        __builtin_trap();
    // A wire format ringd knows, compressed only where it applies; feedback only with one.
    if (static_cast<uint32_t>(desc.wire) >= kWireFormatCount ||
        (desc.wire != WireFormat::Exact && !wire_applies(desc.collective, desc.dtype, desc.op)) ||
        (s->feedback && desc.wire == WireFormat::Exact))
        __builtin_trap();
    // A device reduce_scatter/allgather/all_to_all's part lies inside its block, and its blocks' bytes do not
    // overflow; every other op (a device allreduce, broadcast or reduce: in place) carries no
    // device-collective fields, and no other collective is of device buffers.
    const bool by_blocks = collective_blocked(desc.collective) || desc.collective == Collective::AllToAll;
    if (s->cuda && !allreduce && !by_blocks && !collective_is_rooted(desc.collective))
        __builtin_trap();
    // A broadcast or reduce runs in place (a device one is staged in and out at `offset` for
    // `bytes`, where the engine works at out_offset), from or to one of its ranks.
    if (collective_is_rooted(desc.collective) &&
        (s->out_offset != s->offset || s->out_bytes != s->bytes || desc.root >= desc.ranks))
        __builtin_trap();
    if (s->cuda && by_blocks) {
        uint64_t whole = 0;
        if (s->cuda_part > s->cuda_block || s->cuda_block - s->cuda_part < desc.count ||
            __builtin_mul_overflow(s->cuda_block, uint64_t{desc.ranks} * esize, &whole))
            __builtin_trap();
    } else if (s->cuda_out_reg != 0 || s->cuda_out_offset != 0 || s->cuda_block != 0 || s->cuda_part != 0) {
        __builtin_trap();
    }
    return 0;
}
