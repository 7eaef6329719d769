"""The public view protocol: user-written views through the whole loader.

The guide's own example view (``Pairs``, in ``docs/guide/custom-views.md``) and a
non-rowwise one (a filtered, remapped view of documents) run through the shared
resume harness: rank split, exactly-once across resumes and rescales, threads, and
the fake device.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fake_device import FakeDevice
from harness import Segment, assert_exactly_once, run_segments

import tokload
from tokload import DataLoader, Documents, TokenStream, Writer
from tokload.views.contract import Alloc, BatchView, check_view

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide" / "custom-views.md"


def guide_pairs() -> type:
    """The ``Pairs`` class exactly as the guide's page on views of one's own defines it
    (its block up to the line ``pairs = ...`` that uses it)."""
    text = GUIDE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    block = next(b for b in blocks if "\nclass Pairs:" in b)
    code = block.split("\npairs = ")[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, str(GUIDE.relative_to(GUIDE.parents[2])), "exec"), namespace)
    cls: type = namespace["Pairs"]
    return cls


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("protocol")
    paths = []
    for name, base in (("en", 0), ("de", 10**6)):
        with Writer(root / name, "<u4", shard_bytes=2000) as w:
            for k in range(90):
                w.write(np.arange(base + k * 1000, base + k * 1000 + 6 + k % 13, dtype=np.uint32))
        paths.append(root / name)
    return paths[0], paths[1]


class Filtered:
    """Documents whose index is in ``keep``, padded per batch (not rowwise)."""

    def __init__(self, docs: Documents, keep: np.ndarray) -> None:
        self.docs, self.keep = docs, keep.astype(np.int64)

    def __len__(self) -> int:
        return len(self.keep)

    @property
    def fingerprint(self) -> str:
        return f"Filtered({self.docs.fingerprint}, {hash(self.keep.tobytes())})"

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        raw = self.docs.read_batch(self.keep[indices], alloc)
        raw["kept"] = self.keep[indices]  # made with NumPy, not alloc: the loader copies it
        return raw


def test_the_guide_view_satisfies_the_protocol(two: tuple[Path, Path]) -> None:
    pairs_cls = guide_pairs()
    pairs = pairs_cls(TokenStream(two[0], window=7), TokenStream(two[1], window=7))
    check_view(pairs)
    assert isinstance(pairs, BatchView)
    with pytest.raises(TypeError, match="int is not a view: it lacks __len__, fingerprint"):
        check_view(3)


@pytest.mark.parametrize("threads", [0, 2])
def test_guide_pairs_through_resumes_and_rescales(threads: int, two: tuple[Path, Path]) -> None:
    pairs_cls = guide_pairs()
    a, b = TokenStream(two[0], window=7), TokenStream(two[1], window=7)
    pairs = pairs_cls(a, b)
    n = len(pairs)

    def make(**kw: Any) -> DataLoader:
        return DataLoader(
            pairs, seed=9, epochs=2, **kw, read=tokload.ReadOptions(prefetch=6, steps_per_task=4)
        )

    got = run_segments(
        make,
        [
            Segment(2, 5, 7, threads),
            Segment(3, 2, 9, threads),
            Segment(1, 11, None, threads),
        ],
    )
    assert_exactly_once(got, n, 2 * n)
    for batch in got.batches.values():
        idx = batch["index"].numpy()
        np.testing.assert_array_equal(batch["source"].numpy(), a.read(idx))
        np.testing.assert_array_equal(batch["target"].numpy(), b.read(idx))
        assert set(batch) == {"source", "target", "index", "position"}


def test_a_filtered_view_through_resumes_rescales_and_a_fake_device(
    two: tuple[Path, Path],
) -> None:
    docs = Documents(two[0])
    keep = np.flatnonzero(np.arange(len(docs)) % 3 != 1)
    view = Filtered(docs, keep)
    n = len(view)
    fd = FakeDevice(seed=2)

    def make(**kw: Any) -> DataLoader:
        return DataLoader(view, seed=4, epochs=3, device=fd, **kw)

    got = run_segments(make, [Segment(1, 4, 10, 2), Segment(4, 3, 6, 1), Segment(2, 6, None, 0)])
    assert_exactly_once(got, n, 3 * n)
    for batch in got.batches.values():
        np.testing.assert_array_equal(batch["kept"].numpy(), keep[batch["index"].numpy()])
        for k, d in enumerate(batch["kept"].tolist()):
            length = int(batch["lengths"][k])
            np.testing.assert_array_equal(batch["tokens"][k, :length].numpy(), docs[d])
    fd.close()
    assert fd.violations == []


class BadRows:
    rowwise = True

    def __len__(self) -> int:
        return 100

    fingerprint = "bad"

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        return {"x": np.zeros(3)}


class Reserved(BadRows):
    rowwise = False

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        return {"index": np.zeros(len(indices))}


def test_a_view_breaking_the_protocol_is_named() -> None:
    with pytest.raises(ValueError, match="BadRows is rowwise, but read_batch gave 'x' as"):
        next(
            iter(
                DataLoader(
                    BadRows(),
                    4,
                    num_threads=0,
                    read=tokload.ReadOptions(steps_per_task=2, prefetch=2),
                )
            )
        )
    it = iter(
        DataLoader(
            BadRows(), 4, num_threads=1, read=tokload.ReadOptions(steps_per_task=2, prefetch=2)
        )
    )
    with pytest.raises(ValueError, match="BadRows is rowwise"):
        next(it)
    with pytest.raises(ValueError, match="returned the key 'index', which the loader sets"):
        next(iter(DataLoader(Reserved(), 4, num_threads=0)))


def test_tokload_views_implement_the_protocol(two: tuple[Path, Path]) -> None:
    stream = TokenStream(two[0], window=5)
    docs = Documents(two[0])
    blend = tokload.Blend([(stream, 1.0), (TokenStream(two[1], window=5), 1.0)], length=50)
    for view in (stream, docs, blend, stream.subset(3, 20)):
        assert isinstance(view, BatchView)
    assert stream.rowwise and blend.rowwise and not docs.rowwise
    # a blend of documents is a view of documents, with provenance
    docs_blend = tokload.Blend([(docs, 1.0), (Documents(two[1]), 1.0)], length=50)
    assert isinstance(docs_blend, BatchView) and not docs_blend.rowwise
    assert docs_blend.fields == docs.fields == {"tokens": docs.source.dtype}
    assert isinstance(docs_blend.batching, tokload.Pad) and blend.batching is None
    origin = docs_blend.origin(np.arange(6))
    comp, index = docs_blend.locate(np.arange(6))
    np.testing.assert_array_equal(origin["component"], comp)
    np.testing.assert_array_equal(origin["component_index"], index)
    raw = blend.read_batch(np.arange(6), np.empty)
    np.testing.assert_array_equal(raw["tokens"], blend.read(np.arange(6)))
    t = torch.from_numpy(raw["tokens"])
    assert t.shape == (6, 5)


class Reinterpreted(BadRows):
    """Fields made by reinterpreting an alloc buffer's dtype (a mask, a float)."""

    rowwise = False

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        n = len(indices)
        score = alloc((n,), np.int32).view(np.float32)
        score[...] = indices + 0.5
        mask = alloc((n, 3), np.uint8).view(bool)
        mask[...] = True
        return {"score": score, "mask": mask}


