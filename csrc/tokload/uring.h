/*
 * uring.h -- io_uring through its raw system calls: a batch of reads with up
 * to Q in flight, submitted and reaped by the calling thread.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * No liburing: a wheel must not need a system library, and the little of the
 * interface used here (io_uring_setup, io_uring_enter, three mmap'd regions,
 * IORING_OP_READV) is stable kernel ABI since Linux 5.1.  The structs below
 * mirror <linux/io_uring.h> field for field, so building needs no kernel
 * headers either.  Ordering follows the kernel's documentation: the SQ tail
 * is published with a release store after the SQE is written, the CQ tail is
 * read with an acquire load before the CQEs, and the CQ head is published
 * with a release store after they are consumed.
 *
 * A ring is used by one thread at a time (the caller keeps a free list).
 * Every request is one READV of the remaining bytes; short reads are
 * resubmitted for the rest, -EINTR/-EAGAIN resubmitted as is, 0 bytes is end
 * of file, any other error fails the batch (after every read in flight has
 * completed: the kernel must be done with the caller's buffers and the
 * descriptors stay pinned until then).
 */
#ifndef TOKLOAD_URING_H
#define TOKLOAD_URING_H

#include "common.h"
#include "ioreq.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425 /* the same on every architecture since 5.1 */
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif

#define TL_URING_MAX 256 /* entries of a ring: the most reads a batch keeps in flight */

#define TL_IORING_OFF_SQ_RING 0ULL
#define TL_IORING_OFF_CQ_RING 0x8000000ULL
#define TL_IORING_OFF_SQES 0x10000000ULL
#define TL_IORING_FEAT_SINGLE_MMAP 1u
#define TL_IORING_ENTER_GETEVENTS 1u
#define TL_IORING_OP_READV 1
#define TL_IOSQE_ASYNC (1u << 4)

typedef struct tl_uring_sqe {
    uint8_t opcode;
    uint8_t flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off;
    uint64_t addr;
    uint32_t len;
    uint32_t rw_flags;
    uint64_t user_data;
    uint16_t buf_index;
    uint16_t personality;
    int32_t splice_fd_in;
    uint64_t pad[2];
} tl_uring_sqe;

typedef struct tl_uring_cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
} tl_uring_cqe;

typedef struct tl_uring_sq_offsets {
    uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
    uint64_t resv2;
} tl_uring_sq_offsets;

typedef struct tl_uring_cq_offsets {
    uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
    uint64_t resv2;
} tl_uring_cq_offsets;

typedef struct tl_uring_params {
    uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd;
    uint32_t resv[3];
    tl_uring_sq_offsets sq_off;
    tl_uring_cq_offsets cq_off;
} tl_uring_params;

_Static_assert(sizeof(tl_uring_sqe) == 64, "io_uring SQE is 64 bytes");
_Static_assert(sizeof(tl_uring_cqe) == 16, "io_uring CQE is 16 bytes");
_Static_assert(sizeof(tl_uring_params) == 120, "io_uring_params is 120 bytes");

/* A read in flight: its request, bytes done so far, and its iovec. */
typedef struct tl_uring_slot {
    size_t req;
    uint64_t got;
    int fd;
    struct iovec iov;
} tl_uring_slot;

typedef struct tl_uring {
    int fd;
    unsigned entries;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len;
    tl_uring_sqe *sqes;
    size_t sqes_len;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    tl_uring_cqe *cqes;
    int broken; /* an io_uring_enter failed for good: destroy, do not reuse */
    unsigned inflight; /* reads of the last tl_uring_run the kernel still had when it returned */
    /* Debug builds (TL_FAULT_INJECTION) only, set by the caller before a run:
     * the run's io_uring_enter calls submit at most fail_after SQEs in all
     * (< 0: no limit); once there, a call that would submit fails with errno
     * fail_code without reaching the kernel (fail_waits: a call that only
     * waits, too).  While armed, reads go to the kernel's workers
     * (IOSQE_ASYNC) and a submission does not wait, so that reads are still
     * in flight when the failure comes. */
    int64_t fail_after;
    int fail_code;
    int fail_waits;
    unsigned nfree;
    unsigned free_slots[TL_URING_MAX];
    tl_uring_slot slots[TL_URING_MAX];
} tl_uring;

