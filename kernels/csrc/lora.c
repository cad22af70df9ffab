/* LoRA of short segments (decode rows, small chunks) for one fused projection in one call.
 *
 * Semantics, for each segment s (rows lo:hi, scale_s) and each module m of its table:
 *     h = x[lo:hi] @ A_m^T                          float32 accumulate, [rows, rank_m]
 *     y[lo:hi, start_m:end_m] += scale_s * h @ BT_m  float32 accumulate, y rounded once
 * A_m is [rank_m, d_in] and BT_m [rank_m, end_m - start_m], both row-major with unit element
 * stride, read in place (views of the pool's pages) in float32 or bfloat16. h is never rounded
 * (torch's widened short-segment path does the same). x and y are float32 or bfloat16; a bf16
 * y element is widened, gets its float32 delta and is rounded to nearest even once, as torch's
 * `y.add_(float32 delta)` rounds it.
 *
 * Why one C call: on a CPU a decode step's LoRA is many tiny products (segments x layers x
 * projections); as torch ops each costs a fixed ~5 us whatever its size, here a few hundred ns.
 *
 * Work is split in two phases, each parallel over OpenMP threads when num_threads > 1:
 * shrinks per (segment, module), then expands per (segment, module, column tile). Segments must
 * not share rows and a table's modules must not share columns (the engine's fused slices):
 * no two work items write the same element of y.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1 };
/* An expand work item's columns: as wide as its rows' float32 sums fit in 32 KB (L1), so
 * that one row's B^T is read in long runs (a decode row: the module's whole width, one
 * sequential stream over the block), and at least 256. */
enum { ACC_FLOATS = 8192, MIN_TILE = 256 };

static inline int64_t tile_of(int64_t rows) {
    int64_t t = (ACC_FLOATS / (rows > 0 ? rows : 1)) & ~(int64_t)63;
    return t > MIN_TILE ? t : MIN_TILE;
}

/* One module of a segment's table; Python builds these once per resident adapter's group. */
typedef struct {
    int64_t a, a_stride;  /* A: address, elements between rank rows */
    int64_t b, b_stride;  /* BT: address, elements between rank rows */
    int64_t rank, start, end;  /* the module's rank and its columns of y */
    int64_t d_in, dtype;  /* A's row length (checked against x) and the blocks' dtype */
} module_t;

/* One segment of the call: its rows, its table (module_t[num_modules]) and h's offset. */
typedef struct {
    int64_t lo, hi, table, num_modules;
} segment_t;

