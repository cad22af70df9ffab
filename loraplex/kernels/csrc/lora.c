/* LoRA of short segments (decode rows, small chunks) for one fused projection in one call.
 *
 * Semantics, for each segment s (rows lo:hi, scale_s) and each module m of its table:
 *     h = x[lo:hi] @ A_m^T                          float32 accumulate, [rows, rank_m]
 *     y[lo:hi, start_m:end_m] += scale_s * h @ BT_m  float32 accumulate, y rounded once
 * A_m is [rank_m, d_in] and BT_m [rank_m, end_m - start_m], both row-major with unit element
 * stride, read in place (views of the pool's pages) in float32 or bfloat16. h is never rounded
 * (torch's widened short-segment path does the same). Where the build has AVX512-BF16, a bf16
 * x against bf16 blocks is not widened: the shrink runs on pair dot products (vdpbf16ps: the
 * products exact, summed in float32, bf16 denormals read as zero), 1.2x faster on a decode
 * batch (one Zen 5 core). x and y are float32 or bfloat16; a bf16
 * y element is widened, gets its float32 delta and is rounded to nearest even once, as torch's
 * `y.add_(float32 delta)` rounds it.
 *
 * Why one C call: on a CPU a decode step's LoRA is many tiny products (segments x layers x
 * projections); as torch ops each costs a fixed ~5 us whatever its size, here a few hundred ns.
 *
 * Long float32 segments (prefill: LONG_ROWS rows or more, float32 x and blocks) run tile by
 * tile of rows instead, shrink and expand fused (see "Long float32 segments" below), as pieces
 * of rows dealt round-robin to the threads. The other segments' work is split in two phases,
 * each parallel over OpenMP threads when num_threads > 1: shrinks per (segment, module), then
 * expands per (segment, module, column tile), dealt round-robin. Segments must
 * not share rows and a table's modules must not share columns (the engine's fused slices):
 * no two work items write the same element of y.
 */
#define _GNU_SOURCE  /* syscall(): the AMX tile data permission */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu_id.h"
#include "vector_width.h"

#include "bf16_pairs.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* ISO C (-std=c11) turns FMA contraction off; a * b + c as one FMA is what every BLAS does,
 * and is only more exact. */
#pragma GCC optimize("fp-contract=fast")
/* a * b + c rounded once, where two loops must agree to the bit (see vfma) */
#define FMA(a, b, c) __builtin_fmaf(a, b, c)

enum { DT_F32 = 0, DT_BF16 = 1 };
/* Expand work items' columns when a segment has more than two rows (B^T's tile is then read
 * once per pair of rows: 256 columns x rank stay in L1/L2); a segment of one or two rows sweeps
 * each module's whole width once, B^T read as one stream. */
enum { TILE = 256 };

static inline int64_t tile_of(int64_t rows, int64_t width) {
    return rows <= 2 || width <= TILE ? (width > 0 ? width : 1) : TILE;
}

/* One module of a segment's table; Python builds these once per resident adapter's group. */
typedef struct {
    int64_t a, a_stride;  /* A: address, elements between rank rows */
    int64_t b, b_stride;  /* BT: address, elements between rank rows */
    int64_t rank, start, end;  /* the module's rank and its columns of y */
    int64_t d_in, dtype;  /* A's row length (checked against x) and the blocks' dtype */
} module_t;

/* One segment of the call: its rows and its table (module_t[num_modules]). */
typedef struct {
    int64_t lo, hi, table, num_modules;
} segment_t;

/* GCC/clang vectors of the machine's register width, VW lanes (vector_width.h: 16 with
 * AVX-512, else 8; 16-lane vectors on AVX2 were register pairs, and the expand's 4 x 2
 * accumulators of them spilled: 2-3x slower on Zen 3); unaligned, and allowed to alias the
 * tensors. */
typedef float vf __attribute__((vector_size(4 * VW), aligned(4), may_alias));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));
typedef uint16_t vh __attribute__((vector_size(2 * VW), aligned(2), may_alias));

static inline vf ld_f32(const float *p) { return *(const vf *)p; }

static inline vf ld_bf16(const uint16_t *p) {
    return (vf)(__builtin_convertvector(*(const vh *)p, vu) << 16);
}

static inline vh to_bf16(vf f) {
    /* torch's round_to_nearest_even; a NaN stays a (quiet) NaN with its sign */
    const vu u = (vu)f;
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);  /* all ones where NaN */
    return __builtin_convertvector((rounded & ~nan) | (((u >> 16) | 0x40u) & nan), vh);
}

static inline float hsum(vf v) {
    float s = 0;
    for (int j = 0; j < VW; j++) s += v[j];
    return s;
}

static inline float bf2f(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? (u >> 16) | 0x40u : rounded);
}

static void widen(const uint16_t *restrict in, float *restrict out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bf2f(in[i]);
}

/* The next work item's block, prefetched a line at a time while the current item runs: a burst
 * of all its lines at the item's start fills the core's miss buffers and then
 * waits on them, so the block's memory time and the current item's time add up; spread over
 * the current item's loads they overlap (a plain read of 6-36 KB blocks in random order: 1.4-1.8x
 * the bandwidth of a burst per block, one Zen 4 core; the decode batch of cpu_lora_bench.py
 * 1.08-1.25x in float32 and bf16, bit for bit the same results).
 *
 * The pace: on AMD's family 0x1A (Zen 5) the block's lines go into L1, spread evenly over the
 * current item's (num lines of the next block for every den lines read, so the last goes out as
 * the current item ends): the decode batch 1.13-1.22x in float32 (bf16 0.95-1.09x) against two
 * lines into L2 for every line read until done, which finished halfway through an item of the
 * same size and left the rest of it with nothing in flight (as gemm_bf16.c's next task did). The
 * same on Intel CPUs (a Sapphire Rapids-class core: float32 1.09-1.12x, bf16 0.98-1.03x). On
 * AMD's earlier families (Zen 3, Zen 4) the old pace, measured on Zen 4 (1.0-1.1x there against
 * one line a line). */
typedef struct {
    const char *p;                  /* the next line to fetch */
    int64_t left, stride, row, at;  /* lines left in this row; bytes between rows, of a row */
    int64_t rows;                   /* rows after this one */
    int64_t acc, num, den;          /* num lines fetched for every den lines read */
    int l1;                         /* into L1 (1) or L2 (0) */
} cursor_t;

/* lines of a block of `rows` rows of n elements each */
static inline int64_t block_lines(int64_t rows, int64_t n, int64_t dtype) {
    return rows * ((n * (dtype == DT_F32 ? 4 : 2) + 63) / 64);
}

/* the cursor over the next item's block (rows x n elements from column `from`), while the
 * current item reads `current` lines (block_lines of its own block) */
static void cursor_init(cursor_t *c, int64_t base, int64_t stride, int64_t rows, int64_t from,
                        int64_t n, int64_t dtype, int64_t current) {
    const int64_t elem = dtype == DT_F32 ? 4 : 2;
    c->p = (const char *)(intptr_t)base + from * elem;
    c->stride = stride * elem;
    c->row = (n * elem + 63) / 64;
    c->left = rows > 0 ? c->row : 0;
    c->at = 0;
    c->rows = rows > 0 ? rows - 1 : 0;
    const int amd = amd_family();
    c->l1 = amd == 0 || amd >= 0x1A;
    c->acc = 0;
    c->num = c->l1 ? block_lines(rows, n, dtype) : 2;
    c->den = c->l1 && current > 0 ? current : 1;
}

/* past the cursor's current line: the next one of its row, or the next row's first */
static inline void cursor_next(cursor_t *c) {
    c->at += 64;
    if (--c->left == 0 && c->rows > 0) {
        c->rows--;
        c->p += c->stride;
        c->at = 0;
        c->left = c->row;
    }
}

/* the lines due after the caller has read n more of the current item's */
static inline void cursor_step(cursor_t *c, int64_t n) {
    for (c->acc += n * c->num; c->acc >= c->den && c->left > 0; c->acc -= c->den) {
        if (c->l1)
            __builtin_prefetch(c->p + c->at, 0, 3);
        else
            __builtin_prefetch(c->p + c->at, 0, 2);
        cursor_next(c);
    }
}

static inline const module_t *modules_of(const segment_t *s) {
    return (const module_t *)(intptr_t)s->table;
}

/* The block kernels, once per weight type W (float or uint16_t bf16 bits) through LD (vector
 * load) and LD1 (scalar load). A scalar sum's step is an explicit FMA (see vfma). */

#define LD1_f32(p) (*(p))
#define LD1_bf16(p) bf2f(*(p))

/* h[i * hs + k] = x_i . A_k (float32) for the module's ranks: four ranks by two rows at a
 * time, eight independent sums (a decode segment is often one row, and a single sum is a
 * chain of dependent FMAs), each load of x serving four A rows that stay in L1. */
