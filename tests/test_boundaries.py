"""``TokenStream(..., boundaries=True)``: attention metadata of packed windows.

Every output is checked against a pure-Python reference built from the documents'
lengths (hypothesis: windows that start or end on a boundary, cross shards, hold one
or hundreds of documents, empty documents), on tokload datasets, a Megatron-LM
dataset and flat files with an end-of-document token; a block-diagonal attention
built from the outputs equals attention over each document alone; and through the
DataLoader every sample comes exactly once across a resume on another world size,
with the extras of its batch.

A ``Blend`` of such streams (of the three formats, nested too) gives, for every
sample, its component's own extras, and the batch's ``cu_seqlens`` over its rows;
through the DataLoader the same, exactly once across a resume on another world
size; components whose keys differ are refused.
"""

from __future__ import annotations

import itertools
import os
import struct
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from harness import Segment, run_segments
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tokload

MEGATRON = Path(__file__).resolve().parent / "data" / "megatron" / "tiny_uint16"


def reference(doc_lengths: list[int], rows: list[int], window: int) -> dict[str, Any]:
    """The extras of windows starting at ``rows``, one token at a time."""
    starts = set(np.cumsum([0, *doc_lengths])[:-1].tolist())
    pos, seg, mask, cu = [], [], [], []
    longest = 0
    for b, r in enumerate(rows):
        p_row, s_row, m_row = [], [], []
        p = s = run = 0
        for t in range(window):
            if t > 0 and r + t in starts:  # a document starts inside the window
                cu.append(b * window + t - run)
                s += 1
                longest = max(longest, run)
                p = run = 0
            p_row.append(p)
            s_row.append(s)
            m_row.append(p != 0)
            p += 1
            run += 1
        cu.append(b * window + window - run)
        longest = max(longest, run)
        pos.append(p_row)
        seg.append(s_row)
        mask.append(m_row)
    # cu so far lists each segment's start when the next one begins: put in order
    cu = [*sorted(cu), len(rows) * window]
    return {
        "position_ids": np.array(pos, dtype=np.int64).reshape(len(rows), window),
        "segment_ids": np.array(seg, dtype=np.int32).reshape(len(rows), window),
        "loss_mask": np.array(mask, dtype=bool).reshape(len(rows), window),
        "cu_seqlens": np.array(cu, dtype=np.int32),
        "max_seqlen": longest,
    }


def check(view: tokload.TokenStream, doc_lengths: list[int], indices: np.ndarray) -> None:
    got = view.boundaries(indices)
    rows = [int(i) * view.stride for i in indices]
    want = reference(doc_lengths, rows, view.window)
    for key in ("position_ids", "segment_ids", "loss_mask", "cu_seqlens"):
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert got["max_seqlen"] == want["max_seqlen"]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=120),
    window=st.integers(1, 300),
    stride=st.integers(1, 50),
    shard_bytes=st.sampled_from([64, 256, 1 << 20]),
    held=st.booleans(),
    data=st.data(),
)
def test_every_output_matches_the_reference(
    lengths: list[int],
    window: int,
    stride: int,
    shard_bytes: int,
    held: bool,
    data: st.DataObject,
) -> None:
    """``held``: the document index in memory (searched table by table) or read entry
    by entry (``TOKLOAD_INDEX_MEMORY=0``: the batched search of the index)."""
    rows = sum(lengths)
    assume(rows > 0)
    window = min(window, rows)
    tokens = np.arange(rows, dtype=np.uint16)
    with tempfile.TemporaryDirectory() as d:
        with tokload.Writer(Path(d) / "ds", "<u2", shard_bytes=shard_bytes) as w:
            at = 0
            for n in lengths:
                w.write(tokens[at : at + n])
                at += n
        with mock.patch.dict(os.environ, {"TOKLOAD_INDEX_MEMORY": str(1 << 30 if held else 0)}):
            view = tokload.TokenStream(
                Path(d) / "ds", window=window, stride=stride, boundaries=True
            )
        index: Any = view.source.docs
        assert index.tables.enabled == held
        plain = tokload.TokenStream(Path(d) / "ds", window=window, stride=stride)
        n = len(view)
        idx = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=9)))
        check(view, lengths, idx)
        check(view, lengths, np.arange(n))  # every window: starts and ends on boundaries
        np.testing.assert_array_equal(view.read(idx), plain.read(idx))  # the same tokens
        view.close()


