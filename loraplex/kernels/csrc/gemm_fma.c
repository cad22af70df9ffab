/* A float32 GEMM of FMA vectors on prepacked weights: y = x @ w^T (+ bias), for CPUs without
 * AMX tiles (gemm_amx.c serves those that have them).
 *
 * Why: a decode step's projections are GEMMs of a few dozen rows against weights that do not
 * fit in cache; oneDNN's prepacked float32 GEMM (torch's mkldnn linear) streams them well but
 * leaves FMA throughput on the table at these row counts. On a Zen 3 core (AVX2, 8 lanes) this
 * kernel measured 1.1-1.2x oneDNN on 32 rows and 1.1-1.6x on one row at a Llama's shapes,
 * with the same error against a float64 reference (benchmarks/amx_gemm_bench.py,
 * tests/kernels/test_fma_gemm.py).
 *
 * Layout, rearranged once (loraplex_fma_pack), still float32 (4 bytes an element, as the dense
 * weight): NR = 2 VW columns a panel (VW: the machine's vector, vector_width.h); the depth in
 * chunks of KC (at most KC_BYTES, 64 KiB, of a panel: the chunk stays in L2 while every row
 * group runs over it; 16 KiB chunks, in L1, measured slower: y is reloaded once a chunk; k
 * split evenly, so the last chunk is not a sliver); chunk-major: chunk, then
 * panel, then depth, then the panel's NR columns. Columns past n are zero; nothing pads k.
 *
 * The micro-kernel holds MR rows x NR columns in 2 MR accumulator vectors (6 x 16 on AVX2:
 * 12 of its 16 registers, two for the weights, one for x's broadcast; 12 x 32 with AVX-512's
 * 32 registers), reading x in place (one broadcast a row and depth) and the panel's two weight
 * vectors a depth. Loops: blocks of up to MC rows, split evenly (a decode step's chunk of x,
 * 32 x KC floats, stays in L2; a full block's does not, measured no slower than 120 rows),
 * then depth chunks, then panels over the OpenMP threads, then the block's row groups, their
 * rows spread evenly (32 rows on AVX2: 6,6,5,5,5,5, not 6,6,6,6,6,2). Chunks after the first
 * add to the partial sums in y; the last adds the bias.
 */
#include <stdint.h>
#include <string.h>

#include "vector_width.h"

/* -std=c11 turns off contracting a * b + c into one FMA: this kernel is nothing else. */
#pragma GCC optimize("fp-contract=fast")

#define NR (2 * VW)
#if VW == 16
#define MR 12
#else
#define MR 6
#endif
#ifndef KC_BYTES
#define KC_BYTES 65536
#endif
#define KC_MAX (KC_BYTES / (4 * NR))
#ifndef MC
#define MC (40 * MR)
#endif

#ifndef SUB
#define SUB 128
#endif

#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(4 * VW), aligned(4), may_alias));

static int64_t round_nr(int64_t n) { return (n + NR - 1) / NR * NR; }

/* the depth of every chunk but the last (k split evenly into chunks of at most KC_MAX) */
static int64_t chunk_depth(int64_t k) {
    const int64_t chunks = (k + KC_MAX - 1) / KC_MAX;
    return chunks > 0 ? (k + chunks - 1) / chunks : 1;
}

/* 1 where this build was measured faster than oneDNN (x86 with AVX2 and FMA, no AVX-512:
   a Zen 3 core), so that LORAPLEX_FMA_GEMM=auto turns it on; elsewhere it is correct but
   unmeasured (AVX-512's 12 x 32 tiles) or plainly slower (no FMA) */
int loraplex_fma_tuned(void) {
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* float32 elements of a packed [n, k] weight */
int64_t loraplex_fma_packed_elems(int64_t n, int64_t k) { return round_nr(n) * k; }

void loraplex_fma_pack(const float *w, int64_t ldw, int64_t n, int64_t k, float *out,
                       int threads) {
    const int64_t np = round_nr(n), kc = chunk_depth(k);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t col = 0; col < np; col++) {
        const int64_t panel = col / NR, j = col % NR;
        for (int64_t d0 = 0; d0 < k; d0 += kc) {
            const int64_t kcc = k - d0 < kc ? k - d0 : kc;
            float *dst = out + d0 * np + panel * kcc * NR + j;
            for (int64_t d = 0; d < kcc; d++)
                dst[d * NR] = col < n ? w[col * ldw + d0 + d] : 0.0f;
        }
    }
}

