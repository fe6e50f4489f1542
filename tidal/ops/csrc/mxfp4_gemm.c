/* MXFP4 weights straight from their packed form: the C kernels behind tidal.ops.mxfp4_moe.
 *
 * Weights are compressed-tensors mxfp4-pack-quantized: each weight row is K/2 packed bytes (input
 * column 2j in the low nibble of byte j, 2j+1 in the high nibble) and K/32 scale bytes (E8M0:
 * 2^(s-127), s = 0 the subnormal 2^-127; 255 (NaN) is refused by the loader). K % 32 == 0.
 * Expert e's N output rows are P parts of N/P rows (an expert_rows table): part p's row r is at
 * packed[e * P + p] + r * packed_stride and its scales at scales[e * P + p] + r * scale_stride (the
 * tables hold addresses). Stacked experts [E, N, K/2] are P = 1 at stride K/2; gate and up kept
 * where the checkpoint's mapping holds them (w1 and w3 apart, any order, any file) are P = 2, and a
 * tensor-parallel rank's columns of a row are a stride longer than the row.
 *
 * mxfp4_grouped_gemm: group g holds rows offsets[g] .. offsets[g+1]-1 of x [S, K] (float32);
 * out[t] = x[t] @ W[experts[g]]^T, out [S, N] float32, at every group size (one decode row to a
 * prefill's hundreds); returns 0, or -1 when scratch memory cannot be allocated. A panel of a few
 * weight rows is decoded to float32 (each E2M1 value times the block scale: exact, a power of two)
 * into a per-thread buffer in L1, and the group's rows pass under it in the register tiles of
 * row_tiles.h, whose fixed summation order makes every row's result bitwise independent of the
 * other rows, the group sizes and the thread count. A group of one row (decode) skips the panel:
 * its blocks are decoded in registers straight into the fused multiply-adds; with AVX-512, groups of
 * up to 4 rows do too, two weight rows per 16-lane register (paired_tile_packed). On AVX2 the columns
 * of each group of 8 are taken in the decoder's order (PERM), x's included, so decoding is a few
 * in-lane byte shuffles per 32 weights.
 *
 * mxfp4_dequantize: the experts' weights as float32 [G, N, K], columns in order.
 *
 * mxfp4_moe_tokens: a whole routed-expert sum (tidal.model.moe.PackedExperts.forward) in one call.
 *
 * On CPUs with AMX-BF16 (amx_tiles.h's switch), groups of AMX_GROUP_MIN_ROWS or more rows of
 * bfloat16 values (x_bf16: the gate|up product of a bfloat16 model; the down product's rows are
 * float32 activations and never are) run on the tiles instead: a work item's weight rows decoded
 * to bfloat16 (exact) as A tiles, the group's rows as B tiles. Their order is the tiles' (a row's
 * bits then depend on its group's size crossing the threshold), never under deterministic inference.
 *
 * Built with -march=native where AVX2+FMA exist; the portable build (TIDAL_CPU_PORTABLE=1, or the
 * fallback when the native build fails) uses plain C loops with the same summation order.
 * Threads wait passively (no spin barriers): see tidal.ops.cpu_kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILE_AVX2 1
#define TILE_LOAD8 _mm256_loadu_ps
#ifdef __AVX512F__
static inline __m512 load8_pair(const float *p0, const float *p1) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(p0))),
                                               _mm256_castps_pd(_mm256_loadu_ps(p1)), 1));
}
#define TILE_LOAD8_PAIR load8_pair
#endif
#endif
#define TILE_W float
#define TILE_VALUE(v) (v)
#define TILE_COLS_4 2 /* see row_tiles.h */
#include "row_tiles.h"

#include "amx_tiles.h"
#include "bf16_scalar.h"
#include "gated_act.h"

/* Where the experts' weight rows are (see the top of the file). */
typedef struct {
    const int64_t *packed, *scales;  /* [E * parts] addresses */
    int64_t parts, packed_stride, scale_stride;
} expert_rows;

