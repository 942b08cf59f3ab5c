// Reduction kernels against a float64 reference: every dtype x op, sizes 0, 1, odd and large,
// unaligned buffers, 1..4 sources, several destinations, in place; f16/bf16 sum and avg exactly
// the once-rounded result on inputs where rounding every partial sum would differ.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "bench/bench_data.h"
#include "daemon/engine/reduce.h"

using namespace ringd;

namespace {

double eps(DType t) {
    switch (t) {
    case DType::F16: return std::ldexp(1.0, -10);
    case DType::BF16: return std::ldexp(1.0, -7);
    case DType::F32: return std::ldexp(1.0, -23);
    case DType::F64: return std::ldexp(1.0, -51);
    default: return 0;
    }
}

// Reference for integers: wrapping two's complement, like the kernels.
int64_t wrap(int64_t v, DType t) { return t == DType::I32 ? static_cast<int32_t>(static_cast<uint32_t>(v)) : v; }

struct Case {
    DType dtype;
    ReduceOp op;
    size_t count;
    size_t nsrc;
    size_t misalign;  // bytes added to every buffer's address (a multiple of the element size)
};

void run_case(const Case &c, std::mt19937_64 &rng) {
    const size_t es = dtype_size(c.dtype);
    const size_t bytes = c.count * es + 64;
    std::vector<std::vector<unsigned char>> in(c.nsrc, std::vector<unsigned char>(bytes + 64));
    std::vector<void *> srcs;
    std::uniform_real_distribution<double> real(-100, 100);
    std::uniform_int_distribution<int64_t> i32(INT32_MIN, INT32_MAX);
    std::uniform_int_distribution<int64_t> i64(INT64_MIN / 2, INT64_MAX / 2);
    for (auto &b : in) {
        void *p = b.data() + c.misalign;
        for (size_t i = 0; i < c.count; ++i) {
            double v = c.dtype == DType::I32 ? static_cast<double>(i32(rng))
                       : c.dtype == DType::I64 ? 0
                                               : std::round(real(rng) * 8) / 8;
            if (c.dtype == DType::I64) {
                int64_t x = i64(rng);
                std::memcpy(static_cast<unsigned char *>(p) + 8 * i, &x, 8);
            } else {
                bench::store(p, i, c.dtype, v);
            }
        }
        srcs.push_back(p);
    }
    // Reference from the stored inputs.
    std::vector<double> ref(c.count), mag(c.count);
    std::vector<int64_t> iref(c.count);
    for (size_t i = 0; i < c.count; ++i) {
        double acc = 0, m = 0;
        int64_t iacc = 0;
        for (size_t k = 0; k < c.nsrc; ++k) {
            const double v = bench::load(srcs[k], i, c.dtype);
            int64_t iv = 0;
            if (c.dtype == DType::I64) std::memcpy(&iv, static_cast<unsigned char *>(srcs[k]) + 8 * i, 8);
            else iv = static_cast<int64_t>(v);
            m += std::fabs(v);
            if (k == 0) {
                acc = v;
                iacc = iv;
                continue;
            }
            switch (c.op) {
            case ReduceOp::Sum:
            case ReduceOp::Avg:
                acc += v;
                iacc = static_cast<int64_t>(static_cast<uint64_t>(iacc) + static_cast<uint64_t>(iv));
                break;
            case ReduceOp::Min: acc = std::min(acc, v); iacc = std::min(iacc, iv); break;
            case ReduceOp::Max: acc = std::max(acc, v); iacc = std::max(iacc, iv); break;
            }
        }
        if (c.op == ReduceOp::Avg) acc /= static_cast<double>(c.nsrc);
        ref[i] = acc;
        mag[i] = m;
        iref[i] = wrap(iacc, c.dtype);
    }
    // Two extra destinations besides the sources themselves (in place).
    std::vector<unsigned char> d1(bytes + 64), d2(bytes + 64);
    std::vector<void *> dsts(srcs.begin(), srcs.end());
    dsts.push_back(d1.data() + c.misalign);
    dsts.push_back(d2.data() + c.misalign);
    std::vector<const void *> csrcs(srcs.begin(), srcs.end());
    reduce(ReduceArgs{c.dtype, c.op, csrcs.data(), csrcs.size(), dsts.data(), dsts.size(), c.count,
                      static_cast<uint32_t>(c.nsrc)});

    INFO("dtype " << dtype_name(c.dtype) << " op " << reduce_op_name(c.op) << " count " << c.count << " nsrc " << c.nsrc
                  << " misalign " << c.misalign);
    size_t wrong = 0;
    for (void *d : dsts) {
        for (size_t i = 0; i < c.count; ++i) {
            if (dtype_is_integer(c.dtype)) {
                int64_t got = 0;
                if (c.dtype == DType::I64) std::memcpy(&got, static_cast<unsigned char *>(d) + 8 * i, 8);
                else got = static_cast<int64_t>(bench::load(d, i, c.dtype));
                wrong += got != iref[i];
            } else {
                const double got = bench::load(d, i, c.dtype);
                const bool exact = c.op == ReduceOp::Min || c.op == ReduceOp::Max;
                const double tol = exact ? 0 : 2 * eps(c.dtype) * (mag[i] + std::fabs(ref[i]));
                wrong += !(std::fabs(got - ref[i]) <= tol);
            }
        }
        // Nothing written past the end.
        const auto *tail = static_cast<unsigned char *>(d) + c.count * es;
        if (d == dsts[dsts.size() - 1] || d == dsts[dsts.size() - 2])
            for (size_t i = 0; i < 32; ++i) wrong += tail[i] != 0;
    }
    CHECK(wrong == 0);
}

}  // namespace

