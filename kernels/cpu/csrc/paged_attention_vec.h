/*
 * The vector path of paged_attention_cpu.c (AVX-512 or AVX2 through simd.h), kept in its
 * own file for length only: it is included once, at this point of that source, whose
 * item_t, shape_t and helpers it uses, so the two form one translation unit exactly as
 * before. Defines attend_vec_f32, attend_vec_bf16, attend_vec_f16 and attend_vec_i8 when
 * the build has a vector unit (SIMD_VW). An int8 cache's codes are widened to float32
 * as they are read and its row scales applied to each row's score (K) and weight (V).
 */
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
    if (dtype == DTYPE_I8) return vf_load_i8((const int8_t *)base + idx); /* codes, unscaled */
    return vf_load_f16((const uint16_t *)base + idx);
}

/* Prefetch ``bytes`` starting at ``p`` into L2 (one instruction per cache line). Always
 * inlined: as an ordinary function GCC finds it free of side effects and deletes the
 * calls, prefetches and all. */
static inline __attribute__((always_inline)) void prefetch_bytes(const char *p, int bytes) {
    for (int i = 0; i < bytes; i += 64) prefetch_l2(p + i);
}

/* How many blocks ahead of the one being read its rows are fetched. */
#define PREFETCH_BLOCKS 2

/* Query heads handled together in one sweep over a run of rows. */
#define GCHUNK 4

/* Vector registers: 32 with AVX-512, 16 with AVX2. */
#define VREGS (VW == 16 ? 32 : 16)
/* Whether ``GN`` heads' V accumulators of ``nv`` vectors each, a V row and the weights
 * fit the register file (both are compile-time constants in every body). */
#define V_IN_REGISTERS(GN, nv) ((GN) * (nv) + (nv) + (GN) <= VREGS)

/* The scores of one run of ``m <= VW`` consecutive rows of a cache block, of one KV head
 * (the first at element offset ``base``, rows ``sh->row_stride`` apart), for the ``GN``
 * query heads at ``q`` that share it: the VW dot products of a head reduced together by
 * ``vf_sum_lanes``, scaled, rows past ``m`` at -inf, one vector a head to ``s`` (VW floats
 * apart, aligned).
 * ``next_k`` (or NULL): rows to prefetch, ``next_stride`` apart. */
static inline __attribute__((always_inline)) void score_run(
        const shape_t *sh, const float *q, const int dtype, const int nv, const int GN,
        int64_t base, int m, float *s, const char *next_k, int64_t next_stride, int pf_bytes) {
    const int D = VW * nv;
    const int64_t stride = sh->row_stride;
    const vmask mask = vm_first(m);
    vf part[GCHUNK][VW];
    vf qv[GCHUNK][MAX_NV];
    for (int g = 0; g < GN; ++g)
        for (int j = 0; j < nv; ++j) qv[g][j] = vf_load(q + (int64_t)g * D + VW * j);
    for (int r = 0; r < m; ++r) {
        const int64_t row = base + r * stride;
        if (next_k != NULL) prefetch_bytes(next_k + r * next_stride, pf_bytes);
        vf k[MAX_NV];
        for (int j = 0; j < nv; ++j) k[j] = load_vec(sh->k_cache, row + VW * j, dtype);
        /* An int8 row's products times its K scale (one broadcast a row). */
        const vf ks = dtype == DTYPE_I8 ? vf_set1(row_scale(sh->k_cache, row, D)) : vf_zero();
        for (int g = 0; g < GN; ++g) {
            vf d = vf_mul(qv[g][0], k[0]);
            for (int j = 1; j < nv; ++j) d = vf_fmadd(qv[g][j], k[j], d);
            part[g][VF_SUM_SLOT(r)] = dtype == DTYPE_I8 ? vf_mul(d, ks) : d;
        }
    }
    for (int r = m; r < VW; ++r)
        for (int g = 0; g < GN; ++g) part[g][VF_SUM_SLOT(r)] = vf_zero();
    const vf scale = vf_set1(sh->scale);
    for (int g = 0; g < GN; ++g)
        vf_store_aligned(s + g * VW, vf_select(mask, vf_mul(vf_sum_lanes(part[g]), scale),
                                               vf_set1(-INFINITY)));
}

