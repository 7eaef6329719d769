"""Fuzzing the files a reader trusts: the manifest, ``.docs``, ``.mdx``/``.mdb``, the
rows' metadata ids, metadata blocks (``.msb``/``.mbx``) and the Megatron ``.idx``.

Every case damages one file of a small valid dataset (byte flips, overwritten
64-bit values, truncation, insertion, deletion; for the manifest also JSON
values of any type put anywhere), opens it and reads every observation. The
outcome must be one of:

- the data the damaged files describe, compared with a pure NumPy reading of
  the same files (so a reader never returns anything the files do not say), or
- a :class:`tokload.TokloadError` or an ``OSError`` whose message names the
  dataset,

never another exception type and never a hang (each case runs under a time
limit). ``TOKLOAD_FUZZ_EXAMPLES`` sets the number of cases per file kind (40 by
default, a few seconds in all); the sanitizer job of ``.ci/run`` runs this file
against the debug build.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timeouts import no_hang

import tokload
from tokload import Documents, StreamWithMetadata, TokenStream, TokloadError
from tokload.format import NO_METADATA

EXAMPLES = int(os.environ.get("TOKLOAD_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
META_DT = np.dtype([("token", "<u4"), ("metadata_id", "<u4")])
MEGATRON = Path(__file__).parent / "data" / "megatron"
INVALID = object()  # a row whose metadata the files do not validly describe

# ---- mutations ------------------------------------------------------------------------------

BIG = [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("u64"), st.integers(0, 1 << 20), st.sampled_from(BIG) | st.integers(0, 99)),
    st.tuples(st.just("u32"), st.integers(0, 1 << 20), st.sampled_from(BIG[:6])),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 9)),
)
mutations = st.lists(mutation, min_size=1, max_size=3)


def mutate(data: bytes, muts: list[tuple[str, int, Any]], aligned: int = 1) -> bytes:
    """Apply byte-level mutations; positions wrap around the data (aligned for u32/u64)."""
    b = bytearray(data)
    for op, pos, arg in muts:
        n = len(b)
        if op == "insert":
            p = pos % (n + 1)
            b[p:p] = arg
            continue
        if n == 0:
            continue
        p = pos % n
        if op == "flip":
            b[p] ^= arg
        elif op in ("u64", "u32"):
            size = 8 if op == "u64" else 4
            if n < size:
                continue
            p = (p // aligned * aligned) % (n - size + 1)
            b[p : p + size] = (arg % (1 << (8 * size))).to_bytes(size, "little")
        elif op == "truncate":
            del b[p:]
        else:
            del b[p : p + arg]
    return bytes(b)


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2**63, 2**64, 1.0, 1e308, "", "\x00", "\ud800", "/abs", "a/b"]),
    st.sampled_from(["../x", ".", ">u4", "<u4", "<f4", "u4,u2", "tokload", "s-00000", "|b1"]),
    st.floats(allow_nan=False),
    st.text(max_size=6),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for k, v in enumerate(value):
            yield from json_paths(v, (*prefix, k))


def replace_at(doc: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


# ---- the datasets and their NumPy readings ------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    rng = np.random.default_rng(11)
    with tokload.Writer(root / "plain", "<u2", shard_bytes=40, name_prefix="s") as w:
        for n in [3, 0, 7, 1, 5, 2, 0, 6]:
            w.write(rng.integers(0, 60000, n))
    with tokload.Writer(
        root / "meta", META_DT, metadata=True, shard_bytes=96, name_prefix="s"
    ) as w:
        for k, n in enumerate([4, 6, 0, 5, 3, 7]):
            spans = [(0, min(2, n), b"r%d" % k), (min(3, n), n, b"")] if n >= 4 else []
            w.write({"token": rng.integers(0, 1 << 32, n)}, spans=spans)
    with tokload.Writer(
        root / "blocks", "<u2", metadata=True, span_block=4, shard_bytes=40, name_prefix="s"
    ) as w:
        for k, n in enumerate([4, 6, 0, 5, 3, 7, 9]):
            spans = [(0, min(2, n), b"r%d" % k), (min(3, n), n, b"")] if n >= 4 else []
            w.write(rng.integers(0, 60000, n), spans=spans)
    for ext in (".bin", ".idx"):
        shutil.copy(MEGATRON / f"tiny_uint16{ext}", root / f"mega{ext}")
    return root


def shard_file(directory: Path, ext: str, k: int) -> Path:
    """The k-th (modulo their number) shard file with this extension."""
    files = sorted(directory.glob(f"*.{ext}"))
    return files[k % len(files)]


def fresh(pristine: Path, tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work)
    return work


def numpy_tokload(path: Path, m: tokload.format.Manifest) -> dict[str, Any]:
    """What a tokload dataset's files say, read with NumPy per FORMAT.md."""
    stream: list[np.ndarray] = []
    docs: list[Any] = []
    labels: list[Any] = []
    for s in m.shards:
        rows = np.fromfile(path / f"{s.name}.rows", m.dtype)
        stream.append(rows)
        if m.documents:
            d = np.fromfile(path / f"{s.name}.docs", "<u8").astype(object)
            for j in range(len(d) - 1):
                ok = d[j] <= d[j + 1] <= len(rows)
                docs.append(rows[int(d[j]) : int(d[j + 1])] if ok else INVALID)
        if m.metadata:
            mdx = np.fromfile(path / f"{s.name}.mdx", "<u8").astype(object)
            mdb = (path / f"{s.name}.mdb").read_bytes()
            for i in rows["metadata_id"].tolist():
                if i == NO_METADATA:
                    labels.append(None)
                elif i + 1 < len(mdx) and mdx[i] <= mdx[i + 1] <= len(mdb):
                    labels.append(mdb[mdx[i] : mdx[i + 1]])
                else:
                    labels.append(INVALID)
    return {
        "stream": np.concatenate(stream) if stream else np.zeros(0, m.dtype),
        "docs": docs,
        "labels": labels,
    }


