"""Per-shard index tables held in memory: whole index files of uint64 values,
read once by whichever reader thread first needs them, shared by every thread
(``csrc/tokload/tables.h``), optionally compressed (``csrc/tokload/ctab.h``)."""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy

cimport tokload._lib as lib
from tokload._io cimport _nomem
from tokload._rows cimport RowSet

import numpy as np


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
        directory: for document tables (each shard's ``documents + 1`` row
            offsets), the rows of each shard: each table is then checked whole
            when read (``tl_offsets_bad``: from 0, never decreasing, up to the
            rows; else ``need`` fails with ``TL_ERR_CORRUPT`` naming the entry)
            and followed by its directory (``tl_dir_build`` in
            ``csrc/tokload/bounds.h``: a uint64 per 4 documents or fewer), which
            finds the documents of a row range without a search of the whole
            table.
    """

    def __cinit__(self, RowSet rs not None, bint enabled, bint compress=False, directory=None):
        cdef size_t k
        self.tabs = NULL
        self.rows = NULL
        if rs.rs.row_bytes != 8:
            raise ValueError("tables hold uint64 values: rows of 8 bytes")
        self.rs = rs
        self.enabled = enabled
        self.compress = compress
        self.n = rs.files.nfiles
        self.tabs = <void **>calloc(max(self.n, 1), sizeof(void *))
        if self.tabs is NULL:
            raise MemoryError()
        if directory is not None:
            if compress:
                raise ValueError("a directory is for tables held as they are (compress=False)")
            rows = np.ascontiguousarray(directory, dtype=np.uint64).reshape(-1)
            if rows.shape[0] != self.n:
                raise ValueError(f"directory: {rows.shape[0]} shards' rows for {self.n} tables")
            for k in range(self.n):
                if rs.rs.cum[k + 1] == rs.rs.cum[k]:
                    raise ValueError(f"directory: table {k} has no entry (a document table "
                                     "holds documents + 1)")
            self.rows = <uint64_t *>malloc(max(self.n, 1) * sizeof(uint64_t))
            if self.rows is NULL:
                raise MemoryError()
            for k in range(self.n):
                self.rows[k] = rows[k]

    def __dealloc__(self):
        cdef size_t k
        if self.tabs is not NULL:
            for k in range(self.n):
                free(self.tabs[k])
            free(self.tabs)
            self.tabs = NULL
        free(self.rows)
        self.rows = NULL

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
                if self.rows != NULL:
                    total += 8 * self._dir_entries(k)
        return total

    cdef bint all_loaded(self) noexcept:
        """Whether every shard's table is in memory (once true, for good: a
        caller may then skip ``need``). Called with the GIL held."""
        cdef size_t k
        if self._all:
            return True
        for k in range(self.n):
            if lib.tl_table_get(&self.tabs[k]) == NULL:
                return False
        self._all = True
        return True

    cdef uint64_t _dir_entries(self, size_t k) noexcept nogil:
        return lib.tl_dir_entries(self.rows[k], self.rs.rs.cum[k + 1] - self.rs.rs.cum[k] - 1)

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
        cdef uint64_t ndocs, bad
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
        if rc == 0 and self.rows != NULL:
            for j in range(m):  # document tables: checked whole before they are held
                k = reqs[j].item
                ndocs = self.rs.rs.cum[k + 1] - self.rs.rs.cum[k] - 1
                bad = lib.tl_offsets_bad(<uint64_t *>bufs[j], ndocs + 1, self.rows[k], 1, 1)
                if bad <= ndocs:
                    err.code = lib.TL_ERR_CORRUPT
                    err.file = <int32_t>k
                    err.offset = self.rs.files.files[k].base + 8 * bad
                    err.length = 8
                    err.done = (<uint64_t *>bufs[j])[bad]
                    failed[0] = k
                    rc = lib.TL_ERR_CORRUPT
                    break
                bufs[j] = _with_directory(bufs[j], ndocs, self.rows[k], self._dir_entries(k))
                if bufs[j] == NULL:
                    rc = _nomem(err, k, failed)  # the others are freed below
                    break
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


cdef void *_with_directory(void *raw, uint64_t ndocs, uint64_t rows,
                           uint64_t entries) noexcept nogil:
    """The table of ``ndocs + 1`` entries at ``raw`` followed by its directory
    (``raw`` freed), or NULL when out of memory (``raw`` freed too)."""
    cdef void *mem = realloc(raw, (ndocs + 1 + entries) * 8)
    if mem == NULL:
        free(raw)
        return NULL
    lib.tl_dir_build(<uint64_t *>mem, ndocs, rows, <uint64_t *>mem + ndocs + 1)
    return mem


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
