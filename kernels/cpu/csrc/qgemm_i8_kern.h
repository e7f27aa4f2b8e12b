/*
 * qgemm_i8.h's tiles: included by it once per kind of integer dot the build has, with
 *
 *   I8_SUFFIX  the suffix of this copy's functions (I8K(name) names them)
 *   I8_VNNI    1: VNNI's vpdpbusd (four byte products summed straight into int32 lanes),
 *              with I8_DPBUSD(acc, u, s) its intrinsic and I8_TARGET the functions'
 *              target attribute; 0: AVX2's maddubs (pairs summed in int16, widened by
 *              madd), I8_TARGET empty
 *
 * Both give the same integer sums (maddubs never saturates here: see qgemm_i8.h's
 * bounds), so every copy's output is the same bit for bit. The portable build includes
 * it once (I8_VNNI 0) for its scalar tile.
 */
#define I8_INLINE static inline __attribute__((always_inline)) I8_TARGET
#if I8_VNNI
/* ``a``'s int32 lanes plus the dots of u's and s's four bytes; the same as an int32
 * accumulator (no int16 stage: I8_WIDEN is nothing, no run ever flushes). */
#define I8_PAIRS(a, u, s) I8_DPBUSD(a, u, s)
#define I8_WIDEN(a) (a)
#define I8_DOT32(a, u, s) I8_DPBUSD(a, u, s)
#else
/* ``a``'s int16 lanes plus u's and s's pair dots; I8_WIDEN sums the pairs to int32. */
#define I8_PAIRS(a, u, s) XV(add16)(a, XV(dot_pairs)(u, s))
#define I8_WIDEN(a) XV(sum16)(a)
#define I8_DOT32(a, u, s) XV(add32)(a, XV(sum16)(XV(dot_pairs)(u, s)))
#endif

#if SIMD_I8
/* One sub-block's finished sums for ``rt`` rows into their accumulators: ``isum`` (the
 * integer dots), A (the columns' multipliers) and, with ``fb``, the float offsets B. ``xb``:
 * the sub-block's 32-element x block; ``s16``/``n16``: its first sum of 16 and how many. */
I8_INLINE void I8K(i8_finish)(int base, int rt, const i8_rows_t *x,
                                                            const XV_T isum[I8RT], XVF_T a, int fb,
                                                            XVF_T b, int xb, int s16, int n16,
                                                            XVF_T acc[I8RT]) {
    const int64_t ldd = x->k / QK, lds = x->k / 16;
    const int off = base == QF_Q8_0 && I8_VNNI ? 128 : i8_int_offset(base);
    for (int r = 0; r < rt; ++r) {
        const float d = x->dx[r * ldd + xb];
        int32_t sqv = x->sq[r * lds + s16];
        if (n16 == 2) sqv += x->sq[r * lds + s16 + 1];
        XV_T s = isum[r];
        if (off) s = XV(sub32)(s, XV(set32)(off * sqv));
        acc[r] = XVF(fmadd)(XV(to_f32)(s), XVF(mul)(a, XVF(set1)(d)), acc[r]);
        if (fb) acc[r] = XVF(fmadd)(b, XVF(set1)(d * (float)sqv), acc[r]);
    }
}

/* Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: one 32-weight block. */
I8_INLINE void I8K(i8_block32)(int base, int rt, const uint8_t *cb, int64_t gs,
                                                             const i8_rows_t *x, int xb,
                                                             XVF_T acc[I8RT]) {
    (void)gs; /* the wide copy's loads use it */
    XV_T isum[I8RT];
    for (int r = 0; r < rt; ++r) isum[r] = XV(zero)();
    if (base == QF_Q8_0 && I8_VNNI) { /* c + 128 as they are; i8_finish takes 128 sum(q) */
        for (int t = 0; t < QK / 4; ++t) {
            const XV_T w = XV(load)(cb + t * 4 * I8G);
            for (int r = 0; r < rt; ++r)
                isum[r] = I8_DOT32(isum[r], w, XV(bcast4)(x->xq + r * x->k + 4 * t));
        }
    } else if (base == QF_Q8_0) { /* maddubs: back to c, then |c| and q given c's signs */
        const XV_T flip = XV(set8)((int8_t)0x80);
        for (int t = 0; t < QK / 4; ++t) {
            const XV_T w = XV(xor)(XV(load)(cb + t * 4 * I8G), flip), aw = XV(abs8)(w);
            for (int r = 0; r < rt; ++r) {
                const XV_T xs = XV(sign8)(XV(bcast4)(x->xq + r * x->k + 4 * t), w);
                isum[r] = I8_DOT32(isum[r], aw, xs);
            }
        }
    } else if (base == QF_Q4_0 || base == QF_Q4_1) {
        XV_T a16[I8RT];
        for (int r = 0; r < rt; ++r) a16[r] = XV(zero)();
        for (int t = 0; t < QK / 8; ++t) {
            const XV_T w = XV(load)(cb + t * 4 * I8G), lo = XV(lo_nibbles)(w), hi = XV(hi_nibbles)(w);
            for (int r = 0; r < rt; ++r) {
                const int8_t *xr = x->xq + r * x->k;
                a16[r] = I8_PAIRS(I8_PAIRS(a16[r], lo, XV(bcast4)(xr + 4 * t)), hi,
                                  XV(bcast4)(xr + 16 + 4 * t));
            }
        }
        for (int r = 0; r < rt; ++r) isum[r] = I8_WIDEN(a16[r]);
    } else { /* Q5_0, Q5_1: the fifth bits from their planes (bits t and 4 + t) */
        const XV_T qh = XV(load)(cb + i8_off_qh(base)), x10 = XV(set8)(0x10);
        XV_T a16[I8RT];
        for (int r = 0; r < rt; ++r) a16[r] = XV(zero)();
        for (int t = 0; t < QK / 8; ++t) {
            const XV_T w = XV(load)(cb + t * 4 * I8G);
            const XV_T lo = XV(or)(XV(lo_nibbles)(w), XV(and)(XV(slli16)(qh, 4 - t), x10));
            const XV_T hi = XV(or)(XV(hi_nibbles)(w), XV(and)(t ? XV(srli16)(qh, t) : qh, x10));
            for (int r = 0; r < rt; ++r) {
                const int8_t *xr = x->xq + r * x->k;
                a16[r] = I8_PAIRS(I8_PAIRS(a16[r], lo, XV(bcast4)(xr + 4 * t)), hi,
                                  XV(bcast4)(xr + 16 + 4 * t));
            }
            if (!I8_VNNI && (t & 1)) { /* four 5-bit pairs at most in int16 */
                for (int r = 0; r < rt; ++r) {
                    isum[r] = XV(add32)(isum[r], I8_WIDEN(a16[r]));
                    a16[r] = XV(zero)();
                }
            }
        }
        if (I8_VNNI)
            for (int r = 0; r < rt; ++r) isum[r] = a16[r];
    }
    const XVF_T dw = XVF(load_f16)((const uint16_t *)(cb + i8_off_d(base)));
    const int fb = i8_has_m(base);
    const XVF_T mw = fb ? XVF(load_f16)((const uint16_t *)(cb + i8_off_m(base))) : XVF(zero)();
    I8K(i8_finish)(base, rt, x, isum, dw, fb, mw, xb, 2 * xb, 2, acc);
}

/* Q4_K, Q5_K: sub-block s (32 weights: the low nibbles of code bytes 32 (s/2) .. for even
 * s, the high for odd; Q5_K's fifth bit is bit s of qh byte l). */
