"""Loader statistics: what the trainer waited for, and what the readers did.

The one job of this module: the counters a ``DataLoader`` keeps while it runs,
and the interval reports ``DataLoader.stats()`` and the periodic log line give.

- The training thread adds, per batch, what ``next()`` waited (0.0 when the
  batch was ready: no clock is read then) and the batch's samples and tokens.
- Reader threads add, per task, the time they spent building its batches and
  the tokens they read.
- The I/O engine (C) keeps process-wide totals of its read requests, bytes and
  time (``tokload._io.io_counters``); a report gives their growth over its
  interval, so they include every loader and view of the process; so does the
  remote backend of its GETs and retries (``tokload.remote.counters``).

Counters only grow; each report subtracts the totals it last saw (its mark), so
``stats()`` and the log line keep separate intervals. Waits are kept in a ring
of the last ``WAIT_RING`` batches, from which an interval's percentiles come.

Failures that a retry hid are counted where the retry happens: the remote
backend counts every attempt it repeats after a throttled, failed or cut-short
request (``remote_retries``), whether a later attempt then succeeded or not.
The loader itself never retries: a failed read reaches the ``next()`` that
needed it (and the engine's ``io_failed``), never a second read that might
succeed and hide it. (The C engine's own retries of ``EINTR`` and ``EAGAIN``
are not counted: its counters have no field for them.)

Fork: a child made by ``os.fork()`` gets a new lock for every LoaderStats (a
reader thread may have held the old one at the fork), and a mark taken in
another process counts the I/O engine's totals from zero, as the engine's own
counters do in a child: an interval that spans a fork is never negative.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from tokload import _io, remote

WAIT_RING = 1 << 16
"""Batches whose wait a report's percentiles can see (the latest ones)."""

log = logging.getLogger("tokload")


