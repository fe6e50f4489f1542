/* RMSNorm of rows (the C form of tidal.model.layers.rms_norm): y = x / sqrt(mean(x^2) + eps) * w,
 * computed in float32 and stored in the rows' dtype. x and y: M rows of D values, row strides
 * x_stride / y_stride (elements), float32 or bfloat16 (x_bf16; y has x's dtype); w: D values,
 * float32 or bfloat16 (w_bf16), or NULL. Each row is summed by one thread in index order, so its result does not depend
 * on the other rows or the thread count. */
#include <math.h>
#include <stdint.h>

#include "bf16_scalar.h"

void rms_norm_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, const void *w, int w_bf16, int64_t M,
                   int64_t D, float eps, int x_bf16, int num_threads) {
    const int64_t es = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * D >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const char *xr = (const char *)x + m * x_stride * es;
        char *yr = (char *)y + m * y_stride * es;
        float ss = 0.0f;
        for (int64_t i = 0; i < D; i++) {
            const float v = load_value(xr, i, x_bf16);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) {
            float v = load_value(xr, i, x_bf16) * inv;
            if (w) v *= load_value(w, i, w_bf16);
            store_value(yr, i, v, x_bf16);
        }
    }
}
