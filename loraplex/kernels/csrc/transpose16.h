/* A 16 x 16 transpose of 32-bit elements in AVX-512 registers, for prefill_attention.c's float32
 * keys (as integers) and lora.c's A packing (floats, through the cast wrapper): r[i] lane j ->
 * r[j] lane i, four rounds of in-register shuffles. Included where VW == 16
 * (loraplex/kernels/native.py hashes every header into each build's cache key). */
#ifndef LORAPLEX_TRANSPOSE16_H
#define LORAPLEX_TRANSPOSE16_H

#include <immintrin.h>

static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 4) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        t[i + 2] = _mm512_unpacklo_epi32(r[i + 2], r[i + 3]);
        t[i + 3] = _mm512_unpackhi_epi32(r[i + 2], r[i + 3]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* the same on float registers (a bit cast each way: no instructions) */
static inline __attribute__((always_inline)) void transpose16_ps(__m512 r[16]) {
    __m512i q[16];
    for (int i = 0; i < 16; i++) q[i] = _mm512_castps_si512(r[i]);
    transpose16(q);
    for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(q[i]);
}

#endif
