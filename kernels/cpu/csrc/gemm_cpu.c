/*
 * Float32 linear layer for few rows: y = x @ W^T (+ bias), with W packed once at load.
 *
 * A decode step multiplies a few dozen rows by each weight matrix. At such sizes the
 * BLAS paths torch calls split the work poorly across two cores (some shapes run at one
 * core's speed), and F.linear repacks W on every call. Here W ``[n, k]`` is
 * packed at load into panels of NR output columns, each stored k-major
 * (``panel[kk * NR + j] = W[n0 + j, kk]``, zero-padded past n), so a panel is read
 * once per call as one stream. Threads take contiguous ranges of panels; within a
 * panel, tiles of MR rows keep MR x NR sums in registers over the whole of k, so each
 * output is one fused multiply-add chain in k order, plus the bias. The tile fills the
 * register file: 8 x 48 in 24 of AVX-512's 32 registers, 6 x 16 in 12 of AVX2's 16.
 *
 * An MLP's gate/up weight ``[2 * inter, k]`` (gate rows, then up rows) can be packed in
 * pairs instead (``gemm_f32_pair_pack``): each panel holds NR / 2 gate columns and the
 * same NR / 2 up columns, so that a tile holds both halves of its outputs and its
 * epilogue writes act(gate) * up (gated.h) straight to ``[m, inter]``: the product's
 * ``[m, 2 * inter]`` is never written and read back (``gemm_f32_pair``; PAIR_SPLIT writes
 * the plain product instead).
 *
 * Built with a vector unit (simd.h; ``gemm_f32_available`` says so, and
 * ``gemm_f32_packed_size`` gives the packed size for this build's NR); elsewhere the
 * caller keeps torch's linear.
 */
#include <omp.h>
#include <stdint.h>

#include "abi.h"
#include "gated.h"
#include "pool.h"
#include "simd.h"

#if SIMD_VW == 16
#define NV 3 /* vectors across a panel */
#define MR 8
#elif SIMD_VW == 8
#define NV 2
#define MR 6
#else
#define NV 1
#define MR 1
#endif
#define NR (NV * (SIMD_VW ? SIMD_VW : 16))
/* Gate (and up) columns of a pair panel. */
#define HR (NR / 2)
/* Rows of x per pass over the panels (x stays in L2). */
#define MC 128
/* A panel read by one tile only (a batch of at most MR rows) is one stream through
 * memory. With AVX2 (16 columns, 64 bytes a k step) each k step fetches into L1 the lines
 * STREAM_AHEAD bytes ahead of the ones it reads; with AVX-512 (48 columns) the hardware
 * prefetchers alone stream it faster. One decode row's linears over weights in DRAM, on
 * Zen 4 against the other choice: AVX2 build 4 KiB ahead 0.85-1.0x the time of no
 * prefetch (1-4 rows); AVX-512 build no prefetch 0.82x (1 row) and 0.96x (4-8 rows) the
 * time of 4 KiB ahead (BENCHMARKS.md). */
#define STREAM_AHEAD 4096
#define STREAM_PREFETCH (SIMD_VW == 8)
/* Weights smaller than this many floats stay on the calling thread (even for one row,
 * two threads stream a larger weight from memory faster than one). */
#define PARALLEL_MIN_WEIGHT (1 << 16)
/* Rows from which the panels are shared out evenly rather than in prefetching runs. */
#define BALANCE_ROWS 32

/* Floats in the packed form of an ``[n, k]`` weight. */
int64_t gemm_f32_packed_size(int64_t n, int64_t k) { return (n + NR - 1) / NR * NR * k; }

/* Panels of NR columns, k-major; ``pair``: of an ``[2 * n, k]`` gate/up weight, each
 * panel HR gate columns then the same HR up columns; else of an ``[n, k]`` weight. Columns
 * past the weight's are zeros. */
static void pack_panels(const float *w, int64_t n, int64_t k, float *packed, int pair) {
    const int64_t width = pair ? HR : NR, panels = (n + width - 1) / width;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * NR * k;
        for (int64_t j = 0; j < NR; j++) {
            const int64_t col = p * width + j % width; /* of the gate's or the up's rows */
            if (col < n) {
                const float *src = w + (pair && j >= HR ? n + col : col) * k;
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + j] = src[kk];
            } else {
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + j] = 0.0f;
            }
        }
    }
}

