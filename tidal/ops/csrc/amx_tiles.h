/* AMX-BF16 tiles for bfloat16 rows times bfloat16 weight rows (bf16_parts.h's bf16_rows_linear and
 * bf16_values_product: the bf16 trunk's products, separate or inside the fused layer steps).
 *
 * Layout (no weight repacking): the weight is the A tile, 16 weight rows x 32 values of k loaded
 * straight from the row-major weight at its row stride; the rows of x are the B tile, packed once
 * per call in VNNI order (block b of 16 rows, k step s: a 16 x 64-byte tile whose row r holds the
 * pairs (x[16b + m][32s + 2r], x[16b + m][32s + 2r + 1]) for m = 0..15, zero past M); the C tile is
 * 16 weight rows x 16 rows of x in float32, stored transposed into out.
 *
 * Order: every output is its C tile's sum over the k steps in ascending order, from zero, one
 * TDPBF16PS per step: it depends on the output's row of x and weight row only, not on M, the rows
 * beside it, the tile shape or the thread count (the row-invariance rule, under AMX's own order,
 * which is not row_tiles.h's: a row's bits change where M crosses the threshold).
 *
 * When: the including library's tidal_amx_bind gives it amx_state.c's tidal_amx_rows (the least M
 * that takes the tiles; 0 off: TIDAL_CPU_AMX=0, no AMX permission from the kernel, or the calling
 * thread in deterministic inference). K must be a multiple of 32. Builds without AMX-BF16
 * (TIDAL_CPU_PORTABLE=1, other CPUs) compile none of this: amx_takes is always 0.
 */
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#define TIDAL_AMX 1

/* amx_state.c's tidal_amx_rows, bound once per library; one copy per library (weak: every
 * translation unit that includes this header defines it, the linker keeps one) */
__attribute__((weak, visibility("hidden"))) int (*tidal_amx_rows_fn)(void) = 0;

__attribute__((weak)) void tidal_amx_bind(int (*rows)(void)) { tidal_amx_rows_fn = rows; }

/* Weight rows per work item, a multiple of 16 up to 64 (the passes take up to four A tiles): two
 * tiles' rows are fewer streams at once from memory, which the hardware prefetcher keeps up with
 * better than four's (benchmarks/bench_amx_tiles.py --streamed). */
#define AMX_CHUNK 32
#define AMX_PARALLEL_MIN_MACS (1 << 20)

/* the calling thread's threshold (0: the tiles are off) */
static inline int amx_least_rows(void) { return tidal_amx_rows_fn != 0 ? tidal_amx_rows_fn() : 0; }

static inline int amx_takes(int64_t M, int64_t K) {
    const int least = K % 32 == 0 ? amx_least_rows() : 0;
    return least > 0 && M >= least;
}

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));

/* every tile 16 rows x 64 bytes: C 0..3, A 4 and 5, B 6 and 7 */
static inline void amx_configure(void) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* v[j] <- (v[0][j], ..., v[15][j]): a 16 x 16 transpose of 32-bit values (unpack pairs, then
 * quads, then 128-bit lanes); only moves bits */
