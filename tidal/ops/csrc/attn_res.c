/* Block AttnRes of rows (the C form of tidal.model.attn_res.attn_res): for each token t, values
 * v_0..v_n (the n completed blocks, then the partial sum), scores s_j = (q . v_j) * r_j with
 * r_j = 1 / sqrt(mean(v_j^2) + eps), alpha = softmax(s), out = sum_j alpha_j v_j.
 *
 * The blocks' r_j do not change once a block is complete: the caller passes them (block_inv_rms[j]:
 * T float32 values, computed once per block by attn_res_inv_rms) and only the partial sum's is
 * computed here. values[j]: T rows of D values, row stride strides[j] elements, float32 or
 * bfloat16 (is_bf16; out has the same dtype, row stride D). query: D float32 values (norm weight
 * times projection). Each token is done by one thread in a fixed order, independent of T and the
 * thread count. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_scalar.h"
#include "row_lanes.h"

#define MAX_VALUES 64
#define GROUP (ROW_LANES > 0 ? ROW_LANES : 1)

static float inv_rms(const void *row, int64_t D, float eps, int is_bf16) {
    float ss = 0.0f;
    for (int64_t i = 0; i < D; i++) {
        const float v = load_value(row, i, is_bf16);
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)D + eps);
}

void attn_res_inv_rms(const void *x, int64_t stride, int64_t T, int64_t D, float eps, int is_bf16, float *out) {
    const int64_t es = is_bf16 ? 2 : 4;
    int64_t t = 0;
#if ROW_LANES
    float *buf = T >= LANES_MIN_ROWS ? malloc(sizeof(float) * (size_t)(ROW_LANES * D)) : NULL;
    for (; buf != NULL && t + LANES_MIN_ROWS <= T; t += ROW_LANES) {  /* inv_rms's bits, 16 rows at once */
        const int n = T - t < ROW_LANES ? (int)(T - t) : ROW_LANES;
        const void *rows[ROW_LANES];
        float ss[ROW_LANES];
        for (int l = 0; l < n; l++) rows[l] = (const char *)x + (t + l) * stride * es;
        lanes_transpose(rows, n, D, is_bf16, buf);
        lanes_sums(buf, D, NULL, ss, NULL);
        for (int l = 0; l < n; l++) out[t + l] = 1.0f / sqrtf(ss[l] / (float)D + eps);
    }
    free(buf);
#endif
    for (; t < T; t++) out[t] = inv_rms((const char *)x + t * stride * es, D, eps, is_bf16);
}

/* token t's softmax over score[0..n) and out row (the scores' order and sums as the torch form's
 * one-row loop; acc: D float32 of scratch or NULL, which sums column by column instead of value by
 * value, the same sequence for each output) */
static void mix_row(const char *const *rows, float *score, int64_t n_values, int64_t D, int is_bf16, char *o,
                    float *acc) {
    float top = -INFINITY;
    for (int64_t j = 0; j < n_values; j++)
        if (score[j] > top) top = score[j];
    float total = 0.0f;
    for (int64_t j = 0; j < n_values; j++) {
        score[j] = expf(score[j] - top);
        total += score[j];
    }
    for (int64_t j = 0; j < n_values; j++) score[j] /= total;
    if (acc != NULL) {
        for (int64_t i = 0; i < D; i++) acc[i] = 0.0f;
        for (int64_t j = 0; j < n_values; j++) {
            const float s = score[j];
            if (is_bf16)
                for (int64_t i = 0; i < D; i++) acc[i] += s * bf16_to_float(((const uint16_t *)rows[j])[i]);
            else
                for (int64_t i = 0; i < D; i++) acc[i] += s * ((const float *)rows[j])[i];
        }
        for (int64_t i = 0; i < D; i++) store_value(o, i, acc[i], is_bf16);
        return;
    }
    for (int64_t i = 0; i < D; i++) {
        float a = 0.0f;
        for (int64_t j = 0; j < n_values; j++) a += score[j] * load_value(rows[j], i, is_bf16);
        store_value(o, i, a, is_bf16);
    }
}

/* Tokens go in groups of ROW_LANES: a group of LANES_MIN_ROWS or more sums its scores in row lanes
 * (row_lanes.h), the bits of one token's loop. */