def test_windows_of_hundreds_of_documents_across_shards(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(0, 4, 20_000)]  # empty documents too
    with tokload.Writer(tmp_path / "ds", "<u4", shard_bytes=4096) as w:
        for n in lengths:
            w.write(np.full(n, 7, dtype=np.uint32))
    view = tokload.TokenStream(tmp_path / "ds", window=1024, stride=1000, boundaries=True)
    assert len(view.source.rows.files.paths) > 5
    check(view, lengths, rng.integers(0, len(view), 16))
    got = view.boundaries([3])
    assert got["segment_ids"].max() > 300  # hundreds of documents in one window


def test_a_shard_of_uneven_documents_held_in_memory(tmp_path: Path) -> None:
    """A shard's table held in memory is searched through its directory (buckets of
    rows, about 4 documents each on average): here buckets of dozens of tiny or empty
    documents, then empty buckets inside one long document, then tiny ones again."""
    lengths = [*([0, 1, 2] * 1700), 100_000, *([1] * 5000)]
    with tokload.Writer(tmp_path / "ds", "<u4", shard_bytes=1 << 30) as w:
        for n in lengths:
            w.write(np.full(n, 7, dtype=np.uint32))
    view = tokload.TokenStream(tmp_path / "ds", window=300, stride=97, boundaries=True)
    index: Any = view.source.docs
    assert index.tables.enabled and len(view.source.rows.files.paths) == 1
    n = len(view)
    check(view, lengths, np.arange(n))
    # the table and its directory (rows >> shift, 2 more): less than a quarter more
    table = (len(lengths) + 1) * 8
    assert table < index.tables.held_bytes() <= table + 8 * (len(lengths) // 4 + 2)


def test_a_megatron_dataset_in_place() -> None:
    docs = tokload.Documents(str(MEGATRON))
    lengths = [len(docs[i]) for i in range(len(docs))]
    view = tokload.TokenStream(str(MEGATRON), window=37, stride=11, boundaries=True)
    check(view, lengths, np.arange(len(view)))


def test_flat_files_with_an_end_of_document_token(tmp_path: Path) -> None:
    eos = 0
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(1, 30, 200)]
    parts = [np.concatenate([rng.integers(1, 500, n - 1), [eos]]) for n in lengths]
    np.concatenate(parts).astype(np.uint16).tofile(tmp_path / "train.bin")
    src = tokload.open_flat(tmp_path / "train.bin", np.uint16, eos=eos)
    view = tokload.TokenStream(src, window=64, stride=17, boundaries=True)
    check(view, lengths, np.arange(len(view)))


