/* Paged prefill attention for the CPU backend: every sequence of a step with more than one
 * query row (a prompt chunk, or a decode row with its speculative drafts), causal, K and V
 * read from the pool through the page table, float32 arithmetic (bf16 with AVX512-BF16 at head
 * sizes 64 and 128: both products on bf16 pairs, the probabilities rounded to bf16 in between,
 * as torch's SDPA does; the section on pair dot products below).
 *
 * Semantics, for prefill sequence i (query rows q_starts[i] .. q_starts[i] + n - 1 with
 * n = q_lens[i], table row t = table_rows[i], KV length L = seq_lens[i] once this step's K/V
 * are written, so query a (0 <= a < n) sits at position L - n + a) and query head j of KV
 * head h = j / G (G = num_heads / num_kv_heads):
 *     s[p]            = scale * dot(q[q_starts[i] + a, j], K[t, p, h])   for p <= L - n + a
 *     out[.. + a, j]  = sum_p softmax(s)[p] * V[t, p, h]
 * with K[t, p, h] = pool[page, 0, p % P, h] and page = page_table[t, p / P] (V at index 1):
 * the pool seen as [num_pages, 2, P, Hkv, D] (loraplex/kernels/reference.py kv_view). Positions past a
 * query's own are never read into its sum, and positions at or past L are never read at all
 * (a stale slot may hold NaN or inf).
 *
 * Tensors: q [T, Hq, D] and out [T, Hq, D] with token strides q_stride / out_stride elements
 * (heads and D contiguous); pool [num_pages, 2, P, Hkv, D] one layer; page_table [S,
 * table_stride] int32; q_starts, q_lens, table_rows, seq_lens [num_seqs] int64. Elements are
 * float32 or bfloat16, one dtype for q, pool and out. D must be a multiple of 16.
 *
 * A task is a sequence, one KV head and a block of up to 256 queries (QBLOCKS). It gathers the keys
 * the block can see, transposed ([D, L'] with L' rounded up to KTILE, zero past the end), into a
 * per-thread float32 buffer once, and a pointer to each key's value row (float32 values read in
 * place from the pool, bf16 ones widened into a buffer); then the G * qblock query rows go RB at
 * a time through two register-blocked products: scores = Q K^T as RB x KTILE tiles (each key
 * column loaded once for RB rows; float32 query rows read in place), an exact softmax per row
 * over the keys it may see (the block's later keys masked to -inf as the scores are stored, so
 * exp gives 0), and out = P V as PB x D tiles (each value row loaded once for PB rows; float32
 * outputs written in place). On a Zen 4 core (AVX-512, SmolLM2's 9/3 heads, 16 prompts of
 * 64-128 tokens) the masking in the score pass, the in-place rows and the value row held in a
 * register made the float32 kernel 1.25x faster, the same bits (docs/benchmarks.md). The causal upper triangle is skipped a tile of
 * KTILE keys at a time. Tiles are in the machine's vectors (attention.h's VW): with AVX-512
 * RB = 8 score rows (P V four rows at a time, PB) and KTILE = 32, with AVX2 RB = PB = 2 and
 * KTILE = 16. Against torch's fused SDPA on one
 * sequence at a time (the torch path, cpu._prefill_one): see docs/benchmarks.md.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "bf16_pairs.h"

/* Queries per task: the most of these that still leaves every thread at least TASKS_PER_THREAD
 * tasks (the last one, 64, in any case). A task gathers every key its last query sees, so a
 * sequence split into blocks gathers its first keys once a block: on a Zen 4 core one block of
 * up to 256 queries per KV head made SmolLM2's prompts of 64-128 tokens 1.03-1.1x faster than
 * blocks of 64 (docs/benchmarks.md, "Zen 4, fifth visit"). */
