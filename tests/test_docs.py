"""The README and the pages under docs/ say what is true: every Python snippet runs as written.

Each ```python block of ``README.md`` and ``docs/*.md`` is one case. The HTML comment right
before a block says how it runs (nothing: it runs alone):

- ``<!-- doctest: prelude NAME -->``: after ``tests/doc_preludes/NAME.py``, which defines the
  names a page takes for granted (``model``, ``opt``, a ``loader``) and nothing of nebula_ckpt;
- ``<!-- doctest: example PATH -->``: the block is the file PATH (after its docstring), which
  another test runs;
- ``<!-- doctest: skip REASON -->``: the block needs what a test machine does not have (a cloud
  account, several hosts); it is still compiled, and every attribute it reads from nebula_ckpt,
  through the imports it makes itself, must exist.

A snippet runs in a fresh process in a temporary folder; the absolute example roots it names
(``/ckpt/...``, ``/shared/...``, ``/nvme/...``) are moved under that folder.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRELUDES = Path(__file__).resolve().parent / "doc_preludes"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!--\s*doctest:\s*(?P<directive>[^>]*?)\s*-->[ \t]*\n[ \t]*)?```python\n(?P<code>.*?)```",
                    re.S)
_ROOTS = re.compile(r"([\"'])/(ckpt|shared|nvme)/")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    code: str
    directive: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def snippets() -> list[Snippet]:
    """Every ```python block of the user-facing pages, with the directive before it."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            line = text[: m.start("code")].count("\n") + 1
            out.append(Snippet(page, line, textwrap.dedent(m.group("code")), (m.group("directive") or "").strip()))
    return out


ALL = snippets()


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, NEBULA_SHM_DIR=os.environ.get("NEBULA_SHM_DIR", "/dev/shm"))


def _run(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    script = cwd / "snippet.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_every_snippet_has_a_known_directive() -> None:
    assert len(ALL) >= 8, "the pages hold fewer Python snippets than expected: did the parser break?"
    for s in ALL:
        kind = s.directive.split(" ", 1)[0] if s.directive else "run"
        assert kind in {"run", "prelude", "example", "skip"}, f"{s.id}: unknown doctest directive {s.directive!r}"
        if kind == "skip":
            assert len(s.directive.split(" ", 1)) == 2, f"{s.id}: a skipped snippet must say why"
        if kind == "prelude":
            assert (PRELUDES / f"{s.directive.split()[1]}.py").is_file(), f"{s.id}: no prelude {s.directive}"


@pytest.mark.parametrize("snippet", [s for s in ALL if not s.directive or s.directive.startswith("prelude")],
                         ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    code = _ROOTS.sub(lambda m: f"{m.group(1)}{tmp_path}/{m.group(2)}/", snippet.code)
    if snippet.directive:
        code = (PRELUDES / f"{snippet.directive.split()[1]}.py").read_text() + "\n" + code
    res = _run(code, tmp_path)
    assert res.returncode == 0, f"{snippet.id} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


@pytest.mark.parametrize("snippet", [s for s in ALL if s.directive.startswith("example")], ids=lambda s: s.id)
def test_snippet_is_its_example(snippet: Snippet) -> None:
    path = REPO / snippet.directive.split()[1]
    body = ast.get_docstring(ast.parse(path.read_text()))
    text = path.read_text()
    if body is not None:  # drop the module docstring: the page explains the example in prose
        end = text.index('"""', text.index('"""') + 3) + 3
        text = text[end:]
    assert snippet.code.strip() == text.strip(), f"{snippet.id} differs from {path.name}: keep them the same"


def _nebula_reads(code: str) -> str:
    """A program that resolves every attribute chain the snippet reads from nebula_ckpt, with only
    the imports the snippet makes itself (``nc`` and ``nebula_ckpt`` are taken as a plain
    ``import nebula_ckpt [as nc]`` where the snippet uses them without importing), and prints each
    one that does not exist."""
    tree = ast.parse(code)
    imports = ["import nebula_ckpt", "import nebula_ckpt as nc"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("nebula_ckpt") for a in node.names):
            imports.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nebula_ckpt"):
            imports.append(ast.unparse(node))
    chains = set()
    for node in ast.walk(tree):
        parts: list[str] = []
        cur: ast.expr = node  # type: ignore[assignment]
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if parts and isinstance(cur, ast.Name) and cur.id in {"nc", "nebula_ckpt"}:
            chains.add((cur.id, tuple(reversed(parts))))
    prog = "\n".join(imports) + "\nimport functools\nfails = []\n"
    for head, rest in sorted(chains):
        name = ".".join((head, *rest))
        prog += (f"try:\n    functools.reduce(getattr, {list(rest)!r}, {head})\n"
                 f"except AttributeError as e:\n    fails.append({name!r} + ': ' + str(e))\n")
    return prog + "print('\\n'.join(fails))\n"


@pytest.mark.parametrize("snippet", [s for s in ALL if s.directive.startswith("skip")], ids=lambda s: s.id)
def test_skipped_snippet_compiles_and_names_what_exists(snippet: Snippet, tmp_path: Path) -> None:
    compile(snippet.code, snippet.id, "exec")
    res = _run(_nebula_reads(snippet.code), tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "", f"{snippet.id} reads what does not exist (as written):\n{res.stdout}"


@pytest.mark.slow
def test_quickstart_example_resumes_bit_exact(tmp_path: Path) -> None:
    """The README's example: a run killed with SIGKILL and resumed ends with the loss of a run that
    never crashed, to the last bit."""
    example = REPO / "examples" / "quickstart.py"

    def run(root: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(example), "--root", root, *extra], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=300)

    clean = run("clean")
    assert clean.returncode == 0, clean.stderr
    crashed = run("crashed", "--crash-at", "35")
    assert crashed.returncode == -9, f"the run should have been SIGKILLed: {crashed.returncode} {crashed.stderr}"
    resumed = run("crashed")
    assert resumed.returncode == 0, resumed.stderr
    # step 30's save may not have committed before the kill at step 35 (it persists in the
    # background): the resume is from the newest step that did, and ends bit-identical all the same
    assert re.search(r"^resumed from step (10|20|30) ", resumed.stdout, re.M), resumed.stdout
    final = [ln for ln in clean.stdout.splitlines() if ln.startswith("final loss")]
    assert final and final == [ln for ln in resumed.stdout.splitlines() if ln.startswith("final loss")], (
        clean.stdout, resumed.stdout)


_CITED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def test_every_guarantee_names_tests_that_exist() -> None:
    """docs/guarantees.md and SECURITY.md promise only what a test proves: each guarantee of the
    guarantees page has a ``Tests:`` line, and every test either page names is defined."""
    page = (REPO / "docs" / "guarantees.md").read_text()
    bullets = page.split("\n- **")[1:]
    assert len(bullets) >= 10, "the guarantees page lost its bullets: did the format change?"
    for b in bullets:
        assert "Tests: `" in b, f"guarantee without tests: {b[:80]!r}"
    cited = _CITED.findall(page) + _CITED.findall((REPO / "SECURITY.md").read_text())
    missing = []
    for path, name in cited:
        src = REPO / path
        if not src.is_file() or not re.search(rf"^\s*def {name}\(", src.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"named as proof but not defined: {missing}"
