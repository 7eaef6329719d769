import numpy as np
import numpy.typing as npt

from tokload._rows import RowSet

# Per shard, one whole file of uint64 values held in memory once a read needs it
# (read without the GIL, shared by reader threads), as it is or compressed.
class ShardTables:
    rs: RowSet
    enabled: bool
    compress: bool
    def __init__(
        self,
        rs: RowSet,
        enabled: bool,
        compress: bool = False,
        directory: npt.ArrayLike | None = None,
    ) -> None: ...
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
