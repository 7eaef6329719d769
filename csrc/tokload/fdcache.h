/*
 * fdcache.h -- lazily opened files behind a bounded, least-recently-used set of
 * descriptors shared by every thread.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * A dataset of thousands of shards must not hold a descriptor per file: a
 * file is opened when a read first needs it, and at most `max` descriptors
 * stay open process-wide.  Every read *pins* its file for as long as the read
 * may touch the descriptor (submission to completion); only unpinned files are
 * closed, so a descriptor number is never closed and reused under a read in
 * flight (which would read another file's bytes).  The bound is strict: a
 * descriptor is reserved before open(2), and when every open file is pinned
 * a new open waits for a release (or, for a caller with reads of its own in
 * flight, is refused so that it completes one first).
 *
 * Open, unpinned files form a doubly linked list, least recent first; pinned
 * and closed files are not on it.  One mutex guards the list, the counts and
 * every entry's fd/pins; the open(2) itself runs outside it (a network
 * filesystem may take milliseconds), so two threads may open the same file at
 * once and the loser closes its copy.
 *
 * A file is opened by path, long after its dataset was opened and checked, and
 * again after the bound closed it: an entry that knows the inode, size and
 * mtime the file had then (`known`) refuses, with -ESTALE, a file at that path
 * that is not the same any more (a rebuild renamed other data into its place),
 * whose bytes would be read as the dataset's without a word.  The same file
 * made shorter is let through: its reads end early, and say the file was
 * truncated.
 */
#ifndef TOKLOAD_FDCACHE_H
#define TOKLOAD_FDCACHE_H

#include "common.h"
#include "io.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* One file: an entry of a caller-owned array (a FileSet). */
typedef struct tl_fent {
    const char *path;  /* NUL-terminated, owned by the caller */
    uint64_t base;     /* byte offset of the first row (a header before it) */
    int32_t index;     /* the caller's file number, for error messages */
    int fd;            /* -1 while closed */
    int pins;          /* reads that may use fd now */
    int retired;       /* the set was closed: close fd when unpinned, never reopen */
    struct tl_fent *prev, *next; /* LRU links while open and unpinned */
    void *remote;      /* an object in an object store (read by engine.h's TL_IO_REMOTE,
                        * never opened here), owned by the caller; NULL: a local file */
    int known;         /* ino, size and mtime_ns are the file's when its set was made */
    int64_t ino, size, mtime_ns;
} tl_fent;

typedef struct tl_fdcache {
    pthread_mutex_t mu;
    pthread_cond_t freed; /* a file became unpinned, or a reservation was given back */
    tl_fent lru;     /* sentinel: lru.next is the least recently used */
    size_t open;     /* descriptors open, and reserved for opens in progress */
    size_t max;      /* bound on open descriptors (>= 1) */
    size_t starved;  /* opens that found the process out of descriptors, deciding or
                      * waiting (their reservations, counted in open, hold none) */
    size_t closes;   /* descriptors closed so far (atomic: an open out of them retries) */
    uint64_t opens;  /* open(2) calls that succeeded, for tests and stats */
} tl_fdcache;

TL_INLINE void tl_fdcache_init(tl_fdcache *c, size_t max)
{
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->freed, NULL);
    c->lru.prev = c->lru.next = &c->lru;
    c->open = 0;
    c->max = max ? max : 1;
    c->starved = 0;
    c->closes = 0;
    c->opens = 0;
}

TL_INLINE void tl_fent_init(tl_fent *e, const char *path, uint64_t base, int32_t index)
{
    e->path = path;
    e->base = base;
    e->index = index;
    e->fd = -1;
    e->pins = 0;
    e->retired = 0;
    e->prev = e->next = NULL;
    e->remote = NULL;
    e->known = 0;
    e->ino = e->size = e->mtime_ns = 0;
}

/* Whether st is the file e was made for (any file when e knows nothing). */
TL_INLINE int tl_fent_same(const tl_fent *e, const struct stat *st)
{
    if (!e->known) return 1;
    int64_t mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + (int64_t)st->st_mtim.tv_nsec;
    if ((int64_t)st->st_ino == e->ino && (int64_t)st->st_size < e->size)
        return 1; /* truncated: the reads say so */
    return (int64_t)st->st_size == e->size && mtime_ns == e->mtime_ns;
}

