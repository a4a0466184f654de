"""The GPU campaign's benchmark: what a save costs the training loop on a GPU, at a few model sizes.

``python -m benchmarks.gpu_bench --models 124m,1.3b,largest --out DIR`` (what ``benchmarks/gpu/run.sh``
runs). Per model (a GPT-2-shaped model and AdamW on the GPU, :mod:`benchmarks.workloads`):

* ``torch.save`` + fsync of ``{model, optim state_dict(), step}`` (one save; for ``largest``, and for
  any model whose save would not fit the time left, it is estimated from the bytes per second
  measured on a smaller model, and marked so);
* nebula (``Checkpointer(root)``: the memory tier in /dev/shm and the local root; ``largest``: the
  memory tier only, the disk being too small): the first save of the state (the process's first for
  the first model: the copy path was set up when the Checkpointer was made) without ``prepare()``,
  then ``--reps`` saves, each after a forward/backward: blocking = the ``save_async`` call + the
  stall before the next ``optimizer.step()`` (``wait_snapshot()``), the save then waited for until
  durable (untimed); the same first save with ``prepare()`` on a second root;
* the call per tensor (call / tensors);
* throughput overhead at a cadence where persist keeps up: K = 1.25 x (time to durable / step
  time) steps per checkpoint, rounds of K steps with a save on the first and rounds without,
  interleaved; a round with a save waits for it to be durable at its end and that wait is
  reported apart (backlog: 0 when persist kept up).

Writes ``gpu_bench.json`` and ``gpu_bench.md`` into ``--out``; every step checks the time left
(``--budget-s``) and records what it skipped. ``--device cpu`` runs the same code on the CPU
with ``tiny`` (``--quick``: what ``tests/bench/test_gpu_campaign.py`` does: it checks the script, not the numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import workloads as wl
from benchmarks.peer_base import fsync_path, plain_state_dict

#: models tried as the largest state (it must fit the host: see :func:`_largest`), smallest first
LARGE = ("2.7b",)


class Clock:
    """The time left of the run's budget."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _largest(dev: torch.device) -> Optional[str]:
    """The largest of :data:`LARGE` whose state fits 30% of host RAM (staging, page-locked, plus
    the memory tier's copy) and half of the GPU's memory (training state is ~4/3 of it)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 0
    best = None
    for name in LARGE:
        c = wl.GPT_CONFIGS[name]
        params = c.vocab * c.d + c.block * c.d + c.layers * (12 * c.d * c.d + 13 * c.d)
        if 12 * params <= 0.3 * ram and 16 * params <= 0.8 * gpu:
            best = name
    return best


def torch_save(w: wl.Workload, root: Path) -> float:
    """Seconds of torch.save + fsync of the state (file and folder)."""
    path = root / "torch_save.pt"
    _sync(w.device)
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(plain_state_dict(w.state(0)), f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(root)
    s = time.perf_counter() - t
    path.unlink()
    return s


def _checkpointer(root: Path, memory_only: bool) -> Any:
    import nebula_ckpt as nc

    return nc.Checkpointer(str(root), tiers=[nc.MemoryTier()] if memory_only else None, keep_last=1)


def one_save(ck: Any, w: wl.Workload, step: int) -> dict[str, float]:
    """A save as training does it: call, forward/backward, stall before the step; then durable."""
    _sync(w.device)
    t0 = time.perf_counter()
    h = ck.save_async(step, w.state(step))
    t1 = time.perf_counter()
    w.forward_backward()
    t2 = time.perf_counter()
    h.wait_snapshot()
    t3 = time.perf_counter()
    w.optimizer_step()
    _sync(w.device)
    h.result()
    t4 = time.perf_counter()
    return {"call_s": t1 - t0, "stall_s": t3 - t2, "blocking_s": (t1 - t0) + (t3 - t2), "durable_s": t4 - t0}


def nebula_saves(w: wl.Workload, root: Path, reps: int, memory_only: bool, clock: Clock,
                 quick: bool = False) -> dict[str, Any]:
    """First save (without and with prepare()) and later saves (see the module docstring)."""
    out: dict[str, Any] = {}
    ck = _checkpointer(root / "nebula", memory_only)
    try:
        out["first"] = one_save(ck, w, 1)
        later = []
        for i in range(reps):
            if clock.left() < 2 * out["first"]["durable_s"] + 30:
                out["reps_skipped"] = reps - i
                break
            later.append(one_save(ck, w, 2 + i))
        out["later"] = later
        out["plans"] = ck.stats().get("plans")
    finally:
        ck.close()
    if not quick and clock.left() > out["first"]["durable_s"] + 30:
        ck = _checkpointer(root / "nebula-prepared", memory_only)
        try:
            _sync(w.device)
            t = time.perf_counter()
            ck.prepare(w.state(0), wait=True)
            out["prepare_s"] = time.perf_counter() - t
            out["first_prepared"] = one_save(ck, w, 1)
        finally:
            ck.close()
    return out


def throughput(w: wl.Workload, root: Path, durable_s: float, memory_only: bool, clock: Clock,
               quick: bool = False) -> dict[str, Any]:
    """Overhead of a save every K steps, K long enough for persist to keep up."""
    _sync(w.device)
    t = time.perf_counter()
    for _ in range(3):
        w.train_step()
    step_s = (time.perf_counter() - t) / 3
    k = 2 if quick else max(5, math.ceil(1.25 * durable_s / step_s))
    pairs = 1 if quick else min(3, int(clock.left() // (2 * k * step_s + durable_s + 10)))
    if pairs < 1:
        return {"skipped": f"a round of {k} steps does not fit the time left", "step_s": step_s, "k": k}
    ck = _checkpointer(root / "nebula-throughput", memory_only)
    without, with_, backlog = [], [], []
    try:
        for r in range(pairs):
            _sync(w.device)
            t0 = time.perf_counter()
            for _ in range(k):
                w.train_step()
            without.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            h = ck.save_async(100 + r, w.state(100 + r))
            for _ in range(k):
                w.train_step()
            t1 = time.perf_counter()
            h.result()
            backlog.append(time.perf_counter() - t1)
            with_.append(t1 - t0)
    finally:
        ck.close()
    over = statistics.median(with_) / statistics.median(without) - 1
    return {"step_s": step_s, "k": k, "pairs": pairs, "without_s": without, "with_s": with_,
            "backlog_s": backlog, "overhead": over}


def run_model(name: str, dev: torch.device, root: Path, a: argparse.Namespace, clock: Clock,
              bandwidth: Optional[float]) -> dict[str, Any]:
    """Every measurement of one model (see the module docstring)."""
    memory_only = name in LARGE
    w = wl.build(name, dev)
    res: dict[str, Any] = {"model": w.describe()}
    nbytes = w.state_bytes
    est = nbytes / bandwidth if bandwidth else None
    if memory_only or (est is not None and est > 0.25 * clock.left()):
        res["torch_save_s"], res["torch_save_estimated"] = est, True
    else:
        res["torch_save_s"], res["torch_save_estimated"] = torch_save(w, root), False
    res["nebula"] = nebula_saves(w, root, a.reps, memory_only, clock, a.quick)
    later = res["nebula"].get("later") or [res["nebula"]["first"]]
    durable = max(s["durable_s"] for s in later)
    res["throughput"] = throughput(w, root, durable, memory_only, clock, a.quick)
    del w
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """The figures the campaign reports for one model."""
    n = res["nebula"]
    later = n.get("later") or []
    med = (lambda k: statistics.median(s[k] for s in later)) if later else (lambda k: None)
    ts = res.get("torch_save_s")
    blocking = med("blocking_s")
    first = n["first"]["blocking_s"]
    return {"blocking_s": blocking, "call_s": med("call_s"), "stall_s": med("stall_s"),
            "share_of_torch_save": blocking / ts if blocking is not None and ts else None,
            "call_per_tensor_s": med("call_s") / res["model"]["num_tensors"] if later else None,
            "first_s": first, "first_over_later": first / blocking if blocking else None,
            "first_prepared_s": (n.get("first_prepared") or {}).get("blocking_s"),
            "overhead": res["throughput"].get("overhead"), "backlog_s": res["throughput"].get("backlog_s")}


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.3f}%"


def _ms(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{1e3 * x:.2f} ms"


def _us(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{1e6 * x:.2f} µs"


def _times(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.1f}x"


def _row(r: dict[str, Any]) -> str:
    s, m, tp = summarize(r), r["model"], r["throughput"]
    ts = r.get("torch_save_s")
    saved = "n/a" if ts is None else f"{ts:.2f} s" + (" (estimated)" if r.get("torch_save_estimated") else "")
    share = s["share_of_torch_save"]
    met = "n/a" if share is None else ("met" if share <= 1e-3 else "not met")
    over = "skipped" if s["overhead"] is None else f"{100 * s['overhead']:+.1f}% (K={tp.get('k')})"
    backlog = "n/a" if not s["backlog_s"] else _ms(max(s["backlog_s"]))
    cells = [m["name"], f"{m['state_bytes'] / 1e9:.2f} GB", str(m["num_tensors"]), saved,
             f"{_ms(s['blocking_s'])} ({_ms(s['call_s'])} + {_ms(s['stall_s'])})", _pct(share), met,
             _us(s["call_per_tensor_s"]), _ms(s["first_s"]), _times(s["first_over_later"]),
             _ms(s["first_prepared_s"]), over, backlog]
    return "| " + " | ".join(cells) + " |"


def report(results: dict[str, Any], out: Path) -> None:
    """``gpu_bench.md``: one table of the figures, one line per model."""
    lines = ["# nebula_ckpt on a GPU", "", f"Device: {results['device']}; budget {results['budget_s']:.0f} s.", "",
             "| model | state | tensors | torch.save + fsync | nebula blocking (call + stall) | share | 1000x goal "
             "(<= 0.1%) | call per tensor | first save (no prepare) | first / later | first after prepare() | "
             "throughput overhead (K steps) | backlog |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["models"]:
        lines.append(f"| {r['name']} | error: {r['error']} |" if "error" in r else _row(r))
    lines += ["", __doc__.split("\n\n", 2)[1].strip(), ""]
    (out / "gpu_bench.md").write_text("\n".join(lines))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="124m,1.3b,largest")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--target", default=None, help="folder for the checkpoints (default: a temp folder)")
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true",
                   help="one later save, no first save after prepare(), one throughput pair of 2 steps (a check "
                        "of the code, not a measurement)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here (torch.cuda.is_available() is False); --device cpu runs the code on the CPU")
    clock = Clock(a.budget_s)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(a.target or tempfile.mkdtemp(prefix="gpu-bench-"))
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                               "budget_s": a.budget_s, "models": []}
    bandwidth = None
    try:
        for name in [m for m in a.models.split(",") if m]:
            if name == "largest":
                name = _largest(dev) or ""
                if not name:
                    results["models"].append({"name": "largest", "error": "no larger model fits this host"})
                    continue
            if clock.left() < 60:
                results["models"].append({"name": name, "error": "skipped: out of time"})
                continue
            try:
                r = run_model(name, dev, root, a, clock, bandwidth)
            except Exception as e:  # recorded; the next model still runs
                results["models"].append({"name": name, "error": f"{type(e).__name__}: {e}"})
                continue
            r["name"] = name
            r["summary"] = summarize(r)
            if not r["torch_save_estimated"] and r["torch_save_s"]:
                bandwidth = r["model"]["state_bytes"] / r["torch_save_s"]
            results["models"].append(r)
            (out / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    finally:
        if a.target is None:
            shutil.rmtree(root, ignore_errors=True)
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    report(results, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
