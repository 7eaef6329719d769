/*
 * ctab.h -- a shard's metadata block index held in memory in about 2 bytes an
 * entry instead of 8.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * A block index (FORMAT.md, version 3: a shard's nblocks + 1 uint64 byte
 * offsets into its .msb, never decreasing) is held, once read, in groups of
 * TL_CTAB_GROUP entries: each group's first entry as it is, and for each
 * later entry its distance from the one before (the size of a block) as a
 * uint16.  A group where a distance does not fit (a block of 64 KiB or more,
 * or, mostly, entries that decrease, as in a damaged file) keeps its entries
 * as they are instead.  Distances are taken and added modulo 2^64, so a table
 * decodes to exactly the entries of the file, damage included: the checks
 * after it (blocks.h) report what they would have from the file.
 *
 * Memory, one block from the caller (tl_ctab_bytes): a header, 8 bytes per
 * group, 2 per entry, and 8 per entry of each group kept as it is.  With
 * blocks under 64 KiB that is 2.125 bytes an entry: a 4 TB corpus of uint16
 * tokens (2 x 10^12 rows, 4,096 to a block) holds its 3.9 GB block index in
 * 1.04 GB.  Decoding an entry adds the distances before it in its group (at
 * most 63).
 *
 * The layout of the block: tl_ctab, then head (one uint64 per group: its
 * first entry, or TL_CTAB_FULL | the group's number among the full ones),
 * then full (TL_CTAB_GROUP uint64 per full group), then step (one uint16 per
 * entry; a group's first and a full group's steps are unused).
 */
#ifndef TOKLOAD_CTAB_H
#define TOKLOAD_CTAB_H

#include "common.h"

#define TL_CTAB_GROUP 64u
#define TL_CTAB_FULL (UINT64_C(1) << 63)

typedef struct tl_ctab {
    uint64_t n;      /* entries */
    uint64_t nfull;  /* groups kept as they are */
    uint64_t *head;  /* one per group */
    uint64_t *full;  /* TL_CTAB_GROUP per full group */
    uint16_t *step;  /* one per entry */
} tl_ctab;

/* Whether group g of e[0..n) must be kept as it is. */
TL_INLINE int tl_ctab_group_full(const uint64_t *e, uint64_t n, uint64_t g)
{
    uint64_t a = g * TL_CTAB_GROUP, z = a + TL_CTAB_GROUP < n ? a + TL_CTAB_GROUP : n;
    if (e[a] & TL_CTAB_FULL) return 1; /* a head must leave the flag free */
    for (uint64_t j = a + 1; j < z; j++)
        if (e[j] - e[j - 1] > 0xFFFFu) return 1; /* decreasing: a huge step, mostly */
    return 0;
}

/* The bytes of a table of n entries whose groups all fit (the least it takes). */
TL_INLINE uint64_t tl_ctab_bytes_least(uint64_t n)
{
    return sizeof(tl_ctab) + 8 * ((n + TL_CTAB_GROUP - 1) / TL_CTAB_GROUP) + 2 * n;
}

/* Bytes of the table of e[0..n), and its full groups in *nfull. */
TL_INLINE uint64_t tl_ctab_bytes(const uint64_t *e, uint64_t n, uint64_t *nfull)
{
    uint64_t groups = (n + TL_CTAB_GROUP - 1) / TL_CTAB_GROUP, f = 0;
    for (uint64_t g = 0; g < groups; g++) f += (uint64_t)tl_ctab_group_full(e, n, g);
    *nfull = f;
    return tl_ctab_bytes_least(n) + 8 * TL_CTAB_GROUP * f;
}

/* The bytes table t takes (its header included). */
TL_INLINE uint64_t tl_ctab_size(const tl_ctab *t)
{
    return tl_ctab_bytes_least(t->n) + 8 * TL_CTAB_GROUP * t->nfull;
}

/* Build the table of e[0..n) in mem (tl_ctab_bytes bytes, 8-byte aligned;
 * nfull from it).  Returns the table (at mem). */
TL_INLINE tl_ctab *tl_ctab_build(const uint64_t *e, uint64_t n, uint64_t nfull, void *mem)
{
    uint64_t groups = (n + TL_CTAB_GROUP - 1) / TL_CTAB_GROUP, f = 0;
    tl_ctab *t = (tl_ctab *)mem;
    t->n = n;
    t->nfull = nfull;
    t->head = (uint64_t *)(t + 1);
    t->full = t->head + groups;
    t->step = (uint16_t *)(t->full + TL_CTAB_GROUP * nfull);
    for (uint64_t g = 0; g < groups; g++) {
        uint64_t a = g * TL_CTAB_GROUP, z = a + TL_CTAB_GROUP < n ? a + TL_CTAB_GROUP : n;
        if (tl_ctab_group_full(e, n, g)) {
            TL_ASSERT(f < nfull);
            t->head[g] = TL_CTAB_FULL | f;
            for (uint64_t j = a; j < z; j++) t->full[TL_CTAB_GROUP * f + (j - a)] = e[j];
            f++;
            continue;
        }
        t->head[g] = e[a];
        t->step[a] = 0;
        for (uint64_t j = a + 1; j < z; j++) t->step[j] = (uint16_t)(e[j] - e[j - 1]);
    }
    TL_ASSERT(f == nfull);
    return t;
}

/* Entries [j, j + len) of the table into out.  Returns 0, or -1 (nothing
 * written) when they run past its n entries. */
TL_INLINE int tl_ctab_decode(const tl_ctab *t, uint64_t j, uint64_t len, uint64_t *out)
{
    if (TL_UNLIKELY(j > t->n || len > t->n - j)) return -1;
    uint64_t end = j + len;
    while (j < end) {
        uint64_t g = j / TL_CTAB_GROUP, a = g * TL_CTAB_GROUP;
        uint64_t z = a + TL_CTAB_GROUP < end ? a + TL_CTAB_GROUP : end;
        uint64_t h = t->head[g];
        if (h & TL_CTAB_FULL) {
            const uint64_t *f = t->full + TL_CTAB_GROUP * (h & ~TL_CTAB_FULL) - a;
            for (; j < z; j++) *out++ = f[j];
            continue;
        }
        uint64_t v = h;
        for (uint64_t i = a + 1; i <= j; i++) v += t->step[i];
        *out++ = v;
        for (j++; j < z; j++) {
            v += t->step[j];
            *out++ = v;
        }
    }
    return 0;
}

#endif /* TOKLOAD_CTAB_H */