TL_INLINE void tl_fdcache_unlink_(tl_fent *e)
{
    e->prev->next = e->next;
    e->next->prev = e->prev;
    e->prev = e->next = NULL;
}

/* Close least recently used unpinned files until at most `keep` are open;
 * returns how many it closed.  Called with mu held. */
TL_INLINE size_t tl_fdcache_shrink_(tl_fdcache *c, size_t keep)
{
    size_t closed = 0;
    while (c->open > keep && c->lru.next != &c->lru) {
        tl_fent *victim = c->lru.next;
        tl_fdcache_unlink_(victim);
        close(victim->fd);
        victim->fd = -1;
        c->open--;
        closed++;
    }
    if (closed) __atomic_add_fetch(&c->closes, closed, __ATOMIC_SEQ_CST);
    return closed;
}

/* tl_fdcache_acquire without waiting: every open file is pinned and the
 * bound is reached (distinct from every errno). */
#define TL_FD_BUSY (-100010)

/* tl_fdcache_acquire's may_wait: never, or for the bound and for a descriptor of
 * the process (EMFILE), or for the bound only (a hint: advice, not worth a wait
 * for descriptors a read needs). */
#define TL_FD_NO_WAIT 0
#define TL_FD_WAIT 1
#define TL_FD_WAIT_BOUND 2

/* How long an open that finds the process out of descriptors keeps trying
 * while reads of other threads hold ours (each read frees one). */
#define TL_FD_PATIENCE_NS (2 * 1000000000LL)

/* Whether an open out of descriptors may try again: within TL_FD_PATIENCE_NS of
 * the first failure (*since, zero before it, is set then). */
TL_INLINE int tl_fdcache_patience_(struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (since->tv_sec == 0 && since->tv_nsec == 0) {
        *since = now;
        return 1;
    }
    long long ns = (long long)(now.tv_sec - since->tv_sec) * 1000000000LL +
                   (now.tv_nsec - since->tv_nsec);
    return ns < TL_FD_PATIENCE_NS;
}

/*
 * Pin e and return its descriptor (>= 0), opening the file if needed
 * (O_RDONLY | O_CLOEXEC, then posix_fadvise RANDOM).  Returns a negative
 * errno if it cannot be opened (nothing is pinned then).  Every successful
 * acquire must be matched by one tl_fdcache_release.
 *
 * If the bound is reached and every open file is pinned: with `may_wait`,
 * wait until a read releases one (a caller that holds no pin itself cannot
 * deadlock: pins are held only across reads that finish on their own);
 * without it, return TL_FD_BUSY (a caller with reads in flight completes one
 * of its own and asks again).  The same when the process is out of
 * descriptors (EMFILE, ENFILE: a trainer's sockets hold the rest) and every
 * file of ours is pinned: a read's release lets us close its file and open
 * ours (TL_FD_WAIT_BOUND waits for the bound only: TL_FD_BUSY here); with
 * none pinned, the errno is returned.
 */
