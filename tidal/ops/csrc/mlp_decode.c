/* A bfloat16 gated MLP (tidal.model.moe.KimiMLP: the dense layers and the shared experts) for a few
 * rows in one call: down(act(gate(x), up(x))), with act SiTU or SwiGLU (gated_act.h).
 *
 * Every intermediate the torch form holds in a bfloat16 tensor (the gate and up projections, the
 * activation) is rounded to bfloat16 here too, and the products are bf16_parts.h's, so the result
 * has the bits of the separate calls (bf16_gemm_bf16_parts, gated_activation, bf16_gemm_bf16): a
 * row's result is bitwise independent of the other rows and the thread count.
 */
#include <stdint.h>

#include "bf16_parts.h"
#include "bf16_scalar.h"
#include "gated_act.h"
#include "mlp_weights.h"

/* (declared, with what they take, in mlp_weights.h) */
int64_t mlp_step_scratch(const struct mlp_weights *w) { return 2 * w->hidden + 3 * w->inter; }

int mlp_step(const struct mlp_weights *w, const uint16_t *x, int64_t x_stride, int64_t T, uint16_t *out,
             float *scratch, int num_threads) {
    const int64_t d = w->hidden, I = w->inter;
    if (w->gate_up_rows[0] != I || w->gate_up_rows[1] != I) return -1;
    float *xf = scratch, *gu = xf + T * d, *act = gu + 2 * T * I, *of = act + T * I;
    widen_bf16(x, x_stride, T, d, xf);
    bf16_values_product(xf, T, d, 2, w->gate_up, w->gate_up_stride, w->gate_up_rows, gu, num_threads);
    for (int64_t i = 0; i < 2 * T * I; i++) gu[i] = bf16_round(gu[i]);
    for (int64_t t = 0; t < T; t++) {
        float *a = act + t * I;
        gated_act_row(gu + t * 2 * I, gu + t * 2 * I + I, a, I, (int)w->kind, w->beta, w->linear_beta);
        for (int64_t i = 0; i < I; i++) a[i] = bf16_round(a[i]);
    }
    bf16_values_product(act, T, I, 1, &w->down, &w->down_stride, &d, of, num_threads);
    round_to_bf16(of, T * d, out);
    return 0;
}
