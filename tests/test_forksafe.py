"""A forked child never finds a lock held that a parent's thread held at the fork:
``ForkSafeLock`` (a blend's caches, a view's read-ahead hint) and a permutation's
table lock are new in the child."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from test_seams import in_child

from tokload import Blend, Permutation, TokenStream, Writer
from tokload.forksafe import ForkSafeLock


def held_by_a_thread(lock: ForkSafeLock) -> tuple[threading.Event, threading.Thread]:
    """A thread that takes ``lock`` and keeps it until the returned event is set."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(30)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(5)
    return release, t


def test_a_lock_held_at_the_fork_is_free_in_the_child() -> None:
    lock = ForkSafeLock()
    release, t = held_by_a_thread(lock)
    try:

        def take() -> bool:
            with lock:
                return True

        assert in_child(take, seconds=5) == {"value": True}
        # and the parent's lock is the parent's still: held until the thread lets go
        assert not lock._current().acquire(blocking=False)
    finally:
        release.set()
        t.join(5)
    with lock:
        pass


@pytest.fixture
def blend(tmp_path: Path) -> Blend:
    views = []
    for k in range(2):
        with Writer(tmp_path / f"d{k}", "<u4") as w:
            w.write(np.arange(k * 10_000, k * 10_000 + 5_000, dtype=np.uint32))
        views.append(TokenStream(tmp_path / f"d{k}", 17))
    return Blend([(views[0], 1), (views[1], 2)], seed=3, length=600, block_size=64)


def test_a_blend_holds_no_lock_and_reads_in_a_forked_child(blend: Blend) -> None:
    """A blend computes each lookup in compiled code from its position alone
    (``tokload._slots``, ``tokload._permute.take_many``): it holds no lock that a
    parent thread could hold across a fork (it had one, for its caches of block
    layouts and permutations). The round tables ``take_many`` keeps for it are a
    plain dict, changed one operation at a time under the GIL."""
    locks = (type(threading.Lock()), type(threading.RLock()), ForkSafeLock)
    assert not [k for k, v in vars(blend).items() if isinstance(v, locks)]
    want = np.asarray(blend.read(np.arange(0, 600, 37))).tolist()
    stop = threading.Event()

    def reads() -> None:  # a parent thread reading the blend while the test forks
        while not stop.is_set():
            blend.read(np.arange(0, 600, 41))

    t = threading.Thread(target=reads)
    t.start()
    try:
        got = in_child(lambda: np.asarray(blend.read(np.arange(0, 600, 37))).tolist(), seconds=5)
    finally:
        stop.set()
        t.join(5)
    assert got == {"value": want}


def _take_list(p: Permutation, idx: np.ndarray) -> list[int]:
    return [int(x) for x in p.take(idx)]


def test_a_permutation_forked_while_its_table_is_built_works_in_the_child() -> None:
    """A parent thread builds a permutation's table (without the GIL, holding its lock)
    while the test forks, ten times: the child computes the same permutation (building
    the table again under a lock of its own), never waiting for the parent's thread."""
    n = 1 << 34  # a table of 3 MB: built after 2^17 indices of bulk calls
    want = Permutation(n, seed=5, table=False).take(np.arange(0, 1 << 20, 4099)).tolist()
    for _ in range(10):
        q = Permutation(n, seed=5)
        t = threading.Thread(target=q.take, args=(np.arange(1 << 18),), daemon=True)
        t.start()
        got = in_child(partial(_take_list, q, np.arange(0, 1 << 20, 4099)), seconds=8)
        t.join(30)
        assert got == {"value": want}
        assert q.has_table
