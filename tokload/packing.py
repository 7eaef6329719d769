"""Best-fit packing: the order of a run whose samples are rows of whole documents.

The one job of this module is the schedule of a run that packs documents into
rows of ``window`` tokens (``DataLoader(..., batching=Fill(window))``), as pure
arithmetic over the documents' lengths; the policy reads the rows it gives.

The shuffle is the documents' one (``tokload.schedule``): position ``q`` is
document ``perm_e(q % n)`` of epoch ``e = q // n`` (by blocks of documents with
``shuffle_block``). Each epoch's positions are
cut into groups of ``lookahead`` (the last one shorter), and each group is
packed best-fit decreasing into rows (``tokload._pack.best_fit``: a row holds
whole documents, in permutation order; only a document longer than ``window``
is cut, to its first ``window`` tokens, alone in its row). A group of ``m``
documents fills at most ``m`` rows, so row ``b`` of the group at position
``p`` can be numbered ``p + b``: a **row's position** is an integer, rows are in
increasing order, and a cursor is still one integer, the first position not
yet delivered (a position inside a group past its last row means the next
group). The step at cursor ``c`` is the next ``G = batch_size * world_size``
rows, whatever groups and epochs they come from, and rank ``r`` takes rows
``r, r + world_size, ...`` of them: the rows do not depend on the number of
ranks or the batch size, so a resume with others delivers every document of
every epoch exactly once. Every rank packs every group it reaches (the lengths
of ``lookahead`` documents and one sort per group; about 100 nanoseconds a
document here), with no communication.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokload._pack import MAX_WINDOW, best_fit, gather_rows, greedy_rows
from tokload.arguments import is_integer
from tokload.schedule import Schedule

Extents = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
"""``extents(indices) -> (first_rows, lengths)`` (uint64) of a view's documents."""

DEFAULT_LOOKAHEAD = 1024
"""Documents packed together by default: on log-normal lengths (median 600 tokens)
and rows of 4096, 0.3% of the rows' tokens are padding, against 19% for greedy
packing (``bench/bench_packing.py``)."""

MAX_LOOKAHEAD = 1 << 20


