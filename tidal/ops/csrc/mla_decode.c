/* Weight-absorbed MLA decode attention straight from the engine's KV pages (paged attention on
 * the CPU): the C form of tidal.ops.mla.mla_paged_decode's inner part.
 *
 * For sequence b, head h: o_lat[b, h] = sum_t softmax_t(scale * query[b, h] . row_t) row_t[:r],
 * over its length[b] cached rows row_t = [c | k_pe] (C values), which live in pages: token t is row
 * t % page_size of page table[b, t / page_size]; a page's rows start at
 * layer_base + page * page_stride. Every row is read once, in place, for all heads, with an online
 * softmax updated once per page (no gathered copy of the context, no padding). One thread computes
 * a whole sequence in a fixed order, so results do not depend on the batch or the thread count.
 *
 * query [B, n, C] float32, table [B, max_pages] int64, lengths [B] int64, o_lat [B, n, r] float32;
 * rows are float32 (bf16 == 0) or bfloat16 (bf16 == 1).
 *
 * mla_absorbed_decode: the same with the weight absorption on both sides, from kv_b_proj's weight
 * in place (see below).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_scalar.h"

/* One sequence: o_lat (acc [n, r]) from its query qb [n, C] over its `length` cached rows, pages
 * table[0 ..]; scratch m: 2 n + page_size (C + 1) floats. */
static void attend(const void *layer_base, int64_t page_stride, int64_t page_size, const int64_t *table,
                   int64_t length, const float *qb, float *acc, int64_t n, int64_t C, int64_t r, float scale,
                   int bf16, float *m) {
    float *l = m + n, *scores = m + 2 * n, *tile = scores + page_size;
    for (int64_t h = 0; h < n; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(n * r));
    for (int64_t t0 = 0; t0 < length; t0 += page_size) {  /* one page of rows at a time */
        const int64_t rows = length - t0 < page_size ? length - t0 : page_size;
        const int64_t page = table[t0 / page_size];
        const float *rows_f32 = (const float *)layer_base + page * page_stride;  /* a page's rows are contiguous */
        if (bf16)
            for (int64_t j = 0; j < rows * C; j++) tile[j] = load_value(layer_base, page * page_stride + j, 1);
        const float *restrict block = bf16 ? tile : rows_f32;
        for (int64_t h = 0; h < n; h++) {
            const float *restrict qh = qb + h * C;
            float *restrict ah = acc + h * r;
            float top = m[h];
            for (int64_t i = 0; i < rows; i++) {
                const float *restrict x = block + i * C;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t j = 0; j < C; j++) s += qh[j] * x[j];
                scores[i] = s * scale;
                if (scores[i] > top) top = scores[i];
            }
            if (top > m[h]) {  /* rescale what was accumulated against the new maximum */
                const float c = expf(m[h] - top);
                l[h] *= c;
                for (int64_t j = 0; j < r; j++) ah[j] *= c;
                m[h] = top;
            }
            for (int64_t i = 0; i < rows; i++) {
                const float p = expf(scores[i] - top);
                const float *restrict x = block + i * C;
                l[h] += p;
                for (int64_t j = 0; j < r; j++) ah[j] += p * x[j];
            }
        }
    }
    for (int64_t h = 0; h < n; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t j = 0; j < r; j++) acc[h * r + j] *= inv;
    }
}

void mla_paged_decode(const void *layer_base, int64_t page_stride, int64_t page_size, const int64_t *table,
                      int64_t max_pages, const int64_t *lengths, const float *query, float *o_lat, int64_t B,
                      int64_t n, int64_t C, int64_t r, float scale, int bf16, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t b = 0; b < B; b++) {
        float *m = malloc(sizeof(float) * (size_t)(2 * n + page_size * (C + 1)));
        if (m != NULL)
            attend(layer_base, page_stride, page_size, table + b * max_pages, lengths[b], query + b * n * C,
                   o_lat + b * n * r, n, C, r, scale, bf16, m);
        free(m);
    }
}

/* acc[0 .. r) += q * w[off .. off + r) (float32 or bfloat16 weights): element-wise, vectorised */
static inline void add_scaled_row(float *restrict acc, float q, const void *w, int64_t off, int64_t r, int w_bf16) {
    if (w_bf16) {
        const uint16_t *restrict p = (const uint16_t *)w + off;
        for (int64_t j = 0; j < r; j++) acc[j] += q * bf16_to_float(p[j]);
    } else {
        const float *restrict p = (const float *)w + off;
        for (int64_t j = 0; j < r; j++) acc[j] += q * p[j];
    }
}

