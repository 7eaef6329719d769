"""The process's fetcher thread: the one job of this module is to run the event loop
that every object-store request of the process goes through, woken by the I/O
engine's handoff (``tokload/_remote.pyx``), and to let the client's threads leave
Python before the interpreter finalizes.

What the loop does with the batches the engine's readers hand over is
``tokload.remote.fetch``'s (it says so with ``serve_batches`` when imported); the
other requests (``tokload.remote.objects``: listings, HEADs, small reads) are
coroutines run on the loop with ``run``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tokload import _remote, exiting
from tokload.errors import RemoteError
from tokload.remote.store import longest_timeout


class Counters:
    """Process-wide totals of the remote backend (read with ``counters()``)."""

    def __init__(self) -> None:
        self.gets = 0
        self.retries = 0
        self.bytes = 0


counts = Counters()


def counters() -> dict[str, int]:
    """Process-wide totals since start: ``gets`` (ranged GETs that succeeded),
    ``retries`` (attempts repeated after a retryable failure) and ``bytes``."""
    return {"gets": counts.gets, "retries": counts.retries, "bytes": counts.bytes}


_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = -1
_loop_lock = threading.Lock()
_start_batch: Callable[[Any], None] | None = None


class _Loop(asyncio.SelectorEventLoop):
    """The fetcher's event loop.  Its ``call_soon_threadsafe``, through which the
    client's runtime threads hand every result over, wakes it through the
    handoff's eventfd without letting the GIL go (``_remote.loop_call_soon_threadsafe``)."""

    call_soon_threadsafe = _remote.loop_call_soon_threadsafe  # type: ignore[assignment]


def serve_batches(start: Callable[[Any], None], abandon: Callable[[], None]) -> None:
    """What the loop does with each batch (``_remote.Batch``) a reader hands over:
    ``start(batch)``, which must end the batch, now or later; and at exit,
    ``abandon()``, which must end every batch not ended and send no GET after
    (``tokload.remote.fetch``)."""
    global _start_batch, _abandon
    _start_batch, _abandon = start, abandon


_abandon: Callable[[], None] | None = None

ABANDON_S = 2.0
"""How long the exit waits, at most, for the loop to abandon its batches."""


def _abandon_at_exit() -> None:
    """At exit, first: the loop abandons the reads in progress (``serve_batches``), so
    that reader threads waiting on one return at once, and sends no GET after."""
    if _loop is None or _loop_pid != os.getpid() or _abandon is None:
        return
    done = threading.Event()

    def abandon(step: Callable[[], None]) -> None:
        try:
            step()
        finally:
            done.set()

    _loop.call_soon_threadsafe(abandon, _abandon)
    done.wait(ABANDON_S)


def _on_wake() -> None:
    """The handoff's eventfd is readable: start the batches the readers queued (the
    loop's own wake-ups, by ``call_soon_threadsafe``, come through it too)."""
    for batch in _remote.take():
        try:
            if _start_batch is None:
                raise RuntimeError("no fetcher serves the remote backend's batches")
            _start_batch(batch)
        except BaseException as e:  # never leave a reader waiting (a bug: say which)
            batch.fail(e)


def get_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop thread, the fetcher of the engine's remote batches
    (a new one in a forked child)."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            efd = _remote.open_handoff()
            loop = _Loop()
            loop.add_reader(efd, _on_wake)
            threading.Thread(target=loop.run_forever, name="tokload-remote", daemon=True).start()
            if _loop is None:
                exiting.at_exit(exiting.FETCHES, _abandon_at_exit)
                exiting.at_exit(exiting.CLIENT, quiesce)
            _loop, _loop_pid = loop, os.getpid()
        return _loop


# ---- exit: the client's threads leave Python before the interpreter finalizes ---------------
#
# obstore completes each request on one of its runtime's threads (Rust tokio, not
# Python's): it takes the GIL and hands the result to the event loop
# (``loop.call_soon_threadsafe``).  A thread of that runtime that has to take the GIL
# once the interpreter is finalizing is ended with pthread_exit, which cannot unwind
# through Rust's frames: the process would abort (SIGABRT, nothing printed) after a run
# that did all its work.  Three things close the window: a request is never cancelled on
# obstore's side (a failed batch's other GETs run to their end, their results dropped;
# ``settled`` shields the few awaited ones); the loop's ``call_soon_threadsafe`` never
# lets the GIL go and counts the threads inside it (``_remote.inside``); and at exit
# ``quiesce`` waits until every request has completed and no thread is inside.

pending: set[asyncio.Future[Any]] = set()
"""The client's requests not completed (loop thread)."""


async def settled(request: Any) -> Any:
    """``await request`` (an awaitable of the client's), shielded: if the awaiting task
    is cancelled, the request still runs to its end (``pending`` until then) and its
    result or error is dropped."""
    fut = asyncio.ensure_future(request)
    pending.add(fut)
    fut.add_done_callback(_completed)
    return await asyncio.shield(fut)


def _completed(fut: asyncio.Future[Any]) -> None:
    pending.discard(fut)
    if not fut.cancelled():
        fut.exception()  # retrieved: an abandoned request's error is not logged


def quiesce(limit: float | None = None) -> bool:
    """Wait until the client's requests have completed and its threads have handed
    their results over, at most ``limit`` seconds (by default the longest request
    ``timeout`` of the stores opened, plus 5): run at exit, before the interpreter
    finalizes.  Returns whether they did; if not, says so on stderr."""
    if _loop is None or _loop_pid != os.getpid():
        return True
    if limit is None:
        limit = longest_timeout() + 5.0
    deadline = time.monotonic() + limit
    while pending or _remote.inside():
        if time.monotonic() > deadline:
            print(
                f"tokload: at exit, after waiting {limit:g} s, {len(pending)} object-store "
                f"request(s) still in flight and {_remote.inside()} of the client's threads "
                "still handing a result over: the process may abort",
                file=sys.stderr,
            )
            return False
        time.sleep(0.001)
    return True


_used_pid: int | None = None  # the process whose object-store client has done I/O


def check_fork() -> None:
    """obstore's runtime (Rust tokio threads) does not survive ``fork()``: in a
    child forked after the parent read from a store, every request would hang.
    Refuse at once instead.

    Raises:
        RemoteError: this process was forked after its parent read from a store.
    """
    global _used_pid
    pid = os.getpid()
    if _used_pid is None:
        _used_pid = pid
    elif _used_pid != pid:
        raise RemoteError(
            "tokload cannot read an object store in a process forked after its parent "
            "read from one: the client's runtime (obstore) does not survive fork(). Use the "
            "DataLoader's reader threads (num_threads=) instead of worker processes, or start "
            "worker processes with the 'spawn' or 'forkserver' method"
        )


def run(coro: Any) -> Any:
    """Run ``coro`` on the loop and wait for its result (from any other thread)."""
    try:
        check_fork()
    except RemoteError:
        coro.close()
        raise
    fut = asyncio.run_coroutine_threadsafe(coro, get_loop())
    try:
        return fut.result()
    except BaseException:
        fut.cancel()
        raise
