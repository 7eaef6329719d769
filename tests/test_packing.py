"""Best-fit packing: ``DataLoader(..., batching=Fill(window))`` and ``tokload.packing``.

The packer is checked against the definition of best-fit decreasing (hypothesis:
each document goes to the open row with the least room that holds it, a new row
only when none does), greedy packing and the rows' attention metadata against
pure-Python references; through the DataLoader, every document of every epoch is
delivered exactly once, in rows that hold exactly its tokens, across ranks and a
resume on another world size and batch size; a block-diagonal attention built
from a batch equals attention over each document alone; and the padding goal of
issue 29 (best-fit pads at most a third of what greedy packing pads) holds on a
log-normal corpus.
"""

from __future__ import annotations

import collections
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import Segment, run_segments
from hypothesis import given, settings
from hypothesis import strategies as st

import tokload
from tokload._pack import best_fit, gather_rows, greedy_rows, pad_rows, row_boundaries, row_offsets
from tokload.errors import StateError
from tokload.packing import PackedSchedule, Packing, padding_report

MEGATRON = Path(__file__).resolve().parent / "data" / "megatron" / "tiny_uint16"


def check_best_fit(lengths: list[int], window: int) -> None:
    order, starts = best_fit(np.array(lengths, dtype=np.uint64), window)
    capped = [min(n, window) for n in lengths]
    rows = [order[a:b].tolist() for a, b in itertools.pairwise(starts.tolist())]
    # every document once; each row's in order; rows numbered by their first document
    assert sorted(order.tolist()) == list(range(len(lengths)))
    assert all(r == sorted(r) and r for r in rows)
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert all(sum(capped[i] for i in r) <= window for r in rows)
    # best-fit decreasing: replay the documents by decreasing length; each went to an
    # open row with the least room that held it, or opened a row when none did
    row_of = {i: k for k, r in enumerate(rows) for i in r}
    room: dict[int, int] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (-capped[i], i)):
        fits = [left for left in room.values() if left >= capped[i]]
        k = row_of[i]
        if k in room:
            assert fits and room[k] == min(fits), (i, room, k)
            room[k] -= capped[i]
        else:
            assert not fits, (i, room)
            room[k] = window - capped[i]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), max_size=120),
    window=st.integers(1, 256),
)
def test_best_fit_is_best_fit_decreasing(lengths: list[int], window: int) -> None:
    check_best_fit(lengths, window)


def test_best_fit_on_wide_rows_and_many_documents() -> None:
    """Rows of 2**20 tokens (the bitset has three levels) and 5,000 documents."""
    rng = np.random.default_rng(0)
    check_best_fit(rng.integers(0, 300_000, 400).tolist(), 1 << 20)
    check_best_fit(rng.integers(1, 700, 5000).tolist(), 4096)


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(1, 1 << 30),
    shares=st.lists(st.floats(0, 1.2), max_size=60),
    small=st.lists(st.integers(0, 70), max_size=30),
)
def test_best_fit_is_best_fit_decreasing_at_any_window(
    window: int, shares: list[float], small: list[int]
) -> None:
    """Windows up to 2**30 (up to five levels of the rooms' bitset, whose lower
    levels are never cleared as a whole): lengths spread over the window, some
    past it, and a few tiny ones that land in the rooms left."""
    check_best_fit([int(f * window) for f in shares] + small, window)


def test_best_fit_packs_as_it_always_has() -> None:
    """The rows a run gets are a function of its documents' lengths that must not
    change from one version to the next (a checkpoint resumes into them): the
    packings of these groups, ties between equal rooms included, are pinned."""
    import hashlib

    rng = np.random.default_rng(7)
    digest = hashlib.sha256()
    for window in (1, 7, 64, 4096, 4097, 1 << 16, 1 << 20):
        for n in (0, 1, 50, 1024, 3000):
            lengths = rng.integers(0, 2 * window + 2, n).astype(np.uint64)
            if n > 3:
                lengths[::3] = rng.integers(0, max(2, window // 8), len(lengths[::3]))
            for a in best_fit(lengths, window):
                digest.update(a.tobytes())
    for window in (4096, 8192):
        lengths = np.minimum(rng.lognormal(np.log(600), 1.0, 4096).astype(np.uint64), 5 * window)
        for a in best_fit(lengths, window):
            digest.update(a.tobytes())
    assert digest.hexdigest() == "aa3ebe494f03d24d050bd7455ad5be23b3844dcdc1f2fcf97227ed9b4299b1a1"


def test_best_fit_touches_memory_for_its_rows_not_its_window() -> None:
    """A group packed into rows of 2**30 tokens cleared 4 GiB of bucket heads (and
    took seconds); only the memory of the rooms in use is touched now."""
    import resource

    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 1 << 30, 1024).astype(np.uint64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for _ in range(3):
        order, starts = best_fit(lengths, 1 << 30)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 256 << 10, f"peak memory grew by {grown} KiB"
    assert sorted(order.tolist()) == list(range(1024)) and starts[-1] == 1024


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 100), max_size=80), window=st.integers(1, 120))
def test_greedy_matches_the_reference(lengths: list[int], window: int) -> None:
    rows, used = 0, 0
    for n in (min(x, window) for x in lengths):
        if rows == 0 or used + n > window:
            rows, used = rows + 1, n
        else:
            used += n
    assert greedy_rows(np.array(lengths, dtype=np.int64), window) == rows


