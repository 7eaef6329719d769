"""A keyed pseudorandom permutation of ``[0, n)``, computed per index.

The one job of this module is to wrap the generalized Feistel cipher of
``csrc/tokload/gfc.h``: argument checks and conversions happen here with the
GIL held, whole arrays are permuted in C without it.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport uint32_t, uint64_t

cimport tokload._lib as lib

import operator
import os
import threading

import numpy as np

# Largest table of round outputs built automatically, in bytes.  Larger tables
# stop fitting in the CPU caches, and past that point a lookup costs more than
# computing Speck (measured in bench/bench_permute.py).
AUTO_TABLE_MAX_BYTES = 4 << 20
# Arrays shorter than this are permuted without releasing the GIL (at most some
# 30 us of work): retaking it costs more than the work, and when another thread
# runs Python flat out (a training loop), it costs up to a whole switch interval
# (5 ms) each time. A loader's task of a few hundred samples stays under it.
cdef enum:
    _NOGIL_MIN = 4096
# Rounds beyond this are surely a mistake (and cost 108 bytes each).
MAX_ROUNDS = 1 << 16

_U64_LIMIT = 1 << 64


cdef uint64_t _as_u64(object value, str name, int lo=0, object hi=None) except? 0xFFFFFFFFFFFFFFFF:
    """Convert a Python integer in [lo, hi] (hi: 2**64 - 1 by default) or raise
    naming the argument; a bool is not an integer here (``True`` as n=1)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if not lo <= v < _U64_LIMIT or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {'2**64 - 1' if hi is None else hi}], "
                         f"got {v}")
    return <uint64_t>v


def epoch_seed(seed, epoch):
    """The permutation key of epoch ``epoch`` of a run seeded with ``seed``.

    It is Speck64/128 of the 64-bit block ``epoch`` under the 128-bit key
    ``("tokl", "epoc", seed)``, so for a fixed ``seed`` distinct epochs always
    get distinct keys.  ``Permutation.for_epoch(n, seed, epoch)`` is
    ``Permutation(n, seed=epoch_seed(seed, epoch))``.

    Both arguments are integers in ``[0, 2**64)``; the result is one too.
    """
    return lib.tl_gfc_epoch_seed(_as_u64(seed, "seed"), _as_u64(epoch, "epoch"))


def epoch_seeds(seeds, epochs):
    """``epoch_seed(seeds[i], epochs[i])`` for every ``i`` (uint64 arrays of one
    length; a scalar is repeated), in one compiled call."""
    s = np.ascontiguousarray(np.broadcast_to(seeds, np.shape(epochs)), dtype=np.uint64)
    e = np.ascontiguousarray(epochs, dtype=np.uint64)
    if s.ndim != 1 or e.ndim != 1:
        raise ValueError(f"seeds and epochs must be 1-D, got shapes {s.shape} and {e.shape}")
    out = np.empty(e.shape[0], dtype=np.uint64)
    cdef const uint64_t[::1] sv = s, ev = e
    cdef uint64_t[::1] ov = out
    cdef size_t n = e.shape[0]
    if n < _NOGIL_MIN:
        _epoch_seeds(&sv[0] if n else NULL, &ev[0] if n else NULL, &ov[0] if n else NULL, n)
    else:
        with nogil:
            _epoch_seeds(&sv[0], &ev[0], &ov[0], n)
    return out


cdef enum:
    _SEEDS_KEPT = 64  # (seed, epoch) pairs remembered by _epoch_seeds (a power of two)


