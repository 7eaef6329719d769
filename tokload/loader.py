"""The DataLoader: global shuffle, zero-communication ranks, one-integer resume.

Order (ARCHITECTURE.md, invariants 2-4). With ``n = len(view)``, position
``q >= 0`` is sample ``view[perm_e(q % n)]`` of epoch ``e = q // n``, where
``perm_e = Permutation.for_epoch(n, seed, e, rounds)`` (the identity when
``shuffle=False``). A step that starts at cursor ``c`` covers the global batch
of positions ``[c, c + G)``, ``G = batch_size * world_size``, and rank ``r``
takes positions ``c + r + k * world_size``, ``k < batch_size``. The samples of
a global batch therefore depend on ``c`` and ``G`` only, never on how many
ranks share it, and no rank ever needs another's state.

The checkpoint is the cursor: the first position not yet delivered. Resuming
at it, with any number of ranks and any batch size, delivers every remaining
position of every epoch exactly once. Prefetched batches are not counted and
are rebuilt identically after a resume.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Self, cast

import numpy as np

from tokload._permute import Permutation
from tokload.errors import StateError
from tokload.prefetch import Prefetcher
from tokload.views import Documents, StreamWithMetadata, TokenStream, View

if TYPE_CHECKING:
    from tokload.blend import Blend

STATE_VERSION = 1
Batch = dict[str, Any]


class _Order:
    """Position -> sample index, with the permutation of each epoch cached."""

    def __init__(self, n: int, seed: int, rounds: int, shuffle: bool) -> None:
        self.n, self.seed, self.rounds, self.shuffle = n, seed, rounds, shuffle
        self._cache: OrderedDict[int, Permutation] = OrderedDict()
        self._lock = threading.Lock()

    def perm(self, epoch: int) -> Permutation:
        with self._lock:
            p = self._cache.get(epoch)
            if p is None:
                p = Permutation.for_epoch(self.n, self.seed, epoch, self.rounds)
                self._cache[epoch] = p
                while len(self._cache) > 4:  # a batch spans at most a few epochs
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(epoch)
            return p

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices (int64) of global positions (uint64)."""
        if len(positions) == 0:  # a rank with nothing left in a final partial batch
            return np.zeros(0, dtype=np.int64)
        n = np.uint64(self.n)
        j = positions % n
        if not self.shuffle:
            return j.astype(np.int64)
        epochs = positions // n
        first, last = int(epochs[0]), int(epochs[-1])
        if first == last:
            return self.perm(first).take(j, out=j).view(np.int64)
        out = np.empty(len(positions), dtype=np.uint64)
        for e in range(first, last + 1):
            mask = epochs == e
            out[mask] = self.perm(e).take(j[mask])
        return out.view(np.int64)


def _resolve_rank(
    rank: int | None, world_size: int | None, mesh: Any, mesh_dim: str | int | None
) -> tuple[int, int]:
    if mesh is not None:
        if rank is not None or world_size is not None:
            raise ValueError("give either a DeviceMesh or rank/world_size, not both")
        dim = 0 if mesh_dim is None else mesh_dim
        return int(mesh.get_local_rank(dim)), int(mesh.size(dim))
    if rank is None and world_size is None:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is a dependency
            return 0, 1
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError("give both rank and world_size, or neither")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


