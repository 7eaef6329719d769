"""The document index: each document's first row and length, and what is built
from it per batch without the GIL: documents read back to back or padded
(``read_documents``) and the document boundaries inside token windows
(``window_cuts``, then ``boundary_arrays``: ``csrc/tokload/bounds.h``)."""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cimport tokload._lib as lib
from tokload._io cimport (FileSet, _indices, _out_bytes, _raise_io, _window_starts,
                          _checked_window_starts)
from tokload._pack cimport token_arrays
from tokload._rows cimport RowSet
from tokload._tables cimport ShardTables

import numpy as np

from tokload.errors import CorruptDataError


cdef class ExtentIndex:
    """What the document indexes share: each document's first global row and
    length, read in one batch on the I/O engine (``read_documents`` uses
    it without a Python call per document)."""

    cdef FileSet _files(self):
        raise NotImplementedError

    cdef int fill(self, const uint64_t *ids, size_t n, uint64_t *starts,
                  uint64_t *lengths) except -1:
        """Extents of ids (checked: < total) into starts/lengths; raises on error."""
        raise NotImplementedError

    def extents(self, ids):
        """``(starts, lengths)``, uint64 arrays, for ids in ``[0, total)``."""
        self._files().check_open()
        cdef const uint64_t[::1] i = _checked_ids(ids, self.total, self._what())
        cdef size_t n = i.shape[0]
        starts = np.empty(n, dtype=np.uint64)
        lengths = np.empty(n, dtype=np.uint64)
        cdef uint64_t[::1] s = starts, l = lengths
        if n:
            self.fill(&i[0], n, &s[0], &l[0])
        return starts, lengths

    def _what(self):
        return "document"


def extents_many(tuple indexes, offsets, comp, index):
    """``(starts, lengths)`` (uint64) of document ``index[i] + offsets[comp[i]]``
    of ``indexes[comp[i]]`` (``ExtentIndex``) for every ``i``, as each index's
    ``extents`` gives them: the documents of a ``Blend``'s many components in one
    compiled call (grouped by component with a counting sort), where a call and
    a sort per component cost some 9 us each."""
    cdef size_t k = len(indexes), n, i, c, p, m
    cdef const int64_t[::1] cv = np.ascontiguousarray(comp, dtype=np.int64)
    cdef const int64_t[::1] iv = np.ascontiguousarray(index, dtype=np.int64)
    cdef const uint64_t[::1] ov = np.ascontiguousarray(offsets, dtype=np.uint64)
    n = cv.shape[0]
    if iv.shape[0] != n or ov.shape[0] != k:
        raise ValueError(f"{n} components, {iv.shape[0]} indices, {ov.shape[0]} offsets "
                         f"of {k} indexes")
    cdef uint64_t[::1] totals = np.empty(k, dtype=np.uint64)
    for c in range(k):
        totals[c] = (<ExtentIndex?>indexes[c]).total
    starts = np.empty(n, dtype=np.uint64)
    lengths = np.empty(n, dtype=np.uint64)
    if n == 0:
        return starts, lengths
    cdef uint64_t[::1] sv = starts, lv = lengths
    cdef size_t *first = <size_t *>PyMem_Malloc((2 * k + 1) * sizeof(size_t) + n * sizeof(size_t))
    cdef uint64_t *grouped = <uint64_t *>PyMem_Malloc(3 * n * sizeof(uint64_t))
    cdef size_t *at, *where
    cdef uint64_t doc
    cdef ExtentIndex idx
    try:
        if first is NULL or grouped is NULL:
            raise MemoryError()
        at = first + k + 1
        where = at + k
        for c in range(k + 1):
            first[c] = 0
        for i in range(n):
            if cv[i] < 0 or <size_t>cv[i] >= k:
                raise ValueError(f"component {cv[i]} is not in [0, {k})")
            first[cv[i] + 1] += 1
        for c in range(k):
            first[c + 1] += first[c]
            at[c] = first[c]
        for i in range(n):
            c = <size_t>cv[i]
            doc = <uint64_t>iv[i] + ov[c]
            if iv[i] < 0 or doc >= totals[c]:
                raise IndexError(f"document {iv[i]} of component {c} is out of range "
                                 f"[0, {totals[c] - ov[c]})")
            p = at[c]
            at[c] += 1
            grouped[p] = doc
            where[p] = i
        for c in range(k):
            m = first[c + 1] - first[c]
            if m:
                idx = <ExtentIndex>indexes[c]
                idx._files().check_open()
                idx.fill(grouped + first[c], m, grouped + n + first[c],
                         grouped + 2 * n + first[c])
        for p in range(n):
            sv[where[p]] = grouped[n + p]
            lv[where[p]] = grouped[2 * n + p]
    finally:
        PyMem_Free(first)
        PyMem_Free(grouped)
    return starts, lengths


