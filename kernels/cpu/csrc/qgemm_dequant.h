/*
 * Dequantization, the part of qgemm_cpu.c that expands weights to float32 (embedding
 * lookups and prefill-sized products), kept in its own file for length only: it is
 * included once, at the end of that source, whose helpers (weight_at, the packed
 * layout's QG, block_codes, codes_in_block, group_head_bytes, group_block_bytes,
 * group_bytes, k_blocks, valid) it uses, so the two form one translation unit.
 * Defines qdequant (from the planes) and qdequant_packed (from qgemm_pack's copy), which
 * give the same bits.
 */
#if SIMD_VW
#define NVB (QK / SIMD_VW) /* vectors in a block */

/* One block's codes as float32, unscaled. */
static inline __attribute__((always_inline)) void load_codes(int fmt, const uint8_t *q, vf *c) {
    if (fmt == QF_Q8_0 || fmt == QF_INT8) {
        for (int v = 0; v < NVB; ++v) c[v] = vf_load_i8((const int8_t *)q + v * SIMD_VW);
    } else {
        vf_load_nibbles32(q, c);
    }
}
#endif

/* One GGUF block (its code bytes at ``q`` in the planes' order, its scale's and
 * offset's float16 bits ``db``/``mb``) dequantized into ``o``: each weight as
 * weight_at makes it (the product rounded, then the offset, Q4_0's -8 included). */
static inline void dequant_gguf_block(int fmt, const uint8_t *q, uint16_t db, uint16_t mb,
                                      float *o) {
#if SIMD_VW
    vf c[NVB];
    load_codes(fmt, q, c);
    const vf dv = vf_set1(f16_to_f32_fast(db));
    for (int v = 0; v < NVB; ++v) {
        vf w = fmt == QF_Q4_0 ? vf_sub(c[v], vf_set1(8.0f)) : c[v];
        w = vf_mul(dv, w);
        if (fmt == QF_Q4_1) w = vf_add(w, vf_set1(f16_to_f32_fast(mb)));
        vf_store(o + v * SIMD_VW, w);
    }
#else
    for (int i = 0; i < QK; ++i) o[i] = weight_at(fmt, q, &db, &mb, i);
#endif
}

typedef struct {
    int fmt;
    const void *qs;
    const uint16_t *d, *mn;
    const float *scale;
    int64_t k;
    const int64_t *rows;
    float *out;
} qdequant_task_t;

static void qdequant_rows(void *ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    const qdequant_task_t *t = ctx;
    const int fmt = t->fmt;
    const int64_t k = t->k, rb = row_bytes(fmt, k), nb = k / QK;
    const void *qs = t->qs;
    const uint16_t *d = t->d, *mn = t->mn;
    const float *scale = t->scale;
    const int64_t *rows = t->rows;
    float *out = t->out;
    if (is_blk(fmt)) {
        blk_dequant_rows(fmt, qs, k, rows, i0, i1, out);
        return;
    }
    for (int64_t i = i0; i < i1; ++i) {
        const int64_t j = rows ? rows[i] : i;
        const uint8_t *q = (const uint8_t *)qs + j * rb;
        float *o = out + i * k;
        if (fmt == QF_INT8) {
            for (int64_t kk = 0; kk < k; ++kk) o[kk] = (float)((const int8_t *)q)[kk] * scale[j];
            continue;
        }
        const uint16_t *dq = d + j * nb, *mq = mn ? mn + j * nb : 0;
        for (int64_t b = 0; b < nb; ++b)
            dequant_gguf_block(fmt, q + b * block_codes(fmt), dq[b], mq ? mq[b] : 0,
                               o + b * QK);
    }
}

/* Rows ``rows[0 .. count)`` of W dequantized to float32 into ``out`` ``[count, k]``
 * (embedding lookups and prefill-sized products; ``rows`` NULL: rows 0 .. count). */
