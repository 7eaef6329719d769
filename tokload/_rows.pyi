from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tokload._io import FileSet

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
        out: np.ndarray[Any, Any] | bytearray | memoryview,
    ) -> None: ...
    def hint_windows(
        self, indices: npt.ArrayLike, first: int, count: int, stride: int, window: int
    ) -> int: ...
    # WILLNEED hints for rows [starts[i], starts[i] + lengths[i]); the hints given
    def hint_ranges(self, starts: npt.ArrayLike, lengths: npt.ArrayLike) -> int: ...

# Row sets of one row size read as one part of read_ranges: range i from sets[which[i]].
class RowSets:
    sets: tuple[RowSet, ...]
    row_bytes: int
    def __init__(self, sets: Iterable[RowSet]) -> None: ...
    def __len__(self) -> int: ...
    def at(self, which: npt.ArrayLike) -> Gather: ...

class Gather:
    sets: RowSets
    which: npt.NDArray[np.int64]

def split_fields(
    rows: np.ndarray[Any, Any] | bytes | bytearray | memoryview,
    nrows: int,
    row_bytes: int,
    offsets: Sequence[int],
    sizes: Sequence[int],
    outs: Sequence[np.ndarray[Any, Any]],
) -> None: ...

# RowSet.read of several row sets, in one engine call per backend: parts are
# (target, starts, lengths, dst_offsets, out), the target a RowSet or RowSets.at(which).
def read_ranges(
    parts: Sequence[tuple[RowSet | Gather, npt.ArrayLike, npt.ArrayLike, npt.ArrayLike, Any]],
) -> None: ...
