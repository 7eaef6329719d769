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
 *
 * Index files hold little-endian integers, as FORMAT.md specifies; this
 * header assumes a little-endian host (checked at compile time).
 */
#ifndef TOKLOAD_PLAN_H
#define TOKLOAD_PLAN_H

#include "common.h"
#include "io.h"
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

typedef struct tl_file {
    int fd;
    uint64_t base; /* byte offset of the first row (a header before it) */
} tl_file;

typedef struct tl_rowset {
    const tl_file *files; /* nfiles entries */
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

/* Execute requests into dst.  Returns 0 or an error code (err filled). */
TL_INLINE int tl_plan_execute(const tl_file *files, const tl_read_req *reqs, size_t n,
                              uint8_t *dst, tl_io_error *err)
{
    for (size_t i = 0; i < n; i++) {
        int rc = tl_io_read(files[reqs[i].file].fd, reqs[i].file, dst + reqs[i].dst,
                            reqs[i].length, reqs[i].offset, err);
        if (rc) return rc;
    }
    return 0;
}

/*
 * Read `count` row ranges: range i is rows [starts[i], starts[i] + lengths[i])
 * into dst + dst_offsets[i] (bytes).  Every range must lie within the rowset.
 * On failure *failed_item is the range that failed.
 */
TL_INLINE int tl_rows_read_many(const tl_rowset *rs, const uint64_t *starts, const uint64_t *lengths,
                                const uint64_t *dst_offsets, size_t count, uint8_t *dst,
                                tl_io_error *err, size_t *failed_item)
{
    tl_read_req reqs[64];
    for (size_t i = 0; i < count; i++) {
        uint64_t start = starts[i], left = lengths[i], at = dst_offsets[i];
        while (left > 0) {
            /* Plan in slices of at most 64 shards so the plan lives on the stack. */
            size_t k = tl_shards_locate(rs->cum, rs->nfiles, start);
            uint64_t span = 0, s = start;
            size_t shards = 0;
            while (shards < 64 && span < left) {
                while (rs->cum[k + 1] <= s) k++;
                uint64_t avail = rs->cum[k + 1] - s;
                uint64_t take = left - span < avail ? left - span : avail;
                span += take;
                s += take;
                shards++;
            }
            size_t n = tl_plan_rows(rs, start, span, at, reqs, 64);
            TL_ASSERT(n != (size_t)-1);
            int rc = tl_plan_execute(rs->files, reqs, n, dst, err);
            if (rc) {
                *failed_item = i;
                return rc;
            }
            start += span;
            at += span * rs->row_bytes;
            left -= span;
        }
    }
    return 0;
}

/*
 * Read `count` windows of `window` rows: window i is rows [starts[i], starts[i]
 * + window), written back to back from dst.  Same contract as
 * tl_rows_read_many.
 */
TL_INLINE int tl_rows_read_windows(const tl_rowset *rs, const uint64_t *starts, size_t count,
                                   uint64_t window, uint8_t *dst, tl_io_error *err,
                                   size_t *failed_item)
{
    const uint64_t bytes = window * rs->row_bytes;
    for (size_t i = 0; i < count; i++) {
        uint64_t at = (uint64_t)i * bytes;
        int rc = tl_rows_read_many(rs, &starts[i], &window, &at, 1, dst, err, failed_item);
        if (rc) {
            *failed_item = i;
            return rc;
        }
    }
    return 0;
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

/* ---- documents ------------------------------------------------------------ */

/*
 * Extents of documents stored as per-shard offset indexes: shard k's index
 * file holds docs_k + 1 little-endian uint64 row offsets (local to the shard,
 * starting at 0, non-decreasing, the last equal to the shard's rows).
 * doc_cum has nfiles + 1 cumulative document counts, row_cum the cumulative
 * row counts.  For each global document id: out_start = its first global row,
 * out_len = its rows.  Ids must be < doc_cum[nfiles] (callers check).
 * Offsets that decrease or pass the shard's end give TL_ERR_CORRUPT, with
 * err->offset the byte offset of the bad entry and *failed_item the id.
 */
TL_INLINE int tl_docs_extents(const tl_file *idx_files, const uint64_t *doc_cum,
                              const uint64_t *row_cum, size_t nfiles, const uint64_t *ids,
                              size_t count, uint64_t *out_start, uint64_t *out_len,
                              tl_io_error *err, size_t *failed_item)
{
    for (size_t i = 0; i < count; i++) {
        size_t k = tl_shards_locate(doc_cum, nfiles, ids[i]);
        uint64_t j = ids[i] - doc_cum[k], e[2];
        uint64_t at = idx_files[k].base + 8 * j;
        int rc = tl_io_read(idx_files[k].fd, (int32_t)k, e, 16, at, err);
        if (rc) {
            *failed_item = i;
            return rc;
        }
        uint64_t rows = row_cum[k + 1] - row_cum[k];
        if (TL_UNLIKELY(e[0] > e[1] || e[1] > rows)) {
            err->code = TL_ERR_CORRUPT;
            err->file = (int32_t)k;
            err->offset = at;
            err->length = 16;
            err->done = e[0] > e[1] ? e[0] : e[1]; /* the offending value */
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
 * int64 byte pointers into the .bin at byte ptr_off, nseq of each.  A pointer
 * must be a multiple of itemsize and the sequence must end within bin_rows.
 */
TL_INLINE int tl_megatron_extents(int idx_fd, uint64_t len_off, uint64_t ptr_off, uint64_t itemsize,
                                  uint64_t bin_rows, const uint64_t *ids, size_t count,
                                  uint64_t *out_start, uint64_t *out_len, tl_io_error *err,
                                  size_t *failed_item)
{
    for (size_t i = 0; i < count; i++) {
        int32_t len;
        int64_t ptr;
        int rc = tl_io_read(idx_fd, 0, &len, 4, len_off + 4 * ids[i], err);
        if (!rc) rc = tl_io_read(idx_fd, 0, &ptr, 8, ptr_off + 8 * ids[i], err);
        if (rc) {
            *failed_item = i;
            return rc;
        }
        if (TL_UNLIKELY(len < 0 || ptr < 0 || (uint64_t)ptr % itemsize ||
                        (uint64_t)ptr / itemsize > bin_rows ||
                        (uint64_t)len > bin_rows - (uint64_t)ptr / itemsize)) {
            err->code = TL_ERR_CORRUPT;
            err->file = 0;
            err->offset = ptr_off + 8 * ids[i];
            err->length = 8;
            err->done = (uint64_t)ptr;
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
    tl_file index;
    tl_file data;
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
 * Gather the metadata of `nwin` windows of `window` rows each.  ids holds the
 * metadata_id field of the windows' rows ([nwin, window], row-major), starts
 * their first global rows, row_cum the cumulative rows of the shards.
 *
 * For every window segment inside one shard, the ids not seen before in the
 * batch are found, their index entries [min, max + 1] are read in one request
 * and the record bytes [off[min], off[max + 1]) become one span (read later by
 * tl_meta_read): at most two reads per shard a window spans.
 * Records are de-duplicated across the batch by (shard, id), numbered in
 * order of first appearance: positions[r] is the number of row r's record, or
 * -1 for TL_META_NONE.
 *
 * Scratch: hkeys/hvals, a hash table of hcap entries (a power of two >= 2 *
 * nwin * window); entries, an index buffer of ecap uint64 values.  A segment
 * whose id range does not fit in ecap entries reads each record's two index
 * entries separately instead.  items and spans need nwin * window entries.
 *
 * Returns 0 and sets *nitems, *nspans and *blob_bytes, or an error code.
 */
TL_INLINE int tl_meta_gather(const tl_meta_shard *shards, const uint64_t *row_cum, size_t nfiles,
                             const uint64_t *starts, size_t nwin, uint64_t window,
                             const uint32_t *ids, int32_t *positions, uint64_t *hkeys,
                             int64_t *hvals, uint64_t hcap, uint64_t *entries, uint64_t ecap,
                             tl_meta_item *items, size_t *nitems, tl_meta_span *spans,
                             size_t *nspans, uint64_t *blob_bytes, tl_io_error *err,
                             size_t *failed_item)
{
    size_t ni = 0, ns = 0;
    uint64_t blob = 0;
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
            for (uint64_t r = 0; r < seg; r++) {
                uint32_t id = sid[r];
                if (id == TL_META_NONE) {
                    spos[r] = -1;
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
                    items[ni].length = UINT64_MAX; /* extent not known yet */
                    ni++;
                    if (id < lo) lo = id;
                    if (id > hi) hi = id;
                }
                spos[r] = (int32_t)hvals[hslot];
            }
            if (first_item < ni) {
                /* Extents of the records first seen in this segment (ids in
                 * [lo, hi]); records seen earlier in the batch have theirs. */
                if (hi - lo + 2 <= ecap) {
                    int rc = tl_io_read(ms->index.fd, (int32_t)k, entries, 8 * (hi - lo + 2),
                                        ms->index.base + 8 * lo, err);
                    if (rc) {
                        *failed_item = w;
                        return rc;
                    }
                    for (uint64_t e = 0; e + 1 < hi - lo + 2; e++) {
                        if (TL_UNLIKELY(entries[e] > entries[e + 1] ||
                                        entries[e + 1] > ms->data_bytes)) {
                            err->code = TL_ERR_CORRUPT;
                            err->file = (int32_t)k;
                            err->offset = ms->index.base + 8 * (lo + e + 1);
                            err->length = ms->data_bytes;
                            err->done = entries[e + 1];
                            *failed_item = w;
                            return TL_ERR_CORRUPT;
                        }
                    }
                    /* one coalesced span: bytes of records lo..hi */
                    spans[ns].shard = (uint32_t)k;
                    spans[ns].offset = entries[0];
                    spans[ns].length = entries[hi - lo + 1] - entries[0];
                    spans[ns].blob = blob;
                    for (size_t it = first_item; it < ni; it++) {
                        items[it].offset = entries[items[it].id - lo];
                        items[it].length = entries[items[it].id - lo + 1] - items[it].offset;
                        items[it].blob = blob + (items[it].offset - entries[0]);
                    }
                    blob += spans[ns].length;
                    ns++;
                } else {
                    /* Sparse ids: two entries per new record, and one span each. */
                    for (size_t it = first_item; it < ni; it++) {
                        uint64_t e2[2];
                        uint64_t at = ms->index.base + 8 * (uint64_t)items[it].id;
                        int rc = tl_io_read(ms->index.fd, (int32_t)k, e2, 16, at, err);
                        if (rc) {
                            *failed_item = w;
                            return rc;
                        }
                        if (TL_UNLIKELY(e2[0] > e2[1] || e2[1] > ms->data_bytes)) {
                            err->code = TL_ERR_CORRUPT;
                            err->file = (int32_t)k;
                            err->offset = at;
                            err->length = ms->data_bytes;
                            err->done = e2[0] > e2[1] ? e2[0] : e2[1];
                            *failed_item = w;
                            return TL_ERR_CORRUPT;
                        }
                        items[it].offset = e2[0];
                        items[it].length = e2[1] - e2[0];
                        spans[ns].shard = (uint32_t)k;
                        spans[ns].offset = e2[0];
                        spans[ns].length = e2[1] - e2[0];
                        spans[ns].blob = blob;
                        items[it].blob = blob;
                        blob += spans[ns].length;
                        ns++;
                    }
                }
            }
            row += seg;
            done += seg;
        }
    }
    *nitems = ni;
    *nspans = ns;
    *blob_bytes = blob;
    return 0;
}

/* Read the spans planned by tl_meta_gather into blob. */
TL_INLINE int tl_meta_read(const tl_meta_shard *shards, const tl_meta_span *spans, size_t nspans,
                           uint8_t *blob, tl_io_error *err)
{
    for (size_t s = 0; s < nspans; s++) {
        const tl_meta_shard *ms = &shards[spans[s].shard];
        int rc = tl_io_read(ms->data.fd, (int32_t)spans[s].shard, blob + spans[s].blob,
                            spans[s].length, ms->data.base + spans[s].offset, err);
        if (rc) return rc;
    }
    return 0;
}

#endif /* TOKLOAD_PLAN_H */
