/*
 * bounds.h -- document boundaries inside token windows: the attention
 * metadata of packed training (position ids, segment ids, cu_seqlens).
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * A window is rows [r, r + W) of the token stream.  Its cuts are the first rows
 * of the documents that start inside it, r excluded (a document starting at r
 * begins the window's first segment anyway).  Two parts, pure integer work:
 *
 *  - a batched search, one round at a time: search i looks for the last
 *    document whose first row is <= key[i].  Each round the caller fetches the
 *    first row of each active search's probe (tl_bsearch_probe) from the
 *    document index and hands it back (tl_bsearch_step).  Probes alternate
 *    between interpolation (documents of similar sizes: a few rounds) and
 *    bisection (so no index takes more than 2 log2(documents) rounds);
 *  - the per-window arrays from the cuts (tl_bounds_fill).
 */
#ifndef TOKLOAD_BOUNDS_H
#define TOKLOAD_BOUNDS_H

#include "common.h"
#include "shards.h"

#include <string.h>

/* Search state: the answer is in [lo, hi]; first(lo) <= key < end, where end
 * is first(hi + 1) (or the stream's rows past the last document). */
typedef struct tl_bsearch {
    uint64_t key;
    uint64_t lo, hi;
    uint64_t lo_first, end;
} tl_bsearch;

TL_INLINE void tl_bsearch_init(tl_bsearch *s, uint64_t key, uint64_t ndocs, uint64_t rows)
{
    s->key = key;
    s->lo = 0;
    s->hi = ndocs - 1;
    s->lo_first = 0;
    s->end = rows;
}

/* The document to fetch this round, in (lo, hi]: lo < hi is required. */
TL_INLINE uint64_t tl_bsearch_probe(const tl_bsearch *s, unsigned round)
{
    uint64_t span = s->hi - s->lo;
    uint64_t off;
    if ((round & 1u) == 0 && s->end > s->lo_first) {
        /* where the key falls between first(lo) and end, if documents are alike */
        unsigned __int128 num = (unsigned __int128)(s->key - s->lo_first) * (span + 1);
        off = (uint64_t)(num / (s->end - s->lo_first));
        if (off < 1) off = 1;
        if (off > span) off = span;
    } else {
        off = (span + 1) / 2;
    }
    return s->lo + off;
}

/* The probe's first row is `first`.  Returns 1 while the search goes on. */
TL_INLINE int tl_bsearch_step(tl_bsearch *s, uint64_t probe, uint64_t first)
{
    if (first <= s->key) {
        s->lo = probe;
        s->lo_first = first;
    } else {
        s->hi = probe - 1;
        s->end = first;
    }
    return s->lo < s->hi;
}

/*
 * One segment, tokens [a, e) of a row (a < e): pos[t] = t - a, seg[t] = number,
 * and mask[t] = 1 but at a (its first token: a target across a boundary), or 0
 * throughout when targets is 0 (padding).  Each of pos, seg, mask may be NULL.
 * Three plain loops, each one the compiler vectorizes.
 */
TL_INLINE void tl_segment_fill(int64_t *pos, int32_t *seg, uint8_t *mask, uint64_t a, uint64_t e,
                               int32_t number, int targets)
{
    if (pos)
        for (uint64_t t = a; t < e; t++) pos[t] = (int64_t)(t - a);
    if (seg)
        for (uint64_t t = a; t < e; t++) seg[t] = number;
    if (mask) {
        memset(mask + a, targets ? 1 : 0, (size_t)(e - a));
        mask[a] = 0;
    }
}

/*
 * The arrays of nwin windows of W rows.  Window b starts at row rows[b]; its
 * candidate cuts are cuts[off .. off + ncuts[b]) (off: the sum of the earlier
 * ncuts), ascending; repeated values (empty documents) count once.  Fills, at
 * b * W + t for t < W:
 *   pos[]  the position of token t in its segment (0 at each segment's start);
 *   seg[]  its segment's number in the window (0 for the first);
 *   mask[] 0 where token t is the first of the window or of a document (as a
 *          next-token target it would be predicted across a boundary), else 1;
 * (each of pos, seg, mask may be NULL: not computed),
 * and cu[0..k]: the segments' starts over the flattened batch, then nwin * W
 * (k + 1 entries: the return value; at most total cuts + nwin + 1).  *max_len
 * gets the longest segment.  A cut outside (rows[b], rows[b] + W) or out of
 * order means the index is not sorted by row: returns 0 and *bad = b.
 */