cdef void _epoch_seeds(const uint64_t *seeds, const uint64_t *epochs, uint64_t *out,
                       size_t n) noexcept nogil:
    """out[i] = epoch_seed(seeds[i], epochs[i]); a pair seen before (a blend's
    positions fall in a few component epochs each) is looked up in a small
    table instead of computing Speck's key schedule and encryption again."""
    cdef uint64_t kept_seed[_SEEDS_KEPT]
    cdef uint64_t kept_epoch[_SEEDS_KEPT]
    cdef uint64_t kept[_SEEDS_KEPT]
    cdef bint used[_SEEDS_KEPT]
    cdef size_t i, slot
    for i in range(_SEEDS_KEPT):
        used[i] = False
    for i in range(n):
        slot = <size_t>(((seeds[i] ^ epochs[i]) * <uint64_t>0x9E3779B97F4A7C15) >> 58)
        if not (used[slot] and kept_seed[slot] == seeds[i] and kept_epoch[slot] == epochs[i]):
            used[slot] = True
            kept_seed[slot], kept_epoch[slot] = seeds[i], epochs[i]
            kept[slot] = lib.tl_gfc_epoch_seed(seeds[i], epochs[i])
        out[i] = kept[slot]


cdef enum:
    _TAKE_TABLE_MAX = 1 << 16  # uint32 round outputs of one run's table (256 KiB)
    _KEPT_TABLE_MAX = 1 << 12  # ... of a table kept in ``tables`` (16 KiB)
    _KEPT_RUN_MIN = 8  # runs shorter than this do not look in ``tables``

# Tables kept in a ``take_many(tables=...)`` dict at most (oldest out first): with
# _KEPT_TABLE_MAX, 4 MiB.
TABLES_KEPT = 256


