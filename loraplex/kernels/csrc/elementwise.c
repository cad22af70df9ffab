/* Fused elementwise ops of the Llama forward pass on CPU: RMSNorm (with the residual add),
 * SiLU(gate) * up and RoPE, each one pass over a row instead of torch's three to five; and, at
 * the end, greedy sampling's row argmax and the KV cache's store (a reduction and a copy).
 *
 * Every op reproduces the roundings of the torch code it replaces (llama.py, rope.py), so the
 * results are bit-identical to it with one torch thread on AVX2/AVX512 machines:
 *   - float32 math; a bfloat16 value becomes float as (bits << 16) and a float becomes bf16
 *     by round-to-nearest-even, at exactly the points where torch's bf16 ops round;
 *   - the RMSNorm sum of squares follows torch's cascade sum (aten/src/ATen/native/cpu/
 *     SumKernel.cpp: `lanes`-wide vector accumulators, 4-way ILP, a 4-level cascade, then the
 *     scalar tail and the lanes in order), `lanes` being torch's Vectorized<float>::size();
 *   - exp in SiLU is Sleef's expf_u10 (what torch's vectorised silu calls, FMA form) on the
 *     elements torch's vector loop covers, libm's expf on the row's tail that torch's scalar
 *     loop covers (`vec_block` elements per vector iteration).
 * Built with -std=c11, so GCC does not contract a*b+c into fma behind our back (that would
 * change roundings); the fmaf calls below are the ones Sleef makes.
 *
 * dtype codes: 0 float32, 1 bfloat16. Tensors are contiguous rows; threads split rows.
 */
/* AVX512 machines: use the 16-lane registers (GCC prefers 256-bit vectors for many -march).
 * Only there: on an AVX2 machine a preferred width of 512 bits has no vector type, and GCC
 * then vectorises none of these loops (SiLU * up ran scalar, ~10x slower, on Zen 3). */
#ifdef __AVX512F__
#pragma GCC target("prefer-vector-width=512")
#endif
/* Sleef's exp below is selects; without AVX-512's mask registers GCC if-converts (and so
 * vectorises) them only when FP compares may not trap. No value changes: no reassociation,
 * no contraction, same roundings (the bit-equality tests run on both kinds of machine). */
#ifndef __clang__
#pragma GCC optimize("no-trapping-math")
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF /* clang contracts within expressions by default */
#endif

typedef uint16_t bf16_t;

static inline float bf2f(bf16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even. No NaN case: every float rounded here is the result of float32
 * arithmetic on bf16 inputs, so a NaN is a widened bf16 NaN's payload or the default NaN,
 * both with the low 16 bits zero: the rounding add cannot carry out of it, and NaN stays NaN
 * (quiet, sign kept). */
static inline bf16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf(float f) { return bf2f(f2bf(f)); }

/* ---- RMSNorm ---------------------------------------------------------------------------- */

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t r = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) r++;
    return r;
}

#define MAX_LANES 16

/* sum(x[i]^2) in the order of torch's cascade_sum over a contiguous row (squares rounded to
 * float first, as h.pow(2) stores them). width 1: torch's scalar inner sum (rows shorter
 * than a vector); width `lanes`: its vectorised inner sum. */
static inline __attribute__((always_inline)) float sum_squares_w(const float *restrict x,
                                                                  int64_t n, int64_t width) {
    const int64_t units = n / width, size_ilp = units / 4;
    float acc[4][4][MAX_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t level_power = ceil_log2(size_ilp) / 4;
    if (level_power < 4) level_power = 4;
    const int64_t step = (int64_t)1 << level_power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= size_ilp) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t k = 0; k < 4; k++) {
                const float *v = x + (i * 4 + k) * width;
                for (int64_t l = 0; l < width; l++) acc[0][k][l] += v[l] * v[l];
            }
        for (int64_t j = 1; j < 4; j++) {
            for (int64_t k = 0; k < 4; k++)
                for (int64_t l = 0; l < width; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size_ilp; i++)
        for (int64_t k = 0; k < 4; k++) {
            const float *v = x + (i * 4 + k) * width;
            for (int64_t l = 0; l < width; l++) acc[0][k][l] += v[l] * v[l];
        }
    for (int64_t j = 1; j < 4; j++)
        for (int64_t k = 0; k < 4; k++)
            for (int64_t l = 0; l < width; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t u = size_ilp * 4; u < units; u++) {
        const float *v = x + u * width;
        for (int64_t l = 0; l < width; l++) acc[0][0][l] += v[l] * v[l];
    }
    for (int64_t k = 1; k < 4; k++)
        for (int64_t l = 0; l < width; l++) acc[0][0][l] += acc[0][k][l];
    if (width == 1) return acc[0][0][0];
    float total = 0.0f;
    for (int64_t e = units * width; e < n; e++) total += x[e] * x[e];
    for (int64_t l = 0; l < width; l++) total += acc[0][0][l];
    return total;
}

