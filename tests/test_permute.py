"""The permutation: known answers, the reference library, bijection, bulk paths, errors."""

from __future__ import annotations

import json
import math
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokload import Permutation, epoch_seed
from tokload._permute import (
    TABLES_KEPT,
    _round_function,
    _speck64_128,
    epoch_seeds,
    take_many,
)

DATA = Path(__file__).parent / "data"
U64 = 2**64


# ---- Speck64/128 and the round function (docs/permutation.md sections 2-3) ----------------


def test_speck64_128_official_vector() -> None:
    key = 0x1B1A1918_13121110_0B0A0908_03020100
    assert _speck64_128(key, 0x3B726574_7475432D) == 0x8C6FA548_454E028B


@pytest.mark.parametrize(
    ("seed", "j", "value", "expected"),
    [
        (0, 1, 0, 0x680448D5272F692C),
        (0, 1, 1, 0x21DB61DBF7C4795B),
        (0, 1, U64 - 1, 0x0933367859ECAF93),
        (1234, 1, 0, 0xFF099BB0BC3EC8B9),
        (1234, 1, 1, 0x61005947F9216F68),
        (1234, 1, 42, 0x3B3634310401AB8B),
        (1234, 1, 2**32, 0x495A31037EFE2E05),
        # The official vector seen as a round function: key = i * 2**64 + seed.
        (0x0B0A090803020100, 0x1B1A191813121110 + 1, 0x3B7265747475432D, 0x8C6FA548454E028B),
    ],
)
def test_round_function_known_values(seed: int, j: int, value: int, expected: int) -> None:
    assert _round_function(seed, j - 1, value) == expected


# ---- known permutation values (docs/permutation.md sections 5 and 10) -----------------------


@pytest.mark.parametrize(
    ("n", "rounds", "seed", "prefix"),
    [
        (10, 6, 42, [1, 2, 9, 4, 7, 6, 5, 8, 0, 3]),
        (10, 3, 42, [3, 5, 6, 4, 2, 7, 8, 1, 9, 0]),
        (10, 1, 42, [2, 3, 0, 1, 5, 6, 7, 4, 8, 9]),
        (17, 6, 42, [14, 13, 3, 6, 2, 0, 16, 10, 11, 15]),
        (1000, 8, 0, [523, 608, 357, 706, 323, 336, 137, 943, 728, 858]),
        (65536, 4, 1234, [17815, 35642, 55221, 23097, 47625, 33336]),
    ],
)
def test_known_prefixes(n: int, rounds: int, seed: int, prefix: list[int]) -> None:
    p = Permutation(n, seed, rounds)
    assert [p[i] for i in range(len(prefix))] == prefix
    assert p[: len(prefix)].tolist() == prefix
    assert p.take(np.arange(len(prefix))).tolist() == prefix


@pytest.mark.parametrize(
    ("n", "rounds", "seed", "index", "value"),
    [
        (65536, 4, 1234, 42, 49644),  # the trace of docs/permutation.md section 5
        (10**7, 6, 42, 42, 9485181),
        (U64 - 1, 6, 42, 0, 18347484005719705568),
        (U64 - 1, 6, 42, 1, 12626526404692144220),
        (U64 - 1, 6, 42, U64 - 2, 18170853896512440240),
        (2**63 - 25, 8, 2**63 + 5, 0, 3200372679219010940),
        (2**63 - 25, 8, 2**63 + 5, 2**63 - 26, 7395743602268137334),
    ],
)
def test_known_values(n: int, rounds: int, seed: int, index: int, value: int) -> None:
    p = Permutation(n, seed, rounds)
    assert p[index] == value
    assert p.inverse(value) == index


def test_edge_cases_of_the_reference() -> None:
    assert list(Permutation(1, seed=99, rounds=6)) == [0]
    assert list(Permutation(10, seed=5, rounds=0)) == list(range(10))
    # n = 2, rounds 6, seeds 0-9 (docs/permutation.md section 6).
    two = [list(Permutation(2, seed=s, rounds=6)) for s in range(10)]
    assert two == [[0, 1], [1, 0], [1, 0], [0, 1], [1, 0], [0, 1], [0, 1], [0, 1], [0, 1], [1, 0]]


