/*
 * qgemm_cpu.c's products with 8-bit activations: the format codes with QFLAG_I8A set
 * (``QF_Q8_0 | QFLAG_I8A``, ...). Kept in its own file for length only: included once by
 * that source after its helpers (f16_bits_to_f32, pool_run), so the two form one
 * translation unit.
 *
 * Each row of x is quantized per block of 32 elements as GGML's Q8_0 does: d = max|x| /
 * 127, q = x / d rounded to the nearest integer (ties to even), kept with d as float32
 * and, for the formats with an offset, the block's sum of q. A block's product with a
 * column is then one integer dot product of its codes with q, exact, and the block adds
 *
 *   Q8_0  dw dx sum(w q)                       (w the column's int8 codes)
 *   Q4_0  dw dx (sum(w q) - 8 sum(q))          (w its 4-bit codes 0-15)
 *   Q4_1  dw dx sum(w q) + mw (dx sum(q))
 *
 * to the column's float32 sum (dw, mw: the block's float16 scale and offset).
 *
 * The packed layout (independent of the build's vector width: the same bytes at every
 * level): groups of eight output columns; in a group, block by block, the codes as
 * quads: quad t holds four consecutive code bytes of each of the eight columns, column
 * after column (32 bytes), so one 32-byte load is four codes of eight columns and a
 * broadcast of four bytes of q multiplies them all (AVX2's maddubs: unsigned bytes times
 * signed bytes, pairs summed; Q8_0's signed codes go in as |w| with q given w's signs).
 * Q4 quads are code bytes 4t .. 4t + 3 of the 16 (low nibbles: elements 4t .. 4t + 3,
 * high: 16 + 4t ..). After the codes: the eight columns' float16 scales, then (Q4_1)
 * offsets. A column's block takes the file's bytes (34, 18, 20).
 *
 * The integer sums cannot overflow: a Q4 pair is at most 2 * 15 * 127 = 3810, and a
 * block's eight pairs per lane 30480 < 32768 (summed as int16); a Q8_0 pair at most
 * 2 * 128 * 127 = 32512, widened to int32 at once. The portable build computes the same
 * integers one column at a time, so every level gives the same sums; the float steps
 * differ only in their rounding (fused multiply-adds on AVX2).
 */

/* Columns of a group. */
#define I8G 8
/* Rows of x a tile takes (each decoded quad serves all of them). */
#define I8RT 4

static inline int i8_base(int fmt) { return fmt & ~QFLAG_I8A; }

/* Whether ``fmt`` (QFLAG_I8A set) has an 8-bit-activation product. */
static inline int i8_valid_fmt(int fmt) {
    const int b = i8_base(fmt);
    return (fmt & QFLAG_I8A) && (b == QF_Q8_0 || b == QF_Q4_0 || b == QF_Q4_1);
}

/* Code bytes of one column's block. */
static inline int i8_codes(int base) { return base == QF_Q8_0 ? QK : QK / 2; }

/* Bytes of one group's block: codes, scales, offsets. */
static inline int64_t i8_group_block_bytes(int base) {
    return (int64_t)I8G * (i8_codes(base) + 2 + (base == QF_Q4_1 ? 2 : 0));
}

static inline int64_t i8_group_bytes(int base, int64_t k) {
    return k / QK * i8_group_block_bytes(base);
}

static int i8_valid(int fmt, int64_t n, int64_t k) {
    return i8_valid_fmt(fmt) && n >= 1 && k >= QK && !(k % QK);
}

static int64_t i8_packed_size(int fmt, int64_t n, int64_t k) {
    return i8_valid(fmt, n, k) ? (n + I8G - 1) / I8G * i8_group_bytes(i8_base(fmt), k) : -1;
}

/* Offset of code byte ``i`` of column ``c`` in a group's block. */
static inline int i8_code_at(int c, int i) { return (i / 4) * 4 * I8G + c * 4 + (i % 4); }

