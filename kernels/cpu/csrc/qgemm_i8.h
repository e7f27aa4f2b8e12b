/*
 * qgemm_cpu.c's products with 8-bit activations: the format codes with QFLAG_I8A set
 * (``QF_Q8_0 | QFLAG_I8A``, ...), for every format but INT8. Kept in its own file for
 * length only: included once by that source after its helpers (f16_bits_to_f32,
 * qgemm_blocks.h's scale_min_k4, pack_scale_min_k4 and blk_dequant_raw, pool_run), so the
 * files form one translation unit.
 *
 * Each row of x is quantized per block of 32 elements as GGML's Q8_0 does: dx = max|x| /
 * 127, q = x / dx rounded to the nearest integer (ties to even), kept with dx as float32
 * and the sums of q over each 16 elements. A weight block's product with a column then
 * splits into sub-blocks s (32 weights; Q6_K's 16) of integer codes c (Q8_0: -128..127;
 * Q4: 0..15; Q5: 0..31; Q6_K: 0..63), each an exact integer dot product with q:
 *
 *   acc += (sum(c q) - o sum(q)) * (A_s dx) + B_s (dx sum(q))
 *
 * with the integer offset o (Q4_0 8, Q5_0 16, Q8_0 128 in the VNNI copies, else 0), the multiplier A_s (d, or Q4_K's
 * and Q5_K's d * sc_s rounded as the reference rounds it) and the float offset B_s
 * (Q4_1/Q5_1: m; Q4_K/Q5_K: -(dmin * mn_s); else none). Q6_K's two 16-weight sub-blocks
 * of a 32-element x block take their int8 scales in int32:
 *
 *   acc += (sc_0 (sum(c q) - 32 sum(q)) + sc_1 (...)) * (d dx)
 *
 * The packed layout (independent of the build's vector width: the same bytes at every
 * level): groups of eight output columns; in a group, block by block, each of the block's
 * byte arrays as rows of the eight columns' bytes:
 *
 *   Q    the code bytes (Q6_K: ql) as quads: quad t is bytes 4t .. 4t + 3 of each of the
 *        eight columns, column after column (32 bytes), so one 32-byte load is four
 *        codes of eight columns and a broadcast of four bytes of q multiplies them all
 *        (AVX2's maddubs: unsigned bytes times signed bytes, pairs summed). Q8_0's
 *        signed codes are stored as c + 128 (c ^ 0x80): VNNI multiplies them as they
 *        are, with the integer offset 128; maddubs, whose int16 pairs that would
 *        overflow, takes them back to c and goes in with |c| and q given c's signs
 *   QH   the high bits (Q5_K: 32 bytes; Q6_K: 64), as quads; Q5_0/Q5_1's 32 fifth bits
 *        (the file's uint32) as one quad in bit planes: bit t of byte j is the fifth bit
 *        of weight 4t + j, bit 4 + t that of weight 16 + 4t + j (the weights of byte j of
 *        quad t's low and high nibbles), so a shift and a mask give each its 0x10
 *   D    the columns' float16 d, side by side; M their m or dmin
 *   SC   the K-quants' sub-block scales (Q4_K/Q5_K: unpacked to a byte each; Q6_K's int8),
 *        row s the eight columns' scale of sub-block s; MN the mins likewise
 *
 * so a column's block takes the file's bytes (Q4_K and Q5_K: 4 more, their unpacked
 * scales: 148 and 180).
 *
 * The integer sums cannot overflow: a pair of Q4 products is at most 2 * 15 * 127 = 3810
 * and eight are summed as int16 (30480 < 32768); Q5's pairs (7874) four at a time; Q6's
 * (16002) two; Q8_0's (2 * 128 * 127 = 32512) one. The portable build computes the same
 * integers one column at a time from the file's block, so every level gives the same
 * sums; the float steps differ only in rounding (fused multiply-adds on AVX2).
 */

