"""Views pickle as the call that opened them, for trainers that send them to other processes.

``spawn``-started workers, Ray and ``copy.deepcopy`` pickle what they are given. A
view (and a ``Source``) pickles as the call that made it and its range, never its
open files: unpickled, it opens its data again and reads exactly what the
original reads, or refuses (``StateError``) when the data changed in between.
A ``Source`` built by hand and a ``DataLoader`` (its reader threads) refuse to
be pickled, saying what to pickle instead.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_mixtures import doc_tokens, write_megatron

import tokload
from tokload.remote.urls import absolute_local
from tokload.source import Source


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokload build (with metadata spans), a Megatron prefix, a flat ``.npy`` with
    end-of-document tokens and a headerless ``.bin``."""
    root = tmp_path_factory.mktemp("pickle")
    rng = np.random.default_rng(5)
    lengths = [rng.integers(1, 30, n).tolist() for n in (21, 13, 17)]
    with tokload.Writer(root / "build", np.uint16, metadata=True) as w:
        for d, n in enumerate(lengths[0]):
            w.write(doc_tokens(0, d, n), spans=[(0, n, b"doc%d" % d)])
    write_megatron(root / "mega", [doc_tokens(1, d, n) for d, n in enumerate(lengths[1])])
    flat = [np.append(doc_tokens(2, d, n - 1), 0) for d, n in enumerate(lengths[2])]
    np.save(root / "flat.npy", np.concatenate(flat).astype(np.uint16))
    np.arange(3000, dtype=np.uint32).tofile(root / "flat.bin")
    return root


VIEWS: dict[str, Any] = {
    "token stream": lambda r: tokload.TokenStream(r / "build", window=7),
    "token stream, boundaries": lambda r: tokload.TokenStream(
        r / "build", window=9, stride=4, boundaries=True
    ),
    "stream with metadata": lambda r: tokload.StreamWithMetadata(r / "build", window=6),
    "documents": lambda r: tokload.Documents(r / "build"),
    "Megatron prefix": lambda r: tokload.Documents(str(r / "mega")),
    "flat .npy with eos": lambda r: tokload.Documents(tokload.open_flat(r / "flat.npy", eos=0)),
    "headerless .bin": lambda r: tokload.TokenStream(
        tokload.open_flat([r / "flat.bin", r / "flat.bin"], np.uint32), window=50
    ),
    "a split's part": lambda r: tokload.split(tokload.Documents(r / "build"), "3,2")[1],
    "blend of three formats": lambda r: tokload.Blend(
        [
            (tokload.Documents(r / "build"), 2.0),
            (tokload.Documents(str(r / "mega")), 1.0),
            (tokload.Documents(tokload.open_flat(r / "flat.npy", eos=0)), 1.0),
        ],
        seed=3,
        length=90,
        block_size=8,
        schedule=[(40, [1.0, 1.0, 2.0])],
    ),
}


def _same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    elif hasattr(a, "__dataclass_fields__"):
        _same(vars(a), vars(b))
    else:
        assert a == b


@pytest.mark.parametrize("kind", list(VIEWS))
def test_a_pickled_view_reads_what_the_original_reads(root: Path, kind: str) -> None:
    view = VIEWS[kind](root)
    for copied in (pickle.loads(pickle.dumps(view)), copy.deepcopy(view)):
        assert type(copied) is type(view)
        assert len(copied) == len(view) and copied.fingerprint == view.fingerprint
        assert repr(copied) == repr(view)
        # every sample (every document packed in one batch), then best-fit rows
        docs = hasattr(view, "extents")
        policies: list[Any] = [tokload.Pack(), tokload.Fill(64, lookahead=8)] if docs else [None]
        for how in policies:
            size = len(view) if isinstance(how, tokload.Pack) or how is None else 4
            got = [
                next(iter(tokload.DataLoader(v, size, batching=how, seed=2, num_threads=0)))
                for v in (view, copied)
            ]
            assert got[0].keys() == got[1].keys()
            for key in got[0]:
                _same(np.asarray(got[0][key]), np.asarray(got[1][key]))


