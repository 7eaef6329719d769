/*
 * spans.h -- the metadata of token windows from a per-shard span table.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * FORMAT.md, version 2, "metadata_layout": "spans".  Per shard:
 *   .mds  `runs` entries of 12 packed little-endian bytes: the first row of a
 *         run (uint64, local to the shard) and its record (uint32, or
 *         TL_SPAN_NONE).  Starts are strictly increasing, the first is 0, all
 *         are below the shard's rows.
 *   .msx  ceil(rows / block) + 1 uint64: entry b is the run holding row
 *         b * block, the last entry is `runs`.
 *   .mdx/.mdb  the records, as in version 1.
 *
 * A batch of windows is resolved in five steps, the reads in between done by
 * the caller (one batched, coalesced read per step; tokload/_meta.pyx runs
 * all five and the four reads in one call without the GIL):
 *   1. tl_spans_pieces: cut windows at shard ends; one read of the block
 *      index slice per piece.
 *   2. tl_spans_runs: from the block index entries, the slice of the span
 *      table each piece needs; one read each.
 *   3. tl_spans_resolve: check each slice, binary search the piece's first
 *      row, scan the runs: per row the batch-level number of its record (or
 *      -1), records de-duplicated over the batch in order of first appearance.
 *   4. tl_spans_plan_index: the records' index entries, consecutive ids read
 *      together.
 *   5. tl_spans_plan_data: check the entries, the records' offsets in the
 *      batch buffer, their bytes read together where they touch.
 * Nothing here allocates or reads: every buffer comes from the caller.
 */
#ifndef TOKLOAD_SPANS_H
#define TOKLOAD_SPANS_H

#include <string.h>

#include "common.h"
#include "offsets.h"
#include "shards.h"

#define TL_SPAN_NONE 0xFFFFFFFFu
#define TL_SPAN_ENTRY 12

/* Error codes (positive: not an errno). */
#define TL_SPAN_BAD_BLOCK 1   /* a block index entry out of order or range */
#define TL_SPAN_BAD_START 2   /* run starts not increasing, out of range, first not 0 */
#define TL_SPAN_BAD_RECORD 3  /* a record id past the shard's records */
#define TL_SPAN_BAD_OFFSET 4  /* a record index entry out of order or range */
#define TL_SPAN_BAD_COVER 5   /* the slice the block index names misses a row */
#define TL_SPAN_BAD_HOLD 6    /* a block index value names a run before the one holding its row */

typedef struct {
    int code;
    uint32_t shard;
    uint64_t entry; /* the entry of the file at fault (local to the shard) */
    uint64_t value; /* what it holds */
    uint64_t limit; /* the bound it breaks */
} tl_span_error;

/* The shape of the dataset; every array has one value per shard
 * (the *_cum arrays nfiles + 1 cumulative counts of each file's units). */
typedef struct {
    const uint64_t *row_cum;  /* rows */
    const uint64_t *msx_cum;  /* block index entries */
    const uint64_t *mds_cum;  /* runs */
    const uint64_t *mdx_cum;  /* record index entries (records + 1) */
    const uint64_t *mdb_cum;  /* record bytes */
    size_t nfiles;
    uint64_t block;
} tl_span_set;

typedef struct {
    uint32_t shard;
    uint64_t start; /* first row, local to the shard */
    uint64_t len;   /* rows */
    uint64_t dst;   /* its first row's place in positions */
    uint64_t run0;  /* first run read, local to the shard */
    uint64_t nruns; /* runs read */
    uint64_t at;    /* its first run's entry in the runs buffer */
    uint64_t blk;   /* its block index entries' place in the block buffer */
    uint64_t hold;  /* the run (of those read) the block index names for the first row
                     * of the block after the piece; UINT64_MAX: the piece ends the shard */
} tl_span_piece;

/* A batch request: `len` units from global unit `start` to byte `dst`. */
typedef struct {
    uint64_t *start;
    uint64_t *len;
    uint64_t *dst;
} tl_span_reqs;

/* Fill err and return its code (every check of this header fails through it). */
TL_INLINE int tl_span_fail(tl_span_error *err, int code, size_t shard, uint64_t entry,
                           uint64_t value, uint64_t limit)
{
    err->code = code;
    err->shard = (uint32_t)shard;
    err->entry = entry;
    err->value = value;
    err->limit = limit;
    return code;
}

