#include "daemon/engine/wire.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "daemon/engine/float16.h"

namespace ringd {
namespace {

using namespace float16;

// A block's header: its scale, the f32 that each decoded value is multiplied by.
constexpr size_t kScaleBytes = 4;

RINGD_INLINE float load_scale(const unsigned char *p) {
    float s;
    std::memcpy(&s, p, 4);
    return s;
}
RINGD_INLINE void store_scale(unsigned char *p, float s) { std::memcpy(p, &s, 4); }

// The largest magnitude of n values, and whether any is a NaN or an infinity: an integer max of
// their bits without the sign (magnitudes order as their bits do, infinity and NaN above every
// finite value), which vectorises where a float max reduction would not.
RINGD_INLINE float block_max(const float *x, size_t n, bool &finite) {
    uint32_t top = 0;
    for (size_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, x + i, 4);
        u &= 0x7fffffffu;
        top = u > top ? u : top;
    }
    finite = top <= 0x7f7fffffu;
    float m;
    std::memcpy(&m, &top, 4);
    return m;
}

// encode, accumulate and decode of each format, a block at a time (bf16 has no blocks: it is cut
// into blocks only to keep the sums of value and residual in L1).
RINGD_INLINE void with_residual(const float *src, float *residual, size_t n, float *sum) {
    for (size_t i = 0; i < n; ++i) sum[i] = src[i] + residual[i];
}
RINGD_INLINE void new_residual(const float *sum, const float *decoded, size_t n, float *residual) {
    for (size_t i = 0; i < n; ++i) {
        const float r = sum[i] - decoded[i];
        residual[i] = std::isfinite(r) ? r : 0.0f;  // (a NaN or an infinity leaves nothing to carry)
    }
}

// Each encoder, a block of at most kWireBlock values at a time: encode_block(base, n, x) writes
// values [base, base + n) from x; with a residual, x is each value plus its residual, and the
// residual becomes x minus what decode_block(base, n, back) gives back (what a receiver decodes).
template <typename Encode, typename Decode>
RINGD_INLINE void encode_blocks(const float *src, size_t count, float *residual, Encode encode_block,
                                Decode decode_block) {
    float sum[kWireBlock], back[kWireBlock];
    for (size_t base = 0; base < count; base += kWireBlock) {
        const size_t n = std::min(kWireBlock, count - base);
        const float *x = src + base;
        if (residual) {
            with_residual(x, residual + base, n, sum);
            x = sum;
        }
        encode_block(base, n, x);
        if (residual) {
            decode_block(base, n, back);
            new_residual(x, back, n, residual + base);
        }
    }
}

// (bf16 values are read and written by memcpy: a message's payload has any alignment.)
RINGD_INLINE float get_bf16(const unsigned char *p, size_t i) {
    Bf16 b;
    std::memcpy(&b.bits, p + 2 * i, 2);
    return load_acc(b);
}

RINGD_CLONES void encode_bf16(const float *src, size_t count, unsigned char *out, float *residual) {
    encode_blocks(
        src, count, residual,
        [&](size_t base, size_t n, const float *x) __attribute__((always_inline)) {
            // (The block into L1 first, then out: the whole block is read before any of it is
            // written, so that encoding in place works, and the loop vectorises.)
            uint16_t bits[kWireBlock];
            for (size_t i = 0; i < n; ++i) bits[i] = store_bf16(x[i]).bits;
            std::memcpy(out + 2 * base, bits, 2 * n);
        },
        [&](size_t base, size_t n, float *back) __attribute__((always_inline)) {
            for (size_t i = 0; i < n; ++i) back[i] = get_bf16(out, base + i);
        });
}
RINGD_CLONES void accumulate_bf16(const unsigned char *in, size_t count, float *acc) {
    for (size_t i = 0; i < count; ++i) acc[i] += get_bf16(in, i);
}
RINGD_CLONES void decode_bf16(const unsigned char *in, size_t count, float *out) {
    for (size_t i = 0; i < count; ++i) out[i] = get_bf16(in, i);
}

// fp16: the block's largest magnitude m is brought into [2^14, 2^15) by 2^e, e = 14 - floor(log2
// m) (at most 149, so that the decoding scale 2^-e is a float), applied as two exact powers of two.
struct Fp16Scale {
    float up1 = 1, up2 = 1, down = 1;
};
RINGD_INLINE Fp16Scale fp16_scale(float m, bool finite) {
    Fp16Scale s;
    if (!finite || m == 0) return s;
    int exp = 0;
    (void)std::frexp(m, &exp);  // m = f 2^exp, f in [0.5, 1): floor(log2 m) = exp - 1
    const int e = std::min(14 - (exp - 1), 149);
    const int e1 = std::min(e, 127);
    s.up1 = std::ldexp(1.0f, e1);
    s.up2 = std::ldexp(1.0f, e - e1);
    s.down = std::ldexp(1.0f, -e);
    return s;
}

RINGD_CLONES void decode_fp16_block(const unsigned char *blk, size_t n, float *out) {
    kHalf.to_float_scaled(out, reinterpret_cast<const Half *>(blk + kScaleBytes), n, load_scale(blk));
}

RINGD_CLONES void encode_fp16(const float *src, size_t count, unsigned char *out, float *residual) {
    auto block = [out](size_t base) { return out + (base / kWireBlock) * (kScaleBytes + 2 * kWireBlock); };
    encode_blocks(
        src, count, residual,
        [&](size_t base, size_t n, const float *x) __attribute__((always_inline)) {
            // (The block's halves into L1 first, then out: in place, the scale's bytes would land
            // on values not yet read.)
            Half halves[kWireBlock];
            bool finite = true;
            const float m = block_max(x, n, finite);
            const Fp16Scale s = fp16_scale(m, finite);
            kHalf.from_float_scaled(halves, x, n, s.up1, s.up2);
            store_scale(block(base), s.down);
            std::memcpy(block(base) + kScaleBytes, halves, 2 * n);
        },
        [&](size_t base, size_t n, float *back) __attribute__((always_inline)) { decode_fp16_block(block(base), n, back); });
}

// int8: q = round(x * 127 / m) (|q| <= 127), decoded as q * (m / 127).
RINGD_CLONES void decode_int8_block(const unsigned char *blk, size_t n, float *out) {
    const float scale = load_scale(blk);
    const auto *q = reinterpret_cast<const int8_t *>(blk + kScaleBytes);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
}

RINGD_CLONES void encode_int8(const float *src, size_t count, unsigned char *out, float *residual) {
    auto block = [out](size_t base) { return out + (base / kWireBlock) * (kScaleBytes + kWireBlock); };
    encode_blocks(
        src, count, residual,
        [&](size_t base, size_t n, const float *x) __attribute__((always_inline)) {
            unsigned char *blk = block(base);
            bool finite = true;
            const float m = block_max(x, n, finite);
            // (A block whose values are all below 2^-100 travels as zeros: 127 / m could overflow.)
            const bool zeros = finite && m < 0x1p-100f;
            float scale = !finite ? std::nanf("") : zeros ? 0.0f : m / 127.0f;
            if (finite && !(127.0f * scale <= FLT_MAX)) scale = std::nextafter(scale, 0.0f);  // (m near FLT_MAX: 127 q stays finite)
            const float inv = finite && !zeros ? 127.0f / m : 0.0f;
            // (Quantized into a local array, then copied: stores through the message's bytes could
            // alias the values, which would keep the loop from being vectorised.)
            int8_t q[kWireBlock] = {};  // (a block with a NaN or an infinity: zeros, decoded as NaN)
            if (finite) {
                for (size_t i = 0; i < n; ++i) {
                    // |x inv| <= 127 and a hair: adding and taking away 1.5 x 2^23 rounds it to the
                    // nearest integer, ties to even, in two vector adds (no call, whatever the ISA),
                    // clamped as an integer (a float compare is a branch the vectoriser keeps).
                    const float v = (x[i] * inv + 12582912.0f) - 12582912.0f;
                    int32_t k = static_cast<int32_t>(v);
                    k = k < -127 ? -127 : k;
                    k = k > 127 ? 127 : k;
                    q[i] = static_cast<int8_t>(k);
                }
            }
            store_scale(blk, scale);  // (after every value of the block is read: in place works)
            std::memcpy(blk + kScaleBytes, q, n);
        },
        [&](size_t base, size_t n, float *back) __attribute__((always_inline)) { decode_int8_block(block(base), n, back); });
}

size_t block_bytes(WireFormat f) {
    return f == WireFormat::FP16 ? kScaleBytes + 2 * kWireBlock : kScaleBytes + kWireBlock;
}

// The blocked formats' accumulate and decode: each block decoded into L1, then added or copied.
template <typename Use>
void per_block(WireFormat f, const void *in, size_t count, Use use) {
    const auto *p = static_cast<const unsigned char *>(in);
    float tmp[kWireBlock];
    for (size_t base = 0; base < count; base += kWireBlock) {
        const size_t n = std::min(kWireBlock, count - base);
        const unsigned char *blk = p + (base / kWireBlock) * block_bytes(f);
        if (f == WireFormat::FP16) decode_fp16_block(blk, n, tmp);
        else decode_int8_block(blk, n, tmp);
        use(base, n, tmp);
    }
}

}  // namespace