@dataclass(frozen=True)
class Packing:
    """How a view's documents are packed: rows of ``window`` tokens, best-fit over
    groups of ``lookahead`` consecutive positions of the shuffle."""

    window: int
    lookahead: int = DEFAULT_LOOKAHEAD

    def __post_init__(self) -> None:
        for name, value, top in (
            ("window", self.window, MAX_WINDOW),
            ("lookahead", self.lookahead, MAX_LOOKAHEAD),
        ):
            if not is_integer(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if not 1 <= value <= top:
                raise ValueError(f"{name} must be in [1, {top}], got {value}")


@dataclass(frozen=True)
class PackedRows:
    """This rank's rows of one step: row ``k`` holds ``counts[k]`` documents.

    ``positions`` (uint64, ``[B]``): the rows' positions; ``ids`` (int64,
    ``[D]``): the documents (view indices), row by row, each row's in the
    order of the shuffle; ``starts`` (uint64, ``[D]``): their first rows in the
    source, as ``extents`` gave them; ``lengths`` (uint64, ``[D]``): the tokens
    each puts in its row (its length, or ``window`` for a longer one);
    ``counts`` (int64, ``[B]``).
    """

    positions: np.ndarray
    ids: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray
    located: tuple[np.ndarray, ...] = ()
    """For a view that locates its documents (a ``Blend``): what ``locate`` gave
    for ``ids`` (each document's component and index there), found when its
    group was packed; empty otherwise."""

    @staticmethod
    def one_per_row(
        ids: np.ndarray, extents: tuple[np.ndarray, np.ndarray], window: int
    ) -> PackedRows:
        """Each document alone in its row (``positions`` are the ids)."""
        starts, lengths = extents
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return PackedRows(
            ids.view(np.uint64),
            ids,
            starts,
            np.minimum(lengths, np.uint64(window)),
            np.ones(len(ids), dtype=np.int64),
        )


@dataclass(frozen=True)
class _Group:
    """A group packed: ``ids``, ``starts``, ``lengths`` row by row; row ``b`` is
    entries ``[rows[b], rows[b + 1])`` and has position ``base + b``."""

    base: int
    ids: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    rows: np.ndarray
    located: tuple[np.ndarray, ...] = ()

    @property
    def nrows(self) -> int:
        return len(self.rows) - 1


GROUPS_CACHED = 256
"""Packed groups kept per schedule (each about 32 bytes per document)."""

STEPS_KEPT = 4096
"""Steps whose rows ``span`` found and ``rows`` has not asked for yet, kept (with the
groups they need) so that ``rows`` does not pack them again, however many groups a
step spans."""


class PackedSchedule(Schedule):
    """The order of a run of rows of documents packed best-fit (module docstring).

    Args:
        n: documents in the view.
        batch_size: rows per rank per step.
        extents: the view's ``extents``: first rows and lengths of documents.
        packing: the window and the look-ahead.
        locate: the view's ``locate`` (a ``Blend``'s), or None: called with the
            documents whose ``extents`` were just asked for (so a view that keeps
            its last answer gives it again), its arrays kept with the packed group
            and gathered with its rows (``PackedRows.located``), so that reading
            them does not locate them again.
        **kwargs: as for ``Schedule`` (rank, world_size, seed, rounds, shuffle,
            epochs, drop_last: a step never takes rows of two epochs, and an
            epoch's last rows, fewer than a step, are skipped).

    ``span``, ``spans``, ``positions`` and ``samples`` answer as ``Schedule``'s
    do, for rows; ``rows`` gives the documents of this rank's rows. A run's
    number of steps is not known before its documents are packed:
    ``steps_left`` raises TypeError.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        extents: Extents,
        packing: Packing,
        locate: Callable[[np.ndarray], tuple[np.ndarray, ...]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(n, batch_size, **kwargs)
        self.extents = extents
        self.locate = locate
        self.window, self.lookahead = int(packing.window), int(packing.lookahead)
        self._per_epoch = -(-self.n // self.lookahead)  # groups
        self._groups: OrderedDict[tuple[int, int], _Group] = OrderedDict()
        self._glock = threading.Lock()
        self._steps: OrderedDict[tuple[int, int], list[tuple[_Group, int, int]]] = OrderedDict()

    # ---- groups --------------------------------------------------------------------------

    def group(self, epoch: int, g: int) -> _Group:
        """Group ``g`` of an epoch, packed (the latest ``GROUPS_CACHED`` are kept)."""
        key = (epoch, g)
        with self._glock:
            got = self._groups.get(key)
            if got is not None:
                self._groups.move_to_end(key)
                return got
        base = epoch * self.n + g * self.lookahead
        pos = np.arange(base, min(base + self.lookahead, (epoch + 1) * self.n), dtype=np.uint64)
        ids = Schedule.indices(self, pos)
        starts, lengths = self.extents(ids)
        located = () if self.locate is None else _located(self.locate, ids)
        order, rows = best_fit(lengths, self.window)
        capped = np.minimum(lengths[order], np.uint64(self.window))
        got = _Group(
            base, ids[order], starts[order], capped, rows, tuple(a[order] for a in located)
        )
        with self._glock:
            self._groups[key] = got
            while len(self._groups) > GROUPS_CACHED:
                self._groups.popitem(last=False)
        return got

    def _locate(self, c: int) -> tuple[int, int, int] | None:
        """The first row at or after position ``c``: (epoch, group, row); None at the end."""
        if c >= self.end:
            return None
        e, j = divmod(c, self.n)
        g, b = divmod(j, self.lookahead)
        if b < self.group(e, g).nrows:
            return e, g, b
        if g + 1 < self._per_epoch:
            return e, g + 1, 0
        return (e + 1, 0, 0) if (e + 1) * self.n < self.end else None

    def _walk(
        self, at: tuple[int, int, int], count: int, one_epoch: bool
    ) -> tuple[list[tuple[_Group, int, int]], int, int, tuple[int, int, int] | None]:
        """Up to ``count`` rows from ``at``, within its epoch if ``one_epoch``:
        ([(group, first row, end row)], rows, the position after them, the first
        row there as ``_locate`` gives it: None at the end of the run, or at the
        end of the epoch if ``one_epoch``)."""
        e, g, b = at
        parts: list[tuple[_Group, int, int]] = []
        got = 0
        while got < count:
            grp = self.group(e, g)
            take = min(grp.nrows - b, count - got)
            parts.append((grp, b, b + take))
            got, b = got + take, b + take
            if b < grp.nrows:
                break
            g, b = g + 1, 0  # every group has a row: its first is the next
            if g == self._per_epoch:
                e, g = e + 1, 0
                if one_epoch or e * self.n >= self.end:
                    return parts, got, min(e * self.n, self.end), None
        # runs end at epoch ends (Schedule.end): a row within an epoch is before it
        return parts, got, e * self.n + g * self.lookahead + b, (e, g, b)

    def _step(self, c: int) -> tuple[list[tuple[_Group, int, int]], int, int] | None:
        """The step at cursor ``c``: (its rows as ``_walk`` gives them, its start, its end)."""
        at = self._locate(c)
        if at is None:
            return None
        g = self.global_batch
        parts, got, after, _ = self._walk(at, g, self.drop_last)
        if got == g or not self.drop_last:
            return parts, parts[0][0].base + parts[0][1], after
        # drop_last: the epoch's last rows are fewer than a step
        e = at[0]
        if at[1:] == (0, 0):
            raise ValueError(
                f"drop_last: epoch {e} packs into {got} rows, fewer than the global batch "
                f"of {g} rows"
            )
        return self._step((e + 1) * self.n)

    # ---- steps ---------------------------------------------------------------------------

    def check_span(self, start: int, end: int) -> None:
        """ValueError unless ``[start, end)`` is a step of this run (a ``span``)."""
        step = self._step(start) if 0 <= start < self.end else None
        if step is None or step[1:] != (start, end):
            raise ValueError(
                f"[{start}, {end}) is not a step of this run (its steps: "
                "loader.schedule.spans(cursor, count))"
            )

    def span(self, c: int) -> tuple[int, int] | None:
        """The step at cursor ``c``: ``(its first row's position, the position after
        its last row)``; None past the end."""
        step = self._step(c)
        if step is None:
            return None
        parts, start, end = step
        self._keep({(start, end): parts})
        return start, end

    def spans(self, c: int, count: int) -> list[tuple[int, int]]:
        """Up to ``count`` consecutive steps from cursor ``c`` (fewer at the end),
        in one walk over the packed groups: each step starts where the last
        ended (``span`` one by one would find each start again). Each step's rows
        are kept for ``rows``, as ``span`` keeps them."""
        if self.drop_last:  # a step may skip an epoch's tail: one by one
            return self._spans_one_by_one(c, count)
        kept: dict[tuple[int, int], list[tuple[_Group, int, int]]] = {}
        at = self._locate(c)
        while at is not None and len(kept) < count:
            parts, _, after, at = self._walk(at, self.global_batch, False)
            kept[(parts[0][0].base + parts[0][1], after)] = parts
        self._keep(kept)
        return list(kept)

    def _keep(self, steps: dict[tuple[int, int], list[tuple[_Group, int, int]]]) -> None:
        """Keep the rows of ``steps`` (span: parts) for ``rows`` (``STEPS_KEPT`` at most)."""
        with self._glock:
            self._steps.update(steps)
            while len(self._steps) > STEPS_KEPT:
                self._steps.popitem(last=False)

    def steps_left(self, c: int) -> int:
        """Not known without packing the rest of the run: TypeError."""
        raise TypeError(
            "a run of packed rows has no length: how many rows the documents fill is "
            "known only once they are packed (iterate until the loader stops)"
        )

    def rows(self, start: int, end: int) -> PackedRows:
        """This rank's rows of the step ``[start, end)`` (a ``span``), with their documents."""
        return self._rows_of(self._parts(start, end))

    def task_rows(self, spans: list[tuple[int, int]]) -> tuple[PackedRows, list[int]]:
        """This rank's rows of consecutive steps ``spans``, back to back, and how
        many each step has: ``rows`` of each, computed once for the task (a
        group's rows that several steps share are cut once)."""
        parts: list[tuple[_Group, int, int]] = []
        for a, e in spans:
            parts += self._parts(a, e)
        got = self._rows_of(parts)
        # every step but the last holds G rows: this rank has B of them
        b = self.batch_size
        last = len(got.counts) - b * (len(spans) - 1)
        return got, [b] * (len(spans) - 1) + [last]

    def _parts(self, start: int, end: int, keep: bool = False) -> list[tuple[_Group, int, int]]:
        """The step ``[start, end)``'s rows, as ``_walk`` gives them: taken from those
        kept, or kept (``keep``: a look ahead, whose read takes them later)."""
        with self._glock:
            parts = self._steps.get((start, end)) if keep else self._steps.pop((start, end), None)
        if parts is None:
            step = self._step(start)
            if step is None or step[1:] != (start, end):
                raise ValueError(f"[{start}, {end}) is not a step of this run")
            parts = step[0]
            if keep:
                self._keep({(start, end): parts})
        return parts

    def _rows_of(self, parts: list[tuple[_Group, int, int]]) -> PackedRows:
        """This rank's rows of ``parts`` (the rows of consecutive steps, each but
        the last ``G`` rows: rank ``r`` takes rows ``r, r + world_size, ...``
        counted from the first)."""
        if len(parts) > 1:  # parts of one group that follow one another: one part
            merged = [parts[0]]
            for grp, b0, b1 in parts[1:]:
                g0, a0, e0 = merged[-1]
                if grp is g0 and b0 == e0:
                    merged[-1] = (g0, a0, b1)
                else:
                    merged.append((grp, b0, b1))
            parts = merged
        positions, ids, starts, lengths, counts, located = gather_rows(
            [
                (g.base, g.ids, g.starts, g.lengths, g.rows, b0, b1, g.located)
                for g, b0, b1 in parts
            ],
            self.rank,
            self.world_size,
        )
        return PackedRows(positions, ids, starts, lengths, counts, located)

    def positions(self, start: int, end: int) -> np.ndarray:
        """This rank's rows' positions (uint64) in the step ``[start, end)``."""
        return self.rows(start, end).positions

    def samples(self, start: int, end: int) -> int:
        """How many of the step ``[start, end)``'s rows are this rank's."""
        if end < self.end or self.drop_last:  # a whole step
            return self.batch_size
        return len(self.rows(start, end).counts)

    def task_positions(self, spans: list[tuple[int, int]]) -> tuple[np.ndarray, list[int]]:
        parts = [self.positions(a, e) for a, e in spans]
        return np.concatenate(parts), np.cumsum([len(p) for p in parts]).tolist()

    def task_indices(self, spans: list[tuple[int, int]]) -> np.ndarray:
        """The documents (view indices, int64) of this rank's rows of consecutive
        steps, as read-ahead hints them; the steps' rows are kept for their read."""
        parts = [p for a, e in spans for p in self._parts(a, e, keep=True)]
        ids: np.ndarray = self._rows_of(parts).ids
        return ids

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """Not a packed run's question (a row holds several documents): TypeError."""
        raise TypeError("the positions of a packed run are rows of documents: see rows()")


def padding_report(
    lengths: np.ndarray, window: int, lookahead: int = DEFAULT_LOOKAHEAD
) -> dict[str, Any]:
    """The padding of rows of ``window`` tokens filled with documents of ``lengths``
    (in the order given: a shuffle's), three ways.

    Returns ``{"best_fit", "greedy", "pad"}``: the fraction of the rows' tokens
    that is padding when groups of ``lookahead`` documents are packed best-fit
    (``Fill(window, lookahead)``), when documents fill rows in order and a new
    row starts whenever the next one does not fit (greedy), and with one
    document per row (``Pad(to=window)``); plus
    ``"rows"`` for each. Longer documents count ``window`` tokens each way.
    """
    Packing(window, lookahead)
    lens = np.minimum(np.asarray(lengths, dtype=np.uint64), np.uint64(window))
    real = int(lens.sum())
    rows = {
        "best_fit": sum(
            len(best_fit(lens[g : g + lookahead], window)[1]) - 1
            for g in range(0, len(lens), lookahead)
        ),
        "greedy": greedy_rows(lens, window),
        "pad": len(lens),
    }
    out: dict[str, Any] = {k: (1 - real / (r * window) if r else 0.0) for k, r in rows.items()}
    out["rows"] = rows
    return out


def _located(locate: Any, ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """``locate(ids)``, held to the view contract: 1-D integer arrays of one entry
    per document whose values fit an int64 (they travel with the packed group as
    int64)."""
    out = []
    name = type(getattr(locate, "__self__", locate)).__name__  # (the view's, for its method)
    for a in locate(ids):
        arr = np.asarray(a)
        if arr.ndim != 1 or len(arr) != len(ids) or (arr.dtype.kind not in "iu" and len(arr)):
            raise TypeError(
                f"{name}.locate gave an array of {arr.dtype} and shape {arr.shape} for "
                f"{len(ids)} documents: it gives 1-D integer arrays, one entry per document"
            )
        if arr.dtype.kind == "u" and len(arr) and int(arr.max()) >= 1 << 63:
            raise ValueError(f"{name}.locate gave {int(arr.max())}, past an int64")
        out.append(arr)
    return tuple(out)
