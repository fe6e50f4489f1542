/* bfloat16 <-> float32 one value at a time, for the small fused kernels (norms, AttnRes, the KDA
 * layer step). Rows there are either float32 (is_bf16 == 0) or bfloat16 (is_bf16 == 1).
 * Stores round to nearest even, as torch's .to(torch.bfloat16) does (NaN stays a quiet NaN). */
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* v rounded to bfloat16 and back: the value a bfloat16 tensor of the torch form holds */
static inline float bf16_round(float v) { return bf16_to_float(float_to_bf16(v)); }

/* element i of a float32 or bfloat16 row */
static inline float load_value(const void *row, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline void store_value(void *row, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)row)[i] = float_to_bf16(v);
    else
        ((float *)row)[i] = v;
}

/* bfloat16 rows [T, n] (row stride) widened to float32 [T, n], contiguous */
static inline void widen_bf16(const uint16_t *x, int64_t stride, int64_t T, int64_t n, float *out) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < n; i++) out[t * n + i] = bf16_to_float(x[t * stride + i]);
}

/* n float32 values rounded to bfloat16, as .to(torch.bfloat16) does */
static inline void round_to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16(x[i]);
}
