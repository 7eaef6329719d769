"""Views read byte-exact: every read is compared with a pure NumPy reference."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokload
from tokload import Documents, StreamWithMetadata, TokenStream, Writer
from tokload.format import read_manifest
from tokload.tools import verify

DATA = Path(__file__).parent / "data"
MEGATRON = DATA / "megatron"

PLAIN = ["<u2", "<u4", "<i4", "<u8", "|u1"]
STRUCT = [[("token", "<u4"), ("concept", "<u2")], [("a", "<i2"), ("b", "<u8"), ("c", "|u1")]]


@dataclass
class Corpus:
    """A dataset on disk and what it should contain."""

    path: Path
    dtype: np.dtype[Any]
    docs: list[np.ndarray]
    labels: list[bytes | None] | None = None  # per row, for metadata datasets

    @property
    def stream(self) -> np.ndarray:
        return np.concatenate(self.docs) if self.docs else np.zeros(0, self.dtype)


def make_corpus(
    path: Path,
    dtype: Any,
    lengths: list[int],
    shard_bytes: int,
    seed: int = 0,
    metadata: bool = False,
) -> Corpus:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    docs, labels = [], []
    with Writer(path, dt, metadata=metadata, shard_bytes=shard_bytes) as w:
        for d, n in enumerate(lengths):
            doc = np.zeros(n, dt)
            for name in dt.names or [None]:
                ft = dt if name is None else dt.fields[name][0]
                info = np.iinfo(ft)
                vals = rng.integers(info.min, info.max, size=n, dtype=ft, endpoint=True)
                if name is None:
                    doc = vals
                elif name != "metadata_id":
                    doc[name] = vals
            spans = []
            lab: list[bytes | None] = [None] * n
            if metadata:
                s = 0
                while s < n:
                    e = min(n, s + int(rng.integers(1, 12)))
                    if rng.random() < 0.7:
                        payload = f"d{d}[{s}:{e}]".encode() * int(rng.integers(0, 3))
                        spans.append((s, e, payload))
                        lab[s:e] = [payload] * (e - s)
                    s = e
                doc["metadata_id"] = 0xFFFFFFFF
                for s, e, _p in spans:
                    doc["metadata_id"][s:e] = 0  # the writer renumbers; compare elsewhere
            w.write(doc, spans=spans or None)
            docs.append(doc)
            labels += lab
    return Corpus(path, dt, docs, labels if metadata else None)


def fields_of(value: Any, dtype: np.dtype[Any]) -> dict[str, np.ndarray]:
    if dtype.names is None:
        return {"": np.asarray(value)}
    if isinstance(value, dict):
        return value
    return {name: value[name] for name in dtype.names}


def assert_same(got: Any, expected: np.ndarray, dtype: np.dtype[Any], skip: str = "") -> None:
    exp = fields_of(expected, dtype)
    g = fields_of(got, dtype)
    for name, arr in exp.items():
        if name == skip:
            continue
        assert g[name].dtype == arr.dtype, name
        np.testing.assert_array_equal(g[name], arr, err_msg=f"field {name!r}")


# ---- token streams -----------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(PLAIN + STRUCT),
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=25),
    shard_bytes=st.integers(1, 4000),
    window=st.integers(1, 700),
    stride=st.integers(1, 500),
    data=st.data(),
)
def test_token_stream_matches_numpy(
    dtype: Any, lengths: list[int], shard_bytes: int, window: int, stride: int, data: Any
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        c = make_corpus(Path(tmp) / "ds", dtype, lengths, shard_bytes, seed=len(lengths))
        ref = c.stream
        view = TokenStream(c.path, window=window, stride=stride)
        n = 0 if len(ref) < window else (len(ref) - window) // stride + 1
        assert len(view) == n
        if n == 0:
            return
        idx = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12))
        batch = view.read(idx)
        for b, i in enumerate(idx):
            expected = ref[i * stride : i * stride + window]
            row = {k: v[b] for k, v in batch.items()} if isinstance(batch, dict) else batch[b]
            assert_same(row, expected, c.dtype)
            assert_same(view[i], expected, c.dtype)
        assert_same(view[-1], ref[(n - 1) * stride : (n - 1) * stride + window], c.dtype)
        view.close()


def test_windows_spanning_many_shards_cost_one_request_per_shard(tmp_path: Path) -> None:
    c = make_corpus(tmp_path / "ds", "<u4", [10] * 40, shard_bytes=40)  # one doc per shard
    src = tokload.open_dataset(c.path)
    assert len(src.rows.cum) == 41
    for start, count, shards in [(0, 10, 1), (5, 10, 2), (5, 100, 11), (0, 400, 40), (399, 1, 1)]:
        plan = src.rows.plan(start, count)
        assert len(plan) == shards
        assert sum(length for _, _, length, _ in plan) == count * 4
    view = TokenStream(src, window=95, stride=7)
    got = view.read([3])
    assert isinstance(got, np.ndarray)
    assert_same(got[0], c.stream[21:116], c.dtype)


def test_read_into_preallocated_buffers(tmp_path: Path) -> None:
    c = make_corpus(tmp_path / "ds", STRUCT[0], [500] * 4, shard_bytes=1000)
    view = TokenStream(c.path, window=64)
    out = view.empty(3)
    assert isinstance(out, dict)
    got = view.read([0, 5, 2], out=out)
    assert got is out
    for b, i in enumerate([0, 5, 2]):
        assert_same({k: v[b] for k, v in out.items()}, c.stream[i * 64 : (i + 1) * 64], c.dtype)
    plain = make_corpus(tmp_path / "p", "<u2", [100] * 3, shard_bytes=120)
    pv = TokenStream(plain.path, window=16)
    buf = np.zeros((2, 16), np.uint16)
    assert pv.read([1, 17], out=buf) is buf
    np.testing.assert_array_equal(buf, [plain.stream[16:32], plain.stream[272:288]])


# ---- documents -----------------------------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(PLAIN[:3] + STRUCT[:1]),
    lengths=st.lists(st.integers(0, 200), min_size=1, max_size=30),
    shard_bytes=st.integers(1, 3000),
    data=st.data(),
)
def test_documents_match_numpy(dtype: Any, lengths: list[int], shard_bytes: int, data: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        c = make_corpus(Path(tmp) / "ds", dtype, lengths, shard_bytes, seed=sum(lengths))
        view = Documents(c.path)
        assert len(view) == len(lengths)
        idx = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=10))
        batch = view.read(idx)
        np.testing.assert_array_equal(batch.lengths, [lengths[i] for i in idx])
        values = fields_of(batch.values, c.dtype)
        for b, i in enumerate(idx):
            part = {k: v[batch.offsets[b] : batch.offsets[b + 1]] for k, v in values.items()}
            assert_same(part if c.dtype.names else part[""], c.docs[i], c.dtype)
            assert_same(view[i], c.docs[i], c.dtype)
        padded, plen = view.read_padded(idx, 37, pad=3)
        pf = fields_of(padded, c.dtype)
        for b, i in enumerate(idx):
            k = min(37, lengths[i])
            assert plen[b] == k
            for name, arr in fields_of(c.docs[i], c.dtype).items():
                np.testing.assert_array_equal(pf[name][b, :k], arr[:k])
                assert (pf[name][b, k:] == 3).all()
        longest = max(1, *(lengths[i] for i in idx))
        tight, tlen = view.read_padded(idx)  # to the batch's longest document, pad 0
        np.testing.assert_array_equal(tlen, [lengths[i] for i in idx])
        for name, arr in fields_of(tight, c.dtype).items():
            assert arr.shape == (len(idx), longest)
            for b, i in enumerate(idx):
                np.testing.assert_array_equal(
                    arr[b, : lengths[i]], fields_of(c.docs[i], c.dtype)[name]
                )
                assert (arr[b, lengths[i] :] == 0).all()
        if len(lengths) > 1:  # a subset numbers its documents from its own start
            sub = view.subset(1, len(lengths))
            j = data.draw(st.integers(0, len(lengths) - 2))
            assert_same(sub.read([j]).values, c.docs[j + 1], c.dtype)
            pv = fields_of(sub.read_padded([j], 300)[0], c.dtype)
            for name, arr in fields_of(c.docs[j + 1], c.dtype).items():
                np.testing.assert_array_equal(pv[name][0, : lengths[j + 1]], arr)


def test_subset_and_split(tmp_path: Path) -> None:
    c = make_corpus(tmp_path / "ds", "<u4", list(range(1, 101)), shard_bytes=500)
    docs = Documents(c.path)
    train, valid, test = tokload.split(docs, "969,30,1")
    assert (len(train), len(valid), len(test)) == (97, 3, 0)
    train, valid, test = tokload.split(docs, [8, 1, 1])
    assert (len(train), len(valid), len(test)) == (80, 10, 10)
    np.testing.assert_array_equal(valid[0], c.docs[80])
    np.testing.assert_array_equal(test[-1], c.docs[99])
    with pytest.raises(IndexError, match=r"observation 10 is out of range for a view of 10"):
        valid.read([10])
    inner = train.subset(10, 20).subset(2, 5)
    assert len(inner) == 3
    np.testing.assert_array_equal(inner[0], c.docs[12])
    stream = TokenStream(c.path, window=50)
    part = stream.subset(7, 9)
    np.testing.assert_array_equal(part[1], c.stream[400:450])
    assert part.fingerprint != stream.fingerprint
    for bad in ("0,0", "1,inf", "nan,1", [1, -1]):
        with pytest.raises(ValueError, match="split weights must be finite and non-negative"):
            tokload.split(docs, bad)
    # Megatron's spellings: '/' too, and three parts from a string that names fewer
    assert [len(p) for p in tokload.split(docs, "98/2/0")] == [98, 2, 0]
    assert [len(p) for p in tokload.split(docs, "99, 1")] == [99, 1, 0]
    assert [len(p) for p in tokload.split(docs, " 99 1 ")] == [99, 1, 0]  # (was [100, 0, 0])
    assert [len(p) for p in tokload.split(docs, [99, 1])] == [99, 1]
    with pytest.raises(ValueError, match=r"^split weights must be numbers separated by ',', '/' "):
        tokload.split(docs, "98;2")


def _megatron_split_indices(weights: list[float], n: int) -> list[int]:
    """megatron-core's _get_split_indices (blended_megatron_dataset_builder), as it
    is written there."""
    split = [w / sum(weights) for w in weights]
    indices = [0]
    for i in range(len(split)):
        indices.append(indices[i] + int(round(split[i] * float(n))))  # noqa: RUF046 (as there)
    diff = indices[-1] - n
    for i in range(1, len(indices)):
        indices[i] -= diff
    return indices


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(st.integers(0, 1000), min_size=1, max_size=4).filter(lambda w: sum(w) > 0),
    n=st.integers(1, 5000),
)
def test_split_cuts_where_megatron_core_does(weights: list[int], n: int) -> None:
    """The cuts of ``--split`` (review32: the cumulative weights were rounded, so a
    validation set differed from Megatron's by a document at a cut, n=49 of
    '969,30,1' among them)."""

    class Rows:  # a view of n observations: split needs len and subset
        def __init__(self, a: int, b: int) -> None:
            self.a, self.b = a, b

        def __len__(self) -> int:
            return self.b - self.a

        def subset(self, a: int, b: int) -> Rows:
            return Rows(self.a + a, self.a + b)

    rows: Any = Rows(0, n)
    parts = tokload.split(rows, [float(w) for w in weights])
    got = [0] + [p.b for p in parts]
    want = _megatron_split_indices([float(w) for w in weights], n)
    if min(want) >= 0:  # (Megatron's own cut may fall below 0: tokload's stays at 0)
        assert got == want
    assert got[-1] == n and all(a <= b for a, b in itertools.pairwise(got))


# ---- stream with metadata --------------------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 150), min_size=1, max_size=20),
    shard_bytes=st.integers(1, 2000),
    window=st.integers(1, 300),
    stride=st.integers(1, 200),
    data=st.data(),
)
def test_stream_with_metadata_matches_reference(
    lengths: list[int], shard_bytes: int, window: int, stride: int, data: Any
) -> None:
    dt = [("token", "<u4"), ("metadata_id", "<u4"), ("concept", "<u2")]
    with tempfile.TemporaryDirectory() as tmp:
        c = make_corpus(
            Path(tmp) / "ds", dt, lengths, shard_bytes, metadata=True, seed=len(lengths)
        )
        assert c.labels is not None
        ref = c.stream
        view = StreamWithMetadata(c.path, window=window, stride=stride)
        n = len(view)
        if n == 0:
            return
        idx = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=8))
        batch = view.read(idx)
        assert set(batch.fields) == {"token", "concept"}
        for b, i in enumerate(idx):
            rows = slice(i * stride, i * stride + window)
            for name in ("token", "concept"):
                np.testing.assert_array_equal(batch.fields[name][b], ref[name][rows])
            got = [None if p < 0 else batch.metadata[p] for p in batch.positions[b]]
            assert got == c.labels[rows]
        # Records are distinct per (shard, id) and each is used.
        used = np.unique(batch.positions[batch.positions >= 0])
        np.testing.assert_array_equal(used, np.arange(len(batch.metadata)))
        one = view[idx[0]]
        rows = slice(idx[0] * stride, idx[0] * stride + window)
        assert [None if p < 0 else one.metadata[p] for p in one.positions] == c.labels[rows]


def test_metadata_costs_two_reads_per_shard_segment(tmp_path: Path) -> None:
    dt = [("token", "<u4"), ("metadata_id", "<u4")]
    c = make_corpus(tmp_path / "ds", dt, [40] * 10, shard_bytes=400, metadata=True)
    src = tokload.open_dataset(c.path)
    assert src.meta is not None
    t = 100
    starts = np.array([30, 150], dtype=np.uint64)
    scratch = TokenStream(src, window=t, stride=1).read(starts)
    assert isinstance(scratch, dict)
    ids = np.ascontiguousarray(scratch["metadata_id"]).astype(np.uint32)
    pos = np.empty((2, t), np.int32)
    items, spans, blob = src.meta.gather(starts, t, ids, pos)
    assert len(items) == len(np.unique(pos[pos >= 0]))
    shards_spanned = sum(len(src.rows.plan(int(s), t)) for s in starts)
    assert len(spans) <= shards_spanned  # one coalesced data read per segment
    assert blob == sum(int(s["length"]) for s in spans)
    deser = StreamWithMetadata(src, window=t, stride=1, deserialize=lambda b: b.decode()[::-1])
    assert all(isinstance(m, str) for m in deser.read([30]).metadata)


# ---- foreign formats -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny_uint16", "tiny_int32"])
def test_megatron_fixture_matches_megatron(name: str) -> None:
    expected = json.loads((MEGATRON / "expected.json").read_text())["datasets"][name]
    seqs = [np.array(s) for doc in expected["documents"] for s in doc]
    docs = Documents(MEGATRON / name)
    assert len(docs) == expected["sequence_count"] == len(seqs)
    assert docs.source.dtype == np.dtype(expected["dtype"])
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(docs[i], s)
    batch = docs.read(np.arange(len(seqs))[::-1])
    np.testing.assert_array_equal(batch.values, np.concatenate(seqs[::-1]))
    assert docs.source.user["document_indices"]().tolist() == expected["document_index"]
    flat = np.concatenate(seqs)
    for path in (MEGATRON / name, f"{MEGATRON / name}.bin", f"{MEGATRON / name}.idx"):
        stream = TokenStream(path, window=129, stride=64)
        assert len(stream) == (len(flat) - 129) // 64 + 1
        for i in (0, 7, len(stream) - 1):
            np.testing.assert_array_equal(stream[i], flat[i * 64 : i * 64 + 129])


def test_megatron_cross_check_with_megatron_core(tmp_path: Path) -> None:
    """Files written by megatron-core's own builder, read by both (where it installs)."""
    idx_mod = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    prefix = str(tmp_path / "mc")
    builder = idx_mod.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(5)
    for _ in range(30):
        builder.add_item(
            torch.from_numpy(rng.integers(0, 2**31 - 1, int(rng.integers(1, 99)), dtype=np.int32))
        )
        builder.end_document()
    builder.finalize(prefix + ".idx")
    theirs = idx_mod.IndexedDataset(prefix)
    ours = Documents(prefix)
    assert len(ours) == len(theirs)
    for i in range(len(theirs)):
        np.testing.assert_array_equal(ours[i], theirs[i])


