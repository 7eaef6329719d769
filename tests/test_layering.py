"""The layering rules of ARCHITECTURE.md, checked on the sources."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADERS = sorted((ROOT / "csrc" / "tokload").glob("*.h"))
PYX = sorted((ROOT / "tokload").glob("_*.pyx"))


def test_there_is_something_to_check() -> None:
    assert HEADERS and PYX


@pytest.mark.parametrize("header", HEADERS, ids=lambda p: p.name)
def test_c_headers_are_pure(header: Path) -> None:
    text = header.read_text()
    assert "Python.h" not in text and "Py_" not in text, "no Python API in csrc/"
    for banned in (
        r"\bmalloc\s*\(",
        r"\bcalloc\s*\(",
        r"\bfree\s*\(",
        r"\bprintf\s*\(",
        r"\bexit\s*\(",
    ):
        assert not re.search(banned, text), f"{header.name} must not call {banned}"
    guard = "TOKLOAD_" + header.stem.upper() + "_H"
    assert f"#ifndef {guard}" in text and f"#define {guard}" in text


@pytest.mark.parametrize("header", HEADERS, ids=lambda p: p.name)
def test_c_headers_compile_alone(header: Path) -> None:
    cc = subprocess.run(
        [
            "cc",
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-x",
            "c",
            "-I",
            str(ROOT / "csrc"),
            str(header),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cc.returncode == 0, cc.stderr


@pytest.mark.parametrize("pyx", PYX, ids=lambda p: p.name)
def test_compiled_modules_have_stubs_and_no_torch(pyx: Path) -> None:
    assert pyx.with_suffix(".pyi").exists(), f"{pyx.name} needs a .pyi stub"
    assert not re.search(r"^\s*(import|from)\s+torch", pyx.read_text(), re.M)


def test_compiled_modules_never_import_torch() -> None:
    code = (
        "import sys, tokload; "
        + "; ".join(f"import tokload.{p.stem}" for p in PYX)
        + "; assert 'torch' not in sys.modules, 'a compiled module imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_c_declaration_states_its_exception_behaviour() -> None:
    # Everything in _lib.pxd is declared nogil; a function without noexcept or
    # except would re-take the GIL after each call to check for an exception.
    text = re.sub(r"#.*", "", (ROOT / "tokload" / "_lib.pxd").read_text())
    decls = re.findall(r"\b(tl_\w+)\(([^)]*)\)\s*(noexcept|except\b)?", text)
    assert len(decls) >= 10
    missing = [name for name, _args, spec in decls if not spec]
    assert not missing, f"declare noexcept or except: {missing}"


@pytest.mark.parametrize("header", HEADERS, ids=lambda p: p.name)
def test_headers_name_their_cython_mirror(header: Path) -> None:
    if header.name == "common.h":
        return
    text = header.read_text()
    assert "tokload/_lib.pxd" in text
    lib = (ROOT / "tokload" / "_lib.pxd").read_text()
    assert f'cdef extern from "tokload/{header.name}"' in lib


@pytest.mark.parametrize("pyx", PYX, ids=lambda p: p.name)
def test_no_compiled_code_takes_the_gil_back_inside_a_nogil_section(pyx: Path) -> None:
    """C never calls into Python: the remote backend hands its batches to the fetcher
    and waits (csrc/tokload/handoff.h) instead of taking the GIL inside the engine."""
    assert not re.search(r"\bwith\s+gil\b", pyx.read_text()), f"{pyx.name}: `with gil`"


def test_only_the_client_module_knows_the_object_store_client() -> None:
    """``tokload.remote.client`` is the one module that imports obstore (its requests,
    credentials, and what its exceptions mean): another client is one module."""
    importers = sorted(
        str(p.relative_to(ROOT))
        for p in [*(ROOT / "tokload").rglob("*.py"), *(ROOT / "tokload").glob("*.pyx")]
        if re.search(r"^\s*(import|from)\s+obstore\b", p.read_text(), re.M)
    )
    assert importers == ["tokload/remote/client.py"]


def test_the_remote_modules_import_no_module_that_imports_them() -> None:
    """The remote package has no import cycle: each module imports only modules
    listed before it in this order (the fetcher's loop is told what serves its
    batches, ``loop.serve_batches``, instead of importing the fetcher)."""
    order = ["urls", "client", "store", "failures", "loop", "objects", "fetch"]
    for k, name in enumerate(order):
        text = (ROOT / "tokload" / "remote" / f"{name}.py").read_text()
        used = set(re.findall(r"^from tokload\.remote(?:\.(\w+))? import (.+)$", text, re.M))
        for module, names in used:
            imported = [module] if module else [n.strip() for n in names.split(",")]
            for m in imported:
                assert m in order[:k], f"remote/{name}.py imports remote/{m}.py"
