/* bf16 GEMMs on prepacked weights, on AVX512-BF16's pair dot products (vdpbf16ps): the CPU
 * engine's bf16 projections on CPUs with AVX512-BF16 but no AMX (Zen 4, Zen 5), where oneDNN's
 * bf16 GEMM runs on the same instructions.
 *
 * Semantics: y[i, n] = bf16(sum_k x[i, k] W[n, k] + bias[n]) for i < rows, n < d_out: x, W,
 * bias and y bf16, the products exact (bf16 x bf16 fits float32) and summed in float32, two
 * depth elements at a time, the bias added in float32, one rounding (vcvtneps2bf16: to nearest
 * even, NaN kept quiet; bf16 denormal inputs count as zero and a float32 sum under 2^-126 in
 * magnitude becomes zero, as in oneDNN's bf16 kernels without AMX). Another summation order
 * than oneDNN's: results within a bf16 rounding of each other, not bit for bit.
 *
 * Packed weight: 16-column panels, each [ceil(d_in / 2)] depth pairs of 16 columns x 2 depths,
 * packed[(p * KP + kp) * 32 + 2 l + e] = W[16 p + l, 2 kp + e] (zero past d_out and d_in): one
 * 64-byte vector per panel and depth pair, the operand vdpbf16ps takes against a broadcast pair
 * of x. Tiles of MR rows x NR panels keep MR * NR float32 accumulators in registers (4 x 6:
 * 24 of AVX-512's 32, the rest for the 6 weight vectors); depth in chunks of KC pairs (the
 * panels' chunk stays in L2 for every row of a group of MC rows), partial sums of a chunk
 * kept in a per-thread buffer. Tasks (NR panels x MC rows), a panel group's row blocks in turn,
 * split between threads in runs of groups.
 *
 * Measured against oneDNN's prepacked bf16 GEMM (torch.ops.mkldnn._linear_pointwise) at
 * SmolLM2's shapes on a Zen 4 core: 1.3-2.2x on one row, 1.1-1.2x on 32 (a decode step),
 * 0.97-1.03x on 1536 (a prefill chunk): docs/benchmarks.md.
 */
#define _GNU_SOURCE  /* syscall(): the AMX tile data permission */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_pairs.h"
#include "cpu_id.h"

#define MR 4    /* rows of a register tile */
#define NR 6    /* 16-column panels of a register tile */
#define KC 512  /* depth pairs of a chunk */
#define MC 64   /* rows of a task */
_Static_assert(NR == 6, "task() unrolls each panel count 1 .. 6 of a full row tile");

/* 1 if this build has the kernel (the CPU has AVX512-BF16 and AVX512-BW), else 0 */
int loraplex_bf16_gemm_available(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}

int64_t loraplex_bf16_packed_elems(int64_t d_out, int64_t d_in) {
    return (d_out + 15) / 16 * ((d_in + 1) / 2) * 32;
}

/* packed (packed_elems(d_out, d_in) bf16) from w [d_out, d_in] bf16 with row stride ws */
void loraplex_bf16_pack(const uint16_t *w, int64_t ws, int64_t d_out, int64_t d_in,
                        uint16_t *packed, int threads) {
    const int64_t kps = (d_in + 1) / 2, panels = (d_out + 15) / 16;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kp = 0; kp < kps; kp++) {
            uint16_t *out = packed + (p * kps + kp) * 32;
            for (int l = 0; l < 16; l++)
                for (int e = 0; e < 2; e++) {
                    const int64_t n = 16 * p + l, k = 2 * kp + e;
                    out[2 * l + e] = n < d_out && k < d_in ? w[n * ws + k] : 0;
                }
        }
}

#ifdef HAVE_DPBF16
/* acc[r][c] += x rows' pairs K0 .. K1 - 1 against panel c (b: panel 0's pair 0, panels kps
 * pairs apart) for ROWS rows and COLS panels (ROWS <= MR, COLS <= NR): with both constant the
 * loops unroll and acc stays in registers. PAIR: the row's pair kp as a 32-bit value. */
