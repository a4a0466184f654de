"""One rank of a replicas job whose restore meets a suspect step, a dead rank or a tight budget
(run by tests/tiers/memory/test_replica_faults.py).

Usage: python replica_fault_worker.py SCENARIO ROOT OUT SHM_BASE [BUDGET]

Two simulated nodes, one rank each (rank ``r`` on node ``n<r>``, its own ``NEBULA_SHM_DIR``), a
state of about 1 MiB. Scenarios:

* ``save``: save steps 1..3 to ``[MemoryTier(replicas=1, keep_last=2), LocalTier(ROOT,
  every=1000)]`` (the disk holds step 1 only), report each step's digest, end like a crash;
* ``recover``: after node ``n1`` was lost, the replicas' recover round run as a restore of the
  newest step runs it, once with step 3 left out by rank 0 (suspect) and once without, on a
  :class:`~nebula_ckpt.tiers.memory.replicas.Replicator` of each rank's memory-tier folder (a new
  empty one for rank 1): report each outcome;
* ``nan``: a restart restores the newest step and reports a NaN loss (it is marked suspect);
* ``latest``: a restart's ``load_latest``: the step, its digest and sources;
* ``die``: open the job (``save``'s tiers); rank 1 is SIGKILLed before ``load_latest``; rank 0
  reports what its ``load_latest`` raised (the recover round comes first, whatever is saved);
* ``budget``: save steps 1..4 to ``[MemoryTier(replicas=1, keep_last=1), LocalTier(ROOT, every=1)]``
  (every step on the disk too) with ``host_memory_budget=BUDGET``, full saves; report what each
  handle said and the replicas held at the end, then what ``give_up_memory_steps`` (a save short
  of the budget) gives up.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))
from launch import gloo, simulated_node, write_report  # noqa: E402

SCENARIO, ROOT, OUT, SHM_BASE = sys.argv[1:5]
BUDGET = int(sys.argv[5]) if len(sys.argv) > 5 else None
RANK = int(os.environ["RANK"])
SHM = simulated_node(SHM_BASE, f"n{RANK}")

import torch  # noqa: E402
from state_digest import digest  # noqa: E402

import nebula_ckpt as nc  # noqa: E402
from nebula_ckpt.save.budget import give_up_memory_steps  # noqa: E402


def _state() -> dict[str, Any]:
    torch.manual_seed(100 + RANK)
    model = torch.nn.Linear(32, 16)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "extra": torch.zeros(64),
            "frozen": torch.randn(256 * 1024, generator=torch.Generator().manual_seed(RANK))}


def _train(st: dict[str, Any], step: int) -> None:
    loss = st["model"](torch.randn(4, 32, generator=torch.Generator().manual_seed(1000 * RANK + step))).square().mean()
    st["optim"].zero_grad()
    loss.backward()
    st["optim"].step()
    st["extra"].add_(RANK + step)


def _saves(ck: nc.Checkpointer, steps: range) -> dict[str, Any]:
    st, out = _state(), {"digests": {}, "errors": {}, "written": {}}
    for step in steps:
        _train(st, step)
        h = ck.save_async(step, st)
        out["digests"][step] = digest(st)
        try:
            out["written"][step] = h.result(timeout=120)
        except nc.NebulaError as e:
            out["errors"][step] = f"{type(e).__name__}: {e}"
    return out


def save() -> None:
    ck = nc.Checkpointer(ROOT, tiers=[nc.MemoryTier(replicas=1, keep_last=2), nc.LocalTier(ROOT, every=1000)])
    write_report(OUT, SCENARIO, RANK, _saves(ck, range(1, 4)), default=str)
    os._exit(0)


def recover() -> None:
    import torch.distributed as dist

    from nebula_ckpt.format.commit import committed_writes
    from nebula_ckpt.storage.local import LocalStorage
    from nebula_ckpt.tiers.memory.replicas import Replicator

    folders = glob.glob(f"{SHM}/nebula_ckpt-*/*/")
    folder = folders[0] if folders else os.path.join(SHM, "fresh")  # node n1 was lost: an empty memory tier
    os.makedirs(folder, exist_ok=True)
    shared = committed_writes(LocalStorage(ROOT))
    rep = Replicator(folder, 1, 2, dist.new_group(backend="gloo"))
    out = {}
    for case, skip in (("suspect", lambda g, s, w: RANK == 0 and s == 3), ("plain", None)):
        rec = rep.recover(shared, None, None, skip=skip) if skip else rep.recover(shared)
        out[case] = {k: rec[k] for k in ("step", "generation", "save", "sources")}
    rep.close()
    dist.barrier()
    rep.release()
    write_report(OUT, SCENARIO, RANK, out, default=str)


def nan() -> None:
    """A restart restores step 3 and reports a NaN loss (step 3 marked suspect), then ends."""
    ck = nc.Checkpointer(ROOT, tiers=[nc.MemoryTier(replicas=1, keep_last=2), nc.LocalTier(ROOT, every=1000)])
    step = ck.load_latest(_state())
    ck.report(4, loss=float("nan"))
    ck.close()
    write_report(OUT, SCENARIO, RANK, {"step": step}, default=str)
    os._exit(0)


def latest() -> None:
    """A restart after node ``n1`` was lost: what ``load_latest`` restores, and its digest."""
    ck = nc.Checkpointer(ROOT, tiers=[nc.MemoryTier(replicas=1, keep_last=2), nc.LocalTier(ROOT, every=1000)])
    st = _state()
    step = ck.load_latest(st)
    out = {"step": step, "digest": digest(st), "sources": (ck.last_restore or {}).get("sources")}
    ck.close()
    write_report(OUT, SCENARIO, RANK, out, default=str)
    os._exit(0)


def die() -> None:
    ck = nc.Checkpointer(ROOT, tiers=[nc.MemoryTier(replicas=1, keep_last=2), nc.LocalTier(ROOT, every=1000)])
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        ck.load_latest(_state())
        out = {"raised": None}
    except Exception as e:
        out = {"raised": type(e).__name__, "message": str(e), "cause": type(e.__cause__).__name__}
    write_report(OUT, SCENARIO, RANK, out, default=str)
    os._exit(0)


def budget() -> None:
    ck = nc.Checkpointer(ROOT, tiers=[nc.MemoryTier(replicas=1, keep_last=1), nc.LocalTier(ROOT, every=1)],
                         host_memory_budget=BUDGET, incremental=False)
    out = _saves(ck, range(1, 5))
    out["held"] = sorted(os.path.relpath(p, SHM) for p in glob.glob(f"{SHM}/nebula_ckpt-*/*/replicas/r*/step-*"))
    # what a save short of the budget gives up first (no round runs now: every handle is done)
    out["gave_up"] = give_up_memory_steps(ck._saves.writers)
    out["held_after"] = glob.glob(f"{SHM}/nebula_ckpt-*/*/replicas/r*/step-*")
    write_report(OUT, SCENARIO, RANK, out, default=str)
    os._exit(0)


if __name__ == "__main__":
    with gloo():
        {"save": save, "recover": recover, "nan": nan, "latest": latest, "die": die, "budget": budget}[SCENARIO]()