def read_tokload(path: Path) -> None:
    """Open a (damaged) tokload dataset, read every observation, compare with NumPy."""
    src = tokload.open_dataset(path)
    assert src.manifest is not None
    want = numpy_tokload(path, src.manifest)
    total = src.num_rows
    if src.docs is not None:
        docs = Documents(src)
        got = docs.read(np.arange(len(docs)))
        assert len(docs) == len(want["docs"])
        for j, expected in enumerate(want["docs"]):
            assert expected is not INVALID, f"document {j} read although its index is invalid"
            lo, hi = got.offsets[j], got.offsets[j + 1]
            if isinstance(got.values, dict):  # every field (a fuzzed dtype may rename them)
                assert set(got.values) == set(expected.dtype.names)
                for field, values in got.values.items():
                    np.testing.assert_array_equal(values[lo:hi], expected[field])
            else:
                np.testing.assert_array_equal(got.values[lo:hi], expected)
    if total == 0:
        return
    window = min(total, 5)
    if src.meta is not None:
        view = StreamWithMetadata(src, window=window)
        b = view.read(np.arange(len(view)))
        for i in range(len(view)):
            rows = slice(i * window, (i + 1) * window)
            for field, values in b.fields.items():
                np.testing.assert_array_equal(values[i], want["stream"][field][rows])
            expected = want["labels"][rows]
            assert INVALID not in expected, f"window {i} read although its metadata is invalid"
            assert [None if p < 0 else b.metadata[p] for p in b.positions[i]] == expected
    else:
        stream = TokenStream(src, window=window)
        got_rows = stream.read(np.arange(len(stream)))
        rows = want["stream"][: len(stream) * window]
        if isinstance(got_rows, dict):  # a structured dtype (metadata switched off, say)
            assert set(got_rows) == set(rows.dtype.names)
            for field, values in got_rows.items():
                np.testing.assert_array_equal(values.reshape(-1), rows[field])
        else:
            np.testing.assert_array_equal(got_rows.reshape(-1), rows)


def read_megatron(prefix: Path) -> None:
    """Open a (damaged) Megatron .bin/.idx, read every sequence, compare with NumPy."""
    docs = Documents(prefix)
    idx = Path(str(prefix) + ".idx").read_bytes()
    binary = Path(str(prefix) + ".bin").read_bytes()
    _magic, _version, code, nseq, _ndoc = struct.unpack_from("<9sQBQQ", idx)
    dtype = tokload.interop.MEGATRON_DTYPES[code]
    assert len(docs) == nseq
    lengths = np.frombuffer(idx, "<i4", nseq, 34).astype(object)
    pointers = np.frombuffer(idx, "<i8", nseq, 34 + 4 * nseq).astype(object)
    got = docs.read(np.arange(nseq))
    for i in range(nseq):
        lo, hi = pointers[i], pointers[i] + lengths[i] * dtype.itemsize
        ok = 0 <= lo <= hi <= len(binary) and lengths[i] >= 0
        assert ok, f"sequence {i} read although its pointer/length are invalid"
        expected = np.frombuffer(binary[lo:hi], dtype)
        assert isinstance(got.values, np.ndarray)
        np.testing.assert_array_equal(got.values[got.offsets[i] : got.offsets[i + 1]], expected)


def outcome(read: Callable[[Path], None], path: Path, names: str) -> None:
    """Correct data, or a tokload error / OSError naming ``names``; never a hang."""
    try:
        with no_hang(20):
            read(path)
    except (TokloadError, OSError) as e:
        assert names in str(e), f"{type(e).__name__} does not name {names}: {e}"


# ---- the fuzz tests -------------------------------------------------------------------------


