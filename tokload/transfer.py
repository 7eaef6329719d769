"""The loader's transfer stage: host buffers with an explicit lifetime, device copies.

The one job of this module is to turn the arrays a view filled into the tensors
a trainer receives, and to move them to a device, without ever letting a host
buffer be written while a copy from it may still be running.

**Lifetime, by construction.** Every array the loader hands to a view comes from
``Transfer.alloc``, which allocates a tensor through the backend and gives the
view its NumPy alias to fill. Pinned memory is a fresh
``torch.empty(..., pin_memory=True)``; the tensors of a batch are then rebuilt
as views of that same tensor storage (``Transfer.tensors``), never through
``torch.from_numpy``: PyTorch's pinned-memory allocator then sees every
``non_blocking`` copy from them, whoever starts it (the loader's side stream or
the trainer's own ``.to("cuda", non_blocking=True)``), records an event for it,
and gives the memory back for reuse only once the last tensor sharing it is
gone *and* every recorded copy has completed; tokload never reuses pinned
memory itself. Memory that is not pinned comes from ``_hostmem`` blocks, which
go back to a free list once no array or tensor views them (a batch kept is
never written over); a copy from pageable memory to a device is staged by CUDA
before the copy call returns, so such a block is free to be reused after it.

**Device copies.** With a device, the reader thread copies each batch on a side
stream of that device (one stream per thread), records an event after the
copies (``Batch.ready``), and the ``next()`` that delivers the batch makes
the trainer's current stream wait for that event and ``record_stream``s every
device tensor on it, so the caching allocator never reuses their memory while
the trainer's stream may still use them.

A backend is the mechanism (allocate host memory, copy, wait); tests plug in a
fake one that completes copies asynchronously on CPU threads.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex

import numpy as np

from tokload import _hostmem

if TYPE_CHECKING:
    import torch


class Batch(dict[str, Any]):
    """A batch: a dict of tensors (and, for a stream with metadata, the records).

    ``ready`` is the event recorded after the batch's device copies (None for
    host batches). By the time ``next()`` returns the batch, the trainer's
    current stream already waits for it; use ``ready`` only to hand the batch
    to yet another stream.

    A batch pickles, and ``torch.save`` writes it, as a
    ``collections.OrderedDict`` of its items, without ``ready``: ``torch.load``
    reads it back with its default ``weights_only=True``, as it reads a state
    dict. (The ``"metadata"`` records of a stream with metadata are not
    tensors: that load needs ``weights_only=False``.)
    """

    ready: Any = None

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # torch.load(weights_only=True) refuses any class it does not know,
        # this one included; an OrderedDict is what it reads state dicts as
        return (collections.OrderedDict, (), None, None, iter(self.items()))

    def __missing__(self, key: Any) -> Any:
        hint = ""
        if key == "tokens" and "token" in self:
            hint = (
                " (a dataset of a structured dtype, as a build with --keep-field or "
                "--annotations writes, has a key per field: its tokens are 'token')"
            )
        raise KeyError(f"{key!r}: this batch has the keys {', '.join(map(repr, self))}{hint}")

    def __copy__(self) -> Batch:  # a Batch, with its event (not through pickling)
        out = Batch(self)
        out.ready = self.ready
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Batch:
        import copy

        out = Batch({k: copy.deepcopy(v, memo) for k, v in self.items()})
        out.ready = self.ready  # (an event is not copied: it says when the originals are ready)
        return out


def is_tensor(v: Any) -> bool:
    """Whether ``v`` is a torch tensor (without importing torch for other values)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def check_host(t: Any, what: str) -> None:
    """TypeError, naming ``what``, for a view's tensor that is not in host memory."""
    if t.device.type != "cpu":
        raise TypeError(
            f"{what} is a tensor on {t.device}: a view gives host memory (NumPy arrays "
            "from alloc, or tensors on the CPU); the loader copies batches to the device"
        )


class TransferBackend(Protocol):
    """What the transfer stage needs from a device (CUDA, or a test's fake one)."""

    pinned: bool
    """Whether ``host_empty`` gives page-locked memory."""
    device: Any
    """The device batches are copied to; None: none (``copy`` is the identity)."""

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new host tensor; its memory is reused only as described above."""
        ...

    def copy(self, batch: Batch) -> Batch:
        """The batch with every tensor copied to the device, asynchronously; sets ``ready``.

        The loader may pass the batches of one reader task merged into one
        (keys ``"<step>:<key>"``, ``Transfer.copy_all``): a backend copies
        every tensor whatever its key, and keeps other values as they are."""
        ...

    def deliver(self, batch: Batch) -> None:
        """On the trainer's thread: make its current stream wait for ``batch.ready``."""
        ...


