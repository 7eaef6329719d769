"""One pass of a DataLoader's iteration: its reader threads, the batches they built
for the trainer, and the cursor as ``next()`` moves it.

The one job of this module is ``LoaderIter``, what ``iter(loader)`` returns: it
starts the reader threads of ``tokload.prefetch`` on the loader's reader tasks
(``tokload.tasks``), hands their batches out in order, and counts each batch
in the loader's cursor as it goes. It holds the rules that keep that exact
whatever the training thread does meanwhile: an exception (Ctrl+C, a signal
handler's) anywhere in ``next()`` loses and repeats no batch, and a cursor
move, ``load_state_dict`` or ``close()`` from another thread or a handler
lands between two batches (under the loader's lock, which ``next()`` does not
hold while it waits). The DataLoader owns the cursor, the schedule, the build
of a task's batches and the statistics (``tokload.loader``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from tokload.prefetch import CLOSE_S, Failure, Prefetcher
from tokload.tasks import Counted, Failed, auto_prefetch, batch_nbytes, waiting_threads

if TYPE_CHECKING:
    from tokload.loader import DataLoader


class LoaderIter:
    """One pass of iteration: owns the reader threads; advances the loader's cursor.

    Reader task 0 builds the first step after the cursor the threads started
    from, task ``k > 0`` the ``c = steps_per_task`` steps after task ``k - 1``'s;
    the consumer takes them in order. ``restart`` starts over from the loader's
    current cursor: the old threads are stopped and joined first (one deadline,
    ``CLOSE_S``), so moving the cursor never piles threads up. In a child made by
    ``os.fork()`` the parent's threads do not exist (the prefetcher is marked
    ``forked``): the next ``next()`` restarts from the cursor with the child's
    own threads, and so gets the batches the parent gets next.
    """

    def __init__(self, loader: DataLoader) -> None:
        self._pf: Prefetcher | None = None
        self._loader = loader
        self._closed = False
        self._consumer: int | None = None  # the thread inside next(), if one is
        self.replaced = False  # a newer iter(loader) took over the cursor
        self.failed: BaseException | None = None  # what ended the pass, if a failure did
        # the batches of the task being handed out, in order; _at: the next one
        self._ready: list[tuple[tuple[int, int], Any, Counted] | None] = []
        self._at = 0
        self._task = 0  # the prefetcher's step (reader task) to take next
        self._stale = False  # a restart began and has not finished: next() does it again
        self._gen = 0  # restarts so far: a task taken from an older prefetcher is dropped
        self._waited = 0.0  # the wait for the task being handed out, for its first batch
        self._counted: Any = None  # the last batch delivered (see _delivered)
        self._auto = False  # the automatic prefetch: sized by the batches it sees
        self._largest = 0  # bytes of the largest batch measured
        # Host batches need nothing at delivery: skip the call per batch.
        self._deliver = loader.transfer.deliver if loader.device is not None else None
        self._start()

    def _start(self) -> None:
        loader = self._loader
        loader._own_process()
        self._ready, self._at, self._task = [], 0, 0
        if loader.num_threads > 0:
            # The threads see only the build function, never this object, so
            # dropping the iterator (e.g. leaving a for loop) lets it be collected.
            per = loader.steps_per_task
            # automatic: two tasks until the first batch says how big batches are
            depth = 2 if loader.prefetch is None else max(1, -(-loader.prefetch // per))
            self._auto = loader.prefetch is None
            self._largest = 0
            # read ahead as far as the prefetch reaches: [tasks, the ReadAhead]
            self._lead: list[Any] = [depth]
            cancel = threading.Event()  # set by the prefetcher's close: tasks give up
            # made without threads, which start once it is ours: a prefetcher that an
            # exception (Ctrl+C) cut off before the assignment has none running
            self._pf = Prefetcher(
                loader._task_builder(loader.cursor, self._lead, cancel),
                0,
                None,
                depth,
                0,
                cancel=cancel,
            )
            self._pf.add_threads(loader.num_threads)

    def restart(self) -> None:
        """Drop what was prefetched and go on from the loader's cursor (the old
        threads stopped and joined, ``CLOSE_S`` at most for all of them).

        A restart that an exception (Ctrl+C) cuts short is done again by the
        next ``next()``: never are the old cursor's batches delivered."""
        if self._closed:
            return
        self._stale = True
        pf = self._pf
        if pf is not None:
            pf.close(0)  # told at once; then waited for
            self._loader._still_stopping(pf)
            pf.close(CLOSE_S)
        self._pf, self._ready, self._at, self._gen = None, [], 0, self._gen + 1
        self._start()
        self._stale = False

    def __iter__(self) -> LoaderIter:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError(
            "a DataLoader's iterator holds its reader threads and position and cannot be "
            "copied or pickled: take loader.state_dict(), and call iter(loader) (in another "
            "process, on a DataLoader made there, after load_state_dict)"
        )

    def __next__(self) -> Any:
        # The loader's lock orders this with a cursor move, load_state_dict and close
        # from another thread (or a signal handler): it is not held while waiting for
        # a task or building a batch, and what a move made stale meanwhile is dropped.
        # A batch counts as delivered (leaves the queue, moves the cursor) in one
        # statement after the lock is left, with no call between the test that no
        # move came and the return: no other thread and no signal handler can run
        # there, and an exception anywhere before leaves the batch to come again.
        # One consumer at a time: two threads in next() took one task twice (one then
        # waited forever for a step the other had dropped) or built one batch twice.
        # A signal handler's next() in the same thread goes in, and gives the outer
        # call its mark back. The mark is given back in the statement that delivers
        # a batch (no point where a signal lands comes between them), or on the way
        # out of an exception.
        loader = self._loader
        lock = loader._lock
        me = threading.get_ident()
        entered = False
        try:
            with lock:
                prev = self._consumer
                if prev is not None and prev != me:
                    raise RuntimeError(
                        "this DataLoader iterator is in next() in another thread: one "
                        "consumer per iterator (give each thread a loader of its own, or "
                        "hand the batches over through a queue)"
                    )
                self._consumer = me
                entered = True
            while True:
                with lock:
                    if self._closed:
                        self._ended()
                    if self._stale or (self._pf is not None and self._pf.forked):
                        self.restart()  # cut short before, or in a forked child
                    # (read with no call between: a signal handler's move,
                    # which runs at calls, replaces these, and is seen by the test below)
                    gen, pf, at = self._gen, self._pf, self._at
                    queue, task = self._ready, self._task
                    ready = pf is not None and at < len(queue)
                    if ready:
                        item, end = self._take(queue, (gen, task, at))
                    elif pf is not None:
                        if task and not queue:  # an empty task: the pass is over
                            self.close()
                            raise StopIteration
                    else:
                        # (in the loader's own io scope: a packed schedule reads lengths)
                        with loader._io if loader._io is not None else contextlib.nullcontext():
                            span = loader.schedule.span(loader.cursor)
                        if span is None:
                            self.close()
                            raise StopIteration
                if ready:
                    if gen == self._gen and not self._stale:
                        self._at, loader._cursor, self._consumer = at + 1, end, prev
                        return item
                    continue  # a move came after the lock was left: its batches instead
                t0 = time.perf_counter()
                if pf is None:
                    assert span is not None
                    # (a failure here is raised, the cursor before the batch: built in this
                    # thread, it cannot be told from an exception a signal handler raised,
                    # so the next next() builds the batch again)
                    items, tokens = loader._build([span])
                    with lock:
                        if gen != self._gen or self._stale or self._closed:
                            continue
                        item = items[0]
                        key = (gen, span)
                        self._delivered(key, span, tokens[0], item, time.perf_counter() - t0)
                    if gen == self._gen and not self._stale:
                        loader._cursor, self._consumer = span[1], prev
                        return item
                    continue
                try:
                    got = pf.get(task)
                except StopIteration:
                    self.close()
                    raise
                except RuntimeError:
                    with lock:
                        if self._closed or gen != self._gen:
                            continue  # closed, replaced or moved meanwhile: said at the top
                    raise
                with lock:
                    if gen != self._gen or self._stale or self._closed:
                        continue  # of the prefetcher a move replaced: dropped
                    if isinstance(got, Failure):
                        # A task that failed before its steps were known (a packed
                        # schedule reads its documents' lengths): as for a Failed batch,
                        # the cursor stays before it and a new iterator (or a resume)
                        # builds it again.
                        exc = got.exc
                        exc.add_note(
                            f"(raised in a tokload reader thread while building task {task})"
                        )
                        self._fail(exc)
                        raise exc
                    # taken: stored in one statement without a call (an exception before
                    # it leaves the task to ask for again; a signal handler's cursor move,
                    # which runs at calls, comes before the test or after the store)
                    items = list(got)
                    if gen != self._gen or self._stale:
                        continue
                    self._ready, self._at, self._task = items, 0, task + 1
                    self._waited = time.perf_counter() - t0
                    pf.drop(task)
                    if self._auto and got:
                        self._size_prefetch(got[0][1])
                    if loader.auto_threads:
                        self._size_threads()
        except BaseException:
            if entered:
                self._consumer = prev
            raise

    def _ended(self) -> None:
        """Raise what ``next()`` of a closed iterator raises."""
        if self.replaced:
            raise RuntimeError(
                "this DataLoader iterator was replaced by a newer iter() of its loader, "
                "which goes on from the cursor: a loader has one pass at a time"
            )
        if self.failed is not None:
            raise RuntimeError(
                f"this DataLoader iterator stopped at a failure "
                f"({type(self.failed).__name__}: {self.failed}); iter(loader) goes on "
                f"from the cursor ({self._loader.cursor}), building the failed batch again"
            )
        raise StopIteration

    def _take(self, queue: list[Any], key: tuple[int, int, int]) -> tuple[Any, int]:
        """Batch ``at`` of the task being handed out (``queue``), delivered but for
        the cursor: ``(batch, the cursor after it)``; ``key``: ``(restarts, tasks
        taken, at)``, which names it. Under the loader's lock."""
        at = key[2]
        if at:
            queue[at - 1] = None  # delivered: the queue lets go of it
        entry = queue[at]
        assert entry is not None
        span, item, ntok = entry
        if isinstance(item, Failed):
            # The batch was not delivered: the cursor stays before it, and a new
            # iterator (or a resume) builds it again.
            self._fail(item.exc)
            raise item.exc
        wait, self._waited = self._waited, 0.0
        self._delivered(key, span, ntok, item, wait)
        return item, span[1]

    def _delivered(
        self, key: Any, span: tuple[int, int], ntok: Counted, item: Any, wait: float
    ) -> None:
        """What delivering a batch does before the cursor counts it; its statistics
        once (``key`` names the batch: one an exception made come again is not
        counted twice)."""
        loader = self._loader
        if key != self._counted:
            # (an interrupt inside this update may count the batch twice: only the
            # statistics, never the batches)
            loader._stats.delivered(wait, loader.schedule.samples(*span), *ntok)
            self._counted = key
            if loader.log_every is not None:
                loader._log_stats()
        if self._deliver is not None:
            self._deliver(item)

    def _fail(self, exc: BaseException) -> None:
        """End the pass at a failure: ``next()`` then says so (the cursor stays before
        the batch that failed)."""
        self.failed = exc
        self.close()

    def queue(self) -> dict[str, int]:
        """Built batches waiting for ``next()``, and the most that can wait: the
        prefetch's tasks and the one being handed out."""
        pf = self._pf
        if pf is None:
            return {"batches_ready": 0, "prefetch_batches": 0}
        per = self._loader.steps_per_task
        # (the tasks' own batches: the last tasks of a finite run have fewer than per)
        built = sum(len(t) for t in pf.waiting() if isinstance(t, list))
        return {
            "batches_ready": len(self._ready) - self._at + built,
            "prefetch_batches": (pf.depth + 1) * per,
        }

    def _size_prefetch(self, batch: Any) -> None:
        """The automatic prefetch depth, from the first batch of each task: sized
        by the largest batch seen (batches of documents vary), so it only shrinks
        after the first."""
        if isinstance(batch, Failed) or self._pf is None:
            return
        nbytes = batch_nbytes(batch)
        if self._largest and nbytes <= self._largest:
            return
        self._largest = max(self._largest, nbytes)
        depth = auto_prefetch(self._largest, self._loader.prefetch_bytes)
        tasks = max(2, -(-depth // self._loader.steps_per_task))
        self._lead[0] = tasks
        self._pf.set_depth(tasks)

    def _size_threads(self) -> None:
        """More reader threads while the tasks wait for their reads: a task that
        takes ``r`` times its CPU time (r > 2) leaves a thread idle most of the
        time, so ``num_threads * r`` threads keep ``num_threads`` threads' worth
        of work going; at most ``MAX_WAITING_THREADS`` and the tasks the prefetch
        may hold.  Threads that wait for reads cost neither CPU nor the GIL."""
        pf = self._pf
        if pf is None:
            return
        want = waiting_threads(self._loader.num_threads, *pf.load(), pf.depth)
        if want > pf.threads:
            # more threads only help: where the system refuses one, go on with those
            # there are (the next sizing tries again)
            with contextlib.suppress(RuntimeError):
                pf.add_threads(want - pf.threads)

    def close(self, timeout: float = CLOSE_S) -> None:
        """Stop the reader threads, waiting ``timeout`` seconds at most for all of
        them (0: tell them to stop and return)."""
        with self._loader._lock:  # (not while next() of another thread uses _ready)
            if not self._closed:
                self._closed = True
                self._ready, self._at = [], 0
            pf = self._pf
        # (each call waits: a second close() from another thread returns once the
        # threads are gone, as the first does)
        if pf is not None and not pf.close(timeout):
            self._loader._still_stopping(pf)

    def __del__(self) -> None:
        # Garbage collection runs on whatever thread drops the last reference (the
        # training thread, usually): it only tells the threads to stop, and they exit
        # on their own once a read in progress returns. Nothing else holds this
        # iterator: no lock is needed (nor waited for).
        self._closed = True
        pf = getattr(self, "_pf", None)  # (None: an __init__ that did not finish)
        if pf is not None and not pf.close(0.0):
            self._loader._still_stopping(pf)
