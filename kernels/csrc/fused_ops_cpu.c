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

/* residual += delta (if delta is given), then out = weight * rmsnorm(residual).
 * Same as torch: h = residual + delta; out = w * (h * rsqrt(mean(h * h) + eps)). */
void add_rms_norm_f32(float *residual, const float *delta, const float *weight, float eps,
                      float *out, int rows, int dim, int64_t out_stride, int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * dim, num_threads))
    for (int r = 0; r < rows; ++r) {
        float *h = residual + (int64_t)r * dim;
        if (delta != 0) {
            const float *dl = delta + (int64_t)r * dim;
#pragma omp simd
            for (int i = 0; i < dim; ++i) h[i] = h[i] + dl[i];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < dim; ++i) ss += h[i] * h[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + (int64_t)r * out_stride;
#pragma omp simd
        for (int i = 0; i < dim; ++i) o[i] = weight[i] * (h[i] * inv);
    }
}

#define ROPE_MAX_HEAD_DIM 512

/* Rotate-half RoPE in place on ``heads`` heads of ``head_dim`` (at most
 * ROPE_MAX_HEAD_DIM) at the start of each row (the query then key heads of a fused QKV
 * row): x * cos + rotate_half(x) * sin, cos/sin rows [rows, head_dim]. Bit-identical
 * to the torch expression. */
void rope_f32(float *x, int64_t row_stride, int rows, int heads, int head_dim,
              const float *cos, const float *sin, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for((int64_t)rows * heads * head_dim, num_threads))
    for (int r = 0; r < rows; ++r) {
        const float *c = cos + (int64_t)r * head_dim;
        const float *s = sin + (int64_t)r * head_dim;
        for (int h = 0; h < heads; ++h) {
            float *v = x + (int64_t)r * row_stride + (int64_t)h * head_dim;
            float tmp[ROPE_MAX_HEAD_DIM];
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                const float lo = a * c[i], lo_rot = -b * s[i];
                const float hi = b * c[i + half], hi_rot = a * s[i + half];
                tmp[i] = lo + lo_rot;
                tmp[i + half] = hi + hi_rot;
            }
#pragma omp simd
            for (int i = 0; i < head_dim; ++i) v[i] = tmp[i];
        }
    }
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

/* ------------------------------------------------------------------------- */
/* bfloat16 versions: values are widened to float32, every torch op of the       */
/* expression is computed in float32 and rounded back to bfloat16 (round to       */
/* nearest even, as torch) where torch rounds, so results match the bfloat16      */
/* torch expressions up to the last bit of the float32 steps noted above.         */
/* ------------------------------------------------------------------------- */

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

void add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                       float eps, uint16_t *out, int rows, int dim, int64_t out_stride,
                       int num_threads) {
#pragma omp parallel for num_threads(threads_for((int64_t)rows * dim, num_threads))
    for (int r = 0; r < rows; ++r) {
        uint16_t *h = residual + (int64_t)r * dim;
        if (delta != 0) {
            const uint16_t *dl = delta + (int64_t)r * dim;
#pragma omp simd
            for (int i = 0; i < dim; ++i) h[i] = f32_bf16(bf16_f32(h[i]) + bf16_f32(dl[i]));
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < dim; ++i) ss += bf16_f32(h[i]) * bf16_f32(h[i]);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        uint16_t *o = out + (int64_t)r * out_stride;
#pragma omp simd
        for (int i = 0; i < dim; ++i)
            o[i] = f32_bf16(bf16_f32(weight[i]) * round_bf16(bf16_f32(h[i]) * inv));
    }
}

/* x * cos + rotate_half(x) * sin with every product and the sum rounded to bfloat16. */
void rope_bf16(uint16_t *x, int64_t row_stride, int rows, int heads, int head_dim,
               const uint16_t *cos, const uint16_t *sin, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for((int64_t)rows * heads * head_dim, num_threads))
    for (int r = 0; r < rows; ++r) {
        const uint16_t *c = cos + (int64_t)r * head_dim;
        const uint16_t *s = sin + (int64_t)r * head_dim;
        for (int h = 0; h < heads; ++h) {
            uint16_t *v = x + (int64_t)r * row_stride + (int64_t)h * head_dim;
            uint16_t tmp[ROPE_MAX_HEAD_DIM];
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a = bf16_f32(v[i]), b = bf16_f32(v[i + half]);
                const float lo = round_bf16(a * bf16_f32(c[i]));
                const float lo_rot = round_bf16(-b * bf16_f32(s[i]));
                const float hi = round_bf16(b * bf16_f32(c[i + half]));
                const float hi_rot = round_bf16(a * bf16_f32(s[i + half]));
                tmp[i] = f32_bf16(lo + lo_rot);
                tmp[i + half] = f32_bf16(hi + hi_rot);
            }
            memcpy(v, tmp, sizeof(uint16_t) * (size_t)head_dim);
        }
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
