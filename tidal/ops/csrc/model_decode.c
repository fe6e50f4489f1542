/* A bfloat16 Kimi model's decode step, embedding to final norm, in one call: the layers' one-call
 * steps (kda_layer_step, mla_layer_step, moe_layer_step, mlp_step) and the Block AttnRes glue between
 * them (attn_res_glue, attn_res_inv_rms), called in the order of tidal.model.kimi.KimiModel's
 * _forward_attn_res with the arguments its Python calls pass, so the result has their bits.
 *
 * At a few rows a layer's kernels read a few MiB of weights each, and the Python around each of a
 * step's ~40 kernel calls (argument checks, ctypes conversions, tensor allocations) is of the same
 * order as the kernels; here the step is one call. This library links those kernels' sources
 * (tidal.ops.cpu_kernels.LIBRARY_SOURCES). */
#include <stdint.h>
#include <stdlib.h>

struct kda_layer_weights;
struct mla_layer_weights;
struct moe_layer_weights;
struct mlp_weights;

int kda_layer_step(const struct kda_layer_weights *w, const uint16_t *x, int64_t x_stride, int64_t T,
                   void *conv_state, int64_t conv_stride, int conv_bf16, float *rec_state, int64_t rec_stride,
                   const int32_t *slots, uint16_t *out, float *scratch, int num_threads);
int mla_layer_step(const struct mla_layer_weights *w, const uint16_t *x, int64_t x_stride, int64_t T, uint16_t *pages,
                   int64_t page_stride, int64_t page_size, const int64_t *table, int64_t max_pages,
                   const int64_t *lengths, const int64_t *write_page, const int64_t *write_pos, uint16_t *out,
                   int num_threads);
int moe_layer_step(const struct moe_layer_weights *w, const uint16_t *x, int64_t x_stride, int64_t T, uint16_t *out,
                   float *scratch, int num_threads);
int mlp_step(const struct mlp_weights *w, const uint16_t *x, int64_t x_stride, int64_t T, uint16_t *out,
             float *scratch, int num_threads);
void attn_res_inv_rms(const void *x, int64_t stride, int64_t T, int64_t D, float eps, int is_bf16, float *out);
int attn_res_glue(const void *partial, int64_t p_stride, const void *add, int64_t a_stride, void *sum,
                  const void *const *blocks, const int64_t *b_strides, int64_t n_blocks,
                  const float *const *block_inv_rms, const float *query, float eps, void *mixed, const void *norm_w,
                  int norm_w_bf16, float norm_eps, void *normed, int64_t T, int64_t D, int is_bf16, int num_threads);

#define MAX_BLOCKS 63 /* attn_res_glue takes 64 values: the blocks and the partial sum */

/* The AttnRes glue before a sub-layer: its pseudo-query and the sub-layer's input norm. */
struct glue_weights {
    const float *query;  /* [hidden] float32 */
    const void *norm_w;  /* [hidden] float32 or bfloat16 (norm_bf16) */
    int64_t norm_bf16;
    float norm_eps;
};

/* One decoder layer (tidal.ops.fused_decode.DecodeLayer). The state and page fields are the pool's
 * storage of this layer, set by the caller before each step. */
struct decode_layer {
    int64_t attn_kind; /* 0: KDA, 1: MLA */
    const void *attn_w;
    float *attn_scratch; /* KDA: T * kda_layer_step_scratch floats */
    void *conv_state;
    int64_t conv_stride, conv_bf16;
    float *rec_state;
    int64_t rec_stride;
    uint16_t *pages;
    int64_t page_stride, page_size;
    int64_t ffn_kind; /* 0: dense MLP, 1: MoE */
    const void *ffn_w;
    float *ffn_scratch;
    struct glue_weights attn_glue, ffn_glue;
};

struct decode_program {
    int64_t num_layers, hidden, block_size;
    float eps; /* AttnRes's */
    struct decode_layer *layers;
    struct glue_weights out_glue; /* the output AttnRes and the final norm */
};

/* The step's working rows: a ring of RING rows of T x hidden values, taken in turn (blocks are kept
 * apart). A value is last read when at most 4 more rows have been taken after it (a partial sum, by
 * the next glue, which takes the new sum after the mixed and normed rows and the sub-layer's
 * output), so any ring of 5 or more rows holds every live value. */
#define RING 8

struct rows {
    uint16_t *ring;
    int64_t n, taken;
};

static uint16_t *take(struct rows *r) { return r->ring + (r->taken++ % RING) * r->n; }

/* One glue call: sum = partial + add (partial without add), mixed = AttnRes over the blocks (sum
 * without blocks), normed = the norm of mixed. */