/* Columns of a group. */
#define I8G 8
/* Rows of x a tile takes at most (each decoded quad serves all of them): 4, and 8 for
 * Q6_K where there are 32 vector registers (AVX-512 builds). Q6_K's codes take the most
 * work to decode: 8 rows took 0.88-0.94x the time of 4 at 32-128 rows on a Zen 5, where the
 * other formats gained nothing or lost (Q8_0 1.17x). */
#if defined(__AVX512F__)
#define I8RT 8
#else
#define I8RT 4
#endif
/* How far ahead of the block multiplied its group's bytes are fetched. */
#ifndef I8_PREFETCH
#define I8_PREFETCH 1024
#endif

static inline int i8_base(int fmt) { return fmt & ~QFLAG_I8A; }

/* Whether ``fmt`` (QFLAG_I8A set) has an 8-bit-activation product. */
static inline int i8_valid_fmt(int fmt) {
    const int b = i8_base(fmt);
    return (fmt & QFLAG_I8A) && b >= QF_Q8_0 && b <= QF_Q6_K && b != QF_INT8;
}

static inline int i8_is_k(int base) { return base >= QF_Q4_K; }

/* Weights of one block along k. */
static inline int i8_weights(int base) { return i8_is_k(base) ? QK_K : QK; }

/* Bytes a column has in each of its block's arrays (see the layout above). */
static inline int i8_q_bytes(int base) {
    return base == QF_Q8_0 ? QK : i8_is_k(base) ? 128 : QK / 2;
}
static inline int i8_qh_bytes(int base) {
    return base == QF_Q5_0 || base == QF_Q5_1 ? 4 : base == QF_Q5_K ? 32 : base == QF_Q6_K ? 64 : 0;
}
static inline int i8_has_m(int base) {
    return base == QF_Q4_1 || base == QF_Q5_1 || base == QF_Q4_K || base == QF_Q5_K;
}
static inline int i8_sc_bytes(int base) {
    return base == QF_Q6_K ? 16 : base == QF_Q4_K || base == QF_Q5_K ? 8 : 0;
}
static inline int i8_mn_bytes(int base) { return base == QF_Q4_K || base == QF_Q5_K ? 8 : 0; }

/* Offsets of the arrays in a group's block. */
static inline int64_t i8_off_qh(int base) { return (int64_t)I8G * i8_q_bytes(base); }
static inline int64_t i8_off_d(int base) { return i8_off_qh(base) + (int64_t)I8G * i8_qh_bytes(base); }
static inline int64_t i8_off_m(int base) { return i8_off_d(base) + 2 * I8G; }
static inline int64_t i8_off_sc(int base) { return i8_off_m(base) + (i8_has_m(base) ? 2 * I8G : 0); }
static inline int64_t i8_off_mn(int base) {
    return i8_off_sc(base) + (int64_t)I8G * i8_sc_bytes(base);
}
static inline int64_t i8_group_block_bytes(int base) {
    return i8_off_mn(base) + (int64_t)I8G * i8_mn_bytes(base);
}

static inline int64_t i8_group_bytes(int base, int64_t k) {
    return k / i8_weights(base) * i8_group_block_bytes(base);
}

static int i8_valid(int fmt, int64_t n, int64_t k) {
    return i8_valid_fmt(fmt) && n >= 1 && k >= 1 && !(k % i8_weights(i8_base(fmt)));
}

static int64_t i8_packed_size(int fmt, int64_t n, int64_t k) {
    return i8_valid(fmt, n, k) ? (n + I8G - 1) / I8G * i8_group_bytes(i8_base(fmt), k) : -1;
}

/* Offset of byte ``i`` of column ``c`` in an array of quads. */
static inline int i8_code_at(int c, int i) { return (i / 4) * 4 * I8G + c * 4 + (i % 4); }

/* Where a block format's arrays lie in the file's block (-1: absent). */
typedef struct {
    int q, qh, d, m, scales;
} i8_raw_t;