TL_INLINE uint64_t tl_span_load_start(const uint8_t *e)
{
    uint64_t v;
    memcpy(&v, e, 8);
    return v;
}

TL_INLINE uint32_t tl_span_load_record(const uint8_t *e)
{
    uint32_t v;
    memcpy(&v, e + 8, 4);
    return v;
}

/* Step 1: cut the windows at shard ends into pieces, and plan one block index
 * read per piece into a buffer of uint64 (request dst in bytes).  Sets
 * *npieces; returns the number of block entries to read.  With pieces NULL it
 * only counts (q is not touched), so the caller can size its buffers.
 * Windows must lie inside the rows (callers check). */
TL_INLINE uint64_t tl_spans_pieces(const tl_span_set *s, const uint64_t *starts, size_t nwin,
                                   uint64_t window, tl_span_piece *pieces, tl_span_reqs q,
                                   size_t *npieces)
{
    size_t n = 0;
    uint64_t nblk = 0;
    for (size_t w = 0; w < nwin; w++) {
        uint64_t row = starts[w], end = starts[w] + window;
        size_t k = tl_shards_locate(s->row_cum, s->nfiles, row);
        while (row < end) {
            while (s->row_cum[k + 1] <= row) k++;
            uint64_t stop = s->row_cum[k + 1] < end ? s->row_cum[k + 1] : end;
            uint64_t local = row - s->row_cum[k];
            uint64_t b0 = local / s->block, b1 = (local + (stop - row) - 1) / s->block;
            /* entries b0 .. b1 + 1: the last exists (rows < end) */
            if (pieces) {
                tl_span_piece *p = &pieces[n];
                p->shard = (uint32_t)k;
                p->start = local;
                p->len = stop - row;
                p->dst = w * window + (row - starts[w]);
                p->blk = nblk;
                q.start[n] = s->msx_cum[k] + b0;
                q.len[n] = b1 + 2 - b0;
                q.dst[n] = 8 * nblk;
            }
            nblk += b1 + 2 - b0;
            n++;
            row = stop;
        }
    }
    *npieces = n;
    return nblk;
}

/* Step 2: the slice of the span table each piece needs, from its block index
 * entries; one read per piece into a buffer of TL_SPAN_ENTRY-byte entries.
 * Returns 0 and the runs to read in *nruns, or an error code. */
TL_INLINE int tl_spans_runs(const tl_span_set *s, tl_span_piece *pieces, size_t n,
                            const uint64_t *blocks, tl_span_reqs q, uint64_t *nruns,
                            tl_span_error *err)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        tl_span_piece *p = &pieces[i];
        size_t k = p->shard;
        uint64_t runs = s->mds_cum[k + 1] - s->mds_cum[k];
        uint64_t nblocks = s->msx_cum[k + 1] - s->msx_cum[k] - 1;
        uint64_t b0 = p->start / s->block, b1 = (p->start + p->len - 1) / s->block;
        const uint64_t *e = blocks + p->blk;
        for (uint64_t j = 0; j <= b1 + 1 - b0; j++) {
            uint64_t bound = (b0 + j == nblocks) ? runs : (runs ? runs - 1 : 0);
            int bad = e[j] > bound || (j && e[j] < e[j - 1]) ||
                      (b0 + j == nblocks && e[j] != runs) || (b0 + j == 0 && e[j] != 0);
            if (TL_UNLIKELY(bad)) {
                return tl_span_fail(err, TL_SPAN_BAD_BLOCK, k, b0 + j, e[j], runs);
            }
        }
        uint64_t r0 = e[0], last = e[b1 + 1 - b0];
        /* The run holding the first row of the next block may start inside
         * this piece's last block: read it too, and the run after it, which
         * must start past that row (a block index value too small would stretch
         * its run over rows of later ones: tl_spans_resolve checks). */
        uint64_t r1 = runs;
        p->hold = UINT64_MAX;
        if (b1 + 1 < nblocks) {
            r1 = last + 2 < runs ? last + 2 : runs;
            p->hold = last - r0;
        }
        p->run0 = r0;
        p->nruns = r1 - r0;
        p->at = total;
        q.start[i] = s->mds_cum[k] + r0;
        q.len[i] = r1 - r0;
        q.dst[i] = TL_SPAN_ENTRY * total;
        total += r1 - r0;
    }
    *nruns = total;
    return 0;
}