def test_an_array_keeps_its_dtype_when_it_reinterprets_an_allocation() -> None:
    """The tensor was its allocation's: 0.5 came as the int32 1056964608, a bool
    mask as uint8."""
    ld = DataLoader(Reinterpreted(), 4, shuffle=False, num_threads=0, device="cpu")
    batch = next(iter(ld))
    assert batch["score"].dtype == torch.float32 and batch["mask"].dtype == torch.bool
    np.testing.assert_array_equal(batch["score"].numpy(), batch["index"].numpy() + 0.5)
    assert batch["mask"].all()


class TorchHeld(BadRows):
    """A view whose data lives in a torch tensor: rows are slices of its ``.numpy()``."""

    def __init__(self) -> None:
        self.corpus = torch.arange(100 * 3, dtype=torch.int64).reshape(100, 3)

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        a = int(indices[0])
        return {"x": self.corpus.numpy()[a : a + len(indices)]}


@pytest.mark.parametrize("threads", [0, 1])
def test_a_trainers_edit_of_a_batch_never_reaches_a_views_torch_data(threads: int) -> None:
    """The batch was the view's own memory: masking labels in place changed the corpus
    for every later epoch (review41)."""
    view = TorchHeld()
    ld = DataLoader(view, 4, shuffle=False, num_threads=threads, device="cpu")
    for n, batch in enumerate(ld):
        np.testing.assert_array_equal(batch["x"].numpy(), view.corpus.numpy()[batch["index"]])
        batch["x"].fill_(-100)
        if n == 5:
            break
    assert view.corpus.flatten().tolist() == list(range(300))


