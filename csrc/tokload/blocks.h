/*
 * blocks.h -- the metadata of token windows from per-shard metadata blocks,
 * and the encoder that writes them.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * FORMAT.md, version 3, "metadata_layout": "blocks".  Per shard, with B the
 * manifest's span_block (at most 65536):
 *   .mbx  ceil(rows / B) + 1 uint64: block b is bytes [mbx[b], mbx[b + 1])
 *         of the .msb; mbx[0] = 0, the values never decrease, the last is
 *         the .msb's size.
 *   .msb  per block of B rows (the last may hold fewer), little-endian:
 *           uint32 nruns            1 <= nruns <= the block's rows
 *           uint16 start[nruns]     block-relative first rows: 0, then
 *                                   strictly increasing, below the block's rows
 *           uint32 record[nruns]    shard-local record numbers, or TL_SPAN_NONE
 *           uint32 end[nnew]        nnew: the block's distinct records, in
 *                                   order of first appearance; the bytes of
 *                                   the j-th are data[end[j - 1], end[j])
 *                                   (end[-1] = 0), never decreasing
 *           uint8  data[end[nnew - 1]]
 *         and nothing more: 4 + 6 nruns + 4 nnew + end[nnew - 1] bytes.
 * A run is rows with one record (or none); a block lists the run holding its
 * first row at start 0, so it stands alone: a window reads the blocks it
 * touches (one read) and nothing else, once the block index is known.  The
 * block index is small (8 bytes per B rows on disk): tokload/_meta.pyx holds
 * it in memory per shard, in about 2 bytes an entry (ctab.h), or reads its
 * entries first, when it would not fit.  Either way the functions here get
 * the entries each piece needs, piece p's at entries[p->blk].
 *
 * A batch of windows:
 *   1. tl_spans_pieces (spans.h): the windows cut at shard ends; each
 *      piece's block index entries (decoded from the table held in memory,
 *      or read).
 *   2. tl_blocks_slices: from the entries, one read of each piece's blocks.
 *   3. tl_blocks_check_all: check each block (once where its records are
 *      in order, the usual case); tl_blocks_resolve: per row the
 *      batch-level number of its record (or -1); the batch's
 *      distinct records (shard, id) in order of first appearance, with where
 *      their bytes lie in the blocks.
 *   4. tl_blocks_offsets, tl_blocks_copy: the records' offsets, and their
 *      bytes into the batch's buffer.
 * Nothing here allocates or reads: every buffer comes from the caller.
 */
#ifndef TOKLOAD_BLOCKS_H
#define TOKLOAD_BLOCKS_H

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "shards.h"
#include "spans.h"

#define TL_BLOCK_MAX 65536u /* rows per block: starts are uint16 */

/* Error codes (positive: not an errno), with tl_span_error's fields: shard,
 * entry (the block, or the block index entry), value, limit. */
#define TL_BLOCK_BAD_INDEX 11   /* a block index entry out of order or range */
#define TL_BLOCK_BAD_SIZE 12    /* a block's counts disagree with its size */
#define TL_BLOCK_BAD_START 13   /* run starts not 0, increasing, within the block */
#define TL_BLOCK_BAD_RECORD 14  /* a record past the shard's records */
#define TL_BLOCK_BAD_END 15     /* record ends that decrease */
#define TL_BLOCK_BAD_INPUT 16   /* encoder input: runs, record index or sizes out of range */

typedef struct {
    const uint64_t *row_cum; /* nfiles + 1 cumulative rows */
    const uint64_t *msx_cum; /* .mbx block index entries (blocks + 1 per shard) */
    const uint64_t *msb_cum; /* .msb bytes */
    const uint64_t *nrec;    /* records per shard */
    size_t nfiles;
    uint64_t block;
} tl_block_set;

/* A block-local set of records: open addressing, cleared in O(1) by a new
 * generation.  cap: a power of two, at least twice a block's runs. */
typedef struct {
    uint32_t *key;
    uint32_t *val;
    uint32_t *gen;
    uint64_t cap;
    uint32_t now;
} tl_block_seen;

TL_INLINE void tl_block_seen_reset(tl_block_seen *t)
{
    if (++t->now == 0) { /* wrapped: every slot's generation is stale again */
        memset(t->gen, 0, t->cap * sizeof(uint32_t));
        t->now = 1;
    }
}

/* A hash for record keys that keeps keys differing only in their low 6 bits
 * in neighbouring slots (a block's records mostly have consecutive ids, so
 * its probes touch a few cache lines) and scatters the groups of 64. */
TL_INLINE uint64_t tl_block_hash(uint64_t key)
{
    return (tl_span_hash(key >> 6) << 6) | (key & 63);
}

