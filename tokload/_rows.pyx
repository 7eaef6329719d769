"""Fixed-size rows across the files of a FileSet, read as one sequence.

``RowSet`` plans the reads of windows and row ranges (``csrc/tokload/plan.h``)
and runs each batch's reads on the I/O engine (``_io.pyx``) inside one
``with nogil`` block; ``split_fields`` de-interleaves the rows of a structured
dtype into one array per field without the GIL."""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cimport tokload._lib as lib
from tokload._io cimport (FileSet, _checked_window_starts, _fdcache, _indices, _out_bytes,
                         _raise_io, _window_starts)

import numpy as np


cdef size_t _first_outside(const uint64_t[::1] starts, const uint64_t[::1] lengths,
                           uint64_t total) noexcept:
    """The first ``i`` whose rows ``[starts[i], starts[i] + lengths[i])`` are not
    within ``[0, total)`` (no overflow), or ``len(starts)``: a compiled loop with
    the GIL held (NumPy's checks would let it go and take it back)."""
    cdef size_t i
    for i in range(<size_t>starts.shape[0]):
        if starts[i] > total or lengths[i] > total - starts[i]:
            return i
    return starts.shape[0]


cdef class RowSet:
    """Fixed-size rows stored across the files of a FileSet, read as one sequence.

    Args:
        files: the shards' FileSet (rows of shard k start at its base).
        rows: rows in each shard.
        row_bytes: bytes per row (the dtype's itemsize).
    """

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
        """Read row ranges into ``out``.

        Range i is rows ``[starts[i], starts[i] + lengths[i])``, written at byte
        ``dst_offsets[i]`` of ``out``.  Ranges may span shards.  ``out`` is a
        writable C-contiguous array or buffer with items of ``row_bytes`` or of
        one byte (anything else is a ValueError: it would be filled in a copy).
        Every range and destination is checked here; the reads then run in C
        without the GIL.
        """
        read_ranges([(self, starts, lengths, dst_offsets, out)])

    cdef tuple _checked(self, starts, lengths, dst_offsets, out, known=None):
        """``read``'s arguments, checked: (starts, lengths, dst_offsets, the bytes of
        out), the first three as uint64 arrays. ``known``: the bytes of ``out`` as
        an earlier check of the same ``out`` and row size gave them."""
        self.files.check_open()
        dst = _out_bytes(out, self.rs.row_bytes, 0, False, "out") if known is None else known
        sa = np.ascontiguousarray(starts, dtype=np.uint64)
        la = np.ascontiguousarray(lengths, dtype=np.uint64)
        da = np.ascontiguousarray(dst_offsets, dtype=np.uint64)
        if la.shape[0] != sa.shape[0] or da.shape[0] != sa.shape[0]:
            raise ValueError("starts, lengths and dst_offsets must have the same length")
        # Compiled loops with the GIL held: NumPy's checks would drop and retake
        # it several times (its loops over 500 elements release it).
        cdef const uint64_t[::1] sv = sa, lv = la, dv = da
        cdef size_t i, n = sv.shape[0]
        cdef uint64_t total = self.total, row_bytes = self.rs.row_bytes
        cdef uint64_t size = dst.shape[0]
        i = _first_outside(sv, lv, total)
        if i < n:
            raise IndexError(f"rows [{sv[i]}, {sv[i] + lv[i]}) are not within [0, {total})")
        for i in range(n):
            if (row_bytes and lv[i] > size // row_bytes) or dv[i] > size - lv[i] * row_bytes:
                raise ValueError("a destination range runs past the end of out")
        return sa, la, da, dst

    def read_windows(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                     uint64_t window, out):
        """Read windows of observations ``indices`` into ``out``, in one call.

        Observation ``i`` (``0 <= i < count``) is rows ``[(first + i) * stride,
        (first + i) * stride + window)``; window ``b`` lands at byte
        ``b * window * row_bytes`` of ``out``: a writable C-contiguous array of
        at least those bytes (``[B, window]`` of the rows' dtype, or bytes);
        anything else is a ValueError.  Indices are checked in a compiled loop
        (no per-batch NumPy calls); the reads run without the GIL.
        """
        self.files.check_open()
        cdef const int64_t[::1] iv = _indices(indices)
        cdef size_t n = iv.shape[0]
        cdef uint8_t[::1] dst = _out_bytes(
            out, self.rs.row_bytes, (<object>n) * window * self.rs.row_bytes, False, "out")
        if n == 0:
            return
        cdef uint64_t *starts = <uint64_t *>PyMem_Malloc(n * sizeof(uint64_t))
        if starts is NULL:
            raise MemoryError()
        cdef lib.tl_ioreq *reqs = NULL
        cdef lib.tl_engine eng
        cdef lib.tl_io_error err
        cdef size_t failed = 0, m
        cdef uint8_t *dptr = &dst[0] if dst.shape[0] else NULL
        cdef int rc
        try:
            reqs = self._window_reqs(iv, first, count, stride, window, starts)
            self.files.engine_begin(&eng)
            with nogil:
                m = lib.tl_rows_plan_many(&self.rs, starts, NULL, window, NULL, n, dptr, reqs)
                rc = lib.tl_engine_run(&eng, reqs, m, &err, &failed)
            self.files.engine_end(&eng)
            if rc:
                s0 = starts[reqs[failed].item]
                _raise_io(&err, self.files.paths, f"rows [{s0}, {s0 + window})")
        finally:
            PyMem_Free(reqs)
            PyMem_Free(starts)


    cdef lib.tl_ioreq *_window_reqs(self, const int64_t[::1] iv, uint64_t first, uint64_t count,
                                    uint64_t stride, uint64_t window,
                                    uint64_t *starts) except NULL:
        """Check the windows of observations ``iv``, put their first rows in
        ``starts``, and return room (PyMem_Malloc) for their read requests."""
        _checked_window_starts(iv, first, count, stride, window, self.total, starts)
        cdef size_t nreq = lib.tl_rows_count_reqs(&self.rs, starts, NULL, window, iv.shape[0])
        cdef lib.tl_ioreq *reqs = <lib.tl_ioreq *>PyMem_Malloc(max(nreq, 1) * sizeof(lib.tl_ioreq))
        if reqs is NULL:
            raise MemoryError()
        return reqs

    def hint_windows(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                     uint64_t window):
        """Advise the kernel that the windows of observations ``indices`` (as for
        ``read_windows``) will be read soon: it reads them into the page cache
        in the background (``POSIX_FADV_WILLNEED``) and this returns at once, so
        a slow read is in flight long before it is needed.  Returns the number of
        hints given (files that cannot be opened are skipped: a hint is advice).
        """
        self.files.check_open()
        cdef const int64_t[::1] iv = _indices(indices)
        cdef size_t n = iv.shape[0], nreq, m = 0
        if n == 0 or window == 0 or self.files.remote is not None:  # no page cache to warm
            return 0
        cdef uint64_t *starts = <uint64_t *>PyMem_Malloc(n * sizeof(uint64_t))
        if starts is NULL:
            raise MemoryError()
        cdef lib.tl_ioreq *reqs = NULL
        try:
            reqs = self._window_reqs(iv, first, count, stride, window, starts)
            with nogil:
                nreq = lib.tl_rows_plan_many(&self.rs, starts, NULL, window, NULL, n, NULL, reqs)
                m = lib.tl_ioreq_hint(reqs, nreq, _fdcache())
        finally:
            PyMem_Free(reqs)
            PyMem_Free(starts)
        return m

    def hint_ranges(self, starts, lengths):
        """Advise the kernel that rows ``[starts[i], starts[i] + lengths[i])``
        (global row numbers, uint64) will be read soon, as ``hint_windows``
        does for windows.  Returns the number of hints given."""
        self.files.check_open()
        cdef const uint64_t[::1] sv = np.ascontiguousarray(starts, dtype=np.uint64)
        cdef const uint64_t[::1] lv = np.ascontiguousarray(lengths, dtype=np.uint64)
        cdef size_t n = sv.shape[0], i, nreq, m = 0
        if <size_t>lv.shape[0] != n:
            raise ValueError(f"{n} starts but {lv.shape[0]} lengths")
        i = _first_outside(sv, lv, self.total)
        if i < n:
            raise IndexError(f"rows [{sv[i]}, {sv[i] + lv[i]}) run past the "
                             f"{self.total} rows")
        if n == 0 or self.files.remote is not None:
            return 0
        nreq = lib.tl_rows_count_reqs(&self.rs, &sv[0], &lv[0], 0, n)
        cdef lib.tl_ioreq *reqs = <lib.tl_ioreq *>PyMem_Malloc((nreq + 1) * sizeof(lib.tl_ioreq))
        if reqs is NULL:
            raise MemoryError()
        try:
            with nogil:
                nreq = lib.tl_rows_plan_many(&self.rs, &sv[0], &lv[0], 0, NULL, n, NULL, reqs)
                m = lib.tl_ioreq_hint(reqs, nreq, _fdcache())
        finally:
            PyMem_Free(reqs)
        return m




cdef class RowSets:
    """Row sets of one row size read as one, each range from a set of its own.

    ``RowSets(sets).at(which)`` is a part's target for ``read_ranges``: range
    ``i`` of the part is in ``sets[which[i]]``.  A blend of plain documents reads
    every component's documents this way, as one part: one check and one plan
    for all of them, not one per component (a task of a blend of 1,000 sources
    touches hundreds).
    """

    def __cinit__(self, sets):
        sets = tuple(sets)
        if not sets:
            raise ValueError("RowSets needs at least one RowSet")
        for k, one in enumerate(sets):
            if not isinstance(one, RowSet):
                raise TypeError(f"sets[{k}] is a {type(one).__name__}, not a RowSet")
        sizes = sorted({(<RowSet>one).rs.row_bytes for one in sets})
        if len(sizes) != 1:
            raise ValueError(f"RowSets needs one row size, got {sizes} bytes")
        self.ptrs = <const lib.tl_rowset **>PyMem_Malloc(len(sets) * sizeof(lib.tl_rowset *))
        if self.ptrs is NULL:
            raise MemoryError()
        for k, one in enumerate(sets):
            self.ptrs[k] = &(<RowSet>one).rs
        self.sets = sets
        self.row_bytes = sizes[0]

    def __dealloc__(self):
        PyMem_Free(self.ptrs)

    def __len__(self):
        return len(self.sets)

    def at(self, which):
        """These sets as the target of a ``read_ranges`` part whose range ``i``
        is in set ``which[i]`` (checked with the part)."""
        return Gather(self, which)


cdef class Gather:
    """A ``read_ranges`` part's target: ``RowSets`` and each range's set."""

    def __cinit__(self, RowSets sets, which):
        self.sets = sets
        self.which = np.ascontiguousarray(which, dtype=np.int64)

    cdef tuple _checked(self, starts, lengths, dst_offsets, out, known):
        """As ``RowSet._checked``, each range against its own set, plus the
        sets the ranges use (a flag per set, as bytes)."""
        cdef const int64_t[::1] w = self.which
        sa = np.ascontiguousarray(starts, dtype=np.uint64)
        la = np.ascontiguousarray(lengths, dtype=np.uint64)
        da = np.ascontiguousarray(dst_offsets, dtype=np.uint64)
        if la.shape[0] != sa.shape[0] or da.shape[0] != sa.shape[0] or w.shape[0] != sa.shape[0]:
            raise ValueError("which, starts, lengths and dst_offsets must have the same length")
        dst = _out_bytes(out, self.sets.row_bytes, 0, False, "out") if known is None else known
        cdef const uint64_t[::1] sv = sa, lv = la, dv = da
        cdef size_t i, n = sv.shape[0], nsets = len(self.sets.sets)
        cdef uint64_t total, row_bytes = self.sets.row_bytes, size = dst.shape[0]
        used = bytearray(nsets)
        cdef unsigned char[::1] u = used
        cdef int64_t c
        for i in range(n):
            c = w[i]
            if c < 0 or <size_t>c >= nsets:
                raise IndexError(f"which[{i}] = {c} names no set of {nsets}")
            u[c] = 1
            total = self.sets.ptrs[c].cum[self.sets.ptrs[c].nfiles]
            if sv[i] > total or lv[i] > total - sv[i]:
                raise IndexError(
                    f"rows [{sv[i]}, {sv[i] + lv[i]}) of set {c} are not within [0, {total})")
            if lv[i] > size // row_bytes or dv[i] > size - lv[i] * row_bytes:
                raise ValueError("a destination range runs past the end of out")
        for i in range(nsets):
            if u[i]:
                (<RowSet>self.sets.sets[i]).files.check_open()
        return sa, la, da, dst, used

    cdef list _backends(self, used):
        cdef list got = []
        for k, one in enumerate(self.sets.sets):
            if used[k] and (<RowSet>one).files.backend not in got:
                got.append((<RowSet>one).files.backend)
        return got

    cdef bytearray _use(self, used, int backend):
        """The flags of the used sets of ``backend``."""
        use = bytearray(len(used))
        for k, one in enumerate(self.sets.sets):
            use[k] = used[k] and (<RowSet>one).files.backend == backend
        return use

    cdef FileSet _files(self, use):
        for k, one in enumerate(self.sets.sets):
            if use[k]:
                return (<RowSet>one).files
        raise AssertionError("no set of the backend")


def read_ranges(parts):
    """``RowSet.read`` of several row sets at once: one call into the I/O engine.

    ``parts`` is a list of ``(target, starts, lengths, dst_offsets, out)``: a
    ``RowSet`` target reads as ``RowSet.read`` takes its arguments; a
    ``RowSets.at(which)`` target reads range ``i`` from set ``which[i]``.  Every
    part is checked before any read.  The reads of every part are planned into
    one list and run in one engine call, with the reads in flight of all of
    them (a blend's components read together: one round of I/O where there were
    as many as components).  Files of different backends (an object store and
    local files) run in one call per backend.  A failure raises as
    ``RowSet.read`` does, naming the file of the range that failed.
    """
    cdef list checked = []
    cdef list backends = []
    cdef RowSet rs
    cdef Gather g
    cdef size_t nreq
    cdef uint64_t item = 0
    cdef const int64_t[::1] wv
    cdef const uint64_t[::1] sv, lv
    out = dst = None  # the parts of a blend share one out: its bytes are checked once
    for part in parts:
        target = part[0]
        if isinstance(target, Gather):
            g = target
            known = dst if part[4] is out and g.sets.row_bytes == item else None
            out, item = part[4], g.sets.row_bytes
            sa, la, da, dst, used = g._checked(part[1], part[2], part[3], out, known)
            if sa.shape[0] == 0:
                continue
            wv, sv, lv = g.which, sa, la
            nreq = lib.tl_rows_count_gather(g.sets.ptrs, &wv[0], NULL, &sv[0], &lv[0],
                                            sv.shape[0])
            checked.append((g, sa, la, da, dst, nreq, used))
            for b in g._backends(used):
                if b not in backends:
                    backends.append(b)
            continue
        rs = target
        known = dst if part[4] is out and rs.rs.row_bytes == item else None
        out, item = part[4], rs.rs.row_bytes
        sa, la, da, dst = rs._checked(part[1], part[2], part[3], out, known)
        if sa.shape[0] == 0:
            continue
        checked.append((rs, sa, la, da, dst, _count(rs, sa, la), None))
        if rs.files.backend not in backends:
            backends.append(rs.files.backend)
    for b in backends:
        _run_group(checked, b)


cdef size_t _count(RowSet rs, sa, la):
    cdef const uint64_t[::1] s = sa
    cdef const uint64_t[::1] l = la
    return lib.tl_rows_count_reqs(&rs.rs, &s[0], &l[0], 0, s.shape[0])


cdef _run_group(list checked, int backend):
    """One engine call for the ranges of ``checked`` in files of ``backend``."""
    cdef list group = []
    cdef size_t total = 0, m = 0, k, np_
    cdef FileSet files = None
    for c in checked:
        if c[6] is None:
            if (<RowSet>c[0]).files.backend != backend:
                continue
            use = None
            if files is None:
                files = (<RowSet>c[0]).files
        else:
            use = (<Gather>c[0])._use(c[6], backend)
            if not any(use):
                continue
            if files is None:
                files = (<Gather>c[0])._files(use)
        group.append((c, use))
        total += <size_t>c[5]
    np_ = len(group)
    cdef lib.tl_ioreq *reqs = <lib.tl_ioreq *>PyMem_Malloc(max(total, 1) * sizeof(lib.tl_ioreq))
    if reqs is NULL:
        raise MemoryError()
    cdef size_t *firsts = <size_t *>PyMem_Malloc((np_ + 1) * sizeof(size_t))
    if firsts is NULL:
        PyMem_Free(reqs)
        raise MemoryError()
    cdef RowSet rs
    cdef Gather g
    cdef const uint64_t[::1] s
    cdef const uint64_t[::1] l
    cdef const uint64_t[::1] d
    cdef const int64_t[::1] w
    cdef const unsigned char[::1] u
    cdef uint8_t[::1] dst
    cdef lib.tl_engine eng
    cdef lib.tl_io_error err
    cdef size_t failed = 0
    cdef int rc
    try:
        for k in range(np_):  # plan every part (cheap: arithmetic, with the GIL)
            c, use = group[k]
            s, l, d, dst = c[1], c[2], c[3], c[4]
            firsts[k] = m
            if use is None:
                rs = c[0]
                m += lib.tl_rows_plan_many(&rs.rs, &s[0], &l[0], 0, &d[0], s.shape[0],
                                           &dst[0] if dst.shape[0] else NULL, reqs + m)
            else:
                g = c[0]
                w, u = g.which, use
                m += lib.tl_rows_plan_gather(g.sets.ptrs, &w[0], &u[0], &s[0], &l[0], &d[0],
                                             s.shape[0], &dst[0] if dst.shape[0] else NULL,
                                             reqs + m)
        firsts[np_] = m
        files.engine_begin(&eng)
        with nogil:
            rc = lib.tl_engine_run(&eng, reqs, m, &err, &failed)
        files.engine_end(&eng)
        if rc:
            k = 0
            while k + 1 < np_ and firsts[k + 1] <= failed:
                k += 1
            c = group[k][0]
            i = reqs[failed].item
            sa, la = c[1], c[2]
            where = f"rows [{sa[i]}, {sa[i] + la[i]})"
            if c[6] is None:
                _raise_io(&err, (<RowSet>c[0]).files.paths, where)
            g = c[0]
            _raise_io(&err, (<RowSet>g.sets.sets[g.which[i]]).files.paths, where)
    finally:
        PyMem_Free(reqs)
        PyMem_Free(firsts)


def split_fields(rows, uint64_t nrows, uint64_t row_bytes, offsets, sizes, outs):
    """De-interleave ``nrows`` rows of a structured dtype into one array per field.

    ``rows`` is a buffer of ``nrows * row_bytes`` bytes; field f
    (``offsets[f]``, ``sizes[f]`` bytes) of each row goes to ``outs[f]``, a
    writable C-contiguous array of exactly ``nrows * sizes[f]`` bytes with
    items of ``sizes[f]`` bytes or of one byte.  Every out is checked (a
    ValueError names the first that does not fit) before any is written;
    then the fields are split without the GIL.
    """
    cdef const uint8_t[::1] src = np.frombuffer(rows, dtype=np.uint8) if not isinstance(
        rows, np.ndarray) else rows.reshape(-1).view(np.uint8)
    cdef const uint64_t[::1] off = np.ascontiguousarray(offsets, dtype=np.uint64)
    cdef const uint64_t[::1] siz = np.ascontiguousarray(sizes, dtype=np.uint64)
    cdef size_t nf = off.shape[0], f
    if src.shape[0] < (<object>nrows) * row_bytes:
        raise ValueError(f"rows holds {src.shape[0]} bytes, need {(<object>nrows) * row_bytes}")
    if siz.shape[0] != nf or len(outs) != nf:
        raise ValueError("offsets, sizes and outs must have the same length")
    cdef uint8_t[::1] view
    keep = []
    for f in range(nf):
        if (<object>off[f]) + siz[f] > row_bytes:
            raise ValueError(f"field {f} ({off[f]}+{siz[f]} bytes) overruns a {row_bytes}-byte row")
        keep.append(_out_bytes(outs[f], siz[f], (<object>nrows) * siz[f], True, f"outs[{f}]"))
    if nf == 0 or nrows == 0:
        return
    cdef uint8_t **dst = <uint8_t **>PyMem_Malloc(nf * sizeof(uint8_t *))
    if dst is NULL:
        raise MemoryError()
    try:
        for f in range(nf):
            view = keep[f]
            dst[f] = &view[0]
        with nogil:
            lib.tl_split_fields(&src[0], nrows, row_bytes, nf, &off[0], &siz[0], dst)
    finally:
        PyMem_Free(dst)
