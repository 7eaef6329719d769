"""``tokload demo``: the built-in end-to-end example, with nothing to download.

It checks and times the global shuffle at the scale tokload is built for: a
1.1-trillion-token corpus read as 268,554,297 windows of 4096 tokens, each
epoch in its own order, split across ranks with no communication.
"""

from __future__ import annotations

import time

import numpy as np

from tokload import Permutation, epoch_seed

TOKENS = 1_100_000_000_000
WINDOW = 4096


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(seed: int = 7) -> int:
    """Run the demo; returns a process exit code (0 when every check passed)."""
    n = TOKENS // WINDOW
    _say(f"tokload demo: {TOKENS:,} tokens as {n:,} windows of {WINDOW}, seed {seed}")

    t0 = time.perf_counter()
    perms = [Permutation.for_epoch(n, seed, e) for e in range(3)]
    _say(
        f"  3 epoch permutations ready in {(time.perf_counter() - t0) * 1e3:.2f} ms "
        "(nothing precomputed, O(1) memory)"
    )
    for e, p in enumerate(perms):
        _say(f"  epoch {e}: key {epoch_seed(seed, e):#018x}, first samples {p[:4].tolist()}")

    # One global step of 1024 samples at cursor c, split over R ranks: rank r
    # takes positions c + r + k*R.  The global batch must not depend on R.
    cursor, global_batch = 5 * n // 2, 1024
    reference = None
    for ranks in (1, 2, 8):
        per_rank = global_batch // ranks
        got = []
        for r in range(ranks):
            pos = cursor + r + ranks * np.arange(per_rank, dtype=np.uint64)
            epoch, j = np.divmod(pos, np.uint64(n))
            assert (epoch == epoch[0]).all()
            got.append(perms[int(epoch[0])].take(j))
        batch = np.sort(np.concatenate(got))
        if reference is None:
            reference = batch
        elif not np.array_equal(batch, reference):
            _say(f"  FAIL: the global batch changed with {ranks} ranks")
            return 1
    _say(f"  global batch at cursor {cursor:,} is the same for 1, 2 and 8 ranks: ok")

    small = 10_000_019
    p = Permutation(small, seed=seed)
    values = p.range(0, small)
    if not (np.bincount(values.astype(np.int64), minlength=small) == 1).all():
        _say(f"  FAIL: not a bijection of [0, {small})")
        return 1
    if not np.array_equal(p.inverse_take(values), np.arange(small, dtype=np.uint64)):
        _say("  FAIL: the inverse does not undo the permutation")
        return 1
    _say(f"  exhaustive check: a bijection of [0, {small:,}) and its inverse: ok")

    idx = np.random.default_rng(seed).integers(0, n, size=1 << 22, dtype=np.uint64)
    out = np.empty_like(idx)
    perms[0].take(idx, out=out)
    t0 = time.perf_counter()
    perms[0].take(idx, out=out)
    rate = len(idx) / (time.perf_counter() - t0)
    _say(
        f"  shuffle throughput: {rate / 1e6:.0f} M indices/s on one core "
        f"({rate * WINDOW / 1e12:.1f} T tokens/s of windows)"
    )
    _say("demo passed")
    return 0
