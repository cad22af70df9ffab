/* A float32 GEMM on AMX tiles, as six bfloat16 products: y = x @ w^T (+ bias).
 *
 * Why: on a CPU with AMX (Intel Sapphire Rapids and later) a bf16 tile product does 16x16x32
 * multiply-adds in one instruction, with float32 accumulation; float32 itself has no tile
 * product. Split every float32 value into three bf16 parts, v = h + m + l (truncation: h takes
 * the top 8 mantissa bits, m the next 8 of the remainder, l the next 8: 24 bits in all, so the
 * split is exact for normal floats), and keep the six products of order 2^-16 or more:
 *
 *     x.w ~= xh.wh + xh.wm + xm.wh + xh.wl + xl.wh + xm.wm
 *
 * Each bf16 x bf16 product is exact in float32 and the tile unit accumulates in float32, so the
 * result carries float32's rounding (the dropped terms are below 2^-24 of the product): error
 * within a few ulp of a float32 GEMM's, measured equal to MKL's against a float64 reference
 * (tests/kernels/test_amx_gemm.py). Six tile products per 32-deep step still beat the 16-lane
 * float32 FMAs: against oneDNN's prepacked float32 GEMM, weights out of cache, at SmolLM2's
 * shapes, 1.3-1.5x on 32 decode rows (the weights streamed at ~8 GB/s with the prefetch below,
 * against oneDNN's ~6) and 1.2-1.6x on prefill chunks (benchmarks/cpu_gemm_bench.py). Under 15
 * rows the tiles would mostly multiply padding: those calls run as float32 FMAs on the same
 * packed weights (small_rows), so one copy of the weights serves every row count.
 *
 * Layouts:
 *   weights, rearranged once (loraplex_amx_pack), still float32 (4 bytes an element, as the
 *     dense weight): 32-column panels; in a panel, 32-deep blocks; in a block, two 16-column
 *     halves, each 16 rows of 32 floats in the pair-interleaved order the B tile takes: row r
 *     holds, for each column j of the half, w[j][2r] and w[j][2r + 1]. Columns past n and
 *     depths past k are zero. A block is split into its three bf16 B tiles a part when it is
 *     used (split_block: 16 vector ops per 32 weights), so the weights cost no more memory
 *     traffic than a float32 GEMM's (a stored split would be 6 bytes an element).
 *   x, split per call into the scratch: 32-row blocks; 32-deep blocks; parts h, m, l; two
 *     16-row halves, each a 1 KiB A tile (row i: 32 consecutive depths). Rows past m are zero.
 * The micro-kernel holds a 32x32 output in four accumulator tiles, two A and two B tiles, and
 * orders the six products so that 16 tile loads feed 24 tile products.
 *
 * Blocking: an OpenMP task is a block of rows (as many as keep their split x near 1.25 MiB, so
 * it stays in L2 while the panels stream past it) by one 32-column panel; the task splits its
 * panel's blocks once into a per-thread buffer and runs every 32-row tile of the block over
 * them. A task of one 32-row tile (decode) splits each block just before its products, in L1.
 * Depths over 2048 run in chunks, each chunk adding to the partial sums in y.
 *
 * Compiled without AMX (another CPU under -march=native) the entry points report it:
 * loraplex_amx_init returns 0 and the caller keeps its torch GEMM.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__linux__) && defined(__x86_64__)
#define LORAPLEX_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#endif

#define TILE_ELEMS 512          /* one 16 x 32 bf16 tile, in uint16 */
#define BLOCK_ELEMS (6 * TILE_ELEMS)  /* a 32-deep block of split tiles: 3 parts x 2 halves */
#define WBLOCK_ELEMS 1024       /* a 32-deep block of a packed float32 panel: 2 halves */
#define MAX_CHUNK_BLOCKS 64     /* depth chunk: 64 blocks of 32 */
#define L2_BUDGET (1280 * 1024)
#define PREFETCH_BLOCKS 2       /* split_block prefetches the weights this many blocks ahead */

