"""Files and the I/O engine: every read tokload makes goes through here.

The one job of this module is to own the I/O engine (``csrc/tokload/engine.h``)
and the files it reads: the process-wide descriptor cache, thread pool and
io_uring rings, the ``FileSet`` of a dataset's files (local, or objects in an
object store read by the remote backend, ``tokload/_remote.pyx``), the engine
set-up of each call, the conversion of the index arrays the Python layer passes,
and the translation of C error codes into exceptions that name the file and the
offset.  The readers built on it are one module per concern: rows
(``_rows.pyx``), per-shard tables (``_tables.pyx``), the document index and
batch boundaries (``_docindex.pyx``), the Megatron index (``_megatron.pyx``),
per-row metadata ids (``_metaids.pyx``), metadata spans and blocks
(``_meta.pyx``).

I/O backends (``io=``): ``"uring"`` (io_uring through raw system calls),
``"threads"`` (a pool of C threads issuing ``preadv``), ``"sync"`` (one read
after the other: the reference), ``"auto"`` (io_uring if the kernel allows it
here, else threads); objects in an object store always use ``"remote"``.  Each
batch keeps up to ``queue_depth`` reads in flight.  Defaults come from
``TOKLOAD_IO`` and ``TOKLOAD_IO_DEPTH``.  Files are opened when first read; at
most ``max_open_files()`` descriptors stay open process-wide
(``TOKLOAD_MAX_OPEN_FILES``; by default the smaller of 256 and a quarter of the
soft ``RLIMIT_NOFILE``), least recently used closed first.
"""


from cpython.bytes cimport PyBytes_AS_STRING
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.errno cimport ENOMEM as _ENOMEM
from libc.string cimport memcpy, strerror

cimport tokload._lib as lib
from tokload._remote cimport ready as _remote_ready, remote_run

import errno as _errno
import os
import resource
import threading
import weakref

import numpy as np

from tokload._remote import take_error as _take_remote_error
from tokload.arguments import is_integer
from tokload.envvars import env_int
from tokload.errors import CorruptDataError, MissingShardError, TruncatedFileError, UsageError

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
# Debug builds: the injected io_uring_enter failure of every ring handed out
# (_debug_fail_enter_after), and what the rings destroyed as broken had left.
cdef int64_t _enter_fail_after = -1
cdef int _enter_fail_code = 0
cdef int _enter_fail_waits = 0
cdef uint64_t _broken_rings = 0
cdef uint64_t _broken_inflight = 0
# Rings handed to a call now (their addresses), and every FileSet alive: what
# a forked child must take back from threads it does not have (_after_fork_in_child).
_rings_out = set()
_live_sets = weakref.WeakSet()

# This thread's override of every FileSet's settings (io_scope): (backend code or -1,
# depth or 0), or absent.
_scope = threading.local()


class io_scope:
    """``with io_scope(io, queue_depth):`` the reads this thread runs use that
    backend (``"auto"``, ``"uring"``, ``"threads"``, ``"sync"``; objects in an
    object store keep theirs) and reads in flight, whatever each FileSet's own
    settings are; None leaves a setting to the FileSet. A DataLoader's reader
    threads read in its scope, so ``DataLoader(read=ReadOptions(io=...))`` changes no other
    loader of the same dataset. Scopes nest; each restores the one it replaced."""

    def __init__(self, io=None, queue_depth=None):
        self.value = (-1 if io is None else _BACKEND_CODES[resolve_io(io)],
                      0 if queue_depth is None else _checked_depth(queue_depth, "io_depth"))

    def __enter__(self):
        here = _scope.__dict__  # this thread's: one scope object may serve several threads
        here.setdefault("saved", []).append(here.get("value"))
        here["value"] = self.value
        return self

    def __exit__(self, *exc):
        here = _scope.__dict__
        here["value"] = here["saved"].pop()
        return False


