/* The index of each float32 row's largest value, as torch.argmax(dim=-1) picks it (the greedy
 * sampler's token): the first index of the maximum; a row holding NaN gives its first NaN (NaN ranks
 * above every number, as in torch); -0.0 and +0.0 are equal (the first wins).
 *
 * On AVX-512 builds 16 lanes, lane l over indices l, l + 16, ..: each lane keeps its largest value
 * and the first index of it (a strict > update), so among the lanes holding the row's maximum the
 * smallest index is the row's first. Any NaN in the row sends it to a scalar scan for the first
 * NaN. The result is an index, not a sum: it is the same whatever the vector width, the other rows or
 * the thread count (rows are split over threads whole).
 */
#include <math.h>
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline int64_t first_nan(const float *x, int64_t V) {
    for (int64_t i = 0; i < V; i++)
        if (isnan(x[i])) return i;
    return -1;
}

static int64_t argmax_scalar(const float *x, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; i++) {
        if (isnan(x[i])) return i;  /* no NaN before i */
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static int64_t argmax_row(const float *x, int64_t V) {
#ifdef __AVX512F__
    if (V >= 32) {
        const int64_t V16 = V / 16 * 16;
        __m512 best = _mm512_loadu_ps(x);
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __m512i cur = idx;
        __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
        for (int64_t i = 16; i < V16; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            cur = _mm512_add_epi32(cur, step);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_blend_ps(gt, best, v);
            idx = _mm512_mask_blend_epi32(gt, idx, cur);
        }
        if (nan) return first_nan(x, V);
        for (int64_t i = V16; i < V; i++)  /* no NaN before the tail: its first NaN is the row's */
            if (isnan(x[i])) return i;
        float top = _mm512_reduce_max_ps(best);
        int64_t at = INT64_MAX;
        const __mmask16 ties = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
        int32_t lanes[16];
        _mm512_storeu_si512(lanes, idx);
        for (int l = 0; l < 16; l++)
            if ((ties >> l & 1) && lanes[l] < at) at = lanes[l];
        for (int64_t i = V16; i < V; i++)  /* the tail comes after every lane's index */
            if (x[i] > top) top = x[i], at = i;
        return at;
    }
#endif
    return argmax_scalar(x, V);
}

/* x: B rows of V float32 values at row stride `stride` (elements) -> out[b] the argmax of row b. */
void argmax_rows(const float *x, int64_t stride, int64_t B, int64_t V, int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && B * V >= (1 << 18))
    for (int64_t b = 0; b < B; b++) out[b] = V > 0 ? argmax_row(x + b * stride, V) : 0;
}