static int64_t round32(int64_t v) { return (v + 31) / 32 * 32; }

static int64_t chunk_blocks_of(int64_t k) {
    const int64_t kb_count = round32(k) / 32;
    const int64_t chunks = (kb_count + MAX_CHUNK_BLOCKS - 1) / MAX_CHUNK_BLOCKS;
    return (kb_count + chunks - 1) / chunks;
}

/* float32 elements of a packed [n, k] weight */
int64_t loraplex_amx_packed_elems(int64_t n, int64_t k) { return round32(n) * round32(k); }

/* uint16 elements of the scratch a call with m rows, depth k and this many threads needs:
   the split x, then each thread's split panel blocks (64-byte aligned: every size here is a
   multiple of 32 elements, so the buffer's alignment carries) */
int64_t loraplex_amx_scratch_elems(int64_t m, int64_t k, int threads) {
    return round32(m) * round32(k) * 3 + (int64_t)(threads > 0 ? threads : 1) *
           chunk_blocks_of(k) * BLOCK_ELEMS;
}

#ifdef LORAPLEX_AMX

#include "amx_tiles.h"

/* 1: the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the tile data */
int loraplex_amx_init(void) { return amx_request(); }

/* the first `count` (<= 16) floats of v split into three bf16 parts, zero past count */
static inline void split16(const float *v, int count, uint16_t *h, uint16_t *m, uint16_t *l) {
    __mmask16 mask = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
    __m512 x = _mm512_maskz_loadu_ps(mask, v);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    __m512i hi = _mm512_and_si512(_mm512_castps_si512(x), top);
    __m512 r1 = _mm512_sub_ps(x, _mm512_castsi512_ps(hi));
    __m512i mi = _mm512_and_si512(_mm512_castps_si512(r1), top);
    __m512 r2 = _mm512_sub_ps(r1, _mm512_castsi512_ps(mi));
    __m512i lo = _mm512_and_si512(_mm512_castps_si512(r2), top);
    _mm256_storeu_si256((__m256i *)h, _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)));
    _mm256_storeu_si256((__m256i *)m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(mi, 16)));
    _mm256_storeu_si256((__m256i *)l, _mm512_cvtepi32_epi16(_mm512_srli_epi32(lo, 16)));
}

void loraplex_amx_pack(const float *w, int64_t ldw, int64_t n, int64_t k, float *out,
                       int threads) {
    const int64_t np = round32(n), kb_count = round32(k) / 32;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t col = 0; col < np; col++) {
        const int64_t panel = col / 32, half = (col % 32) / 16, j = col % 16;
        for (int64_t kb = 0; kb < kb_count; kb++) {
            float *block = out + (panel * kb_count + kb) * WBLOCK_ELEMS + half * TILE_ELEMS;
            for (int64_t d = 0; d < 32; d++) {  /* B tile row d / 2, column j, pair slot d % 2 */
                const int64_t depth = kb * 32 + d;
                block[(d / 2) * 32 + j * 2 + d % 2] =
                    col < n && depth < k ? w[col * ldw + depth] : 0.0f;
            }
        }
    }
}

/* one packed block (2 halves x 16 rows x 32 floats) -> its six bf16 B tiles (parts h, m, l,
   each two halves). Truncation makes h and m exact bf16 values and leaves at most 8
   significant bits in l, so the rounding conversion changes none of them. */
