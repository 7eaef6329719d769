/*
 * io.h -- positional reads that either fill the whole buffer or say why not.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * Every read in tokload is a `preadv` at an explicit offset straight into the
 * caller's buffer: no shared file position, so any number of threads can read
 * the same descriptor at once.  The loop retries EINTR and continues after
 * short reads; end of file before the requested length is reported as such,
 * never papered over.  Errors are negative errno values (saved at once after
 * the failing call); TL_IO_EOF is tokload's own code for "the file ended".
 * engine.h runs batches of such reads with many in flight; this is the
 * synchronous reference every backend must match.
 */
#ifndef TOKLOAD_IO_H
#define TOKLOAD_IO_H

#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* A read ended at end of file before its length (distinct from every errno). */
#define TL_IO_EOF (-100000)

/* Where a failed read was, for the caller's error message. */
typedef struct tl_io_error {
    int code;         /* negative errno, or TL_IO_EOF */
    int32_t file;     /* the caller's file number */
    uint64_t offset;  /* byte offset the failed read started at */
    uint64_t length;  /* bytes asked for */
    uint64_t done;    /* bytes read before the failure */
} tl_io_error;

/*
 * Fault injection (debug builds: TL_FAULT_INJECTION).  Each read attempt
 * draws from a counter hashed with a seed; with probability rate/2^32 the
 * attempt is replaced by one of the enabled faults: a short read (half the
 * bytes asked for), EINTR, EAGAIN (both retried) or EIO (an error).  Every
 * backend applies the same draw at the same point (after the kernel's answer,
 * before the result is used), so each path's handling is exercised.
 */
#ifdef TL_FAULT_INJECTION
#define TL_FAULTS_BUILT 1
#else
#define TL_FAULTS_BUILT 0
#endif
#define TL_FAULT_SHORT 1u
#define TL_FAULT_EINTR 2u
#define TL_FAULT_EAGAIN 4u
#define TL_FAULT_EIO 8u

typedef struct tl_io_faults {
    uint64_t seed;
    uint64_t counter; /* atomic */
    uint32_t rate;    /* faults per 2^32 attempts; 0: none */
    uint32_t kinds;   /* TL_FAULT_* mask */
} tl_io_faults;

/* Retries of EAGAIN before it is reported (regular files never return it;
 * a descriptor that keeps doing so is not one tokload can read). */
#define TL_IO_EAGAIN_RETRIES 1000

/* The fault to inject into this attempt (0: none). */
TL_INLINE uint32_t tl_io_fault_draw(tl_io_faults *f)
{
    if (!f || !f->rate) return 0;
    uint64_t x = __atomic_fetch_add(&f->counter, 1, __ATOMIC_RELAXED) * UINT64_C(0x9E3779B97F4A7C15);
    x ^= f->seed;
    x ^= x >> 31;
    x *= UINT64_C(0xBF58476D1CE4E5B9);
    x ^= x >> 29;
    if ((uint32_t)x >= f->rate) return 0;
    uint32_t kinds[4], nk = 0;
    for (uint32_t k = 1; k <= TL_FAULT_EIO; k <<= 1)
        if (f->kinds & k) kinds[nk++] = k;
    return nk ? kinds[(x >> 32) % nk] : 0;
}

/*
 * Apply a drawn fault to a read's result r (bytes, or -errno) of an attempt
 * that asked for `want` bytes.  A short read keeps the first half of what was
 * read (the rest is read again), never zero bytes of a nonzero read.
 */
TL_INLINE int64_t tl_io_fault_apply(uint32_t fault, int64_t r)
{
    switch (fault) {
    case TL_FAULT_SHORT: return r > 1 ? r / 2 : r;
    case TL_FAULT_EINTR: return -EINTR;
    case TL_FAULT_EAGAIN: return -EAGAIN;
    case TL_FAULT_EIO: return -EIO;
    default: return r;
    }
}

/*
 * Read exactly `len` bytes at `offset` of fd into buf.  Returns 0, or a
 * negative errno, or TL_IO_EOF; *done receives the bytes read either way.
 * faults may be NULL (always, in release builds).
 */
TL_INLINE int tl_io_pread_full_f(int fd, void *buf, uint64_t len, uint64_t offset, uint64_t *done,
                                 tl_io_faults *faults)
{
    uint64_t got = 0;
    int again = 0;
    while (got < len) {
        struct iovec iov;
        iov.iov_base = (char *)buf + got;
        uint64_t want = len - got;
        /* Linux moves at most 0x7ffff000 bytes per call; ask for no more. */
        iov.iov_len = (size_t)(want > 0x7ffff000u ? 0x7ffff000u : want);
        ssize_t r = preadv(fd, &iov, 1, (off_t)(offset + got));
        int64_t res = r < 0 ? -(int64_t)errno : (int64_t)r;
#ifdef TL_FAULT_INJECTION
        res = tl_io_fault_apply(tl_io_fault_draw(faults), res);
#else
        (void)faults;
#endif
        if (res < 0) {
            if (res == -EINTR) continue;
            if (res == -EAGAIN && again++ < TL_IO_EAGAIN_RETRIES) continue;
            *done = got;
            return (int)res;
        }
        if (res == 0) {
            *done = got;
            return TL_IO_EOF;
        }
        got += (uint64_t)res;
    }
    *done = got;
    return 0;
}

TL_INLINE int tl_io_pread_full(int fd, void *buf, uint64_t len, uint64_t offset, uint64_t *done)
{
    return tl_io_pread_full_f(fd, buf, len, offset, done, NULL);
}

/* Same, filling *err on failure. */
TL_INLINE int tl_io_read(int fd, int32_t file, void *buf, uint64_t len, uint64_t offset,
                         tl_io_error *err)
{
    uint64_t done = 0;
    int rc = tl_io_pread_full(fd, buf, len, offset, &done);
    if (TL_UNLIKELY(rc != 0)) {
        err->code = rc;
        err->file = file;
        err->offset = offset;
        err->length = len;
        err->done = done;
    }
    return rc;
}

/*
 * Tell the kernel the access pattern is random (no readahead of data that
 * will not be used).  Returns 0 or a negative errno: posix_fadvise returns
 * the error instead of setting errno.
 */
TL_INLINE int tl_io_advise_random(int fd)
{
#ifdef POSIX_FADV_RANDOM
    int rc = posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    return rc ? -rc : 0;
#else
    (void)fd;
    return 0;
#endif
}

#endif /* TOKLOAD_IO_H */
