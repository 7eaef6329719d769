# The compiled interface of tokload/_io.pyx (files and the I/O engine), for the
# modules that read through the engine (_rows, _tables, _docindex, _megatron,
# _metaids, _meta): the file set's C state, engine set-up, index conversion and
# the error translation.  A must-match contract: the attributes are declared
# here only, and those modules compile against this layout (rebuild them all
# when it changes).

from libc.stdint cimport int64_t, uint8_t, uint64_t

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
    cdef object __weakref__

    cdef int check_open(self) except -1
    cdef int engine_begin(self, lib.tl_engine *e) except -1
    cdef void engine_end(self, lib.tl_engine *e) noexcept


cdef const int64_t[::1] _indices(indices) except *
cdef str _layout(a)
cdef uint8_t[::1] _out_bytes(out, uint64_t item, need, bint exact, str what)
cdef int _window_starts(const int64_t[::1] iv, uint64_t first, uint64_t count,
                        uint64_t stride, uint64_t *starts) except -1
cdef int _checked_window_starts(const int64_t[::1] iv, uint64_t first, uint64_t count,
                                uint64_t stride, uint64_t window, uint64_t total,
                                uint64_t *starts) except -1
cdef object _raise_io(lib.tl_io_error *err, list paths, str what)
cdef int _nomem(lib.tl_io_error *err, size_t file, size_t *failed) noexcept nogil
cdef lib.tl_fdcache *_fdcache() noexcept nogil