static int i8_pack(int fmt, const void *qs, const uint16_t *d, const uint16_t *mn, int64_t n,
                   int64_t k, uint8_t *out) {
    if (!i8_valid(fmt, n, k)) return -1;
    const int base = i8_base(fmt), nc = i8_codes(base);
    const int64_t nb = k / QK, bb = i8_group_block_bytes(base), gb = i8_group_bytes(base, k);
    const int64_t rb = base == QF_Q8_0 ? k : k / 2;
    memset(out, 0, (size_t)((n + I8G - 1) / I8G * gb)); /* padding columns: all zero */
    for (int64_t j = 0; j < n; ++j) {
        const int c = (int)(j % I8G);
        uint8_t *go = out + j / I8G * gb;
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *bo = go + b * bb;
            const uint8_t *src = (const uint8_t *)qs + j * rb + b * nc;
            for (int i = 0; i < nc; ++i) bo[i8_code_at(c, i)] = src[i];
            uint16_t *dd = (uint16_t *)(bo + (int64_t)nc * I8G);
            dd[c] = d[j * nb + b];
            if (base == QF_Q4_1) dd[I8G + c] = mn[j * nb + b];
        }
    }
    return 0;
}

/* Column ``c`` of a group's block ``bo`` as float32 weights (the reference's values). */
static void i8_dequant_block(int base, const uint8_t *bo, int c, float *w) {
    const int nc = i8_codes(base);
    const uint16_t *dd = (const uint16_t *)(bo + (int64_t)nc * I8G);
    const float dv = f16_bits_to_f32(dd[c]);
    if (base == QF_Q8_0) {
        for (int i = 0; i < QK; ++i) w[i] = dv * (float)(int8_t)bo[i8_code_at(c, i)];
        return;
    }
    const float mv = base == QF_Q4_1 ? f16_bits_to_f32(dd[I8G + c]) : 0.0f;
    for (int i = 0; i < QK / 2; ++i) {
        const uint8_t byte = bo[i8_code_at(c, i)];
        const int lo = byte & 0x0F, hi = byte >> 4;
        if (base == QF_Q4_0) {
            w[i] = dv * (float)(lo - 8);
            w[i + 16] = dv * (float)(hi - 8);
        } else {
            w[i] = dv * (float)lo + mv;
            w[i + 16] = dv * (float)hi + mv;
        }
    }
}

/* Row ``j`` of W from the packed copy. */
static void i8_dequant_row(int fmt, const uint8_t *packed, int64_t k, int64_t j, float *out) {
    const int base = i8_base(fmt);
    const int64_t bb = i8_group_block_bytes(base);
    const uint8_t *grp = packed + j / I8G * i8_group_bytes(base, k);
    for (int64_t b = 0; b < k / QK; ++b) i8_dequant_block(base, grp + b * bb, (int)(j % I8G), out + b * QK);
}

/* Rows of x quantized: ``xq`` int8 ``[m, k]``, ``dx`` float32 ``[m, k/32]``, ``sq`` int32
 * ``[m, k/32]`` (the blocks' sums of q). */
static void i8_quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *xq,
                             float *dx, int32_t *sq) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + r * ldx + b * QK;
            int8_t *q = xq + r * k + b * QK;
#if SIMD_I8
            const float amax = vq_absmax32(xb);
#else
            float amax = 0.0f;
            for (int i = 0; i < QK; ++i) {
                const float a = xb[i] < 0.0f ? -xb[i] : xb[i];
                amax = a > amax ? a : amax;
            }
#endif
            const float dv = amax / 127.0f, id = dv > 0.0f ? 1.0f / dv : 0.0f;
            dx[r * nb + b] = dv;
            if (!(amax <= 3.0e38f)) { /* inf (or NaN): no codes; d carries it to the sums */
                memset(q, 0, QK);
                sq[r * nb + b] = 0;
                continue;
            }
#if SIMD_I8
            vq_quantize32(xb, id, q);
#else
            for (int i = 0; i < QK; ++i) {
                float v = nearbyintf(xb[i] * id);
                v = v > 127.0f ? 127.0f : v >= -127.0f ? v : -127.0f; /* NaN: -127 */
                q[i] = (int8_t)v;
            }
#endif
            int32_t s = 0;
            for (int i = 0; i < QK; ++i) s += q[i];
            sq[r * nb + b] = s;
        }
}

#if SIMD_I8
/* One block of a group for ``rt`` rows (their q at ``xq``, rows ``k`` apart): each row's
 * eight integer sums. */