cdef class DocIndex(ExtentIndex):
    """Per-shard document indexes: shard k's file holds ``docs_k + 1`` uint64
    row offsets.  ``extents(ids)`` gives each document's first global row and
    its length, reading 16 bytes per document, or, with ``in_memory``, from
    each shard's whole index, read once when a batch first needs it
    (``ShardTables``)."""

    cdef readonly FileSet files
    cdef readonly ShardTables tables
    cdef uint64_t[::1] _doc_cum
    cdef uint64_t[::1] _row_cum

    def __cinit__(self, FileSet files, docs, RowSet rows, bint in_memory=False):
        counts = np.asarray(docs, dtype=np.uint64)
        if len(counts) != files.nfiles or files.nfiles != rows.files.nfiles:
            raise ValueError("one document index per shard is needed")
        cum = np.zeros(len(counts) + 1, dtype=np.uint64)
        np.cumsum(counts, out=cum[1:])
        self.files = files
        self._doc_cum = cum
        self._row_cum = np.array(rows.cum)
        self.total = cum[len(counts)]
        # each table with its directory, to find a window's documents (window_cuts)
        self.tables = ShardTables(RowSet(files, counts + np.uint64(1), 8), in_memory,
                                  directory=np.diff(self._row_cum))

    cdef FileSet _files(self):
        return self.files

    cdef int fill(self, const uint64_t *ids, size_t n, uint64_t *starts,
                  uint64_t *lengths) except -1:
        cdef lib.tl_io_error err
        cdef lib.tl_engine eng
        cdef size_t failed = 0
        cdef int rc = 0
        cdef bint loading = False  # a table failed as it was loaded
        # one allocation: the requests, two index entries and a shard per document
        cdef char *mem = <char *>PyMem_Malloc(n * (sizeof(lib.tl_ioreq) + 16 + 4))
        if mem is NULL:
            raise MemoryError()
        cdef lib.tl_ioreq *reqs = <lib.tl_ioreq *>mem
        cdef uint64_t *ent = <uint64_t *>(mem + n * sizeof(lib.tl_ioreq))
        cdef uint32_t *shards = <uint32_t *>(mem + n * (sizeof(lib.tl_ioreq) + 16))
        cdef ShardTables tables = self.tables
        try:
            self.files.engine_begin(&eng)
            with nogil:
                if tables.enabled:
                    lib.tl_docs_shards(&self._doc_cum[0], self.files.nfiles, ids, n, shards)
                    rc = tables.need(&eng, shards, n, &err, &failed)
                    loading = rc != 0
                    if rc == 0:
                        lib.tl_docs_copy(&self._doc_cum[0], shards,
                                         <const uint64_t *const *>tables.tabs, ids, n, ent)
                    else:  # name a document of the shard whose index failed
                        for failed in range(n):
                            if shards[failed] == <uint32_t>err.file:
                                break
                else:
                    lib.tl_docs_plan(self.files.files, &self._doc_cum[0], self.files.nfiles, ids,
                                     n, ent, reqs)
                    rc = lib.tl_engine_run(&eng, reqs, n, &err, &failed)
                if rc == 0:
                    rc = lib.tl_docs_finish(self.files.files, &self._doc_cum[0],
                                            &self._row_cum[0], self.files.nfiles, ids, n,
                                            ent, starts, lengths, &err, &failed)
            self.files.engine_end(&eng)
            if rc == lib.TL_ERR_CORRUPT and loading:  # (a table is checked whole)
                _raise_io(&err, self.files.paths, "the document index")
            if rc:
                _raise_io(&err, self.files.paths,
                          f"the document index entry of document {ids[failed]}")
        finally:
            PyMem_Free(mem)
        return 0


cdef const uint64_t[::1] _checked_ids(ids, uint64_t total, str what) except *:
    a = np.asarray(ids)
    if a.dtype.kind not in "iu" and a.size:
        raise TypeError(f"{what} ids must be integers, got dtype {a.dtype}")
    a = np.ascontiguousarray(a.reshape(-1))
    if a.size and (a.min() < 0 or a.max() >= total):
        bad = a[(a < 0) | (a >= total)][0]
        raise IndexError(f"{what} {bad} is out of range [0, {total})")
    return a.astype(np.uint64, copy=False)