#define TILE_LOOP(ROWS, COLS, K0, K1, PAIR)                                                \
    for (int64_t kp = (K0); kp < (K1); kp++) {                                             \
        for (pf_acc += pf_num; pf_acc >= pf_steps && pf_at < pf_lines; pf_acc -= pf_steps) \
            __builtin_prefetch(pf + 64 * pf_at++, 0, 2);                                   \
        __m512i bv[NR];                                                                    \
        for (int c = 0; c < (COLS); c++)                                                   \
            bv[c] = _mm512_loadu_si512(b + (c * kps + kp) * 32);                           \
        for (int r = 0; r < (ROWS); r++) {                                                 \
            const __m512i a = _mm512_set1_epi32((int)(PAIR));                              \
            for (int c = 0; c < (COLS); c++)                                               \
                acc[r][c] = dp(acc[r][c], a, bv[c]);                                       \
        }                                                                                  \
    }

/* One task: panels p0 .. p0 + np - 1 (np <= NR) for rows m0 .. m1 - 1 (at most MC), every
 * depth chunk; buf: MC x NR x 16 floats of partial sums between chunks. pf: pf_lines 64-byte
 * lines (or none) prefetched into L2 while the task runs, spread over its depth pairs. */
static void task(const uint16_t *x, int64_t xs, const uint16_t *packed, const uint16_t *bias,
                 uint16_t *y, int64_t ys, int64_t m0, int64_t m1, int64_t p0, int np,
                 int64_t d_out, int64_t d_in, float *buf, const char *pf, int64_t pf_lines) {
    const int64_t kps = (d_in + 1) / 2;
    /* pf_num of pf's lines for every pf_steps depth pairs run. On AMD's family 0x1A (Zen 5)
     * spread evenly over every depth pair of the task (its row groups' passes), so that the
     * last goes out as the task ends: two lines a pair until done (a burst over the first row
     * groups, then none) left the next task's first pass waiting on memory; spread, 16-64 rows
     * ran 1.05-1.29x faster on a Zen 5 core, weights out of cache (finishing at 3/4 of the
     * task or 5/4: slower). Elsewhere two a pair, as measured on Zen 4 (see the caller). */
    const int spread = amd_family() >= 0x1A;
    int64_t pf_at = 0, pf_acc = 0;
    const int64_t pf_num = spread ? pf_lines : 2;
    const int64_t pf_steps = spread ? (m1 - m0 + MR - 1) / MR * kps : 1;
    const int64_t chunks = (kps + KC - 1) / KC, per = (kps + chunks - 1) / chunks;
    const uint16_t *b = packed + p0 * kps * 32;
    for (int64_t k0 = 0; k0 < kps; k0 += per) {
        const int64_t k1 = k0 + per < kps ? k0 + per : kps;
        const int first = k0 == 0, last = k1 == kps;
        for (int64_t i = m0; i < m1; i += MR) {
            const int mr = m1 - i < MR ? (int)(m1 - i) : MR;
            const uint16_t *xr[MR];
            for (int r = 0; r < MR; r++) xr[r] = x + (i + (r < mr ? r : 0)) * xs;
            float *part = buf + (i - m0) * NR * 16;
            __m512 acc[MR][NR];
            for (int r = 0; r < MR; r++)
                for (int c = 0; c < NR; c++)
                    acc[r][c] = first || r >= mr || c >= np
                                    ? _mm512_setzero_ps()
                                    : _mm512_loadu_ps(part + (r * NR + c) * 16);
            /* pairs inside the row; an odd d_in's last element alone (never the one past it) */
            const int64_t kin = k1 < d_in / 2 ? k1 : d_in / 2;
            /* every panel count of a full row tile unrolled: with run-time bounds acc stayed
             * in memory, and a d_out that is no multiple of NR panels (96 columns: 1024,
             * 4096, 14336) lost 5-10% to its last group (a 1024-wide o or down projection on
             * a Zen 5 core, 64-1536 rows). A tile of fewer rows keeps the loop with run-time
             * bounds: unrolled, one to three rows (weights streamed from memory) ran 0.9x. */
#define PAIRS load_pair(xr[r] + 2 * kp)
            if (mr == MR) {
                switch (np) {
                case 6: TILE_LOOP(MR, 6, k0, kin, PAIRS) break;
                case 5: TILE_LOOP(MR, 5, k0, kin, PAIRS) break;
                case 4: TILE_LOOP(MR, 4, k0, kin, PAIRS) break;
                case 3: TILE_LOOP(MR, 3, k0, kin, PAIRS) break;
                case 2: TILE_LOOP(MR, 2, k0, kin, PAIRS) break;
                default: TILE_LOOP(MR, 1, k0, kin, PAIRS) break;
                }
            } else {
                TILE_LOOP(mr, np, k0, kin, PAIRS)
            }
#undef PAIRS
            TILE_LOOP(mr, np, kin, k1, xr[r][2 * kp])
            for (int r = 0; r < mr; r++)
                for (int c = 0; c < np; c++) {
                    if (!last) {
                        _mm512_storeu_ps(part + (r * NR + c) * 16, acc[r][c]);
                        continue;
                    }
                    const int64_t n0 = (p0 + c) * 16, left = d_out - n0;
                    const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF
                                                    : (__mmask16)((1u << left) - 1);
                    __m512 sum = acc[r][c];
                    if (bias != NULL) {
                        const __m256i bb = _mm256_maskz_loadu_epi16(mk, bias + n0);
                        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(
                                                     _mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16)));
                    }
                    _mm256_mask_storeu_epi16(y + (i + r) * ys + n0, mk,
                                             (__m256i)_mm512_cvtneps_pbh(sum));
                }
        }
    }
}
#endif

