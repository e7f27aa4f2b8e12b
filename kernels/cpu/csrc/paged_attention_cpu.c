/*
 * Paged attention for the CPU: each query token attends causally to its request's
 * context, reading K/V in place through the request's block table (no gather copy,
 * no padding to the longest context, no mask). Decode rows (one token per request)
 * and prefill chunks (the last ``q_len`` positions of a context whose K/V are already
 * in the cache) go through the same code. Built at first use by kernels/cpu/native.py
 * and called through ctypes.
 *
 * Layouts (all contiguous):
 *   query, out    [num_tokens, num_heads, head_dim]                float32
 *                 (query rows may be ``q_stride`` floats apart, e.g. a fused QKV row)
 *   query_start_loc [num_seqs + 1] int32: request s owns tokens qsl[s] .. qsl[s+1]-1
 *                 (NULL: one token per request, token s)
 *   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim] float32 | bf16 | f16
 *   block_tables  [num_seqs, max_blocks_per_seq]                   int32
 *   seq_lens      [num_seqs]                                       int32
 *   key, value    [num_rows, num_kv_heads, head_dim] in the cache dtype, this step's
 *                 K/V (rows ``kv_stride`` elements apart), written to cache slots
 *   slots         [num_rows] int64 (-1: not written) before anything is attended
 *
 * A work item is a tile of up to TOKEN_TILE consecutive query tokens of one request
 * and a run of its KV heads (all of them when there are enough tiles to keep every
 * thread busy): the slot rows of a block are then read as one contiguous stream, once
 * per tile (so once per step and layer for a decode), and each run of rows serves
 * every token of the tile from L1. A token sees the first ``pos + 1`` rows of the
 * context, so causality is the row count of each run, never a mask. The G = num_heads
 * / num_kv_heads query heads sharing a KV head are computed together, all in float32.
 * The vector path (AVX-512 or AVX2, one source over simd.h's ``vf``) makes one pass
 * with an online softmax (K and V of each run of rows together); the portable path
 * keeps the scores of the whole context (two passes: q.K, then softmax-weighted V),
 * one token at a time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"

/* Query tokens of one request handled by one work item. */
#define TOKEN_TILE 16

/* One work item: ``ntok`` consecutive tokens of one request, KV heads ``h0 .. h0 + nh -
 * 1``. Token j sees the first ``seq_len + j`` rows of the context. */
