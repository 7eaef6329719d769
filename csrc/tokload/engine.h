/*
 * engine.h -- run a batch of read requests on the chosen I/O backend.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * Three backends read the same bytes and report the same errors:
 *   TL_IO_SYNC     one request after the other (ioreq.h; the reference);
 *   TL_IO_THREADS  a pool of C threads, up to `depth` preadv in flight (pool.h);
 *   TL_IO_URING    io_uring, up to `depth` reads in flight (uring.h);
 *   TL_IO_REMOTE   objects in an object store: the whole batch is handed to
 *                  `remote(remote_ctx, ...)`, a function the caller supplies
 *                  (tokload/_remote.pyx: it queues the batch for the process's
 *                  fetcher and waits without the GIL, handoff.h).
 * The caller (tokload/_io.pyx) owns the process-wide descriptor cache and
 * pool, hands a ring to one call at a time, and picks the backend.
 */
#ifndef TOKLOAD_ENGINE_H
#define TOKLOAD_ENGINE_H

#include "common.h"
#include "ioreq.h"
#include "pool.h"
#include "uring.h"

#include <time.h>

#define TL_IO_SYNC 0
#define TL_IO_THREADS 1
#define TL_IO_URING 2
#define TL_IO_REMOTE 3

/* A remote backend's failure: err->file/offset/length name the request; the
 * backend keeps the cause for the caller to raise (tokload/_remote.pyx). */
#define TL_ERR_REMOTE (-100003)

/* Runs reqs[0..n) (each request's `file->index` names the object), the same
 * contract as tl_ioreq_run_sync: 0, or an error code with err and *failed. */
typedef int (*tl_remote_fn)(void *ctx, const tl_ioreq *reqs, size_t n, unsigned depth,
                            tl_io_error *err, size_t *failed);

/* Totals of the tl_engine_run calls given them (the caller owns the struct;
 * many threads add to one at once, with relaxed atomic adds: each total is
 * exact, but a snapshot of several is not taken at one instant). */
typedef struct tl_io_counters {
    uint64_t calls;    /* calls with at least one request */
    uint64_t requests; /* read requests run */
    uint64_t bytes;    /* bytes of the requests of calls that succeeded */
    uint64_t failed;   /* calls that returned an error */
    uint64_t ns;       /* time in those calls (CLOCK_MONOTONIC), all threads summed */
} tl_io_counters;

typedef struct tl_engine {
    int backend;
    unsigned depth;       /* reads in flight per batch (>= 1) */
    tl_fdcache *cache;
    tl_pool *pool;        /* TL_IO_THREADS */
    tl_uring *ring;       /* TL_IO_URING: used by this call only */
    tl_io_faults *faults; /* NULL: none (always NULL in release builds) */
    tl_io_counters *counters; /* NULL: not counted */
    tl_remote_fn remote;  /* TL_IO_REMOTE */
    void *remote_ctx;
} tl_engine;

/* A copy of the totals (each read atomically). */
TL_INLINE void tl_io_counters_read(const tl_io_counters *c, tl_io_counters *out)
{
    out->calls = __atomic_load_n(&c->calls, __ATOMIC_RELAXED);
    out->requests = __atomic_load_n(&c->requests, __ATOMIC_RELAXED);
    out->bytes = __atomic_load_n(&c->bytes, __ATOMIC_RELAXED);
    out->failed = __atomic_load_n(&c->failed, __ATOMIC_RELAXED);
    out->ns = __atomic_load_n(&c->ns, __ATOMIC_RELAXED);
}

TL_INLINE uint64_t tl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

TL_INLINE int tl_engine_dispatch(const tl_engine *e, const tl_ioreq *reqs, size_t n,
                                 tl_io_error *err, size_t *failed)
{
    if (e->backend == TL_IO_REMOTE) return e->remote(e->remote_ctx, reqs, n, e->depth, err, failed);
    /* One request gains nothing from a queue: the synchronous loop is the
     * cheapest path to the same result. */
    if (e->backend == TL_IO_URING && e->ring && n > 1)
        return tl_uring_run(e->ring, reqs, n, e->depth, e->cache, e->faults, err, failed);
    if (e->backend == TL_IO_THREADS && e->pool && n > 1)
        return tl_pool_run(e->pool, reqs, n, e->depth, e->cache, e->faults, err, failed);
    return tl_ioreq_run_sync(reqs, n, e->cache, e->faults, err, failed);
}

/* Run reqs[0..n).  Returns 0 or the error of the lowest failing request. */
TL_INLINE int tl_engine_run(const tl_engine *e, const tl_ioreq *reqs, size_t n, tl_io_error *err,
                            size_t *failed)
{
    if (n == 0) return 0;
    tl_io_counters *c = e->counters;
    if (c == NULL) return tl_engine_dispatch(e, reqs, n, err, failed);
    uint64_t t0 = tl_now_ns();
    int rc = tl_engine_dispatch(e, reqs, n, err, failed);
    uint64_t ns = tl_now_ns() - t0, bytes = 0;
    for (size_t i = 0; i < n; i++) bytes += reqs[i].length;
    __atomic_fetch_add(&c->calls, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c->requests, (uint64_t)n, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c->ns, ns, __ATOMIC_RELAXED);
    if (rc == 0)
        __atomic_fetch_add(&c->bytes, bytes, __ATOMIC_RELAXED);
    else
        __atomic_fetch_add(&c->failed, 1, __ATOMIC_RELAXED);
    return rc;
}

#endif /* TOKLOAD_ENGINE_H */
