"""Ctrl+C during ``tokload build``: one line, exit 130, every process gone within
2 seconds, nothing half-written visible, and the same command resumes.

The build runs in its own session (``start_new_session``), so a SIGINT to its
process group is what a terminal sends on Ctrl+C; a SIGINT to the parent alone
is what ``kill -INT`` sends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_cli import BUILD_REPORT

import tokload
from tokload.builder import plan_chunks
from tokload.format import read_manifest

FILES, DOCS = 8, 3000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 inputs of about 8 MB: big enough that a build is still running when signalled."""
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    words = np.array(
        [
            "the",
            "quick",
            "brown",
            "fox",
            "jumps",
            "over",
            "a",
            "lazy",
            "dog",
            "while",
            "snowmen",
            "watch",
        ]
    )
    texts = [" ".join(rng.choice(words, 500)) for _ in range(64)]
    for f in range(FILES):
        with open(root / f"in{f}.jsonl", "w") as out:
            for d in range(DOCS):
                out.write(json.dumps({"text": texts[(d * 7 + f) % 64], "id": d}) + "\n")
    return root


@pytest.fixture(autouse=True)
def _sigint_as_a_terminal_leaves_it() -> Iterator[None]:
    """The builds here start with SIGINT's default action, as from a terminal: a suite
    started in the background (``pytest &`` in a script, where the shell ignores
    SIGINT for it) would pass its ignored SIGINT on to them (an ignored signal stays
    ignored across ``exec``; a handler does not)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _session(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _start(corpus: Path, out: Path, workers: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tokload", "build", str(corpus), "-o", str(out)]
    cmd += ["-j", str(workers), "--keep-field", "id", "--no-progress"]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _writing(p: subprocess.Popen[str], out: Path, workers: int) -> None:
    """Wait until the build ``p`` writes a part (its temporary directory exists) and,
    with workers, until the pool's processes exist: the moment to signal it."""
    deadline = time.monotonic() + 60
    while not list((out / "parts").glob("*.tmp")) if (out / "parts").exists() else True:
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "the build never started writing"
        time.sleep(0.01)
    if workers > 1:  # the pool is running (and the parent's handler in place)
        while len(_session(p.pid)) < 1 + workers and time.monotonic() < deadline:
            time.sleep(0.01)
    assert p.poll() is None, "the build ended before the signal: make the input bigger"


def _interrupt(corpus: Path, out: Path, workers: int, group: bool) -> None:
    p = _start(corpus, out, workers)
    _writing(p, out, workers)
    sent = time.monotonic()
    if group:
        os.killpg(p.pid, signal.SIGINT)
    else:
        os.kill(p.pid, signal.SIGINT)
    out_text, err = p.communicate(timeout=30)
    took = time.monotonic() - sent
    assert p.returncode == 130, err
    assert took <= 2.0, f"took {took:.2f} s to stop"
    *report, last = err.splitlines()
    assert last == (
        "tokload build: interrupted; nothing half-written was kept, the same command resumes"
    )
    assert all(BUILD_REPORT.fullmatch(line) for line in report), err
    assert out_text == ""
    while _session(p.pid) and time.monotonic() - sent < 2.0:
        time.sleep(0.02)
    assert _session(p.pid) == [], "a worker outlived the build"
    # Nothing half-written: no manifest, no temporary part, every part complete.
    assert not (out / "manifest.json").exists()
    for part in (out / "parts").iterdir():
        assert re.fullmatch(r"\d{5}-\d{5}", part.name), f"left behind: {part}"
        tokload.open_dataset(part).close()
        assert read_manifest(part).user["build"]["chunk"]["sha256"]  # the chunk's integrity


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("group", [True, False], ids=["ctrl-c", "kill-parent"])
def test_ctrl_c_stops_a_build_cleanly(
    corpus: Path, tmp_path: Path, workers: int, group: bool
) -> None:
    _interrupt(corpus, tmp_path / "ds", workers, group)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