def window_cuts(ExtentIndex index not None, indices, uint64_t first, uint64_t count,
                uint64_t stride, uint64_t window, uint64_t total_rows):
    """Where documents start inside the windows of observations ``indices`` of a
    view of ``count`` windows of ``window`` rows, observation ``i`` starting at row
    ``(first + i) * stride`` (checked as ``RowSet.read_windows`` checks them; document
    0 must start at row 0): ``(starts, ncuts, cuts)``, uint64 arrays:
    each window's first row, how many documents start inside it after that row,
    and those documents' first rows, window after window.

    Finds them where the index is a tokload dataset's with its shards' tables
    held in memory, by a binary search of each table a window spans, in C;
    otherwise with a batched search of ``index`` (one ``fill`` of all active
    searches per round: a few rounds for documents of similar sizes, at most
    ``2 log2(documents)``) and one more ``fill`` for their first rows. A
    ``Blend`` of token streams gathers its components' cuts, row by row, and
    makes the arrays of the whole batch in one ``boundary_arrays``.
    """
    cdef const int64_t[::1] iv = _indices(indices)
    cdef size_t nwin = iv.shape[0], ns = 2 * nwin, i, na, j
    starts = np.empty(nwin, dtype=np.uint64)
    cdef uint64_t[::1] sw = starts
    if nwin:
        _checked_window_starts(iv, first, count, stride, window, total_rows, &sw[0])
    cdef const uint64_t[::1] r = sw
    cdef uint64_t ndocs = index.total
    if ndocs == 0:
        raise ValueError("the source has no documents")
    index._files().check_open()
    if isinstance(index, DocIndex) and (<DocIndex>index).tables.enabled and nwin:
        # the shards' indexes are held in memory: search them directly
        ncuts, cuts = _cuts_from_tables(<DocIndex>index, r, window)
        return starts, ncuts, cuts
    cdef lib.tl_bsearch *srch = <lib.tl_bsearch *>PyMem_Malloc(max(ns, 1) * sizeof(lib.tl_bsearch))
    cdef uint64_t *buf = <uint64_t *>PyMem_Malloc(max(ns, 1) * 4 * sizeof(uint64_t))
    if srch is NULL or buf is NULL:
        PyMem_Free(srch)
        PyMem_Free(buf)
        raise MemoryError()
    cdef uint64_t *probe = buf
    cdef uint64_t *firsts = buf + ns
    cdef uint64_t *length = buf + 2 * ns
    cdef uint64_t *act = buf + 3 * ns  # the searches still going, by number
    cdef unsigned rnd = 0
    cdef uint64_t total = 0, d
    cdef uint64_t[::1] nw, iw
    try:
        for i in range(nwin):
            lib.tl_bsearch_init(&srch[2 * i], r[i], ndocs, total_rows)
            lib.tl_bsearch_init(&srch[2 * i + 1], r[i] + window - 1, ndocs, total_rows)
        na = 0
        for i in range(ns):
            if srch[i].lo < srch[i].hi:
                act[na] = i
                na += 1
        while na:
            for j in range(na):
                probe[j] = lib.tl_bsearch_probe(&srch[act[j]], rnd)
            index.fill(probe, na, firsts, length)
            i = 0
            for j in range(na):
                if lib.tl_bsearch_step(&srch[act[j]], probe[j], firsts[j]):
                    act[i] = act[j]
                    i += 1
            na = i
            rnd += 1
        # the documents after each window's first, up to its last: their first rows
        ncuts = np.empty(nwin, dtype=np.uint64)
        nw = ncuts
        for i in range(nwin):
            if srch[2 * i + 1].lo < srch[2 * i].lo:  # first rows that decrease
                raise CorruptDataError(
                    f"the document index is not sorted by row: around row {r[i]}, document "
                    f"{srch[2 * i].lo} starts after document {srch[2 * i + 1].lo}"
                )
            nw[i] = srch[2 * i + 1].lo - srch[2 * i].lo
            total += nw[i]
        ids = np.empty(total, dtype=np.uint64)
        iw = ids
        j = 0
        for i in range(nwin):
            for d in range(srch[2 * i].lo + 1, srch[2 * i + 1].lo + 1):
                iw[j] = d
                j += 1
        cuts = index.extents(ids)[0] if total else np.empty(0, dtype=np.uint64)
    finally:
        PyMem_Free(srch)
        PyMem_Free(buf)
    return starts, ncuts, cuts


