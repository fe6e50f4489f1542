/* The recurrent part of one KDA layer for one decode token per sequence, between the projections
 * and o_proj (tidal.model.kda.KimiDeltaAttention.forward at T == 1), in one call:
 *
 *   short conv + SiLU of q|k|v (conv state shifted in place), q <- l2norm(q) K^-1/2, k <- l2norm(k),
 *   beta = sigmoid(b), g = kda_gate(z), the delta-rule step on the recurrent state (in place,
 *   delta_rule.h), o <- rmsnorm(o) * o_norm_w * sigmoid(gate).
 *
 * Token t uses state slot slots[t]. Rows in (qkv [3P], z [P], gate [P], b [H] of token t, at
 * row strides in elements) are float32 or bfloat16 (in_bf16); conv states [W-1, 3P] per slot are
 * float32 or bfloat16 (conv_bf16), slot s at conv_state + s * conv_stride; recurrent states [H, K, K]
 * float32 per slot, slot s at rec_state + s * rec_stride. conv_w [3P, W] float32; A_log has H
 * (a_per_head) or K values; dt_bias [P]; o_norm_w [K]. Without a lower bound (has_lb == 0) the gate
 * is Kimi Linear's g = -exp(A_log) softplus(z + dt_bias), with one K3's lb sigmoid(exp(A_log)(z + dt_bias)).
 * out [T, P] float32.
 *
 * Each (token, head) pair is computed by one thread in a fixed order: a row's result is bitwise
 * independent of the batch and the thread count. Tokens must use distinct slots.
 */
#include <math.h>
#include <stdint.h>

#include "bf16_scalar.h"
#include "delta_rule.h"

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

void kda_layer_decode(const void *qkv, int64_t qkv_stride, const void *z, int64_t z_stride, const void *gate,
                      int64_t gate_stride, const void *b, int64_t b_stride, int in_bf16, void *conv_state,
                      int64_t conv_stride, int conv_bf16, float *rec_state, int64_t rec_stride, const int32_t *slots,
                      const float *conv_w, const float *A_log, int a_per_head, const float *dt_bias, float lower_bound,
                      int has_lb, const float *o_norm_w, float eps, float *out, int64_t T, int64_t H, int64_t K,
                      int64_t W, int num_threads) {
    const int64_t P = H * K, C = 3 * P, ies = in_bf16 ? 2 : 4, ces = conv_bf16 ? 2 : 4;
    const float q_scale = 1.0f / sqrtf((float)K);
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) {
            const char *x = (const char *)qkv + t * qkv_stride * ies;
            char *cs = (char *)conv_state + slots[t] * conv_stride * ces;
            float *S = rec_state + slots[t] * rec_stride + h * K * K;
            float qkvh[3][K], g[K], r[K], o[K];
            /* short conv + SiLU over the head's channels of q, k and v; the state keeps the last W-1
             * pre-conv inputs, oldest first */
            for (int part = 0; part < 3; part++) {
                for (int64_t i = 0; i < K; i++) {
                    const int64_t c = part * P + h * K + i;
                    const float *wc = conv_w + c * W;
                    const float xn = load_value(x, c, in_bf16);
                    float y = 0.0f;
                    for (int64_t j = 0; j < W - 1; j++) y += load_value(cs, j * C + c, conv_bf16) * wc[j];
                    y += xn * wc[W - 1];
                    for (int64_t j = 0; j + 1 < W - 1; j++)
                        store_value(cs, j * C + c, load_value(cs, (j + 1) * C + c, conv_bf16), conv_bf16);
                    if (W > 1) store_value(cs, (W - 2) * C + c, xn, conv_bf16);
                    const float act = y * sigmoidf(y);
                    /* the conv output is in the rows' dtype, as in the torch form */
                    qkvh[part][i] = in_bf16 ? bf16_to_float(float_to_bf16(act)) : act;
                }
            }
            float *q = qkvh[0], *k = qkvh[1], *v = qkvh[2];
            float qq = 0.0f, kk = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                qq += q[i] * q[i];
                kk += k[i] * k[i];
            }
            const float qn = q_scale / sqrtf(qq + 1e-6f), kn = 1.0f / sqrtf(kk + 1e-6f);
            float kq = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                q[i] *= qn;
                k[i] *= kn;
                kq += k[i] * q[i];
            }
            const float beta = sigmoidf(load_value((const char *)b + t * b_stride * ies, h, in_bf16));
            const char *zr = (const char *)z + t * z_stride * ies;
            for (int64_t i = 0; i < K; i++) {
                const float a = expf(A_log[a_per_head ? h : i]);
                const float u = load_value(zr, h * K + i, in_bf16) + dt_bias[h * K + i];
                g[i] = has_lb ? lower_bound * sigmoidf(a * u) : -a * softplusf(u);
            }
            for (int64_t i = 0; i < K; i++) g[i] = expf(g[i]);
            delta_rule_step(S, q, k, v, g, beta, kq, r, o, K, K);
            float oo = 0.0f;
            for (int64_t j = 0; j < K; j++) oo += o[j] * o[j];
            /* gated output norm */
            const float on = 1.0f / sqrtf(oo / (float)K + eps);
            const char *gr = (const char *)gate + t * gate_stride * ies;
            float *y = out + t * P + h * K;
            for (int64_t j = 0; j < K; j++)
                y[j] = o[j] * on * o_norm_w[j] * sigmoidf(load_value(gr, h * K + j, in_bf16));
        }
    }
}
