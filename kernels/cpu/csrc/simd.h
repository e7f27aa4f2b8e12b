/*
 * One vector type for the CPU kernels, its width chosen at compile time:
 *
 *   AVX-512F              SIMD_VW 16  (``-march=x86-64-v4`` and newer)
 *   AVX2 + FMA + F16C     SIMD_VW 8   (``-march=x86-64-v3``: Haswell and Zen onwards)
 *   anything else         SIMD_VW 0   (the kernels' portable loops; aarch64 included)
 *
 * Each kernel is written once against ``vf`` (VW float32 lanes) and ``vmask`` (a
 * subset of the lanes); only this header names intrinsics. Every operation rounds as
 * its scalar form does, and ``vf_exp`` gives the same bits at both widths.
 */
#ifndef PAGEDSERVE_SIMD_H
#define PAGEDSERVE_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SIMD_VW 16
#define SIMD_NAME "avx512"
typedef __m512 vf;
typedef __mmask16 vmask;

#define vf_load _mm512_loadu_ps
#define vf_load_aligned _mm512_load_ps
#define vf_store _mm512_storeu_ps
#define vf_store_aligned _mm512_store_ps
#define vf_set1 _mm512_set1_ps
#define vf_zero _mm512_setzero_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_min _mm512_min_ps
#define vf_max _mm512_max_ps
/* a * b + c and c - a * b, each rounded once. */
#define vf_fmadd _mm512_fmadd_ps
#define vf_fnmadd _mm512_fnmadd_ps
#define vf_reduce_add _mm512_reduce_add_ps
#define vf_reduce_max _mm512_reduce_max_ps

static inline vf vf_round(vf x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* p * 2^n for integral n in [-126, 128]. */
static inline vf vf_scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }

/* The first ``n`` lanes (all of them for n >= VW). */
static inline vmask vm_first(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}
/* Lanes ``lo .. hi - 1`` (either bound may lie outside the vector). */
static inline vmask vm_range(int lo, int hi) {
    lo = lo < 0 ? 0 : lo;
    hi = hi > 16 ? 16 : hi;
    return hi <= lo ? (__mmask16)0 : (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}
static inline vmask vm_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline vmask vm_nan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
static inline vmask vm_or(vmask a, vmask b) { return a | b; }
static inline int vm_any(vmask m) { return m != 0; }
/* m ? a : b, lane by lane. */
static inline vf vf_select(vmask m, vf a, vf b) { return _mm512_mask_mov_ps(b, m, a); }
/* The first ``n`` floats at ``p`` (lanes past them are zero and never read). */
static inline vf vf_load_first(const float *p, int n) {
    return _mm512_maskz_loadu_ps(vm_first(n), p);
}
static inline void vf_store_first(float *p, int n, vf v) {
    _mm512_mask_storeu_ps(p, vm_first(n), v);
}
/* VW bfloat16 / float16 values widened to float32 (exact). */
static inline vf vf_load_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf vf_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* VW int8 values widened to float32. */
static inline vf vf_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* VW bytes as two vectors: their low nibbles and their high nibbles, 0-15 each. Each
 * byte is widened to a lane first and split there (fewer operations than splitting
 * bytes, then widening). */
static inline void vf_load_nibble_lanes(const uint8_t *p, vf *lo, vf *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
/* vf_load_nibble_lanes through a table: a lane's low 4 bits pick its float (the low
 * nibble needs no mask). */
static inline void vf_load_nibble_lanes_lut(const uint8_t *p, vf *lo, vf *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512 t = _mm512_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f, 9.0f,
                                    10.0f, 11.0f, 12.0f, 13.0f, 14.0f, 15.0f);
    *lo = _mm512_permutexvar_ps(v, t);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
}
static inline float f16_to_f32_fast(uint16_t h) { return _cvtsh_ss(h); }
/* VW int32 lanes (the block formats' codes, decoded with integer operations). */
typedef __m512i vi;
/* VW bytes widened to int32 lanes, 0-255. */
static inline vi vi_load_u8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vi vi_load_i32(const void *p) { return _mm512_loadu_si512(p); }
static inline vi vi_set1(int v) { return _mm512_set1_epi32(v); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_srli(vi a, int n) { return _mm512_srli_epi32(a, (unsigned)n); }
static inline vi vi_slli(vi a, int n) { return _mm512_slli_epi32(a, (unsigned)n); }
static inline vf vi_to_vf(vi a) { return _mm512_cvtepi32_ps(a); }
/* 1 / d: the hardware estimate refined by one Newton step (within an ulp or two). */
static inline vf vf_rcp(vf d) {
    const vf r = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

/* VW horizontal sums at once: lane r of the result is the sum of the lanes of
 * ``p[VF_SUM_SLOT(r)]``. Each step adds pairs of lanes that come from the same input
 * vector, so a lane of the result never mixes two inputs (unused slots may hold
 * anything finite). 15 shuffle pairs and adds instead of 16 reductions. */
#define VF_SUM_SLOT(r) (4 * ((r) & 3) + ((r) >> 2))
/* The transposing tree with ``OP`` (add or max) combining the pairs of lanes. */
#define VF_LANES_TREE(name, OP)                                                         \
    static inline __attribute__((always_inline)) vf name(const vf *p) {                \
        __m512 c[8], d[4], e[2];                                                        \
        for (int i = 0; i < 8; ++i)                                                     \
            c[i] = OP(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x44),               \
                      _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xEE));              \
        for (int i = 0; i < 4; ++i)                                                     \
            d[i] = OP(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),               \
                      _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));              \
        for (int i = 0; i < 2; ++i)                                                     \
            e[i] = OP(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0x44),                  \
                      _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0xEE));                 \
        return OP(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD)); \
    }
