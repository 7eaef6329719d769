/*
 * plan.h -- read planning and batch reads for the dataset views.
 *
 * Cython mirror: tokload/_lib.pxd (must match).
 *
 * Data model: a *rowset* is a sequence of fixed-size rows stored in several
 * files (shards), each holding its rows from byte `base` on.  Observation reads
 * become *requests* (file, byte offset, length, destination offset): a window
 * of rows spanning k shards is exactly k requests.  Everything here runs
 * without the GIL over arrays the caller allocated and validated; nothing
 * reads outside [base, base + rows * row_bytes) of a file, and a file that
 * shrank since it was opened is reported (TL_IO_EOF), never read past.
 * Planned requests run on the I/O engine (engine.h): all the reads of a
 * batch are known before the first is issued, so they go in flight together.
 *
 * Index files hold little-endian integers, as FORMAT.md specifies; this
 * header assumes a little-endian host (checked at compile time).
 */
#ifndef TOKLOAD_PLAN_H
#define TOKLOAD_PLAN_H

#include "common.h"
#include "engine.h"
#include "io.h"
#include "offsets.h"
#include "shards.h"

#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tokload's on-disk integers are little-endian; big-endian hosts are not supported"
#endif

/* A document or metadata index disagrees with its data (distinct from errno):
 * err->offset is the byte offset of the bad entry, err->done its value. */
#define TL_ERR_CORRUPT (-100001)
/* A row's metadata id is past its shard's metadata index: err->offset is the
 * row (local to the shard), err->length the shard's records, err->done the id. */
#define TL_ERR_BAD_ID (-100002)

typedef struct tl_rowset {
    tl_fent *files;       /* nfiles entries (fdcache.h: opened on demand) */
    const uint64_t *cum;  /* nfiles + 1 cumulative row counts */
    size_t nfiles;
    uint64_t row_bytes;
} tl_rowset;

typedef struct tl_read_req {
    int32_t file;
    uint64_t offset; /* byte offset in the file */
    uint64_t length; /* bytes */
    uint64_t dst;    /* byte offset in the destination */
} tl_read_req;

/*
 * Plan the read of rows [start, start + count) of the rowset into a buffer at
 * byte `dst`: one request per shard the range touches.  Requires
 * start + count <= cum[nfiles].  Returns the number of requests written, or
 * (size_t)-1 if more than max_reqs would be needed.
 */
TL_INLINE size_t tl_plan_rows(const tl_rowset *rs, uint64_t start, uint64_t count, uint64_t dst,
                              tl_read_req *reqs, size_t max_reqs)
{
    size_t n = 0;
    if (count == 0) return 0;
    size_t k = tl_shards_locate(rs->cum, rs->nfiles, start);
    while (count > 0) {
        while (rs->cum[k + 1] <= start) k++; /* skip empty shards */
        uint64_t local = start - rs->cum[k];
        uint64_t avail = rs->cum[k + 1] - start;
        uint64_t take = count < avail ? count : avail;
        if (n == max_reqs) return (size_t)-1;
        reqs[n].file = (int32_t)k;
        reqs[n].offset = rs->files[k].base + local * rs->row_bytes;
        reqs[n].length = take * rs->row_bytes;
        reqs[n].dst = dst;
        n++;
        dst += take * rs->row_bytes;
        start += take;
        count -= take;
    }
    return n;
}

/*
 * Requests needed to read `count` row ranges (range i: rows [starts[i],
 * starts[i] + len), len = lengths[i], or `len1` for all if lengths is NULL):
 * one per shard a range touches, empty shards included (an upper bound).
 * Every range must lie within the rowset.
 */
TL_INLINE size_t tl_rows_count_reqs(const tl_rowset *rs, const uint64_t *starts,
                                    const uint64_t *lengths, uint64_t len1, size_t count)
{
    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        uint64_t len = lengths ? lengths[i] : len1;
        if (len == 0) continue;
        size_t a = tl_shards_locate(rs->cum, rs->nfiles, starts[i]);
        size_t b = tl_shards_locate(rs->cum, rs->nfiles, starts[i] + len - 1);
        total += b - a + 1;
    }
    return total;
}