/* The slot of rec in t; *fresh = whether it was added now (as number *count). */
TL_INLINE uint32_t tl_block_seen_slot(tl_block_seen *t, uint32_t rec, uint32_t *count, int *fresh)
{
    uint64_t h = tl_block_hash(rec) & (t->cap - 1);
    while (t->gen[h] == t->now && t->key[h] != rec) h = (h + 1) & (t->cap - 1);
    if (t->gen[h] != t->now) {
        t->gen[h] = t->now;
        t->key[h] = rec;
        t->val[h] = (*count)++;
        *fresh = 1;
    } else {
        *fresh = 0;
    }
    return t->val[h];
}

TL_INLINE uint32_t tl_load_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

TL_INLINE uint16_t tl_load_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

TL_INLINE uint64_t tl_block_rows(const tl_block_set *s, size_t k, uint64_t b)
{
    uint64_t rows = s->row_cum[k + 1] - s->row_cum[k], first = b * s->block;
    return rows - first < s->block ? rows - first : s->block;
}

/* The first of entries e[0..n) (block index entries b0, b0 + 1, ... of a
 * shard of nblocks blocks whose .msb is size bytes) that breaks 0 = first <=
 * ... <= last = size, or n when none does. */
TL_INLINE uint64_t tl_block_index_bad(const uint64_t *e, uint64_t n, uint64_t b0,
                                      uint64_t nblocks, uint64_t size)
{
    for (uint64_t j = 0; j < n; j++) {
        uint64_t b = b0 + j;
        if (TL_UNLIKELY(e[j] > size || (j && e[j] < e[j - 1]) || (b == 0 && e[j] != 0) ||
                        (b == nblocks && e[j] != size)))
            return j;
    }
    return n;
}

/* Step 2: check each piece's block index entries; one read of its blocks'
 * bytes into the block buffer at at[i].  q: one request per piece, in
 * units of bytes of the .msb files.  Returns 0 and *nbytes, or an error. */
TL_INLINE int tl_blocks_slices(const tl_block_set *s, const tl_span_piece *pieces, size_t n,
                               const uint64_t *entries, tl_span_reqs q, uint64_t *at,
                               uint64_t *nbytes, tl_span_error *err)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const tl_span_piece *p = &pieces[i];
        size_t k = p->shard;
        uint64_t size = s->msb_cum[k + 1] - s->msb_cum[k];
        uint64_t nblocks = s->msx_cum[k + 1] - s->msx_cum[k] - 1;
        uint64_t b0 = p->start / s->block, b1 = (p->start + p->len - 1) / s->block;
        const uint64_t *e = entries + p->blk;
        uint64_t j = tl_block_index_bad(e, b1 + 2 - b0, b0, nblocks, size);
        if (TL_UNLIKELY(j < b1 + 2 - b0))
            return tl_span_fail(err, TL_BLOCK_BAD_INDEX, k, b0 + j, e[j], size);
        uint64_t len = e[b1 + 1 - b0] - e[0];
        at[i] = total;
        q.start[i] = s->msb_cum[k] + e[0];
        q.len[i] = len;
        q.dst[i] = total;
        total += len;
    }
    *nbytes = total;
    return 0;
}

/* What tl_block_check learns of a block. */
typedef struct {
    uint32_t nruns;
    uint32_t nnew;       /* distinct records */
    const uint8_t *ends; /* the end[] array */
    int sorted;          /* its records (none aside) never decrease: t is not used */
    uint32_t first;      /* its first and last record (TL_SPAN_NONE if none) */
    uint32_t last;
} tl_block_info;

/* Check block b of shard k (bytes p, len) and number its distinct records:
 * when its records (none aside) never decrease, as a writer that numbers
 * records in order of appearance leaves them, by counting changes;
 * otherwise in t.  Returns 0 or an error code. */