static inline float e8m0(uint8_t s) {
    uint32_t bits = s == 0 ? (1u << 22) : ((uint32_t)s << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* E2M1 code -> value; codes 8..15 are the negatives (8 = -0, decoded as +0: the products and sums
 * are the same). */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* The 32 values of one block (16 packed bytes) times its scale, into v[32], columns in order. */
static inline void decode_block_in_order(const uint8_t *restrict p, uint8_t scale, float *restrict v) {
    const float s = e8m0(scale);
    for (int j = 0; j < 16; j++) {
        v[2 * j] = E2M1[p[j] & 0xF] * s;
        v[2 * j + 1] = E2M1[p[j] >> 4] * s;
    }
}

#ifdef TILE_AVX2
/* The GEMM's column order (AVX2): within each group of 8 columns, lane l holds column PERM[l]. The
 * decoder below yields the weights in that order with in-lane shuffles only (no widening, no
 * int -> float conversion), and the rows of x are put in the same order once per call
 * (permute_rows), so lane l of an accumulator sums columns 8i + PERM[l]: one fixed order for the
 * panel path and the one-row path alike (a row's bits do not depend on the other rows). */
#define PERMUTED_COLUMNS 1
static const int PERM[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* ... one block as four vectors of 8 (columns 0..7, 8..15, 16..23, 24..31, each in PERM order), in
 * registers. Each E2M1 value is a bfloat16 (two significant bits), so a byte shuffle per half of
 * its bit pattern gives it exactly; times the scale (a power of two: exact). */
/* ... the block's E2M1 values as bfloat16, unscaled: b0 columns 0..15 (lane 0 the even ones 0, 2,
 * .., 14, lane 1 the odd ones), b1 columns 16..31 */
static inline __attribute__((always_inline)) void block_codes_bf16(const uint8_t *restrict p, __m256i *b0, __m256i *b1) {
    const __m256i hi_t = _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                          0x00, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0,
                                          0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                          0x00, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0);
    const __m256i lo_t = _mm256_setr_epi8(0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                          0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                          0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0,
                                          0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0);
    /* low half: the low nibbles (even columns 0, 2, .., 30); high half: the high nibbles (odd) */
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi64(bytes, _mm256_setr_epi64x(0, 0, 4, 4)),
                                           _mm256_set1_epi8(0x0F));
    const __m256i h = _mm256_shuffle_epi8(hi_t, codes), l = _mm256_shuffle_epi8(lo_t, codes);
    *b0 = _mm256_unpacklo_epi8(l, h), *b1 = _mm256_unpackhi_epi8(l, h);
}

static inline __attribute__((always_inline)) void decode_block8(const uint8_t *restrict p, uint8_t scale, __m256 v[4]) {
    __m256i b0, b1;  /* bf16: columns 0..15, 16..31 */
    block_codes_bf16(p, &b0, &b1);
    const __m256i z = _mm256_setzero_si256();
    const __m256 s = _mm256_set1_ps(e8m0(scale));
    v[0] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, b0)), s);
    v[1] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, b0)), s);
    v[2] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, b1)), s);
    v[3] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, b1)), s);
}

/* ... into v[32], in the GEMM's column order (the L1 panel) */
static inline void decode_block(const uint8_t *restrict p, uint8_t scale, float *restrict v) {
    __m256 r[4];
    decode_block8(p, scale, r);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(v + 8 * i, r[i]);
}

/* rows [0, S) of x [S, K] (K % 8 == 0) with each group of 8 columns in PERM order, into out */
static void permute_rows(const float *x, int64_t S, int64_t K, float *out) {
    const __m256i perm = _mm256_loadu_si256((const __m256i *)PERM);
    for (int64_t i = 0; i < S * K; i += 8) _mm256_storeu_ps(out + i, _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + i), perm));
}

/* One row x (K values, PERM order) times C consecutive weight rows of one expert (C <= MAX_C, a
 * constant at each call, so the accumulators stay in registers) -> out[0 .. C): the blocks decoded
 * in registers straight into the fused multiply-adds, without the L1 panel. Each output's order is
 * the tiles' (one 8-lane accumulator over k in steps of 8, lanes_sum; K % 32 == 0 leaves no tail)
 * and the values are decode_block's, so the bits equal the panel path's. */