/*
 * Plan those ranges as engine requests: range i lands at dst + dst_offsets[i]
 * (or dst + i * len1 * row_bytes if dst_offsets is NULL); each request's item
 * is its range.  With dst NULL the requests have no destination (for
 * tl_ioreq_hint).  reqs needs tl_rows_count_reqs entries.  Returns the number
 * of requests written.
 */
TL_INLINE size_t tl_rows_plan_many(const tl_rowset *rs, const uint64_t *starts,
                                   const uint64_t *lengths, uint64_t len1,
                                   const uint64_t *dst_offsets, size_t count, uint8_t *dst,
                                   tl_ioreq *reqs)
{
    size_t n = 0;
    for (size_t i = 0; i < count; i++) {
        uint64_t start = starts[i], left = lengths ? lengths[i] : len1;
        if (left == 0) continue;
        uint8_t *at = NULL;
        if (dst) at = dst + (dst_offsets ? dst_offsets[i] : (uint64_t)i * len1 * rs->row_bytes);
        size_t k = tl_shards_locate(rs->cum, rs->nfiles, start);
        while (left > 0) {
            while (rs->cum[k + 1] <= start) k++; /* skip empty shards */
            uint64_t avail = rs->cum[k + 1] - start;
            uint64_t take = left < avail ? left : avail;
            reqs[n].file = &rs->files[k];
            reqs[n].offset = rs->files[k].base + (start - rs->cum[k]) * rs->row_bytes;
            reqs[n].length = take * rs->row_bytes;
            reqs[n].dst = at;
            reqs[n].item = i;
            n++;
            if (at) at += take * rs->row_bytes;
            start += take;
            left -= take;
        }
    }
    return n;
}

/*
 * Ranges of several row sets (of one row size) as one list: range i is rows
 * [starts[i], starts[i] + lengths[i]) of sets[which[i]], landing at dst +
 * dst_offsets[i].  Only the ranges whose set has use[which[i]] set are planned
 * (the sets of one I/O backend), or all where use is NULL.  The count is what
 * tl_rows_count_reqs gives for each range (an upper bound); the plan writes
 * the requests, each with its range as its item, and returns how many.  Every
 * range must lie within its set and every which[i] must name one.
 */
TL_INLINE size_t tl_rows_count_gather(const tl_rowset *const *sets, const int64_t *which,
                                      const uint8_t *use, const uint64_t *starts,
                                      const uint64_t *lengths, size_t count)
{
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        if (!use || use[which[i]])
            total += tl_rows_count_reqs(sets[which[i]], starts + i, lengths + i, 0, 1);
    return total;
}

TL_INLINE size_t tl_rows_plan_gather(const tl_rowset *const *sets, const int64_t *which,
                                     const uint8_t *use, const uint64_t *starts,
                                     const uint64_t *lengths, const uint64_t *dst_offsets,
                                     size_t count, uint8_t *dst, tl_ioreq *reqs)
{
    size_t n = 0;
    for (size_t i = 0; i < count; i++) {
        if (use && !use[which[i]]) continue;
        size_t m = tl_rows_plan_many(sets[which[i]], starts + i, lengths + i, 0,
                                     dst_offsets + i, 1, dst, reqs + n);
        for (size_t k = n; k < n + m; k++) reqs[k].item = i;
        n += m;
    }
    return n;
}

/*
 * De-interleave rows of a structured dtype: field f (offset off[f], size
 * size[f] bytes in each row) of row r goes to dst[f] + r * size[f].
 */
