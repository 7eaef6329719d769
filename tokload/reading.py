"""How a DataLoader reads: its prefetch, its reader tasks, its I/O and read-ahead.

The one job of this module is ``ReadOptions``, the read-tuning knobs of a
``DataLoader`` grouped in one value (``DataLoader(view, B, read=ReadOptions(...))``):
none of them changes which batches a run delivers, only how early and how they
are read, and each applies to that loader alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from tokload._io import io_scope
from tokload.arguments import is_integer, positive_integer

DEFAULT_PREFETCH_BYTES = 256 << 20
"""The memory the automatic prefetch may fill per rank (256 MiB)."""


@dataclass(frozen=True)
class ReadOptions:
    """How a DataLoader reads; the batches are the same whatever these are.

    Args:
        prefetch: batches built ahead of the trainer (per rank); keep it at
            least twice ``steps_per_task`` so a task is always being built.
            Default (None): as many as ``prefetch_bytes`` of batches hold, at
            most ``tokload.tasks.MAX_AUTO_PREFETCH`` (512) and at least two
            tasks besides the one being handed out (``prefetch_bytes`` does
            not bound that floor), sized by the largest of the batches that
            begin a task (until the first is delivered, two tasks; a
            ``collate`` result with no
            arrays in dicts, lists or tuples counts as unknown: 32 batches).
            512 is sized by ``bench/bench_stall.py``: on storage that delays 1
            read in 1,000 by 200 ms, it lets 8 reader threads hide most of the
            delay from a trainer consuming half the storage's throughput (67 MB
            for batches of 8 windows of 4097 uint32 tokens).
        prefetch_bytes: the memory the automatic prefetch may fill per rank
            (default 256 MiB): host batches, or with a ``device`` that much
            device memory and the pinned host copies besides; ignored when
            ``prefetch`` is given.
        steps_per_task: consecutive steps a reader thread builds per task
            (default 16). The samples of all of them are permuted and read in
            one call each (every batching policy of documents, and ``Stack``
            of rowwise views: token streams and blends of them; a stream with
            metadata blocks in one round): the thread takes the GIL about once
            per task instead of per batch (which is what keeps the training
            thread at full speed), and the I/O engine has a whole task's reads
            to keep in flight (16 steps of 8 windows: 128 reads, what cold
            storage needs). The first task is one step, and the other tasks
            start when it is done (or after half a second), so the first batch
            waits only for its own reads.
        io: how this loader's reads run: ``"auto"`` (io_uring where the kernel
            allows it, else a pool of C threads), ``"uring"``, ``"threads"`` or
            ``"sync"``. None (default): the dataset's setting (``TOKLOAD_IO``,
            else ``"auto"``; ``view.configure_io`` changes it for every user of
            the dataset). Another loader of the same view keeps its own.
        io_depth: the reads kept in flight per read call, for this loader's
            reads only. None (default): the dataset's setting
            (``TOKLOAD_IO_DEPTH``, else the default depth; for objects in a
            store, no bound of the call's own: the process sizes the GETs it
            keeps in flight from the latency, see ``tokload.remote``).
        readahead: while the reader threads build a task, ask the view (when
            it has ``hint``: token streams and streams with metadata) to start
            reading the samples of the tasks the prefetch will reach, so a read
            the storage delays is in flight long before it is needed
            (``tokload.readahead``). None (default): on where the view's files
            are on a network or FUSE filesystem (NFS, Lustre, s3fs, ...), off
            on local disks, where the kernel's read-ahead competes with the
            reader's own reads; True / False: always / never. The loader's
            ``readahead`` attribute says what was chosen.
    """

    prefetch: int | None = None
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
    steps_per_task: int = 16
    io: str | None = None
    io_depth: int | None = None
    readahead: bool | None = None

    def __post_init__(self) -> None:
        p = self.prefetch
        if p is not None and (not is_integer(p) or p < 1):
            raise ValueError(f"prefetch must be >= 1 or None, got {p!r}")
        positive_integer("prefetch_bytes", self.prefetch_bytes)
        s = self.steps_per_task
        if not is_integer(s) or s < 1:
            raise ValueError(f"steps_per_task must be >= 1, got {s!r}")
        if self.readahead is not None and not isinstance(self.readahead, bool):  # (0 == False)
            raise ValueError(f"readahead must be None, True or False, got {self.readahead!r}")
        self.scope()  # checks io and io_depth

    def scope(self) -> io_scope | None:
        """The I/O scope this loader's reads run in (None: the dataset's settings)."""
        if self.io is None and self.io_depth is None:
            return None
        return io_scope(self.io, self.io_depth)


NAMES = tuple(f.name for f in fields(ReadOptions))
"""The ``DataLoader`` keywords that ``ReadOptions`` replaced in 0.2."""


def from_retired(read: ReadOptions | None, given: Mapping[str, Any]) -> ReadOptions:
    """``read``, with the retired ``DataLoader`` keywords ``given`` applied (a
    DeprecationWarning says how to write them); TypeError for any other keyword."""
    unknown = sorted(k for k in given if k not in NAMES)
    if unknown:
        raise TypeError(f"DataLoader() got unexpected keyword arguments: {', '.join(unknown)}")
    if read is not None and not isinstance(read, ReadOptions):
        raise TypeError(
            f"read must be a tokload.ReadOptions(...) (or None), got {read!r}: write "
            "read=tokload.ReadOptions(prefetch=..., io=...)"
        )
    base = ReadOptions() if read is None else read
    if not given:
        return base
    if read is not None:
        raise TypeError(f"give {', '.join(sorted(given))} in read=ReadOptions(...), not beside it")
    spelled = ", ".join(f"{k}={v!r}" for k, v in given.items())
    warnings.warn(
        f"DataLoader({spelled}) is retired since tokload 0.2: write "
        f"DataLoader(..., read=tokload.ReadOptions({spelled}))",
        DeprecationWarning,
        stacklevel=3,
    )
    return replace(base, **given)
