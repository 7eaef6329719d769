# The compiled interface of tokload/_io.pyx, for the other modules that read
# through the I/O engine (tokload/_meta.pyx): the file and row sets' C state,
# engine set-up, and the error translation.

from libc.stdint cimport uint64_t

cimport tokload._lib as lib


cdef class FileSet:
    cdef lib.tl_fent *files
    cdef readonly list paths
    cdef list _cpaths
    cdef readonly size_t nfiles
    cdef bint closed
    cdef int backend
    cdef unsigned depth

    cdef int check_open(self) except -1
    cdef int engine_begin(self, lib.tl_engine *e) except -1
    cdef void engine_end(self, lib.tl_engine *e) noexcept


cdef class RowSet:
    cdef readonly FileSet files
    cdef uint64_t[::1] _cum
    cdef lib.tl_rowset rs
    cdef readonly uint64_t total


cdef object _raise_io(lib.tl_io_error *err, list paths, str what)
