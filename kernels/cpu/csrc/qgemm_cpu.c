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
 * and the block formats Q5_0, Q5_1, Q4_K, Q5_K and Q6_K, whose one plane ``qs`` is the
 * rows' GGML blocks as the GGUF file stores them (``qgemm_blocks.h``; ``d``/``mn`` NULL).
 *
 * A Q4 block's 16 bytes hold its elements 0-15 in the low nibbles and 16-31 in the
 * high ones (GGML's order). :c:func:`qdequant` computes every weight exactly as GGML's
 * reference does (the product rounded, then the offset added).
 *
 * The products run over a packed copy of W (:c:func:`qgemm_pack`, made once at load):
 * groups of QG output columns (QG = the vector width; 8 in the portable build), and in
 * each group, block by block, byte i of every column's block side by side, then the
 * columns' scales (and offsets). One vector load then holds code i of QG columns: each
 * element of x is broadcast once and multiplies QG columns with one FMA, and the sums
 * of the QG columns are the lanes of one vector, so a column needs no horizontal sum.
 * Per block, four chains of sums (x times codes), multiplied by the block's scales once;
 * the Q4 formats add their offsets' share as the block's offset times the sum of x over
 * the block (Q4_0's offset is -8 d). INT8 multiplies each column's sum by its scale
 * once. Rows of x go in tiles of RT, each decoded vector of codes serving all of them;
 * every output is the same sequence of operations whatever the tile, the thread and the
 * other rows, so a row's result does not depend on the batch it came in.
 * :c:func:`qgemm` takes the planes themselves and packs them for the one call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* The formats held as GGML blocks (qgemm_blocks.h). */
static inline int is_blk(int fmt) { return fmt >= QF_Q5_0 && fmt <= QF_Q6_K; }

/* ------------------------------------------------------------------------- */
/* The packed layout.                                                         */
/* ------------------------------------------------------------------------- */
#if SIMD_VW
#define QG SIMD_VW
#else
#define QG 8
#endif

#include "qgemm_blocks.h"

/* Bytes of one row of qs. */
static int64_t row_bytes(int fmt, int64_t k) {
    if (is_blk(fmt)) return k / blk_weights(fmt) * blk_bytes(fmt);
    return fmt == QF_Q4_0 || fmt == QF_Q4_1 ? k / 2 : k;
}

int qgemm_row_bytes(int fmt, int64_t k) { return (int)row_bytes(fmt, k); }

/* Element ``kk`` of row ``q`` (``dq``/``mq``: that row's scales and offsets), as
 * GGML's reference dequantizer makes it. */
static inline float weight_at(int fmt, const uint8_t *q, const uint16_t *dq,
                              const uint16_t *mq, int64_t kk) {
    const int64_t b = kk / QK, i = kk % QK;
    if (fmt == QF_Q8_0) return f16_bits_to_f32(dq[b]) * (float)((const int8_t *)q)[kk];
    const uint8_t byte = q[b * (QK / 2) + (i & 15)];
    const int v = i < 16 ? (byte & 0x0F) : (byte >> 4);
    if (fmt == QF_Q4_0) return f16_bits_to_f32(dq[b]) * (float)(v - 8);
    return f16_bits_to_f32(dq[b]) * (float)v + f16_bits_to_f32(mq[b]);
}

static int is_q4(int fmt) { return fmt == QF_Q4_0 || fmt == QF_Q4_1; }

/* Code bytes of one column's block. */
static int block_codes(int fmt) { return is_q4(fmt) ? QK / 2 : QK; }

/* Bytes of one block of a group: QG columns' codes, then (GGUF formats) their float16
 * scales and (Q4_1) offsets. */
static int64_t group_block_bytes(int fmt) {
    if (is_blk(fmt)) return (int64_t)blk_packed_bytes(fmt) * QG;
    const int64_t codes = (int64_t)block_codes(fmt) * QG;
    return codes + (fmt == QF_INT8 ? 0 : fmt == QF_Q4_1 ? 4 * QG : 2 * QG);
}

/* Blocks along k (INT8: the last one partial when k is not a multiple of 32). */
static int64_t k_blocks(int fmt, int64_t k) {
    if (is_blk(fmt)) return k / blk_weights(fmt);
    return fmt == QF_INT8 ? (k + QK - 1) / QK : k / QK;
}

/* Codes a column has in block b: block_codes, fewer only in INT8's partial last block. */
static int codes_in_block(int fmt, int64_t k, int64_t b) {
    return fmt == QF_INT8 && k - b * QK < QK ? (int)(k - b * QK) : block_codes(fmt);
}

/* Bytes before a group's blocks: INT8's QG float32 scales. */
static int64_t group_head_bytes(int fmt) { return fmt == QF_INT8 ? 4 * QG : 0; }

/* Bytes of one group: its head, then its blocks. */
static int64_t group_bytes(int fmt, int64_t k) {
    return group_head_bytes(fmt) + k_blocks(fmt, k) * group_block_bytes(fmt);
}

static int valid(int fmt, int64_t n, int64_t k) {
    if (is_blk(fmt)) return n >= 1 && k >= 1 && !(k % blk_weights(fmt));
    return fmt >= QF_Q8_0 && fmt <= QF_INT8 && n >= 1 && k >= 1 && (fmt == QF_INT8 || !(k % QK));
}

#include "qgemm_i8.h"

int64_t qgemm_packed_size(int fmt, int64_t n, int64_t k) {
    if (fmt & QFLAG_I8A) return i8_packed_size(fmt, n, k);
    return valid(fmt, n, k) ? (n + QG - 1) / QG * group_bytes(fmt, k) : -1;
}

int qgemm_pack(int fmt, const void *qs, const uint16_t *d, const uint16_t *mn,
               const float *scale, int64_t n, int64_t k, void *packed) {
    if (fmt & QFLAG_I8A) return i8_pack(fmt, qs, d, mn, n, k, packed);
    if (!valid(fmt, n, k)) return -1;
    const int64_t rb = row_bytes(fmt, k), nb = k_blocks(fmt, k), nbq = k / QK;
    const int64_t bb = group_block_bytes(fmt), gb = group_bytes(fmt, k);
    const int nc = block_codes(fmt);
    const int64_t groups = (n + QG - 1) / QG;
    /* Groups on every thread (as i8_pack's). */
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int cols = n - g * QG < QG ? (int)(n - g * QG) : QG;
        uint8_t *go = (uint8_t *)packed + g * gb;
        memset(go, 0, (size_t)gb); /* padding columns: all zero */
        if (is_blk(fmt)) {
            blk_pack_group(fmt, qs, n, k, g, go);
            continue;
        }
        if (fmt == QF_INT8) memcpy(go, scale + g * QG, sizeof(float) * (size_t)cols);
        go += group_head_bytes(fmt);
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *bo = go + b * bb;
            const int have = codes_in_block(fmt, k, b);
            for (int c = 0; c < cols; ++c) {
                const int64_t j = g * QG + c;
                const uint8_t *src = (const uint8_t *)qs + j * rb + b * nc;
                for (int i = 0; i < have; ++i) bo[i * QG + c] = src[i];
                if (fmt != QF_INT8) {
                    uint16_t *dd = (uint16_t *)(bo + (int64_t)nc * QG);
                    dd[c] = d[j * nbq + b];
                    if (fmt == QF_Q4_1) dd[QG + c] = mn[j * nbq + b];
                }
            }
        }
    }
    return 0;
}

