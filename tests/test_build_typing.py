"""After the README's install, a user's own script type-checks against tokload.

mypy must find the installed package (``tokload/py.typed`` marks it typed)
and read its annotations: the script below has one deliberate type error
that mypy can only report if it sees the return type of ``len(TokenStream)``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import tokload

SCRIPT = """\
import tokload

view = tokload.TokenStream("corpus", window=8)
size: str = len(view)
"""

# torch and numpy are followed but not analysed, which keeps this to seconds.
CONFIG = """\
[mypy]
strict = True
[mypy-torch.*]
follow_imports = skip
[mypy-numpy.*]
follow_imports = skip
"""


def test_the_package_is_marked_typed() -> None:
    assert (Path(tokload.__file__).parent / "py.typed").is_file()


def _importable_by_path(cwd: Path) -> bool:
    """Whether a fresh interpreter in ``cwd`` has tokload's parent directory on
    ``sys.path`` (site-packages, or a path a .pth file adds), which is where mypy
    looks; an import hook, as setuptools' default editable install uses, is not."""
    p = subprocess.run(
        [sys.executable, "-c", "import sys; print('\\n'.join(sys.path))"],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=True,
    )
    parent = Path(tokload.__file__).resolve().parent.parent
    return any(line and Path(line).resolve() == parent for line in p.stdout.splitlines())


def test_mypy_checks_a_user_script_against_tokload(tmp_path: Path) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")
    if not _importable_by_path(tmp_path):
        pytest.xfail(
            "tokload is installed through setuptools' editable import hook, which mypy "
            'cannot follow; pyproject.toml needs package-dir = {"" = "."} under '
            "[tool.setuptools] (then the editable install is a static .pth path)"
        )
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "mypy.ini").write_text(CONFIG)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--no-incremental",
            "script.py",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # outside the repository: only the installed package can be found
    )
    assert "Cannot find implementation or library stub" not in p.stdout
    assert p.stdout.splitlines() == [
        'script.py:4: error: Incompatible types in assignment (expression has type "int", '
        'variable has type "str")  [assignment]',
        "Found 1 error in 1 file (checked 1 source file)",
    ]
    assert p.returncode == 1
