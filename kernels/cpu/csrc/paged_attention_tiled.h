/*
 * The tiled prefill path of paged_attention_cpu.c, kept in its own file for length:
 * included once, after paged_attention_vec.h, whose helpers it uses.
 *
 * A long prefill chunk is compute-bound: each query token attends to the whole context,
 * and the per-token sweeps of the vector path spend more of their time reducing dot
 * products across lanes and reloading state than multiplying. Here the query rows of a
 * tile (its tokens x the query heads sharing one KV head) go through the context in
 * runs of up to TK keys of one block, as two small matrix products with the sums in
 * registers:
 *
 *   S = Q K^T   (rows x TK): K's run transposed once into ``kt`` (``[D][TK]``), then
 *               for each d a broadcast of q[r][d] times a vector of TK keys;
 *   O += P V    (rows x D):  for each key a broadcast of p[r][k] times V's row,
 *
 * with an online softmax between them (a running maximum, denominator and rescale of
 * O per row). Causality is a mask on the scores of the one run that holds a token's
 * own position; rows of tokens that see none of a run skip it. Under a sliding window
 * likewise: the sweep starts at the run of token 0's first visible row, the rows of
 * tokens whose window starts past a run skip it (they are the tile's last tokens), and
 * the scores before a token's first row are masked in the run that holds it; a soft cap
 * applies to the scores of a run before their softmax. These are the 8-lane builds'
 * tiles (and, in plain loops, the portable path's); the 16-lane builds put the rows
 * across the lanes instead (paged_attention_tiled16.h), with the same runs and masks.
 */
/* Keys per run. */
#define TK 16

/* The first context row of the tiled sweep: the start of the run (TK keys from the
 * start of a block) that holds the first row token 0 sees. */
static inline int tiled_start(int L0, int window, int bs) {
    const int lo = window_lo(L0, window), in_block = lo % bs;
    return lo - in_block % TK;
}

/* The rows past the last that sees some of the run at ``t .. t + n - 1`` (each of the
 * ``T`` tokens ``G`` rows; token j's window starts at row window_lo(L0 + j)). */
static inline int tiled_rows_seeing(int L0, int T, int G, int window, int t, int n) {
    if (window <= 0) return T * G;
    int j1 = T;
    while (j1 > 0 && window_lo(L0 + j1 - 1, window) >= t + n) --j1;
    return j1 * G;
}

#if SIMD_VW
/* A run of the vector paths' tiled sweep: the keys at context row ``t`` (``n`` of them,
 * within one block, at most TK), its first row's element offset for KV head ``h``, and
 * the rows ``r0 .. r1 - 1`` of the tile that see some of it (tokens before j0 see none of
 * it, nor, under a window, rows from r1 on). The next run's K and V rows are fetched
 * into L2 while this one is computed: its block is anywhere in the pool, out of the
 * hardware prefetcher's reach. */
typedef struct {
    int n, r0, r1;
    int64_t first;
} tiled_run_t;

static inline __attribute__((always_inline)) tiled_run_t tiled_run_at(const item_t *it,
                                                                      const shape_t *sh,
                                                                      const int dtype, int h,
                                                                      int t, int W) {
    const int G = sh->group, T = it->ntok, L0 = it->seq_len, L = L0 + T - 1;
    const int bs = sh->block_size, in_block = t % bs;
    const int64_t stride = sh->row_stride;
    tiled_run_t run;
    run.n = bs - in_block < TK ? bs - in_block : TK;
    run.n = run.n < L - t ? run.n : L - t;
    run.first = cache_at(sh, it->table[t / bs], in_block, h);
    const int j0 = t - L0 + 1 > 0 ? t - L0 + 1 : 0;
    run.r0 = j0 * G;
    run.r1 = W > 0 ? tiled_rows_seeing(L0, T, G, W, t, run.n) : T * G;
    if (t + run.n < L) {
        const int tn = t + run.n, elem = elem_bytes(dtype), rb = sh->row_elems * elem;
        const int64_t next = cache_at(sh, it->table[tn / bs], tn % bs, h);
        const int nn = bs - tn % bs < TK ? bs - tn % bs : TK;
        for (int k = 0; k < nn && tn + k < L; ++k) {
            prefetch_bytes((const char *)sh->k_cache + (next + k * stride) * elem, rb);
            prefetch_bytes((const char *)sh->v_cache + (next + k * stride) * elem, rb);
        }
    }
    return run;
}
#endif