void gemm_f32_pack(const float *w, int64_t n, int64_t k, float *packed) {
    pack_panels(w, n, k, packed, 0);
}

int64_t gemm_f32_pair_packed_size(int64_t inter, int64_t k) {
    return (inter + HR - 1) / HR * NR * k;
}

void gemm_f32_pair_pack(const float *w, int64_t inter, int64_t k, float *packed) {
    pack_panels(w, inter, k, packed, 1);
}

#if SIMD_VW

int gemm_f32_available(void) { return 1; }

/* Where a tile's outputs go: ``cols`` columns of ``y`` (rows ``ldy`` apart), plus
 * ``bias`` or NULL; for a pair panel (``mode`` PAIR_*) the up half's columns of ``up``
 * (PAIR_SPLIT) and its bias ``bias_up``. */
typedef struct {
    const float *bias, *bias_up;
    float *y, *up;
    int64_t ldy;
    int cols, mode;
} out_t;

/* A pair panel's accumulators of one row as its gate and up halves, HR = NV * VW / 2
 * lanes each, in whole vectors: ``g[h]``, ``u[h]`` hold lanes ``h * VW ..`` of each half
 * (those past HR unused). In registers (a copy through memory would stall on
 * store-to-load forwarding): AVX2's two vectors are the halves; AVX-512's three hold
 * gate 0-15, gate 16-23 | up 0-7, up 8-23. */
#define PAIR_VECS ((HR + SIMD_VW - 1) / SIMD_VW)
static inline __attribute__((always_inline)) void pair_halves(const vf *acc, vf *g, vf *u) {
#if SIMD_VW == 16
    g[0] = acc[0];
    g[1] = acc[1];
    u[0] = _mm512_shuffle_f32x4(acc[1], acc[2], _MM_SHUFFLE(1, 0, 3, 2));
    u[1] = _mm512_shuffle_f32x4(acc[2], acc[2], _MM_SHUFFLE(3, 2, 3, 2));
#else
    g[0] = acc[0];
    u[0] = acc[1];
#endif
}

/* The epilogue of a pair panel's tile: each row's gate and up halves (plus their
 * biases) to ``o`` as act(gate) * up, or side by side (PAIR_SPLIT). */
static inline __attribute__((always_inline)) void pair_out(vf acc[][NV], int mr,
                                                           const out_t *o) {
    const int gelu = o->mode == PAIR_GELU_TANH;
    vf bg[PAIR_VECS], bu[PAIR_VECS];
    for (int h = 0; h < PAIR_VECS; h++) {
        const int left = o->cols - SIMD_VW * h;
        bg[h] = o->bias && left > 0 ? vf_load_first(o->bias + SIMD_VW * h, left) : vf_zero();
        bu[h] = o->bias && left > 0 ? vf_load_first(o->bias_up + SIMD_VW * h, left) : vf_zero();
    }
    for (int i = 0; i < mr; i++) {
        vf g[PAIR_VECS], u[PAIR_VECS];
        pair_halves(acc[i], g, u);
        for (int h = 0; h < PAIR_VECS; h++) {
            const int left = o->cols - SIMD_VW * h;
            if (left <= 0) break;
            if (o->bias) {
                g[h] = vf_add(g[h], bg[h]);
                u[h] = vf_add(u[h], bu[h]);
            }
            float *y = o->y + i * o->ldy + SIMD_VW * h;
            if (o->mode == PAIR_SPLIT) {
                vf_store_first(y, left, g[h]);
                vf_store_first(o->up + i * o->ldy + SIMD_VW * h, left, u[h]);
            } else {
                vf_store_first(y, left, gated_vec(g[h], u[h], gelu));
            }
        }
    }
}

