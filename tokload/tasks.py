"""Reader tasks: the one job of this module is to say which steps each reader task
of a DataLoader builds, how many tasks ahead, and on how many threads.

- ``task_builder``: ``build(task)`` for the prefetcher (``tokload.prefetch``): the
  first task one step, the others ``steps_per_task``, their spans computed in task
  order whichever thread asks first, read ahead as far as the prefetch reaches, and
  a failure delivered at the step it belongs to.  How a task's steps are read and
  made into batches is the loader's (``DataLoader._build_task``), handed in;
- ``auto_prefetch`` (with ``batch_nbytes``): how many batches ahead, from the size
  of the batches seen;
- ``waiting_threads``: how many reader threads, more while the tasks wait for their
  reads.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tokload.prefetch import POLL_S
from tokload.readahead import ReadAhead
from tokload.schedule import Schedule

Counted = tuple[int, Any]
"""A batch's real tokens, and per component of a blend its ``[samples, tokens]``
(an int64 array ``[components, 2]``; None for other views)."""

BuildTask = Callable[
    [list[tuple[int, int]], "threading.Event | None"],
    tuple[list[Any], list[Counted], "tuple[BaseException, int] | None"],
]
"""``build_task(spans, cancel)``: the batches of consecutive global batches
``spans``, their ``Counted``, and ``(exception, served)`` when one failed
(``DataLoader._build_task``)."""


MAX_WAITING_THREADS = 16
"""The most reader threads the default ``num_threads`` grows to while tasks wait for
their reads."""


def waiting_threads(base: int, wall: float, cpu: float, tasks: int) -> int:
    """Reader threads for tasks that took ``wall`` seconds (summed) and used ``cpu``
    seconds of their threads' CPU: ``base`` while a task takes less than twice its CPU
    time (or too little is seen yet), else ``base * wall / cpu``, at most
    MAX_WAITING_THREADS and one more than the ``tasks`` the prefetch may hold.  (A
    CPU too busy to run the threads looks like waiting too: the threads added then
    mostly sleep.)"""
    if wall < 2 * cpu or wall < 0.05:
        return base
    return max(base, min(math.ceil(base * wall / max(cpu, 1e-6)), MAX_WAITING_THREADS, tasks + 1))


MAX_AUTO_PREFETCH = 512
"""The most batches the automatic prefetch builds ahead (see ``DataLoader``)."""


UNKNOWN_SIZE_PREFETCH = 32
"""Batches the automatic prefetch keeps when it cannot measure a batch."""


def batch_nbytes(batch: Any) -> int:
    """Bytes of a batch's arrays: tensors and NumPy arrays, in dicts, lists and
    tuples at any depth (0 when there are none)."""
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(v) for v in batch)
    n = getattr(batch, "nbytes", 0)
    return n if isinstance(n, int) else 0


def auto_prefetch(nbytes: int, budget: int) -> int:
    """Batches the automatic prefetch keeps for batches of ``nbytes`` within
    ``budget`` bytes: at most MAX_AUTO_PREFETCH, at least 1; UNKNOWN_SIZE_PREFETCH
    when the size is unknown (0)."""
    if nbytes <= 0:
        return UNKNOWN_SIZE_PREFETCH
    return max(1, min(MAX_AUTO_PREFETCH, budget // nbytes))


class Failed:
    """A batch whose building raised: re-raised by the next() that would return it."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


FIRST_ALONE_S = 0.5
"""How long the other reader tasks wait for the first one (see ``task_builder``)."""