@FUZZ
@given(muts=mutations)
def test_fuzz_manifest_bytes(pristine: Path, tmp_path: Path, muts: Any) -> None:
    work = fresh(pristine, tmp_path)
    for name in ("plain", "meta"):
        f = work / name / "manifest.json"
        f.write_bytes(mutate(f.read_bytes(), muts))
        outcome(read_tokload, work / name, str(work / name))


@FUZZ
@given(data=st.data(), value=json_value, delete=st.booleans())
def test_fuzz_manifest_values(
    pristine: Path, tmp_path: Path, data: Any, value: Any, delete: bool
) -> None:
    work = fresh(pristine, tmp_path)
    for name in ("plain", "meta"):
        f = work / name / "manifest.json"
        doc = json.loads(f.read_text())
        paths = list(json_paths(doc))
        path = data.draw(st.sampled_from(paths), label=f"{name} key")
        doc = replace_at(doc, path, value, delete and bool(path))
        f.write_text(json.dumps(doc))
        outcome(read_tokload, work / name, str(work / name))


@FUZZ
@given(muts=mutations, shard=st.integers(0, 2))
def test_fuzz_document_index(pristine: Path, tmp_path: Path, muts: Any, shard: int) -> None:
    work = fresh(pristine, tmp_path)
    for name in ("plain", "meta"):
        f = shard_file(work / name, "docs", shard)
        f.write_bytes(mutate(f.read_bytes(), muts, aligned=8))
        outcome(read_tokload, work / name, str(work / name))


@FUZZ
@given(muts=mutations, shard=st.integers(0, 2), ext=st.sampled_from(["mdx", "mdb", "rows"]))
def test_fuzz_metadata_files(
    pristine: Path, tmp_path: Path, muts: Any, shard: int, ext: str
) -> None:
    work = fresh(pristine, tmp_path)
    f = shard_file(work / "meta", ext, shard)
    if ext == "rows":  # the metadata ids inside the rows (sizes kept: they are checked on open)
        rows = np.fromfile(f, META_DT)
        raw = mutate(rows["metadata_id"].tobytes(), [m for m in muts if m[0] in ("flip", "u32")], 4)
        rows["metadata_id"] = np.frombuffer(raw, "<u4")
        rows.tofile(f)
    else:
        f.write_bytes(mutate(f.read_bytes(), muts, aligned=8))
    outcome(read_tokload, work / "meta", str(work / "meta"))


def read_blocks(path: Path) -> None:
    """Read every window of a (damaged) dataset with metadata blocks, with the block
    index in memory and without; what comes back must be well formed and the same
    both ways (the blocks' own checks are pinned in tests/test_blocks.py)."""
    got = []
    for memory in ("1073741824", "0"):
        os.environ["TOKLOAD_INDEX_MEMORY"] = memory
        try:
            view = StreamWithMetadata(path, window=3, stride=2)
        finally:
            del os.environ["TOKLOAD_INDEX_MEMORY"]
        b = view.read(np.arange(len(view)))
        n = len(b.metadata)
        assert ((b.positions >= -1) & (b.positions < n)).all()
        assert b.metadata.offsets[0] == 0 and b.metadata.offsets[-1] == len(b.metadata.data)
        assert (np.diff(b.metadata.offsets) >= 0).all()
        got.append((b.fields["tokens"].copy(), b.positions.copy(), list(b.metadata)))
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])
    assert got[0][2] == got[1][2]


@FUZZ
@given(muts=mutations, shard=st.integers(0, 3), ext=st.sampled_from(["msb", "mbx"]))
def test_fuzz_metadata_blocks(
    pristine: Path, tmp_path: Path, muts: Any, shard: int, ext: str
) -> None:
    work = fresh(pristine, tmp_path)
    f = shard_file(work / "blocks", ext, shard)
    f.write_bytes(mutate(f.read_bytes(), muts, aligned=2 if ext == "msb" else 8))
    outcome(read_blocks, work / "blocks", str(work / "blocks"))


@FUZZ
@given(muts=mutations)
def test_fuzz_megatron_index(pristine: Path, tmp_path: Path, muts: Any) -> None:
    work = fresh(pristine, tmp_path)
    f = work / "mega.idx"
    f.write_bytes(mutate(f.read_bytes(), muts, aligned=4))
    outcome(read_megatron, work / "mega", str(work / "mega"))


def test_the_oracles_read_the_pristine_data(pristine: Path, tmp_path: Path) -> None:
    """Sanity: undamaged files read without error and agree with the NumPy readings."""
    work = fresh(pristine, tmp_path)
    read_tokload(work / "plain")
    read_tokload(work / "meta")
    read_blocks(work / "blocks")
    read_megatron(work / "mega")
    assert mutate(b"abcdef", [("u32", 1, 2**32 - 1)], 4) == b"\xff\xff\xff\xffef"
    assert mutate(b"abcdef", [("truncate", 9, 0)]) == b"abc"