static inline __attribute__((always_inline)) void row_tile_packed(const int C, const float *x, int64_t K,
                                                                  const uint8_t *w, int64_t ws, const uint8_t *s,
                                                                  int64_t ss, float *out) {
    const int64_t row_scales = K / 32;
    __m256 a[MAX_C];
    for (int c = 0; c < C; c++) a[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < row_scales; b++) {
        const float *xb = x + b * 32;
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            __m256 v[4];
            decode_block8(w + c * ws + b * 16, s[c * ss + b], v);
            for (int i = 0; i < 4; i++) a[c] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + 8 * i), a[c]);
        }
    }
    for (int c = 0; c < C; c++) out[c] = lanes_sum(a[c]);
}

/* weight rows [j, j + C) of one expert's part (row strides ws, ss bytes), each C its own specialised code */
#define CASE(C) case C: row_tile_packed(C, x, K, we + j * ws, ws, se + j * ss, ss, out); break;
static void row_times_packed(const float *x, int64_t K, const uint8_t *we, int64_t ws, const uint8_t *se,
                             int64_t ss, int64_t j, int C, float *out) {
    switch (C) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
}
#undef CASE
#else
#define decode_block decode_block_in_order
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAIRED_ROWS 1
/* decode_block8 of two weight rows' blocks at once: row 0 in the low 256 bits of each v[i], row 1
 * in the high 256, sc their scales (row 0's in the low 8 lanes). Every instruction of decode_block8
 * works within 128-bit lanes, so each half holds exactly decode_block8's bits for its row. */
static inline __attribute__((always_inline)) void decode_block8_pair(const uint8_t *restrict p0,
                                                                     const uint8_t *restrict p1, __m512 sc,
                                                                     __m512 v[4]) {
    const __m512i hi_t = _mm512_broadcast_i32x4(_mm_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x00,
                                                              (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0,
                                                              (char)0xC0, (char)0xC0, (char)0xC0));
    const __m512i lo_t = _mm512_broadcast_i32x4(_mm_setr_epi8(0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40,
                                                              (char)0x80, (char)0xC0, 0x00, 0x00, (char)0x80,
                                                              (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0));
    const __m512i bytes = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p0))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p1)), 1);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi64(bytes, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                                           _mm512_set1_epi8(0x0F));
    const __m512i h = _mm512_shuffle_epi8(hi_t, codes), l = _mm512_shuffle_epi8(lo_t, codes);
    const __m512i b0 = _mm512_unpacklo_epi8(l, h), b1 = _mm512_unpackhi_epi8(l, h);
    const __m512i z = _mm512_setzero_si512();
    v[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, b0)), sc);
    v[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, b0)), sc);
    v[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, b1)), sc);
    v[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, b1)), sc);
}

/* 8 floats at x in both halves */
static inline __m512 x8_twice(const float *x) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x))));
}

/* e8m0 of the n <= 16 scale bytes at p (a row's consecutive blocks), one per lane (lanes past n: 0) */
static inline __m512 scales16(const uint8_t *p, int n) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p));
    const __m512i bits = _mm512_mask_mov_epi32(_mm512_slli_epi32(d, 23), _mm512_cmpeq_epi32_mask(d, _mm512_setzero_si512()),
                                               _mm512_set1_epi32(1 << 22));
    return _mm512_castsi512_ps(bits);
}

/* Weight rows per register tile of R x rows (the accumulators, R * ceil(C / 2), fit the 32 zmm
 * registers beside the scale vectors, the decoded block and the x loads). */
#define PAIRED_MAX_R 4
#define PAIRED_MAX_PAIRS 4
static const int PAIRED_COLS[PAIRED_MAX_R + 1] = {0, 8, 8, 6, 6};

/* R rows of x (row stride K, PERM order) times C consecutive weight rows of one expert -> out[r * N +
 * c]: weight rows 2q and 2q+1 decoded side by side (decode_block8_pair; an odd last row beside
 * itself) straight into 16-lane accumulators, each half of which is one output's 8-lane accumulator
 * in the tiles' order (k in steps of 8, lanes_sum): the bits of the panel path and of
 * row_tile_packed, with each block decoded once for all R rows and half the instructions. R and C
 * are constants at each call. */
