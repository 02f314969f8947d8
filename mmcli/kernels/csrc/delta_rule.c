/* A decode step of the gated delta rule (kernels/delta_rule.py's step) on the CPU, built by
   kernels/cpu.py: each row's state [heads][dk][dv] updated in place in the cache's row, one head
   at a time, in PyTorch's order (decay, read along k, write the correction, read with q). A head's
   state (64 KiB at 128 x 128) is read from memory once and stays in L2 for the second pass; PyTorch
   gathers the rows' states, makes each step's tensors anew and scatters them back: five passes of
   memory over every state a step. */
#include "vectors.h"

#define MAX_DV 256 /* the values of a head the step holds in registers' arrays */

/* One head: S (dk x dv) <- decay S + k (beta (v - k^T decay S))^T; out = q^T S */
static void step_head(float *S, const float *q, const float *k, const float *v, float decay,
                      float beta, int64_t dk, int64_t dv, float *out) {
    vec read[MAX_DV / GL], delta[MAX_DV / GL];
    const int64_t n = dv / GL;
    const vec e = vset(decay);
    for (int64_t j = 0; j < n; j++) read[j] = vzero();
    for (int64_t i = 0; i < dk; i++) { /* decayed, and read along k */
        float *row = S + i * dv;
        const vec ki = vset(k[i]);
        for (int64_t j = 0; j < n; j++) {
            const vec s = vmul(vload(row + j * GL), e);
            vstore(row + j * GL, s);
            read[j] = vfma(ki, s, read[j]);
        }
    }
    const vec b = vset(beta);
    for (int64_t j = 0; j < n; j++) {
        delta[j] = vmul(vsub(vload(v + j * GL), read[j]), b);
        read[j] = vzero(); /* from here, q^T S */
    }
    for (int64_t i = 0; i < dk; i++) { /* the correction written, and read with q */
        float *row = S + i * dv;
        const vec ki = vset(k[i]), qi = vset(q[i]);
        for (int64_t j = 0; j < n; j++) {
            const vec s = vfma(ki, delta[j], vload(row + j * GL));
            vstore(row + j * GL, s);
            read[j] = vfma(qi, s, read[j]);
        }
    }
    for (int64_t j = 0; j < n; j++) vstore(out + j * GL, read[j]);
}

/* For each of `rows` rows and each head: states row slots[r] advanced by q, k ([rows][heads][dk],
   normalised and scaled), v ([rows][heads][dv]), decay (e^g) and beta ([rows][heads]); out
   [rows][heads][dv]. Nonzero (nothing computed) where dv is not the kernel's. */
int delta_step(const float *q, const float *k, const float *v, const float *decay,
               const float *beta, float *states, const int64_t *slots, float *out, int64_t rows,
               int64_t heads, int64_t dk, int64_t dv, int threads) {
    if (dv % GL || dv > MAX_DV) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < rows * heads; t++) {
        const int64_t r = t / heads, h = t % heads;
        float *S = states + (slots[r] * heads + h) * dk * dv;
        step_head(S, q + t * dk, k + t * dk, v + t * dv, decay[t], beta[t], dk, dv, out + t * dv);
    }
    return 0;
}
