/* The gated MLP activations, float32 (activation.c, mxfp4_gemm.c):
 *   kind 1, SiTU:   beta tanh(g / beta) sigmoid(g) * lbeta tanh(u / lbeta)
 *   kind 0, SwiGLU: silu(g) * u
 * in the operation order of tidal.ops.activation's torch forms.
 *
 * sigmoid_row (the KDA layer's gates, the MLA output gate): sigmoid(x), or mul * sigmoid(x).
 *
 * gated_act: one value pair (libm's expf and tanhf). gated_act_row: n pairs of a row; on AVX2 builds
 * 8 at a time from the row's start with vector exp and tanh (Cephes' single-precision polynomials,
 * within a few ulps of libm's), the n % 8 tail by gated_act. Which form a value gets depends only on
 * its column, so a row's bits do not depend on the other rows, and every caller that runs a row
 * through gated_act_row (the activation kernel, the packed experts' one call) gets the same bits. */
#include <math.h>
#include <stdint.h>

static inline float gated_act(float g, float u, int kind, float beta, float linear_beta) {
    const float sig = 1.0f / (1.0f + expf(-g));
    return kind == 1 ? tanhf(g / beta) * beta * sig * (tanhf(u / linear_beta) * linear_beta) : g * sig * u;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* e^x: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by a degree-7 polynomial, times 2^n.
 * Below -87.3 the result is 0 and above 88.7 +inf (as expf's, up to subnormal results). */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228391f), lo = _mm256_set1_ps(-87.3365448f);
    const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* times 2^n in two steps (n can reach 128 or -126 at the ends of the range) */
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
    return _mm256_andnot_ps(under, y);
}

/* tanh x: an odd polynomial below |x| = 0.625, else 1 - 2 / (e^2|x| + 1) with x's sign; NaN stays NaN */
static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp8(_mm256_add_ps(ax, ax));
    __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    big = _mm256_or_ps(big, _mm256_and_ps(sign, x));
    const __m256 use_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_blendv_ps(big, small, use_small), x, nan);
}

static inline __m256 gated_act8(__m256 g, __m256 u, int kind, float beta, float linear_beta) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    if (kind != 1) return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
    const __m256 b = _mm256_set1_ps(beta), lb = _mm256_set1_ps(linear_beta);
    const __m256 a = _mm256_mul_ps(_mm256_mul_ps(tanh8(_mm256_div_ps(g, b)), b), sig);
    return _mm256_mul_ps(a, _mm256_mul_ps(tanh8(_mm256_div_ps(u, lb)), lb));
}
#endif

static inline void gated_act_row(const float *g, const float *u, float *out, int64_t n, int kind, float beta,
                                 float linear_beta) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, gated_act8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i), kind, beta, linear_beta));
#endif
    for (; i < n; i++) out[i] = gated_act(g[i], u[i], kind, beta, linear_beta);
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* y = sigmoid(x) * (mul ? mul : 1) over n values; on AVX2 builds 8 at a time from the start with
 * the vector exp above, the n % 8 tail with libm's: which form a value gets depends only on its
 * place in the row (a KDA head, an MLA output gate), so a row's bits do not depend on the batch.
 * sigmoid(NaN) is NaN, as libm's. */
static inline void sigmoid_row(const float *x, const float *mul, float *y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), xv));
        __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, e));
        s = _mm256_blendv_ps(s, xv, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));  /* exp8 clamps NaN away */
        if (mul != NULL) s = _mm256_mul_ps(_mm256_loadu_ps(mul + i), s);
        _mm256_storeu_ps(y + i, s);
    }
#endif
    for (; i < n; i++) y[i] = mul != NULL ? mul[i] * sigmoidf(x[i]) : sigmoidf(x[i]);
}
