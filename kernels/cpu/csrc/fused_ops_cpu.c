/*
 * Fused element-wise ops of a decoder layer for the CPU, float32 and bfloat16, and
 * the row-wise argmax of greedy sampling: each replaces
 * several torch ops (and their thread wake-ups) with one pass over the rows. Small
 * calls run on the calling thread; large ones (prefill) split rows across threads.
 *
 * Rounding follows the torch expressions they replace, operation by operation, except
 * where noted: the sum of squares in RMSNorm and exp in SiLU are accumulated or
 * approximated in another order (differences in the last bit).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "convert.h"
#include "gated.h"
#include "simd.h"

#define PARALLEL_MIN_ELEMS (1 << 18)

/* The vector path this build runs (simd.h): "avx512", "avx2" or "portable". */
const char *simd_isa(void) { return SIMD_NAME; }

static inline int threads_for(int64_t elems, int num_threads) {
    return elems >= PARALLEL_MIN_ELEMS && num_threads > 1 ? num_threads : 1;
}

/* bfloat16 values are widened to float32, every torch op of an expression is computed
 * in float32 and rounded back to bfloat16 (round to nearest even, as torch) where torch
 * rounds, so results match the bfloat16 torch expressions up to the last bit of the
 * float32 steps noted above. */

/* bfloat16 ``f32_bf16(x)`` widened back: the float32 value torch holds after rounding. */
static inline float round_bf16(float x) { return bf16_f32(f32_bf16(x)); }

/* Element access shared by the float32 and bfloat16 versions of an op: ``bf16`` is a
 * compile-time constant wherever these are inlined. ``rnd`` is the float32 value torch
 * holds after storing an intermediate result in the tensor's dtype. */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void st(void *p, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline __attribute__((always_inline)) float rnd(float v, const int bf16) {
    return bf16 ? round_bf16(v) : v;
}

/* Row r: residual += delta (if delta is given), then out = weight * rmsnorm(residual).
 * Same as torch: h = residual + delta; out = w * (h * rsqrt(mean(h * h) + eps)), with
 * h and h * rsqrt(...) rounded to the dtype. */
static inline __attribute__((always_inline)) void add_rms_norm_row(
        void *residual, const void *delta, const void *weight, float eps, void *out, int r,
        int dim, int64_t out_stride, const int bf16) {
    const int64_t h = (int64_t)r * dim, o = (int64_t)r * out_stride;
    if (delta != 0) {
#pragma omp simd
        for (int i = 0; i < dim; ++i)
            st(residual, h + i, ld(residual, h + i, bf16) + ld(delta, h + i, bf16), bf16);
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < dim; ++i) ss += ld(residual, h + i, bf16) * ld(residual, h + i, bf16);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; ++i)
        st(out, o + i, ld(weight, i, bf16) * rnd(ld(residual, h + i, bf16) * inv, bf16), bf16);
}

void add_rms_norm_f32(float *residual, const float *delta, const float *weight, float eps,
                      float *out, int rows, int dim, int64_t out_stride, int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * dim, num_threads))
    for (int r = 0; r < rows; ++r)
        add_rms_norm_row(residual, delta, weight, eps, out, r, dim, out_stride, 0);
}

void add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                       float eps, uint16_t *out, int rows, int dim, int64_t out_stride,
                       int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * dim, num_threads))
    for (int r = 0; r < rows; ++r)
        add_rms_norm_row(residual, delta, weight, eps, out, r, dim, out_stride, 1);
}

/* Rotate-half RoPE in place on the ``heads`` heads of ``head_dim`` (at most
 * MAX_HEAD_DIM) at the start of row r (the query then key heads of a fused QKV
 * row): x * cos + rotate_half(x) * sin, cos/sin rows [rows, head_dim]. Every product
 * and the sum are rounded to the dtype, as the torch expression does: bit-identical. */
static inline __attribute__((always_inline)) void rope_row(
        void *x, int64_t row_stride, int r, int heads, int head_dim, const void *cos,
        const void *sin, const int bf16) {
    const int half = head_dim / 2;
    const int64_t cs = (int64_t)r * head_dim;
    for (int h = 0; h < heads; ++h) {
        const int64_t v = (int64_t)r * row_stride + (int64_t)h * head_dim;
        float tmp[MAX_HEAD_DIM];
#pragma omp simd
        for (int i = 0; i < half; ++i) {
            const float a = ld(x, v + i, bf16), b = ld(x, v + i + half, bf16);
            const float lo = rnd(a * ld(cos, cs + i, bf16), bf16);
            const float lo_rot = rnd(-b * ld(sin, cs + i, bf16), bf16);
            const float hi = rnd(b * ld(cos, cs + i + half, bf16), bf16);
            const float hi_rot = rnd(a * ld(sin, cs + i + half, bf16), bf16);
            tmp[i] = lo + lo_rot;
            tmp[i + half] = hi + hi_rot;
        }
#pragma omp simd
        for (int i = 0; i < head_dim; ++i) st(x, v + i, tmp[i], bf16);
    }
}

void rope_f32(float *x, int64_t row_stride, int rows, int heads, int head_dim,
              const float *cos, const float *sin, int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * heads * head_dim, num_threads))
    for (int r = 0; r < rows; ++r) rope_row(x, row_stride, r, heads, head_dim, cos, sin, 0);
}

