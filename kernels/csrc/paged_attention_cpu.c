/*
 * Paged decode attention for the CPU: one query token per request attends to its
 * whole context, reading K/V in place through the request's block table (no gather
 * copy, no padding to the longest context). Built at first use by
 * kernels/cpu_native.py and called through ctypes.
 *
 * Layouts (all contiguous):
 *   query, out    [num_seqs, num_heads, head_dim]                  float32
 *                 (query rows may be ``q_stride`` floats apart, e.g. a fused QKV row)
 *   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim] float32 | bf16 | f16
 *   block_tables  [num_seqs, max_blocks_per_seq]                   int32
 *   seq_lens      [num_seqs]                                       int32
 *
 * A work item is one request and a run of its KV heads (all of them when there are
 * enough requests to keep every thread busy): the slot rows of a block are then read
 * as one contiguous stream, and every K and V element is read from memory exactly
 * once per step and layer. The G = num_heads / num_kv_heads query heads sharing a KV
 * head are computed together. Scores are kept for the whole context (two passes: q.K,
 * then softmax-weighted V), all in float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

#define MAX_HEAD_DIM 512

/* One work item: request ``seq``, KV heads ``h0 .. h0 + nh - 1``. */
typedef struct {
    const float *query; /* [nh * group, head_dim], the item's first query head */
    float *out;         /* same shape */
    const int32_t *table;
    int seq_len, h0, nh;
} item_t;

typedef struct {
    const void *k_cache, *v_cache;
    int num_kv_heads, group, head_dim, block_size;
    float scale;
} shape_t;

/* ------------------------------------------------------------------------- */
/* Portable path (any head_dim, any x86/ARM compiler).                        */
/* ------------------------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

/* Element offset ``idx`` of a cache as ``n`` float32 values: a pointer into the cache
 * itself for float32, else a conversion into ``tmp``. */
static inline const float *load_row(const void *cache, int dtype, int64_t idx, int n,
                                    float *tmp) {
    if (dtype == DTYPE_F32) return (const float *)cache + idx;
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)cache + idx;
#pragma omp simd
        for (int d = 0; d < n; ++d) tmp[d] = bf16_to_f32(src[d]);
        return tmp;
    }
#ifdef __FLT16_MAX__
    const _Float16 *src = (const _Float16 *)cache + idx;
#pragma omp simd
    for (int d = 0; d < n; ++d) tmp[d] = (float)src[d];
#endif
    return tmp;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

static void softmax(float *s, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; ++i) s[i] *= inv;
}

/* Element offset of context row ``t``'s first KV head of the item, through the table. */
static inline int64_t slot_row(const item_t *it, const shape_t *sh, int t) {
    const int64_t slot = (int64_t)it->table[t / sh->block_size] * sh->block_size +
                         t % sh->block_size;
    return (slot * sh->num_kv_heads + it->h0) * sh->head_dim;
}

static void attend_portable(const item_t *it, const shape_t *sh, int dtype, float *scores,
                            float *acc, float *tmp) {
    const int D = sh->head_dim, G = sh->group, L = it->seq_len, nq = it->nh * G;
    for (int t = 0; t < L; ++t) {
        const int64_t row = slot_row(it, sh, t);
        for (int hh = 0; hh < it->nh; ++hh) {
            const float *k = load_row(sh->k_cache, dtype, row + (int64_t)hh * D, D, tmp);
            for (int g = 0; g < G; ++g) {
                const int qh = hh * G + g;
                scores[(int64_t)qh * L + t] = dot(it->query + (int64_t)qh * D, k, D) * sh->scale;
            }
        }
    }
    for (int qh = 0; qh < nq; ++qh) softmax(scores + (int64_t)qh * L, L);
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    for (int t = 0; t < L; ++t) {
        const int64_t row = slot_row(it, sh, t);
        for (int hh = 0; hh < it->nh; ++hh) {
            const float *v = load_row(sh->v_cache, dtype, row + (int64_t)hh * D, D, tmp);
            for (int g = 0; g < G; ++g) {
                const int qh = hh * G + g;
                const float p = scores[(int64_t)qh * L + t];
                float *a = acc + (int64_t)qh * D;
#pragma omp simd
                for (int d = 0; d < D; ++d) a[d] += p * v[d];
            }
        }
    }
    memcpy(it->out, acc, sizeof(float) * (size_t)nq * D);
}