TL_INLINE int tl_fdcache_acquire(tl_fdcache *c, tl_fent *e, int may_wait)
{
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (TL_UNLIKELY(e->retired)) {
            pthread_mutex_unlock(&c->mu);
            return -EBADF;
        }
        if (TL_LIKELY(e->fd >= 0)) {
            if (e->pins++ == 0) tl_fdcache_unlink_(e);
            int fd = e->fd;
            pthread_mutex_unlock(&c->mu);
            return fd;
        }
        if (c->open < c->max) break;
        if (c->lru.next != &c->lru) {
            tl_fdcache_shrink_(c, c->max - 1);
            break;
        }
        if (!may_wait) {
            pthread_mutex_unlock(&c->mu);
            return TL_FD_BUSY;
        }
        pthread_cond_wait(&c->freed, &c->mu);
    }
    /* Reserve the descriptor and pin the entry (a concurrent close of the set
     * then leaves it to us to close), then open outside the lock. */
    c->open++;
    e->pins++;
    pthread_mutex_unlock(&c->mu);

    int fd, err = 0;
    struct timespec since = {0, 0}; /* the first EMFILE (tl_fdcache_patience_) */
    for (;;) {
        size_t closes = __atomic_load_n(&c->closes, __ATOMIC_SEQ_CST);
        /* O_NONBLOCK: a FIFO put in a shard's place after the dataset was
         * checked must not block here; it is refused just below. */
        fd = open(e->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {
                close(fd);
                fd = -1;
                err = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
            } else if (!tl_fent_same(e, &st)) {
                close(fd);
                fd = -1;
                err = ESTALE; /* another file at this path than the dataset's */
            }
            break;
        }
        err = errno;
        if (err == EINTR) continue;
        if ((err == EMFILE || err == ENFILE) && tl_fdcache_patience_(&since)) {
            /* Another part of the process holds descriptors: give back ours. */
            pthread_mutex_lock(&c->mu);
            if (e->fd >= 0) {
                /* Another thread opened this file meanwhile (its descriptor stays
                 * open while our pin holds it): give back our reservation, use it. */
                c->open--;
                pthread_cond_broadcast(&c->freed);
                fd = e->fd;
                pthread_mutex_unlock(&c->mu);
                return fd;
            }
            /* (a descriptor closed since our open failed: it may be free now) */
            int freed = tl_fdcache_shrink_(c, c->open > 1 ? c->open - 1 : 1) > 0 ||
                        __atomic_load_n(&c->closes, __ATOMIC_SEQ_CST) != closes;
            /* Others of ours may hold descriptors (the LRU is empty: pinned by
             * reads in flight, or being opened): one will be released.  Opens
             * out of descriptors, ours among them, hold none. */
            c->starved++;
            int pinned = !freed && c->open > c->starved;
            if (pinned && may_wait != TL_FD_WAIT) {
                /* The caller completes a read of its own, which frees one (or, a
                 * hint, goes without). */
                c->starved--;
                pthread_mutex_unlock(&c->mu);
                err = -TL_FD_BUSY;
                break;
            }
            if (pinned) {
                /* Wait for a read to release one, then try again (another thread
                 * may take the descriptor first: for up to TL_FD_PATIENCE_NS). */
                struct timespec until;
                clock_gettime(CLOCK_REALTIME, &until);
                until.tv_nsec += 20 * 1000 * 1000;
                if (until.tv_nsec >= 1000000000L) {
                    until.tv_sec++;
                    until.tv_nsec -= 1000000000L;
                }
                pthread_cond_timedwait(&c->freed, &c->mu, &until);
                if (e->fd < 0) tl_fdcache_shrink_(c, c->open > 1 ? c->open - 1 : 1);
            }
            c->starved--;
            pthread_mutex_unlock(&c->mu);
            if (freed || pinned) continue;
        }
        break;
    }
    int adv = fd >= 0 ? tl_io_advise_random(fd) : 0;
    if (adv == -EINVAL || adv == -ESPIPE) adv = 0; /* not a regular file: harmless */
    if (fd >= 0 && adv) {
        close(fd);
        fd = -1;
        err = -adv;
    }

    pthread_mutex_lock(&c->mu);
    if (fd < 0 || e->fd >= 0) {
        /* Failed, or another thread opened it meanwhile: give back the
         * reservation (and our copy). */
        if (fd >= 0) {
            close(fd);
            __atomic_add_fetch(&c->closes, 1, __ATOMIC_SEQ_CST);
        }
        c->open--;
        pthread_cond_signal(&c->freed);
        if (fd < 0) {
            e->pins--;
            if (e->pins == 0 && e->fd >= 0 && !e->retired) {
                /* the other thread's descriptor is idle again */
                e->next = &c->lru;
                e->prev = c->lru.prev;
                c->lru.prev->next = e;
                c->lru.prev = e;
                pthread_cond_signal(&c->freed);
            }
            pthread_mutex_unlock(&c->mu);
            return -err;
        }
    } else {
        e->fd = fd;
        c->opens++;
    }
    fd = e->fd;
    pthread_mutex_unlock(&c->mu);
    return fd;
}

