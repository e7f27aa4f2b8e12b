/*
 * The block formats of qgemm_cpu.c (QF_Q5_0, QF_Q5_1, QF_Q4_K, QF_Q5_K, QF_Q6_K), kept in
 * their own file for length only: included once by that source, after its packed
 * layout's helpers (QG, f16_bits_to_f32), so the two form one translation unit.
 *
 * Their one plane is the weight's rows as GGML blocks, byte for byte as a GGUF file
 * stores them (QB_* bytes a block; QK weights a block for Q5_0/Q5_1, QK_K for the
 * K-quants):
 *
 *   Q5_0  {f16 d; u8 qh[4]; u8 qs[16]}         w = d * (q - 16)
 *   Q5_1  {f16 d, m; u8 qh[4]; u8 qs[16]}      w = d * q + m
 *   Q4_K  {f16 d, dmin; u8 scales[12]; u8 qs[128]}             w = (d sc) q - (dmin mn)
 *   Q5_K  {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}  the same, 5-bit q
 *   Q6_K  {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}        w = (d sc) (q - 32)
 *
 * (see kernels/quant.py's dequantize_blocks for where each code's bits lie). The
 * K-quants' sub-blocks are 32 weights (Q4_K, Q5_K: 6-bit scale sc and min mn packed in
 * 12 bytes) or 16 (Q6_K: int8 scales).
 *
 * The packed copy keeps qgemm_cpu.c's groups of QG output columns: per block, the
 * columns' float16 scales side by side, then each byte array of the block (sub-block
 * scales, high bits, codes) as rows of QG bytes, byte i of every column side by side,
 * in the order the product reads them (BO_*: a block is read front to back; Q6_K's ql
 * and qh rows interleaved, q6k_row). The K-quants' 12 bytes of 6-bit scales and mins
 * are unpacked to one byte each (16 bytes a column's block, 4 more than the file's: 148
 * bytes for Q4_K's 144, 180 for Q5_K's 176); every other byte is the file's, so a
 * packed weight is within 3% of its bytes in the file. Q5_0/Q5_1's qh stays one
 * little-endian uint32 a column.
 *
 * Products: per sub-block, chains of sums of x times the codes (integers as float32),
 * then multiplied by the sub-block's float32 scale (``d * sc``, rounded as the reference
 * rounds it), and the offset's share added as the offset times the sum of x over the
 * sub-block (Q5_0's -16 d, Q6_K's -32 d sc, the K-quants' -dmin mn): as qgemm_cpu.c does
 * for Q4_0/Q4_1, so every code costs one multiply-add a row, the scales one a sub-block.
 * Each row's sums are the same operations whatever the tile of rows it is in.
 * Dequantization gives the reference's bits (blk_dequant_raw).
 */

/* Weights of one block. */
static inline int blk_weights(int fmt) { return fmt == QF_Q5_0 || fmt == QF_Q5_1 ? QK : QK_K; }

/* Bytes of one block in the plane (the file's). */
static inline int blk_bytes(int fmt) {
    switch (fmt) {
    case QF_Q5_0: return QB_Q5_0;
    case QF_Q5_1: return QB_Q5_1;
    case QF_Q4_K: return QB_Q4_K;
    case QF_Q5_K: return QB_Q5_K;
    default: return QB_Q6_K;
    }
}

/* Offsets in a group's block, in units of QG bytes (rows of the group's byte arrays),
 * in the order the products read them: the float16 scales d (and m / dmin), the
 * K-quants' sub-block scales (and mins), the high bits (Q5_0/Q5_1: a uint32 a column;
 * Q5_K, Q6_K: rows of bytes), then the codes (the low 4 bits). */
