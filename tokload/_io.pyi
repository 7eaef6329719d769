import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

META_NONE: int
_ITEM_DTYPE: np.dtype[Any]
_SPAN_DTYPE: np.dtype[Any]

IO_CHOICES: tuple[str, ...]  # "auto", "uring", "threads", "sync"
DEFAULT_QUEUE_DEPTH: int
MAX_QUEUE_DEPTH: int
FAULTS_BUILT: bool  # a debug build: _set_fault_injection works

# Bound tokload's open descriptors, process-wide (None: the default,
# TOKLOAD_MAX_OPEN_FILES or min(256, soft RLIMIT_NOFILE // 4)).
def set_max_open_files(n: int | None = None) -> None: ...
def max_open_files() -> int: ...

# Descriptors tokload holds open now, all datasets together.
def open_files() -> int: ...
def uring_available() -> bool: ...
def uring_error() -> str | None: ...

# "uring", "threads" or "sync": what io ("auto", "uring", "threads", "sync";
# None: TOKLOAD_IO, else "auto") selects here.
def resolve_io(io: str | None = None) -> str: ...

# TOKLOAD_IO_DEPTH if set, else DEFAULT_QUEUE_DEPTH.
def default_queue_depth() -> int: ...

# Process-wide totals of tokload's reads: calls, requests, bytes, failed
# (int) and seconds (float, summed over threads).
def io_counters() -> dict[str, float]: ...
def _pool_threads() -> int: ...

# Debug builds only (RuntimeError otherwise): a fraction `rate` of read
# attempts, on every backend, return the given kinds of fault.
def _set_fault_injection(
    seed: int = 0, rate: float = 0.0, kinds: Sequence[str] = ("short", "eintr", "eagain", "eio")
) -> None: ...

# Files read through the I/O engine, opened lazily, descriptors bounded
# process-wide.  io: "auto" | "uring" | "threads" | "sync" (None: TOKLOAD_IO,
# else "auto"); queue_depth: reads in flight per batch, 1 to MAX_QUEUE_DEPTH
# (None: TOKLOAD_IO_DEPTH, else DEFAULT_QUEUE_DEPTH).
class FileSet:
    paths: list[str]
    nfiles: int
    remote: list[Any] | None
    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        bases: Sequence[int] | None = None,
        *,
        io: str | None = None,
        queue_depth: int | None = None,
        remote: Sequence[Any] | None = None,
    ) -> None: ...
    def configure(self, io: str | None = None, queue_depth: int | None = None) -> None: ...
    @property
    def io(self) -> str: ...
    @property
    def queue_depth(self) -> int: ...
    def close(self) -> None: ...
    def fds(self) -> list[int]: ...

class RowSet:
    files: FileSet
    total: int
    def __init__(self, files: FileSet, rows: npt.ArrayLike, row_bytes: int) -> None: ...
    @property
    def cum(self) -> npt.NDArray[np.uint64]: ...
    @property
    def row_bytes(self) -> int: ...
    def locate(self, row: int) -> int: ...
    def plan(self, start: int, count: int) -> list[tuple[int, int, int, int]]: ...
    def read(
        self,
        starts: npt.ArrayLike,
        lengths: npt.ArrayLike,
        dst_offsets: npt.ArrayLike,
        out: np.ndarray[Any, Any] | bytearray | memoryview,
    ) -> None: ...
    def read_windows(
        self,
        indices: npt.ArrayLike,
        first: int,
        count: int,
        stride: int,
        window: int,
        out: np.ndarray[Any, Any],
    ) -> None: ...
    def hint_windows(
        self, indices: npt.ArrayLike, first: int, count: int, stride: int, window: int
    ) -> int: ...
    # WILLNEED hints for rows [starts[i], starts[i] + lengths[i]); the hints given
    def hint_ranges(self, starts: npt.ArrayLike, lengths: npt.ArrayLike) -> int: ...

def split_fields(
    rows: np.ndarray[Any, Any] | bytes | bytearray | memoryview,
    nrows: int,
    row_bytes: int,
    offsets: Sequence[int],
    sizes: Sequence[int],
    outs: Sequence[np.ndarray[Any, Any]],
) -> None: ...

# Each document's first global row and length, read in one batch.
class ExtentIndex:
    total: int
    def extents(
        self, ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]: ...

# Per shard, one whole file of uint64 values held in memory once a read needs it
# (read without the GIL, shared by reader threads), as it is or compressed.
class ShardTables:
    rs: RowSet
    enabled: bool
    compress: bool
    def __init__(self, rs: RowSet, enabled: bool, compress: bool = False) -> None: ...
    def loaded(self) -> list[int]: ...
    def held_bytes(self) -> int: ...

# The least bytes of a compressed table of n entries (about 2.1 bytes an entry).
def compressed_table_bytes(n: int) -> int: ...

# One table as ShardTables(compress=True) holds it.
class CompressedTable:
    n: int
    nbytes: int
    full_groups: int
    def __init__(self, entries: npt.ArrayLike) -> None: ...
    def decode(self, first: int, count: int) -> npt.NDArray[np.uint64]: ...

class DocIndex(ExtentIndex):
    files: FileSet
    tables: ShardTables
    def __init__(
        self, files: FileSet, docs: npt.ArrayLike, rows: RowSet, in_memory: bool = False
    ) -> None: ...

class MegatronIndex(ExtentIndex):
    file: FileSet
    def __init__(
        self,
        file: FileSet,
        nseq: int,
        len_off: int,
        ptr_off: int,
        itemsize: int,
        bin_rows: int,
    ) -> None: ...

# Documents first + ids[b] as one batch, in one call: (values, lengths, offsets)
# back to back when pack, else ([B, L] values, lengths) padded with the row `pad`.
# Attention metadata of observations `indices` of a view of `count` windows
# (observation i at row (first + i) * stride), as read_windows checks them: the
# position/segment/loss-mask arrays [B, window] that per_token names (made with
# alloc), cu_seqlens
# (int32) and max_seqlen.
def window_boundaries(
    index: ExtentIndex,
    indices: npt.ArrayLike,
    first: int,
    count: int,
    stride: int,
    window: int,
    total_rows: int,
    alloc: Callable[[tuple[int, ...], Any], np.ndarray[Any, Any]],
    per_token: Sequence[str] = ("position_ids", "segment_ids", "loss_mask"),
) -> tuple[dict[str, np.ndarray[Any, Any]], npt.NDArray[np.int32], int]: ...
def read_documents(
    index: ExtentIndex,
    rows: RowSet,
    ids: npt.ArrayLike,
    first: int,
    count: int,
    dtype: Any,
    pack: bool,
    length: int | None,
    pad: bytes,
    alloc: Callable[[tuple[int, ...], Any], np.ndarray[Any, Any]],
) -> tuple[np.ndarray[Any, Any], ...]: ...

class MetaSet:
    index_files: FileSet
    data_files: FileSet
    rows: RowSet
    def __init__(
        self,
        index_files: FileSet,
        data_files: FileSet,
        records: Sequence[int],
        data_bytes: Sequence[int],
        rows: RowSet,
    ) -> None: ...
    def gather(
        self,
        starts: npt.ArrayLike,
        window: int,
        ids: npt.NDArray[np.uint32],
        positions: npt.NDArray[np.int32],
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]: ...
    def read(self, spans: np.ndarray[Any, Any], out: npt.NDArray[np.uint8]) -> None: ...