static inline __attribute__((always_inline)) void amx_transpose16(__m512 v[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    __m512d u[16];
    for (int i = 0; i < 4; i++) {
        const __m512d lo0 = _mm512_castps_pd(t[4 * i]), hi0 = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d lo1 = _mm512_castps_pd(t[4 * i + 2]), hi1 = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_unpacklo_pd(lo0, lo1);      /* lane l: column 4l of rows 4i..4i+3 */
        u[4 * i + 1] = _mm512_unpackhi_pd(lo0, lo1);  /* column 4l + 1 */
        u[4 * i + 2] = _mm512_unpacklo_pd(hi0, hi1);  /* column 4l + 2 */
        u[4 * i + 3] = _mm512_unpackhi_pd(hi0, hi1);  /* column 4l + 3 */
    }
    for (int c = 0; c < 4; c++) {
        const __m512 a = _mm512_castpd_ps(u[c]), b = _mm512_castpd_ps(u[4 + c]);
        const __m512 d = _mm512_castpd_ps(u[8 + c]), e = _mm512_castpd_ps(u[12 + c]);
        const __m512 even0 = _mm512_shuffle_f32x4(a, b, 0x88), even1 = _mm512_shuffle_f32x4(d, e, 0x88);
        const __m512 odd0 = _mm512_shuffle_f32x4(a, b, 0xDD), odd1 = _mm512_shuffle_f32x4(d, e, 0xDD);
        v[c] = _mm512_shuffle_f32x4(even0, even1, 0x88);
        v[4 + c] = _mm512_shuffle_f32x4(odd0, odd1, 0x88);
        v[8 + c] = _mm512_shuffle_f32x4(even0, even1, 0xDD);
        v[12 + c] = _mm512_shuffle_f32x4(odd0, odd1, 0xDD);
    }
}

/* x rows -> the B tiles (see the top): bfloat16 rows xb at row stride xs, or (xb NULL) float32 rows
 * xf [M, K] whose values are bfloat16 ones (their high halves, exact). Each tile is the 16 x 16
 * transpose of its rows' 32-bit pairs. */
/* 32 float32 values that are bfloat16 ones -> the 32 bfloat16 (their high halves), in order */
static inline __m512i amx_bf16_32(const float *x) {
    /* word 2j of the result: the high half of float 2j of (lo, hi); word 2j + 1: of float 2j + 1 */
    static const uint16_t highs[32] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                       33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    return _mm512_permutex2var_epi16(_mm512_loadu_si512(x), _mm512_loadu_si512(highs), _mm512_loadu_si512(x + 16));
}

static void amx_pack_rows(const uint16_t *xb, int64_t xs, const float *xf, int64_t M, int64_t K, uint32_t *xp) {
    const int64_t S = K / 32, blocks = (M + 15) / 16;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t s = 0; s < S; s++) {
            __m512 v[16];
            for (int m = 0; m < 16; m++) {
                const int64_t t = 16 * b + m;
                if (t >= M) {
                    v[m] = _mm512_setzero_ps();
                } else if (xb != 0) {
                    v[m] = _mm512_castsi512_ps(_mm512_loadu_si512(xb + t * xs + 32 * s));
                } else {
                    v[m] = _mm512_castsi512_ps(amx_bf16_32(xf + t * K + 32 * s));
                }
            }
            amx_transpose16(v);
            for (int r = 0; r < 16; r++) _mm512_store_ps((float *)(xp + (b * S + s) * 256 + r * 16), v[r]);
        }
}

/* C tile c (16 weight rows x 16 rows of x, row stride 16) -> out[m * N + i], i < wr, m < xr */
static inline void amx_store(const float *c, int64_t wr, int64_t xr, float *out, int64_t N) {
    __m512 v[16];
    for (int i = 0; i < 16; i++) v[i] = _mm512_load_ps(c + i * 16);
    amx_transpose16(v);
    const __mmask16 cols = (__mmask16)((1u << wr) - 1);
    for (int64_t m = 0; m < xr; m++) _mm512_mask_storeu_ps(out + m * N, cols, v[m]);
}

/* The next work item's weight rows, prefetched into L2 a few lines per k step while the current
 * item's first pass streams its own (one chunk is too many concurrent row streams for the hardware
 * prefetcher to keep ahead of the tiles); prefetches change no result. */
struct amx_prefetch {
    const char *row;
    int64_t stride, row_bytes, col, left, per_step;
};

static inline void amx_prefetch_step(struct amx_prefetch *p) {
    if (p == 0) return;
    for (int64_t n = p->per_step; n > 0 && p->left > 0; n--, p->left--) {
        _mm_prefetch(p->row + p->col, _MM_HINT_T1);
        p->col += 64;
        if (p->col >= p->row_bytes) p->col = 0, p->row += p->stride;
    }
}

/* NA (1 or 2) weight tiles a[0..NA) x two row blocks b0, b1 over S k steps -> C tiles (a, b) in
 * c + (2a + b) * 256. as: the weight tiles' row strides in bytes. */
