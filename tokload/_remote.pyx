"""The I/O engine's remote backend, in two phases, with no call from C into Python.

``engine.h`` runs a batch of requests on objects (``tl_fent.remote`` set: a
``tokload.remote.RemoteObject``) through ``remote_run``: the reader thread,
without the GIL, queues the batch (``csrc/tokload/handoff.h``) and waits on a
condition variable.  The fetcher, ``tokload.remote.fetch`` on the process's event
loop thread (``tokload.remote.loop``), is woken through the handoff's eventfd, takes the batches
(``take``: one ``Batch`` each), fetches their bytes with the client and ends
each batch with ``Batch.finish`` (the bodies copied into the requests' buffers
without the GIL) or ``Batch.fail`` (the exception kept for the reader, who
raises it: ``take_error``).  The reader never takes the GIL inside the engine,
so no thread is ever caught inside Python by the interpreter's exit.

``ready`` (called by ``Files.engine_begin``, with the GIL) makes sure this
process's handoff is open and its fetcher runs before a batch is queued.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.pystate cimport PyGILState_Ensure
from libc.stdint cimport uint8_t, uint64_t
from posix.unistd cimport getpid

cimport tokload._lib as lib

import asyncio
import threading

cdef lib.tl_handoff _handoff
cdef int _open_pid = 0   # the process whose handoff is open (0: none yet)
cdef int _ready_pid = 0  # the process whose fetcher runs
cdef Py_ssize_t _inside = 0  # threads inside loop_call_soon_threadsafe
cdef Py_ssize_t _kept = 0  # threads that keep their thread state (loop_call_soon_threadsafe)

cdef extern from *:
    """
    static _Thread_local int tl_remote_kept_ = 0;  /* this thread keeps its thread state */
    """
    int tl_remote_kept_

_errors = {}  # reader thread ident -> the exception of its last failed batch


def take_error():
    """The exception of this thread's last failed remote batch (then forgotten)."""
    return _errors.pop(threading.get_ident(), None)


cdef int remote_run(void *ctx, const lib.tl_ioreq *reqs, size_t n, unsigned depth,
                    lib.tl_io_error *err, size_t *failed) noexcept nogil:
    return lib.tl_handoff_run(&_handoff, reqs, n, depth, err, failed)


cdef int ready() except -1:
    """Before a remote batch, with the GIL: this process's fetcher is running (a
    forked child whose parent read from a store is refused: ``remote.loop.check_fork``)."""
    global _ready_pid
    if _ready_pid == getpid():
        return 0
    from tokload.remote import fetch

    fetch.ready()
    _ready_pid = getpid()
    return 0


def open_handoff():
    """The eventfd that wakes the fetcher (the handoff opened once per process)."""
    global _open_pid
    if _open_pid != getpid():
        rc = lib.tl_handoff_open(&_handoff)
        if rc:
            import os

            raise OSError(-rc, f"the remote backend's eventfd: {os.strerror(-rc)}")
        _open_pid = getpid()
    return _handoff.efd


def queued():
    """Batches handed to the fetcher and not finished yet."""
    return _handoff.queued if _open_pid == getpid() else 0


def wake():
    """Wake the fetcher's event loop (a write to the eventfd; the GIL is kept)."""
    if _open_pid == getpid():
        lib.tl_handoff_wake(&_handoff)


def inside():
    """Threads inside ``loop_call_soon_threadsafe`` now."""
    return _inside


def kept():
    """Threads that have kept their Python thread state (``loop_call_soon_threadsafe``)."""
    return _kept


def loop_call_soon_threadsafe(self, callback, *args, context=None):
    """``call_soon_threadsafe`` of the fetcher's event loop (``tokload.remote.loop._Loop``).

    The client's own threads (obstore's Rust runtime) hand every result over
    through it.  asyncio's version wakes the loop with a socket ``send`` that
    lets the GIL go, and a thread that has to take it back once the
    interpreter is finalizing is ended in a way Rust frames cannot survive.
    This one queues the callback and writes the handoff's eventfd while
    holding the GIL, and counts the threads inside (``inside``) so that exit
    can wait for them: compiled, so no bytecode boundary after the count
    drops lets the GIL go either.  In asyncio's debug mode the loop's own
    method is used.

    A thread that calls it keeps its Python thread state from then on (one
    ``PyGILState_Ensure`` never released; ``kept``).  Each of the client's
    threads takes the GIL with ``PyGILState_Ensure``: without a state kept,
    every result would create one and delete it again, and creating one takes
    the interpreter's lock of thread states without the GIL.  A ``fork()`` by
    another thread at that moment leaves the child stuck in
    ``PyOS_AfterFork_Child`` on CPython before 3.11.10 (CPython gh-112275).
    Kept, a thread of the client's runtime creates its state once, on its
    first result, and none of the per-result cost is paid again."""
    global _inside, _kept, tl_remote_kept_
    if self.get_debug():
        return asyncio.SelectorEventLoop.call_soon_threadsafe(
            self, callback, *args, context=context)
    if not tl_remote_kept_:
        PyGILState_Ensure()  # never released: this thread keeps its state
        tl_remote_kept_ = 1
        _kept += 1
    _inside += 1
    try:
        handle = self.call_soon(callback, *args, context=context)
        if _open_pid == getpid():
            lib.tl_handoff_wake(&_handoff)
    finally:
        _inside -= 1
    return handle


