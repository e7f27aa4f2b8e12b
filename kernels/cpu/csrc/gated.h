/*
 * The gated activations of an MLP, act(gate) * up, as one inline function a vector (and
 * its scalar twin for builds without one), shared by fused_ops_cpu.c (over a whole
 * [gate | up] product) and gemm_cpu.c (in the epilogue of a gate/up product), so that
 * the two give the same bits.
 *
 * act(x) = x sigmoid(z): SiLU's z = x; GELU-tanh's z = 2 y, y = sqrt(2/pi) (x + 0.044715
 * x^3), since 0.5 x (1 + tanh(y)) = x sigmoid(2 y).
 */
#ifndef PAGEDSERVE_GATED_H
#define PAGEDSERVE_GATED_H

#include <math.h>

#include "simd.h"

#define GELU_2B 1.5957691216057308f /* 2 sqrt(2/pi) */
#define GELU_KAPPA 0.044715f

#if SIMD_VW
/* act(x) * u, lane by lane (``gelu``: GELU-tanh, else SiLU). */
static inline __attribute__((always_inline)) vf gated_vec(vf x, vf u, int gelu) {
    const vf one = vf_set1(1.0f), kappa = vf_set1(GELU_KAPPA), minus_2b = vf_set1(-GELU_2B);
    const vf minus_z = gelu ? vf_mul(minus_2b, vf_fmadd(vf_mul(kappa, vf_mul(x, x)), x, x))
                            : vf_sub(vf_zero(), x);
    /* exp(-z) capped below overflow, so that 1 + e stays finite for the reciprocal
     * (act(x) is then x / 1.6e38, i.e. zero, for z < -88). */
    const vf e = vf_exp(vf_min(minus_z, vf_set1(88.0f)));
    /* x / d by a reciprocal estimate refined with one Newton step (a division costs
     * several times more; the result is within a few ulps). */
    const vf act = vf_mul(x, vf_rcp(vf_add(one, e)));
    return vf_mul(act, u);
}

/* out[i] = act(g[i]) * u[i] for i < n, a vector at a time (the last one masked). */
static inline __attribute__((always_inline)) void gated_run(const float *g, const float *u,
                                                            float *out, int n, int gelu) {
    for (int i = 0; i < n; i += SIMD_VW) {
        const int left = n - i;
        vf_store_first(out + i, left,
                       gated_vec(vf_load_first(g + i, left), vf_load_first(u + i, left), gelu));
    }
}
#else
static inline void gated_run(const float *g, const float *u, float *out, int n, int gelu) {
    for (int i = 0; i < n; ++i) {
        const float x = g[i];
        const float minus_z = gelu ? fminf(-GELU_2B * (GELU_KAPPA * (x * x) * x + x), 88.0f)
                                   : -x;
        out[i] = x / (1.0f + expf(minus_z)) * u[i];
    }
}
#endif

#endif