TL_INLINE int tl_block_check(const tl_block_set *s, size_t k, uint64_t b, const uint8_t *p,
                             uint64_t len, tl_block_seen *t, tl_block_info *bi,
                             tl_span_error *err)
{
    uint64_t brows = tl_block_rows(s, k, b);
    if (TL_UNLIKELY(len < 4)) return tl_span_fail(err, TL_BLOCK_BAD_SIZE, k, b, len, 4);
    uint32_t nruns = tl_load_u32(p);
    if (TL_UNLIKELY(nruns == 0 || nruns > brows || 4 + 6 * (uint64_t)nruns > len))
        return tl_span_fail(err, TL_BLOCK_BAD_SIZE, k, b, nruns, brows);
    const uint8_t *st = p + 4, *rc = p + 4 + 2 * (uint64_t)nruns;
    uint64_t nrec = s->nrec[k];
    uint32_t nnew = 0, prev = 0, first = TL_SPAN_NONE, last = TL_SPAN_NONE;
    int sorted = 1;
    for (uint32_t r = 0; r < nruns; r++) {
        uint32_t a = tl_load_u16(st + 2 * (uint64_t)r), rec = tl_load_u32(rc + 4 * (uint64_t)r);
        if (TL_UNLIKELY((r == 0 && a != 0) || (r && a <= prev) || a >= brows))
            return tl_span_fail(err, TL_BLOCK_BAD_START, k, b, a, brows);
        if (rec != TL_SPAN_NONE) {
            if (TL_UNLIKELY(rec >= nrec)) return tl_span_fail(err, TL_BLOCK_BAD_RECORD, k, b, rec, nrec);
            if (last == TL_SPAN_NONE) {
                first = rec;
                nnew = 1;
            } else if (rec != last) {
                sorted &= rec > last;
                nnew++;
            }
            last = rec;
        }
        prev = a;
    }
    if (!sorted) { /* count the distinct records in t */
        int fresh;
        nnew = 0;
        tl_block_seen_reset(t);
        for (uint32_t r = 0; r < nruns; r++) {
            uint32_t rec = tl_load_u32(rc + 4 * (uint64_t)r);
            if (rec != TL_SPAN_NONE) tl_block_seen_slot(t, rec, &nnew, &fresh);
        }
    }
    uint64_t head = 4 + 6 * (uint64_t)nruns + 4 * (uint64_t)nnew;
    if (TL_UNLIKELY(head > len)) return tl_span_fail(err, TL_BLOCK_BAD_SIZE, k, b, len, head);
    const uint8_t *ends = p + 4 + 6 * (uint64_t)nruns;
    uint32_t e0 = 0;
    for (uint32_t j = 0; j < nnew; j++) {
        uint32_t v = tl_load_u32(ends + 4 * (uint64_t)j);
        if (TL_UNLIKELY(v < e0)) return tl_span_fail(err, TL_BLOCK_BAD_END, k, b, v, e0);
        e0 = v;
    }
    if (TL_UNLIKELY(head + e0 != len))
        return tl_span_fail(err, TL_BLOCK_BAD_SIZE, k, b, len, head + e0);
    bi->nruns = nruns;
    bi->nnew = nnew;
    bi->ends = ends;
    bi->sorted = sorted;
    bi->first = first;
    bi->last = last;
    return 0;
}

/* The records of runs [r0, n) of a block (rc: its record array; r0 >= 2)
 * where no two neighbouring runs are both without a record: the record
 * before run r (none aside) is then run r - 1's, or run r - 2's, so each
 * run is checked on its own and the loop carries nothing but its sums (it
 * vectorizes).  A run with a record is bad when the record is nrec or more
 * or below the one before; it is fresh when it differs from the one
 * before.  Adds to *bad and *nnew; sets *pair where runs r - 1 and r both
 * lack a record (then the sums are void). */
TL_INLINE void tl_block_records_quick(const uint8_t *rc, uint32_t r0, uint32_t n, uint64_t nrec,
                                      unsigned *bad, uint32_t *nnew, unsigned *pair)
{
    unsigned bd = 0, pr = 0;
    uint32_t cnt = 0;
    for (uint32_t r = r0; r < n; r++) {
        uint32_t rec = tl_load_u32(rc + 4 * (uint64_t)r);
        uint32_t p1 = tl_load_u32(rc + 4 * (uint64_t)(r - 1));
        uint32_t p2 = tl_load_u32(rc + 4 * (uint64_t)(r - 2));
        uint32_t before = p1 != TL_SPAN_NONE ? p1 : p2;
        unsigned some = rec != TL_SPAN_NONE, fresh = some & (rec != before);
        pr |= !some & (p1 == TL_SPAN_NONE);
        bd |= some & (rec >= nrec);
        bd |= fresh & (before != TL_SPAN_NONE) & (rec < before);
        cnt += fresh;
    }
    *bad |= bd;
    *nnew += cnt;
    *pair |= pr;
}

/* tl_block_check, quick for the usual block: sound, with records (none
 * aside) that never decrease, and no two neighbouring runs without a record
 * (a gap between annotations is one run).  Its loops carry no early exit
 * and no dependence from run to run, so they compile to a few vector
 * instructions a run; any other block, damaged ones included, goes through
 * tl_block_check, which gives the same info or the precise error. */
