"""Metadata as one uint32 id per row (FORMAT.md, version 1): per shard, an index
of ``records + 1`` byte offsets and a data file; a window's distinct records are
collected and read without the GIL."""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cimport tokload._lib as lib
from tokload._io cimport FileSet, _checked_window_starts, _indices, _out_bytes, _raise_io
from tokload._rows cimport RowSet

import numpy as np

from tokload.errors import CorruptDataError

META_NONE = 0xFFFFFFFF


cdef class MetaSet:
    """Per-shard metadata (an index of ``records + 1`` uint64 byte offsets and
    a data file) of a RowSet whose rows carry a uint32 ``metadata_id``."""

    cdef readonly FileSet index_files
    cdef readonly FileSet data_files
    cdef readonly RowSet rows
    cdef lib.tl_meta_shard *shards
    cdef uint64_t[::1] _row_cum

    def __cinit__(self, FileSet index_files, FileSet data_files, records, data_bytes, RowSet rows):
        self.shards = NULL
        n = rows.files.nfiles
        if index_files.nfiles != n or data_files.nfiles != n:
            raise ValueError("one metadata index and data file per shard is needed")
        self.index_files, self.data_files, self.rows = index_files, data_files, rows
        self._row_cum = np.array(rows.cum)
        self.shards = <lib.tl_meta_shard *>PyMem_Malloc(max(n, 1) * sizeof(lib.tl_meta_shard))
        if self.shards is NULL:
            raise MemoryError()
        for k in range(n):
            self.shards[k].index = &index_files.files[k]
            self.shards[k].data = &data_files.files[k]
            self.shards[k].nrec = records[k]
            self.shards[k].data_bytes = data_bytes[k]
            if records[k] >= 0xFFFFFFFF:
                raise ValueError(f"shard {k} has {records[k]} metadata records; ids are uint32")

    def __dealloc__(self):
        PyMem_Free(self.shards)

    def gather(self, starts, uint64_t window, ids, positions):
        """Resolve the metadata of windows whose ``metadata_id`` rows are ``ids``.

        Args:
            starts: first global row of each window (uint64, ``nwin``).
            window: rows per window.
            ids: ``[nwin, window]`` uint32, the windows' metadata ids.
            positions: ``[nwin, window]`` int32 output: the batch-level number
                of each row's record, or -1.

        Returns:
            ``(items, spans, blob_bytes)``: structured arrays (shard, id,
            offset, length, blob) per distinct record in order of first
            appearance, and the coalesced reads to pass to ``read``.
        """
        self.index_files.check_open()
        cdef const uint64_t[::1] s = np.ascontiguousarray(starts, dtype=np.uint64)
        cdef const uint32_t[::1] idv = ids.reshape(-1)
        cdef int32_t[::1] pos = positions.reshape(-1)
        cdef size_t nwin = s.shape[0]
        cdef size_t total = nwin * window
        if idv.shape[0] != total or pos.shape[0] != total:
            raise ValueError(f"ids and positions must hold {nwin} x {window} values")
        if nwin and (np.asarray(s).max() + window > self.rows.total):
            raise IndexError("a window runs past the end of the rows")
        cdef size_t nseg_max = 0, bound = 0
        if total:
            with nogil:
                nseg_max = lib.tl_rows_count_reqs(&self.rows.rs, &s[0], NULL, window, nwin)
                # distinct records <= runs of equal ids + segments: scratch follows the
                # records, not the rows (allocations of the rows' size fault in fresh
                # pages every batch)
                bound = lib.tl_meta_count_runs(&idv[0], nwin, window) + nseg_max
        cdef uint64_t hcap = 1
        while hcap < 2 * max(bound, 1):
            hcap *= 2
        hkeys = np.empty(hcap, dtype=np.uint64)
        hvals = np.empty(hcap, dtype=np.int64)
        entries = np.empty(2 * bound + 64 * nseg_max + 1, dtype=np.uint64)
        items = np.empty(max(bound, 1), dtype=_ITEM_DTYPE)
        spans = np.empty(max(bound, 1), dtype=_SPAN_DTYPE)
        cdef uint64_t[::1] hk = hkeys, ent = entries
        cdef int64_t[::1] hv = hvals
        cdef uint8_t[::1] it_raw = items.view(np.uint8)
        cdef uint8_t[::1] sp_raw = spans.view(np.uint8)
        cdef lib.tl_meta_item *it = <lib.tl_meta_item *>&it_raw[0]
        cdef lib.tl_meta_span *sp = <lib.tl_meta_span *>&sp_raw[0]
        cdef size_t nitems = 0, nspans = 0, nsegs = 0, nreqs = 0, failed = 0
        cdef uint64_t blob = 0
        cdef lib.tl_io_error err
        cdef lib.tl_engine eng
        cdef int rc = 0
        cdef lib.tl_meta_seg *segs = NULL
        cdef lib.tl_ioreq *reqs = NULL
        if nwin == 0 or window == 0:
            return items[:0], spans[:0], 0
        segs = <lib.tl_meta_seg *>PyMem_Malloc(max(nseg_max, 1) * sizeof(lib.tl_meta_seg))
        reqs = <lib.tl_ioreq *>PyMem_Malloc((nseg_max + bound + 1) * sizeof(lib.tl_ioreq))
        try:
            if segs is NULL or reqs is NULL:
                raise MemoryError()
            self.index_files.engine_begin(&eng)
            with nogil:
                # every index read of the batch in one engine call
                rc = lib.tl_meta_plan(self.shards, &self._row_cum[0], self.rows.files.nfiles,
                                      &s[0], nwin, window, &idv[0], &pos[0], &hk[0], &hv[0],
                                      hcap, it, &nitems, segs, &nsegs, &ent[0], reqs, &nreqs,
                                      &err, &failed)
                if rc == 0:
                    rc = lib.tl_engine_run(&eng, reqs, nreqs, &err, &failed)
                if rc == 0:
                    rc = lib.tl_meta_finish(self.shards, segs, nsegs, &ent[0], it, sp, &nspans,
                                            &blob, &err, &failed)
            self.index_files.engine_end(&eng)
        finally:
            PyMem_Free(segs)
            PyMem_Free(reqs)
        if rc == lib.TL_ERR_BAD_ID:
            raise CorruptDataError(
                f"{self.rows.files.paths[err.file]}: row {err.offset} has metadata id "
                f"{err.done}, but the shard has {err.length} metadata records"
            )
        if rc:
            _raise_io(&err, self.index_files.paths, "the metadata index")
        return items[:nitems], spans[:nspans], blob

    def read(self, spans, out):
        """Read the spans from ``gather`` into ``out`` (bytes, ``blob_bytes`` long:
        a writable C-contiguous uint8 array or buffer, else a ValueError)."""
        self.data_files.check_open()
        cdef uint8_t[::1] dst = _out_bytes(out, 1, 0, False, "out")
        sarr = np.ascontiguousarray(spans, dtype=_SPAN_DTYPE)
        cdef size_t n = sarr.shape[0]
        if n == 0:
            return
        cdef uint8_t[::1] sp_raw = sarr.view(np.uint8)
        cdef lib.tl_meta_span *sp = <lib.tl_meta_span *>&sp_raw[0]
        cdef uint8_t *dptr = &dst[0] if dst.shape[0] else NULL
        cdef lib.tl_io_error err
        cdef lib.tl_engine eng
        cdef size_t failed = 0
        cdef int rc = 0
        if (sarr["blob"] + sarr["length"]).max() > dst.shape[0]:
            raise ValueError("out is too small for the spans")
        cdef lib.tl_ioreq *reqs = <lib.tl_ioreq *>PyMem_Malloc(n * sizeof(lib.tl_ioreq))
        if reqs is NULL:
            raise MemoryError()
        try:
            self.data_files.engine_begin(&eng)
            with nogil:
                lib.tl_meta_plan_read(self.shards, sp, n, dptr, reqs)
                rc = lib.tl_engine_run(&eng, reqs, n, &err, &failed)
            self.data_files.engine_end(&eng)
        finally:
            PyMem_Free(reqs)
        if rc:
            _raise_io(&err, self.data_files.paths, "metadata records")


# numpy mirrors of tl_meta_item / tl_meta_span (aligned like the C structs).
_ITEM_DTYPE = np.dtype(
    {"names": ["shard", "id", "offset", "length", "blob"],
     "formats": [np.uint32, np.uint32, np.uint64, np.uint64, np.uint64],
     "offsets": [0, 4, 8, 16, 24], "itemsize": sizeof(lib.tl_meta_item)})
_SPAN_DTYPE = np.dtype(
    {"names": ["shard", "offset", "length", "blob"],
     "formats": [np.uint32, np.uint64, np.uint64, np.uint64],
     "offsets": [0, 8, 16, 24], "itemsize": sizeof(lib.tl_meta_span)})