/* ``mr`` (1..MR) rows of x times one panel, written to ``cols`` (1..NR) columns of y;
 * or, ``pair`` (a compile-time NULL in the plain tiles), as ``pair`` says. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx,
                                                       const float *panel, int64_t k,
                                                       const float *bias, float *y,
                                                       int64_t ldy, int cols, const char *pf,
                                                       int64_t pf_lines, const int stream,
                                                       const int mr, const out_t *pair) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = vf_zero();
    /* ``pf_lines`` cache lines from ``pf`` are prefetched evenly over the k loop: in a
     * burst, the prefetches fill the core's line-fill buffers and stall the arithmetic
     * (evenly spread: 12-18% less time for a decode step's linears at 24-64 rows).
     * ``stream``: the lines STREAM_AHEAD bytes ahead instead (STREAM_PREFETCH), or
     * none. */
    int64_t line = 0, due = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *b = panel + kk * NR;
        if (STREAM_PREFETCH && stream)
            for (int j = 0; j < NR * 4; j += 64) prefetch_l1((const char *)b + STREAM_AHEAD + j);
        due += pf_lines;
        while (due >= k && line < pf_lines) {
            prefetch_l2(pf + 64 * line);
            line++;
            due -= k;
        }
        vf bv[NV];
        for (int j = 0; j < NV; j++) bv[j] = vf_load_aligned(b + SIMD_VW * j);
        for (int i = 0; i < mr; i++) {
            const vf a = vf_set1(x[i * ldx + kk]);
            for (int j = 0; j < NV; j++) acc[i][j] = vf_fmadd(a, bv[j], acc[i][j]);
        }
    }
    if (pair) { /* a pair panel's epilogue (pair_tile_R) */
        pair_out(acc, mr, pair);
        return;
    }
    for (int j = 0; j < NV; j++) {
        const int left = cols - SIMD_VW * j;
        if (left <= 0) break;
        const vf bj = bias ? vf_load_first(bias + SIMD_VW * j, left) : vf_zero();
        for (int i = 0; i < mr; i++) {
            const vf v = bias ? vf_add(acc[i][j], bj) : acc[i][j];
            if (left >= SIMD_VW)
                vf_store(y + i * ldy + SIMD_VW * j, v);
            else
                vf_store_first(y + i * ldy + SIMD_VW * j, left, v);
        }
    }
}

#define TILE_FN(R)                                                                        \
    static void tile_##R(const float *x, int64_t ldx, const float *panel, int64_t k,     \
                         const float *bias, float *y, int64_t ldy, int cols,              \
                         const char *pf, int64_t pf_lines, int stream) {                  \
        tile(x, ldx, panel, k, bias, y, ldy, cols, pf, pf_lines, stream, R, NULL);        \
    }                                                                                     \
    static void pair_tile_##R(const float *x, int64_t ldx, const float *panel, int64_t k,\
                              const out_t *o, const char *pf, int64_t pf_lines,           \
                              int stream) {                                               \
        tile(x, ldx, panel, k, NULL, NULL, 0, 0, pf, pf_lines, stream, R, o);             \
    }
TILE_FN(1)
TILE_FN(2)
TILE_FN(3)
TILE_FN(4)
TILE_FN(5)
TILE_FN(6)
#if MR > 6
TILE_FN(7)
TILE_FN(8)
#endif

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, const float *,
                        float *, int64_t, int, const char *, int64_t, int);
static const tile_fn TILES[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6,
#if MR > 6
                                      tile_7, tile_8
#endif
};
typedef void (*pair_tile_fn)(const float *, int64_t, const float *, int64_t, const out_t *,
                             const char *, int64_t, int);
static const pair_tile_fn PAIR_TILES[MR + 1] = {0, pair_tile_1, pair_tile_2, pair_tile_3,
                                                pair_tile_4, pair_tile_5, pair_tile_6,
#if MR > 6
                                                pair_tile_7, pair_tile_8
#endif
};

/* Panels ``p0 .. p1 - 1``; ``after``: the panel to prefetch while the last of them is
 * read (-1: none). ``mode`` PAIR_NONE: plain panels of ``n`` columns; else pair panels of
 * a gate/up weight whose gate has ``n`` rows, through the pair tiles' epilogue. */