TL_INLINE int tl_block_check_quick(const tl_block_set *s, size_t k, uint64_t b, const uint8_t *p,
                                   uint64_t len, tl_block_seen *t, tl_block_info *bi,
                                   tl_span_error *err)
{
    uint64_t brows = tl_block_rows(s, k, b);
    uint32_t nruns = len >= 4 ? tl_load_u32(p) : 0;
    if (TL_UNLIKELY(nruns == 0 || nruns > brows || 4 + 6 * (uint64_t)nruns > len))
        return tl_block_check(s, k, b, p, len, t, bi, err);
    const uint8_t *st = p + 4, *rc = p + 4 + 2 * (uint64_t)nruns;
    uint64_t nrec = s->nrec[k];
    unsigned bad = (tl_load_u16(st) != 0) | (tl_load_u16(st + 2 * (uint64_t)(nruns - 1)) >= brows);
    for (uint32_t r = 1; r < nruns; r++)
        bad |= tl_load_u16(st + 2 * (uint64_t)r) <= tl_load_u16(st + 2 * (uint64_t)(r - 1));
    /* runs 0 and 1 by hand (nothing before them to load), then the rest;
     * runs 0 and 1 both without a record are a pair too (the block's first
     * record is then further on) */
    uint32_t rec0 = tl_load_u32(rc), rec1 = nruns > 1 ? tl_load_u32(rc + 4) : TL_SPAN_NONE;
    unsigned pair = (rec0 == TL_SPAN_NONE) & (rec1 == TL_SPAN_NONE) & (nruns > 1);
    uint32_t nnew = (rec0 != TL_SPAN_NONE) + (rec1 != TL_SPAN_NONE && rec1 != rec0);
    bad |= (rec0 != TL_SPAN_NONE) & (rec0 >= nrec);
    bad |= (rec1 != TL_SPAN_NONE) & ((rec1 >= nrec) | ((rec0 != TL_SPAN_NONE) & (rec1 < rec0)));
    tl_block_records_quick(rc, 2, nruns, nrec, &bad, &nnew, &pair);
    uint32_t z1 = tl_load_u32(rc + 4 * (uint64_t)(nruns - 1));
    uint32_t z2 = nruns > 1 ? tl_load_u32(rc + 4 * (uint64_t)(nruns - 2)) : TL_SPAN_NONE;
    uint32_t first = rec0 != TL_SPAN_NONE ? rec0 : rec1, last = z1 != TL_SPAN_NONE ? z1 : z2;
    uint64_t head = 4 + 6 * (uint64_t)nruns + 4 * (uint64_t)nnew;
    /* neighbours without a record void the sums (and first, last): tl_block_check counts */
    if (TL_UNLIKELY(bad || pair || head > len)) return tl_block_check(s, k, b, p, len, t, bi, err);
    const uint8_t *ends = p + 4 + 6 * (uint64_t)nruns;
    for (uint32_t j = 1; j < nnew; j++)
        bad |= tl_load_u32(ends + 4 * (uint64_t)j) < tl_load_u32(ends + 4 * (uint64_t)(j - 1));
    uint64_t e0 = nnew ? tl_load_u32(ends + 4 * (uint64_t)(nnew - 1)) : 0;
    if (TL_UNLIKELY(bad || head + e0 != len)) return tl_block_check(s, k, b, p, len, t, bi, err);
    bi->nruns = nruns;
    bi->nnew = nnew;
    bi->ends = ends;
    bi->sorted = 1;
    bi->first = first;
    bi->last = last;
    return 0;
}

/* out[0..m) = v: 64-byte stores from 16 values, 16-byte stores from 4
 * (the last one overlapping the one before), element by element below 4:
 * a run costs a few stores and no element-wise tail.  From 32 values the
 * stores between the first and the last start on 64-byte boundaries (out is
 * aligned to 4 bytes: the readers refuse positions that are not): an
 * unaligned 64-byte store touches two cache lines, and a batch's positions
 * (B x window int32, more than L1 holds) are stored line by line from L2, so
 * runs of 100 fill about 25% faster. */
TL_INLINE void tl_fill_i32(int32_t *out, uint64_t m, int32_t v)
{
    int32_t pat[16];
    for (int j = 0; j < 16; j++) pat[j] = v;
    if (m >= 32) {
        int32_t *e = out + m - 16;
        int32_t *p = out + (64 - ((uintptr_t)out & 63)) / 4; /* the next line, out + 1 .. 16 */
        memcpy(out, pat, 64);
        for (; p < e; p += 16) memcpy(p, pat, 64);
        memcpy(e, pat, 64);
    } else if (m >= 16) {
        for (uint64_t j = 0; j + 16 < m; j += 16) memcpy(out + j, pat, 64);
        memcpy(out + m - 16, pat, 64);
    } else if (m >= 4) {
        for (uint64_t j = 0; j + 4 < m; j += 4) memcpy(out + j, pat, 16);
        memcpy(out + m - 4, pat, 16);
    } else {
        for (uint64_t j = 0; j < m; j++) out[j] = v;
    }
}

