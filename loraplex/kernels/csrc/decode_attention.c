/* Paged decode attention for the CPU backend: one query row per sequence, K and V read in place
 * from the pool through the page table (no gather copy), float32 arithmetic.
 *
 * Semantics, for decode sequence i (query row r = q_rows[i], table row t = table_rows[i],
 * length L = seq_lens[i]) and query head j of KV head h = j / G (G = num_heads / num_kv_heads):
 *     s[p]      = scale * dot(q[r, j], K[t, p, h])        for p < L
 *     out[r, j] = sum_p softmax(s)[p] * V[t, p, h]
 * where K[t, p, h] is pool[page, 0, p % P, h] with page = page_table[t, p / P] (V likewise at
 * index 1): the pool seen as [num_pages, 2, P, Hkv, D] (loraplex/kernels/reference.py kv_view).
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
 * Each task is a sequence and a block of its KV heads (all of them when there are enough
 * sequences to keep every thread busy, else one): a token's K (V) of the block is one
 * contiguous run, read once from memory; the G query heads of each KV head are scored against
 * it while it sits in L1, so each K and V row is read once per KV head, not once per query
 * head. One pass per page with an online softmax (scores, a running maximum and sum, the
 * weighted V sum rescaled when the maximum grows), the next page prefetched row by row: a
 * sequence's pages lie anywhere in the pool, so the hardware prefetcher loses the stream at
 * every page boundary. Tasks go round-robin over the threads, so each knows its next one and
 * prefetches that task's first page during its own last (1.04-1.08x, float32 and bf16, one and
 * two threads, on a Zen 4 core at SmolLM2's shapes with 30 layers' pools out of cache; the
 * same bits: docs/benchmarks.md, "Zen 4, sixth visit"). Scores live in a per-thread buffer of
 * (block query heads) * P floats.
 *
 * Measured on one Sapphire Rapids core at SmolLM2's shapes (9/3 heads, D 64, 32 sequences of
 * 100-250 tokens; benchmarks/decode_attention_bench.py): 2.6-2.7x (fp32) and 2.9-3.1x (bf16)
 * less CPU time than the torch ops (cpu._decode). Tried there and left (no gain measured):
 * reducing 16 dot products at once with a transposing shuffle tree, prefetching two pages
 * ahead, and prefetching the next task's first page (kept since: 1.04-1.08x on Zen 4, above).
 * On a Zen 4 core (AMD EPYC, AVX-512), prefetching into L2 instead of L1 made it 1.3-1.6x
 * faster again (prefetch_bytes); on Zen 5 an MHA model's float32 rows go into L1 (see
 * rows_into_l1). On an AVX2 core (Zen 3)
 * every vector is the machine's width (loadc): 2.0x faster at 16/16 heads, 3.8x at 9/3 float32,
 * 2.9x bf16, than with 16-lane vectors there. bf16 at D = 64 and 128 on CPUs with AVX512-BF16
 * (attend_pairs): the scores on pair dot products, 16 keys reduced at once; on a Zen 4 core,
 * SmolLM2's 9/3 heads, 1.19-1.37x (contexts 16-48 to 300-600), 1.18x at 16/4 heads, 0.95-1.01x
 * at 16/16 (memory-bound there).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "bf16_pairs.h"
#include "cpu_id.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Element i of a row of float32 (bf16 == 0) or bfloat16 (bf16 == 1) values. Called with a
 * constant bf16 after inlining, so each loop is compiled for one dtype and vectorised. */
