// Test data for ringd-bench, the baselines and the tests: values whose allreduce result is known
// exactly, and guard bytes around an op's range that nothing may touch.
//
// Rank g of n contributes value(g, i): a small integer drawn from a hash of (g, i), so the input
// has no period (data moved by any number of elements shows up as wrong values) and sums, minima
// and maxima are exact in every dtype (bf16 included: |sum| <= n * 12 <= 256 for n <= 21).
// avg must be the mean rounded once to the dtype: exactly that value for f16 and bf16 (they
// accumulate in f32), within two f32 roundings for f32 and two f64 roundings for f64.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "daemon/engine/reduce.h"
#include "proto/types.h"

namespace ringd::bench {

inline uint64_t mix64(uint64_t x) {  // splitmix64's finaliser: every input bit moves every output bit
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// In [-8, 12]: 17 hashed values, shifted by rank % 5 so that ranks differ in range too.
inline int64_t value(uint64_t rank, uint64_t i) {
    return static_cast<int64_t>(mix64(i * 0x9e3779b97f4a7c15ull + rank * 0x632be59bd9b4e019ull + 1) % 17) - 8 +
           static_cast<int64_t>(rank % 5);
}

struct Exact {
    int64_t sum = 0, lo = INT64_MAX, hi = INT64_MIN;
};

inline Exact exact(uint64_t nranks, uint64_t i) {
    Exact e;
    for (uint64_t g = 0; g < nranks; ++g) {
        const int64_t v = value(g, i);
        e.sum += v;
        e.lo = v < e.lo ? v : e.lo;
        e.hi = v > e.hi ? v : e.hi;
    }
    return e;
}

inline double expected(uint64_t nranks, uint64_t i, ReduceOp op) {
    const Exact e = exact(nranks, i);
    switch (op) {
    case ReduceOp::Sum: return static_cast<double>(e.sum);
    case ReduceOp::Avg: return static_cast<double>(e.sum) / static_cast<double>(nranks);
    case ReduceOp::Min: return static_cast<double>(e.lo);
    case ReduceOp::Max: return static_cast<double>(e.hi);
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

// `v` rounded once (to nearest even) to dtype t. The means checked here (an integer sum over at
// most a few dozen ranks) are never within a float ulp of a half/bf16 tie, so rounding through
// float is the single rounding.
inline double round_to(DType t, double v) {
    unsigned char b[8];
    store(b, 0, t, v);
    return load(b, 0, t);
}

// Relative error allowed on top of the exact result: none but for f32/f64 avg (the sum times the
// rounded reciprocal: two roundings).
inline double tolerance(DType t, ReduceOp op) {
    if (op != ReduceOp::Avg) return 0;
    switch (t) {
    case DType::F32: return 0x1p-22;
    case DType::F64: return 0x1p-51;
    default: return 0;
    }
}

inline void fill(void *buf, size_t count, DType t, uint64_t rank) {
    for (size_t i = 0; i < count; ++i) store(buf, i, t, static_cast<double>(value(rank, i)));
}

// The value element i of the allreduce of `nranks` ranks' fill() must have, in dtype t.
inline double want(uint64_t nranks, size_t i, DType t, ReduceOp op) { return round_to(t, expected(nranks, i, op)); }

// How far a result over a compressed wire may be from the exact one, for fill()'s values (|v| <=
// 12): (hosts + 1) encodings (docs/wire.md) of at most the sum of every rank's largest magnitude,
// plus the f32 accumulation and a bf16 result's rounding; divided by the ranks for avg. 0: exact.
inline double wire_tolerance(WireFormat f, uint64_t hosts, uint64_t nranks, DType t, ReduceOp op) {
    if (f == WireFormat::Exact || hosts < 2) return 0;
    const double most = 12.0 * static_cast<double>(nranks);
    const double u = f == WireFormat::BF16 ? 0x1p-8 : f == WireFormat::FP16 ? 0x1p-11 : (1 + 0x1p-14) / 254;
    double b = static_cast<double>(hosts + 1) * u * most + static_cast<double>(hosts + nranks + 2) * 0x1p-24 * most;
    if (t == DType::BF16) b += 0x1p-8 * (most + b);
    return op == ReduceOp::Avg ? b / static_cast<double>(nranks) : b;
}

// Elements of buf that differ from the allreduce of `nranks` ranks' fill() (by more than abs_tol).
inline uint64_t count_wrong(const void *buf, size_t count, DType t, ReduceOp op, uint64_t nranks, double abs_tol = 0) {
    uint64_t wrong = 0;
    const double tol = tolerance(t, op);
    for (size_t i = 0; i < count; ++i) {
        const double w = want(nranks, i, t, op);
        const double got = load(buf, i, t);
        if (!(std::fabs(got - w) <= tol * std::fabs(w) + abs_tol)) ++wrong;
    }
    return wrong;
}

// count_wrong for elements [first, first + count) of the allreduce, at buf (a reduce_scatter's block).
inline uint64_t count_wrong_at(const void *buf, size_t count, DType t, ReduceOp op, uint64_t nranks, size_t first,
                               double abs_tol = 0) {
    uint64_t wrong = 0;
    const double tol = tolerance(t, op);
    for (size_t i = 0; i < count; ++i) {
        const double w = want(nranks, first + i, t, op);
        const double got = load(buf, i, t);
        if (!(std::fabs(got - w) <= tol * std::fabs(w) + abs_tol)) ++wrong;
    }
    return wrong;
}

// The result of a collective other than allreduce, checked where it lies (`out`), from every
// rank's fill() of the op's input (`count` elements: the larger buffer, n blocks for
// reduce_scatter, allgather and all_to_all): a reduce_scatter's block is the reduction of elements
// [rank*block, (rank+1)*block), an allgather's block b rank b's own block of its input, value(b,
// b*block + i), a broadcast's buffer the root's, a reduce's the reduction at the root (elsewhere
// nothing is checked), an all_to_all's block b rank b's block for this rank. Wrong values.
inline uint64_t collective_wrong(Collective coll, const void *out, size_t count, DType t, ReduceOp op, uint64_t nranks,
                                 uint64_t rank, uint64_t root, double abs_tol = 0) {
    const size_t block = count / nranks, esize = dtype_size(t);
    const auto *o = static_cast<const unsigned char *>(out);
    uint64_t wrong = 0;
    auto values_of = [&](const unsigned char *at, size_t n, uint64_t g, size_t first) {
        for (size_t i = 0; i < n; ++i)
            if (load(at, i, t) != round_to(t, static_cast<double>(value(g, first + i)))) ++wrong;
    };
    switch (coll) {
    case Collective::Allreduce: return count_wrong(out, count, t, op, nranks, abs_tol);
    case Collective::ReduceScatter: return count_wrong_at(out, block, t, op, nranks, rank * block, abs_tol);
    case Collective::Reduce: return rank == root ? count_wrong(out, count, t, op, nranks, abs_tol) : 0;
    case Collective::Broadcast: values_of(o, count, root, 0); break;
    case Collective::Allgather:
        for (uint64_t b = 0; b < nranks; ++b) values_of(o + b * block * esize, block, b, b * block);
        break;
    case Collective::AllToAll:
        for (uint64_t b = 0; b < nranks; ++b) values_of(o + b * block * esize, block, b, rank * block);
        break;
    default: break;
    }
    return wrong;
}

// The bytes each host's NIC must send (or, for reduce, receive) for a collective of `bytes` (the
// larger buffer), its ranks' data combined first, over `hosts` hosts of `local` ranks each: the
// ring over hosts moves (H-1)/H of the buffer per pass (allreduce two), a chain from or to the
// root's host all of it, an all_to_all the host's ranks' blocks for the other hosts.
inline double host_bytes(Collective coll, double bytes, uint64_t hosts, uint64_t local) {
    const double rest = static_cast<double>(hosts - 1) / static_cast<double>(hosts);
    switch (coll) {
    case Collective::Allreduce: return 2 * rest * bytes;
    case Collective::Broadcast:
    case Collective::Reduce: return bytes;
    case Collective::AllToAll: return rest * static_cast<double>(local) * bytes;
    default: return rest * bytes;
    }
}

// avg of values near the largest finite value of a dtype, where any sum of two contributions is
// out of its range: element i of rank g of n is v_i + (2g - (n-1)) * ulp, with v_i = 2^E (1 + m_i
// 2^-P) a value of the dtype (f16 32768..65504, bf16 and f32 1.7e38..3.4e38, f64 9e307..1.8e308)
// with room for the offsets, which cancel: the mean is exactly v_i.
struct NearMax {
    int exponent, mantissa_bits;
};
inline NearMax near_max(DType t) {
    switch (t) {
    case DType::F16: return {15, 10};
    case DType::BF16: return {127, 7};
    case DType::F32: return {127, 23};
    default: return {1023, 52};
    }
}
inline double near_max_ulp(DType t) { return std::ldexp(1.0, near_max(t).exponent - near_max(t).mantissa_bits); }
inline double near_max_mean(DType t, uint64_t nranks, uint64_t i) {
    const auto [e, p] = near_max(t);
    const uint64_t room = (uint64_t{1} << p) - 2 * nranks - 1;
    const uint64_t m = nranks + mix64(i + 77) % room;
    return std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -p), e);
}
inline double near_max_value(DType t, uint64_t nranks, uint64_t rank, uint64_t i) {
    return near_max_mean(t, nranks, i) +
           (2.0 * static_cast<double>(rank) - static_cast<double>(nranks - 1)) * near_max_ulp(t);
}
// The documented bound on |result - mean| of such an avg over n ranks (docs/client.md, "Accuracy"): none in
// f16/bf16 (their f32 error is far below half an ulp of the dtype, and the mean is a value of it),
// (n+1) u mean(|x|) in f32 (u = 2^-24) and f64 (u = 2^-53).
inline double near_max_bound(DType t, uint64_t nranks, double mean) {
    if (t == DType::F32) return static_cast<double>(nranks + 1) * 0x1p-24 * mean;
    if (t == DType::F64) return static_cast<double>(nranks + 1) * 0x1p-53 * mean;
    return 0;
}

// Guard bytes: a pattern that depends on the absolute position in the buffer (and a salt, so that
// a copy from another rank's buffer or an earlier run does not match), written around an op's
// range before it is submitted and checked afterwards.
constexpr size_t kGuardBytes = 256;

inline unsigned char guard_byte(size_t pos, uint64_t salt) {
    return static_cast<unsigned char>(mix64(pos * 0x2545f4914f6cdd1dull + salt) >> 56);
}

inline void guard_fill(void *base, size_t begin, size_t end, uint64_t salt) {
    auto *b = static_cast<unsigned char *>(base);
    for (size_t p = begin; p < end; ++p) b[p] = guard_byte(p, salt);
}

// Bytes in [begin, end) that no longer hold the guard pattern.
inline uint64_t guard_damage(const void *base, size_t begin, size_t end, uint64_t salt) {
    const auto *b = static_cast<const unsigned char *>(base);
    uint64_t bad = 0;
    for (size_t p = begin; p < end; ++p) bad += b[p] != guard_byte(p, salt);
    return bad;
}

// One op's range inside a buffer of `buf_bytes`, with up to kGuardBytes of guard on each side
// (fewer where the buffer ends). prepare() fills the guards and the rank's input; check() counts
// wrong result values and damaged guard bytes.
struct GuardedRange {
    size_t offset = 0, count = 0, buf_bytes = 0;
    DType dtype = DType::F32;
    uint64_t salt = 0;

    size_t bytes() const { return count * dtype_size(dtype); }
    size_t guard_begin() const { return offset > kGuardBytes ? offset - kGuardBytes : 0; }
    size_t guard_end() const {
        const size_t e = offset + bytes();
        return buf_bytes - e > kGuardBytes ? e + kGuardBytes : buf_bytes;
    }
    void prepare(void *base, uint64_t rank) const {
        guard_fill(base, guard_begin(), offset, salt);
        guard_fill(base, offset + bytes(), guard_end(), salt);
        fill(static_cast<unsigned char *>(base) + offset, count, dtype, rank);
    }
    struct Verdict {
        uint64_t wrong = 0, guard = 0;
        bool ok() const { return wrong == 0 && guard == 0; }
    };
    Verdict check(const void *base, ReduceOp op, uint64_t nranks, double abs_tol = 0) const {
        Verdict v;
        v.wrong = count_wrong(static_cast<const unsigned char *>(base) + offset, count, dtype, op, nranks, abs_tol);
        v.guard = guard_damage(base, guard_begin(), offset, salt) + guard_damage(base, offset + bytes(), guard_end(), salt);
        return v;
    }
};

}  // namespace ringd::bench
