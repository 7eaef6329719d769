"""A batch's reads from an object store: the one job of this module is to fetch the
ranged GETs of the batches the I/O engine's reader threads hand over
(``tokload/_remote.pyx``), on the process's event loop thread (``tokload.remote.loop``).

Each batch's requests are merged into GETs (``plan``); the process keeps as many
GETs in flight, for all its readers together, as cover the store's latency at the
rate the reads go (``_Limit``, from the latency the GETs show; ``_Flow`` gives the
slots, the oldest batch first); every answer is checked (its size; its ETag
through ``If-Match``) and retried as ``tokload.remote.failures`` says; and the
batch ends once, with its bodies copied into place without the GIL or with the
first error that a retry cannot help (``_BatchFetch``).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tokload.errors import RemoteError
from tokload.remote import client, loop
from tokload.remote.failures import ShortBody, named, not_partial, retry_delay, span
from tokload.remote.store import RemoteObject, log

MAX_MERGED = 16 << 20
"""The largest range one GET reads when it merges requests."""


class Gets:
    """A batch's GETs, as columns: GET ``k`` reads ``[starts[k], ends[k])`` of
    ``objs[k]`` and serves ``reqs[k]``, a request's number or (merged) a list of
    them.  Columns of ints, not a tuple and a list per GET: a task's GETs wait
    in flight, or for a slot, for as long as the store takes, and the collector
    would chase every one of those objects meanwhile."""

    __slots__ = ("ends", "objs", "reqs", "starts")

    def __init__(self) -> None:
        self.objs: list[RemoteObject] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.reqs: list[int | list[int]] = []

    def add(self, obj: RemoteObject, start: int, end: int, reqs: list[int]) -> None:
        self.objs.append(obj)
        self.starts.append(start)
        self.ends.append(end)
        self.reqs.append(reqs[0] if len(reqs) == 1 else reqs)

    def size(self, k: int) -> int:
        """The bytes GET ``k`` reads."""
        return self.ends[k] - self.starts[k]

    def requests(self, k: int) -> list[int]:
        """The requests GET ``k`` serves."""
        r = self.reqs[k]
        return [r] if isinstance(r, int) else r

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self) -> Iterator[tuple[RemoteObject, int, int, list[int]]]:
        """``(object, start, end, requests)`` of each GET."""
        for k in range(len(self)):
            yield self.objs[k], self.starts[k], self.ends[k], self.requests(k)


def plan(objs: Sequence[RemoteObject], offsets: Sequence[int], lengths: Sequence[int]) -> Gets:
    """The GETs of a batch: per object, requested ranges sorted and merged
    where the gap between them is at most the store's ``merge_gap`` (and the
    merged range at most MAX_MERGED bytes).  Empty requests need none.

    Raises:
        RemoteError: a request past its object's end (as opened), with
            ``request`` set to its number; before any GET.
    """
    by_obj: dict[int, list[int]] = {}
    for i, o in enumerate(objs):
        if lengths[i]:
            if offsets[i] + lengths[i] > o.size:
                e = RemoteError(
                    f"{o.url}{span(offsets[i], offsets[i] + lengths[i])}: past the object's "
                    f"end ({o.size} bytes when opened)",
                    o.url,
                    offsets[i],
                    offsets[i] + lengths[i],
                )
                e.request = i  # type: ignore[attr-defined]
                raise e
            by_obj.setdefault(id(o), []).append(i)
    gets = Gets()
    for idx in by_obj.values():
        obj = objs[idx[0]]
        gap = obj.store.settings.merge_gap
        idx.sort(key=offsets.__getitem__)
        cur: list[int] = []
        start = end = 0
        for i in idx:
            lo, hi = offsets[i], offsets[i] + lengths[i]
            if cur and lo <= end + gap and max(end, hi) - start <= MAX_MERGED:
                end = max(end, hi)
                cur.append(i)
            else:
                if cur:
                    gets.add(obj, start, end, cur)
                cur, start, end = [i], lo, hi
        gets.add(obj, start, end, cur)
    return gets


SYNC_BODY = 1 << 18
"""Bodies up to this many bytes are taken from an answer at once (they come with its
headers, as a rule: one callback a GET, the client's plain loop's cost); a larger one is
read from the stream without holding the event loop."""

STALLED_S = 1.0
"""A body taken at once that took longer than this to arrive held the event loop, and
every other GET's answer with it (a stall mid-body: a slow server, a lost connection).
The time includes taking the GIL back, which a busy process can hold for a few tenths
of a second (a full garbage collection; at 100 ms, 1,000 GETs in flight took 0.1 to
0.3 s): a shorter stall is not told from that."""

STREAM_FOR_S = 60.0
"""After such a stall, every body is read from its stream for this long (a callback
more a GET, about 50 us of CPU), so that another stall holds only its own GET."""

_stream_until = 0.0
"""Until when (``time.monotonic``) bodies are streamed whatever their size."""


def _stalled(waited: float, url: str) -> None:
    """A body taken at once held the loop ``waited`` seconds: stream bodies for a while."""
    global _stream_until
    if time.monotonic() >= _stream_until:
        log.warning(
            "a GET's body (%s) arrived %.2f s after its headers, and "
            "every other answer of the process waited meanwhile; bodies are read from "
            "their stream for the next %g s",
            url,
            waited,
            STREAM_FOR_S,
        )
    _stream_until = time.monotonic() + STREAM_FOR_S


MIN_IN_FLIGHT = 16
"""The fewest GETs the process keeps in flight (when reads wait for them)."""

MAX_IN_FLIGHT = 4096
"""The most GETs the process keeps in flight, whatever the latency."""

IN_FLIGHT_BYTES = 512 << 20
"""The most bytes of GETs in flight (a GET larger than that still goes, alone)."""


def ready() -> None:
    """Before a remote batch (``_remote.pyx``, with the GIL): the fetcher is running in
    this process, which may read a store (``loop.check_fork``)."""
    loop.check_fork()
    loop.get_loop()


def _start(batch: Any) -> None:
    """A batch a reader handed over (``loop.serve_batches``): its fetch begins."""
    _BatchFetch(batch)


def _abandoned_error(what: str) -> SystemExit:
    """The error of a read abandoned at exit: ``SystemExit`` itself, so that the
    thread that waited on it (a user's own, reading a view) ends without a
    traceback, as threading passes over ``SystemExit`` (that type exactly), and no
    ``except Exception`` in its code takes it for a failed read to retry."""
    return SystemExit(f"the process is exiting: {what}")


_live: set[_BatchFetch] = set()
"""The batches not ended (event loop thread): one entry a batch, none a GET."""

_abandoned = False
"""Whether the process is exiting: no batch starts and no GET is sent any more."""


def _abandon() -> None:
    """At exit (``loop.serve_batches``, on the loop thread): every batch not ended
    fails, so its reader returns at once, and none is started after; their GETs in
    flight run to their end (``loop.quiesce`` waits for them) and none is sent or
    retried after (an ended batch launches nothing)."""
    global _abandoned
    _abandoned = True
    for b in list(_live):
        b._fail(_abandoned_error("the object-store read was abandoned"), 0)


class _Limit:
    """How many GETs the process keeps in flight, from the latency the GETs show.

    Requests in flight are what covers a store's latency: at ``rate`` GETs/s and
    ``latency`` seconds each, ``rate * latency`` are needed (Little's law), and more
    only cost: connections, and the client's CPU per GET, which grows with them.  Past
    that point the extra GETs wait on this side (for the client's CPU, or in the
    store's queue): the latency grows and the rate does not.  So, as TCP Vegas does,
    each period (``PERIOD`` seconds, four round trips at least) compares the mean
    latency of the GETs that completed with the least latency seen: the share of the
    mean spent waiting, ``1 - least / mean``, says how many of the GETs in flight are
    too many.  Under ``LOW`` the limit rises by half; between ``LOW`` and ``HIGH`` it
    stays; over ``HIGH`` it falls by ``FALL``, and further where the period's rate
    says so: to what that rate needs in flight for its GETs to wait between ``LOW``
    and ``HIGH`` of their time (``rate * least / (1 - (LOW + HIGH) / 2)``).  The
    deeper cut is for a collapse: when every completion of the client's needs the GIL
    (obstore's answers do, each from a thread of its own), a thread that holds the GIL
    for a while leaves hundreds of completions waiting for it, and the client's CPU
    goes to their wake-ups instead of to GETs; the rate falls tenfold and the latency
    grows as much.  Falling by ``FALL`` a period from thousands of GETs would take
    seconds; the cut (to a quarter at most per period) ends it in two or three.

    It starts with TCP's slow start: a store 100 ms away may need ten times the first
    limit, which rising by half every four round trips reaches after two seconds.  So
    the limit doubles every two round trips for as long as the doubling pays: as BBR's
    startup does, while a period's rate (counted over its second round trip, once the
    GETs the doubling added are answering) is at least ``GROWTH`` times the best
    before it.  Latency does not end it: the GETs a doubling launches at once queue on
    the client's CPU and lengthen the latency of periods whose rate still grows.  A
    period whose rate did not grow, or in which the readers did not keep the limit
    full, keeps the limit (a large doubling's GETs take a while to be launched and
    answered); ``FLAT`` such periods in a row end the start, with the limit at what
    the best rate needs in flight at the least latency, and at least the limit of the
    last doubling that paid.  If none paid, the first limit was past what the store
    needs already, and the least latency seen was spent partly in a queue: a drain
    (below) follows.

    The least latency is checked, as BBR does, by a drain: one period at half the
    limit, whose least latency becomes the new one (the store may have become slower),
    every ``WINDOW`` seconds and after ``FALLS`` falls in a row.  Between
    ``MIN_IN_FLIGHT`` and ``MAX_IN_FLIGHT``.  After the start, a period in which the
    readers did not keep the limit full (the demand set the rate), that an idle spell
    stretched, or that saw fewer than ``MIN_IN_FLIGHT`` GETs answered (a pause before
    them stretched it and their latency), decides nothing; after an idle spell of
    ``IDLE`` seconds it all starts again (``resumed``).  Pure arithmetic on the
    completions it is told of, so a test drives it with a simulated store."""

    PERIOD = 0.1
    WINDOW = 10.0
    LOW = 0.2
    HIGH = 0.4
    FALL = 0.85
    FALLS = 3
    GROWTH = 1.25
    FLAT = 2
    IDLE = 1.0

    def __init__(self, now: float, start: int = 4 * 16) -> None:
        self.first = start
        self._reset(now)

    def _reset(self, now: float) -> None:
        self.limit = self.first
        self.last = now  # the last completion
        self.t0, self.done, self.bound, self.total = now, 0, 0, 0.0
        self.late = 0  # GETs answered a round trip or more into the period
        self.least, self.least_t = float("inf"), now  # the least latency, and when seen
        self.period_least = float("inf")
        self.falls = 0
        self.drained: int | None = None  # during a drain: the limit before it
        self.starting = True  # doubling while a doubling raises the rate
        self.start_rate = 0.0  # during the start: the best rate a period showed
        self.start_limit = self.first  # the limit of the last doubling that paid
        self.flat = 0  # during the start: periods in a row whose rate did not grow

    def answered(self, now: float, latency: float, bound: bool) -> None:
        """A GET completed at ``now`` after ``latency`` seconds; ``bound``: other
        GETs were waiting for a slot (the limit, not the demand, set the rate)."""
        self.last = now
        self.done += 1
        self.bound += bound
        self.total += latency
        if latency < self.period_least:
            self.period_least = latency
        if latency < self.least:
            self.least, self.least_t = latency, now
        into = now - self.t0
        if into >= self.least:
            self.late += 1
        period = max(self.PERIOD, (2 if self.starting else 4) * self.least)
        if into < period:
            return
        mean, least, rate = self.total / self.done, self.period_least, self.done / into
        # the rate once the GETs of the period's first launches answer
        late = self.late / (into - self.least) if into > self.least else 0.0
        # a period the readers did not keep the limit full says nothing of it
        # (and one of a few GETs says nothing: a pause before them, in this process
        # or the store, stretched the period and their latency)
        said = 2 * self.bound >= self.done and into < 2 * period and self.done >= MIN_IN_FLIGHT
        self.t0, self.done, self.bound, self.total, self.late = now, 0, 0, 0.0, 0
        self.period_least = float("inf")
        if self.drained is not None:  # the drain is over: its least is the store's
            self.least, self.least_t = least, now
            self.limit, self.drained, self.falls = self.drained, None, 0
        elif self.starting:
            self._start(late if said else 0.0)
        elif not said:
            return
        elif now - self.least_t > self.WINDOW or self.falls >= self.FALLS:
            self._drain()
        else:
            self._decide(1.0 - self.least / mean if mean > 0 else 0.0, rate)

    def resumed(self, now: float) -> None:
        """GETs go out again after none were in flight.  After ``IDLE`` seconds or
        more without a completion, what was learnt may hold no more (another
        loader, another store, another latency): start again from the first
        limit, as TCP restarts its slow start after an idle spell."""
        if now - self.last >= self.IDLE:
            self._reset(now)

    def _start(self, rate: float) -> None:
        if rate > 0 and rate >= self.GROWTH * self.start_rate:  # the doubling paid
            self.start_rate, self.start_limit, self.flat = rate, self.limit, 0
            self._set(self.limit * 2)
            return
        self.start_rate = max(self.start_rate, rate)
        self.flat += 1
        if self.flat >= self.FLAT:  # the pipe is full: what the best rate needs
            self.starting = False
            self._set(max(self.start_limit, self.start_rate * self.least))
            if self.start_limit == self.first:  # no doubling paid: the least
                self._drain()  # latency was seen in a queue

    def _drain(self) -> None:
        """One period at half the limit: its least latency becomes the least."""
        self.drained = self.limit
        self.limit = max(MIN_IN_FLIGHT, self.limit // 2)

    def _decide(self, waiting: float, rate: float) -> None:
        if waiting < self.LOW:
            limit, self.falls = self.limit * 1.5, 0
        elif waiting > self.HIGH:
            needed = rate * self.least / (1.0 - (self.LOW + self.HIGH) / 2)
            limit = min(self.limit * self.FALL, max(needed, self.limit / 4))
            self.falls += 1
        else:
            self.falls = 0
            return
        self._set(limit)

    def _set(self, limit: float) -> None:
        self.limit = max(MIN_IN_FLIGHT, min(MAX_IN_FLIGHT, int(limit)))


class _Flow:
    """The GETs in flight for the whole process, from every reader's batches: at
    most ``_Limit``'s limit and ``IN_FLIGHT_BYTES``.  Batches take free slots in the
    order they came (the oldest task's GETs first: it is needed first), each also
    within its own ``depth``."""

    def __init__(self) -> None:
        self.inflight = 0
        self.bytes = 0
        self.ctl = _Limit(time.monotonic())
        self.waiting: collections.deque[_BatchFetch] = collections.deque()

    @property
    def limit(self) -> int:
        return self.ctl.limit

    def add(self, b: _BatchFetch) -> None:
        if not self.inflight:
            self.ctl.resumed(time.monotonic())
        b.queued = True
        self.waiting.append(b)
        self.pump()

    def pump(self) -> None:
        waiting = self.waiting
        while waiting and self.inflight < self.ctl.limit:
            b = waiting[0]
            if b.ended or b.next >= len(b.gets) or b.inflight >= b.batch.depth:
                waiting.popleft()  # back in line once one of its GETs completes
                b.queued = False
                continue
            size = b.gets.size(b.next)
            if self.inflight and self.bytes + size > IN_FLIGHT_BYTES:
                break
            self.inflight += 1
            self.bytes += size
            b.launch()

    def release(self, b: _BatchFetch, size: int, latency: float | None) -> None:
        """A GET of ``b`` is over (``latency``: since its last attempt was sent, for
        one that succeeded)."""
        self.inflight -= 1
        self.bytes -= size
        if latency is not None:
            bound = self.inflight + 1 >= self.ctl.limit and bool(self.waiting)
            self.ctl.answered(time.monotonic(), latency, bound)
        if not b.queued and not b.ended and b.next < len(b.gets):
            b.queued = True
            self.waiting.append(b)
        self.pump()


_flow = _Flow()  # used on the event loop thread only


class _BatchFetch:
    """One reader's batch (``_remote.Batch``), fetched on the event loop thread: its
    merged GETs (``plan``), launched as ``_flow`` gives them slots (at most the
    batch's ``depth`` at once), each answer checked (size, ETag through
    ``If-Match``) and retried as ``retry_delay`` says.  The batch ends once: with
    every body copied into place (``Batch.finish``), or with the error of the first
    GET that failed for good (``Batch.fail``), naming the lowest request it served.
    A failed batch's other GETs are not cancelled: they run to their end and their
    results are dropped.

    Per GET this costs one request of the client's and one callback: no task, no
    coroutine, no shield (the cost of the client's plain loop), and no object of
    its own while it is in flight (``Gets``, ``_owners``): about 8 objects a GET
    in flight for the collector to chase, all the client's, where a bound method,
    a ``partial``, a copied context and a tuple and a list per GET made 14."""

    __slots__ = (
        "asked",
        "attempts",
        "batch",
        "bodies",
        "ended",
        "first",
        "gets",
        "inflight",
        "left",
        "lengths",
        "next",
        "offsets",
        "queued",
        "sent",
        "whole",
    )

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.ended = self.queued = False
        self.next = self.inflight = 0
        self.gets = Gets()
        self.asked: dict[asyncio.Future[Any], int] = {}  # the GET each pending answer is for
        try:
            objs, self.offsets, self.lengths = batch.requests()
            self.gets = plan(objs, self.offsets, self.lengths)
        except BaseException as e:
            self._fail(e, getattr(e, "request", 0))
            return
        if _abandoned:
            self._fail(_abandoned_error("no object-store read starts"), 0)
            return
        n = len(self.gets)
        self.bodies: list[Any] = [None] * n
        self.attempts = [0] * n
        self.whole = [0] * n
        self.first = [0.0] * n  # when the first attempt was sent
        self.sent = [0.0] * n  # when the last one was
        self.left = n
        if n == 0:
            self._finish()
        else:
            _live.add(self)
            _flow.add(self)

    def launch(self) -> None:
        """Send the next GET (``_flow`` gave it a slot)."""
        k = self.next
        self.next += 1
        self.inflight += 1
        self.first[k] = time.monotonic()
        self._get(k)

    def _get(self, k: int) -> None:
        g = self.gets
        obj, start, end = g.objs[k], g.starts[k], g.ends[k]
        self.attempts[k] += 1
        self.sent[k] = time.monotonic()
        try:
            fut = client.get(obj.store.handle, obj.key, start, end, obj.etag)
        except Exception as e:  # refused before it was sent
            self._error(k, e)
            return
        loop.pending.add(fut)
        self._await(fut, k, _answered)

    def _await(self, fut: asyncio.Future[Any], k: int, then: Any) -> None:
        """Call ``then(fut)`` once ``fut`` (for GET ``k``) is done."""
        _owners[fut] = self
        self.asked[fut] = k
        fut.add_done_callback(then, context=_CONTEXT)

    def _over(self, k: int, ok: bool) -> None:
        """GET ``k`` holds its slot no more."""
        self.inflight -= 1
        _flow.release(self, self.gets.size(k), time.monotonic() - self.sent[k] if ok else None)

    def _answered(self, k: int, fut: asyncio.Future[Any]) -> None:
        loop.pending.discard(fut)
        e = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if self.ended:
            self._over(k, False)
            return
        if e is not None:
            self._error(k, e)
            return
        answer = fut.result()
        t = time.monotonic()
        if self.gets.size(k) > SYNC_BODY or t < _stream_until:
            # a large body, or bodies have stalled lately: stream it, not holding the loop
            body = asyncio.ensure_future(client.body_async(answer))
            loop.pending.add(body)
            self._await(body, k, _read)
            return
        try:
            got = client.body(answer)
        except Exception as err:
            got = err
        waited = time.monotonic() - t
        if waited > STALLED_S:
            _stalled(waited, self.gets.objs[k].url)
        if isinstance(got, Exception):
            self._error(k, got)
        else:
            self._got(k, got)

    def _read(self, k: int, fut: asyncio.Future[Any]) -> None:
        loop.pending.discard(fut)
        e = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if self.ended:
            self._over(k, False)
        elif e is not None:
            self._error(k, e)
        else:
            self._got(k, fut.result())

    def _got(self, k: int, body: Any) -> None:
        size = self.gets.size(k)
        if len(body) != size:
            self._error(k, ShortBody(len(body), size))
            return
        self.bodies[k] = body
        self.left -= 1
        loop.counts.gets += 1
        loop.counts.bytes += size
        if self.left == 0:
            self._finish()
        self._over(k, True)

    def _error(self, k: int, e: BaseException) -> None:
        g = self.gets
        obj, start, end = g.objs[k], g.starts[k], g.ends[k]
        self.whole[k] = self.whole[k] + 1 if not_partial(e) else 0
        delay = (
            retry_delay(e, self.attempts[k], self.whole[k], self.first[k], obj.store.settings)
            if isinstance(e, Exception)
            else None
        )
        if delay is None:
            failed = named(e, obj.url, start, end, self.attempts[k], "a range")
            self._fail(failed, min(g.requests(k)))
            self._over(k, False)
            return
        loop.counts.retries += 1
        loop.get_loop().call_later(delay, self._retry, k)  # it keeps its slot meanwhile

    def _retry(self, k: int) -> None:
        if self.ended:
            self._over(k, False)
        else:
            self._get(k)

    def _finish(self) -> None:
        out: list[Any] = [None] * len(self.offsets)
        offsets, lengths = self.offsets, self.lengths
        g = self.gets
        for k, body in enumerate(self.bodies):
            r, start = g.reqs[k], g.starts[k]
            if isinstance(r, int) and g.ends[k] - start == lengths[r]:
                out[r] = body  # the common case: one GET per request
                continue
            mv = memoryview(body)
            for i in g.requests(k):
                out[i] = mv[offsets[i] - start : offsets[i] - start + lengths[i]]
        self.ended = True
        _live.discard(self)
        self.bodies = []
        self.batch.finish(out)

    def _fail(self, e: BaseException, request: int) -> None:
        self.ended = True
        _live.discard(self)
        self.batch.fail(e, request)


_CONTEXT = contextvars.Context()
"""The context the answers' callbacks run in (they read no context variable): one for
all, where ``add_done_callback`` would copy the current one for each."""

_owners: dict[asyncio.Future[Any], _BatchFetch] = {}
"""The batch each pending answer is for (event loop thread).  With ``_BatchFetch.asked``,
this is what a callback needs: no bound method and ``partial`` per GET, which the
collector would have to chase while the GET is in flight."""


def _answered(fut: asyncio.Future[Any]) -> None:
    b = _owners.pop(fut)
    b._answered(b.asked.pop(fut), fut)


def _read(fut: asyncio.Future[Any]) -> None:
    b = _owners.pop(fut)
    b._read(b.asked.pop(fut), fut)


loop.serve_batches(_start, _abandon)