INLINE float load(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* Chunk c (VW elements: 16 with AVX-512, 8 with AVX2) of a row, widened to float32 (the fast
 * paths). A bf16 row is read in pairs: the 32-bit word of elements (2i, 2i + 1) holds 2i in its
 * low half, so chunk 2c is the even elements of 2c VW .. 2c VW + 2 VW - 1 (w << 16) and chunk
 * 2c + 1 the odd ones (w & 0xFFFF0000): two integer ops per VW elements instead of a widening
 * shuffle. The fast paths hold queries and sums in that order (`perm`) and restore the natural
 * one at the end. Every vector here is one register of the machine (attention.h's vwf): 16-lane
 * vectors on AVX2 were register pairs, and GCC kept the V sums' array of them on the stack,
 * moved through general registers (2-3.8x slower on a Zen 3 core). */
INLINE vwf loadc(const void *row, int c, int bf16) {
    if (bf16) {
        const vwu w = *(const vwu_u *)((const uint16_t *)row + 2 * VW * (c / 2));
        return (vwf)(c % 2 ? w & 0xFFFF0000u : w << 16);
    }
    return loadw((const float *)row + VW * c);
}

/* Where element d of a head sits in the fast paths' bf16 order (see loadc). */
INLINE int perm(int d) { return d / (2 * VW) * (2 * VW) + d % 2 * VW + d % (2 * VW) / 2; }

/* Into L2 (prefetcht1), not L1: the next page's K and V are several times L1's size at an
 * MHA model's 16 KV heads (128 KiB of float32 at P = 16, D = 64), so prefetched into L1 they
 * evicted the page being read. Measured on a Zen 4 core (benchmarks/decode_attention_bench.py
 * shapes, the two builds interleaved): 1.36-1.55x faster in float32 and 1.27-1.57x in bf16,
 * at 16/16 and 9/3 heads. */
INLINE void prefetch_bytes(const char *p, int64_t n_bytes) {
    for (int64_t b = 0; b < n_bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

/* How float32 rows of 4 KiB or more (an MHA model's 16 KV heads x 64: one row a page of
 * memory) are prefetched. On a Zen 4 core, one line in four into L2, the hardware's stream
 * prefetcher fetching the rest: every line by hand kept K and V at 17 GB/s, one in four reached
 * 20-21 (32 sequences of 16-600 tokens at 16/16 and 32/32 heads x 64: 1.16-1.28x). On a Zen 5
 * core (AMD family 0x1A) it is the other way round: every line into L2 1.2x faster than one in
 * four at 16/16 heads (64 sequences of 20-288 tokens, 8 layers' pools on huge pages: 21.4
 * against 17.5 GB/s), 1.3x at 32/32, no prefetch at all no better than every line, and every
 * line into L1 1.04-1.05x faster again (four runs; docs/benchmarks.md, "Zen 5, third visit").
 * So AMD's family 0x1A and later take every line into L1 (rows_into_l1() == 1), every other
 * CPU the sparse prefetch it was measured on. Shorter rows (GQA, bf16) prefetch every line
 * into L2 everywhere (the sparse prefetch was 0.65-0.88x there on Zen 4; no prefetch 0.43-0.68x
 * on Zen 5). */
static int rows_into_l1(void) { return amd_family() >= 0x1A; }

/* Where attend() (float32 pages, and bf16 ones attend_pairs does not take) prefetches the next
 * page's V rows: during the current page's scores, with its K rows (every other CPU, as
 * measured on Zen 4), or, on AMD's family 0x1A (Zen 5), spread over its second pass, the query
 * heads' softmax and weighted V sums (SmolLM2's 9/3 heads 1.33-1.38x on one Zen 5 core, 1.10x
 * in CPU time on two; the MHA 16/16 model 1.02x): during the scores alone the next page was all
 * asked for by the end of the first pass, and the second pass had nothing in flight. bf16 pages
 * already spread theirs over the query heads. The same flag turns on, for MHA models, attend()'s
 * V page in row order, and attend_pairs' block sweeps (mha_block_pairs, gqa_block_sweeps; both
 * measured on Zen 5 only). */
static int v_rows_spread(void) { return amd_family() >= 0x1A; }

/* The next rows' prefetch (see rows_into_l1 for float32 rows of 4 KiB or more). */
INLINE void prefetch_row(const char *p, int64_t n_bytes, int64_t esize, int into_l1) {
    if (esize == 4 && n_bytes >= 4096) {
        if (into_l1) {
            for (int64_t b = 0; b < n_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
        } else {
            for (int64_t b = 0; b < n_bytes; b += 256) __builtin_prefetch(p + b, 0, 2);
        }
    } else {
        prefetch_bytes(p, n_bytes);
    }
}

/* The largest of v's lanes, none of them NaN (-inf allowed), by halves: a tree of compares
 * instead of a chain of VW scalar ones per query head and page (the same value: a maximum is
 * exact in any order). */
INLINE float hmaxw(vwf v) {
#if defined(__clang__) || __GNUC__ >= 12 /* __builtin_shufflevector */
    typedef int32_t v4i __attribute__((vector_size(16)));
#if VW == 16
    typedef int32_t v8i __attribute__((vector_size(32)));
    const v8f lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8f hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v8i gt = hi > lo;
    const v8f a = (v8f)(((v8i)hi & gt) | ((v8i)lo & ~gt));
#else
    const v8f a = v;
#endif
    const v4f alo = __builtin_shufflevector(a, a, 0, 1, 2, 3);
    const v4f ahi = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    const v4i bgt = ahi > alo;
    const v4f b = (v4f)(((v4i)ahi & bgt) | ((v4i)alo & ~bgt));
    const float x = b[1] > b[0] ? b[1] : b[0], y = b[3] > b[2] ? b[3] : b[2];
    return y > x ? y : x;
#else
    float r = v[0];
    for (int e = 1; e < VW; e++) r = v[e] > r ? v[e] : r;
    return r;
#endif
}

/* dot(qf, row) for one head: D floats against D elements of a K row. */
INLINE float dot_row(const float *restrict qf, const char *row, int D, int bf16) {
    /* the fast paths: D a constant here; bf16 only at 64 and 128, the sizes task_body holds
     * queries in loadc's pair order for (any other D reads natural order) */
    if (D % 16 == 0 && D <= 128 && (!bf16 || D == 64 || D == 128)) {
#if VW == 16
        vwf s = loadw(qf) * loadc(row, 0, bf16);
        for (int c = 1; c < D / VW; c++) s += loadw(qf + VW * c) * loadc(row, c, bf16);
        return hsumw(s);
#else /* two sums: D / VW dependent FMAs in one were the longer chain */
        vwf s = loadw(qf) * loadc(row, 0, bf16), t = loadw(qf + VW) * loadc(row, 1, bf16);
        for (int c = 2; c < D / VW; c += 2) {
            s += loadw(qf + VW * c) * loadc(row, c, bf16);
            t += loadw(qf + VW * (c + 1)) * loadc(row, c + 1, bf16);
        }
        return hsumw(s + t);
#endif
    }
    /* any other D: whole vectors in order, then the tail element by element. Not an omp simd
     * reduction: its order was the compiler's, and differed between the copies gcc made of
     * the calling loop (with and without the next page's prefetch), so a row's result
     * depended on which task came after it. */
    vwf acc = {0};
    int d = 0;
    for (; d + VW <= D; d += VW) {
        typedef uint16_t vwh_u __attribute__((vector_size(2 * VW), aligned(2)));
        const vwf r = bf16 ? (vwf)(__builtin_convertvector(
                                       *(const vwh_u *)((const uint16_t *)row + d), vwu) << 16)
                           : loadw((const float *)row + d);
        acc += loadw(qf + d) * r;
    }
    float s = hsumw(acc);
    for (; d < D; d++) s += qf[d] * load(row, d, bf16);
    return s;
}

/* accumulate_rows for D = VW * NV, NV a constant: the running sum in registers, at most 8 of
 * them at a time (AVX2 has 16: at D = 128 its 16 sums would spill), so wider heads take the
 * rows again per group of columns (from L1 the second time). */
INLINE void accumulate_fixed(float *restrict acc, float corr, const char *v, int64_t n,
                             int64_t stride, const int NV, int bf16, const float *restrict w) {
    enum { G8 = 8 };
    for (int c0 = 0; c0 < NV; c0 += G8) {
        const int nc = NV - c0 < G8 ? NV - c0 : G8;
        vwf a[G8];
        for (int c = 0; c < nc; c++) a[c] = loadw(acc + VW * (c0 + c)) * corr;
        for (int64_t o = 0; o < n; o++)
            for (int c = 0; c < nc; c++) a[c] += w[o] * loadc(v + o * stride, c0 + c, bf16);
        for (int c = 0; c < nc; c++) storew(acc + VW * (c0 + c), a[c]);
    }
}

/* acc (D floats) = acc * corr + sum_o w[o] * V row o, for n V rows `stride` bytes apart. */
INLINE void accumulate_rows(float *restrict acc, float corr, const char *v, int64_t n,
                            int64_t stride, int D, int bf16, const float *restrict w) {
    if (D == 64) {
        accumulate_fixed(acc, corr, v, n, stride, 64 / VW, bf16, w);
        return;
    }
    if (D == 128) {
        accumulate_fixed(acc, corr, v, n, stride, 128 / VW, bf16, w);
        return;
    }
#pragma omp simd
    for (int d = 0; d < D; d++) acc[d] *= corr;
    for (int64_t o = 0; o < n; o++) {
#pragma omp simd
        for (int d = 0; d < D; d++) acc[d] += w[o] * load(v + o * stride, d, bf16);
    }
}

/* One task: KV heads h0 .. h0 + nh - 1 of one sequence (query heads h0 * G .. (h0 + nh) * G - 1),
 * page by page with an online softmax: per query head a running maximum m and sum l, the
 * running output rescaled by e^(m_old - m_new) when m grows (flash-decoding's recurrence), so
 * each page's K and V are read once, together, while the next page's are being fetched.
 * qf: [nh * G, D] the queries in float32; scores: [nh * G, P rounded up to 16]; ml: [2, nh * G];
 * acc: [nh * G, D], the result. */
INLINE void attend(const void *restrict pool, const int32_t *restrict pages, int64_t len,
                   int h0, int nh, int Hkv, int G, int D, int P, float scale, int bf16,
                   const float *restrict qf, float *restrict scores, float *restrict ml,
                   float *restrict acc, const char *nx_first, int64_t nx_rows, int into_l1,
                   int v_spread) {
    const int64_t esize = bf16 ? 2 : 4;
    const int64_t stride = (int64_t)Hkv * D * esize; /* bytes of one token's K (or V) */
    const int64_t half_bytes = (int64_t)P * stride, block_bytes = (int64_t)nh * D * esize;
    const int nq = nh * G;
    const int64_t P16 = (P + 15) / 16 * 16; /* scores row stride */
    const char *base = (const char *)pool + (int64_t)h0 * D * esize;
    float *m = ml, *l = ml + nq;
    for (int j = 0; j < nq; j++) m[j] = -INFINITY, l[j] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)nq * (size_t)D);

    const int64_t first = len < P ? len : P;
    for (int64_t o = 0; o < first; o++) {
        prefetch_row(base + (int64_t)pages[0] * 2 * half_bytes + o * stride, block_bytes, esize,
                     into_l1);
        prefetch_row(base + (int64_t)pages[0] * 2 * half_bytes + half_bytes + o * stride,
                     block_bytes, esize, into_l1);
    }
    for (int64_t p0 = 0, pi = 0; p0 < len; p0 += P, pi++) {
        const int64_t n = len - p0 < P ? len - p0 : P;
        int64_t next = len - p0 - P < P ? len - p0 - P : P; /* rows of the next page */
        const char *k = base + (int64_t)pages[pi] * 2 * half_bytes, *v = k + half_bytes;
        const char *k_next = next > 0 ? base + (int64_t)pages[pi + 1] * 2 * half_bytes : NULL;
        if (next <= 0 && nx_first != NULL) { /* the last page: the next task's first one */
            k_next = nx_first;
            next = nx_rows;
        }
        for (int64_t o = 0; o < n; o++) {
            if (o < next) { /* spread over the rows: a burst would stall on full fill buffers */
                prefetch_row(k_next + o * stride, block_bytes, esize, into_l1);
                if (!v_spread)
                    prefetch_row(k_next + half_bytes + o * stride, block_bytes, esize, into_l1);
            }
            for (int h = 0, j = 0; h < nh; h++)
                for (int g = 0; g < G; g++, j++)
                    scores[j * P16 + o] = dot_row(qf + (int64_t)j * D,
                                                  k + o * stride + (int64_t)h * D * esize, D,
                                                  bf16) * scale;
        }
        const int64_t nw = (n + VW - 1) / VW; /* chunks of VW scores; lanes past n are -inf */
        /* an MHA model's V page (G == 1) on Zen 5 (v_spread): the softmax of every head
         * first, then the rows in address order, each row adding into every head's sums (one
         * head's rows are D elements of every stride bytes: read head by head, the page was
         * many short strided streams): 1.14-1.16x in float32 at 16/16 heads on one Zen 5
         * core, the same bits (each sum still acc * corr, then the rows in order). With G
         * query heads a KV head (GQA) the sums' loads and stores per row cost more than that
         * saved: 0.79x at SmolLM2's 9/3. D 64 and 128 only, accumulate_fixed's (a bf16 row's
         * chunks in loadc's paired order there; bf16 at those sizes mostly takes attend_pairs,
         * where this does not run). */
        const int rows_order = v_spread && G == 1 && (D == 64 || D == 128);
        for (int j = 0, h = 0; h < nh; h++)
            for (int g = 0; g < G; g++, j++) {
                float *sj = scores + j * P16;
                for (int64_t o = n; o < VW * nw; o++) sj[o] = -INFINITY;
                vwf vm = (vwf){0} - INFINITY;
                for (int64_t c = 0; c < nw; c++) {
                    const vwf x = loadw(sj + VW * c);
                    vm = (vwf)(((vwi)x & (x > vm)) | ((vwi)vm & ~(x > vm)));
                }
                const float vmax = hmaxw(vm), mt = vmax > m[j] ? vmax : m[j];
                /* the running sums' rescaling: 0 at the first page (m = -inf) */
                const float corr = expw((vwf){0} + (m[j] - mt))[0];
                vwf vs = {0};
                for (int64_t c = 0; c < nw; c++) {
                    const vwf x = expw(loadw(sj + VW * c) - mt);
                    storew(sj + VW * c, x);
                    vs += x;
                }
                const float sum = hsumw(vs);
                l[j] = l[j] * corr + sum;
                m[j] = mt;
                if (rows_order) { /* the rows below */
                    float *aj = acc + (int64_t)j * D;
                    for (int e = 0; e < D; e += VW) storew(aj + e, loadw(aj + e) * corr);
                    continue;
                }
                /* v_spread: the next page's V rows here, a share a query head, so that the
                 * page's second pass (its V) has the next page in flight too */
                if (v_spread)
                    for (int64_t o = next * j / nq; o < next * (j + 1) / nq; o++)
                        prefetch_row(k_next + half_bytes + o * stride, block_bytes, esize,
                                     into_l1);
                accumulate_rows(acc + (int64_t)j * D, corr, v + (int64_t)h * D * esize, n,
                                stride, D, bf16, sj);
            }
        if (rows_order) /* acc_h += w_h[o] * V row o's head h, row by row (the next page's V
                         * rows prefetched alongside) */
            for (int64_t o = 0; o < n; o++) {
                if (o < next)
                    prefetch_row(k_next + half_bytes + o * stride, block_bytes, esize, into_l1);
                for (int h = 0; h < nh; h++) {
                    const char *vh = v + o * stride + (int64_t)h * D * esize;
                    const float wh = scores[h * P16 + o];
                    float *ah = acc + (int64_t)h * D;
                    for (int c = 0; c < D / VW; c++)
                        storew(ah + VW * c, loadw(ah + VW * c) + wh * loadc(vh, c, bf16));
                }
            }
    }
    for (int j = 0; j < nq; j++) {
        float *aj = acc + (int64_t)j * D;
        const float inv = 1.0f / l[j];
#pragma omp simd
        for (int d = 0; d < D; d++) aj[d] *= inv;
    }
}

#ifdef HAVE_DPBF16
/* bf16 at D = 64 and 128 on AVX512-BF16: the scores on pair dot products (vdpbf16ps: q and K
 * both bf16, so each product is exact and only the float32 sums' order differs from the
 * float32 path), 16 keys at a time, each key's 16 lanes of partial sums reduced with the
 * other keys' in one transposing tree (sum16) instead of a horizontal sum per key and query
 * head; the weighted V sums in float32 as above, each V row widened once for all the query
 * heads of its KV head instead of once per head. */

/* lane o = the sum of v[o]'s 16 lanes (a transposing tree: 15 adds, 30 shuffles) */
INLINE __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) /* per 128-bit block: x02 y02 x13 y13 (x, y = v[2i], v[2i+1]) */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) { /* per block: keys 4i .. 4i + 3, that block's lanes */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) /* blocks: keys 8i..8i+3 twice, 8i+4..8i+7 twice (halves) */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* scale * dot(q, K row o) in lane o for the n <= 16 rows at k (`stride` bytes apart), -inf in
 * lanes n..15 (rows past n are never read); q: the head's NP vectors of 16 bf16 pairs. */
INLINE __m512 scores16(const __m512i *qv, const char *k, int64_t n, int64_t stride, int NP,
                       float scale) {
    __m512 v[16];
#pragma GCC unroll 16
    for (int o = 0; o < 16; o++) {
        v[o] = _mm512_setzero_ps();
        if (o < n) {
            const uint16_t *row = (const uint16_t *)(k + o * stride);
            for (int c = 0; c < NP; c++) v[o] = dp(v[o], qv[c], _mm512_loadu_si512(row + 32 * c));
        }
    }
    const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    return _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, sum16(v), _mm512_set1_ps(scale));
}