cdef tuple _cuts_from_tables(DocIndex index, const uint64_t[::1] r, uint64_t window):
    """The cuts of the windows at rows ``r`` from the shards' document indexes held
    in memory (loaded here for the shards the windows span): no search rounds."""
    cdef size_t nwin = r.shape[0], nfiles = index.files.nfiles
    cdef const uint64_t *row_cum = &index._row_cum[0]
    cdef ShardTables tables = index.tables
    if not tables.all_loaded():
        _load_tables(index, r, window)
    ncuts = np.empty(nwin, dtype=np.uint64)
    cdef uint64_t[::1] nv = ncuts
    cdef const uint64_t *const *tabs = <const uint64_t *const *>tables.tabs
    cdef uint64_t total
    with nogil:
        total = lib.tl_bounds_cuts_tables(row_cum, &index._doc_cum[0], nfiles, tabs, &r[0],
                                          nwin, window, &nv[0], NULL)
    cuts = np.empty(total, dtype=np.uint64)
    cdef uint64_t[::1] cv = cuts
    cdef uint64_t zero = 0
    with nogil:
        lib.tl_bounds_cuts_tables(row_cum, &index._doc_cum[0], nfiles, tabs, &r[0], nwin,
                                  window, &nv[0], &cv[0] if total else &zero)
    return ncuts, cuts


cdef int _load_tables(DocIndex index, const uint64_t[::1] r, uint64_t window) except -1:
    """Load the tables of the shards the windows at rows ``r`` span (at most a
    few each) that are not in memory yet, in one engine call."""
    cdef size_t nwin = r.shape[0], nfiles = index.files.nfiles, i, m = 0
    cdef const uint64_t *row_cum = &index._row_cum[0]
    cdef uint32_t k, k0, k1
    cdef lib.tl_engine eng
    cdef lib.tl_io_error err
    cdef size_t failed = 0
    cdef int rc = 0
    cdef ShardTables tables = index.tables
    for i in range(nwin):
        k0 = <uint32_t>lib.tl_shards_locate(row_cum, nfiles, r[i])
        k1 = <uint32_t>lib.tl_shards_locate(row_cum, nfiles, r[i] + window - 1)
        m += k1 - k0 + 1
    cdef uint32_t *sv = <uint32_t *>PyMem_Malloc(m * sizeof(uint32_t))
    if sv is NULL:
        raise MemoryError()
    try:
        m = 0
        for i in range(nwin):
            k0 = <uint32_t>lib.tl_shards_locate(row_cum, nfiles, r[i])
            k1 = <uint32_t>lib.tl_shards_locate(row_cum, nfiles, r[i] + window - 1)
            for k in range(k0, k1 + 1):
                sv[m] = k
                m += 1
        index.files.engine_begin(&eng)
        with nogil:
            rc = tables.need(&eng, sv, m, &err, &failed)
        index.files.engine_end(&eng)
    finally:
        PyMem_Free(sv)
    if rc:
        _raise_io(&err, index.files.paths, "a shard's document index")
    return 0