#define BO_D(fmt) 0
#define BO_M(fmt) 2
#define BO_SC(fmt) ((fmt) == QF_Q6_K ? 2 : 4)
#define BO_MN(fmt) (BO_SC(fmt) + 8)
#define BO_QH(fmt) ((fmt) == QF_Q5_0 ? 2 : (fmt) == QF_Q5_1 ? 4 : 20)
#define BO_Q(fmt)                                                                          \
    ((fmt) == QF_Q5_0 ? 6 : (fmt) == QF_Q5_1 ? 8 : (fmt) == QF_Q4_K ? 20                   \
                                                  : (fmt) == QF_Q5_K ? 52 : 18)

/* Bytes of one column's block in the packed copy. */
static inline int blk_packed_bytes(int fmt) {
    switch (fmt) {
    case QF_Q5_0: return 22;
    case QF_Q5_1: return 24;
    case QF_Q4_K: return 148;
    case QF_Q5_K: return 180;
    default: return 210;
    }
}

/* Weights a sum of x covers (the sub-block an offset multiplies). */
static inline int blk_sum_width(int fmt) { return fmt == QF_Q6_K ? 16 : QK; }

/* The 6-bit scales and mins of a Q4_K/Q5_K block's 12 bytes (GGML's get_scale_min_k4). */
static inline void scale_min_k4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* scale_min_k4 undone: the 12 bytes of 8 scales and mins. */
static inline void pack_scale_min_k4(const uint8_t sc[8], const uint8_t mn[8], uint8_t *s) {
    for (int j = 0; j < 4; ++j) {
        s[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)(mn[j] | ((mn[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4));
    }
}

/* Byte arrays of a block: (offset in the file's block, offset in the packed block in
 * rows of QG, bytes); float16 scales are listed apart. */
typedef struct {
    int raw, rows, len;
} blk_array_t;

/* The byte arrays of ``fmt``'s block copied as they are (the K-quants' 12 bytes of
 * scales and their float16 scales apart); returns their count. */
static int blk_arrays(int fmt, blk_array_t a[3]) {
    switch (fmt) {
    case QF_Q5_0: a[0] = (blk_array_t){6, BO_Q(QF_Q5_0), 16}; return 1;
    case QF_Q5_1: a[0] = (blk_array_t){8, BO_Q(QF_Q5_1), 16}; return 1;
    case QF_Q4_K: a[0] = (blk_array_t){16, BO_Q(QF_Q4_K), 128}; return 1;
    case QF_Q5_K:
        a[0] = (blk_array_t){48, BO_Q(QF_Q5_K), 128};
        a[1] = (blk_array_t){16, BO_QH(QF_Q5_K), 32};
        return 2;
    default: /* codes: q6k_row */
        a[0] = (blk_array_t){192, BO_SC(QF_Q6_K), 16};
        return 1;
    }
}

/* Q6_K's code bytes in the packed block, in the order the product reads them: for each
 * half h and each l < 32, ql[64h + l], ql[64h + 32 + l] and qh[32h + l] (``which`` 0, 1,
 * 2) in three consecutive rows. Returns the row of the file's byte ``i`` (0 .. 191:
 * ql then qh). */
static inline int q6k_row(int i) {
    if (i < 128) return BO_Q(QF_Q6_K) + 96 * (i / 64) + 3 * (i % 32) + (i % 64) / 32;
    return BO_Q(QF_Q6_K) + 96 * ((i - 128) / 32) + 3 * ((i - 128) % 32) + 2;
}

/* Offsets of the float16 scales in the file's block: d, then m / dmin (-1: none). */
static inline int blk_raw_d(int fmt) { return fmt == QF_Q6_K ? 208 : 0; }
static inline int blk_raw_m(int fmt) {
    return fmt == QF_Q5_1 || fmt == QF_Q4_K || fmt == QF_Q5_K ? 2 : -1;
}

/* Column ``c``'s block ``r`` (the file's bytes) into the group's block ``bo``. */
static void blk_pack_column(int fmt, const uint8_t *r, int c, uint8_t *bo) {
    blk_array_t a[3];
    const int na = blk_arrays(fmt, a);
    for (int x = 0; x < na; ++x)
        for (int i = 0; i < a[x].len; ++i) bo[(int64_t)(a[x].rows + i) * QG + c] = r[a[x].raw + i];
    if (fmt == QF_Q6_K)
        for (int i = 0; i < 192; ++i) bo[(int64_t)q6k_row(i) * QG + c] = r[i];
    if (fmt == QF_Q5_0 || fmt == QF_Q5_1)
        memcpy(bo + (int64_t)BO_QH(fmt) * QG + 4 * c, r + (fmt == QF_Q5_0 ? 2 : 4), 4);
    if (fmt == QF_Q4_K || fmt == QF_Q5_K) {
        uint8_t sc[8], mn[8];
        scale_min_k4(r + 4, sc, mn);
        for (int j = 0; j < 8; ++j) {
            bo[(int64_t)(BO_SC(fmt) + j) * QG + c] = sc[j];
            bo[(int64_t)(BO_MN(fmt) + j) * QG + c] = mn[j];
        }
    }
    memcpy(bo + (int64_t)BO_D(fmt) * QG + 2 * c, r + blk_raw_d(fmt), 2);
    if (blk_raw_m(fmt) >= 0) memcpy(bo + (int64_t)BO_M(fmt) * QG + 2 * c, r + blk_raw_m(fmt), 2);
}

/* blk_pack_column undone: column ``c``'s block of the group's block ``bo`` as the
 * file's bytes, into ``r``. */
static void blk_unpack_column(int fmt, const uint8_t *bo, int c, uint8_t *r) {
    blk_array_t a[3];
    const int na = blk_arrays(fmt, a);
    for (int x = 0; x < na; ++x)
        for (int i = 0; i < a[x].len; ++i) r[a[x].raw + i] = bo[(int64_t)(a[x].rows + i) * QG + c];
    if (fmt == QF_Q6_K)
        for (int i = 0; i < 192; ++i) r[i] = bo[(int64_t)q6k_row(i) * QG + c];
    if (fmt == QF_Q5_0 || fmt == QF_Q5_1)
        memcpy(r + (fmt == QF_Q5_0 ? 2 : 4), bo + (int64_t)BO_QH(fmt) * QG + 4 * c, 4);
    if (fmt == QF_Q4_K || fmt == QF_Q5_K) {
        uint8_t sc[8], mn[8];
        for (int j = 0; j < 8; ++j) {
            sc[j] = bo[(int64_t)(BO_SC(fmt) + j) * QG + c];
            mn[j] = bo[(int64_t)(BO_MN(fmt) + j) * QG + c];
        }
        pack_scale_min_k4(sc, mn, r + 4);
    }
    memcpy(r + blk_raw_d(fmt), bo + (int64_t)BO_D(fmt) * QG + 2 * c, 2);
    if (blk_raw_m(fmt) >= 0) memcpy(r + blk_raw_m(fmt), bo + (int64_t)BO_M(fmt) * QG + 2 * c, 2);
}

static inline float blk_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_bits_to_f32(h);
}

/* The integer codes of one block ``r`` (the file's bytes) in element order: Q5_0/Q5_1
 * and the K-quants 0-31 (Q4_K 0-15), Q6_K 0-63, before any offset. */
static void blk_codes_raw(int fmt, const uint8_t *r, int *q) {
    if (fmt == QF_Q5_0 || fmt == QF_Q5_1) {
        uint32_t qh;
        memcpy(&qh, r + (fmt == QF_Q5_1 ? 4 : 2), 4);
        const uint8_t *qs = r + (fmt == QF_Q5_1 ? 8 : 6);
        for (int j = 0; j < 16; ++j) {
            q[j] = (qs[j] & 0x0F) | (int)((qh >> j) & 1u) << 4;
            q[j + 16] = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
        }
        return;
    }
    if (fmt == QF_Q4_K || fmt == QF_Q5_K) {
        const uint8_t *qh = r + 16, *qs = r + (fmt == QF_Q5_K ? 48 : 16);
        for (int s = 0; s < 8; ++s)
            for (int l = 0; l < 32; ++l) {
                const uint8_t byte = qs[32 * (s / 2) + l];
                int v = s & 1 ? byte >> 4 : byte & 0x0F;
                if (fmt == QF_Q5_K) v |= ((qh[l] >> s) & 1) << 4;
                q[32 * s + l] = v;
            }
        return;
    }
    const uint8_t *ql = r, *qh = r + 128;
    for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t)
            for (int l = 0; l < 32; ++l) {
                const int lo = (ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 0x0F;
                const int hi = (qh[32 * h + l] >> (2 * t)) & 3;
                q[128 * h + 32 * t + l] = lo | hi << 4;
            }
}

/* One block ``r`` (the file's bytes) dequantized into ``o`` (blk_weights floats), as
 * GGML's reference does it: the products rounded, then the offsets subtracted or added
 * (C11: no contraction into FMAs). */
static void blk_dequant_raw(int fmt, const uint8_t *r, float *o) {
    int q[QK_K];
    blk_codes_raw(fmt, r, q);
    if (fmt == QF_Q5_0 || fmt == QF_Q5_1) {
        const float d = blk_f16(r), m = fmt == QF_Q5_1 ? blk_f16(r + 2) : 0.0f;
        for (int i = 0; i < QK; ++i) o[i] = fmt == QF_Q5_1 ? d * (float)q[i] + m : d * (float)(q[i] - 16);
        return;
    }
    if (fmt == QF_Q4_K || fmt == QF_Q5_K) {
        const float d = blk_f16(r), dmin = blk_f16(r + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(r + 4, sc, mn);
        for (int s = 0; s < 8; ++s) {
            const float a = d * (float)sc[s], b = dmin * (float)mn[s];
            for (int l = 0; l < 32; ++l) o[32 * s + l] = a * (float)q[32 * s + l] - b;
        }
        return;
    }
    const float d = blk_f16(r + 208);
    const int8_t *scales = (const int8_t *)(r + 192);
    for (int i = 0; i < QK_K; ++i) o[i] = d * (float)scales[i / 16] * (float)(q[i] - 32);
}

/* qgemm_pack of a block format's group ``g`` into ``go``: ``raw`` the plane (rows of
 * blocks). */
static void blk_pack_group(int fmt, const uint8_t *raw, int64_t n, int64_t k, int64_t g,
                           uint8_t *go) {
    const int64_t nb = k / blk_weights(fmt), rb = nb * blk_bytes(fmt);
    const int64_t bb = (int64_t)blk_packed_bytes(fmt) * QG;
    const int cols = n - g * QG < QG ? (int)(n - g * QG) : QG;
    for (int64_t b = 0; b < nb; ++b)
        for (int c = 0; c < cols; ++c)
            blk_pack_column(fmt, raw + (g * QG + c) * rb + b * blk_bytes(fmt), c, go + b * bb);
}

#if !SIMD_VW
/* ------------------------------------------------------------------------- */
/* Portable path: each column's block dequantized (blk_dequant_raw), then its   */
/* dot product with each row of a tile of up to 8 rows, in four chains.        */
/* ------------------------------------------------------------------------- */
static void blk_group_rows(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                           const float *sx, const uint8_t *grp, const float *bias, float *y,
                           int64_t ldy, int cols) {
    (void)sx;
    const int bw = blk_weights(fmt);
    const int64_t nb = k / bw, bb = (int64_t)blk_packed_bytes(fmt) * QG;
    uint8_t raw[QB_Q6_K];
    float w[QK_K];
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
        const int rt = m - r0 < 8 ? (int)(m - r0) : 8;
        float acc[8][QG] = {{0}};
        for (int64_t b = 0; b < nb; ++b)
            for (int c = 0; c < cols; ++c) {
                blk_unpack_column(fmt, grp + b * bb, c, raw);
                blk_dequant_raw(fmt, raw, w);
                for (int r = 0; r < rt; ++r) {
                    const float *xb = x + (r0 + r) * ldx + b * bw;
                    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    for (int i = 0; i < bw; ++i) s[i & 3] += xb[i] * w[i];
                    acc[r][c] += (s[0] + s[1]) + (s[2] + s[3]);
                }
            }
        for (int r = 0; r < rt; ++r)
            for (int c = 0; c < cols; ++c)
                y[(r0 + r) * ldy + c] = acc[r][c] + (bias ? bias[c] : 0.0f);
    }
}
#else
/* ------------------------------------------------------------------------- */
/* Vector path: lane c is column c of the group.                              */
/* ------------------------------------------------------------------------- */
#if SIMD_VW == 16
#define BRT 4
#else
#define BRT 2
#endif

/* Blocks ahead of the one multiplied whose lines are fetched into L2. */
#define BLK_PREFETCH 4

/* The lines of quarter ``q`` (-1: all) of the group's block at ``ahead`` (the block
 * BLK_PREFETCH ahead) into L2: a K-quant's block a quarter at a time as the block
 * before it is multiplied (all at once, the burst stalls the loads of the block
 * multiplied). */
static inline __attribute__((always_inline)) void prefetch_quarter(int fmt, const uint8_t *ahead,
                                                                   int q) {
    const int64_t bb = (int64_t)blk_packed_bytes(fmt) * QG, part = q < 0 ? bb : bb / 4;
    for (int64_t p = 0; p < part; p += 64) prefetch_l2(ahead + (q < 0 ? 0 : q * part) + p);
}

/* Bit ``s`` of each lane of ``h`` at bit 4 (16 or 0). */
static inline __attribute__((always_inline)) vi vi_bit4(vi h, int s) {
    const vi b = s <= 4 ? vi_slli(h, 4 - s) : vi_srli(h, s - 4);
    return vi_and(b, vi_set1(16));
}

/* Q5_0/Q5_1: one block of the group for ``rt`` rows (x at ``xb``; ``sxb``: each row's
 * sum over the block, rows ``nsx`` apart), added to ``acc``. */
static inline __attribute__((always_inline)) void q5_block(int fmt, int rt, const float *xb,
                                                           int64_t ldx, const float *sxb,
                                                           int64_t nsx, const uint8_t *cb,
                                                           const uint8_t *ahead, vf acc[BRT]) {
    prefetch_quarter(fmt, ahead, -1);
    vf s[BRT][4];
    for (int r = 0; r < rt; ++r)
        for (int u = 0; u < 4; ++u) s[r][u] = vf_zero();
    const vi qh = vi_load_i32(cb + BO_QH(fmt) * QG), lo4 = vi_set1(0x0F);
    for (int i = 0; i < QK / 2; i += 2)
        for (int u = 0; u < 2; ++u) {
            const vi v = vi_load_u8(cb + (BO_Q(fmt) + i + u) * QG);
            const vf lo = vi_to_vf(vi_or(vi_and(v, lo4), vi_bit4(qh, i + u)));
            const vf hi = vi_to_vf(vi_or(vi_srli(v, 4), vi_bit4(qh, i + u + 16)));
            for (int r = 0; r < rt; ++r) {
                const float *xr = xb + r * ldx + i + u;
                s[r][u] = vf_fmadd(vf_set1(xr[0]), lo, s[r][u]);
                s[r][2 + u] = vf_fmadd(vf_set1(xr[QK / 2]), hi, s[r][2 + u]);
            }
        }
    const vf dv = vf_load_f16((const uint16_t *)(cb + BO_D(fmt) * QG));
    for (int r = 0; r < rt; ++r) {
        const vf t = vf_add(vf_add(s[r][0], s[r][1]), vf_add(s[r][2], s[r][3]));
        if (fmt == QF_Q5_0) {
            acc[r] = vf_fmadd(dv, vf_sub(t, vf_set1(16.0f * sxb[r * nsx])), acc[r]);
        } else {
            acc[r] = vf_fmadd(dv, t, acc[r]);
            acc[r] = vf_fmadd(vf_load_f16((const uint16_t *)(cb + BO_M(fmt) * QG)),
                              vf_set1(sxb[r * nsx]), acc[r]);
        }
    }
}

/* Q4_K/Q5_K: one super-block (x at ``xb``, sums ``sxb`` of its 8 sub-blocks). */
static inline __attribute__((always_inline)) void k45_block(int fmt, int rt, const float *xb,
                                                            int64_t ldx, const float *sxb,
                                                            int64_t nsx, const uint8_t *cb,
                                                            const uint8_t *ahead, vf acc[BRT]) {
    const vf d = vf_load_f16((const uint16_t *)(cb + BO_D(fmt) * QG));
    const vf dmin = vf_load_f16((const uint16_t *)(cb + BO_M(fmt) * QG));
    const vi lo4 = vi_set1(0x0F);
    for (int j = 0; j < 4; ++j) { /* sub-blocks 2j (low nibbles) and 2j + 1 (high) */
        prefetch_quarter(fmt, ahead, j);
        vf s[BRT][4];
        for (int r = 0; r < rt; ++r)
            for (int u = 0; u < 4; ++u) s[r][u] = vf_zero();
        for (int i = 0; i < 32; i += 2)
            for (int u = 0; u < 2; ++u) {
                const uint8_t *row = cb + (BO_Q(fmt) + 32 * j + i + u) * QG;
                vf lo, hi;
                if (fmt == QF_Q4_K) {
                    vf_load_nibble_lanes_lut(row, &lo, &hi);
                } else {
                    const vi v = vi_load_u8(row);
                    const vi h = vi_load_u8(cb + (BO_QH(fmt) + i + u) * QG);
                    lo = vi_to_vf(vi_or(vi_and(v, lo4), vi_bit4(h, 2 * j)));
                    hi = vi_to_vf(vi_or(vi_srli(v, 4), vi_bit4(h, 2 * j + 1)));
                }
                for (int r = 0; r < rt; ++r) {
                    const float *xr = xb + r * ldx + 64 * j + i + u;
                    s[r][u] = vf_fmadd(vf_set1(xr[0]), lo, s[r][u]);
                    s[r][2 + u] = vf_fmadd(vf_set1(xr[32]), hi, s[r][2 + u]);
                }
            }
        const vf a0 = vf_mul(d, vf_load_u8(cb + (BO_SC(fmt) + 2 * j) * QG));
        const vf a1 = vf_mul(d, vf_load_u8(cb + (BO_SC(fmt) + 2 * j + 1) * QG));
        const vf m0 = vf_mul(dmin, vf_load_u8(cb + (BO_MN(fmt) + 2 * j) * QG));
        const vf m1 = vf_mul(dmin, vf_load_u8(cb + (BO_MN(fmt) + 2 * j + 1) * QG));
        for (int r = 0; r < rt; ++r) {
            acc[r] = vf_fmadd(a0, vf_add(s[r][0], s[r][1]), acc[r]);
            acc[r] = vf_fnmadd(m0, vf_set1(sxb[r * nsx + 2 * j]), acc[r]);
            acc[r] = vf_fmadd(a1, vf_add(s[r][2], s[r][3]), acc[r]);
            acc[r] = vf_fnmadd(m1, vf_set1(sxb[r * nsx + 2 * j + 1]), acc[r]);
        }
    }
}

/* Q6_K: one super-block (sums ``sxb`` of its 16 sub-blocks of 16). Per half of 128
 * weights and per 16 of its l = 0..31, the four sub-blocks t (weights 32t + l) in one
 * chain each. */
static inline __attribute__((always_inline)) void q6k_block(int rt, const float *xb,
                                                            int64_t ldx, const float *sxb,
                                                            int64_t nsx, const uint8_t *cb,
                                                            const uint8_t *ahead, vf acc[BRT]) {
    const vf d = vf_load_f16((const uint16_t *)(cb + BO_D(QF_Q6_K) * QG));
    const vi lo4 = vi_set1(0x0F), hi2 = vi_set1(0x30);
    for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half) {
            prefetch_quarter(QF_Q6_K, ahead, 2 * h + half);
            vf s[BRT][4];
            for (int r = 0; r < rt; ++r)
                for (int t = 0; t < 4; ++t) s[r][t] = vf_zero();
            for (int l = 16 * half; l < 16 * half + 16; ++l) {
                const uint8_t *row = cb + (int64_t)(BO_Q(QF_Q6_K) + 96 * h + 3 * l) * QG;
                const vi a = vi_load_u8(row), b = vi_load_u8(row + QG);
                const vi e = vi_load_u8(row + 2 * QG);
                vf q[4];
                q[0] = vi_to_vf(vi_or(vi_and(a, lo4), vi_and(vi_slli(e, 4), hi2)));
                q[1] = vi_to_vf(vi_or(vi_and(b, lo4), vi_and(vi_slli(e, 2), hi2)));
                q[2] = vi_to_vf(vi_or(vi_srli(a, 4), vi_and(e, hi2)));
                q[3] = vi_to_vf(vi_or(vi_srli(b, 4), vi_and(vi_srli(e, 2), hi2)));
                for (int r = 0; r < rt; ++r) {
                    const float *xr = xb + r * ldx + 128 * h + l;
                    for (int t = 0; t < 4; ++t)
                        s[r][t] = vf_fmadd(vf_set1(xr[32 * t]), q[t], s[r][t]);
                }
            }
            for (int t = 0; t < 4; ++t) {
                const int sub = 8 * h + 2 * t + half;
                const int8_t *sc = (const int8_t *)cb + (BO_SC(QF_Q6_K) + sub) * QG;
                const vf a = vf_mul(d, vf_load_i8(sc));
                for (int r = 0; r < rt; ++r)
                    acc[r] = vf_fmadd(a, vf_sub(s[r][t], vf_set1(32.0f * sxb[r * nsx + sub])),
                                      acc[r]);
            }
        }
}

