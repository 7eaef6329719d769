"""Batch reads of sharded row files, document extents and metadata, without the GIL.

The one job of this module is to bind ``csrc/tokload/plan.h`` and the I/O
engine under it (``engine.h``): it owns the process-wide descriptor cache,
thread pool and io_uring rings, checks and converts the arrays the Python
layer passes, plans a whole batch and runs its reads inside one ``with nogil``
block, and turns C error codes into exceptions that name the file and the
offset.  Policy (which rows make an observation, output shapes) lives in
``views.py``.

I/O backends (``io=``): ``"uring"`` (io_uring through raw system calls),
``"threads"`` (a pool of C threads issuing ``preadv``), ``"sync"`` (one read
after the other: the reference), ``"auto"`` (io_uring if the kernel allows it
here, else threads).  Each batch keeps up to ``queue_depth`` reads in flight.
Defaults come from ``TOKLOAD_IO`` and ``TOKLOAD_IO_DEPTH``.  Files are opened
when first read; at most ``max_open_files()`` descriptors stay open
process-wide (``TOKLOAD_MAX_OPEN_FILES``; by default the smaller of 256 and a
quarter of the soft ``RLIMIT_NOFILE``), least recently used closed first.
"""

from cpython.bytes cimport PyBytes_AS_STRING
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.errno cimport ENOMEM as _ENOMEM
from libc.string cimport memcpy, strerror

cimport tokload._lib as lib
from tokload._remote cimport remote_run

import errno as _errno
import os
import resource

import numpy as np

from tokload._remote import take_error as _take_remote_error
from tokload.errors import CorruptDataError, MissingShardError, TruncatedFileError

META_NONE = 0xFFFFFFFF

IO_CHOICES = ("auto", "uring", "threads", "sync")
DEFAULT_QUEUE_DEPTH = 64
MAX_QUEUE_DEPTH = lib.TL_URING_MAX
FAULTS_BUILT = bool(lib.TL_FAULTS_BUILT)

_BACKEND_NAMES = {lib.TL_IO_SYNC: "sync", lib.TL_IO_THREADS: "threads", lib.TL_IO_URING: "uring",
                  lib.TL_IO_REMOTE: "remote"}
_BACKEND_CODES = {v: k for k, v in _BACKEND_NAMES.items()}

# Process-wide engine state: one descriptor cache, one thread pool, a free
# list of io_uring rings (a ring serves one call at a time).  Python-level
# code that touches them runs with the GIL held.
cdef lib.tl_fdcache _cache
cdef lib.tl_pool _pool
cdef lib.tl_io_faults _faults
cdef bint _faults_on = False
cdef lib.tl_io_counters _counters  # every engine call of the process adds to it
cdef lib.tl_uring *_rings[64]
cdef int _nrings = 0
cdef int _uring_state = -1  # -1: not probed, 0: unavailable, 1: available
cdef int _uring_errno = 0
cdef bint _max_explicit = False


