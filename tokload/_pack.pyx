"""Whole documents into rows of a fixed number of tokens (``csrc/tokload/pack.h``).

The one job of this module is to wrap the packer: arguments are checked and
arrays made here with the GIL held; the packing and the per-token arrays are
computed in C without it.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cimport tokload._lib as lib

import numpy as np

MAX_WINDOW = lib.TL_PACK_MAX_WINDOW
"""The longest row ``best_fit`` and ``row_boundaries`` take (2**30 tokens)."""

# Groups smaller than this are packed without releasing the GIL: retaking it
# costs more than the work (a few microseconds), up to a switch interval when
# the training thread runs Python flat out.
cdef enum:
    _NOGIL_MIN = 256
# Padding under this many bytes is set with the GIL held (tens of microseconds at most).
cdef enum:
    _NOGIL_BYTES = 256 * 1024


cdef const uint64_t[::1] _lengths(lengths) except *:
    a = np.asarray(lengths)
    if a.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"lengths must be integers, got dtype {a.dtype}")
    if a.size and a.dtype.kind == "i" and a.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {int(a.min())}")
    return np.ascontiguousarray(a, dtype=np.uint64)


cdef _check_window(uint64_t window):
    if not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"window must be in [1, {MAX_WINDOW}], got {window}")


def best_fit(lengths, uint64_t window):
    """Best-fit decreasing of documents of ``lengths`` into rows of ``window``.

    Lengths above ``window`` count as ``window`` (such a document is truncated,
    alone in its row). Returns ``(order, starts)``, both int64: row ``k`` holds
    documents ``order[starts[k]:starts[k + 1]]``, in increasing order, and rows
    are numbered by their first document.
    """
    _check_window(window)
    cdef const uint64_t[::1] lv = _lengths(lengths)
    cdef size_t n = lv.shape[0]
    if n > lib.TL_PACK_MAX_DOCS:
        raise ValueError(f"at most {lib.TL_PACK_MAX_DOCS} documents per group, got {n}")
    order = np.empty(n, dtype=np.uint32)
    starts = np.empty(n + 1, dtype=np.uint32)
    if n == 0:
        return order.astype(np.int64), np.zeros(1, dtype=np.int64)
    cdef uint32_t[::1] ov = order, sv = starts
    cdef void *scratch = PyMem_Malloc(lib.tl_pack_scratch_bytes(n, window))
    if scratch is NULL:
        raise MemoryError()
    cdef size_t rows
    try:
        if n >= _NOGIL_MIN:
            with nogil:
                rows = lib.tl_pack_best_fit(&lv[0], n, window, scratch, &ov[0], &sv[0])
        else:
            rows = lib.tl_pack_best_fit(&lv[0], n, window, scratch, &ov[0], &sv[0])
    finally:
        PyMem_Free(scratch)
    return order.astype(np.int64), starts[: rows + 1].astype(np.int64)


def greedy_rows(lengths, uint64_t window):
    """Rows that greedy packing fills: documents in order, a new row whenever
    the next one does not fit (lengths above ``window`` count as ``window``)."""
    _check_window(window)
    cdef const uint64_t[::1] lv = _lengths(lengths)
    cdef size_t n = lv.shape[0]
    cdef uint64_t rows = 0
    if n:
        with nogil:
            rows = lib.tl_pack_greedy(&lv[0], n, window)
    return int(rows)


cdef dict token_arrays(size_t n, uint64_t window, alloc, per_token, int64_t **pos,
                       int32_t **seg, uint8_t **mask):
    """The per-token attention arrays that ``per_token`` names, ``[n, window]``
    and made with ``alloc``: ``"position_ids"`` (int64), ``"segment_ids"``
    (int32), ``"loss_mask"`` (bool). ``pos``, ``seg`` and ``mask`` get their
    data (NULL for an array not asked for, and for ``n = 0``)."""
    arrays = {}
    cdef int64_t[:, ::1] pv
    cdef int32_t[:, ::1] sv
    cdef uint8_t[:, ::1] mv
    pos[0], seg[0], mask[0] = NULL, NULL, NULL
    if "position_ids" in per_token:
        arrays["position_ids"] = pv = alloc((n, window), np.dtype(np.int64))
        if n:
            pos[0] = &pv[0, 0]
    if "segment_ids" in per_token:
        arrays["segment_ids"] = sv = alloc((n, window), np.dtype(np.int32))
        if n:
            seg[0] = &sv[0, 0]
    if "loss_mask" in per_token:
        arrays["loss_mask"] = made = alloc((n, window), np.dtype(np.bool_))
        mv = made.view(np.uint8)
        if n:
            mask[0] = &mv[0, 0]
    return arrays


cdef const int64_t[::1] _counts(counts, size_t ndocs) except *:
    c = np.ascontiguousarray(counts, dtype=np.int64)
    if c.ndim != 1:
        raise ValueError(f"counts must be 1-D, got shape {c.shape}")
    if c.size and c.min() < 0:
        raise ValueError(f"counts must be >= 0, got {int(c.min())}")
    if int(c.sum()) != ndocs:
        raise ValueError(f"counts add up to {int(c.sum())} documents, lengths has {ndocs}")
    return c


def row_offsets(lengths, counts, uint64_t window, uint64_t itemsize):
    """Byte offsets (uint64) of each document in a ``[rows, window]`` array of
    ``itemsize``-byte tokens, row ``k`` holding ``counts[k]`` documents of
    ``lengths`` back to back from its start. ValueError naming the row when a
    row's documents exceed ``window``."""
    _check_window(window)
    cdef const uint64_t[::1] lv = _lengths(lengths)
    cdef const int64_t[::1] cv = _counts(counts, lv.shape[0])
    cdef size_t nrows = cv.shape[0], bad = 0
    out = np.empty(lv.shape[0], dtype=np.uint64)
    if nrows == 0 or lv.shape[0] == 0:
        return out
    cdef uint64_t[::1] ov = out
    cdef int ok
    with nogil:
        ok = lib.tl_pack_offsets(&lv[0], &cv[0], nrows, window, itemsize, &ov[0], &bad)
    if not ok:
        raise ValueError(f"row {bad}: its documents hold more than {window} tokens")
    return out


