/* The gated MLP activations of one value pair, float32 (activation.c, mxfp4_gemm.c):
 *   kind 1, SiTU:   beta tanh(g / beta) sigmoid(g) * lbeta tanh(u / lbeta)
 *   kind 0, SwiGLU: silu(g) * u
 * in the operation order of tidal.ops.activation's torch forms. */
#include <math.h>

static inline float gated_act(float g, float u, int kind, float beta, float linear_beta) {
    const float sig = 1.0f / (1.0f + expf(-g));
    return kind == 1 ? tanhf(g / beta) * beta * sig * (tanhf(u / linear_beta) * linear_beta) : g * sig * u;
}
