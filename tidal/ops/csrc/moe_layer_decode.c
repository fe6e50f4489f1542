/* The MoE layer of a bfloat16 model with packed MXFP4 routed experts for a few rows, in one call
 * (tidal.model.moe.KimiMoE.forward): the router (sigmoid scores, bias-corrected top-k, renormalised
 * and scaled weights), K3's latent down projection, the routed experts, the latent norm and up
 * projection, the shared expert, and their sum.
 *
 * It is the separate calls' code, called from here (this library links moe_router.c, mxfp4_gemm.c,
 * mlp_decode.c and rms_norm.c beside this file: tidal.ops.cpu_kernels.LIBRARY_SOURCES), and every
 * value the torch form holds in a bfloat16 tensor is rounded to bfloat16 at the same point, so the
 * result has the bits of the separate calls. Those compute a row by one thread in a fixed order:
 * a row's result is bitwise independent of the other rows and the thread count.
 *
 * The routed branch (router .. up projection) and the shared expert read different weights and
 * meet only in the final sum. At a decode step each reads a few MiB of weights on one thread (their
 * products are below the kernels' thresholds for a second thread), so where the two branches read
 * comparable bytes they run side by side, one thread each (an OpenMP sections region); otherwise one
 * after the other, each with all threads. Either way the bits are the same.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16_parts.h"
#include "bf16_scalar.h"
#include "mlp_weights.h"

/* moe_router.c */
int moe_router_topk(const void *x, int64_t x_stride, int x_bf16, int64_t T, int64_t D, const void *w, int w_bf16,
                    int64_t E, const float *bias, int64_t n_group, int64_t topk_group, int64_t k, int renormalize,
                    float scale, int64_t *ids, float *weights, int num_threads);
/* mxfp4_gemm.c */
int mxfp4_moe_tokens(const void *h, int64_t h_stride, int h_bf16, int64_t T, int64_t d, const int64_t *ids,
                     const float *w, int64_t k, int64_t E, const int64_t *w13, const int64_t *w13_scales,
                     int64_t w13_parts, int64_t w13_stride, int64_t w13_scale_stride, int64_t I, const int64_t *w2,
                     const int64_t *w2_scales, int64_t w2_stride, int64_t w2_scale_stride, int act_kind, float beta,
                     float linear_beta, float *out, int num_threads);
/* rms_norm.c */
void rms_norm_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, const void *w, int w_bf16, int64_t M,
                   int64_t D, float eps, int x_bf16, int num_threads);

/* A layer's weights by address (tidal.ops.cpu_kernels.MoeLayerWeights): d = hidden, de = the
 * experts' width (d without the latent projections), I the routed experts' intermediate size. */
struct moe_layer_weights {
    int64_t hidden, expert_hidden, num_experts, top_k, n_group, topk_group, renormalize;
    float routed_scale;
    const void *router_w;   /* [E, d] float32 or bfloat16 (router_bf16), contiguous */
    int64_t router_bf16;
    const float *router_bias; /* [E] */
    const uint16_t *down_w, *up_w; /* latent: [de, d] and [d, de] bfloat16; NULL without */
    int64_t down_stride, up_stride;
    const void *norm_w;     /* latent norm [de] float32 or bfloat16 (norm_bf16); NULL: no norm */
    int64_t norm_bf16;
    float norm_eps;
    /* the routed experts as mxfp4_moe_tokens reads them (mxfp4_gemm.c's expert_rows tables) */
    const int64_t *w13, *w13_scales;
    int64_t w13_parts, w13_stride, w13_scale_stride, inter;
    const int64_t *w2, *w2_scales;
    int64_t w2_stride, w2_scale_stride;
    int64_t act_kind; /* 1 SiTU, 0 SwiGLU */
    float beta, linear_beta;
    const struct mlp_weights *shared; /* NULL: no shared expert */
};

/* The branches run side by side where the smaller reads at least this share of the larger's bytes:
 * below it, one thread on the larger branch costs more than the second thread saves. */
#define SPLIT_MIN_SHARE 0.5

/* x [T, d] -> the routed experts' sum in the model's width, bfloat16 [T, d] (routed): the torch
 * form's router, down projection (bf16 out), experts (float32, then .to(bfloat16)), norm (bf16 in
 * and out) and up projection (bf16 out). Returns 0, or -1 (no memory, an expert id out of range). */