static inline __attribute__((always_inline)) void paired_tile_packed(const int R, const int C, const float *x,
                                                                     int64_t K, const uint8_t *w, int64_t ws,
                                                                     const uint8_t *s, int64_t ss, float *out,
                                                                     int64_t N) {
    const int pairs = (C + 1) / 2;
    const int64_t row_scales = K / 32;
    /* the next tile's weight rows, C * 16 bytes per block, when they are contiguous (see row_tiles.h) */
    const char *pf = ws == K / 2 ? (const char *)(w + C * ws) : NULL;
    __m512 a[PAIRED_MAX_R][PAIRED_MAX_PAIRS];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < pairs; q++) a[r][q] = _mm512_setzero_ps();
    /* each row's scales 16 blocks at a time, one lane per block; a pair's scale vector for block b
     * (its rows' lanes b, 8 times each) is one two-source permute */
    const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
    for (int64_t b0 = 0; b0 < row_scales; b0 += 16) {
        const int nb = row_scales - b0 < 16 ? (int)(row_scales - b0) : 16;
        __m512 s0[PAIRED_MAX_PAIRS], s1[PAIRED_MAX_PAIRS];
        for (int q = 0; q < pairs; q++) {
            s0[q] = scales16(s + 2 * q * ss + b0, nb);
            s1[q] = scales16(s + (2 * q + 1 < C ? 2 * q + 1 : 2 * q) * ss + b0, nb);
        }
        for (int bi = 0; bi < nb; bi++) {
            const int64_t b = b0 + bi;
            if (pf != NULL)
                for (int64_t o = 0; o < 16 * C; o += 64) _mm_prefetch(pf + b * 16 * C + o, _MM_HINT_T0);
            const __m512i lane = _mm512_add_epi32(first, _mm512_set1_epi32(bi));
#pragma GCC unroll 8
            for (int q = 0; q < pairs; q++) {
                const int c0 = 2 * q, c1 = 2 * q + 1 < C ? 2 * q + 1 : 2 * q;
                __m512 v[4];
                decode_block8_pair(w + c0 * ws + b * 16, w + c1 * ws + b * 16,
                                   _mm512_permutex2var_ps(s0[q], lane, s1[q]), v);
                for (int i = 0; i < 4; i++)
                    for (int r = 0; r < R; r++) a[r][q] = _mm512_fmadd_ps(v[i], x8_twice(x + r * K + b * 32 + 8 * i), a[r][q]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < pairs; q++) {
            out[r * N + 2 * q] = lanes_sum(_mm512_castps512_ps256(a[r][q]));
            if (2 * q + 1 < C)
                out[r * N + 2 * q + 1] = lanes_sum(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r][q]), 1)));
        }
}

/* the tile of R rows by weight rows [j, j + C) (C <= PAIRED_COLS[R]), each shape its own code */
#define CASE(R, C) case (R) * 32 + (C): paired_tile_packed(R, C, x, K, we + j * ws, ws, se + j * ss, ss, out, N); break;
static void rows_times_packed(int R, int C, const float *x, int64_t K, const uint8_t *we, int64_t ws,
                              const uint8_t *se, int64_t ss, int64_t j, float *out, int64_t N) {
    switch (R * 32 + C) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4) CASE(1, 5) CASE(1, 6) CASE(1, 7) CASE(1, 8)
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4) CASE(2, 5) CASE(2, 6) CASE(2, 7) CASE(2, 8)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4) CASE(3, 5) CASE(3, 6)
        CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4) CASE(4, 5) CASE(4, 6)
    }
}
#undef CASE
#endif

/* weight rows [j, j + C) of one expert's part (row strides ws, ss bytes) as float32 rows of K into panel */
static void decode_rows(const uint8_t *we, int64_t ws, const uint8_t *se, int64_t ss, int64_t K, int64_t j, int C,
                        float *panel) {
    const int64_t row_scales = K / 32;
    for (int c = 0; c < C; c++)
        for (int64_t b = 0; b < row_scales; b++)
            decode_block(we + (j + c) * ws + b * 16, se[(j + c) * ss + b], panel + c * K + b * 32);
}

/* Weight rows per work item (a multiple of every tile width): a decode step (as few as top-k
 * groups) still spreads over the threads. An item never spans two parts. */
#define ROW_CHUNK 48
/* (row, 32-weight block) pairs below which a product runs on the calling thread: a passive OpenMP
 * pool's wake-up costs more than a second thread saves on a few experts' rows (a decode step's
 * top-k at one token). The bits do not depend on the thread count either way. */
