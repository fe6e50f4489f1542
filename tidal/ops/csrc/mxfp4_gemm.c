/* MXFP4 weights straight from their packed form: the C kernels behind tidal.ops.mxfp4_moe.
 *
 * Weights are compressed-tensors mxfp4-pack-quantized, stacked per expert: packed [E, N, K/2] uint8
 * (input column 2j in the low nibble of byte j, 2j+1 in the high nibble), scales [E, N, K/32] uint8
 * (E8M0: 2^(s-127), s = 0 the subnormal 2^-127; 255 (NaN) is refused by the loader).
 *
 * mxfp4_grouped_gemm: group g holds rows offsets[g] .. offsets[g+1]-1 of x [S, K] (float32);
 * out[t] = x[t] @ W[experts[g]]^T, out [S, N] float32. Each 32-value block of a weight row is decoded
 * once, in registers (a 16-entry table of E2M1 values times the block scale, which is exact: a power
 * of two), and used for two of the group's rows at a time. Every output is the same fixed-order
 * sum (four 8-lane accumulators, added in a fixed order) whatever the other rows, the batch or the
 * thread count: a row's result is bitwise independent of the other rows.
 *
 * mxfp4_dequantize: the experts' weights as float32 [G, N, K] (for the products with many rows,
 * which a BLAS runs faster than this kernel).
 *
 * Built with -march=native where AVX2+FMA exist; the portable build (TIDAL_CPU_PORTABLE=1, or the
 * fallback when the native build fails) uses the plain C loop with the same summation order.
 * Threads wait passively (no spin barriers): see tidal.ops.cpu_kernels.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MXFP4_AVX2 1
#endif

/* E2M1 code -> value; codes 8..15 are the negatives (8 = -0). */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0(uint8_t s) {
    uint32_t bits = s == 0 ? (1u << 22) : ((uint32_t)s << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 32 values of one block (16 packed bytes) times its scale, into v[32]. */
static inline void decode_block(const uint8_t *restrict p, float scale, float *restrict v) {
    for (int j = 0; j < 16; j++) {
        v[2 * j] = E2M1[p[j] & 0xF] * scale;
        v[2 * j + 1] = E2M1[p[j] >> 4] * scale;
    }
}

#ifdef MXFP4_AVX2
/* Twice the E2M1 values as int8 (exact integers), for a byte shuffle: code -> 2 * value. */
static inline void decode_block_avx2(const uint8_t *restrict p, float half_scale, __m256 v[4]) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);  /* columns 0..15, 16..31 */
    const __m256 s = _mm256_set1_ps(half_scale);
    v[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), s);
    v[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c0, 8))), s);
    v[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1)), s);
    v[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c1, 8))), s);
}

static inline float lanes_sum(__m256 a) {
    /* fixed pairwise order: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* n rows (a constant at each call, so the accumulators stay in registers) times one weight row w
 * (K/2 bytes) with its scales: four 8-lane accumulators per row, one per quarter of a block, then
 * (a0 + a1) + (a2 + a3) and a fixed lane reduction; out[r * N] for each row r. */
#ifdef MXFP4_AVX2
static inline __attribute__((always_inline)) void rows_tile(const int n, const float *x, int64_t K,
                                                             const uint8_t *restrict w, const uint8_t *restrict sc,
                                                             float *out, int64_t N) {
    __m256 a[2][4];
    for (int r = 0; r < n; r++)
        for (int q = 0; q < 4; q++) a[r][q] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4];
        decode_block_avx2(w + b * 16, 0.5f * e8m0(sc[b]), v);
        for (int r = 0; r < n; r++)
            for (int q = 0; q < 4; q++)
                a[r][q] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(x + r * K + b * 32 + 8 * q), a[r][q]);
    }
    for (int r = 0; r < n; r++)
        out[r * N] = lanes_sum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
}
#else
static inline void rows_tile(const int n, const float *x, int64_t K, const uint8_t *restrict w,
                             const uint8_t *restrict sc, float *out, int64_t N) {
    for (int r = 0; r < n; r++) {
        const float *xr = x + r * K;
        float a[4][8];
        for (int q = 0; q < 4; q++)
            for (int l = 0; l < 8; l++) a[q][l] = 0.0f;
        for (int64_t b = 0; b < K / 32; b++) {
            float v[32];
            decode_block(w + b * 16, e8m0(sc[b]), v);
            for (int q = 0; q < 4; q++)
                for (int l = 0; l < 8; l++) a[q][l] += v[8 * q + l] * xr[b * 32 + 8 * q + l];
        }
        float s[8];
        for (int l = 0; l < 8; l++) s[l] = (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]);
        const float s0 = s[0] + s[4], s1 = s[1] + s[5], s2 = s[2] + s[6], s3 = s[3] + s[7];
        out[r * N] = (s0 + s2) + (s1 + s3);
    }
}
#endif

/* out[t * N + j] for rows t in [t0, t1) of x and weight row j: pairs of rows, then a single one. */
static void weight_row(const float *x, int64_t K, int64_t t0, int64_t t1, const uint8_t *restrict w,
                       const uint8_t *restrict sc, float *out, int64_t N, int64_t j) {
    int64_t t = t0;
    for (; t + 2 <= t1; t += 2) rows_tile(2, x + t * K, K, w, sc, out + t * N + j, N);
    if (t < t1) rows_tile(1, x + t * K, K, w, sc, out + t * N + j, N);
}

/* Weight rows per work item: groups are cut into chunks of rows so a batch-1 step spreads over the
 * threads (a decode step has as few as top-k groups). */
#define ROW_CHUNK 64

void mxfp4_grouped_gemm(const float *x, int64_t K, const int64_t *offsets, const int64_t *experts, int64_t G,
                        const uint8_t *packed, const uint8_t *scales, int64_t N, float *out, int num_threads) {
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
    const int64_t row_bytes = K / 2, row_scales = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t item = 0; item < G * chunks; item++) {
        const int64_t g = item / chunks, c = item % chunks;
        const int64_t t0 = offsets[g], t1 = offsets[g + 1];
        if (t0 == t1) continue;
        const uint8_t *we = packed + experts[g] * N * row_bytes;
        const uint8_t *se = scales + experts[g] * N * row_scales;
        const int64_t j1 = (c + 1) * ROW_CHUNK < N ? (c + 1) * ROW_CHUNK : N;
        for (int64_t j = c * ROW_CHUNK; j < j1; j++)
            weight_row(x, K, t0, t1, we + j * row_bytes, se + j * row_scales, out, N, j);
    }
}

void mxfp4_dequantize(const int64_t *experts, int64_t G, const uint8_t *packed, const uint8_t *scales, int64_t N,
                      int64_t K, float *out, int num_threads) {
    const int64_t blocks = N * (K / 32);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < G * blocks; i++) {
        const int64_t g = i / blocks, b = i % blocks;
        const int64_t e = experts[g];
        decode_block(packed + (e * blocks + b) * 16, e8m0(scales[e * blocks + b]), out + (g * blocks + b) * 32);
    }
}