static inline void split_block(const float *src, uint16_t *dst) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    for (int half = 0; half < 2; half++) {
        for (int r = 0; r < 16; r++) {
            const float *s = src + half * TILE_ELEMS + r * 32;
            /* the block two ahead (8 KiB: the panel is one sequential stream), so that its
               lines are on their way while this one is split and multiplied: decode rows run
               at the weights' streaming speed, 1.3-1.4x faster than without (a prefetch past
               the end of the weights is harmless: prefetches never fault) */
            _mm_prefetch((const char *)(s + PREFETCH_BLOCKS * WBLOCK_ELEMS), _MM_HINT_T0);
            _mm_prefetch((const char *)(s + PREFETCH_BLOCKS * WBLOCK_ELEMS + 16), _MM_HINT_T0);
            __m512 v0 = _mm512_loadu_ps(s), v1 = _mm512_loadu_ps(s + 16);
            __m512 h0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), top));
            __m512 h1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), top));
            __m512 r0 = _mm512_sub_ps(v0, h0), r1 = _mm512_sub_ps(v1, h1);
            __m512 m0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r0), top));
            __m512 m1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), top));
            __m512 l0 = _mm512_sub_ps(r0, m0), l1 = _mm512_sub_ps(r1, m1);
            uint16_t *d = dst + half * TILE_ELEMS + r * 32;
            _mm512_storeu_si512((__m512i *)d, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
            _mm512_storeu_si512((__m512i *)(d + 2 * TILE_ELEMS),
                                (__m512i)_mm512_cvtne2ps_pbh(m1, m0));
            _mm512_storeu_si512((__m512i *)(d + 4 * TILE_ELEMS),
                                (__m512i)_mm512_cvtne2ps_pbh(l1, l0));
        }
    }
}

/* Fewer than SMALL_ROWS rows: float32 FMAs straight on the packed weights (no split, no
   tiles: a decode step of a few sequences is bound by streaming the weights, and this streams
   them with the same prefetch as the tile path: 1.1-1.4x oneDNN at one row, 1.0-1.3x to 14).
   A B-tile row of a half is 16 columns' depth pairs, so one broadcast of x's pair
   (x[2r], x[2r + 1]) against it gives each column's two partial sums side by side; they are
   added once at the end. The accumulators stay in registers: up to SMALL_GROUP rows, whole
   panels (4 vectors a row); more, half panels (2 a row, up to HALF_GROUP rows), so that every
   row is in one pass over the weights. From 15 rows on a 32-row tile, half padding, is as
   fast. */
#define SMALL_ROWS 15
#define SMALL_GROUP 6
#define HALF_GROUP 14

/* 16 columns' pair sums (a: columns 0-7, b: 8-15, each column's two partial sums side by
   side) -> min(count, 16) finished outputs at dst, + bias */
static inline void store_pair_sums(__m512 a, __m512 b, const float *bias, float *dst,
                                   int64_t count) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4,
                                          2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5,
                                         3, 1);
    const __mmask16 mask = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
    __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(a, even, b),
                               _mm512_permutex2var_ps(a, odd, b));
    if (bias != NULL)
        sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(dst, mask, sum);
}

static inline __attribute__((always_inline)) void small_group(
        const float *wp, int64_t kb_count, const float *xp, int64_t kp, const float *bias,
        float *y, int64_t ldy, int64_t n0, int64_t cols, const int rows) {
    __m512 acc[SMALL_GROUP][4];
    for (int g = 0; g < rows; g++)
        for (int q = 0; q < 4; q++)
            acc[g][q] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kb_count; kb++) {
        for (int half = 0; half < 2; half++) {
            for (int r = 0; r < 16; r++) {
                const float *s = wp + kb * WBLOCK_ELEMS + half * TILE_ELEMS + r * 32;
                _mm_prefetch((const char *)(s + PREFETCH_BLOCKS * WBLOCK_ELEMS), _MM_HINT_T0);
                _mm_prefetch((const char *)(s + PREFETCH_BLOCKS * WBLOCK_ELEMS + 16),
                             _MM_HINT_T0);
                const __m512 v0 = _mm512_loadu_ps(s), v1 = _mm512_loadu_ps(s + 16);
                for (int g = 0; g < rows; g++) {
                    double pair;
                    memcpy(&pair, xp + g * kp + kb * 32 + 2 * r, sizeof pair);
                    const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(pair));
                    acc[g][2 * half] = _mm512_fmadd_ps(v0, xv, acc[g][2 * half]);
                    acc[g][2 * half + 1] = _mm512_fmadd_ps(v1, xv, acc[g][2 * half + 1]);
                }
            }
        }
    }
    for (int g = 0; g < rows; g++) {
        for (int half = 0; half < 2 && half * 16 < cols; half++) {
            const int64_t c0 = half * 16;
            store_pair_sums(acc[g][2 * half], acc[g][2 * half + 1],
                            bias != NULL ? bias + n0 + c0 : NULL, y + g * ldy + n0 + c0,
                            cols - c0);
        }
    }
}