def take_many(ns, seeds, indices, rounds=6, tables=None):
    """``Permutation(ns[i], seed=seeds[i], rounds=rounds)[indices[i]]`` for every
    ``i``: one permutation per element, bit for bit ``Permutation``'s, in one
    compiled call without the GIL (a run of elements with the same ``n`` and
    ``seed`` expands its round keys once: sort by them to share).

    ``ns``, ``seeds`` and ``indices`` are 1-D integer arrays of one length, each
    ``ns[i] >= 1`` and ``0 <= indices[i] < ns[i]``; returns uint64.

    A run long enough to repay it precomputes its permutation's round outputs
    (a table, as ``Permutation``'s).  ``tables``, a dict, keeps those tables
    between calls, keyed by ``(n, seed, rounds)``: a later run of 8 elements or
    more of the same permutation uses the kept table instead of filling it
    again, even when it is too short to repay one (a blend's groups fall in the
    same component epochs call after call; shorter runs, as a long blend's
    positions in as many epochs, do not look).  It keeps at most
    ``TABLES_KEPT`` tables of up to 16 KiB, the oldest out first; it needs no
    lock (each step is one dict operation under the GIL), and a table is a pure
    function of its key, so a forked child may use it.
    """
    cdef uint64_t crounds = _as_u64(rounds, "rounds", 0, MAX_ROUNDS)
    n = np.ascontiguousarray(ns, dtype=np.uint64)
    s = np.ascontiguousarray(seeds, dtype=np.uint64)
    x = np.ascontiguousarray(indices, dtype=np.uint64)
    if n.ndim != 1 or n.shape != s.shape or n.shape != x.shape:
        raise ValueError(f"ns, seeds and indices must be 1-D of one length, got shapes "
                         f"{n.shape}, {s.shape} and {x.shape}")
    if tables is not None and not isinstance(tables, dict):
        raise TypeError(f"tables must be a dict or None, got {type(tables).__name__}")
    out = np.empty(x.shape[0], dtype=np.uint64)
    cdef const uint64_t[::1] nv = n, sv = s, xv = x
    cdef uint64_t[::1] ov = out
    cdef size_t i, e, r, count = x.shape[0], nruns = 0
    for i in range(count):
        if nv[i] == 0 or xv[i] >= nv[i]:
            raise IndexError(f"index {xv[i]} is out of range for a permutation of {nv[i]}")
    if count == 0:
        return out
    # the runs of one permutation: run r is [starts[r], starts[r + 1])
    starts_arr = np.empty(count + 1, dtype=np.intp)
    cdef Py_ssize_t[::1] starts = starts_arr
    for i in range(count):
        if i == 0 or sv[i] != sv[i - 1] or nv[i] != nv[i - 1]:
            starts[nruns] = i
            nruns += 1
    starts[nruns] = count
    # each run's table: kept (tables), to fill and keep, to fill in the scratch
    # table, or none; ``held`` holds the arrays while the GIL is let go
    cdef uint32_t **tab = <uint32_t **>PyMem_Malloc(nruns * sizeof(uint32_t *))
    cdef char *fill = <char *>PyMem_Malloc(nruns)
    cdef uint32_t *keys = NULL
    cdef uint32_t *scratch = NULL
    cdef const uint32_t[::1] tv
    cdef uint64_t tlen
    cdef bint keep = tables is not None, want_scratch = False
    cdef uint64_t a_kept = _KEPT_TABLE_MAX // crounds if crounds else 0
    cdef uint64_t a_take = _TAKE_TABLE_MAX // crounds if crounds else 0
    held = []  # (key, table array) of each run with a table
    try:
        if tab is NULL or fill is NULL:
            raise MemoryError()
        for r in range(nruns):
            i, e = starts[r], starts[r + 1]
            tab[r], fill[r] = NULL, 0
            if not crounds:
                continue
            # a table of rounds * a values (a = ceil(sqrt(n)); a <= m when n <= m * m):
            # repaid by a run of (e - i) when a <= 4 * (e - i)
            if keep and e - i >= _KEPT_RUN_MIN and _fits(nv[i], a_kept):
                key = (nv[i], sv[i], crounds)
                tlen = crounds * lib.tl_gfc_isqrt_ceil(nv[i])
                t = tables.get(key)
                if t is None and _fits(nv[i], 4 * (e - i)):
                    t = np.empty(tlen, dtype=np.uint32)
                    fill[r] = 1
                if t is not None:
                    tv = t
                    if <uint64_t>tv.shape[0] != tlen:  # C reads tlen values from it
                        raise ValueError(f"tables[{key}] holds {tv.shape[0]} values, "
                                         f"expected {tlen}")
                    tab[r] = <uint32_t *>&tv[0]  # written only when filled here
                    held.append((key, t))
            elif _fits(nv[i], 4 * (e - i)) and _fits(nv[i], a_take):
                fill[r] = 2  # into the scratch table, kept nowhere
                want_scratch = True
        if crounds:
            keys = <uint32_t *>PyMem_Malloc(lib.tl_gfc_keys_len(crounds) * sizeof(uint32_t))
            if keys is NULL:
                raise MemoryError(f"cannot allocate the round keys of {crounds} rounds")
        if want_scratch:
            scratch = <uint32_t *>PyMem_Malloc(_TAKE_TABLE_MAX * sizeof(uint32_t))
            if scratch is NULL:
                raise MemoryError()
        with nogil:
            _take_runs(&nv[0], &sv[0], &xv[0], &ov[0], &starts[0], nruns, crounds, keys,
                       tab, fill, scratch)
    finally:
        PyMem_Free(keys)
        PyMem_Free(scratch)
        PyMem_Free(tab)
        PyMem_Free(fill)
    if tables is not None:
        for key, t in held:
            if key not in tables:
                t.flags.writeable = False
                tables[key] = t
        while len(tables) > TABLES_KEPT:
            try:
                tables.pop(next(iter(tables)), None)
            except (StopIteration, RuntimeError):  # another thread took it out
                break
    return out


cdef inline bint _fits(uint64_t n, uint64_t m) noexcept nogil:
    """Whether ceil(sqrt(n)) <= m, that is n <= m * m (without overflow)."""
    return m >= (<uint64_t>1 << 32) or n <= m * m


