"""Recovery after the loss of a node, and what memory-tier replicas cost the training loop.

Real ranks (gloo on 127.0.0.1) as 2 simulated nodes (``NEBULA_NODE_ID``, one ``NEBULA_SHM_DIR``
per node). Every rank trains its own model + AdamW (``--mb`` MB of state per rank).

* **Training-loop cost**: ``--iters`` iterations of a fixed compute step, ``save_async`` every
  ``--save-every``, memory tier only, with ``replicas=0`` and ``replicas=1`` (jobs alternate,
  ``--repeats`` each): iterations per second (slowest rank) and the training thread's blocked time;
  and each rank's CPU seconds (every thread, from the loop's start until its saves are done), so
  that what replication costs per MB moved shows even where the ranks share their cores.
  Two kinds of step (``--loop``):

  * ``cpu``: the step is the model's forward, backward and AdamW step on the CPU: training keeps
    every host core busy, so every CPU cycle replication takes is taken from training.
  * ``host-idle``: a model of an accelerator step, NOT a GPU measurement. On a GPU host the step
    runs on the device and leaves the host cores idle; here each iteration changes one element of
    every parameter and optimizer moment (the state changes as a device step changes it, so each
    save is as large) and then sleeps for the CPU step's time (its median over a few steps, taken
    by the first job's ranks, or ``--step-ms``; the same in every job of a world): the host
    cores are idle for the step's length. The measured step depends on the host's load at that
    moment (on a shared host it was 5x the quiet one): to compare runs taken under different
    loads, or code before and after a change, give the same ``--step-ms`` to each.

  Each run also splits the training thread's loop time (:mod:`benchmarks.replicas_threads`):
  run-queue delay (it was ready, every core busy), other waits (the GIL, a lock, the save
  pipeline), the ``save_async`` calls, and CPU seconds by thread. A rank's loop holds only
  ``--iters / --save-every`` saves: where the host is shared, take more ``--repeats`` rather than
  trusting a single run's overhead.
* **Draining a lost node's memory** (``--parts drain``, :mod:`benchmarks.replicas_drain`): the
  time from a node's loss to its newest step (only in RAM) being durable on the shared tier,
  against the per-save cost of the persist cadence it replaces.
* **Recovery**: one job saves a step to ``[MemoryTier(replicas=1), LocalTier(disk), RemoteTier(Azurite)]``;
  then, from a copy of both nodes' memory tiers each time, a restarted job measures on every rank
  the time from after ``init_process_group`` to its first optimizer step done (the slowest rank
  counts), for:
  ``crash-memory`` (a process crash: every memory tier intact, ``replicas=0``),
  ``node-replicas`` (node 1's memory tier gone, ``replicas=1``: its ranks pull from node 0),
  ``node-disk`` (node 1 gone, no replicas: its ranks read the local-disk tier),
  ``node-remote`` (node 1 gone, no replicas, tiers memory + remote: its ranks read Azurite).

Run (writes ``results.md`` and ``results.json`` into ``--out``)::

    python -m benchmarks.replicas --worlds 2 4 --mb 48 --repeats 3 \\
        --out benchmarks/results/replicas-<date>

``--parts recovery`` (or ``loop``, or ``drain``) measures that part only (default: recovery and loop).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks import replicas_drain as drain
from benchmarks import replicas_threads as threads
from benchmarks.common import free_port, python_popen

REPO = Path(__file__).resolve().parents[1]
#: where the simulated nodes' memory tiers live (a tmpfs; set by main)
SHM = Path(tempfile.gettempdir())
VARIANTS = ("crash-memory", "node-replicas", "node-disk", "node-remote")
#: where each kind of training step's loop results go in ``results.json``
LOOP_KEYS = {"cpu": "loop", "host-idle": "loop_host_idle"}


# -- one rank (run as a subprocess: python -m benchmarks.replicas --rank-job SPEC.json) ----------
def _rank_main(spec: dict[str, Any]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = rank * 2 // world
    os.environ["NEBULA_NODE_ID"] = f"n{node}"
    os.environ["NEBULA_SHM_DIR"] = os.path.join(spec["shm"], f"n{node}")
    os.makedirs(os.environ["NEBULA_SHM_DIR"], exist_ok=True)
    import torch
    import torch.distributed as dist

    import nebula_ckpt as nc

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    layers = max(1, int(spec["mb"]) // 12)   # 1024 x 1024 fp32 + AdamW's two moments: 12 MB a layer
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 1024)

    def train_step() -> None:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    tiers = drain.rank_tiers(nc, spec) if spec["role"] in ("save-for-drain", "restore-fresh") else _tiers(nc, spec)
    out: dict[str, Any] = {}
    dist.barrier()
    t0 = time.perf_counter()
    if spec["role"] == "save-for-drain":
        ck = nc.Checkpointer(spec["root"], tiers=tiers)
        drain.save_loop(ck, train_step, {"model": model, "optim": opt}, spec, out)
        dist.barrier()
        os._exit(_write(spec, rank, out))  # a crash: nothing closed, the memory tiers stay
    if spec["role"] in ("restore", "restore-fresh"):
        with nc.Checkpointer(spec["root"], tiers=tiers) as ck:
            state = {"model": model, "optim": opt}
            out["step"] = ck.load_latest(state)
            train_step()
            out["recovery_s"] = time.perf_counter() - t0
            out["last_restore"] = ck.last_restore
            dist.barrier()
        # after close(): how long the keep round took (a pulled copy into the memory tier, off the
        # path to the first step: after it, at close() here)
        out["keep_s"] = (ck.stats().get("replicas") or {}).get("last_keep_s")
    else:
        train_step()
        step = train_step if spec.get("loop") != "host-idle" else \
            _host_idle(train_step, model, opt, out, spec.get("compute_s"))
        with nc.Checkpointer(spec["root"], tiers=tiers) as ck:
            dist.barrier()
            _loop(ck, step, {"model": model, "optim": opt}, spec, out)
            out["stats"] = ck.stats()
            dist.barrier()
            if spec["role"] == "save-for-recovery":
                os._exit(_write(spec, rank, out))  # a crash: nothing closed, the memory tiers stay
    _write(spec, rank, out)
    dist.destroy_process_group()


def _loop(ck: Any, step: Callable[[], None], state: dict[str, Any], spec: dict[str, Any], out: dict[str, Any]) -> None:
    """The measured training loop: ``--iters`` steps, ``save_async`` every ``--save-every``, then
    the wait for the saves; its times and CPU (see :mod:`benchmarks.replicas_threads`) into ``out``."""
    th0 = threads.thread_cpu()
    t0, c0, tc0, s0 = time.perf_counter(), _cpu_s(), time.thread_time(), threads.sched()
    step_s = save_s = 0.0
    for i in range(int(spec["iters"])):
        t = time.perf_counter()
        step()
        step_s += time.perf_counter() - t
        if (i + 1) % int(spec["save_every"]) == 0:
            t = time.perf_counter()
            ck.save_async(i + 1, state)
            save_s += time.perf_counter() - t
    out["loop_s"] = time.perf_counter() - t0
    out["train_cpu_s"] = time.thread_time() - tc0  # the training thread's own CPU
    out.update(threads.breakdown(out["loop_s"], int(spec["iters"]), float(out.get("compute_s", 0.0)),
                                 step_s, save_s, s0, threads.sched()))
    ck.wait()
    out["cpu_s"] = _cpu_s() - c0  # every thread of the rank, until its saves are done
    out["threads_cpu"] = {k: v - th0.get(k, 0.0) for k, v in threads.thread_cpu().items()}


def _host_idle(train_step: Callable[[], None], model: Any, opt: Any, out: dict[str, Any],
               spec_s: Optional[float]) -> Callable[[], None]:
    """The host-idle step of this model (see the module docstring): it changes one element of
    every parameter and optimizer moment, then sleeps ``spec_s`` (when given; else the CPU step's
    median time, measured now) (in ``out``)."""
    import torch

    compute_s = out["compute_s"] = float(spec_s) if spec_s else _step_s(train_step)
    moving = [*model.parameters(), *(v for st in opt.state.values() for v in st.values()
                                     if torch.is_tensor(v) and v.numel() > 1)]

    def step() -> None:
        with torch.no_grad():
            for t in moving:
                t.view(-1)[0] += 1.0
        time.sleep(compute_s)
    return step


def _step_s(train_step: Any, n: int = 5) -> float:
    """The median wall time of ``n`` CPU training steps (what a host-idle step sleeps)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _cpu_s() -> float:
    """CPU seconds this process used so far (every thread, user + system)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _tiers(nc: Any, spec: dict[str, Any]) -> list[Any]:
    k = int(spec.get("replicas", 0))
    mem = nc.MemoryTier(replicas=k)
    if spec["role"] == "loop":
        return [mem]
    disk = nc.LocalTier(spec["disk"])
    remote = nc.RemoteTier(spec["remote"], storage_options=spec["remote_options"])
    if spec["role"] == "save-for-recovery":
        return [mem, disk, remote]
    return [mem, remote] if spec["variant"] == "node-remote" else [mem, disk]


def _write(spec: dict[str, Any], rank: int, out: dict[str, Any]) -> int:
    Path(spec["out"], f"r{rank}.json").write_text(json.dumps(out, default=str))
    return 0


# -- the driver ---------------------------------------------------------------------------------
def _job(world: int, spec: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    out = Path(tempfile.mkdtemp(dir=tmp))
    spec = dict(spec, out=str(out))
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r // 2),
                   LOCAL_WORLD_SIZE=str(max(1, world // 2)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        procs.append(python_popen([sys.executable, "-m", "benchmarks.replicas", "--rank-job", str(spec_file)],
                                  env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for r, p in enumerate(procs):
        stdout, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"rank {r} of a {spec['role']} job failed:\n{stdout[-3000:]}")
    return [json.loads((out / f"r{r}.json").read_text()) for r in range(world)]


def _loop_cost(world: int, args: argparse.Namespace, tmp: Path, loop: str = "cpu") -> dict[str, Any]:
    runs: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    # a host-idle step sleeps the same time in every job of this world (--step-ms, or what the
    # first job's ranks measured): replicas=0 and 1 compare the same loop
    step_s = args.step_ms / 1e3 if args.step_ms else None
    for _ in range(args.repeats):
        for k in (0, 1):
            shm = SHM / f"loop-shm-{k}"
            got = _job(world, {"role": "loop", "replicas": k, "root": str(tmp / f"loop-root-{k}-{time.time_ns()}"),
                               "shm": str(shm), "mb": args.mb, "iters": args.iters, "loop": loop,
                               "save_every": args.save_every, "compute_s": step_s}, tmp)
            if loop == "host-idle" and step_s is None:
                step_s = statistics.median(g["compute_s"] for g in got)
            shutil.rmtree(shm, ignore_errors=True)
            repl = [g["stats"].get("replicas") or {} for g in got]
            runs[k].append({"loop_s": max(g["loop_s"] for g in got),
                            "blocked_s": max(g["stats"]["blocked_s_total"] for g in got),
                            "replica_s": max((g["stats"].get("durable_s_last", {}).get("replicas") or 0) for g in got),
                            "cpu_s": statistics.mean(g["cpu_s"] for g in got),
                            "train_cpu_s": statistics.mean(g["train_cpu_s"] for g in got),
                            "moved_mb": statistics.mean((r.get("sent_bytes", 0) + r.get("received_bytes", 0)) / 1e6
                                                        for r in repl),
                            "rounds": statistics.mean(r.get("rounds", 0) for r in repl),
                            "failed_rounds": statistics.mean(r.get("failed", 0) for r in repl),
                            "sent_mb": statistics.mean(r.get("sent_bytes", 0) / 1e6 for r in repl),
                            "compute_s": statistics.mean(g.get("compute_s", 0.0) for g in got),
                            **threads.rank_means(got)})
    med = {k: {m: statistics.median(r.get(m, 0.0) for r in v) for m in {m for r in v for m in r}}
           for k, v in runs.items()}
    overhead = (med[1]["loop_s"] - med[0]["loop_s"]) / med[0]["loop_s"] * 100
    # what replication costs in CPU, per rank: the extra CPU seconds of a replicas=1 run, per MB
    # it sent and received (each rank sends its step and receives a partner's)
    extra_cpu = med[1]["cpu_s"] - med[0]["cpu_s"]
    per_mb = extra_cpu / med[1]["moved_mb"] * 1e3 if med[1]["moved_mb"] else None
    return {"runs": runs, "median": med, "overhead_pp": overhead, "replica_cpu_s": extra_cpu,
            "replica_cpu_ms_per_mb": per_mb, "cpu_overhead_pp": extra_cpu / med[0]["cpu_s"] * 100}


def _recovery(world: int, args: argparse.Namespace, tmp: Path, remote: str, options: dict[str, Any]) -> dict[str, Any]:
    shm, disk = SHM / f"rec-shm-{world}", str(tmp / f"disk-{world}")
    base = {"root": disk, "shm": str(shm), "mb": args.mb, "disk": disk, "remote": f"{remote}/rec-{world}",
            "remote_options": options, "iters": 1, "save_every": 1}
    _job(world, dict(base, role="save-for-recovery", replicas=1), tmp)
    snap = SHM / f"rec-snap-{world}"
    shutil.copytree(shm, snap)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    sources: dict[str, Any] = {}
    keep: list[float] = []
    for _ in range(args.repeats):
        for v in VARIANTS:
            shutil.rmtree(shm)
            shutil.copytree(snap, shm)
            if v != "crash-memory":
                shutil.rmtree(shm / "n1")
            got = _job(world, dict(base, role="restore", variant=v, replicas=1 if v == "node-replicas" else 0), tmp)
            assert all(g["step"] == 1 for g in got), got
            samples[v].append(max(g["recovery_s"] for g in got))
            sources[v] = [g["last_restore"].get("source") or g["last_restore"]["tier"].split(":")[0] for g in got]
            keep += [g["keep_s"] for g in got if g.get("keep_s") is not None]
    shutil.rmtree(snap)
    med = {v: statistics.median(s) for v, s in samples.items()}
    return {"samples": samples, "median": med, "sources": sources,
            "keep_s": statistics.median(keep) if keep else None,
            "replicas_vs_crash": med["node-replicas"] / med["crash-memory"],
            "replicas_vs_remote": med["node-replicas"] / med["node-remote"],
            "replicas_vs_disk": med["node-replicas"] / med["node-disk"]}


def _azurite() -> Optional[str]:
    """The repository's Azurite (scripts/install_blob_servers.sh), else the emulator's own search."""
    local = REPO / ".node" / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else None


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_avg": os.getloadavg()}


def _report(res: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["# Memory-tier replicas: node-loss recovery and training-loop cost", "",
             f"Machine: {res['machine']} (shared with other jobs: noisy; medians of {args.repeats} runs).",
             f"Command: `python -m benchmarks.replicas {' '.join(sys.argv[1:])}`", "",
             f"State per rank: {args.mb} MB (model + AdamW); ranks as 2 simulated nodes"
             + ("; remote tier: Azurite." if res["recovery"] else "."), ""]
    if res["recovery"]:
        lines += ["## Recovery, restart to first optimizer step done (slowest rank), seconds", "",
                  "| ranks | process crash, own memory | node lost, replicas | node lost, local disk | "
                  "node lost, remote | replicas / crash | replicas / remote |", "|---|---:|---:|---:|---:|---:|---:|"]
    for w, r in res["recovery"].items():
        m = r["median"]
        lines.append(f"| {w} | {m['crash-memory']:.3f} | {m['node-replicas']:.3f} | {m['node-disk']:.3f} | "
                     f"{m['node-remote']:.3f} | {r['replicas_vs_crash']:.2f}x | {r['replicas_vs_remote']:.2f}x |")
    if res["recovery"]:
        lines += ["", "Targets: replicas within 1.5x of a process crash, at most 0.25x of the remote tier.", "",
                  "A lost rank restores from the copy it pulled into its process memory; its memory tier keeps "
                  "a copy after the first steps (a second pull, niced, here at close()): the keep round took "
                  + ", ".join(f"{r['keep_s']:.3f} s at {w} ranks" for w, r in res["recovery"].items()
                              if r.get("keep_s") is not None) + " (median), not counted above.", ""]
    if res["loop"]:
        lines += ["## Training-loop cost (memory tier only, save every "
                  f"{args.save_every} of {args.iters} iterations)", ""]
        lines += _loop_lines(res["loop"])
    if res.get("loop_host_idle"):
        lines += ["## Training-loop cost, host-idle step (memory tier only, save every "
                  f"{args.save_every} of {args.iters} iterations)", "",
                  "A model of an accelerator step, not a GPU measurement: each iteration changes one element of "
                  "every parameter and optimizer moment, then sleeps for the CPU step's median time (measured by "
                  "the first job's ranks, or --step-ms; the same in every job), leaving the host cores idle as a "
                  "step on a GPU does.", ""]
        lines += _loop_lines(res["loop_host_idle"])
    if res.get("drain"):
        lines += drain.report_lines(res["drain"], args.mb)
    if res["loop"] and res.get("loop_host_idle"):
        lines += ["## Side by side: replication's loop overhead by kind of step", "",
                  "| ranks | CPU-bound step (pp) | host-idle step (pp) | step s, host-idle | CPU ms per MB, CPU-bound |"
                  " CPU ms per MB, host-idle |", "|---|---:|---:|---:|---:|---:|"]
        for w, c in res["loop"].items():
            h = res["loop_host_idle"].get(w)
            if h is not None:
                lines.append(f"| {w} | {c['overhead_pp']:+.1f} | {h['overhead_pp']:+.1f} | "
                             f"{h['median'][1]['compute_s']:.4f} | {_per_mb(c)} | {_per_mb(h)} |")
        lines += [""]
    return "\n".join(lines)


def _per_mb(c: dict[str, Any]) -> str:
    return "-" if c["replica_cpu_ms_per_mb"] is None else f"{c['replica_cpu_ms_per_mb']:.2f}"


def _loop_lines(loop: dict[Any, dict[str, Any]]) -> list[str]:
    """The training-loop tables of one kind of step."""
    lines = ["| ranks | loop s, replicas=0 | loop s, replicas=1 | overhead (pp) | blocked s, 0 | blocked s, 1 |"
             " replica round s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for w, c in loop.items():
        m = c["median"]
        lines.append(f"| {w} | {m[0]['loop_s']:.3f} | {m[1]['loop_s']:.3f} | {c['overhead_pp']:+.1f} | "
                     f"{m[0]['blocked_s']:.3f} | {m[1]['blocked_s']:.3f} | {m[1]['replica_s']:.3f} |")
    lines += ["", "Target: replication adds at most 2 percentage points of throughput overhead.", "",
              "CPU per rank (every thread, from the loop's start until its saves are done; each rank sends its "
              "step to its partner and receives one):", "",
              "| ranks | CPU s, replicas=0 | CPU s, replicas=1 | training thread CPU s | rounds | MB moved |"
              " replication CPU s | CPU ms per MB moved | CPU overhead (pp) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w, c in loop.items():
        m = c["median"]
        lines.append(f"| {w} | {m[0]['cpu_s']:.3f} | {m[1]['cpu_s']:.3f} | {m[0]['train_cpu_s']:.3f} | "
                     f"{m[1]['rounds']:.1f} | {m[1]['moved_mb']:.0f} | {c['replica_cpu_s']:.3f} | {_per_mb(c)} | "
                     f"{c['cpu_overhead_pp']:+.1f} |")
    return lines + [""] + threads.report_lines(loop)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-job", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=int, default=48, help="state per rank, MB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/replicas")
    ap.add_argument("--parts", nargs="+", choices=("recovery", "loop", "drain"), default=["recovery", "loop"],
                    help="what to measure (default: recovery and loop)")
    ap.add_argument("--drain-saves", type=int, default=5, help="saves of the drain part's jobs")
    ap.add_argument("--loop", nargs="+", choices=("cpu", "host-idle"), default=["cpu", "host-idle"],
                    help="the training loop's kinds of step (default: both; see the module docstring)")
    ap.add_argument("--step-ms", type=float, default=None,
                    help="the host-idle step's sleep, ms (default: the CPU step's median, measured by the first job)")
    args = ap.parse_args(argv)
    if args.rank_job:
        _rank_main(json.loads(Path(args.rank_job).read_text()))
        return 0
    sys.path.insert(0, str(REPO))
    from tests.blob.emulators import AzuriteEmulator  # the test suite's launcher; a checkout has both

    res: dict[str, Any] = {"machine": _machine(), "recovery": {}, "loop": {}, "loop_host_idle": {}, "drain": {}}
    global SHM
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        SHM = Path(stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                                   else None)))
        az = stack.enter_context(AzuriteEmulator(_azurite())) if "recovery" in args.parts else None
        remote = az.create_container("replicas") if az is not None else ""
        for w in args.worlds:
            if az is not None:
                res["recovery"][w] = _recovery(w, args, tmp, remote, az.storage_options)
            if "loop" in args.parts:
                for loop in args.loop:
                    res[LOOP_KEYS[loop]][w] = _loop_cost(w, args, tmp, loop)
            if "drain" in args.parts:
                res["drain"][w] = drain.drain_cost(w, args, tmp, SHM, _job)
            print(json.dumps({w: {part: res[part][w]["median"] for part in ("recovery", "drain", *LOOP_KEYS.values())
                                  if w in res[part]}}, default=str), flush=True)
    res["machine"]["load_avg_after"] = os.getloadavg()
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "results.json").write_text(json.dumps(res, indent=1, default=str))
    Path(args.out, "results.md").write_text(_report(res, args))
    print(_report(res, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