/* One half (16 columns) of a panel for `rows` rows, 2 accumulators a row: at 7-14 rows whole
   panels would need more accumulators than there are registers, and two groups would stream
   the panel twice; half a panel at a time keeps every row in one pass (1.0-1.3x oneDNN at
   7-14 rows, against 0.8-1.0x in two groups). */
static inline __attribute__((always_inline)) void small_half(
        const float *wp, int64_t kb_count, const float *xp, int64_t kp, const float *bias,
        float *y, int64_t ldy, int64_t c0, int64_t count, const int rows, const int half) {
    __m512 acc[HALF_GROUP][2];
    for (int g = 0; g < rows; g++)
        acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kb_count; kb++) {
        for (int r = 0; r < 16; r++) {
            const float *s = wp + kb * WBLOCK_ELEMS + half * TILE_ELEMS + r * 32;
            _mm_prefetch((const char *)(s + PREFETCH_BLOCKS * WBLOCK_ELEMS), _MM_HINT_T0);
            _mm_prefetch((const char *)(s + PREFETCH_BLOCKS * WBLOCK_ELEMS + 16), _MM_HINT_T0);
            const __m512 v0 = _mm512_loadu_ps(s), v1 = _mm512_loadu_ps(s + 16);
            for (int g = 0; g < rows; g++) {
                double pair;
                memcpy(&pair, xp + g * kp + kb * 32 + 2 * r, sizeof pair);
                const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(pair));
                acc[g][0] = _mm512_fmadd_ps(v0, xv, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(v1, xv, acc[g][1]);
            }
        }
    }
    for (int g = 0; g < rows; g++)
        store_pair_sums(acc[g][0], acc[g][1], bias != NULL ? bias + c0 : NULL, y + g * ldy + c0,
                        count);
}

#define SMALL_CASE(R) \
    case R: small_half(wp, kb_count, xg, kp, bias, yg, ldy, c0, count, R, half); break;

static void small_rows(const float *x, int64_t ldx, const float *w, const float *bias,
                       float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, float *xp,
                       int threads) {
    const int64_t kp = round32(k), kb_count = kp / 32, panels = round32(n) / 32;
    for (int64_t r = 0; r < m; r++) {  /* x's rows zero-padded to the packed depth */
        memcpy(xp + r * kp, x + r * ldx, k * sizeof(float));
        memset(xp + r * kp + k, 0, (kp - k) * sizeof(float));
    }
    if (m > SMALL_GROUP) {
        const int64_t halves = 2 * panels;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t hp = 0; hp < halves; hp++) {
            const int64_t c0 = hp * 16;
            const int half = (int)(hp % 2);
            const float *wp = w + (hp / 2) * kb_count * WBLOCK_ELEMS;
            const float *xg = xp;
            float *yg = y;
            if (c0 >= n)
                continue;
            const int64_t count = n - c0 < 16 ? n - c0 : 16;
            switch ((int)m) {
            SMALL_CASE(7) SMALL_CASE(8) SMALL_CASE(9) SMALL_CASE(10) SMALL_CASE(11)
            SMALL_CASE(12) SMALL_CASE(13)
            default: small_half(wp, kb_count, xg, kp, bias, yg, ldy, c0, count, HALF_GROUP,
                                half); break;
            }
        }
        return;
    }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t panel = 0; panel < panels; panel++) {
        const float *wp = w + panel * kb_count * WBLOCK_ELEMS;
        const int64_t n0 = panel * 32, cols = n - n0 < 32 ? n - n0 : 32;
        switch ((int)m) {
        case 1: small_group(wp, kb_count, xp, kp, bias, y, ldy, n0, cols, 1); break;
        case 2: small_group(wp, kb_count, xp, kp, bias, y, ldy, n0, cols, 2); break;
        case 3: small_group(wp, kb_count, xp, kp, bias, y, ldy, n0, cols, 3); break;
        case 4: small_group(wp, kb_count, xp, kp, bias, y, ldy, n0, cols, 4); break;
        case 5: small_group(wp, kb_count, xp, kp, bias, y, ldy, n0, cols, 5); break;
        default: small_group(wp, kb_count, xp, kp, bias, y, ldy, n0, cols, 6); break;
        }
    }
}

