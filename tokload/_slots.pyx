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

from tokload._permute import take_many


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


cdef class _Scratch:
    """The arrays of one lookup of n positions over ncomp components."""
    cdef object q, at, s1, s2, comp, cpos, phase, nxt, heap

    def __init__(self, q, size_t ncomp):
        cdef size_t n = q.shape[0]
        self.q = np.array(q, dtype=np.uint64)  # sorted in place
        self.at = np.arange(n, dtype=np.uint64)
        self.s1 = np.empty(n, dtype=np.uint64)
        self.s2 = np.empty(n, dtype=np.uint64)
        self.comp = np.empty(n, dtype=np.int64)
        self.cpos = np.empty(n, dtype=np.int64)
        self.phase = np.empty(2 * max(ncomp, 1), dtype=np.float64)
        self.nxt = np.empty(max(ncomp, 1), dtype=np.int64)
        self.heap = np.empty(max(ncomp, 1), dtype=np.uint32)


def _checked(q, seg_first, seg_counts, seg_before):
    """The positions (int64) and the segments (int64 arrays), checked."""
    qa = np.ascontiguousarray(q, dtype=np.int64)
    if qa.ndim != 1 or (qa.shape[0] and qa.min() < 0):
        raise ValueError("positions must be a 1-D array of integers >= 0")
    first = np.ascontiguousarray(seg_first, dtype=np.int64)
    counts = np.ascontiguousarray(seg_counts, dtype=np.int64)
    before = np.ascontiguousarray(seg_before, dtype=np.int64)
    if (counts.ndim != 2 or before.shape != counts.shape or first.ndim != 1
            or first.shape[0] != counts.shape[0] or first.shape[0] == 0 or first[0] != 0):
        raise ValueError(f"segments: first {first.shape} (from block 0), counts "
                         f"{counts.shape} and before {before.shape} must agree")
    return qa, first, counts, before


cdef _Scratch _positions(uint64_t slot_seed, q, uint64_t m, first, counts, before):
    """tl_slots_positions over q (int64 >= 0): the scratch holds its answer, sorted."""
    if m == 0:
        raise ValueError("the block size must be positive")
    cdef size_t ncomp = counts.shape[1], n = q.shape[0], got
    cdef _Scratch w = _Scratch(q, ncomp)
    cdef const int64_t[::1] fv = first
    cdef const int64_t[:, ::1] cv = counts, bv = before
    cdef uint64_t[::1] qv = w.q, av = w.at, s1 = w.s1, s2 = w.s2
    cdef int64_t[::1] co = w.comp, po = w.cpos, nx = w.nxt
    cdef double[::1] ph = w.phase
    cdef uint32_t[::1] hp = w.heap
    if n == 0:
        return w
    with nogil:
        got = lib.tl_slots_positions(slot_seed, m, &fv[0], fv.shape[0], &cv[0, 0], &bv[0, 0],
                                     ncomp, &qv[0], &av[0], n, &s1[0], &s2[0], &co[0], &po[0],
                                     &ph[0], &nx[0], &hp[0])
    if got < n:
        b = qv[got] // m
        g = int(np.searchsorted(first, b, side="right")) - 1
        raise ValueError(f"slot {qv[got] % m} of block {b}: its segment has "
                         f"{int(counts[g].sum())} slots")
    return w


def positions(uint64_t slot_seed, q, uint64_t m, seg_first, seg_counts, seg_before):
    """``(component, own position)`` (int64, in ``q``'s order) of blend positions ``q``.

    A ``Blend``'s ``component_positions``: blocks of ``m`` slots, segment ``g``
    from block ``seg_first[g]`` (ascending, the first 0) with ``seg_counts[g]``
    slots per component in each block and ``seg_before[g]`` positions of each
    component before it. One compiled call without the GIL: the positions sorted
    with a radix sort, each block's slots found at once (``tl_slots_block``).
    ValueError when a slot is past its block's slots."""
    qa, first, counts, before = _checked(q, seg_first, seg_counts, seg_before)
    cdef _Scratch w = _positions(slot_seed, qa, m, first, counts, before)
    comp = np.empty(qa.shape[0], dtype=np.int64)
    cpos = np.empty(qa.shape[0], dtype=np.int64)
    comp[w.at] = w.comp
    cpos[w.at] = w.cpos
    return comp, cpos


def locate(uint64_t slot_seed, q, uint64_t m, seg_first, seg_counts, seg_before, sizes,
           comp_seeds, rounds, tables):
    """``(component, index in component)`` (int64, in ``q``'s order): ``Blend.locate``.

    ``positions``' answer, then component ``c``'s own position ``p`` is index
    ``p % sizes[c]`` of the permutation of ``sizes[c]`` elements keyed
    ``epoch_seed(comp_seeds[c], p // sizes[c])`` (``rounds`` rounds; ``tables``
    is ``take_many``'s dict of kept round tables). Grouped by permutation in
    compiled code, one ``take_many`` call for all of them."""
    qa, first, counts, before = _checked(q, seg_first, seg_counts, seg_before)
    cdef const int64_t[::1] sz = np.ascontiguousarray(sizes, dtype=np.int64)
    cdef const uint64_t[::1] cs = np.ascontiguousarray(comp_seeds, dtype=np.uint64)
    cdef size_t ncomp = counts.shape[1], n = qa.shape[0]
    if sz.shape[0] != ncomp or cs.shape[0] != ncomp:
        raise ValueError(f"{ncomp} components, {sz.shape[0]} sizes, {cs.shape[0]} seeds")
    if ncomp and np.asarray(sz).min() < 1:
        raise ValueError("every component's size must be >= 1")
    cdef _Scratch w = _positions(slot_seed, qa, m, first, counts, before)
    comp = np.empty(n, dtype=np.int64)
    index = np.empty(n, dtype=np.int64)
    if n == 0:
        return comp, index
    order = np.empty(n, dtype=np.uint64)
    s3 = np.empty(n, dtype=np.uint64)
    count = np.empty(ncomp + 1, dtype=np.uintp)
    ns = np.empty(n, dtype=np.uint64)
    seeds = np.empty(n, dtype=np.uint64)
    js = np.empty(n, dtype=np.uint64)
    cdef const int64_t[::1] co = w.comp, po = w.cpos
    cdef uint64_t[::1] ov = order, s1 = w.s1, s2 = w.s2, s3v = s3, nv = ns, sv = seeds, jv = js
    cdef size_t[::1] cnt = count
    with nogil:
        lib.tl_slots_by_permutation(&co[0], &po[0], n, &sz[0], &cs[0], ncomp, &ov[0], &s1[0],
                                    &s2[0], &s3v[0], &cnt[0], &nv[0], &sv[0], &jv[0])
    at = w.at
    comp[at] = w.comp
    index[at[order]] = take_many(ns, seeds, js, rounds, tables)
    return comp, index
