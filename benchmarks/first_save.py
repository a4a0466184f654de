"""The first saves of a fresh process, alone: ``python -m benchmarks.first_save --sizes 0.3,1.2,3``.

The "first saves" case of the recovery benchmark (:mod:`benchmarks.recovery`; the ``saves`` role
of :mod:`benchmarks.recovery_worker`: MLP + AdamW, a training step before each save, stall =
``save_async`` + ``wait_snapshot()``, ``result()`` untimed, then ``torch.save`` + fsync of the same
state), without the restarts, for each ``--fault-ahead`` setting (``FAULT_AHEAD_THREADS`` of
:mod:`nebula_ckpt.storage.prefault`; ``default``: its own default) in turn, each repetition in fresh processes, the
settings interleaved so that they share the machine's conditions. Reports per size and setting
the first save's stall, the later saves' median, their ratio and torch.save + fsync (medians over
the repetitions), into ``--out`` (``results.json``, ``results.md``).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import fmt_b, fmt_s, usable_cores
from benchmarks.limits import machine_info
from benchmarks.recovery import launch, parse_sizes
from benchmarks.recovery_report import aggregate_saves
from benchmarks.recovery_worker import WorkerSpec, geometry

log = logging.getLogger(__name__)


def one_rep(size_gb: float, setting: str, work: Path, threads: int, saves: int) -> Optional[dict[str, Any]]:
    """One fresh saving process at ``size_gb`` with fault-ahead ``setting``; its aggregated figures."""
    g = geometry(size_gb)
    sdir = Path(tempfile.mkdtemp(prefix="first-", dir=work))
    fault_ahead = None if setting == "default" else int(setting)
    try:
        res, why = launch(WorkerSpec(role="saves", width=g.width, layers=g.layers, threads=threads,
                                     result=str(sdir / "saves.json"), dir=str(sdir), saves=saves, torch_reps=1,
                                     fault_ahead=fault_ahead),
                          sdir, "saves", 120.0 + 60.0 * size_gb * saves)
    finally:
        shutil.rmtree(sdir, ignore_errors=True)
    if res is None:
        log.warning("%.2f GB, fault-ahead %s: %s", size_gb, setting, why)
        return None
    agg = aggregate_saves(res)
    stalls = [s["stall_s"] for s in res["saves"]]
    return {"state_bytes": res["state_bytes"], "first_s": stalls[0], "second_s": stalls[1],
            "later_s": agg["later_stall_s"]["median"], "torch_save_s": agg["torch_save_s"]["median"]}


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions, and the ratios of the medians."""
    med = {k: statistics.median(r[k] for r in reps) for k in ("first_s", "second_s", "later_s", "torch_save_s")}
    return {**med, "reps": reps, "state_bytes": reps[0]["state_bytes"],
            "first_vs_later": med["first_s"] / med["later_s"],
            "first_vs_torch_save": med["first_s"] / med["torch_save_s"]}


def markdown(res: dict[str, Any]) -> str:
    """The table of ``results.md``."""
    lines = ["| state | fault-ahead threads | first save | second save | later saves | first / later "
             "| torch.save + fsync | first / torch.save | reps |", "|---|---|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        s = row["summary"]
        if s is None:
            lines.append(f"| {row['size_gb']:g} GB | {row['setting']} | failed | | | | | | 0 |")
            continue
        lines.append(f"| {fmt_b(s['state_bytes'])} | {row['setting']} | {fmt_s(s['first_s'])} | {fmt_s(s['second_s'])} "
                     f"| {fmt_s(s['later_s'])} | {s['first_vs_later']:.2f}x | {fmt_s(s['torch_save_s'])} "
                     f"| {s['first_vs_torch_save']:.2f}x | {len(s['reps'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_save", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.3,1.2,3", help="state sizes in GB")
    p.add_argument("--fault-ahead", default="0,default", help="FAULT_AHEAD_THREADS settings, e.g. 0,1,default")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--saves", type=int, default=8, help="saves per process (the first 4 are reported one by one)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the saving process")
    p.add_argument("--target", default="bench_out", help="folder to write the checkpoints in")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sizes, settings = parse_sizes(a.sizes) or [], [s.strip() for s in a.fault_ahead.split(",") if s.strip()]
    work = Path(a.target).resolve()
    work.mkdir(parents=True, exist_ok=True)
    reps: dict[tuple[float, str], list[dict[str, Any]]] = {(g, s): [] for g in sizes for s in settings}
    for size in sizes:
        for r in range(a.reps):
            for setting in settings:  # interleaved: each setting sees the same neighbours
                got = one_rep(size, setting, work, a.threads, a.saves)
                log.info("%.2f GB rep %d fault-ahead %s: %s", size, r + 1, setting, got)
                if got is not None:
                    reps[(size, setting)].append(got)
    res = {"argv": sys.argv, "machine": machine_info(work, str(work)), "cores": usable_cores(),
           "rows": [{"size_gb": g, "setting": s, "summary": summarize(v) if v else None} for (g, s), v in reps.items()]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=repr) + "\n")
    (out / "table.md").write_text(markdown(res))
    sys.stdout.write(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
