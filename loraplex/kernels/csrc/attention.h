/* What the two attention kernels (decode_attention.c, prefill_attention.c) share: vector
 * types, bf16 <-> float32 as torch rounds, a horizontal sum, and a vectorised exp. Included
 * by both (loraplex/kernels/native.py hashes this header into every build's cache key). */
#ifndef LORAPLEX_ATTENTION_H
#define LORAPLEX_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_width.h"

/* -std=c11 turns off contracting a * b + c into one FMA; these loops are sums of products. */
#pragma GCC optimize("fp-contract=fast")

#define INLINE static inline __attribute__((always_inline))

/* GCC/clang vectors: v8f and v4f for horizontal sums; the kernels' own loops are written in
 * vectors of the machine's width, VW (vector_width.h), below. 64-byte vectors on an AVX2 CPU
 * are register pairs: GCC spilled arrays of them to the stack and moved them through general
 * registers (decode_attention.c's running sums: 2-3.8x slower on a Zen 3 core). */
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

INLINE float bf16_to_f32(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* torch's c10::round_to_nearest_even: ties to even, every NaN to the quiet NaN 0x7FC0. */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 (scores minus their maximum), a vector at a time: Cephes' expf, x = n ln2
 * + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n built in the exponent bits;
 * within 2 ulp of expf. Explicit vectors because glibc's expf is a scalar call in gcc's eyes.
 * Below -87 (e^-87 ~ 1.6e-38, nothing next to the largest term, 1) the result is 0, so -inf
 * gives 0 (padding lanes); NaN stays NaN (a NaN score must poison its row, as in the
 * reference). */
#define DEFINE_EXP(NAME, VF, VI)                                                           \
    INLINE VF NAME(VF x) {                                                                 \
        const VI live = (x >= -87.0f) | (x != x); /* all ones where kept; NaN stays NaN */ \
        x = (VF)(((VI)x & live) | ((VI)((VF){0} - 87.0f) & ~live));                        \
        /* round to nearest by the 1.5 * 2^23 trick (|x log2 e| < 2^22; any rounding mode) */ \
        const VF n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;               \
        VF r = x - n * 0.693359375f;                                                       \
        r = r - n * -2.12194440e-4f;                                                       \
        VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                    \
        p = p * r + 8.3334519073e-3f;                                                      \
        p = p * r + 4.1665795894e-2f;                                                      \
        p = p * r + 1.6666665459e-1f;                                                      \
        p = p * r + 5.0000001201e-1f;                                                      \
        p = p * r * r + r + 1.0f;                                                          \
        const VI two_n = (__builtin_convertvector(n, VI) + 127) << 23;                     \
        return (VF)((VI)(p * (VF)two_n) & live);                                           \
    }

/* Vectors of the machine's width, VW floats (vector_width.h: 16 with AVX-512, 8 with AVX2). */
typedef float vwf __attribute__((vector_size(4 * VW)));
typedef float vwf_u __attribute__((vector_size(4 * VW), aligned(4)));
typedef int32_t vwi __attribute__((vector_size(4 * VW)));
typedef uint32_t vwu __attribute__((vector_size(4 * VW)));
typedef uint32_t vwu_u __attribute__((vector_size(4 * VW), aligned(2)));

INLINE vwf loadw(const float *p) { return *(const vwf_u *)p; }
INLINE void storew(float *p, vwf v) { *(vwf_u *)p = v; }

INLINE float hsumw(vwf v) {
#if defined(__clang__) || __GNUC__ >= 12 /* __builtin_shufflevector */
#if VW == 16
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
            + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8f a = v;
#endif
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
#else
    float r = 0.0f;
    for (int i = 0; i < VW; i++) r += v[i];
    return r;
#endif
}

DEFINE_EXP(expw, vwf, vwi)

#endif /* LORAPLEX_ATTENTION_H */