/* The online-softmax step of one run for ``nq`` query heads at once, VW heads a vector:
 * each head's run maximum, new running maximum ``mx``, correction ``corr`` of its earlier
 * sums and denominator ``den``; the scores ``s`` (VW floats a head, rows past ``m`` at
 * -inf) become the run's weights. ``windowed``: rows before ``lo`` (< m) are outside the
 * token's window, masked out of the maximum and given weight 0. The heads' reductions
 * and exponentials are independent, so they overlap instead of following one another. */
static inline __attribute__((always_inline)) void softmax_heads_of(
        float *s, int nq, int lo, int m, float *mx, float *den, float *corr, const int windowed) {
    const vmask mask = windowed ? vm_range(lo, m) : vm_first(m);
    for (int c0 = 0; c0 < nq; c0 += VW) {
        const int cn = nq - c0 < VW ? nq - c0 : VW;
        float *sc = s + (int64_t)c0 * VW;
        vf in[VW];
        if (windowed)
            for (int i = 0; i < cn; ++i)
                vf_store_aligned(sc + i * VW, vf_select(mask, vf_load_aligned(sc + i * VW),
                                                        vf_set1(-INFINITY)));
        for (int i = 0; i < VW; ++i)
            in[VF_SUM_SLOT(i)] = i < cn ? vf_load_aligned(sc + i * VW) : vf_set1(-INFINITY);
        const vf m_old = vf_load_first(mx + c0, cn);
        const vf run_max = vf_max_lanes(in);
        const vf m_new = vf_select(vm_gt(run_max, m_old), run_max, m_old);
        float mn[VW] __attribute__((aligned(64)));
        vf_store_aligned(mn, m_new);
        /* The heads' exponentials and the correction's, all overlapping. */
        vf e[VW + 1];
        for (int i = 0; i < cn; ++i) e[i] = vf_sub(vf_load_aligned(sc + i * VW), vf_set1(mn[i]));
        e[cn] = vf_sub(m_old, m_new);
        vf_exp_array(e, cn + 1);
        for (int i = 0; i < VW; ++i) {
            const vf w = i < cn ? vf_select(mask, e[i], vf_zero()) : vf_zero();
            if (i < cn) vf_store_aligned(sc + i * VW, w);
            in[VF_SUM_SLOT(i)] = w;
        }
        /* No correction before a head's first run (its sums are still zero). */
        const vf c = vf_select(vm_gt(m_old, vf_set1(-INFINITY)), e[cn], vf_zero());
        vf_store_first(corr + c0, cn, c);
        vf_store_first(den + c0, cn, vf_fmadd(vf_load_first(den + c0, cn), c, vf_sum_lanes(in)));
        vf_store_first(mx + c0, cn, m_new);
    }
}

static inline void softmax_heads(float *s, int nq, int m, float *mx, float *den, float *corr) {
    softmax_heads_of(s, nq, 0, m, mx, den, corr, 0);
}

static inline void softmax_heads_window(float *s, int nq, int lo, int m, float *mx, float *den,
                                        float *corr) {
    softmax_heads_of(s, nq, lo, m, mx, den, corr, 1);
}

/* The largest power of two up to 8 (at least 1) such that ``GN * n`` accumulators,
 * ``GN`` broadcast weights and a V vector fit the register file: the V vectors of a block
 * of value_run's fallback. */
#define BLOCK_FOR(GN)                                          \
    ((VREGS - (GN) - 1) / (GN) >= 8   ? 8                      \
     : (VREGS - (GN) - 1) / (GN) >= 4 ? 4                      \
     : (VREGS - (GN) - 1) / (GN) >= 2 ? 2 : 1)

/* The weighted V rows of one run (of one KV head, the first at element offset ``base``,
 * rows ``sh->row_stride`` apart) for ``GN`` query heads: each head's unnormalised output
 * ``acc`` (rows of ``VW * nv``) times its correction ``corr``, plus the run's rows
 * weighted by ``p`` (VW floats a head), accumulated in registers. ``next_v`` (or NULL):
 * rows to prefetch, ``next_stride`` apart. */
