"""One rank of a job that saves one step number twice on a shared root (run by
tests/dist/test_written_twice_ranks.py).

Usage: python twice_worker.py ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

Both ranks save step 0, then save step 0 again. On the second save, hooks on ``LocalStorage``
(the real operations all happen; the hooks only order them, each wait bounded by a timeout)
hold rank 0's replacement of the committed step open: after rank 0 removed the old ``COMMIT``,
rank 1's first look into the step folder waits for it; rank 0's removal of the folder waits
until rank 1 has removed a file of its own there (its leftover of the first save, once it is
unlisted) and made that durable, which in turn waits for the folder's removal. Had rank 1 looked
into the folder while rank 0 replaced the step, its save fails (the folder it syncs is gone).
Each rank then restores the newest step and writes ``OUT/twice-r<rank>.json``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from launch import gloo, write_report

import nebula_ckpt as nc
from nebula_ckpt.storage import local
from nebula_ckpt.storage.local import LocalStorage

ARMED: list[bool] = []
WAIT_S = 5.0


def _wait_for(path: str) -> bool:
    end = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _touch(path: str) -> None:
    open(path, "w").close()


def _hooks(rank: int, out: str) -> None:
    flag = lambda name: os.path.join(out, name)  # noqa: E731
    if rank == 0:
        real_remove, real_remove_dir = LocalStorage.remove, LocalStorage.remove_dir

        def remove(self: LocalStorage, rel: str) -> None:
            real_remove(self, rel)
            if ARMED and rel == "step-0/COMMIT":
                _touch(flag("r0-unmarked"))

        def remove_dir(self: LocalStorage, rel: str) -> None:
            if ARMED and rel == "step-0":
                _wait_for(flag("r1-unlinked"))
            real_remove_dir(self, rel)
            if ARMED and rel == "step-0":
                _touch(flag("r0-removed"))

        LocalStorage.remove = remove  # type: ignore[method-assign]
        LocalStorage.remove_dir = remove_dir  # type: ignore[method-assign]
        return
    real_list, real_fsync_dir = LocalStorage.list, local.fsync_dir

    def list_(self: LocalStorage, rel_dir: str = "") -> list[str]:
        if ARMED and rel_dir == "step-0":
            _wait_for(flag("r0-unmarked"))
        return real_list(self, rel_dir)

    def fsync_dir(path: str) -> None:
        if ARMED and path.rstrip("/").endswith("step-0"):
            _touch(flag("r1-unlinked"))
            _wait_for(flag("r0-removed"))
        real_fsync_dir(path)

    LocalStorage.list = list_  # type: ignore[method-assign]
    local.fsync_dir = fsync_dir  # type: ignore[assignment]


def _outcome(h: Any) -> str:
    try:
        h.result(timeout=120)
        return "committed"
    except Exception as e:  # reported to the test
        return f"{type(e).__name__}: {e}"


def main() -> None:
    root, out = sys.argv[1:3]
    with gloo() as rank:
        report: dict[str, Any] = {"rank": rank}
        _hooks(rank, out)
        with nc.Checkpointer(root, memory_tier=False) as ck:
            report["first"] = _outcome(ck.save_async(0, {"w": torch.full((1000,), 1.0),
                                                         "mine": torch.full((3,), rank)}))
            dist.barrier()
            ARMED.append(True)
            report["second"] = _outcome(ck.save_async(0, {"w": torch.full((1000,), 2.0),
                                                          "mine": torch.full((3,), 10 + rank)}))
            ARMED.clear()
            dist.barrier()
        with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
            state = {"w": torch.zeros(1000), "mine": torch.zeros(3, dtype=torch.int64)}
            report["step"] = ck.load_latest(state)
            report["w"] = sorted(set(state["w"].tolist()))
            report["mine"] = state["mine"].tolist()
        write_report(out, "twice", rank, report)


if __name__ == "__main__":
    main()