#define DEFINE_SHRINK(NAME, W, LD, LD1, STEP)                                              \
    static void NAME(const float *restrict x, int64_t xs, int64_t rows, int64_t d_in,      \
                     const module_t *m, float *restrict h, int64_t hs, cursor_t *next) {   \
        const W *A = (const W *)(intptr_t)m->a;                                            \
        const int64_t as = m->a_stride, dv = d_in - d_in % VW;                             \
        for (int64_t k = 0; k < m->rank; k += 4) {                                         \
            const int64_t nk = m->rank - k < 4 ? m->rank - k : 4;                          \
            /* past the last rank, repeat it: the sums are computed and not stored */      \
            const W *a0 = A + k * as, *a1 = A + (k + (nk > 1)) * as;                       \
            const W *a2 = A + (k + (nk > 2 ? 2 : nk - 1)) * as;                            \
            const W *a3 = A + (k + nk - 1) * as;                                           \
            const W *pf = k + 8 <= m->rank ? A + (k + 4) * as : a0;                        \
            for (int64_t i = 0; i < rows; i += 2) {                                        \
                const float *x0 = x + i * xs, *x1 = i + 1 < rows ? x0 + xs : x0;           \
                vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                 \
                vf t0 = {0}, t1 = {0}, t2 = {0}, t3 = {0};                                 \
                for (int64_t d = 0; d < dv; d += VW) {                                     \
                    /* the next four ranks' rows, one group ahead: blocks are many and */  \
                    /* short, so the hardware's stream prefetch alone starts late */       \
                    __builtin_prefetch(pf + d);                                            \
                    __builtin_prefetch(pf + as + d);                                       \
                    __builtin_prefetch(pf + 2 * as + d);                                   \
                    __builtin_prefetch(pf + 3 * as + d);                                   \
                    STEP(next, (int)(4 * VW * sizeof(W) / 64));                            \
                    const vf u = ld_f32(x0 + d), v = ld_f32(x1 + d);                       \
                    const vf b0 = LD(a0 + d), b1 = LD(a1 + d);                             \
                    const vf b2 = LD(a2 + d), b3 = LD(a3 + d);                             \
                    s0 += u * b0, s1 += u * b1, s2 += u * b2, s3 += u * b3;                \
                    t0 += v * b0, t1 += v * b1, t2 += v * b2, t3 += v * b3;                \
                }                                                                          \
                float r[8] = {hsum(s0), hsum(s1), hsum(s2), hsum(s3),                      \
                              hsum(t0), hsum(t1), hsum(t2), hsum(t3)};                     \
                for (int64_t d = dv; d < d_in; d++) {                                      \
                    const float u = x0[d], v = x1[d];                                      \
                    const float b0 = LD1(a0 + d), b1 = LD1(a1 + d);                        \
                    const float b2 = LD1(a2 + d), b3 = LD1(a3 + d);                        \
                    /* one rounding each, as the vectors' FMAs and stream_shrink_f32's */  \
                    r[0] = FMA(u, b0, r[0]), r[1] = FMA(u, b1, r[1]);                      \
                    r[2] = FMA(u, b2, r[2]), r[3] = FMA(u, b3, r[3]);                      \
                    r[4] = FMA(v, b0, r[4]), r[5] = FMA(v, b1, r[5]);                      \
                    r[6] = FMA(v, b2, r[6]), r[7] = FMA(v, b3, r[7]);                      \
                }                                                                          \
                for (int64_t j = 0; j < nk; j++) {                                         \
                    h[i * hs + k + j] = r[j];                                              \
                    if (i + 1 < rows) h[(i + 1) * hs + k + j] = r[4 + j];                  \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }

/* each kernel twice: a decode item's copy steps the next item's cursor in its loops (STEP), a
 * long segment's does not (there the steps made a prefill chunk's LoRA 1.2x slower) */
#define STEP_ON(next, n) cursor_step(next, n)
#define STEP_OFF(next, n) ((void)(next))

DEFINE_SHRINK(shrink_f32, float, ld_f32, LD1_f32, STEP_OFF)
DEFINE_SHRINK(shrink_bf16, uint16_t, ld_bf16, LD1_bf16, STEP_OFF)
DEFINE_SHRINK(shrink_f32_spread, float, ld_f32, LD1_f32, STEP_ON)
DEFINE_SHRINK(shrink_bf16_spread, uint16_t, ld_bf16, LD1_bf16, STEP_ON)

#ifdef HAVE_DPBF16
/* shrink_bf16's h from bf16 x and bf16 A without widening either: two rows by four ranks of
 * pair dot products (32 depths an instruction), h float32 and not rounded */
static void shrink_pairs(const uint16_t *restrict x, int64_t xs, int64_t rows, int64_t d_in,
                         const module_t *m, float *restrict h, int64_t hs, cursor_t *next) {
    const uint16_t *A = (const uint16_t *)(intptr_t)m->a;
    const int64_t as = m->a_stride, rank = m->rank, dv = d_in - d_in % 32;
    const __mmask32 tail = (__mmask32)((1ull << (d_in - dv)) - 1);
    for (int64_t k = 0; k < rank; k += 4) {
        const uint16_t *ar[4];
        for (int a = 0; a < 4; a++) ar[a] = A + (k + a < rank ? k + a : k) * as;
        const uint16_t *pf = k + 8 <= rank ? A + (k + 4) * as : ar[0];
        for (int64_t i = 0; i < rows; i += 2) {
            const uint16_t *x0 = x + i * xs, *x1 = i + 1 < rows ? x0 + xs : x0;
            __m512 acc[2][4];
            for (int j = 0; j < 2; j++)
                for (int a = 0; a < 4; a++) acc[j][a] = _mm512_setzero_ps();
            for (int64_t d = 0; d < dv; d += 32) {
                for (int a = 0; a < 4; a++) __builtin_prefetch(pf + a * as + d);
                if (next != NULL) cursor_step(next, 4);
                const __m512i u = _mm512_loadu_si512(x0 + d), v = _mm512_loadu_si512(x1 + d);
                for (int a = 0; a < 4; a++) {
                    const __m512i b = _mm512_loadu_si512(ar[a] + d);
                    acc[0][a] = dp(acc[0][a], u, b);
                    acc[1][a] = dp(acc[1][a], v, b);
                }
            }
            if (dv < d_in) {
                const __m512i u = _mm512_maskz_loadu_epi16(tail, x0 + dv);
                const __m512i v = _mm512_maskz_loadu_epi16(tail, x1 + dv);
                for (int a = 0; a < 4; a++) {
                    const __m512i b = _mm512_maskz_loadu_epi16(tail, ar[a] + dv);
                    acc[0][a] = dp(acc[0][a], u, b);
                    acc[1][a] = dp(acc[1][a], v, b);
                }
            }
            for (int a = 0; a < 4 && k + a < rank; a++) {
                h[i * hs + k + a] = _mm512_reduce_add_ps(acc[0][a]);
                if (i + 1 < rows) h[(i + 1) * hs + k + a] = _mm512_reduce_add_ps(acc[1][a]);
            }
        }
    }
}
#endif

/* a * b + c in each lane, rounded once: explicit, because whether the compiler contracts
 * `c + a * b` differs between the loops it is inlined into, and the memory-order path must
 * give the same bits as the work items */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__) && VW == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && VW == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf r;
    for (int j = 0; j < VW; j++) r[j] = __builtin_fmaf(a[j], b[j], c[j]);
    return r;
#endif
}

/* y[i, c] += scale * out[c] for c < n, with y's rounding (the float32 sum one FMA) */
static inline void store_vec(char *y, int64_t y_dtype, int64_t at, vf out, float scale) {
    const vf s = (vf){0} + scale;
    if (y_dtype == DT_F32) {
        float *p = (float *)y + at;
        *(vf *)p = vfma(s, out, ld_f32(p));
    } else {
        uint16_t *p = (uint16_t *)y + at;
        *(vh *)p = to_bf16(vfma(s, out, ld_bf16(p)));
    }
}

static inline void store_one(char *y, int64_t y_dtype, int64_t at, float out, float scale) {
    if (y_dtype == DT_F32) {
        float *p = (float *)y + at;
        *p = FMA(scale, out, *p);
    } else {
        uint16_t *p = (uint16_t *)y + at;
        *p = f2bf(FMA(scale, out, bf2f(*p)));
    }
}

/* y[i, c0:c1] += scale * h_i @ BT[:, c0 - start : c1 - start] for every row i: two rows by 4 VW
 * columns at a time, the sums in eight vectors over the ranks (each B^T load serves two
 * rows), then VW columns, then single ones. */
#define DEFINE_EXPAND(NAME, W, LD, LD1, STEP)                                              \
    static void NAME(const float *restrict h, int64_t hs, int64_t rows, const module_t *m, \
                     int64_t c0, int64_t c1, float scale, char *y, int64_t ys,             \
                     int64_t y_dtype, cursor_t *next) {                                    \
        const W *B = (const W *)(intptr_t)m->b;                                            \
        const int64_t bs = m->b_stride, rank = m->rank, off = m->start;                    \
        for (int64_t i = 0; i < rows; i += 2) {                                            \
            const int two = i + 1 < rows;                                                  \
            const float *h0 = h + i * hs, *h1 = two ? h0 + hs : h0;                        \
            int64_t c = c0;                                                                \
            for (; c + 4 * VW <= c1; c += 4 * VW) {                                        \
                vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                 \
                vf t0 = {0}, t1 = {0}, t2 = {0}, t3 = {0};                                 \
                for (int64_t k = 0; k < rank; k++) {                                       \
                    const W *b = B + k * bs + (c - off);                                   \
                    __builtin_prefetch(b + 4 * VW);  /* this rank's next 4 VW columns */   \
                    __builtin_prefetch(b + 6 * VW);                                        \
                    STEP(next, (int)(4 * VW * sizeof(W) / 64));                            \
                    const vf b0 = LD(b), b1 = LD(b + VW), b2 = LD(b + 2 * VW);             \
                    const vf b3 = LD(b + 3 * VW);                                          \
                    const float p = h0[k], q = h1[k];                                      \
                    s0 += p * b0, s1 += p * b1, s2 += p * b2, s3 += p * b3;                \
                    t0 += q * b0, t1 += q * b1, t2 += q * b2, t3 += q * b3;                \
                }                                                                          \
                const int64_t r0 = i * ys + c, r1 = r0 + ys;                               \
                /* the next two rows' y at these columns: in a long (prefill) segment each  \
                 * row's tile is a short run the hardware prefetcher misses, out of L2      \
                 * after the base GEMM wrote it; its read-modify-write stalled (this made a \
                 * prefill segment's LoRA 1.15-1.55x faster on a Zen 4 core) */             \
                const int64_t el = y_dtype == DT_F32 ? 4 : 2;                              \
                for (int64_t q = 0; i + 2 < rows && q < 4 * VW * el; q += 64) {             \
                    __builtin_prefetch(y + (r0 + 2 * ys) * el + q, 1, 3);                  \
                    if (i + 3 < rows) __builtin_prefetch(y + (r1 + 2 * ys) * el + q, 1, 3); \
                }                                                                          \
                store_vec(y, y_dtype, r0, s0, scale);                                      \
                store_vec(y, y_dtype, r0 + VW, s1, scale);                                 \
                store_vec(y, y_dtype, r0 + 2 * VW, s2, scale);                             \
                store_vec(y, y_dtype, r0 + 3 * VW, s3, scale);                             \
                if (two) {                                                                 \
                    store_vec(y, y_dtype, r1, t0, scale);                                  \
                    store_vec(y, y_dtype, r1 + VW, t1, scale);                             \
                    store_vec(y, y_dtype, r1 + 2 * VW, t2, scale);                         \
                    store_vec(y, y_dtype, r1 + 3 * VW, t3, scale);                         \
                }                                                                          \
            }                                                                              \
            for (; c + VW <= c1; c += VW) {                                                \
                vf s0 = {0}, t0 = {0};                                                     \
                for (int64_t k = 0; k < rank; k++) {                                       \
                    const vf b0 = LD(B + k * bs + (c - off));                              \
                    s0 += h0[k] * b0, t0 += h1[k] * b0;                                    \
                }                                                                          \
                store_vec(y, y_dtype, i * ys + c, s0, scale);                              \
                if (two) store_vec(y, y_dtype, (i + 1) * ys + c, t0, scale);               \
            }                                                                              \
            for (; c < c1; c++) {                                                          \
                float s0 = 0, t0 = 0;                                                      \
                for (int64_t k = 0; k < rank; k++) {                                       \
                    const float b0 = LD1(B + k * bs + (c - off));                          \
                    s0 = FMA(h0[k], b0, s0), t0 = FMA(h1[k], b0, t0);                      \
                }                                                                          \
                store_one(y, y_dtype, i * ys + c, s0, scale);                              \
                if (two) store_one(y, y_dtype, (i + 1) * ys + c, t0, scale);               \
            }                                                                              \
        }                                                                                  \
    }

DEFINE_EXPAND(expand_f32, float, ld_f32, LD1_f32, STEP_OFF)
DEFINE_EXPAND(expand_bf16, uint16_t, ld_bf16, LD1_bf16, STEP_OFF)

DEFINE_EXPAND(expand_f32_spread, float, ld_f32, LD1_f32, STEP_ON)
DEFINE_EXPAND(expand_bf16_spread, uint16_t, ld_bf16, LD1_bf16, STEP_ON)

/* ---- Long float32 segments (prefill) ----------------------------------------------------
 *
 * A float32 segment of LONG_ROWS rows or more (float32 x and y, float32 blocks) runs tile by
 * tile: LT rows at a time, the shrink of the tile (h, LT x the table's total rank, in L1) then
 * its expand into those LT rows of y, while the next tile's rows of x and y are prefetched.
 *
 * The shrink has the ranks in vector lanes: the segment's A blocks (all the table's modules,
 * ranks concatenated, padded to half a vector) are transposed once into At [d_in, rp] (a
 * per-thread buffer, 16 x 16 in-register transposes), and each depth d is one load of At's
 * row per vector of ranks and one broadcast of x per row: LT rows x up to 3 vectors of ranks
 * in registers, no horizontal sums. The expand keeps LT rows x 3 vectors of columns in
 * registers, each B^T load serving the tile's LT rows (h broadcast). Each h element and each
 * y element is one chain of FMAs in a fixed order whatever the tiling or the threads (h over
 * d, y's delta over the module's ranks), so the split of rows over threads changes no bit.
 *
 * Why: the decode-shaped kernels above (dot products with horizontal sums, two rows per B^T
 * load) ran a prefill chunk's LoRA at about half the core's float32 FMA peak. This path is
 * 1.4-1.8x faster on cpu_lora_bench.py's prefill chunk (17 segments of 31-200 rows, ranks 8
 * and 16, SmolLM2's q/k/v and o; one Zen 4 core), 80-95% of peak with the blocks in cache.
 * Below LONG_ROWS rows the packing of A and the tile's padded rows cost more than they save
 * (measured: slower than the short path at 8-12 rows, even at 16 rows for o at rank 8). */
enum { LT = 8 };         /* rows of a tile */
enum { LONG_ROWS = 16 };  /* a float32 segment this long takes the long path */

#define VH (VW / 2)
typedef float vfh __attribute__((vector_size(4 * VH), aligned(4), may_alias));

static inline vfh ld_half(const float *p) { return *(const vfh *)p; }

/* The next piece's blocks to prefetch (into L2), in order, `rate` lines at each of the shrink's
 * steps (16 depths): its A unless it is the same segment's, its B^T and its first tile's rows of
 * x and y, spread over the current piece's first half. The adapters' blocks come from memory
 * (30 layers of them do not stay in L3): without this the first tile of each segment waited on
 * them, 1.1-1.2x on cpu_lora_bench.py's prefill chunk, one Zen 4 core. Prefetching each next
 * tile's rows of x and y through the same steps (768 lines a tile for q/k/v) was 1.1-1.2x
 * slower than a line per row at the loads' own pace (the shrink's x, the expand's y). */
enum { PFQ = 16 };
typedef struct {
    cursor_t c[PFQ];
    int w[PFQ];  /* with the intent to write (y) */
    int n, at;
    int64_t lines, rate;
} pfq_t;

static void pfq_add(pfq_t *q, const float *base, int64_t stride, int64_t rows, int64_t n,
                    int w) {
    if (q->n == PFQ || rows <= 0 || n <= 0) return;
    cursor_init(&q->c[q->n], (int64_t)(intptr_t)base, stride, rows, 0, n, DT_F32, 0);
    q->lines += rows * q->c[q->n].row;
    q->w[q->n++] = w;
}

static inline void pfq_step(pfq_t *q) {
    for (int64_t k = q->rate; k > 0 && q->at < q->n;) {
        cursor_t *c = &q->c[q->at];
        if (c->left == 0) {
            q->at++;
            continue;
        }
        if (q->w[q->at])
            __builtin_prefetch(c->p + c->at, 1, 2);
        else
            __builtin_prefetch(c->p + c->at, 0, 2);
        k--;
        cursor_next(c);
    }
}

static inline int seg_long(const segment_t *sg, int64_t io_dtype) {
    if (io_dtype != DT_F32 || sg->hi - sg->lo < LONG_ROWS) return 0;
    for (int64_t j = 0; j < sg->num_modules; j++)
        if (modules_of(sg)[j].dtype != DT_F32) return 0;
    return 1;
}

/* the table's total rank, padded to half a vector: At's and h's row length */
static inline int64_t seg_rp(const segment_t *sg) {
    int64_t r = 0;
    for (int64_t j = 0; j < sg->num_modules; j++) r += modules_of(sg)[j].rank;
    return (r + VH - 1) / VH * VH;
}

#if VW == 16
#include "transpose16.h"
#endif

/* At[d * rp + r0_m + k] = A_m[k, d] for every module m (r0_m: the ranks before it), zeros in
 * the padding columns */
static void pack_at(const segment_t *sg, int64_t d_in, float *restrict At, int64_t rp) {
    const module_t *mods = modules_of(sg);
    int64_t r0 = 0;
    for (int64_t j = 0; j < sg->num_modules; r0 += mods[j].rank, j++) {
        const float *A = (const float *)(intptr_t)mods[j].a;
        const int64_t as = mods[j].a_stride, rank = mods[j].rank;
#if VW == 16
        for (int64_t k0 = 0; k0 < rank; k0 += 16) {
            const int64_t nk = rank - k0 < 16 ? rank - k0 : 16;
            const __mmask16 km = (__mmask16)((1u << nk) - 1);
            for (int64_t d0 = 0; d0 < d_in; d0 += 16) {
                const int64_t nd = d_in - d0 < 16 ? d_in - d0 : 16;
                const __mmask16 dm = (__mmask16)((1u << nd) - 1);
                __m512 r[16];
                for (int k = 0; k < 16; k++)
                    r[k] = k < nk ? _mm512_maskz_loadu_ps(dm, A + (k0 + k) * as + d0)
                                  : _mm512_setzero_ps();
                transpose16_ps(r);
                for (int c = 0; c < nd; c++)
                    _mm512_mask_storeu_ps(At + (d0 + c) * rp + r0 + k0, km, r[c]);
            }
        }
#else
        for (int64_t k = 0; k < rank; k++)
            for (int64_t d = 0; d < d_in; d++) At[d * rp + r0 + k] = A[k * as + d];
#endif
    }
    if (r0 < rp)
        for (int64_t d = 0; d < d_in; d++)
            for (int64_t c = r0; c < rp; c++) At[d * rp + c] = 0;
}

/* h[i * rp + c0 + c] = x_i . At[:, c0 + c] for the tile's LT rows (xr[i]) and nv vectors plus
 * nh half vectors of ranks from c0; the next tile's rows of x (xn, or NULL) prefetched a line
 * a row each 16 depths, and the next piece's blocks stepped through pq */
static inline __attribute__((always_inline)) void shrink_tile(
    const float *const *xr, const float *const *xn, int64_t d_in, const float *restrict At,
    int64_t rp, int64_t c0, float *restrict h, const int nv, const int nh, pfq_t *pq) {
    vf acc[LT][3];
    vfh acch[LT];
    for (int i = 0; i < LT; i++) {
        for (int v = 0; v < 3; v++) acc[i][v] = (vf){0};
        acch[i] = (vfh){0};
    }
    const float *a = At + c0;
#define SHRINK_STEP(d)                                                      \
    do {                                                                    \
        const float *ad = a + (d) * rp;                                     \
        vf a0 = {0}, a1 = {0}, a2 = {0};                                    \
        vfh ah = {0};                                                       \
        if (nv > 0) a0 = ld_f32(ad);                                        \
        if (nv > 1) a1 = ld_f32(ad + VW);                                   \
        if (nv > 2) a2 = ld_f32(ad + 2 * VW);                               \
        if (nh) ah = ld_half(ad + nv * VW);                                 \
        for (int i = 0; i < LT; i++) {                                      \
            const float xv = xr[i][d];                                      \
            if (nv > 0) acc[i][0] += xv * a0;                               \
            if (nv > 1) acc[i][1] += xv * a1;                               \
            if (nv > 2) acc[i][2] += xv * a2;                               \
            if (nh) acch[i] += xv * ah;                                     \
        }                                                                   \
    } while (0)
    int64_t d0 = 0;
    for (; d0 + 16 <= d_in; d0 += 16) {
        if (xn != NULL)
            for (int i = 0; i < LT; i++) __builtin_prefetch(xn[i] + d0, 0, 2);
        pfq_step(pq);
#pragma GCC unroll 4
        for (int64_t d = d0; d < d0 + 16; d++) SHRINK_STEP(d);
    }
    for (int64_t d = d0; d < d_in; d++) SHRINK_STEP(d);
#undef SHRINK_STEP
    for (int i = 0; i < LT; i++) {
        float *hr = h + i * rp + c0;
        for (int v = 0; v < nv; v++) *(vf *)(hr + v * VW) = acc[i][v];
        if (nh) *(vfh *)(hr + nv * VW) = acch[i];
    }
}

#define DEFINE_SHRINK_TILE(NV, NH)                                                          \
    static void shrink_tile_##NV##_##NH(const float *const *xr, const float *const *xn,    \
                                        int64_t d_in, const float *At, int64_t rp,         \
                                        int64_t c0, float *h, pfq_t *pq) {                 \
        shrink_tile(xr, xn, d_in, At, rp, c0, h, NV, NH, pq);                              \
    }