static const int64_t QBLOCKS[] = {256, 128, 64};
#define TASKS_PER_THREAD 4
#define KTILE (2 * VW) /* keys per score tile: two vectors (32 with AVX-512, 16 with AVX2) */
/* query rows per register-blocked tile: RB rows keep 2 * RB score accumulators live, and the
 * P V product PB rows' PB * D / VW, which at D = 64 fit AVX-512's 32 registers at RB 8, PB 4
 * and (nearly) AVX2's 16 at 2, 2. Measured on a Zen 3 core, RB 4 with AVX2 was no faster; on
 * a Zen 4 core (AVX-512), RB 8 against 4 (PB 4 both) made the kernel 1.2-1.3x faster in
 * float32 and 1.2-1.4x in bf16 at 9/3 and 16/16 heads (each K^T load serves 8 rows). */
#if VW == 16
#define RB 8
#define PB 4
#else
#define PB 2
#define RB 2
#endif

typedef struct {
    const void *q, *pool;
    const int32_t *page_table;
    const int64_t *q_starts, *q_lens, *table_rows, *seq_lens;
    const int64_t *task_seq, *task_q0; /* each task's sequence and first query */
    void *out;
    int64_t q_stride, table_stride, out_stride, max_keys;
    int Hkv, G, D, P;
    float scale;
    int64_t qblock; /* queries per task (one of QBLOCKS) */
} Call;

#if VW == 16
#include "transpose16.h"
#endif

/* Keys 0 .. nk - 1 of KV head h into kt ([D, ldk], transposed, zero from nk to ldk), and each
 * key's value row into vrows[p]: float32 values are read in place from the pool (a pointer per
 * key, no copy: 1.03-1.1x of the whole kernel at SmolLM2's shapes on a Zen 4 core), bf16 ones
 * widened into v ([nk, D]) first. Float32 keys with AVX-512 go 16 keys x 16 elements at a time
 * through transpose16 (1.09x of the whole kernel, against a scalar store per element; the
 * same values). */
INLINE void gather(const Call *c, const int32_t *pages, int64_t nk, int64_t ldk, int h, int bf16,
                   const int D, float *restrict kt, float *restrict v,
                   const float **restrict vrows) {
    const int64_t esize = bf16 ? 2 : 4;
    const int64_t row = (int64_t)c->Hkv * D; /* elements of one token's K (or V) */
    int64_t done = 0; /* keys written to kt (the 16-key groups' zero keys past nk included) */
#if VW == 16
    if (!bf16) {
        for (int64_t p0 = 0; p0 < nk; p0 += 16) {
            const float *k[16];
            for (int e = 0; e < 16; e++) {
                const int64_t p = p0 + e;
                k[e] = NULL; /* past the end: zero keys */
                if (p < nk) {
                    const int64_t page = pages[p / c->P], slot = p % c->P;
                    k[e] = (const float *)c->pool + (page * 2 * c->P + slot) * row
                           + (int64_t)h * D;
                    vrows[p] = k[e] + (int64_t)c->P * row;
                }
            }
            for (int d0 = 0; d0 < D; d0 += 16) {
                __m512i r[16];
                for (int e = 0; e < 16; e++)
                    r[e] = k[e] != NULL ? _mm512_loadu_si512(k[e] + d0) : _mm512_setzero_si512();
                transpose16(r);
                for (int j = 0; j < 16; j++)
                    _mm512_storeu_si512(kt + (int64_t)(d0 + j) * ldk + p0, r[j]);
            }
        }
        done = (nk + 15) / 16 * 16;
    }
#endif
    for (int64_t p = done; p < nk; p++) {
        const int64_t page = pages[p / c->P], slot = p % c->P;
        const char *k = (const char *)c->pool
                        + ((page * 2 * c->P + slot) * row + (int64_t)h * D) * esize;
        const char *vv = k + (int64_t)c->P * row * esize;
        if (bf16) {
            /* two loops: the value row's widening vectorises on its own (1.1x at 9/3 heads) */
            float *vrow = v + p * D;
            for (int d = 0; d < D; d++)
                kt[(int64_t)d * ldk + p] = bf16_to_f32(((const uint16_t *)k)[d]);
            for (int d = 0; d < D; d++) vrow[d] = bf16_to_f32(((const uint16_t *)vv)[d]);
            vrows[p] = vrow;
        } else {
            for (int d = 0; d < D; d++) kt[(int64_t)d * ldk + p] = ((const float *)k)[d];
            vrows[p] = (const float *)vv;
        }
    }
    for (int d = 0; d < D; d++)
        for (int64_t p = done > nk ? done : nk; p < ldk; p++) kt[(int64_t)d * ldk + p] = 0.0f;
}