/* y [rows, d_out] (row stride ys) = x [rows, d_in] (row stride xs) @ W^T + bias (NULL: none),
 * W packed by loraplex_bf16_pack. Returns 0, or 1 where the build has no kernel
 * (loraplex_bf16_gemm_available), 2 where a per-thread buffer could not be allocated (y then
 * partly unwritten). */
int loraplex_bf16_linear(const uint16_t *x, int64_t xs, const uint16_t *packed,
                         const uint16_t *bias, uint16_t *y, int64_t ys, int64_t rows,
                         int64_t d_out, int64_t d_in, int threads) {
#ifndef HAVE_DPBF16
    (void)x, (void)xs, (void)packed, (void)bias, (void)y, (void)ys, (void)rows, (void)d_out,
        (void)d_in, (void)threads;
    return 1;
#else
    if (rows <= 0 || d_out <= 0) return 0;
    const int64_t panels = (d_out + 15) / 16, groups = (panels + NR - 1) / NR;
    const int64_t row_groups = (rows + MC - 1) / MC, tasks = groups * row_groups;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        float *buf = malloc(sizeof(float) * MC * NR * 16);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            if (buf == NULL) continue;
            /* a panel group's row blocks one after another (its panels stay in L2 across
             * them) and each thread a run of groups: with the row blocks outermost every
             * thread read every weight, once per row block (the lm_head's 57 MB from memory
             * 24 times at 1536 rows), and two row blocks of unequal size split the threads
             * unevenly: 1.0-1.14x at 100-1536 rows on one Zen 5 core, 1.26-1.40x at 100 rows
             * on two */
            const int64_t g = t / row_groups, m0 = t % row_groups * MC;
            const int64_t m1 = m0 + MC < rows ? m0 + MC : rows;
            const int np = panels - g * NR < NR ? (int)(panels - g * NR) : NR;
            /* Calls of one row block (decode batches) read each panel group once, from
             * memory: the next task's panels are fetched while this one runs (the thread's
             * next under the static schedule). On a Zen 4 core, weights out of cache, 32 rows:
             * 1.01-1.10x at SmolLM2's shapes, 1.05-1.11x with the weights on huge pages
             * (docs/benchmarks.md, "Zen 4, fourth visit"). Longer calls read a group's panels
             * for each of its row blocks in turn, from L2 after the first (a prefetch of the
             * next task was 0.97-0.99x there on Zen 4, when the row blocks were outermost). */
            const char *pf = NULL;
            int64_t pf_lines = 0;
            if (rows <= MC && t + 1 < tasks) {
                const int64_t g1 = g + 1, kps = (d_in + 1) / 2;  /* one row block: t + 1 */
                pf = (const char *)(packed + g1 * NR * kps * 32);
                pf_lines = (panels - g1 * NR < NR ? panels - g1 * NR : NR) * kps;
            }
            task(x, xs, packed, bias, y, ys, m0, m1, g * NR, np, d_out, d_in, buf, pf,
                 pf_lines);
        }
        free(buf);
    }
    return failed;
#endif
}

