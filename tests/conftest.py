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
