/*
 * Paged decode attention for the CPU: one query token per request attends to its
 * whole context, reading K/V in place through the request's block table (no gather
 * copy). Built at first use by kernels/cpu_native.py and called through ctypes.
 *
 * Layouts (all contiguous):
 *   query, out    [num_seqs, num_heads, head_dim]                 float32
 *   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim] float32 | bf16 | f16
 *   block_tables  [num_seqs, max_blocks_per_seq]                  int32
 *   seq_lens      [num_seqs]                                      int32
 *
 * One work item is (request, KV head): the G = num_heads / num_kv_heads query heads
 * sharing that KV head are computed together, so every K and V row is read from
 * memory exactly once per step and layer. Scores are kept for the whole context
 * (two passes: q.K then softmax-weighted V), accumulating in float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

#define MAX_HEAD_DIM 512

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

/* Row ``row`` of a cache viewed as [rows, head_dim] in float32: a pointer into the
 * cache itself for float32, else a conversion into ``tmp``. */
static inline const float *load_row(const void *cache, int dtype, int64_t row,
                                    int head_dim, float *tmp) {
    if (dtype == DTYPE_F32) return (const float *)cache + row * head_dim;
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)cache + row * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; ++d) tmp[d] = bf16_to_f32(src[d]);
        return tmp;
    }
#ifdef __FLT16_MAX__
    const _Float16 *src = (const _Float16 *)cache + row * head_dim;
#pragma omp simd
    for (int d = 0; d < head_dim; ++d) tmp[d] = (float)src[d];
#endif
    return tmp;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

static void attend_one(const float *restrict query, const void *k_cache,
                       const void *v_cache, int dtype, const int32_t *table, int seq_len,
                       int kv_head, int num_kv_heads, int group, int head_dim,
                       int block_size, float scale, float *restrict out,
                       float *restrict scores, float *restrict acc, float *restrict tmp) {
    /* query/out point at the group's first query head: [group, head_dim]. */
    const int64_t heads_stride = (int64_t)num_kv_heads;
    int t = 0;
    for (int b = 0; t < seq_len; ++b) {
        const int64_t base = (int64_t)table[b] * block_size;
        const int n = seq_len - t < block_size ? seq_len - t : block_size;
        for (int off = 0; off < n; ++off, ++t) {
            const float *k = load_row(k_cache, dtype, (base + off) * heads_stride + kv_head,
                                      head_dim, tmp);
            for (int g = 0; g < group; ++g)
                scores[(int64_t)g * seq_len + t] = dot(query + g * head_dim, k, head_dim) * scale;
        }
    }
    for (int g = 0; g < group; ++g) {
        float *s = scores + (int64_t)g * seq_len;
        float m = -INFINITY;
        for (int i = 0; i < seq_len; ++i) m = s[i] > m ? s[i] : m;
        float sum = 0.0f;
        for (int i = 0; i < seq_len; ++i) {
            s[i] = expf(s[i] - m);
            sum += s[i];
        }
        const float inv = 1.0f / sum;
        for (int i = 0; i < seq_len; ++i) s[i] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)group * head_dim);
    t = 0;
    for (int b = 0; t < seq_len; ++b) {
        const int64_t base = (int64_t)table[b] * block_size;
        const int n = seq_len - t < block_size ? seq_len - t : block_size;
        for (int off = 0; off < n; ++off, ++t) {
            const float *v = load_row(v_cache, dtype, (base + off) * heads_stride + kv_head,
                                      head_dim, tmp);
            for (int g = 0; g < group; ++g) {
                const float p = scores[(int64_t)g * seq_len + t];
                float *a = acc + g * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; ++d) a[d] += p * v[d];
            }
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)group * head_dim);
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define MAX_NV 16 /* head_dim <= 256 */

/* exp(x) for x <= 0 (Cephes' polynomial after n*ln2 range reduction; ~1 ulp). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t idx,
                                                           const int dtype) {
    if (dtype == DTYPE_F32) return _mm512_loadu_ps((const float *)base + idx);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
    if (dtype == DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Softmax in place over s[0..n), vectorized; returns nothing, s sums to 1. */
static void softmax512(float *s, int n) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
    float m = _mm512_reduce_max_ps(mv);
    for (; i < n; ++i) m = s[i] > m ? s[i] : m;
    const __m512 mm = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mm));
        _mm512_storeu_ps(s + i, e);
        sv = _mm512_add_ps(sv, e);
    }
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mm));
        _mm512_mask_storeu_ps(s + i, k, e);
        sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sv));
    for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv));
    }
}