DEFINE_SHRINK_TILE(3, 0)
DEFINE_SHRINK_TILE(2, 1)
DEFINE_SHRINK_TILE(2, 0)
DEFINE_SHRINK_TILE(1, 1)
DEFINE_SHRINK_TILE(1, 0)
DEFINE_SHRINK_TILE(0, 1)

/* yr[i][c] += scale * sum_k ht[k * LT + i] B[k * bs + c] for the tile's first n rows and nv
 * vectors of columns (ht: h rank-major from the module's first rank); the next tile's rows of y
 * at these columns (yn, or NULL) prefetched for writing */
static inline __attribute__((always_inline)) void expand_tile(
    const float *restrict ht, int64_t rank, const float *B, int64_t bs, float *const *yr,
    float *const *yn, int64_t n, float scale, const int nv) {
    if (yn != NULL)
        for (int i = 0; i < LT; i++)
            for (int v = 0; v < nv; v++) __builtin_prefetch(yn[i] + v * VW, 1, 2);
    vf acc[LT][3];
    for (int i = 0; i < LT; i++)
        for (int v = 0; v < 3; v++) acc[i][v] = (vf){0};
    for (int64_t k = 0; k < rank; k++) {
        const float *b = B + k * bs;
        vf b0 = {0}, b1 = {0}, b2 = {0};
        if (nv > 0) b0 = ld_f32(b);
        if (nv > 1) b1 = ld_f32(b + VW);
        if (nv > 2) b2 = ld_f32(b + 2 * VW);
        for (int i = 0; i < LT; i++) {
            const float hv = ht[k * LT + i];
            if (nv > 0) acc[i][0] += hv * b0;
            if (nv > 1) acc[i][1] += hv * b1;
            if (nv > 2) acc[i][2] += hv * b2;
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < LT; i++)
        if (i < n) {
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) {
                float *p = yr[i] + v * VW;
                *(vf *)p = ld_f32(p) + scale * acc[i][v];
            }
        }
}

#define DEFINE_EXPAND_TILE(NV)                                                              \
    static void expand_tile_##NV(const float *ht, int64_t rank, const float *B, int64_t bs, \
                                 float *const *yr, float *const *yn, int64_t n,            \
                                 float scale) {                                             \
        expand_tile(ht, rank, B, bs, yr, yn, n, scale, NV);                                 \
    }