TL_INLINE void tl_split_fields(const uint8_t *rows, uint64_t nrows, uint64_t row_bytes,
                               size_t nfields, const uint64_t *off, const uint64_t *size,
                               uint8_t *const *dst)
{
    for (size_t f = 0; f < nfields; f++) {
        const uint8_t *src = rows + off[f];
        uint8_t *d = dst[f];
        const uint64_t sz = size[f];
        /* Fixed-size copies compile to single moves. */
        if (sz == 4) {
            for (uint64_t r = 0; r < nrows; r++) memcpy(d + 4 * r, src + r * row_bytes, 4);
        } else if (sz == 2) {
            for (uint64_t r = 0; r < nrows; r++) memcpy(d + 2 * r, src + r * row_bytes, 2);
        } else if (sz == 8) {
            for (uint64_t r = 0; r < nrows; r++) memcpy(d + 8 * r, src + r * row_bytes, 8);
        } else if (sz == 1) {
            for (uint64_t r = 0; r < nrows; r++) d[r] = src[r * row_bytes];
        } else {
            for (uint64_t r = 0; r < nrows; r++) memcpy(d + sz * r, src + r * row_bytes, sz);
        }
    }
}

/*
 * Fill nrows rows of row_bytes bytes at dst with the row `pattern` (padding);
 * an all-zero pattern is one memset.
 */
TL_INLINE void tl_fill_rows(uint8_t *dst, uint64_t nrows, const uint8_t *pattern,
                            uint64_t row_bytes)
{
    int zero = 1;
    for (uint64_t j = 0; j < row_bytes; j++) zero &= pattern[j] == 0;
    if (zero) {
        memset(dst, 0, nrows * row_bytes);
        return;
    }
    for (uint64_t r = 0; r < nrows; r++) memcpy(dst + r * row_bytes, pattern, row_bytes);
}

/* ---- documents ------------------------------------------------------------ */

/*
 * Extents of documents stored as per-shard offset indexes: shard k's index
 * file holds docs_k + 1 little-endian uint64 row offsets (local to the shard,
 * starting at 0, non-decreasing, the last equal to the shard's rows).
 * doc_cum has nfiles + 1 cumulative document counts, row_cum the cumulative
 * row counts.  Ids must be < doc_cum[nfiles] (callers check).
 *
 * tl_docs_plan writes one 16-byte request per id (its two index entries, into
 * entries[2i], entries[2i + 1]); after they ran, tl_docs_finish gives each
 * document's first global row (out_start) and rows (out_len).  Offsets that
 * decrease or pass the shard's end, a shard's first that is not 0 and its last
 * that is not its rows give TL_ERR_CORRUPT, with err->offset the byte offset of
 * the bad entry, err->done its value and *failed_item the id's position.
 */
TL_INLINE void tl_docs_plan(tl_fent *idx_files, const uint64_t *doc_cum, size_t nfiles,
                            const uint64_t *ids, size_t count, uint64_t *entries,
                            tl_ioreq *reqs)
{
    for (size_t i = 0; i < count; i++) {
        size_t k = tl_shards_locate(doc_cum, nfiles, ids[i]);
        reqs[i].file = &idx_files[k];
        reqs[i].offset = idx_files[k].base + 8 * (ids[i] - doc_cum[k]);
        reqs[i].length = 16;
        reqs[i].dst = (uint8_t *)&entries[2 * i];
        reqs[i].item = i;
    }
}

/*
 * With the shards' document indexes in memory (tables[k]: the shard's
 * documents + 1 offsets), the two entries of each id are copied instead of
 * read; tl_docs_shards lists each id's shard, for loading the tables first.
 */
TL_INLINE void tl_docs_shards(const uint64_t *doc_cum, size_t nfiles, const uint64_t *ids,
                              size_t count, uint32_t *shards)
{
    for (size_t i = 0; i < count; i++) shards[i] = (uint32_t)tl_shards_locate(doc_cum, nfiles, ids[i]);
}

TL_INLINE void tl_docs_copy(const uint64_t *doc_cum, const uint32_t *shards,
                            const uint64_t *const *tables, const uint64_t *ids, size_t count,
                            uint64_t *entries)
{
    for (size_t i = 0; i < count; i++) {
        const uint64_t *t = tables[shards[i]] + (ids[i] - doc_cum[shards[i]]);
        entries[2 * i] = t[0];
        entries[2 * i + 1] = t[1];
    }
}