#if SIMD_VW == 16
/* attend_tiled16: the 16-lane tiles, rows across the lanes. */
#include "paged_attention_tiled16.h"
#endif

/* Floats of scratch a worker needs for a tiled item with ``group`` query heads per KV
 * head: Q and O (rows x D), P (rows x TK), four per-row values, K^T, and (the portable
 * loops) a run of V rows and one converted row; at 16 lanes, at least attend_tiled16's. */
static size_t tiled_scratch_floats(int group, int head_dim) {
    const size_t rows = (size_t)TILED_TILE * group;
    size_t floats = rows * (2 * (size_t)head_dim + TK + 4) + 2 * (size_t)head_dim * TK + head_dim + 32;
#if SIMD_VW == 16
    const size_t wide = tiled16_scratch_floats(group, head_dim);
    floats = wide > floats ? wide : floats;
#endif
    return floats;
}

/* The same tiles in plain loops (any head_dim; the compiler vectorizes the loops over
 * a run's keys and over D): the portable build's, and the vector builds' for head dims
 * their vectors do not divide. */
static void attend_tiled_portable(const item_t *it, const shape_t *sh, int dtype,
                                  float *scratch) {
    const int D = sh->head_dim, G = sh->group, T = it->ntok, rows = T * G;
    const int L0 = it->seq_len, L = L0 + T - 1, bs = sh->block_size, W = sh->window;
    const float cap = sh->softcap;
    const int64_t stride = sh->row_stride;
    float *q = scratch, *o = q + (size_t)rows * D, *p = o + (size_t)rows * D;
    float *mx = p + (size_t)rows * TK, *den = mx + rows, *kt = den + rows;
    float *vr = kt + (size_t)D * TK, *tmp = vr + (size_t)D * TK;
    for (int hh = 0; hh < it->nh; ++hh) {
        for (int r = 0; r < rows; ++r) {
            memcpy(q + (int64_t)r * D,
                   it->query + (r / G) * it->q_stride + (int64_t)(hh * G + r % G) * D,
                   sizeof(float) * (size_t)D);
            mx[r] = -INFINITY;
            den[r] = 0.0f;
        }
        memset(o, 0, sizeof(float) * (size_t)rows * D);
        const int h = it->h0 + hh;
        for (int t = tiled_start(L0, W, bs); t < L;) {
            int n = bs - t % bs;
            n = n < TK ? n : TK;
            n = n < L - t ? n : L - t;
            const int64_t first = cache_at(sh, it->table[t / bs], t % bs, h);
            memset(kt, 0, sizeof(float) * (size_t)D * TK);
            for (int k = 0; k < n; ++k) {
                const float *row = load_row(sh->k_cache, dtype, first + k * stride, D, tmp);
                for (int d = 0; d < D; ++d) kt[d * TK + k] = row[d];
                memcpy(vr + (int64_t)k * D, load_row(sh->v_cache, dtype, first + k * stride, D, tmp),
                       sizeof(float) * (size_t)D);
            }
            const int j0 = t - L0 + 1 > 0 ? t - L0 + 1 : 0;
            const int r1 = W > 0 ? tiled_rows_seeing(L0, T, G, W, t, n) : rows;
            for (int r = j0 * G; r < r1; ++r) {
                float s[TK] = {0};
                for (int d = 0; d < D; ++d) {
                    const float qd = q[(int64_t)r * D + d];
#pragma omp simd
                    for (int k = 0; k < TK; ++k) s[k] += qd * kt[d * TK + k];
                }
                const int seen = L0 + r / G - t, valid = seen < n ? seen : n;
                /* Keys before k0: outside the token's window. */
                const int lo = window_lo(L0 + r / G, W) - t, k0 = lo > 0 ? lo : 0;
                for (int k = k0; k < valid; ++k) s[k] *= sh->scale;
                if (cap > 0.0f) softcap_scores(s + k0, valid - k0, cap);
                float m = mx[r];
                for (int k = k0; k < valid; ++k) m = s[k] > m ? s[k] : m;
                const float corr = expf(mx[r] - m); /* 0 on a row's first run */
                float sum = 0.0f;
                for (int k = k0; k < valid; ++k) {
                    s[k] = expf(s[k] - m);
                    sum += s[k];
                }
                den[r] = den[r] * corr + sum;
                mx[r] = m;
                float *orow = o + (int64_t)r * D;
#pragma omp simd
                for (int d = 0; d < D; ++d) orow[d] *= corr;
                for (int k = k0; k < valid; ++k) {
                    const float w = s[k], *v = vr + (int64_t)k * D;
#pragma omp simd
                    for (int d = 0; d < D; ++d) orow[d] += w * v[d];
                }
            }
            t += n;
        }
        for (int r = 0; r < rows; ++r) {
            float *out = it->out + (r / G) * it->out_stride + (int64_t)(hh * G + r % G) * D;
            const float inv = 1.0f / den[r];
            for (int d = 0; d < D; ++d) out[d] = o[(int64_t)r * D + d] * inv;
        }
    }
}

