"""Every code block of the README and of the guide runs as the page shows it.

The pages are ``README.md``, ``docs/index.md`` and ``docs/guide/*.md``. Each page
runs in a fresh temporary directory (its working directory), its blocks in page
order, by the kind its fence names:

- ``python``: executed; all of a page's ``python`` blocks share one namespace.
- ``python title="train.py"`` (any block whose title is a file name): written to
  that file, not run; a later ``bash`` block runs it (``torchrun ... train.py``).
- ``bash``: run by ``bash -euo pipefail`` with this interpreter's ``bin`` first on
  ``PATH`` (so ``tokload`` and ``torchrun`` are the installed ones).
- ``text``: output shown to the reader, not code.

Any other fence fails the test, so nothing a reader may copy goes unexecuted. The
README's two set-up commands install the package and run the suite itself: they
are not run here, but :func:`test_readme_setup_commands_are_what_ci_runs` checks
that ``.ci/run`` runs exactly them. The directory of a page starts empty: a
page creates what it reads, as a reader would (a Megatron-LM prefix too,
written as megatron-core writes one; ``tests/test_views.py`` reads the files
megatron-core itself wrote).
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from timeouts import no_hang

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    ROOT / "docs" / "index.md",
    *sorted((ROOT / "docs" / "guide").glob("*.md")),
]

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
TITLE = re.compile(r"""\btitle=(?:"([^"]*)"|'([^']*)'|(\S+))""")
FILE_NAME = re.compile(r"^[\w./-]+\.(py|sh|json|jsonl|txt|yaml|toml)$")
RUN_KINDS = ("python", "bash")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    title: str | None
    code: str

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, indentation (admonitions, lists) removed."""
    out: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        words = info.split(maxsplit=1)
        lang = words[0].lstrip(".{").rstrip("}") if words else ""
        title = TITLE.search(info)
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        else:
            raise AssertionError(f"{page}:{i + 1}: a code fence is never closed")
        name = next((g for g in title.groups() if g), None) if title else None
        out.append(Block(page, i + 1, lang, name, "\n".join(body) + "\n"))
        i = j + 1
    return out


def setup_blocks(readme: list[Block]) -> list[Block]:
    """The README's set-up commands: the install line and the test command."""
    found = [
        b for b in readme if b.lang == "bash" and ("pip install" in b.code or "pytest" in b.code)
    ]
    assert len(found) == 2, [b.where for b in found]
    return found


def _kind(block: Block) -> str:
    if block.title is not None and FILE_NAME.match(block.title):
        return "file"
    if block.lang in RUN_KINDS:
        return block.lang
    if block.lang == "text":
        return "output"
    raise AssertionError(
        f"{block.where}: a ```{block.lang} block is neither run nor a file the page writes;"
        " use python, bash, text, or a title naming a file"
    )


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT)).replace("/", "-").removesuffix(".md")


# The GPU page shows the loader's defaults (batches on the GPU where CUDA is): marked
# ``gpu`` so that tests/conftest.py leaves them as they are; it runs on every host.
PAGE_PARAMS = [pytest.param(p, marks=pytest.mark.gpu) if p.name == "gpu.md" else p for p in PAGES]


@pytest.fixture
def collector_as_it_was() -> Iterator[None]:
    """A page may freeze the garbage collector (the object-storage guide shows
    ``gc.freeze()``, which a page's blocks run in this process): the rest of the suite
    runs with the collector as it was."""
    frozen = gc.get_freeze_count()
    yield
    if not frozen:
        gc.unfreeze()


@pytest.mark.usefixtures("collector_as_it_was")
@pytest.mark.parametrize("page", PAGE_PARAMS, ids=_page_id)
def test_every_block_of_the_page_runs(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = blocks(page)
    skip = setup_blocks(found) if page.name == "README.md" else []
    monkeypatch.chdir(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    namespace: dict[str, object] = {"__name__": "__docs__"}
    ran = 0
    for block in found:
        kind = _kind(block)
        if block in skip or kind == "output":
            continue
        ran += 1
        if kind == "file":
            assert block.title is not None
            target = tmp_path / block.title
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code, encoding="utf-8")
        elif kind == "python":
            code = compile(block.code, block.where, "exec")
            with no_hang(120):
                exec(code, namespace)
        else:
            res = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block.code],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                stdin=subprocess.DEVNULL,
            )
            assert res.returncode == 0, (
                f"{block.where}: exit {res.returncode}\n"
                f"--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}"
            )
    if page.name != "README.md":
        assert ran > 0, f"{page}: no code block to run"


def test_readme_setup_commands_are_what_ci_runs() -> None:
    """.ci/run runs the README's set-up commands verbatim, then its test command."""
    install, tests = setup_blocks(blocks(ROOT / "README.md"))
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    for block in (install, tests):
        for line in block.code.strip().splitlines():
            assert line.strip() in (c.strip() for c in ci), (
                f"{block.where}: .ci/run does not run {line.strip()!r}"
            )


def test_the_block_parser(tmp_path: Path) -> None:
    page = tmp_path / "fences.md"
    page.write_text(
        'text\n```python\nx = 1\n```\n!!! note\n    ```python title="a.py"\n'
        "    print(1)\n    ```\n````bash\n```\n````\n",
        encoding="utf-8",
    )
    got = blocks(page)
    assert [(b.line, b.lang, b.title, b.code) for b in got] == [
        (2, "python", None, "x = 1\n"),
        (6, "python", "a.py", "print(1)\n"),
        (9, "bash", None, "```\n"),
    ]
    with pytest.raises(AssertionError, match="neither run nor a file"):
        _kind(Block(page, 1, "yaml", None, ""))


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor, as both GitHub and mkdocs' ``toc`` make it."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s", "-", text)


def test_readme_links_reach_files_and_headings() -> None:
    """The README's links into the repository and the docs all lead somewhere.

    The site's own links are checked by ``mkdocs build --strict``; the README is not
    part of the site, so its links (the ones a newcomer follows first) are checked here.
    """
    readme = ROOT / "README.md"
    targets = [t for t in LINK.findall(readme.read_text(encoding="utf-8")) if "://" not in t]
    assert targets
    for target in targets:
        path, _, anchor = target.partition("#")
        file = (readme.parent / path).resolve()
        assert file.is_file(), f"README.md links to {target}: no such file"
        if anchor:
            headings = re.findall(r"^#+\s+(.*)$", file.read_text(encoding="utf-8"), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, (
                f"README.md links to {target}: {path} has no heading with that anchor"
            )
