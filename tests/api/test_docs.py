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
from typing import Any

import pytest

import warm_python

REPO = Path(__file__).resolve().parents[2]
PRELUDES = Path(__file__).resolve().parents[1] / "doc_preludes"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!--\s*doctest:\s*(?P<directive>[^>]*?)\s*-->[ \t]*\n[ \t]*)?```python\n(?P<code>.*?)```",
                    re.S)
_ROOTS = re.compile(r"([\"'])/(ckpt|shared|nvme)/")
#: the page whose snippets run exactly as written (test_api_page_snippets_run_as_written)
API_PAGE = REPO / "docs" / "api.md"


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
    return warm_python.run([sys.executable, str(script)], cwd=cwd, env=_env(), capture_output=True,
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


@pytest.mark.parametrize("snippet", [s for s in ALL if (not s.directive or s.directive.startswith("prelude"))
                                     and s.page != API_PAGE], ids=lambda s: s.id)
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


@pytest.mark.parametrize("snippet", [s for s in ALL if s.page == API_PAGE], ids=lambda s: s.id)
def test_api_page_snippets_run_as_written(snippet: Snippet, tmp_path: Path) -> None:
    """docs/api.md's snippets run exactly as written (no prelude, no path rewritten) in an empty
    folder, define what they use, and leave no Checkpointer unclosed."""
    assert not snippet.directive, f"{snippet.id}: the API page's snippets run as written ({snippet.directive!r})"
    assert not _ROOTS.search(snippet.code), f"{snippet.id}: an absolute root; use a relative one"
    res = _run(snippet.code, tmp_path)
    assert res.returncode == 0, f"{snippet.id} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    assert "was not closed" not in res.stderr, res.stderr[-3000:]


#: where the example is killed (each run resumes from the previous one's newest save): mid-epoch 0,
#: just past the end of epoch 0 (the save on its last batch), mid-epoch 2; then it runs to the end
KILLS = {6: (4, 0, 4), 13: (12, 0, 12), 31: (28, 2, 4)}


def _losses(text: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for m in re.finditer(r"^step (\d+) loss (\S+)$", text, re.M):
        step, loss = int(m.group(1)), m.group(2)
        assert out.setdefault(step, loss) == loss, f"step {step} printed twice with different losses"
    return out


def _example_runs(script: Path, out: Path, runs: list[str]) -> dict[str, int]:
    """Run ``script`` once per run ``name:arg,arg,...`` from ``out``, each child's output in
    ``out/<name>.out``; a run named ``bg-...`` goes on beside the others, every other one is waited
    for before the next starts. Each run's exit status (-9: killed by SIGKILL)."""
    background: dict[str, Any] = {}
    codes: dict[str, int] = {}
    for run in runs:
        name, _, args = run.partition(":")
        with open(out / f"{name}.out", "w") as f:
            p = warm_python.popen([sys.executable, str(script), *[a for a in args.split(",") if a]], cwd=out,
                                  env=_env(), stdout=f, stderr=subprocess.STDOUT)
        if name.startswith("bg-"):
            background[name] = p
        else:
            codes[name] = p.wait(600)
    for name, p in background.items():
        codes[name] = p.wait(600)
    return codes


@pytest.mark.slow
def test_quickstart_example_resumes_bit_exact(tmp_path: Path) -> None:
    """The README's example (a shuffled DataLoader with 2 workers drawing from np.random, dropout,
    gradient accumulation), SIGKILLed mid-epoch and at an epoch boundary and resumed each time:
    every loss of every run is the loss of a run that never crashed, bit for bit, and each run
    resumes where the one before it saved last."""
    example = REPO / "examples" / "quickstart.py"
    chain = [f"run{i}:--root,crashed" + (f",--crash-at,{kill}" if kill else "")
             for i, kill in enumerate([*KILLS, None])]
    codes = _example_runs(example, tmp_path, ["bg-clean:--root,clean", *chain])
    outs = {name: (tmp_path / f"{name}.out").read_text() for name in codes}
    assert codes == {"bg-clean": 0, **{f"run{i}": -9 for i in range(len(KILLS))}, f"run{len(KILLS)}": 0}, (
        codes, {n: t[-2000:] for n, t in outs.items()})
    clean_out = tmp_path / "bg-clean.out"
    runs = [outs[f"run{i}"] for i in range(len(KILLS) + 1)]
    want = _losses(clean_out.read_text())
    assert sorted(want) == list(range(1, 37)), clean_out.read_text()[-3000:]
    seen: dict[int, str] = {}
    for text in runs:
        for step, loss in _losses(text).items():
            assert loss == want[step], f"step {step}: {loss} after a resume, {want[step]} without a crash"
            seen[step] = loss
    assert sorted(seen) == list(range(1, 37))
    assert "resumed" not in runs[0]
    for text, (step, epoch, batch) in zip(runs[1:], KILLS.values(), strict=True):
        assert re.search(rf"^resumed at step {step} \(epoch {epoch}, batch {batch}\) from memory:", text, re.M), text


def test_the_readme_names_the_make_targets_a_newcomer_runs() -> None:
    """The README's quickstart names ``make demo``, ``make test-fast`` and ``make test`` (with how long
    the whole suite takes), and each ``make`` target the README names exists in the Makefile."""
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quickstart"):readme.index("## A complete example")]
    for target in ("demo", "test-fast", "test"):
        assert re.search(rf"^make {re.escape(target)}\s", quick, re.M), target
    assert re.search(r"make test\s+#.*\d+ minutes", quick), "how long `make test` takes"
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([\w-]+)", readme)) | set(re.findall(r"^make ([\w-]+)", readme, re.M))
    assert named and named <= targets, named - targets


def test_the_configuration_page_lists_exactly_the_knobs() -> None:
    """docs/configuration.md's table has one row per knob (its variable and name), no more: a knob
    removed from the code leaves the page, and a new one cannot stay undocumented."""
    from nebula_ckpt import knobs

    page = (REPO / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `(NEBULA_\w+)` \| `(\w+)` \|", page, re.M)
    listed = {env: name for env, name in rows}
    assert len(listed) == len(rows), "a variable listed twice"
    assert listed == {env: name for name, (env, _, _) in knobs.describe().items()}


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


def test_every_results_folder_is_cited_by_the_docs() -> None:
    """A folder of benchmarks/results/ that no page names is a result nobody can find the claim of:
    cite it where its figures are used, or remove it."""
    pages = "\n".join(p.read_text() for p in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md",
                                               REPO / "benchmarks" / "README.md"])
    folders = sorted(p.name for p in (REPO / "benchmarks" / "results").iterdir() if p.is_dir())
    assert folders, "benchmarks/results/ lost its folders"
    assert [f for f in folders if f not in pages] == []
