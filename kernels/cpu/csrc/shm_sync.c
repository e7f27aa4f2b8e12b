/*
 * The flags of a shared-memory exchange between processes on one machine (the CPU
 * tensor-parallel ranks' all-reduce). Each rank owns one int64 sequence number on its
 * own cache line: it writes its tensor into its slot, then publishes the collective's
 * sequence number (a release store); a reader waits until every flag has reached that
 * number (acquire loads), so the slots it then reads hold that collective's data on
 * any memory model.
 */
#define _POSIX_C_SOURCE 200809L
#include <sched.h>
#include <time.h>

#include "abi.h"

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void shm_publish(int64_t *flag, int64_t seq) { __atomic_store_n(flag, seq, __ATOMIC_RELEASE); }

int shm_wait(const int64_t *flags, int n, int64_t stride, int64_t seq, int64_t timeout_us) {
    int64_t deadline = -1;
    for (int i = 0; i < n; i++) {
        const int64_t *f = flags + (int64_t)i * stride;
        for (int64_t spins = 0; __atomic_load_n(f, __ATOMIC_ACQUIRE) < seq; spins++) {
            if (spins < SHM_SPINS) {
                cpu_relax();
                continue;
            }
            sched_yield(); /* a peer sharing this core gets to run */
            if ((spins & 255) == 0) {
                int64_t t = now_us();
                if (deadline < 0)
                    deadline = t + timeout_us;
                else if (t > deadline)
                    return SHM_TIMEOUT;
            }
        }
    }
    return 0;
}
