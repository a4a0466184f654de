"""One rank of a job that makes a slip of a first multi-rank script (run by
tests/dist/test_multirank_slips.py). Usage: python slips_worker.py SCENARIO ROOT OUT

* ``destroyed``: every rank saves steps 1 and 2 and waits until each is committed, then saves
  step 3, whose shard write on the shared root is held (a hook on ``LocalStorage``: the real write
  happens) until this rank's training thread has called ``destroy_process_group()`` -- a script
  that ends its job without closing the Checkpointer first. Each rank reports what ``close()``
  and then step 3's handle said, and the steps it lists.
* ``load_on_rank0``: every rank saves step 1; then rank 0 alone calls ``load_latest`` (the
  ``torch.load`` habit: load on rank 0, broadcast) while rank 1 waits at a barrier of the job's
  own group. Rank 0 reports what ``load_latest`` said (run with a short NEBULA_COMMIT_TIMEOUT_S).
* ``one_rank_refused``: every rank saves steps 0 to 5 in order, but rank 1's state of step 2 holds
  a value no checkpoint takes, so its ``save_async(2)`` raises ``ValidationError`` there alone.
  Each rank reports what every save said, then what a new Checkpointer of the job restores.
* ``hf_last_on_rank0``: every rank saves ``checkpoint-4`` and ``checkpoint-8`` (tags of the Hugging
  Face integration); then rank 0 alone calls its ``get_last_checkpoint`` (a script's
  ``if rank == 0:``) while rank 1 waits at a barrier of the job's own group. Rank 0 reports it.
* ``every_seconds``: the disk tier persists at most every 0.5 s (``every_seconds``); the ranks save
  24 times, in lock-step (a barrier per step, as DDP's all-reduce keeps them), 0.2 s apart, rank
  1's first save 0.15 s late. Each rank reports the saves its disk tier wrote and dropped.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

import nebula_ckpt as nc
from nebula_ckpt.storage.local import LocalStorage

destroyed = threading.Event()
_write_parts = LocalStorage.write_parts


def _held_write(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
    info = _write_parts(self, rel, parts)
    if rel.startswith("step-3/shard-"):
        destroyed.wait(60)
    return info


def _outcome(fn: Any) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # the report says what the user would read
        return f"{type(e).__name__}: {e}"


def _destroyed(root: str, rank: int, model: torch.nn.Module) -> dict[str, Any]:
    LocalStorage.write_parts = _held_write  # type: ignore[method-assign]
    report: dict[str, Any] = {}
    ck = nc.Checkpointer(root)
    for step in (1, 2):
        ck.save_async(step, {"model": model, "step": step}).result(timeout=120)
    h = ck.save_async(3, {"model": model, "step": 3})
    dist.destroy_process_group()
    destroyed.set()
    report["close"] = _outcome(ck.close)  # what a script that never asks its handles reads
    report["step3"] = _outcome(lambda: h.result(timeout=120))
    with nc.Checkpointer(root, memory_tier=False) as again:  # a process of one rank: no group left
        report["listed"] = again.list()
    return report


def _load_on_rank0(root: str, rank: int, model: torch.nn.Module) -> dict[str, Any]:
    report: dict[str, Any] = {}
    ck = nc.Checkpointer(root)
    ck.save(1, {"model": model})
    if rank == 0:
        report["load"] = _outcome(lambda: ck.load_latest({"model": model}))
    dist.barrier()
    report["close"] = _outcome(ck.close)
    dist.destroy_process_group()
    return report


def _one_rank_refused(root: str, rank: int, model: torch.nn.Module) -> dict[str, Any]:
    report: dict[str, Any] = {"saves": []}
    with nc.Checkpointer(root, keep_last=20) as ck:
        for step in range(6):
            state: dict[str, Any] = {"x": torch.full((64,), float(10 * step + rank)), "step": step}
            if rank == 1 and step == 2:
                state["bad"] = object()  # refused before anything is written, on this rank only
            report["saves"].append(_outcome(lambda s=step, st=state: ck.save_async(s, st).result(timeout=120)))
    with nc.Checkpointer(root) as ck:
        into: dict[str, Any] = {"x": torch.zeros(64), "step": -1}
        report["restored"] = ck.load_latest(into)
        report["x"] = into["x"][0].item()
    return report


def _hf_last_on_rank0(root: str, rank: int, model: torch.nn.Module) -> dict[str, Any]:
    from nebula_ckpt.integrations.huggingface import get_last_checkpoint

    report: dict[str, Any] = {}
    with nc.Checkpointer(root) as ck:
        for step in (4, 8):
            ck.save(step, {"model": model}, tag=f"checkpoint-{step}")
    if rank == 0:
        report["last"] = _outcome(lambda: report.setdefault("path", get_last_checkpoint("/nonexistent-out", root)))
    dist.barrier()
    return report


def _every_seconds(root: str, rank: int, model: torch.nn.Module) -> dict[str, Any]:
    import time

    handles = []
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every_seconds=0.5, keep_last=100)]) as ck:
        for i in range(24):
            dist.barrier()
            time.sleep(0.2 + (0.15 if rank == 1 and i == 0 else 0.0))
            handles.append(ck.save_async(i, {"x": torch.full((64,), float(10 * i + rank)), "i": i}))
        for h in handles:
            h.result(timeout=120)
    disk = [(h.step, [t for t in h.tiers_written if t.startswith("local")]) for h in handles]
    return {"written": [s for s, t in disk if t],
            "dropped": [h.step for h in handles if any(t.startswith("local") for t in h.tiers_dropped)]}


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(8, 8)
    run = {"destroyed": _destroyed, "load_on_rank0": _load_on_rank0, "one_rank_refused": _one_rank_refused,
           "hf_last_on_rank0": _hf_last_on_rank0, "every_seconds": _every_seconds}[scenario]
    report = {"rank": rank, **run(root, rank, model)}
    with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