class OwnDocuments:
    """Documents of one's own (the document contract), with a hook on ``extents``."""

    def __init__(self, n: int = 30, extents: Any = None, fields: Any = None) -> None:
        self.docs = [np.arange(1, 2 + (i * 7) % 30, dtype=np.uint32) for i in range(n)]
        self.offsets = np.concatenate(([0], np.cumsum([len(d) for d in self.docs])))
        self.flat = np.concatenate(self.docs)
        self.hook = extents
        self.fields = fields or {"tokens": np.dtype(np.uint32)}
        self.fingerprint = f"own:{n}"

    def __len__(self) -> int:
        return len(self.docs)

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        raise NotImplementedError  # batched by a policy of documents only

    def extents(self, indices: np.ndarray) -> tuple[Any, Any]:
        i = np.asarray(indices)
        starts, lengths = self.offsets[i], self.offsets[i + 1] - self.offsets[i]
        return (starts, lengths) if self.hook is None else self.hook(starts, lengths)

    def read_extents(
        self, indices: Any, starts: Any, lengths: Any, dst: Any, out: dict[str, Any]
    ) -> None:
        for name in self.fields:
            for s, n, d in zip(starts.tolist(), lengths.tolist(), dst.tolist(), strict=True):
                out[name][d : d + n] = self.flat[s : s + n]


POLICIES = [tokload.Pad(), tokload.Pad(to=8), tokload.Pack(), tokload.Fill(64, lookahead=16)]


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
@pytest.mark.parametrize(
    ("hook", "error", "message"),
    [
        (lambda s, n: (s[:-1], n[:-1]), ValueError, r"shape \((\d+),\) for (?!\1 )\d+ documents"),
        (lambda s, n: (s, n.astype(np.int64) - 20), ValueError, r"a length of -\d+: lengths must"),
        (lambda s, n: (s, n.astype(np.float64)), TypeError, "lengths of dtype float64, not integ"),
        (
            lambda s, n: (s, n.astype(np.uint64) | np.uint64(1 << 63)),
            ValueError,
            r"a length of \d{19}: lengths must be >= 0 and below 2\*\*63",
        ),
    ],
    ids=["one short", "negative", "float", "past int64"],
)
def test_extents_that_break_the_contract_are_refused_by_every_policy(
    policy: Any, hook: Any, error: type[Exception], message: str, two: tuple[Path, Path]
) -> None:
    """Fill packed what it was given (a list one entry short lost 2 of 30 documents);
    a negative length read 2**64 - 3 rows, or 64 through a Blend; a uint64 length
    past 2**63 failed inside Pad and Pack, naming no view (review60)."""
    view = OwnDocuments(16, hook)
    with pytest.raises(error, match=f"OwnDocuments.extents gave .*{message}"):
        list(DataLoader(view, 4, batching=policy, seed=3, epochs=1, num_threads=0))
    blend = tokload.Blend([(view, 1), (Documents(two[0]), 1)], length=32, seed=1)
    with pytest.raises(error, match=f"OwnDocuments.extents gave .*{message}"):
        list(DataLoader(blend, 4, batching=policy, seed=3, epochs=1, num_threads=0))


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
@pytest.mark.parametrize("given", ["lists", ">u8", ">i8"])
def test_extents_as_lists_or_big_endian_arrays_serve_every_policy(policy: Any, given: str) -> None:
    """Extents as lists of int64, or as big-endian arrays (read from a big-endian
    index: review66 found ``>u8`` lengths with a low byte from 0x80 up refused as
    past 2**63), are the same documents."""

    def convert(s: np.ndarray, n: np.ndarray) -> tuple[Any, Any]:
        if given == "lists":
            return s.astype(np.int64).tolist(), n.astype(np.int64).tolist()
        return s.astype(given), (n + np.uint64(200)).astype(given)  # (lengths from 201)

    view = OwnDocuments(30, convert)
    view.flat = np.resize(view.flat, len(view.flat) + 30 * 200)  # (room for the longer ones)
    ld = DataLoader(view, 4, batching=policy, seed=3, epochs=1, num_threads=0)
    seen = sorted(i for b in ld for i in b["index"].tolist())
    assert seen == list(range(30))


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        (tokload.Fill(64), "loss_mask"),
        (tokload.Fill(64), "doc_counts"),
        (tokload.Pack(), "cu_seqlens"),
        (tokload.Pad(), "lengths"),
        (tokload.Pad(), "index"),
    ],
    ids=repr,
)
def test_a_field_named_as_a_key_the_policy_adds_is_refused(policy: Any, field: str) -> None:
    """An SFT dataset's own loss_mask was replaced by Fill's attention mask, silently."""
    view = OwnDocuments(8, fields={"tokens": np.dtype(np.uint32), field: np.dtype(np.uint32)})
    with pytest.raises(ValueError, match=f"OwnDocuments: a field named '{field}', a key "):
        DataLoader(view, 2, batching=policy, num_threads=0)
    if field == "loss_mask":  # without that key, the field is the batch's
        fill = tokload.Fill(64, attention=["position_ids", "cu_seqlens"])
        batch = next(iter(DataLoader(view, 2, batching=fill, num_threads=0, seed=1)))
        assert batch["loss_mask"].dtype == torch.uint32  # the field's, not a bool mask