DEFINE_EXPAND_TILE(3)
DEFINE_EXPAND_TILE(2)
DEFINE_EXPAND_TILE(1)

/* the last nc < VW columns: as expand_tile's one vector, B and y read and written masked */
static void expand_tail(const float *restrict ht, int64_t rank, const float *B,
                        int64_t bs, float *const *yr, int64_t n, float scale, int64_t nc) {
#if VW == 16
    const __mmask16 cm = (__mmask16)((1u << nc) - 1);
    __m512 acc[LT];
    for (int i = 0; i < LT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < rank; k++) {
        const __m512 b = _mm512_maskz_loadu_ps(cm, B + k * bs);
        for (int i = 0; i < LT; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(ht[k * LT + i]), b, acc[i]);
    }
    for (int64_t i = 0; i < n; i++) {
        const __m512 old = _mm512_maskz_loadu_ps(cm, yr[i]);
        _mm512_mask_storeu_ps(yr[i], cm, _mm512_fmadd_ps(_mm512_set1_ps(scale), acc[i], old));
    }
#else
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < nc; c++) {
            float s = 0;
            for (int64_t k = 0; k < rank; k++) s += ht[k * LT + i] * B[k * bs + c];
            yr[i][c] += scale * s;
        }
#endif
}

/* the columns of y the segment's table writes: [*lo, *hi) */
static void seg_cols(const segment_t *sg, int64_t *lo, int64_t *hi) {
    const module_t *mods = modules_of(sg);
    int64_t cmin = INT64_MAX, cmax = 0;
    for (int64_t j = 0; j < sg->num_modules; j++)
        if (mods[j].end > mods[j].start) {
            cmin = mods[j].start < cmin ? mods[j].start : cmin;
            cmax = mods[j].end > cmax ? mods[j].end : cmax;
        }
    *lo = cmin > cmax ? cmax : cmin;
    *hi = cmax;
}

/* the next piece's blocks (A unless the segment is the same, B^T) and its first tile's rows */
static void pfq_piece(pfq_t *q, const segment_t *cur, const segment_t *sg, int64_t lo,
                      int64_t hi, const float *x, int64_t xs, float *y, int64_t ys,
                      int64_t d_in) {
    if (sg != cur) {
        const module_t *mods = modules_of(sg);
        for (int64_t j = 0; j < sg->num_modules; j++)
            pfq_add(q, (const float *)(intptr_t)mods[j].a, mods[j].a_stride, mods[j].rank, d_in,
                    0);
        for (int64_t j = 0; j < sg->num_modules; j++)
            pfq_add(q, (const float *)(intptr_t)mods[j].b, mods[j].b_stride, mods[j].rank,
                    mods[j].end - mods[j].start, 0);
    }
    int64_t cmin, cmax;
    seg_cols(sg, &cmin, &cmax);
    const int64_t n = hi - lo < LT ? hi - lo : LT;
    pfq_add(q, x + lo * xs, xs, n, d_in, 0);
    pfq_add(q, y + lo * ys + cmin, ys, n, cmax - cmin, 1);
}

/* rows lo:hi of segment sg (absolute rows of x and y), tile by tile; At holds the segment's
 * packed A (rp columns), hb 2 LT x rp floats (h row-major, then rank-major); pq the next
 * piece's prefetches */
static void long_rows(const segment_t *sg, int64_t lo, int64_t hi, const float *x, int64_t xs,
                      float *y, int64_t ys, int64_t d_in, float scale, const float *At,
                      float *hb, int64_t rp, pfq_t *pq) {
    const module_t *mods = modules_of(sg);
    float *const ht = hb + LT * rp;
    /* the shrink's steps per tile (16 depths of each chunk of ranks): the next piece's
     * prefetches over the first half of this one's */
    int64_t chunks = 0;
    for (int64_t c0 = 0; c0 < rp; chunks++)
        c0 += rp - c0 >= 3 * VW ? 3 * VW : rp - c0 >= 2 * VW ? 2 * VW : rp - c0 >= VW ? VW : VH;
    const int64_t steps = chunks * (d_in / 16), tiles = (hi - lo + LT - 1) / LT;
    if (steps > 0) pq->rate = 2 * ((pq->lines + steps * tiles - 1) / (steps * tiles));
    for (int64_t t = lo; t < hi; t += LT) {
        const int64_t n = hi - t < LT ? hi - t : LT, nn = hi - t - LT < LT ? hi - t - LT : LT;
        const float *xr[LT], *xn[LT];  /* this tile's rows of x and the next one's */
        for (int i = 0; i < LT; i++) {
            xr[i] = x + (t + (i < n ? i : n - 1)) * xs;
            xn[i] = nn > 0 ? x + (t + LT + (i < nn ? i : nn - 1)) * xs : NULL;
        }
        const float *const *xnp = nn > 0 ? xn : NULL;
        for (int64_t c0 = 0; c0 < rp;) {
            const int64_t left = rp - c0;
            if (left >= 3 * VW) {
                shrink_tile_3_0(xr, xnp, d_in, At, rp, c0, hb, pq);
                c0 += 3 * VW;
            } else if (left == 2 * VW + VH) {
                shrink_tile_2_1(xr, xnp, d_in, At, rp, c0, hb, pq);
                c0 += 2 * VW + VH;
            } else if (left == 2 * VW) {
                shrink_tile_2_0(xr, xnp, d_in, At, rp, c0, hb, pq);
                c0 += 2 * VW;
            } else if (left == VW + VH) {
                shrink_tile_1_1(xr, xnp, d_in, At, rp, c0, hb, pq);
                c0 += VW + VH;
            } else if (left == VW) {
                shrink_tile_1_0(xr, xnp, d_in, At, rp, c0, hb, pq);
                c0 += VW;
            } else {
                shrink_tile_0_1(xr, xnp, d_in, At, rp, c0, hb, pq);
                c0 += VH;
            }
            xnp = NULL;  /* the next rows of x once */
        }
        /* h rank-major (ht[k * LT + i]): the expand's broadcasts at fixed offsets from one
         * pointer (with h's rows rp apart gcc ran out of registers and reloaded them) */
        for (int64_t k = 0; k < rp; k++)
            for (int i = 0; i < LT; i++) ht[k * LT + i] = hb[i * rp + k];
        int64_t r0 = 0;
        for (int64_t j = 0; j < sg->num_modules; r0 += mods[j].rank, j++) {
            const module_t *m = &mods[j];
            const float *B = (const float *)(intptr_t)m->b;
            const int64_t width = m->end - m->start, rank = m->rank, bs = m->b_stride;
            const float *h = ht + r0 * LT;
            float *yr[LT], *yn[LT];  /* this tile's rows of y at column c and the next one's */
            for (int i = 0; i < LT; i++) {
                yr[i] = y + (t + (i < n ? i : 0)) * ys + m->start;
                yn[i] = nn > 0 ? y + (t + LT + (i < nn ? i : 0)) * ys + m->start : yr[i];
            }
            float *const *ynp = nn > 0 ? yn : NULL;
            int64_t c = 0;
            for (; c + 3 * VW <= width; c += 3 * VW) {
                expand_tile_3(h, rank, B + c, bs, yr, ynp, n, scale);
                for (int i = 0; i < LT; i++) yr[i] += 3 * VW, yn[i] += 3 * VW;
            }
            if (width - c >= 2 * VW) {
                expand_tile_2(h, rank, B + c, bs, yr, ynp, n, scale);
                for (int i = 0; i < LT; i++) yr[i] += 2 * VW, yn[i] += 2 * VW;
                c += 2 * VW;
            } else if (width - c >= VW) {
                expand_tile_1(h, rank, B + c, bs, yr, ynp, n, scale);
                for (int i = 0; i < LT; i++) yr[i] += VW, yn[i] += VW;
                c += VW;
            }
            if (c < width) expand_tail(h, rank, B + c, bs, yr, n, scale, width - c);
        }
    }
}

/* ---- Short segments in memory order, behind one prefetch stream (decode rows) --------------
 *
 * A segment of up to STREAM_ROWS rows whose x, y and blocks are all float32, or all bf16 where
 * the build has pair dot products, can run module by module in the order its blocks lie in
 * memory instead of as the work items above: h = x . A_k rank row after rank row (one sum per
 * row and rank, in the shrink's order: bf16 on pair dot products as shrink_pairs, float32 in
 * vector lanes then hsum then the tail as shrink_f32), then y's delta B^T rank row after rank
 * row into a float32 buffer (each column's sum over the ranks in the expand's order), y updated
 * once as store_vec / store_one do: the same bits as the work items. While it reads, one stream
 * of software prefetches runs STREAM_AHEAD lines ahead of the reads over the same blocks in the
 * same order (the thread's segments' A and B^T, adjacent blocks merged), across module and
 * segment boundaries: one line issued for each line read.
 *
 * Why: a decode step's LoRA reads every resident adapter's blocks once, so it is bound by how
 * many lines one core keeps in flight. The work items read a module's A four rank rows at a
 * time and its B^T column tile by column tile across all rank rows (short strided runs the
 * hardware's stream prefetchers barely follow), and prefetch the next item's block into L1
 * spread over the current one: about 15 GB/s on a Zen 5 core where a plain read of the same
 * adapters' regions gets 20-26. In memory order behind a stream 8 KB ahead (128 lines; 32 and
 * 64 were slower, 192 no faster), 64 one-row bf16 segments of SmolLM2's q/k/v (ranks 8 and 16,
 * the CPU engine's host regions) ran 1.24-1.46x faster and o 1.14-1.28x, segments of 2 and 3
 * rows 1.1-1.25x, of 4 rows 0.95-1.01x (hence STREAM_ROWS); in float32 1.35-1.61x; in the
 * engine a decode step's bf16 LoRA calls 1.12-1.15x (docs/benchmarks.md, "Zen 5, twelfth
 * visit"). Measured on AMD's family 0x1A only: on by default there (loraplex_lora_set_stream:
 * -1 that default, 0 off, 1 on everywhere). */
enum { STREAM_ROWS = 3 };     /* a segment of up to this many rows */
enum { STREAM_AHEAD = 128 };  /* lines the prefetch stream runs ahead of the reads */

static int stream_mode = -1;  /* -1: on AMD's family 0x1A, 0: never, 1: always */

static inline int stream_on(void) {
    const int mode = __atomic_load_n(&stream_mode, __ATOMIC_RELAXED);
    return mode < 0 ? amd_family() >= 0x1A : mode;
}

int64_t loraplex_lora_set_stream(int64_t mode) {
    return __atomic_exchange_n(&stream_mode, mode < 0 ? -1 : mode > 0, __ATOMIC_RELAXED);
}

typedef struct {
    const char *p;
    int64_t n;  /* bytes */
} range_t;

typedef struct {
    const range_t *next, *end;  /* the ranges not yet begun */
    const char *p, *e;          /* the current range's next line, its end */
} stream_t;

/* one more line of the stream (none once it has run out) */
static inline void stream_step(stream_t *st) {
    if (st->p >= st->e) {
        if (st->next == st->end) return;
        st->p = (const char *)((uintptr_t)st->next->p & ~(uintptr_t)63);
        st->e = st->next->p + st->next->n;
        st->next++;
    }
    __builtin_prefetch(st->p, 0, 3);
    st->p += 64;
}