static void panels_range(const float *x, int64_t ldx, int64_t m, int64_t k,
                         const float *packed, int64_t n, const float *bias, float *y,
                         int64_t ldy, int64_t p0, int64_t p1, int64_t after, int mode) {
    const int width = mode == PAIR_NONE ? NR : HR;
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = packed + p * NR * k;
        const int64_t c0 = p * width;
        const int cols = (int)(n - c0 < width ? n - c0 : width);
        const float *pb = bias ? bias + c0 : 0;
        /* The tiles of this panel share out prefetching the next one into L2: with the
         * weights in DRAM a decode step's linears take 15-25% less time at 8-64 rows
         * (one panel ahead is best; two or three are slightly slower). One tile streams
         * its panel instead (STREAM_AHEAD, STREAM_PREFETCH). */
        const int64_t tiles = (m + MR - 1) / MR, lines = NR * k * 4 / 64;
        const int stream = tiles == 1;
        const int64_t ahead = p + 1 < p1 ? p + 1 : after;
        const int64_t per_tile = ahead >= 0 && !stream ? (lines + tiles - 1) / tiles : 0;
        const char *next = (const char *)(packed + (ahead >= 0 ? ahead : 0) * NR * k);
        for (int64_t r = 0, t = 0; r < m; r += MR, t++) {
            const int mr = (int)(m - r < MR ? m - r : MR);
            int64_t pf_lines = lines - t * per_tile;
            pf_lines = pf_lines < per_tile ? pf_lines : per_tile;
            const char *pf = next + 64 * t * per_tile;
            float *yt = y + r * ldy + c0;
            if (mode == PAIR_NONE) {
                TILES[mr](x + r * ldx, ldx, panel, k, pb, yt, ldy, cols, pf, pf_lines, stream);
                continue;
            }
            const out_t o = {pb, bias ? bias + n + c0 : NULL, yt,
                             mode == PAIR_SPLIT ? yt + n : NULL, ldy, cols, mode};
            PAIR_TILES[mr](x + r * ldx, ldx, panel, k, &o, pf, pf_lines, stream);
        }
    }
}

typedef struct {
    const float *x;
    int64_t ldx, m, k;
    const float *packed;
    /* the output columns (a pair weight: its gate's rows) */
    int64_t n;
    const float *bias;
    float *y;
    int64_t ldy;
    /* PAIR_NONE, or the pair tiles' epilogue */
    int mode;
    /* panels in all; chunks are claimed in turn, so a thread's next chunk likely starts
     * ``ahead`` panels past the end of its last */
    int64_t panels, ahead;
} gemm_task_t;

static void gemm_panels(void *ctx, int64_t p0, int64_t p1, int worker) {
    (void)worker;
    const gemm_task_t *t = ctx;
    /* The likely next chunk's first panel is fetched during this chunk's last, as a
     * chunk's panels fetch one another: a chunk no longer starts on a panel in DRAM
     * (one decode step's linears at 32-64 rows over weights in DRAM: 0.66-0.88 of the
     * FMA peak before, 0.73-0.93 after, in turn on a Zen 5). A wrong guess costs one
     * panel's prefetch, which the thread that takes it then finds in cache. */
    const int64_t next = p1 + t->ahead < t->panels ? p1 + t->ahead : -1;
    for (int64_t r = 0; r < t->m; r += MC) /* a block of rows but the last: p0 follows */
        panels_range(t->x + r * t->ldx, t->ldx, t->m - r < MC ? t->m - r : MC, t->k,
                     t->packed, t->n, t->bias, t->y + r * t->ldy, t->ldy, p0, p1,
                     r + MC < t->m ? p0 : next, t->mode);
}

/* The task over its panels on ``num_threads`` threads; ``weight`` floats of weight. */
static void gemm_run(gemm_task_t *task, int64_t weight, int num_threads) {
    const int64_t panels = task->panels;
    const int nt = weight >= PARALLEL_MIN_WEIGHT && num_threads > 1 ? num_threads : 1;
    /* Chunks of panels, about four per thread: a thread that starts late or loses its
     * core leaves its share to the others. Past BALANCE_ROWS rows (bound by arithmetic)
     * a count of chunks the threads cannot share evenly is raised by smaller chunks:
     * 20 panels on two threads in ten chunks of two, not seven of three (11 panels
     * against 9: 0.92-0.95x the time at 33-2,048 rows on a Zen 5). Larger chunks are kept
     * otherwise, since a chunk's panels prefetch one another. */
    const int64_t per = 4 * (int64_t)nt;
    int64_t grain = (panels + per - 1) / per;
    if (task->m > BALANCE_ROWS && (panels + grain - 1) / grain % nt != 0 && panels / per >= 1)
        grain = panels / per;
    task->ahead = (nt - 1) * grain;
    pool_run(gemm_panels, task, panels, grain, nt);
}