def test_a_view_without_documents_and_bad_keys_are_refused(tmp_path: Path) -> None:
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "flat.bin")
    with pytest.raises(ValueError, match=r"flat\.bin: boundaries=True needs document boundaries"):
        tokload.TokenStream(tokload.open_flat(tmp_path / "flat.bin", np.uint16), 8, boundaries=True)
    with pytest.raises(TypeError, match=r"boundaries must be True, False or a list of keys"):
        tokload.TokenStream(str(MEGATRON), 8, boundaries=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got 'cu_seqlens'"):
        tokload.TokenStream(str(MEGATRON), 8, boundaries="cu_seqlens")
    with pytest.raises(ValueError, match=r"unknown keys \['labels'\] \(valid: position_ids,"):
        tokload.TokenStream(str(MEGATRON), 8, boundaries=["cu_seqlens", "labels"])
    with pytest.raises(ValueError, match=r"an empty list of keys; give False for none"):
        tokload.TokenStream(str(MEGATRON), 8, boundaries=[])
    view = tokload.TokenStream(str(MEGATRON), 8, boundaries=True)
    # the same samples: a checkpoint of one resumes on the other
    assert view.fingerprint == tokload.TokenStream(str(MEGATRON), 8).fingerprint


def test_only_the_keys_asked_for(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    with tokload.Writer(tmp_path / "ds", "<u2") as w:
        for _ in range(200):
            w.write(rng.integers(1, 1000, int(rng.integers(1, 50)), dtype=np.uint16))
    full = tokload.TokenStream(tmp_path / "ds", window=40, boundaries=True)
    varlen = tokload.TokenStream(
        tmp_path / "ds", window=40, boundaries=["max_seqlen", "cu_seqlens"]
    )
    assert varlen.boundary_keys == ("cu_seqlens", "max_seqlen")
    idx = np.array([3, 0, 17, 5])
    want, got = full.boundaries(idx), varlen.boundaries(idx)
    assert sorted(got) == ["cu_seqlens", "max_seqlen"]
    np.testing.assert_array_equal(got["cu_seqlens"], want["cu_seqlens"])
    assert got["max_seqlen"] == want["max_seqlen"]
    pos = tokload.TokenStream(tmp_path / "ds", window=40, boundaries=["position_ids"])
    assert sorted(pos.boundaries(idx)) == ["position_ids"]
    np.testing.assert_array_equal(pos.boundaries(idx)["position_ids"], want["position_ids"])
    batch = next(iter(tokload.DataLoader(varlen, 4, num_threads=0, device=None)))
    assert sorted(batch) == ["cu_seqlens", "index", "max_seqlen", "position", "tokens"]
    assert sorted(full.boundaries([])) == sorted(tokload.views.BOUNDARY_KEYS)
    assert full.boundaries([])["position_ids"].shape == (0, 40)


def test_block_diagonal_attention_equals_attention_per_document(tmp_path: Path) -> None:
    """What a trainer builds from a batch: a causal mask within segments. Each
    segment's outputs equal attention over that segment alone."""
    rng = np.random.default_rng(2)
    with tokload.Writer(tmp_path / "ds", "<u2") as w:
        for _ in range(300):
            w.write(rng.integers(1, 1000, int(rng.integers(1, 40)), dtype=np.uint16))
    view = tokload.TokenStream(tmp_path / "ds", window=64, boundaries=True)
    batch = next(iter(tokload.DataLoader(view, 4, seed=5, num_threads=0, device=None)))
    torch.manual_seed(0)
    emb = torch.nn.Embedding(1000, 16)
    x = emb(batch["tokens"].long())  # [B, W, 16]
    seg, pos = batch["segment_ids"], batch["position_ids"]
    same = seg[:, :, None] == seg[:, None, :]
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    mask = same & causal  # [B, W, W]
    out = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
    cu = batch["cu_seqlens"].tolist()
    assert batch["max_seqlen"] == max(b - a for a, b in itertools.pairwise(cu))
    flat_x, flat_out = x.reshape(-1, 16), out.reshape(-1, 16)
    for a, e in itertools.pairwise(cu):
        alone = torch.nn.functional.scaled_dot_product_attention(
            flat_x[a:e], flat_x[a:e], flat_x[a:e], is_causal=True
        )
        torch.testing.assert_close(flat_out[a:e], alone)
        b, t = divmod(a, 64)
        assert pos[b, t] == 0 and (pos.reshape(-1)[a:e] == torch.arange(e - a)).all()
    # the loss mask drops exactly the targets that start a segment
    assert (~batch["loss_mask"]).sum() == len(cu) - 1


def test_exactly_once_across_a_resume_on_another_world_size(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    with tokload.Writer(tmp_path / "ds", "<u2", shard_bytes=2048) as w:
        for _ in range(400):
            w.write(rng.integers(1, 1000, int(rng.integers(1, 90)), dtype=np.uint16))
    view = tokload.TokenStream(tmp_path / "ds", window=50, boundaries=True)

    def make(**kw: Any) -> tokload.DataLoader:
        return tokload.DataLoader(view, seed=9, epochs=1, **kw)

    got = run_segments(make, [Segment(2, 3, 10), Segment(3, 2, None)])
    seen: list[int] = []
    for b in got.batches.values():
        idx = b["index"].cpu().numpy()
        want = view.boundaries(idx)
        for key in ("position_ids", "segment_ids", "loss_mask", "cu_seqlens"):
            np.testing.assert_array_equal(b[key].cpu().numpy(), want[key])
        assert b["max_seqlen"] == want["max_seqlen"]
        seen.extend(idx.tolist())
    assert sorted(seen) == list(range(len(view)))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=2, max_size=40),
    order=st.randoms(use_true_random=False),
    window=st.integers(1, 64),
)
def test_a_megatron_index_out_of_order_never_gives_wrong_windows(
    lengths: list[int], order: Any, window: int
) -> None:
    """A damaged (unsorted) Megatron index: a named error, or extras that match what
    its sequences' first rows say, never a crash or an out-of-range write."""
    starts = np.cumsum([0, *lengths])[:-1]
    ids = list(range(len(lengths)))
    order.shuffle(ids)
    rows = sum(lengths)
    window = min(window, rows)
    with tempfile.TemporaryDirectory() as d:
        prefix = Path(d) / "bad"
        nseq = len(lengths)
        header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, nseq, nseq + 1)
        with open(f"{prefix}.idx", "wb") as f:
            f.write(header)
            f.write(np.array([lengths[i] for i in ids], dtype=np.int32).tobytes())
            f.write(np.array([starts[i] * 2 for i in ids], dtype=np.int64).tobytes())
            f.write(np.arange(nseq + 1, dtype=np.int64).tobytes())
        np.arange(rows, dtype=np.uint16).tofile(f"{prefix}.bin")
        try:
            view = tokload.TokenStream(str(prefix), window=window, boundaries=True)
        except tokload.FormatError:
            return  # the first sequence does not start at row 0
        for i in range(len(view)):
            try:
                got = view.boundaries([i])
            except tokload.CorruptDataError as e:
                assert "not sorted by row" in str(e)
                continue
            r = i * window
            cu = got["cu_seqlens"].tolist()
            assert cu[0] == 0 and cu[-1] == window and cu == sorted(set(cu))
            assert all(r + c in set(starts.tolist()) for c in cu[1:-1])
            assert got["position_ids"].shape == (1, window)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    keys=st.sampled_from(
        [True, ["cu_seqlens"], ["max_seqlen"], ["cu_seqlens", "max_seqlen"], ["loss_mask"]]
    ),
    seed=st.integers(0, 5),
)
def test_read_steps_gives_each_step_what_read_batch_gives(
    sizes: list[int], keys: Any, seed: int
) -> None:
    """The loader reads a task's steps at once (``read_steps``): the rows, and each
    step's cu_seqlens and max_seqlen, equal ``read_batch`` of each step alone,
    steps without rows (a rank's share of a final partial batch) included."""
    view = tokload.TokenStream(str(MEGATRON), window=23, stride=9, boundaries=keys)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(view), sum(sizes))
    ends = np.cumsum(sizes).tolist()
    cuts = list(zip([0, *ends], ends, strict=False))
    raw, steps = view.read_steps(idx, cuts, np.empty)
    assert len(steps) == len(cuts)
    for (a, e), step in zip(cuts, steps, strict=True):
        want = view.read_batch(idx[a:e], np.empty)
        for key, value in want.items():
            got = step[key] if key in step else raw[key][a:e]
            if isinstance(got, slice):
                got = raw[key][got]
            np.testing.assert_array_equal(got, value, err_msg=key)
        assert set(want) == set(step) | (set(raw) - set(step))


