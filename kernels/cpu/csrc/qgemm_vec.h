/*
 * The vector path of qgemm_cpu.c over its packed layout, kept in its own file for length
 * only: it is included once, at this point of that source, whose helpers (QG, is_q4,
 * block_codes, codes_in_block, group_head_bytes, group_block_bytes, k_blocks) it uses,
 * so the two form one translation unit. One group of QG = VW output columns is one
 * vector of sums.
 */
/* Rows of x a tile takes: each vector of decoded codes serves all of them (AVX-512's
 * 32 registers hold four rows' four chains and sums, AVX2's 16 two). */
#if SIMD_VW == 16
#define RT 4
#else
#define RT 2
#endif

/* One block of the group for ``rt`` rows (x at ``xb``, rows ``ldx`` apart): code i of
 * the QG columns times element i of each row, in four chains a row (Q4: low nibbles into
 * chains i % 2, high ones into 2 + i % 2; the others: chain i % 4). ``have``: the
 * block's codes (codes_in_block; only the Q8_0 and INT8 chains read it). */
static inline __attribute__((always_inline)) void block_chains(int fmt, int rt, const float *xb,
                                                               int64_t ldx, const uint8_t *cb,
                                                               int have, vf s[RT][4]) {
    for (int r = 0; r < rt; ++r)
        for (int u = 0; u < 4; ++u) s[r][u] = vf_zero();
    if (is_q4(fmt)) {
        for (int i = 0; i < QK / 2; i += 2)
            for (int u = 0; u < 2; ++u) {
                vf lo, hi;
                vf_load_nibble_lanes(cb + (i + u) * QG, &lo, &hi);
                for (int r = 0; r < rt; ++r) {
                    const float *xr = xb + r * ldx + i + u;
                    s[r][u] = vf_fmadd(vf_set1(xr[0]), lo, s[r][u]);
                    s[r][2 + u] = vf_fmadd(vf_set1(xr[QK / 2]), hi, s[r][2 + u]);
                }
            }
        return;
    }
    if (have == QK) {
        for (int i = 0; i < QK; i += 4)
            for (int u = 0; u < 4; ++u) {
                const vf c = vf_load_i8((const int8_t *)cb + (i + u) * QG);
                for (int r = 0; r < rt; ++r)
                    s[r][u] = vf_fmadd(vf_set1(xb[r * ldx + i + u]), c, s[r][u]);
            }
        return;
    }
    for (int i = 0; i < have; ++i) { /* the same chains, one element at a time */
        const vf c = vf_load_i8((const int8_t *)cb + i * QG);
        for (int r = 0; r < rt; ++r)
            s[r][i & 3] = vf_fmadd(vf_set1(xb[r * ldx + i]), c, s[r][i & 3]);
    }
}

/* Rows ``0 .. rt`` of x (``rt`` <= RT, constant after inlining) against one group. */
static inline __attribute__((always_inline)) void group_tile(int fmt, int rt, const float *x,
                                                             int64_t ldx, int64_t k,
                                                             const float *sx, const uint8_t *grp,
                                                             const float *bias, float *y,
                                                             int64_t ldy, int cols) {
    const int64_t nb = k_blocks(fmt, k), bb = group_block_bytes(fmt), nbq = k / QK;
    const int nc = block_codes(fmt);
    const uint8_t *blocks = grp + group_head_bytes(fmt);
    vf acc[RT];
    for (int r = 0; r < rt; ++r) acc[r] = vf_zero();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *cb = blocks + b * bb;
        const int have = codes_in_block(fmt, k, b);
        vf s[RT][4];
        block_chains(fmt, rt, x + b * QK, ldx, cb, have, s);
        const uint16_t *dd = (const uint16_t *)(cb + (int64_t)nc * QG);
        const vf dv = fmt == QF_INT8 ? vf_zero() : vf_load_f16(dd);
        for (int r = 0; r < rt; ++r) {
            const vf t = vf_add(vf_add(s[r][0], s[r][1]), vf_add(s[r][2], s[r][3]));
            if (fmt == QF_INT8) {
                acc[r] = vf_add(acc[r], t);
            } else if (fmt == QF_Q8_0) {
                acc[r] = vf_fmadd(dv, t, acc[r]);
            } else if (fmt == QF_Q4_0) {
                acc[r] = vf_fmadd(dv, vf_sub(t, vf_set1(8.0f * sx[r * nbq + b])), acc[r]);
            } else {
                acc[r] = vf_fmadd(dv, t, acc[r]);
                acc[r] = vf_fmadd(vf_load_f16(dd + QG), vf_set1(sx[r * nbq + b]), acc[r]);
            }
        }
    }
    const vf sc = fmt == QF_INT8 ? vf_load((const float *)grp) : vf_zero();
    const vf bv = bias == 0 ? vf_zero() : cols == QG ? vf_load(bias) : vf_load_first(bias, cols);
    for (int r = 0; r < rt; ++r) {
        vf v = fmt == QF_INT8 ? vf_mul(acc[r], sc) : acc[r];
        v = vf_add(v, bv);
        if (cols == QG)
            vf_store(y + r * ldy, v);
        else
            vf_store_first(y + r * ldy, cols, v);
    }
}

/* Every row of x against one group, in tiles of RT rows. */
static inline __attribute__((always_inline)) void group_rows_fmt(int fmt, const float *x,
                                                                 int64_t ldx, int64_t m,
                                                                 int64_t k, const float *sx,
                                                                 const uint8_t *grp,
                                                                 const float *bias, float *y,
                                                                 int64_t ldy, int cols) {
    const int64_t nbq = k / QK;
#define TILE(RTN) group_tile(fmt, RTN, x + r * ldx, ldx, k, sx ? sx + r * nbq : 0, grp, bias, \
                             y + r * ldy, ldy, cols)
    int64_t r = 0;
    for (; r + RT <= m; r += RT) TILE(RT);
    switch (m - r) {
#if RT > 3
    case 3: TILE(3); break;
#endif
#if RT > 2
    case 2: TILE(2); break;
#endif
    case 1: TILE(1); break;
    default: break;
    }
#undef TILE
}

#define GROUP_ROWS_FOR(F)                                                                  \
    static void group_rows_##F(const float *x, int64_t ldx, int64_t m, int64_t k,          \
                               const float *sx, const uint8_t *grp, const float *bias,     \
                               float *y, int64_t ldy, int cols) {                          \
        group_rows_fmt(QF_##F, x, ldx, m, k, sx, grp, bias, y, ldy, cols);                 \
    }
GROUP_ROWS_FOR(Q8_0)
GROUP_ROWS_FOR(Q4_0)
GROUP_ROWS_FOR(Q4_1)
GROUP_ROWS_FOR(INT8)
#undef GROUP_ROWS_FOR

static void group_rows(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                       const float *sx, const uint8_t *grp, const float *bias, float *y,
                       int64_t ldy, int cols) {
    typedef void (*fn)(const float *, int64_t, int64_t, int64_t, const float *,
                       const uint8_t *, const float *, float *, int64_t, int);
    static const fn fns[] = {group_rows_Q8_0, group_rows_Q4_0, group_rows_Q4_1, group_rows_INT8};
    fns[fmt](x, ldx, m, k, sx, grp, bias, y, ldy, cols);
}