/* four accumulators (0-3) += A tiles 4, 5 x B tiles 6, 7 */
#define PRODUCTS4                                                                 \
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);                             \
    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
#define LOAD_A(part) \
    _tile_loadd(4, a + (part) * 2 * TILE_ELEMS, 64); _tile_loadd(5, a + (part) * 2 * TILE_ELEMS + TILE_ELEMS, 64);
#define LOAD_B(part) \
    _tile_loadd(6, b + (part) * 2 * TILE_ELEMS, 64); _tile_loadd(7, b + (part) * 2 * TILE_ELEMS + TILE_ELEMS, 64);

/* 0: done; -1: not an AMX build (never reached: init said 0) */
int loraplex_amx_linear(const float *x, int64_t ldx, const float *w, const float *bias,
                        float *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                        uint16_t *scratch, int threads) {
    if (m < SMALL_ROWS) {
        small_rows(x, ldx, w, bias, y, ldy, m, n, k, (float *)(void *)scratch, threads);
        return 0;
    }
    const int64_t mp = round32(m), kb_count = round32(k) / 32, panels = round32(n) / 32;
    const int64_t chunk_blocks = chunk_blocks_of(k);
    const int64_t chunks = (kb_count + chunk_blocks - 1) / chunk_blocks;
    int64_t block_rows = L2_BUDGET / (6 * 32 * chunk_blocks) / 32 * 32;
    if (block_rows < 64) block_rows = 64;
    if (block_rows > 512) block_rows = 512;
    const int64_t row_blocks = (mp + block_rows - 1) / block_rows;
    uint16_t *split_w = scratch + mp * kb_count * 32 * 3;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* split x: A tile (row block rb, depth block kb, part p, half) */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < mp; row++) {
            const int64_t rb = row / 32, half = (row % 32) / 16, i = row % 16;
            for (int64_t kb = 0; kb < kb_count; kb++) {
                uint16_t *t = scratch + (rb * kb_count + kb) * BLOCK_ELEMS + half * TILE_ELEMS
                              + i * 32;
                if (row >= m) {
                    memset(t, 0, 64);
                    memset(t + 2 * TILE_ELEMS, 0, 64);
                    memset(t + 4 * TILE_ELEMS, 0, 64);
                    continue;
                }
                int64_t left = k - kb * 32;
                const float *src = x + row * ldx + kb * 32;
                split16(src, left > 16 ? 16 : (int)left, t, t + 2 * TILE_ELEMS,
                        t + 4 * TILE_ELEMS);
                split16(src + 16, left > 32 ? 16 : (left > 16 ? (int)(left - 16) : 0), t + 16,
                        t + 2 * TILE_ELEMS + 16, t + 4 * TILE_ELEMS + 16);
            }
        }
        amx_config();
        float c[32 * 32];
        uint16_t *mine = split_w;
#ifdef _OPENMP
        mine += (int64_t)omp_get_thread_num() * chunk_blocks * BLOCK_ELEMS;