def _default_max_open_files():
    env = os.environ.get("TOKLOAD_MAX_OPEN_FILES")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"TOKLOAD_MAX_OPEN_FILES={env!r}: expected a positive integer")
        return n
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 256
    return max(1, min(256, soft // 4))


lib.tl_fdcache_init(&_cache, _default_max_open_files())
lib.tl_pool_init(&_pool)
_faults.seed = 0
_faults.counter = 0
_faults.rate = 0
_faults.kinds = 0


def set_max_open_files(n=None):
    """Bound the descriptors tokload keeps open, process-wide (``None``: the
    default, ``TOKLOAD_MAX_OPEN_FILES`` or min(256, soft RLIMIT_NOFILE // 4)).

    Idle files beyond the bound are closed at once.  Reads in flight pin their
    files, so the count may exceed the bound by the files being read at that
    moment (at most the reads in flight), never otherwise.
    """
    global _max_explicit
    if n is None:
        _max_explicit = False
        n = _default_max_open_files()
    else:
        n = int(n)
        if n < 1:
            raise ValueError(f"max_open_files must be at least 1, got {n}")
        _max_explicit = True
    lib.tl_fdcache_set_max(&_cache, n)


def max_open_files():
    """The bound on descriptors tokload keeps open."""
    return _cache.max


def open_files():
    """Descriptors tokload holds open now, all datasets together."""
    return lib.tl_fdcache_open_count(&_cache)


cdef int _probe_uring() noexcept:
    global _uring_state, _uring_errno
    cdef lib.tl_uring *r
    cdef int rc
    if _uring_state < 0:
        r = <lib.tl_uring *>PyMem_RawMalloc(sizeof(lib.tl_uring))
        if r is NULL:
            return 0
        rc = lib.tl_uring_setup(r, lib.TL_URING_MAX)
        if rc == 0:
            _uring_state = 1
            _put_ring(r)
        else:
            _uring_state = 0
            _uring_errno = -rc
            PyMem_RawFree(r)
    return _uring_state


def uring_available():
    """Whether io_uring works in this process (probed once; a seccomp filter,
    ``kernel.io_uring_disabled`` or an old kernel make it unavailable)."""
    return bool(_probe_uring())


def uring_error():
    """Why io_uring is unavailable (``None`` if it is available)."""
    if _probe_uring():
        return None
    code = _uring_errno or _errno.ENOSYS
    return f"io_uring_setup failed: {strerror(code).decode()} (errno {code})"


def resolve_io(io=None):
    """The backend ``io`` selects here: ``"uring"``, ``"threads"`` or ``"sync"``.

    ``None`` means the ``TOKLOAD_IO`` environment variable (default
    ``"auto"``); ``"auto"`` is io_uring where it works, else threads.
    ``"uring"`` where io_uring does not work raises ``OSError``.
    """
    if io is None:
        io = os.environ.get("TOKLOAD_IO") or "auto"
        where = f"TOKLOAD_IO={io!r}"
    else:
        where = f"io={io!r}"
    if io not in IO_CHOICES:
        raise ValueError(f"{where}: expected one of {', '.join(IO_CHOICES)}")
    if io == "auto":
        return "uring" if _probe_uring() else "threads"
    if io == "uring" and not _probe_uring():
        code = _uring_errno or _errno.ENOSYS
        raise OSError(code, f"{where}, but {uring_error()}; use io='threads' or io='auto'")
    return io


def default_queue_depth():
    """``TOKLOAD_IO_DEPTH`` if set, else DEFAULT_QUEUE_DEPTH."""
    env = os.environ.get("TOKLOAD_IO_DEPTH")
    if not env:
        return DEFAULT_QUEUE_DEPTH
    return _checked_depth(env, "TOKLOAD_IO_DEPTH")


def _checked_depth(value, str where):
    try:
        d = int(value)
    except (TypeError, ValueError):
        d = 0
    if not 1 <= d <= MAX_QUEUE_DEPTH:
        raise ValueError(f"{where}={value!r}: expected an integer in [1, {MAX_QUEUE_DEPTH}]")
    return d


cdef lib.tl_uring *_take_ring() noexcept:
    global _nrings
    cdef lib.tl_uring *r
    if _nrings:
        _nrings -= 1
        return _rings[_nrings]
    r = <lib.tl_uring *>PyMem_RawMalloc(sizeof(lib.tl_uring))
    if r is NULL:
        return NULL
    if lib.tl_uring_setup(r, lib.TL_URING_MAX) != 0:
        PyMem_RawFree(r)
        return NULL
    return r


cdef void _put_ring(lib.tl_uring *r) noexcept:
    global _nrings
    if r is NULL:
        return
    if r.broken or _nrings == 64:
        lib.tl_uring_destroy(r)
        PyMem_RawFree(r)
        return
    _rings[_nrings] = r
    _nrings += 1


def _after_fork_in_child():
    # The child has none of the parent's pool threads, and its rings are the
    # parent's: start over with the descriptors (still valid) and nothing else.
    # Its reads are its own: the totals start from zero.
    global _nrings, _counters
    _counters.calls = _counters.requests = _counters.bytes = _counters.failed = 0
    _counters.ns = 0
    lib.tl_fdcache_after_fork(&_cache)
    lib.tl_pool_after_fork(&_pool)
    while _nrings:
        _nrings -= 1
        lib.tl_uring_destroy(_rings[_nrings])
        PyMem_RawFree(_rings[_nrings])


os.register_at_fork(after_in_child=_after_fork_in_child)


def io_counters():
    """Process-wide totals of tokload's reads since the process started (a
    forked child starts from zero): a dict of ``calls`` (batches of requests
    run), ``requests`` (reads issued), ``bytes`` (bytes read by calls that
    succeeded), ``failed`` (calls that raised an I/O error) and ``seconds``
    (time in those calls, summed over the threads that made them). Every thread
    and dataset adds to the same totals; read them twice and subtract for an
    interval."""
    cdef lib.tl_io_counters c
    lib.tl_io_counters_read(&_counters, &c)
    return {
        "calls": c.calls,
        "requests": c.requests,
        "bytes": c.bytes,
        "failed": c.failed,
        "seconds": c.ns / 1e9,
    }


def _pool_threads():
    """Threads in the process-wide read pool (for tests)."""
    return lib.tl_pool_threads(&_pool)


_FAULT_KINDS = {"short": lib.TL_FAULT_SHORT, "eintr": lib.TL_FAULT_EINTR,
                "eagain": lib.TL_FAULT_EAGAIN, "eio": lib.TL_FAULT_EIO}


def _set_fault_injection(seed=0, rate=0.0, kinds=("short", "eintr", "eagain", "eio")):
    """Debug builds only: make a fraction ``rate`` of read attempts on every
    backend return a short read, EINTR, EAGAIN or EIO (``kinds``) instead of
    the kernel's answer, drawn deterministically from ``seed`` and a counter.
    ``rate=0`` switches it off."""
    global _faults_on
    if not FAULTS_BUILT:
        raise RuntimeError("fault injection needs a debug build (TOKLOAD_DEBUG=1 pip install -e .)")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    mask = 0
    for k in kinds:
        if k not in _FAULT_KINDS:
            raise ValueError(f"unknown fault kind {k!r}; expected some of {sorted(_FAULT_KINDS)}")
        mask |= _FAULT_KINDS[k]
    _faults.seed = <uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF)
    _faults.counter = 0
    _faults.kinds = mask
    _faults.rate = <uint32_t>min(int(rate * 4294967296.0), 0xFFFFFFFF)
    _faults_on = rate > 0 and mask != 0


cdef object _raise_io(lib.tl_io_error *err, list paths, str what):
    """Raise the exception for a failed read of paths[err.file]."""
    path = paths[err.file] if 0 <= err.file < len(paths) else "?"
    if err.code == lib.TL_ERR_REMOTE:  # named by tokload.remote: URL, range, cause
        e = _take_remote_error()
        if e is None:
            e = OSError(f"{path}: a remote read failed while reading {what}")
        elif hasattr(e, "add_note"):
            e.add_note(f"while reading {what} of {path}")
        raise e
    if err.code == lib.TL_IO_EOF:
        raise TruncatedFileError(
            f"{path}: file ended at byte {err.offset + err.done} while reading {what} "
            f"({err.length} bytes at offset {err.offset}); was it truncated after opening?"
        )
    if err.code == lib.TL_ERR_CORRUPT:
        raise CorruptDataError(f"{path}: {what}: bad value {err.done} at byte {err.offset}")
    code = -err.code
    if code == _errno.ENOMEM:  # a table held in memory that could not be allocated
        raise MemoryError(f"{path}: out of memory while reading {what}")
    msg = f"{strerror(code).decode()} while reading {what} ({err.length} bytes at offset {err.offset})"
    if code == _errno.ENOENT:
        raise MissingShardError(code, msg, path)
    raise OSError(code, msg, path)


cdef const int64_t[::1] _indices(indices) except *:
    """Observation indices as a contiguous int64 array (for the compiled range
    checks of the batch readers): TypeError for non-integers, IndexError for
    unsigned values past int64 (they would wrap to negative ones)."""
    idx = np.asarray(indices)
    if idx.dtype != np.int64:
        if idx.dtype.kind not in "iu" and idx.size:
            raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
        if idx.dtype.kind == "u" and idx.dtype.itemsize == 8 and idx.size:
            top = idx.max()
            if top > 0x7FFFFFFFFFFFFFFF:
                raise IndexError(f"observation {top} is out of range")
        idx = idx.astype(np.int64)
    return np.ascontiguousarray(idx.reshape(-1))


cdef int _window_starts(const int64_t[::1] iv, uint64_t first, uint64_t count,
                        uint64_t stride, uint64_t *starts) except -1:
    """``starts[b] = (first + iv[b]) * stride`` for observations ``iv`` of a view
    of ``count`` (a compiled loop); IndexError names the first one outside."""
    cdef size_t b
    cdef int64_t i
    for b in range(<size_t>iv.shape[0]):
        i = iv[b]
        if i < 0 or <uint64_t>i >= count:
            raise IndexError(f"observation {i} is out of range for a view of {count} "
                             f"(valid: 0 <= i < {count})")
        starts[b] = (first + <uint64_t>i) * stride
    return 0


cdef int _checked_window_starts(const int64_t[::1] iv, uint64_t first, uint64_t count,
                                uint64_t stride, uint64_t window, uint64_t total,
                                uint64_t *starts) except -1:
    """``_window_starts`` for a view of ``count`` windows over ``total`` rows,
    once its last window is checked to end within them."""
    if count and (first + count - 1) * stride + window > total:
        raise IndexError(f"windows up to {first + count} run past the {total} rows")
    return _window_starts(iv, first, count, stride, starts)


cdef class FileSet:
    """A list of files, each with a byte base, read through the I/O engine.

    Nothing is opened here: a file is opened (``O_CLOEXEC``, then
    ``posix_fadvise(RANDOM)``) when a read first needs it, and closed again
    when the process-wide bound on descriptors needs room (least recently
    used first), by ``close()`` or by garbage collection.

    Args:
        paths: the files.
        bases: byte offset of each file's data (default 0).
        io: ``"auto"``, ``"uring"``, ``"threads"`` or ``"sync"`` (default:
            ``TOKLOAD_IO``, else ``"auto"``).
        queue_depth: reads in flight per batch, 1 to MAX_QUEUE_DEPTH
            (default: ``TOKLOAD_IO_DEPTH``, else DEFAULT_QUEUE_DEPTH).
        remote: for objects in an object store, one ``tokload.remote.RemoteObject``
            per path: every read is then a ranged GET (the ``"remote"``
            backend, ``tokload/_remote.pyx``), and ``io`` is ignored.
    """

    def __cinit__(self, paths, bases=None, *, io=None, queue_depth=None, remote=None):
        global _max_explicit
        self.files = NULL
        self.nfiles = 0
        self.closed = False
        self.paths = [os.fspath(p) for p in paths]
        self._cpaths = [os.fsencode(p) for p in self.paths]
        n = len(self.paths)
        bases = [0] * n if bases is None else list(bases)
        if len(bases) != n:
            raise ValueError(f"{n} files but {len(bases)} bases")
        self.remote = None if remote is None else list(remote)
        if self.remote is not None and len(self.remote) != n:
            raise ValueError(f"{n} files but {len(self.remote)} remote objects")
        self.backend = (lib.TL_IO_REMOTE if self.remote is not None
                        else _BACKEND_CODES[resolve_io(io)])
        self.depth = (default_queue_depth() if queue_depth is None
                      else _checked_depth(queue_depth, "queue_depth"))
        if not _max_explicit:
            # The default follows the limit in force when a dataset is opened.
            lib.tl_fdcache_set_max(&_cache, _default_max_open_files())
        self.files = <lib.tl_fent *>PyMem_Malloc(max(n, 1) * sizeof(lib.tl_fent))
        if self.files is NULL:
            raise MemoryError()
        cdef size_t i
        for i in range(n):
            lib.tl_fent_init(&self.files[i], PyBytes_AS_STRING(self._cpaths[i]), bases[i], i)
            if self.remote is not None:
                self.files[i].remote = <void *>self.remote[i]
        self.nfiles = n

    def configure(self, io=None, queue_depth=None):
        """Choose the I/O backend and/or the reads in flight per batch
        (``None`` leaves a setting as it is).  Takes effect at the next read.
        Objects in an object store always use the remote backend."""
        if io is not None and self.remote is None:
            self.backend = _BACKEND_CODES[resolve_io(io)]
        if queue_depth is not None:
            self.depth = _checked_depth(queue_depth, "queue_depth")

    @property
    def io(self):
        """The backend reads use: ``"uring"``, ``"threads"``, ``"sync"`` or
        ``"remote"`` (objects in an object store)."""
        return _BACKEND_NAMES[self.backend]

    @property
    def queue_depth(self):
        return self.depth

    def close(self):
        """Close every descriptor (idempotent); later reads raise ValueError."""
        self.closed = True
        if self.files is not NULL:
            lib.tl_fdcache_retire(&_cache, self.files, self.nfiles)

    def __dealloc__(self):
        if self.files is not NULL:
            lib.tl_fdcache_retire(&_cache, self.files, self.nfiles)
            PyMem_Free(self.files)
            self.files = NULL

    cdef int check_open(self) except -1:
        if self.closed:
            raise ValueError("I/O on a closed dataset")
        return 0

    cdef int engine_begin(self, lib.tl_engine *e) except -1:
        """Fill e for one call (takes a ring; give it back with engine_end)."""
        e.backend = self.backend
        e.depth = self.depth
        e.cache = &_cache
        e.pool = NULL
        e.ring = NULL
        e.faults = &_faults if _faults_on else NULL
        e.counters = &_counters
        e.remote = NULL
        e.remote_ctx = NULL
        if e.backend == lib.TL_IO_REMOTE:
            e.remote = remote_run
        elif e.backend == lib.TL_IO_THREADS:
            if _pool.nthreads + 1 < e.depth:
                lib.tl_pool_grow(&_pool, e.depth - 1)
            e.pool = &_pool
        elif e.backend == lib.TL_IO_URING:
            e.ring = _take_ring()
            if e.ring is NULL:  # out of memory or locked memory: this call reads in threads
                e.backend = lib.TL_IO_THREADS
                if _pool.nthreads + 1 < e.depth:
                    lib.tl_pool_grow(&_pool, e.depth - 1)
                e.pool = &_pool
        return 0

    cdef void engine_end(self, lib.tl_engine *e) noexcept:
        _put_ring(e.ring)
        e.ring = NULL

    def fds(self):
        """The descriptor of each file now (-1 where it is not open)."""
        return [self.files[i].fd for i in range(self.nfiles)]


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
        cdef uint8_t *dptr = &dst[0] if dst.shape[0] else NULL
        cdef size_t nreq = lib.tl_rows_count_reqs(&self.rs, &s[0], &l[0], 0, n), m
        cdef lib.tl_ioreq *reqs = <lib.tl_ioreq *>PyMem_Malloc(max(nreq, 1) * sizeof(lib.tl_ioreq))
        if reqs is NULL:
            raise MemoryError()
        cdef lib.tl_engine eng
        cdef lib.tl_io_error err
        cdef size_t failed = 0
        cdef int rc
        try:
            self.files.engine_begin(&eng)
            with nogil:
                m = lib.tl_rows_plan_many(&self.rs, &s[0], &l[0], 0, &d[0], n, dptr, reqs)
                rc = lib.tl_engine_run(&eng, reqs, m, &err, &failed)
            self.files.engine_end(&eng)
            if rc:
                i = reqs[failed].item
                _raise_io(&err, self.files.paths, f"rows [{sa[i]}, {sa[i] + la[i]})")
        finally:
            PyMem_Free(reqs)

    def read_windows(self, indices, uint64_t first, uint64_t count, uint64_t stride,
                     uint64_t window, out):
        """Read windows of observations ``indices`` into ``out``, in one call.

        Observation ``i`` (``0 <= i < count``) is rows ``[(first + i) * stride,
        (first + i) * stride + window)``; window ``b`` lands at byte
        ``b * window * row_bytes`` of ``out``.  Indices are checked in a
        compiled loop (no per-batch NumPy calls); the reads run without the GIL.
        """
        self.files.check_open()
        cdef const int64_t[::1] iv = _indices(indices)
        cdef uint8_t[::1] dst = out.reshape(-1).view(np.uint8)
        cdef size_t n = iv.shape[0]
        if n == 0:
            return
        if <uint64_t>dst.shape[0] < n * window * self.rs.row_bytes:
            raise ValueError(f"out holds {dst.shape[0]} bytes, need {n * window * self.rs.row_bytes}")
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
                m = lib.tl_ioreq_hint(reqs, nreq, &_cache)
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
        for i in range(n):
            if sv[i] > self.total or lv[i] > self.total - sv[i]:
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
                m = lib.tl_ioreq_hint(reqs, nreq, &_cache)
        finally:
            PyMem_Free(reqs)
        return m


cdef int _nomem(lib.tl_io_error *err, size_t file, size_t *failed) noexcept nogil:
    err.code = -_ENOMEM
    err.file = <int32_t>file
    err.offset = 0
    err.length = 0
    err.done = 0
    failed[0] = file
    return err.code


cdef class ShardTables:
    """Per shard, one whole index file of uint64 values, held in memory once a
    read first needs it.

    The tables are read without the GIL by whichever reader thread first
    needs them (one engine call for every table a batch lacks) and shared by
    every thread (``csrc/tokload/tables.h``).  They are freed with the object.

    Args:
        rs: the files, a RowSet of 8-byte rows (one file per shard).
        enabled: whether to hold them; when False, ``need`` loads nothing and
            callers read the entries they need from the files instead.
        compress: hold each table as ``csrc/tokload/ctab.h`` does (about 2
            bytes an entry; for values that grow by small steps, as a
            metadata block index does) instead of as it is (8 bytes an
            entry); callers then decode the entries they need.
    """

    def __cinit__(self, RowSet rs not None, bint enabled, bint compress=False):
        self.tabs = NULL
        if rs.rs.row_bytes != 8:
            raise ValueError("tables hold uint64 values: rows of 8 bytes")
        self.rs = rs
        self.enabled = enabled
        self.compress = compress
        self.n = rs.files.nfiles
        self.tabs = <void **>calloc(max(self.n, 1), sizeof(void *))
        if self.tabs is NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef size_t k
        if self.tabs is not NULL:
            for k in range(self.n):
                free(self.tabs[k])
            free(self.tabs)
            self.tabs = NULL

    def loaded(self):
        """The shards whose tables are in memory now."""
        cdef size_t k
        return [k for k in range(self.n) if lib.tl_table_get(&self.tabs[k]) != NULL]

    def held_bytes(self):
        """Bytes the tables in memory now take (each compressed one's whole
        block, header included)."""
        cdef size_t k
        cdef uint64_t total = 0
        cdef void *t
        for k in range(self.n):
            t = lib.tl_table_get(&self.tabs[k])
            if t == NULL:
                continue
            if self.compress:
                total += lib.tl_ctab_size(<lib.tl_ctab *>t)
            else:
                total += 8 * (self.rs.rs.cum[k + 1] - self.rs.rs.cum[k])
        return total

    cdef int need(self, const lib.tl_engine *eng, const uint32_t *shards, size_t count,
                  lib.tl_io_error *err, size_t *failed) noexcept nogil:
        """Make the tables of ``shards`` (repeats allowed) present, reading
        those not in memory yet in one engine call.  0, or an error code
        (-ENOMEM when out of memory: ``_raise_io`` makes it a MemoryError) with
        ``err`` filled and ``*failed`` the shard whose table failed."""
        cdef size_t i, j, m = 0, k
        cdef int rc = 0
        cdef uint64_t start, nrows
        cdef lib.tl_ioreq *reqs
        cdef void **bufs
        cdef size_t nfailed = 0
        if not self.enabled:
            return 0
        for i in range(count):  # the common case: every table is there already
            if lib.tl_table_get(&self.tabs[shards[i]]) == NULL:
                break
        else:
            return 0
        reqs = <lib.tl_ioreq *>malloc(count * (sizeof(lib.tl_ioreq) + sizeof(void *)))
        if reqs == NULL:
            return _nomem(err, shards[0], failed)
        bufs = <void **>(<char *>reqs + count * sizeof(lib.tl_ioreq))
        for i in range(count):
            k = shards[i]
            if lib.tl_table_get(&self.tabs[k]) != NULL:
                continue
            for j in range(m):
                if reqs[j].item == k:
                    break
            else:
                start = self.rs.rs.cum[k]
                nrows = self.rs.rs.cum[k + 1] - start
                bufs[m] = malloc(nrows * 8 if nrows else 8)
                if bufs[m] == NULL:
                    rc = _nomem(err, k, failed)
                    break
                lib.tl_rows_plan_many(&self.rs.rs, &start, &nrows, 0, NULL, 1,
                                      <uint8_t *>bufs[m], &reqs[m])
                reqs[m].item = k
                m += 1
        if rc == 0 and m:
            rc = lib.tl_engine_run(eng, reqs, m, err, &nfailed)
            if rc:
                failed[0] = reqs[nfailed].item
        if rc == 0 and self.compress:
            for j in range(m):
                k = reqs[j].item
                bufs[j] = _compressed(bufs[j], self.rs.rs.cum[k + 1] - self.rs.rs.cum[k])
                if bufs[j] == NULL:
                    rc = _nomem(err, k, failed)  # the others are freed below
                    break
        for j in range(m):
            if rc or not lib.tl_table_publish(&self.tabs[reqs[j].item], bufs[j]):
                free(bufs[j])
        free(reqs)
        return rc


cdef void *_compressed(void *raw, uint64_t n) noexcept nogil:
    """The ctab.h table of the ``n`` entries at ``raw`` (freed here), or NULL
    when out of memory."""
    cdef uint64_t nfull
    cdef uint64_t nbytes = lib.tl_ctab_bytes(<uint64_t *>raw, n, &nfull)
    cdef void *mem = malloc(nbytes)
    if mem != NULL:
        lib.tl_ctab_build(<uint64_t *>raw, n, nfull, mem)
    free(raw)
    return mem


def compressed_table_bytes(uint64_t n):
    """The least bytes a table of ``n`` entries takes compressed (every group
    of 64 entries fits; each one that does not adds 512 bytes): about 2.1
    bytes an entry.  Used to weigh a metadata block index against
    ``TOKLOAD_INDEX_MEMORY``."""
    return lib.tl_ctab_bytes_least(n)


cdef class CompressedTable:
    """One table as ``ShardTables`` holds it with ``compress=True``
    (``csrc/tokload/ctab.h``), to check its decoding and measure its size.

    Args:
        entries: the uint64 values (any values: groups whose steps do not fit
            2 bytes are kept as they are).
    """

    cdef void *t
    cdef readonly uint64_t n

    def __cinit__(self, entries):
        cdef const uint64_t[::1] e = np.ascontiguousarray(entries, dtype=np.uint64).reshape(-1)
        self.n = e.shape[0]
        cdef uint64_t zero = 0
        cdef void *raw = _copied(&e[0] if self.n else &zero, self.n)
        if raw == NULL:
            raise MemoryError()
        self.t = _compressed(raw, self.n)
        if self.t == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.t)

    @property
    def nbytes(self):
        """Bytes the table takes (header included)."""
        return lib.tl_ctab_size(<lib.tl_ctab *>self.t)

    @property
    def full_groups(self):
        """Groups of 64 entries kept as they are (their steps do not fit)."""
        return (<lib.tl_ctab *>self.t).nfull

    def decode(self, uint64_t first, uint64_t count):
        """Entries ``[first, first + count)``, a uint64 array; ``IndexError``
        past the end."""
        out = np.empty(count, dtype=np.uint64)
        cdef uint64_t[::1] o = out
        cdef uint64_t dummy
        if lib.tl_ctab_decode(<lib.tl_ctab *>self.t, first, count, &o[0] if count else &dummy):
            raise IndexError(f"entries [{first}, {first + count}) of a table of {self.n}")
        return out