I8_INLINE void I8K(i8_k45_sub)(int base, int rt, const uint8_t *cb, int64_t gs,
                                                             const i8_rows_t *x, int xb0, int s,
                                                             XVF_T dv, XVF_T dmv, XVF_T acc[I8RT]) {
    (void)gs; /* the wide copy's loads use it */
    XV_T isum[I8RT], a16[I8RT];
    for (int r = 0; r < rt; ++r) isum[r] = a16[r] = XV(zero)();
    const int j = s / 2, sh = s & 1;
    for (int v = 0; v < 8; ++v) {
        const XV_T w = XV(load)(cb + (8 * j + v) * 4 * I8G);
        XV_T c = sh ? XV(hi_nibbles)(w) : XV(lo_nibbles)(w);
        if (base == QF_Q5_K) {
            const XV_T h = XV(load)(cb + i8_off_qh(base) + v * 4 * I8G);
            c = XV(or)(c, XV(and)(s <= 4 ? XV(slli16)(h, 4 - s) : XV(srli16)(h, s - 4), XV(set8)(0x10)));
        }
        for (int r = 0; r < rt; ++r)
            a16[r] = I8_PAIRS(a16[r], c, XV(bcast4)(x->xq + r * x->k + 32 * s + 4 * v));
        if (!I8_VNNI && base == QF_Q5_K && (v & 3) == 3) { /* four 5-bit pairs in int16 */
            for (int r = 0; r < rt; ++r) {
                isum[r] = XV(add32)(isum[r], I8_WIDEN(a16[r]));
                a16[r] = XV(zero)();
            }
        }
    }
    if (I8_VNNI || base == QF_Q4_K)
        for (int r = 0; r < rt; ++r) isum[r] = I8_WIDEN(a16[r]);
    const XVF_T a = XVF(mul)(dv, XVF(load_u8)(cb + i8_off_sc(base) + s * I8G));
    /* B = -(dmin mn): the negation is exact, so its multiply-add rounds as fnmadd would */
    const XVF_T b = XVF(mul)(XVF(mul)(dmv, XVF(load_u8)(cb + i8_off_mn(base) + s * I8G)),
                            XVF(set1)(-1.0f));
    I8K(i8_finish)(base, rt, x, isum, a, 1, b, xb0 + s, 2 * (xb0 + s), 2, acc);
}

/* Q6_K: x block 4 h + t of the weight block (elements 128 h + 32 t ..): its sub-blocks
 * s = 8 h + 2 t + u, u = 0, 1 (16 weights each: their low 4 bits in ql byte 64 h +
 * 32 (t & 1) + l, low or high nibble as t < 2, their top two bits 2t .. 2t + 1 of qh byte
 * 32 h + l, l = 16 u ..). Each sub-block's dots times its scale in int32 (madd with the
 * scales as int16 pairs), less 32 sc_s sum(q), then one float step for the x block. The
 * VNNI copy takes maddubs here too: with int32 dots the scales need a vpmulld per
 * sub-block and row, 1.03-1.06x maddubs' time at 4-128 rows on a Zen 5. */
I8_INLINE void I8K(i8_q6k_block)(int rt, const uint8_t *cb, int64_t gs,
                                                               const i8_rows_t *x, int xb0, int h,
                                                               int t, XVF_T dv, XVF_T acc[I8RT]) {
    (void)gs; /* the wide copy's loads use it */
    XV_T isum[I8RT], sc32[2];
    for (int r = 0; r < rt; ++r) isum[r] = XV(zero)();
    for (int u = 0; u < 2; ++u) {
        sc32[u] = XV(load_i8x8)((const int8_t *)cb + i8_off_sc(QF_Q6_K) + (8 * h + 2 * t + u) * I8G);
        const XV_T sc16 = XV(pair16)(sc32[u]);
        for (int v = 4 * u; v < 4 * u + 4; v += 2) {
            XV_T a16[I8RT];
            for (int r = 0; r < rt; ++r) a16[r] = XV(zero)();
            for (int e = v; e < v + 2; ++e) { /* two 6-bit pairs at most in int16 */
                const XV_T w = XV(load)(cb + (16 * h + 8 * (t & 1) + e) * 4 * I8G);
                const XV_T qh = XV(load)(cb + i8_off_qh(QF_Q6_K) + (8 * h + e) * 4 * I8G);
                const XV_T lo = t < 2 ? XV(lo_nibbles)(w) : XV(hi_nibbles)(w);
                const XV_T hb = 2 * t <= 4 ? XV(slli16)(qh, 4 - 2 * t) : XV(srli16)(qh, 2 * t - 4);
                const XV_T c = XV(or)(lo, XV(and)(hb, XV(set8)(0x30)));
                for (int r = 0; r < rt; ++r)
                    a16[r] = XV(add16)(a16[r], XV(dot_pairs)(c, XV(bcast4)(x->xq + r * x->k + 128 * h +
                                                                          32 * t + 4 * e)));
            }
            for (int r = 0; r < rt; ++r) isum[r] = XV(add32)(isum[r], XV(madd16)(a16[r], sc16));
        }
    }
    const int64_t ldd = x->k / QK, lds = x->k / 16;
    const int xb = xb0 + 4 * h + t;
    for (int r = 0; r < rt; ++r) {
        const int32_t *sq = x->sq + r * lds + 2 * xb;
        const XV_T off = XV(add32)(XV(mul32)(sc32[0], XV(set32)(32 * sq[0])),
                                XV(mul32)(sc32[1], XV(set32)(32 * sq[1])));
        acc[r] = XVF(fmadd)(XV(to_f32)(XV(sub32)(isum[r], off)),
                            XVF(mul)(dv, XVF(set1)(x->dx[r * ldd + xb])), acc[r]);
    }
}

