/*
 * Linear layers over weight-only quantized matrices: y = x @ W^T (+ bias), W kept in
 * its quantized form and dequantized in registers, float32 products and sums.
 *
 * Formats (``QF_*``; W is ``[n, k]``, quantized along k in blocks of 32 for the GGUF
 * ones), each stored as separate planes, one row of W per row of a plane:
 *
 *   Q8_0  qs int8 ``[n, k]``,      d float16 ``[n, k/32]``:   w = d * q
 *   Q4_0  qs uint8 ``[n, k/2]``,   d float16 ``[n, k/32]``:   w = d * (q - 8)
 *   Q4_1  qs uint8 ``[n, k/2]``,   d, m float16 ``[n, k/32]``: w = d * q + m
 *   INT8  qs int8 ``[n, k]``,      s float32 ``[n]`` (one scale per output row)
 *
 * A Q4 block's 16 bytes hold its elements 0-15 in the low nibbles and 16-31 in the
 * high ones (GGML's order). For the GGUF formats every weight is dequantized exactly as
 * GGML's reference does (the product rounded, then the offset added), so the result
 * differs from ``F.linear(x, dequantize(W))`` only in the order of the sums. INT8
 * multiplies each row's sum by its scale once.
 *
 * A decode step reads each weight once for a few rows of x: the kernel is bound by
 * the bytes of W (4.5-8.5 bits a weight instead of 32) and by the work of unpacking
 * them. Threads take contiguous ranges of output columns; for every NC columns (two on
 * AVX-512), tiles of RT rows of x keep their sums in registers over the whole of k (one
 * vector of sums per vector of a block, so the chains are independent), so each
 * decoded block serves RT rows and each row of x loaded serves NC columns. Every build
 * level has this kernel; the portable one is plain C.
 */
#include <stdint.h>
#include <stdlib.h>

#include "abi.h"
#include "pool.h"
#include "simd.h"

/* Work (weights x rows) below which a call stays on the calling thread. */
#define PARALLEL_MIN_WORK (1 << 15)

/* float16 bits to float32 (exact, subnormals included). */
static inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    union { uint32_t u; float f; } c;
    if (exp == 0x1Fu) {
        c.u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        c.u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        c.u = sign;
    } else { /* subnormal: normalise */
        exp = 113u;
        while (!(man & 0x400u)) {
            man <<= 1;
            --exp;
        }
        c.u = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    return c.f;
}

/* Bytes of one row of qs. */
static int64_t row_bytes(int fmt, int64_t k) {
    return fmt == QF_Q4_0 || fmt == QF_Q4_1 ? k / 2 : k;
}

int qgemm_row_bytes(int fmt, int64_t k) { return (int)row_bytes(fmt, k); }

/* ------------------------------------------------------------------------- */
/* Portable reference path: one weight at a time.                            */
/* ------------------------------------------------------------------------- */

/* Element ``kk`` of row ``q`` (``dq``/``mq``: that row's scales and offsets). */
static inline float weight_at(int fmt, const uint8_t *q, const uint16_t *dq,
                              const uint16_t *mq, int64_t kk) {
    const int64_t b = kk / QK, i = kk % QK;
    if (fmt == QF_Q8_0) return f16_bits_to_f32(dq[b]) * (float)((const int8_t *)q)[kk];
    const uint8_t byte = q[b * (QK / 2) + (i & 15)];
    const int v = i < 16 ? (byte & 0x0F) : (byte >> 4);
    if (fmt == QF_Q4_0) return f16_bits_to_f32(dq[b]) * (float)(v - 8);
    return f16_bits_to_f32(dq[b]) * (float)v + f16_bits_to_f32(mq[b]);
}

#if !SIMD_VW
static void cols_portable(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                          const uint8_t *qs, const uint16_t *d, const uint16_t *mn,
                          const float *scale, const float *bias, float *y, int64_t ldy,
                          int64_t j0, int64_t j1) {
    const int64_t rb = row_bytes(fmt, k), nb = k / QK;
    for (int64_t j = j0; j < j1; ++j) {
        const uint8_t *q = qs + j * rb;
        for (int64_t r = 0; r < m; ++r) {
            const float *xr = x + r * ldx;
            float acc = 0.0f;
            if (fmt == QF_INT8) {
                for (int64_t kk = 0; kk < k; ++kk) acc += xr[kk] * (float)((const int8_t *)q)[kk];
                acc *= scale[j];
            } else {
                const uint16_t *dq = d + j * nb, *mq = mn ? mn + j * nb : 0;
                for (int64_t kk = 0; kk < k; ++kk) acc += xr[kk] * weight_at(fmt, q, dq, mq, kk);
            }
            y[r * ldy + j] = acc + (bias ? bias[j] : 0.0f);
        }
    }
}
#endif