class DataLoader:
    """Batches of a view, shuffled globally, split across ranks, resumable exactly.

    Args:
        view: a :class:`~tokload.views.TokenStream`, :class:`~tokload.views.Documents`
            or :class:`~tokload.views.StreamWithMetadata` (or any subset).
        batch_size: samples per rank per step (``B``).
        seed: the run seed; epoch ``e`` uses ``Permutation.for_epoch(n, seed, e)``.
        shuffle: False reads in order (evaluation: ``shuffle=False, epochs=1``).
        rank, world_size: this rank and the number of ranks. Default: from
            ``torch.distributed`` when it is initialized, else 0 and 1.
        mesh, mesh_dim: a ``DeviceMesh`` and its data-parallel dimension (name
            or index, default 0); ranks differing only in other dimensions get
            identical batches.
        prefetch: batches built ahead of the trainer (per rank); keep it at
            least twice ``steps_per_task`` so a task is always being built.
        num_threads: reader threads; 0 builds each batch in ``next()`` (handy
            for debugging). Default: half the CPU cores, between 1 and 4, so
            the training thread keeps a core of its own.
        pin_memory: ``"auto"`` pins when CUDA is available; ``True`` requires
            it (RuntimeError otherwise); ``False`` never pins.
        device: copy each batch to this device in the reader thread, on a side
            stream with ``non_blocking=True`` (CUDA only).
        collate: ``collate(raw)`` replaces the default conversion to tensors;
            ``raw`` is a dict of NumPy arrays (see :meth:`raw_batch`).
        epochs: stop after ``epochs * n`` positions (None: endless).
        drop_last: never let a global batch straddle the end of an epoch (its
            last ``n % G`` positions are skipped), and drop a final partial
            batch. Default False: nothing is ever skipped.
        rounds: Feistel rounds of the permutation.
        documents: for a Documents view, ``"pad"`` (``[B, L]`` plus
            ``lengths``) or ``"pack"`` (one row per rank plus ``cu_seqlens``).
        pad_to: with ``"pad"``, a fixed ``L`` (longer documents are truncated);
            None pads to the longest document of the batch.
        pad_value: the padding token.
        steps_per_task: consecutive steps a reader thread builds per task. For
            token streams their samples are permuted and read in one call each,
            so the thread takes the GIL a few times per task instead of per
            batch, which is what keeps the training thread at full speed. The
            batches are the same whatever this is.

    Batches are dicts of tensors: ``"tokens"`` (or one entry per field of a
    structured dtype), ``"index"`` (int64, the view indices) and
    ``"position"`` (int64, the global positions), plus ``"lengths"`` /
    ``"cu_seqlens"`` for documents and ``"metadata_positions"`` /
    ``"metadata"`` for a stream with metadata. Tensors share memory with the
    buffers the data was read into (no copy); a buffer is never reused.
    """

    def __init__(
        self,
        view: View,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        mesh: Any = None,
        mesh_dim: str | int | None = None,
        prefetch: int = 16,
        num_threads: int | None = None,
        pin_memory: bool | str = "auto",
        device: Any = None,
        collate: Callable[[dict[str, Any]], Any] | None = None,
        epochs: int | None = None,
        drop_last: bool = False,
        rounds: int = 6,
        documents: str = "pad",
        pad_to: int | None = None,
        pad_value: int = 0,
        steps_per_task: int = 8,
    ) -> None:
        from tokload.blend import Blend

        if not isinstance(view, (TokenStream, Documents, StreamWithMetadata, Blend)):
            raise TypeError(
                f"view must be a TokenStream, Documents, StreamWithMetadata or Blend, "
                f"got {type(view).__name__}"
            )
        # token windows (a plain stream or a blend of them): read in chunks
        self._windows = isinstance(view, (TokenStream, Blend)) and not isinstance(
            view, StreamWithMetadata
        )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if len(view) == 0:
            raise ValueError(f"the view is empty: {view!r}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if num_threads is None:
            num_threads = min(4, max(1, (os.cpu_count() or 2) // 2))
        if num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {num_threads}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        if documents not in ("pad", "pack"):
            raise ValueError(f"documents must be 'pad' or 'pack', got {documents!r}")
        if pad_to is not None and pad_to < 1:
            raise ValueError(f"pad_to must be positive, got {pad_to}")
        if steps_per_task < 1:
            raise ValueError(f"steps_per_task must be >= 1, got {steps_per_task}")
        self.view = view
        self.n = len(view)
        self.rank, self.world_size = _resolve_rank(rank, world_size, mesh, mesh_dim)
        self.batch_size = batch_size
        self.global_batch = batch_size * self.world_size
        if drop_last and self.global_batch > self.n:
            raise ValueError(
                f"drop_last with a global batch of {self.global_batch} needs at "
                f"least that many samples, the view has {self.n}"
            )
        self.seed, self.shuffle, self.rounds = int(seed), bool(shuffle), int(rounds)
        self.epochs, self.drop_last = epochs, bool(drop_last)
        self.total = None if epochs is None else epochs * self.n
        self.prefetch, self.num_threads = int(prefetch), int(num_threads)
        self.collate = collate
        self.documents, self.pad_to, self.pad_value = documents, pad_to, pad_value
        self.steps_per_task = int(steps_per_task)
        self._order = _Order(self.n, self.seed, self.rounds, self.shuffle)
        self._pin = self._resolve_pin(pin_memory)
        self.device = device
        self._cursor = 0
        self._iter: weakref.ref[_LoaderIter] | None = None

    # ---- configuration -------------------------------------------------------------

    @staticmethod
    def _resolve_pin(pin_memory: bool | str) -> bool:
        import torch

        if pin_memory == "auto":
            return bool(torch.cuda.is_available())
        if pin_memory is True:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "pin_memory=True needs a CUDA device, and torch.cuda.is_available() is "
                    "False; use pin_memory='auto' to pin only where a GPU is present"
                )
            return True
        if pin_memory is False:
            return False
        raise ValueError(f"pin_memory must be 'auto', True or False, got {pin_memory!r}")

    @property
    def pinned(self) -> bool:
        """Whether batches are built in pinned (page-locked) host memory."""
        return self._pin

    # ---- the cursor ------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """The first global position not yet delivered to the trainer."""
        return self._cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        """Jump to a position (e.g. past a bad batch); restarts prefetching."""
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"cursor must be a non-negative integer, got {value!r}")
        if self.total is not None and value > self.total:
            raise ValueError(
                f"cursor {value} is past the end of the {self.epochs} epochs "
                f"({self.total} positions)"
            )
        self._close_iter()
        self._cursor = int(value)

    @property
    def epoch(self) -> int:
        """The epoch of the cursor."""
        return self._cursor // self.n

    def state_dict(self) -> dict[str, Any]:
        """The loader's checkpoint: the cursor and what it was computed for.

        Identical on every rank; small; ``load_state_dict(state_dict())`` is the
        identity. Follows PyTorch's ``Stateful`` protocol.
        """
        return {
            "version": STATE_VERSION,
            "cursor": self._cursor,
            "n": self.n,
            "seed": self.seed,
            "rounds": self.rounds,
            "shuffle": self.shuffle,
            "fingerprint": self.view.fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any], *, force: bool = False) -> None:
        """Resume at ``state["cursor"]``; any world size and batch size may differ.

        Refuses (StateError) a state computed for another dataset, view size,
        seed, rounds or shuffle setting, unless ``force=True``.
        """
        if not isinstance(state, Mapping) or "cursor" not in state:
            raise StateError(f"not a tokload loader state: {state!r}")
        if state.get("version") != STATE_VERSION:
            raise StateError(f"unknown loader state version {state.get('version')!r}")
        if not force:
            mine = self.state_dict()
            for key in ("n", "seed", "rounds", "shuffle", "fingerprint"):
                if state.get(key) != mine[key]:
                    raise StateError(
                        f"the state was saved for {key}={state.get(key)!r}, this loader has "
                        f"{key}={mine[key]!r}; pass force=True to resume anyway"
                    )
        self.cursor = int(state["cursor"])

    # ---- the schedule -----------------------------------------------------------------

    def _step_span(self, c: int) -> tuple[int, int] | None:
        """The global batch [start, end) of the step at cursor c, or None when done."""
        g = self.global_batch
        if self.drop_last and self.n - c % self.n < g:
            c = (c // self.n + 1) * self.n
        end = c + g
        if self.total is not None:
            if c >= self.total:
                return None
            if end > self.total:
                if self.drop_last:
                    return None
                end = self.total
        return c, end

    def positions(self, start: int, end: int) -> np.ndarray:
        """This rank's positions (uint64) in the global batch [start, end)."""
        first = start + self.rank
        count = max(0, min(self.batch_size, -(-(end - first) // self.world_size)))
        return np.uint64(first) + np.uint64(self.world_size) * np.arange(count, dtype=np.uint64)

    # ---- building batches ---------------------------------------------------------------

    def _alloc(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        if not self._pin:
            return np.empty(shape, dtype=dtype)
        import torch

        t = torch.empty(shape, dtype=_torch_dtype(np.dtype(dtype)), pin_memory=True)
        arr: np.ndarray = t.numpy()
        return arr

    def raw_batch(self, start: int, end: int) -> dict[str, Any]:
        """The NumPy arrays of this rank's part of the global batch [start, end).

        Keys: the view's fields (``"tokens"`` for a plain dtype), ``"index"``,
        ``"position"``, and per view kind ``"lengths"``/``"cu_seqlens"`` or
        ``"metadata_positions"``/``"metadata"``. This is what ``collate`` gets.
        """
        if self._windows:
            return self.raw_batches([(start, end)])[0]
        pos = self.positions(start, end)
        idx = self._order.indices(pos)
        raw: dict[str, Any] = {}
        view = self.view
        b = len(idx)
        if isinstance(view, StreamWithMetadata):
            res = view.read(
                idx,
                out=view.empty(b, alloc=self._alloc),
                positions=self._alloc((b, view.window), np.int32),
            )
            raw.update(res.fields)
            raw["metadata_positions"] = res.positions
            raw["metadata"] = res.metadata
        else:
            assert isinstance(view, Documents)
            if self.documents == "pad":
                values, lengths = view.read_padded(
                    idx, self.pad_to, pad=self.pad_value, alloc=self._alloc
                )
                raw.update(values if isinstance(values, dict) else {"tokens": values})
                raw["lengths"] = lengths
            else:
                batch = view.read(idx, alloc=self._alloc)
                raw.update(
                    batch.values if isinstance(batch.values, dict) else {"tokens": batch.values}
                )
                raw["lengths"] = batch.lengths
                raw["cu_seqlens"] = batch.offsets
        raw["index"] = idx
        raw["position"] = pos.view(np.int64)
        return raw

    def raw_batches(self, spans: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """``raw_batch`` for several consecutive global batches at once.

        For a token stream, the samples of all of them are permuted in one call
        and read in one call into one buffer, and each batch gets a slice of it
        (the slices never overlap, and no buffer is reused). Other views build
        batch by batch: their batch shapes (padding) or metadata lists are per
        batch.
        """
        view = self.view
        if not self._windows:
            return [self.raw_batch(*sp) for sp in spans]
        pos_list = [self.positions(*sp) for sp in spans]
        pos = np.concatenate(pos_list)
        idx = self._order.indices(pos)
        wv = cast("TokenStream | Blend", view)
        got = wv.read(idx, out=wv.empty(len(idx), alloc=self._alloc))
        fields = got if isinstance(got, dict) else {"tokens": got}
        raws, at = [], 0
        for p in pos_list:
            b = len(p)
            raw = {k: v[at : at + b] for k, v in fields.items()}
            raw["index"] = idx[at : at + b]
            raw["position"] = p.view(np.int64)
            raws.append(raw)
            at += b
        return raws

    def _to_tensors(self, raw: dict[str, Any]) -> Batch:
        import torch

        batch: Batch = {}
        for k, v in raw.items():
            batch[k] = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        if self.device is not None:
            is_cuda = torch.device(self.device).type == "cuda"
            stream = torch.cuda.Stream() if is_cuda else None  # type: ignore[no-untyped-call]
            if stream is not None:
                with torch.cuda.stream(stream):
                    batch = {
                        k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                        for k, v in batch.items()
                    }
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
                batch["_ready"] = event
            else:
                batch = {
                    k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()
                }
        return batch

    def build(self, start: int, end: int) -> Any:
        """This rank's batch for the global batch [start, end), collated."""
        return self._finish(self.raw_batch(start, end))

    def _finish(self, raw: dict[str, Any]) -> Any:
        return self.collate(raw) if self.collate is not None else self._to_tensors(raw)

    # ---- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._close_iter()
        it = _LoaderIter(self)
        self._iter = weakref.ref(it)
        return it

    def __len__(self) -> int:
        """Steps left from the cursor (only for a finite number of epochs)."""
        if self.total is None:
            raise TypeError("an endless DataLoader (epochs=None) has no length")
        c = self._cursor
        if not self.drop_last:
            return -(-(self.total - c) // self.global_batch) if c < self.total else 0
        steps = 0
        while (span := self._step_span(c)) is not None:
            steps += 1
            c = span[1]
        return steps

    def _close_iter(self) -> None:
        it = self._iter() if self._iter is not None else None
        if it is not None:
            it.close()
        self._iter = None

    def close(self) -> None:
        """Stop the reader threads (idempotent); the cursor is kept."""
        self._close_iter()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


class _LoaderIter:
    """One pass of iteration: owns the reader threads; advances the loader's cursor.

    Reader task ``k`` builds steps ``[k * c, (k + 1) * c)`` of this pass
    (``c = steps_per_task``); the consumer takes them in order.
    """

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._closed = False
        self._ready: list[tuple[tuple[int, int], Any]] = []
        self._pf: Prefetcher | None = None
        if loader.num_threads > 0:
            # The threads see only the build function, never this object, so
            # dropping the iterator (e.g. leaving a for loop) lets it be collected.
            depth = max(1, -(-loader.prefetch // loader.steps_per_task))
            self._pf = Prefetcher(
                _task_builder(loader, loader.cursor), 0, None, depth, loader.num_threads
            )

    def __iter__(self) -> _LoaderIter:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        loader = self._loader
        if self._pf is None:
            s = loader._step_span(loader.cursor)
            if s is None:
                self.close()
                raise StopIteration
            item = loader.build(*s)
            loader._cursor = s[1]
            return item
        if not self._ready:
            self._ready = self._pf.get()
            self._ready.reverse()
        if not self._ready:  # an empty task: the pass is over
            self.close()
            raise StopIteration
        (_start, end), item = self._ready.pop()
        if isinstance(item, _Failed):
            # The batch was not delivered: the cursor stays before it, and a new
            # iterator (or a resume) builds it again.
            self.close()
            raise item.exc
        loader._cursor = end  # delivered: counts now, not when it was built
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ready = []
            if self._pf is not None:
                self._pf.close()

    def __del__(self) -> None:
        self.close()


class _Failed:
    """A batch whose building raised: re-raised by the next() that would return it."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _task_builder(loader: DataLoader, base: int) -> Callable[[int], Any]:
    """``build(task)``: the (span, batch) pairs of the task's steps, in order.

    Spans follow one another from ``base`` (with drop_last they skip epoch
    tails), so they are computed in task order under a lock, whichever thread
    asks first; each task is asked for once.
    """
    per = loader.steps_per_task
    lock = threading.Lock()
    chain: dict[str, Any] = {"next": 0, "cursor": base}  # cursor None: the end
    computed: dict[int, list[tuple[int, int]]] = {}

    def spans_of(task: int) -> list[tuple[int, int]]:
        with lock:
            while chain["next"] <= task:
                c = chain["cursor"]
                spans: list[tuple[int, int]] = []
                while c is not None and len(spans) < per:
                    sp = loader._step_span(c)
                    c = None if sp is None else sp[1]
                    if sp is not None:
                        spans.append(sp)
                computed[chain["next"]] = spans
                chain["cursor"] = c
                chain["next"] += 1
            return computed.pop(task)

    def build(task: int) -> list[tuple[tuple[int, int], Any]]:
        spans = spans_of(task)
        try:
            raws: list[dict[str, Any]] | None = loader.raw_batches(spans)
        except Exception:
            raws = None  # rebuild one by one, so the failure lands on its own step
        out: list[tuple[tuple[int, int], Any]] = []
        for k, sp in enumerate(spans):
            try:
                raw = raws[k] if raws is not None else loader.raw_batch(*sp)
                out.append((sp, loader._finish(raw)))
            except BaseException as e:
                e.add_note(
                    f"(raised in a tokload reader thread while building the batch "
                    f"at cursor {sp[0]})"
                )
                out.append((sp, _Failed(e)))
                break  # the consumer stops at the failure: nothing after it is needed
        return out

    return build


def _torch_dtype(dtype: np.dtype[Any]) -> Any:
    import torch

    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