def boundaries_reference(lengths: list[int], counts: list[int], window: int) -> dict[str, Any]:
    """The rows' extras, one token at a time: documents, then the padding segment."""
    pos, seg, mask, cu = [], [], [], []
    it = iter(lengths)
    for b, c in enumerate(counts):
        segments = [(n, True) for n in itertools.islice(it, c) if n > 0]
        used = sum(n for n, _ in segments)
        if used < window:
            segments.append((window - used, False))
        t = 0
        for s, (n, real) in enumerate(segments):
            cu.append(b * window + t)
            pos += list(range(n))
            seg += [s] * n
            mask += [real and k > 0 for k in range(n)]
            t += n
    cu.append(len(counts) * window)
    longest = max(np.diff(cu).tolist(), default=0)
    shape = (len(counts), window)
    return {
        "position_ids": np.array(pos, dtype=np.int64).reshape(shape),
        "segment_ids": np.array(seg, dtype=np.int32).reshape(shape),
        "loss_mask": np.array(mask, dtype=bool).reshape(shape),
        "cu_seqlens": np.array(cu, dtype=np.int32),
        "max_seqlen": longest,
    }


@st.composite
def packed_rows(draw: Any) -> tuple[list[int], list[int], int]:
    window = draw(st.integers(1, 64))
    lengths: list[int] = []
    counts: list[int] = []
    for _ in range(draw(st.integers(0, 8))):
        room, c = window, 0
        for _ in range(draw(st.integers(0, 6))):
            n = draw(st.integers(0, room))  # empty documents, full rows, empty rows
            lengths.append(n)
            room -= n
            c += 1
        counts.append(c)
    return lengths, counts, window


@settings(max_examples=200, deadline=None)
@given(packed_rows())
def test_row_boundaries_match_the_reference(rows: tuple[list[int], list[int], int]) -> None:
    lengths, counts, window = rows
    arrays, cu, longest = row_boundaries(
        np.array(lengths, dtype=np.uint64), np.array(counts), window, np.empty
    )
    want = boundaries_reference(lengths, counts, window)
    for key in ("position_ids", "segment_ids", "loss_mask"):
        assert arrays[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(arrays[key], want[key], err_msg=key)
    np.testing.assert_array_equal(cu, want["cu_seqlens"])
    assert longest == want["max_seqlen"]
    # each document's place: its row's start plus the tokens before it in the row
    it = iter(lengths)
    places = []
    for b, c in enumerate(counts):
        t = 0
        for n in itertools.islice(it, c):
            places.append((b * window + t) * 2)
            t += n
    got = row_offsets(np.array(lengths, dtype=np.uint64), np.array(counts), window, 2)
    assert got.tolist() == places


@settings(max_examples=200, deadline=None)
@given(packed_rows(), st.sampled_from(["<u1", "<u2", "<i4", "<u4", "<i8", "<f4"]), st.data())
def test_pad_rows_sets_each_rows_tail_and_nothing_else(
    rows: tuple[list[int], list[int], int], dtype: str, data: Any
) -> None:
    lengths, counts, window = rows
    dt = np.dtype(dtype)
    value = data.draw(st.integers(0, 200)) if dt.kind != "f" else -1.5
    out = np.arange(len(counts) * window).astype(dt).reshape(len(counts), window)
    want = out.copy()
    it = iter(lengths)
    for b, c in enumerate(counts):
        want[b, sum(itertools.islice(it, c)) :] = value
    pad_rows(out, np.array(lengths, dtype=np.uint64), np.array(counts), window, value)
    np.testing.assert_array_equal(out, want)


def test_pad_rows_refuses_an_array_of_another_shape() -> None:
    lengths, counts = np.array([3, 2], dtype=np.uint64), np.array([1, 1])
    with pytest.raises(ValueError, match=r"a writable C-contiguous \[2, 8\] array is needed"):
        pad_rows(np.zeros((2, 7), np.uint16), lengths, counts, 8, 0)
    with pytest.raises(ValueError, match=r"a writable C-contiguous \[2, 8\] array is needed"):
        pad_rows(np.zeros((8, 2), np.uint16).T, lengths, counts, 8, 0)
    with pytest.raises(ValueError, match=r"counts add up to 2 documents, lengths has 3"):
        pad_rows(np.zeros((2, 8), np.uint16), np.array([1, 1, 1]), counts, 8, 0)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_gather_rows_matches_the_reference(data: Any) -> None:
    """A rank's rows of consecutive parts of groups: rows ``rank, rank + world,
    ...`` counted from the first part's first row, entries row by row (the extra
    arrays gathered as ids are)."""
    world = data.draw(st.integers(1, 5))
    rank = data.draw(st.integers(0, world - 1))
    nextra = data.draw(st.integers(0, 2))
    parts, ref_rows = [], []
    k = 0
    for g in range(data.draw(st.integers(0, 4))):
        counts = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=8))
        rows = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        n = int(rows[-1])
        ids = np.arange(n, dtype=np.int64) + 1000 * g
        starts, lengths = (ids * 7).astype(np.uint64), (ids % 13).astype(np.uint64)
        extra = tuple(ids * (x + 2) for x in range(nextra))
        b0 = data.draw(st.integers(0, len(counts)))
        b1 = data.draw(st.integers(b0, len(counts)))
        base = 100 * g
        parts.append((base, ids, starts, lengths, rows, b0, b1, extra))
        for b in range(b0, b1):
            if k % world == rank:
                ref_rows.append((base + b, list(range(rows[b], rows[b + 1])), ids, starts, lengths))
            k += 1
    pos, got_ids, got_starts, got_lengths, got_counts, got_extra = gather_rows(parts, rank, world)
    assert pos.dtype == np.uint64 and got_ids.dtype == np.int64 and got_counts.dtype == np.int64
    assert pos.tolist() == [p for p, *_ in ref_rows]
    assert got_counts.tolist() == [len(e) for _, e, *_ in ref_rows]
    assert got_ids.tolist() == [int(i[x]) for _, e, i, _, _ in ref_rows for x in e]
    assert got_starts.tolist() == [int(s[x]) for _, e, _, s, _ in ref_rows for x in e]
    assert got_lengths.tolist() == [int(n[x]) for _, e, _, _, n in ref_rows for x in e]
    assert len(got_extra) == (nextra if parts else 0)
    for x, a in enumerate(got_extra):
        assert a.dtype == np.int64 and a.tolist() == [i * (x + 2) for i in got_ids.tolist()]