/* whether the segment runs in memory order: 1 to STREAM_ROWS rows, x, y and every block float32
 * (or bf16, with pair dot products) */
static inline int seg_stream(const segment_t *sg, int64_t io_dtype, int on) {
    if (!on || sg->hi - sg->lo > STREAM_ROWS || sg->hi <= sg->lo) return 0;
#ifndef HAVE_DPBF16
    if (io_dtype != DT_F32) return 0;
#endif
    for (int64_t j = 0; j < sg->num_modules; j++)
        if (modules_of(sg)[j].dtype != io_dtype) return 0;
    return 1;
}

/* the segment's blocks in reading order, appended to r (merged into the last range where they
 * follow it); returns the new count */
static int64_t stream_ranges(const segment_t *sg, range_t *r, int64_t n) {
    for (int64_t j = 0; j < sg->num_modules; j++) {
        const module_t *m = &modules_of(sg)[j];
        const int64_t el = m->dtype == DT_F32 ? 4 : 2;
        const range_t blocks[2] = {
            {(const char *)(intptr_t)m->a, ((m->rank - 1) * m->a_stride + m->d_in) * el},
            {(const char *)(intptr_t)m->b, ((m->rank - 1) * m->b_stride + m->end - m->start) * el}};
        for (int b = 0; b < 2; b++) {
            if (blocks[b].n <= 0) continue;  /* rank 0: nothing read */
            if (n > 0 && r[n - 1].p + r[n - 1].n == blocks[b].p)
                r[n - 1].n += blocks[b].n;
            else
                r[n++] = blocks[b];
        }
    }
    return n;
}

/* float32: h[i * rank + k] = x_i . A_k for the ROWS rows (a constant where inlined), each sum
 * as shrink_f32's: VW lanes over the vector part, hsum, then the tail in order */
static inline __attribute__((always_inline)) void stream_shrink_f32(
    const float *restrict x, int64_t xs, const int rows, int64_t d_in, const module_t *m,
    float *restrict h, stream_t *st) {
    const float *A = (const float *)(intptr_t)m->a;
    const int64_t dv = d_in - d_in % VW, rank = m->rank;
    for (int64_t k = 0; k < rank; k++) {
        const float *a = A + k * m->a_stride;
        vf acc[STREAM_ROWS];
        for (int i = 0; i < rows; i++) acc[i] = (vf){0};
        for (int64_t d = 0; d < dv; d += VW) {
            if (d % 16 == 0) stream_step(st);  /* a line: 16 floats */
            const vf b = ld_f32(a + d);
            for (int i = 0; i < rows; i++) acc[i] += ld_f32(x + i * xs + d) * b;
        }
        float r[STREAM_ROWS];
        for (int i = 0; i < rows; i++) r[i] = hsum(acc[i]);
        for (int64_t d = dv; d < d_in; d++)
            for (int i = 0; i < rows; i++) r[i] = FMA(x[i * xs + d], a[d], r[i]);
        for (int i = 0; i < rows; i++) h[i * rank + k] = r[i];
    }
}

/* y[i, start:end] += scale * h_i @ BT for the ROWS rows, the sums in acc (rows x the width),
 * B^T's elements W (float or uint16_t bf16 bits) read through LD / LD1, EL of them a line */
#define DEFINE_STREAM_EXPAND(NAME, W, LD, LD1, EL)                                          \
    static inline __attribute__((always_inline)) void NAME(                                \
        const float *restrict h, const int rows, const module_t *m, float scale, char *y,   \
        int64_t ys, int64_t y_dtype, float *restrict acc, stream_t *st) {                   \
        const W *B = (const W *)(intptr_t)m->b;                                             \
        const int64_t n = m->end - m->start, rank = m->rank;                                \
        for (int64_t c = 0; c < rows * n; c++) acc[c] = 0.0f;                               \
        for (int64_t k = 0; k < rank; k++) {                                                \
            const W *b = B + k * m->b_stride;                                               \
            float p[STREAM_ROWS];                                                           \
            for (int i = 0; i < rows; i++) p[i] = h[i * rank + k];                          \
            int64_t c = 0;                                                                  \
            for (; c + VW <= n; c += VW) {                                                  \
                if (c % (EL) == 0) stream_step(st);                                         \
                const vf b0 = LD(b + c);                                                    \
                for (int i = 0; i < rows; i++)                                              \
                    *(vf *)(acc + i * n + c) = ld_f32(acc + i * n + c) + p[i] * b0;         \
            }                                                                               \
            for (; c < n; c++)                                                              \
                for (int i = 0; i < rows; i++)                                              \
                    acc[i * n + c] = FMA(p[i], LD1(b + c), acc[i * n + c]);                 \
        }                                                                                   \
        const int64_t el = y_dtype == DT_F32 ? 4 : 2;                                       \
        for (int i = 0; i < rows; i++) {                                                    \
            char *yr = y + i * ys * el;                                                     \
            const float *o = acc + i * n;                                                   \
            int64_t c = 0;                                                                  \
            for (; c + VW <= n; c += VW) store_vec(yr, y_dtype, m->start + c, ld_f32(o + c), scale); \
            for (; c < n; c++) store_one(yr, y_dtype, m->start + c, o[c], scale);           \
        }                                                                                   \
    }

DEFINE_STREAM_EXPAND(stream_expand_f32, float, ld_f32, LD1_f32, 16)

#ifdef HAVE_DPBF16
DEFINE_STREAM_EXPAND(stream_expand_bf16, uint16_t, ld_bf16, LD1_bf16, 32)

/* bf16: h[i * rank + k] = x_i . A_k on pair dot products, each sum as shrink_pairs' */
static inline __attribute__((always_inline)) void stream_shrink_bf16(
    const uint16_t *restrict x, int64_t xs, const int rows, int64_t d_in, const module_t *m,
    float *restrict h, stream_t *st) {
    const uint16_t *A = (const uint16_t *)(intptr_t)m->a;
    const int64_t dv = d_in - d_in % 32, rank = m->rank;
    const __mmask32 tail = (__mmask32)((1ull << (d_in - dv)) - 1);
    for (int64_t k = 0; k < rank; k++) {
        const uint16_t *a = A + k * m->a_stride;
        __m512 acc[STREAM_ROWS];
        for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dv; d += 32) {
            stream_step(st);
            const __m512i b = _mm512_loadu_si512(a + d);
            for (int i = 0; i < rows; i++) acc[i] = dp(acc[i], _mm512_loadu_si512(x + i * xs + d), b);
        }
        if (dv < d_in) {
            const __m512i b = _mm512_maskz_loadu_epi16(tail, a + dv);
            for (int i = 0; i < rows; i++)
                acc[i] = dp(acc[i], _mm512_maskz_loadu_epi16(tail, x + i * xs + dv), b);
        }
        for (int i = 0; i < rows; i++) h[i * rank + k] = _mm512_reduce_add_ps(acc[i]);
    }
}
#endif

static inline __attribute__((always_inline)) void stream_rows(
    const char *x, int64_t xs, const int rows, int64_t d_in, const segment_t *sg, float scale,
    char *y, int64_t ys, int64_t io_dtype, float *h, float *acc, stream_t *st) {
    (void)io_dtype;  /* float32 only, without pair dot products */
    for (int64_t j = 0; j < sg->num_modules; j++) {
        const module_t *m = &modules_of(sg)[j];
#ifdef HAVE_DPBF16
        if (io_dtype == DT_BF16) {
            stream_shrink_bf16((const uint16_t *)x, xs, rows, d_in, m, h, st);
            stream_expand_bf16(h, rows, m, scale, y, ys, DT_BF16, acc, st);
            continue;
        }
#endif
        stream_shrink_f32((const float *)x, xs, rows, d_in, m, h, st);
        stream_expand_f32(h, rows, m, scale, y, ys, DT_F32, acc, st);
    }
}

/* one segment (its rows of x and y) in memory order; h: STREAM_ROWS x the widest rank, acc:
 * STREAM_ROWS x the widest module */
static void stream_segment(const void *x, int64_t xs, int64_t d_in, const segment_t *sg,
                           float scale, void *y, int64_t ys, int64_t io_dtype, float *h,
                           float *acc, stream_t *st) {
    const int64_t el = io_dtype == DT_F32 ? 4 : 2;
    const char *xr = (const char *)x + sg->lo * xs * el;
    char *yr = (char *)y + sg->lo * ys * el;
    switch (sg->hi - sg->lo) {  /* 1 to STREAM_ROWS (seg_stream) */
    case 1: stream_rows(xr, xs, 1, d_in, sg, scale, yr, ys, io_dtype, h, acc, st); break;
    case 2: stream_rows(xr, xs, 2, d_in, sg, scale, yr, ys, io_dtype, h, acc, st); break;
    default: stream_rows(xr, xs, 3, d_in, sg, scale, yr, ys, io_dtype, h, acc, st); break;
    }
}

/* segments run in memory order since the library loaded (the tests' witness) */
static int64_t stream_count = 0;

int64_t loraplex_lora_stream_segments(void) { return __atomic_load_n(&stream_count, __ATOMIC_RELAXED); }

int64_t loraplex_lora_abi(void) { return 1; }

/* The checks both entry points make before any write: 0, or 1 a segment's rows outside x, 2 a
 * module's columns outside y, 3 A's row length is not d_in, 4 a block's dtype not taken (any
 * but float32 / bf16; with bf16_only, any but bf16). */
static int64_t check_segments(const segment_t *segs, int64_t num_segments, int64_t num_rows,
                              int64_t d_in, int64_t y_cols, int bf16_only) {
    for (int64_t s = 0; s < num_segments; s++) {
        const segment_t *sg = &segs[s];
        if (sg->lo < 0 || sg->hi > num_rows || sg->lo > sg->hi) return 1;
        for (int64_t j = 0; j < sg->num_modules; j++) {
            const module_t *m = &modules_of(sg)[j];
            if (m->start < 0 || m->end > y_cols || m->start > m->end) return 2;
            if (m->d_in != d_in) return 3;
            if (m->dtype != DT_BF16 && (bf16_only || m->dtype != DT_F32)) return 4;
        }
    }
    return 0;
}

/* Returns 0, or: 1 a segment's rows outside x, 2 a module's columns outside y, 3 A's row
 * length is not d_in, 4 a bad dtype, 5 out of memory. Nothing is written unless it returns 0.
 *
 * x: [num_rows, d_in] rows x_stride elements apart, dtype io_dtype (0 float32, 1 bfloat16);
 * y: [num_rows, y_cols] rows y_stride apart, the same dtype, updated in place;
 * segs: segment_t[num_segments]; scales: float32[num_segments]. */
