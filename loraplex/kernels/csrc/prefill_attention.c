/* Paged prefill attention for the CPU backend: every sequence of a step with more than one
 * query row (a prompt chunk, or a decode row with its speculative drafts), causal, K and V
 * read from the pool through the page table, float32 arithmetic.
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
 * A task is a sequence, one KV head and a block of up to QBLOCK queries. It gathers the keys
 * the block can see, transposed ([D, L'] with L' rounded up to KTILE, zero past the end), and
 * the values ([L', D]), into per-thread float32 buffers once; then the G * QBLOCK query rows
 * go RB at a time through two register-blocked products: scores = Q K^T as RB x KTILE tiles
 * (each key column loaded once for RB rows), an exact softmax per row over the keys it may
 * see (the block's later keys masked to -inf, so exp gives 0), and out = P V as RB x D tiles
 * (each value row loaded once for RB rows). The causal upper triangle is skipped a tile of
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

#define QBLOCK 64 /* queries per task: enough work to amortise the gather, and tasks to share */
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
} Call;

/* Keys 0 .. nk - 1 of KV head h into kt ([D, ldk], transposed, zero from nk to ldk) and their
 * values into v ([nk, D]), float32. */
INLINE void gather(const Call *c, const int32_t *pages, int64_t nk, int64_t ldk, int h, int bf16,
                   const int D, float *restrict kt, float *restrict v) {
    const int64_t esize = bf16 ? 2 : 4;
    const int64_t row = (int64_t)c->Hkv * D; /* elements of one token's K (or V) */
    for (int64_t p = 0; p < nk; p++) {
        const int64_t page = pages[p / c->P], slot = p % c->P;
        const char *k = (const char *)c->pool
                        + ((page * 2 * c->P + slot) * row + (int64_t)h * D) * esize;
        const char *vv = k + (int64_t)c->P * row * esize;
        float *vrow = v + p * D;
        if (bf16) {
            /* two loops: the value row's widening vectorises on its own (1.1x at 9/3 heads) */
            for (int d = 0; d < D; d++)
                kt[(int64_t)d * ldk + p] = bf16_to_f32(((const uint16_t *)k)[d]);
            for (int d = 0; d < D; d++) vrow[d] = bf16_to_f32(((const uint16_t *)vv)[d]);
        } else {
            for (int d = 0; d < D; d++) kt[(int64_t)d * ldk + p] = ((const float *)k)[d];
            memcpy(vrow, vv, sizeof(float) * (size_t)D);
        }
    }
    for (int d = 0; d < D; d++)
        for (int64_t p = nk; p < ldk; p++) kt[(int64_t)d * ldk + p] = 0.0f;
}

/* NR (1 or RB) query rows qf[r * D ..] with key limits lim[r] (row r sees keys < lim[r]; the
 * largest is lim[NR - 1]): their attention outputs into o[r * D ..], float32. s: NR * ldk. */
INLINE void rows_attend(const float *restrict qf, const int64_t *lim, const int NR, const int D,
                        const float *restrict kt, int64_t ldk, const float *restrict v,
                        float scale, float *restrict s, float *restrict o) {
    const int64_t top = lim[NR - 1], tiles = (top + KTILE - 1) / KTILE;
    /* scores, NR x KTILE at a time: each key column is loaded once for the NR rows */
    for (int64_t t = 0; t < tiles; t++) {
        vwf acc[RB][2];
        for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = (vwf){0};
        const float *col = kt + t * KTILE;
        for (int d = 0; d < D; d++) {
            const vwf k0 = loadw(col + (int64_t)d * ldk), k1 = loadw(col + (int64_t)d * ldk + VW);
            for (int r = 0; r < NR; r++) {
                const float qd = qf[r * D + d];
                acc[r][0] += qd * k0;
                acc[r][1] += qd * k1;
            }
        }
        for (int r = 0; r < NR; r++) {
            storew(s + r * ldk + t * KTILE, acc[r][0] * scale);
            storew(s + r * ldk + t * KTILE + VW, acc[r][1] * scale);
        }
    }
    /* exact softmax per row over its own keys; the rest of its tiles -inf, so exp gives 0 */
    float inv[RB];
    for (int r = 0; r < NR; r++) {
        float *sr = s + r * ldk;
        for (int64_t p = lim[r]; p < tiles * KTILE; p++) sr[p] = -INFINITY;
        vwf vm = (vwf){0} - INFINITY;
        for (int64_t p = 0; p < tiles * KTILE; p += VW) {
            const vwf x = loadw(sr + p);
            vm = (vwf)(((vwi)x & (x > vm)) | ((vwi)vm & ~(x > vm)));
        }
        float m = -INFINITY;
        for (int e = 0; e < VW; e++) m = vm[e] > m ? vm[e] : m;
        vwf vs = {0};
        for (int64_t p = 0; p < tiles * KTILE; p += VW) {
            const vwf x = expw(loadw(sr + p) - m);
            storew(sr + p, x);
            vs += x;
        }
        inv[r] = 1.0f / hsumw(vs);
    }
    /* out = P V, PB x D at a time: each value row is loaded once for PB rows */
    const int NP = NR < PB ? NR : PB;
    for (int r0 = 0; r0 < NR; r0 += NP) {
        vwf acc[PB][D / VW];
        const int64_t ptop = lim[r0 + NP - 1];
        for (int r = 0; r < NP; r++)
            for (int e = 0; e < D / VW; e++) acc[r][e] = (vwf){0};
        for (int64_t p = 0; p < ptop; p++) {
            const float *vr = v + p * D;
            for (int e = 0; e < D / VW; e++) {
                const vwf ve = loadw(vr + VW * e);
                for (int r = 0; r < NP; r++) acc[r][e] += s[(r0 + r) * ldk + p] * ve;
            }
        }
        for (int r = 0; r < NP; r++)
            for (int e = 0; e < D / VW; e++)
                storew(o + (r0 + r) * D + VW * e, acc[r][e] * inv[r0 + r]);
    }
}