TL_WIDE size_t tl_bounds_fill(const uint64_t *rows, const uint64_t *cuts, const uint64_t *ncuts,
                                size_t nwin, uint64_t W, int64_t *pos, int32_t *seg,
                                uint8_t *mask, int64_t *cu, uint64_t *max_len, size_t *bad)
{
    size_t k = 0, off = 0;
    uint64_t longest = 0;
    for (size_t b = 0; b < nwin; b++) {
        const uint64_t r = rows[b];
        int64_t *p = pos ? pos + b * W : NULL;
        int32_t *sg = seg ? seg + b * W : NULL;
        uint8_t *m = mask ? mask + b * W : NULL;
        uint64_t start = 0; /* of the current segment, relative to r */
        int32_t number = 0;
        cu[k++] = (int64_t)(b * W);
        for (uint64_t j = 0; j <= ncuts[b]; j++) {
            uint64_t next = W;
            if (j < ncuts[b]) {
                uint64_t c = cuts[off + j];
                if (c <= r || c >= r + W || c - r < start) {
                    *bad = b;
                    return 0;
                }
                if (c - r == start) continue; /* an empty document */
                next = c - r;
            }
            tl_segment_fill(p, sg, m, start, next, number, 1);
            if (next - start > longest) longest = next - start;
            if (next < W) {
                cu[k++] = (int64_t)(b * W + next);
                number++;
                start = next;
            }
        }
        off += ncuts[b];
    }
    cu[k++] = (int64_t)(nwin * W);
    *max_len = longest;
    return k;
}

/*
 * A directory of a shard's document table, so that finding the documents of a
 * window costs a cache miss or two rather than a binary search of the whole
 * table (a miss per probe once the table outgrows the cache).  The table holds
 * ndocs + 1 local row offsets (the last one the shard's rows); the directory
 * cuts the shard's rows into buckets of 2^shift rows, shift the least with at
 * most ndocs / 4 buckets (about 4 documents each, so at most a quarter of the
 * table's bytes), and holds for each bucket b = 0 .. (rows >> shift) + 1 the
 * first entry j with t[j] >= b << shift (n when none).  The first document
 * starting after a row x is then between dir[x >> shift] and
 * dir[(x >> shift) + 1].  Entries out of order (a damaged file) still give a
 * non-decreasing directory within [0, n]: a search through it stays in the table.
 */
TL_INLINE unsigned tl_dir_shift(uint64_t rows, uint64_t ndocs)
{
    /* rows >> s has bitlen(rows) - s bits: start where it has as many as the cap */
    const uint64_t cap = ndocs / 4;
    const unsigned lr = rows ? 64u - (unsigned)__builtin_clzll(rows) : 0u;
    const unsigned lc = cap ? 64u - (unsigned)__builtin_clzll(cap) : 0u;
    unsigned s = lr > lc ? lr - lc : 0u;
    if (s < 63 && (rows >> s) > cap) s++;
    return s > 63 ? 63 : s;
}

/* The directory's entries (uint64) for a shard of rows rows and ndocs documents. */
TL_INLINE uint64_t tl_dir_entries(uint64_t rows, uint64_t ndocs)
{
    return (rows >> tl_dir_shift(rows, ndocs)) + 2;
}

/* Builds the directory of the n = ndocs + 1 entries of t into dir. */
TL_INLINE void tl_dir_build(const uint64_t *t, uint64_t ndocs, uint64_t rows, uint64_t *dir)
{
    const unsigned s = tl_dir_shift(rows, ndocs);
    const uint64_t nb = tl_dir_entries(rows, ndocs), n = ndocs + 1;
    uint64_t j = 0;
    for (uint64_t b = 0; b < nb; b++) {
        const uint64_t lo = b << s;
        while (j < n && t[j] < lo) j++;
        dir[b] = j;
    }
}

/*
 * The cuts of nwin windows of W rows from per-shard document indexes held in
 * memory (plan.h's layout: tables[k] holds shard k's documents + 1 local row
 * offsets, non-decreasing from 0, then their directory, tl_dir_build), without
 * the batched search: for each shard a window spans, the first document
 * starting after the window's start (a binary search of the entries between
 * two of the directory's), then its documents in order.  row_cum and doc_cum
 * have nfiles + 1 cumulative counts; the tables of every shard the windows span
 * must be loaded.  With cuts NULL, only ncuts[b] is set (the first pass);
 * otherwise cuts gets them back to back (the second).  Returns the total.
 */