def test_a_worker_dies_with_its_build(tmp_path: Path) -> None:
    """After ``kill -9`` of a ``-j`` build its workers went on, finished their chunks
    and renamed them into the output outside the build's lock, while a re-run may
    already hold it (review37): a worker's initializer (``_die_with``) has the
    kernel kill it when the build process dies."""
    worker = (
        "import os, time; from tokload.builder import _die_with; "
        "_die_with(os.getppid()); print('ready', flush=True); time.sleep(60)"
    )
    build = (
        "import subprocess, sys, time; "
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=sys.stdout); "
        "print(w.pid, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", build], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    pid = int(p.stdout.readline())
    assert p.stdout.readline() == "ready\n"
    p.kill()
    p.wait(timeout=30)
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid), "the worker outlived its build"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not a zombie: an orphan's is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
def test_the_workers_of_a_killed_build_die_with_it(corpus: Path, tmp_path: Path) -> None:
    """A ``-j 2`` build killed with ``kill -9``: its workers are gone at once, rename
    no chunk into the output after, and the same command then builds the dataset."""
    out = tmp_path / "ds"
    p = _start(corpus, out, 2)
    _writing(p, out, 2)
    workers = [pid for pid in _session(p.pid) if pid != p.pid]
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    done = sorted(d.name for d in (out / "parts").iterdir())
    killed = time.monotonic()
    while any(pid in _session(p.pid) for pid in workers) and time.monotonic() - killed < 10:
        time.sleep(0.02)
    assert time.monotonic() - killed < 1.0, "a worker outlived the build"
    assert sorted(d.name for d in (out / "parts").iterdir()) == done  # nothing renamed since
    q = _start(corpus, out, 2)
    _, err = q.communicate(timeout=120)
    assert q.returncode == 0, err
    assert tokload.open_dataset(out).num_documents == FILES * DOCS


@pytest.mark.slow
def test_an_interrupted_build_resumes(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    _interrupt(corpus, out, 2, group=True)
    done = len(list((out / "parts").iterdir()))
    p = _start(corpus, out, 2)
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert f"from {FILES} inputs in {FILES} chunks ({FILES - done} built now)" in stdout
    src = tokload.open_dataset(out)
    assert src.num_documents == FILES * DOCS
    assert tokload.tools.verify(out) == []


@pytest.mark.slow
def test_an_interrupted_build_of_one_file_resumes_from_its_chunks(
    corpus: Path, tmp_path: Path
) -> None:
    big = tmp_path / "one.jsonl"  # ~32 MB: 32 chunks of 1 MB
    big.write_bytes(b"".join((corpus / f"in{f}.jsonl").read_bytes() for f in range(4)))
    total = len(plan_chunks([big], 1 << 20))
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "tokload", "build", str(big), "-o", str(out), "-j", "2"]
    cmd += ["--keep-field", "id", "--chunk-size", "1M", "--no-progress"]

    def finished() -> list[str]:
        parts = out / "parts"
        names = [d.name for d in parts.iterdir()] if parts.exists() else []
        return [n for n in names if re.fullmatch(r"\d{5}-\d{5}", n)]

    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while len(finished()) < 2:
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "no chunk finished"
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    done = len(finished())
    assert 2 <= done < total, "the build ended before the signal: make the input bigger"
    assert not (out / "manifest.json").exists()
    # the same command: only the unfinished chunks of the one file are built
    stdout = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"from 1 inputs in {total} chunks ({total - done} built now)" in stdout
    fresh = tmp_path / "fresh"
    tokload.build([big], fresh, keep_fields=["id"], chunk_bytes=1 << 20, progress=False)
    for d in sorted((out / "parts").iterdir()):
        for f in sorted(d.iterdir()):
            assert f.read_bytes() == (fresh / "parts" / d.name / f.name).read_bytes(), f
    assert tokload.open_dataset(out).fingerprint == tokload.open_dataset(fresh).fingerprint


@pytest.mark.slow
def test_ctrl_c_stops_a_large_plain_text_build_within_a_second(tmp_path: Path) -> None:
    """One plain-text document of 48 MB, tokenized by a BPE tokenizer (seconds of work):
    Ctrl+C acts between its pieces of 1 MB, not after the whole file."""
    from test_build import _hf_tokenizer

    tj = _hf_tokenizer(tmp_path / "tokenizer.json")
    big = tmp_path / "book.txt"
    line = b"the quick brown fox jumps over a lazy dog while snowmen watch\n"
    big.write_bytes(line * (48_000_000 // len(line)))
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "tokload", "build", str(big), "-o", str(out)]
    cmd += ["--tokenizer", str(tj), "--no-progress"]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        # Signal once the document is being written (its temporary directory has a shard).
        while not list((out / "parts").glob("*.tmp/*.rows")) if (out / "parts").exists() else True:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the build never started writing"
            time.sleep(0.01)
        time.sleep(0.3)
        sent = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=30)
        took = time.monotonic() - sent
        assert p.returncode == 130, err
        assert took <= 1.0, f"took {took:.2f} s to stop"
        assert not list((out / "parts").iterdir()), "a half-written document was kept"
    finally:
        big.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_build_that_starts_with_sigint_ignored_keeps_ignoring_it(
    corpus: Path, tmp_path: Path, workers: int
) -> None:
    """As after ``&`` in a script: the SIGINT is not acted on, with one worker or a
    pool of them, and the build ends complete."""
    out = tmp_path / "ds"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the build
    try:
        p = _start(corpus, out, workers)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _writing(p, out, workers)
    os.killpg(p.pid, signal.SIGINT)
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert f"from {FILES} inputs in {FILES} chunks ({FILES} built now)" in stdout
    assert tokload.open_dataset(out).num_documents == FILES * DOCS
