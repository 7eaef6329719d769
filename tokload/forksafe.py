"""A lock that a child made by ``os.fork()`` gets anew.

The one job of this module: ``ForkSafeLock``, a ``threading.Lock`` for state that
reader threads share, which a forked child never finds held. ``fork()`` copies a
lock as it is: one a parent's thread held at that moment (a permutation filling its
table without the GIL, a blend's cache, a view's read-ahead hint) stays held in the
child, where that thread does not exist, and the child's first reader waits for it
forever. The lock remembers the process that made it and makes a new one in any
other: what it guarded is then as the fork left it, which each user keeps valid
(a table is published only when complete; caches are rebuilt on a miss).
"""

from __future__ import annotations

import os
import threading
from types import TracebackType


class ForkSafeLock:
    """``with lock:`` as a ``threading.Lock``, new in every process that uses it."""

    __slots__ = ("_lock", "_pid")

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _current(self) -> threading.Lock:
        pid = os.getpid()
        if pid != self._pid:  # a forked child: the parent's lock may be held by nobody here
            self._pid, self._lock = pid, threading.Lock()
        return self._lock

    def __enter__(self) -> bool:
        return self._current().acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()