/* width a compile-time constant in each call, so the accumulators live in registers */
static float sum_squares(const float *restrict x, int64_t n, int64_t width) {
    if (width == 8) return sum_squares_w(x, n, 8);
    if (width == 16) return sum_squares_w(x, n, 16);
    if (width == 4) return sum_squares_w(x, n, 4);
    return sum_squares_w(x, n, 1);
}

/* 1 / sqrt(mean(h^2) + eps): torch's sum, then div_ by n, + eps, then rsqrt as 1 / sqrt */
static inline float inv_rms(const float *restrict h, int64_t n, float eps, int64_t lanes) {
    float total = sum_squares(h, n, n >= lanes ? lanes : 1);
    return 1.0f / sqrtf(total / (float)n + eps);
}

/* out = weight * bf16(h * r) in bf16, weight * (h * r) in float32 (HF's rms_norm) */
static void normalise_f32(const float *restrict h, const float *restrict w,
                          float *restrict out, int64_t n, float r) {
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (h[i] * r);
}

static void normalise_bf16(const float *restrict h, const bf16_t *restrict w,
                           bf16_t *restrict out, int64_t n, float r) {
    for (int64_t i = 0; i < n; i++) out[i] = f2bf(bf2f(w[i]) * round_bf(h[i] * r));
}

/* Semantics: hidden[t] += delta[t] (when delta is not NULL), out[t] = rms_norm(hidden[t]).
 * hidden, delta, out: [rows, n] contiguous; weight: [n]; all of `dtype`. */
void loraplex_add_rms_norm(int dtype, void *hidden, const void *delta, const void *weight,
                           void *out, int64_t rows, int64_t n, float eps, int64_t lanes,
                           int threads) {
    if (lanes > MAX_LANES) lanes = MAX_LANES;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (dtype == 0) {
            float *h = (float *)hidden + t * n;
            if (delta) {
                const float *d = (const float *)delta + t * n;
                for (int64_t i = 0; i < n; i++) h[i] += d[i];
            }
            normalise_f32(h, (const float *)weight, (float *)out + t * n, n,
                          inv_rms(h, n, eps, lanes));
        } else {
            bf16_t *h = (bf16_t *)hidden + t * n;
            float buf[n]; /* the row in float32: h.to(float32), then reused to normalise */
            if (delta) {
                const bf16_t *d = (const bf16_t *)delta + t * n;
                for (int64_t i = 0; i < n; i++) {
                    h[i] = f2bf(bf2f(h[i]) + bf2f(d[i]));
                    buf[i] = bf2f(h[i]);
                }
            } else {
                for (int64_t i = 0; i < n; i++) buf[i] = bf2f(h[i]);
            }
            normalise_bf16(buf, (const bf16_t *)weight, (bf16_t *)out + t * n, n,
                           inv_rms(buf, n, eps, lanes));
        }
    }
}

/* ---- SiLU(gate) * up -------------------------------------------------------------------- */

static inline float pow2i(int32_t q) {
    uint32_t u = (uint32_t)(q + 0x7f) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Sleef's xexpf (u10), lane for lane: same constants, same FMAs, same ldexp split. Written
 * with selects and no libm rounding call so that GCC vectorises it. */
static inline float sleef_expf(float d) {
    /* q only matters inside [-104, 100] (results outside are overridden); the compares are
     * false for NaN, which so gets a finite q too (and stays NaN through s) */
    float c = d > -128.0f ? d : -128.0f;
    c = c < 128.0f ? c : 128.0f;
    /* round to nearest even, as Sleef's vrint: exact for |x| < 2^22 */
    const float qf = (c * 1.442695040888963407359924681001892137426645954152985934f
                      + 12582912.0f) - 12582912.0f;
    const int32_t q = (int32_t)qf;
    float s = fmaf(qf, -0.693145751953125f, d);
    s = fmaf(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = (u * pow2i(q >> 1)) * pow2i(q - (q >> 1));
    u = d < -104.0f ? 0.0f : u;
    return 100.0f < d ? INFINITY : u;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* sleef_expf on 16 lanes that all lie in [-104, 100], where none of its clamps or overrides
 * applies: the same operations in the same order (the products and sums unfused where Sleef's
 * are, its FMAs as FMAs), and 2^q applied by one vscalefps: u * 2^q rounded once, as Sleef's
 * two exact-then-rounding multiplies by 2^(q >> 1) and 2^(q - (q >> 1)) are (a subnormal
 * result rounds the same way in both), without their integer exponent arithmetic. */
static inline __m512 sleef_expf16(__m512 d) {
    const __m512 m = _mm512_set1_ps(12582912.0f);
    const __m512 qf = _mm512_sub_ps(
        _mm512_add_ps(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934f)),
                      m),
        m);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    return _mm512_scalef_ps(u, qf);
}

/* the lanes of -g (exp's argument) all inside sleef_expf16's range (NaN is not) */
static inline int exp_args_in_range(__m512 d) {
    return (__mmask16)(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_GE_OQ)
                       & _mm512_cmp_ps_mask(d, _mm512_set1_ps(100.0f), _CMP_LE_OQ)) == 0xFFFF;
}

