"""Host memory for batches, kept mapped between batches (``csrc/tokload/hostmem.h``).

The one job of this module: give the loader's host arrays memory whose pages
stay mapped from one batch to the next. A batch's arrays are a few MiB each;
from ``malloc`` they are unmapped (or trimmed off the heap) when freed, and the
next batch's first write to each page faults and zeroes it again, which for a
packed batch with its attention arrays costs more than its reads. Here an
array of at least ``MIN_BYTES`` gets a block mapped by this module; when the
last array or tensor viewing it is collected, the block goes to a free list of
at most ``limit()`` bytes (``TOKLOAD_HOST_CACHE_MB``, default 256), and the next
request of about its size takes it back, its pages already there. Smaller
arrays come from NumPy.

The list is changed only with the GIL held (a block is given back by its
``__dealloc__``, which runs with it), so it needs no lock. A forked child keeps
the list (its blocks are mapped there too, copy-on-write).
"""

from cpython.buffer cimport PyBuffer_FillInfo
from libc.errno cimport errno
from libc.stdint cimport uint64_t

cimport tokload._lib as lib

import os

import numpy as np

from tokload.envvars import env_int
from tokload.errors import UsageError

cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS
    void *MAP_FAILED

MIN_BYTES = 256 << 10
"""Arrays smaller than this come from NumPy (malloc keeps small blocks itself)."""

GRAIN = 64 << 10
"""Blocks are mapped in multiples of this many bytes."""

DEFAULT_LIMIT_MB = 256

cdef lib.tl_hostmem _free
cdef size_t _mapped = 0  # bytes mapped by this module: in use or free


def _env_limit(bint strict=True):
    try:
        mb = env_int("TOKLOAD_HOST_CACHE_MB", DEFAULT_LIMIT_MB, 0,
                     "a whole number of MiB (>= 0)", (1 << 63) >> 20)  # in bytes, a size_t
    except UsageError:
        if strict:
            raise
        mb = DEFAULT_LIMIT_MB  # (at import: check_environment refuses it, for a loader)
    return mb << 20


def check_environment():
    """UsageError naming ``TOKLOAD_HOST_CACHE_MB`` where its value is not one
    (the import took the default then, so that ``tokload --version`` runs)."""
    _env_limit()


lib.tl_hostmem_init(&_free, _env_limit(False))


cdef void _unmap(lib.tl_hostmem_block *blocks, size_t n) noexcept:
    global _mapped
    cdef size_t k
    for k in range(n):
        munmap(blocks[k].ptr, blocks[k].size)
        _mapped -= blocks[k].size


cdef class Block:
    """A mapped block of host memory; given back to the free list when collected.
    Exports a writable buffer of ``nbytes`` bytes (NumPy arrays view it)."""

    cdef void *ptr
    cdef size_t size
    cdef Py_ssize_t nbytes

    def __getbuffer__(self, Py_buffer *buf, int flags):
        PyBuffer_FillInfo(buf, self, self.ptr, self.nbytes, 0, flags)

    def __releasebuffer__(self, Py_buffer *buf):
        pass

    def __dealloc__(self):
        cdef lib.tl_hostmem_block evicted[lib.TL_HOSTMEM_SLOTS]
        cdef size_t n
        if self.ptr != NULL:
            n = lib.tl_hostmem_put(&_free, self.ptr, self.size, evicted)
            _unmap(evicted, n)
            self.ptr = NULL


cdef Block _block(size_t nbytes):
    global _mapped
    cdef size_t size = (nbytes + GRAIN - 1) // GRAIN * GRAIN, got = 0
    cdef void *p = lib.tl_hostmem_take(&_free, size, &got)
    if p == NULL:
        # (with the GIL: mapping takes microseconds, and a reader thread that let
        # the GIL go would wait up to a switch interval to take it back)
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if p == MAP_FAILED:
            e = errno
            raise MemoryError(f"cannot map {size} bytes of host memory for a batch: "
                              f"{os.strerror(e)}")
        got = size
        _mapped += size
    cdef Block b = Block.__new__(Block)
    b.ptr, b.size, b.nbytes = p, got, nbytes
    return b


def empty(shape, dtype):
    """A new, uninitialized C-contiguous array of ``shape`` and ``dtype``: in a
    block of this module's when it holds ``MIN_BYTES`` or more, else NumPy's."""
    dt = np.dtype(dtype)
    shape = tuple(shape)
    count = 1
    for s in shape:
        count *= s
    if count < 0 or min(shape, default=0) < 0:
        raise ValueError(f"negative dimensions are not allowed, got shape {shape}")
    nbytes = count * dt.itemsize
    if nbytes < MIN_BYTES:
        return np.empty(shape, dtype=dt)
    return np.frombuffer(_block(nbytes), dtype=dt, count=count).reshape(shape)


def limit():
    """The most bytes the free list holds."""
    return _free.cap


def set_limit(uint64_t nbytes):
    """Hold at most ``nbytes`` free (0: unmap every block once it is free); the
    oldest free blocks over it are unmapped now."""
    cdef lib.tl_hostmem_block evicted[lib.TL_HOSTMEM_SLOTS]
    _free.cap = nbytes
    _unmap(evicted, lib.tl_hostmem_fit(&_free, 0, evicted))


def release():
    """Unmap every free block now (those in use stay until they are freed)."""
    cdef lib.tl_hostmem_block evicted[lib.TL_HOSTMEM_SLOTS]
    _unmap(evicted, lib.tl_hostmem_clear(&_free, evicted))


def stats():
    """``{"mapped": bytes mapped (in use or free), "free": bytes held free,
    "free_blocks": n, "reused": requests served from the list so far}``."""
    return {"mapped": _mapped, "free": _free.bytes, "free_blocks": _free.n,
            "reused": _free.reused}
