"""Print, as JSON, the nebula_ckpt modules a later save (or a restore) crosses on its way: the
modules on the call stacks (every thread) that reach a stage of it. A save's stages: the plan, the
staging buffer, the copy, a storage write, the commit. A restore's: a storage read, the opening
and checks of the checkpoint, the copies into the live objects. Usage:
python save_path_probe.py {local,default,whole} [save|restore] (run by tests/api/test_save_path.py;
a process of its own, so its profiler touches no test). Tiers: ``local`` the local tier alone,
``default`` the default tiers (memory and local), ``whole`` those with incremental saves off (the
traced save is whole on every tier: the memory tier links its staged file, the local tier copies
it)."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from types import FrameType
from typing import Any

import torch

STAGES = {
    "save": ("nebula_ckpt.save.plan_cache", "nebula_ckpt.save.buffers", "nebula_ckpt.native",
             "nebula_ckpt.storage.local", "nebula_ckpt.tiers.memory.runtime"),
    "restore": ("nebula_ckpt.storage.local", "nebula_ckpt.native", "nebula_ckpt.restore.open",
                "nebula_ckpt.restore.apply", "nebula_ckpt.restore.copies", "nebula_ckpt.restore.inplace"),
}
ON = [False]
PATH: set[str] = set()


def tracer(stages: tuple[str, ...]) -> Any:
    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not ON[0] or frame.f_globals.get("__name__") not in stages:
            return
        f: "FrameType | None" = frame
        while f is not None:
            name = f.f_globals.get("__name__", "")
            if name.startswith("nebula_ckpt"):
                PATH.add(name)
            f = f.f_back
    return profile


def main() -> None:
    tiers, what = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "save")
    profile = tracer(STAGES[what])
    threading.setprofile(profile)
    sys.setprofile(profile)
    import nebula_ckpt as nc

    with tempfile.TemporaryDirectory() as root:
        (_save_twice if what == "save" else _restore)(nc, root, tiers)
    print(json.dumps(sorted(PATH)))


def _state() -> dict[str, Any]:
    """A small model and AdamW after one step."""
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "step": 0}


def _checkpointer(nc: Any, root: str, tiers: str) -> Any:
    if tiers == "local":
        return nc.Checkpointer(root, tiers=[nc.LocalTier(root)])
    return nc.Checkpointer(root, incremental=tiers != "whole")


def _save_twice(nc: Any, root: str, tiers: str) -> None:
    """Two saves; the second one traced."""
    state = _state()
    ck = _checkpointer(nc, root, tiers)
    ck.save(0, state)
    ON[0] = True
    state["step"] = 1
    ck.save(1, state)
    ck.wait()
    ON[0] = False
    ck.close()


def _restore(nc: Any, root: str, tiers: str) -> None:
    """A save, then a job's restore into its live model and optimizer (``load_latest``), traced."""
    state = _state()
    with _checkpointer(nc, root, tiers) as ck:
        ck.save(0, state)
    ck = _checkpointer(nc, root, tiers)
    ON[0] = True
    ck.load_latest(state)
    ON[0] = False
    ck.close()


if __name__ == "__main__":
    main()  # NEBULA_SHM_DIR: the test's private memory tier folder