cdef void _take_runs(const uint64_t *nv, const uint64_t *sv, const uint64_t *xv, uint64_t *ov,
                     const Py_ssize_t *starts, size_t nruns, uint64_t crounds, uint32_t *keys,
                     uint32_t **tab, const char *fill, uint32_t *scratch) noexcept nogil:
    """take_many's work: each run's keys expanded once, its table filled when
    asked (fill 1: into tab[r]; 2: into the scratch table), then its elements."""
    cdef lib.tl_gfc g
    cdef size_t r, i
    cdef uint64_t last_seed = 0
    for r in range(nruns):
        i = starts[r]
        if crounds and (r == 0 or sv[i] != last_seed):
            lib.tl_gfc_expand_keys(sv[i], crounds, keys)
        last_seed = sv[i]
        lib.tl_gfc_init(&g, nv[i], crounds, sv[i], keys)
        if fill[r] == 1:
            lib.tl_gfc_table_fill(&g, tab[r])
        elif fill[r] == 2:
            lib.tl_gfc_table_fill(&g, scratch)
            tab[r] = scratch
        g.table = tab[r]
        for i in range(<size_t>starts[r], <size_t>starts[r + 1]):
            ov[i] = lib.tl_gfc_encrypt(&g, xv[i])


cdef class Permutation:
    """A seeded pseudorandom permutation of ``range(n)``, computed per index.

    ``Permutation(n, seed=0, rounds=6)`` is the generalized Feistel cipher of
    Black & Rogaway with the Speck64/128 round function and cycle walking,
    bit-compatible with ``pygfc.Permutation(n, rounds, seed)`` (gfc 1.1.0).
    Nothing is precomputed: ``p[i]`` costs O(rounds) time and O(1) memory for
    any ``i``, for every ``n`` from 1 to ``2**64 - 1``.

    Unlike gfc, it is a bijection for every ``n``: gfc maps two indices to one
    value for some ``n > 2**52`` (a floating-point square root) and for some
    ``n`` near ``2**63`` (a 64-bit wrap-around in the round addition).  tokload
    fixes both, so it differs from pygfc only where pygfc is not a permutation.

    Args:
        n: size of the domain, ``1 <= n <= 2**64 - 1``.
        seed: the key, any integer in ``[0, 2**64)``.
        rounds: Feistel rounds, ``0 <= rounds <= 65536``.  0 is the identity;
            use 6 or more for a shuffle (the default, 6, matches gfc's README).
        table: precompute every round output (``rounds * ceil(sqrt(n))``
            uint32 values) so each round is one lookup.  ``None`` (default)
            builds it on the first bulk call whose work it would repay, if it
            fits in ``AUTO_TABLE_MAX_BYTES``; ``True`` builds it now whatever
            its size; ``False`` never.  The results are identical either way.

    Indexing: ``p[i]`` accepts ``-n <= i < n`` like a sequence and returns an
    ``int``; ``p[start:stop:step]`` returns a ``numpy.uint64`` array.
    ``p.take(indices)`` and ``p.inverse_take(values)`` permute whole integer
    arrays with the GIL released; they are safe to call from many threads at
    once on the same object.
    """

    cdef lib.tl_gfc _g
    cdef uint32_t *_keys
    cdef uint32_t *_table
    cdef object _table_mode
    cdef object _table_lock
    cdef object _lock_pid  # the process whose lock _table_lock is (see _build_table)
    cdef uint64_t _bulk_seen

    def __cinit__(self, n, seed=0, rounds=6, *, table=None):
        # Validate everything before allocating anything: a half-built object
        # must still be safe to deallocate.
        self._keys = NULL
        self._table = NULL
        cdef uint64_t cn = _as_u64(n, "n", 1)
        cdef uint64_t cseed = _as_u64(seed, "seed")
        cdef uint64_t crounds = _as_u64(rounds, "rounds", 0, MAX_ROUNDS)
        if table is not None and not isinstance(table, bool):
            raise TypeError(f"table must be True, False or None, got {table!r}")
        self._table_mode = table
        self._table_lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._bulk_seen = 0
        if crounds:
            self._keys = <uint32_t *>PyMem_Malloc(lib.tl_gfc_keys_len(crounds) * sizeof(uint32_t))
            if self._keys is NULL:
                raise MemoryError(f"cannot allocate the round keys of {crounds} rounds")
            lib.tl_gfc_expand_keys(cseed, crounds, self._keys)
        lib.tl_gfc_init(&self._g, cn, crounds, cseed, self._keys)
        if table is True:
            self._build_table()

    def __dealloc__(self):
        # Only called once no thread can be using the object any more.
        if self._table is not NULL:
            PyMem_RawFree(self._table)
        if self._keys is not NULL:
            PyMem_Free(self._keys)

    @classmethod
    def for_epoch(cls, n, seed, epoch, rounds=6, *, table=None):
        """The permutation of epoch ``epoch`` of a run seeded with ``seed``.

        Same as ``Permutation(n, seed=epoch_seed(seed, epoch), rounds=rounds)``:
        each epoch of a run gets its own independent shuffle, and the order of
        epoch ``e`` depends on nothing but ``(n, seed, e, rounds)``.
        """
        return cls(n, seed=epoch_seed(seed, epoch), rounds=rounds, table=table)

    # ---- properties ---------------------------------------------------------

    @property
    def n(self):
        """Size of the domain (an ``int``; may exceed what ``len()`` allows)."""
        return self._g.n

    @property
    def seed(self):
        """The key."""
        return self._g.seed

    @property
    def rounds(self):
        """Number of Feistel rounds."""
        return self._g.rounds

    @property
    def grid_side(self):
        """``a = ceil(sqrt(n))``: the domain sits in an ``a x a`` grid."""
        return self._g.a

    @property
    def has_table(self):
        """Whether the table of round outputs has been built."""
        return self._table is not NULL

    @property
    def table_nbytes(self):
        """Size in bytes the table of round outputs has, or would have."""
        return lib.tl_gfc_table_len(&self._g) * sizeof(uint32_t)

    # ---- scalar access -------------------------------------------------------

    def __len__(self):
        if self._g.n > 0x7FFFFFFFFFFFFFFF:
            raise OverflowError(
                f"len() cannot exceed 2**63 - 1; this permutation has n={self._g.n} (use .n)"
            )
        return self._g.n

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._slice(key)
        try:
            if isinstance(key, (bool, np.bool_)):  # (p[True] was p[1])
                raise TypeError
            i = operator.index(key)
        except TypeError:
            raise TypeError(
                f"Permutation indices must be integers or slices, not {type(key).__name__}"
            ) from None
        n = self._g.n
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {key} is out of range for a permutation of n={n} "
                             f"(valid: -{n} <= i < {n})")
        return lib.tl_gfc_encrypt(&self._g, <uint64_t>i)

    def inverse(self, value):
        """The index ``i`` with ``self[i] == value``, for ``0 <= value < n``."""
        try:
            v = operator.index(value)
        except TypeError:
            raise TypeError(f"value must be an integer, got {type(value).__name__}") from None
        n = self._g.n
        if not 0 <= v < n:
            raise IndexError(f"value {value} is out of range for a permutation of n={n} "
                             f"(valid: 0 <= value < {n})")
        return lib.tl_gfc_decrypt(&self._g, <uint64_t>v)

    def __iter__(self):
        cdef uint64_t start = 0, chunk = 1 << 14
        cdef uint64_t n = self._g.n
        while start < n:
            stop = start + chunk if n - start > chunk else n
            yield from self.range(start, stop).tolist()
            start = stop

    def __contains__(self, value):
        try:
            v = operator.index(value)
        except TypeError:
            return False
        return 0 <= v < self._g.n

    # ---- bulk access ---------------------------------------------------------

    def range(self, start, stop, out=None):
        """``[self[i] for i in range(start, stop)]`` as a 1-D array, in C.

        Args:
            start: the first index, ``0 <= start <= stop``.
            stop: one past the last index, ``stop <= n``.
            out: optional C-contiguous ``uint64`` (or, when ``n <= 2**63``,
                ``int64``) array of length ``stop - start`` to fill.

        Returns:
            ``out``, or a new ``numpy.uint64`` array.
        """
        cdef uint64_t cstart = _as_u64(start, "start")
        cdef uint64_t cstop = _as_u64(stop, "stop")
        if not cstart <= cstop <= self._g.n:
            raise IndexError(f"range [{start}, {stop}) is not within [0, {self._g.n}]")
        cdef uint64_t count = cstop - cstart
        out = self._prepare_out(out, (count,), "out")
        cdef uint64_t[::1] dst = out.reshape(-1).view(np.uint64)
        self._note_bulk(count)
        cdef lib.tl_gfc g = self._g
        if count >= _NOGIL_MIN:
            with nogil:
                lib.tl_gfc_encrypt_range(&g, cstart, &dst[0], count)
        elif count:
            lib.tl_gfc_encrypt_range(&g, cstart, &dst[0], count)
        return out

    def take(self, indices, out=None):
        """``self[i]`` for every ``i`` of an integer array, in C without the GIL.

        Args:
            indices: array-like of integers, any shape, every value in
                ``[0, n)`` (negative values are an error here, unlike ``p[i]``).
                ``uint64`` and ``int64`` C-contiguous arrays are read in place.
            out: optional C-contiguous ``uint64`` (or, when ``n <= 2**63``,
                ``int64``) array of the same shape; may be ``indices`` itself.

        Returns:
            ``out``, or a new ``numpy.uint64`` array of the shape of ``indices``.

        Raises:
            TypeError: ``indices`` is not an integer array.
            IndexError: a value is outside ``[0, n)`` (the first one is named).
        """
        return self._apply(indices, out, 0)

    def inverse_take(self, values, out=None):
        """``self.inverse(v)`` for every ``v`` of an integer array; see ``take``."""
        return self._apply(values, out, 1)

    # ---- helpers ---------------------------------------------------------------

    def _slice(self, key):
        r = range(*key.indices(self._g.n))
        if not len(r):  # (a start of -1 for p[-100::-1] is no uint64)
            return np.empty(0, dtype=np.uint64)
        if r.step == 1:
            return self.range(r.start, max(r.start, r.stop))
        idx = np.arange(len(r), dtype=np.uint64)
        if r.step > 0:
            idx *= np.uint64(r.step)
            idx += np.uint64(r.start)
        else:
            idx *= np.uint64(-r.step)
            idx = np.uint64(r.start) - idx
        return self.take(idx, out=idx)

    def _apply(self, indices, out, int inverse):
        what = "value" if inverse else "index"
        src = np.asarray(indices)
        if src.dtype.kind not in "iu" and src.size:
            raise TypeError(f"{what} arrays must have an integer dtype, got {src.dtype}")
        shape = src.shape
        flat = np.ascontiguousarray(src).reshape(-1)
        if flat.dtype != np.uint64:
            # Negative values wrap to >= 2**63 and are reported below.
            flat = flat.view(np.uint64) if flat.dtype == np.int64 else flat.astype(np.uint64)
        out = self._prepare_out(out, shape, "out")
        cdef const uint64_t[::1] s = flat
        cdef uint64_t[::1] d = out.reshape(-1).view(np.uint64)
        cdef size_t count = s.shape[0]
        self._note_bulk(count)
        cdef lib.tl_gfc g = self._g
        cdef size_t bad = count
        if count >= _NOGIL_MIN:
            with nogil:
                bad = lib.tl_gfc_apply_many(&g, inverse, &s[0], &d[0], count)
        elif count:
            bad = lib.tl_gfc_apply_many(&g, inverse, &s[0], &d[0], count)
        if bad != count:
            orig = src.reshape(-1)[bad]
            raise IndexError(f"{what} {orig} at position {bad} is out of range for a "
                             f"permutation of n={self._g.n} (valid: 0 <= {what} < {self._g.n})")
        return out

    def _prepare_out(self, out, shape, str name):
        if out is None:
            return np.empty(shape, dtype=np.uint64)
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{name} must be a numpy array, got {type(out).__name__}")
        if out.dtype == np.int64:
            if self._g.n > 0x8000000000000000:
                raise TypeError(f"{name} must be uint64 when n > 2**63 (n={self._g.n})")
        elif out.dtype != np.uint64:
            raise TypeError(f"{name} must have dtype uint64 or int64, got {out.dtype}")
        if out.shape != tuple(shape):
            raise ValueError(f"{name} has shape {out.shape}, expected {tuple(shape)}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            # A copy made to fit would be filled instead: refused, saying what was given.
            if not out.flags.writeable:
                got = "a read-only array"
            elif out.ndim > 1 and out.flags.f_contiguous:
                got = f"a Fortran-ordered array of shape {out.shape}"
            else:
                got = f"an array of shape {out.shape} and strides {out.strides}"
            raise ValueError(f"{name} must be a writeable C-contiguous array, got {got}")
        return out

    cdef _note_bulk(self, uint64_t count):
        """Account for bulk work; build the table once it pays for itself."""
        if self._table is not NULL or self._table_mode is False:
            return
        if self._table_mode is None:
            self._bulk_seen += count
            if self._bulk_seen < self._g.a or self.table_nbytes > AUTO_TABLE_MAX_BYTES:
                return
        self._build_table()

    cdef _build_table(self):
        cdef uint64_t length = lib.tl_gfc_table_len(&self._g)
        cdef uint32_t *table
        if self._g.rounds == 0 or self._g.a < 2:
            return  # nothing to look up
        if self._lock_pid != os.getpid():
            # A forked child: a parent's thread may have held the lock at the fork (it
            # fills the table without the GIL) and is not here to release it. The
            # table is published only once complete, so a new lock is all it needs.
            self._table_lock = threading.Lock()
            self._lock_pid = os.getpid()
        with self._table_lock:
            if self._table is not NULL:
                return
            table = <uint32_t *>PyMem_RawMalloc(length * sizeof(uint32_t))
            if table is NULL:
                raise MemoryError(f"cannot allocate a {length * 4}-byte permutation table")
            with nogil:
                lib.tl_gfc_table_fill(&self._g, table)
            # Publish: later bulk calls copy _g, table included, under the GIL.
            self._table = table
            self._g.table = table

    # ---- protocol ----------------------------------------------------------------

    def __reduce__(self):
        return (_rebuild, (self._g.n, self._g.seed, self._g.rounds, self._table_mode))

    def __repr__(self):
        return f"Permutation(n={self._g.n}, seed={self._g.seed}, rounds={self._g.rounds})"

    def __eq__(self, other):
        if not isinstance(other, Permutation):
            return NotImplemented
        return (self.n, self.seed, self.rounds) == (other.n, other.seed, other.rounds)

    def __hash__(self):
        return hash((Permutation, self._g.n, self._g.seed, self._g.rounds))


def _rebuild(n, seed, rounds, table):
    return Permutation(n, seed, rounds, table=table)


def _round_function(seed, round_index, value):
    """F_{i+1}(value) of the Feistel network: Speck64/128 under key ``i*2**64 + seed``.

    A test hook: exposes the C round function to the known-answer tests.
    """
    cdef uint32_t rk[lib.TL_SPECK_ROUNDS]
    cdef uint64_t i = _as_u64(round_index, "round_index")
    cdef uint64_t s = _as_u64(seed, "seed")
    lib.tl_speck_expand(<uint32_t>s, <uint32_t>(s >> 32), <uint32_t>i, <uint32_t>(i >> 32), rk)
    return lib.tl_speck_encrypt(rk, _as_u64(value, "value"))


def _speck64_128(key, block):
    """Speck64/128 of ``block`` (x = high word) under the 128-bit ``key``.  A test hook."""
    cdef uint32_t rk[lib.TL_SPECK_ROUNDS]
    k = operator.index(key)
    if not 0 <= k < (1 << 128):
        raise ValueError(f"key must be in [0, 2**128 - 1], got {k}")
    lib.tl_speck_expand(<uint32_t>(k & 0xFFFFFFFF), <uint32_t>((k >> 32) & 0xFFFFFFFF),
                        <uint32_t>((k >> 64) & 0xFFFFFFFF), <uint32_t>(k >> 96), rk)
    return lib.tl_speck_encrypt(rk, _as_u64(block, "block"))
