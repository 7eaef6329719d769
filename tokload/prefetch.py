"""Ordered, bounded prefetching of numbered work items by reader threads.

The one job of this module: run ``build(step)`` for consecutive step numbers on
a few threads, at most ``depth`` steps ahead of the consumer, and hand the
results out strictly in step order. Threads never raise: a failure travels to
the consumer as the result of its step, a ``Failure`` holding the exception
with its original traceback, for the owner to raise.

Interrupts. The consumer's thread may get an exception between any two calls
(Ctrl+C, or a signal handler that raises: a watchdog's alarm). ``get(step)``
keeps the step it returns until ``drop(step)`` (or the ``get`` of the next
step), so an owner interrupted before it has stored the item asks for the same
step again and loses nothing; and the shared state is guarded by a
``threading.RLock`` entered with ``with``, whose taking and giving back no Python
code can come between (``threading.Condition``'s own ``__enter__`` and
``__exit__`` are Python functions: an exception raised inside one of them leaves
the lock held, and every reader thread waits on it forever).

Stopping. ``close()`` sets the stop flag, which the threads read between steps
and which ``build`` can read inside a step (the ``cancel`` event: the loader's
tasks look at it between the batches of a task), then joins the threads against
one deadline for all of them. ``close(timeout=0)`` only tells them to stop (what
garbage collection does: the thread that drops the last reference, often the
training thread, never waits for a read in progress). The threads are daemons,
so one still inside a read can never keep the interpreter alive; once its read
returns it sees the flag and exits without building anything more.

Exit. A daemon thread still building when the interpreter finalizes (a script
that leaves its loop without ``close()``) is ended in the middle of Python or
torch code, and the process aborts; so at exit every live Prefetcher is closed
and its threads joined, for at most ``EXIT_S`` seconds in all, before anything
else of tokload's (``tokload.exiting``).

Fork. The reader threads do not exist in a child made by ``os.fork()``, and the
lock of the condition they share may have been held by one of them at the
moment of the fork. An ``os.register_at_fork`` hook (as CPython's
``concurrent/futures/thread.py`` has) marks every live Prefetcher as forked in
the child and gives it a new condition: ``forked`` is then True, and ``get``
raises RuntimeError at once instead of waiting forever for threads that are not
there. An owner that can rebuild its steps (the DataLoader) checks ``forked``
and starts a new Prefetcher with the child's own threads.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from tokload import exiting

POLL_S = 0.05  # how often waiting threads look at the stop flag

CLOSE_S = 1.0
"""How long ``close()`` waits, by default, for all the threads together."""


class Failure:
    """A step whose build raised ``exc`` (any ``BaseException``), as ``get`` returns it."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_live: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pf in list(_live):
        pf._forget_threads()


os.register_at_fork(after_in_child=_after_fork_in_child)

EXIT_S = 10.0
"""How long the exit waits, at most, for every reader thread to leave its read."""


def _close_all_at_exit() -> None:
    live = list(_live)
    for pf in live:  # every thread told first, then one deadline for them all
        pf._exiting = True  # (a thread of one's own waiting in get() ends quietly)
        pf.close(timeout=0)
    deadline = time.monotonic() + EXIT_S
    if not all([pf.close(max(0.0, deadline - time.monotonic())) for pf in live]):
        left = sum(t.is_alive() for pf in live for t in pf._threads)
        print(
            f"tokload: at exit, after waiting {EXIT_S:g} s, {left} reader thread(s) still "
            "inside a read: the process may abort",
            file=sys.stderr,
        )


exiting.at_exit(exiting.READERS, _close_all_at_exit)


