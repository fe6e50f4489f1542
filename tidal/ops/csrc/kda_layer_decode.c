/* One KDA layer for one decode token per sequence (tidal.model.kda.KimiDeltaAttention.forward at
 * T == 1), in one call: kda_layer_decode is the recurrent part between the projections and o_proj,
 * kda_layer_step the whole layer with its bfloat16 projections (bf16_parts.h) around it.
 *
 * The recurrent part: short conv + SiLU of q|k|v (conv state shifted in place), q <- l2norm(q) K^-1/2,
 * k <- l2norm(k), beta = sigmoid(b), g = kda_gate(z), the delta-rule step on the recurrent state (in
 * place, delta_rule.h), o <- rmsnorm(o) * o_norm_w * sigmoid(gate).
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
 *
 * kda_layer_chain runs verified chains (tidal.spec.verify, "swap" rollback) with the same per-token
 * code: call row t reads and writes row rows[t] of the inputs and of out (row stride out_stride),
 * in slot slots[t], after copying its head's conv and recurrent state from slot src[t] where
 * src[t] >= 0. Rows group_start[g] .. group_start[g+1]-1 are one group (a decode: one row; a
 * chain: its positions in order, each in the block of the one before), computed in order by one
 * thread per (group, head): every position's bits are those of the decode step it stands for.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_parts.h"
#include "bf16_scalar.h"
#include "delta_rule.h"
#include "gated_act.h"

/* y = e^x over n values, as sigmoid_row splits them (NaN stays NaN) */
static inline void exp_row(const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(y + i, _mm256_blendv_ps(exp8(xv), xv, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q)));
    }
#endif
    for (; i < n; i++) y[i] = expf(x[i]);
}

static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* The recurrent part for head h of one token: rows x (qkv), zr, gr, br at their starts, conv state
 * cs and recurrent state S of the token's slot; writes the head's K outputs to y. round_bf16: the
 * conv output is rounded to bfloat16, as the torch form of a bfloat16 model holds it. */
static void kda_token_head(const char *x, const char *zr, const char *gr, const char *br, int in_bf16,
                           int round_bf16, char *cs, int conv_bf16, float *S, const float *conv_w, const float *A_log,
                           int a_per_head, const float *dt_bias, float lower_bound, int has_lb, const float *o_norm_w,
                           float eps, float *y, int64_t h, int64_t H, int64_t K, int64_t W) {
    const int64_t P = H * K, C = 3 * P;
    const float q_scale = 1.0f / sqrtf((float)K);
    float qkvh[3][K], g[K], r[K], o[K], u[K];
    /* short conv + SiLU over the head's channels of q, k and v; the state keeps the last W-1
     * pre-conv inputs, oldest first */
    for (int part = 0; part < 3; part++) {
        float *acc = qkvh[part];
        for (int64_t i = 0; i < K; i++) {
            const int64_t c = part * P + h * K + i;
            const float *wc = conv_w + c * W;
            const float xn = load_value(x, c, in_bf16);
            float a = 0.0f;
            for (int64_t j = 0; j < W - 1; j++) a += load_value(cs, j * C + c, conv_bf16) * wc[j];
            a += xn * wc[W - 1];
            for (int64_t j = 0; j + 1 < W - 1; j++)
                store_value(cs, j * C + c, load_value(cs, (j + 1) * C + c, conv_bf16), conv_bf16);
            if (W > 1) store_value(cs, (W - 2) * C + c, xn, conv_bf16);
            acc[i] = a;
        }
        sigmoid_row(acc, acc, acc, K);  /* SiLU: acc * sigmoid(acc) */
        if (round_bf16)
            for (int64_t i = 0; i < K; i++) acc[i] = bf16_round(acc[i]);
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
    const float beta = sigmoidf(load_value(br, h, in_bf16));
    const float a_head = a_per_head ? expf(A_log[h]) : 0.0f;
    for (int64_t i = 0; i < K; i++) {
        const float a = a_per_head ? a_head : expf(A_log[i]);
        const float zu = load_value(zr, h * K + i, in_bf16) + dt_bias[h * K + i];
        if (has_lb)
            u[i] = a * zu;
        else
            g[i] = -a * softplusf(zu);
    }
    if (has_lb) {  /* g = lb * sigmoid(a u) */
        sigmoid_row(u, NULL, g, K);
        for (int64_t i = 0; i < K; i++) g[i] = lower_bound * g[i];
    }
    exp_row(g, g, K);
    delta_rule_step(S, q, k, v, g, beta, kq, r, o, K, K);
    float oo = 0.0f;
    for (int64_t j = 0; j < K; j++) oo += o[j] * o[j];
    /* gated output norm: o * on * o_norm_w * sigmoid(gate) */
    const float on = 1.0f / sqrtf(oo / (float)K + eps);
    for (int64_t j = 0; j < K; j++) {
        u[j] = load_value(gr, h * K + j, in_bf16);
        r[j] = o[j] * on * o_norm_w[j];
    }
    sigmoid_row(u, r, y, K);
}

void kda_layer_decode(const void *qkv, int64_t qkv_stride, const void *z, int64_t z_stride, const void *gate,
                      int64_t gate_stride, const void *b, int64_t b_stride, int in_bf16, void *conv_state,
                      int64_t conv_stride, int conv_bf16, float *rec_state, int64_t rec_stride, const int32_t *slots,
                      const float *conv_w, const float *A_log, int a_per_head, const float *dt_bias, float lower_bound,
                      int has_lb, const float *o_norm_w, float eps, float *out, int64_t T, int64_t H, int64_t K,
                      int64_t W, int num_threads) {
    const int64_t P = H * K, ies = in_bf16 ? 2 : 4, ces = conv_bf16 ? 2 : 4;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) {
            kda_token_head((const char *)qkv + t * qkv_stride * ies, (const char *)z + t * z_stride * ies,
                           (const char *)gate + t * gate_stride * ies, (const char *)b + t * b_stride * ies, in_bf16,
                           in_bf16, (char *)conv_state + slots[t] * conv_stride * ces, conv_bf16,
                           rec_state + slots[t] * rec_stride + h * K * K, conv_w, A_log, a_per_head, dt_bias,
                           lower_bound, has_lb, o_norm_w, eps, out + t * P + h * K, h, H, K, W);
        }
    }
}