def test_a_task_of_steps_is_one_read(tmp_path: Path) -> None:
    """With boundaries the loader still reads a task's windows with one call."""
    view = tokload.TokenStream(str(MEGATRON), window=23, stride=9, boundaries=True)
    calls = []
    real = view.read_steps

    def counted(*args: Any) -> Any:
        calls.append(len(args[1]))
        return real(*args)

    with mock.patch.object(view, "read_steps", counted):
        loader = tokload.DataLoader(
            view,
            4,
            epochs=1,
            num_threads=1,
            device=None,
            read=tokload.ReadOptions(steps_per_task=5),
        )
        batches = list(loader)
    assert calls[0] == 1 and set(calls[1:-1]) == {5}  # the first task is one step
    assert sum(calls) == len(batches)
    for b in batches:
        want = view.read_batch(b["index"].numpy(), np.empty)
        assert b["max_seqlen"] == want.pop("max_seqlen")
        for key, value in want.items():
            np.testing.assert_array_equal(b[key].numpy(), value, err_msg=key)


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_each_step_gets_its_slice_of_a_tasks_values(kind: str) -> None:
    """``batching.cut``: rows of the row keys; slices back to back from 0 are
    cut with one split (of a tensor, or of an array under a collate function),
    others one by one; a ``Part`` is a flat range reshaped; values that are not
    slices are given as they are."""
    from tokload.batching import Part, Task, cut

    arr = np.arange(20, dtype=np.int32)
    whole = {"cu": torch.from_numpy(arr) if kind == "tensor" else arr}
    back_to_back = [slice(0, 3), slice(3, 3), slice(3, 10)]
    scattered = [slice(5, 8), slice(0, 2), slice(2, 2)]
    for slices in (back_to_back, scattered):
        steps = [{"cu": s, "top": k} for k, s in enumerate(slices)]
        batches = cut(Task(whole, steps, []), whole)
        for b, s, k in zip(batches, slices, range(len(slices)), strict=True):
            np.testing.assert_array_equal(np.asarray(b["cu"]), arr[s])
            assert b["top"] == k
    rows = cut(Task(whole, [{}, {}], [], rows=[(0, 2), (2, 5)], row_keys=["cu"]), whole)
    np.testing.assert_array_equal(np.asarray(rows[1]["cu"]), arr[2:5])
    steps = [{"cu": Part(2, 8, (2, 3))}, {"cu": Part(8, 8, (0, 4))}]
    parts = cut(Task(whole, steps, []), whole)
    np.testing.assert_array_equal(np.asarray(parts[0]["cu"]), arr[2:8].reshape(2, 3))
    assert tuple(parts[1]["cu"].shape) == (0, 4)