/* The slots of a checked block's records, run after run: call for every
 * record (none aside) in order, from the block's first run.  A block whose
 * records are out of order keeps nothing here (t numbers them): its slots
 * may be asked for any record, at any time. */
typedef struct {
    uint32_t slot;
    uint32_t prev;
} tl_block_walk;

TL_INLINE void tl_block_walk_start(tl_block_walk *w)
{
    w->slot = 0;
    w->prev = TL_SPAN_NONE;
}

TL_INLINE uint32_t tl_block_walk_slot(const tl_block_info *bi, tl_block_seen *t, tl_block_walk *w,
                                      uint32_t rec)
{
    if (bi->sorted) {
        if (rec != w->prev) {
            if (w->prev != TL_SPAN_NONE) w->slot++;
            w->prev = rec;
        }
        return w->slot;
    }
    uint32_t count = bi->nnew; /* the record is in t already: no insert */
    int fresh;
    return tl_block_seen_slot(t, rec, &count, &fresh);
}

/* A record of a batch: the place (*src, in the block buffer) and size (*len)
 * of the bytes of the sl-th record of a checked block whose record ends are
 * at ends and whose data begins at byte data of the buffer. */
TL_INLINE void tl_block_item(const uint8_t *ends, uint32_t sl, uint64_t data, uint64_t *src,
                             uint64_t *len)
{
    uint32_t a0 = sl ? tl_load_u32(ends + 4 * (uint64_t)(sl - 1)) : 0;
    uint32_t a1 = tl_load_u32(ends + 4 * (uint64_t)sl);
    *src = data + a0;
    *len = a1 - a0;
}

/* A piece's range of records, to find the pieces that may share one. */
typedef struct {
    uint64_t shard;
    uint64_t lo;
    uint64_t hi;
    uint64_t piece;
} tl_block_range;

/* Step 3a: check every block of pieces[0..n) (infos[p->blk + b - b0] for
 * block b of piece p: p->blk numbers the pieces' blocks apart); each piece's
 * range of records and whether they are in order (prange: 3 values per
 * piece); *nruns: the runs of all the blocks, a bound on the records.  A
 * block whose records are out of order is checked again by
 * tl_blocks_resolve, which numbers them.  Returns 0 or an error code. */
TL_WIDE int tl_blocks_check_all(const tl_block_set *s, const tl_span_piece *pieces, size_t n,
                                const uint64_t *at, const uint64_t *entries,
                                const uint8_t *blockbuf, tl_block_seen *t,
                                tl_block_info *infos, uint64_t *prange, uint64_t *nruns,
                                tl_span_error *err)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const tl_span_piece *p = &pieces[i];
        const uint64_t *e = entries + p->blk;
        uint64_t b0 = p->start / s->block, b1 = (p->start + p->len - 1) / s->block;
        uint64_t lo = TL_SPAN_NONE, hi = 0, ordered = 1;
        uint32_t prev = TL_SPAN_NONE;
        for (uint64_t b = b0; b <= b1; b++) {
            tl_block_info *bi = &infos[p->blk + (b - b0)];
            const uint8_t *blk = blockbuf + at[i] + (e[b - b0] - e[0]);
            int rc = tl_block_check_quick(s, p->shard, b, blk, e[b - b0 + 1] - e[b - b0], t, bi, err);
            if (rc) return rc;
            total += bi->nruns;
            if (bi->first == TL_SPAN_NONE) continue;
            ordered &= bi->sorted && (prev == TL_SPAN_NONE || bi->first >= prev);
            prev = bi->last;
            if (bi->first < lo) lo = bi->first;
            if (bi->last > hi) hi = bi->last;
            if (!bi->sorted) lo = 0, hi = TL_SPAN_NONE - 1; /* its range is unknown: all */
        }
        prange[3 * i] = lo;
        prange[3 * i + 1] = hi;
        prange[3 * i + 2] = ordered;
    }
    *nruns = total;
    return 0;
}

static inline int tl_block_range_cmp(const void *a, const void *b)
{
    const tl_block_range *x = (const tl_block_range *)a, *y = (const tl_block_range *)b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    if (x->lo != y->lo) return x->lo < y->lo ? -1 : 1;
    return x->piece < y->piece ? -1 : x->piece > y->piece;
}

/* Step 3b, after tl_blocks_check_all over the same pieces: positions
 * (int32, -1 for none) of every row of every piece; the batch's distinct
 * records (a record: a shard and an id in it) in order of first
 * appearance, as their bytes' places in the block buffer (item_src,
 * item_len).  hkeys/hvals: hcap slots
 * (a power of two, at least twice the runs); t: a block-local set; order:
 * one tl_block_range per piece.
 *
 * A piece whose blocks' records never decrease, across its blocks too, and
 * whose range of records meets no other piece's of its shard cannot share a
 * record with another piece: its records need no look-up in the batch's set
 * (a record is new where it differs from the one before).  Others go through
 * the set.  A block whose records are out of order is checked again here,
 * which numbers its records in t.  Returns 0 and *nitems, or an error code.
 * TL_WIDE: the positions (4 bytes a row, twice the bytes of uint16 tokens)
 * are most of the stores. */
