"""Batching: how the DataLoader turns the samples of a step into one batch.

Batching is the loader's policy, not the view's: the same view of documents (a
``Documents``, a ``Blend`` of them, a user's view) can be padded, packed back
to back or best-fit filled into rows by passing another policy to
``DataLoader(view, batch_size, batching=...)``:

- ``Stack()``: each sample's arrays as the view's ``read_batch`` gives them,
  stacked (token windows: ``[B, window]``). The default for views of windows
  and records, and for user views.
- ``Pad(to=None, value=0)``: documents as ``[B, L]`` rows, padded with
  ``value``, plus ``"lengths"``; ``L`` is ``to`` (longer documents are
  truncated) or the longest document of each batch. The default for views of
  documents.
- ``Pack()``: documents back to back in one ``[sum of lengths]`` array, plus
  ``"lengths"`` and ``"cu_seqlens"``.
- ``Fill(window, lookahead=1024, value=0, attention=True)``: rows of ``window``
  tokens, each filled best-fit with whole documents of the shuffle
  (``tokload.packing``), plus ``"lengths"``, ``"doc_counts"`` and the
  attention keys (``"position_ids"``, ``"segment_ids"``, ``"loss_mask"``,
  ``"cu_seqlens"``, ``"max_seqlen"``) that make each document attend only to
  itself. A step is ``batch_size`` rows, and the run's positions count rows.

Every policy reads all the steps of a reader task with one read of the view
(one call into the I/O engine per source): the samples' index entries, then
the rows, straight into the task's buffers; each step's batch is a slice of
them (no copy).

The document contract
---------------------
``Pad``, ``Pack`` and ``Fill`` read through the document contract of
``tokload.views.contract`` (``extents``, ``fields``, ``read_extents``, and
optionally ``origin``): ``Documents``, a ``Blend`` of them and a user's view
of documents all keep it.

The policy protocol (for the loader)
------------------------------------
A policy has ``fingerprint`` (what the run's positions depend on: ``""``
unless positions mean something else than samples, as ``Fill``'s rows),
``read_upto(cursor, n)`` (the view's observations an in-order run has read
before ``cursor``: the loader's checkpoint fingerprints those),
``check(view)`` (TypeError naming what the view lacks), ``schedule(view,
batch_size, **order)`` (a ``tokload.schedule.Schedule``, or one that answers
as it does) and ``reader(view, schedule, alloc)``, whose ``read(spans,
cancel)`` gives a ``Task``: the batches of consecutive steps.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tokload._docindex import split_cu_seqlens
from tokload._pack import pad_rows, row_boundaries, row_offsets
from tokload.arguments import check_fits, is_integer
from tokload.assembly import Assembly
from tokload.packing import DEFAULT_LOOKAHEAD, PackedSchedule, Packing
from tokload.schedule import Schedule
from tokload.stats import TokenCounter
from tokload.views.contract import (
    ATTENTION_KEYS,
    RESERVED_KEYS,
    Alloc,
    attention_keys,
    check_documents,
    check_step_tokens,
    check_view,
    document_extents,
    refuse_field_names,
)

PAD_KEYS = ("lengths",)
PACK_KEYS = ("lengths", "cu_seqlens")
FILL_KEYS = ("lengths", "doc_counts")
"""The keys ``Pad``, ``Pack`` and ``Fill`` add to a batch besides the view's fields
(``Fill`` its attention keys too) and ``RESERVED_KEYS``: no field may have them."""


@dataclass(frozen=True)
class Part:
    """Elements ``[start, stop)`` of a task's flat array, as an array of ``shape``."""

    start: int
    stop: int
    shape: tuple[int, ...]