def test_the_claimed_46430_is_not_the_reference_value() -> None:
    # An article claims 46430; gfc 1.1.0 gives 49644 (docs/permutation.md section 10.2).
    assert Permutation(65536, 1234, 4)[42] == 49644


# ---- the reference library itself ---------------------------------------------


def _golden_cases() -> list[dict[str, object]]:
    cases: list[dict[str, object]] = json.loads((DATA / "gfc_golden.json").read_text())["cases"]
    return cases


def test_golden_vectors_from_pygfc() -> None:
    cases = _golden_cases()
    assert len(cases) > 200
    for case in cases:
        n, rounds, seed = case["n"], case["rounds"], case["seed"]
        p = Permutation(n, seed, rounds)  # type: ignore[arg-type]
        indices = case["indices"]
        assert isinstance(indices, list)
        assert [p[i] for i in indices] == case["values"], case
        assert p.take(np.array(indices, dtype=np.uint64)).tolist() == case["values"], case
        assert [p.inverse(v) for v in case["inverse_of"]] == case["inverse"], case  # type: ignore[attr-defined]


def _gfc_grid_is_exact(n: int) -> bool:
    a = math.ceil(math.sqrt(float(n)))
    return a * a >= n


@settings(max_examples=300, deadline=None)
@given(
    n=st.one_of(
        st.integers(1, 5000), st.integers(1, 2**40), st.integers(1, 2**52), st.integers(1, U64 - 1)
    ),
    rounds=st.integers(0, 12),
    seed=st.integers(0, U64 - 1),
    data=st.data(),
)
def test_matches_pygfc_live(n: int, rounds: int, seed: int, data: st.DataObject) -> None:
    pygfc = pytest.importorskip("pygfc")
    if not _gfc_grid_is_exact(n):
        return  # pygfc is not a bijection there; see test_differs_only_where_pygfc_collides
    ref = pygfc.Permutation(n, rounds, seed)
    p = Permutation(n, seed, rounds)
    idx = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=20))
    assert [p[i] for i in idx] == [ref[i] for i in idx]
    assert p.take(np.array(idx, dtype=np.uint64)).tolist() == [ref[i] for i in idx]
    # pygfc's inverse is exact wherever its forward map does not wrap (docs/permutation.md 7.2).
    assert [p.inverse(i) for i in idx] == [ref.inv(i) for i in idx]


@pytest.mark.parametrize(
    ("n", "rounds", "seed", "i", "j", "collides_at"),
    [
        # docs/permutation.md 7.1: a*a < n from the double square root.
        (2**52 + 1, 6, 42, 2**52, 32834122, 2391083209983088),
        (2**52 + 1, 4, 1234, 2**52, 53911948, 2090053040281422),
        ((2**32 - 1) ** 2 + 1, 6, 42, (2**32 - 1) ** 2, 1768393350, 5567727400342288451),
        # docs/permutation.md 7.2: the 64-bit wrap in the round addition.
        (2**63 - 25, 6, 42, 6987691741796505000, 6987691744542557116, 4674993765494921007),
    ],
)
def test_differs_only_where_pygfc_collides(
    n: int, rounds: int, seed: int, i: int, j: int, collides_at: int
) -> None:
    p = Permutation(n, seed, rounds)
    assert p[i] != p[j]
    assert p.inverse(p[i]) == i
    assert p.inverse(p[j]) == j
    pygfc = pytest.importorskip("pygfc")
    ref = pygfc.Permutation(n, rounds, seed)
    assert ref[i] == ref[j] == collides_at  # the reference is broken here ...
    # ... and on the wrap case only the colliding indices differ from it.
    if _gfc_grid_is_exact(n):
        assert p[j] == ref[j] or p[i] == ref[i]


# ---- bijection -------------------------------------------------------------------


def _assert_bijection(p: Permutation) -> None:
    n = p.n
    values = p.range(0, n)
    counts = np.bincount(values.astype(np.int64), minlength=n)
    assert counts.shape == (n,)
    assert (counts == 1).all(), f"not a bijection for n={n}"
    # The inverse undoes it, in bulk.
    assert np.array_equal(p.inverse_take(values), np.arange(n, dtype=np.uint64))