TL_INLINE uint64_t tl_span_hash(uint64_t key)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return key;
}

/* Step 3: positions (int32, -1 for none) of every row of every piece, and the
 * batch's distinct records (shard, id) in order of first appearance.
 * hkeys/hvals: hcap (a power of two, at least twice the runs read) slots.
 * Returns 0 and *nitems, or an error code. */
TL_INLINE int tl_spans_resolve(const tl_span_set *s, const tl_span_piece *pieces, size_t n,
                               const uint8_t *runbuf, int32_t *positions, uint64_t *hkeys,
                               int64_t *hvals, uint64_t hcap, uint32_t *item_shard,
                               uint32_t *item_id, size_t *nitems, tl_span_error *err)
{
    size_t ni = 0;
    for (uint64_t h = 0; h < hcap; h++) hvals[h] = -1;
    for (size_t i = 0; i < n; i++) {
        const tl_span_piece *p = &pieces[i];
        size_t k = p->shard;
        uint64_t rows = s->row_cum[k + 1] - s->row_cum[k];
        uint64_t runs = s->mds_cum[k + 1] - s->mds_cum[k];
        uint64_t nrec = s->mdx_cum[k + 1] - s->mdx_cum[k] - 1;
        const uint8_t *e = runbuf + TL_SPAN_ENTRY * p->at;
        /* The whole slice is checked before the binary search relies on it. */
        uint64_t prev = 0;
        for (uint64_t j = 0; j < p->nruns; j++) {
            uint64_t st = tl_span_load_start(e + TL_SPAN_ENTRY * j);
            uint32_t rec = tl_span_load_record(e + TL_SPAN_ENTRY * j);
            int bad = st >= rows || (j && st <= prev) || (p->run0 + j == 0 && st != 0);
            if (TL_UNLIKELY(bad)) {
                return tl_span_fail(err, TL_SPAN_BAD_START, k, p->run0 + j, st, rows);
            }
            if (TL_UNLIKELY(rec != TL_SPAN_NONE && rec >= nrec)) {
                return tl_span_fail(err, TL_SPAN_BAD_RECORD, k, p->run0 + j, rec, nrec);
            }
            prev = st;
        }
        if (TL_UNLIKELY(p->nruns == 0 || tl_span_load_start(e) > p->start)) {
            return tl_span_fail(err, TL_SPAN_BAD_COVER, k, p->run0,
                                p->nruns ? tl_span_load_start(e) : 0, p->start);
        }
        /* Unless the piece ends the shard, the run the block index names holds
         * the first row of the block after the piece (so it covers the piece's
         * end): it starts at or before that row, and the run after it past it. */
        if (p->hold != UINT64_MAX) {
            uint64_t after = ((p->start + p->len - 1) / s->block + 1) * s->block;
            uint64_t held = tl_span_load_start(e + TL_SPAN_ENTRY * p->hold);
            if (TL_UNLIKELY(held > after)) {
                return tl_span_fail(err, TL_SPAN_BAD_COVER, k, p->run0 + p->hold, held, after);
            }
            if (TL_UNLIKELY(p->hold + 1 < p->nruns &&
                            tl_span_load_start(e + TL_SPAN_ENTRY * (p->hold + 1)) <= after)) {
                return tl_span_fail(err, TL_SPAN_BAD_HOLD, k, p->run0 + p->hold + 1,
                                    tl_span_load_start(e + TL_SPAN_ENTRY * (p->hold + 1)),
                                    after);
            }
        }
        /* last run with start <= p->start */
        uint64_t lo = 0, hi = p->nruns;
        while (hi - lo > 1) {
            uint64_t mid = lo + (hi - lo) / 2;
            if (tl_span_load_start(e + TL_SPAN_ENTRY * mid) <= p->start)
                lo = mid;
            else
                hi = mid;
        }
        uint64_t row = p->start, end = p->start + p->len;
        int32_t *pos = positions + p->dst - p->start;
        for (uint64_t j = lo; row < end; j++) {
            uint64_t next;
            if (j + 1 < p->nruns)
                next = tl_span_load_start(e + TL_SPAN_ENTRY * (j + 1));
            else if (p->run0 + j + 1 == runs)
                next = rows;
            else
                next = end; /* the run holding the next block's first row (checked above) */
            uint64_t stop = next < end ? next : end;
            uint32_t rec = tl_span_load_record(e + TL_SPAN_ENTRY * j);
            int32_t v = -1;
            if (rec != TL_SPAN_NONE) {
                uint64_t key = ((uint64_t)k << 32) | rec;
                uint64_t h = tl_span_hash(key) & (hcap - 1);
                while (hvals[h] >= 0 && hkeys[h] != key) h = (h + 1) & (hcap - 1);
                if (hvals[h] < 0) {
                    hkeys[h] = key;
                    hvals[h] = (int64_t)ni;
                    item_shard[ni] = (uint32_t)k;
                    item_id[ni] = rec;
                    ni++;
                }
                v = (int32_t)hvals[h];
            }
            for (uint64_t r = row; r < stop; r++) pos[r] = v;
            row = stop;
        }
    }
    *nitems = ni;
    return 0;
}

