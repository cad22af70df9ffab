/* Paged decode attention for the CPU backend: one query row per sequence, K and V read in place
 * from the pool through the page table (no gather copy), float32 arithmetic.
 *
 * Semantics, for decode sequence i (query row r = q_rows[i], table row t = table_rows[i],
 * length L = seq_lens[i]) and query head j of KV head h = j / G (G = num_heads / num_kv_heads):
 *     s[p]      = scale * dot(q[r, j], K[t, p, h])        for p < L
 *     out[r, j] = sum_p softmax(s)[p] * V[t, p, h]
 * where K[t, p, h] is pool[page, 0, p % P, h] with page = page_table[t, p / P] (V likewise at
 * index 1): the pool seen as [num_pages, 2, P, Hkv, D] (kernels/reference.py kv_view).
 * Positions at or past L are never read: a stale slot may hold NaN or inf, and a weight of 0
 * would not hide it (0 * NaN is NaN).
 *
 * Tensors (C-contiguous unless a stride is given; elements are float32 or bfloat16, one dtype
 * for q, pool and out):
 *     q:          [T, Hq, D], token stride q_stride elements (heads and D contiguous)
 *     pool:       [num_pages, 2, P, Hkv, D], one layer
 *     page_table: [S, table_stride] int32
 *     q_rows, table_rows, seq_lens: [num_seqs] int64
 *     out:        [T, Hq, D], token stride out_stride; only the q_rows rows are written
 *
 * Each task is one (sequence, KV head) pair: its G query heads are scored together, so each K
 * and V row is read once per KV head, not once per query head. Two passes (scores, then the
 * weighted V sum) over a per-thread buffer of G * max(L) scores.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

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

/* Element i of a row of float32 (bf16 == 0) or bfloat16 (bf16 == 1) values. Called with a
 * constant bf16 after inlining, so each loop is compiled for one dtype and vectorised. */