/* acc[g] = acc[g] * corr[g] + sum_o w[16 g + o] * V row o for NG query heads (D = 16 NV
 * floats each, loadc's pair order), the n <= 16 V rows at v `stride` bytes apart: each row
 * widened once for the NG heads. NG * NV <= 16: the sums stay in registers. */
INLINE void weigh16(float *restrict acc, const float *restrict corr, const float *restrict w,
                    const char *v, int64_t n, int64_t stride, const int NV, const int NG) {
    vwf a[16], x[8]; /* constant sizes: a VLA would live on the stack */
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NV; c++) a[g * NV + c] = loadw(acc + (g * NV + c) * VW) * corr[g];
    for (int64_t o = 0; o < n; o++) {
        for (int c = 0; c < NV; c++) x[c] = loadc(v + o * stride, c, 1);
        for (int g = 0; g < NG; g++) {
            const float wo = w[16 * g + o];
            for (int c = 0; c < NV; c++) a[g * NV + c] += wo * x[c];
        }
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NV; c++) storew(acc + (g * NV + c) * VW, a[g * NV + c]);
}

/* One query head (q: its D bf16 values) over the n <= 16 K rows at k: its weights exp(s - new
 * maximum) to w[0..15], the rescaling of its earlier sums to *corr, its running maximum *m
 * and sum *l updated. */
