"""Host memory kept mapped between batches (``tokload._hostmem``).

A freed block goes to a bounded free list and the next request of about its
size takes it back; arrays stay valid as long as anything views them; the
limit evicts the oldest blocks; the loader's host batches use it.
"""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokload import _hostmem

MB = 1 << 20


@pytest.fixture(autouse=True)
def _empty_list() -> Iterator[None]:
    """Each test starts with no free block and the default limit, and leaves it so."""
    gc.collect()
    _hostmem.release()
    before = _hostmem.limit()
    yield
    gc.collect()
    _hostmem.set_limit(before)
    _hostmem.release()


def test_a_freed_block_serves_the_next_array_of_about_its_size() -> None:
    a = _hostmem.empty((1024, 1024), np.int32)  # 4 MiB
    addr = a.ctypes.data
    a[...] = 7
    del a
    st0 = _hostmem.stats()
    assert st0["free_blocks"] == 1 and st0["free"] == 4 * MB
    b = _hostmem.empty((1000, 1024), np.int32)  # a little smaller: the same block
    assert b.ctypes.data == addr
    assert _hostmem.stats()["reused"] == st0["reused"] + 1
    assert _hostmem.stats()["free_blocks"] == 0


def test_a_much_smaller_array_does_not_pin_a_large_block() -> None:
    a = _hostmem.empty((4 * MB,), np.uint8)
    addr = a.ctypes.data
    del a
    b = _hostmem.empty((2 * MB,), np.uint8)  # half: more than 1.25x wasted
    assert b.ctypes.data != addr
    assert _hostmem.stats()["free_blocks"] == 1


def test_small_arrays_come_from_numpy() -> None:
    a = _hostmem.empty((100,), np.int64)
    assert a.base is None  # NumPy's own memory
    assert _hostmem.stats()["mapped"] == 0


def test_a_negative_dimension_is_refused_as_numpy_refuses_it() -> None:
    msg = r"negative dimensions are not allowed, got shape \(-1, 1048576\)"
    with pytest.raises(ValueError, match=msg):
        _hostmem.empty((-1, 1 << 20), np.uint8)
    with pytest.raises(ValueError, match="negative dimensions"):
        _hostmem.empty((-1, -(1 << 20)), np.uint8)


def test_the_array_is_writable_aligned_and_of_its_shape() -> None:
    a = _hostmem.empty((3, 5, 70_000), np.float32)
    assert a.shape == (3, 5, 70_000) and a.dtype == np.float32
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % 4096 == 0
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    assert a[2, 4, 69_999] == a.size - 1


def test_a_block_stays_mapped_while_a_view_or_tensor_of_it_lives() -> None:
    torch = pytest.importorskip("torch")
    a = _hostmem.empty((1 << 20,), np.int64)
    a[:] = np.arange(1 << 20)
    t = torch.from_numpy(a)[10:20]
    view = a[100:]
    del a
    gc.collect()
    assert _hostmem.stats()["free_blocks"] == 0  # still in use
    b = _hostmem.empty((1 << 20,), np.int64)  # must not get the same memory
    b[:] = -1
    assert t.tolist() == list(range(10, 20))
    assert view[0] == 100
    del t, view
    gc.collect()
    assert _hostmem.stats()["free_blocks"] == 1


def test_the_limit_evicts_the_oldest_free_blocks() -> None:
    _hostmem.set_limit(10 * MB)
    arrays = [_hostmem.empty((4 * MB,), np.uint8) for _ in range(3)]
    first = arrays[0].ctypes.data
    mapped = _hostmem.stats()["mapped"]
    arrays.clear()  # three blocks of 4 MiB freed in order: the first is evicted
    st0 = _hostmem.stats()
    assert st0["free_blocks"] == 2 and st0["free"] == 8 * MB
    assert st0["mapped"] == mapped - 4 * MB
    got = {_hostmem.empty((4 * MB,), np.uint8).ctypes.data for _ in range(1)}
    assert first not in got
    _hostmem.set_limit(4 * MB)  # lowering the limit unmaps the oldest at once
    assert _hostmem.stats()["free"] <= 4 * MB


def test_a_block_over_the_limit_is_unmapped_when_freed() -> None:
    _hostmem.set_limit(1 * MB)
    a = _hostmem.empty((2 * MB,), np.uint8)
    mapped = _hostmem.stats()["mapped"]
    del a
    st0 = _hostmem.stats()
    assert st0["free_blocks"] == 0 and st0["mapped"] == mapped - 2 * MB


