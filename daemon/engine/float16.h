// The 16-bit float conversions of the reduction kernels (reduce.cpp) and the wire formats
// (wire.cpp): bfloat16 by bits (round to nearest even, NaN kept quiet), IEEE half a block at a
// time with F16C where the CPU has it. Internal to the reduce library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define RINGD_INLINE inline __attribute__((always_inline))
// RINGD_NO_CPU_CLONES: sanitizer builds (meson option cpu_clones), see meson.build.
#if defined(__x86_64__) && !defined(RINGD_NO_CPU_CLONES)
#define RINGD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RINGD_CLONES
#endif

namespace ringd::float16 {

// Storage <-> accumulator conversions.
struct Bf16 { uint16_t bits; };

RINGD_INLINE float load_acc(const Bf16 &v) {
    const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
RINGD_INLINE Bf16 store_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return Bf16{static_cast<uint16_t>(u >> 16)};
}

// IEEE half is stored as bits and converted a block at a time: with F16C (vcvtph2ps/vcvtps2ph)
// 8 lanes per instruction, else through _Float16 one element at a time.
struct Half { uint16_t bits; };

inline void half_to_float_generic(float *d, const Half *s, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        _Float16 h;
        std::memcpy(&h, &s[i], 2);
        d[i] = static_cast<float>(h);
    }
}
inline void float_to_half_generic(Half *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        const _Float16 h = static_cast<_Float16>(s[i]);
        std::memcpy(&d[i], &h, 2);
    }
}
// The same with a scale: d = s x k (decoding), d = half((s x k1) x k2) (encoding), in that order.
inline void half_to_float_scaled_generic(float *d, const Half *s, size_t n, float k) {
    half_to_float_generic(d, s, n);
    for (size_t i = 0; i < n; ++i) d[i] *= k;
}
inline void float_to_half_scaled_generic(Half *d, const float *s, size_t n, float k1, float k2) {
    for (size_t i = 0; i < n; ++i) {
        const _Float16 h = static_cast<_Float16>(s[i] * k1 * k2);
        std::memcpy(&d[i], &h, 2);
    }
}
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) inline void half_to_float_scaled_f16c(float *d, const Half *s, size_t n, float k) {
    size_t i = 0;
    const __m256 kk = _mm256_set1_ps(k);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i))), kk));
    half_to_float_scaled_generic(d + i, s + i, n - i, k);
}
__attribute__((target("avx,f16c"))) inline void float_to_half_scaled_f16c(Half *d, const float *s, size_t n, float k1, float k2) {
    size_t i = 0;
    const __m256 a = _mm256_set1_ps(k1), b = _mm256_set1_ps(k2);
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i *>(d + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(s + i), a), b), _MM_FROUND_TO_NEAREST_INT));
    float_to_half_scaled_generic(d + i, s + i, n - i, k1, k2);
}
__attribute__((target("avx,f16c"))) inline void half_to_float_f16c(float *d, const Half *s, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i))));
    half_to_float_generic(d + i, s + i, n - i);
}
__attribute__((target("avx,f16c"))) inline void float_to_half_f16c(Half *d, const float *s, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i *>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    float_to_half_generic(d + i, s + i, n - i);
}
#endif

struct HalfConv {
    void (*to_float)(float *, const Half *, size_t) = half_to_float_generic;
    void (*from_float)(Half *, const float *, size_t) = float_to_half_generic;
    void (*to_float_scaled)(float *, const Half *, size_t, float) = half_to_float_scaled_generic;
    void (*from_float_scaled)(Half *, const float *, size_t, float, float) = float_to_half_scaled_generic;
    HalfConv() {
#if defined(__x86_64__)
        if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) {
            to_float = half_to_float_f16c;
            from_float = float_to_half_f16c;
            to_float_scaled = half_to_float_scaled_f16c;
            from_float_scaled = float_to_half_scaled_f16c;
        }
#endif
    }
};
inline const HalfConv kHalf;  // (one for the library)

}  // namespace ringd::float16