def test_flat_files_npy_and_bin(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**16, 1000, dtype=np.uint16)
    b = rng.integers(0, 2**16, 777, dtype=np.uint16)
    a.tofile(tmp_path / "a.bin")
    b.tofile(tmp_path / "b.bin")
    np.save(tmp_path / "c.npy", b.astype(np.uint32))
    src = tokload.open_flat([tmp_path / "a.bin", tmp_path / "b.bin"], np.uint16)
    stream = TokenStream(src, window=100, stride=90)
    ab = np.concatenate([a, b])
    for i in range(len(stream)):
        np.testing.assert_array_equal(stream[i], ab[i * 90 : i * 90 + 100])
    npy = TokenStream(tmp_path / "c.npy", window=7)
    np.testing.assert_array_equal(npy[100], b[700:707].astype(np.uint32))
    # documents from an offsets index (.npy) and from an eos token
    np.save(tmp_path / "a.docs.npy", np.array([0, 10, 10, 400, 1000], dtype=np.uint64))
    d = Documents(
        tokload.open_flat(tmp_path / "a.bin", np.uint16, doc_index=tmp_path / "a.docs.npy")
    )
    assert len(d) == 4
    np.testing.assert_array_equal(d[2], a[10:400])
    assert len(d[1]) == 0
    eos = int(a[123])
    ends = np.flatnonzero(a == eos) + 1
    bounds = np.concatenate([[0], ends, [] if ends[-1] == len(a) else [len(a)]]).astype(int)
    e = Documents(tokload.open_flat(tmp_path / "a.bin", np.uint16, eos=eos))
    assert len(e) == len(bounds) - 1
    for k in range(len(e)):
        np.testing.assert_array_equal(e[k], a[bounds[k] : bounds[k + 1]])
    assert (tmp_path / f"a.bin.eos{eos}.docs").exists()  # cached for the next open
    with pytest.raises(ValueError, match=r"needs dtype="):
        tokload.open_flat(tmp_path / "a.bin")


