# The compiled interface of tokload/_docindex.pyx (see tokload/_io.pxd).

from libc.stdint cimport uint64_t

from tokload._io cimport FileSet


cdef class ExtentIndex:
    cdef readonly uint64_t total

    cdef FileSet _files(self)
    cdef int fill(self, const uint64_t *ids, size_t n, uint64_t *starts,
                  uint64_t *lengths) except -1


cdef const uint64_t[::1] _checked_ids(ids, uint64_t total, str what) except *