TL_WIDE int tl_blocks_resolve(const tl_block_set *s, const tl_span_piece *pieces, size_t n,
                              const uint64_t *at, const uint64_t *entries,
                              const uint8_t *blockbuf, const tl_block_info *infos,
                              int32_t *positions, uint64_t *hkeys, int64_t *hvals,
                              uint64_t hcap, tl_block_seen *t,
                              uint64_t *prange, tl_block_range *order, uint64_t *item_src,
                              uint64_t *item_len, size_t *nitems, tl_span_error *err)
{
    size_t ni = 0;
    int any_set = 0;
    /* a piece meets another of its shard when their ranges overlap: sorted by
     * (shard, lo), piece i meets one before it if its lo is at most the largest
     * hi before it, and one after it if the next lo is at most its hi */
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (prange[3 * i] > prange[3 * i + 1]) continue; /* no records: meets none */
        order[m].shard = pieces[i].shard;
        order[m].lo = prange[3 * i];
        order[m].hi = prange[3 * i + 1];
        order[m].piece = i;
        m++;
    }
    qsort(order, m, sizeof(tl_block_range), tl_block_range_cmp);
    uint64_t top = 0;
    for (size_t j = 0; j < m; j++) {
        int first = j == 0 || order[j].shard != order[j - 1].shard;
        int meets = (!first && order[j].lo <= top) ||
                    (j + 1 < m && order[j + 1].shard == order[j].shard && order[j + 1].lo <= order[j].hi);
        if (meets) prange[3 * order[j].piece + 2] = 0;
        top = first || order[j].hi > top ? order[j].hi : top;
    }
    for (size_t i = 0; i < n; i++) any_set |= !prange[3 * i + 2];
    if (any_set)
        for (uint64_t h = 0; h < hcap; h++) hvals[h] = -1;
    for (size_t i = 0; i < n; i++) {
        const tl_span_piece *p = &pieces[i];
        size_t k = p->shard;
        int alone = (int)prange[3 * i + 2];
        const uint64_t *e = entries + p->blk;
        uint64_t b0 = p->start / s->block, b1 = (p->start + p->len - 1) / s->block;
        uint64_t end = p->start + p->len;
        int32_t *pos = positions + p->dst; /* the piece's first row */
        uint32_t last_rec = TL_SPAN_NONE;
        int32_t last_item = -1;
        for (uint64_t b = b0; b <= b1; b++) {
            tl_block_info bi = infos[p->blk + (b - b0)];
            uint64_t off = at[i] + (e[b - b0] - e[0]), len = e[b - b0 + 1] - e[b - b0];
            const uint8_t *blk = blockbuf + off;
            if (!bi.sorted) { /* number its records in t */
                int rc = tl_block_check(s, k, b, blk, len, t, &bi, err);
                if (rc) return rc;
            }
            uint64_t base = b * s->block, brows = tl_block_rows(s, k, b);
            uint64_t data = off + 4 + 6 * (uint64_t)bi.nruns + 4 * (uint64_t)bi.nnew;
            const uint8_t *st = blk + 4, *rcs = blk + 4 + 2 * (uint64_t)bi.nruns;
            tl_block_walk w;
            tl_block_walk_start(&w);
            /* dense: in order, and its records are first .. last, each once (as
             * a writer numbering records in order leaves them), so record rec
             * is the block's (rec - first)-th: no walk, and the runs before the
             * piece need no visit (a binary search finds the one holding its
             * first row) */
            int dense = bi.sorted && bi.first != TL_SPAN_NONE &&
                        (uint64_t)bi.last - bi.first + 1 == bi.nnew;
            uint32_t r0 = 0;
            if (dense && p->start > base) {
                uint64_t row = p->start - base;
                uint32_t lo = 0, hi = bi.nruns; /* st[lo] <= row < st[hi] (st[nruns]: past) */
                while (hi - lo > 1) {
                    uint32_t mid = lo + (hi - lo) / 2;
                    if (tl_load_u16(st + 2 * (uint64_t)mid) <= row) lo = mid;
                    else hi = mid;
                }
                r0 = lo;
            }
            uint64_t a = base + tl_load_u16(st + 2 * (uint64_t)r0); /* the run's first row */
            if (dense && alone) { /* the usual block: the loop below without its look-ups */
                const uint8_t *ends = bi.ends;
                uint64_t start = p->start;
                for (uint32_t r = r0; r < bi.nruns && a < end; r++) {
                    uint32_t rec = tl_load_u32(rcs + 4 * (uint64_t)r);
                    uint64_t z =
                        base + (r + 1 < bi.nruns ? tl_load_u16(st + 2 * (uint64_t)(r + 1)) : brows);
                    uint64_t lo = a > start ? a : start, hi = z < end ? z : end;
                    a = z;
                    if (hi <= lo) continue; /* before the piece */
                    int32_t v = -1;
                    if (rec != TL_SPAN_NONE) {
                        if (rec != last_rec) { /* fresh: the block's (rec - first)-th record */
                            tl_block_item(ends, rec - bi.first, data, item_src + ni, item_len + ni);
                            last_item = (int32_t)ni++;
                            last_rec = rec;
                        }
                        v = last_item;
                    }
                    tl_fill_i32(pos + (lo - start), hi - lo, v);
                }
                continue;
            }
            for (uint32_t r = r0; r < bi.nruns && a < end; r++) {
                uint32_t rec = tl_load_u32(rcs + 4 * (uint64_t)r);
                uint64_t z = base + (r + 1 < bi.nruns ? tl_load_u16(st + 2 * (uint64_t)(r + 1)) : brows);
                /* in order: counted at every run (dense: by its number); out of
                 * order: looked up when fresh below */
                uint32_t slot = !bi.sorted || rec == TL_SPAN_NONE ? 0
                                : dense ? rec - bi.first
                                        : tl_block_walk_slot(&bi, t, &w, rec);
                uint64_t lo = a > p->start ? a : p->start, hi = z < end ? z : end;
                a = z;
                if (hi <= lo) continue; /* before the piece */
                int32_t v = -1;
                if (rec != TL_SPAN_NONE) {
                    int fresh;
                    if (alone) { /* in order, and in no other piece */
                        fresh = rec != last_rec;
                        if (!fresh) v = last_item;
                    } else {
                        uint64_t key = ((uint64_t)k << 32) | rec;
                        uint64_t h = tl_block_hash(key) & (hcap - 1);
                        while (hvals[h] >= 0 && hkeys[h] != key) h = (h + 1) & (hcap - 1);
                        fresh = hvals[h] < 0;
                        if (fresh) {
                            hkeys[h] = key;
                            hvals[h] = (int64_t)ni;
                        }
                        v = (int32_t)hvals[h];
                    }
                    if (fresh) {
                        uint32_t sl = bi.sorted ? slot : tl_block_walk_slot(&bi, t, &w, rec);
                        tl_block_item(bi.ends, sl, data, item_src + ni, item_len + ni);
                        v = (int32_t)ni++;
                    }
                    last_rec = rec;
                    last_item = v;
                }
                tl_fill_i32(pos + (lo - p->start), hi - lo, v);
            }
        }
    }
    *nitems = ni;
    return 0;
}

