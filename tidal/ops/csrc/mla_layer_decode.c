/* One bfloat16 MLA layer for one decode token per sequence, in one call
 * (tidal.model.mla.KimiMLA.forward of a decode step over the engine's pages): the input projections
 * (q_a or q, kv_a, the output gate's, one parts product), q_a_layernorm and q_b_proj, kv_a_layernorm,
 * the new latent [c | k_pe] written into its page row, the absorbed paged attention (mla_decode.c's
 * mla_absorbed_decode: kv_b_proj's weight read in place), the output gate o * sigmoid(g)
 * (gated_act.h's sigmoid_row, as activation.c's sigmoid_gate_rows) and o_proj.
 *
 * This library links mla_decode.c and rms_norm.c beside this file (tidal.ops.cpu_kernels.
 * LIBRARY_SOURCES): the separate calls' code, with every value the torch form holds in a bfloat16
 * tensor rounded to bfloat16 at the same point, so the result and the written latent have the bits
 * of the separate calls. Each of those computes a row (a sequence) by one thread in a fixed order:
 * a row's result does not depend on the other rows or the thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_parts.h"
#include "bf16_scalar.h"
#include "gated_act.h"

/* mla_decode.c */
int mla_absorbed_decode(const void *layer_base, int64_t page_stride, int64_t page_size, const int64_t *table,
                        int64_t max_pages, const int64_t *lengths, const void *q_nope, const void *q_pe,
                        const int64_t *qn, const int64_t *qp, int q_bf16, const void *w, int w_bf16, void *out,
                        int out_bf16, int64_t B, int64_t n, int64_t dn, int64_t dv, int64_t C, int64_t r, float scale,
                        int bf16, int num_threads);
/* rms_norm.c */
void rms_norm_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, const void *w, int w_bf16, int64_t M,
                   int64_t D, float eps, int x_bf16, int num_threads);

/* A layer's weights by address (tidal.ops.cpu_kernels.MlaLayerWeights), all bfloat16 with contiguous
 * rows at their strides; the norms' weights float32 or bfloat16. */
struct mla_layer_weights {
    int64_t hidden, heads, q_rank /* 0: q_proj, no q-LoRA */, kv_rank, nope, rope, v_dim, gated;
    const uint16_t *in_w[3]; /* q_a (or q_proj), kv_a, the output gate (gated) */
    int64_t in_stride[3], in_rows[3];
    const uint16_t *q_b_w;
    int64_t q_b_stride;
    const void *q_norm_w, *kv_norm_w;
    int64_t q_norm_bf16, kv_norm_bf16;
    float q_eps, kv_eps, scale;
    const uint16_t *kv_b_w; /* [heads (nope + v_dim), kv_rank], contiguous */
    const uint16_t *o_w;
    int64_t o_stride;
};

/* x [T, hidden] bfloat16 rows (row stride x_stride) -> out [T, hidden] bfloat16, contiguous. Token t
 * is the one new token of its sequence: its latent goes to row write_pos[t] of page write_page[t],
 * and it attends over lengths[t] rows (its own included) of pages table[t, ..] (max_pages a row).
 * pages: the layer's rows, page p at pages + p * page_stride, page_size rows of kv_rank + rope
 * bfloat16 values each. Returns 0, -1 (no memory), or -2 (projection sizes that do not fit). */
int mla_layer_step(const struct mla_layer_weights *w, const uint16_t *x, int64_t x_stride, int64_t T, uint16_t *pages,
                   int64_t page_stride, int64_t page_size, const int64_t *table, int64_t max_pages,
                   const int64_t *lengths, const int64_t *write_page, const int64_t *write_pos, uint16_t *out,
                   int num_threads) {
    const int64_t d = w->hidden, n = w->heads, qr = w->q_rank, r = w->kv_rank, dn = w->nope, dr = w->rope;
    const int64_t dv = w->v_dim, C = r + dr, q_width = n * (dn + dr), parts = w->gated ? 3 : 2;
    if (w->in_rows[0] != (qr ? qr : q_width) || w->in_rows[1] != C || (w->gated && w->in_rows[2] != n * dv))
        return -2;
    const int64_t N_in = w->in_rows[0] + C + (w->gated ? n * dv : 0);
    int64_t widest = d;  /* of the float32 rows: x, the projections' outputs, the gated attention */
    const int64_t widths[3] = {N_in, q_width, n * dv};
    for (int i = 0; i < 3; i++) widest = widths[i] > widest ? widths[i] : widest;
    float *f = malloc(sizeof(float) * (size_t)(T * widest)), *g = malloc(sizeof(float) * (size_t)(T * widest));
    uint16_t *proj = malloc(sizeof(uint16_t) * (size_t)(T * N_in));
    uint16_t *q = malloc(sizeof(uint16_t) * (size_t)(T * (q_width > qr ? q_width : qr)));
    uint16_t *o = malloc(sizeof(uint16_t) * (size_t)(T * n * dv));
    int status = -1;
    if (!f || !g || !proj || !q || !o) goto done;
    /* the input projections, one product, bfloat16 out */
    bf16_rows_linear(x, x_stride, T, d, parts, w->in_w, w->in_stride, w->in_rows, f, g, proj, num_threads);
    /* q: q_b_proj(q_a_layernorm(q_a)), or the q_proj part itself */
    const uint16_t *qv = proj;
    int64_t q_stride = N_in;
    if (qr) {
        rms_norm_rows(proj, N_in, q, qr, w->q_norm_w, (int)w->q_norm_bf16, T, qr, w->q_eps, 1, num_threads);
        bf16_rows_linear(q, qr, T, qr, 1, &w->q_b_w, &w->q_b_stride, &q_width, f, g, q, num_threads);
        qv = q, q_stride = q_width;
    }
    /* the new latents [kv_a_layernorm(c) | k_pe] into their page rows, before attention reads them */
    const int64_t kv0 = w->in_rows[0];
    for (int64_t t = 0; t < T; t++) {
        uint16_t *row = pages + write_page[t] * page_stride + write_pos[t] * C;
        rms_norm_rows(proj + t * N_in + kv0, N_in, row, C, w->kv_norm_w, (int)w->kv_norm_bf16, 1, r, w->kv_eps, 1, 1);
        memcpy(row + r, proj + t * N_in + kv0 + r, sizeof(uint16_t) * (size_t)dr);
    }
    const int64_t qn[2] = {q_stride, dn + dr}, qp[2] = {q_stride, dn + dr};
    if (mla_absorbed_decode(pages, page_stride, page_size, table, max_pages, lengths, qv, qv + dn, qn, qp, 1, w->kv_b_w,
                            1, o, 1, T, n, dn, dv, C, r, w->scale, 1, num_threads))
        goto done;
    /* the output gate, then o_proj */
    if (w->gated) {
        widen_bf16(proj + kv0 + C, N_in, T, n * dv, g);
        widen_bf16(o, n * dv, T, n * dv, f);
        for (int64_t t = 0; t < T; t++) sigmoid_row(g + t * n * dv, f + t * n * dv, f + t * n * dv, n * dv);
        round_to_bf16(f, T * n * dv, o);
    }
    bf16_rows_linear(o, n * dv, T, n * dv, 1, &w->o_w, &w->o_stride, &d, f, g, out, num_threads);
    status = 0;
done:
    free(f);
    free(g);
    free(proj);
    free(q);
    free(o);
    return status;
}