class Provenance(OwnDocuments):
    def origin(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"lengths": np.zeros(len(indices), dtype=np.int64)}


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_a_provenance_key_the_batch_holds_is_refused(policy: Any) -> None:
    with pytest.raises(ValueError, match="origin gave the key 'lengths', which the batch holds"):
        next(iter(DataLoader(Provenance(8), 2, batching=policy, num_threads=0, seed=1)))


class ShortProvenance(OwnDocuments):
    num_components = 2

    def __init__(self, n: int, short: bool) -> None:
        super().__init__(n)
        self.short = short

    def origin(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        if self.short:
            return {"component": np.zeros(len(indices) - 1, dtype=np.int64)}
        return {"component": np.full(len(indices), 2, dtype=np.int64)}


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_provenance_of_the_wrong_length_or_component_is_refused(policy: Any) -> None:
    """``origin`` arrays one entry short were cut into the batch silently (or failed
    in a bare broadcast error), and components past ``num_components`` were taken
    (review41): refused, naming the view."""
    with pytest.raises(ValueError, match=r"ShortProvenance.origin gave 'component' of shape"):
        next(iter(DataLoader(ShortProvenance(8, True), 2, batching=policy, num_threads=0)))
    with pytest.raises(ValueError, match=r"ShortProvenance.origin gave components outside"):
        next(iter(DataLoader(ShortProvenance(8, False), 2, batching=policy, num_threads=0)))


class Located(OwnDocuments):
    """Documents that find themselves once (``locate``), with what it gives set."""

    def __init__(self, where: Any) -> None:
        super().__init__(30)
        self.where = where
        self.remembered: list[tuple[np.ndarray, ...]] = []

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        return (self.where(np.asarray(indices, dtype=np.int64)),)

    def remember_located(self, indices: np.ndarray, *arrays: np.ndarray) -> None:
        self.remembered.append(arrays)


@pytest.mark.parametrize(
    ("where", "error", "message"),
    [
        (lambda i: i + 0.5, TypeError, r"Located.locate gave an array of float64 and shape"),
        (lambda i: np.stack([i, i], axis=1), TypeError, r"of int64 and shape \(\d+, 2\)"),
        (lambda i: i[:-1], TypeError, r"shape \((\d+),\) for (?!\1 )\d+ documents"),
        (lambda i: i.astype(np.uint64) | np.uint64(1 << 63), ValueError, "past an int64"),
    ],
)
def test_what_locate_gives_is_held_to_the_contract(where: Any, error: Any, message: str) -> None:
    """``locate``'s arrays were cast to int64 on the way back to
    ``remember_located`` (0.5 became 0, 2**63 + 1 negative; review41)."""
    good = Located(lambda i: i * 3)
    next(iter(DataLoader(good, 2, batching=tokload.Fill(64, lookahead=16), num_threads=0)))
    assert good.remembered and all(a[0].dtype == np.int64 for a in good.remembered)
    with pytest.raises(error, match=message):
        next(iter(DataLoader(Located(where), 2, batching=tokload.Fill(64, lookahead=16))))


class Steps:
    """A rowwise view with a per-batch key, read a task at a time by ``read_steps``."""

    rowwise = True
    batch_keys = ("n",)
    fingerprint = "steps"

    def __init__(self, extra: dict[str, Any]) -> None:
        self.extra = extra

    def __len__(self) -> int:
        return 40

    def read_batch(self, indices: np.ndarray, alloc: Any) -> dict[str, Any]:
        return {"x": indices * 10, "n": np.array([len(indices)])}

    def read_steps(
        self, indices: np.ndarray, cuts: list[tuple[int, int]], alloc: Any
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        raw = {"x": indices * 10, "n": np.array([e - a for a, e in cuts])}
        return raw, [{"n": slice(k, k + 1), **self.extra} for k in range(len(cuts))]


def test_a_fingerprint_written_as_a_method_is_refused() -> None:
    """``def fingerprint(self)`` without ``@property`` was taken: the state recorded
    ``<bound method ...>`` with an address, and every resume was refused as another
    view, saying nothing of why (review41; a test view of this suite had it)."""

    class Method(Steps):
        def fingerprint(self) -> str:  # type: ignore[override]
            return "steps"

    with pytest.raises(TypeError, match=r"Method.fingerprint is a method: make it a property"):
        DataLoader(Method({}), 4)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"index": 0}, "read_steps gave a step the key 'index', which the loader sets"),
        ({"position": 0}, "read_steps gave a step the key 'position', which the loader sets"),
        ({"t": slice(0, 1)}, "read_steps gave a step a slice of 't', which its arrays lack"),
    ],
)
def test_read_steps_keys_the_loader_sets_are_refused(extra: dict[str, Any], message: str) -> None:
    """A step of ``read_steps`` could carry ``"index"``/``"position"``, which then
    replaced the loader's (``read_batch``'s are refused), and a slice of a key its
    arrays lack failed in a KeyError naming no method (review41)."""
    assert next(iter(DataLoader(Steps({}), 4, seed=1, num_threads=2)))["n"].tolist() == [4]
    with pytest.raises(ValueError, match=message):
        next(iter(DataLoader(Steps(extra), 4, seed=1, num_threads=2)))