def _formats(tmp_path: Path, keys: Any, window: int = 23) -> list[tokload.TokenStream]:
    """Streams with boundaries of the three formats, ``uint16``: a tokload build, the
    Megatron fixture, a flat file with an end-of-document token."""
    rng = np.random.default_rng(7)
    with tokload.Writer(tmp_path / "ds", "<u2", shard_bytes=512) as w:
        for _ in range(300):
            w.write(rng.integers(1, 1000, int(rng.integers(0, 40)), dtype=np.uint16))
    lengths = [int(x) for x in rng.integers(1, 30, 150)]
    parts = [np.concatenate([rng.integers(1, 500, n - 1), [0]]) for n in lengths]
    np.concatenate(parts).astype(np.uint16).tofile(tmp_path / "flat.bin")
    flat = tokload.open_flat(tmp_path / "flat.bin", np.uint16, eos=0)
    return [
        tokload.TokenStream(tmp_path / "ds", window=window, boundaries=keys),
        tokload.TokenStream(str(MEGATRON), window=window, stride=7, boundaries=keys),
        tokload.TokenStream(flat, window=window, stride=11, boundaries=keys),
    ]


def _per_sample(blend: tokload.Blend, idx: np.ndarray) -> dict[str, Any]:
    """What a blend's boundaries of ``idx`` must be: each sample's component's own,
    row by row, and ``cu_seqlens`` / ``max_seqlen`` over the rows together."""
    rows: list[dict[str, Any]] = []
    for i in idx.tolist():
        view: Any = blend
        j = i
        while isinstance(view, tokload.Blend):  # a nested blend: down to a stream
            comp, index = view.locate([j])
            view, j = view.views[int(comp[0])], int(index[0])
        rows.append(tokload.TokenStream.boundaries(view, [j]))
    w = blend.window
    out: dict[str, Any] = {}
    for key, dtype in (("position_ids", np.int64), ("segment_ids", np.int32), ("loss_mask", bool)):
        if not rows or key in rows[0]:
            out[key] = np.concatenate([np.empty((0, w), dtype), *(r[key] for r in rows)])
    starts = [r["cu_seqlens"][:-1] + b * w for b, r in enumerate(rows)]
    out["cu_seqlens"] = np.concatenate([*starts, [len(rows) * w]]).astype(np.int32)
    out["max_seqlen"] = max((r["max_seqlen"] for r in rows), default=0)
    return out


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.floats(0.1, 5.0), min_size=3, max_size=3),
    seed=st.integers(0, 1000),
    nested=st.booleans(),
    held=st.booleans(),
    positions=st.lists(st.integers(0, 10**6), max_size=12),
)
def test_a_blend_of_streams_gives_each_sample_its_components_extras(
    weights: list[float], seed: int, nested: bool, held: bool, positions: list[int]
) -> None:
    """``held``: the tokload build's document index in memory or read entry by entry."""
    with tempfile.TemporaryDirectory() as d:
        env = {"TOKLOAD_INDEX_MEMORY": str(1 << 30 if held else 0)}
        with mock.patch.dict(os.environ, env):
            streams = _formats(Path(d), True)
        comps: list[tuple[Any, float]] = list(zip(streams, weights, strict=True))
        if nested:  # the first two as a blend of their own
            inner = tokload.Blend(comps[:2], seed=seed + 1, block_size=16, length=500)
            comps = [(inner, 1.0), comps[2]]
        blend = tokload.Blend(comps, seed=seed, block_size=32, length=2000)
        assert blend.boundary_keys == tokload.views.BOUNDARY_KEYS and blend.batch_keys
        idx = np.array([p % len(blend) for p in positions], dtype=np.int64)
        got, want = blend.boundaries(idx), _per_sample(blend, idx)
        for key in ("position_ids", "segment_ids", "loss_mask", "cu_seqlens"):
            assert got[key].dtype == want[key].dtype, key
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        assert got["max_seqlen"] == want["max_seqlen"]
        batch = blend.read_batch(idx, np.empty)  # the tokens with them
        np.testing.assert_array_equal(batch["tokens"], blend.read(idx))
        np.testing.assert_array_equal(batch["cu_seqlens"], want["cu_seqlens"])
        for s in streams:
            s.close()


