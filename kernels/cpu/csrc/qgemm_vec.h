/*
 * The tiles of qgemm_cpu.c's vector path, kept in their own file for length only: it is
 * included once, at this point of that source, whose helpers (load_codes, offsets_dot,
 * f16_to_f32_row, DCHUNK, NVB, RT) it uses, so the two form one translation unit.
 */
/* Output columns a tile computes together: each decoded block then serves every row of
 * the tile and each loaded row of x serves every column (two with AVX-512's 32
 * registers; AVX2's 16 hold one). */
#if SIMD_VW == 16
#define NC 2
#else
#define NC 1
#endif
/* Rows from which columns are paired: with fewer, the pair's extra registers cost more
 * than the shared loads save (measured on Zen 4: 5-25% slower at 1-8 rows, 10-75%
 * faster at 32). The results are the same either way. */
#define NC_MIN_ROWS 16

/* One block of the GGUF formats for ``nc`` columns (codes ``qb`` rb bytes apart, scales
 * ``dval`` DCHUNK apart): each row's products with a column's codes summed, scaled by
 * the block's d and added to accumulator ``slot`` of that row and column. */
static inline __attribute__((always_inline)) void block_step(int fmt, int rt, int nc,
                                                             const float *x, int64_t ldx,
                                                             int64_t b, const uint8_t *qb,
                                                             int64_t rb, const float *dval,
                                                             vf acc[][NC][NVB], int slot) {
    vf c[NC][NVB], d[NC];
    for (int cc = 0; cc < nc; ++cc) {
        load_codes(fmt, qb + cc * rb, c[cc]);
        d[cc] = vf_set1(dval[cc * DCHUNK]);
    }
    for (int r = 0; r < rt; ++r) {
        const float *xb = x + r * ldx + b * QK;
        vf xv[NVB];
        for (int v = 0; v < NVB; ++v) xv[v] = vf_load(xb + v * SIMD_VW);
        for (int cc = 0; cc < nc; ++cc) {
            vf s = vf_mul(xv[0], c[cc][0]);
            for (int v = 1; v < NVB; ++v) s = vf_fmadd(xv[v], c[cc][v], s);
            acc[r][cc][slot] = vf_fmadd(d[cc], s, acc[r][cc][slot]);
        }
    }
}

/* Columns ``j .. j + nc`` (their codes ``rb`` bytes apart, scales and offsets ``nb``
 * apart) for rows ``r0 .. r0 + rt`` of x (``rt`` <= RT, ``nc`` <= NC, both constant
 * after inlining). Per block, each row's products with the codes are summed and scaled
 * by the block's d once; the offsets' share is added at the end. Every output is the
 * same sequence of operations whatever ``rt``, ``nc`` and the other rows and columns,
 * so a row's result does not depend on the batch it came in. */
