"""Blend: exact proportions, per-component epochs, schedules, caps, nesting, resume."""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import Segment, assert_exactly_once, run_segments
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tokload
from tokload import Blend, DataLoader, Documents, TokenStream, Writer
from tokload._docindex import ExtentIndex, extents_many
from tokload._permute import Permutation, epoch_seed, epoch_seeds, take_many
from tokload._slots import block_slots
from tokload._slots import locate as locate_slots
from tokload._slots import positions as slot_positions
from tokload.errors import StateError
from tokload.views import blend as blend_module
from tokload.views.blend import _COMP_TAG, _SLOT_TAG, largest_remainder
from tokload.views.blend_reads import DocumentMix, WindowMix

FOUR_WEIGHTS = st.lists(st.floats(0.0, 10.0), min_size=4, max_size=4).filter(lambda w: sum(w) > 0.1)
"""Weights of the four ``views``, not all (nearly) zero."""


def _components(root: Path, sizes: list[int]) -> list[TokenStream]:
    """Components of ``sizes`` windows; window k of component c is filled with c*10000 + k."""
    out = []
    for c, n in enumerate(sizes):
        with Writer(root / f"c{c}", "<u4") as w:
            for k in range(n):
                w.write(np.full(4, c * 10000 + k, np.uint32))
        out.append(TokenStream(root / f"c{c}", window=4))
    return out


@pytest.fixture(scope="module")
def views(tmp_path_factory: pytest.TempPathFactory) -> list[TokenStream]:
    return _components(tmp_path_factory.mktemp("blend"), [50, 130, 7, 300])


