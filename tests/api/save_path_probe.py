"""Print, as JSON, the nebula_ckpt modules a later save crosses on its way to the disk: the modules
on the call stacks (every thread) that reach a stage of the save -- the plan, the staging buffer,
the copy, a storage write, the commit. Usage: python save_path_probe.py {local,default}
(run by tests/api/test_save_path.py; a process of its own, so its profiler touches no test)."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from types import FrameType
from typing import Any

import torch

STAGES = ("nebula_ckpt.save.plan_cache", "nebula_ckpt.save.buffers", "nebula_ckpt.native",
          "nebula_ckpt.storage.local", "nebula_ckpt.tiers.memory.runtime")
ON = [False]
PATH: set[str] = set()


def profile(frame: FrameType, event: str, arg: Any) -> None:
    if event != "call" or not ON[0] or frame.f_globals.get("__name__") not in STAGES:
        return
    f: "FrameType | None" = frame
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name.startswith("nebula_ckpt"):
            PATH.add(name)
        f = f.f_back


def main() -> None:
    tiers = sys.argv[1]
    threading.setprofile(profile)
    sys.setprofile(profile)
    import nebula_ckpt as nc

    with tempfile.TemporaryDirectory() as root:
        _save_twice(nc, root, tiers)
    print(json.dumps(sorted(PATH)))


def _save_twice(nc: Any, root: str, tiers: str) -> None:
    """Two saves of a small model and AdamW; the second one traced."""
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "step": 0}
    ck = nc.Checkpointer(root, tiers=[nc.LocalTier(root)]) if tiers == "local" else nc.Checkpointer(root)
    ck.save(0, state)
    ON[0] = True
    state["step"] = 1
    ck.save(1, state)
    ck.wait()
    ON[0] = False
    ck.close()


if __name__ == "__main__":
    main()  # NEBULA_SHM_DIR: the test's private memory tier folder