int64_t loraplex_lora_short(const void *x, int64_t x_stride, void *y, int64_t y_stride,
                            int64_t num_rows, int64_t d_in, int64_t y_cols, int64_t io_dtype,
                            int64_t num_segments, const segment_t *segs, const float *scales,
                            int64_t num_threads) {
    if (io_dtype != DT_F32 && io_dtype != DT_BF16) return 4;
    const int64_t bad = check_segments(segs, num_segments, num_rows, d_in, y_cols, 0);
    if (bad) return bad;
    const int nt = num_threads > 1 ? (int)num_threads : 1;
    /* the sizes of h (every short segment's rows x its modules' total rank) and of the work
     * lists; the long float32 segments' pieces (rows split over the threads in whole tiles)
     * and the widest padded rank among them */
    int64_t h_total = 0, num_shrinks = 0, num_items = 0, f32_blocks = 0;
    int64_t num_long = 0, rp_max = 0;
    /* the segments read in memory order: how many, their blocks, their widest rank and module */
    const int stream = stream_on();
    int64_t num_stream = 0, stream_blocks = 0, stream_rank = 0, stream_width = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const segment_t *sg = &segs[s];
        if (seg_stream(sg, io_dtype, stream)) {
            num_stream++;
            stream_blocks += 2 * sg->num_modules;
            for (int64_t j = 0; j < sg->num_modules; j++) {
                const module_t *m = &modules_of(sg)[j];
                stream_rank = m->rank > stream_rank ? m->rank : stream_rank;
                stream_width = m->end - m->start > stream_width ? m->end - m->start : stream_width;
            }
            continue;
        }
        if (seg_long(sg, io_dtype)) {
            const int64_t tiles = (sg->hi - sg->lo + LT - 1) / LT, rp = seg_rp(sg);
            num_long += tiles < nt ? tiles : nt;
            rp_max = rp > rp_max ? rp : rp_max;
            continue;
        }
        int64_t rank = 0;
        for (int64_t j = 0; j < sg->num_modules; j++) {
            const module_t *m = &modules_of(sg)[j];
            f32_blocks += m->dtype == DT_F32;
            const int64_t tile = tile_of(sg->hi - sg->lo, m->end - m->start);
            rank += m->rank;
            num_items += (m->end - m->start + tile - 1) / tile;
        }
        h_total += (sg->hi - sg->lo) * rank;
        num_shrinks += sg->num_modules;
    }
    /* work items: shrinks per (segment, module), expands per (segment, module, tile), each
     * with its h block (h_at, rows of h_stride = the segment's total rank) */
    typedef struct {
        const segment_t *sg;
        const module_t *m;
        int64_t c0, c1, h_at, h_stride;
        float scale;
    } work_t;
    /* bf16 x is widened once (only the rows a segment uses) for float32 blocks, or for every
     * block where the library has no pair dot products; bf16 blocks with them read x as is */
    int pairs = 0;
#ifdef HAVE_DPBF16
    pairs = io_dtype == DT_BF16;
#endif
    const int widened = io_dtype == DT_BF16 && (!pairs || f32_blocks > 0);
    const int64_t xs = io_dtype == DT_F32 ? x_stride : d_in;
    float *h = malloc((size_t)(h_total + 1) * sizeof(float));
    work_t *work = malloc((size_t)(num_shrinks + num_items + 1) * sizeof(work_t));
    float *xw = widened ? malloc((size_t)(num_rows * d_in + 1) * sizeof(float)) : NULL;
    /* the long pieces (segment, rows) and each thread's At (d_in x rp_max) and h tile
     * (LT x rp_max), 64-byte aligned */
    typedef struct {
        const segment_t *sg;
        int64_t lo, hi;
        float scale;
    } piece_t;
    const int64_t per_thread = (d_in * rp_max + 2 * LT * rp_max + 15) / 16 * 16;
    piece_t *pieces = num_long ? malloc((size_t)num_long * sizeof(piece_t)) : NULL;
    float *scratch = num_long ? malloc((size_t)(nt * per_thread + 16) * sizeof(float)) : NULL;
    /* each thread's ranges of blocks and its h and sums (STREAM_ROWS rows of each), 64-byte
     * aligned */
    const int64_t stream_h = 16 * ((STREAM_ROWS * stream_rank + 15) / 16);
    const int64_t stream_floats = stream_h + 16 * ((STREAM_ROWS * stream_width + 15) / 16);
    void *stream_ranges_buf = NULL;
    float *stream_scratch = NULL;
    if (num_stream) {
        stream_ranges_buf = malloc((size_t)(nt * stream_blocks) * sizeof(range_t));
        stream_scratch = malloc((size_t)(nt * stream_floats + 16) * sizeof(float));
    }
    if (h == NULL || work == NULL || (widened && xw == NULL) ||
        (num_long && (pieces == NULL || scratch == NULL)) ||
        (num_stream && (stream_ranges_buf == NULL || stream_scratch == NULL))) {
        free(h);
        free(work);
        free(xw);
        free(pieces);
        free(scratch);
        free(stream_ranges_buf);
        free(stream_scratch);
        return 5;
    }
    int64_t ns = 0, ni = num_shrinks, h_at = 0, np = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const segment_t *sg = &segs[s];
        const module_t *mods = modules_of(sg);
        if (seg_stream(sg, io_dtype, stream)) continue;
        if (seg_long(sg, io_dtype)) {
            const int64_t tiles = (sg->hi - sg->lo + LT - 1) / LT;
            const int64_t parts = tiles < nt ? tiles : nt, per = (tiles + parts - 1) / parts;
            for (int64_t lo = sg->lo; lo < sg->hi; lo += per * LT)
                pieces[np++] = (piece_t){sg, lo, lo + per * LT < sg->hi ? lo + per * LT : sg->hi,
                                         scales[s]};
            continue;
        }
        if (xw != NULL)  /* x widened once for bf16, only the rows a segment uses */
            for (int64_t i = sg->lo; i < sg->hi; i++)
                widen((const uint16_t *)x + i * x_stride, xw + i * d_in, d_in);
        int64_t rank = 0;
        for (int64_t j = 0; j < sg->num_modules; j++) rank += mods[j].rank;
        for (int64_t j = 0, r0 = 0; j < sg->num_modules; r0 += mods[j].rank, j++) {
            const module_t *m = &mods[j];
            work[ns++] = (work_t){sg, m, 0, 0, h_at + r0, rank, scales[s]};
            const int64_t tile = tile_of(sg->hi - sg->lo, m->end - m->start);
            for (int64_t c0 = m->start; c0 < m->end; c0 += tile)
                work[ni++] = (work_t){sg, m, c0, c0 + tile < m->end ? c0 + tile : m->end,
                                      h_at + r0, rank, scales[s]};
        }
        h_at += (sg->hi - sg->lo) * rank;
    }
    const float *xf = xw != NULL ? xw : (const float *)x;
    const int64_t elem = io_dtype == DT_F32 ? 4 : 2;
    float *const aligned_scratch =
        scratch != NULL ? scratch + (16 - ((uintptr_t)scratch / 4) % 16) % 16 : NULL;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* the segments read in memory order first, dealt round-robin (no barrier after) */
        if (num_stream > 0) {
            int me = 0;
#ifdef _OPENMP
            me = omp_get_thread_num();
#endif
            range_t *r = (range_t *)stream_ranges_buf + me * stream_blocks;
            int64_t n = 0, k = 0;
            for (int64_t s = 0; s < num_segments; s++)
                if (seg_stream(&segs[s], io_dtype, stream) && k++ % nt == me)
                    n = stream_ranges(&segs[s], r, n);
            stream_t st = {r, r + n, NULL, NULL};
            for (int i = 0; i < STREAM_AHEAD; i++) stream_step(&st);
            float *hs = stream_scratch + (16 - ((uintptr_t)stream_scratch / 4) % 16) % 16 +
                        me * stream_floats;
            float *acc = hs + stream_h;
            k = 0;
            for (int64_t s = 0; s < num_segments; s++)
                if (seg_stream(&segs[s], io_dtype, stream) && k++ % nt == me)
                    stream_segment(x, x_stride, d_in, &segs[s], scales[s], y, y_stride,
                                   io_dtype, hs, acc, &st);
        }
        /* the long segments' pieces first (nowait: a thread done with them goes on to the
         * short items), each packing its segment's A unless the thread's last piece was of
         * the same segment */
        if (np > 0) {
            int me = 0;
#ifdef _OPENMP
            me = omp_get_thread_num();
#endif
            float *At = aligned_scratch + me * per_thread, *hb = At + d_in * rp_max;
            const segment_t *packed = NULL;
            /* round-robin, so that each thread knows its next piece (p + nt) and prefetches
             * it; a segment's nt pieces go one to each thread */
#pragma omp for schedule(static, 1) nowait
            for (int64_t p = 0; p < np; p++) {
                const piece_t *pc = &pieces[p];
                const int64_t rp = seg_rp(pc->sg);
                if (pc->sg != packed) pack_at(pc->sg, d_in, At, rp);
                packed = pc->sg;
                pfq_t pq = {0};
                if (p + nt < np) {
                    const piece_t *nx = &pieces[p + nt];
                    pfq_piece(&pq, pc->sg, nx->sg, nx->lo, nx->hi, (const float *)x, x_stride,
                              (float *)y, y_stride, d_in);
                }
                long_rows(pc->sg, pc->lo, pc->hi, (const float *)x, x_stride, (float *)y,
                          y_stride, d_in, pc->scale, At, hb, rp, &pq);
            }
        }
        /* Items go round-robin, so that each thread knows its next one (t + nt) and
         * prefetches it: with dynamic scheduling the next item was the other thread's, and
         * two threads ran a decode step's q/k/v LoRA 1.6x faster than one instead of 2.1x. */
#pragma omp for schedule(static, 1)
        for (int64_t t = 0; t < num_shrinks; t++) {
            const work_t *w = &work[t];
            const int64_t rows = w->sg->hi - w->sg->lo;
            cursor_t cur = {0};  /* this thread's next item: its A, or its first B^T tile */
            const int64_t lines = block_lines(w->m->rank, d_in, w->m->dtype);
            if (t + nt < num_shrinks) {
                const work_t *next = &work[t + nt];
                cursor_init(&cur, next->m->a, next->m->a_stride, next->m->rank, 0, d_in,
                            next->m->dtype, lines);
            } else if (t + nt < num_shrinks + num_items) {
                const work_t *next = &work[t + nt];
                cursor_init(&cur, next->m->b, next->m->b_stride, next->m->rank,
                            next->c0 - next->m->start, next->c1 - next->c0, next->m->dtype,
                            lines);
            }
            /* a long segment's item is compute-bound: the next block at once, no steps in
             * its loops (in them the cursor made a prefill chunk's LoRA 1.2x slower) */
            if (rows > 2) cursor_step(&cur, 1 << 29);
            cursor_t *spread = rows > 2 ? NULL : &cur;
#ifdef HAVE_DPBF16
            if (pairs && w->m->dtype == DT_BF16) {
                shrink_pairs((const uint16_t *)x + w->sg->lo * x_stride, x_stride, rows, d_in,
                             w->m, h + w->h_at, w->h_stride, spread);
                continue;
            }
#endif
            (w->m->dtype == DT_F32 ? (spread ? shrink_f32_spread : shrink_f32)
                                   : (spread ? shrink_bf16_spread : shrink_bf16))(
                xf + w->sg->lo * xs, xs, rows, d_in, w->m, h + w->h_at, w->h_stride, spread);
        }