@dataclass
class Task:
    """The batches of a reader task's consecutive steps.

    With ``whole`` (a dict of arrays shared by the steps), step ``k``'s batch
    holds rows ``rows[k]`` (``(a, e)``) of each of ``row_keys``, and for each
    key of ``steps[k]`` a ``slice`` of ``whole[key]`` (along its first axis), a
    ``Part`` of it, or a value as it is (``steps`` may be empty when every key
    is a row key). Without (None), ``steps[k]`` is step
    ``k``'s batch itself. ``tokens[k]``: the real tokens of step ``k`` (for
    ``stats``; ``by_component`` those of each component of a blend).
    ``failure``: ``(exception, steps it served)`` when building
    step ``len(steps)`` failed; the steps before it are built.
    """

    whole: dict[str, Any] | None
    steps: list[dict[str, Any]]
    tokens: list[int]
    failure: tuple[BaseException, int] | None = None
    rows: list[tuple[int, int]] = field(default_factory=list)
    row_keys: list[str] = field(default_factory=list)
    by_component: list[np.ndarray] | None = None
    """Per step, a blend's ``[samples, real tokens]`` per component (int64
    ``[components, 2]``), for ``stats``; None for other views."""


def cut(task: Task, whole: dict[str, Any], make: Any = dict) -> list[Any]:
    """Each step's batch of a ``Task`` with ``whole`` (its arrays, or their
    tensors), made with ``make()``: rows, slices and parts of the task's
    arrays, no copy.

    Rows and slices are cut by indexing, one piece at a time: a tensor's
    ``split`` would make fewer calls, but it drops the GIL (as most torch calls
    do, and freeing the slice it is given drops it again), and a reader thread
    that drops it while the training thread runs Python waits up to a switch
    interval (5 ms) to take it back, each time. Indexing keeps it."""
    steps = task.steps
    rows = task.rows
    out: list[Any] = [make() for _ in (rows or steps)]
    if rows:
        items = [(k, whole[k]) for k in task.row_keys]
        for b, (a, e) in zip(out, rows, strict=True):
            for k, v in items:
                b[k] = v[a:e]
    if not steps:
        return out
    for key in steps[0]:
        values = [st[key] for st in steps]
        v0 = values[0]
        if isinstance(v0, slice):
            arr = whole[key]
            for b, v in zip(out, values, strict=True):
                b[key] = arr[v]
        elif isinstance(v0, Part):
            arr = whole[key]
            for b, v in zip(out, values, strict=True):
                b[key] = arr[v.start : v.stop].reshape(v.shape)
        else:
            for b, v in zip(out, values, strict=True):
                b[key] = v
    return out


class TaskReader(Protocol):
    """What a policy's ``reader`` gives the loader."""

    def read(self, spans: list[tuple[int, int]], cancel: threading.Event | None) -> Task: ...


class Batching(Protocol):
    """A batching policy (see the module docstring)."""

    @property
    def fingerprint(self) -> str: ...

    def read_upto(self, cursor: int, n: int) -> int: ...

    def check(self, view: Any) -> None: ...

    def schedule(self, view: Any, batch_size: int, **order: Any) -> Schedule: ...

    def reader(self, view: Any, schedule: Any, alloc: Alloc) -> TaskReader: ...


def resolve(batching: Any, view: Any) -> Any:
    """The policy a loader of ``view`` uses: ``batching``, or the view's default
    (``view.batching``), or ``Stack()``; checked against the view."""
    if batching is None:
        batching = getattr(view, "batching", None) or Stack()
    if isinstance(batching, type):  # (its methods are callable on the class too)
        raise TypeError(
            f"batching must be a policy, an instance: write batching=tokload.{batching.__name__}"
            f"(...), not the class {batching.__name__}"
        )
    for name in ("check", "schedule", "reader"):
        if not callable(getattr(batching, name, None)):
            raise TypeError(
                f"batching must be a policy (tokload.Stack(), Pad(), Pack(), Fill(...)), "
                f"got {batching!r}"
            )
    batching.check(view)
    return batching


def _cuts(ends: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *ends], ends, strict=False))


