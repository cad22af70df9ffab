/* A float32 GEMM of FMA vectors on prepacked weights: y = x @ w^T (+ bias), for CPUs without
 * AMX tiles (gemm_amx.c serves those that have them).
 *
 * Why: a decode step's projections are GEMMs of a few dozen rows against weights that do not
 * fit in cache; oneDNN's prepacked float32 GEMM (torch's mkldnn linear) streams them well but
 * leaves FMA throughput on the table at these row counts. On a Zen 3 core (AVX2, 8 lanes) this
 * kernel measured 1.1-1.2x oneDNN on 32 rows and 1.1-1.6x on one row at a Llama's shapes,
 * with the same error against a float64 reference (benchmarks/cpu_gemm_bench.py,
 * tests/kernels/test_cpu_gemm.py).
 *
 * Layout, rearranged once (loraplex_fma_pack), still float32 (4 bytes an element, as the dense
 * weight): NR = 2 VW columns a panel (VW: the machine's vector, vector_width.h); the depth in
 * chunks of KC (at most KC_BYTES of a panel, 64 KiB on AVX2, 128 KiB with AVX-512: the chunk
 * stays in L2 while every row group runs over it; 16 KiB chunks, in L1, measured slower on
 * Zen 3: y is reloaded once a chunk; on Zen 5, with its 1 MiB L2, 128 KiB chunks ran
 * 1.5-4% faster than 64 and 256 KiB 1-3% slower than 128; k
 * split evenly, so the last chunk is not a sliver); chunk-major: chunk, then
 * panel, then depth, then the panel's NR columns. Columns past n are zero; nothing pads k.
 *
 * The micro-kernel holds MR rows x NR columns in 2 MR accumulator vectors (6 x 16 on AVX2:
 * 12 of its 16 registers, two for the weights, one for x's broadcast; 12 x 32 with AVX-512's
 * 32 registers), reading the panel's two weight vectors and MR broadcasts of x a depth. x is
 * rearranged first, a row block at a time, into the caller's scratch: a row group's depths
 * of a chunk as [kcc][XS] (XS = MR on AVX2; with AVX-512 16, a depth's rows one 64-byte line,
 * written 16 depths at a time by a register transpose; a block of one row group, a decode
 * step of up to MR rows, as [kcc][rows]: one row's 4 bytes a depth, not a line, 1.15x at one
 * row): every broadcast an offset from one
 * pointer; reading x in place, GCC ran out of general registers for the MR row pointers and
 * moved them in from vector registers every depth: 1.07-1.16x on a Zen 5 core; the
 * transposed, line-aligned copy 1.02-1.07x over a scalar [kcc][MR] one, whose cost showed at
 * narrow outputs: 0.4 ms of a 1536 x 1536 x 576 product). While a panel's row groups run, the
 * weights' next kcc x NR floats (the next panel's chunk: the layout is one sequential stream
 * in the order the loops read it) are prefetched into L1, two lines a depth at most, shared
 * out over the row groups: without it the first row group waited on memory and the others on
 * the FMAs, the two times adding up (166 -> 221 GFLOP/s at 32 rows on Zen 5 with the weights
 * out of cache; 253 with them in L3). Loops: blocks of up to MC rows, split evenly (x's block
 * rearranged once, read by every panel from L2), then depth chunks, then panels over the
 * OpenMP threads, then the block's row groups, their rows spread evenly (32 rows on AVX2:
 * 6,6,5,5,5,5, not 6,6,6,6,6,2). Chunks after the first add to the partial sums in y; the
 * last adds the bias.
 *
 * On a Zen 5 core (AVX-512, one thread, weights out of cache, benchmarks/cpu_gemm_bench.py
 * --kind fma, at 5fa21ba): against oneDNN's prepacked GEMM 1.32-1.55x at 32 rows, 1.13-1.24x
 * at 64, 1.00-1.06x at 256, 0.94-1.04x at 1536, 0.96-1.38x at one row, 1.10-1.38x at four, at
 * SmolLM2's and the benchmark Llama's shapes; end to end the decode-heavy trace's base model
 * went from 1.02x to 1.24-1.28x of vLLM's, prompt-heavy SmolLM2 from 0.99-1.01x to
 * 1.11-1.19x (docs/benchmarks.md, "Zen 5, fourth visit").
 */