/* Unpin e: it becomes the most recently used; closed if over the bound. */
TL_INLINE void tl_fdcache_release(tl_fdcache *c, tl_fent *e)
{
    pthread_mutex_lock(&c->mu);
    TL_ASSERT(e->pins > 0 && e->fd >= 0);
    if (--e->pins == 0) {
        if (e->retired) {
            close(e->fd);
            e->fd = -1;
            c->open--;
            __atomic_add_fetch(&c->closes, 1, __ATOMIC_SEQ_CST);
        } else {
            e->next = &c->lru;
            e->prev = c->lru.prev;
            c->lru.prev->next = e;
            c->lru.prev = e;
            tl_fdcache_shrink_(c, c->max);
        }
        /* every waiter: one for the bound and one for a descriptor (EMFILE) */
        pthread_cond_broadcast(&c->freed);
    }
    pthread_mutex_unlock(&c->mu);
}

/* Close every file of a set (idempotent); pinned ones close when released. */
TL_INLINE void tl_fdcache_retire(tl_fdcache *c, tl_fent *ents, size_t n)
{
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < n; i++) {
        tl_fent *e = &ents[i];
        e->retired = 1;
        if (e->fd >= 0 && e->pins == 0) {
            tl_fdcache_unlink_(e);
            close(e->fd);
            e->fd = -1;
            c->open--;
            __atomic_add_fetch(&c->closes, 1, __ATOMIC_SEQ_CST);
        }
    }
    pthread_mutex_unlock(&c->mu);
}

/* Change the bound; closes idle files beyond it at once. */
TL_INLINE void tl_fdcache_set_max(tl_fdcache *c, size_t max)
{
    pthread_mutex_lock(&c->mu);
    c->max = max ? max : 1;
    tl_fdcache_shrink_(c, c->max);
    pthread_mutex_unlock(&c->mu);
}

TL_INLINE size_t tl_fdcache_open_count(tl_fdcache *c)
{
    pthread_mutex_lock(&c->mu);
    size_t n = c->open;
    pthread_mutex_unlock(&c->mu);
    return n;
}

/*
 * After fork(2), in the child (one thread): start the cache over, empty.  The
 * mutex may have been held by a thread that does not exist there, the list
 * may have been half changed, and the pins and reservations of the parent's
 * reads belong to threads the child does not have: nothing would ever
 * release them, so their files could never be closed and, once every open
 * file counted as pinned, a read would wait for ever.  The descriptors stay
 * valid (O_CLOEXEC closes them only at exec): the caller then hands every
 * entry that may hold one to tl_fdcache_adopt, each array once.  An entry
 * it does not hand back must never be used with this cache again.
 */
TL_INLINE void tl_fdcache_after_fork(tl_fdcache *c)
{
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->freed, NULL);
    c->lru.prev = c->lru.next = &c->lru;
    c->open = 0;
    c->starved = 0;
}

/*
 * After tl_fdcache_after_fork: take back ents[0..n) as the child has them.
 * No read is in flight in the child, so every pin is dropped; an open file
 * becomes idle (least recently used first, in array order), a retired one is
 * closed, and files beyond the bound are closed.  A file being opened by the
 * parent at the fork has fd -1 here: nothing was reserved for it.
 */
TL_INLINE void tl_fdcache_adopt(tl_fdcache *c, tl_fent *ents, size_t n)
{
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < n; i++) {
        tl_fent *e = &ents[i];
        e->pins = 0;
        e->prev = e->next = NULL;
        if (e->fd < 0) continue;
        if (e->retired) {
            close(e->fd);
            e->fd = -1;
            continue;
        }
        e->next = &c->lru;
        e->prev = c->lru.prev;
        c->lru.prev->next = e;
        c->lru.prev = e;
        c->open++;
    }
    tl_fdcache_shrink_(c, c->max);
    pthread_mutex_unlock(&c->mu);
}

#endif /* TOKLOAD_FDCACHE_H */
