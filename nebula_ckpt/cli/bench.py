"""``nebula-ckpt bench``: the full benchmark harness from a checkout, else the quick benchmark.

The harness (``benchmarks/`` at the repository's root: peers, emulated remote stores, recovery,
ranks) is not installed with the package. From a checkout (the folder holding the imported
``nebula_ckpt`` package, or the current folder, with ``benchmarks/runner.py``) ``nebula-ckpt
bench ...`` runs ``benchmarks.runner.main``; a pip-installed package runs
:mod:`nebula_ckpt.quickbench` instead (the user's own state file, or a synthetic state, against
``torch.save`` on this machine).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Optional, Sequence

import nebula_ckpt
from nebula_ckpt.errors import NebulaError

RUNNER = os.path.join("benchmarks", "runner.py")


def find_checkout(cwd: Optional[str] = None) -> Optional[str]:
    """The checkout whose ``benchmarks/`` to run: the folder above the imported package, else
    ``cwd`` (default: the current folder); None when neither holds ``benchmarks/runner.py``."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(nebula_ckpt.__file__)))
    for folder in (package_parent, os.path.abspath(cwd or os.getcwd())):
        if os.path.isfile(os.path.join(folder, RUNNER)):
            return folder
    return None


def _harness(checkout: str) -> Any:
    """``benchmarks.runner`` of ``checkout`` (put first on ``sys.path``)."""
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    runner = importlib.import_module("benchmarks.runner")
    where = os.path.realpath(getattr(runner, "__file__", "") or "")
    if where != os.path.realpath(os.path.join(checkout, RUNNER)):
        raise NebulaError(f"nebula-ckpt bench: 'benchmarks.runner' was imported from {where}, not from the "
                          f"checkout {checkout}: run it as python {os.path.join(checkout, RUNNER)}")
    return runner


def cmd_bench(argv: Sequence[str]) -> int:
    """Run the harness of a checkout, or the quick benchmark; return the exit code."""
    checkout = find_checkout()
    if checkout is not None:
        return int(_harness(checkout).main(list(argv)) or 0)
    try:
        quick = importlib.import_module("nebula_ckpt.quickbench")
    except ModuleNotFoundError as e:
        if e.name != "nebula_ckpt.quickbench":
            raise
        raise NebulaError("nebula-ckpt bench: this installation has neither the benchmark harness (benchmarks/ of "
                          "a checkout: run it from one, git clone the repository) nor the quick benchmark "
                          "(nebula_ckpt.quickbench)") from None
    return int(quick.main(list(argv)) or 0)