TEST_CASE("every dtype x op matches the float64 reference", "[reduce]") {
    std::mt19937_64 rng(42);
    for (uint32_t t = 0; t < kDTypeCount; ++t) {
        for (uint32_t o = 0; o < kReduceOpCount; ++o) {
            const auto dt = static_cast<DType>(t);
            const auto op = static_cast<ReduceOp>(o);
            if (op == ReduceOp::Avg && dtype_is_integer(dt)) continue;
            for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1023}, size_t{1025}, size_t{5000}})
                for (size_t nsrc : {size_t{1}, size_t{2}, size_t{3}, size_t{4}})
                    for (size_t mis : {size_t{0}, dtype_size(dt), 3 * dtype_size(dt)}) run_case({dt, op, count, nsrc, mis}, rng);
        }
    }
}

namespace {

// v rounded once, to nearest even, to `bits` significant bits (11: f16, 8: bf16); v normal.
double round_bits(double v, int bits) {
    if (v == 0) return 0;
    int e;
    const double m = std::frexp(v, &e);  // v = m * 2^e, 0.5 <= |m| < 1
    return std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits);
}

}  // namespace

TEST_CASE("f16 and bf16 sum and avg are the exact result rounded once, not a sum rounded step by step", "[reduce]") {
    const auto [t, bits] = GENERATE(std::pair<DType, int>{DType::F16, 11}, std::pair<DType, int>{DType::BF16, 8});
    const size_t nsrc = GENERATE(3, 4, 5, 7);
    const auto op = GENERATE(ReduceOp::Sum, ReduceOp::Avg);
    INFO(dtype_name(t) << " " << reduce_op_name(op) << " of " << nsrc << " sources");
    // Inputs with every significant bit of the dtype used, signs mixed, magnitudes 1/4 .. 64: their
    // exact sum has up to 20 significant bits (exact in the kernel's f32 accumulator), and the
    // partial sums mostly do not fit the dtype, so rounding each of them gives another result.
    std::mt19937_64 rng(1234 + nsrc);
    const size_t count = 4096 + 13;  // several kernel blocks and a tail that is no vector width
    std::vector<std::vector<unsigned char>> in(nsrc, std::vector<unsigned char>(count * 2));
    std::vector<double> want(count);
    size_t kept = 0, differ = 0;
    while (kept < count) {
        double v[8], exact = 0;
        for (size_t k = 0; k < nsrc; ++k) {
            const double mant = 1 + std::ldexp(static_cast<double>(rng() % (1u << (bits - 1))), 1 - bits);  // [1, 2)
            v[k] = std::ldexp(mant, static_cast<int>(rng() % 9) - 2) * (rng() & 1 ? -1 : 1);
            exact += v[k];  // exact in double
        }
        const double div = op == ReduceOp::Avg ? static_cast<double>(nsrc) : 1;
        const double mean = exact / div;
        // The kernel scales by the f32 reciprocal of the divisor: skip the (rare) means that lie
        // within f32 error of a tie between two values of the dtype, where that could decide.
        if (std::fabs(mean) < 0x1p-12) continue;  // f16 normals only
        const double once = round_bits(mean, bits);
        const double half_ulp = std::ldexp(1.0, std::ilogb(mean) - bits);
        if (std::fabs(std::fabs(mean - once) - half_ulp) < std::fabs(mean) * 0x1p-18) continue;
        // What a kernel that rounded every partial sum to the dtype would give.
        double acc = v[0];
        for (size_t k = 1; k < nsrc; ++k) acc = round_bits(acc + v[k], bits);
        const double stepwise = round_bits(acc / div, bits);
        differ += stepwise != once;
        for (size_t k = 0; k < nsrc; ++k) bench::store(in[k].data(), kept, t, v[k]);  // exact: v fits the dtype
        want[kept++] = once;
    }
    INFO(differ << " of " << count << " results differ when every partial sum is rounded");
    REQUIRE(differ > count / 8);
    std::vector<const void *> srcs;
    for (auto &b : in) srcs.push_back(b.data());
    std::vector<unsigned char> out(count * 2);
    void *dsts[1] = {out.data()};
    reduce(ReduceArgs{t, op, srcs.data(), srcs.size(), dsts, 1, count, static_cast<uint32_t>(nsrc)});
    size_t wrong = 0;
    for (size_t i = 0; i < count; ++i) wrong += bench::load(out.data(), i, t) != want[i];
    CHECK(wrong == 0);
}