class Unlike(Steps):
    """``read_steps`` whose later steps give other keys or kinds than the first."""

    def __init__(self, how: str) -> None:
        super().__init__({})
        self.how = how

    def read_steps(
        self, indices: np.ndarray, cuts: list[tuple[int, int]], alloc: Any
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        raw, steps = super().read_steps(indices, cuts, alloc)
        if len(steps) > 1:  # (the first task is one step)
            if self.how == "a value where a slice was":
                steps[-1]["n"] = 7
            elif self.how == "a key more":
                steps[-1]["tag"] = 101
            else:
                del steps[-1]["n"]
        return raw, steps


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("a value where a slice was", r"gave step 15 a value of 'n', and step 0 a slice"),
        ("a key more", r"gave step 15 a value of 'tag', and step 0 no value"),
        ("a key less", r"gave step 15 no value of 'n', and step 0 a slice"),
    ],
)
def test_read_steps_that_differ_from_the_first_are_refused(how: str, message: str) -> None:
    """review60: a task's steps were cut by the first's keys and kinds: a later step's
    own key was dropped, one it lacked was a bare ``KeyError``, and its value 7 where
    the first gave a slice became element 7 of the array, silently."""
    it = iter(DataLoader(Unlike(how), 2, seed=1, num_threads=2))
    assert next(it)["n"].tolist() == [2]  # the first task: one step
    with pytest.raises(ValueError, match=r"^Unlike\.read_steps " + message):
        next(it)