@pytest.mark.filterwarnings("ignore:Stored array in format")
def test_npy_headers_of_every_version_and_damaged_ones(tmp_path: Path) -> None:
    """review52: a version 3.0 header (``np.save`` of field names outside Latin-1) was
    decoded as Latin-1: the batch's keys were mojibake; a header over 64 KiB was "not
    a .npy file"; a negative shape raised OverflowError naming no file; a 2-D
    ``doc_index`` was called a token file."""
    rows = np.zeros(6, dtype=[("词", "<u4"), ("label", "<u2")])
    rows["词"], rows["label"] = np.arange(6), 7
    np.save(tmp_path / "v3.npy", rows)
    assert (tmp_path / "v3.npy").read_bytes()[6:8] == bytes([3, 0])
    src = tokload.open_flat(tmp_path / "v3.npy")
    assert src.dtype.names == ("词", "label")
    got: Any = TokenStream(src, window=3).read([1])
    assert got["词"].tolist() == [[3, 4, 5]] and got["label"].tolist() == [[7, 7, 7]]
    wide = np.zeros(2, dtype=[(f"f{k:04d}", "<u2") for k in range(4000)])  # a 70 KiB header
    wide["f3999"] = [5, 6]
    np.save(tmp_path / "wide.npy", wide)
    assert tokload.open_flat(tmp_path / "wide.npy").dtype == wide.dtype
    np.save(tmp_path / "neg.npy", np.arange(4, dtype=np.uint32))
    raw = (tmp_path / "neg.npy").read_bytes().replace(b"(4,)", b"(-4,)", 1)
    (tmp_path / "neg.npy").write_bytes(raw)
    with pytest.raises(tokload.FormatError, match=r"neg.npy: the header promises -4 rows"):
        tokload.open_flat(tmp_path / "neg.npy")
    (tmp_path / "v9.npy").write_bytes(b"\x93NUMPY\x09\x00" + raw[8:])
    with pytest.raises(tokload.FormatError, match=r"v9.npy: not a .npy file: format version 9"):
        tokload.open_flat(tmp_path / "v9.npy")
    (tmp_path / "cut.npy").write_bytes(raw[:40])
    with pytest.raises(tokload.FormatError, match=r"cut.npy: not a .npy file: .*cut short"):
        tokload.open_flat(tmp_path / "cut.npy")
    np.arange(4, dtype=np.uint32).tofile(tmp_path / "t.bin")
    np.save(tmp_path / "idx.npy", np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises(tokload.FormatError, match=r"idx.npy: a document index must be 1-D"):
        tokload.open_flat(tmp_path / "t.bin", np.uint32, doc_index=tmp_path / "idx.npy")


def test_an_eos_cache_is_not_used_for_a_copy_that_kept_an_older_mtime(tmp_path: Path) -> None:
    """``cp -p``, ``rsync -a`` and ``tar x`` keep a file's older mtime; its ctime still
    says it changed after the cache was written, so the cache is recomputed."""
    import shutil

    train, other = tmp_path / "train.bin", tmp_path / "other.bin"
    np.array([7, 0, 8, 9, 0, 5, 6], np.uint16).tofile(other)
    np.array([1, 2, 0, 3, 4, 0, 5], np.uint16).tofile(train)
    os.utime(other, ns=(1, 10**18))  # older than the cache about to be written
    docs = Documents(tokload.open_flat(train, np.uint16, eos=0))
    assert [np.asarray(docs[i]).tolist() for i in range(len(docs))] == [[1, 2, 0], [3, 4, 0], [5]]
    cache = tmp_path / "train.bin.eos0.docs"
    assert cache.exists()
    shutil.copy2(other, train)  # same size, the older mtime kept
    assert os.stat(train).st_mtime_ns < os.stat(cache).st_mtime_ns
    docs = Documents(tokload.open_flat(train, np.uint16, eos=0))
    assert [np.asarray(docs[i]).tolist() for i in range(len(docs))] == [[7, 0], [8, 9, 0], [5, 6]]
    np.testing.assert_array_equal(np.fromfile(cache, "<u8"), [0, 2, 5, 7])  # rewritten


def test_a_damaged_eos_cache_is_recomputed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """review63: a cache was checked at its ends only (0 first, the rows last), so
    one with entries that decrease in between was used, and every read of the
    file then failed naming the cache: a cache that is not whole is recomputed,
    as the guide says, in blocks of any size."""
    from tokload import interop

    train = tmp_path / "train.bin"
    tokens = np.array([1, 2, 0, 3, 4, 0, 5, 6, 7, 0, 8], np.uint16)
    tokens.tofile(train)
    want = [[1, 2, 0], [3, 4, 0], [5, 6, 7, 0], [8]]
    cache = tmp_path / "train.bin.eos0.docs"
    monkeypatch.setattr(interop, "_CACHE_CHECK", 16)  # (two entries a block: the seams too)
    for damaged in ([0, 3, 2, 10, 11], [0, 3, 6, 5, 11], [0, 3, 6, 10, 11, 11, 9, 11]):
        docs = Documents(tokload.open_flat(train, np.uint16, eos=0))
        assert [np.asarray(docs[i]).tolist() for i in range(len(docs))] == want
        mtime = os.stat(cache).st_mtime_ns
        np.array(damaged, "<u8").tofile(cache)
        os.utime(cache, ns=(mtime, mtime))  # (as fresh as the one it replaces)
        docs = Documents(tokload.open_flat(train, np.uint16, eos=0))
        assert [np.asarray(docs[i]).tolist() for i in range(len(docs))] == want, damaged
        np.testing.assert_array_equal(np.fromfile(cache, "<u8"), [0, 3, 6, 10, 11])


@pytest.mark.parametrize("through", ["file", "directory"])
def test_an_eos_cache_is_not_used_once_a_link_on_the_way_is_re_pointed(
    tmp_path: Path, through: str
) -> None:
    """The cache sits beside the name given: re-pointing a link (the file's own or a
    directory's) to an older file of the same size found the cache of the file it
    named before, and served its documents, silently."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    np.array([1, 2, 0] * 4, np.uint16).tofile(tmp_path / "v1" / "t.bin")
    np.array([5, 6, 7, 0] * 3, np.uint16).tofile(tmp_path / "v2" / "t.bin")
    os.utime(tmp_path / "v1" / "t.bin", ns=(1, 10**18))  # the older of the two
    link = tmp_path / ("cur.bin" if through == "file" else "cur")
    name = link if through == "file" else link / "t.bin"

    def point(at: str) -> list[list[int]]:
        link.unlink(missing_ok=True)
        link.symlink_to(f"{at}/t.bin" if through == "file" else at)
        docs = Documents(tokload.open_flat(name, np.uint16, eos=0))
        return [np.asarray(docs[i]).tolist() for i in range(len(docs))]

    assert point("v2") == [[5, 6, 7, 0]] * 3
    assert point("v1") == [[1, 2, 0]] * 4
    assert point("v2") == [[5, 6, 7, 0]] * 3


def test_a_file_that_changes_while_its_eos_tokens_are_found_is_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokload import interop

    np.array([1, 2, 0, 3], np.uint16).tofile(tmp_path / "t.bin")
    seen = iter([2, 1])  # the file after the scan, then as it was before it
    monkeypatch.setattr(interop, "_check_unchanged", lambda *args: None)
    monkeypatch.setattr(interop, "file_version", lambda st: next(seen))
    src = tokload.open_flat(tmp_path / "t.bin", np.uint16, eos=0)
    assert len(Documents(src)) == 2
    assert not (tmp_path / "t.bin.eos0.docs").exists()  # a private index instead
    src.close()


def test_a_file_replaced_as_its_eos_cache_is_written_leaves_no_stale_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process replaced the file (the same size, other tokens) after the
    scan's check and before the cache was renamed into place: the cache, newer
    than the new file, passed for its index, and every later open split the new
    file's documents at the old eos tokens."""
    from tokload import interop

    path = tmp_path / "train.bin"
    np.array([1, 2, 7, 3, 4, 5, 7, 6, 6, 6], np.uint16).tofile(path)
    new = np.array([1, 7, 2, 3, 4, 5, 6, 7, 6, 6], np.uint16)
    real = tokload.files.create_unique

    def racing(directory: Path, prefix: str) -> Any:
        new.tofile(tmp_path / "swap")
        os.replace(tmp_path / "swap", path)
        return real(directory, prefix)

    monkeypatch.setattr(interop, "create_unique", racing)
    first = Documents(tokload.open_flat(path, np.uint16, eos=7))  # the old file's boundaries
    assert len(first) == 3
    # the cache, renamed into place after the new file, carries the old one's version
    cache = tmp_path / "train.bin.eos7.docs"
    assert os.stat(cache).st_mtime_ns < os.stat(path).st_ctime_ns
    monkeypatch.setattr(interop, "create_unique", real)
    again = Documents(tokload.open_flat(path, np.uint16, eos=7))
    assert [np.asarray(again[i]).tolist() for i in range(3)] == [[1, 7], [2, 3, 4, 5, 6, 7], [6, 6]]


def test_a_flat_file_shorter_than_it_was_sized_is_named(tmp_path: Path) -> None:
    """Replaced by a shorter file while being opened: a bare "mmap length is
    greater than file size" (naming no file) came out of the scan."""
    from tokload import interop

    path = tmp_path / "t.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    np.arange(4, dtype=np.uint16).tofile(tmp_path / "short")
    os.replace(tmp_path / "short", path)
    with pytest.raises(tokload.FormatError, match=r"t\.bin: the file changed while it was being"):
        interop._eos_index(path, 10, 0, np.dtype(np.uint16), 7, [])


def test_flat_files_refuse_an_eos_or_index_that_does_not_fit(tmp_path: Path) -> None:
    """An eos no row can hold would make the file one document; an index that does
    not run from row 0 to the file's last would leave rows in no document."""
    np.array([5, 6, 0, 7, 8, 0, 9, 4], dtype=np.uint16).tofile(tmp_path / "a.bin")
    before = set(tmp_path.iterdir())
    for eos in (65536, -1):
        with pytest.raises(ValueError, match=rf"a\.bin: eos={eos} is not a token of its dtype "
                           r"uint16 \(0 to 65535\)"):  # fmt: skip
            tokload.open_flat(tmp_path / "a.bin", np.uint16, eos=eos)
    not_ints: list[Any] = ["0", 0.0, True]
    for bad in not_ints:
        with pytest.raises(ValueError, match="eos must be an integer token"):
            tokload.open_flat(tmp_path / "a.bin", np.uint16, eos=bad)
    assert set(tmp_path.iterdir()) == before  # no cache written for a refused eos
    # a big-endian dtype was read as its little-endian twin (1 came back as 256)
    with pytest.raises(tokload.FormatError, match=r"a\.bin: rows must be little-endian, got "
                       r"dtype >u2"):  # fmt: skip
        tokload.open_flat(tmp_path / "a.bin", ">u2")
    zero: Any = np.int64(0)
    assert len(Documents(tokload.open_flat(tmp_path / "a.bin", np.uint16, eos=zero))) == 3
    for offsets, got in (([0, 3, 7], "0 to 7"), ([1, 3, 8], "1 to 8"), ([0, 3, 9], "0 to 9")):
        np.save(tmp_path / "i.npy", np.array(offsets, dtype=np.uint64))
        with pytest.raises(
            tokload.FormatError,
            match=rf"i\.npy: a document index of .*a\.bin must run from row 0 to its 8 rows, "
            rf"but it runs from {got}",
        ):
            tokload.open_flat(tmp_path / "a.bin", np.uint16, doc_index=tmp_path / "i.npy")
    np.array([0, 3, 8], dtype="<u8").tofile(tmp_path / "i.docs")  # raw uint64
    assert (
        len(
            Documents(
                tokload.open_flat(tmp_path / "a.bin", np.uint16, doc_index=tmp_path / "i.docs")
            )
        )
        == 2
    )


def test_a_long_document_index_is_checked_from_the_bytes_of_its_digest(tmp_path: Path) -> None:
    """The first and last entries come from the sample the file's digest reads; an index
    whose last entry is not the file's end (bytes after the array) is read where it is."""
    rows = 30_000
    np.arange(rows, dtype=np.uint16).tofile(tmp_path / "a.bin")
    ends = np.arange(0, rows + 1, 10, dtype=np.uint64)  # 3,001 entries: 24 kB, past 2 blocks
    for last, trailing in ((rows - 1, b""), (rows, b"\0" * 8), (rows + 10, b"\0" * 8)):
        ends[-1] = last
        np.save(tmp_path / "i.npy", ends)
        with open(tmp_path / "i.npy", "ab") as f:
            f.write(trailing)  # after the array: the last entry is not the file's last bytes
        if last != rows:
            with pytest.raises(tokload.FormatError, match=rf"runs from 0 to {last}$"):
                tokload.open_flat(tmp_path / "a.bin", np.uint16, doc_index=tmp_path / "i.npy")
        else:
            docs = Documents(
                tokload.open_flat(tmp_path / "a.bin", np.uint16, doc_index=tmp_path / "i.npy")
            )
            assert len(docs) == 3000
            assert np.asarray(docs[2999]).tolist() == list(range(29_990, rows))


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=300),
    block=st.integers(1, 80),
    start=st.integers(0, 300),
    length=st.integers(1, 16),
)
def test_a_sample_holds_the_bytes_it_says(data: bytes, block: int, start: int, length: int) -> None:
    """``Sample.at`` gives a file's bytes where its head or tail holds them, and its
    digest is SHA-256 of the size, the first ``block`` bytes and the last after them."""
    import hashlib

    from tokload.files import sample

    got = sample(len(data), lambda a, b: data[a:b], block)
    end = min(start + length, len(data))
    start = min(start, end)
    part = got.at(start, end)
    assert part is None or part == data[start:end]
    if end <= block or start >= max(block, len(data) - block):
        assert part == data[start:end]
    h = hashlib.sha256(len(data).to_bytes(8, "little") + data[:block])
    h.update(data[max(block, len(data) - block) :] if len(data) > block else b"")
    assert got.digest == h.hexdigest()