INLINE void weigh_head(const uint16_t *q, const char *k, int64_t n, int64_t stride, int NP,
                       float scale, float *m, float *l, float *corr, float *w) {
    __m512i qv[4];
    for (int c = 0; c < NP; c++) qv[c] = _mm512_loadu_si512(q + 32 * c);
    const __m512 s = scores16(qv, k, n, stride, NP, scale);
    /* NaN scores are skipped by the maximum and poison the sum, as in attend */
    const float mx = _mm512_reduce_max_ps(s), mt = mx > *m ? mx : *m;
    *corr = expw((vwf){0} + (*m - mt))[0];
    const vwf e = expw((vwf)s - mt);
    storew(w, e);
    *l = *l * *corr + _mm512_reduce_add_ps((__m512)e);
    *m = mt;
}

/* One block of n <= 16 rows on Zen 5 (attend_pairs' sweeps): every query head's scores and
 * weights first, over the block's K rows, then every head's V sums, over its V rows, instead
 * of K and V head by head: the K rows, then the V rows, are each read as one sweep (the same
 * bits). With G query heads a KV head (GQA; mha_block_pairs for G == 1) the next page's rows
 * pf_lo .. pf_hi - 1 are prefetched into L2 spread over the K sweep's query heads, as head by
 * head: 1.07-1.08x at SmolLM2's 9/3 heads x 64 (32 sequences of 64-150 tokens), 1.14x at 32/8,
 * 1.05x at 16/4 x 128 (contexts 64-512), 1.01x at 9/3 with two sequences (a KV head a task),
 * on one Zen 5 core. mha_block_pairs' prefetches here: 1.00x with the next head's lines into
 * L1, 0.82x with half a block's distance, 0.93x with each half of the next page in its own
 * sweep. A function of its own: as a G > 1 branch of mha_block_pairs it ran 0.92-0.98x of
 * head by head (the same source lines, compiled differently). */