/* Per row of x, the sum of each ``width`` (32, or 16) weights (the offsets multiply
 * it): the run's vectors added in order, then their lanes. */
static void block_sums(const float *x, int64_t ldx, int64_t m, int64_t k, int width,
                       float *sx) {
    const int64_t nb = k / width;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + r * ldx + b * width;
#if SIMD_VW
            vf s = vf_load(xb);
            for (int v = 1; v < width / SIMD_VW; ++v) s = vf_add(s, vf_load(xb + v * SIMD_VW));
            sx[r * nb + b] = vf_reduce_add(s);
#else
            float s = 0.0f;
            for (int i = 0; i < width; ++i) s += xb[i];
            sx[r * nb + b] = s;
#endif
        }
}

#if !SIMD_VW
/* ------------------------------------------------------------------------- */
/* Portable path: the vector path's sums, one lane at a time.                 */
/* ------------------------------------------------------------------------- */
static void group_rows(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                       const float *sx, const uint8_t *grp, const float *bias, float *y,
                       int64_t ldy, int cols) {
    const int64_t nb = k_blocks(fmt, k), bb = group_block_bytes(fmt);
    const int nc = block_codes(fmt);
    const uint8_t *blocks = grp + group_head_bytes(fmt);
    for (int64_t r = 0; r < m; ++r) {
        const float *xr = x + r * ldx;
        float acc[QG] = {0};
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *cb = blocks + b * bb;
            const uint16_t *dd = (const uint16_t *)(cb + (int64_t)nc * QG);
            const int have = codes_in_block(fmt, k, b);
            for (int c = 0; c < QG; ++c) {
                float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int i = 0; i < have; ++i) {
                    const uint8_t byte = cb[i * QG + c];
                    if (is_q4(fmt)) {
                        s[i & 1] += xr[b * QK + i] * (float)(byte & 0x0F);
                        s[2 + (i & 1)] += xr[b * QK + 16 + i] * (float)(byte >> 4);
                    } else {
                        s[i & 3] += xr[b * QK + i] * (float)(int8_t)byte;
                    }
                }
                const float t = (s[0] + s[1]) + (s[2] + s[3]);
                if (fmt == QF_INT8) {
                    acc[c] += t;
                } else {
                    const float dv = f16_bits_to_f32(dd[c]), sb = is_q4(fmt) ? sx[r * nb + b] : 0.0f;
                    if (fmt == QF_Q4_0) acc[c] += dv * (t - 8.0f * sb);
                    else acc[c] += dv * t;
                    if (fmt == QF_Q4_1) acc[c] += f16_bits_to_f32(dd[QG + c]) * sb;
                }
            }
        }
        for (int c = 0; c < cols; ++c) {
            float v = acc[c];
            if (fmt == QF_INT8) v *= ((const float *)grp)[c];
            y[r * ldy + c] = v + (bias ? bias[c] : 0.0f);
        }
    }
}
#else
#include "qgemm_vec.h"
#endif

