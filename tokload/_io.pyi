import os
from collections.abc import Sequence
from typing import Any, Self

IO_CHOICES: tuple[str, ...]  # "auto", "uring", "threads", "sync"
DEFAULT_QUEUE_DEPTH: int
MAX_QUEUE_DEPTH: int
FAULTS_BUILT: bool  # a debug build: _set_fault_injection works

# Bound tokload's open descriptors, process-wide (None: the default,
# TOKLOAD_MAX_OPEN_FILES or min(256, soft RLIMIT_NOFILE // 4)).
def set_max_open_files(n: int | None = None) -> None: ...
def max_open_files() -> int: ...

# Descriptors tokload holds open now, all datasets together.
def open_files() -> int: ...
def uring_available() -> bool: ...
def uring_error() -> str | None: ...

# "uring", "threads" or "sync": what io ("auto", "uring", "threads", "sync";
# None: TOKLOAD_IO, else "auto") selects here.
def resolve_io(io: str | None = None) -> str: ...
def checked_io_settings(
    io: str | None = None, queue_depth: int | None = None
) -> tuple[str | None, int | None]: ...

# ``with io_scope(io, queue_depth):`` this thread's reads use that backend and
# depth whatever each FileSet's settings (None: the FileSet's); scopes nest.
class io_scope:
    value: tuple[int, int]
    def __init__(self, io: str | None = None, queue_depth: int | None = None) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> bool: ...

# TOKLOAD_IO_DEPTH if set, else DEFAULT_QUEUE_DEPTH.
def default_queue_depth() -> int: ...

# Process-wide totals of tokload's reads: calls, requests, bytes, failed
# (int) and seconds (float, summed over threads).
def io_counters() -> dict[str, float]: ...
def _pool_threads() -> int: ...

# Debug builds only (RuntimeError otherwise): a fraction `rate` of read
# attempts, on every backend, return the given kinds of fault.
def _set_fault_injection(
    seed: int = 0, rate: float = 0.0, kinds: Sequence[str] = ("short", "eintr", "eagain", "eio")
) -> None: ...

# Debug builds only (RuntimeError otherwise): an io_uring batch submits at most
# `n` reads, then io_uring_enter fails with errno `code` (waits: the calls that
# only wait fail too); n < 0 switches it off.
def _debug_fail_enter_after(n: int, code: int = ..., waits: bool = False) -> None: ...

# Rings destroyed as broken, and the reads the kernel still had in them when
# their batch returned (summed).
def _debug_uring_broken() -> dict[str, int]: ...

# Files read through the I/O engine, opened lazily, descriptors bounded
# process-wide.  io: "auto" | "uring" | "threads" | "sync" (None: TOKLOAD_IO,
# else "auto"); queue_depth: reads in flight per batch, 1 to MAX_QUEUE_DEPTH
# (None: TOKLOAD_IO_DEPTH, else DEFAULT_QUEUE_DEPTH).
class FileSet:
    paths: list[str]
    nfiles: int
    remote: list[Any] | None
    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        bases: Sequence[int] | None = None,
        *,
        io: str | None = None,
        queue_depth: int | None = None,
        remote: Sequence[Any] | None = None,
        known: Sequence[tuple[int, int, int] | None] | None = None,
    ) -> None: ...
    def configure(self, io: str | None = None, queue_depth: int | None = None) -> None: ...
    @property
    def io(self) -> str: ...
    @property
    def queue_depth(self) -> int: ...
    def close(self) -> None: ...
    def fds(self) -> list[int]: ...