size_t wire_bytes(WireFormat f, size_t count) {
    switch (f) {
    case WireFormat::Exact: return 4 * count;
    case WireFormat::BF16: return 2 * count;
    case WireFormat::FP16:
    case WireFormat::Int8: {
        const size_t full = count / kWireBlock, rest = count % kWireBlock;
        const size_t per_value = f == WireFormat::FP16 ? 2 : 1;
        return full * block_bytes(f) + (rest ? kScaleBytes + rest * per_value : 0);
    }
    }
    return 0;
}

void wire_encode(WireFormat f, const float *src, size_t count, void *out, float *residual) {
    if (count == 0) return;
    switch (f) {
    case WireFormat::Exact:
        if (residual) {
            for (size_t i = 0; i < count; ++i) {
                const float v = src[i] + residual[i];
                std::memcpy(static_cast<unsigned char *>(out) + 4 * i, &v, 4);
                residual[i] = 0;
            }
        } else {
            std::memcpy(out, src, 4 * count);
        }
        return;
    case WireFormat::BF16: return encode_bf16(src, count, static_cast<unsigned char *>(out), residual);
    case WireFormat::FP16: return encode_fp16(src, count, static_cast<unsigned char *>(out), residual);
    case WireFormat::Int8: return encode_int8(src, count, static_cast<unsigned char *>(out), residual);
    }
}