/*
 * Create a ring of `entries` (a power of two <= TL_URING_MAX).  Returns 0 or
 * a negative errno: -ENOSYS (old kernel, or a seccomp filter), -EPERM
 * (kernel.io_uring_disabled, or a filter), -ENOMEM (memlock limit)...
 */
TL_INLINE int tl_uring_setup(tl_uring *r, unsigned entries)
{
    tl_uring_params p;
    unsigned char *z = (unsigned char *)&p;
    for (size_t i = 0; i < sizeof p; i++) z[i] = 0;
    r->fd = -1;
    r->sq_map = r->cq_map = MAP_FAILED;
    r->sqes = (tl_uring_sqe *)MAP_FAILED;
    r->broken = 0;
    r->inflight = 0;
    r->fail_after = -1;
    r->fail_code = 0;
    r->fail_waits = 0;
    if (entries > TL_URING_MAX) entries = TL_URING_MAX;
    long fd = syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) return -errno;
    r->fd = (int)fd;
    r->entries = p.sq_entries;
    r->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(tl_uring_cqe);
    if (p.features & TL_IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_map_len > r->sq_map_len) r->sq_map_len = r->cq_map_len;
        r->cq_map_len = r->sq_map_len;
    }
    r->sq_map = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                     r->fd, (off_t)TL_IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) goto fail;
    if (p.features & TL_IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                         r->fd, (off_t)TL_IORING_OFF_CQ_RING);
        if (r->cq_map == MAP_FAILED) goto fail;
    }
    r->sqes_len = p.sq_entries * sizeof(tl_uring_sqe);
    r->sqes = (tl_uring_sqe *)mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE,
                                   MAP_SHARED | MAP_POPULATE, r->fd, (off_t)TL_IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail;
    {
        char *sq = (char *)r->sq_map, *cq = (char *)r->cq_map;
        r->sq_head = (unsigned *)(sq + p.sq_off.head);
        r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
        r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
        r->sq_array = (unsigned *)(sq + p.sq_off.array);
        r->cq_head = (unsigned *)(cq + p.cq_off.head);
        r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
        r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
        r->cqes = (tl_uring_cqe *)(cq + p.cq_off.cqes);
    }
    if (r->entries > TL_URING_MAX) r->entries = TL_URING_MAX;
    r->nfree = r->entries;
    for (unsigned i = 0; i < r->entries; i++) r->free_slots[i] = r->entries - 1 - i;
    return 0;
fail : {
    int e = errno;
    if (r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->cq_map != MAP_FAILED && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_len);
    if (r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_map_len);
    close(r->fd);
    r->fd = -1;
    return -e;
}
}

TL_INLINE void tl_uring_destroy(tl_uring *r)
{
    if (r->fd < 0) return;
    munmap(r->sqes, r->sqes_len);
    if (r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_len);
    munmap(r->sq_map, r->sq_map_len);
    close(r->fd);
    r->fd = -1;
}