cdef void *_copied(const uint64_t *e, uint64_t n) noexcept:
    """A malloc'd copy of ``n`` values (at least 8 bytes), or NULL."""
    cdef void *p = malloc(n * 8 if n else 8)
    if p != NULL and n:
        memcpy(p, e, n * 8)
    return p


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


cdef class ExtentIndex:
    """What the document indexes share: each document's first global row and
    length, read in one batch on the I/O engine (``read_documents`` uses
    it without a Python call per document)."""

    cdef readonly uint64_t total

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
        self.tables = ShardTables(RowSet(files, counts + np.uint64(1), 8), in_memory)

    cdef FileSet _files(self):
        return self.files

    cdef int fill(self, const uint64_t *ids, size_t n, uint64_t *starts,
                  uint64_t *lengths) except -1:
        cdef lib.tl_io_error err
        cdef lib.tl_engine eng
        cdef size_t failed = 0
        cdef int rc = 0
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


cdef class MegatronIndex(ExtentIndex):
    """Sequence extents from a Megatron ``.idx``: int32 lengths at ``len_off``,
    int64 byte pointers at ``ptr_off``; 12 bytes read per sequence."""

    cdef readonly FileSet file
    cdef uint64_t len_off, ptr_off, itemsize, bin_rows

    def __cinit__(self, FileSet file, uint64_t nseq, uint64_t len_off, uint64_t ptr_off,
                  uint64_t itemsize, uint64_t bin_rows):
        self.file = file
        self.total = nseq
        self.len_off = len_off
        self.ptr_off = ptr_off
        self.itemsize = itemsize
        self.bin_rows = bin_rows

    def _what(self):
        return "sequence"

    cdef FileSet _files(self):
        return self.file

    cdef int fill(self, const uint64_t *ids, size_t n, uint64_t *starts,
                  uint64_t *lengths) except -1:
        cdef lib.tl_io_error err
        cdef lib.tl_engine eng
        cdef size_t failed = 0
        cdef int rc = 0
        # one allocation: two requests, an int32 length and an int64 pointer per sequence
        cdef char *mem = <char *>PyMem_Malloc(n * (2 * sizeof(lib.tl_ioreq) + 12))
        if mem is NULL:
            raise MemoryError()
        cdef lib.tl_ioreq *reqs = <lib.tl_ioreq *>mem
        cdef int64_t *ptrs = <int64_t *>(mem + 2 * n * sizeof(lib.tl_ioreq))
        cdef int32_t *lens = <int32_t *>(mem + 2 * n * sizeof(lib.tl_ioreq) + 8 * n)
        try:
            self.file.engine_begin(&eng)
            with nogil:
                lib.tl_megatron_plan(&self.file.files[0], self.len_off, self.ptr_off, ids, n,
                                     lens, ptrs, reqs)
                rc = lib.tl_engine_run(&eng, reqs, 2 * n, &err, &failed)
                if rc:
                    failed = reqs[failed].item
                else:
                    rc = lib.tl_megatron_finish(self.ptr_off, self.itemsize, self.bin_rows, ids,
                                                n, lens, ptrs, starts, lengths, &err, &failed)
            self.file.engine_end(&eng)
            if rc:
                _raise_io(&err, self.file.paths, f"the pointer of sequence {ids[failed]}")
        finally:
            PyMem_Free(mem)
        return 0