def _origin(
    view: Any, indices: np.ndarray, alloc: Alloc, taken: Collection[str] = ()
) -> dict[str, np.ndarray]:
    """The view's provenance arrays of ``indices`` (none without ``origin``), in
    buffers of ``alloc``; ValueError for a key the batch has already (``taken``:
    the view's arrays and the policy's) or that the loader sets."""
    origin = getattr(view, "origin", None)
    if origin is None:
        return {}
    out: dict[str, np.ndarray] = {}
    for k, v in origin(indices).items():
        if k in RESERVED_KEYS or k in taken:
            raise ValueError(
                f"{type(view).__name__}.origin gave the key {k!r}, which the "
                + ("loader sets" if k in RESERVED_KEYS else "batch holds already")
                + ": a provenance array needs a name of its own"
            )
        shape = np.shape(v)
        if len(shape) < 1 or shape[0] != len(indices):
            raise ValueError(
                f"{type(view).__name__}.origin gave {k!r} of shape {shape} for "
                f"{len(indices)} samples: a provenance array has one entry per sample"
            )
        a = alloc(shape, np.asarray(v).dtype)
        a[...] = v
        out[k] = a
    k = getattr(view, "num_components", None)
    comp = out.get("component")
    if (
        k is not None
        and comp is not None
        and len(comp)
        and (comp.dtype.kind not in "iu" or int(comp.min()) < 0 or int(comp.max()) >= k)
    ):
        raise ValueError(
            f"{type(view).__name__}.origin gave components outside [0, {k}) "
            f"(num_components), from {comp.min()} to {comp.max()}"
        )
    return out


def _by_component(
    view: Any, origin: dict[str, Any], tokens_each: Any, cuts: list[tuple[int, int]]
) -> list[np.ndarray] | None:
    """Each step's ``[samples, tokens]`` per component (``view.num_components``
    of them), from the samples' ``"component"`` (``origin``) and tokens; None
    for a view without components. Two ``bincount`` calls a task."""
    k = getattr(view, "num_components", None)
    comp = origin.get("component")
    if k is None or comp is None or not cuts:
        return None
    s = len(cuts)
    step = np.repeat(np.arange(s, dtype=np.int64), [e - a for a, e in cuts])
    key = step * k + np.asarray(comp[: cuts[-1][1]], dtype=np.int64)
    samples = np.bincount(key, minlength=s * k)
    tokens = np.bincount(key, weights=np.asarray(tokens_each, dtype=np.float64), minlength=s * k)
    both = np.stack([samples, tokens.astype(np.int64)], axis=1).reshape(s, k, 2)
    return list(both)


