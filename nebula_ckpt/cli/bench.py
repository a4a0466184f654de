"""``nebula-ckpt bench``: the quick benchmark of your own state, the same in every installation.

``nebula-ckpt bench --state FILE`` (or ``--size-gb N``, ``--saves``, ``--torch-reps``, ``--root``,
``--keep``, ``--json``) runs :mod:`nebula_ckpt.quickbench` whether the package was installed with
pip, installed editable, or is imported from a checkout. The full harness (``benchmarks/`` at the
repository's root: peers, emulated remote stores, recovery, ranks) is not installed with the
package; from a checkout (the folder holding the imported ``nebula_ckpt`` package, or the current
folder, with ``benchmarks/runner.py``) an option of its own (``--model``, ``--ranks``,
``--recovery``, ``-q``, ...) runs ``benchmarks.runner.main`` instead, as ``make bench`` and
``python -m benchmarks.run`` do; elsewhere such an option is a usage error that says so.
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


def _harness_options(argv: Sequence[str]) -> list[str]:
    """The options of ``argv`` the quick benchmark does not take (the harness's)."""
    from nebula_ckpt.quickbench import OPTIONS

    return [a.split("=", 1)[0] for a in argv if a.startswith("-") and a.split("=", 1)[0] not in OPTIONS
            and not _is_number(a)]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def cmd_bench(argv: Sequence[str]) -> int:
    """Run the quick benchmark, or (an option of the harness's, from a checkout) the harness; return
    the exit code."""
    try:
        quick = importlib.import_module("nebula_ckpt.quickbench")
    except ModuleNotFoundError as e:
        if e.name != "nebula_ckpt.quickbench":
            raise
        raise NebulaError("nebula-ckpt bench: this installation lacks the quick benchmark (nebula_ckpt.quickbench); "
                          "reinstall the package") from None
    other = _harness_options(argv)
    if not other:
        return int(quick.main(list(argv)) or 0)
    checkout = find_checkout()
    if checkout is None:
        sys.stderr.write(f"nebula-ckpt bench: {other[0]} is an option of the full benchmark harness, which runs from "
                         "a checkout of the repository (git clone it; then nebula-ckpt bench or python -m "
                         "benchmarks.run there). Installed, bench measures your own state: --state FILE or "
                         "--size-gb N (nebula-ckpt bench --help)\n")
        return 2
    return int(_harness(checkout).main(list(argv)) or 0)
