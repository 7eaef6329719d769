"""The seams between tokload's C core and what it does not own: the caller's ``out``
buffers, the kernel's io_uring, and a process forked under the engine.

1. Every binding that writes into a caller's ``out`` refuses one it cannot fill in
   place (strided, Fortran-ordered, read-only, of the wrong item size or size) with
   a ValueError naming what it expected and what it got, before any read: a copy
   filled in its place would leave ``out`` as it was, with no error.
2. When ``io_uring_enter`` fails for good, every read the kernel may still be doing
   into the caller's buffer is waited for before the error is raised (debug builds
   inject the failure).
3. A forked child's descriptor cache holds no pins of the parent's threads: it can
   read, evict and close every file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

import tokload
from tokload import _io, _meta, _metaids, _permute, _rows

# ---- helpers ----------------------------------------------------------------------


def _shards(root: Path, sizes: list[int], dtype: str = "<u4") -> tuple[list[Path], np.ndarray]:
    stream = np.arange(1, sum(sizes) + 1).astype(dtype)
    paths, at = [], 0
    for k, n in enumerate(sizes):
        p = root / f"s{k:03d}.bin"
        stream[at : at + n].tofile(p)
        paths.append(p)
        at += n
    return paths, stream


@pytest.fixture(autouse=True)
def _restore_engine_settings() -> Iterator[None]:
    yield
    _io.set_max_open_files(None)
    if _io.FAULTS_BUILT:
        _io._set_fault_injection(0, 0.0)
        _io._debug_fail_enter_after(-1)


class _BlockedRead:
    """A read that stays in flight until released: its destination is memory
    registered with userfaultfd, so the kernel's copy into it waits on a fault that
    nobody resolves until ``release()`` (which closes the userfaultfd: the fault then
    completes with a zero page and the read finishes).  While it waits, the read's
    file is pinned and, with io_uring, its ring is in use."""

    API, REGISTER = 0xC018AA3F, 0xC020AA00  # _IOWR(0xAA, 0x3F, 24), _IOWR(0xAA, 0x00, 32)

    def __init__(self, nbytes: int) -> None:
        import ctypes
        import fcntl
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        nr = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine)
        if nr is None:
            pytest.skip("userfaultfd's syscall number is not known here")
        fd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            pytest.skip(f"userfaultfd: {os.strerror(ctypes.get_errno())}")
        self.fd = fd
        api = bytearray(np.array([0xAA, 0, 0], np.uint64).tobytes())
        fcntl.ioctl(fd, self.API, api)
        self.size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        reg = bytearray(np.array([addr, self.size, 1, 0], np.uint64).tobytes())  # MODE_MISSING
        fcntl.ioctl(fd, self.REGISTER, reg)
        self.out = np.frombuffer(self.map, np.uint8)[:nbytes]

    def faulted(self, timeout: float) -> bool:
        """Whether a read touched the memory (and now waits) within ``timeout`` s."""
        import select

        ready, _, _ = select.select([self.fd], [], [], timeout)
        return bool(ready)

    def wait_until_blocked(self, timeout: float = 10.0) -> None:
        assert self.faulted(timeout), "the read never reached its destination"

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_windows(
        self, rows: _rows.RowSet, windows: Any, first: int, count: int, stride: int, window: int
    ) -> tuple[threading.Thread, list[BaseException], threading.Event]:
        """``rows.read_windows(...)`` into ``out`` on a thread of its own, started:
        (the thread, the exception it raised if any, set once it returned)."""
        errors: list[BaseException] = []
        returned = threading.Event()

        def read() -> None:
            try:
                rows.read_windows(windows, first, count, stride, window, self.out)
            except BaseException as e:
                errors.append(e)
            returned.set()

        t = threading.Thread(target=read)
        t.start()
        return t, errors, returned


def _io_uring_fds() -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += "io_uring" in os.readlink(f"/proc/self/fd/{name}")
    return n


def _in_child(check: Callable[[], None], timeout: int = 10) -> int:
    """Fork; the child runs ``check`` (killed by SIGALRM after ``timeout`` s if it
    hangs) and exits 0 if it returned, 1 if it raised. Returns the exit code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(timeout)
            check()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _fortran(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return np.zeros(shape, dtype=dtype, order="F")


def _strided(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A C-ordered view that skips every other row: not contiguous."""
    return np.zeros((shape[0] * 2, *shape[1:]), dtype=dtype)[::2]


BAD_LAYOUTS: dict[str, Callable[[tuple[int, ...], Any], np.ndarray]] = {
    "strided": _strided,
    "fortran": _fortran,
}
LAYOUT_WORDS = {"strided": r"strides \(", "fortran": r"Fortran-ordered"}


# ---- 1. out buffers ---------------------------------------------------------------


@pytest.fixture
def rowset(tmp_path: Path) -> tuple[_rows.RowSet, np.ndarray]:
    paths, stream = _shards(tmp_path, [40, 24])
    return _rows.RowSet(_io.FileSet(paths, io="sync"), [40, 24], 4), stream


@pytest.mark.parametrize("layout", sorted(BAD_LAYOUTS))
def test_read_windows_refuses_an_out_it_cannot_fill_in_place(
    rowset: tuple[_rows.RowSet, np.ndarray], layout: str
) -> None:
    rows, stream = rowset
    out = BAD_LAYOUTS[layout]((3, 8), np.uint32)
    with pytest.raises(ValueError, match=r"out must be a writable C-contiguous array.*got a") as e:
        rows.read_windows([0, 2, 5], 0, 8, 8, 8, out)
    assert e.match(LAYOUT_WORDS[layout])
    assert not out.any()
    good = np.zeros((3, 8), np.uint32)
    rows.read_windows([0, 2, 5], 0, 8, 8, 8, good)
    np.testing.assert_array_equal(good, stream.reshape(8, 8)[[0, 2, 5]])


def test_read_windows_refuses_a_wrong_dtype_or_size(
    rowset: tuple[_rows.RowSet, np.ndarray],
) -> None:
    rows, _ = rowset
    with pytest.raises(ValueError, match=r"out must have items of 4 bytes.*got dtype int64"):
        rows.read_windows([0, 1], 0, 8, 8, 8, np.zeros((2, 8), np.int64))
    with pytest.raises(ValueError, match=r"out must have items of 4 bytes.*got dtype uint16"):
        rows.read_windows([0, 1], 0, 8, 8, 8, np.zeros((2, 16), np.uint16))
    with pytest.raises(ValueError, match=r"out holds 60 bytes, expected at least 64"):
        rows.read_windows([0, 1], 0, 8, 8, 8, np.zeros(15, np.uint32))
    with pytest.raises(ValueError, match=r"out must be writable.*read-only"):
        ro = np.zeros((2, 8), np.uint32)
        ro.flags.writeable = False
        rows.read_windows([0, 1], 0, 8, 8, 8, ro)
    with pytest.raises(ValueError, match=r"holds Python objects"):
        rows.read_windows([0], 0, 8, 8, 2, np.zeros(4, object))
    with pytest.raises(TypeError, match=r"out must be a writable buffer.*got int"):
        rows.read_windows([0], 0, 8, 8, 8, cast(Any, 5))
    # the rows' own bytes, as raw bytes, are fine
    raw = np.zeros(64, np.uint8)
    rows.read_windows([0, 1], 0, 8, 8, 8, raw)
    assert raw.view("<u4")[0] == 1


@pytest.mark.parametrize("layout", sorted(BAD_LAYOUTS))
def test_read_refuses_an_out_it_cannot_fill_in_place(
    rowset: tuple[_rows.RowSet, np.ndarray], layout: str
) -> None:
    rows, _ = rowset
    out = BAD_LAYOUTS[layout]((4, 6), np.uint32)
    with pytest.raises(ValueError, match=r"out must be a writable C-contiguous array.*got a") as e:
        rows.read([0, 30], [6, 12], [0, 24], out)
    assert e.match(LAYOUT_WORDS[layout])
    assert not out.any()
    with pytest.raises(ValueError, match=r"out must have items of 4 bytes.*got dtype float64"):
        rows.read([0], [6], [0], np.zeros(6, np.float64))
    mv = np.zeros((4, 24), np.uint8)[:, ::2].data  # a strided memoryview, not an array
    with pytest.raises(ValueError, match=r"out must be a writable C-contiguous array"):
        rows.read([0], [6], [0], mv)
    buf = bytearray(24)
    rows.read([0], [6], [0], buf)
    assert np.frombuffer(buf, "<u4").tolist() == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("layout", sorted(BAD_LAYOUTS))
def test_split_fields_refuses_an_out_it_cannot_fill_in_place(layout: str) -> None:
    dt = np.dtype([("a", "<u4"), ("b", "<u2")])
    src = np.zeros((4, 6), dt)
    src["a"] = np.arange(24).reshape(4, 6)
    src["b"] = 7
    outs = [BAD_LAYOUTS[layout]((4, 6), np.uint32), np.zeros((4, 6), np.uint16)]
    with pytest.raises(ValueError, match=r"outs\[0\] must be a writable C-contiguous") as e:
        _rows.split_fields(src, 24, dt.itemsize, [0, 4], [4, 2], outs)
    assert e.match(LAYOUT_WORDS[layout])
    assert not outs[0].any() and not outs[1].any()  # refused before any field was split
    with pytest.raises(ValueError, match=r"outs\[1\] must have items of 2 bytes.*got dtype int32"):
        _rows.split_fields(
            src, 24, dt.itemsize, [0, 4], [4, 2], [np.zeros(24, np.uint32), np.zeros(24, np.int32)]
        )
    with pytest.raises(ValueError, match=r"outs\[1\] holds 46 bytes, expected 48"):
        _rows.split_fields(
            src, 24, dt.itemsize, [0, 4], [4, 2], [np.zeros(24, np.uint32), np.zeros(23, np.uint16)]
        )
    good: list[np.ndarray] = [np.zeros((4, 6), np.uint32), np.zeros((4, 6), np.uint16)]
    _rows.split_fields(src, 24, dt.itemsize, [0, 4], [4, 2], good)
    np.testing.assert_array_equal(good[0], src["a"])
    assert (good[1] == 7).all()


@pytest.mark.parametrize("layout", sorted(BAD_LAYOUTS))
def test_permutation_names_the_layout_it_refuses(layout: str) -> None:
    p = _permute.Permutation(100, seed=1)
    out = BAD_LAYOUTS[layout]((5, 4), np.uint64)
    with pytest.raises(ValueError, match=r"out must be a writeable C-contiguous array, got a") as e:
        p.take(np.arange(20).reshape(5, 4), out=out)
    assert e.match(LAYOUT_WORDS[layout])
    assert not out.any()


def test_metadata_records_refuse_an_out_they_cannot_fill_in_place(tmp_path: Path) -> None:
    dt = np.dtype([("token", "<u4"), ("metadata_id", "<u4")])
    with tokload.Writer(tmp_path / "ds", dt, metadata=True) as w:
        doc = np.zeros(10, dt)
        w.write(doc, spans=[(0, 5, b"hello world")])
    meta = tokload.open_dataset(tmp_path / "ds").meta
    assert meta is not None
    spans = np.zeros(1, _metaids._SPAN_DTYPE)
    spans["length"] = 5
    for bad, words in (
        (np.zeros(16, np.uint8)[::2], r"strides \("),
        (np.zeros((4, 4), np.uint8, order="F"), r"Fortran-ordered"),
    ):
        with pytest.raises(ValueError, match=r"out must be a writable C-contiguous array") as e:
            meta.read(spans, bad)
        assert e.match(words)
        assert not bad.any()
    with pytest.raises(ValueError, match=r"out must have items of 1 byte.*got dtype uint32"):
        meta.read(spans, np.zeros(8, np.uint32))
    out = np.zeros(5, np.uint8)
    meta.read(spans, out)
    assert out.tobytes() == b"hello"


@pytest.mark.parametrize("layout", ["blocks", "spans"])
def test_metadata_windows_name_the_out_they_refuse(tmp_path: Path, layout: str) -> None:
    toks = np.arange(1, 401, dtype=np.uint16)
    with tokload.Writer(tmp_path / "ds", "<u2", metadata=True, metadata_layout=layout) as w:
        w.write(toks, spans=[(a, a + 7, b"r%d" % a) for a in range(0, 400, 10)])
    view = tokload.StreamWithMetadata(tmp_path / "ds", window=9, stride=4)
    spans: Any = view.source.spans
    pos = np.zeros((2, 9), np.int32)
    args = (0, len(view), 4, 9)
    fortran = np.zeros((9, 2), np.uint16).T
    with pytest.raises(ValueError, match=r"out must be a writable C-contiguous.*Fortran-ordered"):
        spans.read_windows(np.arange(2), *args, fortran, pos, np.empty, _meta.Scratch())
    with pytest.raises(ValueError, match=r"out must have plain items of 2 bytes.*got int32"):
        bad = np.zeros(9, np.int32)
        spans.read_windows(np.arange(2), *args, bad, pos, np.empty, _meta.Scratch())
    assert not fortran.any() and not bad.any() and not pos.any()


def test_the_public_source_rows_refuse_a_strided_out(tmp_path: Path) -> None:
    data = np.arange(1, 401, dtype=np.uint32)
    with tokload.Writer(tmp_path / "ds", np.uint32) as w:
        w.write(data)
    view = tokload.TokenStream(tmp_path / "ds", window=10)
    src = view.source
    out = np.zeros((10, 8), np.uint32).T  # (8, 10), Fortran-ordered
    with pytest.raises(ValueError, match=r"Fortran-ordered"):
        src.rows.read_windows([0, 1, 2, 3, 4, 5, 6, 7], 0, len(view), 10, 10, out)
    assert not out.any()
    strided = np.zeros((16, 10), np.uint32)[::2]
    with pytest.raises(ValueError, match=r"strides \("):
        src.rows.read([0], [10], [0], strided)
    assert not strided.any()


def test_row_ranges_are_checked_before_any_read(tmp_path: Path) -> None:
    """Ranges past the source's rows and destinations past ``out`` are refused,
    naming the range, and nothing is read (checked in a compiled loop)."""
    with tokload.Writer(tmp_path / "ds", np.uint32) as w:
        w.write(np.arange(1, 401, dtype=np.uint32))
    rows = tokload.TokenStream(tmp_path / "ds", window=10).source.rows
    out = np.zeros(20, np.uint32)
    with pytest.raises(IndexError, match=r"rows \[395, 405\) are not within \[0, 400\)"):
        rows.read([0, 395], [10, 10], [0, 40], out)
    with pytest.raises(IndexError, match=r"are not within \[0, 400\)"):
        rows.read([0, 2**64 - 5], [10, 10], [0, 40], out)  # the end wraps around
    with pytest.raises(ValueError, match=r"a destination range runs past the end of out"):
        rows.read([0, 10], [10, 11], [0, 40], out)  # 11 rows at byte 40: 84 > 80 bytes
    with pytest.raises(ValueError, match=r"a destination range runs past the end of out"):
        rows.read([0], [21], [0], out)
    with pytest.raises(ValueError, match=r"the same length"):
        rows.read([0, 1], [1], [0, 4], out)
    assert not out.any()
    with pytest.raises(IndexError, match=r"rows \[395, 405\) run past the 400 rows"):
        rows.hint_ranges([0, 395], [10, 10])  # the hints' check, with its own message
    rows.read([0, 10], [10, 10], [0, 40], out)  # exactly fills out
    np.testing.assert_array_equal(out, np.arange(1, 21))


def test_packed_rows_refuse_a_fortran_alloc(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with tokload.Writer(tmp_path / "ds", np.uint32) as w:
        for _ in range(20):
            w.write(rng.integers(1, 1000, int(rng.integers(3, 30)), dtype=np.uint32))
    view = tokload.Documents(tmp_path / "ds")
    fill = tokload.Fill(32, attention=["position_ids"])
    sched = fill.schedule(view, 4)
    made: list[np.ndarray] = []

    def fortran_alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        a = np.empty(shape, dtype=dtype, order="F")
        made.append(a)
        return a

    with pytest.raises(ValueError, match=r"C-contiguous.*Fortran-ordered"):
        view.read_batch(np.arange(4), fortran_alloc)  # padded rows
    span = sched.span(0)
    assert span is not None
    with pytest.raises(ValueError, match=r"alloc gave a Fortran-ordered array for 'tokens'"):
        fill.reader(view, sched, fortran_alloc).read([span], None)  # packed rows
    task = fill.reader(view, sched, np.empty).read([span], None)
    assert task.whole is not None and task.whole["tokens"].any()
    assert view.read_batch(np.arange(4), np.empty)["tokens"].any()


# ---- 2. a ring that fails ----------------------------------------------------------

needs_debug_uring = pytest.mark.skipif(
    not _io.FAULTS_BUILT or not _io.uring_available(),
    reason="needs a debug build (TOKLOAD_DEBUG=1) and io_uring",
)


@needs_debug_uring
@pytest.mark.parametrize("waits", [False, True], ids=["submit-fails", "every-enter-fails"])
def test_a_failing_ring_waits_for_the_reads_the_kernel_has(tmp_path: Path, waits: bool) -> None:
    """io_uring_enter fails for good while the kernel still reads into the batch's
    buffer (held there by a fault nobody resolves yet): the call must not return,
    and so let its caller free that buffer, until the kernel is done with it; then
    it raises OSError with the errno and the file, and every pin is released."""
    paths, stream = _shards(tmp_path, [4096, 4096])
    rows = _rows.RowSet(_io.FileSet(paths, io="uring", queue_depth=4), [4096, 4096], 4)
    before = _io._debug_uring_broken()
    blocked = _BlockedRead(8 * 512 * 4)
    _io._debug_fail_enter_after(2, errno.EIO, waits=waits)  # 2 of 4 reach the kernel
    t, got, returned = blocked.read_windows(rows, np.arange(8), 0, 16, 512, 512)
    try:
        # Two reads are in the kernel's hands: they reach the buffer (and wait there on
        # the fault) whenever the kernel's workers get to them, before or after the
        # failure. The batch must wait for them, whatever their progress.
        reached = blocked.faulted(10.0)
        assert not returned.is_set(), "the batch returned while the kernel still had its reads"
        assert reached, "the read never reached its destination"
        assert not returned.wait(0.5), "the batch returned while the kernel still read into it"
    finally:
        blocked.release()
        t.join(10)
    assert not t.is_alive()
    assert len(got) == 1 and isinstance(got[0], OSError), got
    e = got[0]
    assert e.errno == errno.EIO and e.filename == str(paths[0]), (e.errno, e.filename)
    after = _io._debug_uring_broken()
    assert after["rings"] == before["rings"] + 1
    assert after["inflight"] == before["inflight"], "reads were in flight when it returned"
    _io._debug_fail_enter_after(-1)
    rows.files.close()  # a pinned file would stay open until its pin is released
    assert rows.files.fds() == [-1, -1], "a read's pin was never released"
    out = np.zeros((8, 512), np.uint32)  # a fresh ring reads as before
    rows2 = _rows.RowSet(_io.FileSet(paths, io="uring", queue_depth=4), [4096, 4096], 4)
    rows2.read_windows(np.arange(8), 0, 16, 512, 512, out)
    rows2.files.close()
    np.testing.assert_array_equal(out.reshape(-1), stream[:4096])


def test_the_ring_failure_hook_is_refused_in_release_builds() -> None:
    if _io.FAULTS_BUILT:
        pytest.skip("a debug build: the hook is available")
    with pytest.raises(RuntimeError, match="needs a debug build"):
        _io._debug_fail_enter_after(1)


# ---- 3. fork ----------------------------------------------------------------------


def test_a_read_the_close_of_its_dataset_overtakes_says_so(tmp_path: Path) -> None:
    """review59: a read that passed the open check when another thread closed the
    dataset (``view.close()`` while reader threads read ahead) got EBADF from the
    descriptor cache for its next file, raised as an ``OSError`` naming a shard
    and an offset (a damaged file, to the reader); it is the closed dataset's
    ``ValueError`` now."""
    paths, _ = _shards(tmp_path, [4096, 4096])
    rows = _rows.RowSet(_io.FileSet(paths, io="sync"), [4096, 4096], 4)
    blocked = _BlockedRead(2 * 1024 * 4)
    # a window of shard 0, then one of shard 1: one after the other (sync)
    t, errors, _ = blocked.read_windows(rows, [0, 4], 0, 8, 1024, 1024)
    try:
        blocked.wait_until_blocked()  # inside shard 0's read
        rows.files.close()
    finally:
        blocked.release()
        t.join(10)
    assert not t.is_alive()
    assert len(errors) == 1 and type(errors[0]) is ValueError, errors
    assert str(errors[0]).startswith(f"I/O on a closed dataset ({paths[1]}: closed while reading")


@pytest.mark.parametrize("io", ["sync", "threads", "uring"])
@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_a_child_forked_during_a_read_holds_no_pins_of_the_parent(
    tmp_path: Path, io: str, closed: bool
) -> None:
    """A thread of the parent is inside a read (its file pinned, with io_uring its
    ring in use) when another forks. The child has no such thread: it must not wait
    for that pin, keep that descriptor open past the bound, or hold that ring."""
    if io == "uring" and not _io.uring_available():
        pytest.skip(f"io_uring is not available here: {_io.uring_error()}")
    paths, stream = _shards(tmp_path, [4096, 4096])
    rows = _rows.RowSet(_io.FileSet(paths, io=io, queue_depth=4), [4096, 4096], 4)
    rows.read_windows([0], 0, 8, 1024, 1024, np.zeros(1024, np.uint32))  # a ring, a pool
    blocked = _BlockedRead(2 * 1024 * 4)
    # windows 0 and 1 of shard 0: two requests, so the backend runs them
    t, errors, _ = blocked.read_windows(rows, [0, 1], 0, 8, 1024, 1024)
    try:
        blocked.wait_until_blocked()
        if closed:  # a closed set's pinned file closes when unpinned: in the child, at once
            rows.files.close()

        def child() -> None:
            assert _io_uring_fds() == 0, "the child holds the parent's io_uring ring"
            fds = rows.files.fds()
            assert fds[0] >= 0 or closed
            if closed:
                assert fds == [-1, -1], fds
                return
            _io.set_max_open_files(1)  # room for one: shard 0's must be closed for shard 1
            out = np.zeros((2, 1024), np.uint32)
            rows.read_windows([4, 5], 0, 8, 1024, 1024, out)  # shard 1
            assert (out.reshape(-1) == stream[4096:6144]).all()
            assert rows.files.fds()[0] == -1 and _io.open_files() == 1
            rows.read_windows([0, 1], 0, 8, 1024, 1024, out)  # and back to shard 0
            assert (out.reshape(-1) == stream[:2048]).all()
            assert rows.files.fds()[1] == -1 and _io.open_files() == 1

        code = _in_child(child)
    finally:
        blocked.release()
        t.join(10)
    assert not t.is_alive()
    assert code == 0, f"the child exited with {code} (-14: it hung and was killed by SIGALRM)"
    if not closed:  # (closed: a request not yet started when it closed fails, EBADF)
        assert not errors, errors
        assert (blocked.out.view("<u4") == stream[:2048]).all()
