/* Float32 rows times a bfloat16 weight: out[t, j] = x[t] . w[j] (x [M, K] float32, w [N, K]
 * bfloat16 with rows contiguous, out [M, N] float32): the C form of F.linear for the bf16 trunk on
 * CPUs without bf16 dot products, where torch's bf16 matmul runs at a fraction of float32 speed.
 * The product itself is bf16_parts.h's (tiles, order, threads). bf16_gemm_bf16: bfloat16 rows in
 * and out, for the bf16 trunk without float32 copies around the call.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16_parts.h"
#include "bf16_scalar.h"

/* x times P weights side by side (bf16_parts.h): 0, or -1 for more than MAX_PARTS parts. */
int bf16_gemm_parts(const float *x, int64_t M, int64_t K, int64_t parts, const uint16_t *const *ws,
                    const int64_t *w_strides, const int64_t *ns, float *out, int num_threads) {
    return bf16_parts_product(x, M, K, parts, ws, w_strides, ns, out, num_threads);
}

/* float32 rows x whose values are all bfloat16 ones times P weights, float32 out: the layer steps'
 * products (bf16_values_product: the AMX tiles where they apply), for tests and benchmarks. */
int bf16_gemm_values_parts(const float *x, int64_t M, int64_t K, int64_t parts, const uint16_t *const *ws,
                           const int64_t *w_strides, const int64_t *ns, float *out, int num_threads) {
    return bf16_values_product(x, M, K, parts, ws, w_strides, ns, out, num_threads);
}

void bf16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t w_stride, int64_t N, float *out,
               int num_threads) {
    bf16_gemm_parts(x, M, K, 1, &w, &w_stride, &N, out, num_threads);
}

/* bfloat16 rows in and out (x [M, K] at row stride x_stride, out [M, N] contiguous): the rows are
 * widened to float32 (exact), multiplied as above, and the float32 sums rounded to nearest even,
 * the bits of bf16_gemm followed by torch's .to(torch.bfloat16). Returns 0, or -1 when the
 * scratch buffers cannot be allocated. */
int bf16_gemm_bf16_parts(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, int64_t parts,
                         const uint16_t *const *ws, const int64_t *w_strides, const int64_t *ns, uint16_t *out,
                         int num_threads) {
    int64_t N = 0;
    for (int64_t p = 0; p < parts && p < MAX_PARTS; p++) N += ns[p];
    float *xf = malloc((size_t)(M * K) * sizeof(float)), *of = malloc((size_t)(M * N) * sizeof(float));
    int status = -1;
    if (xf != NULL && of != NULL)
        status = bf16_rows_linear(x, x_stride, M, K, parts, ws, w_strides, ns, xf, of, out, num_threads);
    free(xf);
    free(of);
    return status;
}

int bf16_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, const uint16_t *w, int64_t w_stride,
                   int64_t N, uint16_t *out, int num_threads) {
    return bf16_gemm_bf16_parts(x, x_stride, M, K, 1, &w, &w_stride, &N, out, num_threads);
}
