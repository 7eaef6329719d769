from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

MAX_WINDOW: int

# Best-fit decreasing into rows of `window`: (order, starts), row k holds
# documents order[starts[k]:starts[k + 1]].
def best_fit(
    lengths: npt.ArrayLike, window: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...

# Rows greedy packing (in order, a new row when the next does not fit) fills.
def greedy_rows(lengths: npt.ArrayLike, window: int) -> int: ...

# Byte offsets of each document in a [rows, window] array of itemsize-byte tokens.
def row_offsets(
    lengths: npt.ArrayLike, counts: npt.ArrayLike, window: int, itemsize: int
) -> npt.NDArray[np.uint64]: ...

# Position/segment/loss-mask arrays [rows, window], cu_seqlens (int32), max_seqlen.
# One rank's rows of consecutive parts of packed groups:
# (positions, ids, starts, lengths, counts, extra).
def gather_rows(
    parts: Sequence[tuple[int, Any, Any, Any, Any, int, int, tuple[Any, ...]]],
    rank: int,
    world_size: int,
) -> tuple[
    npt.NDArray[np.uint64],
    npt.NDArray[np.int64],
    npt.NDArray[np.uint64],
    npt.NDArray[np.uint64],
    npt.NDArray[np.int64],
    tuple[npt.NDArray[np.int64], ...],
]: ...

# Sets each row's elements after its documents to value.
def pad_rows(
    out: npt.NDArray[Any], lengths: npt.ArrayLike, counts: npt.ArrayLike, window: int, value: Any
) -> None: ...
def row_boundaries(
    lengths: npt.ArrayLike,
    counts: npt.ArrayLike,
    window: int,
    alloc: Callable[[tuple[int, ...], Any], np.ndarray],
    per_token: Sequence[str] = ...,
) -> tuple[dict[str, np.ndarray], npt.NDArray[np.int64], int]: ...