/* g / (1 + sleef_expf(-g)) on 16 lanes; in_range: exp_args_in_range(-g) */
static inline __m512 silu16(__m512 g, __m512 neg, int *in_range) {
    *in_range &= exp_args_in_range(neg);
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), sleef_expf16(neg)));
}

/* f2bf on 16 lanes, in each 32-bit lane's low half */
static inline __m512i f2bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd),
                             16);
}

/* The SiLU loops' vector body in AVX-512 intrinsics, 32 elements a step in two independent
 * halves (the compiler's own vectorisation of the loops below made each element's exp a chain
 * of masked selects and integer exponent steps, and a bf16 row's halves one shuffle each way):
 * the same bits as those loops, 1.2-1.5x faster on a Zen 5 core (float32 and bf16, 64 and 1536
 * rows of SmolLM2's 1536-wide gate). A step whose arguments leave [-104, 100] (large gates,
 * inf, NaN) takes the loops' scalar form. Returns how many of n elements it wrote. */
static int64_t silu_mul_f32_avx512(const float *restrict g, const float *restrict up,
                                   float *restrict o, int64_t n) {
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m512 ga = _mm512_loadu_ps(g + j), gb = _mm512_loadu_ps(g + j + 16);
        int ok = 1;
        const __m512 sa = silu16(ga, _mm512_sub_ps(_mm512_setzero_ps(), ga), &ok);
        const __m512 sb = silu16(gb, _mm512_sub_ps(_mm512_setzero_ps(), gb), &ok);
        if (!ok) {
            for (int64_t e = j; e < j + 32; e++) o[e] = g[e] / (1.0f + sleef_expf(-g[e])) * up[e];
            continue;
        }
        _mm512_storeu_ps(o + j, _mm512_mul_ps(sa, _mm512_loadu_ps(up + j)));
        _mm512_storeu_ps(o + j + 16, _mm512_mul_ps(sb, _mm512_loadu_ps(up + j + 16)));
    }
    return j;
}

/* bf16: 32 elements as two 32-bit lanes' halves (even elements << 16, odd ones masked), so
 * that widening and narrowing are one integer op each */
static int64_t silu_mul_bf16_avx512(const bf16_t *restrict g, const bf16_t *restrict up,
                                    bf16_t *restrict o, int64_t n) {
    const __m512i high = _mm512_set1_epi32((int32_t)0xFFFF0000u);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m512i g2 = _mm512_loadu_si512(g + j), u2 = _mm512_loadu_si512(up + j);
        const __m512 ga = _mm512_castsi512_ps(_mm512_slli_epi32(g2, 16));
        const __m512 gb = _mm512_castsi512_ps(_mm512_and_si512(g2, high));
        int ok = 1;
        const __m512 sa = silu16(ga, _mm512_sub_ps(_mm512_setzero_ps(), ga), &ok);
        const __m512 sb = silu16(gb, _mm512_sub_ps(_mm512_setzero_ps(), gb), &ok);
        if (!ok) {
            for (int64_t e = j; e < j + 32; e++) {
                const float x = bf2f(g[e]);
                o[e] = f2bf(round_bf(x / (1.0f + sleef_expf(-x))) * bf2f(up[e]));
            }
            continue;
        }
        /* silu rounded to bf16, times up, rounded again */
        const __m512 ra = _mm512_castsi512_ps(_mm512_slli_epi32(f2bf16(sa), 16));
        const __m512 rb = _mm512_castsi512_ps(_mm512_slli_epi32(f2bf16(sb), 16));
        const __m512 ua = _mm512_castsi512_ps(_mm512_slli_epi32(u2, 16));
        const __m512 ub = _mm512_castsi512_ps(_mm512_and_si512(u2, high));
        const __m512i pa = f2bf16(_mm512_mul_ps(ra, ua)), pb = f2bf16(_mm512_mul_ps(rb, ub));
        _mm512_storeu_si512(o + j, _mm512_or_si512(pa, _mm512_slli_epi32(pb, 16)));
    }
    return j;
}
#endif

