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
 * Read exactly `len` bytes at `offset` of fd into buf.  Returns 0, or a
 * negative errno, or TL_IO_EOF; *done receives the bytes read either way.
 */
TL_INLINE int tl_io_pread_full(int fd, void *buf, uint64_t len, uint64_t offset, uint64_t *done)
{
    uint64_t got = 0;
    while (got < len) {
        struct iovec iov;
        iov.iov_base = (char *)buf + got;
        uint64_t want = len - got;
        /* Linux moves at most 0x7ffff000 bytes per call; ask for no more. */
        iov.iov_len = (size_t)(want > 0x7ffff000u ? 0x7ffff000u : want);
        ssize_t r = preadv(fd, &iov, 1, (off_t)(offset + got));
        if (r < 0) {
            int e = errno;
            if (e == EINTR) continue;
            *done = got;
            return -e;
        }
        if (r == 0) {
            *done = got;
            return TL_IO_EOF;
        }
        got += (uint64_t)r;
    }
    *done = got;
    return 0;
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