def test_gather_rows_refuses_rows_outside_a_group() -> None:
    rows = np.array([0, 2, 3], dtype=np.int64)
    ids = np.arange(3, dtype=np.int64)
    part = (0, ids, ids.astype(np.uint64), ids.astype(np.uint64), rows)
    with pytest.raises(ValueError, match=r"rows \[1, 3\) of a group of 2"):
        gather_rows([(*part, 1, 3, ())], 0, 1)
    with pytest.raises(ValueError, match=r"rank 2 of world size 2"):
        gather_rows([(*part, 0, 2, ())], 2, 2)
    short = (0, ids[:2], ids.astype(np.uint64), ids.astype(np.uint64), rows)
    with pytest.raises(ValueError, match=r"row 1 holds entries \[2, 3\) of 2"):
        gather_rows([(*short, 0, 2, ())], 0, 1)
    with pytest.raises(ValueError, match=r"row 1 holds entries \[2, 3\) of 2"):
        gather_rows([(*part, 0, 2, (ids[:2],))], 0, 1)  # an extra array one short
    with pytest.raises(ValueError, match=r"part 1 has 1 extra arrays, part 0 has 0"):
        gather_rows([(*part, 0, 1, ()), (*part, 1, 2, (ids,))], 0, 1)


def test_row_boundaries_refuse_bad_rows() -> None:
    with pytest.raises(ValueError, match=r"row 1: its documents hold more than 8 tokens"):
        row_boundaries(np.array([3, 5, 6]), np.array([1, 2]), 8, np.empty)
    with pytest.raises(ValueError, match=r"row 1: its documents hold more than 8 tokens"):
        row_offsets(np.array([3, 5, 6]), np.array([1, 2]), 8, 4)
    with pytest.raises(ValueError, match=r"counts add up to 2 documents, lengths has 3"):
        row_boundaries(np.array([3, 5, 6]), np.array([1, 1]), 8, np.empty)
    with pytest.raises(ValueError, match=r"window must be in \[1, 1073741824\], got 0"):
        best_fit(np.array([1]), 0)
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got -2"):
        best_fit(np.array([1, -2]), 8)


# ---- through the view and the loader -------------------------------------------------------


