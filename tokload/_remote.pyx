"""The I/O engine's remote backend: a batch's read requests as ranged GETs.

``engine.h`` hands a whole batch of requests on objects (``tl_fent.remote``
set: a ``tokload.remote.RemoteObject``) to ``remote_run``.  It takes the GIL
once per batch, has ``tokload.remote.fetch`` read them (merged ranges, up to
``depth`` GETs in flight on the process's event loop thread, which waits
without the GIL), and copies every returned range into its batch buffer in one
loop without the GIL.  A failure is kept for this thread and raised by the
caller (``take_error``) as the exception ``fetch`` named: URL, byte range,
cause.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, uint8_t
from libc.string cimport memcpy

cimport tokload._lib as lib

import threading

_tls = threading.local()


def take_error():
    """The exception of this thread's last failed remote batch (then forgotten)."""
    e = getattr(_tls, "error", None)
    _tls.error = None
    return e


cdef int remote_run(void *ctx, const lib.tl_ioreq *reqs, size_t n, unsigned depth,
                    lib.tl_io_error *err, size_t *failed) noexcept nogil:
    cdef int rc
    with gil:
        rc = _run_batch(reqs, n, depth, err, failed)
    return rc


cdef int _run_batch(const lib.tl_ioreq *reqs, size_t n, unsigned depth,
                    lib.tl_io_error *err, size_t *failed) noexcept:
    cdef size_t i
    cdef size_t bad = 0
    try:
        from tokload.remote import fetch

        objs = []
        offsets = []
        lengths = []
        for i in range(n):
            if reqs[i].file.remote == NULL:
                bad = i
                raise ValueError(f"{reqs[i].file.path.decode(errors='replace')}: a local file "
                                 "in a batch of the remote backend")
            objs.append(<object>reqs[i].file.remote)
            offsets.append(reqs[i].offset)
            lengths.append(reqs[i].length)
        try:
            bodies = fetch(objs, offsets, lengths, depth)
        except BaseException as e:
            bad = getattr(e, "request", 0)
            raise
        _copy(reqs, n, bodies)
        return 0
    except BaseException as e:
        if bad >= n:
            bad = 0
        _tls.error = e
        err.code = lib.TL_ERR_REMOTE
        err.file = reqs[bad].file.index
        err.offset = reqs[bad].offset
        err.length = reqs[bad].length
        err.done = 0
        failed[0] = bad
        return lib.TL_ERR_REMOTE


cdef int _copy(const lib.tl_ioreq *reqs, size_t n, list bodies) except -1:
    """Copy bodies[i] (exactly reqs[i].length bytes, or None for an empty
    request) to reqs[i].dst: the buffers are taken with the GIL, the copies
    run in one loop without it."""
    cdef Py_buffer *views = <Py_buffer *>PyMem_Malloc(max(n, 1) * sizeof(Py_buffer))
    cdef size_t i, taken = 0
    cdef const uint8_t **src
    if views is NULL:
        raise MemoryError()
    src = <const uint8_t **>PyMem_Malloc(max(n, 1) * sizeof(uint8_t *))
    if src is NULL:
        PyMem_Free(views)
        raise MemoryError()
    try:
        for i in range(n):
            src[i] = NULL
            if reqs[i].length == 0:
                continue
            PyObject_GetBuffer(bodies[i], &views[taken], PyBUF_SIMPLE)
            taken += 1
            if <size_t>views[taken - 1].len != reqs[i].length:
                raise RuntimeError(f"request {i}: {views[taken - 1].len} bytes for a read of "
                                   f"{reqs[i].length}")
            src[i] = <const uint8_t *>views[taken - 1].buf
        with nogil:
            for i in range(n):
                if src[i] != NULL:
                    memcpy(reqs[i].dst, src[i], reqs[i].length)
    finally:
        for i in range(taken):
            PyBuffer_Release(&views[i])
        PyMem_Free(views)
        PyMem_Free(src)
    return 0