void kda_layer_chain(const void *qkv, int64_t qkv_stride, const void *z, int64_t z_stride, const void *gate,
                     int64_t gate_stride, const void *b, int64_t b_stride, int in_bf16, void *conv_state,
                     int64_t conv_stride, int conv_bf16, float *rec_state, int64_t rec_stride, const int64_t *rows,
                     const int32_t *slots, const int32_t *src, const int64_t *group_start, int64_t G,
                     const float *conv_w, const float *A_log, int a_per_head, const float *dt_bias, float lower_bound,
                     int has_lb, const float *o_norm_w, float eps, float *out, int64_t out_stride, int64_t H,
                     int64_t K, int64_t W, int num_threads) {
    const int64_t P = H * K, C = 3 * P, ies = in_bf16 ? 2 : 4, ces = conv_bf16 ? 2 : 4;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t grp = 0; grp < G; grp++) {
        for (int64_t h = 0; h < H; h++) {
            for (int64_t t = group_start[grp]; t < group_start[grp + 1]; t++) {
                const int64_t row = rows[t];
                char *cs = (char *)conv_state + slots[t] * conv_stride * ces;
                float *S = rec_state + slots[t] * rec_stride + h * K * K;
                if (src[t] >= 0 && src[t] != slots[t]) { /* this head's state after the position before */
                    const char *cs0 = (const char *)conv_state + src[t] * conv_stride * ces;
                    for (int64_t j = 0; j < W - 1; j++)
                        for (int part = 0; part < 3; part++) {
                            const int64_t at = (j * C + part * P + h * K) * ces;
                            memcpy(cs + at, cs0 + at, (size_t)(K * ces));
                        }
                    memcpy(S, rec_state + src[t] * rec_stride + h * K * K, (size_t)(K * K) * sizeof(float));
                }
                kda_token_head((const char *)qkv + row * qkv_stride * ies, (const char *)z + row * z_stride * ies,
                               (const char *)gate + row * gate_stride * ies, (const char *)b + row * b_stride * ies,
                               in_bf16, in_bf16, cs, conv_bf16, S, conv_w, A_log, a_per_head, dt_bias, lower_bound,
                               has_lb, o_norm_w, eps, out + row * out_stride + h * K, h, H, K, W);
            }
        }
    }
}

/* A bfloat16 KDA layer's weights, as kda_layer_step reads them (tidal.ops.fused_decode builds it once
 * per layer). The input projections are in_w[0..5] = q, k, v, f_a, the output gate's first matrix
 * (g, or g_a of rank gate_rank) and b, each [in_rows[p], hidden] at row stride in_stride[p]; f_b_w
 * [P, K], g_b_w [P, gate_rank] (NULL for a full-rank gate) and o_w [hidden, P] likewise. The rest
 * is kda_layer_decode's. */
#define KDA_IN_PARTS 6
/* State values (tokens x heads x K x K) below which the recurrent part runs on the calling thread:
 * one token's heads take less time than a passive OpenMP pool's wake-up saves. Each (token, head)
 * is one thread's work either way, so the bits do not change. */