def test_a_blend_of_streams_through_the_loader_exactly_once(tmp_path: Path) -> None:
    """Steps read as a task (``read_steps``) and resumed on another world size: each
    batch has its samples' extras, and every position of the blend comes once."""
    blend = tokload.Blend(
        [(s, w) for s, w in zip(_formats(tmp_path, True), (3.0, 1.0, 2.0), strict=True)],
        seed=4,
        block_size=6,
        length=300,
    )

    def make(**kw: Any) -> tokload.DataLoader:
        return tokload.DataLoader(blend, seed=2, epochs=1, **kw)

    got = run_segments(make, [Segment(2, 4, 7), Segment(3, 3, None)])
    seen: list[int] = []
    for b in got.batches.values():
        idx = b["index"].cpu().numpy()
        want = _per_sample(blend, idx)
        for key in ("position_ids", "segment_ids", "loss_mask", "cu_seqlens"):
            np.testing.assert_array_equal(b[key].cpu().numpy(), want[key], err_msg=key)
        assert b["max_seqlen"] == want["max_seqlen"]
        np.testing.assert_array_equal(b["tokens"].cpu().numpy(), blend.read(idx))
        comp, index = blend.locate(idx)
        np.testing.assert_array_equal(b["component"].cpu().numpy(), comp)
        np.testing.assert_array_equal(b["component_index"].cpu().numpy(), index)
        seen.extend(idx.tolist())
    assert sorted(seen) == list(range(len(blend)))