int qdequant(int fmt, const void *qs, const uint16_t *d, const uint16_t *mn,
             const float *scale, int64_t k, const int64_t *rows, int64_t count, float *out,
             int num_threads) {
    if ((fmt & QFLAG_I8A) && i8_valid_fmt(fmt)) fmt = i8_base(fmt); /* the planes are the format's */
    if (!valid(fmt, 1, k)) return -1;
    const int nt = count * k >= (1 << 18) && num_threads > 1 ? num_threads : 1;
    qdequant_task_t task = {fmt, qs, d, mn, scale, k, rows, out};
    pool_run(qdequant_rows, &task, count, (count + 4 * nt - 1) / (4 * nt), nt);
    return 0;
}

typedef struct {
    int fmt;
    const uint8_t *packed;
    int64_t n, k;
    const int64_t *rows;
    float *out;
} qdequant_packed_task_t;

/* Column ``c``'s block at ``bo`` (a block of its group in the packed copy; ``q``: its
 * ``have`` codes in the planes' order, ``s``: INT8's column scale) into ``o``. */
static inline void dequant_packed_column(int fmt, const uint8_t *bo, int c, const uint8_t *q,
                                         int have, float s, float *o) {
    if (fmt == QF_INT8) {
        for (int x = 0; x < have; ++x) o[x] = (float)(int8_t)q[x] * s;
        return;
    }
    const int64_t codes = (int64_t)block_codes(fmt) * QG;
    uint16_t db, mb = 0;
    memcpy(&db, bo + codes + 2 * c, sizeof db);
    if (fmt == QF_Q4_1) memcpy(&mb, bo + codes + 2 * (QG + c), sizeof mb);
    dequant_gguf_block(fmt, q, db, mb, o);
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* The 8x8 bytes at ``src`` (rows ``ss`` apart) transposed to ``dst`` (rows ``ds``
 * apart): three rounds of interleaving, bytes, then pairs, then quads. */
static inline void transpose_8x8_bytes(const uint8_t *src, int64_t ss, uint8_t *dst,
                                       int64_t ds) {
    __m128i r[8], a[4], b[4];
    for (int i = 0; i < 8; ++i) r[i] = _mm_loadl_epi64((const __m128i *)(src + i * ss));
    for (int i = 0; i < 4; ++i) a[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    b[0] = _mm_unpacklo_epi16(a[0], a[1]); /* columns 0-3 of rows 0-3 */
    b[1] = _mm_unpackhi_epi16(a[0], a[1]); /* columns 4-7 of rows 0-3 */
    b[2] = _mm_unpacklo_epi16(a[2], a[3]); /* columns 0-3 of rows 4-7 */
    b[3] = _mm_unpackhi_epi16(a[2], a[3]);
    const __m128i c[4] = {_mm_unpacklo_epi32(b[0], b[2]), _mm_unpackhi_epi32(b[0], b[2]),
                          _mm_unpacklo_epi32(b[1], b[3]), _mm_unpackhi_epi32(b[1], b[3])};
    for (int i = 0; i < 4; ++i) { /* columns 2i and 2i + 1 */
        _mm_storel_epi64((__m128i *)(dst + 2 * i * ds), c[i]);
        _mm_storel_epi64((__m128i *)(dst + (2 * i + 1) * ds), _mm_unpackhi_epi64(c[i], c[i]));
    }
}
#endif

/* Every column's codes of a group's block ``bo`` (its rows of QG bytes, as many as the
 * block holds: a multiple of 8) into ``q`` (QK bytes a column, the planes' order). */
static void gather_group_block(int fmt, const uint8_t *bo, uint8_t q[QG][QK]) {
    const int rows = block_codes(fmt);
#if defined(__SSE2__)
    for (int i0 = 0; i0 < rows; i0 += 8)
        for (int c0 = 0; c0 < QG; c0 += 8)
            transpose_8x8_bytes(bo + (int64_t)i0 * QG + c0, QG, &q[c0][i0], QK);
#else
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < QG; ++c) q[c][i] = bo[(int64_t)i * QG + c];
#endif
}

/* Rows of W by groups of QG (all of W's rows: prefill-sized products). */
static void qdequant_packed_groups(void *ctx, int64_t g0, int64_t g1, int worker) {
    (void)worker;
    const qdequant_packed_task_t *t = ctx;
    const int fmt = t->fmt;
    const int64_t k = t->k, nb = k_blocks(fmt, k), bb = group_block_bytes(fmt);
    const int64_t gb = group_bytes(fmt, k);
    uint8_t q[QG][QK];
    for (int64_t g = g0; g < g1; ++g) {
        const int cols = t->n - g * QG < QG ? (int)(t->n - g * QG) : QG;
        if (is_blk(fmt)) {
            for (int c = 0; c < cols; ++c)
                blk_dequant_packed_column(fmt, t->packed + g * gb, k, c, t->out + (g * QG + c) * k);
            continue;
        }
        const uint8_t *grp = t->packed + g * gb, *blocks = grp + group_head_bytes(fmt);
        float s[QG] = {0};
        if (fmt == QF_INT8) memcpy(s, grp, sizeof(float) * (size_t)cols);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *bo = blocks + b * bb;
            gather_group_block(fmt, bo, q);
            for (int c = 0; c < cols; ++c)
                dequant_packed_column(fmt, bo, c, q[c], codes_in_block(fmt, k, b), s[c],
                                      t->out + (g * QG + c) * k + b * QK);
        }
    }
}

