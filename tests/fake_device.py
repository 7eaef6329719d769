"""A fake device for the transfer stage: asynchronous "copies" on CPU threads.

It behaves like CUDA with PyTorch's pinned-memory allocator, as far as buffer
lifetime goes, and checks every rule the loader relies on:

- ``host_empty`` hands out blocks from a pool. A block goes back to the pool
  when the last array or tensor sharing its memory is gone, and is handed out
  again only once every copy recorded on it has completed (what PyTorch's
  ``CachingHostAllocator`` does with the events of ``non_blocking`` copies).
- A copy (the loader's ``copy`` or a trainer's :meth:`FakeDevice.to_device`) must
  read memory the pool handed out and that is still alive; anything else (a
  tensor made by ``torch.from_numpy`` of some other buffer) is recorded as a
  violation, since the real allocator could not see it either.
- A copy completes after a random delay on another thread; it checks that the
  bytes it copies are those the buffer held when the copy was issued, so a
  buffer written while a copy from it is pending is recorded as a violation.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tokload.transfer import Batch


class FakeEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def set(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait(10)


class _Block:
    __slots__ = ("events", "in_use", "memory", "serial")

    def __init__(self, nbytes: int, serial: int) -> None:
        self.memory = np.empty(max(nbytes, 1), dtype=np.uint8)
        self.in_use = False
        self.events: list[FakeEvent] = []
        self.serial = serial


class _Lease:
    """Owns a block while anything shares its memory (arrays keep it as their base)."""

    def __init__(self, block: _Block, nbytes: int) -> None:
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (block.memory.__array_interface__["data"][0], False),
            "version": 3,
        }


class FakeDevice:
    """A :class:`tokload.transfer.TransferBackend` with asynchronous fake copies.

    Args:
        seed: the random delays.
        max_delay: the longest a copy takes, in seconds.
        copies: False for host batches (``device`` None): the trainer copies
            with :meth:`to_device`, as in the GPU guide's ``non_blocking`` recipe.
    """

    pinned = True

    def __init__(
        self, seed: int = 0, max_delay: float = 0.004, copies: bool = True, min_delay: float = 0.0
    ) -> None:
        self.device: Any = "fake" if copies else None
        self._rng = random.Random(seed)
        self._min_delay, self._max_delay = min_delay, max_delay
        self._lock = threading.Lock()
        self._blocks: list[_Block] = []
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="fake-copy")
        self.violations: list[str] = []
        self.copies_issued = 0
        self.reuses = 0

    # ---- host memory -------------------------------------------------------------------

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        with self._lock:
            block = next(
                (
                    b
                    for b in self._blocks
                    if not b.in_use
                    and b.memory.nbytes >= nbytes
                    and b.memory.nbytes <= 2 * nbytes + 64
                    and all(e.query() for e in b.events)
                ),
                None,
            )
            if block is None:
                block = _Block(nbytes, len(self._blocks))
                self._blocks.append(block)
            else:
                self.reuses += 1
            block.in_use = True
            block.events = []
        lease = _Lease(block, block.memory.nbytes)
        weakref.finalize(lease, self._release, block)
        flat = np.asarray(lease)[:nbytes]
        arr = flat.view(torch.empty(0, dtype=dtype).numpy().dtype).reshape(shape)
        return torch.from_numpy(arr)

    def _release(self, block: _Block) -> None:
        with self._lock:
            block.in_use = False

    def _block_of(self, t: torch.Tensor) -> _Block | None:
        """The block of t's storage, found as PyTorch finds it: by the storage's start.

        (PyTorch looks a copy's host memory up by the storage's allocator context,
        or else by the exact start pointer; a tensor made by ``from_numpy`` of a
        slice has a storage of its own starting inside a block, and is lost.)
        """
        start = t.untyped_storage().data_ptr()
        with self._lock:
            for b in self._blocks:
                if b.in_use and b.memory.__array_interface__["data"][0] == start:
                    return b
        return None

    # ---- copies ----------------------------------------------------------------------------

    def _copy_async(self, t: torch.Tensor, event: FakeEvent, then: Any = None) -> torch.Tensor:
        block = self._block_of(t)
        if block is None:
            self.violations.append(
                f"copy from host memory the allocator does not track ({t.shape}, {t.dtype})"
            )
        else:
            with self._lock:
                block.events.append(event)
        src = t.contiguous()
        want = hashlib.blake2b(src.numpy().tobytes()).digest()
        dst = torch.empty_like(src)
        with self._lock:
            delay = self._rng.uniform(self._min_delay, self._max_delay)
            self.copies_issued += 1

        def run() -> None:
            time.sleep(delay)
            dst.copy_(src)
            if hashlib.blake2b(dst.numpy().tobytes()).digest() != want:
                self.violations.append(
                    f"a host buffer ({t.shape}, {t.dtype}) was written while a copy from it "
                    "was pending"
                )
            event.set()
            if then is not None:
                then()

        self._pool.submit(run)
        return dst

    def copy(self, batch: Batch) -> Batch:
        tensors = [k for k, v in batch.items() if isinstance(v, torch.Tensor)]
        ready = FakeEvent()
        left = [len(tensors)]
        lock = threading.Lock()

        def one_done() -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    ready.set()

        out = Batch(batch)
        for k in tensors:
            out[k] = self._copy_async(batch[k], FakeEvent(), one_done)
        if not tensors:
            ready.set()
        out.ready = ready
        return out

    def to_device(self, t: torch.Tensor) -> tuple[torch.Tensor, FakeEvent]:
        """A trainer's ``t.to(device, non_blocking=True)``: the copy and its event."""
        e = FakeEvent()
        return self._copy_async(t, e), e

    def deliver(self, batch: Batch) -> None:
        batch.ready.synchronize()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