TL_INLINE int tl_docs_finish(const tl_fent *idx_files, const uint64_t *doc_cum,
                             const uint64_t *row_cum, size_t nfiles, const uint64_t *ids,
                             size_t count, const uint64_t *entries, uint64_t *out_start,
                             uint64_t *out_len, tl_io_error *err, size_t *failed_item)
{
    for (size_t i = 0; i < count; i++) {
        size_t k = tl_shards_locate(doc_cum, nfiles, ids[i]);
        const uint64_t *e = &entries[2 * i];
        const uint64_t rows = row_cum[k + 1] - row_cum[k], local = ids[i] - doc_cum[k];
        const size_t bad = tl_offsets_bad(e, 2, rows, local == 0,
                                          local + 1 == doc_cum[k + 1] - doc_cum[k]);
        if (TL_UNLIKELY(bad < 2)) {
            err->code = TL_ERR_CORRUPT;
            err->file = (int32_t)k;
            err->offset = idx_files[k].base + 8 * (local + bad);
            err->length = 8;
            err->done = e[bad];
            *failed_item = i;
            return TL_ERR_CORRUPT;
        }
        out_start[i] = row_cum[k] + e[0];
        out_len[i] = e[1] - e[0];
    }
    return 0;
}

/*
 * Extents of sequences in a Megatron .idx: int32 lengths at byte len_off,
 * int64 byte pointers into the .bin at byte ptr_off, nseq of each.
 * tl_megatron_plan writes two requests per id (request 2i: its length into
 * lens[i]; 2i + 1: its pointer into ptrs[i]); tl_megatron_finish checks that
 * a pointer is a multiple of itemsize within the .bin (a bad one: err->length
 * 8, the pointer's offset and value) and that the sequence's length is
 * non-negative and ends within bin_rows (a bad one: err->length 4, the
 * length's offset and its value, sign-extended).
 */
TL_INLINE void tl_megatron_plan(tl_fent *idx, uint64_t len_off, uint64_t ptr_off,
                                const uint64_t *ids, size_t count, int32_t *lens,
                                int64_t *ptrs, tl_ioreq *reqs)
{
    for (size_t i = 0; i < count; i++) {
        reqs[2 * i].file = idx;
        reqs[2 * i].offset = len_off + 4 * ids[i];
        reqs[2 * i].length = 4;
        reqs[2 * i].dst = (uint8_t *)&lens[i];
        reqs[2 * i].item = i;
        reqs[2 * i + 1].file = idx;
        reqs[2 * i + 1].offset = ptr_off + 8 * ids[i];
        reqs[2 * i + 1].length = 8;
        reqs[2 * i + 1].dst = (uint8_t *)&ptrs[i];
        reqs[2 * i + 1].item = i;
    }
}

TL_INLINE int tl_megatron_finish(uint64_t len_off, uint64_t ptr_off, uint64_t itemsize,
                                 uint64_t bin_rows, const uint64_t *ids, size_t count,
                                 const int32_t *lens, const int64_t *ptrs, uint64_t *out_start,
                                 uint64_t *out_len, tl_io_error *err, size_t *failed_item)
{
    for (size_t i = 0; i < count; i++) {
        int32_t len = lens[i];
        int64_t ptr = ptrs[i];
        int bad_ptr = ptr < 0 || (uint64_t)ptr % itemsize || (uint64_t)ptr / itemsize > bin_rows;
        if (TL_UNLIKELY(bad_ptr || len < 0 ||
                        (uint64_t)len > bin_rows - (uint64_t)ptr / itemsize)) {
            err->code = TL_ERR_CORRUPT;
            err->file = 0;
            err->offset = bad_ptr ? ptr_off + 8 * ids[i] : len_off + 4 * ids[i];
            err->length = bad_ptr ? 8 : 4;
            err->done = bad_ptr ? (uint64_t)ptr : (uint64_t)(int64_t)len;
            *failed_item = i;
            return TL_ERR_CORRUPT;
        }
        out_start[i] = (uint64_t)ptr / itemsize;
        out_len[i] = (uint64_t)len;
    }
    return 0;
}

