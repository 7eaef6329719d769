"""Anything tokload writes next to user data while reading is safe to race on.

``open_flat(..., eos=)`` caches document boundaries next to the token file.
Every rank of a job opens the same file at once; all must see the same
number of documents, whatever the interleaving of their cache writes.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from timeouts import no_hang

import tokload
from tokload import Documents
from tokload import interop as interop_module

EOS = 7
PROCESSES = 8


def _token_file(path: Path) -> int:
    """A flat uint16 file with an eos every other token on average; returns #documents."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 16, 2_000_000).astype(np.uint16)
    tokens[rng.random(tokens.size) < 0.5] = EOS
    tokens[-1] = 1  # trailing tokens after the last eos form a last document
    tokens.tofile(path)
    return int(np.count_nonzero(tokens == EOS)) + 1


def _open_and_count(path: str, barrier: Any, out: Any, k: int) -> None:
    barrier.wait()
    try:
        out[k] = len(Documents(tokload.open_flat(path, np.uint16, eos=EOS)))
    except BaseException as e:  # reported through the shared array
        print(f"process {k}: {e!r}", flush=True)
        out[k] = -1


@pytest.mark.slow
def test_eight_processes_opening_one_flat_file_agree(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    expected = _token_file(path)
    cache = tmp_path / f"tokens.bin.eos{EOS}.docs"
    ctx = mp.get_context("fork")
    for _round in range(3):
        cache.unlink(missing_ok=True)
        barrier = ctx.Barrier(PROCESSES)
        out = ctx.Array("q", PROCESSES)
        procs = [
            ctx.Process(target=_open_and_count, args=(str(path), barrier, out, k))
            for k in range(PROCESSES)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * PROCESSES
        assert out[:] == [expected] * PROCESSES
        assert np.fromfile(cache, "<u8").size == expected + 1
        # no temporary file is left behind
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([cache.name, "tokens.bin"])


def _small(tmp_path: Path) -> tuple[Path, Path, list[np.ndarray]]:
    tokens = np.array([3, EOS, 4, 5, EOS, EOS, 6], np.uint16)
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    return (
        path,
        tmp_path / f"t.bin.eos{EOS}.docs",
        [tokens[:2], tokens[2:5], tokens[5:6], tokens[6:]],
    )


def _docs(path: Path) -> list[np.ndarray]:
    d = Documents(tokload.open_flat(path, np.uint16, eos=EOS))
    return [np.asarray(d[i]) for i in range(len(d))]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "bad",
    [
        np.array([0, 2], "<u8").tobytes(),  # a half-written index: ends before the file does
        np.array([0, 2, 5, 6], "<u8").tobytes()[:-3],  # not a whole number of entries
        np.array([1, 2, 5, 6, 7], "<u8").tobytes(),  # does not start at 0
        b"",
    ],
    ids=["half-written", "ragged", "not-from-0", "empty"],
)
def test_a_damaged_cache_is_recomputed(tmp_path: Path, bad: bytes) -> None:
    path, cache, want = _small(tmp_path)
    cache.write_bytes(bad)
    _same(_docs(path), want)
    assert np.fromfile(cache, "<u8").tolist() == [0, 2, 5, 6, 7]


def test_a_stale_cache_is_recomputed(tmp_path: Path) -> None:
    path, cache, want = _small(tmp_path)
    _same(_docs(path), want)
    np.array([EOS, 3, 3, 3, 3, 3, 3], np.uint16).tofile(path)  # same size, new data
    os.utime(cache, (0, 0))  # older than the data
    _same(_docs(path), [np.array([EOS]), np.array([3] * 6)])


def test_a_special_file_in_place_of_the_cache_is_replaced_not_waited_on(tmp_path: Path) -> None:
    path, cache, want = _small(tmp_path)
    os.mkfifo(cache)
    with no_hang(10):
        _same(_docs(path), want)
    assert cache.is_file()


def test_without_a_writable_directory_no_cache_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, cache, want = _small(tmp_path)

    def read_only(directory: Any, prefix: str) -> tuple[int, str]:
        raise PermissionError(13, "Read-only file system", os.fspath(directory))

    monkeypatch.setattr(interop_module, "create_unique", read_only)
    tmpdir = Path(tempfile.gettempdir())
    before = set(tmpdir.iterdir())
    src = tokload.open_flat(path, np.uint16, eos=EOS)
    d = Documents(src)
    _same([np.asarray(d[i]) for i in range(len(d))], want)
    assert not cache.exists()
    src.close()
    assert set(tmpdir.iterdir()) <= before  # the private index is gone with the source
    _same(_docs(path), want)  # a source that is only garbage-collected cleans up too
    gc.collect()
    assert set(tmpdir.iterdir()) <= before