def test_bijection_every_n_up_to_3000() -> None:
    for n in range(1, 3001):
        _assert_bijection(Permutation(n, seed=n * 7919, rounds=6))


@pytest.mark.parametrize("k", range(1, 23))
def test_bijection_around_powers_of_two(k: int) -> None:
    for n in (2**k - 1, 2**k, 2**k + 1):
        _assert_bijection(Permutation(n, seed=k, rounds=6))


@pytest.mark.slow
@pytest.mark.parametrize("k", [24, 25, 26])
def test_bijection_around_large_powers_of_two(k: int) -> None:
    for n in (2**k - 1, 2**k + 1):
        _assert_bijection(Permutation(n, seed=k, rounds=6))


@pytest.mark.parametrize("rounds", [0, 1, 2, 3, 5, 6, 7, 8, 13])
def test_bijection_for_any_rounds(rounds: int) -> None:
    for n in (1, 2, 3, 17, 1000, 4097):
        _assert_bijection(Permutation(n, seed=3, rounds=rounds))


@pytest.mark.parametrize("n", [2**52 + 1, (2**32 - 1) ** 2 + 1, 2**63 - 25, U64 - 1])
def test_inverse_round_trips_on_huge_n(n: int) -> None:
    p = Permutation(n, seed=42, rounds=6)
    idx = np.array([0, 1, n // 3, n // 2, n - 2, n - 1], dtype=np.uint64)
    values = p.take(idx)
    assert (values < np.uint64(n)).all()
    assert np.array_equal(p.inverse_take(values), idx)


# ---- the bulk paths agree with the scalar one ------------------------------------------


@pytest.mark.parametrize("table", [None, True, False])
@pytest.mark.parametrize("n", [1, 2, 37, 4096, 10**6 + 3, 10**12, 2**63 - 25, U64 - 1])
def test_bulk_equals_scalar(n: int, table: bool | None) -> None:
    p = Permutation(n, seed=11, rounds=6, table=table if n < 10**13 else False)
    rng = np.random.default_rng(n % 1000)
    idx = rng.integers(0, n, size=1000, dtype=np.uint64, endpoint=False)
    expected = [p[int(i)] for i in idx]
    assert p.take(idx).tolist() == expected
    start = int(idx[0])
    stop = min(n, start + 600)
    assert p.range(start, stop).tolist() == [p[i] for i in range(start, stop)]
    assert p.inverse_take(np.array(expected, dtype=np.uint64)).tolist() == idx.tolist()


def test_table_and_lanes_give_identical_results() -> None:
    n = 5_000_000
    with_table = Permutation(n, seed=9, table=True)
    without = Permutation(n, seed=9, table=False)
    assert with_table.has_table and not without.has_table
    assert np.array_equal(with_table.range(0, n), without.range(0, n))


def test_auto_table_is_built_when_it_pays() -> None:
    p = Permutation(10**6, seed=1)
    assert not p.has_table
    p[5]  # scalar calls never build it
    assert not p.has_table
    p.range(0, 10)  # not yet worth it (a = 1000)
    assert not p.has_table
    p.range(0, 2000)
    assert p.has_table
    assert p.table_nbytes == 6 * 1000 * 4
    huge = Permutation(10**14, seed=1)  # table of 240 MB: never automatic
    huge.range(0, 1 << 16)
    assert not huge.has_table


def test_slices_and_steps() -> None:
    p = Permutation(1000, seed=5)
    full = [p[i] for i in range(1000)]
    assert p[10:20].tolist() == full[10:20]
    assert p[::7].tolist() == full[::7]
    assert p[900:100:-13].tolist() == full[900:100:-13]
    assert p[-5:].tolist() == full[-5:]
    assert p[5:5].tolist() == []
    assert p[-1] == full[-1]
    assert p[-1000] == full[0]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 40),
    start=st.none() | st.integers(-60, 60),
    stop=st.none() | st.integers(-60, 60),
    step=st.none() | st.integers(-7, 7).filter(bool),
)
def test_every_slice_is_the_list_slice(
    n: int, start: int | None, stop: int | None, step: int | None
) -> None:
    """Any slice, empty ones with a negative step included (p[-100::-1] of 10 raised
    OverflowError), is the slice of the list of values, as uint64."""
    p = Permutation(n, seed=3)
    got = p[start:stop:step]
    assert got.dtype == np.uint64
    assert got.tolist() == [p[i] for i in range(n)][start:stop:step]


