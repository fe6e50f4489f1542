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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load(const void *base, int64_t i, int bf16) {
    if (!bf16) return ((const float *)base)[i];
    uint32_t bits = ((uint32_t)((const uint16_t *)base)[i]) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void mla_paged_decode(const void *layer_base, int64_t page_stride, int64_t page_size, const int64_t *table,
                      int64_t max_pages, const int64_t *lengths, const float *query, float *o_lat, int64_t B,
                      int64_t n, int64_t C, int64_t r, float scale, int bf16, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t b = 0; b < B; b++) {
        float *m = malloc(sizeof(float) * (size_t)(2 * n + page_size * (C + 1)));
        float *l = m + n, *scores = m + 2 * n, *tile = scores + page_size;
        float *acc = o_lat + b * n * r;
        const float *qb = query + b * n * C;
        for (int64_t h = 0; h < n; h++) {
            m[h] = -INFINITY;
            l[h] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)(n * r));
        for (int64_t t0 = 0; t0 < lengths[b]; t0 += page_size) {  /* one page of rows at a time */
            const int64_t rows = lengths[b] - t0 < page_size ? lengths[b] - t0 : page_size;
            const int64_t page = table[b * max_pages + t0 / page_size];
            const float *rows_f32 = (const float *)layer_base + page * page_stride;  /* a page's rows are contiguous */
            if (bf16)
                for (int64_t j = 0; j < rows * C; j++) tile[j] = load(layer_base, page * page_stride + j, 1);
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
        free(m);
    }
}
