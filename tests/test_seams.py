"""The loader's seams: fork, close, cursor moves, failures and retries.

1. A forked child's ``next()`` goes on from the loader's cursor with fresh reader
   threads (the parent's do not exist in the child): it gets exactly the batches
   the parent gets next. An object store still refuses a forked child
   (``RemoteError``), at once.
2. ``close()`` joins every reader thread against one deadline; garbage collection
   of an iterator only tells the threads to stop; a closed loader's task gives up
   between steps.
3. Moving the cursor inside a loop leaves no reader threads behind.
4. A task whose one read failed is not read again step by step: the failure is
   delivered at the task's first step, with a note naming the task's cursors.
5. Failures that a retry hid are counted in ``stats()``; none is hidden by the
   loader itself.
6. A randomized run of all of it (threads, I/O backends, local files and a fast
   local S3 server in its own process) under a 30 s watchdog per run and 5 s per
   forked child: ``TOKLOAD_SEAM_RUNS`` runs (a few by default; the ``slow``
   variant runs 1,000).
"""

from __future__ import annotations

import contextlib
import dis
import faulthandler
import gc
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokload
from tokload import DataLoader, Documents, TokenStream, Writer
from tokload.prefetch import Prefetcher

WATCHDOG_S = 10.0
FORK_WATCHDOG_S = 3 * WATCHDOG_S + 15  # in_child: up to three forks, gdb looks at two
CHILD_S = 5.0  # a randomized run's forked child (it reads at most 12 batches)
SCENARIO_S = 30.0  # a randomized run: room for its forks' own watchdogs and a new fork
BUCKET = "tokload-seams"
FAST = {"retries": 2, "retry_seconds": 10}  # tests' retries: few, quick

# ---- helpers ----------------------------------------------------------------------------


class Hang(AssertionError):
    """A scenario ran past the watchdog."""


_before: set[threading.Thread] = set()  # reader threads alive when the test began


@pytest.fixture(autouse=True)
def _others_readers() -> None:
    """Reader threads that other test files left running (a Prefetcher never closed)
    are not this file's to count."""
    _before.clear()
    _before.update(t for t in threading.enumerate() if t.name.startswith("tokload-reader"))


def reader_threads() -> list[threading.Thread]:
    """This test's reader threads that are alive."""
    return [
        t for t in threading.enumerate() if t.name.startswith("tokload-reader") and t not in _before
    ]


def wait_no_readers(timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.005)
    return not reader_threads()


def _stacks() -> str:
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        f = frames.get(t.ident or -1)
        if f is not None:
            out.append(f"--- {t.name}\n" + "".join(traceback.format_stack(f)))
    return "\n".join(out)


def within(seconds: float, fn: Callable[[], Any], what: str = "") -> Any:
    """``fn()`` on a thread of its own; Hang (with every thread's stack) when it has
    not returned after ``seconds``. Its exception, if any, is raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, name="seam-scenario", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise Hang(f"{what} still running after {seconds} s\n{_stacks()}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class SanitizerForkDeadlock(Hang):
    """A forked child stuck on a lock of AddressSanitizer's allocator that another
    thread of the parent held at the fork: GCC 12's libasan (LLVM's before 18,
    llvm/llvm-project#75290) does not take its allocator's locks around fork(), so
    a child of a multithreaded parent can deadlock in its first malloc. Not a
    tokload hang: the child's C stacks (gdb) show the sanitizer's lock."""


class InterpreterForkDeadlock(Hang):
    """A forked child stuck in CPython's own after-fork code: ``PyOS_AfterFork_Child``
    waits in ``_PyThreadState_DeleteExcept`` on the interpreter's lock of thread
    states, which another thread of the parent held at the fork (a thread Python
    did not start, creating its thread state). CPython before 3.11.10 takes that
    lock before renewing it in the child (gh-112275). The object-store client's
    threads keep their state after their first result (``_remote.kept``), so only
    those first results leave such a moment. Not a tokload hang: the child's C
    stacks (gdb) show it."""


def _interpreter_fork_deadlock(stacks: str) -> bool:
    """Whether these gdb stacks show the child of an affected CPython stuck in its
    after-fork code on the lock of thread states."""
    return sys.version_info < (3, 11, 10) and _AFTER_FORK_LOCK.search(stacks) is not None


_AFTER_FORK_LOCK = re.compile(
    r"PyThread_acquire_lock\w*[^\n]*\n(#\d+[^\n]*\n)*?#\d+[^\n]*_PyThreadState_DeleteExcept"
    r"[^\n]*\n(#\d+[^\n]*\n)*?#\d+[^\n]*PyOS_AfterFork_Child"
)


def _under_asan() -> bool:
    return "libasan" in os.environ.get("LD_PRELOAD", "")


def _c_stacks(pid: int) -> str:
    """Every thread's C stack in process ``pid`` (gdb attached), or "" without gdb."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    cmd = [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 40"]
    # gdb itself must not run under the sanitizer the tests may have preloaded
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


# a thread inside the sanitizer's allocator, waiting on one of its locks
_ASAN_ALLOC = re.compile(r"__asan::(Allocator|asan_\w*alloc|asan_free)|SizeClassAllocator")
_ASAN_LOCK = re.compile(r"__sanitizer::\w*(Mutex|Lock)\w*::(Lock|LockSlow|ReadLock)")


def _asan_fork_deadlock(stacks: str) -> bool:
    """Whether a thread of these gdb stacks waits on a lock inside ASan's allocator."""
    threads = re.split(r"\n(?=Thread \d+ )", stacks)
    return any(_ASAN_ALLOC.search(t) and _ASAN_LOCK.search(t) for t in threads)


def in_child(fn: Callable[[], Any], seconds: float = WATCHDOG_S) -> dict[str, Any]:
    """``fn()`` in a child made by ``os.fork()``: ``{"value": ...}`` (JSON) or
    ``{"error": type name, "message": ...}``. Hang when the child has not exited
    after ``seconds`` (it is killed), with its Python and C stacks.

    Under AddressSanitizer, a child stuck on the sanitizer allocator's lock
    (SanitizerForkDeadlock) is forked again, up to twice: the libasan of this
    toolchain is not fork-safe in a multithreaded parent. So is a child stuck in
    the interpreter's own after-fork code (InterpreterForkDeadlock, CPython
    before 3.11.10). Any other hang fails."""
    for attempt in range(3):
        try:
            return _in_child_once(fn, seconds)
        except (SanitizerForkDeadlock, InterpreterForkDeadlock) as e:
            if attempt == 2:
                raise
            print(f"in_child: forked again: {str(e).splitlines()[0]}", file=sys.stderr)
    raise AssertionError("unreachable")