/* Rows ``rows[i0 .. i1)`` of W one at a time (embedding lookups). */
static void qdequant_packed_rows(void *ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    const qdequant_packed_task_t *t = ctx;
    const int fmt = t->fmt;
    const int64_t k = t->k, nb = k_blocks(fmt, k), bb = group_block_bytes(fmt);
    const int64_t gb = group_bytes(fmt, k);
    for (int64_t i = i0; i < i1; ++i) {
        const int64_t j = t->rows[i];
        const int c = (int)(j % QG);
        const uint8_t *grp = t->packed + j / QG * gb, *blocks = grp + group_head_bytes(fmt);
        if (is_blk(fmt)) {
            blk_dequant_packed_column(fmt, grp, k, c, t->out + i * k);
            continue;
        }
        float s = 0.0f;
        if (fmt == QF_INT8) memcpy(&s, grp + sizeof(float) * (size_t)c, sizeof s);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *bo = blocks + b * bb;
            const int have = codes_in_block(fmt, k, b);
            uint8_t q[QK];
            for (int x = 0; x < have; ++x) q[x] = bo[x * QG + c];
            dequant_packed_column(fmt, bo, c, q, have, s, t->out + i * k + b * QK);
        }
    }
}

/* qdequant from W's packed copy (qgemm_pack's, ``[n, k]``; ``rows`` NULL: all n rows,
 * ``count`` == n): the same values, bit for bit. Returns -1 for a bad format or shape,
 * -3 for a row outside 0 .. n - 1 (or a count other than n without rows). */
/* Rows ``i0 .. i1`` of the result from an 8-bit-activation layout (qgemm_i8.h). */
static void qdequant_i8_rows(void *ctx, int64_t i0, int64_t i1, int worker) {
    (void)worker;
    const qdequant_packed_task_t *t = ctx;
    for (int64_t i = i0; i < i1; ++i)
        i8_dequant_row(t->fmt, t->packed, t->k, t->rows ? t->rows[i] : i, t->out + i * t->k);
}

int qdequant_packed(int fmt, const void *packed, int64_t n, int64_t k, const int64_t *rows,
                    int64_t count, float *out, int num_threads) {
    if (fmt & QFLAG_I8A ? !i8_valid(fmt, n, k) : !valid(fmt, n, k)) return -1;
    if (rows == NULL && count != n) return -3;
    for (int64_t i = 0; rows != NULL && i < count; ++i)
        if (rows[i] < 0 || rows[i] >= n) return -3;
    const int nt = count * k >= (1 << 18) && num_threads > 1 ? num_threads : 1;
    qdequant_packed_task_t task = {fmt, packed, n, k, rows, out};
    if (fmt & QFLAG_I8A) {
        pool_run(qdequant_i8_rows, &task, count, (count + 4 * nt - 1) / (4 * nt), nt);
    } else if (rows == NULL) {
        const int64_t groups = (n + QG - 1) / QG;
        pool_run(qdequant_packed_groups, &task, groups, (groups + 4 * nt - 1) / (4 * nt), nt);
    } else {
        pool_run(qdequant_packed_rows, &task, count, (count + 4 * nt - 1) / (4 * nt), nt);
    }
    return 0;
}
