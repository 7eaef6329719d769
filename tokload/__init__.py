"""tokload: feeds tokens to large-scale LLM training.

Global shuffling with nothing precomputed (``Permutation``), computed per
index in O(1) time and memory and bit-compatible with the reference ``gfc``
library; sharded datasets written by ``Writer`` (FORMAT.md) or found in
Megatron and flat-token layouts, read in constant time per observation through
the views ``TokenStream``, ``Documents`` and ``StreamWithMetadata``.  The
documentation site (``docs/``: a guide, the on-disk format, the API reference built
from these docstrings) has the whole picture; docs/ARCHITECTURE.md the invariants.
"""

from tokload import errors, tools
from tokload._permute import Permutation, epoch_seed
from tokload.batching import Fill, Pack, Pad, Stack
from tokload.builder import build
from tokload.derive import convert, merge
from tokload.errors import (
    BuildError,
    CorruptDataError,
    FormatError,
    MissingShardError,
    ObjectChangedError,
    RangesIgnoredError,
    RemoteAccessError,
    RemoteError,
    StateError,
    TokloadError,
    TruncatedFileError,
    UsageError,
)
from tokload.inputs import InputError
from tokload.interop import open_flat, open_megatron
from tokload.loader import DataLoader
from tokload.reading import ReadOptions
from tokload.source import Source, open_dataset
from tokload.views import (
    Blend,
    DocumentBatch,
    Documents,
    MetadataBatch,
    RecordList,
    StreamWithMetadata,
    TokenStream,
    split,
)
from tokload.writer import Writer

__all__ = [
    "Blend",
    "BuildError",
    "CorruptDataError",
    "DataLoader",
    "DocumentBatch",
    "Documents",
    "Fill",
    "FormatError",
    "InputError",
    "MetadataBatch",
    "MissingShardError",
    "ObjectChangedError",
    "Pack",
    "Pad",
    "Permutation",
    "RangesIgnoredError",
    "ReadOptions",
    "RecordList",
    "RemoteAccessError",
    "RemoteError",
    "Source",
    "Stack",
    "StateError",
    "StreamWithMetadata",
    "TokenStream",
    "TokloadError",
    "TruncatedFileError",
    "UsageError",
    "Writer",
    "__version__",
    "build",
    "convert",
    "epoch_seed",
    "errors",
    "merge",
    "open_dataset",
    "open_flat",
    "open_megatron",
    "split",
    "tools",
]

__version__ = "0.2.0"