def _in_child_once(fn: Callable[[], Any], seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryFile() as dump:  # the child's Python stacks if it hangs
        return _fork_and_wait(fn, seconds, dump)


def _fork_and_wait(fn: Callable[[], Any], seconds: float, dump: Any) -> dict[str, Any]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        faulthandler.dump_traceback_later(max(0.5, seconds - 1), file=dump.fileno())
        code = 0
        try:
            try:
                out: dict[str, Any] = {"value": fn()}
            except BaseException as e:
                out = {"error": type(e).__name__, "message": str(e)}
            os.write(w, json.dumps(out).encode())
        except BaseException:
            code = 2
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + seconds
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                stacks = _c_stacks(pid)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                dump.seek(0)
                python = dump.read().decode(errors="replace")
                kind: type[Hang] = Hang
                if _under_asan() and _asan_fork_deadlock(stacks):
                    kind = SanitizerForkDeadlock
                elif _interpreter_fork_deadlock(stacks):
                    kind = InterpreterForkDeadlock
                raise kind(
                    f"a forked child still running after {seconds} s\n"
                    f"--- its Python stacks\n{python}\n--- its C stacks (gdb)\n{stacks}"
                )
            time.sleep(0.002)
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
    finally:
        os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    return dict(json.loads(data))


# what gdb prints of a child stuck in the sanitizer's allocator, and of one stuck elsewhere
_STUCK_IN_ASAN = """Thread 2 (Thread 0x7f00 (LWP 12) "tokload-reader"):
#0  0x00007f01 in __sanitizer::internal_sched_yield() ()
#1  0x00007f02 in __sanitizer::StaticSpinMutex::LockSlow() ()
#2  0x00007f03 in __sanitizer::SizeClassAllocator64LocalCache<...>::Refill(...) ()
#3  0x00007f04 in __asan::Allocator::Allocate(unsigned long, ...) ()
#4  0x00007f05 in malloc ()

Thread 1 (Thread 0x7f10 (LWP 11) "python"):
#0  0x00007f11 in __futex_abstimed_wait_common () at futex-internal.c:57
#1  0x00007f12 in pthread_cond_timedwait ()
"""
_STUCK_ELSEWHERE = """Thread 2 (Thread 0x7f00 (LWP 12) "tokload-reader"):
#0  0x00007f01 in __futex_abstimed_wait_common () at futex-internal.c:57
#1  0x00007f02 in __sanitizer::BlockingMutex::Lock() ()
#2  0x00007f03 in __interceptor_pthread_mutex_lock ()

Thread 1 (Thread 0x7f10 (LWP 11) "python"):
#0  0x00007f11 in __asan::Allocator::Allocate(unsigned long, ...) ()
#1  0x00007f12 in malloc ()
"""


# what gdb printed of a child of CPython 3.11.7 stuck in its after-fork code (abridged)
_STUCK_AFTER_FORK = """Thread 1 (Thread 0x7f3a1dfd36c0 (LWP 32664) "python"):
#0  __futex_abstimed_wait_common64 (private=<optimized out>, cancel=true) at futex-internal.c:57
#5  0x00007f3ab56aedf9 in __new_sem_wait (sem=sem@entry=0x5640035842d0) at sem_wait.c:42
#6  0x00007f3ab5aa9370 in PyThread_acquire_lock_timed (lock=0x5640035842d0) at thread_pthread.h:497
#7  0x00007f3ab5aa954c in PyThread_acquire_lock (lock=<optimized out>) at thread_pthread.h:751
#8  0x00007f3ab5a972e2 in _PyThreadState_DeleteExcept (runtime=0x7f3ab5d4e540) at pystate.c:1163
#9  0x00007f3ab5a4fc8f in _PyEval_ReInitThreads (tstate=0x7f3a4419e910) at ceval.c:488
#10 0x00007f3ab5acf280 in PyOS_AfterFork_Child () at posixmodule.c:607
#11 0x00007f3ab5acf45d in os_fork_impl (module=<optimized out>) at posixmodule.c:6872
"""
# a child that got past the after-fork code and waits on a lock of its own
_STUCK_PAST_FORK = """Thread 1 (Thread 0x7f3a1dfd36c0 (LWP 32664) "python"):
#0  __futex_abstimed_wait_common64 (private=<optimized out>, cancel=true) at futex-internal.c:57
#6  0x00007f3ab5aa9370 in PyThread_acquire_lock_timed (lock=0x5640035842d0) at thread_pthread.h:497
#7  0x00007f3ab5b1c2a1 in lock_PyThread_acquire_lock (self=0x7f3a4c0) at _threadmodule.c:348
#8  0x00007f3ab5958ba3 in _PyEval_EvalFrameDefault (tstate=0x7f3a4419e910) at ceval.c:4769
"""


def test_a_child_stuck_in_the_interpreters_after_fork_code_is_told_apart() -> None:
    affected = sys.version_info < (3, 11, 10)
    assert _interpreter_fork_deadlock(_STUCK_AFTER_FORK) == affected
    assert not _interpreter_fork_deadlock(_STUCK_PAST_FORK)
    assert not _interpreter_fork_deadlock(_STUCK_IN_ASAN)
    assert not _interpreter_fork_deadlock("")


def test_a_child_stuck_in_the_sanitizers_allocator_is_told_from_one_stuck_elsewhere() -> None:
    assert _asan_fork_deadlock(_STUCK_IN_ASAN)
    # a lock and an allocator frame on two threads: not the allocator's deadlock
    assert not _asan_fork_deadlock(_STUCK_ELSEWHERE)
    assert not _asan_fork_deadlock("")


def test_a_hung_childs_hang_shows_its_python_and_c_stacks() -> None:
    with pytest.raises(Hang) as e:
        in_child(lambda: time.sleep(30), seconds=1.5)
    assert type(e.value) is Hang  # not the sanitizer's: nothing waits on its allocator
    msg = str(e.value)
    assert "a forked child still running after 1.5 s" in msg
    assert "--- its Python stacks" in msg and "<lambda>" in msg
    if shutil.which("gdb"):
        assert "sleep" in msg.split("--- its C stacks (gdb)")[1]


class Rows:
    """A rowwise in-memory view: row ``i`` is ``[i, i, i]``. ``hook(indices)`` runs
    at the start of every read (delays, gates, failures); ``reads`` lists the
    indices of every read."""

    rowwise = True
    fingerprint = "rows"

    def __init__(self, n: int, hook: Callable[[np.ndarray], None] | None = None) -> None:
        self.n, self.hook = n, hook
        self.reads: list[np.ndarray] = []

    def __len__(self) -> int:
        return self.n

    def read_batch(self, indices: np.ndarray, alloc: Any) -> dict[str, Any]:
        self.reads.append(indices.copy())
        if self.hook is not None:
            self.hook(indices)
        out = alloc((len(indices), 3), np.int64)
        out[:] = indices[:, None]
        return {"x": out}


class Steps(Rows):
    """The same, not rowwise: the loader reads it one step at a time."""

    rowwise = False


def _blocking(gate: threading.Event, after: int) -> Callable[[np.ndarray], None]:
    """A hook that blocks reads of indices >= ``after`` until ``gate`` is set."""

    def hook(indices: np.ndarray) -> None:
        if indices.max() >= after:
            gate.wait(30)

    return hook


def _sleeping(seconds: float) -> Callable[[np.ndarray], None]:
    def hook(indices: np.ndarray) -> None:
        time.sleep(seconds)

    return hook


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Documents k = 0..119 whose tokens are k*1000 + (0, 1, ...)."""
    path = tmp_path_factory.mktemp("seams") / "ds"
    with Writer(path, "<u4", shard_bytes=3000) as w:
        for k in range(120):
            w.write(np.arange(k * 1000, k * 1000 + 5 + k % 23, dtype=np.uint32))
    return path


def _backends() -> list[str]:
    from tokload import _io

    return ["sync", "threads"] + (["uring"] if _io.uring_available() else [])


# ---- 1. fork ------------------------------------------------------------------------------


def _firsts(it: Iterator[Any], k: int) -> list[list[int]]:
    return [next(it)["position"].tolist() for _ in range(k)]


@pytest.mark.parametrize(("threads", "per_task"), [(1, 1), (2, 4), (3, 16)])
def test_a_forked_child_goes_on_with_the_batches_the_parent_gets_next(
    corpus: Path, threads: int, per_task: int
) -> None:
    view = TokenStream(corpus, window=9)
    ld = DataLoader(
        view,
        4,
        seed=5,
        num_threads=threads,
        read=tokload.ReadOptions(steps_per_task=per_task, prefetch=8),
    )
    it = iter(ld)
    _firsts(it, 3)
    time.sleep(0.05)  # the readers run ahead: the parent holds built batches

    def child() -> Any:
        got = _firsts(it, 40)  # far past what the parent had built
        return {"got": got, "cursor": ld.cursor, "readers": len(reader_threads())}

    out = within(FORK_WATCHDOG_S, lambda: in_child(child))
    assert "error" not in out, out
    parent = _firsts(it, 40)
    assert out["value"]["got"] == parent
    assert out["value"]["cursor"] == ld.cursor
    assert out["value"]["readers"] == threads  # fresh threads, the child's own
    ld.close()


def test_a_forked_child_s_stats_count_its_own_reads(corpus: Path) -> None:
    view = TokenStream(corpus, window=9)
    for _ in range(50):  # the process has read more than the child will
        view.read(np.arange(len(view)))
    ld = DataLoader(view, 4, num_threads=2, read=tokload.ReadOptions(steps_per_task=2))
    it = iter(ld)
    _firsts(it, 5)

    def child() -> Any:
        _firsts(it, 10)
        return ld.stats()

    st = within(FORK_WATCHDOG_S, lambda: in_child(child))["value"]
    assert st["batches"] == 15
    # the engine's totals start from zero in a child: never a negative interval
    for key in ("io_calls", "io_requests", "io_bytes", "io_s"):
        assert st[key] >= 0, (key, st)
    assert st["io_calls"] >= 1
    ld.close()


@pytest.mark.parametrize("lock", ["schedule", "stats"])
def test_a_forked_child_never_waits_for_a_lock_a_parent_s_reader_held(
    corpus: Path, lock: str
) -> None:
    """A reader thread of the parent may hold a lock at the fork (a permutation of the
    schedule building its table holds one while it works without the GIL; a task's
    statistics are added under one): the child's threads must not wait for it. Here
    a thread of the parent holds the lock (private: the test stands in for a reader
    caught at the fork)."""
    ld = DataLoader(
        TokenStream(corpus, window=9),
        4,
        seed=2,
        num_threads=2,
        read=tokload.ReadOptions(steps_per_task=2),
    )
    it = iter(ld)
    _firsts(it, 2)
    held, release = threading.Event(), threading.Event()
    the_lock = ld.schedule._lock if lock == "schedule" else ld._stats._lock

    def hold() -> None:
        with the_lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(5)
    try:
        out = within(FORK_WATCHDOG_S, lambda: in_child(lambda: _firsts(it, 40)))
    finally:
        release.set()
        t.join()
    assert "error" not in out, out
    assert out["value"] == _firsts(it, 40)
    ld.close()


def test_a_prefetcher_used_in_a_forked_child_raises_at_once() -> None:
    pf = Prefetcher(lambda s: s, 0, None, 2, 2)
    assert pf.get(0) == 0

    def child() -> Any:
        return [pf.get(k) for k in range(1, 10)]

    out = within(FORK_WATCHDOG_S, lambda: in_child(child))
    pf.close()
    assert out["error"] == "RuntimeError", out
    assert "did not survive fork()" in out["message"]


# ---- 2. close ---------------------------------------------------------------------------


def test_close_waits_one_deadline_for_all_threads() -> None:
    gate = threading.Event()
    ld = DataLoader(
        Rows(400, _blocking(gate, 4)),
        4,
        shuffle=False,
        num_threads=3,
        read=tokload.ReadOptions(prefetch=48),
    )
    it = iter(ld)
    next(it)
    deadline = time.monotonic() + 5
    while len([t for t in reader_threads() if t.is_alive()]) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # all three are inside a blocked read
    try:
        t0 = time.monotonic()
        ld.close()
        took = time.monotonic() - t0
    finally:
        gate.set()
    assert 0.9 <= took < 1.5, took  # one second for the three, not one each
    assert wait_no_readers()


def test_a_second_close_from_another_thread_waits_as_the_first_does() -> None:
    """Two ``close()`` calls at once: the second returned at once, the threads still
    inside their reads."""
    gate = threading.Event()
    ld = DataLoader(Rows(400, _blocking(gate, 4)), 4, shuffle=False, num_threads=2)
    it: Any = iter(ld)
    next(it)
    assert reader_threads()
    first = threading.Thread(target=ld.close)
    first.start()
    while not it._closed:
        time.sleep(0.001)
    threading.Timer(0.2, gate.set).start()  # the reads return while both wait
    ld.close()
    assert not reader_threads()
    first.join()


def test_a_close_does_not_forget_an_iterator_made_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``close()`` in one thread while another makes ``iter(loader)``: the close
    forgot the new iterator, and a cursor move or a later close no longer reached it."""
    ld = DataLoader(Rows(400), 4, shuffle=False, num_threads=1)
    old = iter(ld)
    next(old)
    made: list[Any] = []
    real = tokload.iteration.LoaderIter.close

    def close(self: Any, timeout: float = 1.0) -> None:
        real(self, timeout)
        if self is old and not made:  # the other thread's iter() lands here
            made.append(None)
            made[0] = iter(ld)

    monkeypatch.setattr(tokload.iteration.LoaderIter, "close", close)
    ld.close()
    new: Any = made[0]
    assert ld._iter is not None and ld._iter() is made[0]
    ld.cursor = 40  # reaches the new iterator
    assert next(new)["position"].tolist() == [40, 41, 42, 43]
    ld.close()
    assert new._closed and wait_no_readers()
    # put close back while this frame holds the iterators: freeing the patched function
    # (whose closure holds them) inside the undo would run their __del__ mid-setattr
    monkeypatch.undo()


def test_garbage_collection_does_not_wait_for_reads() -> None:
    gate = threading.Event()
    ld = DataLoader(
        Rows(400, _blocking(gate, 4)),
        4,
        shuffle=False,
        num_threads=3,
        read=tokload.ReadOptions(prefetch=48),
    )
    it = iter(ld)
    next(it)
    time.sleep(0.2)
    try:
        t0 = time.monotonic()
        del it  # the last reference: collected here, on this thread
        took = time.monotonic() - t0
    finally:
        gate.set()
    assert took < 0.2, took  # the training thread goes on at once
    assert wait_no_readers()  # the threads stop by themselves once their read returns


def test_a_script_that_leaves_its_loop_without_close_exits_cleanly(tmp_path: Path) -> None:
    """The README's pattern, ``zip(range(5), loader)`` and the end of the script:
    the reader threads, daemons, were still building batches (allocating torch
    tensors) as the interpreter finalized, and 9 runs in 10 aborted (SIGABRT,
    "terminate called without an active exception"). Exit now stops and joins
    them first."""
    ds = tmp_path / "meta"
    with Writer(ds, "<u4", metadata=True, shard_bytes=4000) as w:
        for k in range(3000):
            n = 6 + k % 40
            w.write(np.arange(n), spans=[(0, n // 2, b"s%d" % (k % 5))])
    child = (
        "import sys, tokload\n"
        "view = tokload.StreamWithMetadata(sys.argv[1], window=33)\n"
        "loader = tokload.DataLoader(view, batch_size=8, seed=3, num_threads=8)\n"
        "for step, batch in zip(range(5), loader):\n"
        "    pass\n"
    )
    for _ in range(3):
        r = subprocess.run(
            [sys.executable, "-c", child, str(ds)], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        assert "reader thread" not in r.stderr


def test_exit_steps_run_by_stage_whatever_order_they_came_in() -> None:
    """The object-store client's exit (which waits for requests in flight) comes
    after the readers are stopped, though it registers later, when first used."""
    code = (
        "from tokload import exiting\n"
        "exiting.at_exit(exiting.CLIENT, lambda: print('client'))\n"
        "exiting.at_exit(exiting.READERS, lambda: print('readers'))\n"
        "exiting.at_exit(exiting.READERS, lambda: 1 / 0)\n"
        "exiting.at_exit(exiting.CLIENT, lambda: print('client 2'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert r.stdout.split("\n") == ["readers", "client", "client 2", ""]
    assert "ZeroDivisionError" in r.stderr  # a failing step is shown, the next ones run


@pytest.mark.parametrize("kind", ["steps", "collate"])
def test_a_closed_loader_s_task_gives_up_between_steps(kind: str) -> None:
    """Reads of a view that is not rowwise, and collate, run one step at a time: a
    close is seen before the next step, not at the end of the task."""
    if kind == "steps":
        view: Rows = Steps(10_000, _sleeping(0.05))
        ld = DataLoader(
            view,
            2,
            shuffle=False,
            num_threads=2,
            read=tokload.ReadOptions(steps_per_task=16, prefetch=64),
        )
    else:
        view = Rows(10_000)

        def collate(raw: dict[str, Any]) -> Any:
            time.sleep(0.05)
            return raw["position"]

        read = tokload.ReadOptions(steps_per_task=16, prefetch=64)
        ld = DataLoader(view, 2, shuffle=False, num_threads=2, collate=collate, read=read)
    it = iter(ld)
    next(it)
    time.sleep(0.7)  # both threads are inside a task of 16 steps of 50 ms
    t0 = time.monotonic()
    ld.close()
    took = time.monotonic() - t0
    assert took < 0.3, took
    assert not reader_threads()
    built = len(view.reads)
    time.sleep(0.2)
    assert len(view.reads) == built  # nothing more is read
    del it


# ---- 3. cursor moves ---------------------------------------------------------------------


@pytest.mark.parametrize("view_kind", ["rows", "steps"])
def test_cursor_moves_leave_no_threads_behind(view_kind: str) -> None:
    assert wait_no_readers()
    view = (Steps if view_kind == "steps" else Rows)(100_000, _sleeping(0.01))
    ld = DataLoader(
        view,
        4,
        shuffle=False,
        num_threads=2,
        read=tokload.ReadOptions(steps_per_task=8, prefetch=32),
    )
    rng = np.random.default_rng(1)
    it = iter(ld)
    for _ in range(25):
        next(it)
        at = int(rng.integers(0, 90_000)) // 4 * 4
        t0 = time.monotonic()
        ld.cursor = at
        took = time.monotonic() - t0
        assert took < 0.5, took
        assert len(reader_threads()) == 2, [t.name for t in reader_threads()]
        assert next(it)["position"].tolist() == [at, at + 1, at + 2, at + 3]
    state = ld.state_dict()
    for _ in range(10):
        next(it)
        ld.load_state_dict(state)
        assert len(reader_threads()) == 2
    ld.close()
    assert not reader_threads()


def test_a_cursor_move_from_another_thread_lands_in_the_loop_at_once() -> None:
    """A checkpoint or controller thread moving the cursor while the training thread
    waits in ``next()`` for slow reads: the training thread got the prefetcher's
    internal "the prefetcher was closed" and its loop died. Now its ``next()`` returns
    the new cursor's first batch; and a ``close()`` from another thread ends the loop
    as the end of the data does."""
    ld = DataLoader(
        Rows(100_000, _sleeping(0.3)),
        2,
        shuffle=False,
        num_threads=1,
        read=tokload.ReadOptions(steps_per_task=1, prefetch=2),
    )
    got: list[Any] = []

    def train(it: Any) -> None:
        try:
            got.extend(b["position"].tolist()[0] for b in itertools.islice(it, 3))
        except Exception as e:
            got.append(e)

    t = threading.Thread(target=train, args=(iter(ld),))
    t.start()
    time.sleep(0.1)  # inside next(), waiting for the first read
    state = ld.state_dict()
    ld.load_state_dict({**state, "cursor": 5000})
    t.join(30)
    assert got == [5000, 5002, 5004] and ld.cursor == 5006
    got.clear()
    t = threading.Thread(target=train, args=(iter(ld),))
    t.start()
    time.sleep(0.1)
    ld.close()
    t.join(30)
    assert got == [] and not t.is_alive() and ld.cursor == 5006


def test_a_task_taken_just_before_a_move_from_another_thread_is_dropped(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move lands while the training thread holds a task it just took from the
    old reader threads (a thread switch there): the loop delivered the old cursor's
    batches and then skipped the new cursor's first task."""
    took, go = threading.Event(), threading.Event()
    real = Prefetcher.get

    def get(self: Prefetcher, step: int) -> Any:
        item = real(self, step)
        if threading.current_thread().name == "train" and step == 1 and not took.is_set():
            took.set()
            go.wait(10)  # the switch to the thread that moves the cursor
        return item

    monkeypatch.setattr(Prefetcher, "get", get)
    ld = DataLoader(
        TokenStream(corpus, window=9),
        2,
        shuffle=False,
        num_threads=1,
        read=tokload.ReadOptions(steps_per_task=2),
    )
    seen: list[int] = []

    def train() -> None:
        seen.extend(int(b["position"][0]) for b in itertools.islice(ld, 6))

    t = threading.Thread(target=train, name="train")
    t.start()
    assert took.wait(10)
    ld.cursor = 1000
    go.set()
    t.join(30)
    ld.close()
    assert seen == [0, 1000, 1002, 1004, 1006, 1008]
    assert ld.cursor == 1010
    monkeypatch.undo()


def test_a_reader_thread_the_system_refuses_leaves_no_thread_behind(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limit on threads (a container's pids) refusing the second reader: the first
    kept reading with no owner, close() could not stop it, and the exit's closing of
    every loader stopped at "cannot join thread before it is started"."""
    from tokload import prefetch

    view = TokenStream(corpus, 9)
    other = DataLoader(view, 2, num_threads=1)  # another loader, reading meanwhile
    it_other = iter(other)
    next(it_other)
    real = threading.Thread.start
    started = [0]

    def start(self: threading.Thread) -> None:
        if self.name.startswith("tokload-reader"):
            started[0] += 1
            if started[0] == 2:
                raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    failing = DataLoader(view, 2, num_threads=2)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        iter(failing)
    monkeypatch.setattr(threading.Thread, "start", real)
    failing.close()
    assert len(reader_threads()) == 1  # the other loader's only
    prefetch._close_all_at_exit()  # what the exit runs: every loader's threads stopped
    assert reader_threads() == []
    other.close()


# ---- 4. a failed task --------------------------------------------------------------------


def _failing_at(bad: int, times: int | None = None) -> Callable[[np.ndarray], None]:
    """A hook raising OSError for reads holding index ``bad`` (the first ``times``)."""
    left = [times]

    def hook(indices: np.ndarray) -> None:
        if bad in indices and (left[0] is None or left[0] > 0):
            if left[0] is not None:
                left[0] -= 1
            raise OSError(5, f"cannot read sample {bad}", "shard-7.bin")

    return hook


def _tasks_of_four(view: Rows) -> DataLoader:
    """Batches of 2 in order, one epoch, tasks of 4 steps (task 0: step 0, positions
    0-1; task 1: steps 1-4, positions 2-9; task 2: positions 10-17), one thread."""
    return DataLoader(
        view,
        2,
        shuffle=False,
        epochs=1,
        num_threads=1,
        read=tokload.ReadOptions(steps_per_task=4, prefetch=4),
    )


def test_a_failed_task_is_not_read_again_and_fails_at_its_first_step() -> None:
    # shuffle=False, batches of 2, tasks of 4 steps: task 0 is step 0 (positions 0-1),
    # task 1 steps 1-4 (2-9), task 2 steps 5-8 (10-17); sample 14 is in task 2, step 7
    view = Rows(40, _failing_at(14))
    ld = _tasks_of_four(view)
    it = iter(ld)
    got = [next(it)["position"].tolist() for _ in range(5)]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    with pytest.raises(OSError, match="cannot read sample 14") as e:
        next(it)
    assert e.value.errno == 5 and e.value.filename == "shard-7.bin"
    notes = " ".join(e.value.__notes__)
    assert "4 batches at cursors [10, 18)" in notes, notes
    assert "delivered at the first of them, cursor 10" in notes, notes
    assert ld.cursor == 10  # the task's batches were not delivered
    assert sum(14 in r for r in view.reads) == 1  # read once, not again step by step
    with pytest.raises(RuntimeError, match=r"stopped at a failure \(OSError: .*cursor \(10\)"):
        next(it)  # the pass ended at the failure: not as if the data had run out
    # a resume builds the batches again, in tasks that start at its cursor: the first
    # (one step) is read alone and delivered, the next holds sample 14 again
    it = iter(ld)
    assert next(it)["position"].tolist() == [10, 11]
    with pytest.raises(OSError, match="cannot read sample 14") as e:
        next(it)
    assert "4 batches at cursors [12, 20)" in " ".join(e.value.__notes__)
    assert ld.cursor == 12 and sum(14 in r for r in view.reads) == 2
    ld.close()


def test_a_transient_failure_reaches_next_and_a_resume_goes_on() -> None:
    view = Rows(40, _failing_at(14, times=1))
    ld = DataLoader(
        view,
        2,
        shuffle=False,
        epochs=1,
        num_threads=2,
        read=tokload.ReadOptions(steps_per_task=4, prefetch=8),
    )
    seen: list[int] = []
    with pytest.raises(OSError, match="cannot read sample 14"):
        for b in ld:
            seen += b["position"].tolist()
    assert seen == list(range(10))  # not hidden by a second read that succeeded
    for b in ld:  # the resume reads the task again, and it succeeds now
        seen += b["position"].tolist()
    assert seen == list(range(40))


def test_a_failure_in_a_step_of_its_own_lands_on_that_step() -> None:
    """Reads one step at a time (a view that is not rowwise): the failing step is
    known without a second read, and the steps before it are delivered."""
    view = Steps(40, _failing_at(14))
    ld = DataLoader(
        view,
        2,
        shuffle=False,
        epochs=1,
        num_threads=2,
        read=tokload.ReadOptions(steps_per_task=4, prefetch=8),
    )
    seen: list[int] = []
    with pytest.raises(OSError, match="cannot read sample 14") as e:
        for b in ld:
            seen += b["position"].tolist()
    assert seen == list(range(14))
    assert any("building the batch at cursor 14" in n for n in e.value.__notes__)
    assert ld.cursor == 14 and sum(14 in r for r in view.reads) == 1


def test_a_reader_failure_that_is_no_exception_skips_no_task() -> None:
    """A ``BaseException`` from a read (``asyncio.CancelledError``, from a view whose
    client runs on asyncio) was raised by ``next()`` with the iterator left open and
    its prefetcher past the task: the next ``next()`` went on 4 batches later."""
    import asyncio

    failed: list[int] = []

    def hook(indices: np.ndarray) -> None:
        if 14 in indices and not failed:
            failed.append(1)
            raise asyncio.CancelledError()

    ld = _tasks_of_four(Rows(40, hook))
    it = iter(ld)
    got = [next(it)["position"].tolist() for _ in range(5)]
    with pytest.raises(asyncio.CancelledError):
        next(it)
    with pytest.raises(RuntimeError, match=r"stopped at a failure \(CancelledError"):
        next(it)
    assert ld.cursor == 10
    got += [b["position"].tolist() for b in ld]  # a new loop builds the task again
    assert got == [[k, k + 1] for k in range(0, 40, 2)]


class _LengthsFailOnce:
    """Documents whose ``extents`` (a packed schedule's lengths) fail at call ``bad``."""

    def __init__(self, docs: Documents, bad: int) -> None:
        self.docs, self.calls, self.bad = docs, 0, bad
        self.fields, self.fingerprint = docs.fields, "fails-once:" + docs.fingerprint

    def __len__(self) -> int:
        return len(self.docs)

    def read_batch(self, indices: np.ndarray, alloc: Any) -> Any:
        return self.docs.read_batch(indices, alloc)

    def read_extents(self, *args: Any) -> Any:
        return self.docs.read_extents(*args)

    def extents(self, indices: np.ndarray) -> Any:
        self.calls += 1
        if self.calls == self.bad:
            raise OSError(5, "lengths unreadable", "shard-3.bin")
        return self.docs.extents(indices)


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_a_failure_while_packing_a_task_skips_no_row(corpus: Path, threads: int) -> None:
    """A task whose packing fails (before its steps are known) ends the iterator with
    the cursor before it, as a failed read does: a new loop builds it again. Reader
    threads once went on with the next task, and its rows were lost."""

    def run(bad: int) -> tuple[list[int], int]:
        ld = DataLoader(
            _LengthsFailOnce(Documents(corpus), bad),
            1,
            batching=tokload.Fill(64, lookahead=4),
            seed=1,
            epochs=1,
            num_threads=threads,
            read=tokload.ReadOptions(steps_per_task=2, prefetch=2),
        )
        rows: list[int] = []
        failures = 0
        while True:
            it = iter(ld)
            try:
                for b in it:
                    rows += b["position"].tolist()
                break
            except OSError as e:
                assert e.filename == "shard-3.bin"
                failures += 1
                at = ld.cursor
                if threads:  # the iterator ended at the failure, and says so
                    with pytest.raises(RuntimeError, match=r"stopped at a failure \(OSError"):
                        next(it)
                assert ld.cursor == at
        ld.close()
        return rows, failures

    clean, none = run(0)
    got, failures = run(4)
    assert none == 0 and failures == 1
    assert len(clean) > 10 and len(set(clean)) == len(clean)
    assert got == clean


# ---- 5. interrupts -----------------------------------------------------------------------


class _InterruptAt:
    """A tracer (``sys.settrace``, the calling thread only) that raises ``exc`` (or
    runs ``act()``) at the ``k``-th point of the functions ``codes`` where CPython
    runs a signal handler or lets another thread run: after a call returns, at a
    loop's jump back and as a function starts (the interpreter's "eval breaker" is
    looked at there, and nowhere between other instructions). That is where Ctrl+C,
    a handler (a watchdog's alarm raising, one moving the cursor) or a switch to
    another thread lands in the training thread. ``seen``: the points counted."""

    def __init__(
        self,
        codes: set[Any],
        k: int,
        exc: type[BaseException],
        act: Callable[[], None] | None = None,
    ) -> None:
        self.codes, self.k, self.exc, self.act, self.seen = codes, k, exc, act, 0
        self._last: dict[int, str] = {}  # per frame, the instruction before

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code not in self.codes:
            return None
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return self._op

    def _op(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            before = self._last.get(id(frame))
            self._last[id(frame)] = dis.opname[frame.f_code.co_code[frame.f_lasti]]
            if before in _BREAKER_CHECKED:
                self.seen += 1
                if self.seen == self.k + 1:
                    if self.act is None:
                        raise self.exc("interrupted")
                    sys.settrace(None)  # (the action's own code is not traced)
                    self.act()
        return self._op


_BREAKER_CHECKED = {"CALL", "JUMP_BACKWARD", "RESUME"}
"""The instructions after which CPython 3.11 runs pending signal handlers and thread
switches."""


# (not ``_delivered``: an interrupt inside the statistics' own update may count a batch
# twice; the batches are exact wherever it lands)
_NEXT_CODES = {
    f.__code__
    for f in (
        tokload.iteration.LoaderIter.__next__,
        tokload.iteration.LoaderIter._take,
        tokload.iteration.LoaderIter._ended,
        tokload.iteration.LoaderIter.restart,
        tokload.iteration.LoaderIter._start,
        Prefetcher.get,
        Prefetcher.drop,
        Prefetcher.add_threads,
        Prefetcher.close,
    )
}


def _interrupted(fn: Callable[[], Any], codes: set[Any], k: int, exc: type[BaseException]) -> bool:
    """``fn()`` with ``exc`` raised at its ``k``-th line event in ``codes``: whether it was
    (False once ``k`` is past the events of the call)."""
    tracer = _InterruptAt(codes, k, exc)
    sys.settrace(tracer)
    try:
        fn()
    except exc:
        return True
    finally:
        sys.settrace(None)
    assert tracer.seen <= k, "the interrupt was swallowed"
    return False


def _sample_loader(threads: int) -> DataLoader:
    return DataLoader(
        Rows(300),
        3,
        seed=5,
        num_threads=threads,
        read=tokload.ReadOptions(steps_per_task=4, prefetch=8),
    )


def _samples(b: Any) -> list[int]:
    return [int(v) for v in b["x"][:, 0]]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, TimeoutError])
@pytest.mark.parametrize("threads", [0, 1, 2])
def test_an_interrupt_anywhere_in_next_loses_and_repeats_no_batch(
    threads: int, exc: type[BaseException]
) -> None:
    """Ctrl+C (or a handler's TimeoutError) at each statement of a ``next()`` that takes
    a new task (step 1: task 0 is one step), one inside a task (step 3) and one
    after a task (step 5), one at a time: the same iterator goes on, every batch
    comes once and in order, and the cursor counts only the batches returned. A
    batch was lost, tasks came reversed, the iterator ended (an exception taken for
    a reader's failure) or hung (the condition's lock left held, the step counter
    not moved)."""
    with _sample_loader(threads) as ref:
        want = [_samples(b) for b, _ in zip(ref, range(10), strict=False)]
    for step in (1, 3, 5):
        for k in itertools.count():
            ld = _sample_loader(threads)
            it = iter(ld)
            got = [_samples(next(it)) for _ in range(step)]

            def take(it: Any = it, got: list[list[int]] = got) -> None:
                got.append(_samples(next(it)))

            hit = _interrupted(take, _NEXT_CODES, k, exc)
            assert ld.cursor == 3 * len(got), (step, k, ld.cursor, len(got))
            while len(got) < 10:
                got.append(_samples(next(it)))
                assert ld.cursor == 3 * len(got)
            assert ld.stats()["batches"] == 10, (step, k)  # none counted twice
            ld.close()
            assert got == want, (step, k)
            assert wait_no_readers(), (step, k)
            if not hit:
                assert k >= 5  # the points of the call were all interrupted, one at a time
                break


@pytest.mark.parametrize("mover", ["handler", "thread"])
@pytest.mark.parametrize("threads", [0, 1, 2])
def test_a_cursor_move_anywhere_in_next_lands_between_two_batches(threads: int, mover: str) -> None:
    """``loader.cursor = 150`` made at each statement of a ``next()``, one at a time, by
    a signal handler (in the training thread, inside ``next()``) or by another thread
    (as a switch to it there would): the loop's batches are the old cursor's up to
    some step, then the new cursor's, each once, and the cursor counts exactly the
    batches returned. A move landing between the lock's end and the cursor's update
    was lost, or the cursor read the old batch's end while the new cursor's came."""
    with _sample_loader(threads) as ref:
        by_position = {
            int(p): int(v)
            for b in itertools.islice(ref, 100)  # the first epoch (300 samples)
            for p, v in zip(b["position"], b["x"][:, 0], strict=True)
        }
    for step in (1, 3, 5):
        for k in itertools.count():
            ld = _sample_loader(threads)
            it = iter(ld)
            got = [next(it) for _ in range(step)]

            movers: list[threading.Thread] = []

            def move(ld: DataLoader = ld, movers: list[threading.Thread] = movers) -> None:
                if mover == "handler":
                    ld.cursor = 150
                    return
                # a switch to the other thread: it runs until it is done or waits for
                # the loader's lock (this thread's), and this thread goes on
                t = threading.Thread(target=setattr, args=(ld, "cursor", 150))
                t.start()
                movers.append(t)
                t.join(0.05)

            tracer = _InterruptAt(_NEXT_CODES, k, KeyboardInterrupt, move)
            sys.settrace(tracer)
            try:
                got.append(next(it))
            finally:
                sys.settrace(None)
            for t in movers:
                t.join()
            # the batch returned counted, or a move after it (then the next is 150's)
            assert ld.cursor in (int(got[-1]["position"][-1]) + 1, 150), (step, k)
            while len(got) < 10:
                got.append(next(it))
                assert ld.cursor == int(got[-1]["position"][-1]) + 1, (step, k)
            ld.close()
            starts = [int(b["position"][0]) for b in got]
            assert 150 in starts or tracer.seen <= k, (step, k, starts)
            moved = starts.index(150) if tracer.seen > k else len(starts)
            assert starts == [3 * i for i in range(moved)] + [
                150 + 3 * i for i in range(len(starts) - moved)
            ], (step, k, starts)
            for b in got:  # each position's samples, as the run without moves has them
                assert [int(v) for v in b["x"][:, 0]] == [
                    by_position[int(p)] for p in b["position"]
                ]
            assert wait_no_readers(), (step, k)
            if tracer.seen <= k:
                assert k >= 5
                break


@pytest.mark.parametrize("threads", [1, 2])
def test_an_interrupt_anywhere_in_a_cursor_move_delivers_no_old_batch(threads: int) -> None:
    """Ctrl+C at each statement of ``loader.cursor = c`` inside a loop (the old
    threads are joined there, up to a second on slow storage): once the cursor
    says ``c`` (set again where the move itself was cut short), the loop goes on
    from ``c``. The old cursor's prefetched batches came next."""
    with _sample_loader(threads) as ref:
        ref.cursor = 30
        want = [_samples(b) for b, _ in zip(ref, range(4), strict=False)]
    codes = _NEXT_CODES | {DataLoader.cursor.fset.__code__}  # type: ignore[attr-defined]
    for k in itertools.count():
        ld = _sample_loader(threads)
        it = iter(ld)
        for _ in range(3):
            next(it)

        def move(ld: DataLoader = ld) -> None:
            ld.cursor = 30

        hit = _interrupted(move, codes, k, KeyboardInterrupt)
        if ld.cursor != 30:  # the move itself was cut short: the loop sets it again
            ld.cursor = 30
        got = [_samples(next(it)) for _ in range(4)]
        ld.close()
        assert got == want, k
        assert wait_no_readers(), k
        if not hit:
            assert k >= 5
            break


def test_an_exception_from_the_training_thread_while_next_waits_is_not_a_failure() -> None:
    """A watchdog's alarm raising ``TimeoutError`` while ``next()`` waited for a slow read
    closed the iterator as if a reader had failed: its next ``next()`` raised
    StopIteration, and an endless loop ended as if the data had run out."""
    ld = DataLoader(Rows(100, _sleeping(0.3)), 2, shuffle=False, num_threads=1, device=None)
    it = iter(ld)
    with pytest.raises(TimeoutError):
        _raise_in(0.05, TimeoutError, lambda: next(it))
    assert next(it)["position"].tolist() == [0, 1]
    assert ld.cursor == 2
    ld.close()


def _raise_in(seconds: float, exc: type[BaseException], fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``exc`` raised in this thread after ``seconds`` (a SIGALRM handler)."""

    def alarm(signum: int, frame: Any) -> None:
        raise exc("watchdog")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- the object store ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    pytest.importorskip("boto3")
    from bench.s3local import LocalS3

    with LocalS3() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture
def s3env(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The standard AWS variables point at the proxy; the proxy starts clean."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    s3.proxy.clear()
    yield s3
    s3.proxy.clear()


@pytest.fixture(scope="module")
def remote_url(s3: Any, corpus: Path) -> str:
    s3.upload_dir(str(corpus), BUCKET, "ds")
    return f"s3://{BUCKET}/ds"


def test_a_failed_remote_read_waits_out_its_retries_once(s3env: Any, remote_url: str) -> None:
    # one sample, one GET: its attempts are the retries plus one, not twice that
    view = TokenStream(remote_url, 9, storage_options=FAST).subset(3, 4)
    ld = DataLoader(view, 1, epochs=1, num_threads=1)
    s3env.proxy.inject("503", times=100, match="GET")
    with pytest.raises(tokload.RemoteError, match=r"failed after 3 attempts: HTTP 503"):
        next(iter(ld))
    assert s3env.proxy.faults_done["503"] == FAST["retries"] + 1
    ld.close()


def test_retried_failures_are_counted_in_stats(s3env: Any, remote_url: str) -> None:
    ld = DataLoader(TokenStream(remote_url, 9, storage_options=FAST), 4, num_threads=1)
    ld.stats()
    s3env.proxy.inject("503", times=2, match="GET")
    it = iter(ld)
    _firsts(it, 3)
    st = ld.stats()
    ld.close()
    assert s3env.proxy.faults_done["503"] == 2
    assert st["remote_retries"] == 2
    assert st["io_failed"] == 0  # retried, then read: no failure reached a reader


def test_a_forked_child_is_refused_by_the_object_store_not_hung(
    s3env: Any, remote_url: str
) -> None:
    ld = DataLoader(TokenStream(remote_url, 9, storage_options=FAST), 4, num_threads=2)
    it = iter(ld)
    _firsts(it, 2)

    def child() -> Any:
        return _firsts(it, 30)

    out = within(FORK_WATCHDOG_S, lambda: in_child(child))
    ld.close()
    assert out["error"] == "RemoteError", out
    assert "does not survive fork()" in out["message"]


# ---- 6. randomized: fork, close and cursor moves under a watchdog --------------------------

DEFAULT_RUNS = 40


def _scenario(rng: random.Random, views: dict[str, Any], remote: bool) -> str:
    """One randomized run: a loader with random threads, task size, prefetch, batch
    size and I/O backend, driven through random actions; every batch is checked
    against the schedule. Returns what it did (for a failure's message)."""
    kind = "remote" if remote else rng.choice(["stream", "docs"])
    view = views[kind]
    io = None if remote else rng.choice(_backends())
    threads = rng.choice([0, 1, 2, 3])
    per_task = rng.choice([1, 2, 4, 16])
    prefetch = rng.choice([None, 1, 4, 12])
    batch = rng.randint(1, 6)
    epochs = rng.choice([None, 3])
    ld = DataLoader(
        view, batch, seed=rng.randint(0, 99), num_threads=threads,
        epochs=epochs,
    read=tokload.ReadOptions(steps_per_task=per_task, prefetch=prefetch, io=io))  # fmt: skip
    did = [f"{kind} io={io} threads={threads} per_task={per_task} prefetch={prefetch} "
           f"batch={batch} epochs={epochs}:"]  # fmt: skip
    it: Iterator[Any] | None = iter(ld)

    def take(k: int) -> list[list[int]]:
        assert it is not None
        out = []
        for _ in range(k):
            c = ld.cursor
            try:
                b = next(it)
            except StopIteration:
                break
            span = ld.schedule.span(c)
            assert span is not None
            want = ld.schedule.positions(*span).astype(np.int64).tolist()
            assert b["position"].tolist() == want, (c, b["position"].tolist(), want)
            out.append(want)
        return out

    def in_fork(k: int) -> dict[str, Any]:
        def child() -> Any:
            return {"got": take(k), "readers": len(reader_threads())}

        return in_child(child, seconds=CHILD_S)

    for _ in range(rng.randint(1, 8)):
        action = rng.choice(["next", "next", "cursor", "state", "fork", "close", "reiter", "gc"])
        did.append(action)
        if action == "next":
            take(rng.randint(1, 20))
        elif action == "cursor":
            for _ in range(rng.randint(1, 5)):
                ld.cursor = rng.randrange(0, ld.n * 2)
        elif action == "state":
            st = ld.state_dict()
            take(rng.randint(0, 5))
            ld.load_state_dict(st)
        elif action == "fork":
            k = rng.randint(1, 12)
            out = in_fork(k)
            if remote:
                assert out.get("error") == "RemoteError", out
                assert "does not survive fork()" in out["message"]
            else:
                assert "error" not in out, out
                assert out["value"]["got"] == take(k)
                assert out["value"]["readers"] <= threads
        elif action == "close":
            t0 = time.monotonic()
            ld.close()
            assert time.monotonic() - t0 < 1.5
            it = iter(ld)
        elif action == "reiter":
            it = iter(ld)
        else:  # the iterator is collected: its threads are told to stop
            it = None
            gc.collect()
            it = iter(ld)
        # threads never pile up: each pass's were joined before the next began
        assert len(reader_threads()) <= threads, [t.name for t in reader_threads()]
        time.sleep(rng.choice([0.0, 0.0, 0.002, 0.02]))  # let the readers get ahead
    t0 = time.monotonic()
    ld.close()
    assert time.monotonic() - t0 < 1.5
    assert not reader_threads()
    return " ".join(did)


def _run_scenarios(runs: int, views: dict[str, Any], remote_share: float) -> float:
    """``runs`` scenarios under the watchdog; returns the seconds they took."""
    master = random.Random(int(os.environ.get("TOKLOAD_SEAM_SEED", "20240611")))
    t0 = time.monotonic()
    # The "gc" action's full collections then scan only what the runs made. The
    # objects alive now (pytest, torch, moto, other tests' leftovers) are set aside:
    # scanning them took 0.1 to 0.25 s a collection, 40% of the runs' time.
    frozen = gc.get_freeze_count()
    gc.freeze()
    try:
        _runs(master, runs, views, remote_share)
    finally:
        if not frozen:  # the collector as it was (test_docs' fixture does the same)
            gc.unfreeze()
    return time.monotonic() - t0


def _runs(master: random.Random, runs: int, views: dict[str, Any], remote_share: float) -> None:
    for k in range(runs):
        seed = master.randrange(1 << 32)
        rng = random.Random(seed)
        remote = "remote" in views and rng.random() < remote_share

        def run(rng: random.Random = rng, remote: bool = remote) -> str:
            return _scenario(rng, views, remote)

        try:
            within(SCENARIO_S, run, f"run {k} (seed {seed})")
        except BaseException as e:
            e.add_note(f"seam run {k}, seed {seed} (TOKLOAD_SEAM_SEED reproduces the series)")
            raise


@pytest.fixture(scope="module")
def fast_remote(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenStream]:
    """The corpus on the benchmarks' fast S3 server (``bench/fasts3.py``), 5 ms added to
    every answer so that GETs are in flight when a run closes, forks or moves the
    cursor. It runs in a process of its own: moto (the fault tests' server) runs in
    this one, where it held the GIL against the loader and made the object-store
    runs two thirds of the randomized tests' time."""
    pytest.importorskip("obstore")
    from bench.fasts3 import FastS3Process

    root = tmp_path_factory.mktemp("fasts3")
    shutil.copytree(corpus, root / "seams" / "ds")
    with FastS3Process(root, latency_ms=5, lifetime=3600) as srv:
        options = {"endpoint": srv.endpoint, "access_key_id": "seams"}
        options |= {"secret_access_key": "seams", "region": "us-east-1"}
        yield TokenStream("s3://seams/ds", 9, stride=5, storage_options=FAST | options)


def _views(corpus: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    views: dict[str, Any] = {
        "stream": TokenStream(corpus, window=9, stride=5),
        "docs": Documents(corpus),
    }
    with contextlib.suppress(pytest.skip.Exception):  # where obstore is installed
        views["remote"] = request.getfixturevalue("fast_remote")
    return views


def test_seams_randomized(corpus: Path, request: pytest.FixtureRequest) -> None:
    runs = int(os.environ.get("TOKLOAD_SEAM_RUNS", DEFAULT_RUNS))
    took = _run_scenarios(runs, _views(corpus, request), 0.25)
    print(f"{runs} seam runs in {took:.1f} s")


@pytest.mark.slow
def test_seams_randomized_1000(corpus: Path, request: pytest.FixtureRequest) -> None:
    took = _run_scenarios(1000, _views(corpus, request), 0.25)
    print(f"1000 seam runs in {took:.1f} s")