TEST_CASE("integer sums wrap around", "[reduce]") {
    int32_t a[2] = {INT32_MAX, INT32_MIN};
    int32_t b[2] = {1, -1};
    reduce_into(a, b, 2, DType::I32, ReduceOp::Sum);
    CHECK(a[0] == INT32_MIN);
    CHECK(a[1] == INT32_MAX);
}

TEST_CASE("reduce_into does not scale avg", "[reduce]") {
    float a[3] = {1, 2, 3}, b[3] = {3, 2, 1};
    reduce_into(a, b, 3, DType::F32, ReduceOp::Avg);
    CHECK(a[0] == 4);
    CHECK(a[2] == 4);
}

TEST_CASE("half and bfloat16 round to nearest even", "[reduce]") {
    CHECK(float_to_half(1.0f) == 0x3C00);
    CHECK(half_to_float(0x3C00) == 1.0f);
    CHECK(float_to_half(65504.0f) == 0x7BFF);
    CHECK(float_to_half(1e6f) == 0x7C00);                        // overflow to infinity
    CHECK(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);  // tie -> even
    CHECK(float_to_bf16(1.0f) == 0x3F80);
    CHECK(bf16_to_float(0x3F80) == 1.0f);
    CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);   // tie -> even
    CHECK(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);
    CHECK(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
    CHECK(std::isnan(half_to_float(float_to_half(std::nanf("")))));
}

TEST_CASE("min and max propagate a NaN from any source at any position, as torch.minimum/maximum do", "[reduce]") {
    for (DType t : {DType::F32, DType::F64, DType::F16, DType::BF16})
        for (ReduceOp op : {ReduceOp::Min, ReduceOp::Max})
            for (size_t nsrc : {size_t{2}, size_t{3}})
                for (size_t which = 0; which < nsrc; ++which) {
                    INFO(dtype_name(t) << " " << reduce_op_name(op) << ", NaN in source " << which << " of " << nsrc);
                    // 67 elements: vector blocks and a scalar tail; a NaN at every position in turn
                    // (element i of source `which` is NaN in round i).
                    constexpr size_t n = 67;
                    const size_t es = dtype_size(t);
                    std::vector<std::vector<unsigned char>> src(nsrc, std::vector<unsigned char>(n * es));
                    std::vector<unsigned char> dst(n * es);
                    uint64_t lost = 0;
                    for (size_t pos = 0; pos < n; ++pos) {
                        for (size_t k = 0; k < nsrc; ++k)
                            for (size_t i = 0; i < n; ++i)
                                bench::store(src[k].data(), i, t, k == which && i == pos ? std::nan("") : double(k + i % 5));
                        const void *s[3] = {src[0].data(), src[1].data(), nsrc > 2 ? src[2].data() : nullptr};
                        void *d[1] = {dst.data()};
                        reduce(ReduceArgs{t, op, s, nsrc, d, 1, n, 1});
                        for (size_t i = 0; i < n; ++i) {
                            const double v = bench::load(dst.data(), i, t);
                            if ((i == pos) != std::isnan(v)) ++lost;
                        }
                    }
                    CHECK(lost == 0);
                }
}