def corpus(path: Path, n: int, seed: int, median: float = 40.0, top: int = 400) -> list[np.ndarray]:
    """A dataset of ``n`` documents of log-normal lengths (some empty), in small shards."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(np.log(median), 1.0, n).astype(int), top)
    lengths[rng.random(n) < 0.02] = 0
    docs = [rng.integers(1, 60_000, int(k), dtype=np.uint16) for k in lengths]
    with tokload.Writer(path, "<u2", shard_bytes=20_000, durable=False) as w:
        for d in docs:
            w.write(d)
    return docs


def check_batch(batch: Any, docs: list[np.ndarray], window: int, pad: int = 0) -> list[int]:
    """The batch's rows hold exactly its documents' tokens, then ``pad``; returns them."""
    tokens = batch["tokens"].numpy()
    ids, lengths = batch["index"].tolist(), batch["lengths"].tolist()
    counts = batch["doc_counts"].tolist()
    assert tokens.shape == (len(counts), window) and len(batch["position"]) == len(counts)
    it = iter(zip(ids, lengths, strict=True))
    for row, c in enumerate(counts):
        t = 0
        for d, n in itertools.islice(it, c):
            assert n == min(len(docs[d]), window)
            np.testing.assert_array_equal(tokens[row, t : t + n], docs[d][:n])
            t += n
        assert (tokens[row, t:] == pad).all()
    want = boundaries_reference(lengths, counts, window)
    for key in ("position_ids", "segment_ids", "loss_mask", "cu_seqlens"):
        np.testing.assert_array_equal(batch[key].numpy(), want[key], err_msg=key)
    assert batch["max_seqlen"] == want["max_seqlen"]
    return [int(i) for i in ids]


def test_every_document_once_per_epoch_on_any_world_size(tmp_path: Path) -> None:
    docs = corpus(tmp_path / "ds", 700, seed=1)
    view = tokload.Documents(tmp_path / "ds")
    fill = tokload.Fill(128, lookahead=64)
    rows_of_run: list[list[int]] = []
    for world in (1, 3):
        seen: collections.Counter[int] = collections.Counter()
        positions = []
        for rank in range(world):
            loader = tokload.DataLoader(
                view, 6 // world, batching=fill, seed=3, rank=rank, world_size=world,
                epochs=2, device=None, num_threads=2,
            read=tokload.ReadOptions(steps_per_task=3))  # fmt: skip
            for batch in loader:
                seen.update(check_batch(batch, docs, 128))
                positions += batch["position"].tolist()
        assert seen == collections.Counter({d: 2 for d in range(len(docs))})
        rows_of_run.append(sorted(positions))
    # the same rows whatever the world size: the rows are the run's, not the ranks'
    assert rows_of_run[0] == rows_of_run[1]
    assert len(set(rows_of_run[0])) == len(rows_of_run[0])


def test_exactly_once_across_a_resume_on_another_world_size_and_batch(tmp_path: Path) -> None:
    docs = corpus(tmp_path / "ds", 500, seed=2)
    view = tokload.Documents(tmp_path / "ds")

    def make(**kw: Any) -> tokload.DataLoader:
        fill = tokload.Fill(96, lookahead=50)
        return tokload.DataLoader(view, batching=fill, seed=9, epochs=1, device=None, **kw)

    got = run_segments(make, [Segment(2, 4, 7), Segment(3, 1, 5), Segment(1, 5, None)])
    seen = [d for b in got.batches.values() for d in check_batch(b, docs, 96)]
    assert sorted(seen) == list(range(len(docs)))


def test_a_state_is_refused_for_another_packing(tmp_path: Path) -> None:
    corpus(tmp_path / "ds", 100, seed=3)
    view = tokload.Documents(tmp_path / "ds")
    loader = tokload.DataLoader(view, 2, batching=tokload.Fill(64), device=None)
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    for other in (tokload.Fill(65), tokload.Fill(64, lookahead=99), tokload.Pack()):
        with pytest.raises(StateError, match=r"the state was saved for fingerprint="):
            tokload.DataLoader(view, 2, batching=other, device=None).load_state_dict(state)
    # the metadata asked for and the padding are not part of the run
    same = tokload.Fill(64, value=3, attention=False)
    tokload.DataLoader(view, 2, batching=same, device=None).load_state_dict(state)
    # padded and packed documents are the same run of samples
    state = tokload.DataLoader(view, 2, batching=tokload.Pad(), device=None).state_dict()
    tokload.DataLoader(view, 2, batching=tokload.Pack(), device=None).load_state_dict(state)


def test_drop_last_steps_stay_within_an_epoch(tmp_path: Path) -> None:
    docs = corpus(tmp_path / "ds", 300, seed=4)
    view = tokload.Documents(tmp_path / "ds")
    packing = Packing(100, 40)
    sched = PackedSchedule(
        len(view), 7, extents=view.extents, packing=packing, seed=1, epochs=3, drop_last=True
    )
    c, steps = 0, 0
    while (sp := sched.span(c)) is not None:
        rows = sched.rows(*sp)
        assert len(rows.counts) == 7
        assert len({int(p) // len(docs) for p in rows.positions}) == 1  # one epoch
        c, steps = sp[1], steps + 1
    per_epoch = [sum(sched.group(e, g).nrows for g in range(-(-300 // 40))) for e in range(3)]
    assert steps == sum(n // 7 for n in per_epoch)
    with pytest.raises(ValueError, match=r"drop_last: epoch 0 packs into \d+ rows, fewer than"):
        PackedSchedule(len(view), 290, extents=view.extents, packing=packing, drop_last=True).span(
            0
        )


def _extents_of(lens: np.ndarray) -> Any:
    """A view's ``extents`` over documents of ``lens`` tokens laid end to end
    (document ``i`` starts at row ``i``: only the lengths matter to packing)."""

    def extents(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(ids, dtype=np.uint64), lens[ids]

    return extents


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=120),
    lookahead=st.integers(1, 30),
    batch=st.integers(1, 5),
    world=st.integers(1, 3),
    epochs=st.sampled_from([1, 2, 3, None]),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_spans_in_one_walk_equal_the_steps_one_by_one(
    lengths: list[int],
    lookahead: int,
    batch: int,
    world: int,
    epochs: int | None,
    drop_last: bool,
    data: Any,
) -> None:
    """``spans(c, count)`` (one walk over the packed groups, each step starting
    where the last ended) gives the steps ``span`` gives one by one from any
    cursor, rows between them included, to the run's end and across epochs; and
    ``task_rows`` of them is each step's ``rows`` back to back."""
    n = len(lengths)
    lens = np.array(lengths, dtype=np.uint64)

    extents = _extents_of(lens)

    def sched() -> PackedSchedule:
        return PackedSchedule(
            n, batch, extents=extents, packing=Packing(64, lookahead), rank=world - 1,
            world_size=world, seed=3, epochs=epochs, drop_last=drop_last,
        )  # fmt: skip

    one, walk = sched(), sched()
    c = data.draw(st.integers(0, 3 * n))
    count = data.draw(st.integers(1, 12))
    want: list[tuple[int, int]] = []
    at = c
    try:
        while len(want) < count and (sp := one.span(at)) is not None:
            want.append(sp)
            at = sp[1]
        got = walk.spans(c, count)
    except ValueError as e:  # drop_last with an epoch of fewer rows than a step
        assert "fewer than the global batch" in str(e)
        return
    assert got == want
    if got:
        rows, per_step = walk.task_rows(got)
        each = [one.rows(*sp) for sp in want]
        assert per_step == [len(r.counts) for r in each]
        np.testing.assert_array_equal(rows.ids, np.concatenate([r.ids for r in each]))
        np.testing.assert_array_equal(rows.counts, np.concatenate([r.counts for r in each]))
        np.testing.assert_array_equal(rows.positions, np.concatenate([r.positions for r in each]))


