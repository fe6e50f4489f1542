/* A few float32 rows times a bfloat16 weight: out[t, j] = x[t] . w[j] (x [n, K] float32, w [N, K]
 * bfloat16 with rows contiguous, out [n, N] float32): the C form of F.linear for the small batches
 * of decode with a bf16 trunk, where the CPU has no bf16 dot product that torch uses at one row.
 *
 * Weights are read once per call: bf16 -> float32 is a 16-bit shift, done in registers; fp32
 * accumulation. Every output is the same fixed-order sum whatever n, the other rows or the thread
 * count (four 8-lane accumulators over 32-value steps, a fixed lane reduction, a scalar tail): a
 * row's result is bitwise independent of the other rows. Weight rows are split over
 * threads; the portable build (no AVX2) runs the same order in plain C.
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

#ifdef BF16_AVX2
static inline __m256 load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float lanes_sum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* n rows at once (a constant at each call, so the accumulators stay in registers): four
 * accumulators per row over 32-value steps, then (a0 + a1) + (a2 + a3), the lanes, a scalar tail. */
static inline __attribute__((always_inline)) void rows_tile(const int n, const float *x, int64_t K,
                                                             const uint16_t *restrict w, float *out, int64_t N) {
    const int64_t K32 = K / 32 * 32;
    __m256 a[2][4];
    for (int r = 0; r < n; r++)
        for (int q = 0; q < 4; q++) a[r][q] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K32; k += 32) {
        __m256 wv[4];
        for (int q = 0; q < 4; q++) wv[q] = load8(w + k + 8 * q);
        for (int r = 0; r < n; r++)
            for (int q = 0; q < 4; q++)
                a[r][q] = _mm256_fmadd_ps(wv[q], _mm256_loadu_ps(x + r * K + k + 8 * q), a[r][q]);
    }
    for (int r = 0; r < n; r++) {
        float s = lanes_sum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
        for (int64_t k = K32; k < K; k++) s += bf16(w[k]) * x[r * K + k];
        out[r * N] = s;
    }
}
#else
static inline void rows_tile(const int n, const float *x, int64_t K, const uint16_t *restrict w, float *out,
                             int64_t N) {
    const int64_t K32 = K / 32 * 32;
    for (int r = 0; r < n; r++) {
        const float *xr = x + r * K;
        float a[4][8];
        for (int q = 0; q < 4; q++)
            for (int l = 0; l < 8; l++) a[q][l] = 0.0f;
        for (int64_t k = 0; k < K32; k += 32)
            for (int q = 0; q < 4; q++)
                for (int l = 0; l < 8; l++) a[q][l] += bf16(w[k + 8 * q + l]) * xr[k + 8 * q + l];
        float v[8];
        for (int l = 0; l < 8; l++) v[l] = (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]);
        const float s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
        float s = (s0 + s2) + (s1 + s3);
        for (int64_t k = K32; k < K; k++) s += bf16(w[k]) * xr[k];
        out[r * N] = s;
    }
}
#endif

/* out[t * N + j] for all n rows and weight row w: pairs of rows, then a last single one. */
static void weight_row(const float *x, int64_t n, int64_t K, const uint16_t *restrict w, float *out, int64_t N,
                       int64_t j) {
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) rows_tile(2, x + t * K, K, w, out + t * N + j, N);
    if (t < n) rows_tile(1, x + t * K, K, w, out + t * N + j, N);
}

#define ROW_CHUNK 32

void bf16_rows_gemm(const float *x, int64_t n, int64_t K, const uint16_t *w, int64_t w_stride, int64_t N, float *out,
                    int num_threads) {
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t j1 = (c + 1) * ROW_CHUNK < N ? (c + 1) * ROW_CHUNK : N;
        for (int64_t j = c * ROW_CHUNK; j < j1; j++) weight_row(x, n, K, w + j * w_stride, out, N, j);
    }
}