static inline __attribute__((always_inline)) void i8_block_sums(int base, int rt, const uint8_t *cb,
                                                                const int8_t *xq, int64_t k,
                                                                vq isum[I8RT]) {
    if (base == QF_Q8_0) {
        for (int r = 0; r < rt; ++r) isum[r] = vq_zero();
        for (int t = 0; t < QK / 4; ++t) {
            const vq w = vq_load(cb + t * 4 * I8G), aw = vq_abs8(w);
            for (int r = 0; r < rt; ++r) {
                const vq xs = vq_sign8(vq_bcast4(xq + r * k + 4 * t), w);
                isum[r] = vq_add32(isum[r], vq_sum16(vq_dot_pairs(aw, xs)));
            }
        }
        return;
    }
    vq a[I8RT];
    for (int r = 0; r < rt; ++r) a[r] = vq_zero();
    for (int t = 0; t < QK / 8; ++t) {
        const vq w = vq_load(cb + t * 4 * I8G), lo = vq_lo_nibbles(w), hi = vq_hi_nibbles(w);
        for (int r = 0; r < rt; ++r) {
            const int8_t *xr = xq + r * k;
            a[r] = vq_add16(a[r], vq_add16(vq_dot_pairs(lo, vq_bcast4(xr + 4 * t)),
                                           vq_dot_pairs(hi, vq_bcast4(xr + 16 + 4 * t))));
        }
    }
    for (int r = 0; r < rt; ++r) isum[r] = vq_sum16(a[r]);
}

/* Rows ``0 .. rt`` against one group of ``cols`` columns. */
static inline __attribute__((always_inline)) void i8_group_tile(int base, int rt, const int8_t *xq,
                                                                const float *dx, const int32_t *sq,
                                                                int64_t k, const uint8_t *grp,
                                                                const float *bias, float *y,
                                                                int64_t ldy, int cols) {
    const int64_t nb = k / QK, bb = i8_group_block_bytes(base);
    const int nc = i8_codes(base);
    vq8f acc[I8RT];
    for (int r = 0; r < rt; ++r) acc[r] = vq8f_zero();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *cb = grp + b * bb;
        vq isum[I8RT];
        i8_block_sums(base, rt, cb, xq + b * QK, k, isum);
        const uint16_t *dd = (const uint16_t *)(cb + (int64_t)nc * I8G);
        const vq8f dw = vq8f_load_f16(dd);
        for (int r = 0; r < rt; ++r) {
            const float d = dx[r * nb + b];
            vq s = isum[r];
            if (base == QF_Q4_0) s = vq_sub32(s, vq_set32(8 * sq[r * nb + b]));
            acc[r] = vq8f_fmadd(vq_to_f32(s), vq8f_mul(dw, vq8f_set1(d)), acc[r]);
            if (base == QF_Q4_1)
                acc[r] = vq8f_fmadd(vq8f_load_f16(dd + I8G), vq8f_set1(d * (float)sq[r * nb + b]),
                                    acc[r]);
        }
    }
    for (int r = 0; r < rt; ++r) {
        float out[I8G];
        vq8f_store(out, acc[r]);
        for (int c = 0; c < cols; ++c) y[r * ldy + c] = out[c] + (bias ? bias[c] : 0.0f);
    }
}
#else
/* The same sums, one column at a time. */
static void i8_group_tile(int base, int rt, const int8_t *xq, const float *dx, const int32_t *sq,
                          int64_t k, const uint8_t *grp, const float *bias, float *y, int64_t ldy,
                          int cols) {
    const int64_t nb = k / QK, bb = i8_group_block_bytes(base);
    const int nc = i8_codes(base);
    for (int r = 0; r < rt; ++r) {
        const int8_t *xr = xq + r * k;
        float acc[I8G] = {0};
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *cb = grp + b * bb;
            const uint16_t *dd = (const uint16_t *)(cb + (int64_t)nc * I8G);
            const float d = dx[r * nb + b];
            for (int c = 0; c < I8G; ++c) {
                int32_t s = 0;
                if (base == QF_Q8_0) {
                    for (int i = 0; i < QK; ++i) s += (int8_t)cb[i8_code_at(c, i)] * xr[b * QK + i];
                } else {
                    for (int i = 0; i < QK / 2; ++i) {
                        const uint8_t byte = cb[i8_code_at(c, i)];
                        s += (byte & 0x0F) * xr[b * QK + i] + (byte >> 4) * xr[b * QK + 16 + i];
                    }
                    if (base == QF_Q4_0) s -= 8 * sq[r * nb + b];
                }
                acc[c] += (float)s * (f16_bits_to_f32(dd[c]) * d);
                if (base == QF_Q4_1) acc[c] += f16_bits_to_f32(dd[I8G + c]) * (d * (float)sq[r * nb + b]);
            }
        }
        for (int c = 0; c < cols; ++c) y[r * ldy + c] = acc[c] + (bias ? bias[c] : 0.0f);
    }
}
#endif

