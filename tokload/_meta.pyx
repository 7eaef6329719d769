"""The metadata of a batch of token windows, assembled in one compiled call.

The one job of this module is to bind ``csrc/tokload/spans.h``: for a batch of
windows of a dataset whose metadata is a per-shard span table (FORMAT.md,
version 2), it reads the windows' rows and fills the per-row positions into
the batch's list of distinct records, and returns the records as one byte
buffer plus offsets.  One call crosses into C per batch: the five planning
steps of ``spans.h`` and their four dependent rounds of reads on the I/O
engine (the rows go in flight with the first) run in one ``with nogil``
block, in scratch memory reused from batch to batch.  The Python work of a
batch does not depend on the number of windows, runs or records.
"""

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyBuffer_Release,
                              PyObject_GetBuffer)
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcmp, memcpy, memset

cimport numpy as cnp

cimport tokload._lib as lib
from tokload._io cimport _checked_window_starts, _indices, _layout, _raise_io
from tokload._rows cimport RowSet
from tokload._tables cimport ShardTables

import numpy as np

from tokload.errors import CorruptDataError

cnp.import_array()

SPAN_NONE = lib.TL_SPAN_NONE
SPAN_ENTRY = lib.TL_SPAN_ENTRY
SPAN_DTYPE = np.dtype([("start", "<u8"), ("record", "<u4")])
"""One span table entry as stored (12 packed bytes)."""


# ---- scratch memory ---------------------------------------------------------

cdef struct Buf:
    char *p
    size_t cap  # bytes


cdef int _grow(Buf *b, size_t nbytes) noexcept nogil:
    """Make ``b`` hold at least ``nbytes`` (growing by half at least); 0, or -1
    when out of memory (``b`` unchanged)."""
    cdef size_t cap
    cdef char *p
    if nbytes <= b.cap:
        return 0
    cap = b.cap + b.cap // 2
    if cap < nbytes:
        cap = nbytes
    if cap < 256:
        cap = 256
    p = <char *>realloc(b.p, cap)
    if p == NULL:
        return -1
    b.p = p
    b.cap = cap
    return 0


# The buffers of a Scratch, by use.
cdef enum:
    B_STARTS      # uint64 per window: first global row
    B_PIECES      # tl_span_piece per piece
    B_QSTART      # uint64 per request: first unit (global)
    B_QLEN        # uint64 per request: units
    B_QDST        # uint64 per request: destination byte
    B_REQS        # tl_ioreq per engine request
    B_BLOCKS      # uint64 block index entries
    B_RUNS        # TL_SPAN_ENTRY bytes per run
    B_HKEYS       # uint64 per hash slot
    B_HVALS       # int64 per hash slot
    B_ISHARD      # uint32 per record: shard
    B_IID         # uint32 per record: id in its shard
    B_IENT        # uint64 per record: its first index entry in B_ENTRIES
    B_ENTRIES     # uint64 record index entries
    B_OFFSETS     # int64 per record + 1
    B_AT          # uint64 per piece: its blocks' place in B_BLOCKBUF (layout "blocks")
    B_BLOCKBUF    # the pieces' metadata blocks (layout "blocks")
    B_ISRC        # uint64 per record: its bytes' place in B_BLOCKBUF
    B_ILEN        # uint64 per record: its bytes
    B_PSHARD      # uint32 per piece: its shard
    B_SEEN_KEY    # uint32 per slot of the block-local set
    B_SEEN_VAL    # uint32 per slot
    B_SEEN_GEN    # uint32 per slot
    B_PRANGE      # 3 uint64 per piece: its records' range, and whether it stands alone
    B_ORDER       # tl_block_range per piece
    B_BATCH       # 3 uint64 per batch of windows: its records, their bytes, its first record
    B_INFO        # tl_block_info per block read (at its piece's blk)
    NBUF


cdef class Scratch:
    """Working memory of the span and block readers (``SpanSet.read_windows``,
    ``BlockSet.read_window_batches``, ``BlockSet.hint_windows``), reused
    across batches.

    One per thread: the loader's reader threads each keep their own.  It
    grows to the largest batch seen and is freed with the object.
    """

    cdef Buf b[NBUF]
    cdef lib.tl_block_seen seen  # over B_SEEN_*

    def __cinit__(self):
        memset(self.b, 0, sizeof(self.b))
        memset(&self.seen, 0, sizeof(self.seen))

    def __dealloc__(self):
        cdef int i
        for i in range(NBUF):
            free(self.b[i].p)
            self.b[i].p = NULL

    def nbytes(self):
        """Bytes held now."""
        cdef int i
        return sum(self.b[i].cap for i in range(NBUF))


# ---- one batch, without the GIL ---------------------------------------------

# What failed (Outcome.fail).
cdef enum:
    FAIL_NONE
    FAIL_MEMORY
    FAIL_SPAN
    FAIL_IO

# The rounds of reads, for errors: which files, what was read.
cdef enum:
    R_ROWS
    R_BLOCKS
    R_RUNS
    R_INDEX
    R_DATA

_ROUND_WHAT = ("", "the span table block index", "the span table",
               "the metadata record index", "the metadata records")


cdef struct Outcome:
    int fail
    int round            # FAIL_IO: R_*
    size_t item          # FAIL_IO: the failing request's item (a window for R_ROWS)
    lib.tl_io_error io
    lib.tl_span_error span
    size_t nitems        # records of the batch
    uint64_t nbytes      # their bytes
    size_t nreq          # the unit requests of their read, left in B_Q*


cdef inline lib.tl_span_reqs _reqs(Buf *b) noexcept nogil:
    cdef lib.tl_span_reqs q
    q.start = <uint64_t *>b[B_QSTART].p
    q.len = <uint64_t *>b[B_QLEN].p
    q.dst = <uint64_t *>b[B_QDST].p
    return q


cdef int _grow_reqs(Buf *b, size_t n) noexcept nogil:
    """Room for n unit requests (start, len, dst)."""
    return (_grow(&b[B_QSTART], n * 8) or _grow(&b[B_QLEN], n * 8)
            or _grow(&b[B_QDST], n * 8))


cdef int _round(const lib.tl_engine *eng, const lib.tl_rowset *rs, size_t n, uint8_t *dst,
                Buf *b, size_t before, int rnd, Outcome *o) noexcept nogil:
    """Run the ``n`` unit requests of B_Q* on ``rs`` into ``dst``, after the
    ``before`` engine requests already at the head of B_REQS (they go in
    flight together).  0, or -1 with ``o`` filled."""
    cdef lib.tl_span_reqs q = _reqs(b)
    cdef size_t m = lib.tl_rows_count_reqs(rs, q.start, q.len, 0, n), failed = 0
    cdef lib.tl_ioreq *reqs
    cdef int rc
    if _grow(&b[B_REQS], (before + m) * sizeof(lib.tl_ioreq)):
        o.fail = FAIL_MEMORY
        return -1
    reqs = <lib.tl_ioreq *>b[B_REQS].p
    m = lib.tl_rows_plan_many(rs, q.start, q.len, 0, q.dst, n, dst, reqs + before)
    rc = lib.tl_engine_run(eng, reqs, before + m, &o.io, &failed)
    if rc:
        o.fail = FAIL_IO
        o.round = R_ROWS if failed < before else rnd
        o.item = reqs[failed].item
        return -1
    return 0