TEST_CASE("avg of values near the largest finite one never overflows: f16/bf16 exactly the mean, f32/f64 within the "
          "documented bound",
          "[reduce][avg]") {
    for (DType t : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
        for (size_t nsrc : {size_t{2}, size_t{3}, size_t{5}, size_t{8}}) {
            INFO(dtype_name(t) << " avg of " << nsrc << " sources near the largest value");
            const size_t count = 3 * 1024 + 7, es = dtype_size(t);
            std::vector<std::vector<unsigned char>> in(nsrc, std::vector<unsigned char>(count * es));
            std::vector<const void *> srcs;
            for (size_t k = 0; k < nsrc; ++k) {
                for (size_t i = 0; i < count; ++i) bench::store(in[k].data(), i, t, bench::near_max_value(t, nsrc, k, i));
                srcs.push_back(in[k].data());
            }
            std::vector<unsigned char> out(count * es);
            void *dsts[1] = {out.data()};
            reduce(ReduceArgs{t, ReduceOp::Avg, srcs.data(), nsrc, dsts, 1, count, static_cast<uint32_t>(nsrc)});
            size_t wrong = 0;
            for (size_t i = 0; i < count; ++i) {
                const double want = bench::near_max_mean(t, nsrc, i), got = bench::load(out.data(), i, t);
                wrong += !(std::fabs(got - want) <= bench::near_max_bound(t, nsrc, want));
            }
            CHECK(wrong == 0);
        }
    }
}

TEST_CASE("avg_shift_for: the smallest K with 2^K >= 2 x the contributions", "[reduce][avg]") {
    CHECK(avg_shift_for(0) == 1);
    CHECK(avg_shift_for(1) == 1);
    CHECK(avg_shift_for(2) == 2);
    CHECK(avg_shift_for(3) == 3);
    CHECK(avg_shift_for(4) == 3);
    CHECK(avg_shift_for(5) == 4);
    CHECK(avg_shift_for(3 * 64) == 9);
}

TEST_CASE("avg has the bits of the sum times the rounded reciprocal wherever that sum does not overflow", "[reduce][avg]") {
    // The contributions are scaled by 2^-K, which is exact: random values of every magnitude the
    // sum allows give the same bits as sum x fl(1/n), computed here in the accumulator's type.
    std::mt19937_64 rng(99);
    std::uniform_real_distribution<double> u(-1, 1);
    for (DType t : {DType::F32, DType::F64, DType::F16, DType::BF16})
        for (size_t nsrc : {size_t{2}, size_t{3}, size_t{7}}) {
            INFO(dtype_name(t) << ", " << nsrc << " sources");
            const size_t count = 2048 + 5, es = dtype_size(t);
            std::vector<std::vector<unsigned char>> in(nsrc, std::vector<unsigned char>(count * es));
            std::vector<const void *> srcs;
            for (auto &b : in) {
                for (size_t i = 0; i < count; ++i) bench::store(b.data(), i, t, std::ldexp(u(rng), static_cast<int>(i % 40) - 20));
                srcs.push_back(b.data());
            }
            std::vector<unsigned char> out(count * es), want(count * es);
            void *dsts[1] = {out.data()};
            reduce(ReduceArgs{t, ReduceOp::Avg, srcs.data(), nsrc, dsts, 1, count, static_cast<uint32_t>(nsrc)});
            for (size_t i = 0; i < count; ++i) {
                if (t == DType::F64) {
                    double acc = 0;
                    for (size_t k = 0; k < nsrc; ++k) acc += bench::load(in[k].data(), i, t);
                    acc *= 1.0 / static_cast<double>(nsrc);
                    std::memcpy(want.data() + 8 * i, &acc, 8);
                } else {
                    float acc = 0;
                    for (size_t k = 0; k < nsrc; ++k) acc += static_cast<float>(bench::load(in[k].data(), i, t));
                    acc *= 1.0f / static_cast<float>(nsrc);
                    bench::store(want.data(), i, t, acc);
                }
            }
            CHECK(std::memcmp(out.data(), want.data(), count * es) == 0);
        }
}