def _index_position(
    alloc: Alloc, indices: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    both = alloc((2, len(indices)), np.int64)
    both[0] = indices
    both[1] = positions.view(np.int64)
    return both[0], both[1]


# ---- Stack: the view's own batches ---------------------------------------------------------


class _BySample:
    """What the policies whose positions are samples share (``Stack``, ``Pad``,
    ``Pack``): the plain schedule, and nothing but the view in the checkpoint."""

    @property
    def fingerprint(self) -> str:
        return ""

    def read_upto(self, cursor: int, n: int) -> int:
        """The view's observations ``[0, r)`` an in-order run (``shuffle=False``)
        has read before ``cursor``: ``min(cursor, n)``."""
        return min(cursor, n)

    def schedule(self, view: Any, batch_size: int, **order: Any) -> Schedule:
        return Schedule(len(view), batch_size, **order)


@dataclass(frozen=True)
class Stack(_BySample):
    """Each sample as the view's ``read_batch`` gives it, stacked: a token
    window is a ``[window]`` row of a ``[B, window]`` batch.

    The default for views of windows and records and for user views. A rowwise
    view (``view.rowwise``: token streams, blends of them) reads all the steps
    of a task in one call; a view with ``read_batches`` (a stream with metadata
    blocks) reads them in one round; others one step at a time.
    """

    def check(self, view: Any) -> None:
        check_view(view)

    def reader(self, view: Any, schedule: Any, alloc: Alloc) -> _StackReader:
        return _StackReader(view, schedule, alloc)

    def __repr__(self) -> str:
        return "Stack()"


class _StackReader:
    def __init__(self, view: Any, schedule: Schedule, alloc: Alloc) -> None:
        self.view, self.schedule, self.alloc = view, schedule, alloc
        self.asm = Assembly(view, alloc)
        self.tokens = TokenCounter()
        self.has_origin = getattr(view, "origin", None) is not None

    def _with_origin(self, raw: dict[str, Any]) -> dict[str, Any]:
        if self.has_origin:
            raw.update(_origin(self.view, raw["index"], self.alloc, raw))
        return raw

    def read(self, spans: list[tuple[int, int]], cancel: threading.Event | None) -> Task:
        sched, asm = self.schedule, self.asm
        if not asm.rowwise:
            return self._read_apart(spans, cancel)
        pos, ends = sched.task_positions(spans)
        cuts = list(zip([0, *ends[:-1]], ends, strict=True))
        idx = sched.indices(pos)
        extra: list[dict[str, Any]] | None = None
        per_batch: frozenset[str] = frozenset()
        if asm.stepwise:  # rows, and values per batch (cu_seqlens)
            raw, extra = asm.read_steps(idx, pos, cuts)
            per_batch = frozenset(k for st in extra for k in st)
        else:
            raw = asm.read(idx, pos)
        asm.check_rows(raw, len(pos), per_batch)
        if self.has_origin:
            self._with_origin(raw)
        tokens = self.tokens.rows(raw, cuts)
        rowkeys = [k for k in raw if k not in per_batch] if per_batch else list(raw)
        steps = extra if extra is not None else []  # no values per step: rows only
        by = None
        if self.has_origin:
            per_row = sum(tokens) // len(pos) if len(pos) else 0  # windows: all alike
            each = raw["lengths"] if "lengths" in raw else np.full(len(pos), per_row)
            by = _by_component(self.view, raw, each, cuts)
        return Task(raw, steps, tokens, rows=cuts, row_keys=rowkeys, by_component=by)

    def _read_apart(self, spans: list[tuple[int, int]], cancel: threading.Event | None) -> Task:
        """A view that is not rowwise: one ``read_batches`` for the task where it
        has one (its failure is the task's), else a read per step (a failure is
        its step's)."""
        sched, asm = self.schedule, self.asm
        raws: list[dict[str, Any]] = []
        failure: tuple[BaseException, int] | None = None
        many = len(spans) > 1 and getattr(asm.view, "read_batches", None) is not None
        try:
            if many:
                parts = [(sched.indices(p), p) for p in (sched.positions(*sp) for sp in spans)]
                raws = asm.read_many(parts)
            else:
                for sp in spans:
                    if cancel is not None and cancel.is_set():
                        break
                    pos = sched.positions(*sp)
                    raws.append(asm.read(sched.indices(pos), pos))
            if self.has_origin:
                for r in raws:
                    self._with_origin(r)
        except Exception as e:
            failure = (e, len(spans) if many else 1)
        tokens = [self.tokens.one(r) for r in raws]
        by: list[np.ndarray] | None = None
        if self.has_origin and raws:  # a blend's samples and tokens per component
            by = []
            for r, t in zip(raws, tokens, strict=True):
                n = len(r["index"])
                each = r["lengths"] if "lengths" in r else np.full(n, t // n if n else 0)
                got = _by_component(self.view, r, each, [(0, n)])
                if got is None:
                    by = None
                    break
                by.append(got[0])
        return Task(None, raws, tokens, failure, by_component=by)


# ---- documents -------------------------------------------------------------------------------


def _check_value_type(policy: str, value: object) -> None:
    """ValueError unless the padding ``value`` is an integer token (a float was
    truncated to another token, a string parsed)."""
    if not is_integer(value):
        raise ValueError(f"{policy}(value=...) must be an integer token, got {value!r}")


def _check_keys(view: Any, policy: str, added: Collection[str]) -> None:
    """ValueError when a field of the view has the name of a key the policy adds to
    each batch (``added``) or the loader sets: the field would be replaced."""
    name = type(view).__name__
    fields = list(view.fields)
    refuse_field_names(name, fields, RESERVED_KEYS, "the loader")
    hint = f", or leave it out of {policy}(attention=[...])" if policy == "Fill" else ""
    refuse_field_names(name, fields, set(added) - set(ATTENTION_KEYS), policy)
    refuse_field_names(name, fields, added, policy, hint)


def _check_value(view: Any, value: int) -> None:
    """OverflowError when the padding ``value`` does not fit a field of the view."""
    for name, dt in view.fields.items():
        check_fits(value, dt, "the padding value", name)


def _flat(view: Any, total: int, alloc: Alloc, value: int | None) -> dict[str, np.ndarray]:
    """One flat array of ``total`` rows per field of the view, set to ``value``
    (None: left uninitialized; a value was checked by the policy's ``check``)."""
    out: dict[str, np.ndarray] = {}
    for name, dt in view.fields.items():
        a = alloc((total,), dt)
        if value is not None:
            a[...] = value
        out[name] = a
    return out


def _c_array(alloc: Alloc, shape: tuple[int, ...], dtype: Any, what: str) -> np.ndarray:
    """``alloc(shape, dtype)``, refused unless C-contiguous: it is written in place
    through a flat view (of another order, that view would be a copy)."""
    a = alloc(shape, dtype)
    if not a.flags.c_contiguous:
        order = "a Fortran-ordered" if a.flags.f_contiguous else "a strided"
        raise ValueError(
            f"alloc gave {order} array for {what!r} {list(shape)}: the rows are written "
            "in place, so it must be C-contiguous"
        )
    return a


def _read_docs(
    view: Any,
    indices: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    dst: np.ndarray,
    out: dict[str, np.ndarray],
) -> None:
    if len(indices):
        view.read_extents(indices, starts, lengths, dst, out)


def _task_documents(
    sched: Schedule, view: Any, spans: list[tuple[int, int]]
) -> tuple[np.ndarray, list[int], np.ndarray, np.ndarray, np.ndarray]:
    """A task's positions, where each step ends in them, its documents (view
    indices), and their extents (``starts``, uint64 ``lengths``): what ``Pad``
    and ``Pack`` read before they place the documents."""
    pos, ends = sched.task_positions(spans)
    idx = sched.indices(pos)
    starts, lengths = document_extents(view, idx)
    return pos, ends, idx, starts, lengths


def _real_tokens(lengths: np.ndarray, cuts: list[tuple[int, int]]) -> list[int]:
    csum = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    return [int(csum[e] - csum[a]) for a, e in cuts]


@dataclass(frozen=True)
class Pad(_BySample):
    """Documents as ``[B, L]`` rows padded with ``value``, plus ``"lengths"``.

    Args:
        to: a fixed ``L`` (longer documents are cut to their first ``to``
            tokens); None pads to the longest document of each batch (at least 1).
        value: the padding token (OverflowError when the loader is made, if
            it does not fit the dtype).

    A batch holds one array per field (``"tokens"`` for a plain dtype) and
    ``"lengths"`` (int64, the real tokens of each row).
    """

    to: int | None = None
    value: int = 0

    def __post_init__(self) -> None:
        if self.to is not None and (not is_integer(self.to) or not 1 <= self.to < 1 << 63):
            raise ValueError(
                f"Pad(to=...) must be a positive integer below 2**63 or None, got {self.to!r}"
            )
        _check_value_type("Pad", self.value)

    def check(self, view: Any) -> None:
        check_documents(view, "Pad")
        _check_keys(view, "Pad", PAD_KEYS)
        _check_value(view, self.value)

    def reader(self, view: Any, schedule: Any, alloc: Alloc) -> _PadReader:
        return _PadReader(self, view, schedule, alloc)


class _PadReader:
    def __init__(self, policy: Pad, view: Any, schedule: Schedule, alloc: Alloc) -> None:
        self.policy, self.view, self.schedule, self.alloc = policy, view, schedule, alloc

    def read(self, spans: list[tuple[int, int]], cancel: threading.Event | None) -> Task:
        view, alloc = self.view, self.alloc
        pos, ends, idx, starts, lengths = _task_documents(self.schedule, view, spans)
        cuts = _cuts(ends)
        sizes = np.diff([0, *ends]).astype(np.int64)
        if self.policy.to is not None:
            width = np.full(len(cuts), self.policy.to, dtype=np.int64)
        else:
            width = np.array(
                [max(1, int(lengths[a:e].max())) if e > a else 1 for a, e in cuts], dtype=np.int64
            )
        per_doc = np.repeat(width, sizes)
        capped = np.minimum(lengths, per_doc.astype(np.uint64))
        base = np.concatenate(([0], np.cumsum(sizes * width)))  # each step's first element
        first = np.repeat(np.asarray([a for a, _ in cuts], dtype=np.int64), sizes)
        dst = (np.repeat(base[:-1], sizes) + (np.arange(len(idx)) - first) * per_doc).astype(
            np.uint64
        )
        whole: dict[str, Any] = _flat(view, int(base[-1]), alloc, self.policy.value)
        _read_docs(view, idx, starts, capped, dst, whole)
        fields = list(whole)
        lens = alloc((len(idx),), np.int64)
        lens[:] = capped
        whole["lengths"] = lens
        origin = _origin(view, idx, alloc, whole)
        whole.update(origin)
        whole["index"], whole["position"] = _index_position(alloc, idx, pos)
        rowkeys = [k for k in whole if k not in fields]
        bounds, widths = base.tolist(), width.tolist()
        steps = [
            {f: Part(bounds[k], bounds[k + 1], (e - a, widths[k])) for f in fields}
            for k, (a, e) in enumerate(cuts)
        ]
        return Task(
            whole,
            steps,
            _real_tokens(capped, cuts),
            rows=cuts,
            row_keys=rowkeys,
            by_component=_by_component(view, origin, capped, cuts),
        )


@dataclass(frozen=True)
class Pack(_BySample):
    """Documents back to back: one ``[sum of lengths]`` array per field, plus
    ``"lengths"`` (int64, ``[B]``) and ``"cu_seqlens"`` (int64, ``[B + 1]``:
    where each document starts, then the total)."""

    def check(self, view: Any) -> None:
        check_documents(view, "Pack")
        _check_keys(view, "Pack", PACK_KEYS)

    def reader(self, view: Any, schedule: Any, alloc: Alloc) -> _PackReader:
        return _PackReader(view, schedule, alloc)

    def __repr__(self) -> str:
        return "Pack()"


class _PackReader:
    def __init__(self, view: Any, schedule: Schedule, alloc: Alloc) -> None:
        self.view, self.schedule, self.alloc = view, schedule, alloc

    def read(self, spans: list[tuple[int, int]], cancel: threading.Event | None) -> Task:
        view, alloc = self.view, self.alloc
        pos, ends, idx, starts, lengths = _task_documents(self.schedule, view, spans)
        cuts = _cuts(ends)
        csum = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=csum[1:])
        whole: dict[str, Any] = _flat(view, int(csum[-1]), alloc, None)
        _read_docs(view, idx, starts, lengths, csum[:-1].astype(np.uint64), whole)
        fields = list(whole)
        lens = alloc((len(idx),), np.int64)
        lens[:] = lengths
        whole["lengths"] = lens
        # each step's cu_seqlens (its B + 1 offsets from 0), back to back
        cu = alloc((len(idx) + len(cuts),), np.int64)
        for k, (a, e) in enumerate(cuts):
            cu[a + k : e + k + 1] = csum[a : e + 1] - csum[a]
        whole["cu_seqlens"] = cu
        origin = _origin(view, idx, alloc, whole)
        whole.update(origin)
        whole["index"], whole["position"] = _index_position(alloc, idx, pos)
        rowkeys = [k for k in whole if k not in fields and k != "cu_seqlens"]
        off = csum.tolist()
        steps = []
        for k, (a, e) in enumerate(cuts):
            st: dict[str, Any] = {f: slice(off[a], off[e]) for f in fields}
            st["cu_seqlens"] = slice(a + k, e + k + 1)
            steps.append(st)
        return Task(
            whole,
            steps,
            _real_tokens(lengths, cuts),
            rows=cuts,
            row_keys=rowkeys,
            by_component=_by_component(view, origin, lengths, cuts),
        )


@dataclass(frozen=True)
class Fill:
    """Rows of ``window`` tokens filled best-fit with whole documents (``tokload.packing``).

    Args:
        window: tokens per row.
        lookahead: consecutive documents of the shuffle packed together
            (default 1024): more packs tighter; each rank packs that many
            documents' lengths at a time.
        value: the padding token after each row's documents (OverflowError when
            the loader is made, if it does not fit the dtype).
        attention: the attention keys added to each batch: True (default) for
            all of ``"position_ids"`` (int64), ``"segment_ids"`` (int32),
            ``"loss_mask"`` (bool; False on each document's first token and on
            the padding), each ``[B, window]``, ``"cu_seqlens"`` (int32, the
            segments' starts over the flattened ``[B * window]`` batch, then
            ``B * window``) and ``"max_seqlen"`` (int); a list of them; False
            for none. The padding is its row's last segment.

    A batch holds ``[B, window]`` per field, ``"lengths"`` (int64, ``[D]``: the
    tokens each document puts in its row, row by row; a document longer than
    ``window`` gives its first ``window``), ``"doc_counts"`` (int64, ``[B]``),
    ``"index"`` (the ``D`` documents' view indices) and ``"position"`` (the
    ``B`` rows' positions). ``batch_size`` counts rows. The cursor counts
    positions in the shuffle of documents: row ``b`` of the group of documents
    that starts at position ``p`` is position ``p + b`` (a group of ``m``
    documents fills at most ``m`` rows), so it runs ahead of the rows delivered.
    Another ``window`` or ``lookahead`` is another run (the checkpoint records
    them).
    """

    window: int
    lookahead: int = DEFAULT_LOOKAHEAD
    value: int = 0
    attention: bool | Sequence[str] = True
    keys: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        Packing(self.window, self.lookahead)  # checks both
        _check_value_type("Fill", self.value)
        object.__setattr__(self, "keys", attention_keys(self.attention))

    @property
    def fingerprint(self) -> str:
        return f"Fill(window={self.window}, lookahead={self.lookahead})"

    def read_upto(self, cursor: int, n: int) -> int:
        """The documents ``[0, r)`` an in-order run has read before ``cursor``:
        the whole group of ``lookahead`` documents the cursor is in (its rows
        were packed from all of them), so a blend stage added inside it is
        refused on resume."""
        if cursor >= n:
            return n
        return min(n, -(-cursor // self.lookahead) * self.lookahead)

    def check(self, view: Any) -> None:
        check_documents(view, "Fill")
        _check_keys(view, "Fill", (*FILL_KEYS, *self.keys))
        _check_value(view, self.value)

    def schedule(self, view: Any, batch_size: int, **order: Any) -> PackedSchedule:
        # a view that locates its documents (a Blend) does it once, as it packs them
        locate = getattr(view, "locate", None) if hasattr(view, "remember_located") else None
        return PackedSchedule(
            len(view),
            batch_size,
            extents=functools.partial(document_extents, view),
            packing=Packing(self.window, self.lookahead),
            locate=locate,
            **order,
        )

    def reader(self, view: Any, schedule: Any, alloc: Alloc) -> _FillReader:
        return _FillReader(self, view, schedule, alloc)


class _FillReader:
    def __init__(self, policy: Fill, view: Any, schedule: PackedSchedule, alloc: Alloc) -> None:
        self.policy, self.view, self.schedule, self.alloc = policy, view, schedule, alloc

    def read(self, spans: list[tuple[int, int]], cancel: threading.Event | None) -> Task:
        view, alloc, w = self.view, self.alloc, self.policy.window
        rows, nrows = self.schedule.task_rows(spans)
        if rows.located:  # the reads and provenance below ask for these
            view.remember_located(rows.ids, *rows.located)
        row_ends = np.cumsum(nrows)
        doc_ends = np.cumsum(rows.counts)[row_ends - 1] if len(rows.counts) else row_ends
        doc_ends[row_ends == 0] = 0  # steps before this rank's first row (none usually)
        row_cuts, doc_cuts = _cuts(row_ends.tolist()), _cuts(doc_ends.tolist())
        r, d = len(rows.counts), len(rows.ids)
        if "cu_seqlens" in self.policy.keys or "max_seqlen" in self.policy.keys:
            check_step_tokens(max(nrows), w)
        # [r, w] arrays (each its allocation's own tensor), read and padded flat
        whole: dict[str, Any] = {f: _c_array(alloc, (r, w), dt, f) for f, dt in view.fields.items()}
        flat = {f: a.reshape(-1) for f, a in whole.items()}
        dst = row_offsets(rows.lengths, rows.counts, w, 1)  # rows; checks each row fits
        _read_docs(view, rows.ids, rows.starts, rows.lengths, dst, flat)
        for a in whole.values():  # the value was checked against the dtype by check
            pad_rows(a, rows.lengths, rows.counts, w, self.policy.value)
        lens = alloc((d,), np.int64)
        lens[:] = rows.lengths
        counts = alloc((r,), np.int64)
        counts[:] = rows.counts
        whole["lengths"], whole["doc_counts"] = lens, counts
        keys = self.policy.keys
        per_step: list[dict[str, Any]] = [{} for _ in spans]
        if keys:
            arrays, cu, _ = row_boundaries(rows.lengths, rows.counts, w, alloc, keys)
            whole.update(arrays)
            if "cu_seqlens" in keys or "max_seqlen" in keys:
                joined, offsets, longest = split_cu_seqlens(cu, row_cuts, w)
                off, top = offsets.tolist(), longest.tolist()
                if "cu_seqlens" in keys:
                    whole["cu_seqlens"] = joined
                    for k, st in enumerate(per_step):
                        st["cu_seqlens"] = slice(off[k], off[k + 1])
                if "max_seqlen" in keys:
                    for st, m in zip(per_step, top, strict=True):
                        st["max_seqlen"] = m
        # (whole holds every key of the batch but max_seqlen, a value of each step's)
        origin = _origin(view, rows.ids, alloc, (*whole, *keys))
        whole.update(origin)
        index = alloc((d,), np.int64)
        index[:] = rows.ids
        position = alloc((r,), np.int64)
        position[:] = rows.positions.view(np.int64)
        whole["index"], whole["position"] = index, position
        per_doc = ["lengths", "index", *origin]
        per_row = [k for k in whole if k not in per_doc and k != "cu_seqlens"]
        for (da, de), st in zip(doc_cuts, per_step, strict=True):
            st.update(dict.fromkeys(per_doc, slice(da, de)))
        return Task(
            whole,
            per_step,
            _real_tokens(rows.lengths, doc_cuts),
            rows=row_cuts,
            row_keys=per_row,
            by_component=_by_component(view, origin, rows.lengths, doc_cuts),
        )


def read_step(reader: TaskReader, span: tuple[int, int]) -> dict[str, Any]:
    """One step's batch of NumPy arrays through a policy's reader (the loader's
    ``raw_batch``); its failure is raised."""
    task = reader.read([span], None)
    if task.failure is not None:
        raise task.failure[0]
    if task.whole is None:
        return task.steps[0]
    first: dict[str, Any] = cut(task, task.whole)[0]
    return first
