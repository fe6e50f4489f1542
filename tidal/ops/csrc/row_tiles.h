/* Register tiles of float32 rows x weight rows, shared by the GEMM kernels (bf16_gemm.c,
 * mxfp4_gemm.c). The including file defines TILE_W (the weight element type), TILE_VALUE(w) (one
 * weight as float) and, on AVX2 builds (TILE_AVX2), TILE_LOAD8(p) (8 weights as a __m256).
 *
 * The summation order of every output (the row-invariance rule): one 8-lane accumulator over
 * 8-value steps of k (fused multiply-add on AVX2), a fixed pairwise lane reduction, then the K % 8
 * tail in scalar order. It is the same whatever the tile shape, the rows beside it or the thread
 * count, so a row's result is bitwise independent of the batch. The portable build runs the same
 * order in plain C (without fused multiply-add: equal within rounding, not bitwise).
 *
 * Tile shapes: 1 x 8, 2 x 6, 3 x 4 (as many weight rows as the registers hold beside the rows'
 * accumulators), so a decode step streams several weight rows at once; 4 x TILE_COLS_4 where there
 * are 4 rows, 3 unless the including file says otherwise. (mxfp4_gemm.c's float32 panels take 2: at
 * 4 x 3 the compiler reloads both operands of every multiply-add from memory, measured 1.3-1.5x
 * slower; bf16_gemm.c's widened weights are measured 3-10% faster at 4 x 3.)
 *
 * TILE_PREFETCH (weights streamed from memory, bf16_gemm.c): while a tile runs, the next C weight
 * rows (pf: C * K contiguous elements) are prefetched, one cache line per 64 bytes of them, spread
 * evenly over the tile's k steps. A panel's rows are too short for the hardware prefetcher to ramp
 * up on (one row is a few cache lines, C of them are read side by side); this keeps the next panel
 * arriving while the current one is multiplied. Rows longer than TILE_PREFETCH_MAX_ROW_BYTES are
 * streams the hardware follows by itself (measured no faster with it). Prefetches change no result.
 */
#include <stdint.h>
#include <stdlib.h>

#define MAX_R 4
#define TILE_PREFETCH_MAX_ROW_BYTES 2048
#define MAX_C 8
#ifndef TILE_COLS_4
#define TILE_COLS_4 3
#endif
#if defined(TILE_AVX2) && defined(__AVX512F__) && defined(TILE_LOAD8_PAIR)
/* AVX-512 (TILE_LOAD8_PAIR(p0, p1): 8 weights of two rows, p0's in the low 256 bits): tiles of 2 to 4
 * rows hold two weight rows' accumulators per 16-lane register, each half one output's 8-lane
 * accumulator in the order above (the same bits, half the multiply-add instructions), 8 weight rows
 * wide (32 registers). One row keeps the 1 x 8 tile: it streams weights from memory. */
#define TILE_PAIRED 1
static const int COLS_FOR_ROWS[MAX_R + 1] = {0, 8, 8, 8, 8};
#else
static const int COLS_FOR_ROWS[MAX_R + 1] = {0, 8, 6, 4, TILE_COLS_4};
#endif

/* the tail k in [K8, K) of one output, in order */
static inline float tile_tail(float s, const float *x, const TILE_W *w, int64_t K8, int64_t K) {
    for (int64_t k = K8; k < K; k++) s += TILE_VALUE(w[k]) * x[k];
    return s;
}

#ifdef TILE_AVX2
static inline float lanes_sum(__m256 a) {
    /* fixed pairwise order: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* TILE_PREFETCH: at k step k, the next panel's bytes [k, k + 8) * C * sizeof(TILE_W) (C * 16 bytes
 * per step for bf16), one prefetch per cache line; pf == NULL (or no TILE_PREFETCH): nothing */
static inline __attribute__((always_inline)) void prefetch_panel(const char *pf, int64_t k, const int C) {
#ifdef TILE_PREFETCH
    if (pf != NULL)
        for (int64_t b = 0; b < C * 8 * (int64_t)sizeof(TILE_W); b += 64)
            _mm_prefetch(pf + k * C * (int64_t)sizeof(TILE_W) + b, _MM_HINT_T0);
#else
    (void)pf, (void)k, (void)C;
#endif
}

/* R rows of x (row stride K) times C weight rows (stride ws) -> out[r * N + c]; R and C are
 * constants at each call, so the accumulators stay in registers. Which operand is loaded first only
 * fits the registers (16 ymm); each accumulator's order is fixed. */
static inline __attribute__((always_inline)) void tile(const int R, const int C, const float *x, int64_t K,
                                                       const TILE_W *w, int64_t ws, float *out, int64_t N,
                                                       const char *pf) {
    const int64_t K8 = K / 8 * 8;
    __m256 a[MAX_R][MAX_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
        prefetch_panel(pf, k, C);
        if (R * C + R + 1 <= 16) {  /* the rows' x in registers, each weight vector used once */
            __m256 xv[MAX_R];
            for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * K + k);
            for (int c = 0; c < C; c++) {
                const __m256 wv = TILE_LOAD8(w + c * ws + k);
                for (int r = 0; r < R; r++) a[r][c] = _mm256_fmadd_ps(wv, xv[r], a[r][c]);
            }
        } else {  /* the weight vectors in registers, each x vector used once */
            __m256 wv[MAX_C];
            for (int c = 0; c < C; c++) wv[c] = TILE_LOAD8(w + c * ws + k);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(x + r * K + k);
                for (int c = 0; c < C; c++) a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r * N + c] = tile_tail(lanes_sum(a[r][c]), x + r * K, w + c * ws, K8, K);
}

#ifdef TILE_PAIRED
/* each half of the paired accumulators a[r][q] -> its output: lanes_sum, then the K % 8 tail */
static inline __attribute__((always_inline)) void paired_outputs(const int R, const int C, __m512 a[MAX_R][MAX_C / 2],
                                                                 const float *x, int64_t K, const TILE_W *w,
                                                                 int64_t ws, float *out, int64_t N) {
    const int64_t K8 = K / 8 * 8;
    for (int r = 0; r < R; r++)
        for (int q = 0; q < (C + 1) / 2; q++) {
            const __m256 lo = _mm512_castps512_ps256(a[r][q]);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r][q]), 1));
            out[r * N + 2 * q] = tile_tail(lanes_sum(lo), x + r * K, w + 2 * q * ws, K8, K);
            if (2 * q + 1 < C) out[r * N + 2 * q + 1] = tile_tail(lanes_sum(hi), x + r * K, w + (2 * q + 1) * ws, K8, K);
        }
}

