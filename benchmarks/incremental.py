"""Incremental checkpoints of a mostly frozen model: ``python -m benchmarks.incremental``.

The 124M GPT-2 of the headline benchmark (:mod:`benchmarks.workloads`) with LoRA adapters
(``peft``) on its attention layers: the base is frozen, AdamW trains the adapters only. Saved
every ``--interval`` training steps, on each setup (``--setups``):

* ``disk``: ``Checkpointer(root, tiers=[LocalTier(root)])``;
* ``remote``: ``Checkpointer(url, tiers=[RemoteTier(url)])`` on Azurite (the test suite's launcher,
  ``tests/blob/emulators.py``; ``scripts/install_blob_servers.sh`` installs it),
* ``memory``: ``Checkpointer(root, tiers=[MemoryTier()])``: the memory tier alone, in a private
  folder of ``/dev/shm``; a step's bytes are what its own folder holds in the tmpfs,
* ``memory+disk``: ``Checkpointer(root, tiers=[MemoryTier(), LocalTier(root)])``: both tiers take
  every save (the disk tier takes the memory tier's byte compare for the tensors it found
  unchanged instead of hashing them: :func:`nebula_ckpt.tiers.memory.compare.staged_hashes`); a step's bytes are the
  disk tier's, its time until durable is the later of the two tiers',

by each system (``--systems``):

* ``nebula_incremental``: the default (a save writes the tensors that changed since its base);
* ``nebula_full``: ``Checkpointer(..., incremental=False)``: every save whole;
* ``torch_save``: ``torch.save`` of the whole state (model + optimizer) + fsync (disk only);
* ``torch_save_adapters``: ``torch.save`` of the adapters' weights (``peft``'s
  ``get_peft_model_state_dict``) + the optimizer, what PEFT users save by hand (disk only).

Per save: the bytes it wrote (its step folder / file on disk, the objects under its step prefix
on the remote), blocking time (call + stall before the next optimizer step), time until durable
(:func:`benchmarks.measure.one_save`); per system the throughput overhead of a save every
``--interval`` steps (:func:`benchmarks.measure.measure_throughput`, interleaved rounds) and a
restore into the live model checked bit for bit. The first save of a checkpointer writes its
base in full and is shown apart. Targets: a later save writes at most 2% of the full state's
bytes, and blocks no longer than a full save. ``--quick``: the tiny GPT, 3 saves, a smoke run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from benchmarks import workloads as wl
from benchmarks.common import fmt_b, fmt_pct, fmt_s, summary, usable_cores
from benchmarks.limits import machine_info, rss_bytes
from benchmarks.measure import measure_throughput, one_save
from benchmarks.peer_base import Peer, PeerUnavailable, StateFn, fsync_path
from benchmarks.peers import Nebula, TorchSave

log = logging.getLogger(__name__)

SYSTEMS = ("nebula_incremental", "nebula_full", "torch_save", "torch_save_adapters")
SETUPS = ("disk", "remote", "memory", "memory+disk")
#: the share of the full state's bytes a later save may write (the issue's target)
BYTES_TARGET = 0.02


# --------------------------------------------------------------------------- the workload

def build_lora(name: str, rank: int, targets: list[str], seed: int = 0) -> wl.Workload:
    """GPT workload ``name`` (CPU) with LoRA adapters of ``rank`` on ``targets``; AdamW on the
    adapters only, one step taken so that its moments exist."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = wl.GPT_CONFIGS[name]
    model = get_peft_model(wl.GPT(cfg), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, cfg.vocab, (1, 64), generator=gen)
    w = wl.Workload(name=f"{name}-lora", model=model, optimizer=opt, device=torch.device("cpu"), batch=batch,
                    description=f"GPT-2 shape d={cfg.d}, {cfg.layers} layers, vocab {cfg.vocab}; LoRA r={rank} "
                                f"on {','.join(targets)} (peft), base frozen; AdamW on the adapters")
    w.train_step()
    tensors = wl.state_tensors(model, opt)
    w.params = sum(p.numel() for p in model.parameters())
    w.state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    w.num_tensors = len(tensors)
    return w