#pragma omp for schedule(static, 1)
        for (int64_t t = num_shrinks; t < num_shrinks + num_items; t++) {
            const work_t *w = &work[t];
            const int64_t rows = w->sg->hi - w->sg->lo;
            cursor_t cur = {0};  /* this thread's next B^T tile */
            if (t + nt < num_shrinks + num_items) {
                const work_t *next = &work[t + nt];
                cursor_init(&cur, next->m->b, next->m->b_stride, next->m->rank,
                            next->c0 - next->m->start, next->c1 - next->c0, next->m->dtype,
                            block_lines(w->m->rank, w->c1 - w->c0, w->m->dtype));
            }
            if (rows > 2) cursor_step(&cur, 1 << 29);  /* as for the shrinks */
            cursor_t *spread = rows > 2 ? NULL : &cur;
            (w->m->dtype == DT_F32 ? (spread ? expand_f32_spread : expand_f32)
                                   : (spread ? expand_bf16_spread : expand_bf16))(
                h + w->h_at, w->h_stride, rows, w->m, w->c0, w->c1, w->scale,
                (char *)y + w->sg->lo * y_stride * elem, y_stride, io_dtype, spread);
        }
    }
    free(h);
    free(work);
    free(xw);
    free(pieces);
    free(scratch);
    free(stream_ranges_buf);
    free(stream_scratch);
    if (num_stream) __atomic_fetch_add(&stream_count, num_stream, __ATOMIC_RELAXED);
    return 0;
}

/* ---- Long bf16 segments (prefill) on AVX512-BF16's pair dot products (vdpbf16ps) ----------
 *
 * Semantics, for each segment s and module m (the oneDNN path's, cpu.lora_segments):
 *     h = bf16(x[lo:hi] @ A_m^T)                      float32 accumulate, rounded to bf16
 *     y[lo:hi, start_m:end_m] = bf16(y + scale_s * (h @ BT_m))   float32 accumulate, one rounding
 * x, y, A and BT all bf16. vdpbf16ps multiplies pairs of bf16 exactly and adds them into float32
 * lanes (bf16 denormal inputs count as zero, as in oneDNN's bf16 kernels without AMX); y's
 * rounding is vcvtneps2bf16's (to nearest even, NaN kept quiet, as to_bf16; a float32 sum
 * under 2^-126 in magnitude, which to_bf16 would round to a bf16 denormal, becomes zero).
 *
 * Why: without AMX, a prefill segment's two rank-8-16 bf16 GEMMs on oneDNN are dominated by
 * their fixed cost, and the float32 kernel above widens every element first. The shrink reads
 * x and A as bf16 pairs (4 rows x 4 ranks of 32-lane sums); the expand interleaves B^T's rank
 * pairs once per column tile and row block (two permutes per 32 columns) so that each output
 * vector is one vdpbf16ps per two ranks, h's pair broadcast. */
#ifdef HAVE_DPBF16
enum { ROW_BLOCK = 128 };  /* rows of a work item: shrinks and expands split long segments */

/* h[i * hs + k] = bf16(x_i . A_k) for k < rank; h's pad column (odd rank) set to 0 */
static void shrink_dp(const uint16_t *x, int64_t xs, int64_t rows, int64_t d_in,
                      const module_t *m, uint16_t *h, int64_t hs) {
    const uint16_t *A = (const uint16_t *)(intptr_t)m->a;
    const int64_t as = m->a_stride, rank = m->rank, dv = d_in - d_in % 32;
    const __mmask32 tail = (__mmask32)((1ull << (d_in - dv)) - 1);
    for (int64_t i = 0; i < rows; i += 4) {
        const uint16_t *xr[4];
        for (int j = 0; j < 4; j++) xr[j] = x + (i + j < rows ? i + j : i) * xs;
        for (int64_t k = 0; k < rank; k += 4) {
            const uint16_t *ar[4];
            for (int a = 0; a < 4; a++) ar[a] = A + (k + a < rank ? k + a : k) * as;
            __m512 acc[4][4];
            for (int j = 0; j < 4; j++)
                for (int a = 0; a < 4; a++) acc[j][a] = _mm512_setzero_ps();
            for (int64_t d = 0; d < dv; d += 32) {
                __m512i xv[4], av[4];
                for (int j = 0; j < 4; j++) xv[j] = _mm512_loadu_si512(xr[j] + d);
                for (int a = 0; a < 4; a++) av[a] = _mm512_loadu_si512(ar[a] + d);
                for (int j = 0; j < 4; j++)
                    for (int a = 0; a < 4; a++) acc[j][a] = dp(acc[j][a], xv[j], av[a]);
            }
            if (dv < d_in) {
                __m512i xv[4], av[4];
                for (int j = 0; j < 4; j++) xv[j] = _mm512_maskz_loadu_epi16(tail, xr[j] + dv);
                for (int a = 0; a < 4; a++) av[a] = _mm512_maskz_loadu_epi16(tail, ar[a] + dv);
                for (int j = 0; j < 4; j++)
                    for (int a = 0; a < 4; a++) acc[j][a] = dp(acc[j][a], xv[j], av[a]);
            }
            for (int j = 0; j < 4 && i + j < rows; j++)
                for (int a = 0; a < 4 && k + a < rank; a++)
                    h[(i + j) * hs + k + a] = f2bf(_mm512_reduce_add_ps(acc[j][a]));
        }
        for (int j = 0; j < 4 && i + j < rows; j++)
            if (rank % 2) h[(i + j) * hs + rank] = 0;
    }
}

/* pack[kp * n64 + c] = BT[2 kp][c0 + c] | BT[2 kp + 1][c0 + c] << 16 for c < n (zeros past n and
 * past the last rank): the rank pairs vdpbf16ps takes, columns padded to 64 */
static void pack_pairs(const module_t *m, int64_t c0, int64_t n, int64_t n64, uint32_t *pack) {
    const uint16_t *B = (const uint16_t *)(intptr_t)m->b;
    const int64_t bs = m->b_stride, rank = m->rank, off = c0 - m->start;
    const __m512i lo_idx = pair_lo(), hi_idx = pair_hi();
    for (int64_t kp = 0; 2 * kp < rank; kp++) {
        const uint16_t *b0 = B + 2 * kp * bs + off;
        const uint16_t *b1 = 2 * kp + 1 < rank ? b0 + bs : NULL;
        uint32_t *out = pack + kp * n64;
        for (int64_t c = 0; c < n64; c += 32) {
            const int64_t left = n - c;
            const __mmask32 mk = left >= 32 ? ~(__mmask32)0
                                 : left <= 0 ? 0 : (__mmask32)((1ull << left) - 1);
            const __m512i r0 = _mm512_maskz_loadu_epi16(mk, b0 + c);
            const __m512i r1 = b1 != NULL ? _mm512_maskz_loadu_epi16(mk, b1 + c)
                                          : _mm512_setzero_si512();
            _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(r0, lo_idx, r1));
            _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(r0, hi_idx, r1));
        }
    }
}

/* y[0 .. min(left, 16) - 1] = bf16(y + scale * acc), bf16 y widened exactly; vcvtneps2bf16 is
 * to_bf16's rounding in one instruction (1.12-1.15x on a prefill chunk's LoRA, Zen 4), sums
 * under 2^-126 flushed to zero */
static inline void y_add16(uint16_t *y, int64_t left, __m512 scale, __m512 acc) {
    const __mmask16 mk = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    const __m256i old = _mm256_maskz_loadu_epi16(mk, y);
    const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16));
    _mm256_mask_storeu_epi16(y, mk, (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(scale, acc, wide)));
}

/* y[i, c0 + c] = bf16(y + scale * sum_k h[i, k] BT[k, c0 + c]) for c < n: 4 rows x 64 columns
 * of float32 sums, one vdpbf16ps per rank pair and 16 columns */
static void expand_dp(const uint16_t *h, int64_t hs, int64_t rows, int64_t rank_pairs,
                      const uint32_t *pack, int64_t n, int64_t n64, float scale, uint16_t *y,
                      int64_t ys) {
    for (int64_t i = 0; i < rows; i += 4) {
        const uint16_t *hr[4];
        for (int j = 0; j < 4; j++) hr[j] = h + (i + j < rows ? i + j : i) * hs;
        for (int64_t c = 0; c < n64; c += 64) {
            __m512 acc[4][4];
            for (int j = 0; j < 4; j++)
                for (int v = 0; v < 4; v++) acc[j][v] = _mm512_setzero_ps();
            for (int64_t kp = 0; kp < rank_pairs; kp++) {
                const uint32_t *p = pack + kp * n64 + c;
                __m512i pv[4];
                for (int v = 0; v < 4; v++) pv[v] = _mm512_loadu_si512(p + 16 * v);
                for (int j = 0; j < 4; j++) {
                    const __m512i hb = _mm512_set1_epi32((int)load_pair(hr[j] + 2 * kp));
                    for (int v = 0; v < 4; v++) acc[j][v] = dp(acc[j][v], hb, pv[v]);
                }
            }
            for (int j = 0; j < 4 && i + j < rows; j++) {
                uint16_t *yr = y + (i + j) * ys;
                if (i + j + 4 < rows)  /* the row four on: out of L2 after the base GEMM */
                    for (int64_t q = 0; q < 128 && c + q / 2 < n; q += 64)
                        __builtin_prefetch((const char *)(yr + 4 * ys + c) + q, 1, 3);
                for (int v = 0; v < 4 && c + 16 * v < n; v++)
                    y_add16(yr + c + 16 * v, n - c - 16 * v, _mm512_set1_ps(scale), acc[j][v]);
            }
        }
    }
}

/* ---- The same on AMX tiles (CPUs with AMX-BF16: Sapphire Rapids and later) ---------------
 *
 * Same semantics; the products are TDPBF16PS's (exact bf16 products summed into float32, in
 * another order than vdpbf16ps's lanes; bf16 denormals read as zero and float32 denormal sums
 * flushed, as there). On AMX vdpbf16ps runs at a sixteenth of the tile unit's rate: a prefill
 * chunk's LoRA on tiles is several times faster than on pair dot products (and those than
 * oneDNN's bf16 GEMMs on tiles, whose fixed cost per rank-8-16 product dominates).
 *
 * Shrink, 16 rows at a time: an A tile is 16 rows of x, 32 depths (loaded in place, stride
 * x's), a B tile 16 depth pairs x 16 ranks of A (A's rows as 32-bit pairs, transposed 16 x 16
 * in registers once per work item into a per-thread buffer), up to four C tiles (rank <= 64).
 * h's rows are padded to a multiple of 32 ranks with zeros (the expand's depth).
 * Expand, 16 rows by 64 columns at a time: A tiles are h's rows (one per 32 ranks), B tiles
 * pack_pairs' rank pairs (padded to h's depth with zero pairs), four C tiles, then y's
 * read-modify-write as expand_dp's (one rounding, vcvtneps2bf16).
 * A module whose depth is not a multiple of 32 or whose rank is over 64 runs expand_dp /
 * shrink_dp in the same call. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && \
    defined(__x86_64__) && VW == 16
#define LORA_AMX 1
#include "amx_tiles.h"

enum { AMX_MAX_RANK = 64 };

/* 1: the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the tile data */
int64_t loraplex_lora_amx_init(void) { return amx_request(); }

static inline int amx_module(const module_t *m, int64_t d_in) {
    return d_in % 32 == 0 && m->rank <= AMX_MAX_RANK;
}

/* A's B tiles: bt[(kb * nr + t) * 256 + kp * 16 + n] = A[16 t + n][32 kb + 2 kp .. + 1] as a
 * pair (zero for ranks past the module's) */