INLINE void gqa_block_sweeps(const char *k, const char *v, int64_t n, int64_t stride, int nh,
                             int G, const int D, float scale, const uint16_t *restrict qb,
                             float *restrict w, float *restrict corr, float *restrict m,
                             float *restrict l, float *restrict acc, const char *k_next,
                             int64_t half_bytes, int64_t block_bytes, int64_t pf_lo,
                             int64_t pf_hi) {
    const int NP = D / 32, NV = D / 16, GB = 16 / NV, nq = nh * G;
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < G; g++) {
            const int j = h * G + g;
            for (int64_t o = pf_lo + (pf_hi - pf_lo) * j / nq;
                 o < pf_lo + (pf_hi - pf_lo) * (j + 1) / nq; o++) {
                prefetch_bytes(k_next + o * stride, block_bytes);
                prefetch_bytes(k_next + half_bytes + o * stride, block_bytes);
            }
            weigh_head(qb + (int64_t)j * D, k + (int64_t)h * D * 2, n, stride, NP, scale, m + j,
                       l + j, corr + j, w + 16 * j);
        }
    for (int h = 0; h < nh; h++) {
        const char *vh = v + (int64_t)h * D * 2;
        for (int g = 0; g < G; g += GB) {
            const int j = h * G + g;
            float *a = acc + (int64_t)j * D;
            switch (G - g < GB ? G - g : GB) {
            case 1: weigh16(a, corr + j, w + 16 * j, vh, n, stride, NV, 1); break;
            case 2: weigh16(a, corr + j, w + 16 * j, vh, n, stride, NV, 2); break;
            case 3: weigh16(a, corr + j, w + 16 * j, vh, n, stride, NV, 3); break;
            default: weigh16(a, corr + j, w + 16 * j, vh, n, stride, NV, 4); break;
            }
        }
    }
}