class HostBackend:
    """Host batches in ordinary or pinned memory; no device copies."""

    def __init__(self, pinned: bool = False) -> None:
        _hostmem.check_environment()  # TOKLOAD_HOST_CACHE_MB, taken at import as it is
        self.pinned = pinned
        self.device: Any = None
        self._np: dict[torch.dtype, np.dtype[Any]] = {}

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        if self.pinned:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        # Ordinary memory through NumPy arrays: torch.from_numpy does not release
        # the GIL, torch.empty does, and retaking it costs a reader thread up to a
        # switch interval (5 ms) when the training thread runs Python flat out. No
        # device copy tracks this memory, so the allocator's events are not needed.
        # Large arrays get blocks that stay mapped between batches (_hostmem): from
        # malloc, each batch would fault in and zero its pages anew.
        nd = self._np.get(dtype)
        if nd is None:
            try:
                nd = self._np[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
            except TypeError:  # a dtype NumPy lacks (bfloat16: a view's own tensor's)
                size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                raw = torch.from_numpy(_hostmem.empty((size,), np.dtype(np.uint8)))
                return raw.view(dtype).reshape(shape)
        return torch.from_numpy(_hostmem.empty(shape, nd))

    def copy(self, batch: Batch) -> Batch:
        return batch

    def deliver(self, batch: Batch) -> None:
        return None


class CudaBackend(HostBackend):
    """Pinned host batches copied to one CUDA device on a side stream per reader thread."""

    def __init__(self, device: Any, pinned: bool = True) -> None:
        import torch

        super().__init__(pinned)
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {device!r}")
        self.device = torch.device("cuda", dev.index if dev.index is not None else 0)
        self._local = threading.local()

    def copy(self, batch: Batch) -> Batch:
        import torch

        stream = getattr(self._local, "stream", None)
        if stream is None:  # created on this thread, on our device (not the thread's default 0)
            stream = self._local.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        out = Batch()
        with torch.cuda.stream(stream):
            for k, v in batch.items():
                out[k] = v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        out.ready = event
        return out

    def deliver(self, batch: Batch) -> None:
        import torch

        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(batch.ready)
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.device == self.device:
                v.record_stream(stream)


def _a_cpu(device: Any) -> bool:
    """Whether ``device`` is a cpu device (``"cpu"``, ``"cpu:0"``, ``torch.device("cpu")``)."""
    import torch

    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError, ValueError):
        return False  # (make_backend names what is wrong with it)