TL_INLINE uint64_t tl_bounds_cuts_tables(const uint64_t *row_cum, const uint64_t *doc_cum,
                                         size_t nfiles, const uint64_t *const *tables,
                                         const uint64_t *rows, size_t nwin, uint64_t W,
                                         uint64_t *ncuts, uint64_t *cuts)
{
    uint64_t total = 0;
    for (size_t b = 0; b < nwin; b++) {
        const uint64_t r = rows[b], last = r + W - 1;
        uint64_t count = 0;
        size_t k = tl_shards_locate(row_cum, nfiles, r);
        for (; k < nfiles && row_cum[k] <= last; k++) {
            const uint64_t *t = tables[k];
            uint64_t ndocs = doc_cum[k + 1] - doc_cum[k], base = row_cum[k];
            if (ndocs == 0) continue;
            /* first document of the shard whose start is > r */
            uint64_t lo = 0, hi = ndocs; /* answer in [lo, hi] */
            if (r >= base) {
                const uint64_t local = r - base, rows_k = row_cum[k + 1] - base;
                const uint64_t *dir = t + ndocs + 1;
                if (local < rows_k) { /* always (r is in shard k): bucket + 1 is in dir */
                    const uint64_t bucket = local >> tl_dir_shift(rows_k, ndocs);
                    if (dir[bucket + 1] < hi) hi = dir[bucket + 1];
                    lo = dir[bucket] < hi ? dir[bucket] : hi;
                } else {
                    lo = hi;
                }
                while (lo < hi) {
                    uint64_t mid = lo + (hi - lo) / 2;
                    if (t[mid] <= local)
                        lo = mid + 1;
                    else
                        hi = mid;
                }
            }
            for (uint64_t j = lo; j < ndocs && base + t[j] <= last; j++) {
                if (cuts) cuts[total + count] = base + t[j];
                count++;
            }
        }
        ncuts[b] = count;
        total += count;
    }
    return total;
}

/*
 * Each step's cu_seqlens from those of all the steps' rows (tl_bounds_fill's or
 * tl_pack_bounds's cu, int64, over the flattened rows, ncu entries: every row
 * starts a segment, the last is the total).  Step k has rows [first[k],
 * first[k + 1]) of W tokens (first has nsteps + 1 entries, first[0] = 0,
 * non-decreasing; a step may have no rows).  Writes the steps' arrays back to
 * back to out (int32: each step's segments' starts, less the step's first
 * token, then its tokens; ncu - 1 + nsteps entries), offsets[0..nsteps] where
 * each begins, and each step's longest segment (0 for none).  Returns 1; 0
 * when cu does not fit the rows (not a task's cu_seqlens); -1 when a step holds
 * more tokens than int32 numbers (INT32_MAX), with *bad = that step (nothing
 * is written past the steps before it).
 */
TL_INLINE int tl_bounds_split(const int64_t *cu, size_t ncu, const int64_t *first, size_t nsteps,
                              uint64_t W, int32_t *out, int64_t *offsets, int64_t *longest,
                              size_t *bad)
{
    if (ncu == 0 || cu[0] != 0 || (uint64_t)cu[ncu - 1] != (uint64_t)first[nsteps] * W) return 0;
    size_t j = 0, o = 0;
    for (size_t k = 0; k < nsteps; k++) {
        int64_t lo = first[k] * (int64_t)W, hi = first[k + 1] * (int64_t)W;
        int64_t top = 0;
        if (hi - lo > INT32_MAX) {
            *bad = k;
            return -1;
        }
        offsets[k] = (int64_t)o;
        if (cu[j] != lo) return 0;
        while (cu[j] < hi) {
            if (j + 1 >= ncu || cu[j + 1] <= cu[j]) return 0;
            out[o++] = (int32_t)(cu[j] - lo);
            if (cu[j + 1] - cu[j] > top) top = cu[j + 1] - cu[j];
            j++;
        }
        out[o++] = (int32_t)(hi - lo);
        longest[k] = top;
    }
    offsets[nsteps] = (int64_t)o;
    return 1;
}

#endif /* TOKLOAD_BOUNDS_H */