#define PARALLEL_MIN_WORK (1 << 17)

#ifdef TIDAL_AMX
/* Rows per expert group from which the group runs on the AMX tiles (x of bfloat16 values only; a
 * lower trunk threshold, 1 in tests, lowers it too). */
#define AMX_GROUP_MIN_ROWS 4
_Static_assert(ROW_CHUNK % 16 == 0 && ROW_CHUNK <= 48, "amx_group_chunk holds a work item in three A tiles");

/* One block's 32 values as bfloat16 in decode_block8's column order (PERM within each 8), exactly:
 * decode_block8's bfloat16 codes, the scale 2^(s-127) added to their exponent fields (nonzero values
 * only). Exact for 2 <= s <= 252 (every nonzero E2M1 value times the scale is then a normal bfloat16);
 * other scales go through the float32 decode, whose values are bfloat16 ones too. */
static inline void decode_block_bf16_perm(const uint8_t *restrict p, uint8_t scale, uint16_t *restrict v) {
    if (scale < 2 || scale > 252) {
        float f[32];
        decode_block(p, scale, f);
        _mm512_storeu_si512(v, amx_bf16_32(f));
        return;
    }
    __m256i codes0, codes1;
    block_codes_bf16(p, &codes0, &codes1);
    /* 64-bit quarters 0, 2, 1, 3 of each put its columns in PERM order (0, 2, 4, 6, 1, 3, 5, 7, ...) */
    const __m256i b0 = _mm256_permute4x64_epi64(codes0, 0xD8), b1 = _mm256_permute4x64_epi64(codes1, 0xD8);
    const __m256i add = _mm256_set1_epi16((int16_t)(((int)scale - 127) * 128));
    _mm256_storeu_si256((__m256i *)v, _mm256_mask_add_epi16(b0, _mm256_test_epi16_mask(b0, b0), b0, add));
    _mm256_storeu_si256((__m256i *)(v + 16), _mm256_mask_add_epi16(b1, _mm256_test_epi16_mask(b1, b1), b1, add));
}

/* weight rows [j0, j1) (at most 48: three A tiles) of one expert's part times the group's packed
 * rows xp (R rows) -> out (row stride N, at the group's first row and column j0): the rows decoded
 * as bfloat16 (exact: an E2M1 value times a power of two; the GEMM's column order, x's too) into a
 * (16-row tiles, past j1 zero), then three C tiles at a time (independent sums keep the tile unit
 * busy). Each sum is one C tile's over the ascending k steps from zero, as amx_tiles.h's: bitwise
 * independent of the other rows and groups. */
