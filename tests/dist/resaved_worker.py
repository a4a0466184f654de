"""One rank of a job that restores a step saved again while the ranks read it (run by
tests/dist/test_resaved_while_read_ranks.py).

Usage: python resaved_worker.py write ROOT SAVES   (SAVES: ``step:value,...``, saved in that order)
       python resaved_worker.py read ROOT NEW OUT
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)

``write``: the ranks save each step of ``SAVES`` on the shared disk tier of ``ROOT``, tensor
``train`` filled with its value. ``read``: the ranks restore the newest step of ``ROOT``; a hook
on the open of a candidate (the real open runs) makes rank 0 open step 2 first, then rank 1, just
before its own open of step 2, puts ``NEW``'s step 2 (a later write of that step) in its place, as
a job saving it again would. Each rank writes ``OUT/read-r<rank>.json``: the step restored and
its ``train``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from launch import gloo, write_report

import nebula_ckpt as nc
from nebula_ckpt.restore import select

WAIT_S = 20.0


def _state(value: float) -> dict[str, Any]:
    return {"train": torch.full((8,), value), "w": torch.arange(1024, dtype=torch.float32)}


def _hook(rank: int, root: str, new: str, out: str) -> None:
    real = select.open_checkpoint
    fired: list[bool] = []

    def open_checkpoint(storage: Any, step: int, *args: Any, **kw: Any) -> Any:
        if step != 2 or fired:
            return real(storage, step, *args, **kw)
        fired.append(True)
        flag = os.path.join(out, "r0-opened")
        if rank == 0:
            ck = real(storage, step, *args, **kw)
            open(flag, "w").close()
            return ck
        end = time.monotonic() + WAIT_S
        while not os.path.exists(flag) and time.monotonic() < end:
            time.sleep(0.02)
        os.rename(os.path.join(root, "step-2"), os.path.join(out, "old-step-2"))
        os.rename(os.path.join(new, "step-2"), os.path.join(root, "step-2"))
        return real(storage, step, *args, **kw)

    select.open_checkpoint = open_checkpoint  # type: ignore[assignment]


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    with gloo() as rank:
        if mode == "write":
            with nc.Checkpointer(root, memory_tier=False, incremental=False, keep_last=10) as ck:
                for item in sys.argv[3].split(","):
                    step, value = item.split(":")
                    ck.save(int(step), _state(float(value))).result()
            return
        new, out = sys.argv[3], sys.argv[4]
        _hook(rank, root, new, out)
        s = _state(0.0)
        with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
            step = ck.load_latest(s)
        write_report(out, "read", rank, {"step": step, "train": s["train"].tolist()})


if __name__ == "__main__":
    main()
