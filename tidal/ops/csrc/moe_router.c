/* The MoE router of tidal.model.moe.Router in one call (DeepSeek-V3 "noaux_tc" routing): for each
 * of T rows x [D] (float32 or bfloat16, row stride x_stride elements) and the router weight w [E, D]
 * (float32 or bfloat16, contiguous):
 *   score[e] = sigmoid(x . w[e])                       (float32 dot product, fixed order)
 *   key[e]   = score[e] + bias[e]                      (the correction bias only chooses)
 *   with n_group > 1 and topk_group < n_group: a group's score is the sum of its two largest keys;
 *   the keys outside the topk_group best groups become -inf
 *   ids      = the k largest keys, largest first       (ties: the lower index first; NaN largest)
 *   weights  = score[ids], / (their sum + 1e-20) when renormalize, then * scale.
 * ids [T, k] int64 and weights [T, k] float32 are contiguous. A row is computed by one thread in a
 * fixed order: its result does not depend on the other rows or the thread count. Returns 0, or -1
 * when scratch memory cannot be allocated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_scalar.h"

/* x . w over D values in 8 interleaved partial sums, combined pairwise: one order for every call. */
static float dot_f32(const float *x, const float *w, int64_t D) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += x[i + l] * w[i + l];
    for (; i < D; i++) acc[i % 8] += x[i] * w[i];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

static float dot_bf16(const float *x, const uint16_t *w, int64_t D) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += x[i + l] * bf16_to_float(w[i + l]);
    for (; i < D; i++) acc[i % 8] += x[i] * bf16_to_float(w[i]);
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* Whether (a, ia) ranks before (b, ib): larger value first, NaN above everything, ties by index. */
static int before(float a, int64_t ia, float b, int64_t ib) {
    if (isnan(a) || isnan(b)) return isnan(a) && (!isnan(b) || ia < ib);
    return a > b || (a == b && ia < ib);
}

/* The k best of values[0..n) into out (best first); taken[] marks chosen indices (cleared here). */
static void top_k(const float *values, int64_t n, int64_t k, unsigned char *taken, int64_t *out) {
    for (int64_t e = 0; e < n; e++) taken[e] = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || before(values[e], e, values[best], best))) best = e;
        taken[best] = 1;
        out[j] = best;
    }
}

int moe_router_topk(const void *x, int64_t x_stride, int x_bf16, int64_t T, int64_t D, const void *w, int w_bf16,
                    int64_t E, const float *bias, int64_t n_group, int64_t topk_group, int64_t k, int renormalize,
                    float scale, int64_t *ids, float *weights, int num_threads) {
    int failed = 0;
    const int64_t es = x_bf16 ? 2 : 4;
    const int grouped = n_group > 1 && topk_group < n_group;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T * E * D >= (1 << 20))
    for (int64_t t = 0; t < T; t++) {
        /* scratch: the row in float32, scores, keys, group scores, marks, chosen groups */
        float *xf = malloc((size_t)(D + 2 * E + n_group) * sizeof(float));
        unsigned char *taken = malloc((size_t)(E > n_group ? E : n_group));
        int64_t *keep = malloc((size_t)(n_group > 0 ? n_group : 1) * sizeof(int64_t));
        if (xf == NULL || taken == NULL || keep == NULL) {
#pragma omp atomic write
            failed = 1;
            free(xf);
            free(taken);
            free(keep);
            continue;
        }
        float *score = xf + D, *key = score + E, *group_score = key + E;
        const char *row = (const char *)x + t * x_stride * es;
        for (int64_t i = 0; i < D; i++) xf[i] = load_value(row, i, x_bf16);
        for (int64_t e = 0; e < E; e++) {
            const float logit = w_bf16 ? dot_bf16(xf, (const uint16_t *)w + e * D, D) : dot_f32(xf, (const float *)w + e * D, D);
            score[e] = 1.0f / (1.0f + expf(-logit));
            key[e] = score[e] + bias[e];
        }
        if (grouped) {
            const int64_t size = E / n_group;
            int64_t two[2];
            for (int64_t g = 0; g < n_group; g++) {
                const int64_t m = size < 2 ? size : 2;
                top_k(key + g * size, size, m, taken, two);
                group_score[g] = m == 2 ? key[g * size + two[0]] + key[g * size + two[1]] : key[g * size + two[0]];
            }
            top_k(group_score, n_group, topk_group, taken, keep);
            for (int64_t g = 0; g < n_group; g++) taken[g] = 0;
            for (int64_t j = 0; j < topk_group; j++) taken[keep[j]] = 1;
            for (int64_t g = 0; g < n_group; g++)
                if (!taken[g])
                    for (int64_t e = g * size; e < (g + 1) * size; e++) key[e] = -INFINITY;
        }
        int64_t *row_ids = ids + t * k;
        float *row_w = weights + t * k;
        top_k(key, E, k, taken, row_ids);
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            row_w[j] = score[row_ids[j]];
            sum += row_w[j];
        }
        for (int64_t j = 0; j < k; j++) row_w[j] = (renormalize ? row_w[j] / (sum + 1e-20f) : row_w[j]) * scale;
        free(xf);
        free(taken);
        free(keep);
    }
    return failed ? -1 : 0;
}