typedef struct {
    const float *query; /* token 0's [nh * group, head_dim] query heads; tokens q_stride apart */
    float *out;         /* same shape; tokens out_stride apart */
    const int32_t *table;
    int64_t q_stride, out_stride;
    int seq_len, ntok, h0, nh;
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

static void attend_portable_token(const item_t *it, const shape_t *sh, int dtype,
                                  float *scores, float *acc, float *tmp) {
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

static void attend_portable(const item_t *it, const shape_t *sh, int dtype, float *scores,
                            float *acc, float *tmp) {
    for (int j = 0; j < it->ntok; ++j) {
        item_t one = *it;
        one.query += j * it->q_stride;
        one.out += j * it->out_stride;
        one.seq_len += j;
        one.ntok = 1;
        attend_portable_token(&one, sh, dtype, scores, acc, tmp);
    }
}

/* ------------------------------------------------------------------------- */
/* Vector path (simd.h: AVX-512 or AVX2; head_dim a multiple of VW, up to 256).  */
/* ------------------------------------------------------------------------- */
#include "simd.h"
#if SIMD_VW
#define VW SIMD_VW
#define MAX_NV (256 / VW)

static inline __attribute__((always_inline)) vf load_vec(const void *base, int64_t idx,
                                                         const int dtype) {
    if (dtype == DTYPE_F32) return vf_load((const float *)base + idx);
    if (dtype == DTYPE_BF16) return vf_load_bf16((const uint16_t *)base + idx);
    return vf_load_f16((const uint16_t *)base + idx);
}

/* Prefetch ``bytes`` starting at ``p`` into L2 (one instruction per cache line). Always
 * inlined: as an ordinary function GCC finds it free of side effects and deletes the
 * calls, prefetches and all. */
static inline __attribute__((always_inline)) void prefetch_bytes(const char *p, int bytes) {
    for (int i = 0; i < bytes; i += 64) prefetch_l2(p + i);
}

/* Query heads handled together in one sweep over a run of rows. */
#define GCHUNK 4

/* Vector registers: 32 with AVX-512, 16 with AVX2. */
#define VREGS (VW == 16 ? 32 : 16)
/* Whether ``GN`` heads' V accumulators of ``nv`` vectors each, a V row and the weights
 * fit the register file (both are compile-time constants in every body). */
#define V_IN_REGISTERS(GN, nv) ((GN) * (nv) + (nv) + (GN) <= VREGS)

/* One run of ``m <= VW`` consecutive cache rows starting at row ``first``, for the
 * ``GN`` query heads at ``q`` that share the KV head at element offset ``head``:
 * scores (the VW dot products of a head reduced together by ``vf_sum_lanes``), then
 * the online-softmax update of each head's running maximum ``mx``, denominator ``den``
 * and unnormalised output ``acc`` (rows of ``VW * nv``), with V's rows accumulated in
 * registers. ``next_k``/``next_v`` (or NULL): rows to prefetch, ``next_stride`` apart. */
static inline __attribute__((always_inline)) void attend_run(
        const shape_t *sh, const float *q, const int dtype, const int nv, const int GN,
        int64_t first, int64_t head, int m, float *mx, float *den, float *acc,
        const char *next_k, const char *next_v, int64_t next_stride, int pf_bytes) {
    const int D = VW * nv;
    const int64_t stride = (int64_t)sh->num_kv_heads * D;
    const vmask mask = vm_first(m);
    float p[GCHUNK][VW] __attribute__((aligned(64)));
    float corr[GCHUNK];
    {
        vf part[GCHUNK][VW];
        vf qv[GCHUNK][MAX_NV];
        for (int g = 0; g < GN; ++g)
            for (int j = 0; j < nv; ++j) qv[g][j] = vf_load(q + (int64_t)g * D + VW * j);
        for (int r = 0; r < m; ++r) {
            const int64_t row = (first + r) * stride + head;
            if (next_k != NULL) prefetch_bytes(next_k + r * next_stride, pf_bytes);
            vf k[MAX_NV];
            for (int j = 0; j < nv; ++j) k[j] = load_vec(sh->k_cache, row + VW * j, dtype);
            for (int g = 0; g < GN; ++g) {
                vf d = vf_mul(qv[g][0], k[0]);
                for (int j = 1; j < nv; ++j) d = vf_fmadd(qv[g][j], k[j], d);
                part[g][VF_SUM_SLOT(r)] = d;
            }
        }
        for (int r = m; r < VW; ++r)
            for (int g = 0; g < GN; ++g) part[g][VF_SUM_SLOT(r)] = vf_zero();
        const vf scale = vf_set1(sh->scale);
        for (int g = 0; g < GN; ++g) {
            const vf s = vf_select(mask, vf_mul(vf_sum_lanes(part[g]), scale),
                                   vf_set1(-INFINITY));
            const float run_max = vf_reduce_max(s);
            const float m_new = run_max > mx[g] ? run_max : mx[g];
            const vf e = vf_select(mask, vf_exp(vf_sub(s, vf_set1(m_new))), vf_zero());
            corr[g] = mx[g] == -INFINITY ? 0.0f : expf(mx[g] - m_new);
            den[g] = den[g] * corr[g] + vf_reduce_add(e);
            mx[g] = m_new;
            vf_store_aligned(p[g], e);
        }
    }
    if (V_IN_REGISTERS(GN, nv)) {
        /* Row by row: each V row is loaded once and serves every head's accumulators. */
        vf a[GCHUNK][MAX_NV];
        for (int g = 0; g < GN; ++g) {
            const vf c = vf_set1(corr[g]);
            for (int j = 0; j < nv; ++j)
                a[g][j] = vf_mul(c, vf_load(acc + (int64_t)g * D + VW * j));
        }
        for (int r = 0; r < m; ++r) {
            const int64_t row = (first + r) * stride + head;
            if (next_v != NULL) prefetch_bytes(next_v + r * next_stride, pf_bytes);
            vf v[MAX_NV];
            for (int j = 0; j < nv; ++j) v[j] = load_vec(sh->v_cache, row + VW * j, dtype);
            for (int g = 0; g < GN; ++g) {
                const vf w = vf_set1(p[g][r]);
                for (int j = 0; j < nv; ++j) a[g][j] = vf_fmadd(w, v[j], a[g][j]);
            }
        }
        for (int g = 0; g < GN; ++g)
            for (int j = 0; j < nv; ++j) vf_store(acc + (int64_t)g * D + VW * j, a[g][j]);
        return;
    }
    /* Too many accumulators for the register file (AVX2's 16 registers): one vector of
     * the head dim at a time, over the run's rows (in L1 after the first), so that the
     * accumulators never spill. The same sums in the same order. */
    for (int j = 0; j < nv; ++j) {
        vf a[GCHUNK];
        for (int g = 0; g < GN; ++g)
            a[g] = vf_mul(vf_set1(corr[g]), vf_load(acc + (int64_t)g * D + VW * j));
        for (int r = 0; r < m; ++r) {
            const int64_t row = (first + r) * stride + head;
            if (j == 0 && next_v != NULL) prefetch_bytes(next_v + r * next_stride, pf_bytes);
            const vf v = load_vec(sh->v_cache, row + VW * j, dtype);
            for (int g = 0; g < GN; ++g) a[g] = vf_fmadd(vf_set1(p[g][r]), v, a[g]);
        }
        for (int g = 0; g < GN; ++g) vf_store(acc + (int64_t)g * D + VW * j, a[g]);
    }
}

/* Dispatch on the number of query heads left in a chunk, so that each body has a
 * compile-time head count and its vectors stay in registers. */
#define FOR_GN(gn, CALL)                       \
    switch (gn) {                              \
        case 1: CALL(1); break;                \
        case 2: CALL(2); break;                \
        case 3: CALL(3); break;                \
        default: CALL(GCHUNK); break;          \
    }

/* The item's first KV head in row 0 of cache block ``block``. */
static inline const char *block_rows(const void *cache, const shape_t *sh, const item_t *it,
                                     int64_t block, int D, int elem) {
    return (const char *)cache + (block * sh->block_size * sh->num_kv_heads + it->h0) * D * elem;
}

/* ``nv`` (head_dim / VW) and ``dtype`` are compile-time constants in each caller.
 *
 * One pass over the context in runs of at most VW rows of one block: each run's K
 * rows, then its V rows, so both streams are in flight together and no score buffer is
 * needed. Every token of the tile that sees part of a run takes it (its first rows, up
 * to the token's own position) while the run is in L1. ``state`` holds ``ntok * nq *
 * (head_dim + 2)`` floats. */
static inline __attribute__((always_inline)) void attend_vec(const item_t *it,
                                                             const shape_t *sh,
                                                             const int dtype, const int nv,
                                                             float *state) {
    const int D = VW * nv, G = sh->group, nq = it->nh * G, T = it->ntok;
    const int L0 = it->seq_len, L = L0 + T - 1;
    const int bs = sh->block_size, nblocks = (L + bs - 1) / bs;
    const int elem = dtype == DTYPE_F32 ? 4 : 2;
    const int64_t per_tok = (int64_t)nq * (D + 2);
    for (int j = 0; j < T; ++j) {
        float *acc = state + j * per_tok, *mx = acc + (int64_t)nq * D, *den = mx + nq;
        memset(acc, 0, sizeof(float) * (size_t)nq * D);
        for (int i = 0; i < nq; ++i) {
            mx[i] = -INFINITY;
            den[i] = 0.0f;
        }
    }
    /* Blocks are scattered, so the hardware prefetcher stalls at every block edge: while
     * reading row r of a block, fetch row r of the next one. The first token's sweep of
     * each KV head fetches that head's slice, so that requests to memory go out through
     * all the sweeps over a run, not in one burst: decode attention then overlaps its
     * arithmetic with the stream of K/V rows (30 layers of a 64-request decode step on
     * AVX-512: 41 ms against 54 ms without prefetching). */
    const int64_t row_bytes = (int64_t)sh->num_kv_heads * D * elem;
    const int pf_bytes = D * elem;
    for (int b = 0, t = 0; t < L; ++b) {
        const int64_t block = it->table[b];
        const int n = L - t < bs ? L - t : bs;
        const int last = b + 1 >= nblocks;
        const char *next_k = last ? NULL : block_rows(sh->k_cache, sh, it, it->table[b + 1], D, elem);
        const char *next_v = last ? NULL : block_rows(sh->v_cache, sh, it, it->table[b + 1], D, elem);
        for (int r0 = 0; r0 < n; r0 += VW) {
            const int pos = t + r0; /* the run's first row */
            const int run = n - r0 < VW ? n - r0 : VW;
            const int64_t first = block * bs + r0;
            /* Token j sees rows before L0 + j: the first that sees this run is j0. */
            const int j0 = pos - L0 + 1 > 0 ? pos - L0 + 1 : 0;
            for (int j = j0; j < T; ++j) {
                const int seen = L0 + j - pos;
                const int m = seen < run ? seen : run;
                float *acc = state + j * per_tok, *mx = acc + (int64_t)nq * D, *den = mx + nq;
                const float *q = it->query + j * it->q_stride;
                for (int hh = 0; hh < it->nh; ++hh) {
                    const int64_t head = (int64_t)(it->h0 + hh) * D;
                    for (int g0 = 0; g0 < G; g0 += GCHUNK) {
                        const int qh = hh * G + g0;
                        const int pf = !last && j == j0 && g0 == 0;
                        const int64_t slice = r0 * row_bytes + (int64_t)hh * D * elem;
                        const char *pk = pf ? next_k + slice : NULL;
                        const char *pv = pf ? next_v + slice : NULL;
#define RUN(GN) attend_run(sh, q + (int64_t)qh * D, dtype, nv, GN, first, head, m, mx + qh, \
                           den + qh, acc + (int64_t)qh * D, pk, pv, row_bytes, pf_bytes)
                        FOR_GN(G - g0, RUN)
#undef RUN
                    }
                }
            }
        }
        t += n;
    }
    for (int j = 0; j < T; ++j) {
        const float *acc = state + j * per_tok, *den = acc + (int64_t)nq * D + nq;
        float *out = it->out + j * it->out_stride;
        for (int qh = 0; qh < nq; ++qh) {
            const vf inv = vf_set1(1.0f / den[qh]);
            const float *a = acc + (int64_t)qh * D;
            for (int v = 0; v < nv; ++v)
                vf_store(out + (int64_t)qh * D + VW * v, vf_mul(inv, vf_load(a + VW * v)));
        }
    }
}

/* Specialised for head_dim 64 and 128, where the loops over vectors unroll. */
#define ATTEND_VEC_FOR(name, code)                                                    \
    static void name(const item_t *it, const shape_t *sh, float *state) {             \
        if (sh->head_dim == 64)                                                        \
            attend_vec(it, sh, code, 64 / VW, state);                                  \
        else if (sh->head_dim == 128)                                                  \
            attend_vec(it, sh, code, 128 / VW, state);                                 \
        else                                                                           \
            attend_vec(it, sh, code, sh->head_dim / VW, state);                        \
    }
ATTEND_VEC_FOR(attend_vec_f32, DTYPE_F32)
ATTEND_VEC_FOR(attend_vec_bf16, DTYPE_BF16)
ATTEND_VEC_FOR(attend_vec_f16, DTYPE_F16)
#endif

/* ------------------------------------------------------------------------- */

/* A tile of request ``s``: tokens ``tok0 .. tok0 + ntok - 1``, the first of which sees
 * ``len0`` context rows. */
typedef struct {
    int s, tok0, ntok, len0;
} tile_t;

/* Row ``t`` of ``key``/``value`` (``num_kv_heads * head_dim`` elements of the cache
 * dtype, rows ``kv_stride`` elements apart) to cache slot ``slots[t]``; -1 is skipped. */
static void write_rows(void *k_cache, void *v_cache, const void *key, const void *value,
                       int64_t kv_stride, const int64_t *slots, int num_rows, size_t row_bytes,
                       int elem) {
#pragma omp for schedule(static)
    for (int t = 0; t < num_rows; ++t) {
        if (slots[t] < 0) continue;
        memcpy((char *)k_cache + slots[t] * row_bytes, (const char *)key + t * kv_stride * elem,
               row_bytes);
        memcpy((char *)v_cache + slots[t] * row_bytes,
               (const char *)value + t * kv_stride * elem, row_bytes);
    }
}

/* Writes the step's K/V rows (``key``/``value``, ``num_rows`` of them, to ``slots``;
 * ``slots`` NULL: none), then attends. Returns 0 on success, a negative code on bad
 * arguments (nothing is written then, except for a bad block table) or allocation
 * failure. */
int paged_attention(const float *query, void *k_cache, void *v_cache, int dtype,
                    const int32_t *block_tables, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t q_stride, float *out, int num_seqs,
                    int num_heads, int num_kv_heads, int head_dim, int block_size, int num_blocks,
                    int max_blocks_per_seq, int max_seq_len, float scale, const void *key,
                    const void *value, int64_t kv_stride, const int64_t *slots, int num_rows,
                    int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return PA_ERR_GQA;
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM) return PA_ERR_HEAD_DIM;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16 && dtype != DTYPE_F16) return PA_ERR_DTYPE;
#ifndef __FLT16_MAX__
    if (dtype == DTYPE_F16) return PA_ERR_DTYPE;