/* NR (1 or RB) query rows q[r] (D floats each) with key limits lim[r] (row r sees keys <
 * lim[r]; the largest is lim[NR - 1]): their attention outputs into o[r] (D floats), float32.
 * Value rows vrows[p]. s: NR * ldk. */
INLINE void rows_attend(const float *const *q, const int64_t *lim, const int NR, const int D,
                        const float *restrict kt, int64_t ldk, const float *const *vrows,
                        float scale, float *restrict s, float *const *o) {
    const int64_t top = lim[NR - 1], tiles = (top + KTILE - 1) / KTILE;
    vwi iota;
    for (int e = 0; e < VW; e++) iota[e] = e;
    const vwf ninf = (vwf){0} - INFINITY;
    vwf vm[RB];
    for (int r = 0; r < NR; r++) vm[r] = ninf;
    /* scores, NR x KTILE at a time: each key column is loaded once for the NR rows; each row's
     * keys past its own masked to -inf (so exp gives 0) and its maximum taken as they are
     * stored. The last tile computes only its first vector where the keys end in it. */
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t lo = t * KTILE;
        vwf acc[RB][2];
        for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = (vwf){0};
        const float *col = kt + lo;
        if (top - lo > VW) {
            for (int d = 0; d < D; d++) {
                const vwf k0 = loadw(col + (int64_t)d * ldk);
                const vwf k1 = loadw(col + (int64_t)d * ldk + VW);
                for (int r = 0; r < NR; r++) {
                    const float qd = q[r][d];
                    acc[r][0] += qd * k0;
                    acc[r][1] += qd * k1;
                }
            }
        } else {
            for (int d = 0; d < D; d++) {
                const vwf k0 = loadw(col + (int64_t)d * ldk);
                for (int r = 0; r < NR; r++) acc[r][0] += q[r][d] * k0;
            }
        }
        for (int r = 0; r < NR; r++)
            for (int e = 0; e < 2; e++) {
                /* lanes whose key lo + e VW + lane is under the row's limit */
                const vwi live = iota < (vwi){0} + (int32_t)(lim[r] - lo - e * VW);
                const vwf x = (vwf)(((vwi)(acc[r][e] * scale) & live) | ((vwi)ninf & ~live));
                storew(s + r * ldk + lo + e * VW, x);
                vm[r] = (vwf)(((vwi)x & (x > vm[r])) | ((vwi)vm[r] & ~(x > vm[r])));
            }
    }
    /* exact softmax per row over its own keys (the rest are -inf) */
    float inv[RB];
    for (int r = 0; r < NR; r++) {
        float *sr = s + r * ldk;
        float m = -INFINITY;
        for (int e = 0; e < VW; e++) m = vm[r][e] > m ? vm[r][e] : m;
        vwf vs = {0};
        for (int64_t p = 0; p < tiles * KTILE; p += VW) {
            const vwf x = expw(loadw(sr + p) - m);
            storew(sr + p, x);
            vs += x;
        }
        inv[r] = 1.0f / hsumw(vs);
    }
    /* out = P V, PB x D at a time: each value row is loaded once (into a register: gcc
     * otherwise folded it into every row's FMA as a memory operand) for PB rows */
    const int NP = NR < PB ? NR : PB;
    for (int r0 = 0; r0 < NR; r0 += NP) {
        vwf acc[PB][D / VW];
        const int64_t ptop = lim[r0 + NP - 1];
        for (int r = 0; r < NP; r++)
            for (int e = 0; e < D / VW; e++) acc[r][e] = (vwf){0};
        for (int64_t p = 0; p < ptop; p++) {
            const float *vr = vrows[p];
            for (int e = 0; e < D / VW; e++) {
                vwf ve = loadw(vr + VW * e);
#if defined(__x86_64__) || defined(__i386__)
                __asm__("" : "+v"(ve));
#endif
                for (int r = 0; r < NP; r++) acc[r][e] += s[(r0 + r) * ldk + p] * ve;
            }
        }
        for (int r = 0; r < NP; r++)
            for (int e = 0; e < D / VW; e++)
                storew(o[r0 + r] + VW * e, acc[r][e] * inv[r0 + r]);
    }
}