#include <stdint.h>
#include <string.h>

#include "cpu_id.h"
#include "vector_width.h"
#ifdef _OPENMP
#include <omp.h>
static int thread_index(void) { return omp_get_thread_num(); }
static int thread_count(void) { return omp_get_num_threads(); }
#else
static int thread_index(void) { return 0; }
static int thread_count(void) { return 1; }
#endif

/* -std=c11 turns off contracting a * b + c into one FMA: this kernel is nothing else. */
#pragma GCC optimize("fp-contract=fast")

#define NR (2 * VW)
#if VW == 16
#define MR 12
#else
#define MR 6
#endif
#ifndef KC_BYTES
#if VW == 16
#define KC_BYTES 131072
#else
#define KC_BYTES 65536
#endif
#endif
#define KC_MAX (KC_BYTES / (4 * NR))
#ifndef MC
#define MC 120
#endif

#ifndef SUB
#define SUB 128
#endif

#define INLINE static inline __attribute__((always_inline))

/* floats a depth of rearranged x takes: MR, or a whole vector with AVX-512 (pack_x) */
#if VW == 16
#include "transpose16.h"
#define XS 16
#else
#define XS MR
#endif

typedef float vf __attribute__((vector_size(4 * VW), aligned(4), may_alias));

static int64_t round_nr(int64_t n) { return (n + NR - 1) / NR * NR; }

/* the depth of every chunk but the last (k split evenly into chunks of at most KC_MAX) */
static int64_t chunk_depth(int64_t k) {
    const int64_t chunks = (k + KC_MAX - 1) / KC_MAX;
    return chunks > 0 ? (k + chunks - 1) / chunks : 1;
}

/* 1 where this build was measured faster than oneDNN, so that LORAPLEX_FMA_GEMM=auto turns
   it on: x86 with AVX2 and FMA, no AVX-512 (a Zen 3 core), and AVX-512 on AMD's family 0x1A
   and later (a Zen 5 core: 1.32-1.55x at 32 rows, 0.94-1.06x at 256-1536, see above).
   Elsewhere it is correct but unmeasured (AVX-512 on Intel) or slower (Zen 4, before
   the packed x and the next panel's prefetch; no FMA) */