static inline __attribute__((always_inline)) void value_run(
        const shape_t *sh, const int dtype, const int nv, const int GN, int64_t base, int m,
        const float *p, const float *corr, float *acc, const char *next_v, int64_t next_stride,
        int pf_bytes) {
    const int D = VW * nv;
    const int64_t stride = sh->row_stride;
    float pw[GCHUNK * VW] __attribute__((aligned(64)));
    if (dtype == DTYPE_I8) { /* the run's weights times their rows' V scales, once */
        for (int r = 0; r < m; ++r) {
            const float vs = row_scale(sh->v_cache, base + r * stride, D);
            for (int g = 0; g < GN; ++g) pw[g * VW + r] = p[g * VW + r] * vs;
        }
        p = pw;
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
            const int64_t row = base + r * stride;
            if (next_v != NULL) prefetch_bytes(next_v + r * next_stride, pf_bytes);
            vf v[MAX_NV];
            for (int j = 0; j < nv; ++j) v[j] = load_vec(sh->v_cache, row + VW * j, dtype);
            for (int g = 0; g < GN; ++g) {
                const vf w = vf_set1(p[g * VW + r]);
                for (int j = 0; j < nv; ++j) a[g][j] = vf_fmadd(w, v[j], a[g][j]);
            }
        }
        for (int g = 0; g < GN; ++g)
            for (int j = 0; j < nv; ++j) vf_store(acc + (int64_t)g * D + VW * j, a[g][j]);
        return;
    }
    /* Too many accumulators for the register file (AVX2's 16 registers): a block of
     * ``JB`` vectors of the head dim at a time (each row's weights broadcast once a block),
     * over the run's rows (in L1 after the first block), so that the accumulators never
     * spill. The same sums in the same order. */
    const int JB = BLOCK_FOR(GN);
    for (int j0 = 0; j0 < nv; j0 += JB) {
        const int jn = nv - j0 < JB ? nv - j0 : JB;
        float *out = acc + VW * j0;
        vf a[GCHUNK][8];
        for (int g = 0; g < GN; ++g)
            for (int j = 0; j < JB; ++j)
                a[g][j] = j < jn ? vf_mul(vf_set1(corr[g]), vf_load(out + g * D + VW * j))
                                 : vf_zero();
        for (int r = 0; r < m; ++r) {
            const int64_t row = base + r * stride + VW * j0;
            if (j0 == 0 && next_v != NULL) prefetch_bytes(next_v + r * next_stride, pf_bytes);
            vf w[GCHUNK];
            for (int g = 0; g < GN; ++g) w[g] = vf_set1(p[g * VW + r]);
            for (int j = 0; j < JB; ++j) {
                if (j >= jn) continue;
                const vf v = load_vec(sh->v_cache, row + VW * j, dtype);
                for (int g = 0; g < GN; ++g) a[g][j] = vf_fmadd(w[g], v, a[g][j]);
            }
        }
        for (int g = 0; g < GN; ++g)
            for (int j = 0; j < JB; ++j)
                if (j < jn) vf_store(out + g * D + VW * j, a[g][j]);
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
                                     int64_t block, int elem) {
    return (const char *)cache + cache_at(sh, block, 0, it->h0) * elem;
}

/* The first token of a tile (the first of which sees ``L0`` rows) that sees context row
 * ``pos``. */
static inline int first_seeing(int pos, int L0) { return pos - L0 + 1 > 0 ? pos - L0 + 1 : 0; }

