"""bench/delayfs: the latency-injecting FUSE passthrough that bench_stall reads through.

Skipped unless this is root with /dev/fuse, fusermount3, a C compiler and libfuse3's
headers (``apt-get install libfuse3-dev fuse3 pkg-config``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

SRC = Path(__file__).resolve().parents[1] / "bench" / "delayfs" / "delayfs.c"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "mounting FUSE needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    for tool in ("fusermount3", "cc", "pkg-config"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    if subprocess.run(["pkg-config", "--exists", "fuse3"], check=False).returncode:
        return "no libfuse3 headers (apt-get install libfuse3-dev)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


@pytest.fixture(scope="module")
def delayfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("delayfs") / "delayfs"
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "fuse3"], check=True, capture_output=True, text=True
    ).stdout.split()
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", str(SRC), "-o", str(exe), *flags], check=True)
    return exe


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("source")
    rng = np.random.default_rng(5)
    (d / "a.bin").write_bytes(rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    (d / "sub").mkdir()
    (d / "sub" / "b.bin").write_bytes(rng.integers(0, 256, 100_003, dtype=np.uint8).tobytes())
    return d


@contextmanager
def mount(
    exe: Path, source: Path, mnt: Path, opts: str, stats: dict[str, int] | None = None
) -> Iterator[Path]:
    mnt.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [str(exe), str(source), str(mnt), "-f", "-o", opts + ",max_threads=64"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            assert proc.poll() is None, "delayfs exited before mounting"
            assert time.monotonic() < deadline, "delayfs did not mount within 10 s"
            time.sleep(0.02)
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        _, err = proc.communicate(timeout=10)
        line = [ln for ln in err.splitlines() if ln.startswith("delayfs: reads")]
        if stats is not None:
            words = line[-1].split()
            stats.update(reads=int(words[2]), delayed=int(words[4]), bytes=int(words[6]))


def _pread_cold(path: Path, size: int, offset: int) -> tuple[bytes, float]:
    """One read that reaches the daemon: a fresh open drops delayfs's page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        t0 = time.perf_counter()
        data = os.pread(fd, size, offset)
        return data, time.perf_counter() - t0
    finally:
        os.close(fd)


def test_bytes_through_it_are_the_files_bytes(delayfs: Path, source: Path, tmp_path: Path) -> None:
    stats: dict[str, int] = {}
    with mount(delayfs, source, tmp_path / "m", "fraction=0", stats) as m:
        assert sorted(p.name for p in m.iterdir()) == ["a.bin", "sub"]
        for rel in ("a.bin", "sub/b.bin"):
            assert (m / rel).read_bytes() == (source / rel).read_bytes()
            assert (m / rel).stat().st_size == (source / rel).stat().st_size
        mm = np.memmap(m / "a.bin", dtype=np.uint8, mode="r")  # a shared mapping works
        ref = np.fromfile(source / "a.bin", dtype=np.uint8)
        assert np.array_equal(mm[12345:2_000_000], ref[12345:2_000_000])
        del mm
        assert (
            _pread_cold(m / "sub" / "b.bin", 10, 100_000)[0]
            == (source / "sub" / "b.bin").read_bytes()[100_000:]
        )
        with pytest.raises(OSError, match="Read-only file system"):
            open(m / "a.bin", "r+b")  # noqa: SIM115
        with pytest.raises(FileNotFoundError):
            (m / "missing.bin").read_bytes()
    assert stats["reads"] > 0 and stats["delayed"] == 0


def test_a_delayed_read_takes_at_least_the_delay(
    delayfs: Path, source: Path, tmp_path: Path
) -> None:
    stats: dict[str, int] = {}
    with mount(delayfs, source, tmp_path / "m", "fraction=1,delay_ms=150", stats) as m:
        for off in (0, 1 << 20, (3 << 20) - 5000):
            data, took = _pread_cold(m / "a.bin", 4096, off)
            assert data == (source / "a.bin").read_bytes()[off : off + 4096]
            assert took >= 0.150, (off, took)
    assert stats["delayed"] == stats["reads"] >= 3


def test_the_base_latency_applies_to_every_read(
    delayfs: Path, source: Path, tmp_path: Path
) -> None:
    with mount(delayfs, source, tmp_path / "m", "fraction=0,base_us=20000") as m:
        for off in (0, 777_777):
            assert _pread_cold(m / "a.bin", 100, off)[1] >= 0.020


