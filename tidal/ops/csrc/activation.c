/* The gated MLP activations of rows (the C forms of tidal.ops.activation.situ and .swiglu, kind 1
 * and 0 of gated_act.h), computed in float32, stored in the rows' dtype; sigmoid_gate_rows: the MLA
 * output gate, o * sigmoid(g) (gated_act.h's sigmoid_row), the same way. gate and up: M rows of N values at row strides
 * g_stride / u_stride (elements), float32 or bfloat16 (is_bf16); out [M, N] contiguous, same
 * dtype. Each row is done by one thread (gated_act_row): a row's bits do not depend on the other
 * rows or the thread count. */
#include <math.h>
#include <stdint.h>

#include "bf16_scalar.h"
#include "gated_act.h"

#define CHUNK 256

/* row m of gate (and up) at its stride as float32 chunks of CHUNK (a multiple of 8: every column
 * takes the form it takes in a whole-row call), through fn, stored at out's row m */
static void rows_in_chunks(const void *gate, int64_t g_stride, const void *up, int64_t u_stride, void *out,
                           int64_t m, int64_t N, int is_bf16,
                           void (*fn)(const float *, const float *, float *, int64_t, const void *), const void *arg) {
    const int64_t es = is_bf16 ? 2 : 4;
    const char *g = (const char *)gate + m * g_stride * es, *u = (const char *)up + m * u_stride * es;
    char *o = (char *)out + m * N * es;
    if (!is_bf16) {
        fn((const float *)g, (const float *)u, (float *)o, N, arg);
        return;
    }
    float gf[CHUNK], uf[CHUNK], of[CHUNK];
    for (int64_t c0 = 0; c0 < N; c0 += CHUNK) {
        const int64_t n = N - c0 < CHUNK ? N - c0 : CHUNK;
        for (int64_t i = 0; i < n; i++) {
            gf[i] = load_value(g, c0 + i, 1);
            uf[i] = load_value(u, c0 + i, 1);
        }
        fn(gf, uf, of, n, arg);
        for (int64_t i = 0; i < n; i++) store_value(o, c0 + i, of[i], 1);
    }
}

struct act_args {
    int kind;
    float beta, linear_beta;
};

static void act_chunk(const float *g, const float *u, float *o, int64_t n, const void *arg) {
    const struct act_args *a = arg;
    gated_act_row(g, u, o, n, a->kind, a->beta, a->linear_beta);
}

static void gate_chunk(const float *g, const float *o_in, float *o, int64_t n, const void *arg) {
    (void)arg;
    sigmoid_row(g, o_in, o, n);
}

/* out [M, N] = o * sigmoid(g): o and g M rows of N values at row strides o_stride / g_stride */
void sigmoid_gate_rows(const void *o, int64_t o_stride, const void *g, int64_t g_stride, void *out, int64_t M,
                       int64_t N, int is_bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * N >= 65536)
    for (int64_t m = 0; m < M; m++) rows_in_chunks(g, g_stride, o, o_stride, out, m, N, is_bf16, gate_chunk, NULL);
}

void gated_activation(const void *gate, int64_t g_stride, const void *up, int64_t u_stride, void *out, int64_t M,
                      int64_t N, int kind, float beta, float linear_beta, int is_bf16, int num_threads) {
    const struct act_args a = {kind, beta, linear_beta};
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * N >= 65536)
    for (int64_t m = 0; m < M; m++) rows_in_chunks(gate, g_stride, up, u_stride, out, m, N, is_bf16, act_chunk, &a);
}