static i8_raw_t i8_raw(int base) {
    switch (base) {
    case QF_Q5_0: return (i8_raw_t){6, 2, 0, -1, -1};
    case QF_Q5_1: return (i8_raw_t){8, 4, 0, 2, -1};
    case QF_Q4_K: return (i8_raw_t){16, -1, 0, 2, 4};
    case QF_Q5_K: return (i8_raw_t){48, 16, 0, 2, 4};
    default: return (i8_raw_t){0, 128, 208, -1, 192}; /* Q6_K */
    }
}

/* Q5_0/Q5_1: byte ``j`` of the bit planes of the file's fifth bits ``qh`` (see the
 * layout: bit t is weight 4t + j's, for t < 8), and the fifth bits from the bytes ``p``. */
static uint8_t i8_q5_plane(uint32_t qh, int j) {
    uint8_t b = 0;
    for (int t = 0; t < 8; ++t) b |= (uint8_t)(((qh >> (4 * t + j)) & 1u) << t);
    return b;
}
static uint32_t i8_q5_unplane(const uint8_t p[4]) {
    uint32_t qh = 0;
    for (int w = 0; w < 32; ++w) qh |= (uint32_t)((p[w % 4] >> (w / 4)) & 1u) << w;
    return qh;
}

/* Column ``c``'s block ``r`` (the file's bytes) into the group's block ``bo``. */
static void i8_pack_raw(int base, const uint8_t *r, int c, uint8_t *bo) {
    const i8_raw_t a = i8_raw(base);
    for (int i = 0; i < i8_q_bytes(base); ++i) bo[i8_code_at(c, i)] = r[a.q + i];
    if (base == QF_Q5_0 || base == QF_Q5_1) {
        uint32_t qh;
        memcpy(&qh, r + a.qh, 4);
        for (int j = 0; j < 4; ++j) bo[i8_off_qh(base) + i8_code_at(c, j)] = i8_q5_plane(qh, j);
    } else {
        for (int i = 0; i < i8_qh_bytes(base); ++i)
            bo[i8_off_qh(base) + i8_code_at(c, i)] = r[a.qh + i];
    }
    memcpy(bo + i8_off_d(base) + 2 * c, r + a.d, 2);
    if (a.m >= 0) memcpy(bo + i8_off_m(base) + 2 * c, r + a.m, 2);
    if (base == QF_Q6_K) {
        for (int s = 0; s < 16; ++s) bo[i8_off_sc(base) + s * I8G + c] = r[a.scales + s];
    } else if (a.scales >= 0) {
        uint8_t sc[8], mn[8];
        scale_min_k4(r + a.scales, sc, mn);
        for (int s = 0; s < 8; ++s) {
            bo[i8_off_sc(base) + s * I8G + c] = sc[s];
            bo[i8_off_mn(base) + s * I8G + c] = mn[s];
        }
    }
}

/* i8_pack_raw undone: column ``c``'s block as the file's bytes, into ``r``. */
static void i8_unpack_raw(int base, const uint8_t *bo, int c, uint8_t *r) {
    const i8_raw_t a = i8_raw(base);
    for (int i = 0; i < i8_q_bytes(base); ++i) r[a.q + i] = bo[i8_code_at(c, i)];
    if (base == QF_Q5_0 || base == QF_Q5_1) {
        uint8_t p[4];
        for (int j = 0; j < 4; ++j) p[j] = bo[i8_off_qh(base) + i8_code_at(c, j)];
        const uint32_t qh = i8_q5_unplane(p);
        memcpy(r + a.qh, &qh, 4);
    } else {
        for (int i = 0; i < i8_qh_bytes(base); ++i)
            r[a.qh + i] = bo[i8_off_qh(base) + i8_code_at(c, i)];
    }
    memcpy(r + a.d, bo + i8_off_d(base) + 2 * c, 2);
    if (a.m >= 0) memcpy(r + a.m, bo + i8_off_m(base) + 2 * c, 2);
    if (base == QF_Q6_K) {
        for (int s = 0; s < 16; ++s) r[a.scales + s] = bo[i8_off_sc(base) + s * I8G + c];
    } else if (a.scales >= 0) {
        uint8_t sc[8], mn[8];
        for (int s = 0; s < 8; ++s) {
            sc[s] = bo[i8_off_sc(base) + s * I8G + c];
            mn[s] = bo[i8_off_mn(base) + s * I8G + c];
        }
        pack_scale_min_k4(sc, mn, r + a.scales);
    }
}

