"""tokload build --ray: the same chunks as Ray tasks on a local instance (2 CPUs), the
same bytes as a local build, errors and resume as locally. Skipped without ray
(the test extra installs it).

Each scenario runs in a child process of its own session: Ray starts daemons and
handles signals in the driver, and a driver that Ray brings down must not take the
test session with it (seen once in CI: pytest ended mid-file without a summary).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent

PRELUDE = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from pathlib import Path
import ray
from test_build import dataset_files, write_corpus
from tokload import BuildError, build

KW = {{"keep_fields": ["id"], "annotations_field": "spans", "chunk_bytes": 3000,
      "progress": False}}
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
tmp = Path(sys.argv[1])
"""


def run_driver(body: str, tmp_path: Path) -> str:
    """Run PRELUDE + body as a Ray driver in a new session; its stdout.

    ``CHECKED`` is printed once every assertion of ``body`` has passed, then
    the driver must shut Ray down and exit cleanly. (Ray's core used to abort
    the driver after a failed build, during it or in ``ray.shutdown()``, in
    about one run in eight: the build cancelled the task that had just failed
    as well as the unfinished ones. ``_run_ray`` cancels the unfinished ones
    only.)
    """
    code = (
        PRELUDE
        + textwrap.dedent(body)
        + "\nprint('CHECKED', flush=True)\nray.shutdown()\nprint('DONE', flush=True)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    report = (p.returncode, p.stdout, p.stderr[-3000:])
    assert "CHECKED" in p.stdout, report
    assert p.returncode == 0 and "DONE" in p.stdout, report
    return p.stdout


@pytest.mark.slow
def test_a_ray_build_is_byte_identical_and_resumes(tmp_path: Path) -> None:
    out = run_driver(
        """
        inputs = write_corpus(tmp / "in", files=3, docs=60)
        s_local = build(inputs, tmp / "local", workers=2, **KW)
        out = tmp / "ray"
        s_ray = build(inputs, out, ray=True, **KW)
        assert s_ray.chunks == s_local.chunks > 3 and s_ray.built == s_ray.chunks
        assert dataset_files(out) == dataset_files(tmp / "local")
        # two chunks lost: a re-run on Ray builds those two only, to the same bytes
        parts = sorted((out / "parts").iterdir())
        for d in (parts[1], parts[-1]):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        s = build(inputs, out, ray=True, **KW)
        assert (s.built, s.chunks) == (2, s_local.chunks), (s.built, s.chunks)
        assert dataset_files(out) == dataset_files(tmp / "local")
        print("chunks", s_local.chunks)
        """,
        tmp_path,
    )
    assert "chunks" in out


@pytest.mark.slow
def test_a_bad_record_in_a_ray_task_is_the_same_error(tmp_path: Path) -> None:
    out = run_driver(
        """
        inputs = write_corpus(tmp / "in", files=2, docs=60)
        with open(inputs[1], "a") as f:
            f.write("{broken\\n")
        try:
            build(inputs, tmp / "ds", ray=True, **KW)
        except BuildError as e:
            print("ERROR", str(e))
        else:
            raise AssertionError("the bad record was not reported")
        # nothing half-written is left, and no manifest
        assert not (tmp / "ds" / "manifest.json").exists()
        assert not list((tmp / "ds" / "parts").glob("*.tmp"))
        """,
        tmp_path,
    )
    (line,) = [ln for ln in out.splitlines() if ln.startswith("ERROR ")]
    assert "part-01.jsonl:61: malformed JSON" in line
    assert "Traceback" not in line  # the chunk's error, not Ray's wrapper