/* ---- The same GEMM on AMX tiles (CPUs with AMX-BF16: Sapphire Rapids and later) ------------
 *
 * Same semantics, on the same packed weights: a panel's 16 consecutive depth pairs are one
 * B tile as TDPBF16PS takes it (16 rows of 16 columns' pairs, 64 bytes a row), so the weights
 * need no other copy; A tiles are 16 rows of x by 32 depths, loaded in place (the last rows of
 * a call through a zero-padded copy). The tile unit sums each 32-deep block in its own order
 * (bf16 denormals read as zero, float32 denormal sums flushed, as vdpbf16ps does). Blocking:
 * row blocks of BM rows (x's block stays in L2) by groups of two panels (their weights stream
 * once per row block, then sit in L1/L2 for its row tiles); within a task 32 rows x 2 panels
 * (four accumulator tiles, two A, two B) or, under 17 rows, 16 rows x 4 panels. Depths that
 * are not a multiple of 32 run on the pair dot products above.
 *
 * Why: oneDNN's bf16 GEMM on the same tiles streams a decode step's weights well under the
 * memory's speed (SmolLM2's 120 projections at 32 rows: 26 ms on one Sapphire Rapids-class
 * core, against ~16 for their 212 MB at a plain read's rate); on tiles 20 ms. Measured against
 * oneDNN's prepacked bf16 GEMM there: 1.24-1.40x at 1-32 rows, 1.16-1.19x at 33-64, 1.0x at
 * 100, and slower on prefill chunks (0.88x at 256 rows, 0.5-0.7x at 1536: x's tiles come from
 * L2 at the whole depth; a depth-chunked order with partial sums between chunks reached
 * 0.68-0.88x). So the engine runs it on decode-sized calls only (server/engine/models/llama.py,
 * a second copy of the weights beside oneDNN's), and the pair dot products run at a sixteenth
 * of the tile unit's rate. */
#if defined(HAVE_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__) && defined(__x86_64__)
#define BF16_AMX 1
#include "amx_tiles.h"

#define BM 256  /* rows of a task */

/* 1: the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the tile data */
int loraplex_bf16_amx_init(void) { return amx_request(); }

/* the next panel group's kb-th share of lines (16 a panel), on its way into L2 */
static inline void prefetch_share(const char *pf, int64_t kb, int np) {
    for (int q = 0; q < 16 * np; q++) _mm_prefetch(pf + (kb * 16 * np + q) * 64, _MM_HINT_T1);
}

/* Accumulator tiles of rows of x tile t (16 rows at xa_t, row stride s_t) against panel j
 * (b + j * pstride), over the kbs depth blocks: t < mt <= 2, j < np, mt * np <= 4; tile and c
 * index t * (4 / mt) + j (c: 256 floats a tile). pf: the next panel group's weights, np
 * panels of them prefetched over the blocks (NULL: none). */
