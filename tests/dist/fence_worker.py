"""One rank of a job in the stale-writer test (run by tests/dist/test_fenced_multirank.py).

Usage: python fence_worker.py SCENARIO ROOT OUT GATES   (RANK, WORLD_SIZE, MASTER_* in env)

* ``stale``: saves step 1 (its memory tier keeps 3 steps), touches ``GATES/stale-saved-1-r<rank>``, waits for
  ``GATES/newer-saved``,
  saves steps 10, 11, 12 (each waited for), reports what became of them, what its memory tier
  holds and whether its lock is free, touches ``GATES/stale-done-r<rank>``, waits for
  ``GATES/die`` and SIGKILLs itself (a stale job dies, it does not close);
* ``newer``: waits for ``GATES/stale-saved-1-r*``, restores, saves step 5, closes, touches
  ``GATES/newer-saved``;
* ``load``: restores the newest checkpoint and reports which.

Every state is ``{"w": <rank and step>, "who": <scenario>}``; reports go to ``OUT/<scenario>-r<rank>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import nebula_ckpt as nc
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.storage.local import LocalStorage
from tests.memory_paths import memory_tier_path, try_lock


def _gate(gates: str, name: str) -> None:
    t0 = time.time()
    while not os.path.exists(os.path.join(gates, name)):
        if time.time() - t0 > 180:
            raise SystemExit(f"gate {name} never opened")
        time.sleep(0.02)


def _touch(gates: str, name: str) -> None:
    open(os.path.join(gates, name), "w").close()


def _state(step: int, rank: int, who: str) -> dict[str, Any]:
    return {"w": torch.full((16,), step + rank / 10), "who": who}


def main() -> None:
    scenario, root, out, gates = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {"rank": rank}
    if scenario == "stale":
        # the memory tier keeps step 1 beside a later step: what a save that ended fenced takes
        # back must leave it there
        ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=3), nc.LocalTier(root)])
        ck.save(1, _state(1, rank, "stale"))
        _touch(gates, f"stale-saved-1-r{rank}")
        _gate(gates, "newer-saved")
        for step in (10, 11, 12):
            h = ck.save_async(step, _state(step, rank, "stale"))
            try:
                h.result(timeout=120)
                report[str(step)] = "committed"
            except nc.FencedError:
                report[str(step)] = "fenced"
            report[f"{step}-written"] = list(h.tiers_written)
        folder = memory_tier_path(root, rank)
        report["memory_steps"] = committed_steps(LocalStorage(folder))
        fd = try_lock(folder)
        report["memory_lock_free"] = fd is not None
        if fd is not None:
            os.close(fd)
        with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
            json.dump(report, f)
        _touch(gates, f"stale-done-r{rank}")
        _gate(gates, "die")
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "newer":
        for r in range(world):
            _gate(gates, f"stale-saved-1-r{r}")
        with nc.Checkpointer(root) as ck:
            state = _state(0, rank, "")
            report["resumed"] = ck.load_latest(state)
            ck.save(5, _state(5, rank, "newer"))
        dist.barrier()
        if rank == 0:
            _touch(gates, "newer-saved")
    elif scenario == "load":
        with nc.Checkpointer(root) as ck:
            state = _state(0, rank, "")
            report["step"] = ck.load_latest(state)
            report["tier"] = ck.last_restore["tier"] if ck.last_restore else None
        report["who"] = state["who"]
        report["w"] = state["w"].tolist()
    with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
