from tokload._docindex import ExtentIndex
from tokload._io import FileSet

class MegatronIndex(ExtentIndex):
    file: FileSet
    in_memory: bool
    def __init__(
        self,
        file: FileSet,
        nseq: int,
        len_off: int,
        ptr_off: int,
        itemsize: int,
        bin_rows: int,
        in_memory: bool = False,
    ) -> None: ...
    def check_sorted(self) -> None: ...