def test_a_blend_of_streams_with_only_some_keys_and_refusals(tmp_path: Path) -> None:
    varlen = _formats(tmp_path, ["cu_seqlens", "max_seqlen"])
    blend = tokload.Blend([(s, 1.0) for s in varlen], length=100)
    assert blend.batch_keys == ("cu_seqlens", "max_seqlen")
    batch = next(iter(tokload.DataLoader(blend, 4, num_threads=0, device=None)))
    assert sorted(batch) == [
        "component",
        "component_index",
        "cu_seqlens",
        "index",
        "max_seqlen",
        "position",
        "tokens",
    ]
    want = _per_sample(blend, batch["index"].numpy())
    np.testing.assert_array_equal(batch["cu_seqlens"].numpy(), want["cu_seqlens"])
    plain = tokload.TokenStream(str(MEGATRON), window=23)
    with pytest.raises(
        ValueError,
        match=r"component 1 has boundaries=False, component 0 boundaries=\['cu_seqlens', "
        r"'max_seqlen'\]: the windows of a blend carry the same attention keys",
    ):
        tokload.Blend([(varlen[0], 1.0), (plain, 1.0)], length=10)
    full = tokload.TokenStream(str(MEGATRON), window=23, boundaries=True)
    with pytest.raises(ValueError, match=r"component 1 has boundaries=\['position_ids', "):
        tokload.Blend([(varlen[0], 1.0), (full, 1.0)], length=10)
    # a blend without keys still answers boundaries() (all of them), as a stream does
    bare = tokload.Blend([(plain, 1.0)], length=10)
    assert not bare.with_boundaries and not bare.batch_keys
    assert sorted(bare.boundaries([1, 2])) == sorted(tokload.views.BOUNDARY_KEYS)


def test_boundary_arrays_checks_the_cuts_it_is_given() -> None:
    """``boundary_arrays`` (what a blend calls with its components' cuts gathered)
    refuses counts and cuts that do not agree before any C code reads them, and
    cuts outside their window or out of order with the index's error."""
    from tokload._docindex import boundary_arrays

    u = np.uint64
    got, cu, top = boundary_arrays(
        np.array([0, 10], u), 8, np.array([1, 0], u), np.array([3], u), np.empty
    )
    assert cu.tolist() == [0, 3, 8, 16] and cu.dtype == np.int64 and top == 8
    assert got["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"2 windows, 1 counts of cuts"):
        boundary_arrays(np.array([0, 10], u), 8, np.array([1], u), np.array([3], u), np.empty)
    with pytest.raises(ValueError, match=r"the counts of cuts add up to 2, and there are 1 cuts"):
        boundary_arrays(np.array([0, 10], u), 8, np.array([1, 1], u), np.array([3], u), np.empty)
    with pytest.raises(ValueError, match=r"window must be positive"):
        boundary_arrays(np.array([0], u), 0, np.array([0], u), np.array([], u), np.empty)
    for cuts in ([8], [0], [5, 3]):  # past the window, at its first row, decreasing
        with pytest.raises(tokload.CorruptDataError, match=r"the window at row 0 are out of"):
            boundary_arrays(
                np.array([0], u), 8, np.array([len(cuts)], u), np.array(cuts, u), np.empty
            )
