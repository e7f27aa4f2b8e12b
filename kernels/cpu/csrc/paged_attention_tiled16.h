/*
 * The tiled prefill path at 16 lanes (AVX-512 builds), kept in its own file for length:
 * included once, by paged_attention_tiled.h after its run helper (tiled_run_at).
 *
 * The query rows of a tile lie across the lanes: a row vector holds 16 rows (tokens x
 * the query heads sharing one KV head), with Q and O stored transposed (``[D][16]`` a
 * row vector). For each run of TK keys of one block:
 *
 *   S^T = K Q^T  (TK vectors): for each d, one vector of Q^T times a broadcast of each
 *                key's element d; no transposed copy of K;
 *   softmax      each row's maximum over the run's keys is a vertical maximum of the TK
 *                vectors, each exp covers 16 rows, and the rescale of O is one vector a
 *                row vector: no reductions across lanes;
 *   O^T += V^T P^T, for each d a broadcast of each key's V element times its P vector,
 *                the TK weights staying in registers from the softmax on.
 *
 * The 8-lane builds keep paged_attention_tiled.h's tiles (rows as broadcasts, keys
 * across the lanes), where the TK score vectors would fill the register file. Q is
 * scaled before the products (the 8-lane tiles scale the scores), and an int8 cache's V
 * scales multiply V's rows (there: the weights), so the two differ in rounding.
 */

/* Elements of O's head dim a pass over the run's keys accumulates (each its own chain). */
#define T16_DB 8

/* Floats of scratch: Q^T and O^T, the maxima, denominators and token of each lane (rows
 * rounded up to 16), the run's K and V rows, one row vector's output, and alignment. */
static size_t tiled16_scratch_floats(int group, int head_dim) {
    const size_t lanes = ((size_t)TILED_TILE * group + 15) / 16 * 16;
    return lanes * (2 * (size_t)head_dim + 3) + (2 * TK + 16) * (size_t)head_dim + 16;
}

/* One item of the tiled path at 16 lanes (paged_attention_tiled.h's attend_tiled: the
 * same tile, runs, masks and options). ``D`` is the head dim, a compile-time constant in
 * the common cases (attend_tiled16), so that each key's row is a constant offset. */
