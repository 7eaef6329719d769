"""Progress of a long job, where the user can see it: a bar on a terminal, lines elsewhere.

The one job of this module: count bytes done (of a known total), documents
and tokens, and show them. On a terminal that is a ``tqdm`` bar; without one
(Slurm, CI, ``nohup``, a pipe), where a bar is one endless line or nothing,
it is a line every ``every`` seconds to a ``log`` function, with the rate and
the time left::

    37.5% of 1.20 GB, 120,345 documents, 101,234,567 tokens, 14.2 MB/s, 52 s left
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

DEFAULT_EVERY = 30.0
"""Seconds between progress lines when stderr is not a terminal."""


class Progress:
    """Counts and shows a job's progress.

    Args:
        enabled: ``False``: show nothing; otherwise a bar when stderr is a
            terminal, else lines to ``log`` (nothing when ``log`` is None).
        total: the bytes the job will do (the bar's and the ETA's 100%).
        log: where the lines go.
        every: seconds between lines.
        clock: the time source (for tests).
    """

    def __init__(
        self,
        enabled: bool | None,
        total: int,
        log: Callable[[str], None] | None = None,
        every: float = DEFAULT_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.done = self.documents = self.tokens = 0
        self.every = every
        self._log = log
        self._clock = clock
        self._start = self._last = clock()
        self._bar: Any = None
        if enabled is False:
            self._log = None
        elif sys.stderr.isatty():
            from tqdm import tqdm

            self._log = None
            self._bar = tqdm(
                total=total, unit="B", unit_scale=True, desc="tokload build", smoothing=0.1
            )

    def update(self, nbytes: int, documents: int = 0, tokens: int = 0) -> None:
        """Count ``nbytes`` more done, with the documents and tokens they gave."""
        self.done += nbytes
        self.documents += documents
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(nbytes)
            if documents or tokens:
                self._bar.set_postfix_str(
                    f"{self.documents:,} docs, {self.tokens:,} tokens", refresh=False
                )
        elif self._log is not None:
            now = self._clock()
            if now - self._last >= self.every:
                self._last = now
                self._log(self.line(now))

    def line(self, now: float | None = None) -> str:
        """The progress line as of ``now``."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        share = f"{self.done / self.total:.1%} of {_size(self.total)}" if self.total else "0 B"
        left = self.total - self.done
        eta = f", {_duration(left / rate)} left" if rate > 0 and left > 0 else ""
        return (
            f"{share}, {self.documents:,} documents, {self.tokens:,} tokens, "
            f"{_size(int(rate))}/s{eta}"
        )

    def close(self) -> None:
        """Close the bar (the caller prints the summary)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _duration(s: float) -> str:
    s = int(s + 0.5)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