def default_device() -> Any:
    """The rank's CUDA device (``LOCAL_RANK``, else the current one), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit():
        return torch.device("cuda", int(local) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def is_backend(device: Any) -> bool:
    """Whether the DataLoader's ``device`` is a ``TransferBackend`` of the user's."""
    return all(callable(getattr(device, m, None)) for m in ("host_empty", "copy", "deliver"))


def retired_transfer(device: Any, given: dict[str, Any]) -> Any:
    """``device``, or the retired ``transfer=`` keyword's backend taken out of
    ``given`` (a DeprecationWarning says to write ``device=``)."""
    if "transfer" not in given:
        return device
    backend = given.pop("transfer")
    if not (isinstance(device, str) and device == "auto"):
        raise TypeError("give the TransferBackend as device=, not transfer= beside device=")
    warnings.warn(
        "DataLoader(transfer=backend) is retired (tokload after 0.2.0): write "
        "DataLoader(..., device=backend)",
        DeprecationWarning,
        stacklevel=3,
    )
    return "auto" if backend is None else backend


def loader_backend(device: Any, pin_memory: bool | str, collate: Any) -> TransferBackend:
    """The backend for the DataLoader's ``device``, ``pin_memory`` and ``collate``:
    ``device`` itself when it is a backend, else the one the arguments describe
    (``collate`` replaces the device copy, so it excludes a device that copies:
    any but ``None``, ``"auto"`` and ``"cpu"``)."""
    if is_backend(device):
        if not (isinstance(pin_memory, str) and pin_memory == "auto"):
            raise ValueError(
                f"device={device!r} is a TransferBackend, which decides pinning itself; "
                f"leave pin_memory at 'auto', not {pin_memory!r}"
            )
        if collate is not None and device.device is not None:
            raise ValueError(
                "collate= replaces the conversion to tensors and the device copy; "
                f"give either collate or a backend that copies (device={device!r}), not both"
            )
        backend: TransferBackend = device
        return backend
    # a cpu device keeps host batches (as None does): no copy for collate to exclude
    copies = device is not None and str(device) != "auto" and not _a_cpu(device)
    if collate is not None and copies:
        raise ValueError(
            "collate= replaces the conversion to tensors and the device copy; "
            f"give either collate or device={device!r}, not both"
        )
    return make_backend(pin_memory, None if collate is not None else device)


def make_backend(pin_memory: bool | str, device: Any) -> TransferBackend:
    """The backend for the DataLoader's ``pin_memory`` and ``device`` arguments."""
    import torch

    cuda = torch.cuda.is_available()
    if pin_memory == "auto":
        pin = cuda
    elif pin_memory is True:
        if not cuda:
            raise RuntimeError(
                "pin_memory=True needs a CUDA device, and torch.cuda.is_available() is "
                "False; use pin_memory='auto' to pin only where a GPU is present"
            )
        pin = True
    elif pin_memory is False:
        pin = False
    else:
        raise ValueError(f"pin_memory must be 'auto', True or False, got {pin_memory!r}")
    if isinstance(device, str) and device == "auto":
        device = default_device()
    if device is None:
        return HostBackend(pin)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch device, 'auto' or None, got {device!r}") from e
    if dev.type == "cpu":
        return HostBackend(pin)
    if dev.type != "cuda":
        raise ValueError(f"device {device!r}: only CUDA devices (or 'cpu'/None) are supported")
    if not cuda:
        raise RuntimeError(f"device={device!r} needs CUDA, and torch.cuda.is_available() is False")
    if dev.index is None:
        dev = default_device()
    elif dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this host has {torch.cuda.device_count()} GPUs")
    return CudaBackend(dev, pin)


