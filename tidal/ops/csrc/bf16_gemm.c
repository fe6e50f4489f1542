/* Float32 rows times a bfloat16 weight: out[t, j] = x[t] . w[j] (x [M, K] float32, w [N, K]
 * bfloat16 with rows contiguous, out [M, N] float32): the C form of F.linear for the bf16 trunk on
 * CPUs without bf16 dot products, where torch's bf16 matmul runs at a fraction of float32 speed.
 *
 * Row invariance (the determinism rule): every output is the same fixed-order sum whatever M, the
 * other rows, the tile it falls in or the thread count: one 8-lane accumulator over 8-value steps
 * of k (fused multiply-add), a fixed pairwise lane reduction, then the K % 8 tail in scalar order.
 * So a row's result is bitwise independent of the batch, and 1 row equals row t of M rows.
 *
 * Blocking: a tile of rows x weight rows (4 x 3, or 1 x 8 .. 3 x 4 for fewer rows) keeps its
 * accumulators in registers for the whole of K (bf16 -> float32 is a 16-bit shift, done in
 * registers); the tile's weight rows stay in L1 while a block of rows (in L2) passes under them. Work items are (row block, weight-row
 * chunk) pairs split over threads. The portable build (no AVX2) runs the same order in plain C.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BF16_AVX2 1
#endif

static inline float bf16(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* the tail k in [K8, K) of one output, in order */
static inline float tail(float s, const float *x, const uint16_t *w, int64_t K8, int64_t K) {
    for (int64_t k = K8; k < K; k++) s += bf16(w[k]) * x[k];
    return s;
}

/* Tile shapes: 4 x 3 where there are 4 rows, else as many weight rows as the registers hold
 * (1 x 8, 2 x 6, 3 x 4), so a decode step streams several weight rows at once. */
#define MAX_R 4
#define MAX_C 8
static const int COLS_FOR_ROWS[MAX_R + 1] = {0, 8, 6, 4, 3};

#ifdef BF16_AVX2
static inline __m256 load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float lanes_sum(__m256 a) {
    /* fixed pairwise order: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* R rows of x times C weight rows (both constants at each call: the accumulators stay in registers).
 * Which operand is loaded first only fits the registers (16 ymm); each accumulator's order is fixed. */
static inline __attribute__((always_inline)) void tile(const int R, const int C, const float *x, int64_t K,
                                                       const uint16_t *w, int64_t ws, float *out, int64_t N) {
    const int64_t K8 = K / 8 * 8;
    __m256 a[MAX_R][MAX_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
        if (R * C + R + 1 <= 16) {  /* the rows' x in registers, each weight vector used once */
            __m256 xv[MAX_R];
            for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * K + k);
            for (int c = 0; c < C; c++) {
                const __m256 wv = load8(w + c * ws + k);
                for (int r = 0; r < R; r++) a[r][c] = _mm256_fmadd_ps(wv, xv[r], a[r][c]);
            }
        } else {  /* the weight vectors in registers, each x vector used once */
            __m256 wv[MAX_C];
            for (int c = 0; c < C; c++) wv[c] = load8(w + c * ws + k);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(x + r * K + k);
                for (int c = 0; c < C; c++) a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r * N + c] = tail(lanes_sum(a[r][c]), x + r * K, w + c * ws, K8, K);
}
#else
static inline void tile(const int R, const int C, const float *x, int64_t K, const uint16_t *w, int64_t ws,
                        float *out, int64_t N) {
    const int64_t K8 = K / 8 * 8;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const float *xr = x + r * K;
            const uint16_t *wr = w + c * ws;
            float a[8] = {0};
            for (int64_t k = 0; k < K8; k += 8)
                for (int l = 0; l < 8; l++) a[l] += bf16(wr[k + l]) * xr[k + l];
            const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
            out[r * N + c] = tail((s0 + s2) + (s1 + s3), xr, wr, K8, K);
        }
}
#endif

/* the tile of R rows by C weight rows (C <= COLS_FOR_ROWS[R]), each shape its own specialised code */
#define CASE(R, C) case (R) * 16 + (C): tile(R, C, x, K, w, ws, out, N); break;
static void any_tile(int R, int C, const float *x, int64_t K, const uint16_t *w, int64_t ws, float *out, int64_t N) {
    switch (R * 16 + C) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4) CASE(1, 5) CASE(1, 6) CASE(1, 7) CASE(1, 8)
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4) CASE(2, 5) CASE(2, 6)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
        CASE(4, 1) CASE(4, 2) CASE(4, 3)
    }
}
#undef CASE

/* Weight rows per work item (a multiple of every tile width), and bytes of x rows per row block (half of L2). */
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
        const int64_t rows = t1 - t0;
        const int cols = COLS_FOR_ROWS[rows < MAX_R ? rows : MAX_R];
        for (int64_t j = j0; j < j1; j += cols) {
            const int C = j1 - j < cols ? (int)(j1 - j) : cols;
            for (int64_t t = t0; t < t1; t += MAX_R) {
                const int R = t1 - t < MAX_R ? (int)(t1 - t) : MAX_R;
                any_tile(R, C, x + t * K, K, w + j * w_stride, w_stride, out + t * N + j, N);
            }
        }
    }
}
