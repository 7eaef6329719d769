"""Mixtures that pack: a Blend of documents of three formats under every batching policy.

The recipe of current pretraining runs, as one property: a weighted mixture of a
tokload build, a Megatron prefix and a flat ``.npy`` token file (with a weight
schedule), batched by ``Pad``, ``Pack`` or ``Fill``, read by 1 to 7 ranks and
resumed on another world size and batch size. Every document of every
component comes the number of times its share of the blend says (whole epochs
of the component, then part of one, each document at most once more than any
other), every rank's batches hold what the single-rank run holds at the same
positions, and the provenance arrays name the component and the document the
tokens really came from: each token encodes its component and document.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import Segment, run_segments
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokload

SIZES = (23, 17, 29)  # documents of the build, the Megatron prefix, the flat file


def doc_tokens(c: int, d: int, length: int) -> np.ndarray:
    """Document ``d`` of component ``c``: every token says ``(c, d)``, none is 0."""
    return np.full(length, (c + 1) * 1000 + d, dtype=np.uint16)


def write_megatron(prefix: Path, docs: list[np.ndarray]) -> None:
    """A Megatron ``.bin/.idx`` pair of uint16 documents (one sequence each)."""
    lengths = [len(d) for d in docs]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    n = len(docs)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, n, n + 1))
        f.write(np.array(lengths, dtype=np.int32).tobytes())
        f.write((starts * 2).tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())
    np.concatenate(docs).astype(np.uint16).tofile(f"{prefix}.bin")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The three components' views; lengths 1 to 40 tokens."""
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(11)
    lengths = [rng.integers(1, 41, n).tolist() for n in SIZES]
    with tokload.Writer(root / "build", np.uint16) as w:
        for d, n in enumerate(lengths[0]):
            w.write(doc_tokens(0, d, n))
    write_megatron(root / "mega", [doc_tokens(1, d, n) for d, n in enumerate(lengths[1])])
    # a flat file whose documents end with the end-of-document token 0
    flat = [np.append(doc_tokens(2, d, n - 1), 0) for d, n in enumerate(lengths[2])]
    np.save(root / "flat.npy", np.concatenate(flat).astype(np.uint16))
    views = [
        tokload.Documents(root / "build"),
        tokload.Documents(str(root / "mega")),
        tokload.Documents(tokload.open_flat(root / "flat.npy", eos=0)),
    ]
    assert [len(v) for v in views] == list(SIZES)
    return views


POLICIES: dict[str, Any] = {
    "pad": tokload.Pad(),
    "pad-fixed": tokload.Pad(to=12, value=0),
    "pack": tokload.Pack(),
    "fill": tokload.Fill(48, lookahead=9),
}


def documents_of(batch: dict[str, Any], policy: Any) -> list[np.ndarray]:
    """The tokens of each document of a batch, in the order of ``batch["index"]``."""
    tokens, lengths = batch["tokens"].numpy(), batch["lengths"].tolist()
    if isinstance(policy, tokload.Pack):
        cu = batch["cu_seqlens"].tolist()
        return [tokens[a:e] for a, e in itertools.pairwise(cu)]
    if isinstance(policy, tokload.Pad):
        return [tokens[k, :n] for k, n in enumerate(lengths)]
    out, k = [], 0
    for row, count in enumerate(batch["doc_counts"].tolist()):
        at = 0
        for n in lengths[k : k + count]:
            out.append(tokens[row, at : at + n])
            at += n
        k += count
    return out


def check_batch(batch: dict[str, Any], policy: Any, views: list[Any]) -> None:
    """Provenance names where the tokens came from, and they are that document's."""
    comps, index = batch["component"].tolist(), batch["component_index"].tolist()
    docs = documents_of(batch, policy)
    assert len(comps) == len(index) == len(docs) == len(batch["index"])
    for c, d, got in zip(comps, index, docs, strict=True):
        want = np.asarray(views[c][d])
        if isinstance(policy, tokload.Pad) and policy.to is not None:
            want = want[: policy.to]
        np.testing.assert_array_equal(got, want)
        real = got[got != 0]  # the flat file's end-of-document token
        assert (real == (c + 1) * 1000 + d).all(), (c, d, got)