TEST_CASE("a reduction cut into calls through partial results: f16/bf16 partials are f32 (rounded once, at the end), "
          "avg scaled once; the same bits as one call",
          "[reduce][avg]") {
    // The ring's and the direct exchange's shape: call 1 reduces sources into a partial, each
    // further call adds its sources to the partial of the one before, the last is final.
    // Integer-valued inputs whose sums are exact in f32: any order gives the same bits, so the
    // chain must match one call over every source exactly; for f16/bf16 sum and avg the inputs
    // are those of the once-rounded test above, where rounding a partial to the dtype differs.
    for (uint32_t d = 0; d < kDTypeCount; ++d)
        for (uint32_t o = 0; o < kReduceOpCount; ++o) {
            const auto t = static_cast<DType>(d);
            const auto op = static_cast<ReduceOp>(o);
            if (op == ReduceOp::Avg && dtype_is_integer(t)) continue;
            INFO(dtype_name(t) << " " << reduce_op_name(op));
            const size_t nsrc = 6, count = 1024 + 300, es = dtype_size(t), ps = dtype_size(partial_dtype(t, op));
            std::mt19937_64 rng(7 + d * 4 + o);
            std::vector<std::vector<unsigned char>> in(nsrc, std::vector<unsigned char>(count * es));
            std::vector<const void *> srcs;
            for (auto &b : in) {
                for (size_t i = 0; i < count; ++i) {
                    // 11 significant bits (f16 exact; bf16 keeps 8 of them: rounded on store).
                    const double v = std::ldexp(static_cast<double>(static_cast<int64_t>(rng() % 2048) - 1024),
                                                dtype_is_integer(t) ? 0 : static_cast<int>(rng() % 5) - 2);
                    bench::store(b.data(), i, t, v);
                }
                srcs.push_back(b.data());
            }
            std::vector<unsigned char> once(count * es), chained(count * es);
            void *d1[1] = {once.data()};
            reduce(ReduceArgs{t, op, srcs.data(), nsrc, d1, 1, count, static_cast<uint32_t>(nsrc)});
            // The ring's chain: {0, 1} -> P1; {2, 3} + P1 -> P2; {4} -> P3; {5} + P2 + P3 -> final.
            std::vector<unsigned char> p1(count * ps), p2(count * ps), p3(count * ps);
            ReduceArgs a{t, op, srcs.data(), 2, nullptr, 0, count, static_cast<uint32_t>(nsrc)};
            a.partial_out = p1.data();
            reduce(a);
            const void *pp1[1] = {p1.data()};
            ReduceArgs b{t, op, srcs.data() + 2, 2, nullptr, 0, count, static_cast<uint32_t>(nsrc)};
            b.partials = pp1;
            b.npartial = 1;
            b.partial_out = p2.data();
            reduce(b);
            ReduceArgs c{t, op, srcs.data() + 4, 1, nullptr, 0, count, static_cast<uint32_t>(nsrc)};
            c.partial_out = p3.data();
            reduce(c);
            const void *pp23[2] = {p2.data(), p3.data()};
            void *d2[1] = {chained.data()};
            ReduceArgs f{t, op, srcs.data() + 5, 1, d2, 1, count, static_cast<uint32_t>(nsrc)};
            f.partials = pp23;
            f.npartial = 2;
            reduce(f);
            CHECK(std::memcmp(once.data(), chained.data(), count * es) == 0);
            // One-shot's shape: {0, 1} -> P1, {2..5} -> Q; P1 + Q -> final, no source of its own.
            ReduceArgs g{t, op, nullptr, 0, d2, 1, count, static_cast<uint32_t>(nsrc)};
            std::vector<unsigned char> q(count * ps);
            ReduceArgs h{t, op, srcs.data() + 2, 4, nullptr, 0, count, static_cast<uint32_t>(nsrc)};
            h.partial_out = q.data();
            reduce(h);
            const void *pq[2] = {p1.data(), q.data()};
            g.partials = pq;
            g.npartial = 2;
            std::fill(chained.begin(), chained.end(), 0);
            reduce(g);
            CHECK(std::memcmp(once.data(), chained.data(), count * es) == 0);
        }
}