/* ---- metadata -------------------------------------------------------------- */

#define TL_META_NONE UINT32_C(0xFFFFFFFF) /* a row with no metadata */

/* Per-shard metadata: an index of nrec + 1 uint64 byte offsets and a data file. */
typedef struct tl_meta_shard {
    tl_fent *index;
    tl_fent *data;
    uint64_t nrec;       /* records in the shard */
    uint64_t data_bytes; /* size of the data file's record area */
} tl_meta_shard;

/* One metadata record of a batch: shard, id and where its bytes are. */
typedef struct tl_meta_item {
    uint32_t shard;
    uint32_t id;
    uint64_t offset; /* byte offset in the shard's data area */
    uint64_t length; /* bytes */
    uint64_t blob;   /* byte offset in the batch blob (after tl_meta_read) */
} tl_meta_item;

/* A coalesced data read: bytes [offset, offset + length) of a shard's data. */
typedef struct tl_meta_span {
    uint32_t shard;
    uint64_t offset;
    uint64_t length;
    uint64_t blob; /* where it lands in the batch blob */
} tl_meta_span;

TL_INLINE uint64_t tl_meta_hash(uint64_t key)
{
    key ^= key >> 33;
    key *= UINT64_C(0xff51afd7ed558ccd);
    key ^= key >> 33;
    return key;
}

/*
 * Runs of equal ids (TL_META_NONE excluded, breaking at each window's start)
 * of `nwin` windows of `window` ids: with the number of window segments, an
 * upper bound on the distinct records of the batch, so that tl_meta_plan's
 * scratch is sized by the records rather than by the rows.
 */
TL_INLINE size_t tl_meta_count_runs(const uint32_t *ids, size_t nwin, uint64_t window)
{
    size_t n = 0;
    for (size_t w = 0; w < nwin; w++) {
        const uint32_t *p = ids + w * window;
        uint32_t prev = TL_META_NONE;
        for (uint64_t r = 0; r < window; r++) {
            n += p[r] != TL_META_NONE && p[r] != prev;
            prev = p[r];
        }
    }
    return n;
}

/* A window's rows inside one shard, and the index read of its new records. */
typedef struct tl_meta_seg {
    uint32_t shard;
    uint32_t dense;    /* 1: one read of entries lo .. hi + 1; 0: two per record */
    uint64_t lo, hi;   /* the range of the ids first seen in this segment */
    size_t first_item; /* its new records: items [first_item, end_item) */
    size_t end_item;
    uint64_t ent;      /* its first entry in the entries buffer */
    uint64_t window;   /* for errors */
} tl_meta_seg;

/*
 * Gather the metadata of `nwin` windows of `window` rows each, step 1 of 2.
 * ids holds the metadata_id field of the windows' rows ([nwin, window],
 * row-major), starts their first global rows, row_cum the cumulative rows of
 * the shards.
 *
 * Records are de-duplicated across the batch by (shard, id), numbered in
 * order of first appearance: positions[r] is the number of row r's record, or
 * -1 for TL_META_NONE.  For each window segment inside one shard, the index
 * entries of the records first seen there are planned as one read of entries
 * [lo, hi + 1] when that is at most 2 * (new records) + 64 entries, else as
 * two entries per record; every index read of the batch then runs in one
 * engine call (the caller's), and tl_meta_finish turns the entries into
 * coalesced data spans.
 *
 * Scratch (callers size it), with S the segments (one per shard a window
 * touches: tl_rows_count_reqs of the windows) and R = tl_meta_count_runs + S,
 * a bound on the distinct records: hkeys/hvals, a hash table of hcap entries
 * (a power of two >= 2 * R); items, R entries; segs, S; entries, 2 * R + 64 * S
 * uint64; reqs, S + R.
 *
 * Returns 0 and sets *nitems, *nsegs, *nreqs, or TL_ERR_BAD_ID (err->file the
 * shard, err->offset the row local to it, err->length its records, err->done
 * the id; *failed_item the window).
 */
