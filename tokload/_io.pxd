# The compiled interface of tokload/_io.pyx, for the other modules that read
# through the I/O engine (tokload/_meta.pyx): the file and row sets' C state,
# engine set-up, index conversion and the error translation.  A must-match
# contract: the attributes are declared here only, and _meta.pyx compiles
# against this layout (rebuild both when it changes).

from libc.stdint cimport int64_t, uint32_t, uint64_t

cimport tokload._lib as lib


cdef class FileSet:
    cdef lib.tl_fent *files
    cdef readonly list paths
    cdef list _cpaths
    cdef readonly size_t nfiles
    cdef bint closed
    cdef int backend
    cdef unsigned depth
    cdef readonly list remote

    cdef int check_open(self) except -1
    cdef int engine_begin(self, lib.tl_engine *e) except -1
    cdef void engine_end(self, lib.tl_engine *e) noexcept


cdef class RowSet:
    cdef readonly FileSet files
    cdef uint64_t[::1] _cum
    cdef lib.tl_rowset rs
    cdef readonly uint64_t total

    cdef lib.tl_ioreq *_window_reqs(self, const int64_t[::1] iv, uint64_t first, uint64_t count,
                                    uint64_t stride, uint64_t window,
                                    uint64_t *starts) except NULL


cdef class ShardTables:
    cdef readonly RowSet rs
    cdef void **tabs
    cdef readonly bint enabled
    cdef readonly bint compress
    cdef size_t n

    cdef int need(self, const lib.tl_engine *eng, const uint32_t *shards, size_t count,
                  lib.tl_io_error *err, size_t *failed) noexcept nogil


cdef const int64_t[::1] _indices(indices) except *
cdef int _checked_window_starts(const int64_t[::1] iv, uint64_t first, uint64_t count,
                                uint64_t stride, uint64_t window, uint64_t total,
                                uint64_t *starts) except -1
cdef object _raise_io(lib.tl_io_error *err, list paths, str what)
