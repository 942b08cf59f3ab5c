// Reduction kernels: element-wise sum/avg/min/max over N source buffers, written to M
// destination buffers, for every ringd dtype. Blocked so that each block of the sources is read
// once while it is hot in cache and the result is stored to all destinations from registers/L1;
// vectorised by the compiler, with an x86-64-v3 (AVX2/FMA/F16C) clone picked at load time.
//
// Semantics: integer sums wrap (two's complement); f16/bf16 accumulate in f32 and round once
// (round-to-nearest-even) per call; avg multiplies the sum by 1/avg_divisor before rounding.
// Sources and destinations may alias each other element-for-element (in-place), not partially.
#pragma once

#include <cstddef>
#include <cstdint>

#include "proto/types.h"

namespace ringd {

struct ReduceArgs {
    DType dtype = DType::F32;
    ReduceOp op = ReduceOp::Sum;
    const void *const *srcs = nullptr;
    size_t nsrc = 0;        // >= 1
    void *const *dsts = nullptr;
    size_t ndst = 0;        // >= 1
    size_t count = 0;       // elements
    uint32_t avg_divisor = 1;  // only for ReduceOp::Avg: the number of contributions in total
};

void reduce(const ReduceArgs &a);

// dst = dst (op) src, no avg scaling (the ring's per-step reduction).
void reduce_into(void *dst, const void *src, size_t count, DType dtype, ReduceOp op);

// IEEE half / bfloat16 conversions (round-to-nearest-even), exposed for tests and the bench.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace ringd
