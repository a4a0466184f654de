"""The restore section of ``make bench`` alone: ``python -m benchmarks.restore --model 124m``.

The same workload, peers and measurement as the full benchmark (:mod:`benchmarks.runner`):
each system saves the trained state once, then :func:`~benchmarks.measure.measure_restores`
restores it into the live model and optimizer right after the save, then ``--reps`` times warm
and cold, interleaved (medians; cold: the files evicted with ``posix_fadvise(DONTNEED)``, or
the machine's page cache dropped with ``--drop-caches``), each restore checked against the
state's fingerprint; then the restore floor (:mod:`benchmarks.restore_floor`: read + checksum
+ copy into the live tensors) on the same disk, and again in the memory tier's tmpfs folder
(``shm_dir``): each tier is held to the floor of reading its bytes from where they lie (tmpfs's
4 KiB pages cost more page-table work than the page cache of a disk file). No throughput rounds,
no save figures: minutes instead of half an hour, for the restore targets of the report. Writes ``results.md`` and
``results.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import workloads as wl
from benchmarks.common import fmt_b, fmt_s
from benchmarks.limits import machine_info, rss_bytes
from benchmarks.measure import measure_restores
from benchmarks.peers import PEERS
from benchmarks.report import FLOOR_RATIO
from benchmarks.restore_floor import measure_restore_floor, measure_tmpfs_floor

log = logging.getLogger(__name__)

SYSTEMS = ("torch_save", "nebula_local", "nebula")


def one_system(name: str, w: wl.Workload, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Save ``w``'s state once with system ``name``, then its restores (see the module docstring)."""
    peer = PEERS[name]()
    res: dict[str, Any] = {"name": name, "status": "ok"}
    peer.check(str(folder))
    peer.open(folder / name)
    try:
        w.train_step()
        fingerprint = w.fingerprint()
        peer.save(1, lambda: w.state(1))
        peer.wait_safe()
        peer.wait_durable()
        measure_restores(peer, w, args, res, fingerprint, 1, rss_bytes())
    except Exception as e:
        log.exception("%s failed", name)
        res.update(status="error", reason=f"{type(e).__name__}: {e}")
    finally:
        peer.close()
        shutil.rmtree(folder / name, ignore_errors=True)
    return res


def render(out: dict[str, Any]) -> str:
    """``results.md``: one row per system, the floor, the verdicts."""
    disk_floor = out.get("floor") or {}
    floors = {"nebula": out.get("floor_tmpfs") or disk_floor}  # the memory tier: its bytes are in tmpfs
    lines = [f"# Restore: {out['model']} ({fmt_b(out['state_bytes'])} in {out['tensors']} tensors)", "",
             f"{out['started']}; load average {out['loadavg']}; medians of {out['reps']} warm and "
             f"{out['reps']} cold restores per system, interleaved; every restore checked against the saved state.", "",
             "| system | after save | warm | cold | warm / torch.load | cold / torch.load | warm / its floor | "
             "cold / its floor | CPU warm / cold | checked |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    ts = next((s for s in out["systems"] if s["name"] == "torch_save" and s["status"] == "ok"), None)
    for s in out["systems"]:
        if s["status"] != "ok":
            lines.append(f"| {s['name']} | {s['status']}: {s.get('reason')} ||||||||")
            continue

        fl = floors.get(s["name"], disk_floor)

        def ratio(a: Optional[float], b: Optional[float]) -> str:
            return "n/a" if not a or not b else f"{a / b:.2f}x"
        ok = all(s.get(k) for k in ("restore_ok", "restore_warm_ok", "restore_cold_ok"))
        lines.append(f"| {s['name']} | {fmt_s(s['restore_after_save_s'])} | {fmt_s(s['restore_warm_s'])} "
                     f"| {fmt_s(s['restore_cold_s'])} | {ratio(s['restore_warm_s'], ts and ts['restore_warm_s'])} "
                     f"| {ratio(s['restore_cold_s'], ts and ts['restore_cold_s'])} "
                     f"| {ratio(s['restore_warm_s'], fl.get('warm_s'))} "
                     f"| {ratio(s['restore_cold_s'], fl.get('cold_s'))} "
                     f"| {fmt_s(s.get('restore_warm_cpu_s'))} / {fmt_s(s.get('restore_cold_cpu_s'))} "
                     f"| {'bit-exact' if ok else 'MISMATCH'} |")
    for where, fl in (("the disk", disk_floor), ("tmpfs (the memory tier's folder)", out.get("floor_tmpfs") or {})):
        if "warm_s" in fl:
            lines += ["", f"Floor on {where} (read + CRC32C + copy into the live tensors, nothing else): warm "
                          f"{fmt_s(fl['warm_s'])}, cold {fmt_s(fl['cold_s'])}, CPU {fmt_s(fl.get('warm_cpu_s'))} / "
                          f"{fmt_s(fl.get('cold_cpu_s'))} (readinto {fmt_s(fl['read_warm_s'])} / "
                          f"{fmt_s(fl['read_cold_s'])}, mmap {fmt_s(fl['mmap_warm_s'])} / {fmt_s(fl['mmap_cold_s'])})."]
    lines += ["", f"Targets: every tier's restore <= torch.load + load_state_dict, warm and cold, and <= "
                  f"{FLOOR_RATIO}x the floor of where its bytes lie (`nebula`, the memory tier: tmpfs, whose cold "
                  "restore reads it warm; the others: the disk)."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.restore", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=wl.WORKLOADS, default="124m")
    p.add_argument("--reps", type=int, default=5, help="warm and cold restores per system (medians)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--target", default=None, help="folder to write in (default: a temp folder in bench_out/)")
    p.add_argument("--drop-caches", action="store_true", help="fall back to /proc/sys/vm/drop_caches for cold")
    p.add_argument("--out", default=None, help="output folder (default bench_out/restore-<date>)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    repo = Path(__file__).resolve().parents[1]
    out_dir = Path(a.out or repo / "bench_out" / f"restore-{datetime.now():%Y-%m-%d}")
    base = Path(a.target) if a.target else repo / "bench_out"
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="restore-", dir=base))
    args = argparse.Namespace(restore_reps=a.reps, drop_caches=a.drop_caches)
    w = wl.build(a.model, torch.device("cpu"))  # a CPU state: the restore's own costs, no device copy
    w.train_step()
    out: dict[str, Any] = {"model": a.model, "state_bytes": w.state_bytes, "tensors": w.num_tensors, "reps": a.reps,
                           "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "machine": machine_info(folder, str(folder)), "systems": []}
    try:
        for name in a.systems.split(","):
            log.info("restore: %s", name)
            out["systems"].append(one_system(name, w, folder, args))
        out["floor"] = measure_restore_floor(w, folder, reps=a.reps, drop_caches=a.drop_caches)
        if "nebula" in a.systems.split(","):
            out["floor_tmpfs"] = measure_tmpfs_floor(w, reps=a.reps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out["loadavg"] = " / ".join(f"{x:.1f}" for x in os.getloadavg()) + " (1 / 5 / 15 min, at the end)"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(out, indent=1, default=str))
    (out_dir / "results.md").write_text(render(out))
    print(render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