static int i8_pack(int fmt, const void *qs, const uint16_t *d, const uint16_t *mn, int64_t n,
                   int64_t k, uint8_t *out) {
    if (!i8_valid(fmt, n, k)) return -1;
    const int base = i8_base(fmt), wb = i8_weights(base);
    const int64_t nb = k / wb, bb = i8_group_block_bytes(base), gb = i8_group_bytes(base, k);
    const int blk = base >= QF_Q5_0;
    const int64_t rb = blk ? nb * blk_bytes(base) : (int64_t)nb * i8_q_bytes(base);
    const int64_t groups = (n + I8G - 1) / I8G;
    /* Groups on every thread: one by one, a Gemma 3 1B-shaped Q4_K_M file's weights took
     * 1.5 s of its 4.5 s load. */
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        uint8_t *go = out + g * gb;
        memset(go, 0, (size_t)gb); /* padding columns: all zero */
        for (int64_t j = g * I8G; j < n && j < (g + 1) * I8G; ++j) {
            const int c = (int)(j % I8G);
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t *bo = go + b * bb;
                if (blk) {
                    i8_pack_raw(base, (const uint8_t *)qs + j * rb + b * blk_bytes(base), c, bo);
                    continue;
                }
                const int nc = i8_q_bytes(base);
                const uint8_t *src = (const uint8_t *)qs + j * rb + b * nc;
                const uint8_t flip = base == QF_Q8_0 ? 0x80 : 0; /* Q8_0: c + 128 */
                for (int i = 0; i < nc; ++i) bo[i8_code_at(c, i)] = src[i] ^ flip;
                memcpy(bo + i8_off_d(base) + 2 * c, d + j * nb + b, 2);
                if (base == QF_Q4_1) memcpy(bo + i8_off_m(base) + 2 * c, mn + j * nb + b, 2);
            }
        }
    }
    return 0;
}

/* Column ``c`` of a group's block ``bo`` as float32 weights (the reference's values). */
static void i8_dequant_block(int base, const uint8_t *bo, int c, float *w) {
    if (base >= QF_Q5_0) {
        uint8_t raw[QB_Q5_K > QB_Q6_K ? QB_Q5_K : QB_Q6_K];
        i8_unpack_raw(base, bo, c, raw);
        blk_dequant_raw(base, raw, w);
        return;
    }
    const float dv = f16_bits_to_f32(((const uint16_t *)(bo + i8_off_d(base)))[c]);
    if (base == QF_Q8_0) {
        for (int i = 0; i < QK; ++i) w[i] = dv * (float)(int8_t)(bo[i8_code_at(c, i)] ^ 0x80);
        return;
    }
    const float mv = base == QF_Q4_1 ? f16_bits_to_f32(((const uint16_t *)(bo + i8_off_m(base)))[c]) : 0.0f;
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
    const int base = i8_base(fmt), wb = i8_weights(base);
    const int64_t bb = i8_group_block_bytes(base);
    const uint8_t *grp = packed + j / I8G * i8_group_bytes(base, k);
    for (int64_t b = 0; b < k / wb; ++b)
        i8_dequant_block(base, grp + b * bb, (int)(j % I8G), out + b * wb);
}

/* Rows of x quantized: ``xq`` int8 ``[m, k]``, ``dx`` float32 ``[m, k/32]``, ``sq`` int32
 * ``[m, k/16]`` (the sums of q over each 16 elements). */
