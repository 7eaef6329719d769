"""A time limit for code that must never hang (opening a FIFO, fuzzed files).

``no_hang(s)`` raises :class:`Hang` in the main thread when the block runs
longer than ``s`` seconds (SIGALRM interrupts a blocking ``open``/``read``).
Code stuck in C without returning to the interpreter would not see the
signal, so ``faulthandler`` also dumps every thread's stack and ends the
process a little later: a hang fails the run loudly instead of blocking CI.
"""

from __future__ import annotations

import faulthandler
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Hang(AssertionError):
    """The block ran past its time limit."""


@contextmanager
def no_hang(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("no_hang needs the main thread (it uses SIGALRM)")

    def alarm(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)