/* One block of n <= 16 rows of an MHA model (G == 1) on Zen 5: gqa_block_sweeps' K and V
 * sweeps (1.03-1.04x on one Zen 5 core at 16/16 heads x 64, 64 sequences of 20-290 tokens, the
 * same bits) with prefetches of their own:
 * - in each sweep the next head's lines of the block go into L1 ahead of it (a head's rows are
 *   2 D bytes of every stride: short strided streams out of L2; this prefetch alone, head by
 *   head, was 1.12-1.20x);
 * - into L2, spread over the heads, half a block ahead: the block's V rows during the K sweep,
 *   the next page's K rows pf_lo .. pf_hi - 1 during the V sweep (1.10-1.11x on one core and
 *   two, against both halves of the next page during the K sweep: a burst, then nothing in
 *   flight through the V sweep; both halves one page ahead, each in its own sweep,
 *   1.03-1.08x). */
INLINE void mha_block_pairs(const char *k, const char *v, int64_t n, int64_t stride, int nh,
                            const int D, float scale, const uint16_t *restrict qb,
                            float *restrict w, float *restrict corr, float *restrict m,
                            float *restrict l, float *restrict acc, const char *k_next,
                            int64_t block_bytes, int64_t pf_lo, int64_t pf_hi) {
    const int NP = D / 32, NV = D / 16;
    for (int h = 0; h < nh; h++) {
        if (h + 1 < nh)
            for (int64_t o = 0; o < n; o++)
                for (int64_t b = 0; b < 2 * D; b += 64)
                    __builtin_prefetch(k + o * stride + (int64_t)(h + 1) * D * 2 + b, 0, 3);
        for (int64_t o = n * h / nh; o < n * (h + 1) / nh; o++)
            prefetch_bytes(v + o * stride, block_bytes);
        weigh_head(qb + (int64_t)h * D, k + (int64_t)h * D * 2, n, stride, NP, scale, m + h,
                   l + h, corr + h, w + 16 * h);
    }
    for (int h = 0; h < nh; h++) {
        const char *vh = v + (int64_t)h * D * 2;
        if (h + 1 < nh)
            for (int64_t o = 0; o < n; o++)
                for (int64_t b = 0; b < 2 * D; b += 64)
                    __builtin_prefetch(vh + o * stride + D * 2 + b, 0, 3);
        for (int64_t o = pf_lo + (pf_hi - pf_lo) * h / nh;
             o < pf_lo + (pf_hi - pf_lo) * (h + 1) / nh; o++)
            prefetch_bytes(k_next + o * stride, block_bytes);
        weigh16(acc + (int64_t)h * D, corr + h, w + 16 * h, vh, n, stride, NV, 1);
    }
}

/* attend()'s semantics for bf16 at D = 64 or 128 (NP = D / 32 pair vectors, NV = D / 16),
 * page by page in blocks of 16 keys; qb: the block's nh * G query rows in bf16 (natural
 * order, contiguous); w: [nh * G, 16] floats (the first G * 16 of them unless sweeps);
 * corr: [nh * G] floats (the first G unless sweeps); sweeps: gqa_block_sweeps' order (Zen 5). */
