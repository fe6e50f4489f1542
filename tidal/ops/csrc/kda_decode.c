/* One KDA decode token per (sequence, head), state updated in place: the C form of
 * tidal.ops.kda.kda_decode_step_ for float32 states on the CPU.
 *
 * Each (sequence, head) state is stepped by delta_rule.h (D = diag(exp(g))): one pass over memory
 * where the torch form makes three, and (sequence, head) pairs run in parallel. Each pair is
 * computed by one thread in a fixed order, so results do not depend on the batch or thread count.
 *
 * state: the first sequence's [H, K, V] block; sequence b's block starts seq_stride floats later
 * (states may sit in blocks of the engine's pool). q, k, g [B, H, K], v [B, H, V], beta [B, H],
 * o [B, H, V]: contiguous.
 */
#include <math.h>
#include <stdint.h>

#include "delta_rule.h"

void kda_decode_step_f32(float *state, int64_t seq_stride, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, float *o, int64_t B, int64_t H, int64_t K,
                         int64_t V, int num_threads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            float *S = state + b * seq_stride + h * K * V;
            const int64_t x = b * H + h;
            const float *qq = q + x * K, *kk = k + x * K, *gg = g + x * K, *vv = v + x * V;
            float *oo = o + x * V;
            float decay[K], r[V];
            float kq = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                decay[i] = expf(gg[i]);
                kq += kk[i] * qq[i];
            }
            delta_rule_step(S, qq, kk, vv, decay, beta[x], kq, r, oo, K, V);
        }
    }
}
