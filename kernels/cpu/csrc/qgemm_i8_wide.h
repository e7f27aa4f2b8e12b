/*
 * qgemm_i8.h's 512-bit vectors for AVX-512 builds with VNNI: one vector holds two column
 * groups, group g's eight columns in its low half and group g + 1's in its high half, so
 * each decoded code byte, broadcast activation and vpdpbusd serves sixteen columns. The
 * groups lie gs bytes apart in the packed weight, so the loads take two halves: the
 * loading helpers are macros over ``gs``, which every tile function has in scope.
 * Included once by qgemm_i8.h, before its wide copy of qgemm_i8_kern.h.
 */
typedef __m512i wq;
typedef __m512 wq8f;

static inline wq wq_join(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline wq wq_load2(const void *p, int64_t gs) {
    return wq_join(_mm256_loadu_si256((const __m256i *)p),
                   _mm256_loadu_si256((const __m256i *)((const uint8_t *)p + gs)));
}
/* Eight bytes of each group's array at ``p``, as sixteen int32 lanes' source. */
static inline __m128i wq_load8x2(const void *p, int64_t gs) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p),
                              _mm_loadl_epi64((const __m128i *)((const uint8_t *)p + gs)));
}
static inline wq8f wq8f_load_f16_2(const uint16_t *p, int64_t gs) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)p);
    const __m128i hi = _mm_loadu_si128((const __m128i *)((const uint8_t *)p + gs));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
#define wq_load(p) wq_load2((p), gs)
#define wq8f_load_f16(p) wq8f_load_f16_2((p), gs)
#define wq8f_load_u8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(wq_load8x2((p), gs)))
#define wq_load_i8x8(p) _mm512_cvtepi8_epi32(wq_load8x2((p), gs))

static inline wq wq_zero(void) { return _mm512_setzero_si512(); }
static inline wq wq_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline wq wq_lo_nibbles(wq w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
static inline wq wq_hi_nibbles(wq w) {
    return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F));
}
static inline wq wq_dot_pairs(wq u, wq s) { return _mm512_maddubs_epi16(u, s); }
static inline wq wq_add16(wq a, wq b) { return _mm512_add_epi16(a, b); }
static inline wq wq_add32(wq a, wq b) { return _mm512_add_epi32(a, b); }
static inline wq wq_sub32(wq a, wq b) { return _mm512_sub_epi32(a, b); }
static inline wq wq_set32(int32_t v) { return _mm512_set1_epi32(v); }
static inline wq wq_sum16(wq a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
static inline wq wq_abs8(wq a) { return _mm512_abs_epi8(a); }
/* ``a``'s bytes negated where ``b``'s are negative (AVX-512 has no vpsignb). Unlike
 * vq_sign8 it keeps a where b is zero: its one use multiplies the result by |b|, 0 there. */
static inline wq wq_sign8(wq a, wq b) {
    return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(b), _mm512_setzero_si512(), a);
}
static inline wq8f wq_to_f32(wq a) { return _mm512_cvtepi32_ps(a); }
static inline wq8f wq8f_zero(void) { return _mm512_setzero_ps(); }
static inline wq8f wq8f_set1(float v) { return _mm512_set1_ps(v); }
static inline wq8f wq8f_mul(wq8f a, wq8f b) { return _mm512_mul_ps(a, b); }
static inline wq8f wq8f_fmadd(wq8f a, wq8f b, wq8f c) { return _mm512_fmadd_ps(a, b, c); }
static inline void wq8f_store(float *p, wq8f v) { _mm512_storeu_ps(p, v); }
static inline wq wq_and(wq a, wq b) { return _mm512_and_si512(a, b); }
static inline wq wq_or(wq a, wq b) { return _mm512_or_si512(a, b); }
static inline wq wq_xor(wq a, wq b) { return _mm512_xor_si512(a, b); }
static inline wq wq_set8(int8_t v) { return _mm512_set1_epi8(v); }
static inline wq wq_slli16(wq a, int n) { return _mm512_slli_epi16(a, (unsigned)n); }
static inline wq wq_srli16(wq a, int n) { return _mm512_srli_epi16(a, (unsigned)n); }
static inline wq wq_pair16(wq v) {
    return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(v, 16));
}
static inline wq wq_madd16(wq a, wq b) { return _mm512_madd_epi16(a, b); }
static inline wq wq_mul32(wq a, wq b) { return _mm512_mullo_epi32(a, b); }