/* Rows ``0 .. rt`` against one group of ``cols`` columns. */
I8_INLINE void I8K(i8_group_tile)(int base, int rt, const i8_rows_t *x0, int64_t gs,
                                                                const uint8_t *grp, const float *bias,
                                                                float *y, int64_t ldy, int cols) {
    const int wb = i8_weights(base);
    const int64_t nb = x0->k / wb, bb = i8_group_block_bytes(base);
    XVF_T acc[I8RT];
    for (int r = 0; r < rt; ++r) acc[r] = XVF(zero)();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *cb = grp + b * bb;
        /* The bytes I8_PREFETCH ahead (on into the next group, which follows) into L2:
         * at one row the loads would wait on memory otherwise. The address is computed
         * as an integer: past the last group it points beyond the weight (a prefetch
         * there reads nothing and cannot fault). */
        for (int64_t p = 0; p < bb; p += 64) {
            prefetch_l2((const void *)((uintptr_t)cb + I8_PREFETCH + (uintptr_t)p));
            if (I8_WIDE) prefetch_l2((const void *)((uintptr_t)cb + (uintptr_t)gs + I8_PREFETCH + (uintptr_t)p));
        }
        const int xb0 = (int)(b * wb / QK);
        const i8_rows_t xk = {x0->xq + b * wb, x0->dx, x0->sq, x0->k};
        if (wb == QK) {
            I8K(i8_block32)(base, rt, cb, gs, &xk, xb0, acc);
            continue;
        }
        const XVF_T dv = XVF(load_f16)((const uint16_t *)(cb + i8_off_d(base)));
        /* One row: the sub-block loops unrolled, so their shifts and nibble choices are
         * constants. More rows: rolled, as unrolled they spill the rows' sums. */
        if (base == QF_Q6_K && rt == 1) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
                for (int t = 0; t < 4; ++t) I8K(i8_q6k_block)(rt, cb, gs, &xk, xb0, h, t, dv, acc);
        } else if (base == QF_Q6_K) {
            for (int h = 0; h < 2; ++h)
                for (int t = 0; t < 4; ++t) I8K(i8_q6k_block)(rt, cb, gs, &xk, xb0, h, t, dv, acc);
        } else if (rt == 1) {
            const XVF_T dmv = XVF(load_f16)((const uint16_t *)(cb + i8_off_m(base)));
#pragma GCC unroll 8
            for (int s = 0; s < 8; ++s) I8K(i8_k45_sub)(base, rt, cb, gs, &xk, xb0, s, dv, dmv, acc);
        } else {
            const XVF_T dmv = XVF(load_f16)((const uint16_t *)(cb + i8_off_m(base)));
            for (int s = 0; s < 8; ++s) I8K(i8_k45_sub)(base, rt, cb, gs, &xk, xb0, s, dv, dmv, acc);
        }
    }
    for (int r = 0; r < rt; ++r) {
        float out[I8_COLS];
        XVF(store)(out, acc[r]);
        for (int c = 0; c < cols; ++c) y[r * ldy + c] = out[c] + (bias ? bias[c] : 0.0f);
    }
}
#else
#include "qgemm_i8_portable.h"
#endif
/* Every row of x against one group, in tiles of 4 rows (Q6_K: 8 where I8RT is 8), one
 * function per format, so the format's branches fold away. */