def test_a_cursor_between_rows_goes_on_from_the_next_row(tmp_path: Path) -> None:
    corpus(tmp_path / "ds", 200, seed=5)
    view = tokload.Documents(tmp_path / "ds")
    fill = tokload.Fill(256, lookahead=100)
    sched = PackedSchedule(len(view), 1, extents=view.extents, packing=Packing(256, 100), epochs=1)
    nrows = sched.group(0, 0).nrows
    assert nrows < 100
    # positions nrows..99 are no rows of group 0: the step starts at group 1's first row
    assert sched.span(nrows) == sched.span(99) == sched.span(100) == (100, 101)
    assert sched.span(nrows - 1) == (nrows - 1, 100)
    assert sched.span(200) is None
    with pytest.raises(TypeError, match=r"a run of packed rows has no length"):
        len(tokload.DataLoader(view, 2, batching=fill, epochs=1, device=None))
    with pytest.raises(ValueError, match=r"\[3, 9\) is not a step of this run"):
        sched.rows(3, 9)


def test_block_diagonal_attention_equals_attention_per_document(tmp_path: Path) -> None:
    corpus(tmp_path / "ds", 300, seed=6)
    view = tokload.Documents(tmp_path / "ds")
    fill = tokload.Fill(128)
    batch = next(
        iter(tokload.DataLoader(view, 4, batching=fill, seed=5, num_threads=0, device=None))
    )
    torch.manual_seed(0)
    x = torch.nn.Embedding(60_000, 16)(batch["tokens"].long())  # [B, W, 16]
    seg = batch["segment_ids"]
    mask = (seg[:, :, None] == seg[:, None, :]) & torch.ones(128, 128, dtype=torch.bool).tril()
    out = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
    flat_x, flat_out = x.reshape(-1, 16), out.reshape(-1, 16)
    cu = batch["cu_seqlens"].tolist()
    for a, e in itertools.pairwise(cu):
        alone = torch.nn.functional.scaled_dot_product_attention(
            flat_x[a:e], flat_x[a:e], flat_x[a:e], is_causal=True
        )
        torch.testing.assert_close(flat_out[a:e], alone)
    # the targets kept are the documents' tokens but their first ones
    assert int(batch["loss_mask"].sum()) == int((batch["lengths"] - 1).clamp(min=0).sum())