def test_headerless_npy_files_as_olmo_core_writes_them(tmp_path: Path) -> None:
    """OLMo-core and dolma name headerless token files ``.npy`` (np.memmap, no header)."""
    tokens = np.random.default_rng(2).integers(0, 2**32, 5000, dtype=np.uint32)
    mm = np.memmap(tmp_path / "part-0.npy", mode="w+", dtype=np.uint32, shape=tokens.shape)
    mm[:] = tokens
    mm.flush()
    del mm
    np.save(tmp_path / "saved.npy", tokens)
    src = tokload.open_flat([tmp_path / "part-0.npy", tmp_path / "saved.npy"], np.uint32)
    stream = TokenStream(src, window=5000, stride=5000)
    assert len(stream) == 2
    np.testing.assert_array_equal(stream[0], tokens)  # headerless: every byte a token
    np.testing.assert_array_equal(stream[1], tokens)  # np.save's: the header skipped
    # without dtype= there is no way to know its rows: the error says how to read it
    with pytest.raises(tokload.FormatError, match=r"part-0\.npy: not a \.npy file: .*dtype="):
        tokload.open_flat(tmp_path / "part-0.npy")
    with pytest.raises(tokload.FormatError, match=r"part-0\.npy: not a \.npy file"):
        TokenStream(tmp_path / "part-0.npy", window=8)
    # a real .npy header still decides its dtype
    with pytest.raises(tokload.FormatError, match=r"saved\.npy: holds uint32, but dtype=uint16"):
        tokload.open_flat(tmp_path / "saved.npy", np.uint16)
    # a headerless file must hold whole rows
    (tmp_path / "odd.npy").write_bytes(b"\x01\x02\x03")
    with pytest.raises(tokload.FormatError, match=r"odd\.npy: 3 bytes is not a whole number"):
        tokload.open_flat(tmp_path / "odd.npy", np.uint16)