#endif
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int64_t kb0 = chunk * chunk_blocks;
            const int64_t kb1 = kb0 + chunk_blocks < kb_count ? kb0 + chunk_blocks : kb_count;
            const int last = chunk == chunks - 1;
#pragma omp for collapse(2) schedule(static)
            for (int64_t ib = 0; ib < row_blocks; ib++) {
                for (int64_t panel = 0; panel < panels; panel++) {
                    const int64_t n0 = panel * 32, cols = n - n0 < 32 ? n - n0 : 32;
                    const int64_t r0 = ib * block_rows;
                    const int64_t r_end = r0 + block_rows < mp ? r0 + block_rows : mp;
                    const float *w_panel = w + panel * kb_count * WBLOCK_ELEMS;
                    /* one 32-row tile: split each block as it is used, else all once */
                    const int single = r_end - r0 <= 32;
                    if (!single)
                        for (int64_t kb = kb0; kb < kb1; kb++)
                            split_block(w_panel + kb * WBLOCK_ELEMS,
                                        mine + (kb - kb0) * BLOCK_ELEMS);
                    for (int64_t m0 = r0; m0 < r_end; m0 += 32) {
                        const int64_t rows = m - m0 < 32 ? m - m0 : 32;
                        float *yt = y + m0 * ldy + n0;
                        if (chunk == 0) {
                            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                        } else {
                            for (int64_t r = 0; r < rows; r++)
                                memcpy(c + r * 32, yt + r * ldy, cols * sizeof(float));
                            _tile_loadd(0, c, 128); _tile_loadd(1, c + 16, 128);
                            _tile_loadd(2, c + 512, 128); _tile_loadd(3, c + 528, 128);
                        }
                        const uint16_t *a_row = scratch + (m0 / 32) * kb_count * BLOCK_ELEMS;
                        for (int64_t kb = kb0; kb < kb1; kb++) {
                            const uint16_t *a = a_row + kb * BLOCK_ELEMS;
                            const uint16_t *b;
                            if (single) {  /* two buffers: the next split need not wait */
                                b = mine + ((kb - kb0) & 1) * BLOCK_ELEMS;
                                split_block(w_panel + kb * WBLOCK_ELEMS, (uint16_t *)b);
                            } else {
                                b = mine + (kb - kb0) * BLOCK_ELEMS;
                            }
                            /* the six products h.h, m.h, l.h, m.m, h.m, h.l */
                            LOAD_B(0) LOAD_A(0) PRODUCTS4 LOAD_A(1) PRODUCTS4 LOAD_A(2) PRODUCTS4
                            LOAD_B(1) LOAD_A(1) PRODUCTS4 LOAD_A(0) PRODUCTS4
                            LOAD_B(2) PRODUCTS4
                        }
                        _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128);
                        _tile_stored(2, c + 512, 128); _tile_stored(3, c + 528, 128);
                        for (int64_t r = 0; r < rows; r++) {
                            float *dst = yt + r * ldy;
                            const float *src = c + r * 32;
                            if (last && bias != NULL) {
                                for (int64_t j = 0; j < cols; j++)
                                    dst[j] = src[j] + bias[n0 + j];
                            } else {
                                memcpy(dst, src, cols * sizeof(float));
                            }
                        }
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}

#else /* no AMX in this build */

int loraplex_amx_init(void) { return 0; }

void loraplex_amx_pack(const float *w, int64_t ldw, int64_t n, int64_t k, float *out,
                       int threads) {
    (void)w; (void)ldw; (void)n; (void)k; (void)out; (void)threads;
}

int loraplex_amx_linear(const float *x, int64_t ldx, const float *w, const float *bias,
                        float *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                        uint16_t *scratch, int threads) {
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)ldy; (void)m; (void)n; (void)k;
    (void)scratch; (void)threads;
    return -1;
}

#endif