/* ------------------------------------------------------------------------- */
/* AVX-512 path (head_dim a multiple of 16, up to 256).                       */
/* ------------------------------------------------------------------------- */
#if defined(__AVX512F__)
#include "simd_math.h"

#define MAX_NV 16

static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t idx,
                                                           const int dtype) {
    if (dtype == DTYPE_F32) return _mm512_loadu_ps((const float *)base + idx);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
    if (dtype == DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Prefetch ``bytes`` starting at ``p`` into L1 (one instruction per cache line). */
static inline void prefetch_bytes(const char *p, int bytes) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

static void softmax512(float *s, int n) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
    float m = _mm512_reduce_max_ps(mv);
    for (; i < n; ++i) m = s[i] > m ? s[i] : m;
    const __m512 mm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mm));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mm));
        _mm512_mask_storeu_ps(s + i, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (i = 0; i + 16 <= n; i += 16)
        _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
    if (i < n) {
        const __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv));
    }
}

/* ``nv`` (head_dim / 16) and ``dtype`` are compile-time constants in each caller. */
static inline __attribute__((always_inline)) void attend512(const item_t *it,
                                                            const shape_t *sh,
                                                            const int dtype, const int nv,
                                                            float *scores, float *acc) {
    const int D = 16 * nv, G = sh->group, L = it->seq_len, nq = it->nh * G;
    const int bs = sh->block_size, nblocks = (L + bs - 1) / bs;
    const int elem = dtype == DTYPE_F32 ? 4 : 2, row_bytes = it->nh * D * elem;
    /* Blocks are scattered, so the hardware prefetcher stalls at every block edge: while
     * reading row ``off`` of block b, fetch row ``off`` of block b + 1 (in pass 1 the
     * last block fetches the first V block instead). */
    int t = 0;
    for (int b = 0; t < L; ++b) {
        const int64_t base = (int64_t)it->table[b] * bs;
        const int n = L - t < bs ? L - t : bs;
        const char *next = b + 1 < nblocks
            ? (const char *)sh->k_cache + (int64_t)it->table[b + 1] * bs * sh->num_kv_heads * D * elem
            : (const char *)sh->v_cache + (int64_t)it->table[0] * bs * sh->num_kv_heads * D * elem;
        for (int off = 0; off < n; ++off, ++t) {
            const int64_t row = ((base + off) * sh->num_kv_heads + it->h0) * D;
            prefetch_bytes(next + ((int64_t)off * sh->num_kv_heads + it->h0) * D * elem, row_bytes);
            for (int hh = 0; hh < it->nh; ++hh) {
                __m512 k[MAX_NV];
                for (int j = 0; j < nv; ++j) k[j] = load16(sh->k_cache, row + hh * D + 16 * j, dtype);
                for (int g = 0; g < G; ++g) {
                    const int qh = hh * G + g;
                    const float *q = it->query + (int64_t)qh * D;
                    __m512 d = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
                    for (int j = 1; j < nv; ++j) d = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * j), k[j], d);
                    scores[(int64_t)qh * L + t] = _mm512_reduce_add_ps(d) * sh->scale;
                }
            }
        }
    }
    for (int qh = 0; qh < nq; ++qh) softmax512(scores + (int64_t)qh * L, L);
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    t = 0;
    for (int b = 0; t < L; ++b) {
        const int64_t base = (int64_t)it->table[b] * bs;
        const int n = L - t < bs ? L - t : bs;
        const char *next = b + 1 < nblocks
            ? (const char *)sh->v_cache + (int64_t)it->table[b + 1] * bs * sh->num_kv_heads * D * elem
            : NULL;
        for (int off = 0; off < n; ++off, ++t) {
            const int64_t row = ((base + off) * sh->num_kv_heads + it->h0) * D;
            if (next != NULL)
                prefetch_bytes(next + ((int64_t)off * sh->num_kv_heads + it->h0) * D * elem, row_bytes);
            for (int hh = 0; hh < it->nh; ++hh) {
                __m512 v[MAX_NV];
                for (int j = 0; j < nv; ++j) v[j] = load16(sh->v_cache, row + hh * D + 16 * j, dtype);
                for (int g = 0; g < G; ++g) {
                    const int qh = hh * G + g;
                    const __m512 p = _mm512_set1_ps(scores[(int64_t)qh * L + t]);
                    float *a = acc + (int64_t)qh * D;
                    for (int j = 0; j < nv; ++j)
                        _mm512_storeu_ps(a + 16 * j, _mm512_fmadd_ps(p, v[j], _mm512_loadu_ps(a + 16 * j)));
                }
            }
        }
    }
    memcpy(it->out, acc, sizeof(float) * (size_t)nq * D);
}