/* Rows ``0 .. rt`` of x (``rt`` <= BRT) against one group. ``sx``: each row's sums over
 * blk_sum_width weights (k / width of them a row). */
static inline __attribute__((always_inline)) void blk_tile(int fmt, int rt, const float *x,
                                                           int64_t ldx, int64_t k,
                                                           const float *sx, const uint8_t *grp,
                                                           const float *bias, float *y,
                                                           int64_t ldy, int cols) {
    const int bw = blk_weights(fmt), per = bw / blk_sum_width(fmt);
    const int64_t nb = k / bw, bb = (int64_t)blk_packed_bytes(fmt) * QG;
    const int64_t nsx = k / blk_sum_width(fmt);
    vf acc[BRT];
    for (int r = 0; r < rt; ++r) acc[r] = vf_zero();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *cb = grp + b * bb;
        const float *xb = x + b * bw, *sxb = sx + b * per;
        /* Past the group's last block: the next group's first (a prefetch never faults). */
        const uint8_t *ahead = cb + BLK_PREFETCH * bb;
        if (fmt == QF_Q5_0 || fmt == QF_Q5_1)
            q5_block(fmt, rt, xb, ldx, sxb, nsx, cb, ahead, acc);
        else if (fmt == QF_Q6_K)
            q6k_block(rt, xb, ldx, sxb, nsx, cb, ahead, acc);
        else
            k45_block(fmt, rt, xb, ldx, sxb, nsx, cb, ahead, acc);
    }
    const vf bv = bias == 0 ? vf_zero() : cols == QG ? vf_load(bias) : vf_load_first(bias, cols);
    for (int r = 0; r < rt; ++r) {
        const vf v = vf_add(acc[r], bv);
        if (cols == QG)
            vf_store(y + r * ldy, v);
        else
            vf_store_first(y + r * ldy, cols, v);
    }
}