static inline float bf2f(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {
    /* torch's round_to_nearest_even; a NaN stays a (quiet) NaN with its sign */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

static void widen(const uint16_t *restrict in, float *restrict out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bf2f(in[i]);
}

static inline const module_t *modules_of(const segment_t *s) {
    return (const module_t *)(intptr_t)s->table;
}

/* A's row k as float32: in place, or widened into buf */
static inline const float *row_f32(int64_t base, int64_t stride, int64_t k, int64_t dtype,
                                   int64_t n, float *buf) {
    if (dtype == DT_F32) return (const float *)(intptr_t)base + k * stride;
    widen((const uint16_t *)(intptr_t)base + k * stride, buf, n);
    return buf;
}

/* h[i * hs + k] = x_i . A_k for the module's ranks. Ranks four at a time: four independent
 * sums (a decode segment is often one row, and one sum is a chain of dependent FMAs), each
 * load of x serving four A rows that stay in L1 for the segment's other rows. */
static void shrink(const float *restrict x, int64_t xs, int64_t rows, int64_t d_in,
                   const module_t *m, float *restrict h, int64_t hs, float *buf) {
    int64_t k = 0;
    for (; k + 4 <= m->rank; k += 4) {
        const float *restrict a0 = row_f32(m->a, m->a_stride, k, m->dtype, d_in, buf);
        const float *restrict a1 = row_f32(m->a, m->a_stride, k + 1, m->dtype, d_in,
                                           buf + d_in);
        const float *restrict a2 = row_f32(m->a, m->a_stride, k + 2, m->dtype, d_in,
                                           buf + 2 * d_in);
        const float *restrict a3 = row_f32(m->a, m->a_stride, k + 3, m->dtype, d_in,
                                           buf + 3 * d_in);
        int64_t i = 0;
        for (; i + 2 <= rows; i += 2) {
            const float *restrict x0 = x + i * xs, *restrict x1 = x0 + xs;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0, t0 = 0, t1 = 0, t2 = 0, t3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, t0, t1, t2, t3)
            for (int64_t d = 0; d < d_in; d++) {
                const float u = x0[d], v = x1[d];
                s0 += u * a0[d];
                s1 += u * a1[d];
                s2 += u * a2[d];
                s3 += u * a3[d];
                t0 += v * a0[d];
                t1 += v * a1[d];
                t2 += v * a2[d];
                t3 += v * a3[d];
            }
            float *h0 = h + i * hs + k, *h1 = h0 + hs;
            h0[0] = s0, h0[1] = s1, h0[2] = s2, h0[3] = s3;
            h1[0] = t0, h1[1] = t1, h1[2] = t2, h1[3] = t3;
        }
        for (; i < rows; i++) {
            const float *restrict x0 = x + i * xs;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t d = 0; d < d_in; d++) {
                const float u = x0[d];
                s0 += u * a0[d];
                s1 += u * a1[d];
                s2 += u * a2[d];
                s3 += u * a3[d];
            }
            float *h0 = h + i * hs + k;
            h0[0] = s0, h0[1] = s1, h0[2] = s2, h0[3] = s3;
        }
    }
    for (; k < m->rank; k++) {
        const float *restrict a = row_f32(m->a, m->a_stride, k, m->dtype, d_in, buf);
        for (int64_t i = 0; i < rows; i++) {
            const float *restrict xi = x + i * xs;
            float s = 0;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < d_in; d++) s += xi[d] * a[d];
            h[i * hs + k] = s;
        }
    }
}

/* y[i, c0:c1] += scale * h_i @ BT[:, c0 - start : c1 - start] for every row i */
static void expand(const float *restrict h, int64_t hs, int64_t rows, const module_t *m,
                   int64_t c0, int64_t c1, float scale, char *y, int64_t ys, int64_t y_dtype,
                   float *restrict acc, float *buf) {
    const int64_t n = c1 - c0, off = c0 - m->start;
    memset(acc, 0, (size_t)(rows * n) * sizeof(float));
    for (int64_t k = 0; k < m->rank; k++) {
        const float *restrict b;
        if (m->dtype == DT_F32) {
            b = (const float *)(intptr_t)m->b + k * m->b_stride + off;
        } else {
            widen((const uint16_t *)(intptr_t)m->b + k * m->b_stride + off, buf, n);
            b = buf;
        }
        for (int64_t i = 0; i < rows; i++) {
            const float hk = h[i * hs + k];
            float *restrict ai = acc + i * n;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) ai[c] += hk * b[c];
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        const float *restrict ai = acc + i * n;
        if (y_dtype == DT_F32) {
            float *restrict yi = (float *)y + i * ys + c0;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) yi[c] += scale * ai[c];
        } else {
            uint16_t *restrict yi = (uint16_t *)y + i * ys + c0;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) yi[c] = f2bf(bf2f(yi[c]) + scale * ai[c]);
        }
    }
}

typedef struct {
    int32_t seg, mod;
    int64_t c0;
} item_t;