#if SIMD_VW == 8
/* The 8-lane tiles: keys across the lanes (the 16-lane builds' are attend_tiled16). */
/* Vectors across a run. */
#define NK (TK / VW)
/* Query rows per register tile: NK (scores) or two (outputs) vectors each. */
#define TR 6

/* S rows ``r0 .. r0 + mr - 1`` = scale * Q rows . K^T. */
static inline __attribute__((always_inline)) void tiled_scores(const float *q, const float *kt,
                                                               float *s, int D, int r0,
                                                               float scale, const int mr) {
    vf acc[TR][NK];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NK; ++j) acc[i][j] = vf_zero();
    for (int d = 0; d < D; ++d) {
        vf k[NK];
        for (int j = 0; j < NK; ++j) k[j] = vf_load(kt + d * TK + VW * j);
        for (int i = 0; i < mr; ++i) {
            const vf a = vf_set1(q[(int64_t)(r0 + i) * D + d]);
            for (int j = 0; j < NK; ++j) acc[i][j] = vf_fmadd(a, k[j], acc[i][j]);
        }
    }
    const vf sc = vf_set1(scale);
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NK; ++j) vf_store(s + (r0 + i) * TK + VW * j, vf_mul(acc[i][j], sc));
}

/* O rows ``r0 .. r0 + mr - 1``, vectors ``v0 .. v0 + nc - 1`` of D: O * corr + P V over
 * the run's ``n`` rows of V (``vrow``: row 0's element offset, rows ``stride`` apart). */