/* a . w[off .. off + r): 8 partial sums (j mod 8) in order, then a fixed pairwise reduction and the
 * r % 8 tail: one order at every batch and thread count, and vectorisable without reassociation */
static inline float dot_row(const float *restrict a, const void *w, int64_t off, int64_t r, int w_bf16) {
    float part[8] = {0};
    const int64_t r8 = r / 8 * 8;
    if (w_bf16) {
        const uint16_t *restrict p = (const uint16_t *)w + off;
        for (int64_t j = 0; j < r8; j += 8)
            for (int l = 0; l < 8; l++) part[l] += a[j + l] * bf16_to_float(p[j + l]);
    } else {
        const float *restrict p = (const float *)w + off;
        for (int64_t j = 0; j < r8; j += 8)
            for (int l = 0; l < 8; l++) part[l] += a[j + l] * p[j + l];
    }
    float s = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
    for (int64_t j = r8; j < r; j++) s += a[j] * load_value(w, off + j, w_bf16);
    return s;
}

/* The whole absorbed decode of tidal.ops.mla.mla_paged_decode for one query per sequence, with
 * kv_b_proj's weight w [n * (dn + dv), r] (float32 or bfloat16: w_bf16) read in place, no float32
 * copy of it: query[h] = [q_nope[h] @ W_UK[h] | q_pe[h]] (W_UK[h] = rows h (dn + dv) .. + dn), the
 * paged attention above, then out[h] = o_lat[h] @ W_UV[h]^T (the next dv rows), stored in the
 * rows' dtype (out_bf16). q_nope [B, n, dn] and q_pe [B, n, C - r] (float32 or bfloat16: q_bf16)
 * at strides qn[0], qn[1] and qp[0], qp[1] (the last dim contiguous); out [B, n, dv] contiguous. One thread computes a
 * sequence in a fixed order (float32 sums over d, then over the rank): row-invariant. Returns 0, or
 * -1 when scratch memory cannot be allocated. */
int mla_absorbed_decode(const void *layer_base, int64_t page_stride, int64_t page_size, const int64_t *table,
                        int64_t max_pages, const int64_t *lengths, const void *q_nope, const void *q_pe,
                        const int64_t *qn, const int64_t *qp, int q_bf16, const void *w, int w_bf16, void *out, int out_bf16,
                        int64_t B, int64_t n, int64_t dn, int64_t dv, int64_t C, int64_t r, float scale, int bf16,
                        int num_threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && B > 1)
    for (int64_t b = 0; b < B; b++) {
        float *query = malloc(sizeof(float) * (size_t)(n * C + n * r + 2 * n + page_size * (C + 1)));
        if (query == NULL) {
            failed = 1;
            continue;
        }
        float *o_lat = query + n * C, *scratch = o_lat + n * r;
        for (int64_t h = 0; h < n; h++) {
            float *qh = query + h * C;
            const int64_t wk = h * (dn + dv) * r;  /* W_UK[h]: dn rows of r */
            for (int64_t j = 0; j < r; j++) qh[j] = 0.0f;
            for (int64_t d = 0; d < dn; d++)
                add_scaled_row(qh, load_value(q_nope, b * qn[0] + h * qn[1] + d, q_bf16), w, wk + d * r, r, w_bf16);
            for (int64_t j = r; j < C; j++) qh[j] = load_value(q_pe, b * qp[0] + h * qp[1] + (j - r), q_bf16);
        }
        attend(layer_base, page_stride, page_size, table + b * max_pages, lengths[b], query, o_lat, n, C, r, scale,
               bf16, scratch);
        for (int64_t h = 0; h < n; h++) {
            const float *oh = o_lat + h * r;
            const int64_t wv = (h * (dn + dv) + dn) * r;  /* W_UV[h]: dv rows of r */
            for (int64_t v = 0; v < dv; v++) {
                const float s = dot_row(oh, w, wv + v * r, r, w_bf16);
                const int64_t i = (b * n + h) * dv + v;
                if (out_bf16)
                    ((uint16_t *)out)[i] = float_to_bf16(s);
                else
                    ((float *)out)[i] = s;
            }
        }
        free(query);
    }
    return failed ? -1 : 0;
}