/* Task `task`: KV head task % Hkv of its sequence, queries task_q0 .. + qblock. buf holds
 * D * ldk + ldk * D + RB * ldk + 2 * RB * D floats for ldk = max_keys rounded up to KTILE,
 * then ldk value row pointers. Float32 query rows are read, and output rows written, in place;
 * bf16 ones go through qf and o (widened, rounded). */
INLINE void task_body(const Call *c, int64_t task, float *buf, int bf16, const int D) {
    const int h = (int)(task % c->Hkv);
    const int64_t block = task / c->Hkv, i = c->task_seq[block], a0 = c->task_q0[block];
    const int64_t n = c->q_lens[i], L = c->seq_lens[i];
    const int64_t na = n - a0 < c->qblock ? n - a0 : c->qblock;
    const int64_t nk = L - n + a0 + na; /* keys the block's last query sees */
    const int64_t ldk = (nk + KTILE - 1) / KTILE * KTILE;
    const int64_t ldmax = (c->max_keys + KTILE - 1) / KTILE * KTILE;
    float *kt = buf, *v = kt + (int64_t)D * ldmax, *s = v + ldmax * D, *qf = s + RB * ldmax;
    float *o = qf + RB * D;
    const float **vrows = (const float **)(void *)(o + RB * D);
    gather(c, c->page_table + c->table_rows[i] * c->table_stride, nk, ldk, h, bf16, D, kt, v,
           vrows);
    const int64_t esize = bf16 ? 2 : 4;
    for (int g = 0; g < c->G; g++) {
        const int64_t head = (int64_t)(h * c->G + g) * D;
        for (int64_t a = 0; a < na;) {
            const int nr = na - a >= RB ? RB : 1;
            int64_t lim[RB];
            const float *qr[RB];
            float *outr[RB];
            for (int r = 0; r < nr; r++) {
                const int64_t row = c->q_starts[i] + a0 + a + r;
                const char *qb = (const char *)c->q + (row * c->q_stride + head) * esize;
                if (bf16) {
                    for (int d = 0; d < D; d++)
                        qf[r * D + d] = bf16_to_f32(((const uint16_t *)qb)[d]);
                    qr[r] = qf + r * D;
                    outr[r] = o + r * D;
                } else {
                    qr[r] = (const float *)qb;
                    outr[r] = (float *)c->out + row * c->out_stride + head;
                }
                lim[r] = L - n + a0 + a + r + 1;
            }
            if (nr == RB) {
                rows_attend(qr, lim, RB, D, kt, ldk, vrows, c->scale, s, outr);
            } else {
                rows_attend(qr, lim, 1, D, kt, ldk, vrows, c->scale, s, outr);
            }
            if (bf16)
                for (int r = 0; r < nr; r++) {
                    const int64_t row = c->q_starts[i] + a0 + a + r;
                    uint16_t *orow = (uint16_t *)c->out + row * c->out_stride + head;
                    for (int d = 0; d < D; d++) orow[d] = f32_to_bf16(o[r * D + d]);
                }
            a += nr;
        }
    }
}