void wire_accumulate(WireFormat f, const void *in, size_t count, float *acc) {
    if (count == 0) return;
    switch (f) {
    case WireFormat::Exact: {
        const auto *p = static_cast<const unsigned char *>(in);
        for (size_t i = 0; i < count; ++i) {
            float v;
            std::memcpy(&v, p + 4 * i, 4);
            acc[i] += v;
        }
        return;
    }
    case WireFormat::BF16: return accumulate_bf16(static_cast<const unsigned char *>(in), count, acc);
    default:
        per_block(f, in, count, [&](size_t base, size_t n, const float *v) {
            for (size_t i = 0; i < n; ++i) acc[base + i] += v[i];
        });
    }
}

void wire_decode(WireFormat f, const void *in, size_t count, float *out) {
    if (count == 0) return;
    switch (f) {
    case WireFormat::Exact: std::memcpy(out, in, 4 * count); return;
    case WireFormat::BF16: return decode_bf16(static_cast<const unsigned char *>(in), count, out);
    default: {
        // Each block straight into its place (no copy through L1, as accumulate needs).
        const auto *p = static_cast<const unsigned char *>(in);
        for (size_t base = 0; base < count; base += kWireBlock) {
            const size_t n = std::min(kWireBlock, count - base);
            const unsigned char *blk = p + (base / kWireBlock) * block_bytes(f);
            if (f == WireFormat::FP16) decode_fp16_block(blk, n, out + base);
            else decode_int8_block(blk, n, out + base);
        }
    }
    }
}

}  // namespace ringd
