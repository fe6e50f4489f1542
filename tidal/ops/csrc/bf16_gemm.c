/* Float32 rows times a bfloat16 weight: out[t, j] = x[t] . w[j] (x [M, K] float32, w [N, K]
 * bfloat16 with rows contiguous, out [M, N] float32): the C form of F.linear for the bf16 trunk on
 * CPUs without bf16 dot products, where torch's bf16 matmul runs at a fraction of float32 speed.
 *
 * The register tiles and the summation order are row_tiles.h's: a row's result is bitwise
 * independent of the other rows, M and the thread count. bf16 -> float32 is a 16-bit shift, done in
 * registers; a tile's weight rows stay in L1 while a block of rows (in L2) passes under them. Work
 * items are (row block, weight-row chunk) pairs split over threads.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILE_AVX2 1
static inline __m256 load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define TILE_LOAD8 load8
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

void bf16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t w_stride, int64_t N, float *out,
               int num_threads) {
    int64_t mb = ROW_BLOCK_BYTES / (K * (int64_t)sizeof(float) + 1) / MAX_R * MAX_R;
    if (mb < MAX_R) mb = MAX_R;
    const int64_t row_blocks = (M + mb - 1) / mb, col_chunks = (N + COL_CHUNK - 1) / COL_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < row_blocks * col_chunks; item++) {
        const int64_t t0 = item / col_chunks * mb, j0 = item % col_chunks * COL_CHUNK;
        const int64_t t1 = t0 + mb < M ? t0 + mb : M, j1 = j0 + COL_CHUNK < N ? j0 + COL_CHUNK : N;
        rows_times_panel(x, K, t0, t1, w + j0 * w_stride, w_stride, j0, j1, out, N);
    }
}
