"""tokload build --ray: the same chunks as Ray tasks on a local instance (2 CPUs), the
same bytes as a local build, errors and resume as locally. Skipped without ray
(the test extra installs it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_build import dataset_files, write_corpus

from tokload import BuildError, build

ray = pytest.importorskip("ray")

KW: dict[str, Any] = {
    "keep_fields": ["id"],
    "annotations_field": "spans",
    "chunk_bytes": 3000,
    "progress": False,
}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_a_ray_build_is_byte_identical_and_resumes(local_ray: None, tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=3, docs=60)
    s_local = build(inputs, tmp_path / "local", workers=2, **KW)
    out = tmp_path / "ray"
    s_ray = build(inputs, out, ray=True, **KW)
    assert s_ray.chunks == s_local.chunks > 3 and s_ray.built == s_ray.chunks
    assert dataset_files(out) == dataset_files(tmp_path / "local")
    # two chunks lost: a re-run on Ray builds those two only, to the same bytes
    parts = sorted((out / "parts").iterdir())
    for d in (parts[1], parts[-1]):
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    s = build(inputs, out, ray=True, **KW)
    assert (s.built, s.chunks) == (2, s_local.chunks)
    assert dataset_files(out) == dataset_files(tmp_path / "local")


@pytest.mark.slow
def test_a_bad_record_in_a_ray_task_is_the_same_error(local_ray: None, tmp_path: Path) -> None:
    inputs = write_corpus(tmp_path / "in", files=2, docs=60)
    with open(inputs[1], "a") as f:
        f.write("{broken\n")
    with pytest.raises(BuildError, match=r"part-01\.jsonl:61: malformed JSON") as e:
        build(inputs, tmp_path / "ds", ray=True, **KW)
    assert "Traceback" not in str(e.value)  # the chunk's error, not Ray's wrapper
    # nothing half-written is left, and no manifest
    assert not (tmp_path / "ds" / "manifest.json").exists()
    assert not list((tmp_path / "ds" / "parts").glob("*.tmp"))
