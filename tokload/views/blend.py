"""Deterministic blending of views by weight, random access, O(#stages + #components) memory.

Position ``q`` of a ``Blend`` is computed on demand, from ``q`` alone:

1. **Blocks.** Positions are cut into blocks of ``M`` (``block_size``). In a
   block, component ``c`` gets ``k_c`` slots: its share ``M * w_c / sum(w)``
   rounded by largest remainder (ties, as float64 computes the shares, to the
   lower component), so every block
   holds each component in exactly its proportion up to one sample. (Choose
   ``M`` so that the ``M * w_c / sum(w)`` are whole numbers when long-run
   ratios must be exact: otherwise the rounding repeats in every block.)
2. **Interleaving.** The slots of block ``b`` are dealt by a permutation keyed
   by ``(seed, b)`` that is also *low-discrepancy*: component ``c``'s ``k_c``
   slots get the ideal times ``(j + u_c) / k_c``, ``j < k_c``, with a phase
   ``u_c`` in ``[0, 1)`` keyed by ``(seed, b, c)``, and the slots go to those
   times in increasing order (ties to the lower component). Sources interleave
   evenly, and every prefix of a block holds each component within a few
   samples of its share: at most ``1 + s * (A - 2)`` for a share ``s`` of the
   block among ``A`` components with slots, since each component's count is
   off its time's share by less than one and their sum is the prefix (a
   uniformly random deal would stray by ~sqrt(M)).
3. **Per-component epochs.** The ``j``-th slot of ``c`` in block ``b`` is the
   component's own position ``p = (its samples before block b) + j``:
   component epoch ``p // n_c``, index ``perm_{c,e}(p % n_c)``, a permutation
   per component and epoch keyed by ``(seed, c, e)``. An upsampled component
   cycles through its epochs, each sample once per epoch.

**Schedules.** ``schedule=[(0, weights0), (P1, weights1), ...]`` changes the
weights at positions ``P_i`` (multiples of ``M``). Counts before a change
depend only on the stages before it, so adding a stage to a running job
changes nothing already consumed. A weight of 0 leaves a component out of a
stage, so a component can join from a stage onward.

**Caps.** ``max_epochs={c: k}`` stops component ``c`` after ``k`` epochs: in the
block where it runs out it gets only what is left, and from the next block on
its weight is 0 and the others' shares are recomputed from their weights (its
share is redistributed in proportion). When every component of a stage is
exhausted the blend ends there (without ``length``, a later stage that weights a
component with samples left is refused: it would never come).

Everything is compiled at construction into a short list of *segments*
(runs of blocks with the same counts), so a lookup is a binary search over
segments plus its slot in its block: the components' times merged up to that
slot (``O(slot * log C)``, compiled in ``tokload._slots``; the positions of one
block share one merge); nothing grows with the number of positions.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tokload._io import checked_io_settings
from tokload._permute import epoch_seed, epoch_seeds
from tokload._rows import read_ranges
from tokload._slots import block_slots
from tokload._slots import locate as locate_slots
from tokload._slots import positions as slot_positions
from tokload.arguments import is_integer, positive_integer, seed_and_rounds
from tokload.views.base import Fields, ReadPart, View, _check_rows_out
from tokload.views.blend_reads import DocumentMix, RecordMix, WindowMix
from tokload.views.contract import Alloc, check_view, is_documents
from tokload.views.metadata import MetadataBatch, StreamWithMetadata
from tokload.views.windows import TokenStream, WindowBoundaries

# Domain separation for the keys derived from the blend seed.
_SLOT_TAG = 0x736C6F74  # "slot"
_COMP_TAG = 0x636F6D70  # "comp"


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Integers summing to ``total`` in the proportions of ``weights`` (ties: lower index)."""
    w = np.asarray(weights, dtype=np.float64)
    s = w.sum()
    if s <= 0:
        raise ValueError("weights must have a positive sum")
    exact = w * total / s
    base = np.floor(exact).astype(np.int64)
    left = total - int(base.sum())
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return [int(x) for x in base]


