"""``results.md`` of the many-tensor benchmark (:mod:`benchmarks.many_tensors`): per state, the
blocking time of every system at every size, per tensor, against the two floors measured in the
same run; the growth exponent of each system's blocking time; and the targets' verdicts.

Definitions (all medians over the timed saves):

* *blocking*: the call plus the wait until the state may change (``wait_safe``); for ``nebula_local``
  (a CPU state is copied inside the call) it is the call itself;
* *per tensor*: blocking / tensors; *beyond the bytes*: (blocking - one copy of the state's bytes as
  a single block) / tensors;
* *floor*: a bare Python loop reading every tensor's ``data_ptr()``, per tensor;
* *exponent*: the slope of log(blocking) against log(tensors), least squares over the sizes measured;
  *marginal*: the slope of blocking against tensors (a linear fit), per tensor.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import fmt_s

NEBULA = "nebula_local"
PEERS_TO_BEAT = ("dcp_async_save", "dcp_async_save_shared", "torch_save", "torch_checkpointing")


def _med(x: Optional[dict[str, Any]]) -> Optional[float]:
    return None if not x else x.get("median")


def _us(x: Optional[float]) -> str:
    return "n/a" if x is None else (f"{x * 1e6:.2f} µs" if x < 1e-5 else f"{x * 1e6:.1f} µs")


def fit(points: list[tuple[int, float]]) -> dict[str, Optional[float]]:
    """Exponent (log-log slope) and marginal cost per tensor (linear slope) of (tensors, seconds)."""
    pts = [(n, s) for n, s in points if s and s > 0]
    if len(pts) < 2:
        return {"exponent": None, "marginal_s": None}
    xs, ys = [math.log(n) for n, _ in pts], [math.log(s) for _, s in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    nx, ny = [n for n, _ in pts], [s for _, s in pts]
    mnx, mny = sum(nx) / len(nx), sum(ny) / len(ny)
    b = sum((x - mnx) * (y - mny) for x, y in zip(nx, ny, strict=True)) / sum((x - mnx) ** 2 for x in nx)
    return {"exponent": k, "marginal_s": b}


def blocking(s: dict[str, Any]) -> Optional[float]:
    """The blocking time of one system's result (None unless it ran)."""
    return _med(s.get("safe_s")) if s.get("status") == "ok" else None


def _rows(results: dict[str, Any], workload: str) -> list[dict[str, Any]]:
    return sorted((r for r in results["rows"] if r["workload"] == workload), key=lambda r: r["tensors"])