static void amx_group_chunk(const uint8_t *we, int64_t ws, const uint8_t *se, int64_t ss, int64_t K, int64_t j0,
                            int64_t j1, uint16_t *a, const uint32_t *xp, int64_t R, float *out, int64_t N, float *c) {
    const int64_t S = K / 32, rows = j1 - j0;
    const int NA = (int)((rows + 15) / 16);
    for (int64_t r = 0; r < 16 * NA; r++)
        for (int64_t s = 0; s < S; s++) {
            if (r < rows)
                decode_block_bf16_perm(we + (j0 + r) * ws + s * 16, se[(j0 + r) * ss + s], a + r * K + 32 * s);
            else
                _mm512_storeu_si512(a + r * K + 32 * s, _mm512_setzero_si512());
        }
    const uint16_t *a1 = a + 16 * K, *a2 = a + 32 * K;
    for (int64_t b = 0; 16 * b < R; b++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t s = 0; s < S; s++) {
            _tile_loadd(6, xp + (b * S + s) * 256, 64);
            _tile_loadd(4, a + 32 * s, K * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (NA > 1) {
                _tile_loadd(5, a1 + 32 * s, K * 2);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (NA > 2) {
                _tile_loadd(7, a2 + 32 * s, K * 2);
                _tile_dpbf16ps(2, 7, 6);
            }
        }
        const int64_t xr = R - 16 * b < 16 ? R - 16 * b : 16;
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        _tile_stored(2, c + 512, 64);
        for (int i = 0; i < NA; i++)
            amx_store(c + 256 * i, rows - 16 * i < 16 ? rows - 16 * i : 16, xr, out + 16 * b * N + j0 + 16 * i, N);
    }
}
#endif

static int grouped_gemm(const float *x_in, int64_t K, const int64_t *offsets, const int64_t *experts, int64_t G,
                        const expert_rows *wt, int64_t N, float *out, int x_bf16, int num_threads) {
    const int64_t P = wt->parts, part_rows = N / P;
    const int64_t chunks = (part_rows + ROW_CHUNK - 1) / ROW_CHUNK;
    const int64_t ws = wt->packed_stride, ss = wt->scale_stride;
#ifdef PERMUTED_COLUMNS
    float *x_perm = malloc(sizeof(float) * (size_t)(offsets[G] * K + 1));
    if (x_perm == NULL) return -1;
    permute_rows(x_in, offsets[G], K, x_perm);
    const float *x = x_perm;
#else
    const float *x = x_in;
#endif
    int status = 0;
    const int64_t work = offsets[G] * N * (K / 32);
#ifdef TIDAL_AMX
    /* groups of AMX_GROUP_MIN_ROWS rows or more of bfloat16 values, packed as amx_tiles.h's B tiles
     * (group g's at xp + packed_at[g]); without memory for them every group runs the FMA tiles */
    const int least = amx_least_rows(), group_min = least < AMX_GROUP_MIN_ROWS ? least : AMX_GROUP_MIN_ROWS;
    int amx = x_bf16 && least > 0 && K % 32 == 0;
    int64_t *packed_at = amx ? malloc(sizeof(int64_t) * (size_t)(G + 1)) : NULL;
    for (int64_t g = 0, at = 0; g <= G && packed_at != NULL; g++) {
        packed_at[g] = at;
        if (g < G && offsets[g + 1] - offsets[g] >= group_min) at += (offsets[g + 1] - offsets[g] + 15) / 16 * K * 8;
    }
    amx = packed_at != NULL && packed_at[G] > 0;  /* no group big enough: no tiles configured */
    uint32_t *xp = amx ? aligned_alloc(64, sizeof(uint32_t) * (size_t)packed_at[G]) : NULL;
    amx = xp != NULL;
    for (int64_t g = 0; g < G && amx; g++)
        if (packed_at[g + 1] > packed_at[g])
            amx_pack_rows(NULL, 0, x + offsets[g] * K, offsets[g + 1] - offsets[g], K, xp + packed_at[g]);
#else
    (void)x_bf16;
#endif
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && work >= PARALLEL_MIN_WORK)
    {
        float *panel = malloc(sizeof(float) * MAX_C * K);
#ifdef TIDAL_AMX
        uint16_t *a_tile = amx ? aligned_alloc(64, sizeof(uint16_t) * ROW_CHUNK * (size_t)K) : NULL;
        float c_tile[3 * 256] __attribute__((aligned(64)));
        if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < G * P * chunks; item++) {
            const int64_t g = item / (P * chunks), p = item / chunks % P, c = item % chunks;
            const int64_t t0 = offsets[g], t1 = offsets[g + 1];
            if (panel == NULL) {
#pragma omp atomic write
                status = -1;
            }
            if (t0 == t1 || panel == NULL) continue;
            const uint8_t *we = (const uint8_t *)(intptr_t)wt->packed[experts[g] * P + p];
            const uint8_t *se = (const uint8_t *)(intptr_t)wt->scales[experts[g] * P + p];
            float *part_out = out + p * part_rows;  /* the part's first output column */
            const int64_t rows = t1 - t0;
            const int64_t j1 = (c + 1) * ROW_CHUNK < part_rows ? (c + 1) * ROW_CHUNK : part_rows;
#ifdef TIDAL_AMX
            if (amx && packed_at[g + 1] > packed_at[g]) {
                if (a_tile == NULL) {
#pragma omp atomic write
                    status = -1;
                    continue;
                }
                amx_group_chunk(we, ws, se, ss, K, c * ROW_CHUNK, j1, a_tile, xp + packed_at[g], rows,
                                part_out + t0 * N, N, c_tile);
                continue;
            }
#endif
#ifdef PAIRED_ROWS
            if (rows <= PAIRED_MAX_R) {  /* a few rows: blocks decoded in registers, no panel */
                const int pc = PAIRED_COLS[rows];
                for (int64_t j = c * ROW_CHUNK; j < j1; j += pc)
                    rows_times_packed((int)rows, j1 - j < pc ? (int)(j1 - j) : pc, x + t0 * K, K, we, ws, se, ss, j,
                                      part_out + t0 * N + j, N);
                continue;
            }
#endif
            const int cols = COLS_FOR_ROWS[rows < MAX_R ? rows : MAX_R];
            for (int64_t j = c * ROW_CHUNK; j < j1; j += cols) {
                const int C = j1 - j < cols ? (int)(j1 - j) : cols;
#ifdef TILE_AVX2
                if (rows == 1) {  /* a decode row: nothing to reuse a decoded panel for */
                    row_times_packed(x + t0 * K, K, we, ws, se, ss, j, C, part_out + t0 * N + j);
                    continue;
                }
#endif
                decode_rows(we, ws, se, ss, K, j, C, panel);
                rows_times_panel(x, K, t0, t1, panel, K, j, j + C, part_out, N);
            }
        }
        free(panel);
#ifdef TIDAL_AMX
        if (amx) _tile_release();
        free(a_tile);
#endif
    }