/* Every row of x against one group, in tiles of BRT rows. */
static inline __attribute__((always_inline)) void blk_rows_fmt(int fmt, const float *x,
                                                               int64_t ldx, int64_t m, int64_t k,
                                                               const float *sx,
                                                               const uint8_t *grp,
                                                               const float *bias, float *y,
                                                               int64_t ldy, int cols) {
    const int64_t nsx = k / blk_sum_width(fmt);
#define BTILE(RTN) blk_tile(fmt, RTN, x + r * ldx, ldx, k, sx + r * nsx, grp, bias, \
                            y + r * ldy, ldy, cols)
    int64_t r = 0;
    for (; r + BRT <= m; r += BRT) BTILE(BRT);
    switch (m - r) {
#if BRT > 3
    case 3: BTILE(3); break;
#endif
#if BRT > 2
    case 2: BTILE(2); break;
#endif
    case 1: BTILE(1); break;
    default: break;
    }
#undef BTILE
}

#define BLK_ROWS_FOR(F)                                                                    \
    static void blk_rows_##F(const float *x, int64_t ldx, int64_t m, int64_t k,            \
                             const float *sx, const uint8_t *grp, const float *bias,       \
                             float *y, int64_t ldy, int cols) {                            \
        blk_rows_fmt(QF_##F, x, ldx, m, k, sx, grp, bias, y, ldy, cols);                   \
    }
BLK_ROWS_FOR(Q5_0)
BLK_ROWS_FOR(Q5_1)
BLK_ROWS_FOR(Q4_K)
BLK_ROWS_FOR(Q5_K)
BLK_ROWS_FOR(Q6_K)
#undef BLK_ROWS_FOR

static void blk_group_rows(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                           const float *sx, const uint8_t *grp, const float *bias, float *y,
                           int64_t ldy, int cols) {
    typedef void (*fn)(const float *, int64_t, int64_t, int64_t, const float *,
                       const uint8_t *, const float *, float *, int64_t, int);
    static const fn fns[] = {blk_rows_Q5_0, blk_rows_Q5_1, blk_rows_Q4_K, blk_rows_Q5_K,
                             blk_rows_Q6_K};
    fns[fmt - QF_Q5_0](x, ldx, m, k, sx, grp, bias, y, ldy, cols);
}
#endif

/* Rows of the plane ``raw`` (``rows``: which; NULL: 0 .. count) dequantized. */
static void blk_dequant_rows(int fmt, const uint8_t *raw, int64_t k, const int64_t *rows,
                             int64_t i0, int64_t i1, float *out) {
    const int bw = blk_weights(fmt);
    const int64_t nb = k / bw, rb = nb * blk_bytes(fmt);
    for (int64_t i = i0; i < i1; ++i) {
        const uint8_t *q = raw + (rows ? rows[i] : i) * rb;
        for (int64_t b = 0; b < nb; ++b)
            blk_dequant_raw(fmt, q + b * blk_bytes(fmt), out + i * k + b * bw);
    }
}

/* Column ``c`` of the group at ``grp`` (packed), dequantized into ``o`` (k floats). */
static void blk_dequant_packed_column(int fmt, const uint8_t *grp, int64_t k, int c, float *o) {
    const int bw = blk_weights(fmt);
    const int64_t nb = k / bw, bb = (int64_t)blk_packed_bytes(fmt) * QG;
    uint8_t raw[QB_Q6_K];
    for (int64_t b = 0; b < nb; ++b) {
        blk_unpack_column(fmt, grp + b * bb, c, raw);
        blk_dequant_raw(fmt, raw, o + b * bw);
    }
}