def gather_rows(parts, uint64_t rank, uint64_t world_size):
    """One rank's rows of consecutive parts of packed groups, back to back.

    ``parts`` is a list of ``(base, ids, starts, lengths, rows, b0, b1, extra)``:
    rows ``[b0, b1)`` of a group whose row ``b`` (position ``base + b``) holds
    entries ``[rows[b], rows[b + 1])`` of ``ids``, ``starts``, ``lengths`` and of
    each int64 array of the tuple ``extra`` (the same number in every part).
    Counted from the first part's ``b0``, the rank takes rows ``rank, rank +
    world_size, ...``. Returns ``(positions, ids, starts, lengths, counts,
    extra)`` (uint64, int64, uint64, uint64, int64, a tuple of int64), as
    ``PackedRows`` holds them.

    A compiled loop with the GIL held: the work is a few microseconds, and
    NumPy's gathers would drop the GIL and take it back several times."""
    if world_size == 0 or rank >= world_size:
        raise ValueError(f"rank {rank} of world size {world_size}")
    cdef list checked = []
    cdef const int64_t[::1] rv
    cdef int64_t b0, b1, b, k = 0, first, entries
    cdef size_t nrows = 0, ndocs = 0, nextra = 0, x
    for i, (base, ids, starts, lengths, rows, b0, b1, extra) in enumerate(parts):
        rv = np.ascontiguousarray(rows, dtype=np.int64)
        if not 0 <= b0 <= b1 <= rv.shape[0] - 1:
            raise ValueError(f"rows [{b0}, {b1}) of a group of {rv.shape[0] - 1}")
        extra = tuple(np.ascontiguousarray(a, dtype=np.int64) for a in extra)
        if i == 0:
            nextra = len(extra)
        elif len(extra) != nextra:
            raise ValueError(f"part {i} has {len(extra)} extra arrays, part 0 has {nextra}")
        entries = min(len(ids), len(starts), len(lengths), *(len(a) for a in extra))
        for b in range(b0, b1):
            if not 0 <= rv[b] <= rv[b + 1] <= entries:
                raise ValueError(f"row {b} holds entries [{rv[b]}, {rv[b + 1]}) of {entries}")
        first = b0 + <int64_t>((rank + world_size - <uint64_t>k % world_size) % world_size)
        k += b1 - b0
        b = first
        while b < b1:
            nrows += 1
            ndocs += <size_t>(rv[b + 1] - rv[b])
            b += world_size
        checked.append((base, np.ascontiguousarray(ids, dtype=np.int64),
                        np.ascontiguousarray(starts, dtype=np.uint64),
                        np.ascontiguousarray(lengths, dtype=np.uint64), rv, first, b1, extra))
    positions = np.empty(nrows, dtype=np.uint64)
    out_ids = np.empty(ndocs, dtype=np.int64)
    out_starts = np.empty(ndocs, dtype=np.uint64)
    out_lengths = np.empty(ndocs, dtype=np.uint64)
    counts = np.empty(nrows, dtype=np.int64)
    out_extra = tuple(np.empty(ndocs, dtype=np.int64) for _ in range(nextra))
    cdef uint64_t[::1] pv = positions, osv = out_starts, olv = out_lengths
    cdef int64_t[::1] oiv = out_ids, cv = counts, ev
    cdef const int64_t[::1] iv, cev
    cdef const uint64_t[::1] sv, lv
    cdef size_t r = 0, d = 0
    cdef int64_t e
    cdef uint64_t at
    # the extra arrays' pointers: [nextra] outputs, then [nextra] inputs of each part
    cdef int64_t **xp = <int64_t **>PyMem_Malloc((nextra * 2 + 1) * sizeof(int64_t *))
    if xp is NULL:
        raise MemoryError()
    try:
        for x in range(nextra):
            ev = out_extra[x]
            xp[x] = &ev[0] if ndocs else NULL
        for base, iv, sv, lv, rv, first, b1, extra in checked:
            for x in range(nextra):
                cev = extra[x]
                xp[nextra + x] = <int64_t *>&cev[0] if cev.shape[0] else NULL
            at = base
            b = first
            while b < b1:
                pv[r] = at + <uint64_t>b
                cv[r] = rv[b + 1] - rv[b]
                r += 1
                for e in range(rv[b], rv[b + 1]):
                    oiv[d] = iv[e]
                    osv[d] = sv[e]
                    olv[d] = lv[e]
                    for x in range(nextra):
                        xp[x][d] = xp[nextra + x][e]
                    d += 1
                b += world_size
    finally:
        PyMem_Free(xp)
    return positions, out_ids, out_starts, out_lengths, counts, out_extra