/* Semantics: out[t, j] = silu(x[t, j]) * x[t, inter + j], silu(g) = g / (1 + exp(-g)), with
 * silu rounded to the dtype before the product (torch's in-place F.silu, then `* up`).
 * gate_up: [rows, 2 * inter]; out: [rows, inter]; vec_block: elements per iteration of
 * torch's vector loop (2 * Vectorized<scalar_t>::size()): the first inter - inter % vec_block
 * of a row take Sleef's exp, the rest libm's. */
void loraplex_silu_and_mul(int dtype, const void *gate_up, void *out, int64_t rows,
                           int64_t inter, int64_t vec_block, int threads) {
    const int64_t vec_end = vec_block > 0 ? inter - inter % vec_block : 0;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (dtype == 0) {
            const float *restrict g = (const float *)gate_up + t * 2 * inter;
            const float *restrict up = g + inter;
            float *restrict o = (float *)out + t * inter;
            int64_t done = 0;
#ifdef __AVX512F__
            done = silu_mul_f32_avx512(g, up, o, vec_end);
#endif
            for (int64_t j = done; j < vec_end; j++) o[j] = g[j] / (1.0f + sleef_expf(-g[j])) * up[j];
            for (int64_t j = vec_end; j < inter; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * up[j];
        } else {
            const bf16_t *restrict g = (const bf16_t *)gate_up + t * 2 * inter;
            const bf16_t *restrict up = g + inter;
            bf16_t *restrict o = (bf16_t *)out + t * inter;
            int64_t done = 0;
#ifdef __AVX512F__
            done = silu_mul_bf16_avx512(g, up, o, vec_end);
#endif
            for (int64_t j = done; j < vec_end; j++) {
                const float x = bf2f(g[j]);
                o[j] = f2bf(round_bf(x / (1.0f + sleef_expf(-x))) * bf2f(up[j]));
            }
            for (int64_t j = vec_end; j < inter; j++) {
                const float x = bf2f(g[j]);
                o[j] = f2bf(round_bf(x / (1.0f + expf(-x))) * bf2f(up[j]));
            }
        }
    }
}

/* ---- RoPE ------------------------------------------------------------------------------- */

/* One head: out = [x1 * c - x2 * s, x2 * c + x1 * s] (rotate_half's roundings: each product
 * rounded, then the sum rounded); c = cos[:half] (= cos[half:]), s = sin[:half]. */
static inline void rotate_f32(const float *restrict x, const float *restrict c,
                              const float *restrict s, float *restrict out, int64_t half) {
    for (int64_t j = 0; j < half; j++) {
        out[j] = x[j] * c[j] - x[j + half] * s[j];
        out[j + half] = x[j + half] * c[j + half] + x[j] * s[j];
    }
}

static inline void rotate_bf16(const bf16_t *restrict x, const bf16_t *restrict c,
                               const bf16_t *restrict s, bf16_t *restrict out, int64_t half) {
    for (int64_t j = 0; j < half; j++) {
        const float x1 = bf2f(x[j]), x2 = bf2f(x[j + half]), sj = bf2f(s[j]);
        out[j] = f2bf(round_bf(x1 * bf2f(c[j])) - round_bf(x2 * sj));
        out[j + half] = f2bf(round_bf(x2 * bf2f(c[j + half])) + round_bf(x1 * sj));
    }
}

/* Semantics: q_out[t, h] = rope(qkv[t, h * D : (h + 1) * D]) for the num_heads query heads and
 * k_out[t, h] likewise for the num_kv_heads key heads that follow them in the row.
 * qkv: [rows, qkv_stride] (q then k then v); cos, sin: [rows, D]; q_out: [rows, num_heads, D];
 * k_out: [rows, num_kv_heads, D]; all of `dtype`, D = head_dim even. */
void loraplex_rope_qk(int dtype, const void *qkv, int64_t qkv_stride, const void *cos,
                      const void *sin, void *q_out, void *k_out, int64_t rows,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2, heads = num_heads + num_kv_heads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t src = t * qkv_stride + h * head_dim;
            const int64_t dst = h < num_heads ? (t * num_heads + h) * head_dim
                                              : (t * num_kv_heads + h - num_heads) * head_dim;
            if (dtype == 0) {
                float *o = h < num_heads ? (float *)q_out : (float *)k_out;
                rotate_f32((const float *)qkv + src, (const float *)cos + t * head_dim,
                           (const float *)sin + t * head_dim, o + dst, half);
            } else {
                bf16_t *o = h < num_heads ? (bf16_t *)q_out : (bf16_t *)k_out;
                rotate_bf16((const bf16_t *)qkv + src, (const bf16_t *)cos + t * head_dim,
                            (const bf16_t *)sin + t * head_dim, o + dst, half);
            }
        }
    }
}