static inline __attribute__((always_inline)) void tile(int fmt, int rt, int nc, const float *x,
                                                       int64_t ldx, int64_t k, const float *sx,
                                                       const uint8_t *q, int64_t rb,
                                                       const uint16_t *dq, const uint16_t *mq,
                                                       const float *post, const float *add,
                                                       float *y, int64_t ldy) {
    vf acc[RT][NC][NVB];
    for (int r = 0; r < rt; ++r)
        for (int cc = 0; cc < nc; ++cc)
            for (int v = 0; v < NVB; ++v) acc[r][cc][v] = vf_zero();
    const int64_t nb = k / QK, bbytes = fmt == QF_Q4_0 || fmt == QF_Q4_1 ? QK / 2 : QK;
    if (fmt == QF_INT8) {
        for (int64_t b = 0; b < nb; ++b) {
            vf c[NC][NVB];
            for (int cc = 0; cc < nc; ++cc) load_codes(fmt, q + cc * rb + b * bbytes, c[cc]);
            for (int r = 0; r < rt; ++r)
                for (int v = 0; v < NVB; ++v) {
                    const vf xv = vf_load(x + r * ldx + b * QK + v * SIMD_VW);
                    for (int cc = 0; cc < nc; ++cc)
                        acc[r][cc][v] = vf_fmadd(xv, c[cc][v], acc[r][cc][v]);
                }
        }
    } else {
        /* Two blocks a step, into alternate accumulators (block b into slot b % 2: DCHUNK
         * is even), so consecutive blocks do not chain. */
        float ds[NC * DCHUNK];
        for (int64_t b0 = 0; b0 < nb; b0 += DCHUNK) {
            const int64_t b1 = b0 + DCHUNK < nb ? b0 + DCHUNK : nb;
            for (int cc = 0; cc < nc; ++cc) f16_to_f32_row(dq + cc * nb + b0, b1 - b0, ds + cc * DCHUNK);
            int64_t b = b0;
            for (; b + 2 <= b1; b += 2) {
                block_step(fmt, rt, nc, x, ldx, b, q + b * bbytes, rb, ds + (b - b0), acc, 0);
                block_step(fmt, rt, nc, x, ldx, b + 1, q + (b + 1) * bbytes, rb,
                           ds + (b + 1 - b0), acc, 1);
            }
            if (b < b1)
                block_step(fmt, rt, nc, x, ldx, b, q + b * bbytes, rb, ds + (b - b0), acc, 0);
        }
    }
    for (int r = 0; r < rt; ++r)
        for (int cc = 0; cc < nc; ++cc) {
            vf s = acc[r][cc][0];
            for (int v = 1; v < NVB; ++v) s = vf_add(s, acc[r][cc][v]);
            float t = vf_reduce_add(s);
            if (fmt == QF_Q4_0 || fmt == QF_Q4_1)
                t += offsets_dot(fmt, sx + r * nb, nb, dq + cc * nb, mq ? mq + cc * nb : 0);
            /* INT8 rows whose k is not a multiple of 32: the tail, one weight at a time. */
            const int8_t *qc = (const int8_t *)(q + cc * rb);
            for (int64_t kk = nb * QK; kk < k; ++kk) t += x[r * ldx + kk] * (float)qc[kk];
            y[r * ldy + cc] = t * post[cc] + add[cc];
        }
}

/* Columns j .. j + nc for every row of x, in tiles of RT rows. */
static inline __attribute__((always_inline)) void cols_tiles(
    int fmt, int nc, const float *x, int64_t ldx, int64_t m, int64_t k, const float *sx,
    const uint8_t *q, int64_t rb, const uint16_t *dq, const uint16_t *mq, const float *post,
    const float *add, float *y, int64_t ldy) {
    const int64_t nb = k / QK;
#define TILE(RTN) tile(fmt, RTN, nc, x + r * ldx, ldx, k, sx ? sx + r * nb : 0, q, rb, dq, mq, \
                       post, add, y + r * ldy, ldy)
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

static inline __attribute__((always_inline)) void cols_vec(
    int fmt, const float *x, int64_t ldx, int64_t m, int64_t k, const float *sx, const uint8_t *qs,
    const uint16_t *d, const uint16_t *mn, const float *scale, const float *bias, float *y,
    int64_t ldy, int64_t j0, int64_t j1) {
    const int64_t rb = row_bytes(fmt, k), nb = k / QK;
    const int pair = m >= NC_MIN_ROWS;
    for (int64_t j = j0; j < j1;) {
        const int nc = pair && j + NC <= j1 ? NC : 1;
        float post[NC], add[NC];
        for (int cc = 0; cc < nc; ++cc) {
            post[cc] = fmt == QF_INT8 ? scale[j + cc] : 1.0f;
            add[cc] = bias ? bias[j + cc] : 0.0f;
        }
        const uint8_t *q = qs + j * rb;
        const uint16_t *dq = fmt == QF_INT8 ? 0 : d + j * nb;
        const uint16_t *mq = fmt == QF_Q4_1 ? mn + j * nb : 0;
        if (nc == NC)
            cols_tiles(fmt, NC, x, ldx, m, k, sx, q, rb, dq, mq, post, add, y + j, ldy);
        else
            cols_tiles(fmt, 1, x, ldx, m, k, sx, q, rb, dq, mq, post, add, y + j, ldy);
        j += nc;
    }
}