static void pack_a_tiles(const module_t *m, int64_t d_in, uint32_t *bt) {
    const int64_t rank = m->rank, nr = (rank + 15) / 16, kbs = d_in / 32;
    for (int64_t t = 0; t < nr; t++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            __m512i r[16];
            for (int64_t n = 0; n < 16; n++)
                r[n] = 16 * t + n < rank
                    ? _mm512_loadu_si512((const uint16_t *)(intptr_t)m->a
                                         + (16 * t + n) * m->a_stride + 32 * kb)
                    : _mm512_setzero_si512();
            transpose16(r);
            uint32_t *out = bt + (kb * nr + t) * 256;
            for (int kp = 0; kp < 16; kp++) _mm512_storeu_si512(out + 16 * kp, r[kp]);
        }
}

#define AMX_SHRINK_DP(T) \
    _tile_loadd(5, bt + (kb * nr + T) * 256, 64); \
    _tile_dpbf16ps(T, 4, 5);

/* h[i * hs + k] = bf16(x_i . A_k), k < rank; h's columns rank..hs zero. xpad: 16 x d_in. */
static void shrink_amx(const uint16_t *x, int64_t xs, int64_t rows, int64_t d_in,
                       const module_t *m, uint16_t *h, int64_t hs, const uint32_t *bt,
                       uint16_t *xpad) {
    const int64_t rank = m->rank, nr = (rank + 15) / 16, kbs = d_in / 32;
    float c[4][256];
    for (int64_t i = 0; i < rows; i += 16) {
        const int64_t valid = rows - i < 16 ? rows - i : 16;
        const uint16_t *xa = x + i * xs;
        int64_t stride = xs;
        if (valid < 16) {  /* the last rows: a zero-padded copy (never past x's end) */
            memset(xpad, 0, (size_t)(16 * d_in) * sizeof(uint16_t));
            for (int64_t r = 0; r < valid; r++)
                memcpy(xpad + r * d_in, xa + r * xs, (size_t)d_in * sizeof(uint16_t));
            xa = xpad;
            stride = d_in;
        }
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kb = 0; kb < kbs; kb++) {
            _tile_loadd(4, xa + 32 * kb, stride * 2);
            AMX_SHRINK_DP(0)
            if (nr > 1) { AMX_SHRINK_DP(1) }
            if (nr > 2) { AMX_SHRINK_DP(2) }
            if (nr > 3) { AMX_SHRINK_DP(3) }
        }
        _tile_stored(0, c[0], 64);
        if (nr > 1) _tile_stored(1, c[1], 64);
        if (nr > 2) _tile_stored(2, c[2], 64);
        if (nr > 3) _tile_stored(3, c[3], 64);
        for (int64_t r = 0; r < valid; r++) {
            uint16_t *hr = h + (i + r) * hs;
            for (int64_t k = 0; k < rank; k++) hr[k] = f2bf(c[k / 16][r * 16 + k % 16]);
            for (int64_t k = rank; k < hs; k++) hr[k] = 0;
        }
    }
}

/* y[i, c0 + c] = bf16(y + scale * sum_k h[i, k] BT[k, c0 + c]) for c < n, on tiles: h's rows
 * hs (32 or 64) ranks wide, zero past the rank; pack as pack_pairs' with hs / 2 rank pairs.
 * hpad: 16 x hs. */
static void expand_amx(const uint16_t *h, int64_t hs, int64_t rows, const uint32_t *pack,
                       int64_t n, int64_t n64, float scale, uint16_t *y, int64_t ys,
                       uint16_t *hpad) {
    const int64_t depth_tiles = hs / 32;
    float c[4][256];
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < rows; i += 16) {
        const int64_t valid = rows - i < 16 ? rows - i : 16;
        const uint16_t *ha = h + i * hs;
        if (valid < 16) {
            memset(hpad, 0, (size_t)(16 * hs) * sizeof(uint16_t));
            memcpy(hpad, ha, (size_t)(valid * hs) * sizeof(uint16_t));
            ha = hpad;
        }
        _tile_loadd(4, ha, hs * 2);
        if (depth_tiles > 1) _tile_loadd(6, ha + 32, hs * 2);
        for (int64_t c0 = 0; c0 < n64; c0 += 64) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
#define AMX_EXPAND_DP(T)                                                    \
            _tile_loadd(5, pack + c0 + 16 * T, n64 * 4);                    \
            _tile_dpbf16ps(T, 4, 5);                                        \
            if (depth_tiles > 1) {                                          \
                _tile_loadd(7, pack + 16 * n64 + c0 + 16 * T, n64 * 4);     \
                _tile_dpbf16ps(T, 6, 7);                                    \
            }
            AMX_EXPAND_DP(0) AMX_EXPAND_DP(1) AMX_EXPAND_DP(2) AMX_EXPAND_DP(3)
#undef AMX_EXPAND_DP
            _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
            for (int64_t r = 0; r < valid; r++) {
                uint16_t *yr = y + (i + r) * ys;
                for (int v = 0; v < 4 && c0 + 16 * v < n; v++)
                    y_add16(yr + c0 + 16 * v, n - c0 - 16 * v, sv, _mm512_loadu_ps(c[v] + 16 * r));
            }
        }
    }
}
#else
int64_t loraplex_lora_amx_init(void) { return 0; }
#endif

int64_t loraplex_lora_has_dpbf16(void) { return 1; }

/* Returns 0, or as loraplex_lora_short (4 also when a block is not bf16; 6: tiles asked for in
 * a build or process without AMX). x and y bf16. tiles: 1 runs the modules it can on AMX tiles
 * (after loraplex_lora_amx_init said 1), 0 every module on pair dot products. */
int64_t loraplex_lora_long_bf16(const void *x, int64_t x_stride, void *y, int64_t y_stride,
                                int64_t num_rows, int64_t d_in, int64_t y_cols, int64_t tiles,
                                int64_t num_segments, const segment_t *segs,
                                const float *scales, int64_t num_threads) {
    const int64_t bad = check_segments(segs, num_segments, num_rows, d_in, y_cols, 1);
    if (bad) return bad;
#ifndef LORA_AMX
    if (tiles) return 6;
#endif
    /* h's size (each module its own block of rows x its row length) and the work lists */
    int64_t h_total = 0, num_shrinks = 0, num_items = 0, max_pairs = 0, max_bt = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const segment_t *sg = &segs[s];
        const int64_t rows = sg->hi - sg->lo, blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
        for (int64_t j = 0; j < sg->num_modules; j++) {
            const module_t *m = &modules_of(sg)[j];
            int64_t pairs = (m->rank + 1) / 2;
#ifdef LORA_AMX
            if (tiles && amx_module(m, d_in)) {
                pairs = (m->rank + 31) / 32 * 16;
                const int64_t bt = (d_in / 32) * ((m->rank + 15) / 16) * 256;
                max_bt = bt > max_bt ? bt : max_bt;
            }
#endif
            max_pairs = pairs > max_pairs ? pairs : max_pairs;
            h_total += rows * 2 * pairs;
            num_shrinks += blocks;
            num_items += blocks * ((m->end - m->start + TILE - 1) / TILE);
        }
    }
    typedef struct {
        const segment_t *sg;
        const module_t *m;
        int64_t r0, r1, c0, c1, h_at, hs, tiled;
        float scale;
    } work_t;
    const int nt = num_threads > 1 ? (int)num_threads : 1;
    /* per thread: the expand's rank pairs; with tiles also A's B tiles and a padded 16-row
     * block of x (shrink) or h (expand) */
    const int64_t per_thread = max_pairs * TILE + (max_bt ? max_bt + 8 * d_in + 8 * 64 : 0) + 16;
    uint16_t *h = malloc((size_t)(h_total + 1) * sizeof(uint16_t));
    work_t *work = malloc((size_t)(num_shrinks + num_items + 1) * sizeof(work_t));
    uint32_t *packs = aligned_alloc(64, (size_t)((nt * per_thread + 15) / 16 * 64));
    if (h == NULL || work == NULL || packs == NULL) {
        free(h);
        free(work);
        free(packs);
        return 5;
    }
    int64_t ns = 0, ni = num_shrinks, h_at = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const segment_t *sg = &segs[s];
        const int64_t rows = sg->hi - sg->lo;
        for (int64_t j = 0; j < sg->num_modules; j++) {
            const module_t *m = &modules_of(sg)[j];
            int64_t tiled = 0, hs = 2 * ((m->rank + 1) / 2);
#ifdef LORA_AMX
            if (tiles && amx_module(m, d_in)) {
                tiled = 1;
                hs = (m->rank + 31) / 32 * 32;
            }
#endif
            for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
                const int64_t r1 = r0 + ROW_BLOCK < rows ? r0 + ROW_BLOCK : rows;
                work[ns++] = (work_t){sg, m, r0, r1, 0, 0, h_at, hs, tiled, scales[s]};
                for (int64_t c0 = m->start; c0 < m->end; c0 += TILE)
                    work[ni++] = (work_t){sg, m, r0, r1, c0,
                                          c0 + TILE < m->end ? c0 + TILE : m->end, h_at, hs,
                                          tiled, scales[s]};
            }
            h_at += rows * hs;
        }
    }
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        uint32_t *pack = packs + (int64_t)me * per_thread;
#ifdef LORA_AMX
        uint32_t *bt = pack + max_pairs * TILE;
        uint16_t *pad = (uint16_t *)(bt + max_bt);
        if (tiles) amx_config();
#endif
#pragma omp for schedule(static, 1)
        for (int64_t t = 0; t < num_shrinks; t++) {
            const work_t *w = &work[t];
            const uint16_t *xs = (const uint16_t *)x + (w->sg->lo + w->r0) * x_stride;
            uint16_t *hb = h + w->h_at + w->r0 * w->hs;
#ifdef LORA_AMX
            if (w->tiled) {
                pack_a_tiles(w->m, d_in, bt);
                shrink_amx(xs, x_stride, w->r1 - w->r0, d_in, w->m, hb, w->hs, bt, pad);
                continue;
            }
#endif
            shrink_dp(xs, x_stride, w->r1 - w->r0, d_in, w->m, hb, w->hs);
        }
#pragma omp for schedule(static, 1)
        for (int64_t t = num_shrinks; t < num_shrinks + num_items; t++) {
            const work_t *w = &work[t];
            const int64_t n = w->c1 - w->c0, n64 = (n + 63) / 64 * 64;
            const uint16_t *hb = h + w->h_at + w->r0 * w->hs;
            uint16_t *yb = (uint16_t *)y + (w->sg->lo + w->r0) * y_stride + w->c0;
            pack_pairs(w->m, w->c0, n, n64, pack);
#ifdef LORA_AMX
            if (w->tiled) {  /* rank pairs up to h's depth: zero */
                const int64_t have = (w->m->rank + 1) / 2;
                memset(pack + have * n64, 0, (size_t)((w->hs / 2 - have) * n64) * 4);
                expand_amx(hb, w->hs, w->r1 - w->r0, pack, n, n64, w->scale, yb, y_stride,
                           pad);
                continue;
            }
#endif
            expand_dp(hb, w->hs, w->r1 - w->r0, w->hs / 2, pack, n, n64, w->scale, yb,
                      y_stride);
        }
    }
    free(h);
    free(work);
    free(packs);
    return 0;
}
#endif
