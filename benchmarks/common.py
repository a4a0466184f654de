"""What every part of the benchmark shares: sample statistics, number formatting, target records.

The single-process runner, the multi-rank cases (:mod:`benchmarks.ranks`) and the recovery
benchmark (:mod:`benchmarks.recovery`) all summarise samples the same way and report targets in
one record shape, which :mod:`benchmarks.report` renders. This module imports nothing of the
benchmark's own, so any of them may use it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import statistics
import subprocess
import sys
from typing import Any, Optional, Sequence

__all__ = ["WARM_PYTHON_ENV", "fmt_b", "fmt_pct", "fmt_s", "free_port", "python_popen", "python_run", "summary",
           "target", "usable_cores"]

#: a test's launcher of warm Python children (the file ``tests/warm_python.py``); only the smoke tests
#: set it, so that the benchmark's own processes skip importing torch; a benchmark run never does
WARM_PYTHON_ENV = "NEBULA_BENCH_WARM_PYTHON"


def summary(samples: list[float]) -> dict[str, Any]:
    """median / p95 (linear interpolation) / min / max of ``samples``."""
    if not samples:
        return {"median": None, "p95": None, "min": None, "max": None, "samples": []}
    s = sorted(samples)
    k = (len(s) - 1) * 0.95
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    p95 = s[lo] + (s[hi] - s[lo]) * (k - lo)
    return {"median": statistics.median(s), "p95": p95, "min": s[0], "max": s[-1], "samples": samples}


def fmt_s(x: Optional[float]) -> str:
    """Seconds, with a unit that keeps 3 significant figures."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def fmt_b(n: Optional[float]) -> str:
    """Bytes in decimal units."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1000.0
    return f"{sign}{n:.2f} TB"


def fmt_pct(x: Optional[float]) -> str:
    """Fraction as a percentage."""
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def target(tid: str, title: str, met: Optional[bool], value: str, threshold: str,
           workload: Optional[str] = None, detail: str = "") -> dict[str, Any]:
    """One target's verdict as the report renders it (``met`` None: not measurable here)."""
    return {"id": tid, "title": title, "workload": workload, "met": met, "value": value,
            "threshold": threshold, "detail": detail}


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a job's ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launcher() -> Any:
    """``subprocess``, or the module ``$NEBULA_BENCH_WARM_PYTHON`` names (``popen`` / ``run`` with the
    arguments of ``subprocess.Popen`` / ``subprocess.run``, children forked from a server that imported
    torch once: real processes of their own, started without the import)."""
    path = os.environ.get(WARM_PYTHON_ENV)
    if not path:
        return subprocess
    mod = sys.modules.get("warm_python")
    if mod is None:
        spec = importlib.util.spec_from_file_location("warm_python", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"${WARM_PYTHON_ENV}: no module at {path!r}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["warm_python"] = mod
        spec.loader.exec_module(mod)
    return mod


def python_popen(args: Sequence[str], **kw: Any) -> "subprocess.Popen[Any]":
    """``subprocess.Popen(args, **kw)`` for a ``[sys.executable, ...]`` command (see :func:`_launcher`)."""
    launcher = _launcher()
    return launcher.Popen(args, **kw) if launcher is subprocess else launcher.popen(args, **kw)


def python_run(args: Sequence[str], **kw: Any) -> "subprocess.CompletedProcess[Any]":
    """``subprocess.run(args, **kw)`` for a ``[sys.executable, ...]`` command (see :func:`_launcher`)."""
    return _launcher().run(args, **kw)