def task_builder(
    schedule: Schedule,
    per: int,
    base: int,
    build_task: BuildTask,
    *,
    io: Any = None,
    hint: Any = None,
    lead: list[Any] | None = None,
    cancel: threading.Event | None = None,
) -> Callable[[int], Any]:
    """``build(task)``: the (span, batch, tokens) triples of the task's steps, in order.

    Spans follow one another from ``base`` along ``schedule`` (with drop_last
    they skip epoch tails), ``per`` steps a task after the first, so they are
    computed in task order under a lock, whichever thread asks first; each task
    is asked for once.  ``build_task(spans, cancel)`` reads and makes the
    batches; ``io`` (a context manager, or None) is held while the spans are
    computed (a packer reads lengths).  ``hint`` (the view's, or None for no
    read-ahead) is what a ``ReadAhead`` tells the storage.  ``lead`` (when given) is
    ``[tasks to read ahead]``, kept current by the caller; the builder appends
    its ``ReadAhead`` (or None) to it.  ``cancel`` (the prefetcher's, set by its
    ``close``) makes a task give up between its steps.

    A failure ends the task's list: its step gets a ``Failed`` (re-raised by
    the ``next()`` that would return it) and no step after it is built. The
    failure of a call that served several steps (``DataLoader._build_task``)
    goes to the first of them, with a note naming their cursors: a task is never
    read a second time to find the step that failed.
    """
    lock = threading.Lock()
    chain: dict[str, Any] = {"next": 0, "cursor": base}  # cursor None: the end
    computed: dict[int, list[tuple[int, int]]] = {}

    def spans_of(task: int, keep: bool = False) -> list[tuple[int, int]]:
        with lock:
            while chain["next"] <= task:
                c = chain["cursor"]
                # The first task is one step: the first batch waits for its own reads
                # only, not for a whole task's (on an object store, round trips of 100 ms).
                size = 1 if chain["next"] == 0 else per
                spans = [] if c is None else schedule.spans(c, size)
                computed[chain["next"]] = spans
                chain["cursor"] = spans[-1][1] if len(spans) == size else None
                chain["next"] += 1
            if keep:  # a look ahead: the task is built later
                return computed.get(task, [])
            return computed.pop(task)

    def indices_of(task: int) -> np.ndarray | None:
        spans = spans_of(task, keep=True)
        if not spans:
            return None
        return schedule.task_indices(spans)

    ahead = ReadAhead(hint, indices_of) if hint is not None else None
    if lead is not None:
        lead.append(ahead)

    first_done = threading.Event()

    def build(task: int) -> list[tuple[tuple[int, int], Any, Counted]]:
        if task == 0:
            try:
                return _build(task)
            finally:
                first_done.set()
        if not first_done.is_set():
            # The first batch's reads go alone (on an object store the other tasks'
            # hundreds of requests would queue beside them): the others wait for it,
            # half a second at most, and not at all once the prefetcher is closed.
            deadline = time.monotonic() + FIRST_ALONE_S
            while not (cancel is not None and cancel.is_set()):
                left = deadline - time.monotonic()
                if left <= 0 or first_done.wait(min(left, POLL_S)):
                    break
        return _build(task)

    def _build(task: int) -> list[tuple[tuple[int, int], Any, Counted]]:
        # the loader's own io and io_depth for every read of its own: a packer reads
        # lengths, and read-ahead advice reads index entries
        with io if io is not None else contextlib.nullcontext():
            spans = spans_of(task)
            if not spans:  # past the end: the consumer's pass is over
                return []
            if ahead is not None and lead:
                # advice only: a read that then fails reports it at its own step
                with contextlib.suppress(Exception):
                    ahead.ahead(task, lead[0])
        items, tokens, failure = build_task(spans, cancel)
        out: list[tuple[tuple[int, int], Any, Counted]] = list(
            zip(spans, items, tokens, strict=False)
        )
        if failure is not None:
            exc, served = failure
            k = len(items)
            a = spans[k][0]
            if served > 1:
                exc.add_note(
                    f"(raised in a tokload reader thread while building the {served} batches "
                    f"at cursors [{a}, {spans[k + served - 1][1]}) in one call: the failure "
                    f"is delivered at the first of them, cursor {a}; none of them was read "
                    "again to find the one that failed)"
                )
            else:
                exc.add_note(
                    f"(raised in a tokload reader thread while building the batch at cursor {a})"
                )
            out.append((spans[k], Failed(exc), (0, None)))
        return out

    return build