VF_LANES_TREE(vf_sum_lanes, _mm512_add_ps)
/* The same for maxima: lane r is the largest lane of ``p[VF_SUM_SLOT(r)]``. */
VF_LANES_TREE(vf_max_lanes, _mm512_max_ps)

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD_VW 8
#define SIMD_NAME "avx2"
typedef __m256 vf;
typedef __m256 vmask; /* all-ones lanes */

#define vf_load _mm256_loadu_ps
#define vf_load_aligned _mm256_load_ps
#define vf_store _mm256_storeu_ps
#define vf_store_aligned _mm256_store_ps
#define vf_set1 _mm256_set1_ps
#define vf_zero _mm256_setzero_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_min _mm256_min_ps
#define vf_max _mm256_max_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_fnmadd _mm256_fnmadd_ps

static inline float vf_reduce_add(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vf_reduce_max(vf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
static inline vf vf_round(vf x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p * 2^n for integral n in [-126, 128], as two exact power-of-two products (2^n
 * alone is not a float at n = 128), so the result rounds once, as scalef's. */
static inline vf vf_scale2(vf p, vf n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
static inline vmask vm_first(int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
}
static inline vmask vm_range(int lo, int hi) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i below_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), lane);
    const __m256i below_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane);
    return _mm256_castsi256_ps(_mm256_andnot_si256(below_lo, below_hi));
}
static inline vmask vm_gt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
static inline vmask vm_nan(vf a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
static inline vmask vm_or(vmask a, vmask b) { return _mm256_or_ps(a, b); }
static inline int vm_any(vmask m) { return _mm256_movemask_ps(m) != 0; }
static inline vf vf_select(vmask m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }
/* Through a stack copy for a partial vector: AMD cores microcode VMASKMOVPS stores
 * (tens of cycles each). */
static inline vf vf_load_first(const float *p, int n) {
    if (n >= 8) return _mm256_loadu_ps(p);
    float tmp[8] = {0};
    memcpy(tmp, p, sizeof(float) * (size_t)(n > 0 ? n : 0));
    return _mm256_loadu_ps(tmp);
}
static inline void vf_store_first(float *p, int n, vf v) {
    if (n >= 8) {
        _mm256_storeu_ps(p, v);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    memcpy(p, tmp, sizeof(float) * (size_t)(n > 0 ? n : 0));
}
static inline vf vf_load_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vf_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf vf_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void vf_load_nibble_lanes(const uint8_t *p, vf *lo, vf *hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#define vf_load_nibble_lanes_lut vf_load_nibble_lanes
static inline float f16_to_f32_fast(uint16_t h) { return _cvtsh_ss(h); }
typedef __m256i vi;
static inline vi vi_load_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vi vi_load_i32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_set1(int v) { return _mm256_set1_epi32(v); }
static inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_srli(vi a, int n) { return _mm256_srli_epi32(a, n); }
static inline vi vi_slli(vi a, int n) { return _mm256_slli_epi32(a, n); }
static inline vf vi_to_vf(vi a) { return _mm256_cvtepi32_ps(a); }
/* The 12-bit estimate and one Newton step: about 22 bits. */
static inline vf vf_rcp(vf d) {
    const vf r = _mm256_rcp_ps(d);
    return _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.0f)));
}

/* Lane r of the result is the sum of the lanes of ``p[r]`` (three rounds of pairwise
 * adds within each input, then the two halves). */