/* attend_one for head_dim % 16 == 0 and group <= MAX_GROUP, with AVX-512. */
static inline __attribute__((always_inline)) void attend_one_512(
    const float *restrict query, const void *k_cache, const void *v_cache, const int dtype,
    const int32_t *table, int seq_len, int kv_head, int num_kv_heads, int group,
    const int nv, int block_size, float scale, float *restrict out, float *restrict scores,
    float *restrict acc) {
    const int head_dim = 16 * nv;
    int t = 0;
    for (int b = 0; t < seq_len; ++b) {
        const int64_t base = (int64_t)table[b] * block_size;
        const int n = seq_len - t < block_size ? seq_len - t : block_size;
        for (int off = 0; off < n; ++off, ++t) {
            const int64_t row = ((base + off) * num_kv_heads + kv_head) * head_dim;
            __m512 k[MAX_NV];
            for (int j = 0; j < nv; ++j) k[j] = load16(k_cache, row + 16 * j, dtype);
            for (int g = 0; g < group; ++g) {
                const float *qg = query + g * head_dim;
                __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
                for (int j = 1; j < nv; ++j)
                    dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), k[j], dot);
                scores[(int64_t)g * seq_len + t] = _mm512_reduce_add_ps(dot) * scale;
            }
        }
    }
    for (int g = 0; g < group; ++g) softmax512(scores + (int64_t)g * seq_len, seq_len);
    memset(acc, 0, sizeof(float) * (size_t)group * head_dim);
    t = 0;
    for (int b = 0; t < seq_len; ++b) {
        const int64_t base = (int64_t)table[b] * block_size;
        const int n = seq_len - t < block_size ? seq_len - t : block_size;
        for (int off = 0; off < n; ++off, ++t) {
            const int64_t row = ((base + off) * num_kv_heads + kv_head) * head_dim;
            __m512 v[MAX_NV];
            for (int j = 0; j < nv; ++j) v[j] = load16(v_cache, row + 16 * j, dtype);
            for (int g = 0; g < group; ++g) {
                float *a = acc + g * head_dim;
                const __m512 p = _mm512_set1_ps(scores[(int64_t)g * seq_len + t]);
                for (int j = 0; j < nv; ++j)
                    _mm512_storeu_ps(a + 16 * j, _mm512_fmadd_ps(p, v[j], _mm512_loadu_ps(a + 16 * j)));
            }
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)group * head_dim);
}

/* Specialised for head_dim 64 and 128 (the loops over 16-float vectors unroll). */
#define ATTEND_512(name, code)                                                               \
    static void name(const float *q, const void *kc, const void *vc, const int32_t *tb,     \
                     int len, int h, int hkv, int g, int d, int bs, float sc, float *o,       \
                     float *s, float *a) {                                                   \
        if (d == 64)                                                                         \
            attend_one_512(q, kc, vc, code, tb, len, h, hkv, g, 4, bs, sc, o, s, a);         \
        else if (d == 128)                                                                   \
            attend_one_512(q, kc, vc, code, tb, len, h, hkv, g, 8, bs, sc, o, s, a);         \
        else                                                                                 \
            attend_one_512(q, kc, vc, code, tb, len, h, hkv, g, d / 16, bs, sc, o, s, a);    \
    }
ATTEND_512(attend_512_f32, DTYPE_F32)
ATTEND_512(attend_512_bf16, DTYPE_BF16)
ATTEND_512(attend_512_f16, DTYPE_F16)
#endif

/* Returns 0 on success, a negative code on bad arguments or allocation failure. */
int paged_decode_attention(const float *query, const void *k_cache, const void *v_cache,
                           int dtype, const int32_t *block_tables, const int32_t *seq_lens,
                           float *out, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int num_blocks,
                           int max_blocks_per_seq, int max_seq_len, float scale,
                           int num_threads) {
    if (num_seqs <= 0) return 0;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM) return -2;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16 && dtype != DTYPE_F16) return -3;
#ifndef __FLT16_MAX__
    if (dtype == DTYPE_F16) return -3;
#endif
    const int group = num_heads / num_kv_heads;
    const int64_t items = (int64_t)num_seqs * num_kv_heads;
    int status = 0;
    if (num_threads < 1) num_threads = 1;
    if (items < num_threads) num_threads = (int)items;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * ((size_t)group * max_seq_len + 16));
        float *acc = malloc(sizeof(float) * (size_t)group * head_dim);
        float tmp[MAX_HEAD_DIM];
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            status = -4;
        }
#pragma omp barrier
        if (status == 0) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; ++item) {
                const int s = (int)(item / num_kv_heads);
                const int h = (int)(item % num_kv_heads);
                const int len = seq_lens[s];
                const int32_t *table = block_tables + (int64_t)s * max_blocks_per_seq;
                int bad = len <= 0 || len > max_seq_len ||
                          (len + block_size - 1) / block_size > max_blocks_per_seq;
                for (int b = 0; !bad && b < (len + block_size - 1) / block_size; ++b)
                    bad = table[b] < 0 || table[b] >= num_blocks;
                if (bad) {
#pragma omp atomic write
                    status = -5;
                    continue;
                }
                const int64_t q_off = ((int64_t)s * num_heads + (int64_t)h * group) * head_dim;
#if defined(__AVX512F__)
                if (head_dim % 16 == 0 && head_dim <= 16 * MAX_NV) {
                    void (*fn)(const float *, const void *, const void *, const int32_t *, int,
                               int, int, int, int, int, float, float *, float *, float *) =
                        dtype == DTYPE_F32    ? attend_512_f32
                        : dtype == DTYPE_BF16 ? attend_512_bf16
                                              : attend_512_f16;
                    fn(query + q_off, k_cache, v_cache, table, len, h, num_kv_heads, group,
                       head_dim, block_size, scale, out + q_off, scores, acc);
                    continue;
                }
#endif
                attend_one(query + q_off, k_cache, v_cache, dtype, table, len, h,
                           num_kv_heads, group, head_dim, block_size, scale, out + q_off,
                           scores, acc, tmp);
            }
        }
        free(scores);
        free(acc);
    }
    return status;
}
