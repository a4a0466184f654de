"""One rank of a job that destroys its process group while its Checkpointer still commits a save
(run by tests/dist/test_destroyed_group.py). Usage: python destroyed_worker.py ROOT OUT

Every rank saves steps 1 and 2 and waits until each is committed, then saves step 3, whose shard
write on the shared root is held (a hook on ``LocalStorage``: the real write happens) until this
rank's training thread has called ``destroy_process_group()`` -- the slip of a script that ends
its job without closing the Checkpointer first. Each rank reports what ``close()`` and then step 3's
handle said, and the steps it lists.
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


def main() -> None:
    root, out = sys.argv[1:3]
    LocalStorage.write_parts = _held_write  # type: ignore[method-assign]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(8, 8)
    report: dict[str, Any] = {"rank": rank}
    ck = nc.Checkpointer(root)
    for step in (1, 2):
        ck.save_async(step, {"model": model, "step": step}).result(timeout=120)
    h = ck.save_async(3, {"model": model, "step": 3})
    dist.destroy_process_group()
    destroyed.set()
    report["close"] = _outcome(ck.close)  # what a script that never asks its handles reads
    report["step3"] = _outcome(lambda: h.result(timeout=120))
    report["listed"] = nc.Checkpointer(root, memory_tier=False).list()
    with open(os.path.join(out, f"destroyed-r{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