def test_largest_remainder() -> None:
    assert largest_remainder([1, 1, 1], 100) == [34, 33, 33]
    assert largest_remainder([0.5, 0.3, 0.2], 7) == [4, 2, 1]
    assert largest_remainder([3, 0, 1], 4) == [3, 0, 1]
    assert sum(largest_remainder([0.123, 0.456, 0.789], 1000)) == 1000


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    weights=FOUR_WEIGHTS,
    block=st.integers(1, 300),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_exact_proportions_and_once_per_component_epoch(
    views: list[TokenStream], weights: list[float], block: int, seed: int, data: Any
) -> None:
    length = block * 23 + data.draw(st.integers(0, block - 1))
    blend = Blend(
        list(zip(views, weights, strict=True)), seed=seed, length=length, block_size=block
    )
    comp, cpos = blend.component_positions(np.arange(length))
    per_block = largest_remainder(weights, block)
    for b in range(length // block):  # every full block holds each share exactly
        counts = np.bincount(comp[b * block : (b + 1) * block], minlength=4)
        assert counts.tolist() == per_block
    # Every prefix is near its target L * w. A full block of B slots holds k_c of
    # component c, with |k_c - B * w_c| < 1 (largest remainder). Inside a block, the
    # first r slots are those up to the time T of the r-th, and component c has
    # n_c = T * k_c + d_c of them with d_c in (-1, 1] (its slots are at the times
    # (j + u_c) / k_c). With A components holding slots, the sum of the d's is
    # r - T * B, so n_c - r * k_c / B = d_c - (k_c / B) * sum(d) lies within
    # 1 + (k_c / B) * (A - 2) of 0 (A >= 2), and rounding the share adds r / B.
    w = np.asarray(weights) / sum(weights)
    k = np.asarray(per_block, dtype=np.float64)
    active = int((k > 0).sum())
    inside = np.where(k > 0, 1 + k / block * max(active - 2, 0), 0.0)
    for L in [*range(0, length, max(1, length // 50)), *range(0, length, block)]:
        cum = np.bincount(comp[:L], minlength=4)
        m, r = divmod(L, block)
        bound = m * np.abs(k - block * w) + (r * np.abs(k / block - w) + inside if r else 0)
        assert (np.abs(cum - L * w) <= bound + 1e-9).all(), (L, cum, L * w, bound)
        assert blend.proportions(0, L).tolist() == cum.tolist()
    a, b = sorted(data.draw(st.tuples(st.integers(0, length), st.integers(0, length))))
    assert blend.proportions(a, b).tolist() == np.bincount(comp[a:b], minlength=4).tolist()
    # each component sees its positions 0, 1, 2, ... once; each of its epochs is a permutation
    _, index = blend.locate(np.arange(length))
    for c in range(4):
        mine = np.sort(cpos[comp == c])
        np.testing.assert_array_equal(mine, np.arange(len(mine)))
        n = len(views[c])
        by_pos = index[comp == c][np.argsort(cpos[comp == c])]
        for e in range(len(mine) // n):
            assert sorted(by_pos[e * n : (e + 1) * n].tolist()) == list(range(n))


def test_sources_interleave_rather_than_arrive_in_runs(views: list[TokenStream]) -> None:
    blend = Blend([(views[0], 1), (views[1], 1)], seed=4, length=10_000, block_size=1000)
    comp, _ = blend.locate(np.arange(10_000))
    runs = np.flatnonzero(np.diff(comp)).size + 1
    assert runs > 3000  # a fair coin gives ~5000 runs; blocks of 500+500 would give 20


def test_random_access_equals_sequential(views: list[TokenStream]) -> None:
    blend = Blend([(views[0], 2), (views[2], 1), (views[3], 3)], seed=9, length=5000, block_size=64)
    seq = blend.read(np.arange(5000))
    assert isinstance(seq, np.ndarray)
    comp, index = blend.locate(np.arange(5000))
    np.testing.assert_array_equal(seq[:, 0], np.array([0, 2, 3])[comp] * 10000 + index)
    rng = np.random.default_rng(1)
    for _ in range(20):
        idx = rng.integers(0, 5000, 37)
        np.testing.assert_array_equal(blend.read(idx), seq[idx])
    np.testing.assert_array_equal(blend[4999], seq[4999])


def test_a_schedule_change_leaves_earlier_positions_unchanged(views: list[TokenStream]) -> None:
    base = [(views[0], 5.0), (views[1], 3.0), (views[2], 0.0)]  # component 2 joins later
    one = Blend(base, seed=2, length=20_000, block_size=100, schedule=[(6000, [1, 1, 1])])
    two = Blend(
        base,
        seed=2,
        length=20_000,
        block_size=100,
        schedule=[(6000, [1, 1, 1]), (12_000, [0, 1, 9])],
    )
    a, b = one.locate(np.arange(20_000)), two.locate(np.arange(20_000))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x[:12_000], y[:12_000])
        assert not np.array_equal(x[12_000:], y[12_000:])
    assert one.proportions(0, 6000).tolist() == [63 * 60, 37 * 60, 0]  # 62.5/37.5 -> 63/37
    assert one.proportions(6000, 12_000).tolist() == [2040, 1980, 1980]  # 34/33/33 per block
    assert two.proportions(12_000, 20_000).tolist() == [0, 800, 7200]
    # ... so a run read in order (shuffle=False) resumes before the new stage
    ld = DataLoader(one, 100, shuffle=False, num_threads=0)
    ld.cursor = 9000
    state = ld.state_dict()
    resumed = DataLoader(two, 100, shuffle=False, num_threads=0)
    resumed.load_state_dict(state)
    assert resumed.cursor == 9000
    ld.cursor = 12_100  # past the new stage: the run read what the new stage changes
    with pytest.raises(StateError, match="saved for fingerprint="):
        resumed.load_state_dict(ld.state_dict())
    shuffled = DataLoader(one, 100, seed=1, num_threads=0)
    shuffled.cursor = 100  # a shuffled run has read from everywhere already
    with pytest.raises(StateError, match="saved for fingerprint="):
        DataLoader(two, 100, seed=1).load_state_dict(shuffled.state_dict())
    assert one.fingerprint != two.fingerprint


def test_a_state_is_refused_on_a_blend_of_other_rounds(views: list[TokenStream]) -> None:
    """review62: a blend's ``rounds`` shuffle each component, but were not in its
    fingerprint: a state saved on ``rounds=6`` resumed on ``rounds=8`` without a word
    and read 13 of 50 samples twice. They are now; a blend with the default rounds
    keeps the fingerprint it had, so states saved before still resume."""

    def blend(rounds: int) -> Blend:
        return Blend([(views[0], 1), (views[1], 1)], seed=1, length=50, block_size=10,
                     rounds=rounds)  # fmt: skip

    six, eight = blend(6), blend(8)
    assert not np.array_equal(six.locate(np.arange(50))[1], eight.locate(np.arange(50))[1])
    assert six.fingerprint != eight.fingerprint
    ld = DataLoader(six, 10, shuffle=False, num_threads=0)
    ld.cursor = 20
    with pytest.raises(StateError, match="saved for fingerprint="):
        DataLoader(eight, 10, shuffle=False, num_threads=0).load_state_dict(ld.state_dict())
    parts = ",".join(v.fingerprint for v in views[:2])  # (the form states were saved in)
    assert six.fingerprint == f"Blend({parts}):1:10:[(0, [1.0, 1.0])]:[]:0:50"


def test_caps_redistribute_and_end_the_blend(views: list[TokenStream]) -> None:
    # component 2 (7 samples) capped at 3 epochs = 21 samples; its share then goes to the others
    capped = Blend(
        [(views[0], 1), (views[1], 1), (views[2], 2)],
        seed=1,
        length=4000,
        block_size=100,
        max_epochs={2: 3},
    )
    comp, cpos = capped.component_positions(np.arange(4000))
    assert (comp == 2).sum() == 21
    assert sorted(cpos[comp == 2].tolist()) == list(range(21))
    tail = np.bincount(comp[1000:], minlength=3)
    assert tail.tolist() == [1500, 1500, 0]
    # every component capped: the blend ends by itself
    ends = Blend([(views[0], 1), (views[2], 1)], seed=1, block_size=10, max_epochs={0: 1, 1: 2})
    assert len(ends) == 50 + 14
    comp, index = ends.locate(np.arange(len(ends)))
    assert np.bincount(comp).tolist() == [50, 14]
    assert sorted(index[comp == 0].tolist()) == list(range(50))
    with pytest.raises(ValueError, match=r"length 65 is past the end of the blend \(64"):
        Blend([(views[0], 1), (views[2], 1)], block_size=10, max_epochs={0: 1, 1: 2}, length=65)
    # capped sources run out in a stage before a later one that weights a source with
    # samples left: the blend ended there, silently, without the later stage (review44)
    stages: dict[str, Any] = {"block_size": 10, "max_epochs": {1: 1}}
    for schedule in ([(20, [0, 1]), (100, [1, 1])], [(100, [1, 0])]):
        weights = [0, 1] if len(schedule) == 1 else [1, 1]
        comps = list(zip((views[0], views[2]), weights, strict=True))
        with pytest.raises(
            ValueError, match=r"the blend ends at position (\d+), where .* so that stage is never"
        ) as e:
            Blend(comps, schedule=schedule, **stages)
        end = int(str(e.value).split()[5].rstrip(","))
        assert len(Blend(comps, schedule=schedule, length=end, **stages)) == end  # as it says
    # a later stage of only run-out sources adds nothing: the blend ends as before
    assert len(Blend([(views[0], 0), (views[2], 1)], schedule=[(20, [0, 1])], **stages)) == 7


def test_nested_blends(views: list[TokenStream]) -> None:
    inner = Blend([(views[0], 1), (views[1], 1)], seed=3, length=1000, block_size=10)
    outer = Blend([(inner, 3), (views[3], 1)], seed=4, length=4000, block_size=40)
    got = outer.read(np.arange(4000))
    assert isinstance(got, np.ndarray)
    comp, index = outer.locate(np.arange(4000))
    assert np.bincount(comp).tolist() == [3000, 1000]
    inner_rows = inner.read(index[comp == 0])
    np.testing.assert_array_equal(got[comp == 0], inner_rows)
    assert (got[comp == 1][:, 0] // 10000 == 3).all()
    # the inner blend's 1000 positions are each used 3 times (3 component epochs)
    assert np.bincount(index[comp == 0], minlength=1000).tolist() == [3] * 1000


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cuts=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3)), min_size=4, max_size=4),
    seed=st.integers(0, 2**32),
)
def test_plain_windows_read_as_one_part_equal_each_components_own(
    tmp_path_factory: pytest.TempPathFactory, cuts: list[tuple[int, int]], seed: int
) -> None:
    """A blend of plain TokenStreams (subsets, strides of their own) reads every
    window as one ``RowSets`` part: equal to each component's own ``read``, and
    to the per-component path a component of another class takes."""
    root = tmp_path_factory.mktemp("plainwin")
    comps: list[TokenStream] = []
    for c, (lo, stride) in enumerate(cuts):
        with Writer(root / f"c{c}", "<u2", shard_bytes=256) as w:
            w.write(np.arange(c * 1000, c * 1000 + 600, dtype=np.uint16))
        v = TokenStream(root / f"c{c}", window=6, stride=stride)
        comps.append(v.subset(lo, len(v) - 3))
    blend = Blend([(v, 1.0) for v in comps], seed=seed, length=500, block_size=20)
    assert isinstance(blend._mix, WindowMix) and blend._mix.plain is not None
    idx = np.random.default_rng(seed).integers(0, 500, 64)
    got = blend.read(idx)
    assert isinstance(got, np.ndarray)
    comp, index = blend.locate(idx)
    for k in range(len(idx)):
        want = comps[comp[k]].read(index[k : k + 1])
        np.testing.assert_array_equal(got[k], np.asarray(want).reshape(-1), str(k))

    class Own(TokenStream):  # another class: its windows are its own part
        pass

    own = [object.__new__(Own) for _ in comps]
    for o, v in zip(own, comps, strict=True):
        o.__dict__.update(v.__dict__)
    apart = Blend([(v, 1.0) for v in own], seed=seed, length=500, block_size=20)
    assert isinstance(apart._mix, WindowMix) and apart._mix.plain is None
    np.testing.assert_array_equal(apart.read(idx), got)


def test_through_the_dataloader_resume_and_rescale(views: list[TokenStream]) -> None:
    blend = Blend(
        [(views[0], 1), (views[1], 2), (views[2], 1)],
        seed=5,
        length=900,
        block_size=32,
        schedule=[(320, [0, 1, 1])],
    )

    def make(**kw: Any) -> DataLoader:
        return DataLoader(blend, seed=11, epochs=2, **kw, read=tokload.ReadOptions(prefetch=3))

    got = run_segments(
        make,
        [Segment(3, 4, 17, num_threads=1), Segment(2, 9, 20), Segment(5, 2, None, num_threads=2)],
    )
    assert_exactly_once(got, len(blend), 2 * len(blend))
    whole = run_segments(make, [Segment(3, 4, None, num_threads=0)])
    tokens = {
        p: b["tokens"][k].tolist()
        for b in whole.batches.values()
        for k, p in enumerate(b["position"].tolist())
    }
    for b in got.batches.values():
        for k, p in enumerate(b["position"].tolist()):
            assert b["tokens"][k].tolist() == tokens[p]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"components": []}, ValueError, "at least one component"),
        ({"weights": [1, -1]}, ValueError, r"stage 0: weights must be finite and non-negative"),
        ({"weights": [float("inf"), 1]}, ValueError, r"weights must be finite and non-negative"),
        ({"weights": [float("nan"), 1]}, ValueError, r"weights must be finite and non-negative"),
        ({"weights": [0, 0]}, ValueError, r"stage 0: all weights are zero"),
        ({"schedule": [(200, [1, 1]), (100, [1, 2])]}, ValueError, r"out of order: stage 2"),
        ({"schedule": [(150, [1, 1])]}, ValueError, r"starts at position 150, not a multiple"),
        ({"schedule": [(200, [1])]}, ValueError, r"stage 1 gives 1 weights for 2 components"),
        # review68: 1024.7 was stage 1024, "1024" a string position
        ({"schedule": [(200.7, [1, 1])]}, TypeError, r"stage 1: its position must be an integ"),
        ({"schedule": [("200", [1, 1])]}, TypeError, r"stage 1: .* got '200'"),
        ({"length": None}, ValueError, r"length is required unless every component is capped"),
        ({"max_epochs": {5: 1}}, ValueError, r"max_epochs: need a component in \[0, 2\)"),
        # a float cap failed inside the layout with "slice indices must be integers"
        ({"max_epochs": {0: 1.5}}, ValueError, r"integers both, got 0: 1\.5"),
        ({"max_epochs": {"0": 1}}, ValueError, r"integers both, got '0': 1"),
        ({"block_size": 0}, ValueError, r"block_size must be a positive integer, got 0"),
        ({"block_size": 100.5}, ValueError, r"block_size must be a positive integer, got 100\.5"),
        # a float seed ran as the int it truncated to
        ({"seed": 1.5}, ValueError, r"seed must be an integer in \[0, 2\*\*64 - 1\], got 1\.5"),
        ({"rounds": -1}, ValueError, r"rounds must be an integer in \[0, 65536\], got -1"),
        # each weight finite, their sum not: shares of 0 and a layout that failed to read
        ({"weights": [1e308, 1e308]}, ValueError, r"stage 0: the weights' sum overflows"),
        # a negative length failed at len(); 10.7 ran as 10, "100" as 100, True as 1
        ({"length": -5}, ValueError, r"length must be an integer >= 0, got -5"),
        ({"length": 10.7}, ValueError, r"length must be an integer >= 0, got 10\.7"),
        ({"length": "100"}, ValueError, r"length must be an integer >= 0, got '100'"),
        ({"length": True}, ValueError, r"length must be an integer >= 0, got True"),
    ],
)
def test_bad_blends(
    views: list[TokenStream], kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    weights = kwargs.pop("weights", [1, 1])
    comps = kwargs.pop("components", list(zip(views[:2], weights, strict=True)))
    args: dict[str, Any] = {"length": 1000, "block_size": 100, **kwargs}
    with pytest.raises(exc, match=match):
        Blend(comps, **args)


def test_read_into_out_checks_it_against_the_components(
    views: list[TokenStream], tmp_path: Path
) -> None:
    """``out`` must match ``empty`` as a TokenStream's must: an array of another dtype
    of the same size was filled with raw bytes and returned as if valid."""
    blend = Blend([(views[0], 1), (views[1], 1)], length=40)
    want = blend.read(np.arange(6))
    for dt in (np.float32, np.int32, np.dtype(">u4"), np.uint16):
        with pytest.raises(TypeError, match=rf"out must have dtype uint32, got {np.dtype(dt)}"):
            blend.read(np.arange(6), out=np.zeros((6, 4), dt))
    with pytest.raises(ValueError, match=r"out has shape \(5, 4\), expected \(6, 4\)"):
        blend.read(np.arange(6), out=np.zeros((5, 4), np.uint32))
    out = np.zeros((6, 4), np.uint32)
    assert blend.read(np.arange(6), out=out) is out
    np.testing.assert_array_equal(out, want)
    # structured rows: a dict of the fields, each checked
    rows = np.dtype([("token", "<u4"), ("metadata_id", "<u4")])
    parts = []
    for c in range(2):
        with Writer(tmp_path / f"s{c}", rows) as w:
            w.write({"token": np.arange(20) + 100 * c, "metadata_id": np.arange(20)})
        parts.append((TokenStream(tmp_path / f"s{c}", window=4), 1))
    fields = Blend(parts, length=10)
    good: Any = fields.empty(3)
    fields.read(np.arange(3), out=good)
    bad = {**good, "metadata_id": np.zeros((3, 4), np.int64)}
    with pytest.raises(TypeError, match=r"out\['metadata_id'\] must have dtype uint32, got int64"):
        fields.read(np.arange(3), out=bad)
    with pytest.raises(TypeError, match=r"out\['token'\] must be a numpy array, got NoneType"):
        fields.read(np.arange(3), out={"metadata_id": good["metadata_id"]})
    with pytest.raises(TypeError, match=r"out must be a dict of per-field arrays"):
        fields.read(np.arange(3), out=np.zeros((3, 4), np.uint32))


def test_proportions_take_integer_positions(views: list[TokenStream]) -> None:
    """review68: ``proportions(0.5, 10)`` blamed an "epoch", and True ran as 1."""
    blend = Blend([(views[0], 1), (views[1], 1)], length=100, block_size=10)
    assert blend.proportions(np.int64(0), 10).tolist() == [5, 5]  # type: ignore[arg-type]
    for start, stop in ((0.5, 10), (True, 10), (0, "10")):
        with pytest.raises(TypeError, match=r"start and stop must be integers"):
            blend.proportions(start, stop)  # type: ignore[arg-type]


def test_bad_components(views: list[TokenStream], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="component 1 is empty"):
        Blend([(views[0], 1), (views[1].subset(0, 0), 1)], length=10)
    docs = Documents(views[0].source)
    with pytest.raises(
        TypeError, match="component 1 is a view of documents, component 0 of windows"
    ):
        Blend([(views[0], 1), (docs, 1)], length=10)
    with pytest.raises(
        TypeError, match="component 1 is a view of windows, component 0 of documents"
    ):
        Blend([(docs, 1), (views[0], 1)], length=10)

    class Rows:  # a view, but neither windows nor documents
        fingerprint = "rows"

        def __len__(self) -> int:
            return 3

        def read_batch(self, indices: Any, alloc: Any) -> dict[str, Any]:
            return {}

    with pytest.raises(
        TypeError,
        match="component 0 must be a TokenStream, a StreamWithMetadata, a view of documents",
    ):
        Blend([(Rows(), 1)], length=10)
    with pytest.raises(TypeError, match="component 0 is not a view"):
        Blend([(object(), 1)], length=10)
    # (review31: a bare "too many values to unpack (expected 2)")
    bare: Any = [views[0], views[1]]
    with pytest.raises(
        TypeError, match=r"^component 0 must be a \(view, weight\) pair, got TokenStream "
    ):
        Blend(bare, length=10)
    weighted: Any = {views[0]: 0.5, views[1]: 0.5}
    with pytest.raises(
        TypeError, match=r"^components must be a list of \(view, weight\) pairs, got dict$"
    ):
        Blend(weighted, length=10)
    pairs: Any = ((views[0], 1), [views[1], 1])  # tuples and lists
    assert len(Blend(pairs, length=10)) == 10
    # any iterable of pairs, read once (review33: dict.items() was refused)
    for these in (
        {views[0]: 1, views[1]: 1}.items(),
        ((v, 1) for v in views[:2]),
        np.array([(views[0], 1), (views[1], 1)], dtype=object),
    ):
        mixed: Any = Blend(these, length=10)  # type: ignore[arg-type]
        again = pickle.loads(pickle.dumps(mixed))  # the pairs, not the spent iterator
        assert again.fingerprint == mixed.fingerprint and len(again) == 10
    two = views[0].subset(0, 2)  # a view of two samples is not a pair
    with pytest.raises(TypeError, match=r"^component 0 must be a \(view, weight\) pair"):
        Blend([two, two], length=10)  # type: ignore[list-item]

    # a build with metadata (its tokens are the field "token") and a plain source
    rng = np.random.default_rng(0)
    with Writer(tmp_path / "fields", [("token", "<u2")]) as w:
        for _ in range(20):
            w.write({"token": rng.integers(0, 100, 30)})
    with Writer(tmp_path / "plain", "<u2") as w:
        for _ in range(20):
            w.write(rng.integers(0, 100, 30))
    hint = r"a tokload build with metadata, --keep-field or --annotations, stores its tokens"
    with pytest.raises(ValueError, match=r"component 1 has the fields tokens: uint16; component 0 "
                       r"has token: uint16 \(" + hint):  # fmt: skip
        Blend([(Documents(tmp_path / "fields"), 1), (Documents(tmp_path / "plain"), 1)])
    with pytest.raises(ValueError, match=hint):
        Blend([(TokenStream(tmp_path / "plain", 8), 1), (TokenStream(tmp_path / "fields", 8), 1)])
    other = TokenStream(views[0].source, window=3)
    with pytest.raises(ValueError, match="component 1 has window 3"):
        Blend([(views[0], 1), (other, 1)], length=10)
    # a blend of documents has no windows to find boundaries in (an AttributeError
    # on "window" once, from the cu_seqlens check that came first)
    with pytest.raises(TypeError, match="a blend of documents has no windows"):
        Blend([(docs, 1)], length=10).boundaries([0, 1])


def test_fill_locates_each_document_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill over a blend locates documents when it packs their group; reading a
    task's rows (their extents, reads and provenance) locates nothing again, and
    the batch is what locating them again would give."""
    rng = np.random.default_rng(4)
    views = []
    for c in range(3):
        with Writer(tmp_path / f"d{c}", np.uint16) as w:
            for d in range(60):
                w.write(np.full(int(rng.integers(1, 30)), c * 100 + d, dtype=np.uint16))
        views.append(Documents(tmp_path / f"d{c}"))
    blend = Blend([(v, 1.0) for v in views], length=150, seed=3)
    fill = tokload.Fill(64, lookahead=40)
    sched = fill.schedule(blend, 4)
    spans = sched.spans(0, 6)
    sched.task_rows(spans)  # packs the groups these steps need (kept)
    calls: list[int] = []
    real = locate_slots

    def counted(*args: Any) -> tuple[np.ndarray, np.ndarray]:
        calls.append(len(args[1]))
        return real(*args)

    monkeypatch.setattr(blend_module, "locate_slots", counted)
    task = fill.reader(blend, sched, np.empty).read(spans, None)
    assert calls == []
    assert task.whole is not None
    blend.locate(np.arange(1))  # another answer kept: the next is located again
    comp, index = blend.locate(task.whole["index"])
    assert calls
    np.testing.assert_array_equal(task.whole["component"], comp)
    np.testing.assert_array_equal(task.whole["component_index"], index)
    tokens, lengths = task.whole["tokens"], task.whole["lengths"].tolist()
    k = 0
    for row, count in enumerate(task.whole["doc_counts"].tolist()):
        at = 0
        for n in lengths[k : k + count]:
            assert (tokens[row, at : at + n] == comp[k] * 100 + index[k]).all()
            at, k = at + n, k + 1


def test_remember_located_refuses_arrays_of_other_lengths(views: list[TokenStream]) -> None:
    blend = Blend([(v, 1.0) for v in views], length=100)
    with pytest.raises(ValueError, match=r"3 positions, 2 components, 2 indices"):
        blend.remember_located(np.arange(3), np.zeros(2, np.int64), np.zeros(2, np.int64))


SLOT_CASES: dict[str, Any] = {
    "weights": FOUR_WEIGHTS,
    "block": st.integers(1, 3000),
    "seed": st.integers(0, 2**64 - 1),
    "data": st.data(),
}
"""A blend of four weights in blocks of up to 3,000 slots, for the slot tests."""


def reference_layout(blend: Blend, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(component, lane) of each slot of block ``b``, as the module docstring
    defines them: component c's j-th slot at time (j + u_c) / k_c, the slots in
    increasing time, equal times by component (NumPy, the whole block)."""
    seg = blend._segments[int(np.searchsorted(blend._seg_first, b, side="right")) - 1]
    return layout_of(blend.seed ^ _SLOT_TAG, b, seg.counts)


def layout_of(slot_seed: int, b: int, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """``reference_layout`` of block ``b`` with ``counts`` slots per component."""
    key = epoch_seed(slot_seed, b)
    comps, lanes, times = [], [], []
    for c, k in enumerate(counts):
        if k:
            u = epoch_seed(key, c) / 2.0**64
            j = np.arange(k, dtype=np.int64)
            comps.append(np.full(k, c, dtype=np.int64))
            lanes.append(j)
            times.append((j + u) / k)
    comp, lane, time = (np.concatenate(x) for x in (comps, lanes, times))
    order = np.lexsort((comp, time))
    return comp[order], lane[order]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SLOT_CASES)
def test_slots_found_without_the_layout_equal_the_layout(
    views: list[TokenStream], weights: list[float], block: int, seed: int, data: Any
) -> None:
    """``tokload._slots.block_slots`` (a jump near the slot, then a merge of the
    components' times) gives every slot the component and lane of the block's
    whole layout, bit for bit, for any slots asked, in any order, repeated."""
    blend = Blend(
        list(zip(views, weights, strict=True)), seed=seed, length=20 * block, block_size=block
    )
    blocks = data.draw(st.lists(st.integers(0, 19), min_size=1, max_size=4))
    b_all, s_all, want_c, want_l = [], [], [], []
    for b in blocks:
        comp, lane = reference_layout(blend, b)
        slots = data.draw(
            st.one_of(
                st.just(list(range(len(comp)))),
                st.lists(st.integers(0, len(comp) - 1), min_size=1, max_size=40),
            )
        )
        b_all += [b] * len(slots)
        s_all += slots
        want_c += comp[slots].tolist()
        want_l += lane[slots].tolist()
    g = np.searchsorted(blend._seg_first, b_all, side="right") - 1
    comp, lane = block_slots(blend.seed ^ _SLOT_TAG, b_all, s_all, blend._seg_counts, g)
    assert comp.tolist() == want_c
    assert lane.tolist() == want_l


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SLOT_CASES)
def test_slots_before_a_slot_are_counted_as_the_layout_counts_them(
    views: list[TokenStream], weights: list[float], block: int, seed: int, data: Any
) -> None:
    """``proportions`` counts each component's slots before a position in a block
    from that slot alone (it listed them all: 16 GiB for a block of 2**32)."""
    blend = Blend(
        list(zip(views, weights, strict=True)), seed=seed, length=20 * block, block_size=block
    )
    b = data.draw(st.integers(0, 19))
    comp, _ = reference_layout(blend, b)
    for r in data.draw(st.lists(st.integers(0, len(comp)), min_size=1, max_size=8)):
        q = b * block + r
        assert (
            blend.proportions(0, q).tolist()
            == (blend.proportions(0, b * block) + np.bincount(comp[:r], minlength=4)).tolist()
        )