cdef int _batch(const lib.tl_span_set *s, const lib.tl_rowset *sets, const lib.tl_engine *eng,
                const lib.tl_rowset *rows, uint8_t *rows_dst, size_t nwin, uint64_t window,
                int32_t *pos, Buf *b, Outcome *o) noexcept nogil:
    """Rows (into ``rows_dst`` unless NULL) and metadata of the windows whose
    first rows are B_STARTS[0..nwin), but the records' bytes.  ``sets``: the
    .msx, .mds, .mdx and .mdb row sets.  Leaves the records' offsets in
    B_OFFSETS and the read of their bytes (``o.nreq`` requests) in B_Q*, for
    the caller to run into the batch's buffer.  0, or -1 with ``o`` filled."""
    cdef const uint64_t *starts = <uint64_t *>b[B_STARTS].p
    cdef lib.tl_span_reqs q = _reqs(b)  # not touched while counting
    cdef lib.tl_span_piece *pieces
    cdef size_t npieces = 0, nrow = 0, nreq, nitems = 0
    cdef uint64_t nblk, nruns = 0, hcap = 1
    cdef lib.tl_ioreq *reqs
    cdef int64_t *off
    o.fail = FAIL_NONE
    # 1: pieces, their block index entries, and the rows
    nblk = lib.tl_spans_pieces(s, starts, nwin, window, NULL, q, &npieces)
    if rows_dst != NULL:
        nrow = lib.tl_rows_count_reqs(rows, starts, NULL, window, nwin)
    if (_grow(&b[B_PIECES], npieces * sizeof(lib.tl_span_piece)) or _grow_reqs(b, npieces)
            or _grow(&b[B_BLOCKS], nblk * 8)
            or _grow(&b[B_REQS], nrow * sizeof(lib.tl_ioreq))):
        o.fail = FAIL_MEMORY
        return -1
    pieces = <lib.tl_span_piece *>b[B_PIECES].p
    lib.tl_spans_pieces(s, starts, nwin, window, pieces, _reqs(b), &npieces)
    if rows_dst != NULL:
        reqs = <lib.tl_ioreq *>b[B_REQS].p
        nrow = lib.tl_rows_plan_many(rows, starts, NULL, window, NULL, nwin, rows_dst, reqs)
    if _round(eng, &sets[0], npieces, <uint8_t *>b[B_BLOCKS].p, b, nrow, R_BLOCKS, o):
        return -1
    # 2: the span table slices
    if lib.tl_spans_runs(s, pieces, npieces, <uint64_t *>b[B_BLOCKS].p, _reqs(b), &nruns,
                         &o.span):
        o.fail = FAIL_SPAN
        return -1
    if _grow(&b[B_RUNS], (nruns if nruns else 1) * lib.TL_SPAN_ENTRY):
        o.fail = FAIL_MEMORY
        return -1
    if _round(eng, &sets[1], npieces, <uint8_t *>b[B_RUNS].p, b, 0, R_RUNS, o):
        return -1
    # 3: positions and the distinct records
    while hcap < 2 * (nruns if nruns else 1):
        hcap *= 2
    if (_grow(&b[B_HKEYS], hcap * 8) or _grow(&b[B_HVALS], hcap * 8)
            or _grow(&b[B_ISHARD], nruns * 4 + 4) or _grow(&b[B_IID], nruns * 4 + 4)):
        o.fail = FAIL_MEMORY
        return -1
    if lib.tl_spans_resolve(s, pieces, npieces, <uint8_t *>b[B_RUNS].p, pos,
                            <uint64_t *>b[B_HKEYS].p, <int64_t *>b[B_HVALS].p, hcap,
                            <uint32_t *>b[B_ISHARD].p, <uint32_t *>b[B_IID].p, &nitems,
                            &o.span):
        o.fail = FAIL_SPAN
        return -1
    o.nitems = nitems
    o.nbytes = 0
    if _grow(&b[B_OFFSETS], (nitems + 1) * 8):
        o.fail = FAIL_MEMORY
        return -1
    off = <int64_t *>b[B_OFFSETS].p
    off[0] = 0
    if nitems == 0:
        return 0
    # 4: the records' index entries
    if (_grow(&b[B_IENT], nitems * 8) or _grow(&b[B_ENTRIES], 2 * nitems * 8)
            or _grow_reqs(b, nitems)):
        o.fail = FAIL_MEMORY
        return -1
    nreq = lib.tl_spans_plan_index(s, <uint32_t *>b[B_ISHARD].p, <uint32_t *>b[B_IID].p,
                                   nitems, <uint64_t *>b[B_IENT].p, _reqs(b))
    if _round(eng, &sets[2], nreq, <uint8_t *>b[B_ENTRIES].p, b, 0, R_INDEX, o):
        return -1
    # 5: the records' bytes
    if lib.tl_spans_plan_data(s, <uint32_t *>b[B_ISHARD].p, <uint32_t *>b[B_IID].p, nitems,
                              <uint64_t *>b[B_IENT].p, <uint64_t *>b[B_ENTRIES].p, off,
                              _reqs(b), &nreq, &o.span):
        o.fail = FAIL_SPAN
        return -1
    o.nbytes = <uint64_t>off[nitems]
    o.nreq = nreq
    return 0


cdef object _NP_EMPTY = np.empty


cdef object _new(object alloc, int nd, cnp.npy_intp *dims, int typenum, object dtype):
    """``alloc(shape, dtype)`` (``nd``: 1 or 2 dimensions ``dims``; ``typenum``:
    NumPy's number of ``dtype``).  With ``np.empty``, the views' default, it
    is NumPy's C call instead: about 60 ns where a call through Python takes
    about 160, and a batch makes three arrays (positions, records' bytes and
    offsets)."""
    if alloc is _NP_EMPTY:
        return cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    if nd == 1:
        return alloc((dims[0],), dtype)
    return alloc((dims[0], dims[1]), dtype)


cdef object _bytes(object alloc, uint64_t n):
    """``n`` bytes from ``alloc``; an empty buffer is a plain array (a tensor of no
    bytes may have no data pointer, so the loader copies it instead)."""
    cdef cnp.npy_intp d = <cnp.npy_intp>n
    return _new(alloc if n else _NP_EMPTY, 1, &d, cnp.NPY_UINT8, np.uint8)