void attn_res_rows(const void *const *values, const int64_t *strides, int64_t n_values,
                   const float *const *block_inv_rms, const float *query, int64_t T, int64_t D, float eps,
                   int is_bf16, void *out, int num_threads) {
    const int64_t es = is_bf16 ? 2 : 4, groups = (T + GROUP - 1) / GROUP;
    if (n_values > MAX_VALUES) return;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && T * D * n_values >= 65536)
    {
        float *buf = ROW_LANES > 0 && T >= LANES_MIN_ROWS ? malloc(sizeof(float) * (size_t)(GROUP * D)) : NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t t0 = g * GROUP, t1 = t0 + GROUP < T ? t0 + GROUP : T;
#if ROW_LANES
            const int n = (int)(t1 - t0);
            if (buf != NULL && n >= LANES_MIN_ROWS) {
                float score[ROW_LANES][MAX_VALUES], dot[ROW_LANES], ss[ROW_LANES];
                const char *rows[ROW_LANES][MAX_VALUES];
                for (int64_t j = 0; j < n_values; j++) {
                    const void *lane_rows[ROW_LANES];
                    for (int l = 0; l < n; l++)
                        lane_rows[l] = rows[l][j] = (const char *)values[j] + (t0 + l) * strides[j] * es;
                    const int last = j + 1 == n_values;
                    lanes_transpose(lane_rows, n, D, is_bf16, buf);
                    lanes_sums(buf, D, query, last ? ss : NULL, dot);
                    for (int l = 0; l < n; l++)
                        score[l][j] = dot[l] * (last ? 1.0f / sqrtf(ss[l] / (float)D + eps) : block_inv_rms[j][t0 + l]);
                }
                for (int l = 0; l < n; l++)
                    mix_row(rows[l], score[l], n_values, D, is_bf16, (char *)out + (t0 + l) * D * es, buf);
                continue;
            }
#endif
            for (int64_t t = t0; t < t1; t++) {
                float score[MAX_VALUES];
                const char *rows[MAX_VALUES];
                for (int64_t j = 0; j < n_values; j++) {
                    rows[j] = (const char *)values[j] + t * strides[j] * es;
                    const float r = j + 1 < n_values ? block_inv_rms[j][t] : inv_rms(rows[j], D, eps, is_bf16);
                    float dot = 0.0f;
                    for (int64_t i = 0; i < D; i++) dot += load_value(rows[j], i, is_bf16) * query[i];
                    score[j] = dot * r;
                }
                mix_row(rows, score, n_values, D, is_bf16, (char *)out + t * D * es, buf);
            }
        }
        free(buf);
    }
}

/* rms_norm.c (this library links it: tidal.ops.cpu_kernels.LIBRARY_SOURCES) */
void rms_norm_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, const void *w, int w_bf16, int64_t M,
                   int64_t D, float eps, int x_bf16, int num_threads);

/* The glue between two sub-layers (tidal.model.kimi.KimiModel._forward_attn_res), one call for the
 * three ops the torch form runs: the partial sum's residual add, AttnRes over the blocks, the next
 * sub-layer's RMSNorm, each with the bits of its own call.
 *   sum = partial + add (add != NULL; rounded to the rows' dtype, as torch's add), else partial;
 *   mixed = attn_res_rows([blocks..., sum]) (n_blocks > 0; else mixed is not written: it is sum);
 *   normed = rms_norm_rows(mixed or sum, norm_w).
 * blocks / partial / add: T rows of D values at their row strides; sum, mixed and normed T x D,
 * contiguous; block_inv_rms as attn_res_rows's (one per block). Returns 0, or -1 for more values
 * than attn_res_rows takes (then nothing is written). */
int attn_res_glue(const void *partial, int64_t p_stride, const void *add, int64_t a_stride, void *sum,
                  const void *const *blocks, const int64_t *b_strides, int64_t n_blocks,
                  const float *const *block_inv_rms, const float *query, float eps, void *mixed, const void *norm_w,
                  int norm_w_bf16, float norm_eps, void *normed, int64_t T, int64_t D, int is_bf16, int num_threads) {
    if (n_blocks + 1 > MAX_VALUES) return -1;
    const int64_t es = is_bf16 ? 2 : 4;
    const void *src = partial;
    int64_t src_stride = p_stride;
    if (add != NULL) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T * D >= 65536)
        for (int64_t t = 0; t < T; t++) {
            const char *p = (const char *)partial + t * p_stride * es, *a = (const char *)add + t * a_stride * es;
            char *s = (char *)sum + t * D * es;
            if (is_bf16)
                for (int64_t i = 0; i < D; i++)
                    ((uint16_t *)s)[i] = float_to_bf16(bf16_to_float(((const uint16_t *)p)[i]) +
                                                       bf16_to_float(((const uint16_t *)a)[i]));
            else
                for (int64_t i = 0; i < D; i++) ((float *)s)[i] = ((const float *)p)[i] + ((const float *)a)[i];
        }
        src = sum, src_stride = D;
    }
    if (n_blocks > 0) {
        const void *values[MAX_VALUES];
        int64_t strides[MAX_VALUES];
        for (int64_t j = 0; j < n_blocks; j++) values[j] = blocks[j], strides[j] = b_strides[j];
        values[n_blocks] = src, strides[n_blocks] = src_stride;
        attn_res_rows(values, strides, n_blocks + 1, block_inv_rms, query, T, D, eps, is_bf16, mixed, num_threads);
        src = mixed, src_stride = D;
    }
    rms_norm_rows(src, src_stride, normed, D, norm_w, norm_w_bf16, T, D, norm_eps, is_bf16, num_threads);
    return 0;
}