int loraplex_fma_tuned(void) {
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    return 1;
#elif defined(__x86_64__) && defined(__AVX512F__)
    return amd_family() >= 0x1A;
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
   given; only the first `cols` columns of y exist. xp: the rows' chunk of x as [kcc][xs];
   pf .. pf_last (and pf_half on): the weights' lines this tile prefetches, one a depth each.
   The sum is two-level: SUB depths at a time into fresh register accumulators, each part
   then added to running totals kept in L1 (tot). A single running sum a column errs like
   sqrt(k) roundings (at 4200 deep, 5x oneDNN's blocked sums: the tests' 4x bound failed);
   two levels like sqrt(SUB) + sqrt(k / SUB): measured 3-4x under oneDNN's error. Cost: a
   vector load, add and store per accumulator each SUB depths. */
INLINE void tile(const float *wp, int64_t kcc, const float *xp, int64_t xs, float *y,
                 int64_t ldy, int64_t cols, const float *bias, int first, const int rows,
                 const char *pf, const char *pf_last, int64_t pf_half) {
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
            /* two lines a depth, pf_half apart (the same line twice where one a depth
               covers the share); no branch: pf stops at its last line */
            __builtin_prefetch(pf, 0, 3);
            __builtin_prefetch(pf + pf_half, 0, 3);
            pf = pf + 64 < pf_last ? pf + 64 : pf_last;
            const vf w0 = *(const vf *)(wp + d * NR), w1 = *(const vf *)(wp + d * NR + VW);
            for (int r = 0; r < rows; r++) {
                const float xv = xp[d * xs + r];
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
    case R: tile(wp, kcc, xp, xs, y, ldy, cols, bias, first, R, pf, pf_last, pf_half); break;

static void tile_rows(const float *wp, int64_t kcc, const float *xp, int64_t xs, float *y,
                      int64_t ldy, int64_t cols, const float *bias, int first, int rows,
                      const char *pf, const char *pf_last, int64_t pf_half) {
    switch (rows) {
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5)
#if MR == 12
    TILE_CASE(6) TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11)
#endif
    default: tile(wp, kcc, xp, xs, y, ldy, cols, bias, first, MR, pf, pf_last, pf_half); break;
    }
}

/* row blocks of a call: at most MC rows each, split evenly (256 rows are 2 x 128, not 240 +
   16); with several threads and more than one block, a multiple of the threads (each thread
   runs whole blocks: see loraplex_fma_linear) */
static int64_t block_count(int64_t m, int threads) {
    int64_t blocks = (m + MC - 1) / MC;
    if (threads > 1 && blocks > 1)
        blocks = (blocks + threads - 1) / threads * threads;
    return blocks;
}

/* the scratch one row block needs: its rows' x, a row group's depth XS floats */
static int64_t block_scratch(int64_t m, int64_t k, int threads) {
    const int64_t blocks = block_count(m, threads), mb = (m + blocks - 1) / blocks;
    return (mb + MR - 1) / MR * XS * k;
}

/* float32 elements of the scratch loraplex_fma_linear needs for m rows of depth k on this
   many threads: one row block's x, or one a thread where the threads split the blocks */
int64_t loraplex_fma_scratch_elems(int64_t m, int64_t k, int threads) {
    if (m <= 0 || k <= 0)
        return 0;
    const int64_t copies = threads > 1 && block_count(m, threads) > 1 ? threads : 1;
    return copies * block_scratch(m, k, threads);
}

/* rows (<= MR) of x, depths [0, kcc) -> xp[kcc][xs], a depth's rows side by side (lanes
   past `rows` unused; xs: XS, or the rows); xs == 16 (AVX-512) 16 depths at a time through a
   register transpose */
static void pack_x(const float *x, int64_t ldx, int rows, int64_t kcc, float *xp, int64_t xs) {
    int64_t d = 0;
#if VW == 16
    for (; xs == 16 && d + 16 <= kcc; d += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < rows ? _mm512_loadu_ps(x + i * ldx + d) : _mm512_setzero_ps();
        transpose16_ps(r);
        for (int i = 0; i < 16; i++)
            _mm512_storeu_ps(xp + (d + i) * 16, r[i]);
    }
#endif
    for (; d < kcc; d++)
        for (int r = 0; r < rows; r++)
            xp[d * xs + r] = x[r * ldx + d];
}

/* part `part` of `parts` of [0, count): the static schedule's contiguous share */
static void share_of(int64_t count, int part, int parts, int64_t *lo, int64_t *hi) {
    *lo = count * part / parts;
    *hi = count * (part + 1) / parts;
}

/* rows m0 .. m0 + mc - 1: part `part` of `parts` threads (every one of them calls it), the
   panels split between them; scratch: the block's x, shared by the parts */
static void run_block(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                      int64_t ldy, int64_t m0, int64_t mc, int64_t n, int64_t k, float *scratch,
                      int part, int parts) {
    const int64_t np = round_nr(n), panels = np / NR, kc = chunk_depth(k);
    const char *wend = (const char *)(w + np * k);
    const int64_t groups = (mc + MR - 1) / MR, base = mc / groups, extra = mc % groups;
    /* a depth's floats in the scratch: XS, or a lone group's rows (one row: 4 bytes a depth,
       not a 64-byte line) */
    const int64_t xs = groups == 1 ? mc : XS;
    int64_t lo, hi;
    /* the block's x into the scratch: chunk by chunk, a row group's [kcc][xs] each */
    share_of(groups, part, parts, &lo, &hi);
    for (int64_t g = lo; g < hi; g++) {
        const int64_t r0 = m0 + g * base + (g < extra ? g : extra);
        for (int64_t d0 = 0; d0 < k; d0 += kc) {
            const int64_t kcc = k - d0 < kc ? k - d0 : kc;
            pack_x(x + r0 * ldx + d0, ldx, (int)(base + (g < extra)), kcc,
                   scratch + d0 * groups * xs + g * kcc * xs, xs);
        }
    }
    if (parts > 1) {
#pragma omp barrier
    }
    share_of(panels, part, parts, &lo, &hi);
    for (int64_t d0 = 0; d0 < k; d0 += kc) {
        const int64_t kcc = k - d0 < kc ? k - d0 : kc;
        const int first = d0 == 0, last = d0 + kcc >= k;
        const float *wc = w + d0 * np;
        const float *xc = scratch + d0 * groups * xs;
        for (int64_t p = lo; p < hi; p++) {  /* a part's panels: the same in every chunk */
            const int64_t n0 = p * NR, cols = n - n0 < NR ? n - n0 : NR;
            int64_t r0 = m0;
            /* the weights' next kcc * NR floats (the next panel, or the next chunk's
               first) are prefetched while this panel's row groups run, a share each */
            const char *next = (const char *)(wc + (p + 1) * kcc * NR);
            const int64_t lines = kcc * NR * 4 / 64, share = (lines + groups - 1) / groups;
            for (int64_t g = 0; g < groups; g++) {
                const int rows = (int)(base + (g < extra));
                const char *pf = next + g * share * 64;
                int64_t own = share;  /* this group's lines (none past the weights) */
                if (pf + own * 64 > wend)
                    own = pf < wend ? (wend - pf) / 64 : 0;
                /* one line a depth covers the share, or two (at most 2 kcc lines: a
                   panel's depth is NR floats, at most two lines) */
                const int64_t per = own > kcc ? (own + 1) / 2 : own;  /* lines a stream */
                const int64_t half = own > kcc ? per : 0;  /* the second stream's offset */
                if (own == 0)
                    pf = (const char *)(wc + p * kcc * NR);  /* in cache already */
                const char *pf_last = pf + (per > 0 ? per - 1 : 0) * 64;
                tile_rows(wc + p * kcc * NR, kcc, xc + g * kcc * xs, xs, y + r0 * ldy + n0,
                          ldy, cols, last && bias != NULL ? bias + n0 : NULL, first, rows,
                          pf, pf_last, half * 64);
                r0 += rows;
            }
        }
    }
    if (parts > 1) {  /* before the next block's x overwrites the scratch */
#pragma omp barrier
    }
}

/* y = x @ w^T (+ bias) for x [m, k] (row stride ldx), w packed by loraplex_fma_pack, y [m, n]
   (row stride ldy); scratch: loraplex_fma_scratch_elems(m, k, threads) floats.
   Threads: a call of one row block (a decode step) splits its panels between them, sharing
   the block's x; longer calls give each thread whole row blocks and a scratch of its own, so
   no thread reads x another one wrote (split by panels, with the x rearranged by both, a
   1536-row call ran 0.79-0.82x of oneDNN at two threads on a Zen 5 pair, where one thread
   alone ran 0.94-1.0x). */
void loraplex_fma_linear(const float *x, int64_t ldx, const float *w, const float *bias,
                         float *y, int64_t ldy, int64_t m, int64_t n, int64_t k, float *scratch,
                         int threads) {
    if (m <= 0 || n <= 0)
        return;
    if (k <= 0) {  /* an empty sum: y is the bias (or zero) */
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++)
                y[r * ldy + j] = bias != NULL ? bias[j] : 0.0f;
        return;
    }
    const int64_t blocks = block_count(m, threads), mb = (m + blocks - 1) / blocks;
    const int64_t own = block_scratch(m, k, threads);
    if (threads > 1 && blocks > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t m0 = b * mb, mc = m - m0 < mb ? m - m0 : mb;
            if (mc > 0)
                run_block(x, ldx, w, bias, y, ldy, m0, mc, n, k,
                          scratch + thread_index() * own, 0, 1);
        }
        return;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int part = thread_index(), parts = thread_count();
        for (int64_t m0 = 0; m0 < m; m0 += mb)
            run_block(x, ldx, w, bias, y, ldy, m0, m - m0 < mb ? m - m0 : mb, n, k, scratch,
                      part, parts);
    }
}