def test_opening_is_independent_of_size(tmp_path: Path) -> None:
    """A 16 GiB sparse token file opens without reading it; reads at its end work."""
    big = tmp_path / "big.bin"
    rows = 4 << 30
    with open(big, "wb") as f:
        f.truncate(rows * 4)
        f.seek((rows - 3) * 4)
        f.write(np.array([7, 8, 9], dtype=np.uint32).tobytes())
    t0 = time.perf_counter()
    stream = TokenStream(tokload.open_flat(big, np.uint32), window=3, stride=1)
    assert time.perf_counter() - t0 < 1.0
    assert len(stream) == rows - 2
    np.testing.assert_array_equal(stream[-1], [7, 8, 9])
    np.testing.assert_array_equal(stream[rows // 2], [0, 0, 0])


# ---- writer behaviour ----------------------------------------------------------------------------


def test_append_and_merge_without_copying(tmp_path: Path) -> None:
    a = make_corpus(tmp_path / "a", "<u4", [50, 60], shard_bytes=10**6, seed=1)
    with Writer(a.path, "<u4", mode="a") as w:
        w.write([1, 2, 3])
    m = tokload.open_dataset(a.path).manifest
    assert m is not None and len(m.shards) == 2
    np.testing.assert_array_equal(Documents(a.path)[2], [1, 2, 3])
    b = make_corpus(tmp_path / "parts" / "b", "<u4", [5, 6, 7], shard_bytes=30, seed=2)
    merged = tokload.merge(tmp_path / "merged", [a.path, b.path])
    assert all(not (tmp_path / "merged" / f"{s.name}.rows").is_symlink() for s in merged.shards)
    assert os.listdir(tmp_path / "merged") == ["manifest.json"]
    docs = Documents(tmp_path / "merged")
    assert len(docs) == 6
    np.testing.assert_array_equal(docs[5], b.docs[2])
    # the fingerprint depends on contents, not on where shards live
    again = tokload.merge(tmp_path / "merged2", [a.path, b.path])
    assert again.fingerprint() == merged.fingerprint()


def test_a_crash_leaves_only_complete_shards(tmp_path: Path) -> None:
    code = f"""
import os, numpy as np, tokload
w = tokload.Writer({str(tmp_path / "ds")!r}, "<u4", shard_bytes=400)
for k in range(25):
    w.write(np.full(30, k, np.uint32))  # a shard holds 3 documents of 120 bytes
os._exit(0)  # killed mid-shard: no close(), no flush
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    docs = Documents(tmp_path / "ds")
    assert len(docs) == 24  # 8 complete shards of 3; the 25th document was never published
    for k in range(24):
        np.testing.assert_array_equal(docs[k], np.full(30, k))


def test_append_after_a_crash_steps_past_the_killed_writers_files(tmp_path: Path) -> None:
    """A writer killed with a shard open leaves that shard's files, listed in no
    manifest (and, in layout "blocks", hidden ``.tmp`` files); appending with the
    same ``name_prefix`` once failed on them (FileExistsError). The new shard
    takes the next free name and the leftovers stay as they were."""
    ds = tmp_path / "ds"
    code = f"""
import os, numpy as np, tokload
w = tokload.Writer({str(ds)!r}, "<u2", metadata=True, metadata_layout="blocks",
                   shard_bytes=100, name_prefix="p")
for k in range(9):
    w.write(np.full(30, k, np.uint16), spans=[(0, 5, b"x")])  # 60 bytes: a shard each
os._exit(0)  # killed with shard p-00008 open
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    left = sorted(p.name for p in ds.iterdir() if "p-00008" in p.name)
    assert left == [
        ".p-00008.mdb.tmp",
        ".p-00008.mds.tmp",
        ".p-00008.mdx.tmp",
        "p-00008.docs",
        "p-00008.rows",
    ]
    before = {p.name: p.read_bytes() for p in ds.iterdir() if "p-00008" in p.name}
    with Writer(ds, "<u2", mode="a", metadata=True, metadata_layout="blocks", name_prefix="p") as w:
        w.write(np.full(4, 99, np.uint16), spans=[(0, 4, b"y")])
        w.flush()
        # a file that appears while the writer runs (another writer with the
        # same prefix) is stepped past too
        (ds / "p-00010.rows").write_bytes(b"")
        w.write(np.full(3, 98, np.uint16), spans=[(0, 3, b"z")])
    names = [s.name for s in read_manifest(ds).shards]
    assert names == [f"p-{k:05d}" for k in range(8)] + ["p-00009", "p-00011"]
    assert {p.name: p.read_bytes() for p in ds.iterdir() if "p-00008" in p.name} == before
    docs = Documents(ds)
    assert len(docs) == 10
    np.testing.assert_array_equal(docs[8], np.full(4, 99))
    np.testing.assert_array_equal(docs[9], np.full(3, 98))
    assert verify(ds) == []


@pytest.mark.parametrize(("prefix", "existing"), [(None, True), ("same", True), (None, False)])
def test_writers_appending_at_once_keep_each_others_documents(
    tmp_path: Path, prefix: str | None, existing: bool
) -> None:
    """Each writer rewrote the manifest from the copy it read at open: the last to
    close a shard dropped the other's (20 of 41 documents were left). The manifest
    is now updated under a lock, from what is on disk (also when the directory held
    no dataset yet: the second to publish adds to the first's)."""
    ds = tmp_path / "ds"
    if existing:
        with Writer(ds, "<u2") as w:
            w.write(np.full(5, 999, np.uint16))
    go = tmp_path / "go"
    code = f"""
import os, sys, time, numpy as np, tokload
k = int(sys.argv[1])
while not os.path.exists({str(go)!r}):
    time.sleep(0.001)
with tokload.Writer({str(ds)!r}, "<u2", mode="a", name_prefix={prefix!r}, shard_bytes=200) as w:
    for i in range(30):
        w.write(np.full(50, k * 100 + i, np.uint16))
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(k)]) for k in (1, 2)]
    time.sleep(1.0)  # both started, waiting
    go.touch()
    assert [p.wait(60) for p in procs] == [0, 0]
    docs = Documents(ds)
    every = docs.read(np.arange(len(docs)))
    firsts = sorted(np.asarray(every.values)[every.offsets[:-1]].tolist())
    assert firsts == sorted([999] * existing + [*range(100, 130), *range(200, 230)])
    assert verify(ds) == []
    listed = {s.name for s in read_manifest(ds).shards}
    assert {p.name.rsplit(".", 1)[0] for p in ds.glob("*.rows")} == listed  # none unlisted


def test_values_are_range_checked_and_structured_input_accepted(tmp_path: Path) -> None:
    with Writer(tmp_path / "u2", "<u2") as w:
        with pytest.raises(ValueError, match=r"value 65536 does not fit in uint16"):
            w.write([1, 65536])
        with pytest.raises(ValueError, match=r"value -1 does not fit"):
            w.write(np.array([-1]))
        with pytest.raises(TypeError, match=r"must be integers, got dtype float64"):
            w.write([1.5])
        w.write(np.array([1, 2], dtype=np.int64))
    np.testing.assert_array_equal(Documents(tmp_path / "u2")[0], [1, 2])
    # without loss at uint64's edge: NumPy makes [2**64 - 1, 1] float64, [2**64] object,
    # and a bool array once failed its range check
    with Writer(tmp_path / "u8", "<u8") as w:
        w.write([2**64 - 1, 1, 2])
        w.write(np.array([True, False]))
        with pytest.raises(ValueError, match=r"value 18446744073709551616 does not fit in uint64"):
            w.write([2**64, 1])
        with pytest.raises(ValueError, match=r"value -1 does not fit in uint64"):
            w.write([2**63, -1])
        with pytest.raises(TypeError, match=r"must be integers, got dtype float64"):
            w.write([2**64 - 1, 1.5])
    docs = Documents(tmp_path / "u8")
    assert np.asarray(docs[0]).tolist() == [2**64 - 1, 1, 2]
    assert np.asarray(docs[1]).tolist() == [1, 0]


def test_a_views_repr_shows_its_part_and_boundaries(tmp_path: Path) -> None:
    """review68: a ``Documents`` repr had a double space, a part of a view showed no
    range, and boundaries did not show (the fingerprint is unchanged by them)."""
    with Writer(tmp_path / "d", "<u2") as w:
        for n in (3, 5, 2):
            w.write(np.arange(n, dtype=np.uint16))
    d = str(tmp_path / "d")
    assert repr(Documents(d)) == f"Documents({d!r}, n=3)"
    assert repr(Documents(d).subset(1, 3)) == f"Documents({d!r}, n=2 of [1, 3))"
    ts = TokenStream(d, window=4, boundaries=["cu_seqlens"])
    assert repr(ts) == f"TokenStream({d!r}, window=4, stride=4, boundaries=['cu_seqlens'], n=2)"
    assert ts.fingerprint == TokenStream(d, window=4).fingerprint
    blend = tokload.Blend([(ts, 1)], length=8, block_size=2).subset(2, 6)  # (review69)
    assert repr(blend) == (
        "Blend(1 component, stages=1, block_size=2, boundaries=['cu_seqlens'], n=4 of [2, 6))"
    )


def test_read_padded_refuses_a_pad_that_is_not_an_integer_whatever_the_dtype(
    tmp_path: Path,
) -> None:
    """review68, review69: pad=1.5 padded with 1, and the first fix held for a plain
    dtype only (a structured one took its own path)."""
    for dtype, rows in (("<u2", np.arange(3)), ([("tokens", "<u2"), ("mask", "<u1")], None)):
        path = tmp_path / str(len(str(dtype)))
        with Writer(path, dtype) as w:
            for n in (3, 1):
                w.write(np.arange(n) if rows is not None else
                        {"tokens": np.arange(n), "mask": np.ones(n, np.uint8)})  # fmt: skip
        for pad in (1.5, True):
            with pytest.raises(TypeError, match=rf"pad must be an integer token, got {pad!r}"):
                Documents(path).read_padded([0, 1], pad=pad)  # type: ignore[arg-type]
        values, _ = Documents(path).read_padded([1, 0], pad=7)
        first = values if rows is not None else values["tokens"]
        assert np.asarray(first)[0].tolist() == [0, 7, 7]


def test_document_batches_refuse_bad_arguments(tmp_path: Path) -> None:
    with Writer(tmp_path / "d", "<u2") as w:
        for n in (3, 5, 2):
            w.write(np.arange(n, dtype=np.uint16))
    docs = Documents(tmp_path / "d").subset(1, 3)
    with pytest.raises(IndexError, match=r"observation 2 is out of range for a view of 2"):
        docs.read([0, 2])
    with pytest.raises(IndexError, match=r"observation -1 is out of range for a view of 2"):
        docs.read_padded([-1])
    with pytest.raises(TypeError, match=r"indices must be integers, got dtype float64"):
        docs.read([0.5])
    with pytest.raises(IndexError, match=r"observation 9223372036854775808 is out of range"):
        docs.read(np.array([1 << 63], dtype=np.uint64))  # not wrapped to a negative index
    with pytest.raises(ValueError, match=r"length must be a positive integer, got 0"):
        docs.read_padded([0], 0)
    for length in (2.5, True, "4"):  # (review68: 2.5 was 2, True 1, "4" a bare TypeError)
        with pytest.raises(ValueError, match=rf"length must be a positive integer, got {length!r}"):
            docs.read_padded([0], length)  # type: ignore[arg-type]
    for pad in (1.5, True):  # (review68: both padded with 1)
        with pytest.raises(TypeError, match=rf"pad must be an integer token, got {pad!r}"):
            docs.read_padded([0], 4, pad=pad)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        docs.read_padded([0], pad=70000)  # does not fit uint16
    padded, plen = docs.read_padded([1, 0], pad=65535)
    np.testing.assert_array_equal(padded, [[0, 1, 65535, 65535, 65535], [0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(plen, [2, 5])


def test_empty_documents_and_all_empty_metadata_records(tmp_path: Path) -> None:
    """Valid data with nothing in it reads the same in every build (the debug build
    once refused it: ``&buf[0]`` on an empty buffer). The sanitizer job runs this."""
    lengths = [0, 3, 0, 0, 2, 0]
    with Writer(tmp_path / "d", "<u4", shard_bytes=12, name_prefix="e") as w:
        for k, n in enumerate(lengths):
            w.write(np.arange(n, dtype=np.uint32) + 10 * k)
    docs = Documents(tmp_path / "d")
    assert len(docs) == len(lengths)
    for k, n in enumerate(lengths):
        np.testing.assert_array_equal(docs[k], np.arange(n) + 10 * k)
    batch = docs.read([0, 2, 3])  # a batch of empty documents only
    assert batch.lengths.tolist() == [0, 0, 0]
    assert batch.offsets.tolist() == [0, 0, 0, 0]
    assert len(np.asarray(batch.values)) == 0
    padded, plen = docs.read_padded([5, 1], 4)
    assert plen.tolist() == [0, 3]
    np.testing.assert_array_equal(np.asarray(padded)[1, :3], [10, 11, 12])

    dt = [("token", "<u4"), ("metadata_id", "<u4")]
    with Writer(tmp_path / "m", dt, metadata=True, shard_bytes=48, name_prefix="e") as w:
        w.write({"token": np.arange(6)}, spans=[(0, 3, b""), (3, 6, b"")])  # empty records only
        w.write({"token": np.arange(0)})  # an empty document
        w.write({"token": np.arange(6) + 6}, spans=[(0, 1, b""), (2, 4, b"x")])
    view = StreamWithMetadata(tmp_path / "m", window=3)
    b = view.read([0, 1])  # windows whose records are all empty
    assert b.metadata == [b"", b""]
    assert b.positions.tolist() == [[0, 0, 0], [1, 1, 1]]
    c = view[2]
    np.testing.assert_array_equal(c.fields["token"], [6, 7, 8])
    assert [None if p < 0 else c.metadata[p] for p in c.positions] == [b"", None, b"x"]
    mdocs = Documents(tmp_path / "m")
    assert [len(mdocs[k]["token"]) for k in range(3)] == [6, 0, 6]
