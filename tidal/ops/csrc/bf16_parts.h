/* Float32 rows times bfloat16 weights side by side (bf16_gemm.c, and kda_layer_decode.c's whole
 * layer step, which multiplies by its projections without leaving C).
 *
 * The register tiles and the summation order are row_tiles.h's: a row's result is bitwise
 * independent of the other rows, M and the thread count. bf16 -> float32 is a 16-bit shift, done in
 * registers; a tile's weight rows stay in L1 while a block of rows (in L2) passes under them. Work
 * items are (row block, weight-row chunk) pairs split over threads.
 *
 * Rows of bfloat16 values (bf16_rows_linear, bf16_values_product) take the AMX-BF16 tiles instead
 * from a threshold number of rows (amx_tiles.h): row-invariant too, in their own order, so a row's
 * bits differ on either side of the threshold (never under deterministic inference, which turns
 * the tiles off). Float32 rows (bf16_parts_product) always run the register tiles.
 */
#include <stdint.h>
#include <string.h>

#include "bf16_scalar.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILE_AVX2 1
static inline __m256 load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define TILE_LOAD8 load8
#ifdef __AVX512F__
/* 8 weights of row p0 (low 256 bits) and of row p1 (high), widened as load8 does */
static inline __m512 load8_pair(const uint16_t *p0, const uint16_t *p1) {
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                              _mm_loadu_si128((const __m128i *)p1), 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#define TILE_LOAD8_PAIR load8_pair
#define TILE_WIDEN_PANEL 1
#endif
#define TILE_PREFETCH 1
#endif

#define TILE_W uint16_t
#define TILE_VALUE bf16_to_float
#include "row_tiles.h"

/* Weight rows per work item (a multiple of every tile width), and bytes of x rows per row block. */
#define COL_CHUNK 48
#define ROW_BLOCK_BYTES (192 * 1024)
/* A product of fewer multiply-adds runs on the calling thread: waking a passive OpenMP pool costs
 * tens of microseconds, more than a second thread saves on a weight of a few hundred KiB. The
 * summation order does not depend on the thread count, so the bits are the same either way. */
#define PARALLEL_MIN_MACS (1 << 20)
#define MAX_PARTS 8

#include "amx_tiles.h"

/* x [M, K] (contiguous rows) times P weights side by side, as if their rows were one weight: out
 * [M, N_0 + ... + N_{P-1}], part p's columns after those of the parts before it; part p is ws[p]
 * [N_p, K] at row stride w_strides[p]. Each output is the sum on the concatenated weight, bit for
 * bit, without concatenating it (the parts stay where they are: a checkpoint's mapped pages, say).
 * Returns 0, or -1 for more than MAX_PARTS parts. */
static int bf16_parts_product(const float *x, int64_t M, int64_t K, int64_t parts, const uint16_t *const *ws,
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

/* bf16_parts_product for float32 rows x whose values are all bfloat16 ones (widened or rounded
 * bfloat16 intermediates of the layer steps): on the AMX tiles where amx_tiles.h takes M rows (their
 * order, not row_tiles.h's), else bf16_parts_product. The same bits as bf16_rows_linear's float32
 * sums on those rows. */
static inline int bf16_values_product(const float *x, int64_t M, int64_t K, int64_t parts, const uint16_t *const *ws,
                                      const int64_t *w_strides, const int64_t *ns, float *out, int num_threads) {
    if (amx_takes(M, K) && amx_parts_product(NULL, 0, x, M, K, parts, ws, w_strides, ns, out, num_threads) == 0)
        return 0;
    return bf16_parts_product(x, M, K, parts, ws, w_strides, ns, out, num_threads);
}

/* bfloat16 rows x [M, K] (row stride x_stride) times P bfloat16 weights side by side (as
 * bf16_parts_product) -> bfloat16 out [M, N_0 + ...], contiguous: the torch form's bf16 linear
 * (float32 sums, one rounding at the end), through bf16_values_product's choice of tiles. xf
 * [M, K] and of [M, N] are float32 scratch; out may be x's memory (x is read before out is
 * written). Returns bf16_parts_product's status. */
static inline int bf16_rows_linear(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, int64_t parts,
                                   const uint16_t *const *ws, const int64_t *w_strides, const int64_t *ns, float *xf,
                                   float *of, uint16_t *out, int num_threads) {
    int64_t N = 0;
    for (int64_t p = 0; p < parts && p < MAX_PARTS; p++) N += ns[p];
    int status = -1;
    if (amx_takes(M, K)) status = amx_parts_product(x, x_stride, NULL, M, K, parts, ws, w_strides, ns, of, num_threads);
    if (status != 0) {
        widen_bf16(x, x_stride, M, K, xf);
        status = bf16_parts_product(xf, M, K, parts, ws, w_strides, ns, of, num_threads);
    }
    if (status == 0) round_to_bf16(of, M * N, out);
    return status;
}
