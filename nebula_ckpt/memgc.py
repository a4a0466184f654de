"""Garbage collection of memory tiers: RAM in ``/dev/shm`` that no run will restore from.

A memory tier outlives its process on purpose (a restart resumes from it), so a job that
crashed and is never restarted leaves its checkpoints in RAM. The policy (``nebula-ckpt gc``):

==========================================  ===========================================
memory tier                                 decision
==========================================  ===========================================
in use (a live process holds its lock)      kept
not safely ours (owner, mode, symlink)      kept, never touched (reported)
no ``ROOT`` file                            removed: nobody's tier, never restored from
local root gone                             removed
root now belongs to another run             removed: it would never be restored from
newest step also committed on the root      removed: durable elsewhere
no committed step                           removed
newest step only in memory                  kept, unless ``--force``
remote root (not checked: no credentials)   kept, unless ``--force``
==========================================  ===========================================

Removal happens under the tier's lock, so a job starting meanwhile is never robbed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Optional

from . import manifest as mf
from .fencing import read_run_id
from .memtier import Found, scan, try_lock
from .storage.local import LocalStorage


@dataclass(frozen=True)
class Decision:
    """What ``gc`` does with one memory tier, and why."""

    found: Found
    remove: bool
    reason: str

    def as_dict(self) -> dict[str, object]:
        """For ``--json``."""
        f = self.found
        return {"folder": f.folder, "root": f.owner.root if f.owner else None,
                "run_id": f.owner.run_id if f.owner else None, "in_use": f.in_use, "bytes": f.nbytes,
                "remove": self.remove, "reason": self.reason}


def _committed(folder: str) -> list[int]:
    return mf.committed_steps(LocalStorage(folder, private=True, fsync=False))


def decide(f: Found, force: bool = False) -> Decision:
    """Apply the module's policy to one memory tier."""
    if f.problem:
        return Decision(f, False, f"not safely ours, not touched: {f.problem}")
    if f.in_use:
        return Decision(f, False, "in use by a live process")
    if f.owner is None:
        return Decision(f, True, "no ROOT file: nobody's memory tier")
    root = f.owner.root
    steps = _committed(f.folder)
    if not steps:
        return Decision(f, True, "holds no committed checkpoint")
    if "://" in root:
        return Decision(f, force, f"remote root {root} not checked (newest step {steps[-1]})"
                        + ("" if force else "; --force removes it"))
    if not os.path.isdir(root):
        return Decision(f, True, f"its root {root} is gone")
    root_st = LocalStorage(root)
    if read_run_id(root_st) != f.owner.run_id:
        return Decision(f, True, f"{root} now belongs to another run")
    if root_st.exists(f"{mf.step_dir(steps[-1])}/{mf.COMMIT}"):
        return Decision(f, True, f"newest step {steps[-1]} is durable on {root}")
    return Decision(f, force, f"newest step {steps[-1]} is only in memory"
                    + (" (--force)" if force else ": restart the job to resume from it, or --force"))


def collect(shm_dir: Optional[str] = None, force: bool = False) -> list[Decision]:
    """Decisions for every memory tier of this user (nothing is removed)."""
    return [decide(f, force) for f in scan(shm_dir)]


def remove(d: Decision) -> bool:
    """Remove the memory tier of ``d`` under its lock; False if a process took it meanwhile."""
    fd = try_lock(d.found.folder)
    if fd is None:
        return False
    try:
        shutil.rmtree(d.found.folder, ignore_errors=True)
    finally:
        os.close(fd)
    return True