/* R rows of x times C weight rows, rows 2q and 2q+1 side by side (an odd last row beside itself) */
static inline __attribute__((always_inline)) void tile_paired(const int R, const int C, const float *x, int64_t K,
                                                              const TILE_W *w, int64_t ws, float *out, int64_t N,
                                                              const char *pf) {
    const int64_t K8 = K / 8 * 8;
    const int P = (C + 1) / 2;
    __m512 a[MAX_R][MAX_C / 2];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) a[r][q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
        prefetch_panel(pf, k, C);
        __m512 wv[MAX_C / 2];
        for (int q = 0; q < P; q++)
            wv[q] = TILE_LOAD8_PAIR(w + 2 * q * ws + k, w + (2 * q + 1 < C ? 2 * q + 1 : 2 * q) * ws + k);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x + r * K + k))));
            for (int q = 0; q < P; q++) a[r][q] = _mm512_fmadd_ps(wv[q], xv, a[r][q]);
        }
    }
    paired_outputs(R, C, a, x, K, w, ws, out, N);
}
#endif
#else
static inline void tile(const int R, const int C, const float *x, int64_t K, const TILE_W *w, int64_t ws,
                        float *out, int64_t N, const char *pf) {
    (void)pf;
    const int64_t K8 = K / 8 * 8;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const float *xr = x + r * K;
            const TILE_W *wr = w + c * ws;
            float a[8] = {0};
            for (int64_t k = 0; k < K8; k += 8)
                for (int l = 0; l < 8; l++) a[l] += TILE_VALUE(wr[k + l]) * xr[k + l];
            const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
            out[r * N + c] = tile_tail((s0 + s2) + (s1 + s3), xr, wr, K8, K);
        }
}
#endif

/* the tile of R rows by C weight rows (C <= COLS_FOR_ROWS[R]), each shape its own specialised code */
#define CASE(R, C) case (R) * 16 + (C): tile(R, C, x, K, w, ws, out, N, pf); break;
#ifdef TILE_PAIRED
#define PCASE(R, C) case (R) * 16 + (C): tile_paired(R, C, x, K, w, ws, out, N, pf); break;
#define PCASES(R) PCASE(R, 1) PCASE(R, 2) PCASE(R, 3) PCASE(R, 4) PCASE(R, 5) PCASE(R, 6) PCASE(R, 7) PCASE(R, 8)
#endif
static void any_tile(int R, int C, const float *x, int64_t K, const TILE_W *w, int64_t ws, float *out, int64_t N,
                     const char *pf) {
    switch (R * 16 + C) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4) CASE(1, 5) CASE(1, 6) CASE(1, 7) CASE(1, 8)
#ifdef TILE_PAIRED
        PCASES(2) PCASES(3) PCASES(4)
#else
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4) CASE(2, 5) CASE(2, 6)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
        CASE(4, 1) CASE(4, 2) CASE(4, 3)
#endif
    }
}
#undef CASE
#undef PCASE
#undef PCASES

#if defined(TILE_PAIRED) && defined(TILE_WIDEN_PANEL)
/* TILE_WIDEN_PANEL (16-bit weights): with WIDEN_MIN_ROWS rows or more under a panel, its C weight
 * rows are widened to float32 once, into an L1 buffer laid out as the paired tiles read them (pair
 * q, k step s: 16 floats at (q * K8 / 8 + s) * 16), instead of once per row tile. The products and
 * their order are tile_paired's (the K % 8 tail reads the weights themselves): the same bits. Below
 * WIDEN_MIN_ROWS rows the widening's stores and reloads cost more than they save. */