def trainable_share(w: wl.Workload) -> dict[str, Any]:
    """What trains: parameters, and the bytes a step changes (adapters + their AdamW state)."""
    params = [p for p in w.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    changed = sum(p.numel() * p.element_size() for p in params)
    for st in w.optimizer.state.values():
        changed += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return {"trainable_params": n, "params": w.params, "trainable_param_share": n / w.params,
            "changed_bytes_per_step": changed, "changed_share": changed / w.state_bytes}


def digest(w: wl.Workload) -> str:
    """SHA-256 of every tensor of the model and optimizer state (bit-exact restores)."""
    h = hashlib.sha256()
    tensors = list(w.model.state_dict().values())
    tensors += [v for st in w.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- the systems

class NebulaTier(Nebula):
    """nebula_ckpt on one tier (local disk or a remote URL), incremental or full."""

    incremental = True

    def __init__(self, setup: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        self.setup = setup
        self.storage_options = storage_options or {}
        self.name = "nebula_incremental" if self.incremental else "nebula_full"
        kind = {"disk": "LocalTier(root)", "remote": "RemoteTier(root)", "memory": "MemoryTier()",
                "memory+disk": "MemoryTier(), LocalTier(root)"}[setup]
        self.calls = (f"nc.Checkpointer(root, tiers=[{kind}]"
                      + ("" if self.incremental else ", incremental=False") + "); save_async; wait_snapshot; result")
        self.last_metrics: Optional[dict[str, Any]] = None

    def check(self, target: str) -> None:
        import inspect

        import nebula_ckpt as nc

        if "incremental" not in inspect.signature(nc.Checkpointer).parameters:
            raise PeerUnavailable("this nebula_ckpt has no incremental checkpoints (Checkpointer(incremental=...))")

    def open(self, root: Path | str) -> None:
        import nebula_ckpt as nc

        self.root = root if isinstance(root, Path) else None
        self.url = str(root)
        if isinstance(root, Path):
            root.mkdir(parents=True, exist_ok=True)
            tiers: list[Any] = local_tiers(self.setup, str(root))
        else:
            tiers = [nc.RemoteTier(self.url, storage_options=self.storage_options)]
        kw: dict[str, Any] = {} if self.incremental else {"incremental": False}
        self.ck = nc.Checkpointer(self.url, tiers=tiers, storage_options=self.storage_options or None, **kw)
        self._handle = None
        self._handles = []

    def wait_durable(self) -> None:
        h = self._handle
        super().wait_durable()
        if h is not None:
            self.last_metrics = h.metrics.to_dict()

    def step_bytes(self, step: int) -> int:
        """Bytes stored under the folder of ``step`` on the tier (what that save wrote)."""
        import fsspec

        from nebula_ckpt.format.names import step_dir

        if self.setup == "memory":  # what the step holds in the tmpfs (its own folder's files)
            folder = Path(self.ck.tiers[0].path or "") / step_dir(step)  # type: ignore[attr-defined]
            return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())

        fs, path = fsspec.core.url_to_fs(self.url, **self.storage_options)
        fs.invalidate_cache()
        found = fs.find(f"{path.rstrip('/')}/{step_dir(step)}", detail=True)
        return sum(int(v.get("size") or 0) for v in found.values())


def local_tiers(setup: str, root: str) -> list[Any]:
    """The tiers of a local ``setup``: the memory tier, the disk tier at ``root``, or both."""
    import nebula_ckpt as nc

    tiers: dict[str, list[Any]] = {"memory": [nc.MemoryTier()], "disk": [nc.LocalTier(root)],
                                   "memory+disk": [nc.MemoryTier(), nc.LocalTier(root)]}
    return tiers[setup]


class NebulaFullTier(NebulaTier):
    incremental = False


class TorchSaveWhole(TorchSave):
    """``torch.save`` of the whole state + fsync (:class:`benchmarks.peers.TorchSave`)."""

    def step_bytes(self, step: int) -> int:
        assert self._latest is not None
        return os.path.getsize(self._latest)


class TorchSaveAdapters(TorchSaveWhole):
    """What PEFT users save by hand: the adapters' weights and the optimizer, ``torch.save`` + fsync."""

    name = "torch_save_adapters"
    calls = ("torch.save({model: peft.get_peft_model_state_dict(model), optim: opt.state_dict(), step}, f); "
             "f.flush(); os.fsync; fsync(dir)")

    def save(self, step: int, state_fn: StateFn) -> None:
        from peft import get_peft_model_state_dict

        state = state_fn()
        path = self._new_path(step, ".pt")
        with open(path, "wb") as f:
            torch.save({"model": get_peft_model_state_dict(state["model"]), "optim": state["optim"].state_dict(),
                        "step": state["step"]}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(path.parent)

    def restore(self, into: dict[str, Any]) -> int:
        from peft import set_peft_model_state_dict

        assert self._latest is not None
        sd = torch.load(self._latest, map_location="cpu", weights_only=True)
        set_peft_model_state_dict(into["model"], sd["model"])
        into["optim"].load_state_dict(sd["optim"])
        return int(sd["step"])


def make_peer(system: str, setup: str, storage_options: Optional[dict[str, Any]]) -> Peer:
    """The peer of ``system`` on ``setup``."""
    if system in ("nebula_incremental", "nebula_full"):
        return (NebulaTier if system == "nebula_incremental" else NebulaFullTier)(setup, storage_options)
    if setup != "disk":
        raise PeerUnavailable(f"{system} writes local files only")
    return TorchSaveWhole() if system == "torch_save" else TorchSaveAdapters()


# --------------------------------------------------------------------------- one system

def measure_system(peer: Peer, w: wl.Workload, root: Any, args: argparse.Namespace,
                   baselines: list[float]) -> dict[str, Any]:
    """``args.saves`` saves, one every ``args.interval`` steps, a bit-exact restore, then the
    throughput rounds; never raises (an error is recorded)."""
    res: dict[str, Any] = {"name": peer.name, "calls": peer.calls, "status": "ok", "saves": []}
    try:
        peer.open(root)
    except Exception as e:
        log.exception("%s: open failed", peer.name)
        return {**res, "status": "error", "reason": f"{type(e).__name__}: {e}"}
    try:
        step = 0
        for _ in range(args.saves):
            for _ in range(args.interval - 1):
                w.train_step()
            step += args.interval
            saved = digest(w)
            s: dict[str, Any] = dict(one_save(peer, w, step))  # returns once the save is durable
            s["bytes"] = peer.step_bytes(step)  # type: ignore[attr-defined]
            s["metrics"] = getattr(peer, "last_metrics", None)
            res["saves"].append(s)
        w.train_step()  # move away from the saved state: a no-op restore cannot pass
        t0 = time.perf_counter()
        res["restored_step"] = peer.restore(w.state(0))
        res["restore_s"] = time.perf_counter() - t0
        res["restore_bit_exact"] = res["restored_step"] == step and digest(w) == saved
        measure_throughput(peer, w, args, res, step, baselines, rss_bytes())
    except Exception as e:
        log.exception("%s failed", peer.name)
        res.update(status="error", reason=f"{type(e).__name__}: {e}")
    finally:
        try:
            peer.close()
        except Exception as e:
            log.warning("%s: close() failed: %s", peer.name, e)
    return _summarize(res)


def _summarize(res: dict[str, Any]) -> dict[str, Any]:
    """First save apart; medians of the later ones."""
    saves = res["saves"]
    if saves:
        res["first"] = {k: saves[0][k] for k in ("bytes", "blocking", "durable")}
    later = saves[1:]
    for k in ("bytes", "blocking", "durable", "call", "stall"):
        res[f"later_{k}"] = summary([s[k] for s in later])
    th = res.get("throughput") or {}
    res["overhead"] = th.get("overhead")
    return res


# --------------------------------------------------------------------------- targets and report

def targets(setup: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's two targets on one setup: bytes of a later save vs the full state's, blocking
    of an incremental save vs a full save (medians of the later saves)."""
    inc, full = setup["systems"].get("nebula_incremental"), setup["systems"].get("nebula_full")
    if not inc or not full or inc["status"] != "ok" or full["status"] != "ok":
        return []
    full_b, inc_b = full["later_bytes"]["median"], inc["later_bytes"]["median"]
    share = inc_b / full_b if full_b else None
    out = [{"title": "a later incremental save writes <= 2% of a full save's bytes", "value": share,
            "met": share is not None and share <= BYTES_TARGET,
            "detail": f"{fmt_b(inc_b)} vs {fmt_b(full_b)}"}]
    ib, fb = inc["later_blocking"]["median"], full["later_blocking"]["median"]
    out.append({"title": "an incremental save blocks no longer than a full save", "value": ib / fb if fb else None,
                "met": ib <= fb, "detail": f"{fmt_s(ib)} vs {fmt_s(fb)} (medians)"})
    return out


def markdown(res: dict[str, Any], argv: list[str]) -> str:
    """``results.md``: command, machine and load, one table per setup, the targets."""
    m, sh = res["machine"], res["trainable"]
    lines = ["# Incremental checkpoints of a mostly frozen model", "",
             f"Command: `python -m benchmarks.incremental {' '.join(argv)}`", "",
             f"Machine: {m.get('cpu_model')}, {m.get('usable_cores')} usable cores, torch {m.get('torch')}; "
             f"load average {res['load_before']} before, {res['load_after']} after (a shared machine is noisy).",
             f"Took {res['wall_s']:.0f} s.", "",
             f"Workload: {res['workload']['description']}. State {fmt_b(res['workload']['state_bytes'])}; "
             f"{sh['trainable_params']:,} of {sh['params']:,} parameters train "
             f"({sh['trainable_param_share']:.2%}); a step changes {fmt_b(sh['changed_bytes_per_step'])} "
             f"({sh['changed_share']:.2%} of the state: adapters + AdamW moments + step counters).",
             f"A save every {res['args']['interval']} steps, {res['args']['saves']} saves per system; "
             "the first save of each system is its base (written whole) and shown apart; "
             "'later' columns are medians of the others.", ""]
    for name, setup in res["setups"].items():
        if setup.get("unavailable"):
            lines += [f"## {name}", "", f"not run: {setup['unavailable']}", ""]
            continue
        lines += [f"## {name}", "", "| system | first save bytes | later save bytes | share of state | "
                  "blocking (later) | durable (later) | throughput overhead | restore |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        state = res["workload"]["state_bytes"]
        for sname, r in setup["systems"].items():
            if r["status"] != "ok":
                lines.append(f"| {sname} | {r['status']}: {r.get('reason')} | | | | | | |")
                continue
            b = r["later_bytes"]["median"]
            lines.append(f"| {sname} | {fmt_b(r['first']['bytes'])} | {fmt_b(b)} | "
                         f"{b / state:.2%} | {fmt_s(r['later_blocking']['median'])} | "
                         f"{fmt_s(r['later_durable']['median'])} | {fmt_pct(r['overhead'])} | "
                         f"{'bit-exact' if r['restore_bit_exact'] else 'MISMATCH'} |")
        lines.append("")
        for t in setup["targets"]:
            verdict = "met" if t["met"] else "NOT met"
            value = "n/a" if t["value"] is None else f"{t['value']:.2%}"
            lines.append(f"- {t['title']}: **{verdict}** ({value}; {t['detail']})")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run

def _setups(names: list[str]) -> Iterator[tuple[str, str, Optional[dict[str, Any]], Optional[str]]]:
    """``(setup, container URL, storage options, why it cannot run)`` per setup; Azurite is
    started for ``remote`` and stopped after it."""
    for name in names:
        if name == "disk":
            yield name, "", None, None
            continue
        if name in ("memory", "memory+disk"):
            yield from _memory_setup(name)
            continue
        here = str(Path(__file__).resolve().parents[1])
        if here not in sys.path:
            sys.path.insert(0, here)
        # the test suite's launcher (the repository's Azurite in .node/); a checkout has both
        from tests.blob.emulators import AzuriteEmulator, EmulatorUnavailable

        try:
            az = AzuriteEmulator()
        except EmulatorUnavailable as e:
            yield name, "", None, str(e)
            continue
        with az:
            yield name, az.create_container("incr"), az.storage_options, None


def _memory_setup(name: str = "memory") -> Iterator[tuple[str, str, Optional[dict[str, Any]], Optional[str]]]:
    """The ``memory`` (or ``memory+disk``) setup: the memory tier in a private folder of
    ``/dev/shm`` (the knob ``shm_dir``), removed afterwards (a memory tier alone outlives its
    Checkpointer)."""
    from nebula_ckpt import knobs

    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield name, "", None, "no writable /dev/shm"
        return
    folder = tempfile.mkdtemp(prefix="nebula-bench-", dir="/dev/shm")
    try:
        with knobs.override(shm_dir=folder):
            yield name, "", None, None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_setup(setup: str, url: str, so: Optional[dict[str, Any]], w: wl.Workload, work: Path,
              args: argparse.Namespace) -> dict[str, Any]:
    """Every system of ``args.systems`` on one setup, each on a fresh root."""
    out: dict[str, Any] = {"systems": {}}
    baselines: list[float] = []
    for system in args.systems:
        try:
            peer = make_peer(system, setup, so)
            peer.check(str(work))
        except PeerUnavailable as e:
            out["systems"][system] = {"name": system, "status": "unavailable", "reason": str(e)}
            continue
        local = setup in ("disk", "memory", "memory+disk")
        root: Any = work / f"{setup}-{system}" if local else f"{url}/{system}"
        out["systems"][system] = measure_system(peer, w, root, args, baselines)
        if local:
            shutil.rmtree(work / f"{setup}-{system}", ignore_errors=True)
        log.warning("%s / %s: %s", setup, system, {k: out["systems"][system].get(k) for k in
                                                   ("status", "reason", "overhead")})
    out["baseline_cv"] = (statistics.pstdev(baselines) / statistics.mean(baselines)) if len(baselines) > 1 else None
    out["targets"] = targets(out)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.incremental", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny GPT, 3 saves, interval 3: a smoke run")
    p.add_argument("--model", choices=["tiny", "124m", "350m"], default=None, help="default 124m (tiny with --quick)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-targets", default="c_attn,attn_proj",
                   help="modules given LoRA adapters (comma-separated; all: c_attn,attn_proj,c_fc,mlp_proj)")
    p.add_argument("--saves", type=int, default=None, help="saves per system (default 6; 3 with --quick)")
    p.add_argument("--interval", type=int, default=None, help="training steps per save (default 10; 3 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps of the throughput run (default 3 x interval)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch compute threads (default: the usable cores)")
    p.add_argument("--setups", default="disk,remote,memory", help=f"comma-separated of {','.join(SETUPS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated of {','.join(SYSTEMS)}")
    p.add_argument("--target", default=None, help="folder for the disk setup (default: a temp dir in bench_out/)")
    p.add_argument("--out", default=None, help="folder for results.md / results.json "
                                                "(default benchmarks/results/incremental-<date>)")
    a = p.parse_args(argv)
    a.model = a.model or ("tiny" if a.quick else "124m")
    a.saves = a.saves or (3 if a.quick else 6)
    a.interval = a.interval or (3 if a.quick else 10)
    a.steps = a.steps or 3 * a.interval
    a.setups = [s for s in a.setups.split(",") if s]
    a.systems = [s for s in a.systems.split(",") if s]
    for what, given, known in (("setup", a.setups, SETUPS), ("system", a.systems, SYSTEMS)):
        bad = [s for s in given if s not in known]
        if bad:
            p.error(f"unknown {what}(s) {bad}; choose from {', '.join(known)}")
    if a.saves < 2:
        p.error("--saves must be at least 2 (the first save is the base)")
    a.out = a.out or f"benchmarks/results/incremental-{time.strftime('%Y-%m-%d')}"
    return a


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark; write ``results.json`` and ``results.md`` into ``--out``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads or max(1, usable_cores()))
    t0 = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    w = build_lora(args.model, args.lora_rank, args.lora_targets.split(","))
    base = Path(args.target) if args.target else Path("bench_out")
    base.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "workload": w.describe(),
                           "trainable": trainable_share(w), "setups": {}}
    with tempfile.TemporaryDirectory(prefix="incremental-", dir=base) as tmp:
        res["machine"] = machine_info(Path(tmp), tmp)
        for setup, url, so, why in _setups(args.setups):
            res["setups"][setup] = {"unavailable": why, "systems": {}, "targets": []} if why else \
                run_setup(setup, url, so, w, Path(tmp), args)
    res["load_before"], res["load_after"] = load_before, [round(x, 2) for x in os.getloadavg()]
    res["wall_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "results.json").write_text(json.dumps(res, indent=1, default=str))
    text = markdown(res, argv)
    Path(args.out, "results.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
