/* The gated MLP activations of rows (the C forms of tidal.ops.activation.situ and .swiglu, kind 1
 * and 0 of gated_act.h), computed in float32, stored in the rows' dtype. gate and up: M rows of N values at row strides
 * g_stride / u_stride (elements), float32 or bfloat16 (is_bf16); out [M, N] contiguous, same
 * dtype. Each row is done by one thread (gated_act_row): a row's bits do not depend on the other
 * rows or the thread count. */
#include <math.h>
#include <stdint.h>

#include "bf16_scalar.h"
#include "gated_act.h"

#define CHUNK 256

void gated_activation(const void *gate, int64_t g_stride, const void *up, int64_t u_stride, void *out, int64_t M,
                      int64_t N, int kind, float beta, float linear_beta, int is_bf16, int num_threads) {
    const int64_t es = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * N >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const char *g = (const char *)gate + m * g_stride * es, *u = (const char *)up + m * u_stride * es;
        char *o = (char *)out + m * N * es;
        if (!is_bf16) {
            gated_act_row((const float *)g, (const float *)u, (float *)o, N, kind, beta, linear_beta);
            continue;
        }
        /* bfloat16 rows through float32 chunks (a multiple of 8: the same columns take the vector form) */
        float gf[CHUNK], uf[CHUNK], of[CHUNK];
        for (int64_t c0 = 0; c0 < N; c0 += CHUNK) {
            const int64_t n = N - c0 < CHUNK ? N - c0 : CHUNK;
            for (int64_t i = 0; i < n; i++) {
                gf[i] = load_value(g, c0 + i, 1);
                uf[i] = load_value(u, c0 + i, 1);
            }
            gated_act_row(gf, uf, of, n, kind, beta, linear_beta);
            for (int64_t i = 0; i < n; i++) store_value(o, c0 + i, of[i], 1);
        }
    }
}