def boundary_arrays(starts, uint64_t window, ncuts, cuts, alloc,
                    per_token=("position_ids", "segment_ids", "loss_mask")):
    """The attention metadata of windows from their cuts (``window_cuts``, of one
    source, or gathered row by row from several: a ``Blend``'s), computed in C
    without the GIL: windows of ``window`` rows starting at rows ``starts``,
    window ``i`` with ``ncuts[i]`` documents starting inside it after its first
    row, at the next ``ncuts[i]`` rows of ``cuts`` (uint64 arrays).

    Returns ``(arrays, cu_seqlens, max_seqlen)``: ``arrays`` holds those of
    ``"position_ids"`` (int64), ``"segment_ids"`` (int32) and ``"loss_mask"``
    (bool) that ``per_token`` names, each ``[B, window]`` and allocated with
    ``alloc`` (the others are not computed); ``cu_seqlens`` is int64 over the
    flattened batch (``split_cu_seqlens`` makes each step's int32 one). ``CorruptDataError`` where a window's cuts are not
    increasing rows inside it (an index not sorted by row)."""
    cdef const uint64_t[::1] r = np.ascontiguousarray(starts, dtype=np.uint64)
    cdef const uint64_t[::1] nv = np.ascontiguousarray(ncuts, dtype=np.uint64)
    cuts = np.ascontiguousarray(cuts, dtype=np.uint64)
    cdef const uint64_t[::1] cv = cuts
    if window == 0:
        raise ValueError("window must be positive")
    if nv.shape[0] != r.shape[0]:
        raise ValueError(f"{r.shape[0]} windows, {nv.shape[0]} counts of cuts")
    cdef uint64_t want = 0
    cdef size_t i
    for i in range(nv.shape[0]):
        want += nv[i]
    if want != <uint64_t>cv.shape[0]:
        raise ValueError(f"the counts of cuts add up to {want}, and there are {cv.shape[0]} cuts")
    cdef size_t nwin = r.shape[0]
    cdef size_t total = cv.shape[0]
    cdef int64_t *pp
    cdef int32_t *sp
    cdef uint8_t *mp
    arrays = token_arrays(nwin, window, alloc, per_token, &pp, &sp, &mp)
    cu = np.empty(total + nwin + 1, dtype=np.int64)
    cdef int64_t[::1] cuv = cu
    cdef uint64_t longest = 0
    cdef size_t k = 0, bad = 0
    cdef uint64_t zero = 0
    if nwin:
        with nogil:
            k = lib.tl_bounds_fill(&r[0], &cv[0] if total else &zero, &nv[0], nwin, window,
                                   pp, sp, mp, &cuv[0], &longest, &bad)
        if k == 0:
            raise CorruptDataError(
                f"the document index is not sorted by row: the documents that start in "
                f"the window at row {r[bad]} are out of order"
            )
    else:
        cu[0] = 0
        k = 1
    return arrays, cu[:k], int(longest)


def split_cu_seqlens(cu, cuts, uint64_t window):
    """Each step's ``cu_seqlens`` from those of all the steps' rows at once.

    ``cu`` (int64: a task may hold more tokens than int32 numbers) holds the
    segments' starts over the flattened rows of ``window`` tokens, then their
    total; every row starts a segment, so step ``k``'s rows ``[a, e)``
    (``cuts``, consecutive from 0) are the entries from ``a * window`` to
    ``e * window``, less ``a * window``. Returns the steps' arrays back to back
    (int32), where each begins (``len(cuts) + 1`` offsets, int64) and each
    step's longest segment (int64; 0 for a step without rows), computed in C.
    ValueError when a step holds more than 2**31 - 1 tokens (its
    ``cu_seqlens``, int32 as attention kernels take them, cannot number them).
    """
    cdef const int64_t[::1] cv = np.ascontiguousarray(cu, dtype=np.int64)
    # (no negative indices here: this module is compiled with wraparound off)
    first = np.array([a for a, _ in cuts] + [cuts[len(cuts) - 1][1] if cuts else 0],
                     dtype=np.int64)
    cdef const int64_t[::1] fv = first
    cdef size_t nsteps = len(cuts), ncu = cv.shape[0], bad = 0
    out = np.empty(ncu + nsteps, dtype=np.int32)
    offsets = np.empty(nsteps + 1, dtype=np.int64)
    longest = np.empty(nsteps, dtype=np.int64)
    cdef int32_t[::1] ov = out
    cdef int64_t[::1] offv = offsets
    cdef int64_t[::1] lv = longest
    cdef int ok = 0
    if ncu and nsteps:
        ok = lib.tl_bounds_split(&cv[0], ncu, &fv[0], nsteps, window, &ov[0], &offv[0], &lv[0],
                                 &bad)
    if ok < 0:
        a, e = cuts[bad]
        raise ValueError(step_tokens_error(e - a, window))
    if not ok:
        raise ValueError(f"cu_seqlens {np.asarray(cv)[:8].tolist()}... do not fit rows "
                         f"{first.tolist()[:8]}... of {window} tokens")
    return out[: offsets[nsteps]], offsets, longest


def step_tokens_error(rows, window):
    """What is wrong with a step of ``rows`` rows of ``window`` tokens whose
    ``cu_seqlens`` (int32) cannot number its tokens."""
    return (f"a step of {rows:,} rows of {window:,} tokens holds {rows * window:,} tokens, "
            "more than the 2**31 - 1 that cu_seqlens (int32) numbers: take fewer rows per "
            "step or a shorter window")