#define VF_SUM_SLOT(r) (r)
/* Pairs of neighbouring lanes combined in hadd's order, with max. */
static inline __m256 vf_hmax_pairs(__m256 a, __m256 b) {
    return _mm256_max_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
}
/* The tree with ``PAIRS`` combining neighbouring lanes and ``OP`` the two halves. */
#define VF_LANES_TREE(name, PAIRS, OP)                                                 \
    static inline __attribute__((always_inline)) vf name(const vf *p) {               \
        const __m256 t0 = PAIRS(p[0], p[1]), t1 = PAIRS(p[2], p[3]);                   \
        const __m256 t2 = PAIRS(p[4], p[5]), t3 = PAIRS(p[6], p[7]);                   \
        const __m256 u0 = PAIRS(t0, t1), u1 = PAIRS(t2, t3);                           \
        return OP(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)); \
    }
VF_LANES_TREE(vf_sum_lanes, _mm256_hadd_ps, _mm256_add_ps)
/* The same for maxima: lane r is the largest lane of ``p[r]``. */
VF_LANES_TREE(vf_max_lanes, vf_hmax_pairs, _mm256_max_ps)

#else
#define SIMD_VW 0
#define SIMD_NAME "portable"
#endif

#if SIMD_VW
/* VW unsigned bytes as float32. */
static inline vf vf_load_u8(const uint8_t *p) { return vi_to_vf(vi_load_u8(p)); }

/* A GGML 4-bit block (16 bytes: elements 0-15 in the low nibbles, 16-31 in the high)
 * as 32 / VW vectors of its codes 0-15, in element order. */
static inline void vf_load_nibbles32(const uint8_t *p, vf *out) {
    for (int h = 0; h < 16 / SIMD_VW; ++h)
        vf_load_nibble_lanes(p + h * SIMD_VW, &out[h], &out[16 / SIMD_VW + h]);
}

/* exp of the ``N`` vectors at ``x``, in place (Cephes' polynomial after n*ln2 range
 * reduction; ~1 ulp). Inputs below -87 give about 1e-38 and above 88.7 overflow to
 * +inf, as expf. Each step is taken for all the vectors before the next, so that their
 * chains of dependent operations overlap (``N`` a compile-time constant up to 4). */
static inline __attribute__((always_inline)) void vf_exp_many(vf *x, const int N) {
    vf n[4], r[4], p[4];
    for (int i = 0; i < N; ++i) {
        x[i] = vf_min(vf_max(x[i], vf_set1(-87.0f)), vf_set1(89.0f));
        n[i] = vf_round(vf_mul(x[i], vf_set1(1.44269504088896341f)));
    }
    for (int i = 0; i < N; ++i) r[i] = vf_fnmadd(n[i], vf_set1(0.693359375f), x[i]);
    for (int i = 0; i < N; ++i) r[i] = vf_fnmadd(n[i], vf_set1(-2.12194440e-4f), r[i]);
    for (int i = 0; i < N; ++i)
        p[i] = vf_fmadd(vf_set1(1.9875691500e-4f), r[i], vf_set1(1.3981999507e-3f));
    for (int i = 0; i < N; ++i) p[i] = vf_fmadd(p[i], r[i], vf_set1(8.3334519073e-3f));
    for (int i = 0; i < N; ++i) p[i] = vf_fmadd(p[i], r[i], vf_set1(4.1665795894e-2f));
    for (int i = 0; i < N; ++i) p[i] = vf_fmadd(p[i], r[i], vf_set1(1.6666665459e-1f));
    for (int i = 0; i < N; ++i) p[i] = vf_fmadd(p[i], r[i], vf_set1(5.0000001201e-1f));
    for (int i = 0; i < N; ++i)
        p[i] = vf_fmadd(vf_mul(p[i], r[i]), r[i], vf_add(r[i], vf_set1(1.0f)));
    for (int i = 0; i < N; ++i) x[i] = vf_scale2(p[i], n[i]);
}

/* exp of ``n`` vectors at ``x`` (a run-time count), in place: groups of four, then two,
 * then one, each overlapping its vectors' steps. */
static inline __attribute__((always_inline)) void vf_exp_array(vf *x, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vf_exp_many(x + i, 4);
    if (i + 2 <= n) {
        vf_exp_many(x + i, 2);
        i += 2;
    }
    if (i < n) vf_exp_many(x + i, 1);
}

/* exp(x) of one vector (vf_exp_many's bits). */
static inline vf vf_exp(vf x) {
    vf_exp_many(&x, 1);
    return x;
}

/* Fetch the cache line at ``p`` into L2. */
#define prefetch_l2(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
/* Fetch the cache line at ``p`` into L1. */
#define prefetch_l1(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#endif


