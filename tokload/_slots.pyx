"""Which component and lane a ``Blend``'s slots hold (``csrc/tokload/slots.h``).

The one job of this module: answer, for many blend positions at once, the
(component, lane) of each position's slot in its block, as ``Blend``'s layout
defines them (``tokload/views/blend.py``), without building each block's whole
layout. A shuffled read touches a different block with almost every position; a
layout per block (a sort of the block's slots, with one key per component)
made such reads of a large blend cost a millisecond per batch.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint32_t, uint64_t

cimport tokload._lib as lib

import numpy as np


def block_slots(uint64_t slot_seed, blocks, slots, counts, segments):
    """``(component, lane)`` (int64 arrays) of slot ``slots[i]`` of block ``blocks[i]``.

    ``slot_seed`` is the blend's ``seed ^ _SLOT_TAG``; block ``b`` belongs to
    segment ``segments[i]``, whose slots per component are row ``segments[i]``
    of ``counts`` (int64, ``[segments, components]``). ValueError when a slot is
    not one of its block's (at or past the sum of its segment's counts). The
    blocks are walked in order, each once, without the GIL."""
    b = np.ascontiguousarray(blocks, dtype=np.int64)
    s = np.ascontiguousarray(slots, dtype=np.int64)
    g = np.ascontiguousarray(segments, dtype=np.int64)
    cdef const int64_t[:, ::1] cv = np.ascontiguousarray(counts, dtype=np.int64)
    cdef size_t n = b.shape[0], ncomp = cv.shape[1]
    if s.shape[0] != n or g.shape[0] != n or b.ndim != 1:
        raise ValueError(f"{n} blocks, {s.shape[0]} slots and {g.shape[0]} segments")
    comp = np.empty(n, dtype=np.int64)
    lane = np.empty(n, dtype=np.int64)
    if n == 0:
        return comp, lane
    if (g < 0).any() or (g >= cv.shape[0]).any() or (s < 0).any() or (b < 0).any():
        raise ValueError("blocks, slots and segments must be >= 0, segments < "
                         f"{cv.shape[0]}")
    order = np.lexsort((s, b))  # by block, then slot
    cdef const int64_t[::1] bo = b[order], so = s[order], go = g[order]
    cdef int64_t[::1] co = np.empty(n, dtype=np.int64), lo = np.empty(n, dtype=np.int64)
    cdef double *phase = <double *>PyMem_Malloc(max(ncomp, 1) * 2 * sizeof(double))
    cdef int64_t *nxt = <int64_t *>PyMem_Malloc(max(ncomp, 1) * sizeof(int64_t))
    cdef uint32_t *heap = <uint32_t *>PyMem_Malloc(max(ncomp, 1) * sizeof(uint32_t))
    cdef size_t i = 0, e, served, bad = n
    cdef uint64_t key
    try:
        if phase is NULL or nxt is NULL or heap is NULL:
            raise MemoryError()
        with nogil:
            while i < n:
                e = i + 1
                while e < n and bo[e] == bo[i]:
                    e += 1
                key = lib.tl_gfc_epoch_seed(slot_seed, <uint64_t>bo[i])
                served = lib.tl_slots_block(key, &cv[go[i], 0], ncomp, &so[i], e - i,
                                            &co[i], &lo[i], phase, phase + ncomp, nxt, heap)
                if served < e - i:
                    bad = i + served
                    break
                i = e
    finally:
        PyMem_Free(phase)
        PyMem_Free(nxt)
        PyMem_Free(heap)
    if bad < n:
        raise ValueError(f"slot {so[bad]} of block {bo[bad]}: its segment has "
                         f"{int(np.asarray(cv[go[bad]]).sum())} slots")
    comp[order] = co
    lane[order] = lo
    return comp, lane