def _table(results: dict[str, Any], workload: str, systems: list[str]) -> list[str]:
    head = ["tensors", "floor / tensor", "bytes copy"] + [f"{s} (/ tensor)" for s in systems]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in _rows(results, workload):
        n = r["tensors"]
        cells = [f"{n:,}", _us(_med(r["floor_s"]) / n), fmt_s(_med(r["copy_s"]))]
        for name in systems:
            s = r["systems"].get(name, {})
            b = blocking(s)
            cells.append(f"{fmt_s(b)} ({_us(b / n)})" if b is not None else s.get("status", "—"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _nebula_table(results: dict[str, Any], workload: str) -> list[str]:
    lines = ["| tensors | call | per tensor | beyond the bytes, per tensor | x floor | first save (planned) | "
             "async call (enqueue only) | plans reused / made |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in _rows(results, workload):
        n, s = r["tensors"], r["systems"].get(NEBULA, {})
        b = blocking(s)
        if b is None:
            continue
        beyond = max(b - (_med(r["copy_s"]) or 0.0), 0.0) / n
        floor = _med(r["floor_s"]) / n
        a = r["systems"].get("nebula_async", {})
        plans = s.get("plans") or {}
        lines.append(f"| {n:,} | {fmt_s(b)} | {_us(b / n)} | {_us(beyond)} | {beyond / floor:.2f} | "
                     f"{fmt_s((s.get('first') or {}).get('safe_s'))} | "
                     f"{fmt_s(_med(a.get('call_s'))) if a.get('status') == 'ok' else '—'} | "
                     f"{plans.get('hits', '—')} / {plans.get('misses', 0) + 1 if plans else '—'} |")
    return lines


def _fits(results: dict[str, Any], workload: str, systems: list[str]) -> tuple[list[str], dict[str, Any]]:
    lines = ["| system | exponent | marginal per tensor | sizes fitted |", "|---|---:|---:|---|"]
    fits: dict[str, Any] = {}
    rows = _rows(results, workload)
    series = {"floor (data_ptr loop)": [(r["tensors"], _med(r["floor_s"])) for r in rows]}
    for name in systems:
        series[name] = [(r["tensors"], blocking(r["systems"].get(name, {}))) for r in rows]
    if any(r["systems"].get("nebula_async", {}).get("status") == "ok" for r in rows):
        series["nebula_async (call)"] = [(r["tensors"], _med(r["systems"].get("nebula_async", {}).get("call_s")))
                                         for r in rows]
    for name, pts in series.items():
        got = [(n, s) for n, s in pts if s is not None]
        f = fits[name] = fit(got)
        k = "n/a" if f["exponent"] is None else f"{f['exponent']:.3f}"
        lines.append(f"| {name} | {k} | {_us(f['marginal_s'])} | {', '.join(f'{n:,}' for n, _ in got)} |")
    return lines, fits


def verdicts(results: dict[str, Any], workload: str, fits: dict[str, Any]) -> list[str]:
    """The issue's three targets for ``nebula_local`` on this state, with the values."""
    rows = _rows(results, workload)
    ratios = []
    behind = []
    for r in rows:
        b = blocking(r["systems"].get(NEBULA, {}))
        if b is None:
            continue
        n = r["tensors"]
        ratios.append((n, max(b - (_med(r["copy_s"]) or 0.0), 0.0) / n / (_med(r["floor_s"]) / n)))
        for p in PEERS_TO_BEAT:
            pb = blocking(r["systems"].get(p, {}))
            if pb is not None and pb <= b:
                behind.append(f"{p} at {n:,}")
    k = (fits.get(NEBULA) or {}).get("exponent")
    marg = (fits.get(NEBULA) or {}).get("marginal_s")
    floor_marg = (fits.get("floor (data_ptr loop)") or {}).get("marginal_s")
    out = []
    if ratios:
        worst = max(ratios, key=lambda x: x[1])
        out.append(f"- beyond the bytes, per tensor, <= 3x the floor: largest ratio {worst[1]:.2f} at {worst[0]:,} "
                   f"tensors; marginal cost {_us(marg)} against the floor's {_us(floor_marg)}"
                   f" ({marg / floor_marg:.2f}x)" if marg and floor_marg else "")
    out.append(f"- exponent <= 1.05: {'n/a' if k is None else f'{k:.3f}'}")
    out.append("- ahead of every peer at every size: " + ("yes" if not behind else "no: " + ", ".join(behind)))
    return out


def write_report(results: dict[str, Any], path: Path) -> None:
    """Write ``results.md`` (see the module docstring)."""
    systems = [s for s in results["settings"]["systems"]]
    lines = ["# Many tensors: the save call against the number of tensors", "",
             f"Load average before / after: {results['load_before']} / {results.get('load_after')}; "
             f"{results['settings']['warmup']} warm-up and {results['settings']['reps']} timed saves per "
             "system and size (4x that up to 1,000 tensors), each followed by an untimed wait until "
             "durable, systems interleaved; medians.", ""]
    for workload in results["settings"]["workloads"]:
        lines += [f"## {workload}", "", "Blocking time (call + wait until the state may change), median:", ""]
        lines += _table(results, workload, systems) + [""]
        lines += [f"`{NEBULA}` in detail:", ""] + _nebula_table(results, workload) + [""]
        fit_lines, fits = _fits(results, workload, systems)
        results.setdefault("fits", {})[workload] = fits
        lines += ["Growth with the number of tensors:", ""] + fit_lines + [""]
        lines += ["Targets:", ""] + verdicts(results, workload, fits) + [""]
    lines += ["## How each system is called", ""] + [f"- `{n}`: {c}" for n, c in results["calls"].items()]
    lines += ["", __doc__.split("\n\n", 1)[1].strip(), ""]
    path.write_text("\n".join(lines))