_live: weakref.WeakSet[LoaderStats] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for st in list(_live):
        st._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LoaderStats:
    """Counters of one DataLoader (see ``DataLoader.stats``)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._lock = threading.Lock()  # reader-side totals (several threads)
        _live.add(self)
        # training-thread totals (one thread: no lock)
        self.batches = 0
        self.samples = 0
        self.tokens = 0
        self.wait_s = 0.0
        self._waits = [0.0] * WAIT_RING
        self.by_component: np.ndarray | None = None  # a blend's [samples, tokens] per component
        # reader-side totals
        self.tasks = 0
        self.build_s = 0.0
        self.tokens_built = 0

    # ---- adding --------------------------------------------------------------------------

    def delivered(self, wait_s: float, samples: int, tokens: int, by_component: Any = None) -> None:
        """A batch left ``next()`` after waiting ``wait_s`` (training thread);
        ``by_component``: a blend's ``[samples, tokens]`` per component (int64
        ``[components, 2]``) or None."""
        self._waits[self.batches % WAIT_RING] = wait_s
        self.batches += 1
        self.samples += samples
        self.tokens += tokens
        self.wait_s += wait_s
        if by_component is not None:
            if self.by_component is None:
                self.by_component = np.zeros(by_component.shape, dtype=np.int64)
            self.by_component += by_component

    def built(self, seconds: float, tokens: int) -> None:
        """A reader built a task's batches in ``seconds`` (any thread)."""
        with self._lock:
            self.tasks += 1
            self.build_s += seconds
            self.tokens_built += tokens

    # ---- reports -------------------------------------------------------------------------

    def mark(self) -> dict[str, Any]:
        """The totals now: a report's starting point."""
        with self._lock:
            reader = (self.tasks, self.build_s, self.tokens_built)
        return {
            "time": time.perf_counter(),
            "batches": self.batches,
            "samples": self.samples,
            "tokens": self.tokens,
            "wait_s": self.wait_s,
            "by_component": None if self.by_component is None else self.by_component.copy(),
            "reader": reader,
            "io": _io.io_counters(),
            "remote": remote.counters(),
            "pid": os.getpid(),
        }

    def report(
        self, since: dict[str, Any], queue: dict[str, int]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """What happened since ``since`` (a ``mark``), as ``DataLoader.stats`` returns
        it, and the mark of now: the next interval's start, so nothing falls between."""
        now = self.mark()
        seconds = now["time"] - since["time"]
        batches = now["batches"] - since["batches"]
        kept = min(batches, WAIT_RING)
        if kept:
            end = now["batches"] % WAIT_RING
            ring = np.asarray(self._waits)
            waits = np.roll(ring, -end)[WAIT_RING - kept :] if kept < WAIT_RING else ring
            p50, p99, wmax = (float(x) for x in np.percentile(waits, [50, 99, 100]))
        else:
            p50 = p99 = wmax = 0.0
        tasks, build_s, built = (a - b for a, b in zip(now["reader"], since["reader"], strict=True))
        # the engine's totals restart from zero in a forked child (tokload._io)
        io_since = since["io"] if since.get("pid") == now["pid"] else dict.fromkeys(now["io"], 0)
        io = {k: now["io"][k] - io_since[k] for k in now["io"]}
        rem = {k: now["remote"][k] - since["remote"][k] for k in now["remote"]}
        tokens = now["tokens"] - since["tokens"]
        wait = now["wait_s"] - since["wait_s"]
        report = {
            "rank": self.rank,
            "world_size": self.world_size,
            "seconds": seconds,
            "batches": batches,
            "samples": now["samples"] - since["samples"],
            "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "wait_s": wait,
            "wait_fraction": wait / seconds if seconds > 0 else 0.0,
            "wait_p50_s": p50,
            "wait_p99_s": p99,
            "wait_max_s": wmax,
            "tasks_built": int(tasks),
            "build_s": build_s,
            "tokens_built": int(built),
            "io_calls": int(io["calls"]),
            "io_requests": int(io["requests"]),
            "io_bytes": int(io["bytes"]),
            "io_failed": int(io["failed"]),
            "io_s": io["seconds"],
            "remote_gets": int(rem["gets"]),
            "remote_retries": int(rem["retries"]),
            **queue,
        }
        by = now["by_component"]
        if by is not None:
            was = since.get("by_component")
            grew = by - was if was is not None else by
            report["component_samples"] = grew[:, 0].tolist()
            report["component_tokens"] = grew[:, 1].tolist()
        return report, now


def format_report(r: dict[str, Any]) -> str:
    """One log line of a report."""
    return (
        f"tokload rank {r['rank']}/{r['world_size']}: {r['batches']:,} batches, "
        f"{r['tokens']:,} tokens in {r['seconds']:.1f} s "
        f"({r['tokens_per_s'] / 1e6:.2f}M tokens/s); waited {r['wait_s']:.3f} s "
        f"({100 * r['wait_fraction']:.1f}%; p50 {1e3 * r['wait_p50_s']:.2f} ms, "
        f"p99 {1e3 * r['wait_p99_s']:.2f} ms, max {1e3 * r['wait_max_s']:.2f} ms); "
        f"readers {r['build_s']:.2f} s over {r['tasks_built']} tasks; I/O "
        f"{r['io_bytes'] / 2**20:.1f} MiB in {r['io_requests']} requests, "
        f"{r['io_s']:.2f} s, {r['io_failed']} failed"
        + (
            f" ({r['remote_gets']} GETs, {r['remote_retries']} retried)"
            if r["remote_gets"] or r["remote_retries"]
            else ""
        )
        + f"; {r['batches_ready']} of {r['prefetch_batches']} batches ready"
    )


class TokenCounter:
    """Tokens of the batches a view's arrays hold (reader threads, NumPy).

    Documents count their lengths (no padding); other views the elements of
    ``"tokens"``, or else of their first array other than ``"index"``,
    ``"position"`` and ``"metadata*"`` (one field of a structured dtype). A view
    with no such array counts 0. Which key counts is decided from the first
    arrays seen and kept (decided again for a batch without it), so a batch
    costs the reader a call or two.
    """

    def __init__(self) -> None:
        self._key: str | None = None
        self._lengths = False
        self._known = False

    def _learn(self, raw: dict[str, Any]) -> None:
        lengths = raw.get("lengths")
        if isinstance(lengths, np.ndarray) and lengths.ndim == 1:
            self._key, self._lengths = "lengths", True
        elif isinstance(raw.get("tokens"), np.ndarray):
            self._key = "tokens"
        else:
            self._key = next(
                (
                    k
                    for k, v in raw.items()
                    if isinstance(v, np.ndarray)
                    and v.ndim
                    and k not in ("index", "position")
                    and not k.startswith("metadata")
                ),
                None,
            )
        self._known = True

    def one(self, raw: dict[str, Any]) -> int:
        """Tokens of one batch's arrays."""
        # (a view that is not rowwise may give batches of other keys; `in`: no call)
        if not self._known or (self._key is not None and self._key not in raw):
            self._learn(raw)
        if self._key is None:
            return 0
        if self._lengths:
            return int(raw["lengths"].sum())
        return int(raw[self._key].size)

    def rows(self, raw: dict[str, Any], cuts: list[tuple[int, int]]) -> list[int]:
        """Tokens of each batch ``[a, e)`` of a task's rowwise arrays."""
        if not self._known or (self._key is not None and self._key not in raw):
            self._learn(raw)
        if self._key is None:
            return [0] * len(cuts)
        arr = raw[self._key]
        if self._lengths:
            csum = np.cumsum(arr, dtype=np.int64).tolist()
            return [csum[e - 1] - (csum[a - 1] if a else 0) if e > a else 0 for a, e in cuts]
        per_row = arr.size // len(arr) if len(arr) else 0
        return [(e - a) * per_row for a, e in cuts]