TL_INLINE int tl_meta_plan(const tl_meta_shard *shards, const uint64_t *row_cum, size_t nfiles,
                           const uint64_t *starts, size_t nwin, uint64_t window,
                           const uint32_t *ids, int32_t *positions, uint64_t *hkeys,
                           int64_t *hvals, uint64_t hcap, tl_meta_item *items, size_t *nitems,
                           tl_meta_seg *segs, size_t *nsegs, uint64_t *entries, tl_ioreq *reqs,
                           size_t *nreqs, tl_io_error *err, size_t *failed_item)
{
    size_t ni = 0, nseg = 0, nq = 0;
    uint64_t nent = 0;
    for (uint64_t h = 0; h < hcap; h++) hvals[h] = -1;
    for (size_t w = 0; w < nwin; w++) {
        uint64_t row = starts[w], done = 0;
        size_t k = tl_shards_locate(row_cum, nfiles, row);
        while (done < window) {
            while (row_cum[k + 1] <= row) k++;
            uint64_t seg = row_cum[k + 1] - row;
            if (seg > window - done) seg = window - done;
            const uint32_t *sid = ids + w * window + done;
            int32_t *spos = positions + w * window + done;
            const tl_meta_shard *ms = &shards[k];
            /* distinct ids of the segment, and their range */
            uint64_t lo = UINT64_MAX, hi = 0;
            size_t first_item = ni;
            uint32_t prev = TL_META_NONE; /* a run of one id costs one lookup */
            int32_t prev_pos = -1;
            for (uint64_t r = 0; r < seg; r++) {
                uint32_t id = sid[r];
                if (id == prev) {
                    spos[r] = prev_pos;
                    continue;
                }
                if (id == TL_META_NONE) {
                    spos[r] = -1;
                    prev = id;
                    prev_pos = -1;
                    continue;
                }
                if (TL_UNLIKELY(id >= ms->nrec)) {
                    err->code = TL_ERR_BAD_ID;
                    err->file = (int32_t)k;
                    err->offset = row - row_cum[k] + r; /* the row, local to the shard */
                    err->length = ms->nrec;
                    err->done = id;
                    *failed_item = w;
                    return TL_ERR_BAD_ID;
                }
                uint64_t key = ((uint64_t)k << 32) | id;
                uint64_t hslot = tl_meta_hash(key) & (hcap - 1);
                while (hvals[hslot] >= 0 && hkeys[hslot] != key) hslot = (hslot + 1) & (hcap - 1);
                if (hvals[hslot] < 0) {
                    hkeys[hslot] = key;
                    hvals[hslot] = (int64_t)ni;
                    items[ni].shard = (uint32_t)k;
                    items[ni].id = id;
                    ni++;
                    if (id < lo) lo = id;
                    if (id > hi) hi = id;
                }
                spos[r] = (int32_t)hvals[hslot];
                prev = id;
                prev_pos = spos[r];
            }
            if (first_item < ni) {
                tl_meta_seg *sg = &segs[nseg++];
                size_t fresh = ni - first_item;
                sg->shard = (uint32_t)k;
                sg->lo = lo;
                sg->hi = hi;
                sg->first_item = first_item;
                sg->end_item = ni;
                sg->ent = nent;
                sg->window = w;
                sg->dense = hi - lo + 2 <= 2 * (uint64_t)fresh + 64;
                if (sg->dense) {
                    tl_ioreq q = {ms->index, ms->index->base + 8 * lo, 8 * (hi - lo + 2),
                                  (uint8_t *)(entries + nent), w};
                    reqs[nq++] = q;
                    nent += hi - lo + 2;
                } else {
                    for (size_t it = first_item; it < ni; it++) {
                        tl_ioreq q = {ms->index, ms->index->base + 8 * (uint64_t)items[it].id, 16,
                                      (uint8_t *)(entries + nent), w};
                        reqs[nq++] = q;
                        nent += 2;
                    }
                }
            }
            row += seg;
            done += seg;
        }
    }
    *nitems = ni;
    *nsegs = nseg;
    *nreqs = nq;
    return 0;
}

