# The compiled interface of tokload/_pack.pyx (see tokload/_io.pxd).

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t


cdef dict token_arrays(size_t n, uint64_t window, alloc, per_token, int64_t **pos,
                       int32_t **seg, uint8_t **mask)