#endif
    if (num_threads < 1) num_threads = 1;
    if (slots == NULL) num_rows = 0;
    for (int t = 0; t < num_rows; ++t)
        if (slots[t] < -1 || slots[t] >= (int64_t)num_blocks * block_size) return PA_ERR_SLOT;
    const int elem = dtype == DTYPE_F32 ? 4 : 2;
    const size_t row_bytes = (size_t)num_kv_heads * head_dim * elem;
    if (num_seqs <= 0) {
        /* Nothing to attend; rows may still be written (a step of padding only has none). */
#pragma omp parallel num_threads(num_rows >= 64 ? num_threads : 1)
        write_rows(k_cache, v_cache, key, value, kv_stride, slots, num_rows, row_bytes, elem);
        return 0;
    }
    /* Tiles of each request's query tokens; a request with no token this step has none. */
    int64_t num_tiles = 0;
    for (int s = 0; s < num_seqs; ++s) {
        const int q_len = query_start_loc ? query_start_loc[s + 1] - query_start_loc[s] : 1;
        if (q_len < 0 || q_len > seq_lens[s]) return PA_ERR_RANGE;
        num_tiles += (q_len + TOKEN_TILE - 1) / TOKEN_TILE;
    }
    tile_t *tiles = malloc(sizeof(tile_t) * (size_t)(num_tiles > 0 ? num_tiles : 1));
    if (tiles == NULL) return PA_ERR_NOMEM;
    for (int s = 0, i = 0; s < num_seqs; ++s) {
        const int tok = query_start_loc ? query_start_loc[s] : s;
        const int q_len = query_start_loc ? query_start_loc[s + 1] - tok : 1;
        for (int j = 0; j < q_len; j += TOKEN_TILE)
            tiles[i++] = (tile_t){s, tok + j, q_len - j < TOKEN_TILE ? q_len - j : TOKEN_TILE,
                                  seq_lens[s] - q_len + 1 + j};
    }
    const shape_t sh = {k_cache, v_cache, num_kv_heads, num_heads / num_kv_heads, head_dim,
                        block_size, scale};
    /* All KV heads per item when there are enough tiles; else one KV head each. */
    const int per_item = num_tiles >= 4 * num_threads ? num_kv_heads : 1;
    const int splits = num_kv_heads / per_item;
    const int64_t items = num_tiles * splits;
    if (items < num_threads) num_threads = items > 0 ? (int)items : 1;
