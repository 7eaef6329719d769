"""One consumer per iterator, no copies of it, and a Ctrl+C while the exit waits (review54).

Two threads in one iterator's ``next()`` took one reader task twice: one of them
then waited forever for a step the other had dropped (or, without reader threads,
both built one batch). ``copy.copy`` of an iterator shared its prefetcher and hung
the same way. A Ctrl+C while the exit waited for reader threads skipped the exit's
later steps, and the interpreter aborted (SIGABRT) finalizing with them running.
"""

from __future__ import annotations

import copy
import gc
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokload
from tokload.prefetch import Prefetcher
from tokload.views.contract import Alloc


class GatedView:
    """Windows of zeros whose reads wait for ``gate`` (a user view)."""

    fingerprint = "gated"

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __len__(self) -> int:
        return 64

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        self.gate.wait(30)
        out = alloc((len(indices), 4), np.int64)
        out[:] = indices[:, None]
        return {"tokens": out}


@pytest.mark.parametrize("threads", [0, 1])
def test_a_second_thread_in_next_is_refused(threads: int) -> None:
    view = GatedView()
    loader = tokload.DataLoader(view, 2, num_threads=threads, device=None, seed=3)
    it: Any = iter(loader)
    got: list[Any] = []
    first = threading.Thread(target=lambda: got.append(next(it)))
    first.start()
    deadline = time.monotonic() + 10
    while it._consumer is None and time.monotonic() < deadline:  # (inside next())
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=r"iterator is in next\(\) in another thread"):
        next(it)
    view.gate.set()
    first.join(10)
    assert not first.is_alive() and len(got) == 1
    second = next(it)  # (the same thread again, or another, once the first is out)
    assert second["position"].tolist() != got[0]["position"].tolist()
    loader.close()


def test_a_signal_handlers_next_gives_the_outer_call_its_mark_back() -> None:
    """review55: a handler's next() in the same thread cleared the mark, and another
    thread then got into the outer next()."""

    class Slow(GatedView):
        def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
            time.sleep(0.4)
            return super().read_batch(indices, alloc)

    view = Slow()
    view.gate.set()
    loader = tokload.DataLoader(view, 2, num_threads=0, device=None)
    it: Any = iter(loader)
    seen: list[Any] = []

    def handler(signum: int, frame: Any) -> None:
        next(it)
        seen.append(it._consumer)

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        next(it)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert seen == [threading.get_ident()]  # (the outer next() still held it)
    assert it._consumer is None
    loader.close()


def test_a_step_dropped_is_refused_not_waited_for() -> None:
    pf = Prefetcher(lambda step: step * 10, first=0, stop=None, depth=2, threads=1)
    try:
        assert pf.get(0) == 0
        pf.drop(0)
        with pytest.raises(ValueError, match=r"step 0 was handed out and dropped"):
            pf.get(0)
        assert pf.get(1) == 10
    finally:
        pf.close()


def test_an_iterator_is_not_copied_or_pickled(monkeypatch: pytest.MonkeyPatch) -> None:
    view = GatedView()
    view.gate.set()
    loader = tokload.DataLoader(view, 2, num_threads=1, device=None)
    it: Any = iter(loader)
    next(it)
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    for make in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(
            TypeError, match=r"iterator holds its reader threads .* loader\.state_dict\(\)"
        ):
            make(it)
    gc.collect()
    assert unraisable == []  # (a half-made copy's __del__ said AttributeError)
    next(it)
    loader.close()


def test_a_thread_waiting_for_a_batch_at_exit_ends_quietly(tmp_path: Path) -> None:
    """review65: a thread of one's own waiting in ``next()`` when the script ended
    printed ``RuntimeError: the prefetcher was closed`` with its traceback (exit 0):
    the exit closes the readers, and the waiting thread ends quietly, as one
    waiting on a raw read does (``SystemExit``); a close by hand still raises."""
    script = tmp_path / "waiting.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, threading, time, numpy as np, tokload

            class Slow:
                fingerprint = "slow"
                def __len__(self):
                    return 1000
                def read_batch(self, indices, alloc):
                    time.sleep(0.3 if indices[0] else 0)
                    return {"tokens": np.zeros((len(indices), 4), np.int64)}

            it = iter(tokload.DataLoader(Slow(), 2, num_threads=1, device=None))
            next(it)
            def consume():
                while True:
                    next(it)
            threading.Thread(target=consume, daemon=True).start()
            time.sleep(0.5)
            print("leaving", flush=True)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "leaving\n", "")


@pytest.mark.slow
def test_a_ctrl_c_while_the_exit_waits_for_reader_threads_leaves_at_once(
    tmp_path: Path,
) -> None:
    script = tmp_path / "slow.py"
    script.write_text(
        textwrap.dedent(
            """
            import time, numpy as np, tokload

            class Slow:
                fingerprint = "slow"
                calls = 0
                def __len__(self):
                    return 1000
                def read_batch(self, indices, alloc):
                    Slow.calls += 1
                    if Slow.calls > 1:
                        time.sleep(4)  # (a read the exit waits for)
                    return {"tokens": np.zeros((len(indices), 4), np.int64)}

            it = iter(tokload.DataLoader(Slow(), 2, num_threads=2, device=None))
            next(it)
            time.sleep(0.5)
            print("leaving", flush=True)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "leaving\n"
    time.sleep(0.7)  # (the exit waits for the reader threads' reads)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err)  # (as Python's own)
    assert "interrupted while waiting for its threads at exit: leaving at once" in err
    assert "terminate called" not in err
