/* What the kernels on AVX512-BF16's pair dot products share (lora.c's long bf16 segments,
 * prefill_attention.c's bf16 tiles, decode_attention.c's bf16 scores, gemm_bf16.c):
 * HAVE_DPBF16 where the build has the instructions, vdpbf16ps as `dp`, a bf16 pair as one
 * 32-bit value, and the permutes that interleave two rows of bf16 into pairs. Included by
 * each (loraplex/kernels/native.py hashes every header into every build's cache key). */
#ifndef LORAPLEX_BF16_PAIRS_H
#define LORAPLEX_BF16_PAIRS_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#include <immintrin.h>

/* vdpbf16ps: each float32 lane += a[2j] b[2j] + a[2j + 1] b[2j + 1], the bf16 products exact
 * (bf16 denormal inputs count as zero) */
static inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* elements p[0], p[1] as one 32-bit value (p[0] in the low half): the pair vdpbf16ps takes */
static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t u;
    memcpy(&u, p, sizeof u);
    return u;
}

/* _mm512_permutex2var_epi16 indices over rows r0, r1 of 32 bf16: pair_lo() gives
 * r0[0], r1[0], r0[1], r1[1], ..., r0[15], r1[15] and pair_hi() the same from element 16 */
static inline __m512i pair_lo(void) {
    return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                            38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}

static inline __m512i pair_hi(void) {
    return _mm512_add_epi16(pair_lo(), _mm512_set1_epi16(16));
}
#endif

#endif /* LORAPLEX_BF16_PAIRS_H */