static inline void amx_block(const uint16_t *xa0, int64_t s0, const uint16_t *xa1, int64_t s1,
                             int mt, const uint16_t *b, int64_t pstride, int np, int64_t kbs,
                             const char *pf, float *c) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    if (mt == 2) {
        for (int64_t kb = 0; kb < kbs; kb++) {
            if (pf != NULL) prefetch_share(pf, kb, np);
            _tile_loadd(4, xa0 + 32 * kb, s0 * 2);
            _tile_loadd(5, xa1 + 32 * kb, s1 * 2);
            _tile_loadd(6, b + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (np > 1) {
                _tile_loadd(7, b + pstride + kb * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    } else {
        for (int64_t kb = 0; kb < kbs; kb++) {
            if (pf != NULL) prefetch_share(pf, kb, np);
            _tile_loadd(4, xa0 + 32 * kb, s0 * 2);
            _tile_loadd(6, b + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (np > 1) {
                _tile_loadd(7, b + pstride + kb * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (np > 2) {
                _tile_loadd(6, b + 2 * pstride + kb * 512, 64);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (np > 3) {
                _tile_loadd(7, b + 3 * pstride + kb * 512, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* y's rows (rows <= 16, row stride ys) at columns n0 .. n0 + 15: bf16(c + bias) */
static inline void amx_store(const float *c, int64_t rows, const uint16_t *bias, uint16_t *y,
                             int64_t ys, int64_t n0, int64_t d_out) {
    const int64_t left = d_out - n0;
    if (left <= 0) return;
    const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    __m512 bv = _mm512_setzero_ps();
    if (bias != NULL)
        bv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, bias + n0)), 16));
    for (int64_t r = 0; r < rows; r++) {
        __m512 sum = _mm512_loadu_ps(c + 16 * r);
        if (bias != NULL) sum = _mm512_add_ps(sum, bv);
        _mm256_mask_storeu_epi16(y + r * ys + n0, mk, (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

/* The x tiles of the 32 rows from row i (those before `rows`): in place while 16 rows are
 * left, else from the padded copy of the call's last rows (pad, row stride d_in). */
typedef struct {
    const uint16_t *a0, *a1;
    int64_t s0, s1, r0, r1;  /* strides; rows of each tile */
    int mt;
} units_t;

static inline units_t unit_at(const uint16_t *x, int64_t xs, const uint16_t *pad, int64_t d_in,
                              int64_t i, int64_t end, int pair) {
    units_t u;
    const int64_t left = end - i;
    u.mt = pair && left > 16 ? 2 : 1;
    u.r0 = left < 16 ? left : 16;
    u.a0 = left >= 16 ? x + i * xs : pad;
    u.s0 = left >= 16 ? xs : d_in;
    u.r1 = u.mt == 2 ? (left - 16 < 16 ? left - 16 : 16) : 0;
    u.a1 = left >= 32 ? x + (i + 16) * xs : pad;
    u.s1 = left >= 32 ? xs : d_in;
    return u;
}

/* As loraplex_bf16_linear, on tiles (loraplex_bf16_amx_init must have said 1). A task is a
 * group of panels (4 under 17 rows, else 2) by a block of up to BM rows, the whole depth at
 * once; with one row block (a decode step) the next group's weights are prefetched while a
 * group runs, so that the weights stream once, at about the memory's speed. */
int loraplex_bf16_linear_tiles(const uint16_t *x, int64_t xs, const uint16_t *packed,
                               const uint16_t *bias, uint16_t *y, int64_t ys, int64_t rows,
                               int64_t d_out, int64_t d_in, int threads) {
    if (d_in % 32 != 0)
        return loraplex_bf16_linear(x, xs, packed, bias, y, ys, rows, d_out, d_in, threads);
    if (rows <= 0 || d_out <= 0) return 0;
    const int64_t kps = d_in / 2, kbs = d_in / 32, panels = (d_out + 15) / 16;
    const int64_t pstride = kps * 32;  /* uint16 elements between panels */
    const int small = rows <= 16;
    const int64_t group = small ? 4 : 2;  /* panels of a task */
    const int64_t groups = (panels + group - 1) / group;
    const int64_t row_blocks = (rows + BM - 1) / BM, tasks = groups * row_blocks;
    /* the last rows' padded copy: rows past a multiple of 16, zero beyond */
    const int64_t tail0 = rows / 16 * 16, tail = rows - tail0;
    uint16_t *pad = NULL;
    if (tail) {
        pad = aligned_alloc(64, (size_t)(16 * d_in * 2 + 63) / 64 * 64);
        if (pad == NULL) return 2;
        memset(pad, 0, (size_t)(16 * d_in) * 2);
        for (int64_t r = 0; r < tail; r++)
            memcpy(pad + r * d_in, x + (tail0 + r) * xs, (size_t)d_in * 2);
    }
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        amx_config();
        float c[4 * 256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            /* a panel group's row blocks in turn (its weights stay in L2 across them) */
            const int64_t g = t / row_blocks, m0 = t % row_blocks * BM;
            const int64_t m1 = m0 + BM < rows ? m0 + BM : rows;
            const int64_t p0 = g * group;
            const int np = panels - p0 < group ? (int)(panels - p0) : (int)group;
            const uint16_t *b = packed + p0 * pstride;
            /* one row block: the next group's weights fetched meanwhile, on its first rows */
            const char *pf = row_blocks == 1 && t + 1 < tasks
                             ? (const char *)(b + group * pstride) : NULL;
            for (int64_t i = m0; i < m1; i += small ? 16 : 32, pf = NULL) {
                const units_t u = unit_at(x, xs, pad, d_in, i, m1, !small);
                amx_block(u.a0, u.s0, u.a1, u.s1, u.mt, b, pstride, np, kbs, pf, c);
                const int per = 4 / u.mt;
                for (int j = 0; j < np; j++) {
                    amx_store(c + j * 256, u.r0, bias, y + i * ys, ys, (p0 + j) * 16, d_out);
                    if (u.mt == 2)
                        amx_store(c + (per + j) * 256, u.r1, bias, y + (i + 16) * ys, ys,
                                  (p0 + j) * 16, d_out);
                }
            }
        }
    }
    free(pad);
    return 0;
}
#else
int loraplex_bf16_amx_init(void) { return 0; }

int loraplex_bf16_linear_tiles(const uint16_t *x, int64_t xs, const uint16_t *packed,
                               const uint16_t *bias, uint16_t *y, int64_t ys, int64_t rows,
                               int64_t d_out, int64_t d_in, int threads) {
    (void)x, (void)xs, (void)packed, (void)bias, (void)y, (void)ys, (void)rows, (void)d_out,
        (void)d_in, (void)threads;
    return 1;
}
#endif
