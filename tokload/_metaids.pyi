from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tokload._io import FileSet
from tokload._rows import RowSet

META_NONE: int
_ITEM_DTYPE: np.dtype[Any]
_SPAN_DTYPE: np.dtype[Any]

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
