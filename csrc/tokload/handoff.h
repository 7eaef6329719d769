/*
 * handoff.h -- the remote backend's two phases: a reader thread hands a batch of
 * requests to the thread that fetches them, and waits, without the GIL, until
 * that thread has copied every body into place or failed the batch.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * The engine (engine.h, TL_IO_REMOTE) plans a batch's requests in C like any
 * other; `tl_handoff_run` queues them and blocks on a condition variable.  The
 * fetcher (tokload/remote/fetch.py, on the process's event loop thread, which
 * holds the GIL as Python threads do) is woken through `efd`, an eventfd it
 * watches; it takes the queued batches (`tl_handoff_take`), fetches their
 * bytes with the object-store client, copies them into the requests' buffers
 * (`tl_handoff_copy`, called without the GIL) and ends each batch
 * (`tl_handoff_finish`).  No reader thread ever calls into Python: a read in an
 * object store looks, to the code that asked for it, like a slow preadv.
 *
 * A batch lives on its reader's stack: the fetcher must not touch it, or the
 * requests' buffers, after `tl_handoff_finish`.  `efd` also serves as the event
 * loop's wake-up (tokload/_remote.pyx `wake`): one descriptor to watch.
 */
#ifndef TOKLOAD_HANDOFF_H
#define TOKLOAD_HANDOFF_H

#include "common.h"
#include "io.h"
#include "ioreq.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

typedef struct tl_handoff_batch {
    const tl_ioreq *reqs;
    size_t n;
    unsigned depth;   /* GETs in flight the caller asked for (the engine's depth) */
    uint64_t waiter;  /* pthread_self() of the reader: names its error in Python */
    int rc;           /* set by tl_handoff_finish: 0 or an error code */
    tl_io_error err;  /* rc != 0: the failing request, as engine.h reports it */
    size_t failed;
    int done;
    struct tl_handoff_batch *next;
} tl_handoff_batch;

typedef struct tl_handoff {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    tl_handoff_batch *head, *tail;
    size_t queued;  /* batches handed over and not finished */
    int efd;        /* -1 until tl_handoff_open */
} tl_handoff;

/* Make h ready (a process's first remote read; again in a forked child).  0 or -errno. */
TL_INLINE int tl_handoff_open(tl_handoff *h)
{
    int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) return -errno;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    h->head = h->tail = NULL;
    h->queued = 0;
    h->efd = fd;
    return 0;
}

/* Wake whoever watches efd (never blocks: an eventfd's counter only adds). */
TL_INLINE void tl_handoff_wake(const tl_handoff *h)
{
    uint64_t one = 1;
    ssize_t r;
    do r = write(h->efd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
}

/* Hand reqs[0..n) over and wait until the fetcher has finished them.  The
 * engine's contract: 0, or an error code with err and *failed. */
TL_INLINE int tl_handoff_run(tl_handoff *h, const tl_ioreq *reqs, size_t n, unsigned depth,
                             tl_io_error *err, size_t *failed)
{
    tl_handoff_batch b;
    memset(&b, 0, sizeof b);
    b.reqs = reqs;
    b.n = n;
    b.depth = depth ? depth : 1;
    b.waiter = (uint64_t)pthread_self();
    pthread_mutex_lock(&h->mu);
    if (h->tail) h->tail->next = &b;
    else h->head = &b;
    h->tail = &b;
    h->queued++;
    pthread_mutex_unlock(&h->mu);
    tl_handoff_wake(h);
    pthread_mutex_lock(&h->mu);
    while (!b.done) pthread_cond_wait(&h->cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
    if (b.rc) {
        *err = b.err;
        *failed = b.failed;
    }
    return b.rc;
}

/* The batches queued since the last call, oldest first, as a list linked by
 * `next` (NULL: none); clears efd's counter. */
TL_INLINE tl_handoff_batch *tl_handoff_take(tl_handoff *h)
{
    uint64_t count;
    ssize_t r;
    do r = read(h->efd, &count, sizeof count);
    while (r < 0 && errno == EINTR);
    pthread_mutex_lock(&h->mu);
    tl_handoff_batch *b = h->head;
    h->head = h->tail = NULL;
    pthread_mutex_unlock(&h->mu);
    return b;
}

/* End batch b (rc 0, or an error code and the request that failed): its reader
 * returns.  b must not be touched afterwards. */
TL_INLINE void tl_handoff_finish(tl_handoff *h, tl_handoff_batch *b, int rc,
                                 const tl_io_error *err, size_t failed)
{
    pthread_mutex_lock(&h->mu);
    b->rc = rc;
    if (rc) {
        b->err = *err;
        b->failed = failed;
    }
    b->done = 1;
    h->queued--;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

/* Copy src[i] (reqs[i].length bytes; NULL for an empty request) to reqs[i].dst. */
TL_INLINE void tl_handoff_copy(const tl_ioreq *reqs, size_t n, const uint8_t *const *src)
{
    for (size_t i = 0; i < n; i++)
        if (src[i] != NULL && reqs[i].length) memcpy(reqs[i].dst, src[i], reqs[i].length);
}

#endif /* TOKLOAD_HANDOFF_H */