static void i8_quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *xq,
                             float *dx, int32_t *sq) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + r * ldx + b * QK;
            int8_t *q = xq + r * k + b * QK;
            int32_t *s = sq + r * 2 * nb + 2 * b;
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
            if (!(amax <= 3.0e38f)) { /* inf (or NaN): no codes; dx carries it to the sums */
                memset(q, 0, QK);
                s[0] = s[1] = 0;
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
            int32_t s0 = 0, s1 = 0; /* in locals: s may alias q (a byte pointer) */
            for (int i = 0; i < 16; ++i) {
                s0 += q[i];
                s1 += q[16 + i];
            }
            s[0] = s0;
            s[1] = s1;
        }
}

/* Integer offset of the codes (subtracted times the sum of q). */
static inline int i8_int_offset(int base) {
    return base == QF_Q4_0 ? 8 : base == QF_Q5_0 ? 16 : base == QF_Q6_K ? 32 : 0;
}

/* Rows a tile's x pointers step by. */
typedef struct {
    const int8_t *xq; /* the tile's first row's q at the block */
    const float *dx;  /* its first row's dx at the block's first 32 */
    const int32_t *sq; /* its first row's sums at the block's first 16 */
    int64_t k;        /* q's row stride; dx's is k / 32, sq's k / 16 */
} i8_rows_t;

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

/* The tiles, once per kind of integer dot (qgemm_i8_kern.h): I8K(name) is name's copy. */
#define I8_CAT2(a, b) a##b
#define I8_CAT(a, b) I8_CAT2(a, b)
#define I8K(name) I8_CAT(name, I8_SUFFIX)

#define XV(op) vq_##op /* the 256-bit copies' vectors (simd.h): eight columns */
#define XVF(op) vq8f_##op
#define XV_T vq
#define XVF_T vq8f
#define I8_COLS I8G
#define I8_WIDE 0
#define I8_SUFFIX _base
#define I8_VNNI 0
#define I8_TARGET
#include "qgemm_i8_kern.h"
#undef I8_SUFFIX
#undef I8_VNNI
#undef I8_TARGET

/* VNNI's vpdpbusd where the build level has an encoding of it and the compiler knows it:
 * AVX-512 VNNI (with AVX-512 VL, at 256 bits) on AVX-512 builds, AVX-VNNI on AVX2 builds.
 * Those functions carry their own target attribute, so the library still loads on CPUs
 * without it; i8_dots_on picks them only where the CPU reports the instructions. */
#if SIMD_I8 && defined(__GNUC__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define I8_HAVE_VNNI 1
#define I8_SUFFIX _vnni
#define I8_VNNI 1
#if defined(__AVX512F__)
#define I8_TARGET __attribute__((target("avx512vnni,avx512vl")))
#define I8_DPBUSD(a, u, s) _mm256_dpbusd_epi32(a, u, s)
#define I8_CPU_HAS_VNNI() __builtin_cpu_supports("avx512vnni")
#else
#define I8_TARGET __attribute__((target("avxvnni")))
#define I8_DPBUSD(a, u, s) _mm256_dpbusd_avx_epi32(a, u, s)
#define I8_CPU_HAS_VNNI() __builtin_cpu_supports("avxvnni")
#endif
#include "qgemm_i8_kern.h"
#else
#define I8_HAVE_VNNI 0
#endif

/* AVX-512 builds: a third copy with 512-bit vectors, two column groups a vector
 * (qgemm_i8_wide.h), VNNI's dots at 512 bits. */
