"""Ordered, bounded prefetching of numbered work items by reader threads.

The one job of this module: run ``build(step)`` for consecutive step numbers on
a few threads, at most ``depth`` steps ahead of the consumer, and hand the
results out strictly in step order. Threads never raise: a failure travels to
the consumer as the result of its step and is re-raised, with its original
traceback, by the ``get`` that would have returned that step. ``close()`` (or
garbage collection of the owner) stops the threads within a fraction of a
second; they are daemons, so they can never keep the interpreter alive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

POLL_S = 0.05  # how often waiting threads look at the stop flag


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher:
    """Build steps ``first, first + 1, ...`` (up to ``stop``, exclusive, when given).

    Args:
        build: ``build(step)`` returns the item for ``step``. It runs on the
            reader threads; it should release the GIL for its heavy parts.
        first: the first step to build.
        stop: one past the last step, or None for endless.
        depth: how many steps may be built ahead of the consumer (>= 1).
        threads: reader threads (>= 1).
        name: thread name prefix.
    """

    def __init__(
        self,
        build: Callable[[int], Any],
        first: int,
        stop: int | None,
        depth: int,
        threads: int,
        name: str = "tokload-reader",
    ) -> None:
        if depth < 1 or threads < 1:
            raise ValueError(f"depth and threads must be >= 1, got {depth} and {threads}")
        self._build = build
        self._stop = stop
        self._depth = depth
        self._cond = threading.Condition()
        self._claim = first  # next step a thread may take
        self._next = first  # next step the consumer gets
        self._results: dict[int, Any] = {}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{k}", daemon=True)
            for k in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._closed and (
                    self._claim - self._next >= self._depth
                    or (self._stop is not None and self._claim >= self._stop)
                ):
                    cond.wait(POLL_S)
                if self._closed:
                    return
                step = self._claim
                self._claim += 1
            try:
                item: Any = self._build(step)
            except BaseException as e:  # travels to the consumer, never raised here
                item = _Failure(e)
            with cond:
                if self._closed:
                    return
                self._results[step] = item
                cond.notify_all()

    @property
    def depth(self) -> int:
        """How many steps may be built ahead of the consumer."""
        return self._depth

    def set_depth(self, depth: int) -> None:
        """Change how far ahead the threads build (>= 1); steps already built stay."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        with self._cond:
            self._depth = depth
            self._cond.notify_all()

    @property
    def ready(self) -> int:
        """Steps built and waiting for ``get`` (a snapshot)."""
        return len(self._results)

    @property
    def next_step(self) -> int:
        """The step the next ``get`` returns."""
        return self._next

    def get(self) -> Any:
        """The next step's item, in order; raises StopIteration past ``stop``.

        A failure in ``build`` is re-raised here, for the step it happened on.
        """
        cond = self._cond
        with cond:
            step = self._next
            if self._stop is not None and step >= self._stop:
                raise StopIteration
            while step not in self._results:
                if self._closed:
                    raise RuntimeError("the prefetcher was closed")
                cond.wait(POLL_S)  # short waits: Ctrl+C is seen at once
            item = self._results.pop(step)
            self._next = step + 1
            cond.notify_all()
        if isinstance(item, _Failure):
            exc = item.exc
            exc.add_note(f"(raised in a tokload reader thread while building step {step})")
            raise exc
        return item

    def close(self, timeout: float = 1.0) -> None:
        """Stop the threads and drop built items (idempotent)."""
        with self._cond:
            self._closed = True
            self._results.clear()
            self._cond.notify_all()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)