INLINE void attend_pairs(const void *restrict pool, const int32_t *restrict pages,
                         int64_t len, int h0, int nh, int Hkv, int G, const int D, int P,
                         float scale, const uint16_t *restrict qb, float *restrict w,
                         float *restrict corr, float *restrict ml, float *restrict acc,
                         const char *nx_first, int64_t nx_rows, int sweeps) {
    const int NP = D / 32, NV = D / 16, GB = 16 / NV; /* heads whose sums fit in registers */
    const int64_t stride = (int64_t)Hkv * D * 2;
    const int64_t half_bytes = (int64_t)P * stride, block_bytes = (int64_t)nh * D * 2;
    const int nq = nh * G;
    const char *base = (const char *)pool + (int64_t)h0 * D * 2;
    float *m = ml, *l = ml + nq;
    for (int j = 0; j < nq; j++) m[j] = -INFINITY, l[j] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)nq * (size_t)D);

    const int64_t first = len < P ? len : P;
    for (int64_t o = 0; o < first; o++) {
        prefetch_bytes(base + (int64_t)pages[0] * 2 * half_bytes + o * stride, block_bytes);
        prefetch_bytes(base + (int64_t)pages[0] * 2 * half_bytes + half_bytes + o * stride,
                       block_bytes);
    }
    for (int64_t p0 = 0, pi = 0; p0 < len; p0 += P, pi++) {
        const int64_t n_page = len - p0 < P ? len - p0 : P;
        int64_t next = len - p0 - P < P ? len - p0 - P : P; /* rows of the next page */
        const char *k_page = base + (int64_t)pages[pi] * 2 * half_bytes;
        const char *k_next = next > 0 ? base + (int64_t)pages[pi + 1] * 2 * half_bytes : NULL;
        if (next <= 0 && nx_first != NULL) { /* the last page: the next task's first one */
            k_next = nx_first;
            next = nx_rows;
        }
        for (int64_t o0 = 0; o0 < n_page; o0 += 16) {
            const int64_t n = n_page - o0 < 16 ? n_page - o0 : 16;
            const int64_t pf_end = o0 + n < next ? o0 + n : next; /* next page's rows */
            const char *k = k_page + o0 * stride, *v = k + half_bytes;
            if (sweeps && G == 1) {
                mha_block_pairs(k, v, n, stride, nh, D, scale, qb, w, corr, m, l, acc, k_next,
                                block_bytes, o0, pf_end);
                continue;
            }
            if (sweeps) {
                gqa_block_sweeps(k, v, n, stride, nh, G, D, scale, qb, w, corr, m, l, acc,
                                 k_next, half_bytes, block_bytes, o0, pf_end);
                continue;
            }
            for (int h = 0; h < nh; h++) {
                const int j0 = h * G;
                for (int g = 0; g < G; g++) {
                    const int j = j0 + g;
                    /* the next page's rows o0 .. pf_end - 1 spread over the block's nq query
                     * heads: a burst would stall on full fill buffers */
                    for (int64_t o = o0 + (pf_end - o0) * j / nq;
                         o < o0 + (pf_end - o0) * (j + 1) / nq; o++) {
                        prefetch_bytes(k_next + o * stride, block_bytes);
                        prefetch_bytes(k_next + half_bytes + o * stride, block_bytes);
                    }
                    weigh_head(qb + (int64_t)j * D, k + (int64_t)h * D * 2, n, stride, NP, scale,
                               m + j, l + j, corr + g, w + 16 * g);
                }
                const char *vh = v + (int64_t)h * D * 2;
                for (int g = 0; g < G; g += GB) {
                    float *a = acc + (int64_t)(j0 + g) * D;
                    switch (G - g < GB ? G - g : GB) {
                    case 1: weigh16(a, corr + g, w + 16 * g, vh, n, stride, NV, 1); break;
                    case 2: weigh16(a, corr + g, w + 16 * g, vh, n, stride, NV, 2); break;
                    case 3: weigh16(a, corr + g, w + 16 * g, vh, n, stride, NV, 3); break;
                    default: weigh16(a, corr + g, w + 16 * g, vh, n, stride, NV, 4); break;
                    }
                }
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        float *aj = acc + (int64_t)j * D;
        const float inv = 1.0f / l[j];
#pragma omp simd
        for (int d = 0; d < D; d++) aj[d] *= inv;
    }
}
#endif

/* Everything the tasks of one call share. */
typedef struct {
    const void *q, *pool;
    const int32_t *page_table;
    const int64_t *q_rows, *table_rows, *seq_lens;
    void *out;
    int64_t q_stride, table_stride, out_stride;
    int Hkv, G, D, P, heads_per_task;
    float scale;
    int64_t num_tasks;
    int into_l1; /* rows_into_l1() */
    int v_spread; /* v_rows_spread() */
} Call;

/* Task `task` (sequence task / blocks, KV heads from (task % blocks) * heads_per_task) for one
 * dtype and head size: called with constants, so each specialisation below compiles its loops
 * for that D. buf holds heads_per_task * G * (P16 + 2 + 2 * D) floats, P16 = P rounded up to
 * 16. */
INLINE void task_body(const Call *c, int64_t task, int64_t next_task, float *buf, int bf16,
                      int D) {
    const int nh = c->heads_per_task, nq = nh * c->G, blocks = c->Hkv / nh;
    const int64_t i = task / blocks;
    const int h0 = (int)(task % blocks) * nh;
    const int64_t len = c->seq_lens[i];
    const int64_t esize = bf16 ? 2 : 4;
    float *scores = buf, *ml = buf + (int64_t)nq * ((c->P + 15) / 16 * 16), *qf = ml + 2 * nq;
    float *acc = qf + (int64_t)nq * D;
    const int64_t head0 = (int64_t)h0 * c->G * D; /* first element of the block's query heads */
    const char *qr = (const char *)c->q + (c->q_rows[i] * c->q_stride + head0) * esize;
    const int paired = bf16 && (D == 64 || D == 128); /* loadc's pair order */
    /* the next task's first page (this thread's next: tasks go round-robin), prefetched
     * during this one's last page */
    const char *nx_first = NULL;
    int64_t nx_rows = 0;
    if (next_task < c->num_tasks) {
        const int64_t ni = next_task / blocks;
        const int nh0 = (int)(next_task % blocks) * nh;
        const int64_t nlen = c->seq_lens[ni];
        if (nlen > 0) {
            const int32_t page = c->page_table[c->table_rows[ni] * c->table_stride];
            nx_first = (const char *)c->pool
                       + ((int64_t)page * 2 * c->P * c->Hkv * D + (int64_t)nh0 * D) * esize;
            nx_rows = nlen < c->P ? nlen : c->P;
        }
    }
#ifdef HAVE_DPBF16
    if (paired && len > 0) {
        /* the weights in scores (G * 16 floats of nq * P16), the rescalings in qf */
        attend_pairs(c->pool, c->page_table + c->table_rows[i] * c->table_stride, len, h0, nh,
                     c->Hkv, c->G, D, c->P, c->scale, (const uint16_t *)qr, scores, qf, ml,
                     acc, nx_first, nx_rows, c->v_spread);
    } else
#endif
    {
    for (int64_t e = 0; e < (int64_t)nq * D; e++)
        qf[paired ? e / D * D + perm((int)(e % D)) : e] = load(qr, e, bf16);
    if (len <= 0) { /* no keys: nothing to attend to (the engine never asks this) */
        memset(acc, 0, sizeof(float) * (size_t)nq * (size_t)D);
    } else {
        attend(c->pool, c->page_table + c->table_rows[i] * c->table_stride, len, h0, nh, c->Hkv,
               c->G, D, c->P, c->scale, bf16, qf, scores, ml, acc, nx_first, nx_rows, c->into_l1,
               c->v_spread);
    }
    }
    char *orow = (char *)c->out + (c->q_rows[i] * c->out_stride + head0) * esize;
    if (bf16) {
        for (int64_t e = 0; e < (int64_t)nq * D; e++)
            ((uint16_t *)orow)[e] = f32_to_bf16(acc[paired ? e / D * D + perm((int)(e % D)) : e]);
    } else {
        memcpy(orow, acc, sizeof(float) * (size_t)nq * (size_t)D);
    }
}

typedef void (*TaskFn)(const Call *, int64_t, int64_t, float *);

#define SPECIALISE(NAME, BF16, DIM)                                                        \
    static void NAME(const Call *c, int64_t task, int64_t next, float *buf) {              \
        task_body(c, task, next, buf, BF16, DIM);                                          \
    }
SPECIALISE(task_f32_d64, 0, 64)
SPECIALISE(task_f32_d128, 0, 128)
SPECIALISE(task_f32_any, 0, c->D)
SPECIALISE(task_bf16_d64, 1, 64)
SPECIALISE(task_bf16_d128, 1, 128)
SPECIALISE(task_bf16_any, 1, c->D)

/* dtype: 0 float32, 1 bfloat16. Returns 0 on success, 1 if a per-thread buffer could not be
 * allocated (some rows then unwritten), 2 for a bad argument (an unknown dtype or a
 * non-positive size). */
int loraplex_decode_attention(const void *q, int64_t q_stride, const void *pool,
                              const int32_t *page_table, int64_t table_stride,
                              const int64_t *q_rows, const int64_t *table_rows,
                              const int64_t *seq_lens, void *out, int64_t out_stride,
                              int64_t num_seqs, int Hkv, int G, int D, int P, float scale,
                              int num_threads, int dtype) {
    if (num_seqs <= 0) return 0;
    if (Hkv <= 0 || G <= 0 || D <= 0 || P <= 0 || num_threads <= 0 || (dtype != 0 && dtype != 1))
        return 2;
    static const TaskFn fns[2][3] = {{task_f32_d64, task_f32_d128, task_f32_any},
                                     {task_bf16_d64, task_bf16_d128, task_bf16_any}};
    const TaskFn fn = fns[dtype][D == 64 ? 0 : D == 128 ? 1 : 2];
    /* whole tokens per task where sequences alone give each thread a few tasks */
    const int heads_per_task = num_seqs >= 4 * (int64_t)num_threads ? Hkv : 1;
    const int64_t num_tasks = num_seqs * (Hkv / heads_per_task);
    const Call c = {q, pool, page_table, q_rows, table_rows, seq_lens, out, q_stride,
                    table_stride, out_stride, Hkv, G, D, P, heads_per_task, scale, num_tasks,
                    rows_into_l1(), v_rows_spread()};
    const size_t buf_floats = (size_t)heads_per_task * (size_t)G
                              * (size_t)((P + 15) / 16 * 16 + 2 + 2 * D);
    int failed = 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_tasks > 1)
    {
        /* 64-byte aligned, as every thread's: the generic head sizes' simd loops peel by
         * alignment, so a result must not depend on which thread's buffer a task gets (tasks
         * are dealt round-robin) */
        float *buf = aligned_alloc(64, (sizeof(float) * buf_floats + 63) / 64 * 64);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int nt = 1;
#ifdef _OPENMP
        nt = omp_get_num_threads();
#endif
#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (buf != NULL) fn(&c, task, task + nt, buf);
        }
        free(buf);
    }
    return failed;
}