int64_t loraplex_lora_abi(void) { return 1; }

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
    /* checks, sizes of h (every segment's rows x its modules' total rank) and the items */
    int64_t h_total = 0, num_shrinks = 0, num_items = 0, max_acc = 0;
    int64_t *h_off = malloc((size_t)(num_segments + 1) * sizeof(int64_t));
    if (h_off == NULL) return 5;
    for (int64_t s = 0; s < num_segments; s++) {
        const segment_t *sg = &segs[s];
        if (sg->lo < 0 || sg->hi > num_rows || sg->lo > sg->hi) { free(h_off); return 1; }
        int64_t rank = 0;
        for (int64_t j = 0; j < sg->num_modules; j++) {
            const module_t *m = &modules_of(sg)[j];
            if (m->start < 0 || m->end > y_cols || m->start > m->end) { free(h_off); return 2; }
            if (m->d_in != d_in) { free(h_off); return 3; }
            if (m->dtype != DT_F32 && m->dtype != DT_BF16) { free(h_off); return 4; }
            rank += m->rank;
            const int64_t tile = tile_of(sg->hi - sg->lo);
            num_items += (m->end - m->start + tile - 1) / tile;
            if ((sg->hi - sg->lo) * tile > max_acc) max_acc = (sg->hi - sg->lo) * tile;
        }
        h_off[s] = h_total;
        h_total += (sg->hi - sg->lo) * rank;
        num_shrinks += sg->num_modules;
    }
    h_off[num_segments] = h_total;
    /* x widened once for bf16 (only the rows segments use are read) */
    const int64_t xs = io_dtype == DT_F32 ? x_stride : d_in;
    float *xw = NULL, *h = malloc((size_t)(h_total + 1) * sizeof(float));
    item_t *shrinks = malloc((size_t)(num_shrinks + 1) * sizeof(item_t));
    item_t *items = malloc((size_t)(num_items + 1) * sizeof(item_t));
    if (io_dtype == DT_BF16) xw = malloc((size_t)(num_rows * d_in + 1) * sizeof(float));
    int64_t rc = 0;
    if (h == NULL || shrinks == NULL || items == NULL || (io_dtype == DT_BF16 && xw == NULL)) {
        rc = 5;
        goto done;
    }
    int64_t ns = 0, ni = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const segment_t *sg = &segs[s];
        if (xw != NULL)
            for (int64_t i = sg->lo; i < sg->hi; i++)
                widen((const uint16_t *)x + i * x_stride, xw + i * d_in, d_in);
        for (int64_t j = 0; j < sg->num_modules; j++) {
            const module_t *m = &modules_of(sg)[j];
            shrinks[ns++] = (item_t){(int32_t)s, (int32_t)j, 0};
            for (int64_t c0 = m->start; c0 < m->end; c0 += tile_of(sg->hi - sg->lo))
                items[ni++] = (item_t){(int32_t)s, (int32_t)j, c0};
        }
    }
    const float *xf = xw != NULL ? xw : (const float *)x;
    const int64_t elem = io_dtype == DT_F32 ? 4 : 2;
    const int nt = num_threads > 1 ? (int)num_threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* per thread: four widened A rows or one BT tile, the expand's sums */
        float *buf = malloc((size_t)(4 * d_in > max_acc ? 4 * d_in : max_acc) * sizeof(float));
        float *acc = malloc((size_t)(max_acc + 1) * sizeof(float));
        if (buf == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic)
            for (int64_t t = 0; t < ns; t++) {
                const segment_t *sg = &segs[shrinks[t].seg];
                const module_t *mods = modules_of(sg);
                int64_t r0 = 0, rank = 0;
                for (int64_t j = 0; j < sg->num_modules; j++) {
                    if (j < shrinks[t].mod) r0 += mods[j].rank;
                    rank += mods[j].rank;
                }
                shrink(xf + sg->lo * xs, xs, sg->hi - sg->lo, d_in, &mods[shrinks[t].mod],
                       h + h_off[shrinks[t].seg] + r0, rank, buf);
            }
#pragma omp for schedule(dynamic)
            for (int64_t t = 0; t < ni; t++) {
                const segment_t *sg = &segs[items[t].seg];
                const module_t *mods = modules_of(sg);
                const module_t *m = &mods[items[t].mod];
                int64_t r0 = 0, rank = 0;
                for (int64_t j = 0; j < sg->num_modules; j++) {
                    if (j < items[t].mod) r0 += mods[j].rank;
                    rank += mods[j].rank;
                }
                const int64_t tile = tile_of(sg->hi - sg->lo);
                const int64_t c1 = items[t].c0 + tile < m->end ? items[t].c0 + tile : m->end;
                expand(h + h_off[items[t].seg] + r0, rank, sg->hi - sg->lo, m, items[t].c0, c1,
                       scales[items[t].seg], (char *)y + sg->lo * y_stride * elem, y_stride,
                       io_dtype, acc, buf);
            }
        }
        free(buf);
        free(acc);
    }
    if (failed) rc = 5;
done:
    free(h_off);
    free(h);
    free(shrinks);
    free(items);
    free(xw);
    return rc;
}