def _default_max_open_files(bint strict=True):
    try:
        n = env_int("TOKLOAD_MAX_OPEN_FILES", 0, 1, "a positive integer")
    except UsageError:
        if strict:
            raise
        n = 0  # (at import: refused when a dataset is opened, so `tokload --version` runs)
    if n:
        return n
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 256
    return max(1, min(256, soft // 4))


lib.tl_fdcache_init(&_cache, _default_max_open_files(False))
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
        if not is_integer(n) or n < 1:  # (2.7 ran as 2, True as 1, "3" as 3)
            raise ValueError(f"max_open_files must be an integer >= 1, got {n!r}")
        n = int(n)
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
            _uring_errno = -rc
            PyMem_RawFree(r)
            if -rc in (_errno.EMFILE, _errno.ENFILE, _errno.ENOMEM):
                return 0  # out of descriptors or memory now: unavailable, probed again later
            _uring_state = 0
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
        error = UsageError if where.startswith("TOKLOAD_") else ValueError
        raise error(f"{where}: expected one of {', '.join(IO_CHOICES)}")
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
    return _checked_depth(env, "TOKLOAD_IO_DEPTH", text=True)


def checked_io_settings(io=None, queue_depth=None):
    """``(backend, depth)`` that ``io`` and ``queue_depth`` select (``None`` for one
    not given), or the error a setting gets, before anything is changed (a view's
    files are configured one file set after another)."""
    backend = None if io is None else resolve_io(io)
    depth = None if queue_depth is None else _checked_depth(queue_depth, "queue_depth")
    return backend, depth


def _checked_depth(value, str where, bint text=False):
    """``value`` as a queue depth: an integer argument (a float or bool is refused,
    not truncated), or with ``text`` an environment variable's digits."""
    d = 0
    if is_integer(value):
        d = int(value)
    elif text:
        try:
            d = int(value)
        except ValueError:
            pass
    if not 1 <= d <= MAX_QUEUE_DEPTH:
        error = UsageError if text else ValueError  # (an environment variable's: a setting)
        raise error(f"{where}={value!r}: expected an integer in [1, {MAX_QUEUE_DEPTH}]")
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
    global _nrings, _broken_rings, _broken_inflight
    if r is NULL:
        return
    if r.broken:
        _broken_rings += 1
        _broken_inflight += r.inflight
    if r.broken or _nrings == 64:
        lib.tl_uring_destroy(r)
        PyMem_RawFree(r)
        return
    _rings[_nrings] = r
    _nrings += 1


def _after_fork_in_child():
    # The child has none of the parent's threads: no read is in flight here.
    # The descriptors are still valid, but the pins of the reads the parent's
    # threads were making would never be released: the cache starts over and
    # takes back every live set's files, unpinned.  The pool's threads are
    # gone, and every ring (idle, or in use by a thread of the parent) is the
    # parent's, its memory shared with it: the child closes its copies and
    # makes rings of its own.  Its reads are its own: the totals start from zero.
    global _nrings, _counters
    cdef FileSet fs
    cdef lib.tl_uring *r
    _counters.calls = _counters.requests = _counters.bytes = _counters.failed = 0
    _counters.ns = 0
    lib.tl_fdcache_after_fork(&_cache)
    for fs in list(_live_sets):
        if fs.files is not NULL:
            lib.tl_fdcache_adopt(&_cache, fs.files, fs.nfiles)
    lib.tl_pool_after_fork(&_pool)
    while _nrings:
        _nrings -= 1
        lib.tl_uring_destroy(_rings[_nrings])
        PyMem_RawFree(_rings[_nrings])
    for addr in _rings_out:
        r = <lib.tl_uring *><uintptr_t>addr
        lib.tl_uring_destroy(r)
        PyMem_RawFree(r)
    _rings_out.clear()


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


def _debug_fail_enter_after(n, code=_errno.EIO, waits=False):
    """Debug builds only: every later io_uring batch submits at most ``n``
    reads; its next ``io_uring_enter`` that would submit more fails with errno
    ``code`` (without reaching the kernel), as a ring that fails for good;
    ``waits``: so do the calls that only wait for completions.  While armed,
    reads go to the kernel's workers and a submission does not wait, so reads
    are in flight when it fails.  ``n < 0`` switches it off."""
    global _enter_fail_after, _enter_fail_code, _enter_fail_waits
    if not FAULTS_BUILT:
        raise RuntimeError("fault injection needs a debug build (TOKLOAD_DEBUG=1 pip install -e .)")
    code = int(code)
    if n >= 0 and code <= 0:
        raise ValueError(f"code must be a positive errno, got {code}")
    _enter_fail_after = -1 if n < 0 else int(n)
    _enter_fail_code = code
    _enter_fail_waits = bool(waits)


def _debug_uring_broken():
    """Rings destroyed after an io_uring_enter failed for good, and the reads
    the kernel still had in them when their batch returned (summed): 0 means
    no completion could come after the caller freed its buffer."""
    return {"rings": _broken_rings, "inflight": _broken_inflight}


def _eof_byte(path, uint64_t offset, uint64_t done):
    """Where a read that stopped short found the file's end: after the ``done`` bytes
    it got, or (none) where the file ends now, which is at or before ``offset``."""
    if done:
        return f"byte {offset + done}"
    try:
        size = os.stat(path).st_size
    except (OSError, TypeError, ValueError):
        return f"or before byte {offset}"
    return f"byte {size}" if size <= offset else f"or before byte {offset}"


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
            f"{path}: file ended at {_eof_byte(path, err.offset, err.done)} while reading "
            f"{what} ({err.length} bytes at offset {err.offset}); was it truncated after "
            "opening?"
        )
    if err.code == lib.TL_ERR_CORRUPT:
        raise CorruptDataError(f"{path}: {what}: bad value {err.done} at byte {err.offset}")
    code = -err.code
    if code == _errno.EBADF:  # fdcache.h: the dataset was closed while this read ran
        raise ValueError(f"I/O on a closed dataset ({path}: closed while reading {what})")
    if code == _errno.ENOMEM:  # a table held in memory that could not be allocated
        raise MemoryError(f"{path}: out of memory while reading {what}")
    msg = f"{strerror(code).decode()} while reading {what} ({err.length} bytes at offset {err.offset})"
    if code == _errno.ENOENT:
        raise MissingShardError(code, msg, path)
    if code == _errno.ESTALE:  # fdcache.h: not the file the dataset was opened with
        raise MissingShardError(
            code,
            f"the file at this path is not the one the dataset was opened with (another size "
            f"or modification time: rebuilt or copied over since); open the dataset again "
            f"(while reading {what})",
            path,
        )
    raise OSError(code, msg, path)


cdef str _layout(a):
    """How ``a`` (an array that is not C-contiguous) is laid out, for messages."""
    if a.ndim > 1 and a.flags.f_contiguous:
        return f"a Fortran-ordered array of shape {a.shape}"
    return f"an array of shape {a.shape} and strides {a.strides}"


cdef uint8_t[::1] _out_bytes(out, uint64_t item, need, bint exact, str what):
    """The bytes of ``out``, a caller's buffer that C fills in place (as
    numpy/random's ``check_output``): a writable C-contiguous array (or buffer)
    of plain items of ``item`` bytes or of single bytes, holding exactly
    ``need`` bytes (``exact``) or at least that many (the first are filled).
    A copy made to fit would be filled instead of ``out``, which would come
    back unchanged without an error: anything else is refused here, before
    any read, with a ValueError naming what was expected and what was given
    (a TypeError for an object that is no buffer)."""
    if isinstance(out, np.ndarray):
        a = out
    else:
        try:
            a = np.asarray(memoryview(out))
        except TypeError:
            raise TypeError(f"{what} must be a writable buffer such as a NumPy array, "
                            f"got {type(out).__name__}") from None
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a writable C-contiguous array (it is filled in "
                         f"place), got {_layout(a)}")
    if not a.flags.writeable:
        raise ValueError(f"{what} must be writable, got a read-only {type(out).__name__}")
    dt = a.dtype
    if dt.hasobject:
        raise ValueError(f"{what} must hold plain bytes, got dtype {dt} (holds Python objects)")
    if dt.itemsize != item and dt.itemsize != 1:
        size = "1 byte" if item == 1 else f"{item} bytes or of 1 byte"
        raise ValueError(f"{what} must have items of {size}, got dtype {dt} "
                         f"({dt.itemsize} bytes)")
    if (exact and a.nbytes != need) or a.nbytes < need:
        raise ValueError(f"{what} holds {a.nbytes} bytes, expected "
                         f"{'' if exact else 'at least '}{need}")
    return a.reshape(-1).view(np.uint8)


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
            (default: ``TOKLOAD_IO_DEPTH``, else DEFAULT_QUEUE_DEPTH; for
            objects in a store, else MAX_QUEUE_DEPTH: the process sizes its
            GETs in flight from the latency, ``tokload.remote``).
        remote: for objects in an object store, one ``tokload.remote.RemoteObject``
            per path: every read is then a ranged GET (the ``"remote"``
            backend, ``tokload/_remote.pyx``), and ``io`` is ignored.
        known: for local files, ``(inode, size, mtime_ns)`` of each as the dataset was
            checked (or None for a file not checked): a file found at its path
            with another size or mtime when it is opened, later, is not read
            (``MissingShardError``: the dataset was rebuilt or copied over).
    """

    def __cinit__(self, paths, bases=None, *, io=None, queue_depth=None, remote=None,
                  known=None):
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
        known = [None] * n if known is None else list(known)
        if len(known) != n:
            raise ValueError(f"{n} files but {len(known)} known sizes and times")
        self.backend = (lib.TL_IO_REMOTE if self.remote is not None
                        else _BACKEND_CODES[resolve_io(io)])
        if queue_depth is not None:
            self.depth = _checked_depth(queue_depth, "queue_depth")
        elif self.remote is not None and not os.environ.get("TOKLOAD_IO_DEPTH"):
            # GETs in flight are sized process-wide from the latency seen
            # (tokload.remote.fetch._Flow): a batch's own bound stays out of the way
            self.depth = MAX_QUEUE_DEPTH
        else:
            self.depth = default_queue_depth()
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
            elif known[i] is not None:
                self.files[i].known = 1
                self.files[i].ino, self.files[i].size, self.files[i].mtime_ns = known[i]
        self.nfiles = n
        _live_sets.add(self)  # a forked child takes its files back (_after_fork_in_child)

    def configure(self, io=None, queue_depth=None):
        """Choose the I/O backend and/or the reads in flight per batch
        (``None`` leaves a setting as it is).  Takes effect at the next read.
        Objects in an object store always use the remote backend.  A refused
        setting changes neither."""
        backend, depth = checked_io_settings(io, queue_depth)
        if backend is not None and self.remote is None:
            self.backend = _BACKEND_CODES[backend]
        if depth is not None:
            self.depth = depth

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
        scoped = getattr(_scope, "value", None)
        if scoped is not None:
            if scoped[0] >= 0 and self.remote is None:
                e.backend = scoped[0]
            if scoped[1]:
                e.depth = scoped[1]
        e.cache = &_cache
        e.pool = NULL
        e.ring = NULL
        e.faults = &_faults if _faults_on else NULL
        e.counters = &_counters
        e.remote = NULL
        e.remote_ctx = NULL
        if e.backend == lib.TL_IO_REMOTE:
            _remote_ready()  # this process's fetcher runs (tokload/_remote.pyx)
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
            else:
                _rings_out.add(<uintptr_t>e.ring)
                e.ring.fail_after = _enter_fail_after
                e.ring.fail_code = _enter_fail_code
                e.ring.fail_waits = _enter_fail_waits
        return 0

    cdef void engine_end(self, lib.tl_engine *e) noexcept:
        if e.ring is not NULL:
            _rings_out.discard(<uintptr_t>e.ring)
        _put_ring(e.ring)
        e.ring = NULL

    def fds(self):
        """The descriptor of each file now (-1 where it is not open)."""
        return [self.files[i].fd for i in range(self.nfiles)]


cdef int _nomem(lib.tl_io_error *err, size_t file, size_t *failed) noexcept nogil:
    err.code = -_ENOMEM
    err.file = <int32_t>file
    err.offset = 0
    err.length = 0
    err.done = 0
    failed[0] = file
    return err.code



cdef lib.tl_fdcache *_fdcache() noexcept nogil:
    """The process-wide descriptor cache (for read hints)."""
    return &_cache