def test_out_arrays_and_dtypes() -> None:
    p = Permutation(10_000, seed=2)
    idx = np.arange(10_000, dtype=np.int32).reshape(100, 100)
    ref = p.take(idx.astype(np.uint64))
    assert ref.shape == (100, 100) and ref.dtype == np.uint64
    out = np.empty((100, 100), dtype=np.int64)
    assert p.take(idx, out=out) is out
    assert np.array_equal(out, ref.astype(np.int64))
    inplace = np.arange(10_000, dtype=np.uint64)
    assert p.take(inplace, out=inplace) is inplace
    assert np.array_equal(inplace, ref.reshape(-1))
    assert p.take([]).shape == (0,)
    assert p.take(np.array([3], dtype=np.uint8)).tolist() == [p[3]]


def test_iteration_is_the_whole_permutation() -> None:
    p = Permutation(40_000, seed=8)
    assert list(p) == p.range(0, 40_000).tolist()
    assert len(p) == 40_000
    assert 39_999 in p and 40_000 not in p and "x" not in p


# ---- threads ----------------------------------------------------------------------------


def test_threads_agree_with_one_thread() -> None:
    n = 10**9
    p = Permutation(n, seed=123)
    idx = np.random.default_rng(0).integers(0, n, size=400_000, dtype=np.uint64)
    expected = p.take(idx)
    results: list[np.ndarray] = [np.empty(0)] * 8
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            # Half the threads use a fresh object, so table builds race too.
            q = p if k % 2 else Permutation(n, seed=123)
            results[k] = q.take(idx) if k < 4 else q.range(0, 400_000)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(4):
        assert np.array_equal(results[k], expected)
    for k in range(4, 8):
        assert np.array_equal(results[k], p.range(0, 400_000))


# ---- statistics ---------------------------------------------------------------------------


def _position_chi2(n: int, seeds: int, rounds: int) -> float:
    counts = np.zeros((n, n), dtype=np.int64)
    for s in range(seeds):
        counts[
            np.arange(n), Permutation(n, seed=s * 0x9E3779B97F4A7C15 % U64, rounds=rounds)[:]
        ] += 1
    expected = seeds / n
    return float(((counts - expected) ** 2 / expected).sum())


def test_each_position_is_uniform_over_seeds() -> None:
    n, seeds = 12, 3000
    dof = (n - 1) ** 2
    chi2 = _position_chi2(n, seeds, rounds=6)
    assert chi2 < dof + 6 * math.sqrt(2 * dof), chi2
    # The statistic has power: one Feistel round (a rotation of blocks) fails it.
    assert _position_chi2(n, seeds, rounds=1) > dof + 20 * math.sqrt(2 * dof)