/* Queue a READV of slot s's remaining bytes (not yet submitted). */
TL_INLINE void tl_uring_prep_(tl_uring *r, const tl_ioreq *reqs, unsigned s)
{
    tl_uring_slot *sl = &r->slots[s];
    const tl_ioreq *q = &reqs[sl->req];
    uint64_t want = q->length - sl->got;
    sl->iov.iov_base = q->dst + sl->got;
    sl->iov.iov_len = (size_t)(want > 0x7ffff000u ? 0x7ffff000u : want);
    unsigned tail = *r->sq_tail; /* only this thread writes it */
    unsigned idx = tail & *r->sq_mask;
    tl_uring_sqe *sqe = &r->sqes[idx];
    unsigned char *z = (unsigned char *)sqe;
    for (size_t i = 0; i < sizeof *sqe; i++) z[i] = 0;
    sqe->opcode = TL_IORING_OP_READV;
#ifdef TL_FAULT_INJECTION
    if (r->fail_after >= 0) sqe->flags = TL_IOSQE_ASYNC;
#endif
    sqe->fd = sl->fd;
    sqe->off = q->offset + sl->got;
    sqe->addr = (uint64_t)(uintptr_t)&sl->iov;
    sqe->len = 1;
    sqe->user_data = s;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* io_uring_enter: submit `to_submit` SQEs and, with `wait`, wait for one
 * completion.  *submitted counts the SQEs submitted by this run (for the
 * debug builds' injected failure). */
TL_INLINE long tl_uring_enter_(tl_uring *r, unsigned to_submit, int wait, uint64_t *submitted)
{
#ifdef TL_FAULT_INJECTION
    if (r->fail_after >= 0) {
        uint64_t cap = (uint64_t)r->fail_after;
        uint64_t room = cap > *submitted ? cap - *submitted : 0;
        if (room == 0 && (to_submit || r->fail_waits)) {
            errno = r->fail_code;
            return -1;
        }
        if (to_submit > room) to_submit = (unsigned)room; /* the kernel takes only some */
        if (to_submit) wait = 0;
    }
#endif
    long ret = syscall(__NR_io_uring_enter, r->fd, to_submit, wait ? 1u : 0u,
                       wait ? TL_IORING_ENTER_GETEVENTS : 0u, NULL, 0);
    if (ret > 0) *submitted += (uint64_t)ret;
    return ret;
}

/*
 * The ring failed for good: withdraw the SQEs the kernel has not taken (the
 * SQ head says which; without SQPOLL the kernel reads the SQ only inside
 * io_uring_enter, so moving the tail back is safe).  Their reads never
 * started: their pins are released and their slots freed.  Returns how many
 * were withdrawn; *lowest becomes the lowest request among them.
 */
TL_INLINE unsigned tl_uring_withdraw_(tl_uring *r, const tl_ioreq *reqs, tl_fdcache *cache,
                                      size_t *lowest)
{
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    unsigned tail = *r->sq_tail, k;
    for (k = head; k != tail; k++) {
        unsigned s = (unsigned)r->sqes[r->sq_array[k & *r->sq_mask]].user_data;
        size_t req = r->slots[s].req;
        if (req < *lowest) *lowest = req;
        tl_fdcache_release(cache, reqs[req].file);
        r->free_slots[r->nfree++] = s;
    }
    __atomic_store_n(r->sq_tail, head, __ATOMIC_RELEASE);
    return tail - head;
}

/*
 * Run a batch with up to `depth` reads in flight.  Returns 0, or the error of
 * the lowest failing request (*failed, err).
 *
 * If the ring itself fails (io_uring_enter errors other than EINTR, EAGAIN
 * and EBUSY), r->broken is set and the batch fails with that errno on its
 * lowest unfinished request -- but only once the kernel is done with every
 * read it took: the caller frees its buffers (and the ring) when this
 * returns, and a completion after that would write into freed memory.  The
 * SQEs it had not taken are withdrawn; the reads it had each end with one
 * CQE (the kernel posts one for every SQE it consumed, cancelled or not).
 * They are waited for with io_uring_enter while that still waits, else by
 * reading the CQ tail between 1 ms sleeps: completions are posted by the
 * kernel's workers, or by task work that runs when this thread returns from
 * any system call, nanosleep's included.  No cancellation
 * (IORING_OP_ASYNC_CANCEL) is tried: it would need the submission that just
 * failed, and a read of a regular file ends on its own.  Every pin is
 * released before returning; r->inflight is then 0.
 */
TL_INLINE int tl_uring_run(tl_uring *r, const tl_ioreq *reqs, size_t n, unsigned depth,
                           tl_fdcache *cache, tl_io_faults *faults, tl_io_error *err,
                           size_t *failed)
{
    size_t next = 0, lowest = n; /* lowest: the lowest request a dead ring left unfinished */
    unsigned inflight = 0, unsubmitted = 0;
    uint64_t submitted = 0;
    int rc = 0, stop = 0, dead = 0, poll = 0;
    if (depth == 0) depth = 1;
    if (depth > r->entries) depth = r->entries;
#ifndef TL_FAULT_INJECTION
    (void)faults;
#endif
#define TL_URING_FAIL_(i, code, done)                                                              \
    do {                                                                                           \
        if (!rc || (i) < *failed) {                                                                \
            rc = (code);                                                                           \
            *failed = (i);                                                                         \
            tl_ioreq_fail(&reqs[i], (code), (done), err);                                          \
        }                                                                                          \
        stop = 1;                                                                                  \
    } while (0)

    for (;;) {
        while (!stop && next < n && inflight < depth) {
            const tl_ioreq *q = &reqs[next];
            if (q->length == 0) {
                next++;
                continue;
            }
            /* With reads of our own in flight, never wait for a descriptor:
             * complete one of ours instead (it may be what frees one). */
            int fd = tl_fdcache_acquire(cache, q->file, inflight == 0);
            if (fd == TL_FD_BUSY) break;
            if (TL_UNLIKELY(fd < 0)) {
                TL_URING_FAIL_(next, fd, 0);
                break;
            }
            unsigned s = r->free_slots[--r->nfree];
            r->slots[s].req = next;
            r->slots[s].got = 0;
            r->slots[s].fd = fd;
            tl_uring_prep_(r, reqs, s);
            inflight++;
            unsubmitted++;
            next++;
        }
        if (inflight == 0) break;
        if (!dead) {
            long ret = tl_uring_enter_(r, unsubmitted, 1, &submitted);
            if (ret >= 0) {
                unsubmitted -= (unsigned)ret;
            } else {
                int e = errno;
                if (e != EINTR && e != EAGAIN && e != EBUSY) {
                    /* The ring cannot be driven (never seen with valid SQEs). */
                    r->broken = 1;
                    dead = -e;
                    stop = 1;
                    inflight -= tl_uring_withdraw_(r, reqs, cache, &lowest);
                    unsubmitted = 0;
                    if (next < lowest) lowest = next; /* never issued */
                    continue;
                }
            }
        } else if (!poll) {
            long ret = tl_uring_enter_(r, 0, 1, &submitted);
            int e = ret < 0 ? errno : 0;
            if (ret < 0 && e != EINTR && e != EAGAIN && e != EBUSY) poll = 1;
        } else if (*r->cq_head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            struct timespec ms = {0, 1000000};
            nanosleep(&ms, NULL);
        }
        unsigned head = *r->cq_head;
        unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail) {
            const tl_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
            unsigned s = (unsigned)cqe->user_data;
            int64_t res = cqe->res;
            head++;
            tl_uring_slot *sl = &r->slots[s];
            const tl_ioreq *q = &reqs[sl->req];
#ifdef TL_FAULT_INJECTION
            res = tl_io_fault_apply(tl_io_fault_draw(faults), res);
#endif
            if (res > 0) sl->got += (uint64_t)res;
            if (res == -EINTR || res == -EAGAIN || (res > 0 && sl->got < q->length)) {
                if (!dead) { /* again, or the rest of a short read */
                    tl_uring_prep_(r, reqs, s);
                    unsubmitted++;
                    continue;
                }
                if (sl->req < lowest) lowest = sl->req; /* a dead ring takes no more */
            } else if (res <= 0) {
                TL_URING_FAIL_(sl->req, res == 0 ? TL_IO_EOF : (int)res, sl->got);
            }
            tl_fdcache_release(cache, q->file);
            r->free_slots[r->nfree++] = s;
            inflight--;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    if (dead && lowest < n) TL_URING_FAIL_(lowest, dead, 0);
#undef TL_URING_FAIL_
    r->inflight = inflight;
    return rc;
}

#endif /* TOKLOAD_URING_H */