/* ``nv`` (head_dim / VW) and ``dtype`` are compile-time constants in each caller.
 *
 * One pass over the context a block at a time, in runs of at most VW rows: each KV
 * head's K rows of the block in order (the scores of its query heads, run by run), one
 * online-softmax step a run for all the item's heads together, then each KV head's V
 * rows in order. So K and V are each read as one stream in memory order (a KV head's
 * rows of a block are contiguous, and its heads follow one another): reading a run of
 * every head in turn instead, the 30-layer decode of a 7,864-token context took 1.13x as
 * long on a Zen 1 host, where it is bound by memory. The sums are the same in the same
 * order as run after run. Every token of the tile that sees part of a block takes it
 * (its first rows, up to the token's own position) while the block is in cache.
 * Under a sliding window the sweep starts at the block of token 0's first visible row
 * (not before the part's ``c0``); a token skips the blocks and runs wholly below its own
 * first row and masks that row's predecessors in its run; ``softcap`` caps each token's
 * scores of a block before their softmax.
 * ``state`` holds ``ntok * nq * (head_dim + 2)`` floats, then (64-byte aligned) ``nq *
 * VW`` scores and ``nq`` corrections for each run of a block. */
static inline __attribute__((always_inline)) void attend_vec(const item_t *it,
                                                             const shape_t *sh,
                                                             const int dtype, const int nv,
                                                             float *state) {
    const int D = VW * nv, G = sh->group, nq = it->nh * G, T = it->ntok;
    const int L0 = it->seq_len, L = L0 + T - 1 < it->c1 ? L0 + T - 1 : it->c1;
    const int bs = sh->block_size, nblocks = (L + bs - 1) / bs, bs_runs = (bs + VW - 1) / VW;
    const int elem = elem_bytes(dtype);
    const int64_t per_tok = (int64_t)nq * (D + 2);
    /* After the tokens' states: each run's scores (then weights) and corrections. */
    float *scores = (float *)(((uintptr_t)(state + T * per_tok) + 63) & ~(uintptr_t)63);
    float *corr = scores + (int64_t)nq * bs_runs * VW;
    for (int j = 0; j < T; ++j) {
        float *acc = state + j * per_tok, *mx = acc + (int64_t)nq * D, *den = mx + nq;
        memset(acc, 0, sizeof(float) * (size_t)nq * D);
        for (int i = 0; i < nq; ++i) {
            mx[i] = -INFINITY;
            den[i] = 0.0f;
        }
    }
    /* Blocks are scattered, so the hardware prefetcher stalls at every block edge: while
     * reading row r of a block, fetch row r of the block PREFETCH_BLOCKS ahead (two: on
     * Zen 4, 30 layers of a 7.8k-token decode 0-5% faster than one ahead; three ahead
     * is no better). The first token to see a run of a KV head's rows fetches that
     * slice of the block ahead, so that requests to memory go out through the whole
     * sweep over a block, not in one burst: decode attention then overlaps its
     * arithmetic with the stream of K/V rows
     * (30 layers of a 64-request decode step on AVX-512: 41 ms against 54 ms without
     * prefetching). */
    const int64_t row_bytes = sh->row_stride * elem, head_bytes = sh->head_stride * elem;
    const int pf_bytes = sh->row_elems * elem;
    const int W = sh->window;
    const float cap = sh->softcap;
    int start = window_lo(L0, W);
    start -= start % bs;
    start = start > it->c0 ? start : it->c0;
    for (int b = start / bs, t = start; t < L; ++b) {
        const int64_t block = it->table[b];
        const int n = L - t < bs ? L - t : bs;
        const int last = b + PREFETCH_BLOCKS >= nblocks; /* nothing that far ahead */
        const int64_t ahead = last ? 0 : it->table[b + PREFETCH_BLOCKS];
        const char *next_k = last ? NULL : block_rows(sh->k_cache, sh, it, ahead, elem);
        const char *next_v = last ? NULL : block_rows(sh->v_cache, sh, it, ahead, elem);
        /* Token j sees the block's first ``L0 + j - t`` rows (all ``n`` from some token
         * on): from token jb on, some of them. */
        const int jb = first_seeing(t, L0);
        for (int j = jb; j < T; ++j) {
            const int nr = L0 + j - t < n ? L0 + j - t : n;
            const int runs = (nr + VW - 1) / VW;
            /* Under a window: the token's rows before ``lr`` of the block are outside it,
             * its runs before ``ri0`` wholly (so are every later token's). */
            const int lo = window_lo(L0 + j, W) - t, lr = lo > 0 ? lo : 0, ri0 = lr / VW;
            if (lr >= n) break;
            float *acc = state + j * per_tok, *mx = acc + (int64_t)nq * D, *den = mx + nq;
            const float *q = it->query + j * it->q_stride;
            for (int hh = 0; hh < it->nh; ++hh) {
                const int64_t hb = hh * head_bytes;
                for (int ri = ri0; ri < runs; ++ri) {
                    const int r0 = ri * VW, m = nr - r0 < VW ? nr - r0 : VW;
                    const int pf = !last && j == first_seeing(t + r0, L0);
                    const int64_t base = cache_at(sh, block, r0, it->h0 + hh);
                    float *sr = scores + (int64_t)ri * nq * VW;
                    for (int g0 = 0; g0 < G; g0 += GCHUNK) {
                        const int qh = hh * G + g0;
                        const char *pk = pf && g0 == 0 ? next_k + r0 * row_bytes + hb : NULL;
#define RUN(GN) score_run(sh, q + (int64_t)qh * D, dtype, nv, GN, base, m, \
                          sr + (int64_t)qh * VW, pk, row_bytes, pf_bytes)
                        FOR_GN(G - g0, RUN)
#undef RUN
                    }
                }
            }
            if (cap > 0.0f)
                for (int ri = ri0; ri < runs; ++ri)
                    for (int qh = 0; qh < nq; ++qh)
                        softcap_scores(scores + ((int64_t)ri * nq + qh) * VW,
                                       nr - ri * VW < VW ? nr - ri * VW : VW, cap);
            for (int ri = ri0; ri < runs; ++ri) {
                const int m = nr - ri * VW < VW ? nr - ri * VW : VW;
                float *sr = scores + (int64_t)ri * nq * VW;
                if (ri == ri0 && lr > ri0 * VW)
                    softmax_heads_window(sr, nq, lr - ri0 * VW, m, mx, den, corr + ri * nq);
                else
                    softmax_heads(sr, nq, m, mx, den, corr + ri * nq);
            }
            for (int hh = 0; hh < it->nh; ++hh) {
                const int64_t hb = hh * head_bytes;
                for (int ri = ri0; ri < runs; ++ri) {
                    const int r0 = ri * VW, m = nr - r0 < VW ? nr - r0 : VW;
                    const int pf = !last && j == first_seeing(t + r0, L0);
                    const int64_t base = cache_at(sh, block, r0, it->h0 + hh);
                    const float *pr = scores + (int64_t)ri * nq * VW;
                    for (int g0 = 0; g0 < G; g0 += GCHUNK) {
                        const int qh = hh * G + g0;
                        const char *pv = pf && g0 == 0 ? next_v + r0 * row_bytes + hb : NULL;
#define RUN(GN) value_run(sh, dtype, nv, GN, base, m, pr + (int64_t)qh * VW, \
                          corr + ri * nq + qh, acc + (int64_t)qh * D, pv, row_bytes, pf_bytes)
                        FOR_GN(G - g0, RUN)
#undef RUN
                    }
                }
            }
        }
        t += n;
    }
    if (it->part != NULL) {
        /* One part of a split context: the raw state, merged with the other parts'. */
        const int H = sh->num_kv_heads * G, q0 = it->h0 * G;
        for (int j = 0; j < T; ++j) {
            const float *acc = state + j * per_tok;
            float *dst = it->part + j * (int64_t)H * (D + 2);
            memcpy(dst + (int64_t)q0 * D, acc, sizeof(float) * (size_t)nq * D);
            memcpy(dst + (int64_t)H * D + q0, acc + (int64_t)nq * D, sizeof(float) * (size_t)nq);
            memcpy(dst + (int64_t)H * D + H + q0, acc + (int64_t)nq * D + nq,
                   sizeof(float) * (size_t)nq);
        }
        return;
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
ATTEND_VEC_FOR(attend_vec_i8, DTYPE_I8)
#endif