def by_position(batches: list[dict[str, Any]], policy: Any) -> dict[int, list[int]]:
    """Position -> the blend indices it holds (a row of documents with Fill)."""
    out: dict[int, list[int]] = {}
    for b in batches:
        idx, pos = b["index"].tolist(), b["position"].tolist()
        if isinstance(policy, tokload.Fill):
            k = 0
            for p, count in zip(pos, b["doc_counts"].tolist(), strict=True):
                out[p] = idx[k : k + count]
                k += count
        else:
            for p, i in zip(pos, idx, strict=True):
                out[p] = [i]
    return out


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    weights=st.lists(st.integers(0, 3), min_size=3, max_size=3).filter(lambda w: sum(w) > 0),
    later=st.none()
    | st.lists(st.integers(0, 3), min_size=3, max_size=3).filter(lambda w: sum(w) > 0),
    blocks=st.integers(3, 8),
    first=st.tuples(st.integers(1, 7), st.integers(1, 4), st.integers(0, 6)),
    then=st.tuples(st.integers(1, 7), st.integers(1, 4)),
    seed=st.integers(0, 3),
)
def test_a_mixture_delivers_every_document_its_share_on_any_world_size(
    sources: list[Any],
    policy: str,
    weights: list[int],
    later: list[int] | None,
    blocks: int,
    first: tuple[int, int, int],
    then: tuple[int, int],
    seed: int,
) -> None:
    block = 16
    schedule = [] if later is None else [(block * (blocks // 2), later)]
    blend = tokload.Blend(
        list(zip(sources, weights, strict=True)),
        length=block * blocks,
        block_size=block,
        schedule=schedule,
        seed=seed,
    )
    how = POLICIES[policy]

    def make(**kw: Any) -> tokload.DataLoader:
        return tokload.DataLoader(blend, batching=how, seed=seed, epochs=1, device=None, **kw)

    got = run_segments(make, [Segment(*first), Segment(*then, None)])
    batches = list(got.batches.values())
    for b in batches:
        check_batch(b, how, sources)
    # every blend position once; each component's documents as its count says
    blend_indices = [i for b in batches for i in b["index"].tolist()]
    assert sorted(blend_indices) == list(range(len(blend)))
    counts = blend.proportions(0, len(blend)).tolist()
    for c, n in enumerate(SIZES):
        seen = collections.Counter(
            d
            for b in batches
            for cc, d in zip(b["component"].tolist(), b["component_index"].tolist(), strict=True)
            if cc == c
        )
        assert sum(seen.values()) == counts[c]
        full, part = divmod(counts[c], n)
        times = collections.Counter(seen.get(d, 0) for d in range(n))
        want = {k: v for k, v in ((full + 1, part), (full, n - part)) if v}
        assert times == collections.Counter(want), (c, times)
    # the ranks hold what one rank holds at the same positions
    alone = run_segments(make, [Segment(1, 3, None)])
    assert by_position(batches, how) == by_position(list(alone.batches.values()), how)


def test_a_mixture_reads_each_task_in_one_engine_call(
    sources: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task of 8 steps over a blend of three formats: the rows of every
    component are read in one engine call, and nothing else (every index is in
    memory: a tokload build's, a flat file's, and a Megatron prefix's, read once);
    with the Megatron index read per batch (too large for the index memory), its
    entries take one more call, except with Fill, whose packer read them already."""
    from tokload._io import io_counters

    blend = tokload.Blend([(v, 1) for v in sources], length=160, block_size=16)
    for name, how in POLICIES.items():
        ld = tokload.DataLoader(blend, 4, batching=how, epochs=1, device=None, num_threads=0)
        spans = ld.schedule.spans(0, 8)
        ld.build_steps(spans)  # opens what a first read opens
        before = io_counters()["calls"]
        got = ld.build_steps(spans)
        calls = io_counters()["calls"] - before
        assert len(got) == 8
        assert calls == 1, (name, calls)
        ld.close()
    # the Megatron index too large for the index memory: read per batch
    prefix = sources[1].source.rows.files.paths[0].removesuffix(".bin")
    monkeypatch.setenv("TOKLOAD_INDEX_MEMORY", "0")
    on_disk = tokload.Documents(prefix)
    monkeypatch.delenv("TOKLOAD_INDEX_MEMORY")
    held = [getattr(v.source.docs, "in_memory", None) for v in (on_disk, sources[1])]
    assert held == [False, True]
    blend = tokload.Blend(
        [(sources[0], 1), (on_disk, 1), (sources[2], 1)], length=160, block_size=16
    )
    for name, how in POLICIES.items():
        ld = tokload.DataLoader(blend, 4, batching=how, epochs=1, device=None, num_threads=0)
        spans = ld.schedule.spans(0, 8)
        ld.build_steps(spans)
        before = io_counters()["calls"]
        ld.build_steps(spans)
        calls = io_counters()["calls"] - before
        assert calls == (1 if name == "fill" else 2), (name, calls)
        ld.close()


def test_a_failed_read_names_the_components_file(tmp_path: Path) -> None:
    """One engine call reads every component: a failure still names the file of
    the component whose read failed."""
    for name in ("a", "b"):
        with tokload.Writer(tmp_path / name, np.uint16) as w:
            for d in range(20):
                w.write(doc_tokens(0, d, 30))
    a, b = tokload.Documents(tmp_path / "a"), tokload.Documents(tmp_path / "b")
    blend = tokload.Blend([(a, 1), (b, 1)], length=40, block_size=8)
    ld = tokload.DataLoader(blend, 8, batching=tokload.Pack(), device=None, num_threads=0)
    next(iter(ld))
    shard = next(p for p in b.source.rows.files.paths)
    os.truncate(shard, 64)  # after opening: the reads find the file shorter
    with pytest.raises(tokload.TruncatedFileError, match=re.escape(shard)):
        ld.build_steps(ld.schedule.spans(0, 5))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_stats_count_each_components_samples_and_tokens(sources: list[Any], policy: str) -> None:
    blend = tokload.Blend([(v, w) for v, w in zip(sources, (3, 1, 2), strict=True)], length=96)
    how = POLICIES[policy]
    ld = tokload.DataLoader(blend, 5, batching=how, epochs=1, device=None, num_threads=2)
    samples, tokens = np.zeros(3, np.int64), np.zeros(3, np.int64)
    for taken, batch in enumerate(ld, 1):
        comp = batch["component"].numpy()
        samples += np.bincount(comp, minlength=3)
        tokens += np.bincount(comp, weights=batch["lengths"].numpy(), minlength=3).astype(np.int64)
        if taken == 4:
            first = ld.stats()  # an interval: the next report counts from here
            assert first["component_samples"] == samples.tolist()
            assert first["component_tokens"] == tokens.tolist()
            assert sum(first["component_tokens"]) == first["tokens"]
            samples[:], tokens[:] = 0, 0
    rest = ld.stats()
    assert rest["component_samples"] == samples.tolist()
    assert rest["component_tokens"] == tokens.tolist()
    assert sum(rest["component_tokens"]) == rest["tokens"]
    # a view without components reports none
    plain = tokload.DataLoader(sources[0], 5, epochs=1, device=None, num_threads=0)
    next(iter(plain))
    assert "component_samples" not in plain.stats()


def test_a_blend_of_windows_carries_provenance_and_counts(sources: list[Any]) -> None:
    a = tokload.TokenStream(sources[0].source, window=4)
    b = tokload.TokenStream(sources[1].source, window=4)
    blend = tokload.Blend([(a, 1), (b, 3)], length=64, block_size=16)
    ld = tokload.DataLoader(
        blend, 4, epochs=1, device=None, num_threads=1, read=tokload.ReadOptions(steps_per_task=3)
    )
    samples = np.zeros(2, np.int64)
    for batch in ld:
        for c, i, row in zip(
            batch["component"].tolist(), batch["component_index"].tolist(), batch["tokens"].numpy(),
            strict=True,
        ):  # fmt: skip
            np.testing.assert_array_equal(row, (a, b)[c][i])
        samples += np.bincount(batch["component"].numpy(), minlength=2)
    report = ld.stats()
    assert report["component_samples"] == samples.tolist() == [16, 48]
    assert report["component_tokens"] == [16 * 4, 48 * 4]


def test_a_stage_added_inside_a_packed_group_is_refused_on_resume(sources: list[Any]) -> None:
    """An in-order run with ``Fill`` has read the whole packing group its cursor is
    in: a blend stage that starts inside that group changes rows already
    delivered, so the resume is refused; one after the group is accepted."""
    comps = [(sources[0], 1.0), (sources[1], 0.0)]

    def blend(stage_at: int) -> tokload.Blend:
        return tokload.Blend(comps, schedule=[(stage_at, [0.0, 1.0])], length=96, block_size=8)

    fill = tokload.Fill(64, lookahead=32)
    ld = tokload.DataLoader(blend(80), 2, batching=fill, shuffle=False, device=None, num_threads=0)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    ld.close()
    assert 0 < state["cursor"] < 32  # inside the first group of 32 documents
    inside = tokload.DataLoader(blend(24), 2, batching=fill, shuffle=False, device=None)
    with pytest.raises(tokload.StateError, match="fingerprint"):
        inside.load_state_dict(state)
    after = tokload.DataLoader(blend(40), 2, batching=fill, shuffle=False, device=None)
    after.load_state_dict(state)  # the stage starts after the group: nothing read changes
    # without Fill, a position is a sample: only what was delivered counts
    pad = tokload.DataLoader(blend(80), 2, shuffle=False, device=None, num_threads=0)
    next(iter(pad))
    state = pad.state_dict()
    tokload.DataLoader(blend(8), 2, shuffle=False, device=None).load_state_dict(state)
