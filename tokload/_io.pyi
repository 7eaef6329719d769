import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

META_NONE: int
_ITEM_DTYPE: np.dtype[Any]
_SPAN_DTYPE: np.dtype[Any]

class FileSet:
    paths: list[str]
    nfiles: int
    def __init__(
        self, paths: Sequence[str | os.PathLike[str]], bases: Sequence[int] | None = None
    ) -> None: ...
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

def split_fields(
    rows: np.ndarray[Any, Any] | bytes | bytearray | memoryview,
    nrows: int,
    row_bytes: int,
    offsets: Sequence[int],
    sizes: Sequence[int],
    outs: Sequence[np.ndarray[Any, Any]],
) -> None: ...

class DocIndex:
    files: FileSet
    total: int
    def __init__(self, files: FileSet, docs: npt.ArrayLike, rows: RowSet) -> None: ...
    def extents(
        self, ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]: ...

class MegatronIndex:
    file: FileSet
    total: int
    def __init__(
        self,
        file: FileSet,
        nseq: int,
        len_off: int,
        ptr_off: int,
        itemsize: int,
        bin_rows: int,
    ) -> None: ...
    def extents(
        self, ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]: ...

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