def test_proportions_of_a_huge_block_take_no_memory_to_speak_of(
    views: list[TokenStream],
) -> None:
    """A block of 2**32 slots: ``proportions`` answers from one slot, and agrees
    with each position's own position in its component."""
    block = 2**32 + 12345
    blend = Blend(list(zip(views, [3, 1, 0.5, 2], strict=True)), length=3 * block, block_size=block)
    tracemalloc.start()
    try:
        for q in (2**31, block + 2**31 + 7, 3 * block - 1):
            counts = blend.proportions(0, q)
            assert int(counts.sum()) == q
            comp, own = blend.component_positions([q])
            assert counts[comp[0]] == own[0]  # the samples of q's component before it
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_locate_equals_the_definition_on_a_long_blend(views: list[TokenStream]) -> None:
    """On a blend of many blocks and component epochs (each shuffled position in a
    block and a (component, epoch) of its own), ``locate`` equals the definition:
    the slot's component and lane, the component's own position, and its epoch's
    permutation (``Permutation``, one per component and epoch)."""
    blend = Blend([(v, w) for v, w in zip(views, [3, 1, 0.5, 2], strict=True)], length=10**7)
    rng = np.random.default_rng(9)
    q = rng.integers(0, 10**7, 500)
    comp, index = blend.locate(q)
    m = blend.block_size
    for p, c, i in zip(q.tolist(), comp.tolist(), index.tolist(), strict=True):
        b, s = divmod(p, m)
        cs, ls = reference_layout(blend, b)
        assert c == cs[s]
        g = int(np.searchsorted(blend._seg_first, b, side="right")) - 1
        seg = blend._segments[g]
        own = seg.before[c] + (b - seg.first_block) * seg.counts[c] + int(ls[s])
        epoch, j = divmod(own, len(views[c]))
        cseed = epoch_seed(epoch_seed(blend.seed ^ _COMP_TAG, c), epoch)
        assert i == Permutation(len(views[c]), seed=cseed, rounds=blend.rounds)[j]