def test_concurrent_delayed_reads_overlap(delayfs: Path, source: Path, tmp_path: Path) -> None:
    """Reads in flight at once each wait the delay, side by side.

    The file is opened once per read before any read starts: an open of a delayfs
    file drops its page cache, and the kernel then waits for each page still being
    read (locked), so an open that lands while another thread's read is in flight
    waits for that read, and the reads after it would queue behind their opens (CI
    saw 2 at a time).
    """
    n, delay = 16, 0.3
    took: list[float] = []
    got: dict[int, bytes] = {}
    with mount(delayfs, source, tmp_path / "m", f"fraction=1,delay_ms={int(delay * 1000)}") as m:
        fds = [os.open(m / "a.bin", os.O_RDONLY) for _ in range(n)]
        try:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            start = threading.Barrier(n + 1, timeout=30)

            def read(k: int) -> None:
                start.wait()
                t0 = time.perf_counter()
                got[k] = os.pread(fds[k], 4096, k * 131072)
                took.append(time.perf_counter() - t0)

            threads = [threading.Thread(target=read, args=(k,)) for k in range(n)]
            for t in threads:
                t.start()
            start.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        finally:
            for fd in fds:
                os.close(fd)
    assert len(took) == n and min(took) >= delay
    data = (source / "a.bin").read_bytes()
    assert all(got[k] == data[k * 131072 : k * 131072 + 4096] for k in range(n))
    assert wall < n * delay / 2, f"{n} reads of {delay} s each took {wall:.2f} s: not overlapped"


def test_which_reads_are_delayed_depends_only_on_the_seed(
    delayfs: Path, source: Path, tmp_path: Path
) -> None:
    """The same reads under the same seed are delayed alike; another seed picks others."""
    offsets = [k * 65536 for k in range(40)]

    def delayed(seed: int) -> list[bool]:
        with mount(
            delayfs, source, tmp_path / f"m{seed}", f"fraction=0.5,delay_ms=60,seed={seed}"
        ) as m:
            return [_pread_cold(m / "a.bin", 4096, off)[1] >= 0.060 for off in offsets]

    first, again, other = delayed(1), delayed(1), delayed(2)
    assert first == again
    assert 5 <= sum(first) <= 35  # about half
    assert first != other


def test_readahead_hints_hide_a_delay(delayfs: Path, source: Path, tmp_path: Path) -> None:
    """tokload's read-ahead through a slow FUSE mount: the loader turns it on by
    itself there, a hint returns at once, and the hinted window is then read
    without the delay while another one still waits for it."""
    import tokload

    with mount(delayfs, source, tmp_path / "m", "delay_ms=300,fraction=1") as m:
        view = tokload.TokenStream(tokload.open_flat(m / "a.bin", np.uint32), window=1024)
        assert tokload.DataLoader(view, 2, num_threads=0).readahead is True  # a fuse mount
        t0 = time.perf_counter()
        view.hint([5])
        assert time.perf_counter() - t0 < 0.1
        time.sleep(0.6)
        t0 = time.perf_counter()
        hinted = view[5]
        assert time.perf_counter() - t0 < 0.1
        t0 = time.perf_counter()
        view[300]
        assert time.perf_counter() - t0 >= 0.3
        view.close()  # the mount must not be busy when it is unmounted
        flat = np.frombuffer((source / "a.bin").read_bytes(), dtype=np.uint32)
        np.testing.assert_array_equal(hinted, flat[5 * 1024 : 6 * 1024])


