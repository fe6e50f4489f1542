/* A bfloat16 gated MLP's weights as mlp_decode.c's mlp_step reads them (tidal.ops.cpu_kernels.MlpWeights;
 * moe_layer_decode.c hands its shared expert to mlp_step in this form). */
#pragma once
#include <stdint.h>

/* gate and up [inter, hidden], down [hidden, inter], rows contiguous at the strides */
struct mlp_weights {
    int64_t hidden, inter;
    const uint16_t *gate_up[2];
    int64_t gate_up_stride[2], gate_up_rows[2];
    const uint16_t *down;
    int64_t down_stride;
    int64_t kind; /* 1 SiTU, 0 SwiGLU */
    float beta, linear_beta;
};

/* float32 values of scratch mlp_step needs per row */
int64_t mlp_step_scratch(const struct mlp_weights *w);

/* x [T, hidden] bfloat16 rows (row stride x_stride) -> out [T, hidden] bfloat16, contiguous. scratch
 * holds T * mlp_step_scratch(w) floats. Returns 0, or -1 for weights of mismatched sizes. */
int mlp_step(const struct mlp_weights *w, const uint16_t *x, int64_t x_stride, int64_t T, uint16_t *out,
             float *scratch, int num_threads);
