"""The I/O engine: every backend reads the same bytes and reports the same
errors as the synchronous reference; descriptors are opened lazily and bounded;
faults on the read path reach the caller naming the file and offset."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokload
from tokload import _docindex, _io, _rows
from tokload.errors import MissingShardError, TruncatedFileError

BACKENDS = ["sync", "threads", "uring"]


def _backend_or_skip(io: str) -> str:
    if io == "uring" and not _io.uring_available():
        pytest.skip(f"io_uring is not available here: {_io.uring_error()}")
    return io


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return _backend_or_skip(request.param)


@pytest.fixture(autouse=True)
def _restore_engine_settings() -> Iterator[None]:
    yield
    _io.set_max_open_files(None)
    if _io.FAULTS_BUILT:
        _io._set_fault_injection(0, 0.0)


def _shards(
    root: Path, sizes: list[int], dtype: str = "<u4", seed: int = 0
) -> tuple[list[Path], np.ndarray]:
    """Files holding consecutive values, one per size; returns paths and the whole stream."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, 2**31, size=sum(sizes)).astype(dtype)
    paths, at = [], 0
    for k, n in enumerate(sizes):
        p = root / f"s{k:05d}.bin"
        stream[at : at + n].tofile(p)
        paths.append(p)
        at += n
    return paths, stream


def _rowset(
    paths: list[Path], sizes: list[int], itemsize: int, io: str, depth: int = 8
) -> _rows.RowSet:
    return _rows.RowSet(_io.FileSet(paths, io=io, queue_depth=depth), sizes, itemsize)


# ---- same bytes on every path ----------------------------------------------------


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12).filter(lambda s: sum(s) >= 2),
    data=st.data(),
)
def test_windows_equal_the_stream_on_every_backend(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], data: st.DataObject
) -> None:
    root = tmp_path_factory.mktemp("layout")
    paths, stream = _shards(root, sizes)
    total = len(stream)
    window = data.draw(st.integers(1, total), label="window")
    stride = data.draw(st.integers(1, max(1, total)), label="stride")
    count = (total - window) // stride + 1
    idx = np.array(
        data.draw(st.lists(st.integers(0, count - 1), max_size=40), label="idx"), dtype=np.int64
    )
    depth = data.draw(st.sampled_from([1, 2, 7, 64]), label="depth")
    expect = np.stack([stream[i * stride : i * stride + window] for i in idx]) if len(idx) else None
    for io in BACKENDS:
        if io == "uring" and not _io.uring_available():
            continue
        rows = _rowset(paths, sizes, 4, io, depth)
        out = np.full((len(idx), window), 0xDEAD, dtype=np.uint32)
        rows.read_windows(idx, 0, count, stride, window, out)
        if expect is not None:
            np.testing.assert_array_equal(out, expect, err_msg=f"io={io} depth={depth}")
        rows.files.close()


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=8).filter(lambda s: sum(s) >= 1),
    data=st.data(),
)
def test_row_ranges_equal_the_stream_on_every_backend(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], data: st.DataObject
) -> None:
    root = tmp_path_factory.mktemp("ranges")
    paths, stream = _shards(root, sizes, dtype="<u2", seed=1)
    total = len(stream)
    ranges = data.draw(
        st.lists(st.tuples(st.integers(0, total - 1), st.integers(0, total)), max_size=20),
        label="ranges",
    )
    starts = [s for s, _ in ranges]
    lengths = [min(n, total - s) for s, n in ranges]
    offsets = (np.cumsum([0, *lengths])[:-1] * 2).astype(np.uint64)
    expect = np.concatenate(
        [stream[s : s + n] for s, n in zip(starts, lengths, strict=True)] or [np.zeros(0, "<u2")]
    )
    for io in BACKENDS:
        if io == "uring" and not _io.uring_available():
            continue
        rows = _rowset(paths, sizes, 2, io)
        out = np.zeros(len(expect), dtype="<u2")
        rows.read(starts, lengths, offsets, out)
        np.testing.assert_array_equal(out, expect, err_msg=f"io={io}")