#define RECURRENT_PARALLEL_MIN (1 << 19)
struct kda_layer_weights {
    int64_t hidden, heads, head_dim, conv_kernel, gate_rank;
    const uint16_t *in_w[KDA_IN_PARTS];
    int64_t in_stride[KDA_IN_PARTS], in_rows[KDA_IN_PARTS];
    const uint16_t *f_b_w, *g_b_w, *o_w;
    int64_t f_b_stride, g_b_stride, o_stride;
    const float *conv_w, *A_log, *dt_bias, *o_norm_w;
    int64_t a_per_head, has_lb;
    float lower_bound, eps;
};

static int64_t in_width(const struct kda_layer_weights *w) {
    int64_t n = 0;
    for (int p = 0; p < KDA_IN_PARTS; p++) n += w->in_rows[p];
    return n;
}

/* float32 values of scratch kda_layer_step needs per token */
int64_t kda_layer_step_scratch(const struct kda_layer_weights *w) {
    const int64_t P = w->heads * w->head_dim;
    return 2 * w->hidden + in_width(w) + w->head_dim + w->gate_rank + 3 * P;
}

/* rows [T, n] of src (row stride ld) at column c0 -> dst [T, n] contiguous */
static void take_columns(const float *src, int64_t ld, int64_t c0, int64_t T, int64_t n, float *dst) {
    for (int64_t t = 0; t < T; t++) memcpy(dst + t * n, src + t * ld + c0, (size_t)n * sizeof(float));
}

static void round_all(float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) v[i] = bf16_round(v[i]);
}

/* The whole bfloat16 layer: x [T, hidden] bfloat16 rows (row stride x_stride) -> out [T, hidden]
 * bfloat16 (contiguous), the states of the tokens' slots updated in place as kda_layer_decode does.
 * Every intermediate a bfloat16 tensor holds in the torch form (the projections, z, the output gate's
 * input, o before o_proj) is rounded to bfloat16 here too, so the result has the bits of the
 * separate calls (bf16_gemm_bf16_parts, kda_layer_decode, bf16_gemm_bf16). scratch holds
 * T * kda_layer_step_scratch(w) floats. Returns 0, or -1 for weights it does not take. */
int kda_layer_step(const struct kda_layer_weights *w, const uint16_t *x, int64_t x_stride, int64_t T,
                   void *conv_state, int64_t conv_stride, int conv_bf16, float *rec_state, int64_t rec_stride,
                   const int32_t *slots, uint16_t *out, float *scratch, int num_threads) {
    const int64_t d = w->hidden, H = w->heads, K = w->head_dim, W = w->conv_kernel, P = H * K, R = w->gate_rank;
    const int64_t n_in = in_width(w), gate_w = R ? R : P, ces = conv_bf16 ? 2 : 4;
    if (w->in_rows[0] + w->in_rows[1] + w->in_rows[2] != 3 * P || w->in_rows[3] != K || w->in_rows[4] != gate_w
        || w->in_rows[5] != H || (R && w->g_b_w == NULL))
        return -1;
    float *xf = scratch, *proj = xf + T * d, *fa = proj + T * n_in, *ga = fa + T * K, *z = ga + T * R;
    float *gate = z + T * P, *o = gate + T * P, *of = o + T * P;
    widen_bf16(x, x_stride, T, d, xf);
    bf16_values_product(xf, T, d, KDA_IN_PARTS, w->in_w, w->in_stride, w->in_rows, proj, num_threads);
    round_all(proj, T * n_in);
    take_columns(proj, n_in, 3 * P, T, K, fa);
    bf16_values_product(fa, T, K, 1, &w->f_b_w, &w->f_b_stride, &P, z, num_threads);
    round_all(z, T * P);
    const float *gate_rows = proj + 3 * P + K;
    int64_t gate_ld = n_in;
    if (R) {  /* a low-rank output gate: g_b(g_a(x)) */
        take_columns(proj, n_in, 3 * P + K, T, R, ga);
        bf16_values_product(ga, T, R, 1, &w->g_b_w, &w->g_b_stride, &P, gate, num_threads);
        round_all(gate, T * P);
        gate_rows = gate;
        gate_ld = P;
    }
    const float *b_rows = proj + 3 * P + K + gate_w;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (num_threads > 1 && T * H * K * K >= RECURRENT_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) {
            kda_token_head((const char *)(proj + t * n_in), (const char *)(z + t * P),
                           (const char *)(gate_rows + t * gate_ld), (const char *)(b_rows + t * n_in), 0, 1,
                           (char *)conv_state + slots[t] * conv_stride * ces, conv_bf16,
                           rec_state + slots[t] * rec_stride + h * K * K, w->conv_w, w->A_log, (int)w->a_per_head,
                           w->dt_bias, w->lower_bound, (int)w->has_lb, w->o_norm_w, w->eps, o + t * P + h * K, h, H,
                           K, W);
        }
    }
    round_all(o, T * P);
    bf16_values_product(o, T, P, 1, &w->o_w, &w->o_stride, &d, of, num_threads);
    round_to_bf16(of, T * d, out);
    return 0;
}