#ifdef TIDAL_AMX
    free(packed_at);
    free(xp);
#endif
#ifdef PERMUTED_COLUMNS
    free(x_perm);
#endif
    return status;
}

/* The grouped GEMM over experts given by an expert_rows table (see the top of the file); returns
 * 0, -1 when scratch memory cannot be allocated, -2 when N is not a multiple of parts. */
int mxfp4_grouped_gemm(const float *x, int64_t K, const int64_t *offsets, const int64_t *experts, int64_t G,
                       const int64_t *packed, const int64_t *scales, int64_t parts, int64_t packed_stride,
                       int64_t scale_stride, int64_t N, float *out, int x_bf16, int num_threads) {
    if (parts < 1 || N % parts) return -2;
    const expert_rows wt = {packed, scales, parts, packed_stride, scale_stride};
    return grouped_gemm(x, K, offsets, experts, G, &wt, N, out, x_bf16, num_threads);
}

void mxfp4_dequantize(const int64_t *experts, int64_t G, const uint8_t *packed, const uint8_t *scales, int64_t N,
                      int64_t K, float *out, int num_threads) {
    const int64_t blocks = N * (K / 32);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < G * blocks; i++) {
        const int64_t g = i / blocks, b = i % blocks;
        const int64_t e = experts[g];
        decode_block_in_order(packed + (e * blocks + b) * 16, scales[e * blocks + b], out + (g * blocks + b) * 32);
    }
}

/* One block's 32 weights as bfloat16, columns in order: each value (an E2M1 code times a power of
 * two, at most two significant bits) is a bfloat16 exactly, so it is the upper half of its float32. */
static inline void decode_block_bf16(const uint8_t *restrict p, uint8_t scale, uint16_t *restrict v) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* the block's 16 values (one per code) as bfloat16, then the 32 codes looked up in them */
    const __m512 values = _mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(e8m0(scale)));
    const __m256i table = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(values), 16));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p), nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, nib), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
    const __m256i codes = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    const __m512i idx = _mm512_cvtepu8_epi16(codes);
    _mm512_storeu_si512(v, _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(table)));
#else
    float f[32];
    decode_block_in_order(p, scale, f);
    for (int i = 0; i < 32; i++) {
        uint32_t bits;
        memcpy(&bits, f + i, sizeof bits);
        v[i] = (uint16_t)(bits >> 16);
    }
#endif
}

/* Expert e of a table (see expert_rows: N rows of K inputs, in parts) as bfloat16 out [N, K], columns
 * in order, exactly (tidal.ops.bf16_blas's products of many rows). Returns 0, -2 when N is not a
 * multiple of parts. */
int mxfp4_dequantize_bf16(int64_t e, const int64_t *packed, const int64_t *scales, int64_t parts,
                          int64_t packed_stride, int64_t scale_stride, int64_t N, int64_t K, uint16_t *out,
                          int num_threads) {
    if (parts < 1 || N % parts) return -2;
    const int64_t part_rows = N / parts, blocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && N * K >= (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        const int64_t p = n / part_rows, r = n % part_rows;
        const uint8_t *we = (const uint8_t *)(intptr_t)packed[e * parts + p] + r * packed_stride;
        const uint8_t *se = (const uint8_t *)(intptr_t)scales[e * parts + p] + r * scale_stride;
        for (int64_t b = 0; b < blocks; b++) decode_block_bf16(we + b * 16, se[b], out + n * K + b * 32);
    }
    return 0;
}

