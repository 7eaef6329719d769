/*
 * shards.h -- which shard holds global position `pos`.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * A sharded sequence (rows, documents, metadata records) is described by its
 * cumulative counts: cum[0] = 0, cum[k + 1] = cum[k] + count of shard k, for
 * nshards + 1 entries.  Position pos < cum[nshards] lives in the shard k with
 * cum[k] <= pos < cum[k + 1]; empty shards are skipped.  O(log nshards) time,
 * no allocation: a dataset of 10,000 shards costs 14 comparisons per lookup.
 */
#ifndef TOKLOAD_SHARDS_H
#define TOKLOAD_SHARDS_H

#include "common.h"

/* The shard holding pos.  Requires pos < cum[nshards] (callers check). */
TL_INLINE size_t tl_shards_locate(const uint64_t *cum, size_t nshards, uint64_t pos)
{
    /* Last k with cum[k] <= pos: upper_bound over cum[1..nshards] counts the
     * shards that end at or before pos. */
    size_t lo = 0, hi = nshards; /* answer in [lo, hi) */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (cum[mid] <= pos)
            lo = mid;
        else
            hi = mid;
    }
    TL_ASSERT(cum[lo] <= pos && pos < cum[lo + 1]);
    return lo;
}

/* shard[i] = tl_shards_locate(cum, nshards, pos[i]).  Returns count, or the
 * position of the first pos >= cum[nshards]. */
TL_INLINE size_t tl_shards_locate_many(const uint64_t *cum, size_t nshards, const uint64_t *pos,
                                       size_t count, uint64_t *shard)
{
    const uint64_t total = cum[nshards];
    for (size_t i = 0; i < count; i++) {
        if (TL_UNLIKELY(pos[i] >= total)) return i;
        shard[i] = tl_shards_locate(cum, nshards, pos[i]);
    }
    return count;
}

#endif /* TOKLOAD_SHARDS_H */