class Transfer:
    """Host buffers for the views, tensors for the trainer, device copies.

    Args:
        backend: where memory comes from and how copies run.
    """

    def __init__(self, backend: TransferBackend) -> None:
        self.backend = backend
        self._dtypes: dict[np.dtype[Any], torch.dtype] = {}

    @property
    def pinned(self) -> bool:
        return self.backend.pinned

    def _torch_dtype(self, dtype: np.dtype[Any]) -> torch.dtype:
        td = self._dtypes.get(dtype)
        if td is None:
            import torch

            td = self._dtypes[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        return td

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A new, uninitialized C-contiguous host array (the views' ``alloc``)."""
        dt = np.dtype(dtype)
        td = self._dtypes.get(dt) or self._torch_dtype(dt)
        arr: np.ndarray = self.backend.host_empty(shape, td).numpy()
        # The tensor ``arr`` views (a new alias of the allocation, the same object
        # every slice of ``arr`` leads back to) is marked as the loader's: ``tensor``
        # hands out such memory as the batch's and copies every other tensor's
        # (an attribute, not a registry: no call per array on the reader's path).
        arr.base._tokload_alloc = True  # type: ignore[union-attr]
        return arr

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        """The tensor for array ``a``: a view of the storage ``a`` was allocated in.

        Arrays that ``alloc`` did not make (a view computed a small array
        itself, or handed out its own data, NumPy or inside a torch tensor) are
        copied into a new host tensor, so every tensor of a batch lives in memory
        the backend tracks (pinned when it pins) and none is a view's own data.
        """
        import torch

        base: Any = a.base
        try:  # (a subscript, not a call: this runs for every array of every batch)
            td = self._dtypes[a.dtype]
        except KeyError:
            td = self._torch_dtype(a.dtype)
        # (``"..." in t.__dict__``: alloc's mark, read without a call)
        # (the dtype too: a view may reinterpret its buffer, alloc(..., np.uint8).view(bool))
        if (
            isinstance(base, torch.Tensor)
            and "_tokload_alloc" in base.__dict__
            and base.shape == a.shape
            and base.dtype == td
        ):
            return base  # ``a`` is exactly an allocation's ``.numpy()``: its own tensor
        if type(base) is np.ndarray and a.flags.c_contiguous and a.dtype == base.dtype:
            # Rows of an allocation (a task's rows, the index/position pair): the
            # same rows of its tensor, by indexing (no call that drops the GIL).
            whole = base.base
            if (
                isinstance(whole, torch.Tensor)
                and "_tokload_alloc" in whole.__dict__
                and whole.shape == base.shape
                and whole.dtype == td
                and base.ndim
            ):
                row = base.strides[0]
                at = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
                k = at // row if row > 0 else -1
                if 0 <= k < len(base) and at == k * row:
                    if a.shape == base.shape[1:]:
                        return whole[k]
                    if a.ndim == base.ndim and a.shape[1:] == base.shape[1:]:
                        return whole[k : k + len(a)]
        while type(base) is np.ndarray:
            base = base.base
        if (
            isinstance(base, torch.Tensor)
            and "_tokload_alloc" in base.__dict__
            and a.flags.c_contiguous
        ):
            storage = base.untyped_storage()
            at = a.__array_interface__["data"][0] - storage.data_ptr()
            if at % a.itemsize == 0 and 0 <= at <= storage.nbytes() - a.nbytes:
                # (size without stride: contiguous; the stubs lack this overload)
                return torch.empty(0, dtype=td).set_(storage, at // a.itemsize, a.shape)  # type: ignore[call-overload,no-any-return]
        # Not inside an allocation (or strided): copy into one the backend tracks.
        t = self.backend.host_empty(a.shape, td)
        t.numpy()[...] = a
        return t

    def own_copy(self, t: Any, what: str) -> torch.Tensor:
        """A view's own tensor copied into memory the backend tracks (as ``tensor``
        copies arrays ``alloc`` did not make): never the view's data itself; any
        dtype torch has (bfloat16 too), sparse ones made dense."""
        import torch

        check_host(t, what)
        t = t.detach()
        if t.layout != torch.strided:  # (sparse)
            t = t.to_dense()
        out = self.backend.host_empty(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out

    def tensors(self, raw: dict[str, Any]) -> Batch:
        """The raw arrays of a batch as tensors (other values are kept as they are;
        a torch tensor of a view's is an array: copied, as its NumPy arrays are, and
        an array in the other byte order is copied in the machine's)."""
        out = Batch()
        for k, v in raw.items():
            if not isinstance(v, np.ndarray):
                # (a records list, a number: kept; torch's classes by name, with no call)
                if v.__class__.__module__[:5] != "torch" or not is_tensor(v):
                    out[k] = v
                else:
                    out[k] = self.own_copy(v, f"the batch's {k!r}")
                continue
            try:
                out[k] = self.tensor(v)
            except (TypeError, ValueError, RuntimeError) as e:  # a dtype torch lacks
                out[k] = self._refused(k, v, e)
        return out

    def _refused(self, k: str, v: np.ndarray, e: Exception) -> torch.Tensor:
        """The tensor of an array ``tensor`` refused with ``e``: in the other byte
        order (torch has none), copied in the machine's, the same values; else the
        error, naming the key."""
        if not v.dtype.isnative:
            try:
                return self.tensor(v.astype(v.dtype.newbyteorder("=")))
            except (TypeError, ValueError, RuntimeError) as again:
                e = again
        e.add_note(f"(the batch's {k!r}: a {v.dtype} array of shape {v.shape})")
        raise e

    def copy(self, batch: Batch) -> Batch:
        """The batch on the device (or itself when there is none)."""
        return batch if self.backend.device is None else self.backend.copy(batch)

    def copy_all(self, batches: list[Batch]) -> list[Batch]:
        """The batches of one task on the device: one ``copy`` for all of them.

        The backend's per-call work (entering its stream, an event) is done once
        per task instead of once per batch; every batch's ``ready`` is the
        task's event."""
        if self.backend.device is None or len(batches) < 2:
            return [self.copy(b) for b in batches]
        merged, where = Batch(), {}
        for i, b in enumerate(batches):
            for k, v in b.items():
                key = f"{i}:{k}"
                merged[key] = v
                where[key] = (i, k)
        copied = self.backend.copy(merged)
        out = [Batch() for _ in batches]
        for key, v in copied.items():
            i, k = where[key]
            out[i][k] = v
        for b in out:
            b.ready = copied.ready
        return out

    def deliver(self, batch: Any) -> None:
        """On the trainer's thread, as ``next()`` returns the batch."""
        if isinstance(batch, Batch) and batch.ready is not None:
            self.backend.deliver(batch)