static inline __attribute__((always_inline)) void amx_2x2(const int NA, const uint16_t *const *a, const int64_t *as,
                                                          const uint32_t *b0, const uint32_t *b1, int64_t S,
                                                          float *c, struct amx_prefetch *pf) {
    _tile_zero(0);
    _tile_zero(1);
    if (NA > 1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t s = 0; s < S; s++) {
        amx_prefetch_step(pf);
        _tile_loadd(6, b0 + s * 256, 64);
        _tile_loadd(7, b1 + s * 256, 64);
        _tile_loadd(4, a[0] + s * 32, as[0]);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (NA > 1) {
            _tile_loadd(5, a[1] + s * 32, as[1]);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (NA > 1) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
}

/* NA (1..4) weight tiles x one row block b0 -> C tile a in c + a * 256 (A tiles alternate 4, 5) */
static inline __attribute__((always_inline)) void amx_1x4(const int NA, const uint16_t *const *a, const int64_t *as,
                                                          const uint32_t *b0, int64_t S, float *c,
                                                          struct amx_prefetch *pf) {
    _tile_zero(0);
    if (NA > 1) _tile_zero(1);
    if (NA > 2) _tile_zero(2);
    if (NA > 3) _tile_zero(3);
    for (int64_t s = 0; s < S; s++) {
        amx_prefetch_step(pf);
        _tile_loadd(6, b0 + s * 256, 64);
        _tile_loadd(4, a[0] + s * 32, as[0]);
        _tile_dpbf16ps(0, 4, 6);
        if (NA > 1) {
            _tile_loadd(5, a[1] + s * 32, as[1]);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (NA > 2) {
            _tile_loadd(4, a[2] + s * 32, as[2]);
            _tile_dpbf16ps(2, 4, 6);
        }
        if (NA > 3) {
            _tile_loadd(5, a[3] + s * 32, as[3]);
            _tile_dpbf16ps(3, 5, 6);
        }
    }
    _tile_stored(0, c, 64);
    if (NA > 1) _tile_stored(1, c + 256, 64);
    if (NA > 2) _tile_stored(2, c + 512, 64);
    if (NA > 3) _tile_stored(3, c + 768, 64);
}

#ifdef MAX_PARTS /* bf16_parts.h's products (mxfp4_gemm.c takes the pieces above) */
/* weight rows [j0, j1) of w (row stride ws, j1 - j0 <= AMX_CHUNK) times all packed row blocks ->
 * out at column col (row stride N). A last block of fewer than 16 weight rows is read from pad
 * (16 x K, its other rows zero), never past the weight. next (NULL: none): the next item's rows,
 * next_rows of them at row stride next_ws, prefetched during the first pass. */
static void amx_chunk(const uint16_t *w, int64_t ws, int64_t j0, int64_t j1, const uint32_t *xp, int64_t M,
                      int64_t K, float *out, int64_t col, int64_t N, uint16_t *pad, float *c, const uint16_t *next,
                      int64_t next_ws, int64_t next_rows) {
    const int64_t S = K / 32, blocks = (M + 15) / 16, rows = j1 - j0;
    const int NA = (int)((rows + 15) / 16);
    const int64_t first_pass_steps = S * (blocks > 1 ? (NA + 1) / 2 : 1), lines = next_rows * (K * 2 / 64);
    struct amx_prefetch prefetch = {(const char *)next, next_ws * 2, K * 2, 0, next ? lines : 0,
                                    (lines + first_pass_steps - 1) / first_pass_steps};
    const uint16_t *a[4];
    int64_t as[4], wr[4];
    for (int i = 0; i < NA; i++) {
        a[i] = w + (j0 + 16 * i) * ws, as[i] = ws * 2;
        wr[i] = rows - 16 * i < 16 ? rows - 16 * i : 16;
    }
    if (wr[NA - 1] < 16) {
        memset(pad, 0, (size_t)(16 * K) * sizeof(uint16_t));
        for (int64_t i = 0; i < wr[NA - 1]; i++) memcpy(pad + i * K, a[NA - 1] + i * ws, (size_t)K * sizeof(uint16_t));
        a[NA - 1] = pad, as[NA - 1] = K * 2;
    }
    for (int64_t b = 0; b < blocks; b += 2) {
        const uint32_t *b0 = xp + b * S * 256;
        const int64_t xr0 = M - 16 * b < 16 ? M - 16 * b : 16;
        float *o0 = out + 16 * b * N + col;
        struct amx_prefetch *pf = b == 0 && next != 0 ? &prefetch : 0;
        if (b + 1 < blocks) {
            const int64_t xr1 = M - 16 * (b + 1) < 16 ? M - 16 * (b + 1) : 16;
            for (int i = 0; i < NA; i += 2) {
                if (NA - i > 1)
                    amx_2x2(2, a + i, as + i, b0, b0 + S * 256, S, c, pf);
                else
                    amx_2x2(1, a + i, as + i, b0, b0 + S * 256, S, c, pf);
                for (int q = 0; q < 2 && i + q < NA; q++) {
                    amx_store(c + (2 * q) * 256, wr[i + q], xr0, o0 + 16 * (i + q), N);
                    amx_store(c + (2 * q + 1) * 256, wr[i + q], xr1, o0 + 16 * N + 16 * (i + q), N);
                }
            }
        } else {
            switch (NA) {
                case 1: amx_1x4(1, a, as, b0, S, c, pf); break;
                case 2: amx_1x4(2, a, as, b0, S, c, pf); break;
                case 3: amx_1x4(3, a, as, b0, S, c, pf); break;
                default: amx_1x4(4, a, as, b0, S, c, pf); break;
            }
            for (int i = 0; i < NA; i++) amx_store(c + i * 256, wr[i], xr0, o0 + 16 * i, N);
        }
    }
}

/* bf16_parts_product's product on the tiles, for rows of bfloat16 values: bfloat16 rows xb (row
 * stride xs) or, xb NULL, float32 rows xf [M, K] holding bfloat16 values. Returns 0, or -1 (nothing
 * written: more than MAX_PARTS parts, K not a multiple of 32, no memory for the packed rows). */
static int amx_parts_product(const uint16_t *xb, int64_t xs, const float *xf, int64_t M, int64_t K, int64_t parts,
                             const uint16_t *const *ws, const int64_t *w_strides, const int64_t *ns, float *out,
                             int num_threads) {
    if (parts < 1 || parts > MAX_PARTS || K % 32 != 0 || M < 1) return -1;
    int64_t first_chunk[MAX_PARTS + 1], first_col[MAX_PARTS + 1];
    first_chunk[0] = first_col[0] = 0;
    for (int64_t p = 0; p < parts; p++) {
        first_chunk[p + 1] = first_chunk[p] + (ns[p] + AMX_CHUNK - 1) / AMX_CHUNK;
        first_col[p + 1] = first_col[p] + ns[p];
    }
    const int64_t N = first_col[parts], chunks = first_chunk[parts], blocks = (M + 15) / 16;
    const int threads = num_threads > 1 && M * N * K >= AMX_PARALLEL_MIN_MACS ? num_threads : 1;
    const size_t xp_bytes = (size_t)(blocks * K) * 32, pad_bytes = (size_t)(16 * K) * sizeof(uint16_t);
    uint32_t *xp = aligned_alloc(64, xp_bytes);
    uint16_t *pads = malloc(pad_bytes * (size_t)threads);
    if (xp == NULL || pads == NULL) {
        free(xp), free(pads);
        return -1;
    }
    amx_pack_rows(xb, xs, xf, M, K, xp);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float c[4 * 256] __attribute__((aligned(64)));
        uint16_t *pad = pads + (size_t)omp_get_thread_num() * 16 * (size_t)K;
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            int64_t p = 0;
            while (chunk >= first_chunk[p + 1]) p++;
            const int64_t j0 = (chunk - first_chunk[p]) * AMX_CHUNK;
            const int64_t j1 = j0 + AMX_CHUNK < ns[p] ? j0 + AMX_CHUNK : ns[p];
            /* the next item's rows: this part's next chunk, or the next part's first */
            const uint16_t *next = 0;
            int64_t next_ws = 0, next_rows = 0;
            if (j1 < ns[p]) {
                next = ws[p] + j1 * w_strides[p], next_ws = w_strides[p];
                next_rows = j1 + AMX_CHUNK < ns[p] ? AMX_CHUNK : ns[p] - j1;
            } else if (p + 1 < parts) {
                next = ws[p + 1], next_ws = w_strides[p + 1];
                next_rows = AMX_CHUNK < ns[p + 1] ? AMX_CHUNK : ns[p + 1];
            }
            amx_chunk(ws[p], w_strides[p], j0, j1, xp, M, K, out, first_col[p] + j0, N, pad, c, next, next_ws,
                      next_rows);
        }
        _tile_release();
    }
    free(xp);
    free(pads);
    return 0;
}
#endif
#else
static inline int amx_least_rows(void) { return 0; }
static inline int amx_takes(int64_t M, int64_t K) { (void)M, (void)K; return 0; }
static inline int amx_parts_product(const uint16_t *xb, int64_t xs, const float *xf, int64_t M, int64_t K,
                                    int64_t parts, const uint16_t *const *ws, const int64_t *w_strides,
                                    const int64_t *ns, float *out, int num_threads) {
    (void)xb, (void)xs, (void)xf, (void)M, (void)K, (void)parts, (void)ws, (void)w_strides, (void)ns, (void)out;
    (void)num_threads;
    return -1;
}
#endif
