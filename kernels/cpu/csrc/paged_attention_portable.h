/*
 * The portable per-token path of paged_attention_cpu.c (any head_dim, any compiler),
 * kept in its own file for length: included once, after that source's item_t and
 * shape_t, as one translation unit. Also the cache-row loads the tiled path's plain
 * loops use.
 */
/* ------------------------------------------------------------------------- */
/* Portable path (any head_dim, any x86/ARM compiler).                        */
/* ------------------------------------------------------------------------- */

/* The cache row at element offset ``idx`` as ``n`` (head_dim) float32 values: a pointer
 * into the cache itself for float32, else a conversion into ``tmp`` (an int8 row's codes
 * times its scale). */
static inline const float *load_row(const void *cache, int dtype, int64_t idx, int n,
                                    float *tmp) {
    if (dtype == DTYPE_F32) return (const float *)cache + idx;
    if (dtype == DTYPE_I8) {
        const int8_t *src = (const int8_t *)cache + idx;
        const float s = row_scale(cache, idx, n);
#pragma omp simd
        for (int d = 0; d < n; ++d) tmp[d] = s * (float)src[d];
        return tmp;
    }
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)cache + idx;
#pragma omp simd
        for (int d = 0; d < n; ++d) tmp[d] = bf16_f32(src[d]);
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

/* Element offset of context row ``t``, the item's KV head ``hh``, through the table. */
static inline int64_t slot_row(const item_t *it, const shape_t *sh, int t, int hh) {
    return cache_at(sh, it->table[t / sh->block_size], t % sh->block_size, it->h0 + hh);
}

/* One token: its scores of context rows ``lo .. L - 1`` (its window; all ``L`` rows
 * without one), ``n`` a query head, then their softmax-weighted V rows. */
static void attend_portable_token(const item_t *it, const shape_t *sh, int dtype,
                                  float *scores, float *acc, float *tmp) {
    const int D = sh->head_dim, G = sh->group, L = it->seq_len, nq = it->nh * G;
    const int lo = window_lo(L, sh->window), n = L - lo;
    for (int t = lo; t < L; ++t) {
        for (int hh = 0; hh < it->nh; ++hh) {
            const float *k = load_row(sh->k_cache, dtype, slot_row(it, sh, t, hh), D, tmp);
            for (int g = 0; g < G; ++g) {
                const int qh = hh * G + g;
                scores[(int64_t)qh * n + t - lo] =
                    dot(it->query + (int64_t)qh * D, k, D) * sh->scale;
            }
        }
    }
    if (sh->softcap > 0.0f) softcap_scores(scores, nq * n, sh->softcap);
    for (int qh = 0; qh < nq; ++qh) softmax(scores + (int64_t)qh * n, n);
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    for (int t = lo; t < L; ++t) {
        for (int hh = 0; hh < it->nh; ++hh) {
            const float *v = load_row(sh->v_cache, dtype, slot_row(it, sh, t, hh), D, tmp);
            for (int g = 0; g < G; ++g) {
                const int qh = hh * G + g;
                const float p = scores[(int64_t)qh * n + t - lo];
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
