from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tokload._io import FileSet
from tokload._rows import RowSet
from tokload._tables import ShardTables

# Each document's first global row and length, read in one batch.
class ExtentIndex:
    total: int
    def extents(
        self, ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]: ...

# (starts, lengths) of document index[i] + offsets[comp[i]] of indexes[comp[i]],
# for every i, in one compiled call (a Blend's documents of many components).
def extents_many(
    indexes: tuple[ExtentIndex, ...],
    offsets: npt.ArrayLike,
    comp: npt.ArrayLike,
    index: npt.ArrayLike,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]: ...

class DocIndex(ExtentIndex):
    files: FileSet
    tables: ShardTables
    def __init__(
        self, files: FileSet, docs: npt.ArrayLike, rows: RowSet, in_memory: bool = False
    ) -> None: ...

# Where documents start inside windows `indices` of a view of `count` windows
# (observation i at row (first + i) * stride), as read_windows checks them:
# (starts, ncuts, cuts), uint64: each window's first row, the documents starting
# inside it after that row, and their first rows, window after window.
def window_cuts(
    index: ExtentIndex,
    indices: npt.ArrayLike,
    first: int,
    count: int,
    stride: int,
    window: int,
    total_rows: int,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]: ...

# The attention metadata from window_cuts' result (of one source, or gathered row
# by row from several: a Blend's): the position/segment/loss-mask arrays
# [B, window] that per_token names (made with alloc), cu_seqlens (int32) and
# max_seqlen.
def boundary_arrays(
    starts: npt.ArrayLike,
    window: int,
    ncuts: npt.ArrayLike,
    cuts: npt.ArrayLike,
    alloc: Callable[[tuple[int, ...], Any], np.ndarray[Any, Any]],
    per_token: Sequence[str] = ("position_ids", "segment_ids", "loss_mask"),
) -> tuple[dict[str, np.ndarray[Any, Any]], npt.NDArray[np.int64], int]: ...

# Documents first + ids[b] as one batch, in one call: (values, lengths, offsets)
# back to back when pack, else ([B, L] values, lengths) padded with the row `pad`.
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

# Each step's cu_seqlens from a task's (rows [a, e) of `window` tokens per step):
# the arrays back to back (int32), their offsets and each step's longest segment.
def split_cu_seqlens(
    cu: npt.ArrayLike, cuts: Sequence[tuple[int, int]], window: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...

# What is wrong with a step of `rows` rows of `window` tokens past int32 cu_seqlens.
def step_tokens_error(rows: int, window: int) -> str: ...
