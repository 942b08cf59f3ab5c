// Reduction kernels against a float64 reference: every dtype x op, sizes 0, 1, odd and large,
// unaligned buffers, 1..4 sources, several destinations, in place.
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
