"""Batch reads of sharded row files, document extents and metadata, without the GIL.

The one job of this module is to bind ``csrc/tokload/plan.h``: it owns the
open file descriptors of a dataset's shards, checks and converts the arrays
the Python layer passes, runs a whole batch inside one ``with nogil`` block,
and turns C error codes into exceptions that name the file and the offset.
Policy (which rows make an observation, output shapes) lives in ``views.py``.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport strerror

cimport tokload._lib as lib

import os

import numpy as np

from tokload.errors import CorruptDataError, TruncatedFileError

META_NONE = 0xFFFFFFFF


cdef object _raise_io(lib.tl_io_error *err, list paths, str what):
    """Raise the exception for a failed read of paths[err.file]."""
    path = paths[err.file] if 0 <= err.file < len(paths) else "?"
    if err.code == lib.TL_IO_EOF:
        raise TruncatedFileError(
            f"{path}: file ended at byte {err.offset + err.done} while reading {what} "
            f"({err.length} bytes at offset {err.offset}); was it truncated after opening?"
        )
    if err.code == lib.TL_ERR_CORRUPT:
        raise CorruptDataError(f"{path}: {what}: bad value {err.done} at byte {err.offset}")
    code = -err.code
    raise OSError(code, strerror(code).decode(), path)


cdef class FileSet:
    """Open read-only descriptors of a list of files, with a byte base each.

    Descriptors are opened with ``O_CLOEXEC`` and ``posix_fadvise(RANDOM)``
    and closed by ``close()`` or garbage collection.
    """

    cdef lib.tl_file *files
    cdef readonly list paths
    cdef readonly size_t nfiles

    def __cinit__(self, paths, bases=None):
        self.files = NULL
        self.nfiles = 0
        self.paths = [os.fspath(p) for p in paths]
        n = len(self.paths)
        bases = [0] * n if bases is None else list(bases)
        if len(bases) != n:
            raise ValueError(f"{n} files but {len(bases)} bases")
        self.files = <lib.tl_file *>PyMem_Malloc(max(n, 1) * sizeof(lib.tl_file))
        if self.files is NULL:
            raise MemoryError()
        cdef size_t i
        for i in range(n):
            self.files[i].fd = -1
        for i in range(n):
            self.files[i].fd = os.open(self.paths[i], os.O_RDONLY | os.O_CLOEXEC)
            self.files[i].base = bases[i]
            self.nfiles = i + 1
            rc = lib.tl_io_advise_random(self.files[i].fd)
            if rc not in (0, -22, -29):  # EINVAL, ESPIPE: not a regular file; harmless
                raise OSError(-rc, strerror(-rc).decode(), self.paths[i])

    def close(self):
        """Close every descriptor (idempotent)."""
        cdef size_t i
        if self.files is not NULL:
            for i in range(self.nfiles):
                if self.files[i].fd >= 0:
                    os.close(self.files[i].fd)
                    self.files[i].fd = -1

    def __dealloc__(self):
        if self.files is not NULL:
            for i in range(self.nfiles):
                if self.files[i].fd >= 0:
                    os.close(self.files[i].fd)
            PyMem_Free(self.files)
            self.files = NULL

    cdef int check_open(self) except -1:
        if self.nfiles and self.files[0].fd < 0:
            raise ValueError("I/O on a closed dataset")
        return 0

    def fds(self):
        return [self.files[i].fd for i in range(self.nfiles)]


cdef class RowSet:
    """Fixed-size rows stored across the files of a FileSet, read as one sequence.

    Args:
        files: the shards' FileSet (rows of shard k start at its base).
        rows: rows in each shard.
        row_bytes: bytes per row (the dtype's itemsize).
    """

    cdef readonly FileSet files
    cdef uint64_t[::1] _cum
    cdef lib.tl_rowset rs
    cdef readonly uint64_t total

    def __cinit__(self, FileSet files, rows, uint64_t row_bytes):
        counts = np.asarray(rows, dtype=np.uint64)
        if len(counts) != files.nfiles:
            raise ValueError(f"{files.nfiles} files but {len(counts)} row counts")
        if row_bytes == 0:
            raise ValueError("row_bytes must be positive")
        cum = np.zeros(len(counts) + 1, dtype=np.uint64)
        np.cumsum(counts, out=cum[1:])
        self.files = files
        self._cum = cum
        self.total = cum[len(counts)]
        self.rs.files = files.files
        self.rs.cum = &self._cum[0]
        self.rs.nfiles = files.nfiles
        self.rs.row_bytes = row_bytes

    @property
    def cum(self):
        """Cumulative row counts, ``nfiles + 1`` entries (read-only view)."""
        a = np.asarray(self._cum)
        a.flags.writeable = False
        return a

    @property
    def row_bytes(self):
        return self.rs.row_bytes

    def locate(self, row):
        """The shard holding global row ``row``."""
        if not 0 <= row < self.total:
            raise IndexError(f"row {row} is out of range [0, {self.total})")
        return lib.tl_shards_locate(&self._cum[0], self.rs.nfiles, row)

    def plan(self, start, count):
        """The read requests for rows [start, start + count): a list of
        ``(shard, byte offset, byte length, destination offset)``."""
        if not (0 <= start and 0 <= count and start + count <= self.total):
            raise IndexError(f"rows [{start}, {start + count}) are not within [0, {self.total})")
        cdef lib.tl_read_req *reqs = <lib.tl_read_req *>PyMem_Malloc(
            (self.rs.nfiles + 1) * sizeof(lib.tl_read_req))
        if reqs is NULL:
            raise MemoryError()
        try:
            n = lib.tl_plan_rows(&self.rs, start, count, 0, reqs, self.rs.nfiles + 1)
            return [(reqs[i].file, reqs[i].offset, reqs[i].length, reqs[i].dst) for i in range(n)]
        finally:
            PyMem_Free(reqs)

    def read(self, starts, lengths, dst_offsets, out):
        """Read row ranges into ``out`` (a writable C-contiguous buffer).

        Range i is rows ``[starts[i], starts[i] + lengths[i])``, written at byte
        ``dst_offsets[i]`` of ``out``.  Ranges may span shards.  Every range and
        destination is checked here; the reads then run in C without the GIL.
        """
        self.files.check_open()
        cdef const uint64_t[::1] s = np.ascontiguousarray(starts, dtype=np.uint64)
        cdef const uint64_t[::1] l = np.ascontiguousarray(lengths, dtype=np.uint64)
        cdef const uint64_t[::1] d = np.ascontiguousarray(dst_offsets, dtype=np.uint64)
        cdef uint8_t[::1] dst = np.frombuffer(out, dtype=np.uint8) if not isinstance(
            out, np.ndarray) else out.reshape(-1).view(np.uint8)
        cdef size_t n = s.shape[0]
        if l.shape[0] != n or d.shape[0] != n:
            raise ValueError("starts, lengths and dst_offsets must have the same length")
        if n == 0:
            return
        sa, la, da = np.asarray(s), np.asarray(l), np.asarray(d)
        end = sa + la
        if (end < sa).any() or (end > self.total).any():
            i = int(np.flatnonzero((end < sa) | (end > self.total))[0])
            raise IndexError(f"rows [{sa[i]}, {sa[i] + la[i]}) are not within [0, {self.total})")
        nbytes = la * np.uint64(self.rs.row_bytes)
        if ((da + nbytes) > dst.shape[0]).any():
            raise ValueError("a destination range runs past the end of out")
        cdef lib.tl_io_error err
        cdef size_t failed = 0
        cdef int rc
        with nogil:
            rc = lib.tl_rows_read_many(&self.rs, &s[0], &l[0], &d[0], n, &dst[0], &err, &failed)
        if rc:
            _raise_io(&err, self.files.paths, f"rows [{sa[failed]}, {sa[failed] + la[failed]})")


    def read_windows(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                     uint64_t window, out):
        """Read windows of observations ``indices`` into ``out``, in one call.

        Observation ``i`` (``0 <= i < count``) is rows ``[(first + i) * stride,
        (first + i) * stride + window)``; window ``b`` lands at byte
        ``b * window * row_bytes`` of ``out``.  Indices are checked in a
        compiled loop (no per-batch NumPy calls); the reads run without the GIL.
        """
        self.files.check_open()
        idx = np.asarray(indices)
        if idx.dtype != np.int64:
            if idx.dtype.kind not in "iu" and idx.size:
                raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
            idx = idx.astype(np.int64)
        cdef const int64_t[::1] iv = np.ascontiguousarray(idx.reshape(-1))
        cdef uint8_t[::1] dst = out.reshape(-1).view(np.uint8)
        cdef size_t n = iv.shape[0], b
        cdef int64_t i
        if n == 0:
            return
        if <uint64_t>dst.shape[0] < n * window * self.rs.row_bytes:
            raise ValueError(f"out holds {dst.shape[0]} bytes, need {n * window * self.rs.row_bytes}")
        if count and ((first + count - 1) * stride + window > self.total):
            raise IndexError(f"windows up to {first + count} run past the {self.total} rows")
        cdef uint64_t *starts = <uint64_t *>PyMem_Malloc(n * sizeof(uint64_t))
        if starts is NULL:
            raise MemoryError()
        cdef lib.tl_io_error err
        cdef size_t failed = 0
        cdef int rc
        try:
            for b in range(n):
                i = iv[b]
                if i < 0 or <uint64_t>i >= count:
                    raise IndexError(f"observation {i} is out of range for a view of {count} "
                                     f"(valid: 0 <= i < {count})")
                starts[b] = (first + <uint64_t>i) * stride
            with nogil:
                rc = lib.tl_rows_read_windows(&self.rs, starts, n, window, &dst[0], &err, &failed)
            if rc:
                s0 = starts[failed]
                _raise_io(&err, self.files.paths, f"rows [{s0}, {s0 + window})")
        finally:
            PyMem_Free(starts)


def split_fields(rows, uint64_t nrows, uint64_t row_bytes, offsets, sizes, outs):
    """De-interleave ``nrows`` rows of a structured dtype into one array per field.

    ``rows`` is a C-contiguous buffer of ``nrows * row_bytes`` bytes; field f
    (``offsets[f]``, ``sizes[f]`` bytes) of each row goes to ``outs[f]``, a
    C-contiguous array of ``nrows * sizes[f]`` bytes.  Runs without the GIL.
    """
    cdef const uint8_t[::1] src = np.frombuffer(rows, dtype=np.uint8) if not isinstance(
        rows, np.ndarray) else rows.reshape(-1).view(np.uint8)
    cdef const uint64_t[::1] off = np.ascontiguousarray(offsets, dtype=np.uint64)
    cdef const uint64_t[::1] siz = np.ascontiguousarray(sizes, dtype=np.uint64)
    cdef size_t nf = off.shape[0], f
    if src.shape[0] < nrows * row_bytes:
        raise ValueError(f"rows holds {src.shape[0]} bytes, need {nrows * row_bytes}")
    if siz.shape[0] != nf or len(outs) != nf:
        raise ValueError("offsets, sizes and outs must have the same length")
    if nf == 0 or nrows == 0:
        return
    cdef uint8_t **dst = <uint8_t **>PyMem_Malloc(nf * sizeof(uint8_t *))
    if dst is NULL:
        raise MemoryError()
    cdef uint8_t[::1] view
    keep = []
    try:
        for f in range(nf):
            if off[f] + siz[f] > row_bytes:
                raise ValueError(f"field {f} ({off[f]}+{siz[f]} bytes) overruns a {row_bytes}-byte row")
            view = outs[f].reshape(-1).view(np.uint8)
            if view.shape[0] < nrows * siz[f]:
                raise ValueError(f"out {f} holds {view.shape[0]} bytes, need {nrows * siz[f]}")
            keep.append(view)
            dst[f] = &view[0]
        with nogil:
            lib.tl_split_fields(&src[0], nrows, row_bytes, nf, &off[0], &siz[0], dst)
    finally:
        PyMem_Free(dst)


cdef class DocIndex:
    """Per-shard document indexes: shard k's file holds ``docs_k + 1`` uint64
    row offsets.  ``extents(ids)`` gives each document's first global row and
    its length, reading 16 bytes per document."""

    cdef readonly FileSet files
    cdef uint64_t[::1] _doc_cum
    cdef uint64_t[::1] _row_cum
    cdef readonly uint64_t total

    def __cinit__(self, FileSet files, docs, RowSet rows):
        counts = np.asarray(docs, dtype=np.uint64)
        if len(counts) != files.nfiles or files.nfiles != rows.files.nfiles:
            raise ValueError("one document index per shard is needed")
        cum = np.zeros(len(counts) + 1, dtype=np.uint64)
        np.cumsum(counts, out=cum[1:])
        self.files = files
        self._doc_cum = cum
        self._row_cum = np.array(rows.cum)
        self.total = cum[len(counts)]

    def extents(self, ids):
        """``(starts, lengths)``, uint64 arrays, for document ids in ``[0, total)``."""
        self.files.check_open()
        cdef const uint64_t[::1] i = _checked_ids(ids, self.total, "document")
        cdef size_t n = i.shape[0]
        starts = np.empty(n, dtype=np.uint64)
        lengths = np.empty(n, dtype=np.uint64)
        cdef uint64_t[::1] s = starts, l = lengths
        cdef lib.tl_io_error err
        cdef size_t failed = 0
        cdef int rc = 0
        if n:
            with nogil:
                rc = lib.tl_docs_extents(self.files.files, &self._doc_cum[0], &self._row_cum[0],
                                         self.files.nfiles, &i[0], n, &s[0], &l[0], &err, &failed)
        if rc:
            _raise_io(&err, self.files.paths, f"the document index entry of document {i[failed]}")
        return starts, lengths


cdef const uint64_t[::1] _checked_ids(ids, uint64_t total, str what) except *:
    a = np.asarray(ids)
    if a.dtype.kind not in "iu" and a.size:
        raise TypeError(f"{what} ids must be integers, got dtype {a.dtype}")
    a = np.ascontiguousarray(a.reshape(-1))
    if a.size and (a.min() < 0 or a.max() >= total):
        bad = a[(a < 0) | (a >= total)][0]
        raise IndexError(f"{what} {bad} is out of range [0, {total})")
    return a.astype(np.uint64, copy=False)


cdef class MegatronIndex:
    """Sequence extents from a Megatron ``.idx``: int32 lengths at ``len_off``,
    int64 byte pointers at ``ptr_off``; 12 bytes read per sequence."""

    cdef readonly FileSet file
    cdef uint64_t len_off, ptr_off, itemsize, bin_rows
    cdef readonly uint64_t total

    def __cinit__(self, FileSet file, uint64_t nseq, uint64_t len_off, uint64_t ptr_off,
                  uint64_t itemsize, uint64_t bin_rows):
        self.file = file
        self.total = nseq
        self.len_off = len_off
        self.ptr_off = ptr_off
        self.itemsize = itemsize
        self.bin_rows = bin_rows

    def extents(self, ids):
        self.file.check_open()
        cdef const uint64_t[::1] i = _checked_ids(ids, self.total, "sequence")
        cdef size_t n = i.shape[0]
        starts = np.empty(n, dtype=np.uint64)
        lengths = np.empty(n, dtype=np.uint64)
        cdef uint64_t[::1] s = starts, l = lengths
        cdef lib.tl_io_error err
        cdef size_t failed = 0
        cdef int rc = 0
        if n:
            with nogil:
                rc = lib.tl_megatron_extents(self.file.files[0].fd, self.len_off, self.ptr_off,
                                             self.itemsize, self.bin_rows, &i[0], n, &s[0],
                                             &l[0], &err, &failed)
        if rc:
            _raise_io(&err, self.file.paths, f"the pointer of sequence {i[failed]}")
        return starts, lengths


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
            self.shards[k].index = index_files.files[k]
            self.shards[k].data = data_files.files[k]
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
        cdef uint64_t hcap = 1, ecap = max(4 * window + 2, 1024)
        while hcap < 2 * max(total, 1):
            hcap *= 2
        hkeys = np.empty(hcap, dtype=np.uint64)
        hvals = np.empty(hcap, dtype=np.int64)
        entries = np.empty(ecap, dtype=np.uint64)
        items = np.empty(max(total, 1), dtype=_ITEM_DTYPE)
        spans = np.empty(max(total, 1), dtype=_SPAN_DTYPE)
        cdef uint64_t[::1] hk = hkeys, ent = entries
        cdef int64_t[::1] hv = hvals
        cdef uint8_t[::1] it_raw = items.view(np.uint8)
        cdef uint8_t[::1] sp_raw = spans.view(np.uint8)
        cdef lib.tl_meta_item *it = <lib.tl_meta_item *>&it_raw[0]
        cdef lib.tl_meta_span *sp = <lib.tl_meta_span *>&sp_raw[0]
        cdef size_t nitems = 0, nspans = 0, failed = 0
        cdef uint64_t blob = 0
        cdef lib.tl_io_error err
        cdef int rc = 0
        if nwin and window:
            with nogil:
                rc = lib.tl_meta_gather(self.shards, &self._row_cum[0], self.rows.files.nfiles,
                                        &s[0], nwin, window, &idv[0], &pos[0], &hk[0], &hv[0],
                                        hcap, &ent[0], ecap, it, &nitems, sp, &nspans,
                                        &blob, &err, &failed)
        if rc == lib.TL_ERR_BAD_ID:
            raise CorruptDataError(
                f"{self.rows.files.paths[err.file]}: row {err.offset} has metadata id "
                f"{err.done}, but the shard has {err.length} metadata records"
            )
        if rc:
            _raise_io(&err, self.index_files.paths, "the metadata index")
        return items[:nitems], spans[:nspans], blob

    def read(self, spans, out):
        """Read the spans from ``gather`` into ``out`` (bytes, ``blob_bytes`` long)."""
        self.data_files.check_open()
        sarr = np.ascontiguousarray(spans, dtype=_SPAN_DTYPE)
        cdef size_t n = sarr.shape[0]
        if n == 0:
            return
        cdef uint8_t[::1] sp_raw = sarr.view(np.uint8)
        cdef lib.tl_meta_span *sp = <lib.tl_meta_span *>&sp_raw[0]
        cdef uint8_t[::1] dst = out
        cdef lib.tl_io_error err
        cdef int rc = 0
        if (sarr["blob"] + sarr["length"]).max() > dst.shape[0]:
            raise ValueError("out is too small for the spans")
        with nogil:
            rc = lib.tl_meta_read(self.shards, sp, n, &dst[0], &err)
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
