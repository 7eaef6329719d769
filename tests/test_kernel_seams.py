"""The seams between tokload's C core and what it does not own: the caller's ``out``
buffers.

1. Every binding that writes into a caller's ``out`` refuses one it cannot fill in
   place (strided, Fortran-ordered, read-only, of the wrong item size or size) with
   a ValueError naming what it expected and what it got, before any read: a copy
   filled in its place would leave ``out`` as it was, with no error.
"""

from __future__ import annotations

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


def test_packed_rows_refuse_a_fortran_alloc(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with tokload.Writer(tmp_path / "ds", np.uint32) as w:
        for _ in range(20):
            w.write(rng.integers(1, 1000, int(rng.integers(3, 30)), dtype=np.uint32))
    view = tokload.Documents(tmp_path / "ds", batch="fill", window=32, boundaries=False)
    made: list[np.ndarray] = []

    def fortran_alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        a = np.empty(shape, dtype=dtype, order="F")
        made.append(a)
        return a

    with pytest.raises(ValueError, match=r"C-contiguous.*Fortran-ordered"):
        view.read_batch(np.arange(4), fortran_alloc)
    assert view.read_batch(np.arange(4), np.empty)["tokens"].any()