/* x ``[m, k]`` (row stride ldx), packed from ``gemm_f32_pack``, bias ``[n]`` or NULL,
 * y ``[m, n]`` (row stride ldy). */
void gemm_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
              int64_t n, const float *bias, float *y, int64_t ldy, int num_threads) {
    gemm_task_t task = {x, ldx, m, k, packed, n, bias, y, ldy, PAIR_NONE,
                        (n + NR - 1) / NR, 0};
    gemm_run(&task, n * k, num_threads);
}

/* x ``[m, k]`` times a gate/up weight packed from ``gemm_f32_pair_pack``, bias ``[2 *
 * inter]`` or NULL: y ``[m, inter]`` (row stride ldy) = act(gate) * up, ``mode``
 * PAIR_SILU or PAIR_GELU_TANH; or, PAIR_SPLIT, the plain product ``[m, 2 * inter]``.
 * Each output is the same as gemm_f32's (then silu_mul_f32's or gelu_tanh_mul_f32's) on
 * the same weight, bit for bit. Returns 0, or -1 for an unknown mode. */
int gemm_f32_pair(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
                  int64_t inter, const float *bias, int mode, float *y, int64_t ldy,
                  int num_threads) {
    if (mode != PAIR_SPLIT && mode != PAIR_SILU && mode != PAIR_GELU_TANH) return -1;
    gemm_task_t task = {x, ldx, m, k, packed, inter, bias, y, ldy, mode,
                        (inter + HR - 1) / HR, 0};
    gemm_run(&task, 2 * inter * k, num_threads);
    return 0;
}

/* Independent multiply-add chains a thread keeps in registers: enough to cover the
 * FMA latency times the number of FMA units on every x86-64 core (Zen 1: 5 cycles x 1
 * 256-bit unit; Skylake-X: 4 x 2 512-bit units). */
#define PEAK_CHAINS 12
#define PEAK_STEPS (1 << 21)

/* The float32 multiply-add peak of ``num_threads`` threads at this build's vector width,
 * in GFLOP/s (2 per multiply-add): every thread runs PEAK_CHAINS independent chains of
 * vf_fmadd on registers alone, all threads at once; best of 5 timings after an untimed
 * one. The ceiling the matrix products of gemm_f32 (and torch's BLAS at the same width)
 * work against. 0 when OpenMP gives fewer threads than asked. */
float fma_peak_gflops(int num_threads) {
    static volatile float sink, factor = 0.999f, term = 1e-4f; /* not constants to fold */
    if (num_threads < 1) num_threads = 1;
    double best = 0.0;
    for (int rep = 0; rep < 6; rep++) {
        int team = 0;
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(num_threads)
        {
            const vf a = vf_set1(factor), b = vf_set1(term);
            vf acc[PEAK_CHAINS];
            for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = vf_set1((float)c);
            for (int64_t s = 0; s < PEAK_STEPS; s++) {
#pragma GCC unroll 12
                for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = vf_fmadd(acc[c], a, b);
            }
            for (int c = 1; c < PEAK_CHAINS; c++) acc[0] = vf_add(acc[0], acc[c]);
            if (omp_get_thread_num() == 0) team = omp_get_num_threads();
#pragma omp critical
            sink += vf_reduce_add(acc[0]);
        }
        const double dt = omp_get_wtime() - t0;
        if (team != num_threads) return 0.0f;
        const double gflops = 2.0 * SIMD_VW * PEAK_CHAINS * (double)PEAK_STEPS * team / dt / 1e9;
        if (rep > 0 && gflops > best) best = gflops;
    }
    return (float)best;
}

#else

int gemm_f32_available(void) { return 0; }

float fma_peak_gflops(int num_threads) {
    (void)num_threads;
    return 0.0f;
}

void gemm_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
              int64_t n, const float *bias, float *y, int64_t ldy, int num_threads) {
    (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y;
    (void)ldy, (void)num_threads;
}

int gemm_f32_pair(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed,
                  int64_t inter, const float *bias, int mode, float *y, int64_t ldy,
                  int num_threads) {
    (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)inter, (void)bias, (void)mode;
    (void)y, (void)ldy, (void)num_threads;
    return -1;
}

#endif