@pytest.mark.parametrize("memory", [True, False], ids=["index-in-memory", "index-read"])
def test_readahead_hints_a_metadata_streams_blocks_too(
    delayfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory: bool
) -> None:
    """A stream with metadata blocks: a hint covers the window's rows and its
    metadata blocks (with the block index in memory), so the read that follows
    waits on neither. With the index read per batch, the hint covers the index
    entries, and the next hint call reads them and covers the blocks: the read
    after that waits on nothing either (after one hint only, the blocks wait
    once)."""
    import tokload

    src = tmp_path / "src"
    rng = np.random.default_rng(9)
    # blocks of 4 rows: the block index (400 KB) is larger than the kernel reads ahead
    # of a read, so the entries of a window far from the first are not cached by it
    with tokload.Writer(src / "ds", "<u2", metadata=True, span_block=4) as w:
        for k in range(200):
            w.write(rng.integers(0, 65535, 1000, dtype=np.uint16), spans=[(0, 500, b"%d" % k)])
    if not memory:
        monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")
    ref = tokload.StreamWithMetadata(src / "ds", window=257)
    with mount(delayfs, src, tmp_path / "m", "delay_ms=300,fraction=1") as m:
        view = tokload.StreamWithMetadata(m / "ds", window=257)
        try:
            t0 = time.perf_counter()
            view.hint([770])  # before any read: no table to load, still at once
            assert time.perf_counter() - t0 < 0.1
            view.read([0])  # opens the files, and loads the block index when it is held
            t0 = time.perf_counter()
            view.hint([770])
            assert time.perf_counter() - t0 < 0.1
            time.sleep(0.7)
            if not memory:  # the second step: the entries are cached, their blocks advised
                t0 = time.perf_counter()
                view.hint([10])
                assert time.perf_counter() - t0 < 0.1
                time.sleep(0.7)
            t0 = time.perf_counter()
            got = view.read([770])
            took = time.perf_counter() - t0
            assert took < 0.1, took
            if not memory:  # window 10: its entries hinted, not yet its blocks
                time.sleep(0.7)
                t0 = time.perf_counter()
                view.read([10])
                assert 0.3 <= time.perf_counter() - t0 < 0.6  # one delayed read, not two
            want = ref.read([770])
            np.testing.assert_array_equal(got.fields["tokens"], want.fields["tokens"])
            np.testing.assert_array_equal(got.positions, want.positions)
            assert got.metadata == want.metadata
            t0 = time.perf_counter()
            view.read([400])  # not hinted: waits
            assert time.perf_counter() - t0 >= 0.3
        finally:
            view.close()  # the mount must not be busy when it is unmounted


def test_readahead_hints_the_blocks_of_a_table_no_read_has_loaded_yet(
    delayfs: Path, tmp_path: Path
) -> None:
    """The block index held (the default budget), but the hinted window's shard
    has not had its table loaded by a read yet: the hint advises the window's
    index entries, and the next hint call reads them and advises its blocks,
    so the read that then loads the table waits for the table only (before,
    for the table and then the blocks)."""
    import tokload

    src = tmp_path / "src"
    rng = np.random.default_rng(11)
    # 4 shards of 50,000 rows in blocks of 4: a table of 100 KB each
    with tokload.Writer(src / "ds", "<u2", metadata=True, span_block=4, shard_bytes=100_000) as w:
        for k in range(800):
            w.write(rng.integers(0, 65535, 250, dtype=np.uint16), spans=[(0, 125, b"%d" % k)])
    ref = tokload.StreamWithMetadata(src / "ds", window=257)
    assert len(ref.source.rows.files.paths) == 4
    in_shard = [i * 50_000 // 257 + 5 for i in range(4)]  # a window inside each shard
    with mount(delayfs, src, tmp_path / "m", "delay_ms=300,fraction=1") as m:
        view = tokload.StreamWithMetadata(m / "ds", window=257)
        try:
            spans = view.source.spans
            assert isinstance(spans, tokload._meta.BlockSet)
            tables = spans.tables
            view.read([in_shard[0]])  # opens the files, loads shard 0's table
            assert tables.enabled and tables.loaded() == [0]
            for i in (2, 0):  # shard 2's rows and entries; then the second step: its blocks
                t0 = time.perf_counter()
                view.hint([in_shard[i]])
                assert time.perf_counter() - t0 < 0.1
                time.sleep(0.7)
            t0 = time.perf_counter()
            got = view.read([in_shard[2]])
            took = time.perf_counter() - t0
            assert 0.3 <= took < 0.6, took  # its table: one delayed read, not two
            assert tables.loaded() == [0, 2]
            want = ref.read([in_shard[2]])
            np.testing.assert_array_equal(got.fields["tokens"], want.fields["tokens"])
            np.testing.assert_array_equal(got.positions, want.positions)
            assert got.metadata == want.metadata
            t0 = time.perf_counter()
            view.read([in_shard[3]])  # not hinted: waits for its table, then its blocks
            assert time.perf_counter() - t0 >= 0.6
        finally:
            view.close()  # the mount must not be busy when it is unmounted