def _gap_chi2(p: Permutation, bins: int) -> float:
    v = p.range(0, p.n).astype(np.int64)
    gaps = (v[1:] - v[:-1]) % p.n
    hist = np.bincount(gaps * bins // p.n, minlength=bins)
    expected = len(gaps) / bins
    return float(((hist - expected) ** 2 / expected).sum())


def test_consecutive_differences_show_no_structure() -> None:
    bins = 100
    bound = (bins - 1) + 6 * math.sqrt(2 * (bins - 1))
    for seed in range(5):
        p = Permutation(1_000_003, seed=seed)
        assert _gap_chi2(p, bins) < bound
        v = p.range(0, p.n).astype(np.float64)
        assert abs(np.corrcoef(np.arange(p.n), v)[0, 1]) < 0.01
    assert _gap_chi2(Permutation(1_000_003, seed=0, rounds=2), bins) > 10 * bound


# ---- epochs ------------------------------------------------------------------------------------


def test_epoch_seeds_are_distinct_and_pinned() -> None:
    seeds = {epoch_seed(7, e) for e in range(10_000)}
    # The derivation as documented: Speck64/128 of the epoch under ("tokl", "epoc", seed).
    tag = (0x746F6B6C << 96) | (0x65706F63 << 64)
    assert epoch_seed(2**64 - 3, 12) == _speck64_128(tag | (2**64 - 3), 12)
    assert len(seeds) == 10_000
    # Pinned: changing the derivation would silently change every resumed run.
    assert epoch_seed(0, 0) == 0xCAD3A241E368B515
    assert epoch_seed(7, 3) == 0xE5903FC79F793B93
    assert epoch_seed(7, 3) != epoch_seed(8, 3)
    p = Permutation.for_epoch(1000, seed=7, epoch=3)
    assert p == Permutation(1000, seed=epoch_seed(7, 3))
    assert p != Permutation.for_epoch(1000, seed=7, epoch=4)


# ---- protocol ----------------------------------------------------------------------------------


def test_pickle_repr_eq_hash() -> None:
    p = Permutation(12345, seed=2**64 - 1, rounds=8, table=False)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and hash(q) == hash(p)
    assert q.range(0, 100).tolist() == p.range(0, 100).tolist()
    assert repr(p) == f"Permutation(n=12345, seed={2**64 - 1}, rounds=8)"
    assert (p.n, p.seed, p.rounds, p.grid_side) == (12345, 2**64 - 1, 8, 112)
    assert p != Permutation(12345, seed=0, rounds=8)
    assert p.__eq__(object()) is NotImplemented


def test_huge_n_len_raises_but_n_works() -> None:
    p = Permutation(2**63, seed=1)
    with pytest.raises(OverflowError, match=r"use \.n"):
        len(p)
    assert p.n == 2**63
    assert len(Permutation(2**63 - 1)) == 2**63 - 1


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((0,), {}, ValueError, r"n must be in \[1, 2\*\*64 - 1\], got 0"),
        ((-1,), {}, ValueError, r"n must be in \[1, 2\*\*64 - 1\], got -1"),
        ((2**64,), {}, ValueError, r"n must be in \[1, 2\*\*64 - 1\], got 18446744073709551616"),
        ((1.5,), {}, TypeError, r"n must be an integer, got float"),
        ((10, -3), {}, ValueError, r"seed must be in \[0, 2\*\*64 - 1\], got -3"),
        ((10, "a"), {}, TypeError, r"seed must be an integer, got str"),
        ((10, 0, 2**16 + 1), {}, ValueError, r"rounds must be in \[0, 65536\], got 65537"),
        ((10, 0, -1), {}, ValueError, r"rounds must be in \[0, 65536\], got -1"),  # (review68)
        ((True,), {}, TypeError, r"n must be an integer, got bool"),  # (was n=1)
        ((10, True), {}, TypeError, r"seed must be an integer, got bool"),
        ((10, 0, np.bool_(True)), {}, TypeError, r"rounds must be an integer, got bool"),
        ((10,), {"table": "yes"}, TypeError, r"table must be True, False or None, got 'yes'"),
    ],
)
def test_bad_constructor_arguments(
    args: tuple[object, ...], kwargs: dict[str, object], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        Permutation(*args, **kwargs)  # type: ignore[arg-type]


def test_bad_indices() -> None:
    p = Permutation(100, seed=1)
    with pytest.raises(
        IndexError, match=r"index 100 is out of range .* n=100 \(valid: -100 <= i < 100\)"
    ):
        p[100]
    with pytest.raises(IndexError, match=r"index -101 is out of range"):
        p[-101]
    with pytest.raises(TypeError, match=r"indices must be integers or slices, not float"):
        p[1.0]  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"indices must be integers or slices, not bool"):
        p[True]  # (review68: was p[1])
    with pytest.raises(TypeError, match=r"epoch must be an integer, got bool"):
        epoch_seed(3, True)
    with pytest.raises(
        IndexError, match=r"value 100 is out of range .* \(valid: 0 <= value < 100\)"
    ):
        p.inverse(100)
    with pytest.raises(IndexError, match=r"value -1 is out of range"):
        p.inverse(-1)
    with pytest.raises(TypeError, match=r"value must be an integer, got str"):
        p.inverse("3")  # type: ignore[arg-type]