I8_INLINE void I8K(i8_group_rows)(int base, const i8_task_t *t,
                                                                int64_t g) {
    const int64_t j = g * I8G, gs = i8_group_bytes(base, t->k);
    const int cols = t->n - j < I8_COLS ? (int)(t->n - j) : I8_COLS;
    const uint8_t *grp = t->packed + g * gs;
    const float *bias = t->bias ? t->bias + j : 0;
    int64_t r = 0;
#define I8_TILE(RTN)                                                                        \
    do {                                                                                    \
        const i8_rows_t x = {t->xq + r * t->k, t->dx + r * (t->k / QK), t->sq + r * (t->k / 16), \
                             t->k};                                                         \
        I8K(i8_group_tile)(base, RTN, &x, gs, grp, bias, t->y + r * t->ldy + j, t->ldy, cols);      \
    } while (0)
#if I8RT > 4
    if (base == QF_Q6_K)
        for (; r + 8 <= t->m; r += 8) I8_TILE(8);
#endif
    for (; r + 4 <= t->m; r += 4) I8_TILE(4);
    switch (t->m - r) {
    case 3: I8_TILE(3); break;
    case 2: I8_TILE(2); break;
    case 1: I8_TILE(1); break;
    default: break;
    }
#undef I8_TILE
}

#define I8_GROUP_ROWS_FOR(F) \
    I8_TARGET static void I8K(i8_group_rows_##F)(const i8_task_t *t, int64_t g) {              \
        I8K(i8_group_rows)(QF_##F, t, g);                                                    \
    }
I8_GROUP_ROWS_FOR(Q8_0)
I8_GROUP_ROWS_FOR(Q4_0)
I8_GROUP_ROWS_FOR(Q4_1)
I8_GROUP_ROWS_FOR(Q5_0)
I8_GROUP_ROWS_FOR(Q5_1)
I8_GROUP_ROWS_FOR(Q4_K)
I8_GROUP_ROWS_FOR(Q5_K)
I8_GROUP_ROWS_FOR(Q6_K)
#undef I8_GROUP_ROWS_FOR

I8_TARGET static void I8K(i8_groups)(void *ctx, int64_t g0, int64_t g1, int worker) {
    (void)worker;
    const i8_task_t *t = ctx;
    typedef void (*fn)(const i8_task_t *, int64_t);
    static const fn fns[] = {[QF_Q8_0] = I8K(i8_group_rows_Q8_0), [QF_Q4_0] = I8K(i8_group_rows_Q4_0),
                             [QF_Q4_1] = I8K(i8_group_rows_Q4_1), [QF_Q5_0] = I8K(i8_group_rows_Q5_0),
                             [QF_Q5_1] = I8K(i8_group_rows_Q5_1), [QF_Q4_K] = I8K(i8_group_rows_Q4_K),
                             [QF_Q5_K] = I8K(i8_group_rows_Q5_K), [QF_Q6_K] = I8K(i8_group_rows_Q6_K)};
#if I8_WIDE
    /* Items are pairs of groups; a last group alone takes the 256-bit copy. */
    const int64_t groups = (t->n + I8G - 1) / I8G;
    for (int64_t i = g0; i < g1; ++i) {
        if (2 * i + 1 < groups)
            fns[t->base](t, 2 * i);
        else
            I8_SINGLE_GROUPS(ctx, 2 * i, 2 * i + 1, worker);
    }
#else
    for (int64_t g = g0; g < g1; ++g) fns[t->base](t, g);
#endif
}

#undef I8_INLINE
#undef I8_PAIRS
#undef I8_WIDEN
#undef I8_DOT32