INLINE float load(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* exp(x) for x <= 0 (scores minus their maximum), Cephes' expf: x = n ln2 + r with
 * |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n built in the exponent bits; within 2 ulp
 * of expf. Written branch-free so gcc vectorises it (glibc's expf is a scalar call). Below
 * -87 the result is clamped to e^-87 (~1.6e-38), nothing next to the sum's largest term, 1. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* One (sequence, KV head) task. qf: [G, D] the query heads in float32; scores: [G, L]. */
INLINE void attend(const void *restrict pool, const int32_t *restrict pages, int64_t len,
                   int h, int Hkv, int G, int D, int P, float scale, int bf16,
                   const float *restrict qf, float *restrict scores, float *restrict acc) {
    const int64_t row_elems = (int64_t)Hkv * D;  /* one token's K (or V) of every head */
    const int64_t page_elems = 2 * (int64_t)P * row_elems;
    const int64_t esize = bf16 ? 2 : 4;
    const char *base = (const char *)pool;

    for (int64_t p0 = 0, pi = 0; p0 < len; p0 += P, pi++) {
        const int64_t n = len - p0 < P ? len - p0 : P;
        const int64_t k0 = (int64_t)pages[pi] * page_elems + h * (int64_t)D;
        for (int64_t o = 0; o < n; o++) {
            const void *k = base + (k0 + o * row_elems) * esize;
            for (int g = 0; g < G; g++) {
                const float *qg = qf + (int64_t)g * D;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qg[d] * load(k, d, bf16);
                scores[(int64_t)g * len + p0 + o] = s * scale;
            }
        }
    }

    float inv_sum[G];
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * len;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t p = 0; p < len; p++) m = sg[p] > m ? sg[p] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < len; p++) {
            sg[p] = exp_nonpositive(sg[p] - m);
            sum += sg[p];
        }
        inv_sum[g] = 1.0f / sum;
    }

    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
    for (int64_t p0 = 0, pi = 0; p0 < len; p0 += P, pi++) {
        const int64_t n = len - p0 < P ? len - p0 : P;
        const int64_t v0 = (int64_t)pages[pi] * page_elems + (int64_t)P * row_elems
                           + h * (int64_t)D;
        for (int64_t o = 0; o < n; o++) {
            const void *v = base + (v0 + o * row_elems) * esize;
            for (int g = 0; g < G; g++) {
                const float w = scores[(int64_t)g * len + p0 + o];
                float *ag = acc + (int64_t)g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ag[d] += w * load(v, d, bf16);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *ag = acc + (int64_t)g * D;
#pragma omp simd
        for (int d = 0; d < D; d++) ag[d] *= inv_sum[g];
    }
}

/* The whole call for one dtype and head size (constants after inlining: the loops over d are
 * compiled for D = 64 and 128 exactly, and for any D). Returns 0, or 1 if a buffer could not
 * be allocated (nothing written then is guaranteed). */
INLINE int run(const void *restrict q, int64_t q_stride, const void *restrict pool,
               const int32_t *restrict page_table, int64_t table_stride,
               const int64_t *restrict q_rows, const int64_t *restrict table_rows,
               const int64_t *restrict seq_lens, void *restrict out, int64_t out_stride,
               int64_t num_seqs, int Hkv, int G, int D, int P, float scale, int num_threads,
               int bf16) {
    int64_t max_len = 1;
    for (int64_t i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int64_t num_tasks = num_seqs * Hkv;
    const int64_t esize = bf16 ? 2 : 4;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_tasks > 1)
    {
        /* per thread: scores [G, max_len], the task's queries and sums [G, D] each */
        float *buf = malloc(sizeof(float) * (size_t)G * (size_t)(max_len + 2 * D));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (buf == NULL) continue;
            const int64_t i = task / Hkv;
            const int h = (int)(task % Hkv);
            const int64_t len = seq_lens[i];
            float *scores = buf, *qf = buf + (int64_t)G * max_len, *acc = qf + (int64_t)G * D;
            const int64_t head0 = (int64_t)h * G * D; /* first element of this group's heads */
            const char *qr = (const char *)q + (q_rows[i] * q_stride + head0) * esize;
            for (int64_t e = 0; e < (int64_t)G * D; e++) qf[e] = load(qr, e, bf16);
            if (len <= 0) { /* no keys: nothing to attend to (the engine never asks this) */
                memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
            } else {
                attend(pool, page_table + table_rows[i] * table_stride, len, h, Hkv, G, D, P,
                       scale, bf16, qf, scores, acc);
            }
            char *orow = (char *)out + (q_rows[i] * out_stride + head0) * esize;
            if (bf16) {
                for (int64_t e = 0; e < (int64_t)G * D; e++)
                    ((uint16_t *)orow)[e] = f32_to_bf16(acc[e]);
            } else {
                memcpy(orow, acc, sizeof(float) * (size_t)G * (size_t)D);
            }
        }
        free(buf);
    }
    return failed;
}

#define DISPATCH_D(BF16)                                                                      \
    do {                                                                                      \
        if (D == 64)                                                                          \
            return run(q, q_stride, pool, page_table, table_stride, q_rows, table_rows,       \
                       seq_lens, out, out_stride, num_seqs, Hkv, G, 64, P, scale,             \
                       num_threads, BF16);                                                    \
        if (D == 128)                                                                         \
            return run(q, q_stride, pool, page_table, table_stride, q_rows, table_rows,       \
                       seq_lens, out, out_stride, num_seqs, Hkv, G, 128, P, scale,            \
                       num_threads, BF16);                                                    \
        return run(q, q_stride, pool, page_table, table_stride, q_rows, table_rows, seq_lens, \
                   out, out_stride, num_seqs, Hkv, G, D, P, scale, num_threads, BF16);        \
    } while (0)

/* dtype: 0 float32, 1 bfloat16. Returns 0 on success, 1 if out of memory, 2 for a bad
 * argument (an unknown dtype or a non-positive size). */
int loraplex_decode_attention(const void *q, int64_t q_stride, const void *pool,
                              const int32_t *page_table, int64_t table_stride,
                              const int64_t *q_rows, const int64_t *table_rows,
                              const int64_t *seq_lens, void *out, int64_t out_stride,
                              int64_t num_seqs, int Hkv, int G, int D, int P, float scale,
                              int num_threads, int dtype) {
    if (num_seqs <= 0) return 0;
    if (Hkv <= 0 || G <= 0 || D <= 0 || P <= 0 || num_threads <= 0) return 2;
    if (dtype == 0) DISPATCH_D(0);
    if (dtype == 1) DISPATCH_D(1);
    return 2;
}
