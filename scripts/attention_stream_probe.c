/*
 * A synthetic stand-in for the CPU decode attention's memory stream (BENCHMARKS.md,
 * "Long-context decode against the bandwidth read beside each step"): 30 layers of the
 * engine's KV cache layout for one 7,864-token request (per layer a K and a V region of
 * 492 blocks of 16 rows x 3 KV heads x 64 floats), read in the kernel's order (each
 * head's 256-byte slice of a block's rows in turn, K then V), with the kernel's
 * prefetches (the same slice two blocks ahead, into L2), by two OpenMP threads taking
 * chunks of 32 blocks, and WORK register-only multiply-adds per slice.
 *
 * It prints, for each amount of arithmetic and for the engine's block layout ([row][head])
 * and a heads-first one ([head][row], the same slices in address order): a second pass
 * from memory, the same work on one layer's 12 MB from L3 (30 times), a plain read of the
 * bytes, and the first over the larger of the other two (1.0: the stream and the
 * arithmetic overlap fully).
 *
 *   cc -O3 -fopenmp -march=x86-64-v4 scripts/attention_stream_probe.c -o /tmp/probe
 *   /tmp/probe
 *
 * Needs AVX-512 (x86-64-v4).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

#define BLOCK_BYTES 12288 /* 16 rows x 3 heads x 64 floats */
#define BLOCKS 492
#define LAYERS 30
#define CHUNK 32
#define AHEAD 2

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One block's slices, head by head, each row's four lines multiplied ``work`` times;
 * ``heads_first``: the block laid out [head][row] (each head's rows contiguous, so the
 * slices are read in address order) instead of the engine's [row][head]. */
static void block(const char *base, const char *ahead, int work, int heads_first, __m512 *a) {
    const __m512 w = _mm512_set1_ps(1.0001f);
    for (int h = 0; h < 3; h++)
        for (int r = 0; r < 16; r++) {
            const int64_t off = heads_first ? (h * 16 + r) * 256 : r * 768 + h * 256;
            if (ahead)
                for (int l = 0; l < 256; l += 64) _mm_prefetch(ahead + off + l, _MM_HINT_T1);
            __m512 x[4];
            const float *row = (const float *)(base + off);
            for (int j = 0; j < 4; j++) x[j] = _mm512_loadu_ps(row + 16 * j);
            for (int k = 0; k < work; k++)
                for (int j = 0; j < 4; j++) {
                    a[j] = _mm512_fmadd_ps(a[j], w, x[j]);
                    a[4 + j] = _mm512_fmadd_ps(a[4 + j], w, x[j]);
                }
            for (int j = 0; j < 4; j++) a[j] = _mm512_add_ps(a[j], x[j]);
        }
}

static float pass(const char *cache, int work, int heads_first, int layers) {
    float total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
    {
        const int t = omp_get_thread_num();
        __m512 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
        for (int l = 0; l < layers; l++) {
            const char *k = cache + (int64_t)l * 2 * BLOCKS * BLOCK_BYTES;
            const char *v = k + (int64_t)BLOCKS * BLOCK_BYTES;
            for (int c = t; c * CHUNK < BLOCKS; c += 2)
                for (int b = c * CHUNK; b < BLOCKS && b < (c + 1) * CHUNK; b++) {
                    const int pf = b + AHEAD < BLOCKS;
                    block(k + (int64_t)b * BLOCK_BYTES,
                          pf ? k + (int64_t)(b + AHEAD) * BLOCK_BYTES : 0, work, heads_first, a);
                    block(v + (int64_t)b * BLOCK_BYTES,
                          pf ? v + (int64_t)(b + AHEAD) * BLOCK_BYTES : 0, work, heads_first, a);
                }
#pragma omp barrier
        }
        for (int i = 1; i < 8; i++) a[0] = _mm512_add_ps(a[0], a[i]);
        total = _mm512_reduce_add_ps(a[0]);
    }
    return total;
}

static float plain_read(const float *p, int64_t n) {
    float total = 0;
#pragma omp parallel for num_threads(2) reduction(+ : total) schedule(static)
    for (int64_t i = 0; i < n; i += 16) total += _mm512_reduce_add_ps(_mm512_loadu_ps(p + i));
    return total;
}

int main(void) {
    const int64_t bytes = (int64_t)LAYERS * 2 * BLOCKS * BLOCK_BYTES;
    char *cache = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (cache == MAP_FAILED) return 1;
    madvise(cache, bytes, MADV_HUGEPAGE);
    for (int64_t i = 0; i < bytes / 4; i++) ((float *)cache)[i] = 1e-3f;
    volatile float sink = 0;
    for (int round = 0; round < 3; round++)
        for (int work = 0; work <= 6; work += 3)
            for (int heads_first = 0; heads_first < 2; heads_first++) {
                sink = pass(cache, work, heads_first, LAYERS);
                double t0 = now();
                sink = pass(cache, work, heads_first, LAYERS);
                const double memory = now() - t0;
                sink = pass(cache, work, heads_first, 1);
                t0 = now();
                for (int i = 0; i < LAYERS; i++) sink = pass(cache, work, heads_first, 1);
                const double l3 = now() - t0;
                t0 = now();
                sink = plain_read((const float *)cache, bytes / 4);
                const double read = now() - t0;
                const double larger = l3 > read ? l3 : read;
                printf("work %d, %s: from memory %6.2f ms, from L3 %6.2f ms, plain read %6.2f "
                       "ms, memory / larger %.2f\n",
                       work, heads_first ? "heads first" : "rows first ", memory * 1e3,
                       l3 * 1e3, read * 1e3, memory / larger);
            }
    (void)sink;
    return 0;
}
