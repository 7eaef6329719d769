"""Megatron ``.idx`` sequence extents read in place: int32 lengths and int64
byte pointers, 12 bytes per sequence, read per batch on the I/O engine."""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cimport tokload._lib as lib
from tokload._docindex cimport ExtentIndex, _checked_ids
from tokload._io cimport FileSet, _raise_io

import numpy as np


cdef class MegatronIndex(ExtentIndex):
    """Sequence extents from a Megatron ``.idx``: int32 lengths at ``len_off``,
    int64 byte pointers at ``ptr_off``; 12 bytes read per sequence."""

    cdef readonly FileSet file
    cdef uint64_t len_off, ptr_off, itemsize, bin_rows

    def __cinit__(self, FileSet file, uint64_t nseq, uint64_t len_off, uint64_t ptr_off,
                  uint64_t itemsize, uint64_t bin_rows):
        self.file = file
        self.total = nseq
        self.len_off = len_off
        self.ptr_off = ptr_off
        self.itemsize = itemsize
        self.bin_rows = bin_rows

    def _what(self):
        return "sequence"

    cdef FileSet _files(self):
        return self.file

    cdef int fill(self, const uint64_t *ids, size_t n, uint64_t *starts,
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
                    rc = lib.tl_megatron_finish(self.ptr_off, self.itemsize, self.bin_rows, ids,
                                                n, lens, ptrs, starts, lengths, &err, &failed)
            self.file.engine_end(&eng)
            if rc:
                _raise_io(&err, self.file.paths, f"the pointer of sequence {ids[failed]}")
        finally:
            PyMem_Free(mem)
        return 0