#if SIMD_VW
    const int vector_path = head_dim % VW == 0 && head_dim <= VW * MAX_NV;
#else
    const int vector_path = 0;
#endif
    const int64_t out_stride = (int64_t)num_heads * head_dim;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const size_t nq = (size_t)per_item * sh.group;
        /* The portable path keeps the scores of a whole context (one token at a time);
         * the vector path only the online-softmax state (acc, running max, denominator)
         * of each token of a tile, in ``acc``. */
        float *scores =
            vector_path ? NULL : malloc(sizeof(float) * (nq * (size_t)max_seq_len + 16));
        float *acc = malloc(sizeof(float) * nq * ((size_t)head_dim + 2) * TOKEN_TILE);
        float tmp[MAX_HEAD_DIM];
        if ((scores == NULL && !vector_path) || acc == NULL) {
#pragma omp atomic write
            status = -4;
        }
        /* This step's K/V rows first: a prefill tile reads rows that other threads
         * write (the omp for ends with a barrier). */
        write_rows(k_cache, v_cache, key, value, kv_stride, slots, num_rows, row_bytes, elem);
        if (status != -4) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; ++i) {
                const tile_t tl = tiles[i / splits];
                const int h0 = (int)(i % splits) * per_item;
                const int last_len = tl.len0 + tl.ntok - 1;
                const int32_t *table = block_tables + (int64_t)tl.s * max_blocks_per_seq;
                const int nb = (last_len + block_size - 1) / block_size;
                /* len0 >= 1: every request was checked for q_len <= seq_len above. */
                int bad = last_len > max_seq_len || nb > max_blocks_per_seq;
                for (int b = 0; !bad && b < nb; ++b) bad = table[b] < 0 || table[b] >= num_blocks;
                if (bad) {
#pragma omp atomic write
                    status = -5;
                    continue;
                }
                const int64_t head_off = (int64_t)h0 * sh.group * head_dim;
                const item_t it = {query + (int64_t)tl.tok0 * q_stride + head_off,
                                   out + (int64_t)tl.tok0 * out_stride + head_off, table,
                                   q_stride, out_stride, tl.len0, tl.ntok, h0, per_item};
#if SIMD_VW
                if (vector_path) {
                    if (dtype == DTYPE_F32)
                        attend_vec_f32(&it, &sh, acc);
                    else if (dtype == DTYPE_BF16)
                        attend_vec_bf16(&it, &sh, acc);
                    else
                        attend_vec_f16(&it, &sh, acc);
                    continue;
                }
#endif
                attend_portable(&it, &sh, dtype, scores, acc, tmp);
            }
        }
        free(scores);
        free(acc);
    }
    free(tiles);
    return status;
}