@pytest.mark.parametrize("kind", list(VIEWS))
def test_a_view_opened_by_a_relative_path_unpickles_in_another_directory(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A view (or source) opened from paths relative to the working directory
    holds and records them made absolute: after a ``chdir`` it still reads its
    files, and unpickled where the working directory is another (a Ray
    worker's) it reads the same data, not what those names mean there."""
    monkeypatch.chdir(root)
    view = VIEWS[kind](Path())  # every path relative: "build", "mega", "flat.npy", ...
    blob = pickle.dumps(view)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "build").mkdir(parents=True)  # a name there that means nothing
    monkeypatch.chdir(elsewhere)
    copied = pickle.loads(blob)
    assert copied.fingerprint == view.fingerprint
    ix = np.arange(min(len(view), 4))
    want, got = (v.read_batch(ix, np.empty) for v in (view, copied))
    assert want.keys() == got.keys()
    for key in want:
        _same(np.asarray(want[key]), np.asarray(got[key]))


def test_a_relative_doc_index_unpickles_in_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``open_flat(..., doc_index=<relative>)``: only the token file's path was recorded
    made absolute, and a worker in another directory failed to find the index."""
    monkeypatch.chdir(tmp_path)
    np.arange(12, dtype=np.uint16).tofile("tokens.bin")
    np.array([0, 4, 12], dtype="<u8").tofile("tokens.idx")
    view = tokload.Documents(tokload.open_flat("tokens.bin", np.uint16, doc_index="tokens.idx"))
    blob = pickle.dumps(view)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    copied = pickle.loads(blob)
    assert [np.asarray(copied[i]).tolist() for i in range(2)] == [[0, 1, 2, 3], list(range(4, 12))]


def test_absolute_local_makes_local_paths_absolute_and_leaves_urls() -> None:
    here = os.getcwd()
    assert absolute_local("build") == os.path.join(here, "build")
    assert absolute_local(Path("a/../b")) == os.path.join(here, "b")
    assert absolute_local("file:///data/x") == "/data/x"
    assert absolute_local(["a", "/b"]) == [os.path.join(here, "a"), "/b"]
    assert absolute_local(("a",)) == (os.path.join(here, "a"),)
    p = Path("/abs/path")
    assert absolute_local(p) is p  # already absolute: as given
    for kept in ("s3://bucket/prefix", "gs://b/k", "http://host/x", 3, None):
        assert absolute_local(kept) == kept


def test_a_view_pickled_before_its_data_changed_refuses(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(100, dtype=np.uint16))
    blob = pickle.dumps(tokload.TokenStream(tokload.open_flat(path), window=10))
    np.save(path, np.arange(100, dtype=np.uint16)[::-1].copy())  # same size, other tokens
    with pytest.raises(tokload.StateError, match=r"tokens\.npy.*changed since this source was"):
        pickle.loads(blob)


def test_a_view_pickled_before_its_build_was_replaced_refuses(tmp_path: Path) -> None:
    def build(tokens: list[int]) -> None:
        shutil.rmtree(tmp_path / "ds", ignore_errors=True)
        with tokload.Writer(tmp_path / "ds", np.uint16) as w:
            w.write(np.array(tokens, dtype=np.uint16))

    build([1, 2, 3, 4, 5, 6])
    blob = pickle.dumps(tokload.Documents(tmp_path / "ds"))
    build([6, 5, 4, 3, 2, 1])
    with pytest.raises(tokload.StateError, match=r"changed since this (view|source) was pickled"):
        pickle.loads(blob)


def test_a_source_built_by_hand_and_a_loader_say_what_to_pickle(root: Path) -> None:
    opened = tokload.open_dataset(root / "build")
    by_hand = Source(opened.rows, opened.dtype, opened.docs, None, "fp", "my rows")
    with pytest.raises(TypeError, match="my rows: this Source was not made by tokload's open"):
        pickle.dumps(tokload.TokenStream(by_hand, window=4))
    loader = tokload.DataLoader(tokload.TokenStream(root / "build", window=4), 2)
    with pytest.raises(TypeError, match=r"a DataLoader holds reader threads.*pickle its view"):
        pickle.dumps(loader)
    loader.close()


def _all_packed(view: Any) -> dict[str, np.ndarray]:
    """Every document of ``view``, packed in one batch."""
    loader = tokload.DataLoader(view, len(view), batching=tokload.Pack(), seed=2, num_threads=0)
    return {k: np.asarray(v) for k, v in next(iter(loader)).items()}


def test_a_view_reopens_in_a_spawned_process(root: Path) -> None:
    view = VIEWS["blend of three formats"](root)
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_all_packed, (view,))
    _same(got, _all_packed(view))
