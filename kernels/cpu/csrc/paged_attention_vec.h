/*
 * The vector path of paged_attention_cpu.c (AVX-512 or AVX2 through simd.h), kept in its
 * own file for length only: it is included once, at this point of that source, whose
 * item_t, shape_t and helpers it uses, so the two form one translation unit exactly as
 * before. Defines attend_vec_f32, attend_vec_bf16 and attend_vec_f16 when the build has
 * a vector unit (SIMD_VW).
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
    const int L0 = it->seq_len, L = L0 + T - 1 < it->c1 ? L0 + T - 1 : it->c1;
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
    for (int b = it->c0 / bs, t = it->c0; t < L; ++b) {
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
#endif
