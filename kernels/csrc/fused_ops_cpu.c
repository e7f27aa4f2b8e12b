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

#include "simd_math.h"

#define PARALLEL_MIN_ELEMS (1 << 18)

static inline int threads_for(int64_t elems, int num_threads) {
    return elems >= PARALLEL_MIN_ELEMS && num_threads > 1 ? num_threads : 1;
}

/* bfloat16 values are widened to float32, every torch op of an expression is computed
 * in float32 and rounded back to bfloat16 (round to nearest even, as torch) where torch
 * rounds, so results match the bfloat16 torch expressions up to the last bit of the
 * float32 steps noted above. */

static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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

#define ROPE_MAX_HEAD_DIM 512

/* Rotate-half RoPE in place on the ``heads`` heads of ``head_dim`` (at most
 * ROPE_MAX_HEAD_DIM) at the start of row r (the query then key heads of a fused QKV
 * row): x * cos + rotate_half(x) * sin, cos/sin rows [rows, head_dim]. Every product
 * and the sum are rounded to the dtype, as the torch expression does: bit-identical. */
static inline __attribute__((always_inline)) void rope_row(
        void *x, int64_t row_stride, int r, int heads, int head_dim, const void *cos,
        const void *sin, const int bf16) {
    const int half = head_dim / 2;
    const int64_t cs = (int64_t)r * head_dim;
    for (int h = 0; h < heads; ++h) {
        const int64_t v = (int64_t)r * row_stride + (int64_t)h * head_dim;
        float tmp[ROPE_MAX_HEAD_DIM];
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

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] for i < inter. */
void silu_mul_f32(const float *gate_up, float *out, int rows, int inter, int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * inter, num_threads))
    for (int r = 0; r < rows; ++r) {
        const float *g = gate_up + (int64_t)r * 2 * inter;
        const float *u = g + inter;
        float *o = out + (int64_t)r * inter;
        int i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i < inter; i += 16) {
            const __mmask16 k = tail_mask(inter - i);
            const __m512 x = _mm512_maskz_loadu_ps(k, g + i);
            /* exp(-x) capped below overflow, so that 1 + e stays finite for the
             * reciprocal (silu(x) is then x / 1.6e38, i.e. zero, for x < -88). */
            const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x),
                                                  _mm512_set1_ps(88.0f)));
            /* x / d by a reciprocal estimate refined with one Newton step (a division
             * costs several times more; the result is within an ulp or two). */
            const __m512 d = _mm512_add_ps(one, e);
            __m512 r = _mm512_rcp14_ps(d);
            r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
            const __m512 silu = _mm512_mul_ps(x, r);
            _mm512_mask_storeu_ps(o + i, k, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(k, u + i)));
        }
#endif
        for (; i < inter; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
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
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        float silu[16] __attribute__((aligned(64)));
        for (; i + 16 <= inter; i += 16) {
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i))), 16));
            const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x),
                                                  _mm512_set1_ps(88.0f)));
            _mm512_store_ps(silu, _mm512_div_ps(x, _mm512_add_ps(one, e)));
#pragma omp simd
            for (int j = 0; j < 16; ++j)
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
#if defined(__AVX512F__)
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_idx = _mm512_setzero_si512();
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (; i < cols; i += 16) {
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(cols - i), x + i);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
        idx = _mm512_add_epi32(idx, step);
    }
    if (!nan) {
        const float m = _mm512_reduce_max_ps(best);
        const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
        /* Lanes holding the maximum: the smallest index among them. */
        return _mm512_mask_reduce_min_epi32(at, best_idx);
    }
    i = 0;
#endif
    int64_t arg = 0;
    float m = x[0];
    if (m != m) return 0;
    for (i = 1; i < cols; ++i) {
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
