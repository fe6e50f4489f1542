/* Sums along a row for 16 rows at once, one row per vector lane (the norms' and AttnRes' sums over
 * a row's D values). A row's sum there runs over i in ascending order, multiply then add (these
 * kernels are built without contraction: -std=c11), exactly as the one-row loop does; each lane
 * holds its own row, so a row's result is the same bits alone or among 15 others, and the
 * 16-way parallelism turns the latency-bound chain of one row into 16 chains side by side.
 * A group of fewer rows (down to LANES_MIN_ROWS) leaves the other lanes idle. ROW_LANES is 16
 * where AVX-512 is built in, else 0 (callers then keep the one-row loop). */
#pragma once
#include <stdint.h>
#include <string.h>

#include "bf16_scalar.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define ROW_LANES 16
#define LANES_MIN_ROWS 4

/* rows[l] for l < n (D values each, float32 or bfloat16) widened and transposed: buf[i * 16 + l];
 * the lanes from n on hold zeros */
static inline void lanes_transpose(const void *const rows[ROW_LANES], int n, int64_t D, int is_bf16, float *buf) {
    if (n < ROW_LANES) memset(buf, 0, sizeof(float) * (size_t)(ROW_LANES * D));
    for (int l = 0; l < n; l++)
        for (int64_t i = 0; i < D; i++) buf[i * ROW_LANES + l] = load_value(rows[l], i, is_bf16);
}

/* per lane l: squares = sum_i v_l[i]^2 (NULL: not computed), dot = sum_i v_l[i] * q[i] (q NULL: not
 * computed), each from 0.0f over i ascending, multiply then add */
static inline void lanes_sums(const float *buf, int64_t D, const float *q, float *squares, float *dot) {
    __m512 ss = _mm512_setzero_ps(), dp = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i++) {
        const __m512 v = _mm512_loadu_ps(buf + i * ROW_LANES);
        if (squares != NULL) ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
        if (q != NULL) dp = _mm512_add_ps(dp, _mm512_mul_ps(v, _mm512_set1_ps(q[i])));
    }
    if (squares != NULL) _mm512_storeu_ps(squares, ss);
    if (dot != NULL) _mm512_storeu_ps(dot, dp);
}
#else
#define ROW_LANES 0
#define LANES_MIN_ROWS (1 << 30)
#endif
