// The compressed wire formats (daemon/engine/wire.h): sizes, each format's error bound on data of
// every scale, accumulation in f32, error feedback, non-finite values, unaligned buffers.
#include <catch2/catch.hpp>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "daemon/engine/wire.h"

using namespace ringd;

namespace {

constexpr WireFormat kCompressed[] = {WireFormat::BF16, WireFormat::FP16, WireFormat::Int8};

// Values of every scale: each block of 256 its own magnitude (1e-30 .. 1e30, and some near the
// largest float), signs and zeros mixed in, and a block whose values span 2^40.
std::vector<float> test_values(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) {
        const size_t block = i / kWireBlock;
        float scale = std::pow(10.0f, static_cast<float>(static_cast<int>(block % 13) * 5 - 30));
        if (block % 7 == 3) scale = FLT_MAX / 2;
        float x = u(rng) * scale;
        if (block % 5 == 2) x = u(rng) * std::ldexp(1.0f, static_cast<int>(i % 41) - 20);  // 2^-20 .. 2^20 in one block
        if (i % 17 == 0) x = 0;
        v[i] = x;
    }
    return v;
}

float block_max(const std::vector<float> &v, size_t i) {
    const size_t b = i / kWireBlock * kWireBlock;
    float m = 0;
    for (size_t k = b; k < std::min(v.size(), b + kWireBlock); ++k) m = std::max(m, std::fabs(v[k]));
    return m;
}

// wire.h's bound on one value's error.
double bound(WireFormat f, double x, double m) {
    switch (f) {
    case WireFormat::BF16: return std::fabs(x) >= std::ldexp(1.0, -126) ? std::ldexp(std::fabs(x), -8) : std::ldexp(1.0, -134);
    case WireFormat::FP16: return std::ldexp(std::fabs(x), -11) + std::ldexp(m, -39);
    case WireFormat::Int8: return m / 254 * (1 + std::ldexp(1.0, -14));
    default: return 0;
    }
}

}  // namespace

TEST_CASE("wire formats: names and sizes", "[wire]") {
    for (auto f : {WireFormat::Exact, WireFormat::BF16, WireFormat::FP16, WireFormat::Int8})
        CHECK(parse_wire_format(wire_format_name(f)) == f);
    CHECK_FALSE(parse_wire_format("int4"));
    CHECK(wire_bytes(WireFormat::Exact, 1000) == 4000);
    CHECK(wire_bytes(WireFormat::BF16, 1000) == 2000);
    CHECK(wire_bytes(WireFormat::FP16, 256) == 4 + 512);
    CHECK(wire_bytes(WireFormat::FP16, 257) == 4 + 512 + 4 + 2);
    CHECK(wire_bytes(WireFormat::Int8, 1000) == 3 * 260 + 4 + 232);
    CHECK(wire_bytes(WireFormat::Int8, 0) == 0);
}

