"""The contracts every view keeps: what the DataLoader and its batching read through.

The one job of this module is to say, in code and in words, what a view is:
the loader never looks at a view's type, so tokload's views and a user's are
read through the same two protocols, checked here.

The view protocol
-----------------
A view is any object with

- ``len(view)``: the number of observations ``n``; the loader's positions map to
  indices in ``[0, n)``;
- ``view.fingerprint``: a string that identifies the data and the view's
  configuration; the loader's checkpoint records it and a resume on a view with
  another fingerprint is refused;
- ``view.read_batch(indices, alloc) -> dict``: the observations ``indices`` (an
  int64 array) as a dict of arrays. Each array that should become a tensor is
  allocated with ``alloc(shape, dtype)`` and filled in place (the loader passes
  an allocator of pinned memory on GPU hosts: the bytes go from the file into
  the final buffer once). Arrays made otherwise (in NumPy, or views of data the
  view holds in a torch tensor) are copied into such a buffer, so a trainer's
  in-place edit of a batch never reaches the view's data; values that are not
  arrays (a list of records) are passed through as they are.
  The keys ``"index"`` and ``"position"`` are the loader's.

and, optionally,

- ``view.rowwise = True``: every array ``read_batch`` returns has one row per
  index, in order, and reading a concatenation of index arrays gives the
  concatenation of the results. The loader then reads the samples of several
  steps with one call and gives each step its rows (a token stream's fast path);
- ``view.read_steps(indices, cuts, alloc) -> (dict, list[dict])`` with
  ``view.batch_keys`` (a tuple of keys, not empty): for a rowwise view whose
  batches also hold values of the whole batch (a token stream's
  ``cu_seqlens`` and ``max_seqlen``), the read of several steps at once that
  the loader uses instead of ``read_batch``: ``cuts`` gives each step's
  rows ``(a, e)`` of ``indices``; the dict holds the rows' arrays and arrays of
  any shape; the list, for each step, its per-batch values: a ``slice`` of one
  of those arrays, or a value as it is (the same keys in every step, each a
  slice in every one or a value in every one). The loader gives each step its
  rows of the rowwise arrays and those values;
- ``view.read_batches(list_of_indices, alloc) -> list[dict]``: ``read_batch``
  of each index array, in one call, for views that are not rowwise but can read
  several batches in one round of I/O (a stream with metadata blocks); the
  loader uses it for the steps of one task;
- ``view.hint(indices)``: start reading observations ``indices`` in the
  background and return at once (tokload's windowed views advise the kernel with
  ``POSIX_FADV_WILLNEED``); the loader's read-ahead (``tokload.readahead``)
  calls it for the tasks ahead of those being built. With
  ``view.storage_paths() -> list[str]`` too, the loader turns read-ahead on by
  itself where those files are on a network or FUSE filesystem;
- ``view.fingerprint_upto(stop) -> str``: what observations ``[0, stop)``
  depend on (a blend, whose later stages may be added during a run). The loader
  records and compares it instead of ``fingerprint``, for ``stop`` the first
  observation not yet read in order (``n`` once a shuffled run has started).

``read_batch`` runs on the loader's reader threads, several at once: it must be
thread-safe, and should spend its time in calls that release the GIL (NumPy on
large arrays, tokload's reads), not in per-sample Python.

The document contract
---------------------
A view of documents (``Documents``, a ``Blend`` of them, a user's view) is
batched by any policy of documents (``tokload.batching``: ``Pad``, ``Pack``,
``Fill``) when it also offers

- ``view.extents(indices) -> (starts, lengths)``: two integer arrays (uint64
  or int64), one entry per document: a value per document that the view's own
  ``read_extents`` understands (its first row in the source, for tokload's
  views) and the documents' lengths in rows, none below 0 or from 2**63 up
  (``document_extents`` holds a view to this). ``Fill`` and a ``Blend`` hand
  the starts back to ``read_extents`` as uint64 (a negative start as its bit
  pattern: ``.view(np.int64)`` gives it back), ``Pad`` and ``Pack`` as they
  came;
- ``view.fields``: ``{name: dtype}`` of the arrays a read of documents fills
  (``{"tokens": dtype}``, or one entry per field of a structured dtype); no
  field has the name of a key the policy adds (``batching.PAD_KEYS``,
  ``PACK_KEYS``, ``FILL_KEYS`` and ``Fill``'s attention keys) or
  ``RESERVED_KEYS``;
- ``view.read_extents(indices, starts, lengths, dst, out)``: write document
  ``k`` (``indices[k]``, with ``starts[k]`` from ``extents``) into rows
  ``[dst[k], dst[k] + lengths[k])`` of each flat array of ``out`` (one per
  field of ``fields``; ``lengths[k]`` may be shorter than the document: its
  first rows), leaving every other row as it is;

and, optionally, ``view.origin(indices) -> dict`` of int64 arrays saying where
each sample came from (a ``Blend``: ``"component"`` and ``"component_index"``)
with ``view.num_components``; every policy adds them to the batch, one entry
per sample (per document with ``Fill``), and the loader's ``stats()`` counts
each component's samples and tokens. A view that finds its documents with a
lookup worth doing once (a ``Blend``'s ``locate``: component and index of each
position) may offer ``view.locate(indices)`` (1-D integer arrays, one entry per
document, values that fit an int64: they come back as int64; others are
refused) with ``view.remember_located(indices, *arrays)``: ``Fill`` calls ``locate``
as it packs a group of documents, right after their ``extents``, keeps the
arrays with the group, and hands a task's gathered ones back to
``remember_located`` before it reads the task's documents.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tokload._docindex import step_tokens_error

Alloc = Callable[[tuple[int, ...], Any], np.ndarray]
"""Allocates an uninitialized C-contiguous array: ``alloc(shape, dtype)``. The
loader passes one that returns NumPy views of (pinned) torch tensors."""

RESERVED_KEYS = ("index", "position")
"""The keys of a batch that the loader sets: a view never returns them."""

ATTENTION_KEYS = ("position_ids", "segment_ids", "loss_mask", "cu_seqlens", "max_seqlen")
"""The attention keys that make each document attend only to itself
(``TokenStream(boundaries=...)``, ``Fill(attention=...)``)."""


def refuse_field_names(
    description: str, fields: Sequence[str], keys: Collection[str], who: str, hint: str = ""
) -> None:
    """ValueError, naming the source, when one of ``fields`` has the name of one
    of ``keys``, which ``who`` adds to each batch: the batch's own array would
    replace the field's values, silently."""
    clash = [f for f in fields if f in keys]
    if clash:
        raise ValueError(
            f"{description}: a field named {clash[0]!r}, a key {who} adds to each batch: "
            f"its values would be replaced by the batch's own (rename the field{hint})"
        )