def test_parts_sharing_one_out_are_each_checked_and_read(tmp_path: Path) -> None:
    """``read_ranges`` checks the bytes of an ``out`` that several parts share once
    (a blend's components read into one batch), yet every part's ranges and
    destinations against it; a part of another row size into the same bytes
    checks them again."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, sa = _shards(tmp_path / "a", [50, 30], dtype="<u4", seed=1)
    pb, sb = _shards(tmp_path / "b", [40], dtype="<u4", seed=2)
    a, b = _rowset(pa, [50, 30], 4, "sync"), _rowset(pb, [40], 4, "sync")
    out = np.zeros(12, dtype="<u4")
    u64 = np.uint64
    parts = [
        (a, np.array([45], u64), np.array([10], u64), np.array([0], u64), out),
        (b, np.array([3], u64), np.array([2], u64), np.array([40], u64), out),
    ]
    _rows.read_ranges(parts)
    np.testing.assert_array_equal(out, np.concatenate([sa[45:55], sb[3:5]]))
    late = (b, np.array([3], u64), np.array([2], u64), np.array([44], u64), out)
    with pytest.raises(ValueError, match="a destination range runs past the end of out"):
        _rows.read_ranges([parts[0], late])
    with pytest.raises(IndexError, match=r"rows \[39, 41\) are not within \[0, 40\)"):
        _rows.read_ranges([parts[0], (b, np.array([39], u64), *late[2:4], out)])
    wide = _rowset(pb, [20], 8, "sync")  # the same bytes as 8-byte rows
    got = out.view(np.uint8)
    got[:] = 0
    _rows.read_ranges(
        [
            (a, np.array([0], u64), np.array([2], u64), np.array([0], u64), got),
            (wide, np.array([1], u64), np.array([5], u64), np.array([8], u64), got),
        ]
    )
    np.testing.assert_array_equal(out, np.concatenate([sa[0:2], sb[2:12]]))
    with pytest.raises(ValueError, match="a destination range runs past the end of out"):
        _rows.read_ranges(
            [
                (a, np.array([0], u64), np.array([2], u64), np.array([0], u64), got),
                (wide, np.array([1], u64), np.array([6], u64), np.array([8], u64), got),
            ]
        )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layouts=st.lists(
        st.lists(st.integers(0, 120), min_size=1, max_size=4).filter(lambda s: sum(s) >= 1),
        min_size=1,
        max_size=6,
    ),
    data=st.data(),
)
def test_a_gather_part_reads_each_range_from_its_own_set(
    tmp_path_factory: pytest.TempPathFactory, layouts: list[list[int]], data: st.DataObject
) -> None:
    """``RowSets(sets).at(which)``: range ``i`` from ``sets[which[i]]``, the sets on
    backends of their own (one engine call per backend), beside a plain part
    into the same ``out``; every byte as the streams hold it."""
    root = tmp_path_factory.mktemp("gather")
    ios = [io for io in BACKENDS if io != "uring" or _io.uring_available()]
    sets, streams = [], []
    for k, sizes in enumerate(layouts):
        (root / f"set{k}").mkdir()
        paths, stream = _shards(root / f"set{k}", sizes, seed=k)
        io = data.draw(st.sampled_from(ios), label=f"io of set {k}")
        sets.append(_rowset(paths, sizes, 4, io))
        streams.append(stream)
    ranges = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(sets) - 1), st.floats(0, 1), st.integers(0, 50)),
            max_size=30,
        ),
        label="ranges",
    )
    which = np.array([c for c, _, _ in ranges], dtype=np.int64)
    starts = np.array(
        [int(f * (len(streams[c]) - 1)) for c, f, _ in ranges], dtype=np.uint64
    ).reshape(-1)
    lengths = np.array(
        [min(n, len(streams[c]) - int(s)) for (c, _, n), s in zip(ranges, starts, strict=True)],
        dtype=np.uint64,
    ).reshape(-1)
    want = [streams[c][s : s + n] for c, s, n in zip(which, starts, lengths, strict=True)]
    plain = streams[0][: min(7, len(streams[0]))]
    n = int(lengths.sum())
    dst = (np.cumsum([0, *lengths.tolist()])[:-1] * 4).astype(np.uint64)
    out = np.full(n + len(plain), 0xDEAD, dtype=np.uint32)
    u64 = np.uint64
    before = _io.io_counters()["calls"]
    _rows.read_ranges(
        [
            (_rows.RowSets(sets).at(which), starts, lengths, dst, out),
            (sets[0], [0], [len(plain)], np.array([n * 4], u64), out),
        ]
    )
    np.testing.assert_array_equal(out, np.concatenate([*want, plain]))
    used = {sets[c].files.io for c, n in zip(which, lengths, strict=True) if n}
    used.add(sets[0].files.io)
    assert _io.io_counters()["calls"] - before == len(used)


def test_a_gather_part_is_checked_before_any_read(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, sa = _shards(tmp_path / "a", [50, 30], seed=1)
    pb, sb = _shards(tmp_path / "b", [40], seed=2)
    a, b = _rowset(pa, [50, 30], 4, "sync"), _rowset(pb, [40], 4, "sync")
    both = _rows.RowSets([a, b])
    assert len(both) == 2 and both.sets == (a, b) and both.row_bytes == 4
    u64 = np.uint64
    out = np.zeros(8, dtype="<u4")

    def read(which: list[int], starts: list[int], lengths: list[int], dst: list[int]) -> None:
        s, n, d = (np.array(a, u64) for a in (starts, lengths, dst))
        _rows.read_ranges([(both.at(which), s, n, d, out)])

    read([1, 0], [38, 78], [2, 2], [0, 8])
    np.testing.assert_array_equal(out, [*sb[38:40], *sa[78:80], 0, 0, 0, 0])
    out[:] = 0
    with pytest.raises(IndexError, match=r"rows \[39, 41\) of set 1 are not within \[0, 40\)"):
        read([0, 1], [0, 39], [2, 2], [0, 8])
    with pytest.raises(IndexError, match=r"which\[1\] = 2 names no set of 2"):
        read([0, 2], [0, 0], [2, 2], [0, 8])
    with pytest.raises(IndexError, match=r"which\[0\] = -1 names no set of 2"):
        read([-1], [0], [1], [0])
    with pytest.raises(ValueError, match="a destination range runs past the end of out"):
        read([0, 1], [0, 0], [2, 2], [0, 28])
    with pytest.raises(ValueError, match="which, starts, lengths and dst_offsets must have"):
        read([0], [0, 1], [1, 1], [0, 4])
    assert not out.any()  # nothing was read by a refused call
    with pytest.raises(ValueError, match=r"RowSets needs one row size, got \[4, 8\] bytes"):
        _rows.RowSets([a, _rowset(pb, [20], 8, "sync")])
    with pytest.raises(TypeError, match=r"sets\[1\] is a str, not a RowSet"):
        _rows.RowSets([a, "b"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="RowSets needs at least one RowSet"):
        _rows.RowSets([])
    b.files.close()
    with pytest.raises(ValueError, match="closed"):
        read([1], [0], [1], [0])
    read([0], [3], [1], [0])  # a closed set that no range uses is not in the way
    assert out[0] == sa[3]


def test_a_gather_part_names_the_file_of_the_range_that_failed(
    tmp_path: Path, backend: str
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, _ = _shards(tmp_path / "a", [10, 10], seed=1)
    pb, _ = _shards(tmp_path / "b", [10, 10], seed=2)
    both = _rows.RowSets([_rowset(pa, [10, 10], 4, backend), _rowset(pb, [10, 10], 4, backend)])
    pb[1].unlink()
    u64 = np.uint64
    part = (both.at([0, 1, 0]), [12, 14, 0], [3, 3, 3], np.array([0, 12, 24], u64))
    with pytest.raises(MissingShardError) as e:
        _rows.read_ranges([(*part, np.zeros(9, np.uint32))])
    assert e.value.filename == str(pb[1])
    assert "while reading rows [14, 17) (12 bytes at offset 16)" in str(e.value)


def test_empty_reads_need_no_buffer(tmp_path: Path, backend: str) -> None:
    # Zero-length ranges into an empty buffer: valid in debug builds too.
    paths, _ = _shards(tmp_path, [5, 0, 3])
    rows = _rowset(paths, [5, 0, 3], 4, backend)
    rows.read([0, 5, 7], [0, 0, 0], [0, 0, 0], np.zeros(0, np.uint32))
    rows.read_windows([0, 1], 0, 8, 1, 0, np.zeros((2, 0), np.uint32))


def test_metadata_with_only_empty_records_reads_the_same(tmp_path: Path, backend: str) -> None:
    dtype = [("token", "<u4"), ("metadata_id", "<u4")]
    with tokload.Writer(tmp_path / "d", dtype, metadata=True, durable=False) as w:
        w.write({"token": np.arange(10, dtype=np.uint32)}, spans=[(0, 4, b""), (6, 9, b"")])
    view = tokload.StreamWithMetadata(tmp_path / "d", window=10)
    meta = view.source.meta
    assert meta is not None
    meta.index_files.configure(io=backend)
    meta.data_files.configure(io=backend)
    b = view[0]
    assert list(b.metadata) == [b"", b""]
    assert b.positions.tolist() == [0, 0, 0, 0, -1, -1, 1, 1, 1, -1]


def test_documents_and_metadata_read_the_same_on_every_backend(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, size=int(n)).astype(np.uint32) for n in rng.integers(0, 50, 200)]
    with tokload.Writer(tmp_path / "d", durable=False, shard_bytes=800) as w:
        for d in docs:
            w.write(d)
    ids = rng.integers(0, len(docs), 100)
    for io in BACKENDS:
        if io == "uring" and not _io.uring_available():
            continue
        view = tokload.Documents(tmp_path / "d")
        assert isinstance(view.source.docs, _docindex.DocIndex)
        view.source.docs.files.configure(io=io)
        view.source.rows.files.configure(io=io)
        _, lengths = view.source.docs.extents(ids)
        got = [view[int(i)] for i in ids]
        for i, g in zip(ids, got, strict=True):
            np.testing.assert_array_equal(np.asarray(g).reshape(-1), docs[i], err_msg=f"io={io}")
        assert lengths.tolist() == [len(docs[i]) for i in ids]


# ---- descriptors -----------------------------------------------------------------


def _open_count(directory: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
                n += 1
        except OSError:
            pass
    return n


def test_files_open_lazily_and_only_when_read(tmp_path: Path, backend: str) -> None:
    paths, stream = _shards(tmp_path, [100] * 10)
    rows = _rowset(paths, [100] * 10, 4, backend)
    assert rows.files.fds() == [-1] * 10 and _open_count(tmp_path) == 0
    out = np.zeros((2, 50), np.uint32)
    rows.read_windows([3, 7], 0, 20, 50, 50, out)  # rows 150..200 and 350..400: shards 1, 3
    np.testing.assert_array_equal(out, [stream[150:200], stream[350:400]])
    opened = [k for k, fd in enumerate(rows.files.fds()) if fd >= 0]
    assert opened == [1, 3]
    assert _open_count(tmp_path) == 2
    rows.files.close()
    assert _open_count(tmp_path) == 0
    with pytest.raises(ValueError, match="I/O on a closed dataset"):
        rows.read_windows([0], 0, 20, 50, 50, out)


def test_a_token_stream_never_opens_the_document_index(tmp_path: Path) -> None:
    with tokload.Writer(tmp_path / "d", durable=False, shard_bytes=400) as w:
        for k in range(20):
            w.write(np.arange(k, k + 30, dtype=np.uint32))
    view = tokload.TokenStream(tmp_path / "d", window=64)
    view.read(np.arange(len(view)), out=view.empty(len(view)))
    assert isinstance(view.source.docs, _docindex.DocIndex)
    assert view.source.docs.files.fds() == [-1] * view.source.docs.files.nfiles
    mine = str(tmp_path / "d")  # (other tests' views may not be collected yet)
    assert not any(
        (p := os.readlink(f"/proc/self/fd/{fd}")).endswith(".docs") and p.startswith(mine)
        for fd in os.listdir("/proc/self/fd")
        if os.path.islink(f"/proc/self/fd/{fd}")
    )


def test_descriptors_stay_within_the_bound_under_concurrent_reads(
    tmp_path: Path, backend: str
) -> None:
    # 40 shards, at most 3 descriptors, 4 Python threads reading windows that
    # span shards: a descriptor closed under a read in flight and reused for
    # another file would show up as wrong bytes.
    sizes = [int(s) for s in np.random.default_rng(2).integers(1, 60, 40)]
    paths, stream = _shards(tmp_path, sizes, seed=2)
    _io.set_max_open_files(3)
    assert _io.max_open_files() == 3
    rows = _rowset(paths, sizes, 4, backend, depth=16)
    window, total = 37, len(stream)
    count = total - window + 1
    errors: list[BaseException] = []
    peak = [0]

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                idx = rng.integers(0, count, 24)
                out = np.zeros((24, window), np.uint32)
                rows.read_windows(idx, 0, count, 1, window, out)
                np.testing.assert_array_equal(out, np.stack([stream[i : i + window] for i in idx]))
                peak[0] = max(peak[0], _io.open_files())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    # Pinned files may exceed the bound while read; idle ones never stay open beyond it.
    assert _io.open_files() <= 3
    assert peak[0] <= 3 + 4 * 16
    assert _open_count(tmp_path) <= 3


def test_max_open_files_setter_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _io.max_open_files()
    # (2.7 ran as 2, True as 1, "3" as 3: review45)
    for bad in (0, 2.7, True, "3"):
        with pytest.raises(
            ValueError, match=f"max_open_files must be an integer >= 1, got {bad!r}"
        ):
            _io.set_max_open_files(bad)  # type: ignore[arg-type]
    assert _io.max_open_files() == before
    monkeypatch.setenv("TOKLOAD_MAX_OPEN_FILES", "17")
    _io.set_max_open_files(None)
    assert _io.max_open_files() == 17
    monkeypatch.setenv("TOKLOAD_MAX_OPEN_FILES", "lots")
    with pytest.raises(
        ValueError, match="TOKLOAD_MAX_OPEN_FILES='lots': expected a positive integer"
    ):
        _io.set_max_open_files(None)


_ULIMIT_CHILD = textwrap.dedent(
    """
    import os, resource, sys, threading
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    import numpy as np
    import tokload
    from tokload import _io

    root = sys.argv[1]
    bound = _io.max_open_files()
    assert bound == 64, bound

    def held():
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink("/proc/self/fd/" + fd).startswith(root)
            except OSError:
                pass
        return n

    view = tokload.TokenStream(root, window=100, stride=50)
    loader = tokload.DataLoader(view, batch_size=16, num_threads=2, epochs=1, seed=3)
    peak, seen, batches = 0, 0, 0
    for batch in loader:
        peak = max(peak, held())
        seen += batch["tokens"].shape[0]
        batches += 1
    assert seen == len(view), (seen, len(view))
    print("peak", peak, "bound", bound, "batches", batches, "docs", sum(
        os.readlink("/proc/self/fd/" + fd).endswith(".docs") for fd in os.listdir("/proc/self/fd")
        if os.path.islink("/proc/self/fd/" + fd)))
    """
)


def _run_child(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``code`` run by a new interpreter with ``args``, without the test process's
    TOKLOAD_MAX_OPEN_FILES (the child sets its own limits)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "TOKLOAD_MAX_OPEN_FILES"},
    )


_FEW_DESCRIPTORS_CHILD = textwrap.dedent(
    """
    import os, resource, sys, time
    import numpy as np
    from tokload import _io, _rows

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    root, free = sys.argv[1], int(sys.argv[2])
    paths = sorted(os.path.join(root, f) for f in os.listdir(root))
    backends = ["sync", "threads"] + (["uring"] if _io.uring_available() else [])
    windows = np.random.default_rng(0).permutation(len(paths) * 10 - 1)[:300]
    held = []  # the rest of the process (a trainer's sockets and logs) holds the others
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    for fd in held[len(held) - free :]:
        os.close(fd)
    for io in backends:
        _io.set_max_open_files(None)  # 16: more than the process has left
        files = _io.FileSet(paths, io=io, queue_depth=64)
        rows = _rows.RowSet(files, [100] * len(paths), 4)
        out = np.zeros((len(windows), 15), np.uint32)
        t0 = time.monotonic()
        try:
            rows.read_windows(windows, 0, len(paths) * 10 - 1, 10, 15, out)
            print(io, "ok", int(out.astype(np.int64).sum()))
        except OSError as e:
            print(io, "error", e.errno, time.monotonic() - t0)
        files.close()
    """
)


@pytest.mark.parametrize("free", [1, 3, 0])
def test_every_backend_reads_when_the_process_is_short_of_descriptors(
    tmp_path: Path, free: int
) -> None:
    """With fewer descriptors left in the process than the bound, ``threads`` and
    ``uring`` failed with EMFILE where ``sync`` read (review45): a thread out of
    descriptors waited holding a reservation of a file another thread had opened,
    whose descriptor its pin then kept from being closed; and io_uring never
    completed a read of its own to free one. With none left at all, each backend
    reports EMFILE at once (threads out of descriptors do not wait for each other)."""
    _shards(tmp_path, [100] * 60)
    child = _run_child(_FEW_DESCRIPTORS_CHILD, str(tmp_path), str(free), timeout=120)
    assert child.returncode == 0, child.stderr
    lines = [line.split() for line in child.stdout.splitlines()]
    assert len(lines) >= 2
    if free:
        assert {w[1] for w in lines} == {"ok"} and len({w[2] for w in lines}) == 1, lines
    else:
        assert all(w[1:3] == ["error", str(errno.EMFILE)] for w in lines), lines
        assert all(float(w[3]) < 1 for w in lines), lines


def test_io_uring_probed_out_of_descriptors_is_probed_again() -> None:
    """A probe of io_uring that found the process out of descriptors cached
    "unavailable" for good: ``io="auto"`` read with threads, and ``io="uring"``
    failed, for the rest of the process (review46)."""
    _backend_or_skip("uring")
    code = textwrap.dedent(
        """
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from tokload import _io
        held = []
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        print(_io.uring_available(), _io.resolve_io("auto"))
        for fd in held:
            os.close(fd)
        print(_io.uring_available(), _io.resolve_io("auto"))
        """
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["False", "threads", "True", "uring"], child.stdout


@pytest.mark.slow
def test_three_thousand_shards_stream_under_ulimit_256(tmp_path: Path) -> None:
    # Written by hand as FORMAT.md specifies (the Writer rewrites its manifest
    # per shard, which takes minutes at 3,000 shards): one document per shard.
    root = tmp_path / "many"
    root.mkdir()
    shards = []
    for k in range(3000):
        np.full(100, k, dtype="<u4").tofile(root / f"s{k:04d}.rows")
        np.array([0, 100], dtype="<u8").tofile(root / f"s{k:04d}.docs")
        shards.append(
            {
                "name": f"s{k:04d}",
                "rows": 100,
                "documents": 1,
                "metadata_records": 0,
                "metadata_bytes": 0,
            }
        )
    manifest = {
        "format": "tokload",
        "version": 1,
        "dtype": "<u4",
        "documents": True,
        "metadata": False,
    }
    (root / "manifest.json").write_text(json.dumps({**manifest, "shards": shards, "user": {}}))
    child = _run_child(_ULIMIT_CHILD, str(root), timeout=300)
    assert child.returncode == 0, child.stderr
    words = child.stdout.split()
    peak, bound, docs = int(words[1]), int(words[3]), int(words[7])
    assert 0 < peak <= bound == 64
    assert docs == 0


# ---- errors ----------------------------------------------------------------------


def test_a_file_truncated_after_opening_is_reported_on_every_backend(
    tmp_path: Path, backend: str
) -> None:
    paths, _ = _shards(tmp_path, [100, 100, 100])
    rows = _rowset(paths, [100] * 3, 4, backend)
    out = np.zeros((4, 30), np.uint32)
    rows.read_windows([0, 4, 8], 0, 10, 30, 30, out)  # opens all three
    os.truncate(paths[1], 40 * 4)
    with pytest.raises(TruncatedFileError) as e:
        rows.read_windows([0, 1, 4, 5], 0, 10, 30, 30, out)  # window 4 = rows 120..150 ends early
    msg = str(e.value)
    assert str(paths[1]) in msg
    assert "file ended at byte 160 while reading rows [120, 150) (120 bytes at offset 80)" in msg


def test_a_file_deleted_before_its_first_read_names_the_file(tmp_path: Path, backend: str) -> None:
    paths, _ = _shards(tmp_path, [10, 10])
    rows = _rowset(paths, [10, 10], 4, backend)
    paths[1].unlink()
    with pytest.raises(MissingShardError) as e:
        rows.read_windows([0, 1, 2], 0, 4, 5, 5, np.zeros((3, 5), np.uint32))
    assert e.value.errno == errno.ENOENT
    assert e.value.filename == str(paths[1])
    assert "while reading rows [10, 15) (20 bytes at offset 0)" in str(e.value)


def test_a_fifo_put_in_place_after_opening_is_refused_not_waited_on(
    tmp_path: Path, backend: str
) -> None:
    paths, _ = _shards(tmp_path, [10, 10])
    rows = _rowset(paths, [10, 10], 4, backend)
    paths[1].unlink()
    os.mkfifo(paths[1])  # no writer: a blocking open would wait forever
    with pytest.raises(OSError) as e:
        rows.read_windows([2], 0, 4, 5, 5, np.zeros((1, 5), np.uint32))
    assert e.value.errno == errno.EINVAL
    assert e.value.filename == str(paths[1])


def test_a_failing_descriptor_reports_the_first_failing_read(tmp_path: Path, backend: str) -> None:
    # A directory opens read-only but every read of it fails with EISDIR.
    # Windows 3.. live in the two "shards" that are directories; the lowest
    # failing window is reported whatever completes first.
    paths, _ = _shards(tmp_path, [30, 30])
    bad = [tmp_path / "dir_a", tmp_path / "dir_b"]
    for d in bad:
        d.mkdir()
    rows = _rowset([*paths, *bad], [30, 30, 30, 30], 4, backend, depth=32)
    idx = np.array([0, 1, 7, 2, 5, 3, 6, 4, 1, 0], dtype=np.int64)
    with pytest.raises(OSError) as e:
        rows.read_windows(idx, 0, 12, 10, 10, np.zeros((10, 10), np.uint32))
    assert e.value.errno == errno.EISDIR
    assert e.value.filename == str(bad[0])  # window 7 = rows 70..80 comes first in the batch
    assert "while reading rows [70, 80) (40 bytes at offset 40)" in str(e.value)


# ---- configuration ---------------------------------------------------------------


def test_backend_and_depth_are_chosen_and_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    paths, _ = _shards(tmp_path, [4])
    monkeypatch.delenv("TOKLOAD_IO", raising=False)
    monkeypatch.delenv("TOKLOAD_IO_DEPTH", raising=False)
    fs = _io.FileSet(paths)
    assert fs.io == ("uring" if _io.uring_available() else "threads")
    assert fs.queue_depth == _io.DEFAULT_QUEUE_DEPTH
    fs.configure(io="sync", queue_depth=3)
    assert (fs.io, fs.queue_depth) == ("sync", 3)
    with pytest.raises(ValueError, match=r"io='fast': expected one of auto, uring, threads, sync"):
        fs.configure(io="fast")
    with pytest.raises(ValueError, match=r"queue_depth=0: expected an integer in \[1, 256\]"):
        fs.configure(queue_depth=0)
    monkeypatch.setenv("TOKLOAD_IO", "threads")
    monkeypatch.setenv("TOKLOAD_IO_DEPTH", "5")
    fs = _io.FileSet(paths)
    assert (fs.io, fs.queue_depth) == ("threads", 5)
    monkeypatch.setenv("TOKLOAD_IO", "aio")
    with pytest.raises(
        ValueError, match=r"TOKLOAD_IO='aio': expected one of auto, uring, threads, sync"
    ):
        _io.FileSet(paths)
    monkeypatch.setenv("TOKLOAD_IO", "sync")
    monkeypatch.setenv("TOKLOAD_IO_DEPTH", "999")
    with pytest.raises(
        ValueError, match=r"TOKLOAD_IO_DEPTH='999': expected an integer in \[1, 256\]"
    ):
        _io.FileSet(paths)


def test_threads_backend_grows_its_pool_to_the_depth(tmp_path: Path) -> None:
    paths, stream = _shards(tmp_path, [1000])
    rows = _rowset(paths, [1000], 4, "threads", depth=6)
    out = np.zeros((50, 10), np.uint32)
    rows.read_windows(np.arange(50), 0, 100, 10, 10, out)
    np.testing.assert_array_equal(out.reshape(-1), stream[:500])
    assert _io._pool_threads() >= 5


def test_a_forked_child_reads_with_every_backend(tmp_path: Path) -> None:
    paths, stream = _shards(tmp_path, [500, 500])
    sets = {
        io: _rowset(
            paths,
            [500, 500],
            4,
            _backend_or_skip(io) if io != "uring" or _io.uring_available() else "threads",
            8,
        )
        for io in BACKENDS
    }
    out = np.zeros((20, 40), np.uint32)
    for rows in sets.values():  # parent: pool threads and rings exist now
        rows.read_windows(np.arange(20), 0, 24, 40, 40, out)
    pid = os.fork()
    if pid == 0:  # child: a pool without threads would hang; rings are the parent's
        code = 0
        try:
            for rows in sets.values():
                out[:] = 0
                rows.read_windows(np.arange(20)[::-1], 0, 24, 40, 40, out)
                if not np.array_equal(out[::-1].reshape(-1), stream[:800]):
                    code = 1
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# ---- fault injection (debug builds) ----------------------------------------------


def test_fault_injection_is_refused_in_release_builds() -> None:
    if _io.FAULTS_BUILT:
        pytest.skip("a debug build: fault injection is available")
    with pytest.raises(RuntimeError, match="fault injection needs a debug build"):
        _io._set_fault_injection(1, 0.1)


needs_faults = pytest.mark.skipif(
    not _io.FAULTS_BUILT, reason="fault injection needs TOKLOAD_DEBUG=1"
)


@needs_faults
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_transient_faults_change_nothing(tmp_path: Path, backend: str, seed: int) -> None:
    sizes = [97, 3, 0, 250, 41]
    paths, stream = _shards(tmp_path, sizes, seed=seed)
    rows = _rowset(paths, sizes, 4, backend, depth=16)
    _io._set_fault_injection(seed, 0.4, kinds=("short", "eintr", "eagain"))
    rng = np.random.default_rng(seed)
    for _ in range(20):
        idx = rng.integers(0, len(stream) - 64, 32)
        out = np.zeros((32, 64), np.uint32)
        rows.read_windows(idx, 0, len(stream) - 63, 1, 64, out)
        np.testing.assert_array_equal(out, np.stack([stream[i : i + 64] for i in idx]))


@needs_faults
def test_injected_eio_names_the_file_and_offset(tmp_path: Path, backend: str) -> None:
    paths, _ = _shards(tmp_path, [100, 100])
    rows = _rowset(paths, [100, 100], 4, backend, depth=8)
    _io._set_fault_injection(7, 1.0, kinds=("eio",))
    with pytest.raises(OSError) as e:
        rows.read_windows([15, 2, 9], 0, 20, 10, 10, np.zeros((3, 10), np.uint32))
    assert e.value.errno == errno.EIO
    assert e.value.filename == str(paths[1])
    assert "Input/output error while reading rows [150, 160) (40 bytes at offset 200)" in str(
        e.value
    )


def test_a_refused_io_setting_changes_no_file(tmp_path: Path) -> None:
    """``configure_io("sync", 0)`` switched the first of a dataset's file sets to
    ``sync`` before it refused the depth: the dataset read with mixed engines
    (review45)."""
    meta = tmp_path / "meta"
    with tokload.Writer(meta, "<u4", metadata=True) as w:
        for k in range(20):
            w.write(np.arange(50, dtype=np.uint32), spans=[(0, 10, b"r%d" % k)])
    view = tokload.StreamWithMetadata(meta, window=8)
    blend = tokload.Blend([(view, 1.0), (tokload.StreamWithMetadata(meta, window=8), 1.0)],
                          length=10)  # fmt: skip
    sets = [f for f in view.source._closers if isinstance(f, _io.FileSet)]
    assert len(sets) > 1
    before = [(f.io, f.queue_depth) for f in sets]
    for target in (view, blend):
        with pytest.raises(ValueError, match=r"queue_depth=0: expected an integer in \[1, "):
            target.configure_io("sync", 0)
        with pytest.raises(ValueError, match="io='fast': expected one of"):
            target.configure_io("fast", 8)
        assert [(f.io, f.queue_depth) for f in sets] == before
    view.configure_io("sync", 8)
    assert {(f.io, f.queue_depth) for f in sets} == {("sync", 8)}