TEST_CASE("wire formats: every value within its format's bound, at every scale; accumulation adds the decoded "
          "values in f32; any alignment",
          "[wire]") {
    for (WireFormat f : kCompressed) {
        for (size_t n : {size_t{1}, size_t{255}, size_t{256}, size_t{257}, size_t{1000}, size_t{4099}}) {
            INFO(wire_format_name(f) << ", " << n << " values");
            const auto x = test_values(n, static_cast<uint32_t>(n));
            // Out of a buffer one byte off alignment, as a frame's payload may be.
            std::vector<unsigned char> buf(wire_bytes(f, n) + 1, 0xee);
            wire_encode(f, x.data(), n, buf.data() + 1);
            CHECK(buf[0] == 0xee);
            std::vector<float> d(n);
            wire_decode(f, buf.data() + 1, n, d.data());
            size_t over = 0;
            for (size_t i = 0; i < n; ++i)
                if (!(std::fabs(static_cast<double>(d[i]) - x[i]) <= bound(f, x[i], block_max(x, i)))) ++over;
            CHECK(over == 0);
            std::vector<float> acc(n), want(n);
            for (size_t i = 0; i < n; ++i) acc[i] = want[i] = static_cast<float>(i % 9) - 4.0f;
            for (size_t i = 0; i < n; ++i) want[i] += d[i];
            wire_accumulate(f, buf.data() + 1, n, acc.data());
            CHECK(std::memcmp(acc.data(), want.data(), 4 * n) == 0);
            // In place (over the values themselves, where the encoding fits them: not one value
            // with a scale), with and without a residual: the same bytes.
            for (bool with_residual : {false, true}) {
                if (wire_bytes(f, n) > 4 * n) break;
                std::vector<float> r1(n, 0.25f), r2(n, 0.25f), in_place = x;
                std::vector<unsigned char> apart(wire_bytes(f, n));
                wire_encode(f, x.data(), n, apart.data(), with_residual ? r1.data() : nullptr);
                wire_encode(f, in_place.data(), n, in_place.data(), with_residual ? r2.data() : nullptr);
                CHECK(std::memcmp(in_place.data(), apart.data(), apart.size()) == 0);
                CHECK(std::memcmp(r1.data(), r2.data(), 4 * n) == 0);
            }
        }
    }
    // exact is the data, byte for byte.
    const auto x = test_values(300, 3);
    std::vector<float> out(300);
    std::vector<unsigned char> buf(wire_bytes(WireFormat::Exact, 300));
    wire_encode(WireFormat::Exact, x.data(), 300, buf.data());
    wire_decode(WireFormat::Exact, buf.data(), 300, out.data());
    CHECK(std::memcmp(out.data(), x.data(), 4 * 300) == 0);
}

TEST_CASE("wire formats: with error feedback what a value loses is sent in the next steps, so the sum over steps "
          "stays within one step's bound; without it int8 loses a small value every step",
          "[wire]") {
    // Small values next to a large one in their block: int8 rounds them to 0 each time.
    const size_t n = 512;
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = (i % kWireBlock == 0) ? 100.0f : 0.1f + 0.001f * static_cast<float>(i % 50);
    constexpr int kSteps = 64;
    for (WireFormat f : kCompressed) {
        INFO(wire_format_name(f));
        std::vector<float> residual(n, 0.0f), sum_fb(n, 0.0f), sum_plain(n, 0.0f), d(n);
        std::vector<unsigned char> buf(wire_bytes(f, n));
        for (int s = 0; s < kSteps; ++s) {
            wire_encode(f, x.data(), n, buf.data(), residual.data());
            wire_accumulate(f, buf.data(), n, sum_fb.data());
            wire_encode(f, x.data(), n, buf.data());
            wire_accumulate(f, buf.data(), n, sum_plain.data());
        }
        size_t over = 0;
        for (size_t i = 0; i < n; ++i) {
            // The residual left is what is not yet sent: sum + residual is kSteps x exactly (but
            // for f32 rounding of the sums), and the residual is within one step's bound.
            const double want = static_cast<double>(x[i]) * kSteps;
            const double slack = want * 1e-5;
            if (!(std::fabs(sum_fb[i] + residual[i] - want) <= slack)) ++over;
            if (!(std::fabs(residual[i]) <= bound(f, x[i] + residual[i], 100.0) + slack)) ++over;
        }
        CHECK(over == 0);
        if (f == WireFormat::Int8) CHECK(sum_plain[1] == 0.0f);  // 0.1 in a block of 100: 0 every step
    }
}

