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

#include "bf16_scalar.h"

#define MAX_VALUES 64

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
    for (int64_t t = 0; t < T; t++) out[t] = inv_rms((const char *)x + t * stride * es, D, eps, is_bf16);
}

void attn_res_rows(const void *const *values, const int64_t *strides, int64_t n_values,
                   const float *const *block_inv_rms, const float *query, int64_t T, int64_t D, float eps,
                   int is_bf16, void *out, int num_threads) {
    const int64_t es = is_bf16 ? 2 : 4;
    if (n_values > MAX_VALUES) return;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T * D * n_values >= 65536)
    for (int64_t t = 0; t < T; t++) {
        float score[MAX_VALUES];
        const char *rows[MAX_VALUES];
        float top = -INFINITY;
        for (int64_t j = 0; j < n_values; j++) {
            rows[j] = (const char *)values[j] + t * strides[j] * es;
            const float r = j + 1 < n_values ? block_inv_rms[j][t] : inv_rms(rows[j], D, eps, is_bf16);
            float dot = 0.0f;
            for (int64_t i = 0; i < D; i++) dot += load_value(rows[j], i, is_bf16) * query[i];
            score[j] = dot * r;
            if (score[j] > top) top = score[j];
        }
        float total = 0.0f;
        for (int64_t j = 0; j < n_values; j++) {
            score[j] = expf(score[j] - top);
            total += score[j];
        }
        for (int64_t j = 0; j < n_values; j++) score[j] /= total;
        char *o = (char *)out + t * D * es;
        for (int64_t i = 0; i < D; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < n_values; j++) acc += score[j] * load_value(rows[j], i, is_bf16);
            store_value(o, i, acc, is_bf16);
        }
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