@runtime_checkable
class BatchView(Protocol):
    """What the DataLoader needs from a view (see the module docstring)."""

    def __len__(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def read_batch(self, indices: np.ndarray, alloc: Alloc) -> dict[str, Any]: ...


@runtime_checkable
class DocumentView(BatchView, Protocol):
    """A view of documents, for the batching policies of documents (module docstring)."""

    @property
    def fields(self) -> Mapping[str, np.dtype[Any]]: ...

    def extents(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def read_extents(
        self,
        indices: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        dst: np.ndarray,
        out: Mapping[str, np.ndarray],
    ) -> None: ...


def check_view(view: object) -> None:
    """Raise TypeError naming what ``view`` lacks of the view protocol."""
    missing = [
        name
        for name, ok in (
            ("__len__", callable(getattr(type(view), "__len__", None))),
            ("fingerprint", hasattr(view, "fingerprint")),
            ("read_batch", callable(getattr(view, "read_batch", None))),
        )
        if not ok
    ]
    if missing:
        raise TypeError(
            f"{type(view).__name__} is not a view: it lacks {', '.join(missing)} "
            "(a view needs len(), .fingerprint and .read_batch(indices, alloc); "
            "see tokload.views.contract)"
        )
    if callable(view.fingerprint):  # type: ignore[attr-defined]
        raise TypeError(
            f"{type(view).__name__}.fingerprint is a method: make it a property (or an "
            "attribute) whose value is a string that names the data, or every resume is "
            "refused as another view"
        )


DOCUMENT_NEEDS = ("extents", "read_extents", "fields")


def is_documents(view: object) -> bool:
    """Whether ``view`` offers the document contract."""
    return all(getattr(view, m, None) is not None for m in DOCUMENT_NEEDS)


def check_documents(view: object, policy: str) -> None:
    """TypeError naming what ``view`` lacks of the document contract (for ``policy``)."""
    check_view(view)
    missing = [m for m in DOCUMENT_NEEDS if getattr(view, m, None) is None]
    if missing:
        raise TypeError(
            f"{policy} batches documents, and {type(view).__name__} is not a view of "
            f"documents: it lacks {', '.join(missing)} (Documents, a Blend of them, or a "
            "view with extents, fields and read_extents: see tokload.views.contract)"
        )
    for name, given in view.fields.items():  # type: ignore[attr-defined]
        dt = np.dtype(given)
        if dt.shape or dt.fields:
            raise TypeError(
                f"{type(view).__name__}'s field {name!r} has the dtype {dt}: a "
                "field of documents holds one number per row (give each element a field "
                "of its own)"
            )


def document_extents(view: Any, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``view.extents(indices)``, held to the document contract: two integer arrays of
    one entry per document, no length below 0 or past 2**63; the lengths as uint64.

    A view of your own that breaks it is refused here (ValueError or TypeError
    naming it), before any policy packs or reads: a list one entry short once
    lost documents from ``Fill``'s rows, and a negative length read as 2**64 - 3
    rows."""
    starts, lengths = view.extents(indices)
    starts, lengths = np.asarray(starts), np.asarray(lengths)
    name = type(view).__name__
    n = len(indices)
    if starts.shape != (n,) or lengths.shape != (n,):
        raise ValueError(
            f"{name}.extents gave starts of shape {starts.shape} and lengths of shape "
            f"{lengths.shape} for {n} documents: one of each per document is needed"
        )
    for what, a in (("starts", starts), ("lengths", lengths)):
        if n and a.dtype.kind not in "iu":
            raise TypeError(f"{name}.extents gave {what} of dtype {a.dtype}, not integers")
    kind = lengths.dtype.kind
    if n and (kind == "i" or lengths.itemsize == 8):  # (uint64 >= 2**63: negative as int64)
        signed = lengths if kind == "i" else lengths.astype(np.int64)  # (any byte order)
        if signed.min() < 0:
            k = int(np.argmin(signed))
            raise ValueError(
                f"{name}.extents gave document {int(indices[k])} a length of "
                f"{int(lengths[k])}: lengths must be >= 0 and below 2**63"
            )
    return starts, lengths.astype(np.uint64, copy=False)


def check_step_tokens(step_rows: int, window: int) -> None:
    """ValueError when a step of ``step_rows`` rows of ``window`` tokens holds more
    tokens than its ``cu_seqlens`` (int32, as attention kernels take them)
    numbers: checked before anything is read or allocated. A reader task of
    many steps may hold more (its keys are computed with int64 offsets)."""
    if step_rows * window > (1 << 31) - 1:
        raise ValueError(step_tokens_error(step_rows, window))


def attention_keys(value: object, name: str = "attention") -> tuple[str, ...]:
    """The attention keys ``value`` asks for (True: all, False: none, or a list
    of them), in ``ATTENTION_KEYS`` order; ``name`` is the argument's, for errors."""
    if value is True:
        return ATTENTION_KEYS
    if value is False:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(
            f"{name} must be True, False or a list of keys out of "
            f"{', '.join(ATTENTION_KEYS)}; got {value!r}"
        )
    wanted = set(value)
    unknown = sorted(str(k) for k in wanted - set(ATTENTION_KEYS))
    if unknown or not wanted:
        raise ValueError(
            f"{name}: unknown keys {unknown} (valid: {', '.join(ATTENTION_KEYS)})"
            if unknown
            else f"{name}: an empty list of keys; give False for none"
        )
    return tuple(k for k in ATTENTION_KEYS if k in wanted)


def fingerprint_upto(view: Any, stop: int) -> str:
    """What observations ``[0, stop)`` depend on (the whole fingerprint by default)."""
    upto = getattr(view, "fingerprint_upto", None)
    return str(upto(stop) if upto is not None else view.fingerprint)