TEST_CASE("wire formats: NaN and infinities", "[wire]") {
    std::vector<float> x(2 * kWireBlock, 1.5f);
    x[3] = std::nanf("");
    x[7] = INFINITY;
    for (WireFormat f : kCompressed) {
        INFO(wire_format_name(f));
        std::vector<unsigned char> buf(wire_bytes(f, x.size()));
        std::vector<float> residual(x.size(), 0.0f), d(x.size());
        wire_encode(f, x.data(), x.size(), buf.data(), residual.data());
        wire_decode(f, buf.data(), x.size(), d.data());
        CHECK(std::isnan(d[3]));
        if (f == WireFormat::Int8) {
            CHECK(std::isnan(d[7]));
            CHECK(std::isnan(d[100]));  // the whole block
        } else {
            CHECK(d[7] == INFINITY);
            CHECK(d[100] == 1.5f);
        }
        CHECK(d[kWireBlock + 5] == 1.5f);  // the next block is its own
        CHECK(residual[3] == 0.0f);
        CHECK(residual[7] == 0.0f);
    }
    // A value next to a rounding midpoint of int8 (its error just over half a step: the f32
    // roundings of 127 / m and of q s count), and the largest floats: int8 keeps them finite.
    {
        const std::vector<float> mid{0x1.6ad99ap+41f, 0x1.0290fcp+41f};
        std::vector<unsigned char> b(wire_bytes(WireFormat::Int8, 2));
        std::vector<float> t(2);
        wire_encode(WireFormat::Int8, mid.data(), 2, b.data());
        wire_decode(WireFormat::Int8, b.data(), 2, t.data());
        for (size_t i = 0; i < 2; ++i) CHECK(std::fabs(static_cast<double>(t[i]) - mid[i]) <= bound(WireFormat::Int8, mid[i], mid[0]));
        const std::vector<float> top{FLT_MAX, -FLT_MAX, 1.0f};
        std::vector<float> residual(3, 0.0f);
        b.resize(wire_bytes(WireFormat::Int8, 3));
        t.resize(3);
        wire_encode(WireFormat::Int8, top.data(), 3, b.data(), residual.data());
        wire_decode(WireFormat::Int8, b.data(), 3, t.data());
        for (size_t i = 0; i < 2; ++i) {
            CHECK(std::isfinite(t[i]));
            CHECK(std::fabs(static_cast<double>(t[i]) - top[i]) <= bound(WireFormat::Int8, top[i], FLT_MAX));
            CHECK(residual[i] == top[i] - t[i]);  // (what the receiver decodes, however the CPU multiplies)
        }
    }
    // Blocks of tiny values (subnormal floats included): within m, never a NaN or an infinity.
    for (WireFormat f : kCompressed) {
        std::vector<float> tiny(kWireBlock);
        for (size_t i = 0; i < tiny.size(); ++i) tiny[i] = std::ldexp(static_cast<float>(i % 5) - 2.0f, -140 + static_cast<int>(i % 20));
        std::vector<unsigned char> b(wire_bytes(f, tiny.size()));
        std::vector<float> t(tiny.size());
        wire_encode(f, tiny.data(), tiny.size(), b.data());
        wire_decode(f, b.data(), tiny.size(), t.data());
        const float m = std::ldexp(2.0f, -121);
        for (size_t i = 0; i < tiny.size(); ++i) CHECK(std::fabs(t[i] - tiny[i]) <= m);
    }
    // fp16: each block's scale puts its largest magnitude in [2^14, 2^15] (a block whose largest
    // value is just under a power of two: one power more would take it past half's range).
    for (int k : {-90, -3, 0, 7, 100}) {
        std::vector<float> blk(kWireBlock, 0.25f * std::ldexp(1.0f, k));
        blk[9] = std::ldexp(0x1.fffp0f, k);
        std::vector<unsigned char> b(wire_bytes(WireFormat::FP16, blk.size()));
        std::vector<float> t(blk.size());
        wire_encode(WireFormat::FP16, blk.data(), blk.size(), b.data());
        float scale;
        std::memcpy(&scale, b.data(), 4);
        const double scaled = blk[9] / static_cast<double>(scale);
        CHECK(scaled >= 0x1p14);
        CHECK(scaled <= 0x1p15);
        wire_decode(WireFormat::FP16, b.data(), blk.size(), t.data());
        CHECK(std::fabs(static_cast<double>(t[9]) - blk[9]) <= bound(WireFormat::FP16, blk[9], blk[9]));
    }
    // fp16: large floats are scaled, not overflowed (up to where rounding to 11 bits reaches 2^128).
    std::vector<float> big(kWireBlock, std::ldexp(1.999f, 127));
    big[1] = -FLT_MAX / 3;
    std::vector<unsigned char> buf(wire_bytes(WireFormat::FP16, big.size()));
    std::vector<float> d(big.size());
    wire_encode(WireFormat::FP16, big.data(), big.size(), buf.data());
    wire_decode(WireFormat::FP16, buf.data(), big.size(), d.data());
    CHECK(std::fabs(d[0] - big[0]) <= std::ldexp(big[0], -11));
    CHECK(std::fabs(d[1] + FLT_MAX / 3) <= std::ldexp(FLT_MAX / 3, -11));
}
