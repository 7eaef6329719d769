"""Megatron ``.idx`` sequence extents read in place: int32 lengths and int64
byte pointers, 12 bytes per sequence, read per batch on the I/O engine, or held
in memory when the index is small enough (``in_memory``)."""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cimport tokload._lib as lib
from tokload._docindex cimport ExtentIndex, _checked_ids
from tokload._io cimport FileSet, _raise_io

import numpy as np

from tokload.errors import CorruptDataError
from tokload.forksafe import ForkSafeLock


_LOAD_CHUNK = 1 << 20
"""Sequences whose entries one engine call of the in-memory load reads (60 MB of
requests and entries at most)."""


cdef class MegatronIndex(ExtentIndex):
    """Sequence extents from a Megatron ``.idx``: int32 lengths at ``len_off``,
    int64 byte pointers at ``ptr_off``; 12 bytes read per sequence, or, with
    ``in_memory``, every sequence's extents read and checked once (16 bytes
    each held), when a batch first needs one: a blend of many Megatron prefixes
    then reads no index entries per batch."""

    cdef readonly FileSet file
    cdef uint64_t len_off, ptr_off, itemsize, bin_rows
    cdef readonly bint in_memory
    cdef object _table  # None: not loaded; False: could not be; else (starts, lengths)
    cdef object _lock

    def __cinit__(self, FileSet file, uint64_t nseq, uint64_t len_off, uint64_t ptr_off,
                  uint64_t itemsize, uint64_t bin_rows, bint in_memory=False):
        self.file = file
        self.total = nseq
        self.len_off = len_off
        self.ptr_off = ptr_off
        self.itemsize = itemsize
        self.bin_rows = bin_rows
        self.in_memory = in_memory
        self._table = None
        self._lock = ForkSafeLock()

    cdef object _loaded(self):
        """Every sequence's (start, length), read and checked in one engine call
        the first time a batch needs one (``in_memory``); False when the index
        holds a bad entry: each batch then reads its own entries, and the one
        that needs the bad entry raises, naming it, as without ``in_memory``."""
        with self._lock:
            if self._table is None:
                ids = np.arange(self.total, dtype=np.uint64)
                starts = np.empty(self.total, dtype=np.uint64)
                lengths = np.empty(self.total, dtype=np.uint64)
                try:
                    for a in range(0, self.total, _LOAD_CHUNK):  # bounded scratch memory
                        e = min(a + _LOAD_CHUNK, self.total)
                        self._read(ids[a:e], starts[a:e], lengths[a:e])
                except (OSError, ValueError):  # a bad entry: read per batch, as on disk
                    self._table = False
                else:
                    self._table = (starts, lengths)
            return self._table

    def check_sorted(self):
        """``CorruptDataError`` naming the ``.idx`` where a sequence starts before the
        one listed before it: ``boundaries=`` find a window's documents by a search
        of the starts, which needs them in the ``.bin``'s order (Megatron's own
        reader, one sequence at a time, does not, and neither do ``Documents``).
        Checked once, where the index is held in memory; otherwise a batch's search
        refuses what it comes across."""
        if not (self.in_memory and self.total > 1):
            return
        table = self._loaded()
        if table is False:
            return
        starts = table[0]
        for a in range(0, self.total - 1, _LOAD_CHUNK):  # (bounded scratch memory)
            e = min(a + _LOAD_CHUNK, self.total - 1)
            bad = np.flatnonzero(starts[a + 1:e + 1] < starts[a:e])
            if len(bad):
                k = a + int(bad[0]) + 1
                raise CorruptDataError(
                    f"{self.file.paths[0]}: sequence {k} starts at row {int(starts[k])}, "
                    f"before sequence {k - 1} (row {int(starts[k - 1])}): windows with "
                    "boundaries= need the sequences in the order of the .bin (Documents "
                    "read them in any order)"
                )

    def _what(self):
        return "sequence"

    cdef FileSet _files(self):
        return self.file

    cdef int fill(self, const uint64_t *ids, size_t n, uint64_t *starts,
                  uint64_t *lengths) except -1:
        cdef const uint64_t[::1] ts
        cdef const uint64_t[::1] tl
        cdef size_t k
        if self.in_memory and self.total:
            table = self._loaded()
            if table is not False:
                ts, tl = table[0], table[1]
                with nogil:  # ids were checked against total by extents()
                    for k in range(n):
                        starts[k] = ts[ids[k]]
                        lengths[k] = tl[ids[k]]
                return 0
        return self._fill_disk(ids, n, starts, lengths)

    def _read(self, ids, starts, lengths):
        """The on-disk read of ``ids``' extents into ``starts`` and ``lengths``."""
        cdef const uint64_t[::1] iv = ids
        cdef uint64_t[::1] sv = starts, lv = lengths
        if iv.shape[0]:
            self._fill_disk(&iv[0], iv.shape[0], &sv[0], &lv[0])

    cdef int _fill_disk(self, const uint64_t *ids, size_t n, uint64_t *starts,
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
                    rc = lib.tl_megatron_finish(self.len_off, self.ptr_off, self.itemsize,
                                                self.bin_rows, ids, n, lens, ptrs, starts,
                                                lengths, &err, &failed)
            self.file.engine_end(&eng)
            if rc == lib.TL_ERR_CORRUPT:
                _bad_entry(self.file.paths[0], ids[failed], lens[failed], ptrs[failed],
                           self.itemsize, self.bin_rows, err.offset, err.length == 8)
            if rc:
                _raise_io(&err, self.file.paths, f"the pointer of sequence {ids[failed]}")
        finally:
            PyMem_Free(mem)
        return 0


def _bad_entry(idx, seq, length, ptr, itemsize, bin_rows, offset, pointer):
    """Raise the CorruptDataError of sequence ``seq``'s entry: its ``length`` (or its
    ``pointer``, a byte offset) out of the .bin's ``bin_rows`` rows. An entry that
    is sound but reaches past the end is told as a .bin cut short, which is what
    it is most often (an interrupted copy): the .idx says how big the .bin is."""
    size = bin_rows * itemsize
    if pointer and (ptr < 0 or ptr % itemsize):
        raise CorruptDataError(
            f"{idx}: the pointer of sequence {seq}: bad value {ptr} at byte {offset} "
            f"(not a multiple of {itemsize} within the .bin's {size} bytes)"
        )
    if length < 0:
        raise CorruptDataError(
            f"{idx}: the length of sequence {seq}: bad value {length} at byte {offset}"
        )
    end = ptr + length * itemsize
    raise CorruptDataError(
        f"{idx}: sequence {seq} ({length} rows from byte {ptr}) ends at byte {end} of the "
        f".bin, which holds {size} bytes ({bin_rows} rows): the .bin is shorter than the "
        f".idx says (a copy cut short?), or the .idx entry at byte {offset} is damaged"
    )