@pytest.mark.parametrize("dtype", [np.dtype(("f4", (2,))), np.dtype([("a", "u2"), ("b", "u2")])])
def test_a_field_of_documents_holds_one_number_per_row(dtype: np.dtype[Any]) -> None:
    """A subarray field got a flat buffer of one element per row, and the view's own
    read_extents then failed with a bare broadcast error."""
    view = OwnDocuments(8, fields={"tokens": np.dtype(np.uint32), "pair": dtype})
    with pytest.raises(TypeError, match=r"OwnDocuments's field 'pair' has the dtype .* one number"):
        DataLoader(view, 2, batching=tokload.Fill(64), num_threads=0)


class Exhausted:
    """A view whose ``read_batch`` calls ``next()`` on an iterator it ran dry."""

    def __init__(self, n: int, dry_at: int) -> None:
        self.n, self.dry_at, self.calls = n, dry_at, 0

    def __len__(self) -> int:
        return self.n

    @property
    def fingerprint(self) -> str:
        return f"Exhausted({self.n})"

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        self.calls += 1
        if self.calls == self.dry_at:
            next(iter(()))  # StopIteration, from the view's own code
        return {"x": np.asarray(indices, dtype=np.int64)}


@pytest.mark.parametrize("threads", [0, 2])
def test_a_stop_iteration_a_view_raises_is_no_end_of_the_epoch(threads: int) -> None:
    """review60: a ``StopIteration`` raised inside ``read_batch`` left ``next()`` as
    it was, so a ``for`` loop ended, silently, after 3 of 10 batches (1 with reader
    threads), the cursor mid-epoch: it is a ``RuntimeError`` now (PEP 479's rule)."""
    view = Exhausted(40, dry_at=4)
    ld = DataLoader(view, 4, shuffle=False, num_threads=threads, device=None, epochs=1)
    seen = []
    with pytest.raises(RuntimeError, match=r"Exhausted \(or collate\) raised StopIteration") as e:
        for b in ld:
            seen.append(int(b["x"][0]))
    assert isinstance(e.value.__cause__, StopIteration)
    assert seen == [0, 4, 8][: len(seen)] and ld.cursor == 4 * len(seen)
    ld.close()


class Uneven:
    """Not rowwise: a batch holding an even index has a key more."""

    def __len__(self) -> int:
        return 20

    @property
    def fingerprint(self) -> str:
        return "Uneven"

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        out: dict[str, Any] = {"x": 2 * np.asarray(indices, dtype=np.int64)}
        if (np.asarray(indices) % 2 == 0).any():
            out = {"extra": np.ones((len(indices), 3), np.int32), **out}
        return out


@pytest.mark.parametrize("threads", [0, 2])
def test_batches_of_other_keys_are_counted_not_refused(threads: int) -> None:
    """review60: the token count kept the key of the first batch it saw ('extra')
    and raised ``KeyError`` from ``stats`` on a batch without it."""
    ld = DataLoader(Uneven(), 1, seed=3, num_threads=threads, device=None, epochs=1)
    got = sorted(int(b["x"][0]) // 2 for b in ld)
    assert got == list(range(20))
    st = ld.stats()
    assert st["batches"] == 20 and 20 <= st["tokens"] <= 40  # each x's (1) or extra's (3)


class OwnTensor:
    """Sample ``i`` is row ``i`` of a ``[100, 3]`` torch tensor the view holds, given
    as a slice of it (``rowwise``: by index, one row per sample)."""

    def __init__(self, rowwise: bool) -> None:
        self.corpus = torch.arange(300, dtype=torch.int64).reshape(100, 3)
        self.rowwise = rowwise

    def __len__(self) -> int:
        return 100

    @property
    def fingerprint(self) -> str:
        return f"OwnTensor({self.rowwise})"

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]:
        if self.rowwise:
            return {"x": self.corpus[torch.from_numpy(indices)]}
        a = int(indices[0])
        return {"x": self.corpus[a : a + len(indices)]}


