#include "daemon/engine/reduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "daemon/engine/float16.h"

namespace ringd {
namespace {

using namespace float16;

constexpr size_t kBlock = 1024;  // elements per block: 4-8 KiB of accumulator, stays in L1

template <typename T> struct Acc { using type = T; };
template <> struct Acc<Bf16> { using type = float; };
// Integer sums wrap: accumulate in the unsigned type (no UB); min/max compare signed values.
template <typename T> using UnsignedOf = std::make_unsigned_t<T>;

template <typename T, typename A>
RINGD_INLINE A to_acc(const T &v) {
    if constexpr (std::is_same_v<T, Bf16>) return load_acc(v);
    else return static_cast<A>(v);
}
template <typename T, typename A>
RINGD_INLINE T from_acc(A v) {
    if constexpr (std::is_same_v<T, Bf16>) return store_bf16(v);
    else return static_cast<T>(v);
}

// min/max propagate NaN whichever side it is on (as torch.minimum/maximum do): a NaN y wins by
// `y != y`, a NaN x by losing every comparison. Integers never compare unequal to themselves.
template <typename A, ReduceOp Op>
RINGD_INLINE A combine(A x, A y) {
    if constexpr (Op == ReduceOp::Min) return (y < x || y != y) ? y : x;
    else if constexpr (Op == ReduceOp::Max) return (y > x || y != y) ? y : x;
    else if constexpr (std::is_integral_v<A>)
        return static_cast<A>(static_cast<UnsignedOf<A>>(x) + static_cast<UnsignedOf<A>>(y));
    else return x + y;
}

// avg: contributions are scaled by pre = 2^-K (exact) as they are accumulated, the final result
// by post = 2^K x fl(1/n) (exact: a power of two times the reciprocal rounded to A).
template <typename A> struct AvgScale { A pre = 1, post = 1; };
template <typename A> AvgScale<A> avg_scale(const ReduceArgs &a) {
    const uint32_t n = a.avg_divisor ? a.avg_divisor : 1;
    const int k = static_cast<int>(a.avg_shift ? a.avg_shift : avg_shift_for(n));
    return {std::ldexp(static_cast<A>(1), -k), std::ldexp(static_cast<A>(1) / static_cast<A>(n), k)};
}

// Half: convert each block to float, reduce in float, convert back once. Partials P are float
// (sum, avg) or Half (min, max).
template <typename P, ReduceOp Op>
RINGD_INLINE void reduce_half(const ReduceArgs &a) {
    constexpr bool kAvg = Op == ReduceOp::Avg;
    constexpr ReduceOp kCombine = kAvg ? ReduceOp::Sum : Op;
    float acc[kBlock], in[kBlock];
    AvgScale<float> sc;
    if constexpr (kAvg) sc = avg_scale<float>(a);
    // Block k of partial `k` as floats: in place when partials are float, else converted into buf.
    auto partial = [&](size_t k, size_t base, size_t n, float *buf) -> const float * {
        if constexpr (std::is_same_v<P, float>) return static_cast<const float *>(a.partials[k]) + base;
        else {
            kHalf.to_float(buf, static_cast<const Half *>(a.partials[k]) + base, n);
            return buf;
        }
    };
    for (size_t base = 0; base < a.count; base += kBlock) {
        const size_t n = std::min(kBlock, a.count - base);
        size_t first_partial = 0;
        if (a.nsrc > 0) {
            kHalf.to_float(acc, static_cast<const Half *>(a.srcs[0]) + base, n);
            if constexpr (kAvg) {
                for (size_t i = 0; i < n; ++i) acc[i] *= sc.pre;
            }
            for (size_t k = 1; k < a.nsrc; ++k) {
                kHalf.to_float(in, static_cast<const Half *>(a.srcs[k]) + base, n);
                if constexpr (kAvg) {
                    for (size_t i = 0; i < n; ++i) acc[i] += in[i] * sc.pre;
                } else {
                    for (size_t i = 0; i < n; ++i) acc[i] = combine<float, Op>(acc[i], in[i]);
                }
            }
        } else {
            const float *p = partial(0, base, n, in);
            for (size_t i = 0; i < n; ++i) acc[i] = p[i];
            first_partial = 1;
        }
        for (size_t k = first_partial; k < a.npartial; ++k) {
            const float *p = partial(k, base, n, in);
            for (size_t i = 0; i < n; ++i) acc[i] = combine<float, kCombine>(acc[i], p[i]);
        }
        if (a.partial_out) {
            if constexpr (std::is_same_v<P, float>) std::memcpy(static_cast<float *>(a.partial_out) + base, acc, n * 4);
            else kHalf.from_float(static_cast<Half *>(a.partial_out) + base, acc, n);
            continue;
        }
        if constexpr (kAvg) {
            for (size_t i = 0; i < n; ++i) acc[i] *= sc.post;
        }
        for (size_t k = 0; k < a.ndst; ++k) kHalf.from_float(static_cast<Half *>(a.dsts[k]) + base, acc, n);
    }
}

// T: the dtype's storage; P: its partials' (partial_dtype).
template <typename T, typename P, ReduceOp Op>
RINGD_INLINE void reduce_typed(const ReduceArgs &a) {
    using A = typename Acc<T>::type;
    constexpr bool kAvg = Op == ReduceOp::Avg;
    constexpr ReduceOp kCombine = kAvg ? ReduceOp::Sum : Op;
    A acc[kBlock];
    AvgScale<A> sc;
    if constexpr (kAvg) sc = avg_scale<A>(a);
    for (size_t base = 0; base < a.count; base += kBlock) {
        const size_t n = std::min(kBlock, a.count - base);
        size_t first_partial = 0;
        if (a.nsrc > 0) {
            const T *s0 = static_cast<const T *>(a.srcs[0]) + base;
            if constexpr (kAvg) {
                for (size_t i = 0; i < n; ++i) acc[i] = to_acc<T, A>(s0[i]) * sc.pre;
            } else {
                for (size_t i = 0; i < n; ++i) acc[i] = to_acc<T, A>(s0[i]);
            }
            for (size_t k = 1; k < a.nsrc; ++k) {
                const T *s = static_cast<const T *>(a.srcs[k]) + base;
                if constexpr (kAvg) {
                    for (size_t i = 0; i < n; ++i) acc[i] += to_acc<T, A>(s[i]) * sc.pre;
                } else {
                    for (size_t i = 0; i < n; ++i) acc[i] = combine<A, Op>(acc[i], to_acc<T, A>(s[i]));
                }
            }
        } else {
            const P *p = static_cast<const P *>(a.partials[0]) + base;
            for (size_t i = 0; i < n; ++i) acc[i] = to_acc<P, A>(p[i]);
            first_partial = 1;
        }
        for (size_t k = first_partial; k < a.npartial; ++k) {
            const P *p = static_cast<const P *>(a.partials[k]) + base;
            for (size_t i = 0; i < n; ++i) acc[i] = combine<A, kCombine>(acc[i], to_acc<P, A>(p[i]));
        }
        if (a.partial_out) {
            P *d = static_cast<P *>(a.partial_out) + base;
            for (size_t i = 0; i < n; ++i) d[i] = from_acc<P, A>(acc[i]);
            continue;
        }
        if constexpr (kAvg) {
            for (size_t i = 0; i < n; ++i) acc[i] *= sc.post;
        }
        for (size_t k = 0; k < a.ndst; ++k) {
            T *d = static_cast<T *>(a.dsts[k]) + base;
            for (size_t i = 0; i < n; ++i) d[i] = from_acc<T, A>(acc[i]);
        }
    }
}

// Partials of sums and averages of bf16 are f32; everything else's are its own type.
template <typename T> struct SumPartial { using type = T; };
template <> struct SumPartial<Bf16> { using type = float; };

template <typename T>
RINGD_INLINE void reduce_dispatch_op(const ReduceArgs &a) {
    using P = typename SumPartial<T>::type;
    switch (a.op) {
    case ReduceOp::Sum: reduce_typed<T, P, ReduceOp::Sum>(a); break;
    case ReduceOp::Avg:
        if constexpr (!std::is_integral_v<T>) reduce_typed<T, P, ReduceOp::Avg>(a);
        break;  // avg of integers is rejected at validation
    case ReduceOp::Min: reduce_typed<T, T, ReduceOp::Min>(a); break;
    case ReduceOp::Max: reduce_typed<T, T, ReduceOp::Max>(a); break;
    }
}

// One non-template entry per dtype so that target_clones can version it; the templates above
// are force-inlined into each clone and compiled for its ISA.
RINGD_CLONES void reduce_f32(const ReduceArgs &a) { reduce_dispatch_op<float>(a); }
RINGD_CLONES void reduce_f64(const ReduceArgs &a) { reduce_dispatch_op<double>(a); }
RINGD_CLONES void reduce_f16(const ReduceArgs &a) {
    switch (a.op) {
    case ReduceOp::Sum: reduce_half<float, ReduceOp::Sum>(a); break;
    case ReduceOp::Avg: reduce_half<float, ReduceOp::Avg>(a); break;
    case ReduceOp::Min: reduce_half<Half, ReduceOp::Min>(a); break;
    case ReduceOp::Max: reduce_half<Half, ReduceOp::Max>(a); break;
    }
}
RINGD_CLONES void reduce_bf16(const ReduceArgs &a) { reduce_dispatch_op<Bf16>(a); }
RINGD_CLONES void reduce_i32(const ReduceArgs &a) { reduce_dispatch_op<int32_t>(a); }
RINGD_CLONES void reduce_i64(const ReduceArgs &a) { reduce_dispatch_op<int64_t>(a); }

}  // namespace

void reduce(const ReduceArgs &a) {
    if (a.count == 0 || a.nsrc + a.npartial == 0 || (a.ndst == 0 && !a.partial_out)) return;
    switch (a.dtype) {
    case DType::F32: reduce_f32(a); break;
    case DType::F64: reduce_f64(a); break;
    case DType::F16: reduce_f16(a); break;
    case DType::BF16: reduce_bf16(a); break;
    case DType::I32: reduce_i32(a); break;
    case DType::I64: reduce_i64(a); break;
    }
}

void reduce_into(void *dst, const void *src, size_t count, DType dtype, ReduceOp op) {
    const void *srcs[2] = {dst, src};
    void *dsts[1] = {dst};
    reduce(ReduceArgs{dtype, op == ReduceOp::Avg ? ReduceOp::Sum : op, srcs, 2, dsts, 1, count, 1});
}

uint32_t avg_shift_for(uint64_t contributions) {
    uint32_t k = 1;
    while (k < 63 && (uint64_t{1} << k) < 2 * std::max<uint64_t>(contributions, 1)) ++k;
    return k;
}

float half_to_float(uint16_t h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return static_cast<float>(v);
}
uint16_t float_to_half(float f) {
    const _Float16 v = static_cast<_Float16>(f);
    uint16_t h;
    std::memcpy(&h, &v, 2);
    return h;
}
float bf16_to_float(uint16_t b) { return load_acc(Bf16{b}); }
uint16_t float_to_bf16(float f) { return store_bf16(f).bits; }

}  // namespace ringd
