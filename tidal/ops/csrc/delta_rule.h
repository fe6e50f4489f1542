/* One delta-rule token on one head's float32 state S [K, V], in place (kda_decode.c and
 * kda_layer_decode.c): with D = diag(decay),
 *   r = beta (v - (D S)^T k);   o = (D S)^T q + r (k . q);   S <- D S + k r^T.
 * Both reads of D S come from one pass over S; the update is a second pass while S is in cache.
 * kq = k . q; r [V] and o [V] are written (r is scratch). A fixed order: the bits depend only on
 * the inputs. */
#include <stdint.h>

static inline void delta_rule_step(float *S, const float *q, const float *k, const float *v, const float *decay,
                                   float beta, float kq, float *r, float *o, int64_t K, int64_t V) {
    for (int64_t j = 0; j < V; j++) r[j] = o[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        const float a = k[i] * decay[i], c = q[i] * decay[i];
        const float *row = S + i * V;
        for (int64_t j = 0; j < V; j++) {
            r[j] += a * row[j];
            o[j] += c * row[j];
        }
    }
    for (int64_t j = 0; j < V; j++) {
        const float rj = (v[j] - r[j]) * beta;
        r[j] = rj;
        o[j] += rj * kq;
    }
    for (int64_t i = 0; i < K; i++) {
        float *row = S + i * V;
        const float d = decay[i], ki = k[i];
        for (int64_t j = 0; j < V; j++) row[j] = row[j] * d + ki * r[j];
    }
}
