"""Tests give the same results on hosts with and without CUDA.

The DataLoader's defaults (``pin_memory="auto"``, ``device="auto"``) deliver
batches on this rank's GPU where CUDA is available. Tests not marked ``gpu``
check the loader's logic on host batches and compare them with NumPy, so on a
CUDA host ``device="auto"`` resolves to no device for them (pinning stays
``"auto"``: their host batches are pinned, as a trainer's would be). The device
path is tested on every machine by ``tests/test_transfer.py`` (a fake device)
and on a real GPU by ``tests/test_gpu.py`` (and the GPU guide's examples,
``tests/test_docs.py``, which run on every host).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tokload.loader
from tokload.transfer import make_backend


@pytest.fixture(autouse=True)
def _host_batches_unless_marked_gpu(request: pytest.FixtureRequest) -> Iterator[None]:
    # Not monkeypatch: requesting it here would tear it down after the tests' own
    # fixtures, which may read the environment it restores.
    if not torch.cuda.is_available() or request.node.get_closest_marker("gpu") is not None:
        yield
        return

    def host_make_backend(pin_memory: bool | str, device: Any) -> Any:
        return make_backend(pin_memory, None if device == "auto" else device)

    setattr(tokload.loader, "make_backend", host_make_backend)  # noqa: B010
    try:
        yield
    finally:
        setattr(tokload.loader, "make_backend", make_backend)  # noqa: B010


LEFT_BEHIND_LIMIT = 16 << 20
"""The most disk (allocated, not apparent) one file may keep in pytest's temporary
directory after the run: pytest keeps the last three runs' directories."""


def _large_files(top: os.PathLike[str] | str) -> list[tuple[str, int]]:
    """The files under ``top`` holding more than LEFT_BEHIND_LIMIT bytes of blocks."""
    large = []
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_blocks * 512 > LEFT_BEHIND_LIMIT:
                large.append((path, st.st_blocks * 512))
    return large


@pytest.fixture(autouse=True)
def _large_files_removed(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, the large files in its ``tmp_path`` go: pytest keeps the
    directories of the last three runs, and nobody reads a test's 30 MB input there."""
    yield
    tmp = getattr(request.node, "funcargs", {}).get("tmp_path")  # (torn down before us)
    if tmp is not None:
        for path, _ in _large_files(tmp):
            with contextlib.suppress(OSError):
                os.unlink(path)


@pytest.fixture(scope="session", autouse=True)
def _nothing_large_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fail the run when a file of more than 16 MB is left on disk in pytest's temporary
    directory (a sparse file counts by the blocks it holds): a module's or session's
    fixture that makes one removes it in its own teardown."""
    yield
    large = [
        f"{path} ({size / 2**20:.0f} MB)"
        for path, size in _large_files(tmp_path_factory.getbasetemp())
    ]
    if large:
        pytest.fail(
            f"tests left {len(large)} large files behind: {', '.join(sorted(large)[:10])}",
            pytrace=False,
        )