def read_documents(ExtentIndex index not None, RowSet rows not None, ids, uint64_t first, uint64_t count, dtype,
                   bint pack, length, bytes pad, alloc):
    """Documents ``first + ids[b]`` of ``index`` as one batch, in one call.

    Ids are checked (``0 <= ids[b] < count``) in a compiled loop; the index
    entries are read in one batch, the outputs are made with ``alloc``, and
    the padding and the rows' reads run without the GIL.

    ``pack``: returns ``(values, lengths, offsets)``: the documents back to
    back (``[sum of lengths]``), their lengths (int64, ``B``) and offsets
    (int64, ``B + 1``).  Otherwise returns ``(values, lengths)``: ``[B, L]``
    rows, ``L`` = ``length``, or the longest document (at least 1) when
    ``length`` is None; longer documents are truncated, rows past a
    document's length hold ``pad`` (one row's bytes, repeated).
    """
    index._files().check_open()
    rows.files.check_open()
    cdef const int64_t[::1] iv = _indices(ids)
    cdef size_t n = iv.shape[0], b
    cdef uint64_t rb = rows.rs.row_bytes, L = 0, total = 0, longest = 0
    if not pack:
        if length is not None and length < 1:
            raise ValueError(f"length must be positive, got {length}")
        if <uint64_t>len(pad) != rb:
            raise ValueError(f"pad must be one row ({rb} bytes), got {len(pad)}")
    if count and first + count > index.total:
        raise IndexError(f"documents up to {first + count} are past the {index.total} documents")
    # per document: global id, first row, length, destination byte
    cdef uint64_t *mem = <uint64_t *>PyMem_Malloc(max(n, 1) * 4 * sizeof(uint64_t))
    if mem is NULL:
        raise MemoryError()
    cdef uint64_t *gid = mem
    cdef uint64_t *st = mem + n
    cdef uint64_t *ln = mem + 2 * n
    cdef uint64_t *dof = mem + 3 * n
    cdef lib.tl_ioreq *reqs = NULL
    cdef lib.tl_engine eng
    cdef lib.tl_io_error err
    cdef size_t failed = 0, nreq, m
    cdef int rc
    cdef int64_t[::1] lv, ov
    cdef uint8_t[::1] dst
    cdef uint8_t *dptr = NULL
    cdef const uint8_t *pp = pad
    try:
        _window_starts(iv, first, count, 1, gid)
        if n:
            index.fill(gid, n, st, ln)
        for b in range(n):  # the index and the rows are checked against each other
            if st[b] > rows.total or ln[b] > rows.total - st[b]:
                raise CorruptDataError(
                    f"{index._files().paths[0] if index._files().paths else '?'}: document "
                    f"{gid[b]} spans rows [{st[b]}, {st[b] + ln[b]}), past the {rows.total} rows")
        lengths = alloc((n,), np.int64)
        lv = lengths
        if pack:
            offsets = alloc((n + 1,), np.int64)
            ov = offsets
            ov[0] = 0
            for b in range(n):
                dof[b] = total * rb
                total += ln[b]
                lv[b] = <int64_t>ln[b]
                ov[b + 1] = <int64_t>total
            values = alloc((total,), dtype)
        else:
            for b in range(n):
                if ln[b] > longest:
                    longest = ln[b]
            L = <uint64_t>length if length is not None else (longest if longest else 1)
            for b in range(n):
                if ln[b] > L:
                    ln[b] = L
                lv[b] = <int64_t>ln[b]
                dof[b] = b * L * rb
            total = n * L
            values = alloc((n, L), dtype)
        if total:
            # alloc's array is filled in place: one that is not C-contiguous is refused
            # (a reshape would copy it, and the copy would be filled instead)
            dst = _out_bytes(values, rb, total * rb, True, "the alloc'd values array")
            dptr = &dst[0]
        nreq = lib.tl_rows_count_reqs(&rows.rs, st, ln, 0, n)
        reqs = <lib.tl_ioreq *>PyMem_Malloc(max(nreq, 1) * sizeof(lib.tl_ioreq))
        if reqs is NULL:
            raise MemoryError()
        rows.files.engine_begin(&eng)
        with nogil:
            if not pack:
                for b in range(n):
                    lib.tl_fill_rows(dptr + dof[b] + ln[b] * rb, L - ln[b], pp, rb)
            m = lib.tl_rows_plan_many(&rows.rs, st, ln, 0, dof, n, dptr, reqs)
            rc = lib.tl_engine_run(&eng, reqs, m, &err, &failed)
        rows.files.engine_end(&eng)
        if rc:
            b = reqs[failed].item
            _raise_io(&err, rows.files.paths, f"rows [{st[b]}, {st[b] + ln[b]})")
    finally:
        PyMem_Free(reqs)
        PyMem_Free(mem)
    if pack:
        return values, lengths, offsets
    return values, lengths