def take():
    """The batches queued since the last call, oldest first (clears the eventfd)."""
    cdef lib.tl_handoff_batch *b
    cdef Batch batch
    out = []
    if _open_pid != getpid():
        return out
    b = lib.tl_handoff_take(&_handoff)
    while b is not NULL:
        batch = Batch.__new__(Batch)
        batch.b = b
        batch.n = b.n
        batch.depth = b.depth
        batch.waiter = b.waiter
        b = b.next
        out.append(batch)
    return out


cdef class Batch:
    """One reader's batch of requests, held by the fetcher until it ends it with
    ``finish`` or ``fail`` (exactly once: the reader waits until then)."""

    cdef lib.tl_handoff_batch *b
    cdef readonly size_t n
    cdef readonly unsigned depth
    cdef readonly uint64_t waiter

    def requests(self):
        """``(objects, offsets, lengths)``: the ``RemoteObject``, byte offset and
        length of each request, as lists."""
        cdef size_t i
        cdef const lib.tl_ioreq *r
        if self.b is NULL:
            raise ValueError("the batch has ended")
        r = self.b.reqs
        objs = [None] * self.n
        offsets = [0] * self.n
        lengths = [0] * self.n
        for i in range(self.n):
            if r[i].file.remote == NULL:
                raise ValueError(f"{r[i].file.path.decode(errors='replace')}: a local file "
                                 "in a batch of the remote backend")
            objs[i] = <object>r[i].file.remote
            offsets[i] = r[i].offset
            lengths[i] = r[i].length
        return objs, offsets, lengths

    def finish(self, list bodies):
        """Copy ``bodies[i]`` (a buffer of exactly request i's length, or None for
        an empty request) into request i's destination, without the GIL, and
        end the batch.  A body of the wrong size fails the batch instead."""
        if self.b is NULL:
            raise ValueError("the batch has ended")
        cdef size_t n = self.n, i, taken = 0
        cdef Py_buffer *views = <Py_buffer *>PyMem_Malloc(max(n, 1) * sizeof(Py_buffer))
        cdef const uint8_t **src = <const uint8_t **>PyMem_Malloc(max(n, 1) * sizeof(uint8_t *))
        cdef const lib.tl_ioreq *r = self.b.reqs
        try:
            if views is NULL or src is NULL:
                raise MemoryError()
            if len(bodies) != n:
                raise ValueError(f"{len(bodies)} bodies for {n} requests")
            for i in range(n):
                src[i] = NULL
                if r[i].length == 0:
                    continue
                PyObject_GetBuffer(bodies[i], &views[taken], PyBUF_SIMPLE)
                taken += 1
                if <size_t>views[taken - 1].len != r[i].length:
                    raise RuntimeError(f"request {i}: {views[taken - 1].len} bytes for a read "
                                       f"of {r[i].length}")
                src[i] = <const uint8_t *>views[taken - 1].buf
            with nogil:
                lib.tl_handoff_copy(r, n, src)
        except BaseException as e:
            self.fail(e, 0)  # (the bodies' buffers are released below)
            return
        finally:
            for i in range(taken):
                PyBuffer_Release(&views[i])
            PyMem_Free(views)
            PyMem_Free(src)
        self._end(0, 0)

    def fail(self, exc, size_t request=0):
        """End the batch with ``exc``, raised in the reader (``take_error``);
        ``request`` names the request that failed (its file and range go
        into the engine's error)."""
        if self.b is NULL:
            return
        _errors[self.waiter] = exc
        self._end(lib.TL_ERR_REMOTE, request if request < self.n else 0)

    cdef void _end(self, int rc, size_t failed) noexcept:
        cdef lib.tl_io_error err
        cdef const lib.tl_ioreq *r
        if self.b is NULL:
            return
        if rc:
            r = &self.b.reqs[failed]
            err.code = rc
            err.file = r.file.index
            err.offset = r.offset
            err.length = r.length
            err.done = 0
        lib.tl_handoff_finish(&_handoff, self.b, rc, &err, failed)
        self.b = NULL

    def __dealloc__(self):
        # never leave a reader waiting: a batch dropped unfinished fails (the
        # reader raises a generic error naming the file)
        self._end(lib.TL_ERR_REMOTE, 0)