/* Task `task`: KV head task % Hkv of its sequence, queries task_q0 .. + QBLOCK. buf holds
 * D * ldk + ldk * D + RB * ldk + 2 * RB * D floats for ldk = max_keys rounded up to KTILE. */
INLINE void task_body(const Call *c, int64_t task, float *buf, int bf16, const int D) {
    const int h = (int)(task % c->Hkv);
    const int64_t block = task / c->Hkv, i = c->task_seq[block], a0 = c->task_q0[block];
    const int64_t n = c->q_lens[i], L = c->seq_lens[i];
    const int64_t na = n - a0 < QBLOCK ? n - a0 : QBLOCK;
    const int64_t nk = L - n + a0 + na; /* keys the block's last query sees */
    const int64_t ldk = (nk + KTILE - 1) / KTILE * KTILE;
    const int64_t ldmax = (c->max_keys + KTILE - 1) / KTILE * KTILE;
    float *kt = buf, *v = kt + (int64_t)D * ldmax, *s = v + ldmax * D, *qf = s + RB * ldmax;
    float *o = qf + RB * D;
    gather(c, c->page_table + c->table_rows[i] * c->table_stride, nk, ldk, h, bf16, D, kt, v);
    const int64_t esize = bf16 ? 2 : 4;
    for (int g = 0; g < c->G; g++) {
        const int64_t head = (int64_t)(h * c->G + g) * D;
        for (int64_t a = 0; a < na;) {
            const int nr = na - a >= RB ? RB : 1;
            int64_t lim[RB];
            for (int r = 0; r < nr; r++) {
                const int64_t row = c->q_starts[i] + a0 + a + r;
                const char *qr = (const char *)c->q + (row * c->q_stride + head) * esize;
                for (int d = 0; d < D; d++)
                    qf[r * D + d] = bf16 ? bf16_to_f32(((const uint16_t *)qr)[d])
                                         : ((const float *)qr)[d];
                lim[r] = L - n + a0 + a + r + 1;
            }
            if (nr == RB) {
                rows_attend(qf, lim, RB, D, kt, ldk, v, c->scale, s, o);
            } else {
                rows_attend(qf, lim, 1, D, kt, ldk, v, c->scale, s, o);
            }
            for (int r = 0; r < nr; r++) {
                const int64_t row = c->q_starts[i] + a0 + a + r;
                char *orow = (char *)c->out + (row * c->out_stride + head) * esize;
                if (bf16) {
                    for (int d = 0; d < D; d++)
                        ((uint16_t *)orow)[d] = f32_to_bf16(o[r * D + d]);
                } else {
                    memcpy(orow, o + r * D, sizeof(float) * (size_t)D);
                }
            }
            a += nr;
        }
    }
}

typedef void (*TaskFn)(const Call *, int64_t, float *);

#define SPECIALISE(NAME, BF16, DIM)                                                        \
    static void NAME(const Call *c, int64_t task, float *buf) {                            \
        task_body(c, task, buf, BF16, DIM);                                                \
    }
SPECIALISE(task_f32_d64, 0, 64)
SPECIALISE(task_f32_d128, 0, 128)
SPECIALISE(task_bf16_d64, 1, 64)
SPECIALISE(task_bf16_d128, 1, 128)

/* Any other multiple of 16 up to 256: one specialisation with D known only at run time (its
 * P V accumulators an array in L1, not registers). One per size compiled for minutes with AVX2
 * (32 instances of the tile loops) for head sizes no model the engine serves uses. */
SPECIALISE(task_f32_any, 0, c->D)
SPECIALISE(task_bf16_any, 1, c->D)

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
    int64_t blocks = 0, max_keys = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (q_lens[i] <= 0 || q_lens[i] > seq_lens[i]) return 2;
        blocks += (q_lens[i] + QBLOCK - 1) / QBLOCK;
        max_keys = seq_lens[i] > max_keys ? seq_lens[i] : max_keys;
    }
    int64_t *plan = malloc(sizeof(int64_t) * 2 * (size_t)blocks);
    if (plan == NULL) return 1;
    for (int64_t i = 0, b = 0; i < num_seqs; i++)
        for (int64_t a = 0; a < q_lens[i]; a += QBLOCK, b++) plan[b] = i, plan[blocks + b] = a;
    static const TaskFn fns[2][3] = {{task_f32_d64, task_f32_d128, task_f32_any},
                                     {task_bf16_d64, task_bf16_d128, task_bf16_any}};
    const TaskFn fn = fns[dtype][D == 64 ? 0 : D == 128 ? 1 : 2];
    const Call c = {q, pool, page_table, q_starts, q_lens, table_rows, seq_lens, plan,
                    plan + blocks, out, q_stride, table_stride, out_stride, max_keys,
                    Hkv, G, D, P, scale};
    const int64_t num_tasks = blocks * Hkv;
    const int64_t ldmax = (max_keys + KTILE - 1) / KTILE * KTILE;
    const size_t buf_floats = (size_t)(2 * D * ldmax + RB * ldmax + 2 * RB * D);
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