/* ------------------------------------------------------------------------- */
/* Integer dot products of bytes, eight output columns at a time (qgemm_i8.h). */
/* ------------------------------------------------------------------------- */
/* ``vq``: 32 bytes, four consecutive bytes of each of eight columns; ``vq8f``: those
 * columns' eight float32 sums. AVX2's 256-bit integer instructions, on AVX-512 builds
 * too (the same instructions, the same results). */
#if defined(__AVX2__)
#define SIMD_I8 1
typedef __m256i vq;
typedef __m256 vq8f;
static inline vq vq_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vq vq_zero(void) { return _mm256_setzero_si256(); }
/* The four bytes at ``p`` in every column. */
static inline vq vq_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline vq vq_lo_nibbles(vq w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
static inline vq vq_hi_nibbles(vq w) {
    return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F));
}
/* Unsigned bytes ``u`` times signed bytes ``s``, neighbouring pairs summed to int16
 * (each pair's sum must fit: |sum| < 32768). */
static inline vq vq_dot_pairs(vq u, vq s) { return _mm256_maddubs_epi16(u, s); }
static inline vq vq_add16(vq a, vq b) { return _mm256_add_epi16(a, b); }
static inline vq vq_add32(vq a, vq b) { return _mm256_add_epi32(a, b); }
static inline vq vq_sub32(vq a, vq b) { return _mm256_sub_epi32(a, b); }
static inline vq vq_set32(int32_t v) { return _mm256_set1_epi32(v); }
/* Neighbouring int16 pairs summed to int32: a column's four bytes, one lane. */
static inline vq vq_sum16(vq a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
static inline vq vq_abs8(vq a) { return _mm256_abs_epi8(a); }
/* ``a``'s bytes with the signs of ``b``'s (zero where b's byte is zero). */
static inline vq vq_sign8(vq a, vq b) { return _mm256_sign_epi8(a, b); }
static inline vq8f vq_to_f32(vq a) { return _mm256_cvtepi32_ps(a); }
static inline vq8f vq8f_zero(void) { return _mm256_setzero_ps(); }
static inline vq8f vq8f_set1(float v) { return _mm256_set1_ps(v); }
static inline vq8f vq8f_mul(vq8f a, vq8f b) { return _mm256_mul_ps(a, b); }
static inline vq8f vq8f_fmadd(vq8f a, vq8f b, vq8f c) { return _mm256_fmadd_ps(a, b, c); }
static inline vq8f vq8f_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vq8f vq8f_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vq8f_store(float *p, vq8f v) { _mm256_storeu_ps(p, v); }
static inline vq vq_and(vq a, vq b) { return _mm256_and_si256(a, b); }
static inline vq vq_xor(vq a, vq b) { return _mm256_xor_si256(a, b); }
static inline vq vq_or(vq a, vq b) { return _mm256_or_si256(a, b); }
static inline vq vq_set8(int8_t v) { return _mm256_set1_epi8(v); }
/* Shifts of 16-bit lanes (a byte's bits move within it as long as the caller masks the
 * bits that cross into the neighbouring byte). */
static inline vq vq_slli16(vq a, int n) { return _mm256_slli_epi16(a, n); }
static inline vq vq_srli16(vq a, int n) { return _mm256_srli_epi16(a, n); }
/* Eight signed bytes as int32 lanes; such lanes as int16 pairs (both halves the value,
 * for |v| < 32768); int16 pairs times int16 pairs, summed to int32; int32 products. */
static inline vq vq_load_i8x8(const int8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vq vq_pair16(vq v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}
static inline vq vq_madd16(vq a, vq b) { return _mm256_madd_epi16(a, b); }
static inline vq vq_mul32(vq a, vq b) { return _mm256_mullo_epi32(a, b); }
/* Eight unsigned / signed bytes as float32. */
static inline vq8f vq8f_load_u8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vq8f vq8f_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* The largest |x| of 32 floats, and those floats times ``id`` rounded to the nearest
 * integer (ties to even) as bytes. */
static inline float vq_absmax32(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int i = 8; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
static inline void vq_quantize32(const float *x, float id, int8_t *q) {
    const __m256 s = _mm256_set1_ps(id);
    __m256i v[4];
    for (int i = 0; i < 4; ++i)
        v[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), s),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* packs interleave 128-bit halves: undo with one permute */
    const __m256i a = _mm256_packs_epi32(v[0], v[1]), b = _mm256_packs_epi32(v[2], v[3]);
    const __m256i c = _mm256_packs_epi16(a, b);
    _mm256_storeu_si256((__m256i *)q,
                        _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#else
#define SIMD_I8 0
#endif

#endif