/* Specialised for head_dim 64 and 128, where the loops over 16-float vectors unroll. */
#define ATTEND512_FOR(name, code)                                                     \
    static void name(const item_t *it, const shape_t *sh, float *s, float *a) {       \
        if (sh->head_dim == 64)                                                        \
            attend512(it, sh, code, 4, s, a);                                          \
        else if (sh->head_dim == 128)                                                  \
            attend512(it, sh, code, 8, s, a);                                          \
        else                                                                           \
            attend512(it, sh, code, sh->head_dim / 16, s, a);                          \
    }
ATTEND512_FOR(attend512_f32, DTYPE_F32)
ATTEND512_FOR(attend512_bf16, DTYPE_BF16)
ATTEND512_FOR(attend512_f16, DTYPE_F16)
#endif

/* ------------------------------------------------------------------------- */

/* Returns 0 on success, a negative code on bad arguments or allocation failure. */
int paged_decode_attention(const float *query, const void *k_cache, const void *v_cache,
                           int dtype, const int32_t *block_tables, const int32_t *seq_lens,
                           int64_t q_stride, float *out, int num_seqs, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, int num_blocks,
                           int max_blocks_per_seq, int max_seq_len, float scale,
                           int num_threads) {
    if (num_seqs <= 0) return 0;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM) return -2;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16 && dtype != DTYPE_F16) return -3;
#ifndef __FLT16_MAX__
    if (dtype == DTYPE_F16) return -3;
#endif
    if (num_threads < 1) num_threads = 1;
    const shape_t sh = {k_cache, v_cache, num_kv_heads, num_heads / num_kv_heads, head_dim,
                        block_size, scale};
    /* Whole requests per item when there are enough of them; else one KV head each. */
    const int per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
    const int splits = num_kv_heads / per_item;
    const int64_t items = (int64_t)num_seqs * splits;
    if (items < num_threads) num_threads = (int)items;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const size_t nq = (size_t)per_item * sh.group;
        float *scores = malloc(sizeof(float) * (nq * (size_t)max_seq_len + 16));
        float *acc = malloc(sizeof(float) * nq * (size_t)head_dim);
        float tmp[MAX_HEAD_DIM];
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            status = -4;
        }
#pragma omp barrier
        if (status != -4) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; ++i) {
                const int s = (int)(i / splits);
                const int h0 = (int)(i % splits) * per_item;
                const int len = seq_lens[s];
                const int32_t *table = block_tables + (int64_t)s * max_blocks_per_seq;
                const int nb = len > 0 ? (len + block_size - 1) / block_size : 0;
                int bad = len <= 0 || len > max_seq_len || nb > max_blocks_per_seq;
                for (int b = 0; !bad && b < nb; ++b) bad = table[b] < 0 || table[b] >= num_blocks;
                if (bad) {
#pragma omp atomic write
                    status = -5;
                    continue;
                }
                const int64_t head_off = (int64_t)h0 * sh.group * head_dim;
                const item_t it = {query + (int64_t)s * q_stride + head_off,
                                   out + (int64_t)s * num_heads * head_dim + head_off, table,
                                   len, h0, per_item};
#if defined(__AVX512F__)
                if (head_dim % 16 == 0 && head_dim <= 16 * MAX_NV) {
                    if (dtype == DTYPE_F32)
                        attend512_f32(&it, &sh, scores, acc);
                    else if (dtype == DTYPE_BF16)
                        attend512_bf16(&it, &sh, scores, acc);
                    else
                        attend512_f16(&it, &sh, scores, acc);
                    continue;
                }
#endif
                attend_portable(&it, &sh, dtype, scores, acc, tmp);
            }
        }
        free(scores);
        free(acc);
    }
    return status;
}