def test_padding_is_a_third_of_greedy_packings_on_log_normal_documents() -> None:
    """Issue 29's goal at W = 4096, median 600 tokens, with the default look-ahead."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(np.log(600), 1.0, 100_000).astype(np.int64), 1)
    got = padding_report(lengths, 4096)
    assert got["best_fit"] <= got["greedy"] / 3, got
    assert got["greedy"] < got["pad"]
    real = np.minimum(lengths, 4096).sum()
    assert got["rows"]["pad"] == len(lengths)
    assert got["best_fit"] == pytest.approx(1 - real / (got["rows"]["best_fit"] * 4096))


def test_megatron_and_flat_sources_and_fields(tmp_path: Path) -> None:
    mega = tokload.Documents(str(MEGATRON))
    docs = [np.asarray(mega[i]) for i in range(len(mega))]
    fill = tokload.Fill(48, lookahead=16, value=7)
    seen: list[int] = []
    for batch in tokload.DataLoader(mega, 3, batching=fill, epochs=1, device=None, num_threads=1):
        seen += check_batch(batch, docs, 48, pad=7)
    assert sorted(seen) == list(range(len(docs)))
    # a flat file with an end-of-document token
    rng = np.random.default_rng(7)
    parts = [np.append(rng.integers(1, 500, int(n)), 0) for n in rng.integers(0, 30, 120)]
    np.concatenate(parts).astype(np.uint16).tofile(tmp_path / "flat.bin")
    flat = tokload.open_flat(tmp_path / "flat.bin", np.uint16, eos=0)
    view = tokload.Documents(flat)
    fill = tokload.Fill(40, attention=["cu_seqlens"])
    seen = []
    for batch in tokload.DataLoader(view, 2, batching=fill, epochs=1, device=None, num_threads=0):
        assert sorted(batch) == ["cu_seqlens", "doc_counts", "index", "lengths", "position",
                                 "tokens"]  # fmt: skip
        seen += batch["index"].tolist()
    assert sorted(seen) == list(range(len(parts)))
    # a structured dtype: one array per field, padded with pad_value
    dt = np.dtype([("tok", "<u2"), ("w", "<u1")])
    recs = [np.zeros(int(n), dt) for n in (5, 9, 3, 12)]
    for k, r in enumerate(recs):
        r["tok"], r["w"] = np.arange(len(r)) + 10 * k, k
    with tokload.Writer(tmp_path / "st", dt) as w:
        for r in recs:
            w.write(r)
    view = tokload.Documents(tmp_path / "st")
    assert view.fields == {"tok": np.dtype("<u2"), "w": np.dtype("<u1")}
    # every document alone in its row: a window of 12 and a look-ahead of 1
    fill = tokload.Fill(12, lookahead=1, value=1)
    loader = tokload.DataLoader(view, 4, batching=fill, shuffle=False, device=None, num_threads=0)
    rows = next(iter(loader))
    assert sorted(rows)[:2] == ["cu_seqlens", "doc_counts"] and rows["tok"].shape == (4, 12)
    np.testing.assert_array_equal(rows["doc_counts"], [1, 1, 1, 1])
    for k, r in enumerate(recs):
        np.testing.assert_array_equal(rows["tok"][k, : len(r)], r["tok"])
        assert (rows["tok"][k, len(r) :] == 1).all() and (rows["w"][k, : len(r)] == k).all()
        assert (rows["w"][k, len(r) :] == 1).all()


def test_bad_options_are_refused(tmp_path: Path) -> None:
    corpus(tmp_path / "ds", 10, seed=8)
    for make, message in (
        (lambda: tokload.Fill(0), r"window must be in \[1, 1073741824\], got 0"),
        (lambda: tokload.Fill(8, lookahead=0), r"lookahead must be in \[1, 1048576\], got 0"),
        (lambda: tokload.Fill(True), r"window must be a positive integer, got True"),
        (lambda: tokload.Fill(8, attention=["labels"]), r"unknown keys \['labels'\]"),
        (lambda: tokload.Fill(8, attention=[]), r"attention: an empty list of keys"),
        (
            lambda: tokload.Pad(to=0),
            r"Pad\(to=...\) must be a positive integer below 2\*\*63 or None, got 0",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(TypeError, match=r"attention must be True, False or a list of keys"):
        tokload.Fill(8, attention="cu_seqlens")
    assert Packing(8).lookahead == tokload.packing.DEFAULT_LOOKAHEAD
    assert tokload.Fill(8).lookahead == tokload.packing.DEFAULT_LOOKAHEAD
    # a policy of documents on a view of windows, and something that is no policy
    windows = tokload.TokenStream(tmp_path / "ds", 4)
    for policy in (tokload.Pad(), tokload.Pack(), tokload.Fill(8)):
        name = type(policy).__name__
        with pytest.raises(TypeError, match=rf"{name} batches documents, and TokenStream is not"):
            tokload.DataLoader(windows, 2, batching=policy, device=None)
    with pytest.raises(TypeError, match=r"batching must be a policy \(tokload.Stack\(\)"):
        tokload.DataLoader(windows, 2, batching="fill", device=None)  # type: ignore[arg-type]
    # a padding value that does not fit the dtype is refused with the loader
    # (NumPy integers too: NumPy casts them with wraparound, np.int64(-1) as 65535)
    fits_not: list[Any] = [1 << 40, -1, np.int64(-1), np.int32(70_000), np.uint64(2**64 - 1)]
    for value in fits_not:
        for policy in (tokload.Fill(8, value=value), tokload.Pad(value=value)):
            with pytest.raises(OverflowError, match=r"padding value -?\d+ does not fit the field"):
                tokload.DataLoader(tokload.Documents(tmp_path / "ds"), 2, batching=policy)
        with pytest.raises(OverflowError, match=r"the padding value -?\d+ does not fit"):
            tokload.Documents(tmp_path / "ds").read_padded([0, 1], pad=value)
    # nor is one that is not an integer (1.5 padded with 1, "7" was parsed)
    bads: list[Any] = [1.5, "7", True, None]
    for bad in bads:
        with pytest.raises(ValueError, match=r"Pad\(value=\.\.\.\) must be an integer token"):
            tokload.Pad(value=bad)
        with pytest.raises(ValueError, match=r"Fill\(value=\.\.\.\) must be an integer token"):
            tokload.Fill(8, value=bad)
    seven: Any = np.int64(7)
    assert tokload.Pad(value=seven).value == 7


@pytest.mark.parametrize(
    ("kwargs", "new"),
    [
        (dict(batch="fill", window=8), r"batching=tokload.Fill\(window=8\)"),
        (
            dict(batch="fill", window=8, lookahead=4, pad_value=1, boundaries=False),
            r"batching=tokload.Fill\(window=8, lookahead=4, value=1, attention=False\)",
        ),
        (dict(batch="pack"), r"batching=tokload.Pack\(\)"),
        (dict(batch="pad", pad_to=16), r"batching=tokload.Pad\(to=16\)"),
        (dict(pad_value=3), r"batching=tokload.Pad\(value=3\)"),
        # review68: window and lookahead alone were told Pad() (dropped), a "fill" with
        # no window Fill(window=None) (which raises), an unknown batch Pad()
        (dict(window=64), r"batching=tokload.Fill\(window=64\)\)$"),
        (dict(lookahead=8), r"batching=tokload.Fill\(W, lookahead=8\)\) \(W: the tokens"),
        (dict(batch="fill"), r"batching=tokload.Fill\(W\)\) \(W: the tokens of a row\)$"),
        (dict(batch="bogus"), r"\(and 'bogus' was never a batch\): batching is the DataLoader"),
    ],
)
def test_the_retired_batch_arguments_say_what_replaces_them(
    tmp_path: Path, kwargs: dict[str, Any], new: str
) -> None:
    corpus(tmp_path / "ds", 4, seed=8)
    with pytest.raises(TypeError, match=r"was retired in tokload 0.2.*batching is the DataLoader"):
        tokload.Documents(tmp_path / "ds", **kwargs)
    with pytest.raises(TypeError, match=new):
        tokload.Documents(tmp_path / "ds", **kwargs)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments: colour"):
        tokload.Documents(tmp_path / "ds", colour="red")


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=150),
    window=st.integers(1, 100),
    lookahead=st.integers(1, 40),
    epochs=st.integers(1, 2),
    first=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(0, 12)),
    then=st.tuples(st.integers(1, 4), st.integers(1, 5)),
    seed=st.integers(0, 3),
)
def test_schedules_deliver_each_document_once_per_epoch_across_a_resume(
    lengths: list[int],
    window: int,
    lookahead: int,
    epochs: int,
    first: tuple[int, int, int],
    then: tuple[int, int],
    seed: int,
) -> None:
    """The schedule alone, on lengths: steps of one world size and batch size, then
    a resume from the cursor with others; every document once per epoch, in rows
    that hold at most ``window`` tokens."""
    n = len(lengths)
    lens = np.array(lengths, dtype=np.uint64)

    extents = _extents_of(lens)

    def run(world: int, batch: int, cursor: int, steps: int | None) -> tuple[list[int], int]:
        scheds = [
            PackedSchedule(
                n,
                batch,
                extents=extents,
                packing=Packing(window, lookahead),
                rank=r,
                world_size=world,
                seed=seed,
                epochs=epochs,
            )
            for r in range(world)
        ]
        got: list[int] = []
        done = 0
        while steps is None or done < steps:
            span = scheds[0].span(cursor)
            if span is None:
                break
            assert all(s.span(cursor) == span for s in scheds)
            for s in scheds:
                rows = s.rows(*span)
                assert len(rows.counts) == s.samples(*span)
                assert len(rows.positions) == len(rows.counts)
                assert (rows.counts >= 1).all()  # a row holds one document at least
                used = np.add.reduceat(rows.lengths, np.cumsum(rows.counts) - rows.counts)
                assert (used <= window).all()
                epoch_of = np.repeat(rows.positions, rows.counts) // np.uint64(n)
                got += (epoch_of.astype(np.int64) * n + rows.ids).tolist()
            cursor, done = span[1], done + 1
        return got, cursor

    world, batch, steps = first
    got, cursor = run(world, batch, 0, steps)
    more, end = run(*then, cursor, None)
    # each (epoch, document) exactly once
    assert sorted(got + more) == list(range(epochs * n))
    assert end == epochs * n


def test_a_task_past_int32_tokens_is_read_and_a_step_past_it_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attention keys are computed for a reader task at once: 16 steps of 2 rows
    of 2**26 tokens (each step fine) failed as "cannot hold 2147483648 tokens".
    The task's offsets are int64 now and only each step's ``cu_seqlens`` must fit
    int32; a step past it is refused before anything is read or allocated."""
    from tokload._docindex import split_cu_seqlens
    from tokload.views.contract import check_step_tokens

    # three rows of 2**30 tokens, one segment each: offsets past 2**31, in int64
    _, cu, top = row_boundaries(np.zeros(0), np.zeros(3, dtype=np.int64), 1 << 30, np.empty, ())
    assert cu.dtype == np.int64 and cu.tolist() == [0, 1 << 30, 2 << 30, 3 << 30]
    assert top == 1 << 30
    joined, offsets, longest = split_cu_seqlens(cu, [(0, 1), (1, 2), (2, 3)], 1 << 30)
    assert joined.dtype == np.int32 and joined.tolist() == [0, 1 << 30] * 3
    assert offsets.tolist() == [0, 2, 4, 6] and longest.tolist() == [1 << 30] * 3
    step = r"a step of 2 rows of 1,073,741,824 tokens holds 2,147,483,648 tokens, more than"
    with pytest.raises(ValueError, match=step):
        split_cu_seqlens(cu, [(0, 1), (1, 3)], 1 << 30)
    with pytest.raises(ValueError, match=step):
        check_step_tokens(2, 1 << 30)
    check_step_tokens(31, 1 << 26)
    check_step_tokens(1, (1 << 31) - 1)

    with tokload.Writer(tmp_path / "ds", "<u2") as w:
        for d in range(64):
            w.write(np.full(3, d, dtype=np.uint16))

    class Allocated(Exception):
        pass

    def refuse(shape: Any, dtype: Any) -> np.ndarray:
        raise Allocated(f"{shape}")

    stream = tokload.TokenStream(tmp_path / "ds", window=1 << 26, stride=1, boundaries=True)
    cuts = [(2 * k, 2 * k + 2) for k in range(16)]
    with pytest.raises(Allocated):  # the task of 2**31 tokens goes on to its reads
        stream.read_steps(np.zeros(32, dtype=np.int64), cuts, refuse)
    many = r"a step of 32 rows of 67,108,864 tokens holds 2,147,483,648 tokens"
    with pytest.raises(ValueError, match=many):  # before anything is allocated
        stream.read_steps(np.zeros(32, dtype=np.int64), [(0, 32)], refuse)
    # (2**26-token windows of this dataset: none; boundaries() of 32 found, as a spy)
    u = np.uint64
    monkeypatch.setattr(stream, "_window_cuts", lambda ix: (np.zeros(32, u), np.zeros(32, u), []))
    with pytest.raises(ValueError, match=many):
        stream.boundaries(np.zeros(32, dtype=np.int64), refuse)
    # Fill checks its steps the same way (2**26-token rows pack slowly: a spy)
    seen: list[tuple[int, ...]] = []
    monkeypatch.setattr(tokload.batching, "check_step_tokens", lambda *a: seen.append(a))
    fill = tokload.Fill(16, lookahead=4)
    view = tokload.Documents(tmp_path / "ds")
    sched = fill.schedule(view, 2)
    fill.reader(view, sched, np.empty).read(sched.spans(0, 3), None)
    assert seen == [(2, 16)]
