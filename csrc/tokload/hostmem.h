/*
 * hostmem.h -- the free blocks of host memory kept for the next batches.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * A batch's arrays are a few MiB each.  Taken from malloc and given back, they
 * are unmapped (or trimmed off the heap) and the next batch's first touch of
 * every page faults and zeroes it again: for a packed batch with its attention
 * arrays that is most of its cost.  The caller (tokload/_hostmem.pyx) maps its
 * blocks itself and, when one is no longer used, holds it here instead of
 * unmapping it; the next request of about its size takes it back.
 *
 * The list is a fixed array of TL_HOSTMEM_SLOTS blocks holding at most `cap`
 * bytes.  A request takes the smallest free block of at least its size and at
 * most 1.25 times it (so a small request never pins a large block).  A block
 * given back evicts the oldest ones until it fits; one larger than `cap` is
 * evicted itself.  The caller unmaps what is evicted.  Pure bookkeeping: no
 * allocation, no syscall, no lock (the caller serializes: it holds the GIL).
 */
#ifndef TOKLOAD_HOSTMEM_H
#define TOKLOAD_HOSTMEM_H

#include "common.h"

#define TL_HOSTMEM_SLOTS 64

typedef struct {
    void *ptr;
    size_t size;
    uint64_t age; /* when it was given back (the list's clock) */
} tl_hostmem_block;

typedef struct {
    tl_hostmem_block free[TL_HOSTMEM_SLOTS];
    size_t n;       /* free blocks held */
    size_t bytes;   /* their total size */
    size_t cap;     /* the most bytes held free */
    uint64_t clock; /* blocks given back so far */
    uint64_t reused; /* requests served from the list */
} tl_hostmem;

TL_INLINE void tl_hostmem_init(tl_hostmem *h, size_t cap)
{
    h->n = 0;
    h->bytes = 0;
    h->cap = cap;
    h->clock = 0;
    h->reused = 0;
}

TL_INLINE void tl_hostmem_drop(tl_hostmem *h, size_t k)
{
    h->bytes -= h->free[k].size;
    h->free[k] = h->free[--h->n];
}

/* A free block of at least `size` bytes (and at most size + size / 4), taken
 * off the list: its address, its size in *got; NULL when none fits. */
TL_INLINE void *tl_hostmem_take(tl_hostmem *h, size_t size, size_t *got)
{
    size_t best = h->n, most = size + size / 4;
    for (size_t k = 0; k < h->n; k++) {
        size_t s = h->free[k].size;
        if (s >= size && s <= most && (best == h->n || s < h->free[best].size))
            best = k;
    }
    if (best == h->n)
        return NULL;
    void *p = h->free[best].ptr;
    *got = h->free[best].size;
    tl_hostmem_drop(h, best);
    h->reused++;
    return p;
}

/* Evict the oldest free blocks until `extra` more bytes fit under `cap` (and,
 * when extra > 0, a slot is free): they go to evicted[] (room for
 * TL_HOSTMEM_SLOTS); returns how many. */
TL_INLINE size_t tl_hostmem_fit(tl_hostmem *h, size_t extra, tl_hostmem_block *evicted)
{
    size_t out = 0;
    while (h->n && ((extra && h->n == TL_HOSTMEM_SLOTS) || h->bytes + extra > h->cap)) {
        size_t oldest = 0;
        for (size_t k = 1; k < h->n; k++)
            if (h->free[k].age < h->free[oldest].age)
                oldest = k;
        evicted[out++] = h->free[oldest];
        tl_hostmem_drop(h, oldest);
    }
    return out;
}

/* Hold block (ptr, size) free.  The blocks that must be unmapped now (the
 * oldest, until it fits; or the block itself, when it is larger than `cap`)
 * go to evicted[] (room for TL_HOSTMEM_SLOTS); returns how many. */
TL_INLINE size_t tl_hostmem_put(tl_hostmem *h, void *ptr, size_t size, tl_hostmem_block *evicted)
{
    if (size == 0 || size > h->cap) {
        evicted[0].ptr = ptr;
        evicted[0].size = size;
        return 1;
    }
    size_t out = tl_hostmem_fit(h, size, evicted);
    h->free[h->n].ptr = ptr;
    h->free[h->n].size = size;
    h->free[h->n++].age = h->clock++;
    h->bytes += size;
    return out;
}

/* Empty the list: every free block goes to evicted[] (room for
 * TL_HOSTMEM_SLOTS); returns how many. */
TL_INLINE size_t tl_hostmem_clear(tl_hostmem *h, tl_hostmem_block *evicted)
{
    size_t out = h->n;
    for (size_t k = 0; k < out; k++)
        evicted[k] = h->free[k];
    h->n = 0;
    h->bytes = 0;
    return out;
}

#endif /* TOKLOAD_HOSTMEM_H */