@pytest.mark.parametrize("rowwise", [False, True], ids=["apart", "rowwise"])
def test_a_views_own_torch_tensor_is_copied_as_its_arrays_are(rowwise: bool) -> None:
    """review60: a tensor a view returned went out as the batch itself: a trainer's
    in-place edit (label masking) rewrote the view's data, a device copy read memory
    the backend does not track, and a rowwise view's was refused as having the
    wrong rows. It is copied into the loader's memory, as a NumPy array is."""
    view = OwnTensor(rowwise)
    fd = FakeDevice(seed=3)
    for device in (None, fd):
        ld = DataLoader(view, 4, shuffle=False, num_threads=0, device=device, epochs=1)
        for b in ld:
            assert torch.equal(b["x"].cpu(), view.corpus[b["index"].cpu().long()])
            b["x"].fill_(-100)  # the trainer's in-place edit
        ld.close()
    assert torch.equal(view.corpus.flatten(), torch.arange(300))
    assert fd.violations == []
    for dtype in (torch.bfloat16, torch.int8):  # (bfloat16: a dtype NumPy lacks, review61)
        view.corpus = torch.arange(300).reshape(100, 3).to(dtype)
        b = next(iter(DataLoader(view, 4, shuffle=False, num_threads=0, device=None)))
        assert b["x"].dtype == dtype and torch.equal(b["x"], view.corpus[:4])
    sparse = torch.eye(4).to_sparse()
    view.read_batch = lambda indices, alloc: {"x": sparse}  # type: ignore[method-assign]
    b = next(iter(DataLoader(view, 4, shuffle=False, num_threads=0, device=None)))
    assert torch.equal(b["x"], torch.eye(4))  # made dense
    elsewhere = torch.zeros((4, 3), device="meta")  # (as a GPU's would be)
    view.read_batch = lambda indices, alloc: {"x": elsewhere}  # type: ignore[method-assign]
    with pytest.raises(TypeError, match=r"'x'.* is a tensor on meta: a view gives host memory"):
        next(iter(DataLoader(view, 4, shuffle=False, num_threads=0, device=None)))


def test_a_views_big_endian_array_comes_in_the_machines_byte_order() -> None:
    """review60: torch has no big-endian dtypes, and a view of one's own that read
    big-endian data got torch's "byte order" ValueError: the array is copied in the
    machine's byte order, the same values (and an array of a dtype torch lacks
    still raises, naming the key)."""
    view = OwnTensor(rowwise=False)
    big = np.arange(12, dtype=">u4").reshape(4, 3)
    view.read_batch = lambda indices, alloc: {"x": big}  # type: ignore[method-assign]
    b = next(iter(DataLoader(view, 4, shuffle=False, num_threads=0, device=None)))
    assert b["x"].dtype == torch.uint32 and b["x"].tolist() == big.tolist()
    words = np.array([["a", "b", "c"]] * 4, dtype=">U1")  # (no torch dtype, either order)
    view.read_batch = lambda indices, alloc: {"x": words}  # type: ignore[method-assign]
    with pytest.raises(TypeError, match=r"the batch's 'x': a >U1 array of shape \(4, 3\)"):
        next(iter(DataLoader(view, 4, shuffle=False, num_threads=0, device=None)))


class Hinted(OwnDocuments):
    """Documents of one's own that record what read-ahead hints."""

    def __init__(self) -> None:
        super().__init__(200)
        self.hinted: list[int] = []

    def hint(self, indices: np.ndarray) -> None:
        self.hinted.extend(np.asarray(indices).tolist())

    def storage_paths(self) -> list[str]:
        return []


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_read_ahead_hints_the_documents_every_policy_reads(policy: Any) -> None:
    """review60: under ``Fill`` a view's ``hint`` was never called, read-ahead on or
    not (the schedule of packed rows has no indices of positions, and the
    ``TypeError`` was swallowed as advice): it hints the documents of the rows of
    the tasks ahead, as the other policies hint theirs."""
    view = Hinted()
    read = tokload.ReadOptions(readahead=True, steps_per_task=2, prefetch=4)
    ld = DataLoader(view, 2, batching=policy, seed=1, epochs=1, num_threads=2, read=read)
    seen: list[int] = []
    for b in ld:
        seen.extend(b["index"].tolist())
    ld.close()
    assert len(view.hinted) > len(seen) // 4  # the tasks ahead of the first ones
    assert set(view.hinted) <= set(seen) == set(range(len(view)))