@dataclass(frozen=True)
class _Segment:
    first_block: int  # blocks [first_block, first_block + blocks)
    blocks: int  # may be -1 for "to infinity"
    counts: tuple[int, ...]  # slots per component per block
    before: tuple[int, ...]  # samples of each component before first_block


def _slots_before(slot_seed: int, b: int, counts: np.ndarray, cr: int, jr: int) -> np.ndarray:
    """How many slots of each component come before component ``cr``'s slot
    ``jr`` in block ``b`` (``counts`` slots per component), in O(components)
    memory and time, whatever the block's size.

    The block's layout (the module docstring, ``csrc/tokload/slots.h``):
    component c's j-th slot at time ``t(c, j) = (j + u_c) / k_c``, the slots in
    increasing time, equal times by component. Component c has before slot
    ``(cr, jr)`` the ``j`` whose time is below ``t(cr, jr)`` (or equal, for
    ``c < cr``): a first guess from the real numbers, moved by the same double
    operations to where the comparison turns."""
    k = counts.astype(np.float64)
    u = epoch_seeds(epoch_seed(slot_seed, b), np.arange(len(counts))).astype(np.float64) / 2.0**64
    t = (float(jr) + u[cr]) / k[cr]
    lower = np.arange(len(counts)) < cr

    def before(j: np.ndarray) -> np.ndarray:
        tj = (j.astype(np.float64) + u) / np.maximum(k, 1.0)
        is_before: np.ndarray = (tj < t) | ((tj == t) & lower)
        return is_before

    top = counts.astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.ceil(t * k - u)
    n: np.ndarray = np.clip(np.nan_to_num(guess), 0, top).astype(np.int64)
    while True:  # up while slot n still comes before; down while slot n - 1 does not
        up = (n < top) & before(n)
        down = (n > 0) & ~before(n - 1)
        if not (up.any() or down.any()):
            break
        n += up.astype(np.int64) - down.astype(np.int64)
    n[top == 0] = 0
    n[cr] = jr
    return n