def test_limit_zero_keeps_nothing_and_release_empties_the_list() -> None:
    a = _hostmem.empty((MB,), np.uint8)
    del a
    assert _hostmem.stats()["free_blocks"] == 1
    _hostmem.release()
    assert _hostmem.stats() | {"reused": 0} == {
        "mapped": 0,
        "free": 0,
        "free_blocks": 0,
        "reused": 0,
    }
    _hostmem.set_limit(0)
    b = _hostmem.empty((MB,), np.uint8)
    del b
    assert _hostmem.stats()["free_blocks"] == 0


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(256 << 10, 6 * MB)), min_size=1, max_size=40),
    limit_mb=st.integers(0, 24),
)
def test_the_list_stays_within_its_limit_and_never_hands_out_memory_in_use(
    ops: list[tuple[bool, int]], limit_mb: int
) -> None:
    _hostmem.set_limit(limit_mb * MB)
    live: list[tuple[np.ndarray, int]] = []
    made = 0
    for alloc, size in ops:
        if alloc or not live:
            a = _hostmem.empty((size,), np.uint8)
            made += 1
            a[:] = made % 251
            live.append((a, made % 251))
        else:
            live.pop(size % len(live))
        st0 = _hostmem.stats()
        assert st0["free"] <= limit_mb * MB
        assert st0["free_blocks"] <= 64
        spans = sorted((x.ctypes.data, x.ctypes.data + x.nbytes) for x, _ in live)
        assert all(e <= a for (_, e), (a, _) in itertools.pairwise(spans))
    for a, value in live:  # no later array was given memory a live one uses
        assert (a == value).all()
    live.clear()
    assert _hostmem.stats()["free"] <= limit_mb * MB


def test_the_limit_comes_from_the_environment() -> None:
    code = "from tokload import _hostmem; print(_hostmem.limit())"
    env = {**os.environ, "TOKLOAD_HOST_CACHE_MB": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(3 * MB), out.stderr
    # A bad value: the import takes the default (a traceback at import stopped even
    # `tokload --version`, review43); a loader, or opening a dataset, names it
    loader = (
        "import tokload, numpy as np\n"
        "from tokload import _hostmem\n"
        "print(_hostmem.limit())\n"
        "with tokload.Writer('ds', '<u4') as w: w.write(np.arange(9, dtype=np.uint32))\n"
        "tokload.DataLoader(tokload.TokenStream('ds', window=4), 2)\n"
    )
    for name, value, expected in (
        ("TOKLOAD_HOST_CACHE_MB", "lots", "a whole number of MiB (>= 0)"),
        # too large for bytes in a size_t, for C's int64: named, not a bare OverflowError
        ("TOKLOAD_HOST_CACHE_MB", str(1 << 44), "a whole number of MiB (>= 0)"),
        ("TOKLOAD_MAX_OPEN_FILES", str(1 << 64), "a positive integer"),
    ):
        bad = {**os.environ, name: value}
        with tempfile.TemporaryDirectory() as d:
            out = subprocess.run(
                [sys.executable, "-c", loader], env=bad, capture_output=True, text=True, cwd=d
            )
        assert out.stdout.strip() == str(_hostmem.DEFAULT_LIMIT_MB * MB), out.stderr
        assert out.returncode != 0, out.stderr
        assert f"UsageError: {name}='{value}': expected {expected}" in out.stderr, out.stderr


def test_the_loaders_host_batches_reuse_the_blocks(tmp_path: object) -> None:
    pytest.importorskip("torch")
    import tokload

    path = os.path.join(str(tmp_path), "ds")
    with tokload.Writer(path, "<u4") as w:
        for k in range(256):
            w.write(np.arange(k * 10_000, k * 10_000 + 9_000, dtype=np.uint32))
    view = tokload.TokenStream(path, window=1024)  # tasks of 16 steps: 1 MiB of tokens
    reused = _hostmem.stats()["reused"]
    loader = tokload.DataLoader(view, 16, seed=0, num_threads=1, device=None, epochs=1)
    got, positions = [], []
    for b in loader:
        got.append(b["tokens"].clone())
        positions.append(b["position"].numpy().copy())
    loader.close()
    assert len(got) == -(-len(view) // 16)  # the last batch is short
    assert _hostmem.stats()["reused"] > reused
    for g, pos in zip(got, positions, strict=True):
        idx = loader.schedule.indices(pos.astype(np.uint64))
        want = view.read_batch(idx, np.empty)["tokens"]
        assert np.array_equal(g.numpy(), want)
