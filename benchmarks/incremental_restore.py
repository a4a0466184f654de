"""Restore after a crash from the memory tier, incremental vs full step: ``python -m benchmarks.incremental_restore``.

The LoRA workload of :mod:`benchmarks.incremental` (GPT-2 124M, adapters on the attention, base
frozen, AdamW on the adapters). Each round, per variant, a real process builds it, saves step 0
and, after one training step, step 1 on ``[MemoryTier(), LocalTier(root)]`` (memory tier in a
private folder of ``/dev/shm``), waits until both are durable, and is SIGKILLed; a fresh process
then restores the newest step (from the memory tier) and times ``load_latest`` alone. Variants:

* ``incremental``: the default; memory-tier step 1 holds what changed and refers to step 0's
  shard for the frozen base: the restore hands step 1's own bytes over and maps the base's
  copy-on-write (:mod:`nebula_ckpt.tiers.memory.adopt`);
* ``full``: ``incremental=False``: step 1 whole, handed over;
* ``incremental_copied``: as ``incremental`` with ``NEBULA_ADOPT_MEMORY_TIER=0``: every created
  tensor copied (what an incremental step's restore cost before it could be adopted).

Two restore targets (``--into``): ``objects`` (a freshly built model and optimizer: the model's
parameters are copied into, the optimizer state is created) and ``none`` (``{"model": None,
"optim": None}``: every tensor created, as a script that inspects or exports the state does).
Every restore is checked bit for bit (SHA-256 of every tensor) against what was saved. Variants
run interleaved, the order rotating each round; medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any, Optional

from benchmarks.common import python_run

VARIANTS = ("incremental", "full", "incremental_copied")

_SAVE = r"""
import hashlib, json, os, signal, sys
import nebula_ckpt as nc
from benchmarks.incremental import build_lora
root, model, incremental, out = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
w = build_lora(model, 8, ["c_attn", "attn_proj"])
ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier(root)], incremental=incremental)
ck.save(0, {"model": w.model, "optim": w.optimizer})
w.train_step()
ck.save(1, {"model": w.model, "optim": w.optimizer})
ck.wait()
from benchmarks.incremental_restore import state_digest
with open(out, "w") as f:
    json.dump({"digest": state_digest(w.model.state_dict(), w.optimizer.state_dict()), "state_bytes": w.state_bytes}, f)
os.kill(os.getpid(), signal.SIGKILL)
"""

_RESTORE = r"""
import json, sys, time
import nebula_ckpt as nc
from benchmarks.incremental import build_lora
from benchmarks.incremental_restore import state_digest
root, model, into_kind = sys.argv[1], sys.argv[2], sys.argv[3]
w = build_lora(model, 8, ["c_attn", "attn_proj"], seed=1)
into = {"model": w.model, "optim": w.optimizer} if into_kind == "objects" else {"model": None, "optim": None}
with nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier(root)]) as ck:
    t = time.perf_counter()
    step = ck.load_latest(into=into)
    dt = time.perf_counter() - t
    lr = ck.last_restore
    m = w.model.state_dict() if into_kind == "objects" else into["model"]
    o = w.optimizer.state_dict() if into_kind == "objects" else into["optim"]
    print(json.dumps({"s": dt, "step": step, "tier": lr["tier"].split(":")[0], "adopted": lr["adopted_bytes"],
                      "cow": lr["copy_on_write_bytes"], "digest": state_digest(m, o)}))
"""


def state_digest(model_sd: Any, optim_sd: Any) -> str:
    """SHA-256 of the tensors of a model's state dict and of an optimizer state dict's ``state``."""
    import hashlib

    import torch

    h = hashlib.sha256()
    tensors = [model_sd[k] for k in sorted(model_sd)]
    tensors += [st[k] for i in sorted(optim_sd["state"]) for st in [optim_sd["state"][i]] for k in sorted(st)
                if isinstance(st[k], torch.Tensor)]
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _env(shm: str, variant: str) -> dict[str, str]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    adopt = "0" if variant == "incremental_copied" else "1"
    return dict(os.environ, NEBULA_SHM_DIR=shm, NEBULA_ADOPT_MEMORY_TIER=adopt,
                PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))


def one(variant: str, model: str, into: str) -> dict[str, Any]:
    """Save (SIGKILLed after step 1) and restore once; the restore's timing and what it adopted."""
    shm = tempfile.mkdtemp(prefix="nebula-bench-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="nebula-bench-restore-")
    try:
        env, root, ref = _env(shm, variant), os.path.join(work, "ck"), os.path.join(work, "ref.json")
        r = python_run([sys.executable, "-c", _SAVE, root, model, "0" if variant == "full" else "1", ref],
                       env=env, capture_output=True, timeout=1800)
        if r.returncode != -9:
            raise RuntimeError(f"saver: {r.stderr.decode()[-3000:]}")
        r = python_run([sys.executable, "-c", _RESTORE, root, model, into], env=env, capture_output=True,
                       timeout=1800, check=False)
        if r.returncode:
            raise RuntimeError(f"restore: {r.stderr.decode()[-3000:]}")
        got = json.loads(r.stdout.decode().strip().splitlines()[-1])
        with open(ref) as f:
            want = json.load(f)
        got["bit_exact"] = got.pop("digest") == want["digest"]
        got["state_bytes"] = want["state_bytes"]
        return got
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def run(model: str, into: str, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of every variant, the order rotating; the medians per variant."""
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for i in range(rounds):
        for v in VARIANTS[i % 3:] + VARIANTS[:i % 3]:
            rows[v].append(one(v, model, into))
    return {"model": model, "into": into, "rounds": rounds, "variants": {
        v: {"restore_s": [r["s"] for r in rs], "median_restore_s": statistics.median(r["s"] for r in rs),
            "tier": rs[0]["tier"], "adopted_bytes": rs[0]["adopted"], "copy_on_write_bytes": rs[0]["cow"],
            "state_bytes": rs[0]["state_bytes"], "bit_exact": all(r["bit_exact"] for r in rs)}
        for v, rs in rows.items()}}


def main(argv: Optional[list[str]] = None) -> int:
    """Run it; print the medians and write ``--out`` (JSON) if given."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.incremental_restore", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "124m", "350m"], default="124m")
    p.add_argument("--into", choices=["objects", "none", "both"], default="both")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    results = []
    for into in (("objects", "none") if a.into == "both" else (a.into,)):
        res = run(a.model, into, a.rounds)
        results.append(res)
        for v, r in res["variants"].items():
            sys.stdout.write(f"into={into} {v}: restore {r['median_restore_s'] * 1e3:.1f} ms (median of {a.rounds}; "
                             f"{', '.join(f'{s * 1e3:.0f}' for s in r['restore_s'])}), tier {r['tier']}, handed over "
                             f"{r['adopted_bytes'] / 1e6:.1f} MB, copy-on-write "
                             f"{r['copy_on_write_bytes'] / 1e6:.1f} MB "
                             f"of {r['state_bytes'] / 1e6:.1f} MB, bit-exact {r['bit_exact']}\n")
        sys.stdout.flush()
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["bit_exact"] for res in results for r in res["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