static int routed_branch(const struct moe_layer_weights *w, const uint16_t *x, int64_t x_stride, int64_t T,
                         uint16_t *routed, int num_threads) {
    const int64_t d = w->hidden, de = w->expert_hidden, k = w->top_k;
    const int latent = w->down_w != NULL;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(T * k));
    float *wts = malloc(sizeof(float) * (size_t)(T * k));
    float *fd = malloc(sizeof(float) * (size_t)(T * d)), *fe = malloc(sizeof(float) * (size_t)(T * de));
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(T * de)), *y = malloc(sizeof(uint16_t) * (size_t)(T * de));
    int status = -1;
    if (!ids || !wts || !fd || !fe || !h || !y) goto done;
    if (moe_router_topk(x, x_stride, 1, T, d, w->router_w, (int)w->router_bf16, w->num_experts, w->router_bias,
                        w->n_group, w->topk_group, k, (int)w->renormalize, w->routed_scale, ids, wts, num_threads))
        goto done;
    const uint16_t *hx = x;
    int64_t h_stride = x_stride;
    if (latent) {  /* h = down(x), bfloat16 */
        bf16_rows_linear(x, x_stride, T, d, 1, &w->down_w, &w->down_stride, &de, fd, fe, h, num_threads);
        hx = h, h_stride = de;
    }
    if (mxfp4_moe_tokens(hx, h_stride, 1, T, de, ids, wts, k, w->num_experts, w->w13, w->w13_scales, w->w13_parts,
                         w->w13_stride, w->w13_scale_stride, w->inter, w->w2, w->w2_scales, w->w2_stride,
                         w->w2_scale_stride, (int)w->act_kind, w->beta, w->linear_beta, fe, num_threads))
        goto done;
    if (latent) {  /* up(norm(y)), each bfloat16 */
        round_to_bf16(fe, T * de, y);
        if (w->norm_w != NULL) rms_norm_rows(y, de, y, de, w->norm_w, (int)w->norm_bf16, T, de, w->norm_eps, 1, num_threads);
        bf16_rows_linear(y, de, T, de, 1, &w->up_w, &w->up_stride, &d, fe, fd, routed, num_threads);
    } else {  /* de == d */
        round_to_bf16(fe, T * d, routed);
    }
    status = 0;
done:
    free(ids);
    free(wts);
    free(fd);
    free(fe);
    free(h);
    free(y);
    return status;
}

/* bytes of weights each branch reads at T rows (the routed experts: as if the rows' top-k were
 * all distinct) */
static double routed_bytes(const struct moe_layer_weights *w, int64_t T) {
    const double d = (double)w->hidden, de = (double)w->expert_hidden, I = (double)w->inter;
    const double E = (double)w->num_experts, active = T * w->top_k < w->num_experts ? (double)(T * w->top_k) : E;
    const double expert = (2 * I * de + de * I) * (0.5 + 1.0 / 32);  /* 4-bit codes + one scale byte per 32 */
    return E * d * (w->router_bf16 ? 2 : 4) + (w->down_w != NULL ? 2 * d * de * 2 : 0) + active * expert;
}

static double shared_bytes(const struct moe_layer_weights *w) {
    return w->shared == NULL ? 0.0 : 3.0 * (double)w->shared->hidden * (double)w->shared->inter * 2;
}

/* float32 values of scratch moe_layer_step needs per row: the shared expert's */
int64_t moe_layer_step_scratch(const struct moe_layer_weights *w) {
    return w->shared != NULL ? mlp_step_scratch(w->shared) : 0;
}

/* x [T, hidden] bfloat16 rows (row stride x_stride) -> out [T, hidden] bfloat16, contiguous:
 * routed(x) + shared(x), each rounded to bfloat16 first (the torch form's bf16 + bf16). scratch
 * holds T * moe_layer_step_scratch(w) floats. Returns 0, -1 (no memory, an expert id out of
 * range), or -2 (a shared expert whose gate and up differ in size). */
int moe_layer_step(const struct moe_layer_weights *w, const uint16_t *x, int64_t x_stride, int64_t T, uint16_t *out,
                   float *scratch, int num_threads) {
    const int64_t d = w->hidden;
    uint16_t *shared = w->shared != NULL ? malloc(sizeof(uint16_t) * (size_t)(T * d)) : NULL;
    if (w->shared != NULL && shared == NULL) return -1;
    const double r = routed_bytes(w, T), s = shared_bytes(w);
    const int split = num_threads > 1 && s > 0 && (r < s ? r >= SPLIT_MIN_SHARE * s : s >= SPLIT_MIN_SHARE * r);
    int routed_status = 0, shared_status = 0;
    if (split) {
#pragma omp parallel sections num_threads(2)
        {
#pragma omp section
            routed_status = routed_branch(w, x, x_stride, T, out, 1);
#pragma omp section
            shared_status = mlp_step(w->shared, x, x_stride, T, shared, scratch, 1);
        }
    } else {
        routed_status = routed_branch(w, x, x_stride, T, out, num_threads);
        if (w->shared != NULL) shared_status = mlp_step(w->shared, x, x_stride, T, shared, scratch, num_threads);
    }
    if (shared != NULL && routed_status == 0 && shared_status == 0)
        for (int64_t i = 0; i < T * d; i++) out[i] = float_to_bf16(bf16_to_float(out[i]) + bf16_to_float(shared[i]));
    free(shared);
    return routed_status != 0 ? -1 : shared_status != 0 ? -2 : 0;
}
