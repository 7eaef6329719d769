/*
 * engine.h -- run a batch of read requests on the chosen I/O backend.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * Three backends read the same bytes and report the same errors:
 *   TL_IO_SYNC     one request after the other (ioreq.h; the reference);
 *   TL_IO_THREADS  a pool of C threads, up to `depth` preadv in flight (pool.h);
 *   TL_IO_URING    io_uring, up to `depth` reads in flight (uring.h).
 * The caller (tokload/_io.pyx) owns the process-wide descriptor cache and
 * pool, hands a ring to one call at a time, and picks the backend.
 */
#ifndef TOKLOAD_ENGINE_H
#define TOKLOAD_ENGINE_H

#include "common.h"
#include "ioreq.h"
#include "pool.h"
#include "uring.h"

#define TL_IO_SYNC 0
#define TL_IO_THREADS 1
#define TL_IO_URING 2

typedef struct tl_engine {
    int backend;
    unsigned depth;       /* reads in flight per batch (>= 1) */
    tl_fdcache *cache;
    tl_pool *pool;        /* TL_IO_THREADS */
    tl_uring *ring;       /* TL_IO_URING: used by this call only */
    tl_io_faults *faults; /* NULL: none (always NULL in release builds) */
} tl_engine;

/* Run reqs[0..n).  Returns 0 or the error of the lowest failing request. */
TL_INLINE int tl_engine_run(const tl_engine *e, const tl_ioreq *reqs, size_t n, tl_io_error *err,
                            size_t *failed)
{
    if (n == 0) return 0;
    /* One request gains nothing from a queue: the synchronous loop is the
     * cheapest path to the same result. */
    if (e->backend == TL_IO_URING && e->ring && n > 1)
        return tl_uring_run(e->ring, reqs, n, e->depth, e->cache, e->faults, err, failed);
    if (e->backend == TL_IO_THREADS && e->pool && n > 1)
        return tl_pool_run(e->pool, reqs, n, e->depth, e->cache, e->faults, err, failed);
    return tl_ioreq_run_sync(reqs, n, e->cache, e->faults, err, failed);
}

#endif /* TOKLOAD_ENGINE_H */