#if VW == 16 && defined(HAVE_DPBF16)
/* ---- bf16 on AVX512-BF16's pair dot products (vdpbf16ps), head sizes 64 and 128 ------------
 *
 * The same task, with both products on bf16 pairs: each float32 lane += a[2j] b[2j] + a[2j + 1]
 * b[2j + 1], the bf16 products exact (bf16 denormal inputs count as zero). Scores: q's element
 * pairs (broadcast) against the keys gathered as element pairs in tiles of KTILE keys ([D / 2,
 * KTILE] per tile, a key's pair j in lane p of row j: 16 x 16 blocks transposed in registers),
 * so one instruction adds two of D's terms to 16 scores; masked to -inf past each row's own
 * keys, their maximum taken in the same pass. Softmax in float32 (exp as above), its sum over
 * the float32 terms; the terms rounded to bf16 (torch's SDPA in bf16 rounds its probabilities
 * the same way before its second product) and out = P V on pairs of keys, the values gathered
 * as [L' / 2, D] pairs of rows (two keys' element d side by side), each output vector one
 * instruction per two keys, P's key pair broadcast; normalised and rounded to bf16 once.
 * Against the float32-arithmetic tiles above (which widen every element first): 1.8-2.0x on
 * SmolLM2's prefill shapes on a Zen 4 core (docs/benchmarks.md). */

/* Keys 0 .. nk - 1 of KV head h as element pairs in tiles of KTILE keys, kp[(p / KTILE * D / 2
 * + j) * KTILE + p % KTILE] = K[p][2j .. 2j + 1] (zero from nk to ldk), transposed 16 keys x 16
 * pairs at a time in registers; and their values as key pairs, vp[(p / 2) * 2D + 2d + p % 2] =
 * V[p][d] (the odd key count's last pair padded with zero). */
INLINE void gather_pairs(const Call *c, const int32_t *pages, int64_t nk, int64_t ldk, int h,
                         const int D, uint32_t *restrict kp, uint16_t *restrict vp) {
    const int64_t row = (int64_t)c->Hkv * D;
    const __m512i lo_idx = pair_lo(), hi_idx = pair_hi();
    for (int64_t p0 = 0; p0 < ldk; p0 += 16) {
        const uint16_t *k[16];
        for (int e = 0; e < 16; e++) {
            const int64_t p = p0 + e;
            if (p < nk) {
                const int64_t page = pages[p / c->P], slot = p % c->P;
                k[e] = (const uint16_t *)c->pool + (page * 2 * c->P + slot) * row + (int64_t)h * D;
            } else {
                k[e] = NULL;
            }
        }
        /* values: pairs of keys side by side */
        for (int e = 0; e < 16 && p0 + e < nk; e += 2) {
            const uint16_t *v0 = k[e] + (int64_t)c->P * row;
            const uint16_t *v1 = k[e + 1] != NULL ? k[e + 1] + (int64_t)c->P * row : NULL;
            uint16_t *out = vp + (p0 + e) * D;
            for (int d = 0; d < D; d += 32) {
                const __m512i r0 = _mm512_loadu_si512(v0 + d);
                const __m512i r1 = v1 != NULL ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
                _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(r0, lo_idx, r1));
                _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(r0, hi_idx, r1));
            }
        }
        /* keys: 16 keys x 16 pairs transposed at a time */
        uint32_t *tile = kp + p0 / KTILE * KTILE * (D / 2) + p0 % KTILE;
        for (int j0 = 0; j0 < D / 2; j0 += 16) {
            __m512i r[16];
            for (int e = 0; e < 16; e++)
                r[e] = k[e] != NULL ? _mm512_loadu_si512(k[e] + 2 * j0) : _mm512_setzero_si512();
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(tile + (j0 + j) * KTILE, r[j]);
        }
    }
}