/* Step 4: the index entries of the records (two uint64 each, consecutive ids
 * of one shard read together); item_ent[i] is record i's first entry in the
 * entries buffer.  Returns the number of requests. */
TL_INLINE size_t tl_spans_plan_index(const tl_span_set *s, const uint32_t *item_shard,
                                     const uint32_t *item_id, size_t nitems, uint64_t *item_ent,
                                     tl_span_reqs q)
{
    size_t nq = 0;
    uint64_t nent = 0;
    for (size_t i = 0; i < nitems; i++) {
        if (i && item_shard[i] == item_shard[i - 1] && item_id[i] == (uint64_t)item_id[i - 1] + 1) {
            item_ent[i] = item_ent[i - 1] + 1;
            q.len[nq - 1]++;
            nent++;
            continue;
        }
        item_ent[i] = nent;
        q.start[nq] = s->mdx_cum[item_shard[i]] + item_id[i];
        q.len[nq] = 2;
        q.dst[nq] = 8 * nent;
        nent += 2;
        nq++;
    }
    return nq;
}

/* Step 5: check the entries; offsets[i] (nitems + 1, int64) of record i in the
 * batch buffer; the reads of its bytes (one per run of records that touch in
 * one shard).  Returns 0 and *nreq, or an error code. */
TL_INLINE int tl_spans_plan_data(const tl_span_set *s, const uint32_t *item_shard,
                                 const uint32_t *item_id, size_t nitems, const uint64_t *item_ent,
                                 const uint64_t *entries, int64_t *offsets, tl_span_reqs q,
                                 size_t *nreq, tl_span_error *err)
{
    size_t nq = 0;
    uint64_t at = 0;
    offsets[0] = 0;
    for (size_t i = 0; i < nitems; i++) {
        size_t k = item_shard[i];
        uint64_t bytes = s->mdb_cum[k + 1] - s->mdb_cum[k];
        const uint64_t *e = &entries[item_ent[i]], a = e[0], b = e[1];
        const uint64_t nrec = s->mdx_cum[k + 1] - s->mdx_cum[k] - 1;
        const size_t bad =
            tl_offsets_bad(e, 2, bytes, item_id[i] == 0, (uint64_t)item_id[i] + 1 == nrec);
        if (TL_UNLIKELY(bad < 2))
            return tl_span_fail(err, TL_SPAN_BAD_OFFSET, k, (uint64_t)item_id[i] + bad, e[bad],
                                bytes);
        offsets[i + 1] = (int64_t)(at + (b - a));
        if (b > a) {
            /* Bytes that follow the previous read's in the file and in the
             * buffer extend it. */
            if (nq && q.start[nq - 1] + q.len[nq - 1] == s->mdb_cum[k] + a &&
                q.dst[nq - 1] + q.len[nq - 1] == at) {
                q.len[nq - 1] += b - a;
            } else {
                q.start[nq] = s->mdb_cum[k] + a;
                q.len[nq] = b - a;
                q.dst[nq] = at;
                nq++;
            }
        }
        at += b - a;
    }
    *nreq = nq;
    return 0;
}

#endif /* TOKLOAD_SPANS_H */
