// Reduction kernels: element-wise sum/avg/min/max over N source buffers, written to M
// destination buffers, for every ringd dtype. Blocked so that each block of the sources is read
// once while it is hot in cache and the result is stored to all destinations from registers/L1;
// vectorised by the compiler, with an x86-64-v3 (AVX2/FMA/F16C) clone picked at load time.
//
// Semantics: integer sums wrap (two's complement); f16/bf16 accumulate in f32 and round once
// (round-to-nearest-even) per call. Sources and destinations may alias each other
// element-for-element (in-place), not partially.
//
// Partial results (for reductions cut into several calls, as across hosts): a call may take
// partial results of earlier calls besides its sources, and leave its own result partial instead
// of final. Partials are in partial_dtype(dtype, op) (proto/types.h): f32 for f16/bf16 sum and
// avg, so that those round once, in the call that makes the final result.
//
// avg never overflows where the mean is representable: every source (contribution) is multiplied
// by 2^-K before it is accumulated, 2^K >= 2 x the number of contributions, and the final result
// by 2^K x fl(1/avg_divisor). Scaling by a power of two is exact (but for values below 2^(K-126)
// in f32/f16/bf16, 2^(K-1022) in f64, which lose bits to underflow), so the result has the bits of
// the sum multiplied by the rounded reciprocal wherever that sum did not overflow. Partials of
// avg carry the 2^-K and are not scaled again; every call of one avg must use the same K.
#pragma once

#include <cstddef>
#include <cstdint>

#include "proto/types.h"

namespace ringd {

struct ReduceArgs {
    DType dtype = DType::F32;
    ReduceOp op = ReduceOp::Sum;
    const void *const *srcs = nullptr;  // contributions, in dtype
    size_t nsrc = 0;
    void *const *dsts = nullptr;        // the final result, in dtype (none when partial_out is set)
    size_t ndst = 0;
    size_t count = 0;                   // elements
    uint32_t avg_divisor = 1;           // only for ReduceOp::Avg: the number of contributions in total
    // Partial results of earlier calls (partial_dtype), combined after the sources.
    const void *const *partials = nullptr;
    size_t npartial = 0;                // nsrc + npartial >= 1
    void *partial_out = nullptr;        // set: the result stays partial (partial_dtype), written here
    uint32_t avg_shift = 0;             // K for avg; 0: avg_shift_for(avg_divisor)
};

void reduce(const ReduceArgs &a);

// dst = dst (op) src, no avg scaling (the ring's per-step reduction).
void reduce_into(void *dst, const void *src, size_t count, DType dtype, ReduceOp op);

// The smallest K with 2^K >= 2 x contributions: partial sums of contributions scaled by 2^-K stay
// at most half the largest finite value, whatever the rounding on the way.
uint32_t avg_shift_for(uint64_t contributions);

// IEEE half / bfloat16 conversions (round-to-nearest-even), exposed for tests and the bench.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace ringd