def window_boundaries(ExtentIndex index not None, indices, uint64_t first, uint64_t count,
                      uint64_t stride, uint64_t window, uint64_t total_rows, alloc,
                      per_token=("position_ids", "segment_ids", "loss_mask")):
    """The attention metadata of observations ``indices`` of a view of ``count``
    windows of ``window`` rows, observation ``i`` starting at row
    ``(first + i) * stride`` (checked as ``RowSet.read_windows`` checks them).

    Finds the documents that start inside each window: where the index is a
    tokload dataset's with its shards' tables held in memory, by a binary search
    of each table a window spans, in C; otherwise with a batched search of
    ``index`` (one ``fill`` of all active searches per round: a few rounds for
    documents of similar sizes, at most ``2 log2(documents)``) and one more
    ``fill`` for their first rows. Then computes the arrays in C without the
    GIL. Returns ``(arrays, cu_seqlens, max_seqlen)``: ``arrays`` holds those
    of ``"position_ids"`` (int64), ``"segment_ids"`` (int32) and
    ``"loss_mask"`` (bool) that ``per_token`` names, each ``[B, window]`` and
    allocated with ``alloc`` (the others are not computed); ``cu_seqlens`` is
    int32 over the flattened batch. Document 0 must start at row 0 and the
    index be sorted by row (checked where a window sees it).
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
    if nwin * window >= (<uint64_t>1 << 31):
        raise ValueError(f"{nwin} windows of {window} rows: cu_seqlens (int32) cannot hold "
                         f"{nwin * window} tokens")
    index._files().check_open()
    if isinstance(index, DocIndex) and (<DocIndex>index).tables.enabled and nwin:
        # the shards' indexes are held in memory: search them directly
        ncuts, cuts = _cuts_from_tables(<DocIndex>index, r, window)
        return _boundary_arrays(r, window, ncuts, cuts, alloc, per_token)
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
    return _boundary_arrays(r, window, ncuts, cuts, alloc, per_token)


cdef tuple _cuts_from_tables(DocIndex index, const uint64_t[::1] r, uint64_t window):
    """The cuts of the windows at rows ``r`` from the shards' document indexes held
    in memory (loaded here for the shards the windows span): no search rounds."""
    cdef size_t nwin = r.shape[0], nfiles = index.files.nfiles, i, m = 0
    cdef const uint64_t *row_cum = &index._row_cum[0]
    cdef uint32_t k, k0, k1
    cdef lib.tl_engine eng
    cdef lib.tl_io_error err
    cdef size_t failed = 0
    cdef int rc = 0
    cdef ShardTables tables = index.tables
    # the shards every window spans (at most a few each), for loading their tables
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


cdef tuple _boundary_arrays(const uint64_t[::1] r, uint64_t window, ncuts, cuts, alloc,
                            per_token):
    """The arrays of ``window_boundaries`` from each window's cuts."""
    cdef size_t nwin = r.shape[0]
    cdef size_t total = cuts.shape[0]
    arrays = {}
    cdef int64_t *pp = NULL
    cdef int32_t *sp = NULL
    cdef uint8_t *mp = NULL
    cdef int64_t[:, ::1] pv
    cdef int32_t[:, ::1] sv
    cdef uint8_t[:, ::1] mv
    if nwin and "position_ids" in per_token:
        arrays["position_ids"] = pv = alloc((nwin, window), np.dtype(np.int64))
        pp = &pv[0, 0]
    if nwin and "segment_ids" in per_token:
        arrays["segment_ids"] = sv = alloc((nwin, window), np.dtype(np.int32))
        sp = &sv[0, 0]
    if nwin and "loss_mask" in per_token:
        arrays["loss_mask"] = maska = alloc((nwin, window), np.dtype(np.bool_))
        mv = maska.view(np.uint8)
        mp = &mv[0, 0]
    cu = np.empty(total + nwin + 1, dtype=np.int32)
    cdef const uint64_t[::1] cv = cuts, nv = ncuts
    cdef int32_t[::1] cuv = cu
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
        for key, dt in (("position_ids", np.int64), ("segment_ids", np.int32),
                        ("loss_mask", np.bool_)):
            if key in per_token:
                arrays[key] = alloc((0, window), np.dtype(dt))
        cu[0] = 0
        k = 1
    return arrays, cu[:k], int(longest)


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
            dst = values.reshape(-1).view(np.uint8)
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
        """Read the spans from ``gather`` into ``out`` (bytes, ``blob_bytes`` long)."""
        self.data_files.check_open()
        sarr = np.ascontiguousarray(spans, dtype=_SPAN_DTYPE)
        cdef size_t n = sarr.shape[0]
        if n == 0:
            return
        cdef uint8_t[::1] sp_raw = sarr.view(np.uint8)
        cdef lib.tl_meta_span *sp = <lib.tl_meta_span *>&sp_raw[0]
        cdef uint8_t[::1] dst = out
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
