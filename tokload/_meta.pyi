from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from tokload._io import FileSet
from tokload._rows import RowSet
from tokload._tables import ShardTables

SPAN_NONE: int
SPAN_ENTRY: int
SPAN_DTYPE: np.dtype[Any]

_Alloc: TypeAlias = Callable[[tuple[int, ...], Any], np.ndarray[Any, Any]]

# Working memory of SpanSet.read_windows, reused across batches (one per thread).
class Scratch:
    def __init__(self) -> None: ...
    def nbytes(self) -> int: ...

# The span tables (.msx block index, .mds runs) and records (.mdx, .mdb) of
# a dataset's shards (FORMAT.md, version 2).
class SpanSet:
    rows: RowSet
    block: int
    def __init__(
        self,
        rows: RowSet,
        block_files: FileSet,
        run_files: FileSet,
        index_files: FileSet,
        data_files: FileSet,
        runs: Sequence[int],
        records: Sequence[int],
        data_bytes: Sequence[int],
        block: int,
    ) -> None: ...
    # Reads the rows of windows of observations `indices` into `out` (unless None),
    # fills positions ([B, window] int32; None: made with alloc); returns (positions,
    # data uint8, offsets int64 [M + 1]), the last two made with alloc.  One call,
    # without the GIL.
    def read_windows(
        self,
        indices: npt.ArrayLike,
        first: int,
        count: int,
        stride: int,
        window: int,
        out: np.ndarray[Any, Any] | None,
        positions: npt.NDArray[np.int32] | None,
        alloc: _Alloc,
        scratch: Scratch,
    ) -> tuple[npt.NDArray[np.int32], np.ndarray[Any, Any], np.ndarray[Any, Any]]: ...

def compact_records(
    blob: npt.ArrayLike, item_blob: npt.ArrayLike, item_len: npt.ArrayLike, alloc: _Alloc
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]: ...

BLOCK_MAX: int

# The metadata blocks (.mbx block index, .msb blocks) of a dataset's shards
# (FORMAT.md, version 3); read_windows as SpanSet's, in one round of reads when
# the block index is in memory.
class BlockSet:
    rows: RowSet
    block: int
    tables: ShardTables
    index_in_memory: bool
    def __init__(
        self,
        rows: RowSet,
        index_files: FileSet,
        block_files: FileSet,
        records: Sequence[int],
        block_bytes: Sequence[int],
        block: int,
        index_in_memory: bool = True,
    ) -> None: ...
    def read_windows(
        self,
        indices: npt.ArrayLike,
        first: int,
        count: int,
        stride: int,
        window: int,
        out: np.ndarray[Any, Any] | None,
        positions: npt.NDArray[np.int32] | None,
        alloc: _Alloc,
        scratch: Scratch,
    ) -> tuple[npt.NDArray[np.int32], np.ndarray[Any, Any], np.ndarray[Any, Any]]: ...
    # several batches (windows up to cuts[k]) in one round; records per batch
    def read_window_batches(
        self,
        indices: npt.ArrayLike,
        first: int,
        count: int,
        stride: int,
        window: int,
        out: np.ndarray[Any, Any] | None,
        positions: npt.NDArray[np.int32],
        alloc: _Alloc,
        scratch: Scratch,
        cuts: npt.ArrayLike | None,
    ) -> list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]: ...
    # WILLNEED hints for the windows' blocks (or block index entries); the hints given
    def hint_windows(
        self,
        indices: npt.ArrayLike,
        first: int,
        count: int,
        stride: int,
        window: int,
        scratch: Scratch,
    ) -> int: ...
    # where a shard's block index table is not in memory (not held, or not loaded
    # yet): read the windows' entries (advised earlier), then WILLNEED hints for
    # their blocks; the hints given
    def hint_blocks_after_index(
        self,
        indices: npt.ArrayLike,
        first: int,
        count: int,
        stride: int,
        window: int,
        scratch: Scratch,
    ) -> int: ...

# A shard's runs and records as blocks; write() gets the .msb in pieces;
# returns the block index.
def encode_blocks(
    block: int,
    rows: int,
    starts: npt.ArrayLike,
    records: npt.ArrayLike,
    mdx: npt.ArrayLike,
    mdb: Any,
    write: Callable[[np.ndarray[Any, Any]], Any],
) -> np.ndarray[Any, Any]: ...

# The inverse: (starts, records, mdx, mdb) of a shard's blocks.
def decode_blocks(
    block: int,
    rows: int,
    nrec: int,
    index: npt.ArrayLike,
    msb: Any,
    index_path: str,
    where: str,
    records: bool = True,
) -> tuple[Any, Any, Any, Any]: ...
