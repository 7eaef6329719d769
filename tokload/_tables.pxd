# The compiled interface of tokload/_tables.pyx (see tokload/_io.pxd).

from libc.stdint cimport uint32_t, uint64_t

cimport tokload._lib as lib
from tokload._rows cimport RowSet


cdef class ShardTables:
    cdef readonly RowSet rs
    cdef void **tabs
    cdef readonly bint enabled
    cdef readonly bint compress
    cdef size_t n
    cdef uint64_t *rows  # per shard, with a directory (document tables), else NULL
    cdef bint _all  # every table is loaded (they stay)

    cdef int need(self, const lib.tl_engine *eng, const uint32_t *shards, size_t count,
                  lib.tl_io_error *err, size_t *failed) noexcept nogil
    cdef uint64_t _dir_entries(self, size_t k) noexcept nogil
    cdef bint all_loaded(self) noexcept