#if SIMD_VW
/* ------------------------------------------------------------------------- */
/* Vector path.                                                               */
/* ------------------------------------------------------------------------- */
#define NVB (QK / SIMD_VW) /* vectors in a block */
#if SIMD_VW == 16
#define RT 4
#else
#define RT 2
#endif

/* One block's codes as float32, unscaled (Q4_0's are 0-15 here: its -8 is folded into
 * the offsets, see ``tile``). */
static inline __attribute__((always_inline)) void load_codes(int fmt, const uint8_t *q, vf *c) {
    if (fmt == QF_Q8_0 || fmt == QF_INT8) {
        for (int v = 0; v < NVB; ++v) c[v] = vf_load_i8((const int8_t *)q + v * SIMD_VW);
    } else {
        vf_load_nibbles32(q, c);
    }
}

/* The offsets' share of row ``r``'s dot product: the sum over blocks of ``off_b *
 * sx_b`` with ``sx_b`` the sum of x over block b (Q4_1: off = m; Q4_0: off = -8 d). */
static inline float offsets_dot(int fmt, const float *sx, int64_t nb, const uint16_t *dq,
                                const uint16_t *mq) {
    const uint16_t *off = fmt == QF_Q4_1 ? mq : dq;
    vf acc = vf_zero();
    int64_t b = 0;
    for (; b + SIMD_VW <= nb; b += SIMD_VW)
        acc = vf_fmadd(vf_load_f16(off + b), vf_load(sx + b), acc);
    float t = vf_reduce_add(acc);
    for (; b < nb; ++b) t += f16_to_f32_fast(off[b]) * sx[b];
    return fmt == QF_Q4_1 ? t : -8.0f * t;
}

/* Scales converted ahead of the blocks that use them (16 or 8 at a time, instead of one
 * scalar conversion and a broadcast per block). */
#define DCHUNK 256

static inline void f16_to_f32_row(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + SIMD_VW <= n; i += SIMD_VW) vf_store(dst + i, vf_load_f16(src + i));
    for (; i < n; ++i) dst[i] = f16_to_f32_fast(src[i]);
}

#include "qgemm_vec.h"