static inline __attribute__((always_inline)) void attend_tiled16_dim(const item_t *it,
                                                                     const shape_t *sh,
                                                                     const int dtype,
                                                                     float *scratch,
                                                                     const int options,
                                                                     const int D) {
    const int G = sh->group, T = it->ntok, rows = T * G;
    const int nrv = (rows + 15) / 16;
    const int L0 = it->seq_len, L = L0 + T - 1, bs = sh->block_size;
    const int W = options ? sh->window : 0;
    const float cap = options ? sh->softcap : 0.0f;
    const int64_t stride = sh->row_stride;
    float *qt = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *ot = qt + (size_t)nrv * D * 16, *mx = ot + (size_t)nrv * D * 16;
    float *den = mx + nrv * 16, *tok = den + nrv * 16, *krun = tok + nrv * 16;
    float *vrun = krun + (size_t)TK * D, *tr = vrun + (size_t)TK * D;
    for (int hh = 0; hh < it->nh; ++hh) {
        /* Q^T times the scale; each lane's token (lanes past the rows: one that sees no
         * key of any run). */
        for (int r = 0; r < nrv * 16; ++r) {
            float *col = qt + (size_t)(r / 16) * D * 16 + r % 16;
            if (r < rows) {
                const float *src = it->query + (r / G) * it->q_stride + (int64_t)(hh * G + r % G) * D;
                for (int d = 0; d < D; ++d) col[d * 16] = src[d] * sh->scale;
            } else {
                for (int d = 0; d < D; ++d) col[d * 16] = 0.0f;
            }
            tok[r] = r < rows ? (float)(r / G) : -1e9f;
            mx[r] = -INFINITY;
            den[r] = 0.0f;
        }
        memset(ot, 0, sizeof(float) * (size_t)nrv * D * 16);
        const int h = it->h0 + hh;
        for (int t = tiled_start(L0, W, bs); t < L;) {
            const tiled_run_t run = tiled_run_at(it, sh, dtype, h, t, W);
            const int n = run.n, r0 = run.r0, r1 = run.r1;
            const int64_t first = run.first;
            /* The run's K and V rows in float32 (int8: times their scales), zero past n. */
            for (int k = 0; k < TK; ++k) {
                float *kr = krun + (size_t)k * D, *vr = vrun + (size_t)k * D;
                if (k >= n) {
                    memset(kr, 0, sizeof(float) * (size_t)D);
                    memset(vr, 0, sizeof(float) * (size_t)D);
                    continue;
                }
                const int64_t row = first + k * stride;
                const vf ks = vf_set1(dtype == DTYPE_I8 ? row_scale(sh->k_cache, row, D) : 1.0f);
                const vf vs = vf_set1(dtype == DTYPE_I8 ? row_scale(sh->v_cache, row, D) : 1.0f);
                for (int d = 0; d < D; d += VW) {
                    vf kv = load_vec(sh->k_cache, row + d, dtype);
                    vf vv = load_vec(sh->v_cache, row + d, dtype);
                    if (dtype == DTYPE_I8) {
                        kv = vf_mul(ks, kv);
                        vv = vf_mul(vs, vv);
                    }
                    vf_store_aligned(kr + d, kv);
                    vf_store_aligned(vr + d, vv);
                }
            }
            for (int rv = r0 / 16; rv < (r1 + 15) / 16; ++rv) {
                const float *q = qt + (size_t)rv * D * 16;
                vf s[TK];
                for (int k = 0; k < TK; ++k) s[k] = vf_zero();
                for (int d = 0; d < D; ++d) {
                    const vf qd = vf_load_aligned(q + d * 16);
                    for (int k = 0; k < TK; ++k)
                        s[k] = vf_fmadd(vf_set1(krun[(size_t)k * D + d]), qd, s[k]);
                }
                if (cap > 0.0f) {
                    float c[16] __attribute__((aligned(64)));
                    for (int k = 0; k < n; ++k) {
                        vf_store_aligned(c, s[k]);
                        softcap_scores(c, 16, cap);
                        s[k] = vf_load_aligned(c);
                    }
                }
                /* Lane r sees key k of the run when k < L0 + token - t (its own position
                 * and before) and k < n; under a window, from its first row on. */
                const vf tk = vf_load_aligned(tok + rv * 16);
                const vf seen = vf_add(tk, vf_set1((float)(L0 - t)));
                const vf lo = W > 0 ? vf_sub(vf_max(vf_add(tk, vf_set1((float)(L0 - W))), vf_zero()),
                                             vf_set1((float)t))
                                    : vf_zero();
                vmask vis[TK];
                vf m = vf_set1(-INFINITY);
                for (int k = 0; k < TK; ++k) {
                    const vf kf = vf_set1((float)k);
                    vis[k] = k < n ? vm_gt(seen, kf) : 0;
                    if (W > 0) vis[k] = vis[k] & (vmask)~vm_gt(lo, kf);
                    m = vf_max(m, vf_select(vis[k], s[k], vf_set1(-INFINITY)));
                }
                const vf m_old = vf_load_aligned(mx + rv * 16), m_new = vf_max(m_old, m);
                /* A lane that has seen no key yet keeps -inf; its exps are taken against 0
                 * (and masked). Its O and denominator are 0, so its rescale's clamped tiny
                 * value leaves them 0. */
                const vf m_ref = vf_select(vm_gt(m_new, vf_set1(-INFINITY)), m_new, vf_zero());
                const vf corr = vf_exp(vf_sub(m_old, m_ref));
                for (int k = 0; k < TK; ++k) s[k] = vf_sub(s[k], m_ref);
                vf_exp_array(s, TK);
                vf sum = vf_zero();
                for (int k = 0; k < TK; ++k) {
                    s[k] = vf_select(vis[k], s[k], vf_zero());
                    sum = vf_add(sum, s[k]);
                }
                vf_store_aligned(den + rv * 16, vf_fmadd(vf_load_aligned(den + rv * 16), corr, sum));
                vf_store_aligned(mx + rv * 16, m_new);
                float *o = ot + (size_t)rv * D * 16;
                for (int d0 = 0; d0 < D; d0 += T16_DB) {
                    vf acc[T16_DB];
                    for (int j = 0; j < T16_DB; ++j)
                        acc[j] = vf_mul(corr, vf_load_aligned(o + (d0 + j) * 16));
                    for (int k = 0; k < TK; ++k)
                        for (int j = 0; j < T16_DB; ++j)
                            acc[j] = vf_fmadd(s[k], vf_set1(vrun[(size_t)k * D + d0 + j]), acc[j]);
                    for (int j = 0; j < T16_DB; ++j) vf_store_aligned(o + (d0 + j) * 16, acc[j]);
                }
            }
            t += n;
        }
        /* O / the denominator, transposed back to the rows. */
        for (int rv = 0; rv < nrv; ++rv) {
            const vf inv = vf_div(vf_set1(1.0f), vf_load_aligned(den + rv * 16));
            for (int d = 0; d < D; ++d)
                vf_store_aligned(tr + d * 16, vf_mul(inv, vf_load_aligned(ot + ((size_t)rv * D + d) * 16)));
            for (int l = 0; l < 16 && rv * 16 + l < rows; ++l) {
                const int r = rv * 16 + l;
                float *out = it->out + (r / G) * it->out_stride + (int64_t)(hh * G + r % G) * D;
                for (int d = 0; d < D; ++d) out[d] = tr[d * 16 + l];
            }
        }
    }
}

static inline __attribute__((always_inline)) void attend_tiled16(const item_t *it,
                                                                 const shape_t *sh,
                                                                 const int dtype,
                                                                 float *scratch,
                                                                 const int options) {
    if (sh->head_dim == 64)
        attend_tiled16_dim(it, sh, dtype, scratch, options, 64);
    else if (sh->head_dim == 128)
        attend_tiled16_dim(it, sh, dtype, scratch, options, 128);
    else
        attend_tiled16_dim(it, sh, dtype, scratch, options, sh->head_dim);
}
