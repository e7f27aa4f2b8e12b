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
 *   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim] (KV_ROWS_FIRST) or
 *                 [num_blocks, num_kv_heads, block_size, head_dim] (KV_HEADS_FIRST: a
 *                 KV head's rows of a block are one contiguous run); float32 | bf16 | f16,
 *                 or int8 (DTYPE_I8: bytes, head_dim + KV_I8_SCALE_BYTES a row, each
 *                 row its codes then its float32 scale)
 *   block_tables  [num_seqs, max_blocks_per_seq]                   int32
 *   seq_lens      [num_seqs]                                       int32
 *   key, value    [num_rows, num_kv_heads, head_dim] in ``key_dtype`` (the cache dtype,
 *                 or float32 rounded or quantized to it on the way in; float32 only for
 *                 an int8 cache), this step's K/V (rows
 *                 ``kv_stride`` elements apart), written to cache slots
 *   slots         [num_rows] int64 (-1: not written) before anything is attended
 *
 * A work item is a tile of up to TOKEN_TILE consecutive query tokens of one request
 * and a run of its KV heads (all of them when there are enough tiles to keep every
 * thread busy): the slot rows of a block are then read as one contiguous stream, once
 * per tile (so once per step and layer for a decode), and each block serves every
 * token of the tile from cache. A token sees the first ``pos + 1`` rows of the
 * context, so causality is the row count of each run, never a mask. The G = num_heads
 * / num_kv_heads query heads sharing a KV head are computed together, all in float32.
 * The vector path (AVX-512 or AVX2, one source over simd.h's ``vf``) makes one pass
 * with an online softmax (a block's K rows, then its V rows, each in memory order);
 * the portable path keeps the scores of the whole context (two passes: q.K, then
 * softmax-weighted V), one token at a time. A request's chunk of TILED_MIN_Q or more
 * tokens instead goes through paged_attention_tiled.h's tiles of Q.K^T and P.V products
 * (vector and portable forms), and a context of more than SPLIT_ROWS rows on the vector
 * path is split into parts that threads share, merged in part order.
 *
 * Two per-layer options (as kernels/torch_ref.py computes them): ``window`` > 0, a
 * sliding window: the token at context position p sees rows p - window + 1 .. p only, so
 * each path starts its sweep at the block (or run) holding the first row any token of
 * the tile sees, a token skips the runs below its own first row and masks the rows below
 * it in the one run it sees part of, and a split context plans no part below the tile's
 * first row; ``softcap`` > 0: each scaled score s becomes softcap * tanh(s / softcap)
 * before the softmax (Gemma 2). Both 0: the code and the bits of a call without them.
 */
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "convert.h"
#include "pool.h"

/* Query tokens of one request handled by one work item. */
#define TOKEN_TILE 16
/* Tokens per tile of the tiled path, and the chunk length from which a request takes
 * it: shorter chunks, speculative verification and decodes keep the per-token sweeps,
 * so a token's result there never depends on how it was batched. */
#define TILED_TILE 32
#define TILED_MIN_Q 32

/* One work item: ``ntok`` consecutive tokens of one request, KV heads ``h0 .. h0 + nh -
 * 1``. Token j sees the first ``seq_len + j`` rows of the context. */
typedef struct {
    const float *query; /* token 0's [nh * group, head_dim] query heads; tokens q_stride apart */
    float *out;         /* same shape; tokens out_stride apart */
    const int32_t *table;
    int64_t q_stride, out_stride;
    int seq_len, ntok, h0, nh;
    /* Context rows ``c0 .. c1 - 1`` only (a part of a split context; else 0, INT_MAX),
     * and where such a part leaves its softmax state (NULL: normalised to ``out``). */
    int c0, c1;
    float *part;
} item_t;

typedef struct {
    const void *k_cache, *v_cache;
    int num_kv_heads, group, head_dim, block_size;
    float scale;
    /* Cache elements from one block, row of a block, and KV head to the next (the
     * layout). */
    int64_t block_stride, row_stride, head_stride;
    /* The sliding window (0: none) and the scores' soft cap (0: none). */
    int window;
    float softcap;
    /* Cache elements of one KV head's row: head_dim, and its scale's bytes after the
     * codes in an int8 cache. */
    int row_elems;
} shape_t;

/* The first context row a token that sees ``seen`` rows attends to under ``window``. */
static inline int window_lo(int seen, int window) {
    return window > 0 && seen > window ? seen - window : 0;
}

/* ``n`` scaled scores at ``s`` soft-capped in place: softcap * tanh(s / softcap). */
static inline void softcap_scores(float *s, int n, float softcap) {
    for (int i = 0; i < n; ++i) s[i] = softcap * tanhf(s[i] / softcap);
}

/* Bytes of one cache element. */
static inline int elem_bytes(int dtype) {
    return dtype == DTYPE_F32 ? 4 : dtype == DTYPE_I8 ? 1 : 2;
}

/* The scale of the int8 cache row at element (byte) offset ``row``: after its
 * ``head_dim`` codes. */
static inline float row_scale(const void *cache, int64_t row, int head_dim) {
    float s;
    memcpy(&s, (const char *)cache + row + head_dim, sizeof s);
    return s;
}

/* Element offset of row ``r`` of cache block ``block``, KV head ``h``. */
static inline int64_t cache_at(const shape_t *sh, int64_t block, int r, int h) {
    return block * sh->block_stride + r * sh->row_stride + h * sh->head_stride;
}

/* The portable per-token path: attend_portable, load_row. */
#include "paged_attention_portable.h"

/* The vector path (AVX-512 or AVX2 through simd.h): attend_vec_f32/_bf16/_f16. */
#include "paged_attention_vec.h"
/* The tiled path for long prefill chunks: attend_tiled_f32/_bf16/_f16. */
#include "paged_attention_tiled.h"

/* ------------------------------------------------------------------------- */

/* A tile of request ``s``: tokens ``tok0 .. tok0 + ntok - 1``, the first of which sees
 * ``len0`` context rows; ``tiled``: the tiled path. A long context is split into parts of
 * SPLIT_ROWS rows (whole blocks), one tile each with the same tokens: rows ``c0 .. c1 -
 * 1``, its state left in partial slot ``part`` (-1: not split), merged after; ``first``:
 * the first part of its tile (under a window not the one at row 0), or not split. */
typedef struct {
    int s, tok0, ntok, len0, tiled, c0, c1, part, first;
} tile_t;

/* Context rows per part of a split context (rounded up to whole blocks): a long
 * request's decode is shared among threads. Fixed, so a token's result never depends
 * on the thread count or on the other requests of its step. */
#define SPLIT_ROWS 512

/* Floats of one partial slot: per token, every query head's unnormalised output, then
 * their running maxima, then their denominators. */
static size_t part_floats(int num_heads, int head_dim) {
    return (size_t)TOKEN_TILE * num_heads * ((size_t)head_dim + 2);
}

/* The output of each token of a split tile from its parts' states, in part order. */
static void merge_parts(const tile_t *tiles, int64_t first, int nparts, const float *parts,
                        float *out, int64_t out_stride, int num_heads, int head_dim) {
    const tile_t *tl = &tiles[first];
    const int H = num_heads, D = head_dim;
    const size_t slot = part_floats(H, D), per_tok = (size_t)H * (D + 2);
    for (int j = 0; j < tl->ntok; ++j) {
        float *o = out + (int64_t)(tl->tok0 + j) * out_stride;
        for (int h = 0; h < H; ++h) {
            float m = -INFINITY;
            for (int p = 0; p < nparts; ++p) {
                const float mp = parts[tiles[first + p].part * slot + j * per_tok + (size_t)H * D + h];
                m = mp > m ? mp : m;
            }
            float den = 0.0f;
            for (int d = 0; d < D; ++d) o[h * D + d] = 0.0f;
            for (int p = 0; p < nparts; ++p) {
                const float *st = parts + tiles[first + p].part * slot + j * per_tok;
                const float mp = st[(size_t)H * D + h];
                if (mp == -INFINITY) continue; /* the token sees none of this part */
                const float w = expf(mp - m);
                den += w * st[(size_t)H * D + H + h];
                for (int d = 0; d < D; ++d) o[h * D + d] += w * st[h * D + d];
            }
            const float inv = 1.0f / den;
            for (int d = 0; d < D; ++d) o[h * D + d] *= inv;
        }
    }
}

/* The tiles of a call, written to ``tiles`` unless NULL: each request's query tokens in
 * tiles (a request with no token this step has none), a long context's tile once per
 * part (under ``window``, only the parts from the one holding the tile's first visible
 * row on). Returns their number, or -1 for a query length outside 0 .. seq_len; the
 * parts of split contexts go to ``*num_parts``, whether any tile is tiled to
 * ``*any_tiled``. */
static int64_t plan_tiles(const int32_t *seq_lens, const int32_t *query_start_loc,
                          int num_seqs, int vector_path, int split_rows, int window,
                          tile_t *tiles, int64_t *num_parts, int *any_tiled) {
    int64_t i = 0, part = 0;
    *any_tiled = 0;
    for (int s = 0; s < num_seqs; ++s) {
        const int tok = query_start_loc ? query_start_loc[s] : s;
        const int q_len = query_start_loc ? query_start_loc[s + 1] - tok : 1;
        if (q_len < 0 || q_len > seq_lens[s]) return -1;
        const int tiled = q_len >= TILED_MIN_Q, tile = tiled ? TILED_TILE : TOKEN_TILE;
        *any_tiled |= tiled;
        for (int j = 0; j < q_len; j += tile) {
            const int ntok = q_len - j < tile ? q_len - j : tile;
            const int len0 = seq_lens[s] - q_len + 1 + j, last = len0 + ntok - 1;
            /* Parts p0 .. end - 1: none below the part of the tile's first visible row. */
            const int end = tiled || !vector_path ? 1 : (last + split_rows - 1) / split_rows;
            const int p0 = end > 1 ? window_lo(len0, window) / split_rows : 0;
            const int nparts = end - p0;
            for (int p = p0; p < end; ++p, ++i)
                if (tiles != NULL)
                    tiles[i] = (tile_t){s, tok + j, ntok, len0, tiled,
                                        nparts > 1 ? p * split_rows : 0,
                                        nparts > 1 && p + 1 < end ? (p + 1) * split_rows
                                                                  : INT_MAX,
                                        nparts > 1 ? (int)part + p - p0 : -1, p == p0};
            part += nparts > 1 ? nparts : 0;
        }
    }
    *num_parts = part;
    return i;
}

/* The K/V write: write_task_t, write_rows. */
#include "paged_attention_write.h"

/* The work items of one call: item ``i`` is tile ``i / splits``, KV heads
 * ``(i % splits) * per_item ..``; each thread has its own scratch (``scores[worker]``,
 * ``acc[worker]``). */
typedef struct {
    const tile_t *tiles;
    const shape_t *sh;
    const float *query;
    float *out;
    const int32_t *block_tables;
    int64_t q_stride, out_stride;
    int splits, per_item, dtype, vector_path, block_size, num_blocks, max_blocks_per_seq,
        max_seq_len, head_dim;
    float **scores, **acc, **tiled;
    float *parts;
    size_t part_slot;
    _Atomic int status;
} attend_task_t;

static void attend_items(void *ctx, int64_t i0, int64_t i1, int worker) {
    attend_task_t *a = ctx;
    const shape_t *sh = a->sh;
    float *scores = a->scores[worker], *acc = a->acc[worker];
    float tmp[MAX_HEAD_DIM];
    for (int64_t i = i0; i < i1; ++i) {
        const tile_t tl = a->tiles[i / a->splits];
        const int h0 = (int)(i % a->splits) * a->per_item;
        const int last_len = tl.len0 + tl.ntok - 1;
        const int32_t *table = a->block_tables + (int64_t)tl.s * a->max_blocks_per_seq;
        const int nb = (last_len + a->block_size - 1) / a->block_size;
        /* len0 >= 1: every request was checked for q_len <= seq_len. */
        int bad = last_len > a->max_seq_len || nb > a->max_blocks_per_seq;
        for (int b = 0; !bad && b < nb; ++b) bad = table[b] < 0 || table[b] >= a->num_blocks;
        if (bad) {
            atomic_store(&a->status, PA_ERR_RANGE);
            continue;
        }
        const int64_t head_off = (int64_t)h0 * sh->group * a->head_dim;
        const item_t it = {a->query + (int64_t)tl.tok0 * a->q_stride + head_off,
                           a->out + (int64_t)tl.tok0 * a->out_stride + head_off, table,
                           a->q_stride, a->out_stride, tl.len0, tl.ntok, h0, a->per_item,
                           tl.c0, tl.c1,
                           tl.part >= 0 ? a->parts + (size_t)tl.part * a->part_slot : NULL};
        if (tl.tiled && !a->vector_path) {
            attend_tiled_portable(&it, sh, a->dtype, a->tiled[worker]);
            continue;
        }
#if SIMD_VW
        if (tl.tiled) {
            if (a->dtype == DTYPE_F32)
                attend_tiled_f32(&it, sh, a->tiled[worker]);
            else if (a->dtype == DTYPE_BF16)
                attend_tiled_bf16(&it, sh, a->tiled[worker]);
            else if (a->dtype == DTYPE_I8)
                attend_tiled_i8(&it, sh, a->tiled[worker]);
            else
                attend_tiled_f16(&it, sh, a->tiled[worker]);
            continue;
        }
        if (a->vector_path) {
            if (a->dtype == DTYPE_F32)
                attend_vec_f32(&it, sh, acc);
            else if (a->dtype == DTYPE_BF16)
                attend_vec_bf16(&it, sh, acc);
            else if (a->dtype == DTYPE_I8)
                attend_vec_i8(&it, sh, acc);
            else
                attend_vec_f16(&it, sh, acc);
            continue;
        }
#endif
        attend_portable(&it, sh, a->dtype, scores, acc, tmp);
    }
}

/* Writes the step's K/V rows (``key``/``value``, ``num_rows`` of them, to ``slots``;
 * ``slots`` NULL: none), then attends. Returns 0 on success, a negative code on bad
 * arguments (nothing is written then, except for a bad block table) or allocation
 * failure. */
int paged_attention(const float *query, void *k_cache, void *v_cache, int dtype, int kv_layout,
                    const int32_t *block_tables, const int32_t *seq_lens,
                    const int32_t *query_start_loc, int64_t q_stride, float *out, int num_seqs,
                    int num_heads, int num_kv_heads, int head_dim, int block_size, int num_blocks,
                    int max_blocks_per_seq, int max_seq_len, float scale, int window,
                    float softcap, const void *key, const void *value, int key_dtype,
                    int64_t kv_stride, const int64_t *slots, int num_rows, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return PA_ERR_GQA;
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM) return PA_ERR_HEAD_DIM;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16 && dtype != DTYPE_F16 && dtype != DTYPE_I8)
        return PA_ERR_DTYPE;
    if (kv_layout != KV_ROWS_FIRST && kv_layout != KV_HEADS_FIRST) return PA_ERR_LAYOUT;
    if (block_size <= 0) return PA_ERR_BLOCK_SIZE;
    if (window < 0 || !(softcap >= 0.0f) || isinf(softcap)) return PA_ERR_WINDOW;
#ifndef __FLT16_MAX__
    if (dtype == DTYPE_F16) return PA_ERR_DTYPE;
#endif
    if (num_threads < 1) num_threads = 1;
    if (slots == NULL) num_rows = 0;
    /* This step's rows come in the cache dtype or in float32 (an int8 cache's always in
     * float32). */
    if (num_rows > 0 && key_dtype != DTYPE_F32 && (key_dtype != dtype || dtype == DTYPE_I8))
        return PA_ERR_DTYPE;
    for (int t = 0; t < num_rows; ++t)
        if (slots[t] < -1 || slots[t] >= (int64_t)num_blocks * block_size) return PA_ERR_SLOT;
    const int64_t D = head_dim + (dtype == DTYPE_I8 ? KV_I8_SCALE_BYTES : 0);
    const int64_t rows_first = kv_layout == KV_ROWS_FIRST;
    const shape_t sh = {k_cache, v_cache, num_kv_heads, num_heads / num_kv_heads, head_dim,
                        block_size, scale, (int64_t)block_size * num_kv_heads * D,
                        rows_first ? num_kv_heads * D : D, rows_first ? D : block_size * D,
                        window, softcap, (int)D};
#if SIMD_VW
    const int vector_path = head_dim % VW == 0 && head_dim <= VW * MAX_NV;
#else
    const int vector_path = 0;
#endif
    const int split_rows = (SPLIT_ROWS + block_size - 1) / block_size * block_size;
    int64_t num_parts = 0;
    int any_tiled = 0;
    const int64_t num_tiles = plan_tiles(seq_lens, query_start_loc, num_seqs, vector_path,
                                         split_rows, window, NULL, &num_parts, &any_tiled);
    if (num_tiles < 0) return PA_ERR_RANGE;
    tile_t *tiles = NULL;
    float *parts = NULL;
    const size_t part_slot = part_floats(num_heads, head_dim);
    if (num_seqs > 0) {
        tiles = malloc(sizeof(tile_t) * (size_t)(num_tiles > 0 ? num_tiles : 1));
        parts = num_parts ? malloc(sizeof(float) * part_slot * (size_t)num_parts) : NULL;
        if (tiles == NULL || (num_parts && parts == NULL)) {
            free(tiles);
            free(parts);
            return PA_ERR_NOMEM;
        }
    }
    /* The arguments hold: this step's K/V rows first (a prefill tile reads rows that
     * other threads write). */
    write_task_t wt = {.sh = &sh, .k_cache = k_cache, .v_cache = v_cache, .key = key,
                       .value = value, .kv_stride = kv_stride, .slots = slots, .dtype = dtype,
                       .src_dtype = key_dtype};
    const int write_threads = num_rows >= 64 ? num_threads : 1;
    pool_run(write_rows, &wt, num_rows, (num_rows + 4 * write_threads - 1) / (4 * write_threads),
             write_threads);
    if (num_seqs <= 0) return 0; /* nothing to attend (a step of padding only) */
    plan_tiles(seq_lens, query_start_loc, num_seqs, vector_path, split_rows, window, tiles,
               &num_parts, &any_tiled);
    /* All KV heads per item when there are enough tiles; else one KV head each. */
    const int per_item = num_tiles >= 4 * num_threads ? num_kv_heads : 1;
    const int splits = num_kv_heads / per_item;
    const int64_t items = num_tiles * splits;
    if (items < num_threads) num_threads = items > 0 ? (int)items : 1;
    const int64_t out_stride = (int64_t)num_heads * head_dim;
    /* The portable path keeps the scores of a whole context (one token at a time); the
     * vector path only the online-softmax state (acc, running max, denominator) of
     * each token of a tile, in ``acc``. */
    const size_t nq = (size_t)per_item * sh.group;
    float *scores[POOL_MAX_THREADS] = {0}, *acc[POOL_MAX_THREADS] = {0};
    float *tiled[POOL_MAX_THREADS] = {0};
    if (num_threads > POOL_MAX_THREADS) num_threads = POOL_MAX_THREADS;
    int status = 0;
    for (int w = 0; w < num_threads && status == 0; ++w) {
        scores[w] = vector_path ? NULL : malloc(sizeof(float) * (nq * (size_t)max_seq_len + 16));
        /* After the tokens' states, the vector path's scores of a block's runs (up to
         * block_size + 15 floats a query head) and their corrections (one a head and
         * run, at most block_size / 8 + 1 runs), aligned to 64 bytes. */
        const size_t run_floats = (size_t)block_size + 16 + (size_t)block_size / 8 + 1;
        acc[w] = malloc(sizeof(float) *
                        (nq * ((size_t)head_dim + 2) * TOKEN_TILE + nq * run_floats + 16));
        if ((scores[w] == NULL && !vector_path) || acc[w] == NULL) status = PA_ERR_NOMEM;
        if (any_tiled && status == 0) {
            tiled[w] = malloc(sizeof(float) * tiled_scratch_floats(sh.group, head_dim));
            if (tiled[w] == NULL) status = PA_ERR_NOMEM;
        }
    }
    if (status == 0) {
        attend_task_t task = {tiles, &sh, query, out, block_tables, q_stride, out_stride,
                              splits, per_item, dtype, vector_path, block_size, num_blocks,
                              max_blocks_per_seq, max_seq_len, head_dim, scores, acc, tiled,
                              parts, part_slot, 0};
        pool_run(attend_items, &task, items, 1, num_threads);
        status = atomic_load(&task.status);
    }
    /* The parts of each split tile are consecutive tiles with the same tokens. */
    for (int64_t i = 0; status == 0 && i < num_tiles;) {
        int n = 1;
        if (tiles[i].part >= 0)
            while (i + n < num_tiles && tiles[i + n].part >= 0 && !tiles[i + n].first) ++n;
        if (n > 1) merge_parts(tiles, i, n, parts, out, out_stride, num_heads, head_dim);
        i += n;
    }
    for (int w = 0; w < num_threads; ++w) {
        free(scores[w]);
        free(acc[w]);
        free(tiled[w]);
    }
    free(tiles);
    free(parts);
    return status;
}
