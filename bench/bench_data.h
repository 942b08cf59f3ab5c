// Test data for ringd-bench and the integration tests: values whose allreduce result is known
// exactly. Rank g of n contributes value(g, i), small integers, so that sums, minima and maxima
// are exact in every dtype (bf16 included, up to n * 16 <= 256); avg is exact up to one
// rounding of sum / n, and checked with a tolerance of a few ulp of the dtype.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "daemon/engine/reduce.h"
#include "proto/types.h"

namespace ringd::bench {

inline int64_t value(uint64_t rank, uint64_t i) {
    return static_cast<int64_t>((i * 7 + rank * 13) % 17) - 8 + static_cast<int64_t>(rank % 5);
}

inline double expected(uint64_t nranks, uint64_t i, ReduceOp op) {
    int64_t sum = 0, lo = INT64_MAX, hi = INT64_MIN;
    for (uint64_t g = 0; g < nranks; ++g) {
        const int64_t v = value(g, i);
        sum += v;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    switch (op) {
    case ReduceOp::Sum: return static_cast<double>(sum);
    case ReduceOp::Avg: return static_cast<double>(sum) / static_cast<double>(nranks);
    case ReduceOp::Min: return static_cast<double>(lo);
    case ReduceOp::Max: return static_cast<double>(hi);
    }
    return 0;
}

inline void store(void *buf, size_t i, DType t, double v) {
    auto *b = static_cast<unsigned char *>(buf);
    switch (t) {
    case DType::F32: { float x = static_cast<float>(v); std::memcpy(b + 4 * i, &x, 4); break; }
    case DType::F64: std::memcpy(b + 8 * i, &v, 8); break;
    case DType::F16: { uint16_t x = float_to_half(static_cast<float>(v)); std::memcpy(b + 2 * i, &x, 2); break; }
    case DType::BF16: { uint16_t x = float_to_bf16(static_cast<float>(v)); std::memcpy(b + 2 * i, &x, 2); break; }
    case DType::I32: { int32_t x = static_cast<int32_t>(v); std::memcpy(b + 4 * i, &x, 4); break; }
    case DType::I64: { int64_t x = static_cast<int64_t>(v); std::memcpy(b + 8 * i, &x, 8); break; }
    }
}

inline double load(const void *buf, size_t i, DType t) {
    const auto *b = static_cast<const unsigned char *>(buf);
    switch (t) {
    case DType::F32: { float x; std::memcpy(&x, b + 4 * i, 4); return x; }
    case DType::F64: { double x; std::memcpy(&x, b + 8 * i, 8); return x; }
    case DType::F16: { uint16_t x; std::memcpy(&x, b + 2 * i, 2); return half_to_float(x); }
    case DType::BF16: { uint16_t x; std::memcpy(&x, b + 2 * i, 2); return bf16_to_float(x); }
    case DType::I32: { int32_t x; std::memcpy(&x, b + 4 * i, 4); return x; }
    case DType::I64: { int64_t x; std::memcpy(&x, b + 8 * i, 8); return static_cast<double>(x); }
    }
    return 0;
}

// Relative tolerance for one rounding of the result in dtype t.
inline double tolerance(DType t, ReduceOp op) {
    if (op != ReduceOp::Avg) return 0;
    switch (t) {
    case DType::F16: return 1.0 / 1024;
    case DType::BF16: return 1.0 / 128;
    case DType::F32: return 1e-6;
    case DType::F64: return 1e-14;
    default: return 0;
    }
}

inline void fill(void *buf, size_t count, DType t, uint64_t rank) {
    for (size_t i = 0; i < count; ++i) store(buf, i, t, static_cast<double>(value(rank, i)));
}

// Elements of buf that differ from the allreduce of `nranks` ranks' fill().
inline uint64_t count_wrong(const void *buf, size_t count, DType t, ReduceOp op, uint64_t nranks) {
    uint64_t wrong = 0;
    const double tol = tolerance(t, op);
    for (size_t i = 0; i < count; ++i) {
        const double want = expected(nranks, i, op);
        const double got = load(buf, i, t);
        if (!(std::fabs(got - want) <= tol * std::fabs(want))) ++wrong;
    }
    return wrong;
}

}  // namespace ringd::bench
