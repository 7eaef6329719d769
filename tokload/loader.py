"""The DataLoader: global shuffle, zero-communication ranks, one-integer resume.

It composes three stages, one job each:

- the **schedule** (``tokload.schedule``): cursor -> steps -> this rank's
  positions -> sample indices, pure arithmetic (ARCHITECTURE.md, invariants 2-4);
- the **batching** (``tokload.batching``): the policy that makes the
  schedule and turns a task's sample indices into its batches' arrays,
  through the contracts every view keeps (``tokload.views.contract``: no
  type dispatch);
- the **transfer** (``tokload.transfer``): host buffers with an explicit
  lifetime, tensors, device copies on a side stream.

This module owns the policy around them: the cursor (the first position not yet
delivered; the whole checkpoint), how a reader task's steps are read and made
into batches (``DataLoader._build_task``) and the statistics. A pass of iteration
(reader threads that build several steps per task ahead of the trainer, handed
out in order as ``next()`` moves the cursor) is ``tokload.iteration``'s; which
steps a task builds, how many tasks ahead and on how many threads is
``tokload.tasks``'s.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Self

import numpy as np

from tokload.arguments import is_integer, is_positive_seconds, positive_integer, seed_and_rounds
from tokload.batching import Batching, cut, read_step, resolve
from tokload.errors import StateError
from tokload.iteration import LoaderIter
from tokload.prefetch import CLOSE_S, Prefetcher
from tokload.ranks import resolve_rank
from tokload.readahead import wanted
from tokload.reading import ReadOptions, from_retired
from tokload.schedule import Schedule
from tokload.stats import LoaderStats, format_report, log
from tokload.tasks import (
    Counted,
    task_builder,
)
from tokload.transfer import Batch, Transfer, loader_backend, retired_transfer
from tokload.views.contract import check_view, fingerprint_upto

STATE_VERSION = 1


MAX_THREADS = 256
"""The most reader threads a loader takes (``num_threads``): more is a mistake
that would end in the system refusing threads."""


class DataLoader:
    """Batches of a view, shuffled globally, split across ranks, resumable exactly.

    Args:
        view: any view: ``TokenStream``, ``Documents``,
            ``StreamWithMetadata``, ``Blend`` (or a subset of one), or your
            own object implementing the view protocol of ``tokload.views.contract``
            (``len``, ``fingerprint``, ``read_batch``) and, for documents, the
            document contract there.
        batch_size: samples per rank per step (``B``); with ``Fill``, rows.
        batching: how a step's samples become a batch (``tokload.batching``):
            ``Stack()`` (the view's own arrays stacked: token windows),
            ``Pad(to=None, value=0)``, ``Pack()`` or ``Fill(window, ...)``
            (documents best-fit into rows, with the attention keys). Default
            (None): the view's ``batching`` attribute (``Pad()`` for
            ``Documents`` and blends of them), else ``Stack()``.
        seed: the run seed, an integer in [0, 2**64 - 1]; epoch ``e`` uses
            ``Permutation.for_epoch(n, seed, e)`` (of the blocks, with
            ``shuffle_block``).
        shuffle: False reads in order (evaluation: ``shuffle=False, epochs=1``).
        shuffle_block: shuffle blocks of this many consecutive samples (each
            block's samples in order) instead of single samples: a rank's samples
            of a step then lie close together in the data (every ``world_size``-th
            sample of a block), so that one request of object storage serves
            several (documents of a few hundred tokens otherwise cost a GET each),
            for a view whose samples are stored in order (``Documents``,
            ``TokenStream``; not a ``Blend``, which shuffles each component with its
            own permutation). Default 1: every sample on its own; at most half of
            ``len(view)`` (two blocks). Every
            sample still comes once an epoch; the state records the block, and a
            resume with another is refused.
        rank: this rank. Default: from ``torch.distributed`` when it is
            initialized, else 0.
        world_size: the number of ranks. Default: from ``torch.distributed``
            when it is initialized, else 1; ValueError when it is not but the
            environment says several processes were launched (``WORLD_SIZE`` >
            1, as ``torchrun`` sets it): each would read every batch.
        mesh: a ``DeviceMesh``: rank and world size come from its
            data-parallel dimension; ranks differing only in other dimensions
            get identical batches. TypeError for anything else; ValueError for
            a mesh this process is not in.
        mesh_dim: the mesh's data-parallel dimension (name or index, default 0);
            ValueError without ``mesh`` where there are several ranks.
        num_threads: reader threads (at most 256); 0 builds each batch in
            ``next()`` (handy for debugging). Default: half the CPU cores,
            between 1 and 4, so the training thread keeps a core of its own;
            more, up to 16 (``tokload.tasks.MAX_WAITING_THREADS``), while
            tasks take more than twice their own CPU time (they wait for reads: an object
            store's latency, a network file system), so that enough reads are
            in flight to cover the wait (``num_threads`` threads' worth of work
            going at once).
        pin_memory: ``"auto"`` pins when CUDA is available; ``True`` requires
            it (RuntimeError otherwise); ``False`` never pins.
        device: where batches are delivered. ``"auto"`` (default): this rank's
            CUDA device (``LOCAL_RANK``, else the current device at
            construction) when CUDA is available, else the host. A torch device
            or string (``"cuda:1"``) picks one; ``None`` or ``"cpu"`` keeps host
            batches. Copies run in the reader threads on a side stream; see
            ``tokload.transfer`` for what a trainer may do with a batch. A
            ``tokload.transfer.TransferBackend`` of your own allocates the host
            buffers and makes the copies instead (the tests' fake device); it
            decides pinning, so ``pin_memory`` stays ``"auto"``.
        collate: ``collate(raw)`` replaces the conversion to tensors and the
            device copy; ``raw`` is the dict of NumPy arrays the view gave, plus
            ``"index"`` and ``"position"``.
        epochs: stop after ``epochs * n`` positions (None: endless).
        drop_last: never let a global batch straddle the end of an epoch (its
            last ``n % G`` positions are skipped), and drop a final partial
            batch. Default False: nothing is ever skipped.
        rounds: Feistel rounds of the permutation (0 to 65536; default 6).
        read: how this loader reads (``ReadOptions``: its prefetch, the steps
            of a reader task, its I/O backend and depth, read-ahead); the
            batches are the same whatever it is. Default: ``ReadOptions()``.
        log_every: seconds between log lines of ``stats()`` (logger
            ``"tokload"``, level INFO), written by ``next()`` once that much
            time has passed; None (default): none. The log keeps its own
            interval: it does not reset the one ``stats()`` reports.

    Batches are ``Batch`` dicts of tensors: the arrays the batching policy
    gives (``"tokens"``, or one entry per field of a structured dtype, plus
    ``"lengths"``/``"cu_seqlens"`` and the attention keys for documents and
    ``"metadata_positions"``/``"metadata"`` for a stream with metadata), the
    view's provenance (a ``Blend``: ``"component"``, ``"component_index"``),
    ``"index"`` (int64, the view indices) and ``"position"`` (int64, the
    global positions). Host tensors
    share memory with the buffers the data was read into; a buffer is reused
    only once no tensor views it any more, so a batch you keep is never
    written over.

    Errors, closing, fork. A reader thread's error is raised by the ``next()``
    that would have returned its batch, and the cursor stays before that batch.
    The error of a call that served several batches (the batching policy's read
    of a whole task) is raised at the first of them, with a note naming their
    cursors; nothing is read a second time to find the batch that failed. The
    error of a batch's own call (reads of a user's view that is neither rowwise
    nor has ``read_batches``, ``collate``) is raised at that batch. ``close()`` waits for the
    threads one second (``tokload.prefetch.CLOSE_S``) at most for all of them;
    garbage collection only tells them to stop. A thread stops between the
    batches of a task, or when a read in progress returns (the I/O engine
    cannot cancel one). In a child made by ``os.fork()``, an iterator's next
    ``next()`` starts the child's own threads at the cursor (the parent's are
    not there), so it gets the batches the parent gets next; a dataset in an
    object store refuses a forked child (``RemoteError``).
    """

    def __init__(
        self,
        view: Any,
        batch_size: int,
        *,
        batching: Batching | None = None,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_block: int = 1,
        rank: int | None = None,
        world_size: int | None = None,
        mesh: Any = None,
        mesh_dim: str | int | None = None,
        num_threads: int | None = None,
        pin_memory: bool | str = "auto",
        device: Any = "auto",
        collate: Callable[[dict[str, Any]], Any] | None = None,
        epochs: int | None = None,
        drop_last: bool = False,
        rounds: int = 6,
        read: ReadOptions | None = None,
        log_every: float | None = None,
        **retired: Any,
    ) -> None:
        device = retired_transfer(device, retired)
        read = from_retired(read, retired)
        check_view(view)
        batch_size = positive_integer("batch_size", batch_size)
        if batch_size >= 1 << 40:  # (an array of them per step: NumPy's bare size error)
            raise ValueError(f"batch_size must be below 2**40, got {batch_size}")
        n = len(view)
        if n == 0:
            raise ValueError(f"the view is empty: {view!r}")
        self.auto_threads = num_threads is None
        if num_threads is None:
            num_threads = min(4, max(1, (os.cpu_count() or 2) // 2))
        if not is_integer(num_threads) or not 0 <= num_threads <= MAX_THREADS:
            raise ValueError(
                f"num_threads must be an integer from 0 to {MAX_THREADS} or None, "
                f"got {num_threads!r}"
            )
        if epochs is not None and (not is_integer(epochs) or epochs < 1):
            raise ValueError(f"epochs must be an integer >= 1 or None, got {epochs!r}")
        seed, rounds = seed_and_rounds(seed, rounds)
        shuffle_block = positive_integer("shuffle_block", shuffle_block)
        if shuffle_block > 1 and not shuffle:
            raise ValueError(
                f"shuffle_block={shuffle_block} shuffles blocks of samples; with "
                "shuffle=False the samples come in order (leave shuffle_block at 1)"
            )
        if shuffle_block > 1 and n // shuffle_block < 2:
            raise ValueError(
                f"shuffle_block={shuffle_block} leaves fewer than two whole blocks of the "
                f"view's {n} samples: the epochs would come in (nearly) one order; take a "
                "block of a small fraction of them"
            )
        self.read = read
        # this loader's reads only: its reader threads read in this scope
        self._io = read.scope()
        self.view = view
        self.n = n
        self.rank, self.world_size = resolve_rank(rank, world_size, mesh, mesh_dim)
        self.batch_size = batch_size
        self.global_batch = batch_size * self.world_size
        if drop_last and self.global_batch > n:
            raise ValueError(
                f"drop_last with a global batch of {self.global_batch} needs at "
                f"least that many samples, the view has {n}"
            )
        self.seed, self.shuffle, self.rounds = int(seed), bool(shuffle), int(rounds)
        self.shuffle_block = int(shuffle_block)
        epochs = None if epochs is None else int(epochs)
        self.epochs, self.drop_last = epochs, bool(drop_last)
        self.total = None if epochs is None else epochs * n
        self.prefetch = read.prefetch
        self.prefetch_bytes, self.num_threads = read.prefetch_bytes, int(num_threads)
        self.steps_per_task = read.steps_per_task
        if log_every is not None and not is_positive_seconds(log_every):
            raise ValueError(
                f"log_every must be a positive number of seconds or None, got {log_every!r}"
            )
        self.readahead = wanted(view) if read.readahead is None else read.readahead
        if collate is not None and not callable(collate):  # (it failed at the first batch)
            raise TypeError(f"collate must be a function of a batch's arrays, got {collate!r}")
        self.collate = collate
        order: dict[str, Any] = dict(
            rank=self.rank,
            world_size=self.world_size,
            seed=self.seed,
            rounds=self.rounds,
            shuffle=self.shuffle,
            epochs=epochs,
            drop_last=self.drop_last,
            shuffle_block=self.shuffle_block,
        )
        self.batching = resolve(batching, view)
        self._order = order
        self.schedule: Schedule = self._new_schedule()
        self._pid = os.getpid()  # the process the schedule's locks belong to
        self.transfer = Transfer(loader_backend(device, pin_memory, collate))
        self._reader = self.batching.reader(view, self.schedule, self.transfer.alloc)
        self._cursor = 0
        self._iter: weakref.ref[LoaderIter] | None = None
        self._stopping: list[Prefetcher] = []  # told to stop, not joined yet
        # taken by a cursor move and an iterator's next() (not while it waits for
        # its reader threads), so that a move from another thread lands between two
        # batches; a new one in a child made by os.fork() (_new_locks_after_fork)
        self._lock = threading.RLock()
        _LOADERS.add(self)
        self._stats = LoaderStats(self.rank, self.world_size)
        self._stats_mark = self._stats.mark()
        self.log_every = None if log_every is None else float(log_every)
        self._log_mark = self._stats_mark

    def _new_schedule(self) -> Schedule:
        """The schedule of this configuration (pure: a new one gives the same order)."""
        made: Schedule = self.batching.schedule(self.view, self.batch_size, **self._order)
        return made

    def _own_process(self) -> None:
        """In a child made by ``os.fork()``: a new schedule (and a reader of it). A
        reader thread of the parent may have held one of the old one's locks at
        the fork (a permutation building its table holds one while it works
        without the GIL); the child's threads would wait for it forever."""
        if self._pid != os.getpid():
            self.schedule = self._new_schedule()
            self._reader = self.batching.reader(self.view, self.schedule, self.transfer.alloc)
            self._pid = os.getpid()

    @property
    def pinned(self) -> bool:
        """Whether batches are built in pinned (page-locked) host memory."""
        return self.transfer.pinned

    @property
    def device(self) -> Any:
        """The device batches are copied to, or None for host batches."""
        return self.transfer.backend.device

    # ---- the cursor ------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """The first global position not yet delivered to the trainer."""
        return self._cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        """Jump to a position (e.g. past a bad batch).

        Inside a running ``for batch in loader`` loop, the loop goes on from the
        new cursor: batches prefetched for the old one are dropped, nothing is
        skipped or repeated. A value outside ``[0, 2**64)`` or past the end of
        the run raises ValueError here.
        """
        value = self.schedule.check_cursor(value)
        with self._lock:  # (a loop in another thread takes the next batch after it)
            it = self._iter() if self._iter is not None else None
            if it is not None:
                it._stale = True  # before the cursor moves: its prefetch is of the old one
            self._cursor = value
            if it is not None:
                it.restart()

    @property
    def epoch(self) -> int:
        """The epoch of the cursor."""
        return self._cursor // self.n

    def state_dict(self) -> dict[str, Any]:
        """The loader's checkpoint: the cursor and what it was computed for.

        Identical on every rank; small; ``load_state_dict(state_dict())`` is the
        identity. Follows PyTorch's ``Stateful`` protocol.
        """
        return {
            "version": STATE_VERSION,
            "cursor": self._cursor,
            "n": self.n,
            "seed": self.seed,
            "rounds": self.rounds,
            "shuffle": self.shuffle,
            "shuffle_block": self.shuffle_block,
            "fingerprint": self._fingerprint(self._cursor),
        }

    def _fingerprint(self, cursor: int) -> str:
        """The view's fingerprint for what the positions before ``cursor`` read
        (and the batching's, where positions are not samples: ``Fill``'s rows)."""
        if cursor == 0:
            stop = 0
        else:
            stop = self.n if self.shuffle else self.batching.read_upto(cursor, self.n)
        view = fingerprint_upto(self.view, stop)
        how = self.batching.fingerprint
        return f"{view}:{how}" if how else view

    def load_state_dict(self, state: Mapping[str, Any], *, force: bool = False) -> None:
        """Resume at ``state["cursor"]``; any world size and batch size may differ.

        Refuses (StateError) a state computed for another dataset, view size,
        seed, rounds, shuffle or shuffle_block setting, unless ``force=True``. Inside a running
        loop, the loop goes on from the state's cursor (as when setting
        ``cursor``).
        """
        if not isinstance(state, Mapping) or "cursor" not in state:
            raise StateError(f"not a tokload loader state: {state!r}")
        if state.get("version") != STATE_VERSION:
            raise StateError(f"unknown loader state version {state.get('version')!r}")
        try:
            cursor = self.schedule.check_cursor(state["cursor"])
        except ValueError as e:
            raise StateError(f"the state's cursor is unusable here: {e}") from None
        if not force:
            mine = {
                "n": self.n,
                "seed": self.seed,
                "rounds": self.rounds,
                "shuffle": self.shuffle,
                "shuffle_block": self.shuffle_block,
                "fingerprint": self._fingerprint(cursor),
            }
            for key, value in mine.items():
                was = state.get(key, 1 if key == "shuffle_block" else None)  # (older states)
                if was != value:
                    saved, here = _shown_apart(was, value)
                    raise StateError(
                        f"the state was saved for {key}={saved}, this loader has "
                        f"{key}={here}; pass force=True to resume anyway"
                    )
        self.cursor = cursor

    # ---- building steps ----------------------------------------------------------------

    def positions(self, start: int, end: int) -> np.ndarray:
        """This rank's positions (uint64) in the global batch [start, end)."""
        return self.schedule.positions(*self._span(start, end, "positions"))

    def _span(self, start: object, end: object, what: str) -> tuple[int, int]:
        """``[start, end)`` as a global batch of this loader's (a step, or the last
        one cut short by the end of the run), else ValueError or TypeError naming
        ``what`` (a wider one was cut to the global batch without a word)."""
        if not (is_integer(start) and is_integer(end)):
            raise TypeError(f"{what}: start and end must be integers, got {start!r} and {end!r}")
        a, e = int(start), int(end)
        check = getattr(self.schedule, "check_span", None)  # (a policy's own may lack it)
        try:
            if check is not None:
                check(a, e)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None
        return a, e

    def build_steps(self, spans: list[tuple[int, int]]) -> list[Any]:
        """This rank's batches of consecutive global batches ``spans``, finished, in
        this thread (no reader thread, no cursor moved). On a device they are
        delivered as ``next()`` delivers a batch: the calling thread's current
        stream waits for their copies, and their memory is not given to another
        copy until that stream is done with them (they raced the copy before).

        Other views read them with one ``read_batches`` where they have it (a
        stream with metadata blocks: one round of I/O for the task). A rowwise
        view reads the samples of all of them with one permutation
        call and one ``read_batch``; each batch is a slice of the result, and
        their tensors are built once for all of them. With a device, a task's
        tensors are copied in one backend call with one event (the Python of a
        stream switch and an event is paid per task, not per step); a rowwise
        task's batches are slices of its device tensors.
        """
        if len(spans) == 0:  # (spans may be an array)
            raise ValueError("build_steps: no steps given (a list of (start, end) spans)")
        spans = [self._span(a, e, "build_steps") for a, e in spans]
        out = self._build(spans)[0]
        if self.device is not None:
            for b in out:
                self.transfer.deliver(b)
        return out

    def _build(self, spans: list[tuple[int, int]]) -> tuple[list[Any], list[Counted]]:
        """``build_steps``, and the tokens of each batch (for ``stats``): the first
        failure is raised."""
        items, tokens, failure = self._build_task(spans)
        if failure is not None:
            raise failure[0]
        return items, tokens

    def _build_task(
        self, spans: list[tuple[int, int]], cancel: threading.Event | None = None
    ) -> tuple[list[Any], list[Counted], tuple[BaseException, int] | None]:
        """The batches of consecutive global batches ``spans``, as far as they go.

        Returns the batches of the first ``k`` spans, their tokens (and those of
        each component of a blend: ``Counted``), and, when
        building span ``k`` failed, ``(exception, served)``: ``served`` is how
        many spans from ``k`` on the call that failed was building. Where one
        call serves several steps (the batching policy's read of the whole
        task, a view's ``read_batches``, a task's tensors and device copy) its
        failure stops the build at the first of them (``served > 1``): nothing
        is read a second time to find the step that failed, so an object
        store's retries are waited out once. Where each step has a call of its
        own (the reads of a view that is neither rowwise nor has
        ``read_batches``, ``collate``) a failure lands on its own step
        (``served == 1``) and the steps before it are built.

        ``cancel`` (a closed prefetcher's event) is looked at between the steps
        and before each call: once it is set, the build stops where it is (with
        fewer batches and no failure; the caller drops them). A call in progress
        is not interrupted: the I/O engine has no way to abandon its reads.
        """
        items, tokens, failure = self._build_steps(spans, cancel)
        if failure is not None and isinstance(failure[0], StopIteration):
            # (raised from next(), it would end the user's loop as the epoch's end)
            e = RuntimeError(
                f"{type(self.view).__name__} (or collate) raised StopIteration while "
                "building a batch; it is not the end of the data (PEP 479 turns it into "
                "this error inside generators, for the same reason)"
            )
            e.__cause__ = failure[0]
            failure = (e, failure[1])
        return items, tokens, failure

    def _build_steps(
        self, spans: list[tuple[int, int]], cancel: threading.Event | None
    ) -> tuple[list[Any], list[Counted], tuple[BaseException, int] | None]:
        """``_build_task``, raising what the view and collate raise."""
        t0 = time.perf_counter()
        if cancel is not None and cancel.is_set():
            return [], [], None
        try:
            if self._io is None:
                task = self._reader.read(spans, cancel)
            else:
                with self._io:
                    task = self._reader.read(spans, cancel)
        except Exception as e:
            return [], [], (e, len(spans))
        failure = task.failure
        collate = self.collate
        out: list[Any] = []
        if collate is not None:
            raws = task.steps if task.whole is None else cut(task, task.whole)
            for r in raws:
                if cancel is not None and cancel.is_set():
                    failure = None  # given up: the caller drops what it gets
                    break
                try:
                    out.append(collate(r))
                except Exception as e:
                    failure = (e, 1)
                    break
        elif cancel is not None and cancel.is_set():
            return [], [], None
        elif task.whole is None:
            if task.steps:
                try:
                    out = self.transfer.copy_all([self.transfer.tensors(r) for r in task.steps])
                except Exception as e:
                    out, failure = [], (e, len(task.steps))
        else:
            try:
                whole = self.transfer.copy(self.transfer.tensors(task.whole))
                out = cut(task, whole, Batch)
                for b in out:
                    b.ready = whole.ready
            except Exception as e:
                return [], [], (e, len(spans))
        # (the steps delivered: fewer where collate or a step failed)
        counts = task.tokens[: len(out)]
        by = task.by_component
        tokens: list[Counted] = list(
            zip(counts, by[: len(out)] if by is not None else [None] * len(counts), strict=True)
        )
        if out:
            self._stats.built(time.perf_counter() - t0, sum(counts))
        return out, tokens, failure

    def _task_builder(
        self, base: int, lead: list[Any] | None = None, cancel: threading.Event | None = None
    ) -> Callable[[int], Any]:
        """The reader tasks' ``build(task)`` from cursor ``base`` (``tokload.tasks``)."""
        hint = getattr(self.view, "hint", None) if self.readahead else None
        return task_builder(
            self.schedule,
            self.steps_per_task,
            base,
            self._build_task,
            io=self._io,
            hint=hint,
            lead=lead,
            cancel=cancel,
        )

    # ---- statistics ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What this rank's loader did since the last ``stats()`` (or since it was built).

        A dict of numbers, cheap to take every few seconds (counters are kept
        whatever you call):

        - ``rank``, ``world_size``; ``seconds``: the interval's length;
        - ``batches``, ``samples``, ``tokens`` delivered by ``next()`` and
          ``tokens_per_s`` (documents count their lengths, not padding);
        - ``wait_s``: the training thread's total wait in ``next()`` for batches
          not yet built, ``wait_fraction`` of the interval, and ``wait_p50_s``,
          ``wait_p99_s``, ``wait_max_s`` over its batches (the latest 65,536 at
          most; a batch that was ready waited 0);
        - ``tasks_built``, ``build_s`` (reader threads' time building batches,
          summed over threads: reads, assembly, tensors, device copies) and
          ``tokens_built``;
        - ``io_calls``, ``io_requests``, ``io_bytes``, ``io_failed``, ``io_s``:
          the reads tokload's I/O engine ran in the interval, for every loader
          and view of this process (its totals are process-wide);
        - ``remote_gets``, ``remote_retries``: for datasets in an object store,
          the ranged GETs that succeeded and the attempts repeated after a
          throttled, failed or cut-short request, whether a later attempt
          succeeded or not (process-wide too). A failure that a retry got past
          never reaches ``next()``: it is counted here. ``io_failed`` counts
          the engine's calls that failed after any retries; the loader itself
          never retries a read (a failure reaches the ``next()`` that needed
          it: see the class docstring);
        - ``component_samples``, ``component_tokens`` (for a ``Blend``: lists
          with one entry per component): the samples (documents with
          ``Fill``) and real tokens of each component in the batches
          delivered;
        - ``batches_ready``: built batches waiting for ``next()`` now, and
          ``prefetch_batches``: the most that can wait (the prefetch's tasks
          of ``steps_per_task`` batches, and the task being handed out; 0
          without reader threads).
        """
        report, self._stats_mark = self._stats.report(self._stats_mark, self._queue())
        return report

    def _queue(self) -> dict[str, int]:
        it = self._iter() if self._iter is not None else None
        if it is None:
            return {"batches_ready": 0, "prefetch_batches": 0}
        return it.queue()

    def _log_stats(self) -> None:
        if time.perf_counter() - self._log_mark["time"] >= self.log_every:
            report, self._log_mark = self._stats.report(self._log_mark, self._queue())
            log.info(format_report(report))

    def raw_batch(self, start: int, end: int) -> dict[str, Any]:
        """The NumPy arrays of this rank's part of the global batch ``[start, end)``.

        This is what ``collate`` gets: the batching policy's arrays of the step
        (for ``Stack``, the view's ``read_batch`` result) plus ``"index"`` and
        ``"position"``.
        """
        span = self._span(start, end, "raw_batch")
        if self._io is None:
            return read_step(self._reader, span)
        with self._io:
            got = read_step(self._reader, span)
        return got

    # ---- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        old = self._iter() if self._iter is not None else None
        if old is not None and not old._closed:  # (one that has ended stays ended)
            old.replaced = True  # its next() says so, rather than end as if the data had
        self._close_iter()
        it = LoaderIter(self)
        self._iter = weakref.ref(it)
        return it

    def __len__(self) -> int:
        """Steps left from the cursor (only for a finite number of epochs); O(1)."""
        if self.total is None:
            raise TypeError("an endless DataLoader (epochs=None) has no length")
        return self.schedule.steps_left(self._cursor)

    def _close_iter(self, timeout: float = CLOSE_S) -> None:
        """Stop the iterator's threads and wait for them and for those of earlier
        iterators still stopping (garbage collection only tells threads to stop):
        ``timeout`` seconds at most for all of them."""
        deadline = time.monotonic() + timeout
        ref = self._iter
        it = ref() if ref is not None else None
        if it is not None:
            it.close(timeout)
        if self._iter is ref:  # (not one another thread's iter() made meanwhile)
            self._iter = None
        for pf in self._stopping:
            pf.close(max(0.0, deadline - time.monotonic()))
        self._stopping = [pf for pf in self._stopping if pf.alive]

    def _still_stopping(self, pf: Prefetcher) -> None:
        """``pf`` was told to stop, and its threads have not all exited yet: the
        next ``close()`` or pass waits for them."""
        self._stopping = [p for p in self._stopping if p.alive]
        self._stopping.append(pf)

    def close(self) -> None:
        """Stop the reader threads (idempotent); the cursor is kept.

        Waits until they have exited, at most ``CLOSE_S`` (one second) for all of
        them together; a thread still inside a read then exits when the read
        returns, without building anything more (the I/O engine cannot abandon a
        read in progress)."""
        self._close_iter()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError(
            "a DataLoader holds reader threads and cannot be pickled: pickle its view "
            "(a view pickles as the call that opened it) and make the DataLoader in the "
            "other process; state_dict() carries the cursor"
        )

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._close_iter(0.0)  # never wait on the collecting thread


_LOADERS: weakref.WeakSet[DataLoader] = weakref.WeakSet()


def _new_locks_after_fork() -> None:
    """In a child made by ``os.fork()``: a new lock for every loader (a thread of the
    parent may have held one at the fork; the child has that thread alone)."""
    for loader in list(_LOADERS):
        loader._lock = threading.RLock()


os.register_at_fork(after_in_child=_new_locks_after_fork)


SHOWN = 240
"""Characters of two differing values a ``StateError`` shows in full; longer ones
(a blend's fingerprint names every component) are shown around where they differ."""


def _shown_apart(saved: Any, here: Any, around: int = 40) -> tuple[str, str]:
    """``repr`` of two values of a state that differ: whole when short, else the
    part of each from a little before the first character where they differ."""
    if not (isinstance(saved, str) and isinstance(here, str)) or len(saved) + len(here) <= SHOWN:
        return repr(saved), repr(here)
    same = (a == b for a, b in zip(saved, here, strict=False))  # (the shorter one's length)
    at = next((k for k, eq in enumerate(same) if not eq), min(len(saved), len(here)))
    lo = max(0, at - around)

    def part(text: str) -> str:
        hi = at + 2 * around
        return ("..." if lo else "") + repr(text[lo:hi]) + ("..." if len(text) > hi else "")

    return part(saved), f"{part(here)} (they differ from character {at})"
