"""One rank of a job whose multi-rank commit is hit by a fault (run by tests/dist/test_commit_faults.py).

Usage: python commit_worker.py SCENARIO ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

Every rank trains the same tiny DDP model, saves steps 1 and 2 on the shared ROOT (memory tier
off: the disk tier alone), then saves step 3 with a fault at a named stage of the commit
protocol, installed on one rank as a hook on its ``LocalStorage`` (the real writes happen; the
hook only adds a SIGKILL, a pause or an error at that point):

* ``after_commit``   rank 0 SIGKILLs itself right after its ``COMMIT`` of step 3 is written;
* ``before_commit``  rank 0 SIGKILLs itself at the ``COMMIT`` write of step 3, before it;
* ``before_report``  the last rank SIGKILLs itself right after its shard of step 3 is written
                     (durable), before it reports it to rank 0;
* ``slow_report``    the last rank stalls right after its shard of step 3 is written until rank 0's
                     round timed out and its save reported back (``OUT/decided-r0``), then reports;
* ``slow_commit``    rank 0 stalls at the ``COMMIT`` write of step 3 until the last rank's round
                     timed out and its save reported back (a file in OUT says so), then commits;
* ``mem_before_commit`` (memory tier on) the last rank SIGKILLs itself at the ``COMMIT`` write of
                     step 3 on its own memory tier, after that tier's manifest;
* ``disk_full``      step 2 carries a large per-rank tensor that does not fit on ROOT (a small
                     file system; with ``TEST_INJECT_ENOSPC=1`` every rank's shard write of step 2
                     fails with ``ENOSPC`` at the ``shard`` stage instead). Once its shard write
                     failed, each rank's first look into step 2's folder (the ``cleanup``
                     stage) returns only once every rank has looked: every rank sees the
                     others' partial shards while it cleans up.

``resume`` restores the newest checkpoint, then saves step 4 (``TEST_MEMORY_TIER=1``: with the
memory tier, whose folders it reports before closing). Each rank writes what it observed to
``OUT/<scenario>-r<rank>.json``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import nebula_ckpt as nc
from nebula_ckpt.storage.local import LocalStorage
from tests.memory_paths import memory_tier_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_worker import _ddp, _digest, _train  # noqa: E402

FAULT_STEP = 3


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _at_commit(step: int, before: Callable[[], None], after: Callable[[], None], under: str = "") -> None:
    """Run ``before`` / ``after`` around the real ``COMMIT`` write of ``step`` on the LocalStorage
    rooted at ``under`` (default: every one)."""
    real = LocalStorage.write_small

    def write_small(self: LocalStorage, rel: str, data: bytes, *, create_only: bool = False) -> None:
        hit = rel == f"step-{step}/COMMIT" and self.root.startswith(under)
        if hit:
            before()
        real(self, rel, data, create_only=create_only)
        if hit:
            after()

    LocalStorage.write_small = write_small  # type: ignore[method-assign]


def _after_shard(step: int, after: Callable[[], None]) -> None:
    """Run ``after`` once this rank's shard of ``step`` is written and fsync'd (not yet reported)."""
    real = LocalStorage.write_parts

    def write_parts(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        info = real(self, rel, parts)
        if rel.startswith(f"step-{step}/shard-"):
            after()
        return info

    LocalStorage.write_parts = write_parts  # type: ignore[method-assign]


def _enospc_at_shard(step: int) -> None:
    """The ``shard`` stage of ``step`` fails as a full disk does: the file is created, then ENOSPC."""
    real = LocalStorage.write_parts

    def write_parts(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        if rel.startswith(f"step-{step}/shard-"):
            path = self.local_path(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(bytes(parts[0]))
            raise OSError(errno.ENOSPC, f"injected at stage 'shard': no space left writing {rel}")
        return real(self, rel, parts)

    LocalStorage.write_parts = write_parts  # type: ignore[method-assign]


def _meet_at_cleanup(step: int, rank: int, world: int, out: str) -> None:
    """After this rank's shard write of ``step`` failed, its first ``list`` of the step's folder
    returns only once every rank has listed it too (files ``OUT/cleanup-r<R>``): no rank removes
    anything before every rank has looked."""
    real_write, real_list = LocalStorage.write_parts, LocalStorage.list
    failed: list[bool] = []

    def write_parts(self: LocalStorage, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        try:
            return real_write(self, rel, parts)
        except OSError:
            if rel.startswith(f"step-{step}/shard-"):
                failed.append(True)
            raise

    def list_(self: LocalStorage, rel_dir: str = "") -> list[str]:
        got = real_list(self, rel_dir)
        if rel_dir == f"step-{step}" and len(failed) == 1:
            failed.append(True)
            open(os.path.join(out, f"cleanup-r{rank}"), "w").close()
            for r in range(world):
                _wait_for(os.path.join(out, f"cleanup-r{r}"), timeout=30)
        return got

    LocalStorage.write_parts = write_parts  # type: ignore[method-assign]
    LocalStorage.list = list_  # type: ignore[method-assign]


def _wait_for(path: str, timeout: float = 200.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def _install(scenario: str, rank: int, world: int, out: str) -> None:
    if scenario == "after_commit" and rank == 0:
        _at_commit(FAULT_STEP, lambda: None, _kill_self)
    elif scenario == "before_commit" and rank == 0:
        _at_commit(FAULT_STEP, _kill_self, lambda: None)
    elif scenario == "before_report" and rank == world - 1:
        _after_shard(FAULT_STEP, _kill_self)
    elif scenario == "mem_before_commit" and rank == world - 1:
        _at_commit(FAULT_STEP, _kill_self, lambda: None, under=os.environ["NEBULA_SHM_DIR"])
    elif scenario == "slow_report" and rank == world - 1:
        _after_shard(FAULT_STEP, lambda: _wait_for(os.path.join(out, "decided-r0")))
    elif scenario == "slow_commit" and rank == 0:
        _at_commit(FAULT_STEP, lambda: _wait_for(os.path.join(out, f"decided-r{world - 1}")), lambda: None)
    elif scenario == "disk_full":
        if os.environ.get("TEST_INJECT_ENOSPC") == "1":
            _enospc_at_shard(2)
        _meet_at_cleanup(2, rank, world, out)


def _outcome(h: Any) -> str:
    try:
        h.result(timeout=200)
        return "committed"
    except Exception as e:  # the job goes on to report it
        return f"{type(e).__name__}: {e}"


def main() -> None:
    scenario, root, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {"rank": rank, "world": world}
    model, opt = _ddp(0 if scenario != "resume" else 1234)
    mine = torch.full((3,), float(rank))
    memory = scenario.startswith("mem_") or os.environ.get("TEST_MEMORY_TIER") == "1"
    if scenario == "resume":
        _train(model, opt, 1, seed=99)
        state: dict[str, Any] = {"model": model, "optim": opt, "step": -1, "mine": torch.zeros(3)}
        with nc.Checkpointer(root, memory_tier=memory) as ck:
            report["step"] = ck.load_latest(state)
            report["restored_from"] = ck.last_restore
            report["digest"] = _digest(model, opt)
            report["mine"] = state["mine"].tolist()
            ck.save(4, {"model": model, "optim": opt, "step": 4, "mine": mine})
            report["list"] = ck.list()
            mem = memory_tier_path(root, rank)
            report["memory"] = sorted(os.listdir(mem)) if memory and os.path.isdir(mem) else None
    else:
        _install(scenario, rank, world, out)
        with nc.Checkpointer(root, memory_tier=memory) as ck:
            for step in (1, 2, 3):
                _train(model, opt, 2, seed=step * 10)
                report[f"digest{step}"] = _digest(model, opt)
                state = {"model": model, "optim": opt, "step": step, "mine": mine}
                if scenario == "disk_full" and step == 2:  # this rank's own: never a replica
                    state["big"] = torch.full((int(os.environ.get("TEST_BIG_NUMEL", "1048576")),), float(rank))
                h = ck.save_async(step, state)
                report[f"step{step}"] = _outcome(h)
                if scenario == "disk_full" and step == 2:  # every rank's failure path is done: what is left?
                    dist.barrier()
                    left = os.path.join(root, "step-2")
                    report["step2_left"] = sorted(os.listdir(left)) if os.path.isdir(left) else None
                if scenario != "disk_full" and step == FAULT_STEP:
                    report["list"] = ck.list()
                    with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
                        json.dump(report, f)
                    open(os.path.join(out, f"decided-r{rank}"), "w").close()
                    if rank == 0 and scenario == "slow_commit":
                        os._exit(0)
                    # a job whose rank died is torn down, not closed; wait so rank 0 can finish
                    _wait_for(os.path.join(out, "decided-r0"), timeout=60 if scenario == "slow_commit" else 0)
                    os._exit(0)
            report["list"] = ck.list()
    with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