cdef int _check_batch(size_t nwin, uint64_t window, uint64_t row_bytes) except -1:
    """ValueError when ``nwin`` windows of ``window`` rows (``row_bytes`` each,
    and 4 bytes of positions) are past what a batch can address."""
    cdef uint64_t cells = nwin * window
    cdef uint64_t unit = row_bytes if row_bytes > 4 else 4  # int32 positions
    if window and (cells // window != nwin or cells > (<uint64_t>1 << 60) // unit):
        raise ValueError(f"{nwin} windows of {window} rows is too large a batch")
    return 0


cdef object _positions(object positions, object alloc, size_t nwin, uint64_t window,
                       uint64_t row_bytes):
    """``positions``, or when None a new ``[nwin, window]`` int32 array from
    ``alloc`` (the batch's size checked first)."""
    if positions is not None:
        return positions
    _check_batch(nwin, window, row_bytes)
    cdef cnp.npy_intp dims[2]
    dims[0] = <cnp.npy_intp>nwin
    dims[1] = <cnp.npy_intp>window
    return _new(alloc, 2, dims, cnp.NPY_INT32, np.int32)


cdef struct Windows:
    size_t nwin
    int32_t *pos   # their positions
    uint8_t *dst   # their rows' destination, or NULL
    Py_buffer pos_view  # positions and out, held until _release_windows
    Py_buffer dst_view
    bint held_pos, held_dst


cdef int _acquire(obj, Py_buffer *v, uint64_t nbytes, bint int32, str what,
                  uint64_t item=0) except -1:
    """Hold ``obj``'s memory in ``v`` (PyBuffer_Release gives it back): a
    writable C-contiguous buffer of at least ``nbytes`` bytes, exactly that
    many of int32 items, aligned to 4 bytes, when ``int32``; with ``item``,
    of plain items of ``item`` bytes or of single bytes.  Held, it cannot
    move or shrink while C writes into it without the GIL; cheaper than a
    typed memoryview (a batch takes four).  ValueError (TypeError for an object that is no
    buffer) names ``what`` and what was given when it does not fit: a copy
    made to fit would be filled in its place."""
    try:
        PyObject_GetBuffer(obj, v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS
                           | (PyBUF_FORMAT if int32 else 0))
    except TypeError:
        raise TypeError(f"{what} must be a writable buffer such as a NumPy array, "
                        f"got {type(obj).__name__}") from None
    except (BufferError, ValueError) as e:
        flags = getattr(obj, "flags", None)
        got = (f", got {_layout(obj)}" if flags is not None and not flags.c_contiguous
               else "")
        raise ValueError(f"{what} must be a writable C-contiguous buffer: {e}{got}") from None
    if item and (v.itemsize != <Py_ssize_t>item and v.itemsize != 1
                 or isinstance(obj, np.ndarray) and obj.dtype.hasobject):
        PyBuffer_Release(v)
        dt = getattr(obj, "dtype", f"items of {v.itemsize} bytes")
        raise ValueError(f"{what} must have plain items of {item} bytes or of 1 byte, "
                         f"got {dt}")
    cdef const char *f = v.format
    if f != NULL and f[0] == b"=":  # NumPy's format of an int32 array off its alignment: "=i"
        f += 1
    cdef bint ok = not int32 or (v.itemsize == 4 and f != NULL and f[0] == b"i" and f[1] == 0)
    cdef uintptr_t addr = <uintptr_t>v.buf
    cdef bint aligned = not int32 or addr % 4 == 0
    cdef uint64_t n = <uint64_t>v.len
    if ok and aligned and n >= nbytes and (not int32 or n == nbytes):
        return 0
    PyBuffer_Release(v)
    if not ok:
        raise ValueError(f"{what} must be int32, got {getattr(obj, 'dtype', type(obj))}")
    if not aligned:
        raise ValueError(f"{what} must be aligned to 4 bytes (int32); its address is "
                         f"{addr % 4} past a multiple of 4")
    raise ValueError(f"{what} holds {n} bytes, need {nbytes}")


cdef int _window_args(RowSet rows, const int64_t[::1] iv, uint64_t first, uint64_t count,
                      uint64_t stride, uint64_t window, out, positions, Buf *b,
                      Windows *w) except -1:
    """Check the arguments of a ``read_windows`` and put the windows' first
    rows in B_STARTS.  ``w`` holds ``positions`` and ``out`` (unless None)
    and points into them: give them back with _release_windows, also when
    this raises.  Returns 1 when there is nothing to read, else 0."""
    w.nwin = iv.shape[0]
    w.pos = NULL
    w.dst = NULL
    w.held_pos = w.held_dst = False
    _check_batch(w.nwin, window, rows.rs.row_bytes)
    cdef uint64_t cells = w.nwin * window
    _acquire(positions, &w.pos_view, cells * 4, True, "positions")
    w.held_pos = True
    w.pos = <int32_t *>w.pos_view.buf
    if out is not None:
        _acquire(out, &w.dst_view, cells * rows.rs.row_bytes, False, "out", rows.rs.row_bytes)
        w.held_dst = True
        w.dst = <uint8_t *>w.dst_view.buf
    if w.nwin == 0 or window == 0:
        return 1
    if _grow(&b[B_STARTS], w.nwin * 8):
        raise MemoryError()
    _checked_window_starts(iv, first, count, stride, window, rows.total,
                           <uint64_t *>b[B_STARTS].p)
    return 0


cdef void _release_windows(Windows *w) noexcept:
    """Give back what _window_args holds (whatever it got to)."""
    if w.held_pos:
        PyBuffer_Release(&w.pos_view)
        w.held_pos = False
    if w.held_dst:
        PyBuffer_Release(&w.dst_view)
        w.held_dst = False


cdef tuple _record_arrays(object alloc, Buf *b, size_t nitems, uint64_t nbytes, size_t at=0):
    """The batch's ``(data, offsets)`` made with ``alloc``: the offsets from
    B_OFFSETS[at:] (all 0 when there are no records), ``data`` to be filled."""
    cdef cnp.npy_intp m = <cnp.npy_intp>(nitems + 1)
    offsets = _new(alloc, 1, &m, cnp.NPY_INT64, np.int64)
    cdef Py_buffer v
    _acquire(offsets, &v, (nitems + 1) * 8, False, "offsets")  # written with the GIL held
    if nitems:
        memcpy(v.buf, <int64_t *>b[B_OFFSETS].p + at, (nitems + 1) * 8)  # 8 bytes a record
    else:
        (<int64_t *>v.buf)[0] = 0
    PyBuffer_Release(&v)
    return _bytes(alloc, nbytes), offsets


cdef class SpanSet:
    """The span tables and records of a dataset's shards (FORMAT.md, version 2).

    Args:
        rows: the dataset's rows (read together with the metadata).
        block_files, run_files, index_files, data_files: FileSets of the
            shards' ``.msx``, ``.mds``, ``.mdx`` and ``.mdb`` files.
        runs, records, data_bytes: per shard, from the manifest.
        block: rows per block index entry.
    """

    cdef readonly RowSet rows, blocks_rs, runs_rs, index_rs, data_rs
    cdef readonly uint64_t block
    cdef uint64_t[::1] _row_cum
    cdef lib.tl_span_set s
    cdef lib.tl_rowset sets[4]
    cdef list _paths

    def __cinit__(self, RowSet rows, block_files, run_files, index_files, data_files, runs,
                  records, data_bytes, uint64_t block):
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
        self.s.row_cum = &self._row_cum[0]
        # Each RowSet keeps its cumulative counts alive as long as this object.
        self.s.msx_cum = self.blocks_rs.rs.cum
        self.s.mds_cum = self.runs_rs.rs.cum
        self.s.mdx_cum = self.index_rs.rs.cum
        self.s.mdb_cum = self.data_rs.rs.cum
        self.s.nfiles = n
        self.s.block = block
        self.sets[0] = self.blocks_rs.rs
        self.sets[1] = self.runs_rs.rs
        self.sets[2] = self.index_rs.rs
        self.sets[3] = self.data_rs.rs
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
        if e.code == lib.TL_SPAN_BAD_HOLD:
            return CorruptDataError(
                f"{self._paths[0][k]}: a block index value names span table entry "
                f"{e.entry - 1} for row {e.limit}, but entry {e.entry} starts at row "
                f"{e.value}, at or before it (the value is too small)")
        return CorruptDataError(
            f"{self._paths[0][k]}: the block index names span table entries that do not cover "
            f"row {e.limit} (entry {e.entry} starts at row {e.value})")

    def read_windows(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                     uint64_t window, out, positions, alloc, Scratch scratch not None):
        """Rows and metadata of windows of observations ``indices``, in one call.

        Observation ``i`` (``0 <= i < count``) is rows ``[(first + i) * stride,
        (first + i) * stride + window)``, as for ``RowSet.read_windows``.  Its
        rows land at byte ``b * window * row_bytes`` of ``out`` (skipped when
        ``out`` is None).  Fills ``positions`` (``[B, window]`` int32,
        C-contiguous; None: made with ``alloc``): the index of each row's
        record in the batch's list of distinct records (in order of first
        appearance), or -1.  Returns ``(positions, data, offsets)``, the last
        two allocated with ``alloc``: ``data`` (uint8) holds the records back
        to back, record ``k`` is ``data[offsets[k]:offsets[k + 1]]``
        (``offsets``: int64, one more than the records).

        Everything runs in C without the GIL: the rows and the block index
        entries are read together, then the span table slices, the records'
        index entries and their bytes, each round one batched, coalesced read.
        """
        cdef RowSet r
        for r in (self.rows, self.blocks_rs, self.runs_rs, self.index_rs, self.data_rs):
            r.files.check_open()
        cdef Buf *b = scratch.b
        cdef Windows w
        cdef const int64_t[::1] iv = _indices(indices)
        cdef uint64_t *starts
        cdef lib.tl_engine eng
        cdef Outcome o
        cdef int rc
        positions = _positions(positions, alloc, iv.shape[0], window, self.rows.rs.row_bytes)
        w.held_pos = w.held_dst = False
        try:
            if _window_args(self.rows, iv, first, count, stride, window, out, positions, b,
                            &w):
                data, offsets = _record_arrays(alloc, b, 0, 0)
                return positions, data, offsets
            starts = <uint64_t *>b[B_STARTS].p
            self.rows.files.engine_begin(&eng)
            with nogil:
                rc = _batch(&self.s, self.sets, &eng, &self.rows.rs, w.dst, w.nwin, window,
                            w.pos, b, &o)
            self.rows.files.engine_end(&eng)
        finally:
            _release_windows(&w)
        if rc:
            if o.fail == FAIL_MEMORY:
                raise MemoryError()
            if o.fail == FAIL_SPAN:
                raise self._corrupt(&o.span)
            if o.round == R_ROWS:
                s0 = starts[o.item]
                _raise_io(&o.io, self.rows.files.paths, f"rows [{s0}, {s0 + window})")
            _raise_io(&o.io, self._paths[o.round - 1], _ROUND_WHAT[o.round])
        data, offsets = _record_arrays(alloc, b, o.nitems, o.nbytes)
        cdef Py_buffer d
        if o.nbytes:
            # the records' bytes go from the files straight into the batch's buffer
            _acquire(data, &d, o.nbytes, False, "data")
            try:
                self.data_rs.files.engine_begin(&eng)
                with nogil:
                    rc = _round(&eng, &self.sets[3], o.nreq, <uint8_t *>d.buf, b, 0, R_DATA, &o)
                self.data_rs.files.engine_end(&eng)
            finally:
                PyBuffer_Release(&d)
            if rc:
                if o.fail == FAIL_MEMORY:
                    raise MemoryError()
                _raise_io(&o.io, self._paths[3], _ROUND_WHAT[R_DATA])
        return positions, data, offsets


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
    if at:  # (then there are records, and bytes to take them from)
        with nogil:
            lib.tl_blocks_copy(&src[0], &b[0], &n[0], m, &dst[0])
    return data, offsets


# ---- layout "blocks" (FORMAT.md, version 3) ------------------------------------

BLOCK_MAX = lib.TL_BLOCK_MAX

# The rounds of reads of a blocks batch, for errors.
cdef enum:
    K_ROWS
    K_INDEX   # the block index (.mbx): entries, or whole tables
    K_BLOCKS  # the blocks (.msb)


cdef int _seen_ready(Scratch sc, uint64_t block) noexcept nogil:
    """Size the block-local set for blocks of ``block`` rows (at most that many
    runs).  0, or -1 when out of memory."""
    cdef uint64_t cap = 16
    cdef Buf *b = sc.b
    while cap < 2 * block:
        cap *= 2
    if sc.seen.cap == cap:
        return 0
    if (_grow(&b[B_SEEN_KEY], cap * 4) or _grow(&b[B_SEEN_VAL], cap * 4)
            or _grow(&b[B_SEEN_GEN], cap * 4)):
        return -1
    memset(b[B_SEEN_GEN].p, 0, cap * 4)
    sc.seen.key = <uint32_t *>b[B_SEEN_KEY].p
    sc.seen.val = <uint32_t *>b[B_SEEN_VAL].p
    sc.seen.gen = <uint32_t *>b[B_SEEN_GEN].p
    sc.seen.cap = cap
    sc.seen.now = 0
    return 0


cdef void _decode_entries(ShardTables tables, const lib.tl_span_piece *pieces, size_t n,
                          uint64_t block, uint64_t *entries) noexcept nogil:
    """The block index entries of ``pieces`` (their shards' tables held:
    ``tables.need`` first) decoded into ``entries``, piece p's at ``p.blk``,
    where a round of reads would have put them.  It cannot run past a table:
    a table holds its shard's blocks + 1 entries, and a piece's entries lie
    within them (``tl_spans_pieces``)."""
    cdef size_t i
    cdef uint64_t b0
    cdef const lib.tl_span_piece *p
    for i in range(n):
        p = &pieces[i]
        b0 = p.start // block
        lib.tl_ctab_decode(<const lib.tl_ctab *>lib.tl_table_get(&tables.tabs[p.shard]), b0,
                           (p.start + p.len - 1) // block + 2 - b0, entries + p.blk)


cdef int _blocks_batch(const lib.tl_block_set *s, const lib.tl_span_set *sp, ShardTables tables,
                       const lib.tl_rowset *msx, const lib.tl_rowset *msb,
                       const lib.tl_engine *eng, const lib.tl_rowset *rows, uint8_t *rows_dst,
                       size_t nwin, uint64_t window, int32_t *pos, Scratch sc,
                       const uint64_t *cuts, size_t nbatch, Outcome *o) noexcept nogil:
    """Rows (into ``rows_dst`` unless NULL) and metadata of the windows whose
    first rows are B_STARTS[0..nwin), in ``nbatch`` batches: batch k is the
    windows up to ``cuts[k]`` (``cuts[nbatch - 1] == nwin``).  Positions count
    the records of their own batch; batch k's records are B_BATCH[3k] places
    in B_BLOCKBUF (B_ISRC, B_ILEN) from item B_BATCH[3k + 2], with
    B_BATCH[3k + 1] bytes and offsets in B_OFFSETS from B_BATCH[3k + 2] + k.
    With the block index in memory (``tables``), the rows and the blocks of
    all batches are one round of reads; otherwise the rows go with the block
    index entries, then the blocks.  0, or -1 with ``o`` filled (``o.round``:
    K_*)."""
    cdef Buf *b = sc.b
    cdef const uint64_t *starts = <uint64_t *>b[B_STARTS].p
    cdef lib.tl_span_reqs q = _reqs(b)
    cdef lib.tl_span_piece *pieces
    cdef size_t npieces = 0, nrow = 0, nitems = 0, i, failed = 0, k, p0 = 0, p1, done = 0
    cdef uint64_t nent, nbytes = 0, hcap, nruns, end
    cdef uint64_t *res
    cdef const uint64_t *at
    cdef lib.tl_ioreq *reqs
    cdef uint32_t *pshard
    cdef int rc
    o.fail = FAIL_NONE
    nent = lib.tl_spans_pieces(sp, starts, nwin, window, NULL, q, &npieces)
    if rows_dst != NULL:
        nrow = lib.tl_rows_count_reqs(rows, starts, NULL, window, nwin)
    if (_grow(&b[B_PIECES], npieces * sizeof(lib.tl_span_piece)) or _grow_reqs(b, npieces)
            or _grow(&b[B_BLOCKS], nent * 8) or _grow(&b[B_AT], npieces * 8)
            or _grow(&b[B_INFO], nent * sizeof(lib.tl_block_info))
            or _grow(&b[B_PSHARD], npieces * 4) or _grow(&b[B_PRANGE], npieces * 24)
            or _grow(&b[B_ORDER], npieces * sizeof(lib.tl_block_range))
            or _grow(&b[B_REQS], nrow * sizeof(lib.tl_ioreq))
            or _seen_ready(sc, s.block)):
        o.fail = FAIL_MEMORY
        return -1
    pieces = <lib.tl_span_piece *>b[B_PIECES].p
    lib.tl_spans_pieces(sp, starts, nwin, window, pieces, _reqs(b), &npieces)
    if rows_dst != NULL:
        reqs = <lib.tl_ioreq *>b[B_REQS].p
        nrow = lib.tl_rows_plan_many(rows, starts, NULL, window, NULL, nwin, rows_dst, reqs)
    if tables.enabled:
        pshard = <uint32_t *>b[B_PSHARD].p
        for i in range(npieces):
            pshard[i] = pieces[i].shard
        rc = tables.need(eng, pshard, npieces, &o.io, &failed)
        if rc:
            o.fail = FAIL_IO  # out of memory too: a MemoryError naming the index (_raise_io)
            o.round = K_INDEX
            o.item = failed
            return -1
        _decode_entries(tables, pieces, npieces, s.block, <uint64_t *>b[B_BLOCKS].p)
    elif _round(eng, msx, npieces, <uint8_t *>b[B_BLOCKS].p, b, nrow, K_INDEX, o):
        if o.round == R_ROWS:
            o.round = K_ROWS
        return -1
    else:
        nrow = 0  # the rows went with the entries
    if lib.tl_blocks_slices(s, pieces, npieces, <uint64_t *>b[B_BLOCKS].p, _reqs(b),
                            <uint64_t *>b[B_AT].p, &nbytes, &o.span):
        o.fail = FAIL_SPAN
        return -1
    if _grow(&b[B_BLOCKBUF], nbytes if nbytes else 1):
        o.fail = FAIL_MEMORY
        return -1
    if _round(eng, msb, npieces, <uint8_t *>b[B_BLOCKBUF].p, b, nrow, K_BLOCKS, o):
        if o.round == R_ROWS:
            o.round = K_ROWS
        return -1
    if _grow(&b[B_BATCH], nbatch * 24):
        o.fail = FAIL_MEMORY
        return -1
    res = <uint64_t *>b[B_BATCH].p
    for k in range(nbatch):  # a batch's pieces follow its windows' positions
        end = cuts[k] * window
        p1 = p0
        while p1 < npieces and pieces[p1].dst < end:
            p1 += 1
        at = <uint64_t *>b[B_AT].p + p0
        # each block checked (an in-order one once); the batch's records fit in their runs
        if lib.tl_blocks_check_all(s, pieces + p0, p1 - p0, at, <uint64_t *>b[B_BLOCKS].p,
                                   <uint8_t *>b[B_BLOCKBUF].p, &sc.seen,
                                   <lib.tl_block_info *>b[B_INFO].p, <uint64_t *>b[B_PRANGE].p,
                                   &nruns, &o.span):
            o.fail = FAIL_SPAN
            return -1
        nruns += 1
        hcap = 1
        while hcap < 2 * nruns:
            hcap *= 2
        if (_grow(&b[B_HKEYS], hcap * 8) or _grow(&b[B_HVALS], hcap * 8)
                or _grow(&b[B_ISRC], (done + nruns) * 8) or _grow(&b[B_ILEN], (done + nruns) * 8)
                or _grow(&b[B_OFFSETS], (done + nruns + k + 1) * 8)):
            o.fail = FAIL_MEMORY
            return -1
        if lib.tl_blocks_resolve(s, pieces + p0, p1 - p0, at, <uint64_t *>b[B_BLOCKS].p,
                                 <uint8_t *>b[B_BLOCKBUF].p, <lib.tl_block_info *>b[B_INFO].p, pos,
                                 <uint64_t *>b[B_HKEYS].p, <int64_t *>b[B_HVALS].p, hcap,
                                 &sc.seen, <uint64_t *>b[B_PRANGE].p,
                                 <lib.tl_block_range *>b[B_ORDER].p,
                                 <uint64_t *>b[B_ISRC].p + done, <uint64_t *>b[B_ILEN].p + done,
                                 &nitems, &o.span):
            o.fail = FAIL_SPAN
            return -1
        res[3 * k] = nitems
        res[3 * k + 1] = lib.tl_blocks_offsets(<uint64_t *>b[B_ILEN].p + done, nitems,
                                               <int64_t *>b[B_OFFSETS].p + done + k)
        res[3 * k + 2] = done
        done += nitems
        p0 = p1
    return 0


cdef uint64_t GIL_COPY_MAX = 65536
"""Records' bytes a batch copies with the GIL held: below this, releasing and
taking back the GIL costs more than the copy (at 1 record / 100 tokens a
batch of 8 windows of 4,097 has about 2.6 KB)."""


cdef inline void _copy_records(Buf *b, const uint64_t *res, size_t k, uint8_t *dst) noexcept nogil:
    """Batch k's records' bytes from the block buffer to ``dst`` (see
    _blocks_batch for ``res``)."""
    lib.tl_blocks_copy(<uint8_t *>b[B_BLOCKBUF].p, <uint64_t *>b[B_ISRC].p + res[3 * k + 2],
                       <uint64_t *>b[B_ILEN].p + res[3 * k + 2], res[3 * k], dst)


cdef object _block_corrupt(lib.tl_span_error *e, str index_path, str msb_path):
    """The CorruptDataError of a blocks.h error code, naming the file at fault."""
    if e.code == lib.TL_BLOCK_BAD_INDEX:
        return CorruptDataError(
            f"{index_path}: block index entry {e.entry} = {e.value} breaks "
            f"0 = first <= ... <= last = {e.limit} (the .msb size)")
    where = f"{msb_path}: metadata block {e.entry}"
    if e.code == lib.TL_BLOCK_BAD_START:
        return CorruptDataError(
            f"{where} has a run starting at row {e.value}: starts must be 0, then increase, "
            f"and stay below the block's {e.limit} rows")
    if e.code == lib.TL_BLOCK_BAD_RECORD:
        return CorruptDataError(
            f"{where} refers to record {e.value}, but the shard has {e.limit} metadata "
            "records")
    if e.code == lib.TL_BLOCK_BAD_END:
        return CorruptDataError(
            f"{where}: a record ends at byte {e.value}, before the previous one's end "
            f"{e.limit}")
    return CorruptDataError(
        f"{where}: its counts and its size disagree ({e.value} against {e.limit})")


cdef class BlockSet:
    """The metadata blocks of a dataset's shards (FORMAT.md, version 3).

    Args:
        rows: the dataset's rows (read together with the metadata).
        index_files, block_files: FileSets of the shards' ``.mbx`` and ``.msb``.
        records, block_bytes: per shard, from the manifest.
        block: rows per block (at most BLOCK_MAX).
        index_in_memory: hold each shard's block index in memory once a read
            needs it, compressed (``csrc/tokload/ctab.h``: about 2.1 bytes per
            block; 8 more for each block of a group of 64 that holds one of 64
            KiB or more), so that a window costs one read of metadata;
            otherwise its entries are read first, in a round of their own.
    """

    cdef readonly RowSet rows, index_rs, blocks_rs
    cdef readonly ShardTables tables
    cdef readonly uint64_t block
    cdef uint64_t[::1] _row_cum, _nrec
    cdef lib.tl_block_set s
    cdef lib.tl_span_set sp
    cdef list _paths

    def __cinit__(self, RowSet rows, index_files, block_files, records, block_bytes,
                  uint64_t block, bint index_in_memory=True):
        if not 1 <= block <= lib.TL_BLOCK_MAX:
            raise ValueError(f"block must be in [1, {lib.TL_BLOCK_MAX}], got {block}")
        row_counts = np.diff(np.asarray(rows.cum))
        n = len(row_counts)
        if not (len(records) == len(block_bytes) == n):
            raise ValueError(f"{n} shards but {len(records)} record and {len(block_bytes)} "
                             "byte counts")
        nblocks = (row_counts + np.uint64(block - 1)) // np.uint64(block)
        self.rows = rows
        self.block = block
        self.index_rs = RowSet(index_files, nblocks + np.uint64(1), 8)
        self.blocks_rs = RowSet(block_files, np.asarray(block_bytes, dtype=np.uint64), 1)
        self.tables = ShardTables(self.index_rs, index_in_memory, True)
        self._row_cum = np.array(rows.cum, dtype=np.uint64)
        self._nrec = np.array(records, dtype=np.uint64).reshape(-1)
        if n == 0:
            self._nrec = np.zeros(1, dtype=np.uint64)
        self.s.row_cum = &self._row_cum[0]
        self.s.msx_cum = self.index_rs.rs.cum
        self.s.msb_cum = self.blocks_rs.rs.cum
        self.s.nrec = &self._nrec[0]
        self.s.nfiles = n
        self.s.block = block
        memset(&self.sp, 0, sizeof(self.sp))  # tl_spans_pieces reads these four
        self.sp.row_cum = &self._row_cum[0]
        self.sp.msx_cum = self.index_rs.rs.cum
        self.sp.nfiles = n
        self.sp.block = block
        self._paths = [index_files.paths, block_files.paths]

    @property
    def index_in_memory(self):
        """Whether the block index is held in memory (see the class)."""
        return self.tables.enabled

    cdef object _corrupt(self, lib.tl_span_error *e):
        return _block_corrupt(e, self._paths[0][e.shard], self._paths[1][e.shard])


    def read_windows(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                     uint64_t window, out, positions, alloc, Scratch scratch not None):
        """As ``SpanSet.read_windows``: rows into ``out`` (unless None),
        ``positions`` filled (made with ``alloc`` when None), returns
        ``(positions, data, offsets)``.

        The rows and the windows' blocks are read in one round (with the
        block index in memory; else the index entries go with the rows, then
        the blocks); the records' bytes are copied from the blocks into
        ``data``.  Everything but the allocations runs without the GIL.
        """
        cdef uint64_t one_cut
        cdef const int64_t[::1] iv = _indices(indices)
        one_cut = iv.shape[0]
        positions = _positions(positions, alloc, one_cut, window, self.rows.rs.row_bytes)
        data, offsets = self._read(iv, first, count, stride, window, out, positions, alloc,
                                   scratch, &one_cut, 1)[0]
        return positions, data, offsets

    def read_window_batches(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                            uint64_t window, out, positions, alloc, Scratch scratch not None,
                            cuts):
        """``read_windows`` of several batches in one round of reads: batch
        k is the windows up to ``cuts[k]`` (ascending, the last one
        ``len(indices)``; None: one batch).  Each batch's positions count its
        own records; returns one ``(data, offsets)`` per batch."""
        cdef const int64_t[::1] iv = _indices(indices)  # flat, int64
        cdef size_t nwin0 = iv.shape[0], nbatch = 1, k
        cdef uint64_t one_cut = nwin0
        cdef const uint64_t *cp = &one_cut
        cdef const uint64_t[::1] cv
        cdef bint bad = False
        if cuts is not None:
            cv = np.ascontiguousarray(cuts, dtype=np.uint64)
            nbatch = cv.shape[0]
            bad = nbatch == 0 or cv[nbatch - 1] != nwin0
            for k in range(nbatch):
                bad |= cv[k] <= (cv[k - 1] if k else 0)
            if bad:
                raise ValueError(f"cuts must rise from above 0 to {nwin0}, got {list(cv)}")
            cp = &cv[0]
        return self._read(iv, first, count, stride, window, out, positions, alloc, scratch, cp,
                          nbatch)

    cdef int _check_open(self) except -1:
        """Raise as a closed dataset's read does (its rows, block index and
        blocks are one dataset's files)."""
        self.rows.files.check_open()
        self.index_rs.files.check_open()
        self.blocks_rs.files.check_open()
        return 0

    cdef list _read(self, const int64_t[::1] iv, uint64_t first, uint64_t count,
                    uint64_t stride, uint64_t window, out, positions, alloc, Scratch scratch,
                    const uint64_t *cp, size_t nbatch):
        """``read_window_batches`` with its indices and cuts checked
        (``cp``: the ``nbatch`` cuts); _window_args checks the rest."""
        self._check_open()
        cdef Buf *b = scratch.b
        cdef Windows w
        cdef size_t k
        cdef uint64_t *starts
        cdef lib.tl_engine eng
        cdef Outcome o
        cdef int rc
        w.held_pos = w.held_dst = False
        try:
            if _window_args(self.rows, iv, first, count, stride, window, out, positions, b, &w):
                return [_record_arrays(alloc, b, 0, 0) for k in range(nbatch)]
            starts = <uint64_t *>b[B_STARTS].p
            self.rows.files.engine_begin(&eng)
            with nogil:
                rc = _blocks_batch(&self.s, &self.sp, self.tables, &self.index_rs.rs,
                                   &self.blocks_rs.rs, &eng, &self.rows.rs, w.dst, w.nwin,
                                   window, w.pos, scratch, cp, nbatch, &o)
            self.rows.files.engine_end(&eng)
        finally:
            _release_windows(&w)
        if rc:
            if o.fail == FAIL_MEMORY:
                raise MemoryError()
            if o.fail == FAIL_SPAN:
                raise self._corrupt(&o.span)
            if o.round == K_ROWS:
                s0 = starts[o.item]
                _raise_io(&o.io, self.rows.files.paths, f"rows [{s0}, {s0 + window})")
            if o.round == K_INDEX:
                _raise_io(&o.io, self._paths[0], "the metadata block index")
            _raise_io(&o.io, self._paths[1], "the metadata blocks")
        cdef const uint64_t *res
        cdef Py_buffer d
        out_records = []
        for k in range(nbatch):
            res = <uint64_t *>b[B_BATCH].p  # (re-read: alloc runs Python in between)
            data, offsets = _record_arrays(alloc, b, res[3 * k], res[3 * k + 1],
                                           res[3 * k + 2] + k)
            if res[3 * k + 1]:
                _acquire(data, &d, res[3 * k + 1], False, "data")
                if res[3 * k + 1] <= GIL_COPY_MAX:  # a few KB: cheaper than passing the GIL
                    _copy_records(b, res, k, <uint8_t *>d.buf)
                else:
                    with nogil:
                        _copy_records(b, res, k, <uint8_t *>d.buf)
                PyBuffer_Release(&d)
            out_records.append((data, offsets))
        return out_records

    cdef int _hint_pieces(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                          uint64_t window, Scratch scratch, size_t *npieces,
                          size_t *unheld) except -1:
        """The first step of both hints: the files open and the indices in
        range, the windows cut into pieces (B_PIECES) with the requests of
        their block index entries (B_Q*, in entries; B_BLOCKS has room for
        them).  The ``*unheld`` pieces whose shard's table is not held come
        first, each with its request; the held ones follow (``*npieces`` in
        all).  Returns 1 when there is nothing to hint, else 0."""
        self._check_open()
        cdef const int64_t[::1] iv = _indices(indices)
        cdef size_t n = iv.shape[0], np_ = 0, i, rest = 0
        if n == 0 or window == 0:
            return 1
        cdef Buf *b = scratch.b
        if _grow(&b[B_STARTS], n * 8):
            raise MemoryError()
        cdef uint64_t *starts = <uint64_t *>b[B_STARTS].p
        _checked_window_starts(iv, first, count, stride, window, self.rows.total, starts)
        cdef lib.tl_span_piece *pieces
        cdef lib.tl_span_piece piece
        cdef lib.tl_span_reqs q
        cdef uint64_t nent, v
        cdef int rc = 0
        cdef void **tabs = self.tables.tabs
        with nogil:
            nent = lib.tl_spans_pieces(&self.sp, starts, n, window, NULL, _reqs(b), &np_)
            if (_grow(&b[B_PIECES], np_ * sizeof(lib.tl_span_piece))
                    or _grow_reqs(b, np_) or _grow(&b[B_AT], np_ * 8)
                    or _grow(&b[B_BLOCKS], nent * 8)):
                rc = -1
            else:
                pieces = <lib.tl_span_piece *>b[B_PIECES].p
                q = _reqs(b)
                lib.tl_spans_pieces(&self.sp, starts, n, window, pieces, q, &np_)
                for i in range(np_):  # the unheld to the front, each with its request
                    if self.tables.enabled and lib.tl_table_get(&tabs[pieces[i].shard]) != NULL:
                        continue
                    piece = pieces[rest]
                    pieces[rest] = pieces[i]
                    pieces[i] = piece
                    v = q.start[rest]
                    q.start[rest] = q.start[i]
                    q.start[i] = v
                    v = q.len[rest]
                    q.len[rest] = q.len[i]
                    q.len[i] = v
                    v = q.dst[rest]
                    q.dst[rest] = q.dst[i]
                    q.dst[i] = v
                    rest += 1
        if rc:
            raise MemoryError()
        npieces[0] = np_
        unheld[0] = rest
        return 0

    def hint_windows(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                     uint64_t window, Scratch scratch not None):
        """The read-ahead of the windows' metadata (the rows are the caller's):
        ``POSIX_FADV_WILLNEED`` for the blocks the windows need where their
        shard's block index table is in memory, else for their block index
        entries (a hint loads no table: it reads nothing itself and returns at
        once).  Returns the hints given.  A hint is advice: an entry that does
        not check gives none (the read says why)."""
        cdef size_t npieces, rest
        if self._hint_pieces(indices, first, count, stride, window, scratch, &npieces, &rest):
            return 0
        cdef Buf *b = scratch.b
        cdef lib.tl_span_reqs q = _reqs(b)
        cdef lib.tl_span_piece *pieces = <lib.tl_span_piece *>b[B_PIECES].p
        cdef size_t held = npieces - rest
        cdef lib.tl_span_error serr
        cdef uint64_t nbytes = 0
        cdef int rc
        given = 0
        if rest:  # the unheld pieces' entries
            given += self.index_rs.hint_ranges(<uint64_t[:rest]>q.start, <uint64_t[:rest]>q.len)
        if held:
            with nogil:  # q becomes the held pieces' blocks, in bytes of the .msb files
                _decode_entries(self.tables, pieces + rest, held, self.s.block,
                                <uint64_t *>b[B_BLOCKS].p)
                rc = lib.tl_blocks_slices(&self.s, pieces + rest, held, <uint64_t *>b[B_BLOCKS].p,
                                          q, <uint64_t *>b[B_AT].p, &nbytes, &serr)
            if rc == 0:
                given += self.blocks_rs.hint_ranges(<uint64_t[:held]>q.start,
                                                    <uint64_t[:held]>q.len)
        return given

    def hint_blocks_after_index(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                                uint64_t window, Scratch scratch not None):
        """The read-ahead's second step where a shard's block index table is
        not in memory (not held, or not loaded by a read yet): read the block
        index entries of the windows (the entries a ``hint_windows`` call
        advised earlier, so usually in the page cache by now; this waits for
        them otherwise) and advise the kernel of the blocks they point to.
        Windows whose shard's table is in memory are skipped
        (``hint_windows`` gave their blocks).  Returns the hints given.
        A hint is advice: entries that fail to read or do not check give none
        (the read says why)."""
        cdef size_t npieces, rest
        if (self._hint_pieces(indices, first, count, stride, window, scratch, &npieces, &rest)
                or rest == 0):
            return 0
        cdef Buf *b = scratch.b
        cdef lib.tl_span_piece *pieces = <lib.tl_span_piece *>b[B_PIECES].p
        cdef lib.tl_span_error serr
        cdef lib.tl_engine eng
        cdef Outcome o
        cdef uint64_t nbytes = 0
        cdef int rc
        o.fail = FAIL_NONE
        self.rows.files.engine_begin(&eng)
        with nogil:
            rc = _round(&eng, &self.index_rs.rs, rest, <uint8_t *>b[B_BLOCKS].p, b, 0, K_INDEX,
                        &o)
            if rc == 0:  # q becomes their blocks, in bytes of the .msb files
                rc = lib.tl_blocks_slices(&self.s, pieces, rest, <uint64_t *>b[B_BLOCKS].p,
                                          _reqs(b), <uint64_t *>b[B_AT].p, &nbytes, &serr)
        self.rows.files.engine_end(&eng)
        if o.fail == FAIL_MEMORY:
            raise MemoryError()
        if rc:  # an I/O error or an entry that does not check: no hint
            return 0
        cdef lib.tl_span_reqs q = _reqs(b)
        return self.blocks_rs.hint_ranges(<uint64_t[:rest]>q.start, <uint64_t[:rest]>q.len)


_ENCODE_CHUNK = 4096  # blocks encoded per buffer


def encode_blocks(uint64_t block, uint64_t rows, starts, records, mdx, mdb, write):
    """A shard's metadata as blocks (FORMAT.md, version 3).

    Args:
        block: rows per block (at most BLOCK_MAX).
        rows: the shard's rows.
        starts, records: its runs as in a span table (uint64 first rows,
            strictly increasing from 0; uint32 records or SPAN_NONE).
        mdx, mdb: its records: ``len(records) + 1`` uint64 offsets into the
            bytes ``mdb`` (any buffer; a memory map is fine).
        write: called with each encoded piece of the ``.msb`` (a NumPy
            uint8 array, in order).

    Returns the block index (uint64, ``ceil(rows / block) + 1`` values).
    Raises ValueError naming the run or record that is out of order or
    range.  The encoding runs without the GIL, a few thousand blocks at a time.
    """
    if not 1 <= block <= lib.TL_BLOCK_MAX:
        raise ValueError(f"block must be in [1, {lib.TL_BLOCK_MAX}], got {block}")
    cdef const uint64_t[::1] st = np.ascontiguousarray(starts, dtype=np.uint64)
    cdef const uint32_t[::1] rc = np.ascontiguousarray(records, dtype=np.uint32)
    cdef const uint64_t[::1] ix = np.ascontiguousarray(mdx, dtype=np.uint64)
    mdb_arr = np.frombuffer(mdb, dtype=np.uint8) if not isinstance(mdb, np.ndarray) else mdb
    cdef const uint8_t[::1] db = np.ascontiguousarray(mdb_arr.reshape(-1).view(np.uint8))
    if st.shape[0] != rc.shape[0]:
        raise ValueError(f"{st.shape[0]} run starts but {rc.shape[0]} records")
    if ix.shape[0] < 1:
        raise ValueError("mdx needs at least one offset")
    if rows and st.shape[0] == 0:
        raise ValueError(f"a shard of {rows} rows needs runs")
    if rows == 0 and st.shape[0]:  # no block to hold them
        raise ValueError(f"metadata run 0: {st[0]} is out of order or range (limit 0)")
    cdef uint64_t nblocks = (rows + block - 1) // block, b0, b1, run = 0, k, w
    index = np.zeros(nblocks + 1, dtype=np.uint64)
    cdef uint64_t[::1] idx = index
    sizes = np.empty(min(nblocks, _ENCODE_CHUNK) + 1, dtype=np.uint64)
    cdef uint64_t[::1] sz = sizes
    cdef Scratch sc = Scratch()
    cdef lib.tl_span_error err
    cdef int r = 0
    cdef uint64_t cur, total = 0
    cdef uint8_t[::1] ob
    cdef const uint64_t *stp = &st[0] if st.shape[0] else NULL
    cdef const uint32_t *rcp = &rc[0] if rc.shape[0] else NULL
    cdef const uint8_t *dbp = &db[0] if db.shape[0] else NULL
    if _seen_ready(sc, block):
        raise MemoryError()
    b0 = 0
    while b0 < nblocks:
        b1 = min(nblocks, b0 + _ENCODE_CHUNK)
        cur = run
        with nogil:
            r = lib.tl_blocks_encode(block, rows, stp, rcp, st.shape[0], &ix[0],
                                     ix.shape[0] - 1, dbp, db.shape[0], b0, b1, &cur, &sc.seen,
                                     &sz[0], NULL, 0, &err)
        if r == 0:
            w = 0
            for k in range(b1 - b0):
                w += sz[k]
                idx[b0 + k + 1] = total + w
            out = np.empty(w, dtype=np.uint8)
            ob = out
            cur = run
            with nogil:
                r = lib.tl_blocks_encode(block, rows, stp, rcp, st.shape[0], &ix[0],
                                         ix.shape[0] - 1, dbp, db.shape[0], b0, b1, &cur,
                                         &sc.seen, &sz[0], &ob[0] if w else NULL, w, &err)
        if r:
            what = ("run", "record", "block", "block")[err.shard]
            raise ValueError(f"metadata {what} {err.entry}: {err.value} is out of order or range "
                             f"(limit {err.limit})")
        write(out)
        total += w
        run = cur
        b0 = b1
    return index


def decode_blocks(uint64_t block, uint64_t rows, uint64_t nrec, index, msb, str index_path,
                  str where, bint records=True):
    """A shard's runs and records from its metadata blocks (the inverse of
    ``encode_blocks``, for ``tokload.convert``).

    Args:
        block, rows, nrec: the manifest's ``span_block`` and the shard's
            rows and ``metadata_records``.
        index, msb: the shard's ``.mbx`` (uint64) and ``.msb`` (bytes).
        index_path, where: the ``.mbx``'s and the ``.msb``'s paths, for errors.
        records: build ``mdx``/``mdb`` (else they come back as None: checking
            needs memory in proportion to the records the blocks use, not to
            the manifest's count).

    Returns ``(starts, records, mdx, mdb)``: the runs as in a span table
    (a run that continues across a block boundary is one run), and the
    records as in ``.mdx``/``.mdb`` (a record no run refers to has no bytes).
    Raises CorruptDataError naming ``where`` and the block at fault, also
    for a record whose bytes differ from those of its first appearance.
    """
    if not 1 <= block <= lib.TL_BLOCK_MAX:
        raise ValueError(f"block must be in [1, {lib.TL_BLOCK_MAX}], got {block}")
    cdef const uint64_t[::1] ix = np.ascontiguousarray(index, dtype=np.uint64)
    msb_arr = np.frombuffer(msb, dtype=np.uint8) if not isinstance(msb, np.ndarray) else msb
    cdef const uint8_t[::1] db = np.ascontiguousarray(msb_arr.reshape(-1).view(np.uint8))
    cdef uint64_t nblocks = (rows + block - 1) // block, b, size = db.shape[0]
    if <uint64_t>ix.shape[0] != nblocks + 1:
        raise ValueError(f"{nblocks + 1} block index entries needed, got {ix.shape[0]}")
    cdef lib.tl_span_error err
    b = lib.tl_block_index_bad(&ix[0], nblocks + 1, 0, nblocks, size)
    if b <= nblocks:
        err.code, err.shard, err.entry, err.value, err.limit = (
            lib.TL_BLOCK_BAD_INDEX, 0, b, ix[b], size)
        raise _block_corrupt(&err, index_path, where)
    cdef uint64_t row_cum[2]
    cdef uint64_t nrec1[1]
    row_cum[0] = 0
    row_cum[1] = rows
    nrec1[0] = nrec
    cdef lib.tl_block_set s
    memset(&s, 0, sizeof(s))
    s.row_cum = row_cum
    s.nrec = nrec1
    s.nfiles = 1
    s.block = block
    cdef Scratch sc = Scratch()
    if _seen_ready(sc, block):
        raise MemoryError()
    cap = size // 6 + 1  # runs: at least 6 bytes each
    cdef const uint8_t *base = &db[0] if size else NULL
    cdef uint64_t used = _records_used(base, &ix[0], nblocks, nrec)
    starts = np.empty(cap, dtype=np.uint64)
    runs_rec = np.empty(cap, dtype=np.uint32)
    src = np.full(used if used else 1, -1, dtype=np.int64)
    lens = np.zeros(used if used else 1, dtype=np.uint64)
    cdef uint64_t[::1] so = starts, ln = lens
    cdef uint32_t[::1] ro = runs_rec
    cdef int64_t[::1] sr = src
    cdef lib.tl_block_info bi
    cdef lib.tl_block_walk walk
    cdef uint32_t r, rec, j, a0, a1
    cdef const uint8_t *p
    cdef uint64_t n = 0, data
    cdef int rc = 0
    cdef uint32_t differs = lib.TL_SPAN_NONE
    with nogil:
        for b in range(nblocks):
            p = base + ix[b] if size else NULL
            rc = lib.tl_block_check(&s, 0, b, p, ix[b + 1] - ix[b], &sc.seen, &bi, &err)
            if rc:
                break
            data = ix[b] + 4 + 6 * <uint64_t>bi.nruns + 4 * <uint64_t>bi.nnew
            lib.tl_block_walk_start(&walk)
            for r in range(bi.nruns):
                rec = lib.tl_load_u32(p + 4 + 2 * <uint64_t>bi.nruns + 4 * <uint64_t>r)
                if r == 0 and n and ro[n - 1] == rec:
                    pass  # the run goes on from the previous block
                else:
                    so[n] = b * block + lib.tl_load_u16(p + 4 + 2 * <uint64_t>r)
                    ro[n] = rec
                    n += 1
                if rec == lib.TL_SPAN_NONE:
                    continue
                j = lib.tl_block_walk_slot(&bi, &sc.seen, &walk, rec)
                a0 = lib.tl_load_u32(bi.ends + 4 * <uint64_t>(j - 1)) if j else 0
                a1 = lib.tl_load_u32(bi.ends + 4 * <uint64_t>j)
                if sr[rec] < 0:
                    sr[rec] = <int64_t>(data + a0)
                    ln[rec] = a1 - a0
                elif ln[rec] != a1 - a0 or memcmp(base + sr[rec], base + data + a0, ln[rec]):
                    differs = rec  # a record's bytes are the same wherever it appears
                    break
            if differs != lib.TL_SPAN_NONE:
                break
    if rc:
        raise _block_corrupt(&err, index_path, where)
    if differs != lib.TL_SPAN_NONE:
        raise CorruptDataError(f"{where}: metadata block {b}: record {differs} has other bytes "
                               "than where it appears first")
    if not records:
        return starts[:n].copy(), runs_rec[:n].copy(), None, None
    mdx = np.zeros(nrec + 1, dtype=np.uint64)
    if used:
        np.cumsum(lens[:used], out=mdx[1 : used + 1])
        mdx[used + 1 :] = mdx[used]
    mdb = np.empty(int(mdx[nrec]), dtype=np.uint8)
    cdef uint8_t[::1] mo = mdb
    cdef uint8_t *out = &mo[0] if mo.shape[0] else NULL
    cdef const uint64_t[::1] mx = mdx
    cdef uint64_t k
    with nogil:
        for k in range(used):
            if ln[k]:
                memcpy(out + mx[k], base + sr[k], ln[k])
    return starts[:n].copy(), runs_rec[:n].copy(), mdx, mdb


cdef uint64_t _records_used(const uint8_t *base, const uint64_t *ix, uint64_t nblocks,
                            uint64_t nrec) noexcept nogil:
    """One more than the largest record (below ``nrec``) the blocks name, read
    without the checks (they come after): sizes decode_blocks' tables."""
    cdef uint64_t b, r, nruns, len_, used = 0
    cdef uint32_t rec
    for b in range(nblocks):
        len_ = ix[b + 1] - ix[b] if ix[b + 1] >= ix[b] else 0
        if len_ < 4:
            continue
        nruns = lib.tl_load_u32(base + ix[b])
        if 4 + 6 * nruns > len_:
            continue
        for r in range(nruns):
            rec = lib.tl_load_u32(base + ix[b] + 4 + 2 * nruns + 4 * r)
            if rec < nrec and rec + 1 > used:
                used = rec + 1
    return used
