"""Crash worker for the retention kills (tests/crash/test_retention_kill.py): a zygote that imports
torch and nebula_ckpt once, then forks one real process per scenario, which the test kills with
SIGKILL at a chosen point of a deletion.

Protocol: the zygote prints ``READY``, then reads one JSON scenario per line on stdin, forks a
child for it and, once the child is gone, prints ``EXIT <pid> <wait status>``. A child prints
``KILLPOINT <pid> <n> <message>`` when it reaches the deletion point the scenario names (the
``n``-th log record of a deletion stage) and then waits there for its SIGKILL; or ``DONE <pid>
<points>`` when it finished without reaching it (``points``: how many there were). A child that
fails prints ``ERROR <pid> <text>``.

A scenario: ``{"phase": "fill" | "prune" | "gc", "root": ..., "opts": {...} | null, "tier":
"local" | "memory" | "remote", "shm": <memory tier base>, "steps": n, "kill_at": k}``. ``fill``
saves steps 0..n-1 (incremental: every 3rd save full) keeping them all, then exits without
closing (as a preempted job: the memory tier stays). ``prune`` restarts on that root keeping one
step, restores the newest, saves step n: retention then deletes the older steps (and the bases
they refer to); the kill lands between two deletions. ``gc`` runs ``nebula-ckpt gc ROOT --force`` (its
``main``, in the child) on the filled memory tier, killed between its deletions.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import traceback
from typing import Any

import torch

#: the log records that mark a point between two deletions: retention about to delete a step, a
#: step whose marker is gone and whose files are not yet, gc about to delete a memory tier's files
POINTS = re.compile(r"retention deletes step|phase=unlisted|phase=gc-unlisted|gc: removing")


def value(step: int) -> torch.Tensor:
    """The trained tensor of ``step`` (what the test expects back)."""
    return torch.full((64,), float(step))


#: never changes: every incremental save refers to the full save that holds it
FROZEN = torch.arange(64 * 1024, dtype=torch.float32)


def state(step: int) -> dict[str, Any]:
    return {"frozen": FROZEN, "train": value(step), "step": step}


class KillPoint(logging.Handler):
    """Counts the deletion points once armed; at the ``kill_at``-th it tells the test and waits."""

    def __init__(self, kill_at: int) -> None:
        super().__init__(logging.DEBUG)
        self.kill_at, self.seen, self.armed = kill_at, 0, False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.armed or not POINTS.search(record.getMessage()):
            return
        self.seen += 1
        if self.seen == self.kill_at:
            say(f"KILLPOINT {os.getpid()} {self.seen} {record.getMessage()}")
            time.sleep(600)  # the test's SIGKILL ends the process here


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def checkpointer(sc: dict[str, Any], keep: int) -> Any:
    import nebula_ckpt as nc

    if sc["tier"] == "memory":  # retention on the memory tier; the disk keeps every step
        tiers = [nc.MemoryTier(keep_last=keep), nc.LocalTier(sc["root"], keep_last=50)]
        return nc.Checkpointer(sc["root"], tiers=tiers)
    return nc.Checkpointer(sc["root"], storage_options=sc.get("opts"), keep_last=keep, memory_tier=False)


def run(sc: dict[str, Any], hook: KillPoint) -> None:
    from nebula_ckpt import knobs

    with knobs.override(incremental_full_every=3, shm_dir=sc["shm"]):
        if sc["phase"] == "fill":
            ck = checkpointer(sc, 50)
            for s in range(sc["steps"]):
                ck.save(s, state(s))
            ck.wait()
            return  # no close(): the memory tier stays, as after a preempted job
        if sc["phase"] == "gc":  # the command itself, in this process: its deletions are the points
            from nebula_ckpt.cli import main as cli

            hook.armed = True
            code = cli(["gc", sc["root"], "--force", "--shm-dir", sc["shm"]])
            assert code == 0, f"nebula-ckpt gc exited with {code}"
            return
        ck = checkpointer(sc, 1)
        into = {"frozen": torch.zeros_like(FROZEN), "train": torch.zeros(64), "step": -1}
        n = sc["steps"]
        assert ck.load_latest(into=into) == n - 1, f"the restart restores step {n - 1}"
        hook.armed = True
        ck.save(n, state(n))  # retention runs before the save is over


def child(sc: dict[str, Any]) -> None:
    hook = KillPoint(int(sc.get("kill_at", 0)))
    lg = logging.getLogger("nebula_ckpt")
    lg.addHandler(hook)
    lg.setLevel(logging.DEBUG)
    try:
        run(sc, hook)
        say(f"DONE {os.getpid()} {hook.seen}")
    except BaseException:
        say(f"ERROR {os.getpid()} " + traceback.format_exc().replace("\n", " | "))
    finally:
        os._exit(0)  # no atexit: nothing is closed, as when a job is killed


def main() -> None:
    import nebula_ckpt  # noqa: F401  (imported once here; every child starts with it)

    torch.set_num_threads(1)
    say("READY")
    for line in sys.stdin:
        sc = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(sc)
        _, status = os.waitpid(pid, 0)
        say(f"EXIT {pid} {status}")


if __name__ == "__main__":
    main()