def pad_rows(out, lengths, counts, uint64_t window, value):
    """Set the padding of each row of ``out`` (a C-contiguous ``[rows, window]``
    array): row ``k`` holds ``counts[k]`` documents of ``lengths`` (all rows'
    back to back, as ``row_offsets`` checked they fit) from its start, and each
    element after them is set to ``value`` (of ``out``'s dtype). One C call
    for all rows, without the GIL when the padding is over ``_NOGIL_BYTES``."""
    _check_window(window)
    cdef const uint64_t[::1] lv = _lengths(lengths)
    cdef const int64_t[::1] cv = _counts(counts, lv.shape[0])
    cdef size_t nrows = cv.shape[0]
    if out.ndim != 2 or out.shape[0] != nrows or out.shape[1] != window \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out: a writable C-contiguous [{nrows}, {window}] array is needed, "
                         f"not {out.dtype} {out.shape}")
    if nrows == 0:
        return
    pattern = np.array(value, dtype=out.dtype)
    cdef const unsigned char[::1] pv = pattern.reshape(-1).view(np.uint8)
    cdef unsigned char[::1] ov = out.reshape(-1).view(np.uint8)
    cdef uint64_t zero = 0, used = 0
    cdef const uint64_t *lp = &zero
    cdef size_t i, itemsize = out.dtype.itemsize
    if lv.shape[0]:
        lp = &lv[0]
    for i in range(<size_t>lv.shape[0]):  # every document is in a row (_counts checked)
        used += lv[i]
    if (nrows * window - used) * itemsize < _NOGIL_BYTES:
        lib.tl_pack_pad(lp, &cv[0], nrows, window, itemsize, &pv[0], <char *>&ov[0])
        return
    with nogil:
        lib.tl_pack_pad(lp, &cv[0], nrows, window, itemsize, &pv[0], <char *>&ov[0])


def row_boundaries(lengths, counts, uint64_t window, alloc,
                   per_token=("position_ids", "segment_ids", "loss_mask")):
    """The attention metadata of rows of ``window`` tokens holding documents.

    Row ``k`` holds ``counts[k]`` documents, of ``lengths`` (all rows' back to
    back), then padding. Returns ``(arrays, cu_seqlens, max_seqlen)`` as
    ``tokload._docindex.boundary_arrays`` does: ``arrays`` holds those of ``"position_ids"``
    (int64), ``"segment_ids"`` (int32) and ``"loss_mask"`` (bool) that
    ``per_token`` names, each ``[rows, window]`` and made with ``alloc``; the
    padding is each row's last segment, with ``loss_mask`` False throughout.
    ``cu_seqlens`` (int64: the rows of a task may hold more tokens than int32
    numbers) covers the flattened rows; ``split_cu_seqlens`` makes each step's.
    """
    _check_window(window)
    cdef const uint64_t[::1] lv = _lengths(lengths)
    cdef const int64_t[::1] cv = _counts(counts, lv.shape[0])
    cdef size_t nrows = cv.shape[0], k = 0, bad = 0
    cdef int64_t *pp
    cdef int32_t *sp
    cdef uint8_t *mp
    arrays = token_arrays(nrows, window, alloc, per_token, &pp, &sp, &mp)
    cu = np.empty(lv.shape[0] + nrows + 1, dtype=np.int64)
    cdef int64_t[::1] cuv = cu
    cdef uint64_t longest = 0, zero = 0
    cdef int64_t none = 0
    cdef const uint64_t *lp = &zero
    cdef const int64_t *cp = &none
    if lv.shape[0]:
        lp = &lv[0]
    if nrows:
        cp = &cv[0]
    with nogil:
        k = lib.tl_pack_bounds(lp, cp, nrows, window, pp, sp, mp, &cuv[0], &longest, &bad)
    if k == 0:
        raise ValueError(f"row {bad}: its documents hold more than {window} tokens")
    return arrays, cu[:k], int(longest)
