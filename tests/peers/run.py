"""Run the frameworks' own checkpoint tests twice, stock then with nebula_ckpt, and compare.

``python tests/peers/run.py PEER_SUITES [--suite NAME ...] [--out DIR]`` (``make peer-test
PEER_SUITES=/path``). ``PEER_SUITES`` holds the suites as :file:`tests/peers/README.md` says how to
fetch them (never committed here); a suite whose folder is missing is skipped with a message
saying what to put where, and so is the whole run when ``PEER_SUITES`` is unset or empty.

For each suite of :file:`manifest.json`: the test files it lists are run with pytest from the
suite's own folder (its conftest and helpers apply), with :mod:`plugin` loaded, once with
``NEBULA_PEER_MODE=stock`` and once with ``nebula``. The manifest's ``skip`` entries (they fail
on stock too) are skipped in both runs, its ``xfail`` entries (documented refusals) are expected
to fail with nebula_ckpt only, each with its reason. Then a table: per suite, passed / failed /
skipped / xfailed for both runs, and every test whose outcome differs. Exits non-zero when a test
that passes stock fails with nebula_ckpt (or an expected failure passes).

Lightning's tests import the unified ``lightning`` package; the installed package is
``pytorch_lightning`` (+ ``lightning_fabric``), so the Lightning suite is run from a copy whose
imports are rewritten the way Lightning's own release tooling does for that package (see the README).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MANIFEST = os.path.join(HERE, "manifest.json")
_LIGHTNING_IMPORTS = [(re.compile(r"\blightning\.pytorch\b"), "pytorch_lightning"),
                      (re.compile(r"\blightning\.fabric\b"), "lightning_fabric"),
                      (re.compile(r"\bfrom lightning import\b"), "from pytorch_lightning import"),
                      (re.compile(r"^import lightning$", re.M), "import pytorch_lightning as lightning")]


def load_manifest() -> dict[str, Any]:
    with open(MANIFEST, encoding="utf-8") as f:
        out: dict[str, Any] = json.load(f)
    return out


def _converted(src: str, work: str) -> str:
    """A copy of the Lightning suite ``src`` with its imports rewritten for ``pytorch_lightning``."""
    dst = os.path.join(work, "lightning-converted")
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for folder, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                p = os.path.join(folder, name)
                with open(p, encoding="utf-8") as f:
                    text = f.read()
                new = text
                for pat, rep in _LIGHTNING_IMPORTS:
                    new = pat.sub(rep, new)
                if new != text:
                    with open(p, "w", encoding="utf-8") as f:
                        f.write(new)
    return dst


def _outcomes(xml_path: str) -> dict[str, str]:
    """Test id -> passed / failed / skipped / xfailed / xpassed / error, from pytest's JUnit XML."""
    out: dict[str, str] = {}
    if not os.path.exists(xml_path):
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kids = {c.tag: c for c in case}
        if "failure" in kids:
            out[name] = "xpassed" if "XPASS" in (kids["failure"].get("message") or "") else "failed"
        elif "error" in kids:
            out[name] = "error"
        elif "skipped" in kids:
            msg = kids["skipped"].get("type") or ""
            out[name] = "xfailed" if "xfail" in msg else "skipped"
        else:
            out[name] = "passed"
    return out


def _env(name: str, spec: dict[str, Any], mode: str, work: str) -> dict[str, str]:
    return {**os.environ, "NEBULA_PEER_MODE": mode, "NEBULA_PEER_SUITE": name, "NEBULA_PEER_MANIFEST": MANIFEST,
            "NEBULA_PEER_ROOTS": os.path.join(work, f"roots-{name}-{mode}"),
            "PYTHONPATH": os.pathsep.join([HERE, REPO, *spec.get("pythonpath", []), os.environ.get("PYTHONPATH", "")]),
            **spec.get("env", {})}