void rope_bf16(uint16_t *x, int64_t row_stride, int rows, int heads, int head_dim,
               const uint16_t *cos, const uint16_t *sin, int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * heads * head_dim, num_threads))
    for (int r = 0; r < rows; ++r) rope_row(x, row_stride, r, heads, head_dim, cos, sin, 1);
}

/* out[r, i] = act(gate_up[r, i]) * gate_up[r, inter + i] for i < inter (gated.h; with
 * ``gelu`` GELU-tanh, else SiLU). */
static inline __attribute__((always_inline)) void gated_mul_f32(const float *gate_up, float *out,
                                                                int rows, int inter, int gelu,
                                                                int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * inter, num_threads))
    for (int r = 0; r < rows; ++r) {
        const float *g = gate_up + (int64_t)r * 2 * inter;
        gated_run(g, g + inter, out + (int64_t)r * inter, inter, gelu);
    }
}

void silu_mul_f32(const float *gate_up, float *out, int rows, int inter, int num_threads) {
    gated_mul_f32(gate_up, out, rows, inter, 0, num_threads);
}

void gelu_tanh_mul_f32(const float *gate_up, float *out, int rows, int inter,
                       int num_threads) {
    gated_mul_f32(gate_up, out, rows, inter, 1, num_threads);
}

/* silu(gate) rounded to bfloat16, times up, rounded again (F.silu(gate) * up). */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter,
                   int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * inter, num_threads))
    for (int r = 0; r < rows; ++r) {
        const uint16_t *g = gate_up + (int64_t)r * 2 * inter;
        const uint16_t *u = g + inter;
        uint16_t *o = out + (int64_t)r * inter;
        int i = 0;
#if SIMD_VW
        const vf one = vf_set1(1.0f);
        float silu[SIMD_VW] __attribute__((aligned(64)));
        for (; i + SIMD_VW <= inter; i += SIMD_VW) {
            const vf x = vf_load_bf16(g + i);
            const vf e = vf_exp(vf_min(vf_sub(vf_zero(), x), vf_set1(88.0f)));
            vf_store_aligned(silu, vf_div(x, vf_add(one, e)));
#pragma omp simd
            for (int j = 0; j < SIMD_VW; ++j)
                o[i + j] = f32_bf16(round_bf16(silu[j]) * bf16_f32(u[i + j]));
        }
#endif
        for (; i < inter; ++i) {
            const float x = bf16_f32(g[i]);
            o[i] = f32_bf16(round_bf16(x / (1.0f + expf(-x))) * bf16_f32(u[i]));
        }
    }
}

/* The first index of the largest value of each row, as torch.argmax: a NaN counts as
 * larger than anything (the first NaN wins); a row of -inf gives 0. */
static int64_t argmax_row(const float *x, int cols) {
    int i = 0;
    int64_t arg = 0;
    float m = -INFINITY;
#if SIMD_VW
    /* Lane l keeps the first largest value among columns l, l + VW, ... and its column
     * (as a float: exact below 2^24 columns). */
    if (cols >= SIMD_VW && cols < (1 << 24)) {
        vf best = vf_set1(-INFINITY), best_idx = vf_zero(), idx;
        {
            float lanes[SIMD_VW];
            for (int l = 0; l < SIMD_VW; ++l) lanes[l] = (float)l;
            idx = vf_load(lanes);
        }
        const vf step = vf_set1((float)SIMD_VW);
        vmask nan = vm_nan(vf_zero());
        for (; i + SIMD_VW <= cols; i += SIMD_VW) {
            const vf v = vf_load(x + i);
            const vmask gt = vm_gt(v, best);
            nan = vm_or(nan, vm_nan(v));
            best = vf_select(gt, v, best);
            best_idx = vf_select(gt, idx, best_idx);
            idx = vf_add(idx, step);
        }
        if (vm_any(nan)) {
            i = 0; /* the scalar loop below finds the first NaN */
        } else {
            float vals[SIMD_VW], cols_of[SIMD_VW];
            vf_store(vals, best);
            vf_store(cols_of, best_idx);
            m = vals[0];
            arg = (int64_t)cols_of[0];
            for (int l = 1; l < SIMD_VW; ++l)
                if (vals[l] > m || (vals[l] == m && (int64_t)cols_of[l] < arg)) {
                    m = vals[l];
                    arg = (int64_t)cols_of[l];
                }
        }
    }
#endif
    /* The columns from i on (all of them without a vector pass): later than any column
     * seen, so only a strictly larger value moves the answer. */
    if (i == 0) {
        m = x[0];
        arg = 0;
        if (m != m) return 0;
        i = 1;
    }
    for (; i < cols; ++i) {
        if (x[i] != x[i]) return i;
        if (x[i] > m) {
            m = x[i];
            arg = i;
        }
    }
    return arg;
}

/* out[r] = argmax of row r (``cols`` floats; rows ``row_stride`` floats apart). */
void argmax_f32(const float *x, int64_t row_stride, int rows, int cols, int64_t *out,
                int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * cols, num_threads))
    for (int r = 0; r < rows; ++r) out[r] = argmax_row(x + (int64_t)r * row_stride, cols);
}
