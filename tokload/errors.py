"""tokload's exceptions.

Every problem with a dataset's files raises a subclass of ``TokloadError``
whose message names the file and the offending value.  The classes also
derive from the built-in exception a caller would expect (``ValueError``,
``OSError``, ``FileNotFoundError``), so generic handlers still work.
"""

from __future__ import annotations


class TokloadError(Exception):
    """Base class of tokload's own exceptions."""


class FormatError(TokloadError, ValueError):
    """A dataset's manifest or files are not what the format requires
    (unknown version, sizes that disagree with the manifest, bad dtype)."""


class CorruptDataError(FormatError):
    """An index disagrees with the data it indexes (offsets decreasing or past
    the end, a metadata id past its index)."""


class MissingShardError(TokloadError, FileNotFoundError):
    """A file the manifest lists is not there."""


class TruncatedFileError(TokloadError, OSError):
    """A file ended before the data the manifest promised (it shrank after
    the dataset was opened, or was never fully written)."""


class StateError(TokloadError, ValueError):
    """A saved loader state does not belong to this dataset or configuration."""


__all__ = [
    "CorruptDataError",
    "FormatError",
    "MissingShardError",
    "StateError",
    "TokloadError",
    "TruncatedFileError",
]