/* lanes lo .. lo + 15 of a row that sees keys < lim: those under lim */
INLINE __mmask16 live_lanes(int64_t lim, int64_t lo) {
    const int64_t n = lim - lo;
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* NR (1 or RB) query rows q[r] (bf16, D elements) with key limits lim[r]: their attention
 * outputs into o[r * D ..], float32. s: NR * ldk floats, pb: NR * ldk bf16. */
INLINE void rows_attend_dp(const uint16_t *const *q, const int64_t *lim, const int NR,
                           const int D, const uint32_t *restrict kp, int64_t ldk,
                           const uint16_t *restrict vp, float scale, float *restrict s,
                           uint16_t *restrict pb, float *restrict o) {
    const int64_t top = lim[NR - 1], tiles = (top + KTILE - 1) / KTILE;
    __m512 vm[RB];
    for (int r = 0; r < NR; r++) vm[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < tiles; t++) {
        __m512 acc[RB][2];
        for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const uint32_t *col = kp + t * KTILE * (D / 2);
        for (int j = 0; j < D / 2; j++) {
            const __m512i k0 = _mm512_loadu_si512(col + j * KTILE);
            const __m512i k1 = _mm512_loadu_si512(col + j * KTILE + 16);
            for (int r = 0; r < NR; r++) {
                const __m512i qj = _mm512_set1_epi32((int)load_pair(q[r] + 2 * j));
                acc[r][0] = dp(acc[r][0], qj, k0);
                acc[r][1] = dp(acc[r][1], qj, k1);
            }
        }
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        for (int r = 0; r < NR; r++) {
            for (int e = 0; e < 2; e++) {
                const int64_t lo = t * KTILE + 16 * e;
                const __m512 x = _mm512_mask_mov_ps(ninf, live_lanes(lim[r], lo),
                                                    _mm512_mul_ps(acc[r][e], _mm512_set1_ps(scale)));
                _mm512_storeu_ps(s + r * ldk + lo, x);
                vm[r] = _mm512_max_ps(vm[r], x);
            }
        }
    }
    /* exact softmax per row over its own keys (the rest -inf, so exp gives 0), in float32;
     * the probabilities rounded to bf16 for P V, the sum taken before the rounding */
    float inv[RB];
    for (int r = 0; r < NR; r++) {
        const float *sr = s + r * ldk;
        /* a NaN score (which the maximum may drop) still poisons the row through the sum */
        const vwf m = (vwf)_mm512_set1_ps(_mm512_reduce_max_ps(vm[r]));
        vwf vs = {0};
        uint16_t *pr = pb + r * ldk;
        for (int64_t p = 0; p < tiles * KTILE; p += KTILE) {
            const vwf x0 = expw(loadw(sr + p) - m), x1 = expw(loadw(sr + p + 16) - m);
            vs += x0 + x1;
            _mm512_storeu_si512(pr + p, (__m512i)_mm512_cvtne2ps_pbh((__m512)x1, (__m512)x0));
        }
        inv[r] = 1.0f / hsumw(vs);
    }
    /* out = P V, PB rows x 64 columns at a time, over key pairs (P's pad key is 0) */
    const int NP = NR < PB ? NR : PB;
    for (int r0 = 0; r0 < NR; r0 += NP) {
        const int64_t pairs = (lim[r0 + NP - 1] + 1) / 2;
        for (int c0 = 0; c0 < D; c0 += 64) {
            __m512 acc[PB][4];
            for (int r = 0; r < NP; r++)
                for (int e = 0; e < 4; e++) acc[r][e] = _mm512_setzero_ps();
            for (int64_t jp = 0; jp < pairs; jp++) {
                const uint16_t *vr = vp + jp * 2 * D + 2 * c0;
                __m512i ve[4];
                for (int e = 0; e < 4; e++) ve[e] = _mm512_loadu_si512(vr + 32 * e);
                for (int r = 0; r < NP; r++) {
                    const __m512i pj =
                        _mm512_set1_epi32((int)load_pair(pb + (r0 + r) * ldk + 2 * jp));
                    for (int e = 0; e < 4; e++) acc[r][e] = dp(acc[r][e], pj, ve[e]);
                }
            }
            for (int r = 0; r < NP; r++)
                for (int e = 0; e < 4; e++)
                    _mm512_storeu_ps(o + (r0 + r) * D + c0 + 16 * e,
                                     _mm512_mul_ps(acc[r][e], _mm512_set1_ps(inv[r0 + r])));
        }
    }
}

/* n floats of o into bf16 at out, as f32_to_bf16 rounds (ties to even, NaN to 0x7FC0) */
INLINE void round_row(const float *restrict o, uint16_t *restrict out, const int n) {
    for (int d = 0; d < n; d += 16) {
        const __m512i u = _mm512_loadu_si512(o + d);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
        const __m512 f = _mm512_castsi512_ps(u);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
        _mm256_storeu_si256((__m256i *)(out + d), _mm512_cvtepi32_epi16(r));
    }
}

/* The bf16 task on pair dot products: as task_body's, for D 64 or 128. buf as there (the pair
 * buffers take half the floats of the widened ones). */
INLINE void task_body_dp(const Call *c, int64_t task, float *buf, const int D) {
    const int h = (int)(task % c->Hkv);
    const int64_t block = task / c->Hkv, i = c->task_seq[block], a0 = c->task_q0[block];
    const int64_t n = c->q_lens[i], L = c->seq_lens[i];
    const int64_t na = n - a0 < c->qblock ? n - a0 : c->qblock;
    const int64_t nk = L - n + a0 + na;
    const int64_t ldk = (nk + KTILE - 1) / KTILE * KTILE;
    const int64_t ldmax = (c->max_keys + KTILE - 1) / KTILE * KTILE;
    uint32_t *kp = (uint32_t *)buf;                     /* D / 2 x ldmax pairs */
    uint16_t *vp = (uint16_t *)(kp + (int64_t)D / 2 * ldmax); /* ldmax x D bf16 */
    float *s = (float *)(vp + ldmax * D);               /* RB x ldmax */
    uint16_t *pb = (uint16_t *)(s + RB * ldmax);        /* RB x ldmax bf16 */
    float *o = (float *)(pb + RB * ldmax);              /* RB x D */
    gather_pairs(c, c->page_table + c->table_rows[i] * c->table_stride, nk, ldk, h, D, kp, vp);
    for (int g = 0; g < c->G; g++) {
        const int64_t head = (int64_t)(h * c->G + g) * D;
        for (int64_t a = 0; a < na;) {
            const int nr = na - a >= RB ? RB : 1;
            int64_t lim[RB];
            const uint16_t *qr[RB];
            for (int r = 0; r < nr; r++) {
                const int64_t row = c->q_starts[i] + a0 + a + r;
                qr[r] = (const uint16_t *)c->q + row * c->q_stride + head;
                lim[r] = L - n + a0 + a + r + 1;
            }
            if (nr == RB) {
                rows_attend_dp(qr, lim, RB, D, kp, ldk, vp, c->scale, s, pb, o);
            } else {
                rows_attend_dp(qr, lim, 1, D, kp, ldk, vp, c->scale, s, pb, o);
            }
            for (int r = 0; r < nr; r++) {
                const int64_t row = c->q_starts[i] + a0 + a + r;
                round_row(o + r * D, (uint16_t *)c->out + row * c->out_stride + head, D);
            }
            a += nr;
        }
    }
}
#endif

typedef void (*TaskFn)(const Call *, int64_t, float *);

#define SPECIALISE(NAME, BF16, DIM)                                                        \
    static void NAME(const Call *c, int64_t task, float *buf) {                            \
        task_body(c, task, buf, BF16, DIM);                                                \
    }
SPECIALISE(task_f32_d64, 0, 64)
SPECIALISE(task_f32_d128, 0, 128)
#ifdef HAVE_DPBF16
static void task_bf16_d64(const Call *c, int64_t task, float *buf) {
    task_body_dp(c, task, buf, 64);
}
static void task_bf16_d128(const Call *c, int64_t task, float *buf) {
    task_body_dp(c, task, buf, 128);
}
#else
SPECIALISE(task_bf16_d64, 1, 64)
SPECIALISE(task_bf16_d128, 1, 128)
#endif

/* Any other multiple of 16 up to 256: one specialisation with D known only at run time (its
 * P V accumulators an array in L1, not registers). One per size compiled for minutes with AVX2
 * (32 instances of the tile loops) for head sizes no model the engine serves uses. */
SPECIALISE(task_f32_any, 0, c->D)
SPECIALISE(task_bf16_any, 1, c->D)

/* 1 if bf16 runs on pair dot products (probabilities rounded to bf16 before P V), 0 if in
 * float32 arithmetic throughout (the tests hold each to its own semantics) */
int loraplex_prefill_attention_bf16_pairs(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}

/* dtype: 0 float32, 1 bfloat16. Returns 0 on success, 1 if a buffer could not be allocated
 * (some rows then unwritten: the caller runs its torch path), 2 for a bad argument (an unknown
 * dtype, a non-positive size, D not a multiple of 16 or over 256, a query count over its
 * sequence's length). */
int loraplex_prefill_attention(const void *q, int64_t q_stride, const void *pool,
                               const int32_t *page_table, int64_t table_stride,
                               const int64_t *q_starts, const int64_t *q_lens,
                               const int64_t *table_rows, const int64_t *seq_lens, void *out,
                               int64_t out_stride, int64_t num_seqs, int Hkv, int G, int D, int P,
                               float scale, int num_threads, int dtype) {
    if (num_seqs <= 0) return 0;
    if (Hkv <= 0 || G <= 0 || D <= 0 || D % 16 || D > 256 || P <= 0 || num_threads <= 0
        || (dtype != 0 && dtype != 1))
        return 2;
    int64_t max_keys = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (q_lens[i] <= 0 || q_lens[i] > seq_lens[i]) return 2;
        max_keys = seq_lens[i] > max_keys ? seq_lens[i] : max_keys;
    }
    int64_t qblock = 0, blocks = 0;
    for (size_t k = 0; k < sizeof QBLOCKS / sizeof QBLOCKS[0]; k++) {
        qblock = QBLOCKS[k], blocks = 0;
        for (int64_t i = 0; i < num_seqs; i++) blocks += (q_lens[i] + qblock - 1) / qblock;
        if (num_threads == 1 || blocks * Hkv >= (int64_t)TASKS_PER_THREAD * num_threads) break;
    }
    int64_t *plan = malloc(sizeof(int64_t) * 2 * (size_t)blocks);
    if (plan == NULL) return 1;
    for (int64_t i = 0, b = 0; i < num_seqs; i++)
        for (int64_t a = 0; a < q_lens[i]; a += qblock, b++) plan[b] = i, plan[blocks + b] = a;
    static const TaskFn fns[2][3] = {{task_f32_d64, task_f32_d128, task_f32_any},
                                     {task_bf16_d64, task_bf16_d128, task_bf16_any}};
    const TaskFn fn = fns[dtype][D == 64 ? 0 : D == 128 ? 1 : 2];
    const Call c = {q, pool, page_table, q_starts, q_lens, table_rows, seq_lens, plan,
                    plan + blocks, out, q_stride, table_stride, out_stride, max_keys,
                    Hkv, G, D, P, scale, qblock};
    const int64_t num_tasks = blocks * Hkv;
    const int64_t ldmax = (max_keys + KTILE - 1) / KTILE * KTILE;
    /* the last ldmax pointers' worth: task_body's value row pointers */
    const size_t buf_floats = (size_t)(2 * D * ldmax + RB * ldmax + 2 * RB * D
                                       + (size_t)ldmax * sizeof(const float *) / sizeof(float));
    int failed = 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_tasks > 1)
    {
        float *buf = malloc(sizeof(float) * buf_floats);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (buf != NULL) fn(&c, task, buf);
        }
        free(buf);
    }
    free(plan);
    return failed;
}
