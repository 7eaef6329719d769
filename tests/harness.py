"""One save/resume harness, reused for every view (and every future component).

``run_segments`` plays a training job that is stopped and resumed several
times, each segment with its own number of ranks and batch size, all ranks
simulated in this process (the loader needs no communication). It returns
everything every rank received, so tests can check the invariants:
exactly-once per epoch, global batches independent of the rank count, and
resumed batches equal to an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokload import DataLoader


@dataclass
class Segment:
    """Run ``steps`` steps (None: to the end) with this many ranks and batch size."""

    world_size: int
    batch_size: int
    steps: int | None
    num_threads: int = 0


@dataclass
class Received:
    """What the ranks received: per step and rank, the batch."""

    # (segment, step, rank) -> batch
    batches: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    cursors: list[int] = field(default_factory=list)

    def positions(self) -> np.ndarray:
        return np.sort(
            np.concatenate(
                [b["position"].numpy() for b in self.batches.values()] or [np.zeros(0, np.int64)]
            )
        )

    def pairs(self) -> list[tuple[int, int]]:
        """(position, index) of every sample received, sorted by position."""
        out: list[tuple[int, int]] = []
        for b in self.batches.values():
            out += zip(b["position"].tolist(), b["index"].tolist(), strict=True)
        return sorted(out)


MakeLoader = Callable[..., DataLoader]


def run_segments(make: MakeLoader, segments: Sequence[Segment]) -> Received:
    """Play the segments; each resumes from the previous one's state_dict.

    ``make(rank=, world_size=, batch_size=, num_threads=)`` builds a loader.
    """
    got = Received()
    state: dict[str, Any] | None = None
    for s_idx, seg in enumerate(segments):
        loaders = [
            make(
                rank=r,
                world_size=seg.world_size,
                batch_size=seg.batch_size,
                num_threads=seg.num_threads,
            )
            for r in range(seg.world_size)
        ]
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
        iters = [iter(ld) for ld in loaders]
        step = 0
        while seg.steps is None or step < seg.steps:
            batches = []
            for it in iters:
                try:
                    batches.append(next(it))
                except StopIteration:
                    batches.append(None)
            if all(b is None for b in batches):
                break
            assert all(b is not None for b in batches), "ranks disagree on when the data ends"
            for r, b in enumerate(batches):
                got.batches[(s_idx, step, r)] = b
            step += 1
        states = [ld.state_dict() for ld in loaders]
        assert all(st == states[0] for st in states), "ranks disagree on the cursor"
        state = states[0]
        got.cursors.append(state["cursor"])
        for ld in loaders:
            ld.close()
    return got


def assert_exactly_once(got: Received, n: int, total: int) -> None:
    """Positions [0, total) each once; each epoch's indices a permutation of [0, n)."""
    pairs = got.pairs()
    positions = np.array([p for p, _ in pairs], dtype=np.int64)
    np.testing.assert_array_equal(positions, np.arange(total))
    indices = np.array([i for _, i in pairs], dtype=np.int64)
    for e in range(-(-total // n)):
        chunk = indices[e * n : (e + 1) * n]
        assert len(np.unique(chunk)) == len(chunk), f"a sample repeats in epoch {e}"
        assert chunk.min() >= 0 and chunk.max() < n