/* rows (<= MR) x one panel's chunk: y = (first ? 0 : y) + x[:, chunk] @ panel, + bias when
   given; only the first `cols` columns of y exist.
   The sum is two-level: SUB depths at a time into fresh register accumulators, each part
   then added to running totals kept in L1 (tot). A single running sum a column errs like
   sqrt(k) roundings (at 4200 deep, 5x oneDNN's blocked sums: the tests' 4x bound failed);
   two levels like sqrt(SUB) + sqrt(k / SUB): measured 3-4x under oneDNN's error. Cost: a
   vector load, add and store per accumulator each SUB depths. */
INLINE void tile(const float *wp, int64_t kcc, const float *x, int64_t ldx, float *y,
                 int64_t ldy, int64_t cols, const float *bias, int first, const int rows) {
    float tot[MR][NR] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++) {
        if (first) {
            memset(tot[r], 0, sizeof tot[r]);
        } else {
            memcpy(tot[r], y + r * ldy, cols * sizeof(float));
            if (cols < NR) memset(tot[r] + cols, 0, (NR - cols) * sizeof(float));
        }
    }
    for (int64_t s0 = 0; s0 < kcc; s0 += SUB) {
        const int64_t s1 = kcc - s0 < SUB ? kcc : s0 + SUB;
        /* tot lives in memory: kept in registers across the loop below (GCC does, unasked),
           it leaves too few for the accumulators, which then move between registers every
           depth (0.8x) */
        __asm__ volatile("" : : "r"(tot) : "memory");
        vf acc[MR][2];
        for (int r = 0; r < rows; r++)
            acc[r][0] = acc[r][1] = (vf){0};
        for (int64_t d = s0; d < s1; d++) {
            const vf w0 = *(const vf *)(wp + d * NR), w1 = *(const vf *)(wp + d * NR + VW);
            for (int r = 0; r < rows; r++) {
                const float xv = x[r * ldx + d];
                acc[r][0] += w0 * xv;
                acc[r][1] += w1 * xv;
            }
        }
        for (int r = 0; r < rows; r++) {
            *(vf *)tot[r] += acc[r][0];
            *(vf *)(tot[r] + VW) += acc[r][1];
        }
    }
    if (bias != NULL) {
        float b[NR] = {0};
        memcpy(b, bias, cols * sizeof(float));
        const vf b0 = *(const vf *)b, b1 = *(const vf *)(b + VW);
        for (int r = 0; r < rows; r++) {
            *(vf *)tot[r] += b0;
            *(vf *)(tot[r] + VW) += b1;
        }
    }
    for (int r = 0; r < rows; r++)
        memcpy(y + r * ldy, tot[r], cols * sizeof(float));
}

#define TILE_CASE(R) \
    case R: tile(wp, kcc, x, ldx, y, ldy, cols, bias, first, R); break;

static void tile_rows(const float *wp, int64_t kcc, const float *x, int64_t ldx, float *y,
                      int64_t ldy, int64_t cols, const float *bias, int first, int rows) {
    switch (rows) {
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5)
#if MR == 12
    TILE_CASE(6) TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11)
#endif
    default: tile(wp, kcc, x, ldx, y, ldy, cols, bias, first, MR); break;
    }
}

void loraplex_fma_linear(const float *x, int64_t ldx, const float *w, const float *bias,
                         float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int threads) {
    if (m <= 0 || n <= 0)
        return;
    if (k <= 0) {  /* an empty sum: y is the bias (or zero) */
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++)
                y[r * ldy + j] = bias != NULL ? bias[j] : 0.0f;
        return;
    }
    const int64_t np = round_nr(n), panels = np / NR, kc = chunk_depth(k);
    /* row blocks of at most MC rows, split evenly (256 rows: 2 x 128, not 240 + 16) */
    const int64_t blocks = (m + MC - 1) / MC, mb = (m + blocks - 1) / blocks;
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
        const int64_t mc = m - m0 < mb ? m - m0 : mb;
        const int64_t groups = (mc + MR - 1) / MR, base = mc / groups, extra = mc % groups;
        for (int64_t d0 = 0; d0 < k; d0 += kc) {
            const int64_t kcc = k - d0 < kc ? k - d0 : kc;
            const int first = d0 == 0, last = d0 + kcc >= k;
            const float *wc = w + d0 * np;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int64_t n0 = p * NR, cols = n - n0 < NR ? n - n0 : NR;
                int64_t r0 = m0;
                for (int64_t g = 0; g < groups; g++) {
                    const int rows = (int)(base + (g < extra));
                    tile_rows(wc + p * kcc * NR, kcc, x + r0 * ldx + d0, ldx, y + r0 * ldy + n0,
                              ldy, cols, last && bias != NULL ? bias + n0 : NULL, first, rows);
                    r0 += rows;
                }
            }
        }
    }
}
