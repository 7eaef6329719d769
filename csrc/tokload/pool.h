/*
 * pool.h -- a pool of C threads that keeps up to Q reads of a batch in flight
 * with plain preadv: the portable backend, for kernels or containers where
 * io_uring is missing or forbidden.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * One pool serves the process.  A caller posts its batch as a *job* (on its
 * own stack) asking for up to Q - 1 helpers, then works on the job itself:
 * each worker (helpers and caller) claims the next request with an atomic
 * increment and runs it synchronously (ioreq.h).  So a batch has at most Q
 * reads in flight, the whole process at most (pool threads + callers), and a
 * warm-cache batch is mostly done by the caller before a helper wakes.  The
 * caller unqueues the job and waits until no helper is on it before returning,
 * so no thread ever touches a finished job.  Workers block every signal (the
 * interpreter's main thread handles them) and never touch Python.
 */
#ifndef TOKLOAD_POOL_H
#define TOKLOAD_POOL_H

#include "common.h"
#include "ioreq.h"

#include <pthread.h>
#include <signal.h>

#define TL_POOL_MAX 256

typedef struct tl_pool_job {
    const tl_ioreq *reqs;
    size_t n;
    size_t next;     /* atomic: the next request to claim */
    int stop;        /* atomic: a request failed, claim no more */
    unsigned want;   /* helpers still wanted (under the pool's mutex) */
    unsigned active; /* helpers working on it (under the pool's mutex) */
    int rc;          /* error of the lowest failing request (under the mutex) */
    size_t failed;
    tl_io_error err;
    tl_fdcache *cache;
    tl_io_faults *faults;
    struct tl_pool_job *next_job;
} tl_pool_job;

typedef struct tl_pool {
    pthread_mutex_t mu;
    pthread_cond_t work; /* a job was queued, or stop */
    pthread_cond_t idle; /* a helper left a job */
    tl_pool_job *head, *tail;
    unsigned nthreads;
    int stop;
    pthread_t threads[TL_POOL_MAX];
} tl_pool;

TL_INLINE void tl_pool_init(tl_pool *p)
{
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->idle, NULL);
    p->head = p->tail = NULL;
    p->nthreads = 0;
    p->stop = 0;
}

/* Claim and run requests until none is left or one failed. */
TL_INLINE void tl_pool_work_(tl_pool *p, tl_pool_job *job)
{
    for (;;) {
        if (__atomic_load_n(&job->stop, __ATOMIC_RELAXED)) return;
        size_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->n) return;
        tl_io_error err;
        int rc = tl_ioreq_exec(&job->reqs[i], job->cache, job->faults, &err);
        if (TL_UNLIKELY(rc)) {
            pthread_mutex_lock(&p->mu);
            if (!job->rc || i < job->failed) {
                job->rc = rc;
                job->failed = i;
                job->err = err;
            }
            pthread_mutex_unlock(&p->mu);
            __atomic_store_n(&job->stop, 1, __ATOMIC_RELAXED);
            return;
        }
    }
}

static inline void *tl_pool_main_(void *arg)
{
    tl_pool *p = (tl_pool *)arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !p->head) pthread_cond_wait(&p->work, &p->mu);
        if (p->stop) break;
        tl_pool_job *job = p->head;
        job->active++;
        if (--job->want == 0) {
            p->head = job->next_job;
            if (!p->head) p->tail = NULL;
        }
        pthread_mutex_unlock(&p->mu);
        tl_pool_work_(p, job);
        pthread_mutex_lock(&p->mu);
        if (--job->active == 0) pthread_cond_broadcast(&p->idle);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/*
 * Grow the pool to `threads` workers (at most TL_POOL_MAX).  Returns 0 or a
 * negative errno if a thread could not be started (the pool keeps those that
 * did; it still works with fewer).
 */
TL_INLINE int tl_pool_grow(tl_pool *p, unsigned threads)
{
    if (threads > TL_POOL_MAX) threads = TL_POOL_MAX;
    int rc = 0;
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* new threads inherit the mask */
    pthread_mutex_lock(&p->mu);
    while (p->nthreads < threads) {
        int e = pthread_create(&p->threads[p->nthreads], &attr, tl_pool_main_, p);
        if (e) {
            rc = -e;
            break;
        }
        p->nthreads++;
    }
    pthread_mutex_unlock(&p->mu);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return rc;
}

TL_INLINE unsigned tl_pool_threads(tl_pool *p)
{
    pthread_mutex_lock(&p->mu);
    unsigned n = p->nthreads;
    pthread_mutex_unlock(&p->mu);
    return n;
}

/*
 * Run a batch with up to `depth` reads in flight (the caller plus depth - 1
 * helpers).  Returns 0, or the error of the lowest failing request
 * (*failed = its number, err filled).
 */
TL_INLINE int tl_pool_run(tl_pool *p, const tl_ioreq *reqs, size_t n, unsigned depth,
                          tl_fdcache *cache, tl_io_faults *faults, tl_io_error *err,
                          size_t *failed)
{
    tl_pool_job job;
    job.reqs = reqs;
    job.n = n;
    job.next = 0;
    job.stop = 0;
    job.active = 0;
    job.rc = 0;
    job.failed = 0;
    job.cache = cache;
    job.faults = faults;
    job.next_job = NULL;
    unsigned want = depth > 1 ? depth - 1 : 0;
    if (n > 0 && want > n - 1) want = (unsigned)(n - 1);
    pthread_mutex_lock(&p->mu);
    if (want > p->nthreads) want = p->nthreads;
    job.want = want;
    if (want) {
        if (p->tail)
            p->tail->next_job = &job;
        else
            p->head = &job;
        p->tail = &job;
        pthread_cond_broadcast(&p->work);
    }
    pthread_mutex_unlock(&p->mu);

    tl_pool_work_(p, &job);

    if (want) {
        pthread_mutex_lock(&p->mu);
        if (job.want) { /* still queued: take it off */
            tl_pool_job **link = &p->head, *prev = NULL;
            while (*link != &job) {
                prev = *link;
                link = &(*link)->next_job;
            }
            *link = job.next_job;
            if (p->tail == &job) p->tail = prev;
        }
        while (job.active) pthread_cond_wait(&p->idle, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    if (job.rc) {
        *err = job.err;
        *failed = job.failed;
    }
    return job.rc;
}

/* After fork(2) in the child: its pool has no threads, and the mutex may have
 * been held by one that does not exist there. */
TL_INLINE void tl_pool_after_fork(tl_pool *p)
{
    tl_pool_init(p);
}

#endif /* TOKLOAD_POOL_H */
