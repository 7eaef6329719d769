"""The metadata of a batch of token windows, assembled in one compiled call.

The one job of this module is to bind ``csrc/tokload/spans.h``: for a batch of
windows of a dataset whose metadata is a per-shard span table (FORMAT.md,
version 2), it fills the per-row positions into the batch's list of distinct
records and returns the records as one byte buffer plus offsets.  The reads
go through the I/O engine of ``tokload._io`` (``RowSet.read``: batched,
coalesced, without the GIL); the planning between them runs here in C without
the GIL, in scratch memory reused from batch to batch.  Python work per batch
does not depend on the number of windows, runs or records.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

cimport tokload._lib as lib

import numpy as np

from tokload._io import RowSet
from tokload.errors import CorruptDataError

SPAN_NONE = lib.TL_SPAN_NONE
SPAN_ENTRY = lib.TL_SPAN_ENTRY
SPAN_DTYPE = np.dtype([("start", "<u8"), ("record", "<u4")])
"""One span table entry as stored (12 packed bytes)."""


cdef object _fit(object arr, size_t n, object dtype):
    """``arr`` if it holds ``n`` values, else a new array of at least ``n`` (grown 1.5x)."""
    if arr is not None and arr.shape[0] >= n:
        return arr
    cap = max(n, 64) if arr is None else max(n, arr.shape[0] * 3 // 2)
    return np.empty(cap, dtype=dtype)


cdef object _bytes(object alloc, uint64_t n):
    """``n`` bytes from ``alloc``; an empty buffer is a plain array (a tensor of no
    bytes may have no data pointer, so the loader copies it instead)."""
    return alloc((n,), np.uint8) if n else np.empty(0, dtype=np.uint8)


cdef class Scratch:
    """Working memory of :meth:`SpanSet.read`, reused across batches.

    One per thread: the loader's reader threads each keep their own.
    """

    cdef object pieces, q_start, q_len, q_dst, blocks, runs, hkeys, hvals
    cdef object item_shard, item_id, item_ent, entries

    def nbytes(self):
        """Bytes held now."""
        return sum(a.nbytes for a in (self.pieces, self.q_start, self.q_len, self.q_dst,
                                      self.blocks, self.runs, self.hkeys, self.hvals,
                                      self.item_shard, self.item_id, self.item_ent,
                                      self.entries) if a is not None)


cdef inline lib.tl_span_reqs _reqs(Scratch sc):
    cdef uint64_t[::1] a = sc.q_start, b = sc.q_len, c = sc.q_dst
    cdef lib.tl_span_reqs q
    q.start = &a[0]
    q.len = &b[0]
    q.dst = &c[0]
    return q


cdef class SpanSet:
    """The span tables and records of a dataset's shards (FORMAT.md, version 2).

    Args:
        rows: the dataset's rows (for the shards' row counts).
        block_files, run_files, index_files, data_files: FileSets of the
            shards' ``.msx``, ``.mds``, ``.mdx`` and ``.mdb`` files.
        runs, records, data_bytes: per shard, from the manifest.
        block: rows per block index entry.
    """

    cdef readonly object rows, blocks_rs, runs_rs, index_rs, data_rs
    cdef readonly uint64_t block
    cdef uint64_t[::1] _row_cum, _msx_cum, _mds_cum, _mdx_cum, _mdb_cum
    cdef lib.tl_span_set s
    cdef list _paths

    def __cinit__(self, rows, block_files, run_files, index_files, data_files, runs, records,
                  data_bytes, uint64_t block):
        if block == 0:
            raise ValueError("block must be positive")
        row_counts = np.diff(np.asarray(rows.cum))
        n = len(row_counts)
        if not (len(runs) == len(records) == len(data_bytes) == n):
            raise ValueError(f"{n} shards but {len(runs)}, {len(records)}, {len(data_bytes)} "
                             "run, record and byte counts")
        nblocks = (row_counts + np.uint64(block - 1)) // np.uint64(block)
        self.rows = rows
        self.block = block
        self.blocks_rs = RowSet(block_files, nblocks + np.uint64(1), 8)
        self.runs_rs = RowSet(run_files, np.asarray(runs, dtype=np.uint64), lib.TL_SPAN_ENTRY)
        self.index_rs = RowSet(index_files, np.asarray(records, dtype=np.uint64) + np.uint64(1), 8)
        self.data_rs = RowSet(data_files, np.asarray(data_bytes, dtype=np.uint64), 1)
        self._row_cum = np.array(rows.cum, dtype=np.uint64)
        self._msx_cum = np.array(self.blocks_rs.cum, dtype=np.uint64)
        self._mds_cum = np.array(self.runs_rs.cum, dtype=np.uint64)
        self._mdx_cum = np.array(self.index_rs.cum, dtype=np.uint64)
        self._mdb_cum = np.array(self.data_rs.cum, dtype=np.uint64)
        self.s.row_cum = &self._row_cum[0]
        self.s.msx_cum = &self._msx_cum[0]
        self.s.mds_cum = &self._mds_cum[0]
        self.s.mdx_cum = &self._mdx_cum[0]
        self.s.mdb_cum = &self._mdb_cum[0]
        self.s.nfiles = n
        self.s.block = block
        self._paths = [block_files.paths, run_files.paths, index_files.paths, data_files.paths]

    cdef object _corrupt(self, lib.tl_span_error *e):
        k = e.shard
        if e.code == lib.TL_SPAN_BAD_BLOCK:
            return CorruptDataError(
                f"{self._paths[0][k]}: block index entry {e.entry} = {e.value} is out of order "
                f"or out of range (the shard has {e.limit} runs)")
        if e.code == lib.TL_SPAN_BAD_START:
            return CorruptDataError(
                f"{self._paths[1][k]}: span table entry {e.entry} starts at row {e.value}: "
                f"starts must begin at 0, increase, and stay below the shard's {e.limit} rows")
        if e.code == lib.TL_SPAN_BAD_RECORD:
            return CorruptDataError(
                f"{self._paths[1][k]}: span table entry {e.entry} refers to record {e.value}, "
                f"but the shard has {e.limit} metadata records")
        if e.code == lib.TL_SPAN_BAD_OFFSET:
            return CorruptDataError(
                f"{self._paths[2][k]}: metadata index entry {e.entry} = {e.value} breaks "
                f"0 = first <= ... <= last = {e.limit} (the data size)")
        return CorruptDataError(
            f"{self._paths[0][k]}: the block index names span table entries that do not cover "
            f"row {e.limit} (entry {e.entry} starts at row {e.value})")

    def read(self, starts, uint64_t window, positions, alloc, Scratch scratch):
        """The metadata of windows ``[starts[b], starts[b] + window)`` (global rows).

        Fills ``positions`` (``[B, window]`` int32, C-contiguous): the index of
        each row's record in the batch's list of distinct records (in order of
        first appearance), or -1.  Returns ``(data, offsets)``, both allocated
        with ``alloc``: ``data`` (uint8) holds the records back to back,
        record ``k`` is ``data[offsets[k]:offsets[k + 1]]`` (``offsets``:
        int64, one more than the records).

        Four batched reads (block index, span table, record index, record
        bytes), each coalesced; the planning runs in C without the GIL.
        """
        cdef const uint64_t[::1] st = np.ascontiguousarray(starts, dtype=np.uint64)
        cdef size_t nwin = st.shape[0]
        cdef int32_t[::1] pos = positions.reshape(-1)
        if <uint64_t>pos.shape[0] != nwin * window:
            raise ValueError(f"positions must hold {nwin} x {window} values")
        if nwin == 0 or window == 0:
            offsets = alloc((1,), np.int64)
            offsets[0] = 0
            return _bytes(alloc, 0), offsets
        total = self._row_cum[self.s.nfiles]
        top = np.asarray(st).max()
        if top + window > total:
            raise IndexError(f"a window of rows [{top}, {top + window}) runs past the "
                             f"{total} rows")
        cdef lib.tl_span_error err
        cdef size_t npieces, nitems = 0, nreq = 0, k
        cdef uint64_t nblk, nruns = 0, hcap = 1
        cdef int rc
        cdef Scratch sc = scratch
        # 1: pieces and the block index slices
        with nogil:
            npieces = lib.tl_spans_count_pieces(&self.s, &st[0], nwin, window)
        sc.pieces = _fit(sc.pieces, npieces * sizeof(lib.tl_span_piece), np.uint8)
        sc.q_start = _fit(sc.q_start, npieces, np.uint64)
        sc.q_len = _fit(sc.q_len, npieces, np.uint64)
        sc.q_dst = _fit(sc.q_dst, npieces, np.uint64)
        cdef uint8_t[::1] praw = sc.pieces
        cdef lib.tl_span_piece *pieces = <lib.tl_span_piece *>&praw[0]
        cdef lib.tl_span_reqs q = _reqs(sc)
        with nogil:
            nblk = lib.tl_spans_pieces(&self.s, &st[0], nwin, window, pieces, q)
        sc.blocks = _fit(sc.blocks, nblk, np.uint64)
        self.blocks_rs.read(sc.q_start[:npieces], sc.q_len[:npieces], sc.q_dst[:npieces],
                            sc.blocks)
        # 2: the span table slices
        cdef uint64_t[::1] blocks = sc.blocks
        with nogil:
            rc = lib.tl_spans_runs(&self.s, pieces, npieces, &blocks[0], q, &nruns, &err)
        if rc:
            raise self._corrupt(&err)
        sc.runs = _fit(sc.runs, max(nruns, 1) * lib.TL_SPAN_ENTRY, np.uint8)
        self.runs_rs.read(sc.q_start[:npieces], sc.q_len[:npieces], sc.q_dst[:npieces], sc.runs)
        # 3: positions and the distinct records
        while hcap < 2 * max(nruns, 1):
            hcap *= 2
        sc.hkeys = _fit(sc.hkeys, hcap, np.uint64)
        sc.hvals = _fit(sc.hvals, hcap, np.int64)
        sc.item_shard = _fit(sc.item_shard, nruns, np.uint32)
        sc.item_id = _fit(sc.item_id, nruns, np.uint32)
        cdef uint8_t[::1] runs = sc.runs
        cdef uint64_t[::1] hk = sc.hkeys
        cdef int64_t[::1] hv = sc.hvals
        cdef uint32_t[::1] ishard = sc.item_shard, iid = sc.item_id
        with nogil:
            rc = lib.tl_spans_resolve(&self.s, pieces, npieces, &runs[0], &pos[0], &hk[0],
                                      &hv[0], hcap, &ishard[0], &iid[0], &nitems, &err)
        if rc:
            raise self._corrupt(&err)
        offsets = alloc((nitems + 1,), np.int64)
        cdef int64_t[::1] off = offsets
        if nitems == 0:
            off[0] = 0
            return _bytes(alloc, 0), offsets
        # 4: the records' index entries
        sc.item_ent = _fit(sc.item_ent, nitems, np.uint64)
        sc.entries = _fit(sc.entries, 2 * nitems, np.uint64)
        sc.q_start = _fit(sc.q_start, nitems, np.uint64)
        sc.q_len = _fit(sc.q_len, nitems, np.uint64)
        sc.q_dst = _fit(sc.q_dst, nitems, np.uint64)
        q = _reqs(sc)
        cdef uint64_t[::1] ient = sc.item_ent, ent = sc.entries
        with nogil:
            nreq = lib.tl_spans_plan_index(&self.s, &ishard[0], &iid[0], nitems, &ient[0], q)
        self.index_rs.read(sc.q_start[:nreq], sc.q_len[:nreq], sc.q_dst[:nreq], sc.entries)
        # 5: the records' bytes, straight into the batch's buffer
        with nogil:
            rc = lib.tl_spans_plan_data(&self.s, &ishard[0], &iid[0], nitems, &ient[0], &ent[0],
                                        &off[0], q, &nreq, &err)
        if rc:
            raise self._corrupt(&err)
        data = _bytes(alloc, off[nitems])
        if nreq:
            self.data_rs.read(sc.q_start[:nreq], sc.q_len[:nreq], sc.q_dst[:nreq], data)
        return data, offsets


def compact_records(blob, item_blob, item_len, alloc):
    """Records at ``blob[item_blob[k] : item_blob[k] + item_len[k]]``, back to back.

    Returns ``(data, offsets)`` allocated with ``alloc`` (uint8, and int64 with
    one more entry than the records); the copies run without the GIL.
    """
    cdef const uint8_t[::1] src = np.ascontiguousarray(blob, dtype=np.uint8)
    cdef const uint64_t[::1] b = np.ascontiguousarray(item_blob, dtype=np.uint64)
    cdef const uint64_t[::1] n = np.ascontiguousarray(item_len, dtype=np.uint64)
    cdef size_t m = b.shape[0], k
    if n.shape[0] != m:
        raise ValueError("item_blob and item_len must have the same length")
    offsets = alloc((m + 1,), np.int64)
    cdef int64_t[::1] off = offsets
    cdef uint64_t at = 0
    off[0] = 0
    for k in range(m):
        if b[k] + n[k] > <uint64_t>src.shape[0] or b[k] + n[k] < b[k]:
            raise ValueError(f"record {k} runs past the {src.shape[0]} bytes given")
        at += n[k]
        off[k + 1] = at
    data = _bytes(alloc, at)
    cdef uint8_t[::1] dst = data
    if at:
        with nogil:
            for k in range(m):
                if n[k]:
                    memcpy(&dst[off[k]], &src[b[k]], n[k])
    return data, offsets