def test_bad_bulk_arguments() -> None:
    p = Permutation(100, seed=1)
    big = np.arange(5000, dtype=np.int64) % 100
    big[4321] = 250
    with pytest.raises(IndexError, match=r"index 250 at position 4321 is out of range .* n=100"):
        p.take(big)
    with pytest.raises(IndexError, match=r"index -7 at position 1 is out of range"):
        p.take(np.array([1, -7, 3]))
    with pytest.raises(IndexError, match=r"value 100 at position 0 is out of range"):
        p.inverse_take([100])
    with pytest.raises(TypeError, match=r"index arrays must have an integer dtype, got float64"):
        p.take(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"must have an integer dtype, got bool"):
        p.take(np.array([True]))
    with pytest.raises(TypeError, match=r"out must have dtype uint64 or int64, got int32"):
        p.take([1, 2], out=np.empty(2, dtype=np.int32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"out has shape \(3,\), expected \(2,\)"):
        p.take([1, 2], out=np.empty(3, dtype=np.uint64))
    with pytest.raises(ValueError, match=r"writeable C-contiguous"):
        p.take([1, 2], out=np.empty(4, dtype=np.uint64)[::2])
    with pytest.raises(TypeError, match=r"out must be a numpy array, got list"):
        p.take([1, 2], out=[0, 0])  # type: ignore[arg-type]
    with pytest.raises(IndexError, match=r"range \[50, 101\) is not within \[0, 100\]"):
        p.range(50, 101)
    with pytest.raises(IndexError, match=r"range \[60, 50\)"):
        p.range(60, 50)
    with pytest.raises(TypeError, match=r"out must be uint64 when n > 2\*\*63"):
        Permutation(2**63 + 1).range(0, 2, out=np.empty(2, dtype=np.int64))


@settings(max_examples=100, deadline=None)
@given(
    runs=st.lists(
        st.tuples(
            st.sampled_from([1, 2, 3, 17, 2000, 10**6, 2**40, 2**63, 2**64 - 1]),
            st.integers(0, 2**64 - 1),
            st.integers(1, 200),
        ),
        min_size=1,
        max_size=5,
    ),
    rounds=st.sampled_from([0, 1, 6, 9]),
    data=st.data(),
)
def test_take_many_equals_one_permutation_per_element(
    runs: list[tuple[int, int, int]], rounds: int, data: Any
) -> None:
    """``take_many`` (each element its own ``(n, seed)``, runs sharing round keys
    and, when long, a table) is bit for bit ``Permutation(n, seed, rounds)[i]``."""
    ns, seeds, xs = [], [], []
    for n, seed, count in runs:
        ns += [n] * count
        seeds += [seed] * count
        xs += data.draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count))
    got = take_many(
        np.array(ns, dtype=np.uint64),
        np.array(seeds, dtype=np.uint64),
        np.array(xs, dtype=np.uint64),
        rounds,
    )
    perms = {(n, s): Permutation(n, seed=s, rounds=rounds) for n, s, _ in runs}
    want = [perms[n, s][x] for n, s, x in zip(ns, seeds, xs, strict=True)]
    assert got.tolist() == want
    # with tables kept between calls: the first call fills them, the second uses
    # them, and calls on one element each (too short to look) do not
    tables: dict[Any, Any] = {}
    n_, s_, x_ = (np.array(v, dtype=np.uint64) for v in (ns, seeds, xs))
    assert take_many(n_, s_, x_, rounds, tables).tolist() == want
    assert take_many(n_, s_, x_, rounds, tables).tolist() == want
    for k in range(0, len(xs), max(1, len(xs) // 7)):
        one = slice(k, k + 1)
        assert take_many(n_[one], s_[one], x_[one], rounds, tables).tolist() == [want[k]]
    assert all(not t.flags.writeable and t.dtype == np.uint32 for t in tables.values())
    assert all(key[2] == rounds for key in tables)


def test_take_many_keeps_a_bounded_number_of_tables() -> None:
    """A run long enough to repay its table keeps it in ``tables`` under ``(n, seed,
    rounds)``; at most ``TABLES_KEPT`` tables stay (the oldest go first), none larger
    than 16 KiB, and a kept table serves a later run too short to fill one."""
    tables: dict[Any, Any] = {}
    n, count = 2000, 64  # a = 45: a table of 6 * 45 values repays 64 elements
    for seed in range(TABLES_KEPT + 10):
        got = take_many(np.full(count, n), np.full(count, seed), np.arange(count), 6, tables)
        assert got.tolist() == Permutation(n, seed=seed).take(np.arange(count)).tolist()
    assert len(tables) == TABLES_KEPT
    assert (n, 0, 6) not in tables and (n, TABLES_KEPT + 9, 6) in tables
    assert tables[n, 20, 6].shape == (6 * 45,)
    # a kept table serves a run of 8 (which alone would not fill one: 270 > 4 * 6 * 8)
    tables[n, 20, 6] = np.zeros(6 * 45, dtype=np.uint32)  # a wrong table shows it is used
    right = Permutation(n, seed=20).take(np.arange(8)).tolist()
    assert take_many(np.full(8, n), np.full(8, 20), np.arange(8), 6, tables).tolist() != right
    # runs shorter than 8 do not look (a long blend's positions, an epoch each)
    assert take_many(np.full(7, n), np.full(7, 20), np.arange(7), 6, tables).tolist() == right[:7]
    # a table larger than 16 KiB is not kept: a = 2**12 needs 6 * 4096 values
    take_many(np.full(30_000, 2**24), np.zeros(30_000), np.arange(30_000), 6, tables)
    assert (2**24, 0, 6) not in tables
    tables[n, 21, 6] = np.zeros(5, dtype=np.uint32)  # never read past its end
    with pytest.raises(ValueError, match=r"tables\[\(2000, 21, 6\)\] holds 5 values, expected 270"):
        take_many(np.full(8, n), np.full(8, 21), np.arange(8), 6, tables)
    with pytest.raises(TypeError, match=r"tables must be a dict or None, got list"):
        take_many(np.ones(1), np.ones(1), np.zeros(1), 6, [])  # type: ignore[arg-type]


def test_take_many_and_epoch_seeds_refuse_bad_input() -> None:
    one = np.ones(1, dtype=np.uint64)
    with pytest.raises(IndexError, match=r"index 5 is out of range for a permutation of 5"):
        take_many(np.array([5], dtype=np.uint64), one, np.array([5], dtype=np.uint64))
    with pytest.raises(IndexError, match=r"out of range for a permutation of 0"):
        take_many(np.zeros(1, dtype=np.uint64), one, np.zeros(1, dtype=np.uint64))
    with pytest.raises(ValueError, match=r"1-D of one length"):
        take_many(one, np.ones(2, dtype=np.uint64), one)
    with pytest.raises(ValueError, match=r"rounds must be in \[0, 65536\]"):
        take_many(one, one, np.zeros(1, dtype=np.uint64), rounds=1 << 17)
    assert take_many(one[:0], one[:0], one[:0]).tolist() == []
    seeds = np.array([0, 1, 2**64 - 1], dtype=np.uint64)
    epochs = np.array([0, 2**64 - 1, 7], dtype=np.uint64)
    assert epoch_seeds(seeds, epochs).tolist() == [
        epoch_seed(int(s), int(e)) for s, e in zip(seeds, epochs, strict=True)
    ]
    assert epoch_seeds(5, np.arange(3)).tolist() == [epoch_seed(5, e) for e in range(3)]


@settings(max_examples=40, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=90),
    epochs=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=90),
    data=st.data(),
)
def test_epoch_seeds_of_repeated_pairs(seeds: list[int], epochs: list[int], data: Any) -> None:
    """``epoch_seeds`` remembers pairs it has seen (a table of 64): pairs drawn
    again and again from up to 8,100 (most slots taken by several), in any
    order, and more than 4,096 of them (computed without the GIL), are each
    ``epoch_seed``."""
    count = data.draw(st.sampled_from([1, 50, 500, 5000]))
    s = data.draw(st.lists(st.sampled_from(seeds), min_size=count, max_size=count))
    e = data.draw(st.lists(st.sampled_from(epochs), min_size=count, max_size=count))
    pairs = list(zip(s, e, strict=True))
    want = {pair: epoch_seed(*pair) for pair in set(pairs)}
    got = epoch_seeds(np.array(s, dtype=np.uint64), np.array(e, dtype=np.uint64))
    assert got.tolist() == [want[pair] for pair in pairs]
