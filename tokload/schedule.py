"""The loader's schedule: cursor -> steps -> this rank's positions -> sample indices.

The one job of this module is the order of a training run (ARCHITECTURE.md,
invariants 2-4), as pure arithmetic: it reads no data and holds no buffers.
With ``n`` observations, position ``q >= 0`` is sample ``perm_e(q % n)`` of
epoch ``e = q // n``, where ``perm_e = Permutation.for_epoch(n, seed, e,
rounds)`` (the identity when ``shuffle=False``). With ``shuffle_block = K > 1``
the shuffle moves blocks of ``K`` consecutive samples instead (``block_sample``):
the ``n // K`` whole blocks and the ``n % K`` samples left (a short block) are
permuted by ``Permutation.for_epoch(blocks, seed, e, rounds)``, and each block's
samples come in order, so that a rank's samples of one step lie close together
in the data (one request serves several on object storage). The step at cursor ``c``
covers the global batch ``[c, c + G)``, ``G = batch_size * world_size``
(shortened at the end of the run, or moved to the next epoch's start with
``drop_last`` when the epoch has fewer than ``G`` positions left), and rank
``r`` takes positions ``c + r + k * world_size``, ``k < batch_size``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from tokload._permute import Permutation
from tokload.arguments import is_integer

POSITION_LIMIT = 1 << 64
"""Positions are unsigned 64-bit integers: a cursor is in ``[0, 2**64)``."""


class Schedule:
    """The order of a run: which positions and samples each step gives this rank.

    Args:
        n: observations in the view (``len(view)``, >= 1).
        batch_size: samples per rank per step.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: the number of ranks.
        seed: the run seed (the permutation of each epoch).
        rounds: Feistel rounds of the permutation.
        shuffle: False reads in order.
        epochs: the run ends after ``epochs * n`` positions (None: endless,
            up to ``2**64`` positions).
        drop_last: global batches never straddle an epoch's end (its last
            ``n % G`` positions are skipped), and a final partial batch is dropped.
        shuffle_block: samples per block of the shuffle (module docstring); 1
            (default): every sample on its own.

    Every method is a pure function of the arguments and safe to call from
    several threads (the per-epoch permutations are cached under a lock).
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        rounds: int = 6,
        shuffle: bool = True,
        epochs: int | None = None,
        drop_last: bool = False,
        shuffle_block: int = 1,
    ) -> None:
        if n < 1:
            raise ValueError(f"a schedule needs at least one observation, got n={n}")
        self.block = int(shuffle_block)
        # whole blocks, and the samples left over (the short block, numbered last)
        self._whole, self._rest = divmod(int(n), self.block)
        self.n, self.batch_size = int(n), int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.global_batch = self.batch_size * self.world_size
        self.seed, self.rounds, self.shuffle = int(seed), int(rounds), bool(shuffle)
        self.epochs, self.drop_last = epochs, bool(drop_last)
        self.end = POSITION_LIMIT if epochs is None else min(epochs * self.n, POSITION_LIMIT)
        self._perms: OrderedDict[int, Permutation] = OrderedDict()
        self._lock = threading.Lock()
        # The rank's offsets within a global batch: position c + offsets[k].
        self._offsets = np.uint64(self.rank) + np.uint64(self.world_size) * np.arange(
            self.batch_size, dtype=np.uint64
        )

    # ---- steps --------------------------------------------------------------------------

    def check_cursor(self, value: object) -> int:
        """``value`` as a cursor, or ValueError naming what is wrong with it."""
        if not is_integer(value):
            raise ValueError(f"cursor must be a non-negative integer, got {value!r}")
        c = int(value)
        if not 0 <= c < POSITION_LIMIT:
            raise ValueError(f"cursor must be a non-negative integer below 2**64, got {c}")
        if self.epochs is not None and c > self.end:
            raise ValueError(
                f"cursor {c} is past the end of the {self.epochs} epochs ({self.end} positions)"
            )
        return c

    def check_span(self, start: int, end: int) -> None:
        """ValueError unless ``[start, end)`` is a global batch of this run: 1 to
        ``global_batch`` consecutive positions from a start >= 0, within the run."""
        if not 0 <= start < end <= min(start + self.global_batch, self.end):
            raise ValueError(
                f"[{start}, {end}) is not a global batch of this run: 1 to "
                f"{self.global_batch} consecutive positions from a start >= 0, within its "
                f"{self.end} positions"
            )

    def span(self, c: int) -> tuple[int, int] | None:
        """The global batch ``[start, end)`` of the step at cursor ``c``; None past the end."""
        n, g = self.n, self.global_batch
        if self.drop_last and n - c % n < g:
            c = (c // n + 1) * n
        if c >= self.end:
            return None
        stop = c + g
        if stop > self.end:
            if self.drop_last:
                return None
            stop = self.end
        return c, stop

    def spans(self, c: int, count: int) -> list[tuple[int, int]]:
        """Up to ``count`` consecutive steps from cursor ``c`` (fewer at the end)."""
        g = self.global_batch
        last = c + count * g
        if last <= self.end and (not self.drop_last or c % self.n + count * g <= self.n):
            # No end and no epoch tail to skip: the steps are plain multiples of G.
            return [(a, a + g) for a in range(c, last, g)]
        return self._spans_one_by_one(c, count)

    def _spans_one_by_one(self, c: int, count: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while len(out) < count:
            sp = self.span(c)
            if sp is None:
                break
            out.append(sp)
            c = sp[1]
        return out

    def steps_left(self, c: int) -> int:
        """Steps from cursor ``c`` to the end of a finite run, in O(1)."""
        if self.epochs is None:
            raise TypeError("an endless schedule (epochs=None) has no length")
        if c >= self.end:
            return 0
        g = self.global_batch
        if not self.drop_last:
            return -(-(self.end - c) // g)
        # Within an epoch, steps start at c, c + G, ... while G positions remain;
        # every later epoch has n // G steps from its start.
        e, o = divmod(c, self.n)
        return (self.n - o) // g + (self.epochs - e - 1) * (self.n // g)

    # ---- positions and samples -------------------------------------------------------------

    def positions(self, start: int, end: int) -> np.ndarray:
        """This rank's positions (uint64) in the global batch ``[start, end)``."""
        if end - start == self.global_batch:
            out: np.ndarray = self._offsets + np.uint64(start)
            return out
        return self._offsets[: self.samples(start, end)] + np.uint64(start)

    def samples(self, start: int, end: int) -> int:
        """How many of the global batch ``[start, end)`` are this rank's (O(1))."""
        if end - start == self.global_batch:
            return self.batch_size
        first = start + self.rank
        return max(0, min(self.batch_size, -(-(end - first) // self.world_size)))

    def task_positions(self, spans: list[tuple[int, int]]) -> tuple[np.ndarray, list[int]]:
        """This rank's positions of consecutive steps, back to back, and where each ends."""
        b, g = self.batch_size, self.global_batch
        if spans[-1][1] - spans[0][0] == len(spans) * g:  # all full: one broadcast
            starts = np.arange(spans[0][0], spans[-1][1], g, dtype=np.uint64)
            pos = (starts[:, None] + self._offsets).reshape(-1)
            return pos, list(range(b, b * len(spans) + 1, b))
        parts = [self.positions(a, e) for a, e in spans]
        return np.concatenate(parts), np.cumsum([len(p) for p in parts]).tolist()

    def task_indices(self, spans: list[tuple[int, int]]) -> np.ndarray:
        """The samples (view indices, int64) this rank reads for consecutive steps:
        what read-ahead hints (``tokload.tasks``)."""
        return self.indices(self.task_positions(spans)[0])

    def perm(self, epoch: int) -> Permutation:
        """The permutation of an epoch: of its samples, or of its blocks with
        ``shuffle_block`` (the last few are cached)."""
        with self._lock:
            p = self._perms.get(epoch)
            if p is None:
                m = self.n if self.block == 1 else self._whole + (self._rest > 0)
                p = Permutation.for_epoch(m, self.seed, epoch, self.rounds)
                self._perms[epoch] = p
                while len(self._perms) > 4:  # a batch spans at most a few epochs
                    self._perms.popitem(last=False)
            else:
                self._perms.move_to_end(epoch)
            return p

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices (int64) of global positions (uint64, ascending)."""
        if len(positions) == 0:  # a rank with nothing left in a final partial batch
            return np.zeros(0, dtype=np.int64)
        n = np.uint64(self.n)
        j = positions % n
        if not self.shuffle:
            return j.view(np.int64)
        first, last = int(positions[0]) // self.n, int(positions[-1]) // self.n
        take = self._take if self.block == 1 else self.block_sample
        if first == last:
            return take(first, j).view(np.int64)
        epochs = positions // n
        out = np.empty(len(positions), dtype=np.uint64)
        for e in range(first, last + 1):
            mask = epochs == e
            out[mask] = take(e, j[mask])
        return out.view(np.int64)

    def _take(self, epoch: int, j: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.perm(epoch).take(j, out=j)
        return out

    def block_sample(self, epoch: int, j: np.ndarray) -> np.ndarray:
        """Samples (uint64) at offsets ``j`` (uint64, < n) of an epoch shuffled by
        blocks: offset ``j`` falls in slot ``j // K`` of the epoch's order of blocks
        (slots before the short block's, ``s``), in it, or after it (shifted by its
        ``r`` samples); the slot's block ``b = perm(slot)`` gives sample
        ``b * K + j % K``, and the short block (numbered ``whole``) its own samples
        from ``whole * K``. O(1) a position, with one ``inverse`` an epoch."""
        k, whole, rest = np.uint64(self.block), self._whole, self._rest
        p = self.perm(epoch)
        s = np.uint64(p.inverse(whole) if rest else whole)  # the short block's slot
        lo = s * k  # where it starts in the epoch's order
        after = j >= lo + np.uint64(rest)
        shifted = np.where(after, j - np.uint64(rest), j)
        slot = shifted // k + after.astype(np.uint64)  # (the short block's: set below)
        out: np.ndarray = p.take(slot) * k + shifted % k
        short = (j >= lo) & ~after
        if short.any():
            out[short] = np.uint64(whole) * k + (j[short] - lo)
        return out