/* Step 4a: offsets (nitems + 1, int64) of the records in the batch's
 * buffer.  Returns the bytes. */
TL_INLINE uint64_t tl_blocks_offsets(const uint64_t *item_len, size_t nitems, int64_t *offsets)
{
    uint64_t total = 0;
    offsets[0] = 0;
    for (size_t i = 0; i < nitems; i++) {
        total += item_len[i];
        offsets[i + 1] = (int64_t)total;
    }
    return total;
}

/* Step 4b: the records' bytes back to back into dst: one copy for each
 * stretch of records that lie back to back in the blocks (a block's fresh
 * records usually do, in order). */
TL_INLINE void tl_blocks_copy(const uint8_t *blockbuf, const uint64_t *item_src,
                              const uint64_t *item_len, size_t nitems, uint8_t *dst)
{
    uint64_t from = 0, to = 0, run = 0; /* the stretch: [from, from + run) to dst + to */
    for (size_t i = 0; i < nitems; i++) {
        if (item_src[i] != from + run) {
            if (run) memcpy(dst + to, blockbuf + from, run);
            from = item_src[i], to += run, run = 0;
        }
        run += item_len[i];
    }
    if (run) memcpy(dst + to, blockbuf + from, run);
}

/*
 * The encoder.  A shard's runs (starts strictly increasing from 0, below
 * rows; records below nrec or TL_SPAN_NONE) and its records (mdx: nrec + 1
 * byte offsets into mdb, never decreasing, the last at most mdb_bytes)
 * become blocks [b0, b1).  *run is a cursor: the run holding block b0's
 * first row (0 for b0 = 0); it is left at block b1's.  With out NULL only
 * the sizes are computed (sizes[b - b0]); otherwise the blocks are written
 * back to back (cap bytes at most).  Every run must meet a block: with b1
 * the last block, runs left over (starting at or past rows) are an error.
 * Returns 0 or an error code (TL_BLOCK_BAD_INPUT: entry the run or record,
 * value what it holds).
 */
