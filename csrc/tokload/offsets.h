/*
 * offsets.h -- the rules of an offset index (.docs, .mdx; FORMAT.md).
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * An offset index of a shard holds count + 1 uint64 offsets into something of
 * `limit` units (rows, bytes): the first is 0, none passes limit or is below the
 * one before it, the last is limit.  Readers check the entries they read, a
 * whole table or a run or pair of them, and name the entry at fault as tokload
 * verify does (tools._first_bad_offset): the first when not 0, else the first
 * that passes limit or goes below the one before it, else the last when short.
 */
#ifndef TOKLOAD_OFFSETS_H
#define TOKLOAD_OFFSETS_H

#include "common.h"

/*
 * The first of the n offsets t[0..n) (n >= 1) that breaks the rules, or n when
 * none does; `first`: t[0] is the index's first entry, `last`: t[n - 1] its last.
 */
TL_INLINE size_t tl_offsets_bad(const uint64_t *t, size_t n, uint64_t limit, int first, int last)
{
    if (first && t[0] != 0) return 0;
    for (size_t j = 0; j < n; j++)
        if (t[j] > limit || (j && t[j] < t[j - 1])) return j;
    return last && t[n - 1] != limit ? n - 1 : n;
}

#endif /* TOKLOAD_OFFSETS_H */