/*
 * Step 2: check the index entries read for tl_meta_plan's segments, give
 * every record its extent and place in the batch blob, and plan the data
 * reads: one span per dense segment (the bytes of records lo .. hi), one per
 * record otherwise.  spans needs as many entries as items.  Returns 0 and
 * sets *nspans and *blob_bytes, or TL_ERR_CORRUPT for entries that decrease or
 * pass the data, a shard's first that is not 0 or its last that is not the
 * data's size (err->offset the entry's byte offset in the index file,
 * err->done its value; *failed_item the window).
 */
TL_INLINE int tl_meta_finish(const tl_meta_shard *shards, const tl_meta_seg *segs, size_t nsegs,
                             const uint64_t *entries, tl_meta_item *items, tl_meta_span *spans,
                             size_t *nspans, uint64_t *blob_bytes, tl_io_error *err,
                             size_t *failed_item)
{
    size_t ns = 0;
    uint64_t blob = 0;
    for (size_t g = 0; g < nsegs; g++) {
        const tl_meta_seg *sg = &segs[g];
        const tl_meta_shard *ms = &shards[sg->shard];
        const uint64_t *e = entries + sg->ent;
        if (sg->dense) {
            uint64_t n = sg->hi - sg->lo + 2;
            const size_t bad = tl_offsets_bad(e, (size_t)n, ms->data_bytes, sg->lo == 0,
                                              sg->hi + 1 == ms->nrec);
            if (TL_UNLIKELY(bad < n)) {
                err->code = TL_ERR_CORRUPT;
                err->file = (int32_t)sg->shard;
                err->offset = ms->index->base + 8 * (sg->lo + bad);
                err->length = ms->data_bytes;
                err->done = e[bad];
                *failed_item = sg->window;
                return TL_ERR_CORRUPT;
            }
            /* one coalesced span: bytes of records lo..hi */
            spans[ns].shard = sg->shard;
            spans[ns].offset = e[0];
            spans[ns].length = e[n - 1] - e[0];
            spans[ns].blob = blob;
            for (size_t it = sg->first_item; it < sg->end_item; it++) {
                items[it].offset = e[items[it].id - sg->lo];
                items[it].length = e[items[it].id - sg->lo + 1] - items[it].offset;
                items[it].blob = blob + (items[it].offset - e[0]);
            }
            blob += spans[ns].length;
            ns++;
            continue;
        }
        for (size_t it = sg->first_item; it < sg->end_item; it++, e += 2) {
            const uint64_t id = items[it].id;
            const size_t bad = tl_offsets_bad(e, 2, ms->data_bytes, id == 0, id + 1 == ms->nrec);
            if (TL_UNLIKELY(bad < 2)) {
                err->code = TL_ERR_CORRUPT;
                err->file = (int32_t)sg->shard;
                err->offset = ms->index->base + 8 * (id + bad);
                err->length = ms->data_bytes;
                err->done = e[bad];
                *failed_item = sg->window;
                return TL_ERR_CORRUPT;
            }
            items[it].offset = e[0];
            items[it].length = e[1] - e[0];
            items[it].blob = blob;
            spans[ns].shard = sg->shard;
            spans[ns].offset = e[0];
            spans[ns].length = e[1] - e[0];
            spans[ns].blob = blob;
            blob += e[1] - e[0];
            ns++;
        }
    }
    *nspans = ns;
    *blob_bytes = blob;
    return 0;
}

/* The reads of the spans planned by tl_meta_finish into blob: one request
 * per span (item = the span). */
TL_INLINE void tl_meta_plan_read(const tl_meta_shard *shards, const tl_meta_span *spans,
                                 size_t nspans, uint8_t *blob, tl_ioreq *reqs)
{
    for (size_t s = 0; s < nspans; s++) {
        tl_fent *data = shards[spans[s].shard].data;
        reqs[s].file = data;
        reqs[s].offset = data->base + spans[s].offset;
        reqs[s].length = spans[s].length;
        reqs[s].dst = blob + spans[s].blob;
        reqs[s].item = s;
    }
}

#endif /* TOKLOAD_PLAN_H */