static inline __attribute__((always_inline)) void tiled_pv(const void *v_cache, const int dtype,
                                                           int64_t vrow, int64_t stride, int n,
                                                           const float *p, const float *corr,
                                                           float *o, int D, int r0, int v0,
                                                           const int mr, const int nc) {
    vf acc[TR][2];
    for (int i = 0; i < mr; ++i) {
        const vf c = vf_set1(corr[r0 + i]);
        for (int j = 0; j < nc; ++j)
            acc[i][j] = vf_mul(c, vf_load(o + (int64_t)(r0 + i) * D + VW * (v0 + j)));
    }
    for (int k = 0; k < n; ++k) {
        vf v[2];
        for (int j = 0; j < nc; ++j)
            v[j] = load_vec(v_cache, vrow + k * stride + VW * (v0 + j), dtype);
        const float vs = dtype == DTYPE_I8 ? row_scale(v_cache, vrow + k * stride, D) : 1.0f;
        for (int i = 0; i < mr; ++i) {
            const vf w = vf_set1(dtype == DTYPE_I8 ? p[(r0 + i) * TK + k] * vs
                                                   : p[(r0 + i) * TK + k]);
            for (int j = 0; j < nc; ++j) acc[i][j] = vf_fmadd(w, v[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nc; ++j) vf_store(o + (int64_t)(r0 + i) * D + VW * (v0 + j), acc[i][j]);
}

/* Dispatch on the rows left, so that each body has a compile-time row count. */
#define FOR_TR(mr, CALL)                                                                 \
    switch (mr) {                                                                        \
        case 1: CALL(1); break;                                                          \
        case 2: CALL(2); break;                                                          \
        case 3: CALL(3); break;                                                          \
        case 4: CALL(4); break;                                                          \
        case 5: CALL(5); break;                                                          \
        default: CALL(6); break;                                                         \
    }

/* vf_exp, always inlined (GCC keeps it out of line in the windowed step otherwise). */
static inline __attribute__((always_inline)) vf tiled_exp(vf x) {
    vf_exp_many(&x, 1);
    return x;
}

/* The keys of a run that row ``r`` sees: the first ``valid``, from ``k0`` on under a
 * window (the lanes of vector ``j`` of the run). */
static inline vmask tiled_lanes(int k0, int valid, int j, const int windowed) {
    return windowed ? vm_range(k0 - VW * j, valid - VW * j) : vm_first(valid - VW * j);
}

/* The softmax step of rows ``r0 .. rows - 1`` for a run of ``n`` keys at context row
 * ``t``: row r (token r / G) sees the run's first ``L0 + r / G - t`` keys (under a
 * ``window``, from its first row on). Scores in ``s`` become weights (0 past what a row
 * sees); ``corr`` gets each row's rescale of O. */
static inline __attribute__((always_inline)) void tiled_softmax_of(
        float *s, float *mx, float *den, float *mnew, float *corr, int r0, int rows, int G,
        int L0, int t, int n, int window, const int windowed) {
    for (int r = r0; r < rows; ++r) {
        const int seen = L0 + r / G - t;
        const int valid = seen < n ? seen : n;
        const int k0 = windowed ? window_lo(L0 + r / G, window) - t : 0;
        float m = mx[r];
        for (int j = 0; j < NK; ++j) {
            const vf x = vf_select(tiled_lanes(k0, valid, j, windowed),
                                   vf_load(s + r * TK + VW * j), vf_set1(-INFINITY));
            const float rm = vf_reduce_max(x);
            m = rm > m ? rm : m;
        }
        mnew[r] = m;
    }
    /* The rescales, VW rows at a time (a row's first run has mx = -inf: its O and
     * denominator are still 0, so the clamped exp's tiny value leaves them 0). */
    for (int r = r0; r < rows; r += VW) {
        const int left = rows - r;
        const vf c = tiled_exp(vf_sub(vf_load_first(mx + r, left), vf_load_first(mnew + r, left)));
        vf_store_first(corr + r, left, c);
        vf_store_first(mx + r, left, vf_load_first(mnew + r, left));
    }
    for (int r = r0; r < rows; ++r) {
        const int seen = L0 + r / G - t;
        const int valid = seen < n ? seen : n;
        const int k0 = windowed ? window_lo(L0 + r / G, window) - t : 0;
        const vf m = vf_set1(mx[r]);
        vf sum = vf_zero();
        for (int j = 0; j < NK; ++j) {
            const vf e = vf_select(tiled_lanes(k0, valid, j, windowed),
                                   tiled_exp(vf_sub(vf_load(s + r * TK + VW * j), m)), vf_zero());
            vf_store(s + r * TK + VW * j, e);
            sum = vf_add(sum, e);
        }
        den[r] = den[r] * corr[r] + vf_reduce_add(sum);
    }
}

static inline void tiled_softmax(float *s, float *mx, float *den, float *mnew, float *corr,
                                 int r0, int rows, int G, int L0, int t, int n) {
    tiled_softmax_of(s, mx, den, mnew, corr, r0, rows, G, L0, t, n, 0, 0);
}

/* K's run of ``n`` rows (element offset ``krow``, rows ``stride`` apart) as float32
 * ``kt[d * TK + k]``, zero past n. */
static inline __attribute__((always_inline)) void tiled_transpose(const void *k_cache,
                                                                  const int dtype, int64_t krow,
                                                                  int64_t stride, int n, int D,
                                                                  float *kt) {
    float row[MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int k = 0; k < TK; ++k) {
        if (k < n && dtype == DTYPE_I8) { /* codes times the row's scale */
            const vf ks = vf_set1(row_scale(k_cache, krow + k * stride, D));
            for (int d = 0; d < D; d += VW)
                vf_store_aligned(row + d,
                                 vf_mul(ks, load_vec(k_cache, krow + k * stride + d, dtype)));
        } else if (k < n)
            for (int d = 0; d < D; d += VW)
                vf_store_aligned(row + d, load_vec(k_cache, krow + k * stride + d, dtype));
        else
            memset(row, 0, sizeof(float) * (size_t)D);
        for (int d = 0; d < D; ++d) kt[d * TK + k] = row[d];
    }
}

/* One item of the tiled path: the tile's tokens x every query head of KV heads ``h0 ..
 * h0 + nh - 1``, one KV head at a time. ``scratch``: tiled_scratch_floats(G, D).
 * ``options`` (a compile-time constant, as ``dtype``): sh->window and sh->softcap apply;
 * without, the loops hold no call of the windowed step or of tanhf (either there cost
 * 2-3% of a 512-token prefill, even untaken, when these tiles ran on AVX-512). */
static inline __attribute__((always_inline)) void attend_tiled(const item_t *it,
                                                               const shape_t *sh,
                                                               const int dtype, float *scratch,
                                                               const int options) {
    const int D = sh->head_dim, G = sh->group, T = it->ntok, rows = T * G;
    const int L0 = it->seq_len, L = L0 + T - 1, bs = sh->block_size;
    const int W = options ? sh->window : 0;
    const float cap = options ? sh->softcap : 0.0f;
    const int64_t stride = sh->row_stride;
    float *q = scratch, *o = q + (size_t)rows * D, *p = o + (size_t)rows * D;
    float *mx = p + (size_t)rows * TK, *den = mx + rows, *mnew = den + rows, *corr = mnew + rows;
    float *kt = corr + rows + VW;
    const int nvec = D / VW;
    for (int hh = 0; hh < it->nh; ++hh) {
        for (int r = 0; r < rows; ++r) {
            memcpy(q + (int64_t)r * D, it->query + (r / G) * it->q_stride + (int64_t)(hh * G + r % G) * D,
                   sizeof(float) * (size_t)D);
            mx[r] = -INFINITY;
            den[r] = 0.0f;
        }
        memset(o, 0, sizeof(float) * (size_t)rows * D);
        const int h = it->h0 + hh;
        for (int t = tiled_start(L0, W, bs); t < L;) {
            const tiled_run_t run = tiled_run_at(it, sh, dtype, h, t, W);
            const int n = run.n, r0 = run.r0, r1 = run.r1;
            const int64_t first = run.first;
            tiled_transpose(sh->k_cache, dtype, first, stride, n, D, kt);
            for (int r = r0; r < r1; r += TR) {
                const int mr = r1 - r < TR ? r1 - r : TR;
#define SCORES(MR) tiled_scores(q, kt, p, D, r, sh->scale, MR)
                FOR_TR(mr, SCORES)
#undef SCORES
            }
            if (cap > 0.0f)
                for (int r = r0; r < r1; ++r) softcap_scores(p + r * TK, n, cap);
            if (W > 0)
                tiled_softmax_of(p, mx, den, mnew, corr, r0, r1, G, L0, t, n, W, 1);
            else
                tiled_softmax(p, mx, den, mnew, corr, r0, r1, G, L0, t, n);
            for (int r = r0; r < r1; r += TR) {
                const int mr = r1 - r < TR ? r1 - r : TR;
                for (int v0 = 0; v0 < nvec; v0 += 2) {
                    if (nvec - v0 >= 2) {
#define PV(MR) tiled_pv(sh->v_cache, dtype, first, stride, n, p, corr, o, D, r, v0, MR, 2)
                        FOR_TR(mr, PV)
#undef PV
                    } else {
#define PV(MR) tiled_pv(sh->v_cache, dtype, first, stride, n, p, corr, o, D, r, v0, MR, 1)
                        FOR_TR(mr, PV)
#undef PV
                    }
                }
            }
            t += n;
        }
        for (int r = 0; r < rows; ++r) {
            float *out = it->out + (r / G) * it->out_stride + (int64_t)(hh * G + r % G) * D;
            const vf inv = vf_set1(1.0f / den[r]);
            for (int v = 0; v < nvec; ++v)
                vf_store(out + VW * v, vf_mul(inv, vf_load(o + (int64_t)r * D + VW * v)));
        }
    }
}

#define ATTEND_TILED_BODY attend_tiled
#elif SIMD_VW == 16
#define ATTEND_TILED_BODY attend_tiled16
#endif

#if SIMD_VW
/* The tiles of this build's width: rows across the lanes at 16, keys at 8. */
#define ATTEND_TILED_FOR(name, code)                                                   \
    static __attribute__((noinline)) void name##_options(const item_t *it,            \
                                                         const shape_t *sh,           \
                                                         float *scratch) {            \
        ATTEND_TILED_BODY(it, sh, code, scratch, 1);                                   \
    }                                                                                  \
    static void name(const item_t *it, const shape_t *sh, float *scratch) {            \
        if (sh->window > 0 || sh->softcap > 0.0f)                                      \
            name##_options(it, sh, scratch);                                           \
        else                                                                           \
            ATTEND_TILED_BODY(it, sh, code, scratch, 0);                               \
    }
ATTEND_TILED_FOR(attend_tiled_f32, DTYPE_F32)
ATTEND_TILED_FOR(attend_tiled_bf16, DTYPE_BF16)
ATTEND_TILED_FOR(attend_tiled_f16, DTYPE_F16)
ATTEND_TILED_FOR(attend_tiled_i8, DTYPE_I8)
#endif