def _prepare(name: str, module: str, env: dict[str, str], cwd: str) -> None:
    """Import ``module`` once before the runs, with no time limit (DeepSpeed: its CPU ops are
    JIT-built into torch's extension cache there, not inside a test's timeout; a build killed midway
    leaves torch's ``lock`` file behind, and every later load waits for it to go)."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    for folder, _, files in os.walk(ext):
        if "lock" in files:
            print(f"peer-test: {name}: {os.path.join(folder, 'lock')} exists: a build is running, or a killed one "
                  "left it (then remove it, or every load of that op waits for it)", flush=True)
    print(f"peer-test: {name}: preparing (import {module}: the CPU ops are built once, minutes when not cached)",
          flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=cwd, env=env, check=True)
    print(f"peer-test: {name}: prepared in {time.monotonic() - t0:.0f} s", flush=True)


def run_suite(name: str, spec: dict[str, Any], suites: str, work: str, extra: list[str]) -> Optional[dict[str, Any]]:
    src = os.path.join(suites, spec["folder"])
    if not os.path.isdir(src):
        print(f"peer-test: {name}: skipped: {src} is missing (fetch {spec['source']} at {spec['ref']} there, "
              "see tests/peers/README.md)")
        return None
    base = _converted(src, work) if spec.get("convert_lightning_imports") else src
    cwd = os.path.join(base, spec.get("cwd", ""))
    files = [f for f in spec["files"] if os.path.exists(os.path.join(cwd, f.split("::")[0]))]
    missing = sorted(set(spec["files"]) - set(files))
    if missing:
        print(f"peer-test: {name}: not in this copy of the suite, not run: {missing}")
    chosen = [x for x in extra if x.split("::")[0] in spec["files"]]
    if chosen:  # a file (or test) of the manifest named after --: that one only
        files, extra = chosen, [x for x in extra if x not in chosen]
    results: dict[str, Any] = {}
    for mode in ("stock", "nebula"):
        xml = os.path.join(work, f"{name}-{mode}.xml")
        env = _env(name, spec, mode, work)
        if mode == "stock" and spec.get("prepare"):
            _prepare(name, spec["prepare"], env, cwd)
        cmd = [sys.executable, "-m", "pytest", "-p", "plugin", "-q", "-rN", "--no-header", "-o", "addopts=",
               "-p", "no:cacheprovider", f"--junitxml={xml}", *spec.get("pytest_args", []), *extra, *files]
        print(f"peer-test: {name} ({mode}): {' '.join(cmd[3:])}", flush=True)
        log = os.path.join(work, f"{name}-{mode}.log")
        with open(log, "w", encoding="utf-8") as f:
            subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
        with open(log, encoding="utf-8") as f:
            tail = f.read().strip().splitlines()[-2:]
        print("   " + "\n   ".join(tail), flush=True)
        results[mode] = _outcomes(xml)
    return results


def _counts(outcomes: dict[str, str]) -> dict[str, int]:
    keys = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    return {k: sum(1 for v in outcomes.values() if v == k) for k in keys}


def report(all_results: dict[str, dict[str, Any]]) -> int:
    bad = 0
    for name, res in all_results.items():
        for mode in ("stock", "nebula"):
            if not res[mode]:
                print(f"peer-test: {name} ({mode}) reported no test (see its log): nothing to compare")
                bad += 1
    print("\n| suite | run | passed | failed | errors | skipped | xfailed | xpassed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in all_results.items():
        for mode in ("stock", "nebula"):
            c = _counts(res[mode])
            print(f"| {name} | {mode} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} | "
                  f"{c['xfailed']} | {c['xpassed']} |")
    for name, res in all_results.items():
        stock, ours = res["stock"], res["nebula"]
        diff = sorted(t for t in set(stock) | set(ours) if stock.get(t) != ours.get(t))
        for t in diff:
            s, o = stock.get(t, "-"), ours.get(t, "-")
            regression = s == "passed" and o in ("failed", "error", "-") or o == "xpassed"
            bad += regression
            print(f"{'REGRESSION ' if regression else ''}{name}: {t}: stock {s}, nebula_ckpt {o}")
    return 1 if bad else 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="after --: more pytest arguments (-k EXPR, a test file of the manifest ...)")
    p.add_argument("suites", nargs="?", default=os.environ.get("PEER_SUITES", ""))
    p.add_argument("--suite", action="append", help="run only these suites (names in manifest.json)")
    p.add_argument("--out", help="folder for logs, JUnit XML and roots (default: a temporary one)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not a.suites or not os.path.isdir(a.suites):
        print("peer-test: skipped: no peer suites here (PEER_SUITES is unset or not a folder). They are not "
              "part of this repository; tests/peers/README.md says where to fetch them. Then: "
              "make peer-test PEER_SUITES=/path/to/peer-suites")
        return 0
    manifest = load_manifest()
    work = a.out or tempfile.mkdtemp(prefix="nebula-peer-test-")
    os.makedirs(work, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name, spec in manifest["suites"].items():
        if a.suite and name not in a.suite:
            continue
        got = run_suite(name, spec, a.suites, work, extra)
        if got is not None:
            results[name] = got
    if not results:
        print("peer-test: skipped: none of the suites is under", a.suites)
        return 0
    with open(os.path.join(work, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    print(f"peer-test: logs, JUnit XML and per-test outcomes in {work}")
    return report(results)


if __name__ == "__main__":
    sys.exit(main())