/* Greedy sampling's reduction: each row's maximum and the first index holding it, as
 * torch.max(x, dim=-1) gives them (that op runs one element at a time on the CPU: about 1 ms
 * for 64 rows of a 32000-token vocabulary on a Zen 5 core, ten times its amax). float32 rows,
 * `stride` elements apart. A row holding a NaN has maximum NaN and the index of its first NaN
 * (torch propagates NaN the same way); otherwise the maximum over the row (+-inf included)
 * and its first index. Two passes a row: the lane maxima and a NaN flag (vectors of
 * LANES floats, compared and selected: no reassociation, a maximum is exact in any order),
 * then the first element equal to the maximum, which stops there. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float lanes_f __attribute__((vector_size(4 * LANES), aligned(4)));
typedef int32_t lanes_i __attribute__((vector_size(4 * LANES), aligned(4)));

/* the lanes where v > m take v (a NaN in v never does) */
static inline lanes_f lanes_max(lanes_f m, lanes_f v) {
    const lanes_i gt = v > m;
    return (lanes_f)(((lanes_i)v & gt) | ((lanes_i)m & ~gt));
}

static inline int lanes_any(lanes_i e) {
    uint64_t w[LANES / 2], any = 0;
    memcpy(w, &e, sizeof w);
    for (int l = 0; l < LANES / 2; l++) any |= w[l];
    return any != 0;
}

void loraplex_row_argmax(const float *x, int64_t stride, int64_t rows, int64_t n, float *maxes,
                         int64_t *index, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        /* four accumulators: the compare-and-select chain is the loop's latency */
        lanes_f m[4];
        lanes_i nan = {0};
        for (int a = 0; a < 4; a++)
            for (int l = 0; l < LANES; l++) m[a][l] = -INFINITY;
        int64_t i = 0;
        for (; i + 4 * LANES <= n; i += 4 * LANES) {
            for (int a = 0; a < 4; a++) {
                lanes_f v;
                memcpy(&v, row + i + a * LANES, sizeof v);
                nan |= v != v;
                m[a] = lanes_max(m[a], v);
            }
        }
        const lanes_f mm = lanes_max(lanes_max(m[0], m[1]), lanes_max(m[2], m[3]));
        float best = -INFINITY;
        int any_nan = lanes_any(nan);
        for (int l = 0; l < LANES; l++) best = mm[l] > best ? mm[l] : best;
        for (int64_t j = i; j < n; j++) {
            best = row[j] > best ? row[j] : best;
            any_nan |= row[j] != row[j];
        }
        int64_t at = 0;
        if (any_nan) {
            while (at < n && row[at] == row[at]) at++;
            best = NAN;
        } else {
            const lanes_f b = (lanes_f){0} + best;
            for (i = 0; i + 4 * LANES <= n; i += 4 * LANES) {
                lanes_f v[4];
                memcpy(v, row + i, sizeof v);
                if (lanes_any((v[0] == b) | (v[1] == b) | (v[2] == b) | (v[3] == b))) break;
            }
            at = i;
            while (at < n && row[at] != best) at++;
            if (at == n) at = 0; /* n == 0 */
        }
        maxes[r] = best;
        index[r] = at;
    }
}

/* The KV cache's store: token t's K row (row_bytes: its heads' elements, contiguous) to slot
 * s = slots[t] of a layer's pool seen as [num_pages, 2, P, row], at [s / P, 0, s % P] and its
 * V row at [s / P, 1, s % P] (loraplex/kernels/reference.py write_kv): one copy a row, where
 * torch's indexed store spent ~50 us a layer on 64 tokens. Every slot is checked first: returns
 * 1 (nothing written) when one is outside [0, num_slots), else 0. */
int loraplex_write_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                      char *pool, const int64_t *slots, int64_t tokens, int64_t row_bytes,
                      int64_t page_size, int64_t num_slots, int threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t page = slots[t] / page_size, off = slots[t] % page_size;
        char *dst = pool + (page * 2 * page_size + off) * row_bytes;
        memcpy(dst, k + t * k_stride, (size_t)row_bytes);
        memcpy(dst + page_size * row_bytes, v + t * v_stride, (size_t)row_bytes);
    }
    return 0;
}
