/* The DSPARK drafter's slot loop in one call (tidal.spec.dspark.DsparkDrafter.propose_many): the
 * slots of a block depend on each other only through the Markov head's bias, so once every slot's
 * LM head logits are known the rest is a short sequential scan per block, which in torch ops is a
 * dozen small calls per slot (each a few microseconds of dispatch around a vocabulary-wide pass).
 *
 * For each block b (B of them, S slots, vocabulary V, Markov rank r):
 *   p = prev[b], reach = 1
 *   slot j = 0, 1, ...:  logits[v] = head[b, j, v] + bias[v],  bias[v] = sum_i m_in[p, i] * m_out_t[i, v]
 *                        (summed in order i = 0 .. r-1)
 *                        token = the first largest logit, conf = 1 / sum_v exp(logits[v] - max)
 *                        (the token's softmax probability; the sum in 16 interleaved partial sums,
 *                        combined pairwise), reach *= conf, p = token
 *   a block stops after slot wanted[b] - 1, or once reach < min_reach * (1 - 1e-3) with
 *   min_reach > 0 (the caller cuts exactly, in float64: this only stops drafting early).
 * r = 0: no bias. drafted [B, S] int64 (-1 after the last slot drafted) and confidence [B, S] float32
 * are contiguous; head [B, S, V] float32 contiguous; m_in [V, r] and m_out_t [r, V] (the Markov output weight
 * input-major: the bias is r passes of multiply-adds along the vocabulary) float32 contiguous. A block
 * is scanned by one thread in a fixed order: its result does not depend on the other blocks or the
 * thread count. The vocabulary-wide passes run in vector registers where the build has them (the
 * bias and the maximum on AVX-512, the exponentials on AVX2: the same per-entry order).
 * Returns 0, or -1 without scratch memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gated_act.h"

/* the lanes of 16 partial sums, combined pairwise: (0+8, 1+9, ..), then (0+4, ..), (0+2, ..), 0+1 */
static float lanes16(float *a) {
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] += a[l + w];
    return a[0];
}

/* logits[v] += sum_i e[i] * w_t[i, v] for v in [0, V), summed in order i = 0 .. r-1 (fused
 * multiply-adds on AVX-512, in registers over 128 entries at a time; the tail in the same order) */
static void add_bias(float *logits, const float *e, const float *w_t, int64_t r, int64_t V) {
    int64_t v0 = 0;
#ifdef __AVX512F__
    for (; v0 + 128 <= V; v0 += 128) {
        __m512 a[8];
        for (int k = 0; k < 8; k++) a[k] = _mm512_setzero_ps();
        for (int64_t i = 0; i < r; i++) {
            const __m512 ei = _mm512_set1_ps(e[i]);
            const float *w = w_t + i * V + v0;
            for (int k = 0; k < 8; k++) a[k] = _mm512_fmadd_ps(ei, _mm512_loadu_ps(w + 16 * k), a[k]);
        }
        for (int k = 0; k < 8; k++)
            _mm512_storeu_ps(logits + v0 + 16 * k, _mm512_add_ps(_mm512_loadu_ps(logits + v0 + 16 * k), a[k]));
    }
#endif
    for (int64_t v = v0; v < V; v++) {
        float a = 0.0f;
        for (int64_t i = 0; i < r; i++) a = fmaf(e[i], w_t[i * V + v], a);
        logits[v] += a;
    }
}

/* sum_v e^(x[v] - best) in 16 lanes (lane v % 16), combined pairwise; e^ is gated_act.h's exp8 on
 * AVX2 builds (within a few ulps of expf), libm's expf for the tail and elsewhere */
static float exp_sum(const float *x, int64_t V, float best) {
    float acc[16] = {0};
    int64_t v = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    const __m256 b = _mm256_set1_ps(best);
    for (; v + 16 <= V; v += 16) {
        s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + v), b)));
        s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + v + 8), b)));
    }
    _mm256_storeu_ps(acc, s0);
    _mm256_storeu_ps(acc + 8, s1);
#endif
    for (; v < V; v++) acc[v % 16] += expf(x[v] - best);
    return lanes16(acc);
}

/* the first largest of x [V] (its index into *token); 16 lanes (lane v % 16), each keeping its
 * first maximum, then the lanes' largest, the lowest index among equals */
static float first_max(const float *x, int64_t V, int64_t *token) {
    float m[16];
    int32_t at[16];
    int64_t v = 0;
    for (int l = 0; l < 16; l++) {
        m[l] = x[0];
        at[l] = 0;
    }
#ifdef __AVX512F__
    __m512 mv = _mm512_set1_ps(x[0]);
    __m512i av = _mm512_setzero_si512();
    __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; v + 16 <= V; v += 16) {
        const __m512 xv = _mm512_loadu_ps(x + v);
        const __mmask16 more = _mm512_cmp_ps_mask(xv, mv, _CMP_GT_OQ);
        mv = _mm512_mask_mov_ps(mv, more, xv);
        av = _mm512_mask_mov_epi32(av, more, iv);
        iv = _mm512_add_epi32(iv, _mm512_set1_epi32(16));
    }
    _mm512_storeu_ps(m, mv);
    _mm512_storeu_si512(at, av);
#endif
    for (; v < V; v++)
        if (x[v] > m[v % 16]) {
            m[v % 16] = x[v];
            at[v % 16] = (int32_t)v;
        }
    float best = m[0];
    int64_t first = at[0];
    for (int l = 1; l < 16; l++)
        if (m[l] > best || (m[l] == best && at[l] < first)) {
            best = m[l];
            first = at[l];
        }
    *token = first;
    return best;
}

int markov_draft(const float *head, int64_t B, int64_t S, int64_t V, const float *m_in, const float *m_out_t,
                 int64_t r, const int64_t *prev, const int64_t *wanted, float min_reach, int64_t *drafted,
                 float *confidence, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && B > 1)
    {
        float *logits = malloc(sizeof(float) * (size_t)V);
        if (logits == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t j = 0; j < S; j++) {
                drafted[b * S + j] = -1;
                confidence[b * S + j] = 0.0f;
            }
            if (logits == NULL) continue;
            int64_t p = prev[b];
            float reach = 1.0f;
            for (int64_t j = 0; j < S && j < wanted[b]; j++) {
                const float *h = head + (b * S + j) * V;
                memcpy(logits, h, sizeof(float) * (size_t)V);
                if (r > 0) add_bias(logits, m_in + p * r, m_out_t, r, V);
                int64_t token;
                const float best = first_max(logits, V, &token);
                const float sum = exp_sum(logits, V, best);
                const float conf = 1.0f / sum;
                drafted[b * S + j] = token;
                confidence[b * S + j] = conf;
                reach *= conf;
                p = token;
                if (min_reach > 0.0f && reach < min_reach * (1.0f - 1e-3f)) break;
            }
        }
        free(logits);
    }
    return failed ? -1 : 0;
}