typedef struct {
    int fmt;
    const float *x;
    int64_t ldx, m, k;
    const float *sx;
    const uint8_t *packed;
    int64_t n;
    const float *bias;
    float *y;
    int64_t ldy;
} qgemm_task_t;

static void qgemm_groups(void *ctx, int64_t g0, int64_t g1, int worker) {
    (void)worker;
    const qgemm_task_t *t = ctx;
    const int64_t gb = group_bytes(t->fmt, t->k);
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t j = g * QG;
        const int cols = t->n - j < QG ? (int)(t->n - j) : QG;
        if (is_blk(t->fmt)) {
            blk_group_rows(t->fmt, t->x, t->ldx, t->m, t->k, t->sx, t->packed + g * gb,
                           t->bias ? t->bias + j : 0, t->y + j, t->ldy, cols);
            continue;
        }
        group_rows(t->fmt, t->x, t->ldx, t->m, t->k, t->sx, t->packed + g * gb,
                   t->bias ? t->bias + j : 0, t->y + j, t->ldy, cols);
    }
}

/* x ``[m, k]`` (row stride ldx) times W packed by qgemm_pack, plus bias ``[n]`` or
 * NULL, into y ``[m, n]`` (row stride ldy). Returns 0, -1 for a format, n or k it does
 * not take, -2 when out of memory. */
int qgemm_packed(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                 const void *packed, int64_t n, const float *bias, float *y, int64_t ldy,
                 int num_threads) {
    if (fmt & QFLAG_I8A) return i8_gemm(fmt, x, ldx, m, k, packed, n, bias, y, ldy, num_threads);
    if (!valid(fmt, n, k)) return -1;
    if (m < 1) return 0;
    float *sx = 0;
    if (is_q4(fmt) || is_blk(fmt)) {
        const int width = is_blk(fmt) ? blk_sum_width(fmt) : QK;
        sx = malloc(sizeof(float) * (size_t)(m * (k / width)));
        if (!sx) return -2;
        block_sums(x, ldx, m, k, width, sx);
    }
    const int64_t groups = (n + QG - 1) / QG;
    const int nt = n * k * m >= PARALLEL_MIN_WORK && num_threads > 1 ? num_threads : 1;
    qgemm_task_t task = {fmt, x, ldx, m, k, sx, packed, n, bias, y, ldy};
    /* Chunks of groups: four per thread, so a thread that starts late or loses its core
     * leaves its share to the others. */
    pool_run(qgemm_groups, &task, groups, (groups + 4 * nt - 1) / (4 * nt), nt);
    free(sx);
    return 0;
}

/* The same product from W's planes (described at the top; ``d``/``mn`` unused by
 * INT8, ``scale`` used only by it), packed for this call. */
int qgemm(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k, const void *qs,
          const uint16_t *d, const uint16_t *mn, const float *scale, int64_t n,
          const float *bias, float *y, int64_t ldy, int num_threads) {
    const int64_t size = qgemm_packed_size(fmt, n, k);
    if (size < 0) return -1;
    void *packed = malloc((size_t)size);
    if (!packed) return -2;
    qgemm_pack(fmt, qs, d, mn, scale, n, k, packed);
    const int status = qgemm_packed(fmt, x, ldx, m, k, packed, n, bias, y, ldy, num_threads);
    free(packed);
    return status;
}

/* qdequant and qdequant_packed. */
#include "qgemm_dequant.h"

int qgemm_i8_dots_built(void) { return i8_dots_built(); }
int qgemm_i8_dots(void) { return i8_dots(); }
int qgemm_i8_use_dots(int dots) { return i8_use_dots(dots); }