#if I8_HAVE_VNNI && defined(__AVX512F__)
#define I8_HAVE_WIDE 1
#undef XV
#undef XVF
#undef XV_T
#undef XVF_T
#undef I8_COLS
#undef I8_WIDE
#undef I8_SUFFIX
#undef I8_DPBUSD
#define XV(op) wq_##op
#define XVF(op) wq8f_##op
#define XV_T wq
#define XVF_T wq8f
#define I8_COLS (2 * I8G)
#define I8_WIDE 1
#define I8_SUFFIX _wide
#define I8_DPBUSD(a, u, s) _mm512_dpbusd_epi32(a, u, s)
#define I8_SINGLE_GROUPS i8_groups_vnni
#include "qgemm_i8_wide.h"
#include "qgemm_i8_kern.h"
#else
#define I8_HAVE_WIDE 0
#endif

/* Rows from which VNNI512 products take the 512-bit copy. One row is memory-bound, and
 * the 256-bit copy streams one group at a time where the wide one streams two, gs bytes
 * apart: from memory (weights past L3) at one row it read Q5_0 1.27x, Q6_K 1.13x, Q8_0
 * 1.09x and Q4_K 1.07x as fast on a Zen 5; from two rows on the K-quants lose. */
#define I8_WIDE_MIN_ROWS 2

/* The dots in use: the widest VNNI built and on this CPU (I8_DOTS_VNNI512, then
 * I8_DOTS_VNNI), else I8_DOTS_MADDUBS (0 on the portable build, whose scalar sums are
 * neither). */
static int i8_dots_on = -1;

static int i8_dots_built(void) {
    return SIMD_I8 ? I8_DOTS_MADDUBS | (I8_HAVE_VNNI ? I8_DOTS_VNNI : 0) |
                         (I8_HAVE_WIDE ? I8_DOTS_VNNI512 : 0)
                   : 0;
}

static int i8_use_dots(int dots) {
    if (!SIMD_I8) return dots == 0 ? 0 : -1;
    if (dots == I8_DOTS_MADDUBS) return i8_dots_on = I8_DOTS_MADDUBS, 0;
#if I8_HAVE_VNNI
    __builtin_cpu_init();
    if (dots == I8_DOTS_VNNI && I8_CPU_HAS_VNNI()) return i8_dots_on = I8_DOTS_VNNI, 0;
#endif
#if I8_HAVE_WIDE
    if (dots == I8_DOTS_VNNI512 && I8_CPU_HAS_VNNI()) return i8_dots_on = I8_DOTS_VNNI512, 0;
#endif
    return -1;
}

static int i8_dots(void) {
    if (i8_dots_on < 0 && i8_use_dots(I8_DOTS_VNNI512) != 0 && i8_use_dots(I8_DOTS_VNNI) != 0)
        i8_use_dots(I8_DOTS_MADDUBS);
    return SIMD_I8 ? i8_dots_on : 0;
}

static int i8_gemm(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k, const void *packed,
                   int64_t n, const float *bias, float *y, int64_t ldy, int num_threads) {
    if (!i8_valid(fmt, n, k)) return -1;
    if (m < 1) return 0;
    const int64_t nb = k / QK;
    int8_t *xq = malloc((size_t)(m * k));
    float *dx = malloc(sizeof(float) * (size_t)(m * nb));
    int32_t *sq = malloc(sizeof(int32_t) * (size_t)(m * 2 * nb));
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
    void (*run)(void *, int64_t, int64_t, int) = i8_groups_base;
    int64_t items = groups; /* what run takes: groups, or pairs of them */
    const int dots = i8_dots();
    (void)dots;
#if I8_HAVE_VNNI
    if (dots == I8_DOTS_VNNI) run = i8_groups_vnni;
#endif
#if I8_HAVE_WIDE
    if (dots == I8_DOTS_VNNI512 && m >= I8_WIDE_MIN_ROWS) {
        run = i8_groups_wide;
        items = (groups + 1) / 2;
    } else if (dots == I8_DOTS_VNNI512) {
        run = i8_groups_vnni;
    }
#endif
    pool_run(run, &task, items, (items + 4 * nt - 1) / (4 * nt), nt);
    free(xq);
    free(dx);
    free(sq);
    return 0;
}