#define WIDEN_MIN_ROWS (8 * MAX_R)
static inline __attribute__((always_inline)) void tile_widened(const int R, const int C, const float *x, int64_t K,
                                                               const float *panel, const TILE_W *w, int64_t ws,
                                                               float *out, int64_t N) {
    const int64_t K8 = K / 8 * 8, S = K8 / 8;
    const int P = (C + 1) / 2;
    __m512 a[MAX_R][MAX_C / 2];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) a[r][q] = _mm512_setzero_ps();
    for (int64_t st = 0; st < S; st++) {
        __m512 wv[MAX_C / 2];
        for (int q = 0; q < P; q++) wv[q] = _mm512_loadu_ps(panel + (q * S + st) * 16);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x + r * K + 8 * st))));
            for (int q = 0; q < P; q++) a[r][q] = _mm512_fmadd_ps(wv[q], xv, a[r][q]);
        }
    }
    paired_outputs(R, C, a, x, K, w, ws, out, N);
}

#define WCASE(R, C) case (R) * 16 + (C): tile_widened(R, C, x, K, panel, w, ws, out, N); break;
#define WCASES(R) WCASE(R, 1) WCASE(R, 2) WCASE(R, 3) WCASE(R, 4) WCASE(R, 5) WCASE(R, 6) WCASE(R, 7) WCASE(R, 8)
static void any_widened_tile(int R, int C, const float *x, int64_t K, const float *panel, const TILE_W *w, int64_t ws,
                             float *out, int64_t N) {
    switch (R * 16 + C) { WCASES(1) WCASES(2) WCASES(3) WCASES(4) }
}
#undef WCASE
#undef WCASES

/* rows_times_panel's work through widened panels; returns 0, or -1 (nothing done) without memory */
static int rows_times_widened(const float *x, int64_t K, int64_t t0, int64_t t1, const TILE_W *w, int64_t ws,
                              int64_t j0, int64_t j1, float *out, int64_t N) {
    const int64_t S = K / 8;
    float *panel = malloc(sizeof(float) * (size_t)(MAX_C / 2 * S * 16 + 1));
    if (panel == NULL) return -1;
    for (int64_t j = j0; j < j1; j += MAX_C) {
        const int C = j1 - j < MAX_C ? (int)(j1 - j) : MAX_C;
        const TILE_W *wj = w + (j - j0) * ws;
        for (int q = 0; q < (C + 1) / 2; q++) {
            const TILE_W *w0 = wj + 2 * q * ws, *w1 = wj + (2 * q + 1 < C ? 2 * q + 1 : 2 * q) * ws;
            for (int64_t st = 0; st < S; st++) _mm512_storeu_ps(panel + (q * S + st) * 16, TILE_LOAD8_PAIR(w0 + 8 * st, w1 + 8 * st));
        }
        for (int64_t t = t0; t < t1; t += MAX_R) {
            const int R = t1 - t < MAX_R ? (int)(t1 - t) : MAX_R;
            any_widened_tile(R, C, x + t * K, K, panel, wj, ws, out + t * N + j, N);
        }
    }
    free(panel);
    return 0;
}
#endif

/* rows [t0, t1) of x times weight rows [j0, j1) (w points at row j0) into out (row stride N, at
 * column j0): weight-row panels of the tile width, all row tiles under each panel. Under
 * TILE_PREFETCH, with contiguous weight rows (ws == K), the first row tile of each panel prefetches
 * the next panel (up to j1 + one panel: the next work item's first rows). */
static void rows_times_panel(const float *x, int64_t K, int64_t t0, int64_t t1, const TILE_W *w, int64_t ws,
                             int64_t j0, int64_t j1, float *out, int64_t N) {
    const int64_t rows = t1 - t0;
#if defined(TILE_PAIRED) && defined(TILE_WIDEN_PANEL)
    if (rows >= WIDEN_MIN_ROWS && rows_times_widened(x, K, t0, t1, w, ws, j0, j1, out, N) == 0) return;
#endif
    const int cols = COLS_FOR_ROWS[rows < MAX_R ? rows : MAX_R];
    for (int64_t j = j0; j < j1; j += cols) {
        const int C = j1 - j < cols ? (int)(j1 - j) : cols;
        const char *pf = NULL;
#ifdef TILE_PREFETCH
        if (ws == K && K * (int64_t)sizeof(TILE_W) <= TILE_PREFETCH_MAX_ROW_BYTES && j + C < j1 + cols)
            pf = (const char *)(w + (j - j0 + C) * ws);
#endif
        for (int64_t t = t0; t < t1; t += MAX_R) {
            const int R = t1 - t < MAX_R ? (int)(t1 - t) : MAX_R;
            any_tile(R, C, x + t * K, K, w + (j - j0) * ws, ws, out + t * N + j, N, t == t0 ? pf : NULL);
        }
    }
}
