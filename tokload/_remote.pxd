# The compiled interface of tokload/_remote.pyx: the remote backend that
# tokload/_io.pyx gives the I/O engine (engine.h's TL_IO_REMOTE).

cimport tokload._lib as lib


cdef int remote_run(void *ctx, const lib.tl_ioreq *reqs, size_t n, unsigned depth,
                    lib.tl_io_error *err, size_t *failed) noexcept nogil
cdef int ready() except -1
