/*
 * ioreq.h -- one read request of a batch, and the synchronous loop that is the
 * reference for every I/O backend.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * A request names a file (an fdcache entry, opened on demand), an absolute
 * byte offset, a length and where the bytes go.  `item` is the caller's
 * number for the thing the request belongs to (a window, a document) so an
 * error can name it.  A batch fails with the error of its lowest-numbered
 * failing request: the synchronous loop stops there, and the concurrent
 * backends issue requests in order and stop issuing at the first failure, so
 * every request before it was tried and they report the same one.
 */
#ifndef TOKLOAD_IOREQ_H
#define TOKLOAD_IOREQ_H

#include "common.h"
#include "fdcache.h"
#include "io.h"

#include <fcntl.h>

typedef struct tl_ioreq {
    tl_fent *file;
    uint64_t offset; /* absolute byte offset in the file */
    uint64_t length; /* bytes */
    uint8_t *dst;
    uint64_t item;   /* the caller's number, for errors */
} tl_ioreq;

TL_INLINE void tl_ioreq_fail(const tl_ioreq *q, int code, uint64_t done, tl_io_error *err)
{
    err->code = code;
    err->file = q->file->index;
    err->offset = q->offset;
    err->length = q->length;
    err->done = done;
}

/* Open (pin), read fully, unpin.  Returns 0 or an error code (err filled). */
TL_INLINE int tl_ioreq_exec(const tl_ioreq *q, tl_fdcache *cache, tl_io_faults *faults,
                            tl_io_error *err)
{
    if (q->length == 0) return 0;
    int fd = tl_fdcache_acquire(cache, q->file, 1); /* holds no pin: may wait */
    if (TL_UNLIKELY(fd < 0)) {
        tl_ioreq_fail(q, fd, 0, err);
        return fd;
    }
    uint64_t done = 0;
    int rc = tl_io_pread_full_f(fd, q->dst, q->length, q->offset, &done, faults);
    tl_fdcache_release(cache, q->file);
    if (TL_UNLIKELY(rc)) tl_ioreq_fail(q, rc, done, err);
    return rc;
}

/* The reference: requests one after the other.  *failed = the failing request. */
TL_INLINE int tl_ioreq_run_sync(const tl_ioreq *reqs, size_t n, tl_fdcache *cache,
                                tl_io_faults *faults, tl_io_error *err, size_t *failed)
{
    for (size_t i = 0; i < n; i++) {
        int rc = tl_ioreq_exec(&reqs[i], cache, faults, err);
        if (TL_UNLIKELY(rc)) {
            *failed = i;
            return rc;
        }
    }
    return 0;
}

/*
 * Tell the kernel that reqs[0..n) will be read soon (POSIX_FADV_WILLNEED):
 * it starts reading them into the page cache in the background and returns
 * without waiting, so a slow read (a network filesystem's spike) overlaps
 * what the caller does meanwhile.  dst is not used.  A hint is advice: a file
 * that cannot be opened or advised is skipped.  Returns the hints given.
 */
TL_INLINE size_t tl_ioreq_hint(const tl_ioreq *reqs, size_t n, tl_fdcache *cache)
{
    size_t given = 0;
#ifdef POSIX_FADV_WILLNEED
    for (size_t i = 0; i < n; i++) {
        const tl_ioreq *q = &reqs[i];
        if (q->length == 0) continue;
        int fd = tl_fdcache_acquire(cache, q->file, TL_FD_WAIT_BOUND);
        if (fd < 0) continue;
        given += posix_fadvise(fd, (off_t)q->offset, (off_t)q->length, POSIX_FADV_WILLNEED) == 0;
        tl_fdcache_release(cache, q->file);
    }
#else
    (void)reqs;
    (void)n;
    (void)cache;
#endif
    return given;
}

#endif /* TOKLOAD_IOREQ_H */