def _locate_by_numpy(blend: Blend, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(component, own position, index)`` of global positions ``q``, composed in
    NumPy from ``block_slots`` (checked against the layout above) and one
    ``take_many`` call per position in the given order: the lookup as it was
    written before ``tokload._slots.locate`` did it in one compiled call."""
    m = blend.block_size
    blocks, slots = np.divmod(q, m)
    g = np.searchsorted(blend._seg_first, blocks, side="right") - 1
    comp, lane = block_slots(blend.seed ^ _SLOT_TAG, blocks, slots, blend._seg_counts, g)
    counts, before = blend._seg_counts[g, comp], blend._seg_before[g, comp]
    cpos = before + (blocks - blend._seg_first[g]) * counts + lane
    sizes = blend._sizes[comp]
    epochs, j = np.divmod(cpos, sizes)
    index = take_many(sizes, epoch_seeds(blend._comp_seeds[comp], epochs), j, blend.rounds)
    return comp, cpos, index.astype(np.int64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ncomp=st.sampled_from([1, 2, 4, 16, 130]),
    block=st.integers(1, 1500),
    seed=st.integers(0, 2**64 - 1),
    rounds=st.integers(0, 8),
    data=st.data(),
)
def test_locate_in_one_call_equals_its_parts(
    views: list[TokenStream], ncomp: int, block: int, seed: int, rounds: int, data: Any
) -> None:
    """``Blend.locate`` and ``component_positions`` (``tokload._slots``: a radix
    sort of the positions, each block's slots, a grouping by (component, epoch),
    one permutation call) equal the same lookup composed of its checked parts,
    in the caller's order: positions in any order and repeated, near and far
    (keys of one to five bytes), over schedules of weights (several segments),
    caps (partial blocks, components without slots), many epochs of small
    components, and more components than the linear merge takes (a heap)."""
    weights = data.draw(st.lists(st.floats(0.0, 5.0), min_size=ncomp, max_size=ncomp))
    weights[data.draw(st.integers(0, ncomp - 1))] += 1.0
    comps = [(views[c % 4], w) for c, w in enumerate(weights)]
    stages = data.draw(st.lists(st.integers(1, 40), max_size=3, unique=True))
    schedule = [
        (b * block, data.draw(st.lists(st.floats(0.5, 3.0), min_size=ncomp, max_size=ncomp)))
        for b in sorted(stages)
    ]
    caps = {c: data.draw(st.integers(1, 3)) for c in data.draw(st.sets(st.integers(0, ncomp - 1)))}
    # every component capped: the blend ends (length None); else a long one or not
    ends = len(caps) == ncomp
    length = None if ends else data.draw(st.sampled_from([50 * block, 2**40 + 7]))

    def blend_of(length: int | None) -> Blend:
        return Blend(
            comps, seed=seed, block_size=block, schedule=schedule, max_epochs=caps or None,
            rounds=rounds, length=length,
        )  # fmt: skip

    try:
        blend = blend_of(length)
    except ValueError as e:
        # the uncapped components weigh 0 until the capped ones have run out: the
        # blend ends there all the same, and its own length is that end
        assert "past the end of the blend" in str(e), e
        blend = blend_of(None)
    n = len(blend)
    q = np.asarray(
        data.draw(
            st.one_of(
                st.lists(st.integers(0, n - 1), min_size=0, max_size=300),
                st.integers(0, max(0, n - 300)).map(lambda a: list(range(a, min(n, a + 300)))),
            )
        ),
        dtype=np.int64,
    )
    q = np.concatenate([q, q[: len(q) // 5]])  # some asked twice
    want_c, want_p, want_i = _locate_by_numpy(blend, q)
    comp, cpos = blend.component_positions(q)
    assert comp.tolist() == want_c.tolist() and cpos.tolist() == want_p.tolist()
    comp, index = blend.locate(q)
    assert comp.dtype == index.dtype == np.int64
    assert comp.tolist() == want_c.tolist() and index.tolist() == want_i.tolist()


@pytest.fixture(scope="module")
def small_views(tmp_path_factory: pytest.TempPathFactory) -> list[TokenStream]:
    """Components of 13, 7, 3 and 29 windows: each runs out within a few blocks."""
    return _components(tmp_path_factory.mktemp("small"), [13, 7, 3, 29])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    weights=st.lists(st.integers(1, 9).map(float), min_size=4, max_size=4),
    caps=st.dictionaries(st.integers(0, 3), st.integers(1, 2), min_size=1),
    block=st.integers(1, 30),
)
@example(weights=[9.0, 6.0, 7.0, 3.0], caps={1: 1, 2: 1}, block=26)  # 1 got 8 of its 7
@example(weights=[3.0, 7.0, 5.0, 5.0], caps={0: 2, 1: 1, 2: 2, 3: 1}, block=12)  # a count -1
def test_a_capped_component_never_passes_its_cap(
    small_views: list[TokenStream], weights: list[float], caps: dict[int, int], block: int
) -> None:
    """Every component sees its own positions 0, 1, 2, ... once each, a capped one
    never more than ``max_epochs`` passes (the slots a running-out component freed
    were dealt to capped ones past their cap: a sample came twice, and a later
    block got a negative count), and a blend that ends has given each its all."""
    views = small_views
    ends = len(caps) == len(views)
    blend = Blend(
        list(zip(views, weights, strict=True)),
        block_size=block,
        max_epochs=caps,
        length=None if ends else 300,
    )
    assert all(n >= 0 for seg in blend._segments for n in seg.counts)
    n = len(blend)
    comp, own = blend.component_positions(np.arange(n))
    counted = np.bincount(comp, minlength=4)
    assert blend.proportions(0, n).tolist() == counted.tolist()
    for c, view in enumerate(views):
        assert own[comp == c].tolist() == list(range(counted[c]))
        if c in caps:
            assert counted[c] <= caps[c] * len(view)
            if ends:
                assert counted[c] == caps[c] * len(view)


def test_locate_in_one_call_refuses_what_is_not_a_blend() -> None:
    counts = np.array([[3, 1]], dtype=np.int64)  # 4 slots in blocks of 5: a final block
    before = np.zeros_like(counts)
    first = np.zeros(1, dtype=np.int64)
    sizes, seeds = np.array([4, 5]), np.array([1, 2], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"slot 4 of block 7: its segment has 4 slots"):
        slot_positions(1, [40, 39, 36], 5, first, counts, before)
    with pytest.raises(ValueError, match=r"slot 4 of block 2: its segment has 4 slots"):
        locate_slots(1, [36, 14], 5, first, counts, before, sizes, seeds, 6, None)
    with pytest.raises(ValueError, match=r"positions must be a 1-D array of integers >= 0"):
        slot_positions(1, [3, -1], 5, first, counts, before)
    with pytest.raises(ValueError, match=r"segments: first \(1,\) \(from block 0\)"):
        slot_positions(1, [3], 5, first + 1, counts, before)
    with pytest.raises(ValueError, match=r"the block size must be positive"):
        slot_positions(1, [3], 0, first, counts, before)
    with pytest.raises(ValueError, match=r"2 components, 1 sizes, 2 seeds"):
        locate_slots(1, [3], 5, first, counts, before, sizes[:1], seeds, 6, None)
    with pytest.raises(ValueError, match=r"every component's size must be >= 1"):
        locate_slots(1, [3], 5, first, counts, before, [4, 0], seeds, 6, None)
    comp, index = locate_slots(1, [], 5, first, counts, before, sizes, seeds, 6, None)
    assert comp.shape == index.shape == (0,)


@settings(max_examples=150, deadline=None)
@given(
    counts=st.one_of(
        st.lists(st.integers(0, 60), min_size=1, max_size=40),
        st.lists(st.integers(0, 8), min_size=120, max_size=200),
    ).filter(lambda c: sum(c) > 0),
    slot_seed=st.integers(0, 2**64 - 1),
    block=st.integers(0, 2**40),
    data=st.data(),
)
def test_block_slots_equal_the_layout_for_any_counts(
    counts: list[int], slot_seed: int, block: int, data: Any
) -> None:
    """Any number of components (a scan of their next slots up to 128; above, a
    heap where the slots asked are on average fewer than 24 apart, else the
    scan), some of them without slots in the block, and slots asked densely or
    sparsely: ``block_slots`` gives the layout's component and lane."""
    comp, lane = layout_of(slot_seed, block, counts)
    n = len(comp)
    slots = data.draw(
        st.one_of(
            st.just(list(range(n))),
            st.lists(st.integers(0, n - 1), min_size=1, max_size=3 * n),
            st.lists(st.integers(0, n - 1), min_size=1, max_size=8),  # mostly the scan
        )
    )
    got_c, got_l = block_slots(
        slot_seed, [block] * len(slots), slots, np.array([counts]), [0] * len(slots)
    )
    assert got_c.tolist() == comp[slots].tolist()
    assert got_l.tolist() == lane[slots].tolist()


@pytest.mark.parametrize("flags", [[], ["-DTL_NO_TARGET_CLONES"]], ids=["clones", "baseline"])
def test_the_slot_jump_in_lanes_is_exact_or_says_it_missed(
    tmp_path: Path, flags: list[str]
) -> None:
    """The linear merge's jump (``tl_slots_jump_lanes``) estimates each component's
    slots before a time in SIMD lanes. At a slot's own time, and one ulp either
    side, the estimate is often off by a rounding: it must say so (the merge then
    counts one slot at a time), and be exact whenever it does not (a C program
    against a brute-force count; random blocks never hit these times). Built as
    the extension is (the best clone this CPU runs) and for the x86-64 baseline."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    root = Path(__file__).resolve().parent.parent
    exe = tmp_path / "slots_jump"
    subprocess.run(
        [cc, "-O3", "-std=c11", "-Wall", "-Wextra", "-Werror", *flags, "-I", str(root / "csrc"),
         str(root / "tests" / "c" / "slots_jump.c"), "-o", str(exe), "-lm"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=False)
    asked, missed, wrong = map(int, re.findall(r"\d+", run.stdout))
    assert run.returncode == 0 and wrong == 0, run.stdout
    assert asked > 50_000 and 0 < missed < asked, run.stdout  # both paths taken


def test_block_slots_refuses_a_slot_past_its_block() -> None:
    counts = np.array([[3, 2]], dtype=np.int64)
    with pytest.raises(ValueError, match=r"slot 5 of block 7: its segment has 5 slots"):
        block_slots(1, [7, 7], [1, 5], counts, [0, 0])
    with pytest.raises(ValueError, match=r"must be >= 0, segments < 1"):
        block_slots(1, [7], [1], counts, [1])
    with pytest.raises(ValueError, match=r"2 blocks, 1 slots and 2 segments"):
        block_slots(1, [7, 8], [1], counts, [0, 0])


def test_a_blend_of_documents_finds_extents_in_one_call(tmp_path: Path) -> None:
    """``Blend.extents`` over plain ``Documents`` (subsets too) is one compiled
    call (``extents_many``) and equals each component's own ``extents``; a
    component with an ``extents`` of its own (a subclass) takes a call per
    component, with the same answer, and so do the documents read."""
    rng = np.random.default_rng(5)
    views = []
    for c in range(3):
        with Writer(tmp_path / f"d{c}", np.uint16) as w:
            for d in range(50):
                n = int(rng.integers(1, 40))
                w.write(c * 1000 + d * 10 + np.arange(n, dtype=np.uint16) % 10)
        views.append(Documents(tmp_path / f"d{c}"))
    views[1] = views[1].subset(7, 41)

    class Shifted(Documents):
        def extents(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
            return super().extents(indices)

    blend = Blend([(v, 1.0) for v in views], length=300, seed=2)
    assert isinstance(blend._mix, DocumentMix) and blend._mix.plain is not None
    positions = rng.permutation(300)
    comp, index = blend.locate(positions)
    starts, lengths = blend.extents(positions)
    for c, v in enumerate(views):
        mine = comp == c
        want = v.extents(index[mine])
        np.testing.assert_array_equal(starts[mine], want[0])
        np.testing.assert_array_equal(lengths[mine], want[1])
    other = Blend(
        [(Shifted(tmp_path / "d0"), 1.0), (views[1], 1.0), (views[2], 1.0)], length=300, seed=2
    )
    assert isinstance(other._mix, DocumentMix) and other._mix.plain is None
    got = other.extents(positions)
    np.testing.assert_array_equal(got[0], starts)
    np.testing.assert_array_equal(got[1], lengths)
    # the reads too: one part per component made by the blend, or by each component
    fast, slow = blend.read_batch(positions, np.empty), other.read_batch(positions, np.empty)
    assert fast.keys() == slow.keys()
    for key in fast:
        np.testing.assert_array_equal(fast[key], slow[key])
    for row, n, c, i in zip(fast["tokens"], fast["lengths"], comp, index, strict=True):
        d = i + (7 if c == 1 else 0)  # the subset's first document
        assert row[:n].tolist() == (c * 1000 + d * 10 + np.arange(n) % 10).tolist()
    # one document, as Documents[i] gives it; read() is for windows, and says so
    for p in (0, 17, -1):
        c, i = (int(a[0]) for a in blend.locate([p % 300]))
        np.testing.assert_array_equal(blend[p], views[c][i])
    with pytest.raises(TypeError, match=r"read\(\) reads a blend of windows; a blend of "
                       r"documents is read with blend\[i\] or read_batch"):  # fmt: skip
        blend.read([0])


def test_extents_many_refuses_what_is_not_a_document(tmp_path: Path) -> None:
    with Writer(tmp_path / "d", np.uint16) as w:
        for length in (3, 5, 2):
            w.write(np.zeros(length, dtype=np.uint16))
    idx = Documents(tmp_path / "d").source.docs
    assert isinstance(idx, ExtentIndex)
    s, n = extents_many((idx, idx), [0, 1], [1, 0, 1], [0, 2, 1])
    assert s.tolist() == [3, 8, 8] and n.tolist() == [5, 2, 2]  # documents 1, 2, 2
    with pytest.raises(IndexError, match=r"document 2 of component 1 is out of range \[0, 2\)"):
        extents_many((idx, idx), [0, 1], [1], [2])
    with pytest.raises(IndexError, match=r"document -1 of component 0"):
        extents_many((idx,), [0], [0], [-1])
    with pytest.raises(ValueError, match=r"component 2 is not in \[0, 2\)"):
        extents_many((idx, idx), [0, 0], [2], [0])
    with pytest.raises(ValueError, match=r"2 components, 1 indices, 1 offsets of 1 indexes"):
        extents_many((idx,), [0], [0, 0], [0])
    with pytest.raises(TypeError):
        extents_many((object(),), [0], [0], [0])  # type: ignore[arg-type]


def test_a_subset_never_answers_from_its_parents_last_locate(views: list[TokenStream]) -> None:
    """A subset shares its parent's per-thread answer of ``locate``; keyed by the start
    alone, a position past the subset's end was answered with the parent's sample
    instead of refused (review44)."""
    mix = Blend([(views[0], 1), (views[1], 1)], length=1000, block_size=100)
    head = mix.subset(0, 100)
    mix.locate([500])
    for call in (head.locate, head.read, head.origin):
        with pytest.raises(IndexError, match="observation 500 is out of range for a view of 100"):
            call([500])
