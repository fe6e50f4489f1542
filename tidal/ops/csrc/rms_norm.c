/* RMSNorm of rows (the C form of tidal.model.layers.rms_norm): y = x / sqrt(mean(x^2) + eps) * w,
 * computed in float32 and stored in the rows' dtype. x and y: M rows of D values, row strides
 * x_stride / y_stride (elements), float32 or bfloat16 (x_bf16; y has x's dtype); w: D values,
 * float32 or bfloat16 (w_bf16), or NULL. Each row is summed by one thread in index order, so its result does not depend
 * on the other rows or the thread count. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_scalar.h"
#include "row_lanes.h"

#define GROUP (ROW_LANES > 0 ? ROW_LANES : 1)

static float row_squares(const char *xr, int64_t D, int x_bf16) {
    float ss = 0.0f;
    for (int64_t i = 0; i < D; i++) {
        const float v = load_value(xr, i, x_bf16);
        ss += v * v;
    }
    return ss;
}

static void norm_row(const char *xr, char *yr, const void *w, int w_bf16, int64_t D, float eps, int x_bf16, float ss) {
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; i++) {
        float v = load_value(xr, i, x_bf16) * inv;
        if (w) v *= load_value(w, i, w_bf16);
        store_value(yr, i, v, x_bf16);
    }
}

/* Rows go in groups of ROW_LANES: a group of LANES_MIN_ROWS or more sums its squares in row lanes
 * (row_lanes.h), the same bits as one row's loop. */
void rms_norm_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, const void *w, int w_bf16, int64_t M,
                   int64_t D, float eps, int x_bf16, int num_threads) {
    const int64_t es = x_bf16 ? 2 : 4, groups = (M + GROUP - 1) / GROUP;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && M * D >= 65536)
    {
        float *buf = ROW_LANES > 0 && M >= LANES_MIN_ROWS ? malloc(sizeof(float) * (size_t)(GROUP * D)) : NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t m0 = g * GROUP, m1 = m0 + GROUP < M ? m0 + GROUP : M;
#if ROW_LANES
            const int n = (int)(m1 - m0);
            if (buf != NULL && n >= LANES_MIN_ROWS) {
                const void *rows[ROW_LANES];
                float ss[ROW_LANES];
                for (int l = 0; l < n; l++) rows[l] = (const char *)x + (m0 + l) * x_stride * es;
                lanes_transpose(rows, n, D, x_bf16, buf);
                lanes_sums(buf, D, NULL, ss, NULL);
                for (int l = 0; l < n; l++)
                    norm_row(rows[l], (char *)y + (m0 + l) * y_stride * es, w, w_bf16, D, eps, x_bf16, ss[l]);
                continue;
            }
#endif
            for (int64_t m = m0; m < m1; m++) {
                const char *xr = (const char *)x + m * x_stride * es;
                norm_row(xr, (char *)y + m * y_stride * es, w, w_bf16, D, eps, x_bf16, row_squares(xr, D, x_bf16));
            }
        }
        free(buf);
    }
}
