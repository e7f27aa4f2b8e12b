/*
 * A small thread pool for the native CPU kernels: the calling thread and the pool's
 * workers split a range of independent items in chunks (``pool_run``).
 *
 * Why not OpenMP regions: a decode step of a small model runs ~150 short parallel
 * regions with Python between them. libgomp's idle workers either sleep after a short
 * spin (then every region pays a wake-up, 30-50 us on a VM) or spin long (then a
 * region whose worker lost its core to another process waits for it: a step can take
 * 30x longer on a loaded machine). Here:
 *   - workers spin for a bounded time after each task (``pool_set_spin_us``), yielding
 *     the core every few microseconds so that another runnable thread on it (the
 *     server's event loop, a client) is not held up; then they sleep on a futex;
 *   - the caller takes chunks too, and nobody waits for a worker that has not started:
 *     chunks are claimed from a shared counter, so a worker that is off its core claims
 *     nothing, and the caller waits only for chunks already claimed.
 *
 * A task is published through ``claim`` (generation << 32 | next chunk): the caller
 * closes the word to claims under a new generation, writes the task's fields, then
 * opens it. A claim is a compare-and-swap on the word, so a worker that read the fields
 * of one generation can never claim a chunk of another. Workers start on first use, as
 * many as the largest ``max_threads`` asked for less one; after a fork the child has
 * none and the caller runs every chunk itself.
 */
#define _GNU_SOURCE
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "abi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define LOCKED 0xFFFFFFFFu

static struct {
    /* generation << 32 | next chunk to claim */
    _Atomic uint64_t claim;
    /* chunks finished in the current generation */
    _Atomic int64_t done;
    /* the current task (written while no chunk can be claimed) */
    _Atomic(pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n, grain, num_chunks;
    _Atomic int max_threads;
    /* futex word: bumped at each publish; sleepers wait on it */
    _Atomic uint32_t wake_seq;
    _Atomic int num_sleeping;
    _Atomic int spin_us;
    int num_workers;
    pthread_mutex_t lock; /* one task at a time; worker start-up */
    pthread_t threads[POOL_MAX_THREADS];
} P = {.spin_us = DEFAULT_SPIN_US, .lock = PTHREAD_MUTEX_INITIALIZER};

static inline uint32_t gen_of(uint64_t c) { return (uint32_t)(c >> 32); }
static inline uint32_t next_of(uint64_t c) { return (uint32_t)c; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#if defined(__linux__)
static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
}
#else /* no futex: nap and look again */
static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    const struct timespec nap = {0, 50000};
    if (atomic_load(addr) == expected) nanosleep(&nap, NULL);
}

static void futex_wake_all(_Atomic uint32_t *addr) { (void)addr; }
#endif

/* Claim and run chunks of generation ``gen`` until none is left. */
static void work(uint32_t gen, int worker) {
    uint64_t c;
    for (;;) { /* the task's fields are readable once its generation is open */
        c = atomic_load(&P.claim);
        if (gen_of(c) != gen) return;
        if (next_of(c) != LOCKED) break;
        CPU_RELAX();
    }
    const pool_fn fn = atomic_load(&P.fn);
    void *const ctx = atomic_load(&P.ctx);
    const int64_t n = atomic_load(&P.n), grain = atomic_load(&P.grain);
    const int64_t chunks = atomic_load(&P.num_chunks);
    /* A claim succeeds only while generation gen is current: then these fields are
     * gen's (a newer task closes the word before it writes its fields). */
    while (gen_of(c) == gen && next_of(c) < chunks) {
        if (!atomic_compare_exchange_weak(&P.claim, &c, c + 1)) continue;
        const int64_t i = next_of(c), b = i * grain;
        fn(ctx, b, b + grain < n ? b + grain : n, worker);
        atomic_fetch_add(&P.done, 1);
        c = atomic_load(&P.claim);
    }
}

static void *worker_main(void *arg) {
    const int worker = (int)(intptr_t)arg;
    uint32_t seen = gen_of(atomic_load(&P.claim));
    for (;;) {
        /* Spin (yielding now and then) for a new generation, then sleep. */
        const int64_t deadline = now_ns() + (int64_t)atomic_load(&P.spin_us) * 1000;
        uint32_t gen = gen_of(atomic_load(&P.claim));
        for (int spins = 0; gen == seen; ++spins) {
            CPU_RELAX();
            if ((spins & 63) == 63) {
                if (now_ns() > deadline) break;
                sched_yield();
            }
            gen = gen_of(atomic_load(&P.claim));
        }
        if (gen == seen) {
            const uint32_t ws = atomic_load(&P.wake_seq);
            atomic_fetch_add(&P.num_sleeping, 1);
            if (gen_of(atomic_load(&P.claim)) == seen) futex_wait(&P.wake_seq, ws);
            atomic_fetch_sub(&P.num_sleeping, 1);
            continue;
        }
        seen = gen;
        if (worker < atomic_load(&P.max_threads)) work(gen, worker);
    }
    return NULL;
}

static void start_workers(int count) {
    while (P.num_workers < count && P.num_workers < POOL_MAX_THREADS - 1) {
        const int id = P.num_workers + 1;
        if (pthread_create(&P.threads[P.num_workers], NULL, worker_main, (void *)(intptr_t)id))
            break;
        pthread_detach(P.threads[P.num_workers]);
        ++P.num_workers;
    }
}

int pool_size(void) { return P.num_workers + 1; }

void pool_set_spin_us(int spin_us) { atomic_store(&P.spin_us, spin_us < 0 ? 0 : spin_us); }

void pool_run(pool_fn fn, void *ctx, int64_t n, int64_t grain, int max_threads) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int64_t chunks = (n + grain - 1) / grain;
    if (max_threads <= 1 || chunks == 1) {
        fn(ctx, 0, n, 0);
        return;
    }
    if (max_threads > POOL_MAX_THREADS) max_threads = POOL_MAX_THREADS;
    pthread_mutex_lock(&P.lock);
    if (P.num_workers < max_threads - 1) start_workers(max_threads - 1);
    /* Close the old generation to claims, write the task, then open it. */
    const uint32_t gen = gen_of(atomic_load(&P.claim)) + 1;
    atomic_store(&P.claim, (uint64_t)gen << 32 | LOCKED);
    atomic_store(&P.fn, fn);
    atomic_store(&P.ctx, ctx);
    atomic_store(&P.n, n);
    atomic_store(&P.grain, grain);
    atomic_store(&P.num_chunks, chunks);
    atomic_store(&P.max_threads, max_threads);
    atomic_store(&P.done, 0);
    atomic_store(&P.claim, (uint64_t)gen << 32);
    atomic_fetch_add(&P.wake_seq, 1);
    if (atomic_load(&P.num_sleeping) > 0) futex_wake_all(&P.wake_seq);
    work(gen, 0);
    /* Only chunks already claimed remain: wait for them. */
    for (int spins = 0; atomic_load(&P.done) < chunks; ++spins) {
        CPU_RELAX();
        if ((spins & 1023) == 1023) sched_yield();
    }
    pthread_mutex_unlock(&P.lock);
}
