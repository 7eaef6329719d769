# The compiled interface of tokload/_rows.pyx (see tokload/_io.pxd).

from libc.stdint cimport int64_t, uint64_t

cimport tokload._lib as lib
from tokload._io cimport FileSet


cdef class RowSet:
    cdef readonly FileSet files
    cdef uint64_t[::1] _cum
    cdef lib.tl_rowset rs
    cdef readonly uint64_t total

    cdef tuple _checked(self, starts, lengths, dst_offsets, out, known=*)
    cdef lib.tl_ioreq *_window_reqs(self, const int64_t[::1] iv, uint64_t first, uint64_t count,
                                    uint64_t stride, uint64_t window,
                                    uint64_t *starts) except NULL


cdef class RowSets:
    cdef readonly tuple sets
    cdef const lib.tl_rowset **ptrs
    cdef readonly uint64_t row_bytes


cdef class Gather:
    cdef readonly RowSets sets
    cdef readonly object which

    cdef tuple _checked(self, starts, lengths, dst_offsets, out, known)
    cdef list _backends(self, used)
    cdef bytearray _use(self, used, int backend)
    cdef FileSet _files(self, use)