class Prefetcher:
    """Build steps ``first, first + 1, ...`` (up to ``stop``, exclusive, when given).

    Args:
        build: ``build(step)`` returns the item for ``step``. It runs on the
            reader threads; it should release the GIL for its heavy parts.
        first: the first step to build.
        stop: one past the last step, or None for endless.
        depth: how many steps may be built ahead of the consumer (>= 1).
        threads: reader threads to start now (0: none until ``add_threads``).
        name: thread name prefix.
        cancel: an event that ``close()`` sets (a new one by default): ``build``
            may look at it to give up a long step early. What it returns then is
            dropped.
    """

    def __init__(
        self,
        build: Callable[[int], Any],
        first: int,
        stop: int | None,
        depth: int,
        threads: int,
        name: str = "tokload-reader",
        cancel: threading.Event | None = None,
    ) -> None:
        if depth < 1 or threads < 0:
            raise ValueError(f"depth must be >= 1 and threads >= 0, got {depth} and {threads}")
        self._build = build
        self._stop = stop
        self._depth = depth
        # entered with `with`; the condition waits on it. Reentrant: a signal handler
        # that moves a loader's cursor closes this prefetcher from inside get().
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._claim = first  # next step a thread may take
        self._next = first  # next step the consumer gets
        self._dropped = first - 1  # the last step the consumer dropped (built no more)
        self._results: dict[int, Any] = {}
        self._closed = False
        self._exiting = False  # closed as the interpreter ends
        self._forked = False
        self.cancel = cancel if cancel is not None else threading.Event()
        self._name = name
        self._wall = self._cpu = 0.0  # seconds the builds took, and their threads' CPU
        self._threads: list[threading.Thread] = []
        _live.add(self)
        try:
            self.add_threads(threads)
        except BaseException:  # no owner will see this one: stop what started
            self.close()
            raise

    def add_threads(self, n: int) -> None:
        """Start ``n`` more reader threads (none once closed or in a forked child).

        A thread the system refuses (a limit on threads or processes) raises its
        RuntimeError; the threads started before it stay, and ``close`` stops them."""
        for _ in range(n):
            with self._lock:
                if self._closed or self._forked:
                    return
                t = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                t.start()  # under the lock: _threads holds only threads that started
                self._threads.append(t)

    @property
    def threads(self) -> int:
        """Reader threads started."""
        return len(self._threads)

    def load(self) -> tuple[float, float]:
        """``(wall, cpu)``: seconds the builds so far took, summed, and the CPU
        seconds their threads used meanwhile: ``wall / cpu`` is how much longer a
        build takes than its own work (it waits for reads the rest of the time)."""
        with self._lock:
            return self._wall, self._cpu

    def _work(self) -> None:
        lock, cond = self._lock, self._cond
        while True:
            with lock:
                while not self._closed and (
                    self._claim - self._next >= self._depth
                    or (self._stop is not None and self._claim >= self._stop)
                ):
                    cond.wait(POLL_S)
                if self._closed:
                    return
                step = self._claim
                self._claim += 1
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                item: Any = self._build(step)
            except BaseException as e:  # travels to the consumer, never raised here
                item = Failure(e)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            with lock:
                self._wall += wall
                self._cpu += cpu
                if self._closed:
                    return
                self._results[step] = item
                cond.notify_all()

    def _forget_threads(self) -> None:
        """In a forked child (the at-fork hook): the threads are gone and the
        condition's lock may be held by one of them; keep nothing of either."""
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._threads = []
        self._forked = True
        self._results.clear()

    @property
    def forked(self) -> bool:
        """Whether this process is a child forked after the threads started: the
        threads are not here; ``get`` raises RuntimeError."""
        return self._forked

    @property
    def depth(self) -> int:
        """How many steps may be built ahead of the consumer."""
        return self._depth

    def set_depth(self, depth: int) -> None:
        """Change how far ahead the threads build (>= 1); steps already built stay."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        with self._lock:
            self._depth = depth
            self._cond.notify_all()

    @property
    def ready(self) -> int:
        """Steps built and waiting for ``get`` (a snapshot)."""
        return len(self._results)

    def waiting(self) -> list[Any]:
        """The items built and waiting for ``get`` (a snapshot)."""
        with self._lock:
            return list(self._results.values())

    @property
    def next_step(self) -> int:
        """The step the next ``get`` returns."""
        return self._next

    def get(self, step: int) -> Any:
        """Step ``step``'s item once it is built (a ``Failure`` where its build raised).

        The consumer asks for the steps in order, by number (``first``,
        ``first + 1``, ...), and may ask for the same step again: it is kept
        until ``drop(step)`` or the ``get`` of the next one, so an exception that
        interrupts the consumer between this call and its use of the item (Ctrl+C)
        loses nothing. Raises StopIteration past ``stop``, RuntimeError when the
        Prefetcher was closed or in a forked child, and whatever interrupts the
        wait (nothing is taken then).
        """
        if self._forked:
            raise RuntimeError(
                "this prefetcher's reader threads did not survive fork(): make a new one "
                "in the child (a DataLoader's iterator does so by itself)"
            )
        cond = self._cond
        with self._lock:
            if self._stop is not None and step >= self._stop:
                raise StopIteration
            self._results.pop(step - 1, None)  # the consumer has it (its drop was cut short)
            while step not in self._results:
                if step < self._next - 1 or step <= self._dropped:  # (it is built no more)
                    raise ValueError(
                        f"step {step} was handed out and dropped (the next is {self._next})"
                    )
                if self._closed:
                    if self._exiting:  # (as a thread waiting on a raw read does: no traceback)
                        raise SystemExit
                    raise RuntimeError("the prefetcher was closed")
                cond.wait(POLL_S)  # short waits: Ctrl+C is seen at once
            item = self._results[step]  # (before a call: a handler may close it there)
            if self._next <= step:  # the threads may build one step further
                self._next = step + 1
                cond.notify_all()
            return item

    def drop(self, step: int) -> None:
        """Forget step ``step``'s item: the consumer has stored it."""
        with self._lock:
            self._results.pop(step, None)
            self._dropped = max(self._dropped, step)

    def close(self, timeout: float = CLOSE_S) -> bool:
        """Stop the threads and drop built items (idempotent).

        Waits until the threads have exited, at most ``timeout`` seconds for all
        of them together (0: do not wait). Returns whether they all did; a thread
        still inside a step exits when the step returns, building nothing more.
        """
        if self._lock._is_owned():  # type: ignore[attr-defined]
            # a signal handler closing it inside this thread's get(): the threads wait
            # for the lock that get holds, so they exit once it returns (not waited for)
            timeout = 0.0
        with self._lock:
            self._closed = True
            self._results.clear()
            # after _closed, under the lock: a build that gave up early because of
            # it finds _closed set, so what it returns is never handed out
            self.cancel.set()
            self._cond.notify_all()
        me = threading.current_thread()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads if t is not me)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)