/* The routed experts of T tokens: token t's rows h[t] (d values at row stride h_stride, float32 or
 * bfloat16) go to experts ids[t, :k] (int64 in [0, E)) with weights w[t, :k] (float32); the w13
 * table (2I rows of d inputs, 1 or 2 parts) gives gate | up, the w2 table (d rows of I inputs, one
 * part) the down projection; out[t] (float32 [T, d], zeroed here) = sum over t's experts in ascending order
 * of w * expert(h[t]). The slots are sorted by expert (stable), so the products, the activation
 * (gated_act.h) and the sums are those of the torch form bit for bit: the grouped GEMM's rows do
 * not depend on the groups. Returns 0, or -1 when scratch memory cannot be allocated. */
int mxfp4_moe_tokens(const void *h, int64_t h_stride, int h_bf16, int64_t T, int64_t d, const int64_t *ids,
                     const float *w, int64_t k, int64_t E, const int64_t *w13, const int64_t *w13_scales,
                     int64_t w13_parts, int64_t w13_stride, int64_t w13_scale_stride, int64_t I, const int64_t *w2,
                     const int64_t *w2_scales, int64_t w2_stride, int64_t w2_scale_stride, int act_kind, float beta,
                     float linear_beta, float *out, int num_threads) {
    if (w13_parts < 1 || (2 * I) % w13_parts) return -1;
    const expert_rows gate_up = {w13, w13_scales, w13_parts, w13_stride, w13_scale_stride};
    const expert_rows down = {w2, w2_scales, 1, w2_stride, w2_scale_stride};
    const int64_t S = T * k, es = h_bf16 ? 2 : 4;
    int64_t *count = calloc((size_t)E + 1, sizeof(int64_t)), *slot = malloc(sizeof(int64_t) * (size_t)S);
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)(E + 1)), *experts = malloc(sizeof(int64_t) * (size_t)E);
    float *x = malloc(sizeof(float) * (size_t)(S * d)), *gu = malloc(sizeof(float) * (size_t)(S * 2 * I));
    float *act = malloc(sizeof(float) * (size_t)(S * I)), *y = malloc(sizeof(float) * (size_t)(S * d));
    int status = -1;
    if (!count || !slot || !offsets || !experts || !x || !gu || !act || !y) goto done;
    for (int64_t i = 0; i < S; i++) {
        if (ids[i] < 0 || ids[i] >= E) goto done;
        count[ids[i] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];  /* count[e]: first sorted slot of expert e */
    int64_t G = 0;
    for (int64_t e = 0; e < E; e++)
        if (count[e + 1] > count[e]) {
            offsets[G] = count[e];
            experts[G++] = e;
        }
    offsets[G] = S;
    for (int64_t i = 0; i < S; i++) slot[count[ids[i]]++] = i;  /* stable counting sort */
    for (int64_t s = 0; s < S; s++) {
        const char *row = (const char *)h + (slot[s] / k) * h_stride * es;
        for (int64_t c = 0; c < d; c++) x[s * d + c] = load_value(row, c, h_bf16);
    }
    if (grouped_gemm(x, d, offsets, experts, G, &gate_up, 2 * I, gu, h_bf16, num_threads) != 0) goto done;
    for (int64_t s = 0; s < S; s++)
        gated_act_row(gu + s * 2 * I, gu + s * 2 * I + I, act + s * I, I, act_kind, beta, linear_beta);
    if (grouped_gemm(act, I, offsets, experts, G, &down, d, y, 0, num_threads) != 0) goto done;
    memset(out, 0, sizeof(float) * (size_t)(T * d));
    for (int64_t s = 0; s < S; s++) {
        float *o = out + (slot[s] / k) * d;
        const float ws = w[slot[s]];
        for (int64_t c = 0; c < d; c++) o[c] += y[s * d + c] * ws;
    }
    status = 0;
done:
    free(count);
    free(slot);
    free(offsets);
    free(experts);
    free(x);
    free(gu);
    free(act);
    free(y);
    return status;
}