typedef struct {
    int base;
    const int8_t *xq;
    const float *dx;
    const int32_t *sq;
    int64_t m, k;
    const uint8_t *packed;
    int64_t n;
    const float *bias;
    float *y;
    int64_t ldy;
} i8_task_t;

/* Every row of x against one group, in tiles of I8RT rows (one function per format, so
 * the format's branches fold away). */
#define I8_GROUP_ROWS_FOR(F)                                                                \
    static void i8_group_rows_##F(const i8_task_t *t, int64_t g) {                          \
        const int64_t j = g * I8G, nbk = t->k / QK;                                          \
        const int cols = t->n - j < I8G ? (int)(t->n - j) : I8G;                            \
        const uint8_t *grp = t->packed + g * i8_group_bytes(QF_##F, t->k);                  \
        const float *bias = t->bias ? t->bias + j : 0;                                       \
        int64_t r = 0;                                                                       \
        for (; r + I8RT <= t->m; r += I8RT)                                                  \
            i8_group_tile(QF_##F, I8RT, t->xq + r * t->k, t->dx + r * nbk, t->sq + r * nbk,  \
                          t->k, grp, bias, t->y + r * t->ldy + j, t->ldy, cols);             \
        switch (t->m - r) {                                                                  \
        case 3:                                                                              \
            i8_group_tile(QF_##F, 3, t->xq + r * t->k, t->dx + r * nbk, t->sq + r * nbk,     \
                          t->k, grp, bias, t->y + r * t->ldy + j, t->ldy, cols);             \
            break;                                                                           \
        case 2:                                                                              \
            i8_group_tile(QF_##F, 2, t->xq + r * t->k, t->dx + r * nbk, t->sq + r * nbk,     \
                          t->k, grp, bias, t->y + r * t->ldy + j, t->ldy, cols);             \
            break;                                                                           \
        case 1:                                                                              \
            i8_group_tile(QF_##F, 1, t->xq + r * t->k, t->dx + r * nbk, t->sq + r * nbk,     \
                          t->k, grp, bias, t->y + r * t->ldy + j, t->ldy, cols);             \
            break;                                                                           \
        default: break;                                                                      \
        }                                                                                    \
    }
I8_GROUP_ROWS_FOR(Q8_0)
I8_GROUP_ROWS_FOR(Q4_0)
I8_GROUP_ROWS_FOR(Q4_1)
#undef I8_GROUP_ROWS_FOR

static void i8_groups(void *ctx, int64_t g0, int64_t g1, int worker) {
    (void)worker;
    const i8_task_t *t = ctx;
    for (int64_t g = g0; g < g1; ++g) {
        if (t->base == QF_Q8_0) i8_group_rows_Q8_0(t, g);
        else if (t->base == QF_Q4_0) i8_group_rows_Q4_0(t, g);
        else i8_group_rows_Q4_1(t, g);
    }
}

static int i8_gemm(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k, const void *packed,
                   int64_t n, const float *bias, float *y, int64_t ldy, int num_threads) {
    if (!i8_valid(fmt, n, k)) return -1;
    if (m < 1) return 0;
    const int64_t nb = k / QK;
    int8_t *xq = malloc((size_t)(m * k));
    float *dx = malloc(sizeof(float) * (size_t)(m * nb));
    int32_t *sq = malloc(sizeof(int32_t) * (size_t)(m * nb));
    if (!xq || !dx || !sq) {
        free(xq);
        free(dx);
        free(sq);
        return -2;
    }
    i8_quantize_rows(x, ldx, m, k, xq, dx, sq);
    const int64_t groups = (n + I8G - 1) / I8G;
    const int nt = n * k * m >= PARALLEL_MIN_WORK && num_threads > 1 ? num_threads : 1;
    i8_task_t task = {i8_base(fmt), xq, dx, sq, m, k, packed, n, bias, y, ldy};
    pool_run(i8_groups, &task, groups, (groups + 4 * nt - 1) / (4 * nt), nt);
    free(xq);
    free(dx);
    free(sq);
    return 0;
}