#define COLS_FOR(F)                                                                         \
    static void cols_##F(const float *x, int64_t ldx, int64_t m, int64_t k,                \
                         const float *sx, const uint8_t *qs, const uint16_t *d, const uint16_t *mn,         \
                         const float *scale, const float *bias, float *y, int64_t ldy,     \
                         int64_t j0, int64_t j1) {                                         \
        cols_vec(QF_##F, x, ldx, m, k, sx, qs, d, mn, scale, bias, y, ldy, j0, j1);             \
    }
COLS_FOR(Q8_0)
COLS_FOR(Q4_0)
COLS_FOR(Q4_1)
COLS_FOR(INT8)
#endif

typedef void (*cols_fn)(const float *, int64_t, int64_t, int64_t, const float *, const uint8_t *,
                        const uint16_t *, const uint16_t *, const float *, const float *,
                        float *, int64_t, int64_t, int64_t);

static void cols_dispatch(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                          const float *sx, const uint8_t *qs, const uint16_t *d, const uint16_t *mn,
                          const float *scale, const float *bias, float *y, int64_t ldy,
                          int64_t j0, int64_t j1) {
#if SIMD_VW
    static const cols_fn fns[] = {cols_Q8_0, cols_Q4_0, cols_Q4_1, cols_INT8};
    fns[fmt](x, ldx, m, k, sx, qs, d, mn, scale, bias, y, ldy, j0, j1);
#else
    (void)sx;
    cols_portable(fmt, x, ldx, m, k, qs, d, mn, scale, bias, y, ldy, j0, j1);
#endif
}

typedef struct {
    int fmt;
    const float *x;
    int64_t ldx, m, k;
    const float *sx;
    const void *qs;
    const uint16_t *d, *mn;
    const float *scale, *bias;
    float *y;
    int64_t ldy;
} qgemm_task_t;

static void qgemm_cols(void *ctx, int64_t j0, int64_t j1, int worker) {
    (void)worker;
    const qgemm_task_t *t = ctx;
    cols_dispatch(t->fmt, t->x, t->ldx, t->m, t->k, t->sx, t->qs, t->d, t->mn, t->scale,
                  t->bias, t->y, t->ldy, j0, j1);
}

/* x ``[m, k]`` (row stride ldx), W in format ``fmt`` as described above (``d``/``mn``
 * unused by INT8, ``scale`` used only by it), bias ``[n]`` or NULL, y ``[m, n]`` (row
 * stride ldy). The GGUF formats need k a multiple of 32. Returns 0, or -1 for a format
 * or k it does not take. */
int qgemm(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k, const void *qs,
          const uint16_t *d, const uint16_t *mn, const float *scale, int64_t n,
          const float *bias, float *y, int64_t ldy, int num_threads) {
    if (fmt < QF_Q8_0 || fmt > QF_INT8 || (fmt != QF_INT8 && k % QK)) return -1;
    /* Per row of x, the sum of each block (the Q4 formats' offsets multiply it). */
    float *sx = 0;
#if SIMD_VW
    if (fmt == QF_Q4_0 || fmt == QF_Q4_1) {
        const int64_t nb = k / QK;
        sx = malloc(sizeof(float) * (size_t)(m * nb > 0 ? m * nb : 1));
        if (!sx) return -2;
        for (int64_t r = 0; r < m; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                vf s = vf_load(x + r * ldx + b * QK);
                for (int v = 1; v < NVB; ++v) s = vf_add(s, vf_load(x + r * ldx + b * QK + v * SIMD_VW));
                sx[r * nb + b] = vf_reduce_add(s);
            }
    }
#endif
    const int nt = n * k * m >= PARALLEL_MIN_WORK && num_threads > 1 ? num_threads : 1;
    qgemm_task_t task = {fmt, x, ldx, m, k, sx, qs, d, mn, scale, bias, y, ldy};
    /* Chunks of columns: four per thread, so a thread that starts late or loses its core
     * leaves its share to the others. */
    pool_run(qgemm_cols, &task, n, (n + 4 * nt - 1) / (4 * nt), nt);
    free(sx);
    return 0;
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
    for (int64_t i = i0; i < i1; ++i) {
        const int64_t j = rows ? rows[i] : i;
        const uint8_t *q = (const uint8_t *)qs + j * rb;
        float *o = out + i * k;
        if (fmt == QF_INT8) {
            for (int64_t kk = 0; kk < k; ++kk) o[kk] = (float)((const int8_t *)q)[kk] * scale[j];
            continue;
        }
        const uint16_t *dq = d + j * nb, *mq = mn ? mn + j * nb : 0;
#if SIMD_VW
        const int64_t bbytes = fmt == QF_Q8_0 ? QK : QK / 2;
        for (int64_t b = 0; b < nb; ++b) {
            vf c[NVB];
            load_codes(fmt, q + b * bbytes, c);
            const vf dv = vf_set1(f16_to_f32_fast(dq[b]));
            /* as weight_at: the product rounded, then the offset (Q4_0: -8) added */
            for (int v = 0; v < NVB; ++v) {
                vf w = fmt == QF_Q4_0 ? vf_sub(c[v], vf_set1(8.0f)) : c[v];
                w = vf_mul(dv, w);
                if (fmt == QF_Q4_1) w = vf_add(w, vf_set1(f16_to_f32_fast(mq[b])));
                vf_store(o + b * QK + v * SIMD_VW, w);
            }
        }
#else
        for (int64_t kk = 0; kk < k; ++kk) o[kk] = weight_at(fmt, q, dq, mq, kk);
#endif
    }
}

/* Rows ``rows[0 .. count)`` of W dequantized to float32 into ``out`` ``[count, k]``
 * (embedding lookups and prefill-sized products; ``rows`` NULL: rows 0 .. count). */
int qdequant(int fmt, const void *qs, const uint16_t *d, const uint16_t *mn,
             const float *scale, int64_t k, const int64_t *rows, int64_t count, float *out,
             int num_threads) {
    if (fmt < QF_Q8_0 || fmt > QF_INT8 || (fmt != QF_INT8 && k % QK)) return -1;
    const int nt = count * k >= (1 << 18) && num_threads > 1 ? num_threads : 1;
    qdequant_task_t task = {fmt, qs, d, mn, scale, k, rows, out};
    pool_run(qdequant_rows, &task, count, (count + 4 * nt - 1) / (4 * nt), nt);
    return 0;
}