class Blend(WindowBoundaries, View):
    """A weighted, scheduled mixture of views; itself a view for the DataLoader.

    Args:
        components: ``[(view, weight), ...]`` (any iterable of pairs, read
            once: ``weights.items()`` too); the views are of one kind:
            TokenStreams (same window, dtype and ``boundaries``),
            StreamWithMetadatas (same window, fields and ``deserialize``), or views
            of documents
            (``Documents`` of tokload builds, Megatron prefixes, flat files,
            local or in an object store, or a user's view with the document
            contract of ``tokload.batching``; same fields and dtypes), or
            Blends of them. Weights are the first stage's.
        seed: the blend's key (slot interleaving and component shuffles), an
            integer in [0, 2**64 - 1].
        length: number of positions (``len(blend)``); default: where the blend
            ends because every component a stage weights is capped and has run
            out (refused when a later stage weights one with samples left),
            else required.
        block_size: ``M``; proportions are exact in every block of ``M``.
        schedule: ``[(position, weights), ...]`` stages after the first
            (positions multiples of ``M``, increasing).
        max_epochs: ``{component: epochs}`` caps.
        rounds: Feistel rounds of the permutations.

    ``blend.locate(positions)`` gives ``(component, index in component)``;
    ``blend.read(positions)`` reads the samples (a blend of windows), and
    ``blend.boundaries(positions)`` the attention keys of their documents (as
    ``TokenStream.boundaries``; the loader's batches carry those the components'
    ``boundaries=`` names);
    ``blend.proportions(a, b)`` counts the components over positions
    ``[a, b)``. A blend of documents is batched by any policy of documents
    (``Pad``, ``Pack``, ``Fill``: best-fit over the blend's documents), and
    every batch says where each sample came from: ``"component"`` and
    ``"component_index"`` (``origin``).
    """

    window: int
    batching: Any = None
    """The DataLoader's default policy: ``Pad()`` for a blend of documents."""

    def __init__(
        self,
        components: Sequence[tuple[Any, float]],
        *,
        seed: int = 0,
        length: int | None = None,
        block_size: int = 1024,
        schedule: Sequence[tuple[int, Sequence[float]]] = (),
        max_epochs: Mapping[int, int] | None = None,
        rounds: int = 6,
    ) -> None:
        if isinstance(components, Mapping | str | bytes) or not isinstance(components, Iterable):
            raise TypeError(
                "components must be a list of (view, weight) pairs, got "
                f"{type(components).__name__}"
            )
        components = list(components)  # (dict.items(), a generator, ...: read once)
        if not components:
            raise ValueError("a Blend needs at least one component")
        for c, pair in enumerate(components):
            if isinstance(pair, Mapping | str | bytes) or not _a_pair(pair):
                raise TypeError(
                    f"component {c} must be a (view, weight) pair, got {type(pair).__name__} "
                    f"{pair!r:.80}"
                )
        components = [(v, w) for v, w in components]
        # (what pickling records: these pairs, not an iterator they were read from)
        args, kwargs = self._made_with
        self._made_with = (
            ((components, *args[1:]), kwargs)
            if args
            else (args, {**kwargs, "components": components})
        )
        block_size = positive_integer("block_size", block_size)
        seed, rounds = seed_and_rounds(seed, rounds)
        self.views: list[Any] = []
        for c, (v, _w) in enumerate(components):
            try:
                check_view(v)
            except TypeError as err:
                raise TypeError(f"component {c} is not a view: {err}") from None
            if len(v) == 0:
                raise ValueError(f"component {c} is empty: {v!r}")
            self.views.append(v)
        self.sizes = [len(v) for v in self.views]
        self.kind = _kind(self.views[0], 0)
        for c, v in enumerate(self.views):
            if _kind(v, c) != self.kind:
                raise TypeError(
                    f"component {c} is a view of {_kind(v, c)}, component 0 of {self.kind}: "
                    "a Blend mixes views of one kind"
                )
        nested = [isinstance(v, Blend) for v in self.views]
        mix = _MIXES[self.kind](self.views, nested)  # checks that the components agree
        self._mix: WindowMix | RecordMix | DocumentMix = mix
        if isinstance(mix, WindowMix):
            self.window = mix.window
            self._set_boundary_keys(mix.keys)
        elif isinstance(mix, RecordMix):
            self.window = mix.window
            self.deserialize = mix.deserialize
        else:
            from tokload.batching import Pad  # the policies read views: imported when used

            self.batching = Pad()
        self.seed, self.block_size, self.rounds = int(seed), int(block_size), int(rounds)
        k = len(self.views)
        stages = [(0, list(map(float, (w for _, w in components))))]
        for i, (pos, weights) in enumerate(schedule, 1):
            if not is_integer(pos):  # (1024.7 was stage 1024, "1024" a string)
                raise TypeError(f"stage {i}: its position must be an integer, got {pos!r}")
            stages.append((int(pos), list(map(float, weights))))
        for i, (pos, weights) in enumerate(stages):
            if len(weights) != k:
                raise ValueError(f"stage {i} gives {len(weights)} weights for {k} components")
            if not all(0 <= w < math.inf for w in weights):  # NaN fails too
                raise ValueError(
                    f"stage {i}: weights must be finite and non-negative, got {weights}"
                )
            if sum(weights) <= 0:
                raise ValueError(f"stage {i}: all weights are zero")
            if not sum(weights) < math.inf:  # each finite, their sum not: shares of 0
                raise ValueError(
                    f"stage {i}: the weights' sum overflows a float64, got {weights}; they "
                    "are relative: scale them down"
                )
            if pos % self.block_size:
                raise ValueError(
                    f"stage {i} starts at position {pos}, not a multiple of the "
                    f"block size {self.block_size}"
                )
            if i and pos <= stages[i - 1][0]:
                raise ValueError(
                    f"the schedule is out of order: stage {i} starts at {pos}, "
                    f"after {stages[i - 1][0]}"
                )
        caps = dict(max_epochs or {})
        for c, e in caps.items():
            if not (is_integer(c) and is_integer(e)) or not 0 <= c < k or e < 1:
                raise ValueError(
                    f"max_epochs: need a component in [0, {k}) and epochs >= 1, "
                    f"integers both, got {c!r}: {e!r}"
                )
        self.stages = stages
        self.max_epochs = {int(c): int(e) for c, e in caps.items()}
        self._segments = self._compile()
        self._starts = [s.first_block for s in self._segments]
        # the segments as arrays, for component_positions' vectorized lookups
        self._seg_first = np.asarray(self._starts, dtype=np.int64)
        self._seg_counts = np.asarray([s.counts for s in self._segments], dtype=np.int64)
        self._seg_before = np.asarray([s.before for s in self._segments], dtype=np.int64)
        end = self._end_position()
        if length is None:
            if end is None:
                raise ValueError("length is required unless every component is capped")
            unreached = self._unreached_stage(end)
            if unreached is not None:  # the blend ran dry before it: silently cut short
                pos = stages[unreached][0]
                raise ValueError(
                    f"the blend ends at position {end}, where the components weighted before "
                    f"stage {unreached} (position {pos}) run out (max_epochs), so that stage "
                    f"is never reached: give length={end} to end the blend there, or weights "
                    "that last until the stage"
                )
            length = end
        elif not is_integer(length) or length < 0:
            raise ValueError(f"length must be an integer >= 0, got {length!r}")
        if end is not None and length > end:
            raise ValueError(
                f"length {length} is past the end of the blend ({end} positions: "
                "its capped components run out)"
            )
        self.source = getattr(self.views[0], "source", None)  # type: ignore[assignment]  # components keep theirs
        self._total = int(length)
        self._lo, self._hi = 0, self._total
        self._sizes = np.asarray(self.sizes, dtype=np.int64)
        self._comp_seeds = epoch_seeds(self.seed ^ _COMP_TAG, np.arange(len(self.views)))
        self._located = threading.local()  # each thread's last locate() answer
        # round tables of the (component, epoch) permutations, kept by take_many
        # (bounded; a plain dict, so no lock)
        self._tables: dict[tuple[int, int, int], np.ndarray] = {}

    # ---- compilation --------------------------------------------------------------

    def _compile(self) -> list[_Segment]:
        m, k = self.block_size, len(self.views)
        limit = {c: e * self.sizes[c] for c, e in self.max_epochs.items()}
        used = [0] * k
        segments: list[_Segment] = []
        stage_blocks = [pos // m for pos, _ in self.stages] + [-1]
        for si, (_, weights) in enumerate(self.stages):
            block, stop = stage_blocks[si], stage_blocks[si + 1]
            while stop == -1 or block < stop:
                live = [
                    w if (c not in limit or used[c] < limit[c]) else 0.0
                    for c, w in enumerate(weights)
                ]
                if sum(live) <= 0:
                    return segments  # everything capped: the blend ends here
                counts = largest_remainder(live, m)
                # blocks until a capped component runs out with these counts
                run = -1 if stop == -1 else stop - block
                for c, lim in limit.items():
                    if counts[c]:
                        full = (lim - used[c]) // counts[c]  # whole blocks it can fill
                        run = full if run == -1 else min(run, full)
                if run:
                    segments.append(_Segment(block, run, tuple(counts), tuple(used)))
                    if run == -1:
                        return segments
                    used = [u + run * n for u, n in zip(used, counts, strict=True)]
                    block += run
                    continue
                # One block where some capped component has fewer left than its count:
                # give it what is left and deal the freed slots to the others, until
                # no capped component is dealt more than it has left.
                counts, final = self._short_block(counts, live, used, limit)
                segments.append(_Segment(block, 1, tuple(counts), tuple(used)))
                if final:  # only exhausted components were left: a final partial block
                    return segments
                used = [u + n for u, n in zip(used, counts, strict=True)]
                block += 1
        return segments

    def _short_block(
        self, counts: list[int], live: list[float], used: list[int], limit: dict[int, int]
    ) -> tuple[list[int], bool]:
        """The counts of a block in which a capped component has fewer left than
        ``counts`` gives it, and whether it is the blend's last (partial) block.

        Each such component gets what it has left, and the slots it frees are
        dealt to the others by weight; a capped one dealt more than it has left
        is fixed in turn, until none is (the dealing never gives a component more
        than its cap: a sample past it would come twice)."""
        fixed: dict[int, int] = {}
        while True:
            short = {
                c: limit[c] - used[c]
                for c in limit
                if c not in fixed and counts[c] > limit[c] - used[c]
            }
            if not short:
                return counts, False
            fixed.update(short)
            others = [0.0 if c in fixed else w for c, w in enumerate(live)]
            if sum(others) <= 0:
                return [fixed.get(c, 0) for c in range(len(counts))], True
            extra = largest_remainder(others, self.block_size - sum(fixed.values()))
            counts = [fixed.get(c, e) for c, e in enumerate(extra)]

    def _end_position(self) -> int | None:
        """Where the blend ends (every component capped), or None when it never does.

        The compiled segments run to infinity unless it ends; then the last
        segment's last block holds ``sum(counts)`` slots (fewer than M when the
        final block is partial).
        """
        last = self._segments[-1]
        if last.blocks == -1:
            return None
        return (last.first_block + last.blocks - 1) * self.block_size + sum(last.counts)

    def _unreached_stage(self, end: int) -> int | None:
        """The first stage the blend, ending at ``end``, never reaches although it
        weights a component with samples left (uncapped, or capped and not run
        out), or None."""
        last = self._segments[-1]
        used = [b + last.blocks * n for b, n in zip(last.before, last.counts, strict=True)]
        left = [
            c
            for c in range(len(self.views))
            if c not in self.max_epochs or used[c] < self.max_epochs[c] * self.sizes[c]
        ]
        for i, (pos, weights) in enumerate(self.stages):
            if pos >= end and any(weights[c] > 0 for c in left):
                return i
        return None

    # ---- lookups --------------------------------------------------------------------

    def component_positions(self, positions: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``(component, its own position p)`` (int64) of blend positions.

        Component ``c`` sees its positions ``0, 1, 2, ...`` exactly once each, in
        order within every block; ``p // len(component)`` is its epoch. Each
        position's slot is found in compiled code (``tokload._slots``), without
        its block's whole layout: a shuffled read touches a block per position.
        """
        q = self._global(positions).astype(np.int64)
        return slot_positions(
            self.seed ^ _SLOT_TAG,
            q,
            self.block_size,
            self._seg_first,
            self._seg_counts,
            self._seg_before,
        )

    def locate(self, positions: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``(component, index in component)`` (int64 arrays) of blend positions.

        One compiled call (``tokload._slots.locate``): the positions' slots,
        then one permutation call for all of them, grouped by (component,
        epoch). The last answer is kept per thread: a
        policy asks for the same positions' components and documents more than
        once while it builds a task (their extents, reads and provenance), so
        the arrays are read-only."""
        key = (self._lo, self._hi, np.ascontiguousarray(positions, dtype=np.int64).tobytes())
        last = getattr(self._located, "last", None)
        if last is not None and last[0] == key:
            return last[1], last[2]
        comp, index = self._locate(positions)
        comp.flags.writeable = index.flags.writeable = False  # shared with the next caller
        self._located.last = (key, comp, index)
        return comp, index

    def _locate(self, positions: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``locate`` without its per-thread answer (read-ahead's, for later tasks)."""
        # perm_{c,e}(p % n_c), keyed by epoch_seed(epoch_seed(seed ^ "comp", c), e),
        # for every position in one compiled call (grouped by (component, epoch):
        # a large blend's shuffled positions fall in as many as there are positions)
        return locate_slots(
            self.seed ^ _SLOT_TAG,
            self._global(positions).astype(np.int64),
            self.block_size,
            self._seg_first,
            self._seg_counts,
            self._seg_before,
            self._sizes,
            self._comp_seeds,
            self.rounds,
            self._tables,
        )

    def storage_paths(self) -> list[str]:
        """The files of the components that read ahead (``hint``): the loader turns
        read-ahead on when one is on a network or FUSE filesystem."""
        paths: list[str] = []
        for v in self.views:
            if getattr(v, "hint", None) is not None and hasattr(v, "storage_paths"):
                paths.extend(v.storage_paths())
        return paths

    def hint(self, indices: npt.ArrayLike) -> None:
        """The view protocol's read-ahead: each component that reads ahead is given
        its own indices of positions ``indices`` (a blend in a blend passes them
        on); returns at once."""
        comp, index = self._locate(indices)
        for c in np.unique(comp).tolist():
            hint = getattr(self.views[c], "hint", None)
            if hint is not None:
                hint(index[comp == c])

    def remember_located(
        self, positions: npt.ArrayLike, comp: np.ndarray, index: np.ndarray
    ) -> None:
        """Keep ``(comp, index)`` as this thread's answer of ``locate(positions)``.

        A packed schedule located these positions when it packed their group
        (``PackedSchedule``'s ``locate``) and gathered the answers with its rows;
        the reads and provenance of those rows then ask ``locate`` for them in
        this order, and get these instead of locating them again."""
        key = (self._lo, self._hi, np.ascontiguousarray(positions, dtype=np.int64).tobytes())
        comp = np.array(comp, dtype=np.int64)  # copies: read-only, as locate's are
        index = np.array(index, dtype=np.int64)
        if comp.shape != index.shape or len(comp) != len(key[2]) // 8:
            raise ValueError(
                f"{len(key[2]) // 8} positions, {len(comp)} components, {len(index)} indices"
            )
        comp.flags.writeable = index.flags.writeable = False
        self._located.last = (key, comp, index)

    def proportions(self, start: int, stop: int) -> np.ndarray:
        """How many of positions ``[start, stop)`` each component gets (int64 counts)."""
        if not (is_integer(start) and is_integer(stop)):  # (0.5 blamed "epoch", True was 1)
            raise TypeError(f"start and stop must be integers, got {start!r} and {stop!r}")
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"range [{start}, {stop}) is not within [0, {len(self)}]")
        counts: np.ndarray = self._count_before(stop) - self._count_before(start)
        return counts

    def _count_before(self, q: int) -> np.ndarray:
        """Samples of each component in blend positions [0, q) (of the whole blend)."""
        m = self.block_size
        q += self._lo
        b, r = divmod(q, m)
        g = bisect.bisect_right(self._starts, b) - 1
        seg = self._segments[g] if self._segments else None
        k = len(self.views)
        if seg is None:
            return np.zeros(k, dtype=np.int64)
        counts = np.asarray(seg.counts, dtype=np.int64)
        total = np.asarray(seg.before, dtype=np.int64) + (b - seg.first_block) * counts
        if r >= int(counts.sum()):  # a block of fewer slots (a capped blend's last)
            total += counts
        elif r:  # the slots of block b before slot r: found from slot r, in O(components)
            comp, lane = block_slots(
                self.seed ^ _SLOT_TAG, [b], [r], self._seg_counts, np.array([g], np.int64)
            )
            total += _slots_before(self.seed ^ _SLOT_TAG, b, counts, int(comp[0]), int(lane[0]))
        return total

    # ---- reading: what is read for located samples is the mix's (blend_reads) ----------

    def empty(self, batch: int, alloc: Alloc = np.empty) -> Fields:
        """Arrays ``read`` can fill for ``batch`` observations (as the components')."""
        made: Fields = self.views[0].empty(batch, alloc=alloc)
        return made

    @property
    def rowwise(self) -> bool:
        """A blend of windows: each sample is one row of every array (the loader
        reads many steps at once)."""
        return self.kind == "windows"

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, np.ndarray]:
        """The view protocol (``tokload.views.contract``), as the components'
        ``read_batch``: windows stacked (with the attention keys the components'
        ``boundaries=`` names), windows with their records (as
        ``StreamWithMetadata.read_batch``: one batch's records, in order of first
        appearance), or documents padded to the batch's longest (``"lengths"``
        too), as ``Pad()`` gives them."""
        mix = self._mix
        if isinstance(mix, DocumentMix):
            return mix.read_padded(*self.locate(np.asarray(indices).reshape(-1)), alloc)
        if isinstance(mix, RecordMix):
            return self._records([indices], alloc)[0].raw()
        return super().read_batch(indices, alloc)

    def read_batches(self, batches: list[np.ndarray], alloc: Alloc) -> list[dict[str, Any]]:
        """``read_batch`` of each index array of ``batches`` (the view protocol's
        several-batches call, which the loader makes for a task's steps): a blend
        of streams with metadata asks each component for its samples of all the
        batches in one ``read_batches`` of its own (one round of reads per
        component for the task, where the stream has metadata blocks), then
        gathers each batch. Other blends read one batch after the other."""
        if not isinstance(self._mix, RecordMix):
            return [self.read_batch(ix, alloc) for ix in batches]
        return [b.raw() for b in self._records(batches, alloc)]

    def _records(self, batches: Sequence[npt.ArrayLike], alloc: Alloc) -> list[MetadataBatch]:
        """Windows with their records, batch by batch (``RecordMix.read_batches``)."""
        flat = [np.asarray(ix, dtype=np.int64).reshape(-1) for ix in batches]
        located = self.locate(np.concatenate(flat) if flat else np.empty(0, np.int64))
        assert isinstance(self._mix, RecordMix)
        return self._mix.read_batches(*located, [len(ix) for ix in flat], alloc)

    @property
    def num_components(self) -> int:
        """The components (the loader's ``stats()`` counts each one's samples and tokens)."""
        return len(self.views)

    def origin(self, indices: npt.ArrayLike) -> dict[str, np.ndarray]:
        """Where samples ``indices`` come from: ``"component"`` and
        ``"component_index"`` (int64; the sample's index in that component)."""
        comp, index = self.locate(indices)
        return {"component": comp, "component_index": index}

    def read(self, indices: npt.ArrayLike, out: Fields | None = None) -> Any:
        """The samples at blend positions ``indices`` (a blend of windows), each
        component's windows read straight into their rows of ``out`` (a plain
        dtype; a structured one is read per component, then placed); for a blend
        of streams with metadata, a ``MetadataBatch`` (``out`` not taken)."""
        mix = self._mix
        if isinstance(mix, RecordMix):
            if out is not None:
                raise TypeError("a blend of streams with metadata reads into arrays of its own")
            return self._records([indices], np.empty)[0]
        if not isinstance(mix, WindowMix):
            raise TypeError(
                "read() reads a blend of windows; a blend of documents is read with "
                "blend[i] or read_batch, or batched by the DataLoader (Pad, Pack or Fill)"
            )
        comp, index = self.locate(indices)
        b = len(comp)
        if out is None:
            out = self.empty(b)
        _check_rows_out(out, (b, self.window), mix.dtype)  # the components' rows
        parts: list[ReadPart] = []
        mix.read_rows(comp, index, np.arange(b, dtype=np.uint64), out, parts)
        read_ranges(parts)
        return out

    def _window_cuts(self, indices: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where documents start inside the windows at blend positions ``indices``
        (``WindowMix.window_cuts``): the batch's attention keys are then made in
        one call (``WindowBoundaries``)."""
        if not isinstance(self._mix, WindowMix):
            raise TypeError(
                "a blend of documents has no windows: batch it with Fill(window) for "
                "document masking"
            )
        return self._mix.window_cuts(*self.locate(indices))

    # ---- the document contract (tokload.batching) -------------------------------------

    @property
    def fields(self) -> dict[str, Any]:
        """The components' ``fields`` (a blend of documents)."""
        if not isinstance(self._mix, DocumentMix):
            raise AttributeError("fields: a blend of windows is not a view of documents")
        return dict(self._mix.fields)

    def _documents(self) -> DocumentMix:
        if not isinstance(self._mix, DocumentMix):
            raise TypeError("a blend of windows is not a view of documents")
        return self._mix

    def extents(self, indices: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's ``extents`` in its component (a blend of documents):
        one compiled call over every component's document index where all are
        plain ``Documents`` (``tokload._docindex.extents_many``), else a call
        per component."""
        mix = self._documents()
        return mix.extents(*self.locate(indices))

    def read_extents(
        self,
        indices: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        dst: np.ndarray,
        out: Mapping[str, np.ndarray],
    ) -> None:
        """The samples' documents into ``out``: every component's reads straight
        into the same arrays (no temporary per component), in one engine call
        (``tokload._rows.read_ranges``)."""
        mix = self._documents()
        parts: list[ReadPart] = []
        mix.extent_parts(*self.locate(indices), starts, lengths, dst, out, parts)
        read_ranges(parts)

    def __getitem__(self, i: int) -> Any:
        if isinstance(self._mix, DocumentMix):  # the document's rows, as Documents[i]
            got = self.read_batch(self._index(i), np.empty)
            n = int(got.pop("lengths")[0])
            rows = {k: v[0, :n] for k, v in got.items()}
            return rows["tokens"] if list(rows) == ["tokens"] else rows
        got = self.read(self._index(i))
        if isinstance(got, MetadataBatch):
            return MetadataBatch(
                {k: v[0] for k, v in got.fields.items()}, got.positions[0], got.metadata
            )
        if isinstance(got, dict):
            return {k: v[0] for k, v in got.items()}
        return np.asarray(got[0])

    @property
    def fingerprint(self) -> str:
        """The components, the seed (and the rounds, where not 6), the block size,
        every stage, the caps and the range."""
        return f"{self._fingerprint(self.stages)}:{self._hi}"

    def fingerprint_upto(self, stop: int) -> str:
        """What samples ``[0, stop)`` depend on: the stages that start before ``stop``.

        A stage added later in the schedule changes no earlier position, so the
        loader (which compares this on resume) accepts it before the new stage.
        """
        return self._fingerprint([st for st in self.stages if st[0] < self._lo + stop])

    def _fingerprint(self, stages: list[tuple[int, list[float]]]) -> str:
        parts = ",".join(v.fingerprint for v in self.views)
        # (the rounds shuffle each component: written where not the default, so the
        # states of blends with the default, saved before they were, still resume)
        rounds = "" if self.rounds == 6 else f"/{self.rounds}"
        return (
            f"Blend({parts}):{self.seed}{rounds}:{self.block_size}:{stages}:"
            f"{sorted(self.max_epochs.items())}:{self._lo}"
        )

    def close(self) -> None:
        for v in self.views:
            close = getattr(v, "close", None)
            if close is not None:
                close()

    def configure_io(self, io: str | None = None, queue_depth: int | None = None) -> None:
        """``View.configure_io`` for every component that has it (a refused setting
        changes none)."""
        checked_io_settings(io, queue_depth)
        for v in self.views:
            configure = getattr(v, "configure_io", None)
            if configure is not None:
                configure(io, queue_depth)

    def __repr__(self) -> str:
        if not hasattr(self, "_total"):  # (half made: a failed __init__'s error)
            return f"Blend({len(getattr(self, 'views', ()))} components, n=?)"
        return (
            f"Blend({len(self.views)} component{'s' if len(self.views) != 1 else ''}, "
            f"stages={len(self.stages)}, block_size={self.block_size},"
            f"{self._shown_boundaries()} n={len(self)}{self._shown_part()})"
        )


def _a_pair(x: Any) -> bool:
    """Whether ``x`` is two items, as ``(view, weight)`` (a tuple, a list, a NumPy
    array of objects), and not a view (a view of two samples has a length of 2)."""
    if hasattr(x, "fingerprint"):
        return False
    try:
        return len(x) == 2
    except TypeError:
        return False


def _kind(view: Any, c: int) -> str:
    """``"windows"`` (token streams, blends of them), ``"metadata"`` (streams with
    metadata, blends of them) or ``"documents"`` (the document contract of
    ``tokload.batching``); TypeError for any other view."""
    if isinstance(view, Blend):
        return view.kind
    if isinstance(view, TokenStream):
        return "windows"
    if isinstance(view, StreamWithMetadata):
        return "metadata"
    if is_documents(view):
        return "documents"
    raise TypeError(
        f"component {c} must be a TokenStream, a StreamWithMetadata, a view of documents "
        "(Documents, or a view with extents, fields and read_extents: see "
        f"tokload.batching) or a Blend of them, got {type(view).__name__}"
    )


_MIXES: dict[str, type[WindowMix | RecordMix | DocumentMix]] = {
    mix.kind: mix for mix in (WindowMix, RecordMix, DocumentMix)
}
