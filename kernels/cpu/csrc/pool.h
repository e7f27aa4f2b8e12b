/* The native kernels' thread pool (pool.c): the caller and the pool's workers split
 * ``[0, n)`` in chunks of ``grain`` items. */
#ifndef PAGEDSERVE_POOL_H
#define PAGEDSERVE_POOL_H

#include <stdint.h>

/* The most threads a task runs on (the caller included). */
#define POOL_MAX_THREADS 64

/* Items ``[begin, end)`` of a task; ``worker`` is 0 for the caller and 1.. for the
 * pool's threads (an index for per-thread scratch, below ``max_threads``). */
typedef void (*pool_fn)(void *ctx, int64_t begin, int64_t end, int worker);

/* Run ``fn`` over ``[0, n)`` in chunks of ``grain`` items on up to ``max_threads``
 * threads, the caller included; returns when every item is done. Calls are serialized
 * (one task at a time); a task must not call pool_run. */
void pool_run(pool_fn fn, void *ctx, int64_t n, int64_t grain, int max_threads);

#endif
