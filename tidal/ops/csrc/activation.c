/* The gated MLP activations of rows (the C forms of tidal.ops.activation.situ and .swiglu, kind 1
 * and 0 of gated_act.h), computed in float32, stored in the rows' dtype. gate and up: M rows of N values at row strides
 * g_stride / u_stride (elements), float32 or bfloat16 (is_bf16); out [M, N] contiguous, same
 * dtype. Each row is done by one thread, element by element: a row's bits do not depend on the
 * other rows or the thread count. */
#include <math.h>
#include <stdint.h>

#include "bf16_scalar.h"
#include "gated_act.h"

void gated_activation(const void *gate, int64_t g_stride, const void *up, int64_t u_stride, void *out, int64_t M,
                      int64_t N, int kind, float beta, float linear_beta, int is_bf16, int num_threads) {
    const int64_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * N >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const char *g = (const char *)gate + m * g_stride * es, *u = (const char *)up + m * u_stride * es;
        char *o = (char *)out + m * N * es;
        for (int64_t i = 0; i < N; i++) {
            const float v = gated_act(load_value(g, i, is_bf16), load_value(u, i, is_bf16), kind, beta, linear_beta);
            store_value(o, i, v, is_bf16);
        }
    }
}
