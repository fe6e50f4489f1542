/* Float32 rows times a bfloat16 weight: out[t, j] = x[t] . w[j] (x [M, K] float32, w [N, K]
 * bfloat16 with rows contiguous, out [M, N] float32): the C form of F.linear for the bf16 trunk on
 * CPUs without bf16 dot products, where torch's bf16 matmul runs at a fraction of float32 speed.
 *
 * The register tiles and the summation order are row_tiles.h's: a row's result is bitwise
 * independent of the other rows, M and the thread count. bf16 -> float32 is a 16-bit shift, done in
 * registers; a tile's weight rows stay in L1 while a block of rows (in L2) passes under them. Work
 * items are (row block, weight-row chunk) pairs split over threads. bf16_gemm_bf16: bfloat16 rows in
 * and out, for the bf16 trunk without float32 copies around the call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_scalar.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILE_AVX2 1
static inline __m256 load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define TILE_LOAD8 load8
#define TILE_PREFETCH 1
#endif

static inline float bf16(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define TILE_W uint16_t
#define TILE_VALUE bf16
#include "row_tiles.h"

/* Weight rows per work item (a multiple of every tile width), and bytes of x rows per row block. */
#define COL_CHUNK 48
#define ROW_BLOCK_BYTES (192 * 1024)
/* A product of fewer multiply-adds runs on the calling thread: waking a passive OpenMP pool costs
 * tens of microseconds, more than a second thread saves on a weight of a few hundred KiB. The
 * summation order does not depend on the thread count, so the bits are the same either way. */
#define PARALLEL_MIN_MACS (1 << 20)

/* x times P weights side by side, as if their rows were one weight: out [M, N_0 + ... + N_{P-1}],
 * part p's columns after those of the parts before it; part p is ws[p] [N_p, K] at row stride
 * w_strides[p]. Each output is bf16_gemm's sum on the concatenated weight, bit for bit, without
 * concatenating it (the parts stay where they are: a checkpoint's mapped pages, say). Returns 0,
 * or -1 for more than MAX_PARTS parts. */
#define MAX_PARTS 8
int bf16_gemm_parts(const float *x, int64_t M, int64_t K, int64_t parts, const uint16_t *const *ws,
                    const int64_t *w_strides, const int64_t *ns, float *out, int num_threads) {
    if (parts < 1 || parts > MAX_PARTS) return -1;
    int64_t first_chunk[MAX_PARTS + 1], first_col[MAX_PARTS + 1];
    first_chunk[0] = first_col[0] = 0;
    for (int64_t p = 0; p < parts; p++) {
        first_chunk[p + 1] = first_chunk[p] + (ns[p] + COL_CHUNK - 1) / COL_CHUNK;
        first_col[p + 1] = first_col[p] + ns[p];
    }
    const int64_t N = first_col[parts], chunks = first_chunk[parts];
    int64_t mb = ROW_BLOCK_BYTES / (K * (int64_t)sizeof(float) + 1) / MAX_R * MAX_R;
    if (mb < MAX_R) mb = MAX_R;
    const int64_t row_blocks = (M + mb - 1) / mb;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * N * K >= PARALLEL_MIN_MACS)
    for (int64_t item = 0; item < row_blocks * chunks; item++) {
        const int64_t chunk = item % chunks, t0 = item / chunks * mb;
        int64_t p = 0;
        while (chunk >= first_chunk[p + 1]) p++;
        const int64_t j0 = (chunk - first_chunk[p]) * COL_CHUNK;
        const int64_t t1 = t0 + mb < M ? t0 + mb : M, j1 = j0 + COL_CHUNK < ns[p] ? j0 + COL_CHUNK : ns[p];
        rows_times_panel(x, K, t0, t1, ws[p] + j0 * w_strides[p], w_strides[p], j0, j1, out + first_col[p], N);
    }
    return 0;
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
    if (xf == NULL || of == NULL) {
        free(xf);
        free(of);
        return -1;
    }
    for (int64_t t = 0; t < M; t++)
        for (int64_t k = 0; k < K; k++) xf[t * K + k] = bf16_to_float(x[t * x_stride + k]);
    const int status = bf16_gemm_parts(xf, M, K, parts, ws, w_strides, ns, of, num_threads);
    if (status == 0)
        for (int64_t i = 0; i < M * N; i++) out[i] = float_to_bf16(of[i]);
    free(xf);
    free(of);
    return status;
}

int bf16_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, const uint16_t *w, int64_t w_stride,
                   int64_t N, uint16_t *out, int num_threads) {
    return bf16_gemm_bf16_parts(x, x_stride, M, K, 1, &w, &w_stride, &N, out, num_threads);
}