TL_INLINE int tl_blocks_encode(uint64_t block, uint64_t rows, const uint64_t *starts,
                               const uint32_t *records, uint64_t nruns, const uint64_t *mdx,
                               uint64_t nrec, const uint8_t *mdb, uint64_t mdb_bytes, uint64_t b0,
                               uint64_t b1, uint64_t *run, tl_block_seen *t, uint64_t *sizes,
                               uint8_t *out, uint64_t cap, tl_span_error *err)
{
    uint64_t r = *run, w = 0, unused = b0 ? nruns : 0; /* the first run after the blocks */
    for (uint64_t b = b0; b < b1; b++) {
        uint64_t base = b * block, top = base + block < rows ? base + block : rows;
        if (TL_UNLIKELY(r >= nruns || starts[r] > base))
            return tl_span_fail(err, TL_BLOCK_BAD_INPUT, 0, r, r < nruns ? starts[r] : 0, base);
        /* runs r .. r1 - 1 meet the block */
        uint64_t r1 = r + 1;
        while (r1 < nruns && starts[r1] < top) {
            if (TL_UNLIKELY(starts[r1] <= starts[r1 - 1]))
                return tl_span_fail(err, TL_BLOCK_BAD_INPUT, 0, r1, starts[r1], starts[r1 - 1]);
            r1++;
        }
        uint32_t nnew = 0;
        uint64_t bytes = 0;
        int fresh;
        tl_block_seen_reset(t);
        for (uint64_t j = r; j < r1; j++) {
            uint32_t rec = records[j];
            if (rec == TL_SPAN_NONE) continue;
            if (TL_UNLIKELY(rec >= nrec)) return tl_span_fail(err, TL_BLOCK_BAD_INPUT, 0, j, rec, nrec);
            tl_block_seen_slot(t, rec, &nnew, &fresh);
            if (fresh) {
                if (TL_UNLIKELY(mdx[rec] > mdx[rec + 1] || mdx[rec + 1] > mdb_bytes))
                    return tl_span_fail(err, TL_BLOCK_BAD_INPUT, 1, rec, mdx[rec + 1], mdb_bytes);
                bytes += mdx[rec + 1] - mdx[rec];
            }
        }
        if (TL_UNLIKELY(bytes > 0xFFFFFFFFu))
            return tl_span_fail(err, TL_BLOCK_BAD_INPUT, 2, b, bytes, 0xFFFFFFFFu);
        uint64_t m = r1 - r, size = 4 + 6 * m + 4 * (uint64_t)nnew + bytes;
        sizes[b - b0] = size;
        if (out) {
            if (TL_UNLIKELY(w + size > cap))
                return tl_span_fail(err, TL_BLOCK_BAD_INPUT, 3, b, w + size, cap);
            uint8_t *p = out + w, *st = p + 4, *rc = p + 4 + 2 * m, *en = p + 4 + 6 * m;
            uint8_t *data = en + 4 * (uint64_t)nnew;
            uint32_t v = (uint32_t)m, count = 0, filled = 0;
            memcpy(p, &v, 4);
            tl_block_seen_reset(t);
            for (uint64_t j = r; j < r1; j++) {
                uint16_t a = (uint16_t)(j == r ? 0 : starts[j] - base);
                memcpy(st + 2 * (j - r), &a, 2);
                memcpy(rc + 4 * (j - r), &records[j], 4);
                if (records[j] == TL_SPAN_NONE) continue;
                tl_block_seen_slot(t, records[j], &count, &fresh);
                if (fresh) {
                    uint64_t len = mdx[records[j] + 1] - mdx[records[j]];
                    if (len) memcpy(data + filled, mdb + mdx[records[j]], len);
                    filled += (uint32_t)len;
                    memcpy(en + 4 * (uint64_t)(count - 1), &filled, 4);
                }
            }
        }
        w += size;
        /* the run holding the next block's first row */
        while (r + 1 < nruns && starts[r + 1] <= top) {
            if (TL_UNLIKELY(starts[r + 1] <= starts[r]))
                return tl_span_fail(err, TL_BLOCK_BAD_INPUT, 0, r + 1, starts[r + 1], starts[r]);
            r++;
        }
        unused = r1;
    }
    if (TL_UNLIKELY(b1 * block >= rows && unused < nruns)) /* a run no block holds */
        return tl_span_fail(err, TL_BLOCK_BAD_INPUT, 0, unused, starts[unused], rows);
    *run = r;
    return 0;
}

#endif /* TOKLOAD_BLOCKS_H */