static int glue(const struct decode_program *p, const struct glue_weights *g, const uint16_t *partial,
                const uint16_t *add, const void *const *blocks, const int64_t *strides, int64_t n_blocks,
                const float *const *inv, int64_t T, struct rows *r, uint16_t **sum, uint16_t **normed,
                int num_threads) {
    *sum = add != NULL ? take(r) : (uint16_t *)partial;
    uint16_t *mixed = n_blocks > 0 ? take(r) : *sum;
    *normed = take(r);
    return attn_res_glue(partial, p->hidden, add, p->hidden, *sum, blocks, strides, n_blocks, inv, g->query, p->eps,
                         mixed, g->norm_w, (int)g->norm_bf16, g->norm_eps, *normed, T, p->hidden, 1, num_threads);
}

/* h [T, hidden] bfloat16 (contiguous: the embeddings of one new token per sequence) -> out [T, hidden]
 * bfloat16, the final-normed hidden states. Token t's KDA states are in slot slots[t]; its latent
 * goes to row write_pos[t] of page write_page[t] and it attends over lengths[t] rows of pages
 * table[t, ..] (max_pages a row) in every MLA layer. Returns 0; -1 (no memory, more blocks than
 * the glue takes, or an MoE layer's expert ids out of range); -2 a KDA or MLA layer's weights that
 * do not fit; nothing after a failed layer is computed (the states of earlier layers have moved:
 * the step is failed). */
int model_decode_step(const struct decode_program *p, const uint16_t *h, int64_t T, const int32_t *slots,
                      const int64_t *table, int64_t max_pages, const int64_t *lengths, const int64_t *write_page,
                      const int64_t *write_pos, uint16_t *out, int num_threads) {
    const int64_t L = p->num_layers, n = T * p->hidden, max_blocks = (L + p->block_size - 1) / p->block_size;
    if (max_blocks > MAX_BLOCKS) return -1;
    struct rows r = {malloc(sizeof(uint16_t) * (size_t)(RING * n)), n, 0};
    uint16_t *block_rows = malloc(sizeof(uint16_t) * (size_t)(max_blocks * n)); /* the blocks, kept whole */
    float *inv_rows = malloc(sizeof(float) * (size_t)(T * max_blocks));
    int status = -1;
    if (r.ring == NULL || block_rows == NULL || inv_rows == NULL) goto done;
    const void *blocks[MAX_BLOCKS];
    int64_t strides[MAX_BLOCKS];
    const float *inv[MAX_BLOCKS];
    int64_t n_blocks = 0;
    uint16_t *sum, *normed;
    const uint16_t *partial = h, *add = NULL;
    for (int64_t i = 0; i < L; i++) {
        const struct decode_layer *l = &p->layers[i];
        if (glue(p, &l->attn_glue, partial, add, blocks, strides, n_blocks, inv, T, &r, &sum, &normed, num_threads))
            goto done;
        partial = sum;
        if (i % p->block_size == 0) { /* the partial sum completes a block */
            uint16_t *b = block_rows + n_blocks * n;
            for (int64_t j = 0; j < n; j++) b[j] = partial[j];
            float *rms = inv_rows + n_blocks * T;
            attn_res_inv_rms(b, p->hidden, T, p->hidden, p->eps, 1, rms);
            blocks[n_blocks] = b, strides[n_blocks] = p->hidden, inv[n_blocks] = rms;
            n_blocks++;
            partial = NULL;
        }
        uint16_t *a = take(&r);
        if (l->attn_kind == 0) {
            if (kda_layer_step(l->attn_w, normed, p->hidden, T, l->conv_state, l->conv_stride, (int)l->conv_bf16,
                               l->rec_state, l->rec_stride, slots, a, l->attn_scratch, num_threads)) {
                status = -2;
                goto done;
            }
        } else {
            const int s = mla_layer_step(l->attn_w, normed, p->hidden, T, l->pages, l->page_stride, l->page_size, table,
                                         max_pages, lengths, write_page, write_pos, a, num_threads);
            if (s) {
                status = s == -2 ? -2 : -1;
                goto done;
            }
        }
        if (partial == NULL) partial = a, add = NULL;
        else add = a;
        if (glue(p, &l->ffn_glue, partial, add, blocks, strides, n_blocks, inv, T, &r, &sum, &normed, num_threads))
            goto done;
        partial = sum;
        uint16_t *f = take(&r);
        if (l->ffn_kind == 1 ? moe_layer_step(l->ffn_w, normed, p->hidden, T, f, l->ffn_scratch, num_threads)
                             : mlp_step(l->ffn_w, normed, p->hidden, T, f, l->ffn_scratch, num_threads))
            goto done;
        add = f;
    }
    if (glue(p, &p->out_glue, partial, add, blocks, strides, n_blocks, inv, T, &r, &sum, &normed, num_threads))
        goto done;
    for (int64_t j = 0; j < n; j++) out[j] = normed[j];
    status = 0;
done:
    free(r.ring);
    free(block_rows);
    free(inv_rows);
    return status;
}
