/*
 * Float32 linear layer for few rows: y = x @ W^T (+ bias), with W packed once at load.
 *
 * A decode step multiplies a few dozen rows by each weight matrix. At such sizes the
 * BLAS paths torch calls split the work poorly across two cores (some shapes run at one
 * core's speed), and F.linear repacks W on every call. Here W ``[n, k]`` is
 * packed at load into panels of NR = 48 output columns, each stored k-major
 * (``panel[kk * NR + j] = W[n0 + j, kk]``, zero-padded past n), so a panel is read
 * once per call as one stream. Threads take contiguous ranges of panels; within a
 * panel, tiles of MR = 8 rows keep 8 x 48 sums in 24 AVX-512 registers over the whole
 * of k, so each output is one fused multiply-add chain in k order, plus the bias.
 *
 * Only built with AVX-512 (``gemm_f32_available`` says so); elsewhere the caller keeps
 * torch's linear.
 */
#include <omp.h>
#include <stdint.h>

#include "simd_math.h"

#define NR 48
#define MR 8
/* Rows of x per pass over the panels (x stays in L2). */
#define MC 128
/* Weights smaller than this many floats stay on the calling thread (even for one row,
 * two threads stream a larger weight from memory faster than one). */
#define PARALLEL_MIN_WEIGHT (1 << 16)

/* Floats in the packed form of an ``[n, k]`` weight. */
int64_t gemm_f32_packed_size(int64_t n, int64_t k) { return (n + NR - 1) / NR * NR * k; }

void gemm_f32_pack(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * NR * k;
        for (int64_t j = 0; j < NR; j++) {
            const int64_t col = p * NR + j;
            if (col < n) {
                const float *src = w + col * k;
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + j] = src[kk];
            } else {
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + j] = 0.0f;
            }
        }
    }
}

#if defined(__AVX512F__)

int gemm_f32_available(void) { return 1; }

/* ``mr`` (1..MR) rows of x times one panel, written to ``cols`` (1..NR) columns of y. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx,
                                                       const float *panel, int64_t k,
                                                       const float *bias, float *y,
                                                       int64_t ldy, int cols, const char *pf,
                                                       int64_t pf_lines, const int mr) {
    __m512 acc[MR][3];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
    /* ``pf_lines`` cache lines from ``pf`` are prefetched evenly over the k loop: in a
     * burst, the prefetches fill the core's line-fill buffers and stall the arithmetic
     * (evenly spread: 12-18% less time for a decode step's linears at 24-64 rows). */
    int64_t line = 0, due = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *b = panel + kk * NR;
        due += pf_lines;
        while (due >= k && line < pf_lines) {
            _mm_prefetch(pf + 64 * line, _MM_HINT_T1);
            line++;
            due -= k;
        }
        const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16),
                     b2 = _mm512_load_ps(b + 32);
        for (int i = 0; i < mr; i++) {
            const __m512 a = _mm512_set1_ps(x[i * ldx + kk]);
            acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(a, b2, acc[i][2]);
        }
    }
    for (int j = 0; j < 3; j++) {
        const int left = cols - 16 * j;
        if (left <= 0) break;
        const __mmask16 m = tail_mask(left);
        const __m512 bj = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const __m512 v = bias ? _mm512_add_ps(acc[i][j], bj) : acc[i][j];
            _mm512_mask_storeu_ps(y + i * ldy + 16 * j, m, v);
        }
    }
}

#define TILE_FN(R)                                                                        \
    static void tile_##R(const float *x, int64_t ldx, const float *panel, int64_t k,     \
                         const float *bias, float *y, int64_t ldy, int cols,              \
                         const char *pf, int64_t pf_lines) {                              \
        tile(x, ldx, panel, k, bias, y, ldy, cols, pf, pf_lines, R);                      \
    }
TILE_FN(1)
TILE_FN(2)
TILE_FN(3)
TILE_FN(4)
TILE_FN(5)
TILE_FN(6)
TILE_FN(7)
TILE_FN(8)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, const float *,
                        float *, int64_t, int, const char *, int64_t);
static const tile_fn TILES[MR + 1] = {0,      tile_1, tile_2, tile_3, tile_4,
                                      tile_5, tile_6, tile_7, tile_8};

static void panels_range(const float *x, int64_t ldx, int64_t m, int64_t k,
                         const float *packed, int64_t n, const float *bias, float *y,
                         int64_t ldy, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = packed + p * NR * k;
        const int64_t c0 = p * NR;
        const int cols = (int)(n - c0 < NR ? n - c0 : NR);
        const float *pb = bias ? bias + c0 : 0;
        /* The tiles of this panel share out prefetching the next one into L2: with the
         * weights in DRAM a decode step's linears take 15-25% less time at 8-64 rows
         * (one panel ahead is best; two or three are slightly slower). */
        const int64_t tiles = (m + MR - 1) / MR, lines = NR * k * 4 / 64;
        const int64_t per_tile = p + 1 < p1 ? (lines + tiles - 1) / tiles : 0;
        const char *next = (const char *)(panel + NR * k);
        for (int64_t r = 0, t = 0; r < m; r += MR, t++) {
            const int mr = (int)(m - r < MR ? m - r : MR);
            int64_t pf_lines = lines - t * per_tile;
            pf_lines = pf_lines < per_tile ? pf_lines : per_tile;
            TILES[mr](x + r * ldx, ldx, panel, k, pb, y + r * ldy + c0, ldy, cols,
                      next + 64 * t * per_tile, pf_lines);
        }
    }
}

static void blocks_range(const float *x, int64_t ldx, int64_t m, int64_t k,
                         const float *packed, int64_t n, const float *bias, float *y,
                         int64_t ldy, int64_t p0, int64_t p1) {
    for (int64_t r = 0; r < m; r += MC)
        panels_range(x + r * ldx, ldx, m - r < MC ? m - r : MC, k, packed, n, bias,
                     y + r * ldy, ldy, p0, p1);
}

/* x ``[m, k]`` (row stride ldx), packed from ``gemm_f32_pack``, bias ``[n]`` or NULL,
 * y ``[m, n]`` (row stride ldy). */
void gemm_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
              int64_t n, const float *bias, float *y, int64_t ldy, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    int nt = n * k >= PARALLEL_MIN_WEIGHT && num_threads > 1 ? num_threads : 1;
    if (nt > panels) nt = (int)panels;
    if (nt <= 1) {
        blocks_range(x, ldx, m, k, packed, n, bias, y, ldy, 0, panels);
        return;
    }
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num();
        blocks_range(x, ldx, m, k, packed, n, bias, y, ldy, panels * t / nt,
                     panels * (t + 1) / nt);
    }
}

#else

int gemm_f32_available(void) { return 0; }

void gemm_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
              int64_t n, const float *bias, float *y, int64_t ldy, int num_threads) {
    (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)ldy, (void)num_threads;
}

#endif
