/* Rows grouped by expert times that expert's weight, for the few rows per expert of a decode batch:
 * the C form of the per-expert matmuls in tidal.model.moe.Experts.
 *
 * Group g holds rows offsets[g] .. offsets[g+1]-1 of x [S, K]; out[t] = x[t] @ w[experts[g]]^T with
 * w [E, N, K] (expert e's [N, K] matrix at w + e * expert_stride, rows contiguous). Each weight row
 * is read from memory once and used for all of the group's rows while in L1, so decode runs near
 * the memory bandwidth where a BLAS call per expert pays its setup on a handful of rows; groups run
 * in parallel. Every output is one fixed-order dot product: a row's result does not depend on the
 * other rows, the batch or the thread count.
 */
#include <stdint.h>

void grouped_rows_gemm(const float *x, int64_t K, const int64_t *offsets, const int64_t *experts, int64_t G,
                       const float *w, int64_t expert_stride, int64_t N, float *out, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t g = 0; g < G; g++) {
        const float *we = w + experts[g] * expert_stride;
        for (int64_t j = 0; j < N; j++) {
            const float *restrict wr = we + j * K;
            for (int64_t t = offsets[g]; t < offsets[g + 1]; t++) {
                const float *restrict xr = x + t * K;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t k = 0; k < K; k++) s += xr[k] * wr[k];
                out[t * N + j] = s;
            }
        }
    }
}
