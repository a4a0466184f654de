"""Helpers of the retention-kill tests (tests/crash/test_retention_kill.py and
tests/blob/test_retention_kill_remote.py): the zygote worker and the loop over kill points."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Iterator, Optional

import torch

import nebula_ckpt as nc
import warm_python
from crash.retention_worker import FROZEN, value
from nebula_ckpt import knobs
from nebula_ckpt.cli import main as cli
from proc_lines import lines

HERE = os.path.dirname(os.path.abspath(__file__))
#: more kill points than retention of one save here can have (the loop ends when one is not reached)
MAX_POINTS = 40


class Zygote:
    """The worker process; :meth:`run` forks one scenario in it and returns what it printed."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")]))
        self.proc = warm_python.popen([sys.executable, "-u", os.path.join(HERE, "retention_worker.py")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env, cwd=os.path.dirname(HERE))
        self.out = lines(self.proc, time.monotonic() + 600)
        self._expect("READY")

    def _expect(self, word: str) -> str:
        for line in self.out:
            if line.startswith(word):
                return line
        raise AssertionError(f"the worker ended before {word}")

    def run(self, sc: dict[str, Any]) -> tuple[str, str]:
        """Run scenario ``sc``; ``("killed", message)`` when its child reached its kill point
        and was SIGKILLed there, ``("done", points)`` when it finished without reaching it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(sc) + "\n")
        self.proc.stdin.flush()
        for line in self.out:
            word, _, rest = line.partition(" ")
            if word == "KILLPOINT":
                pid, _, msg = rest.partition(" ")
                os.kill(int(pid), signal.SIGKILL)
                status = int(self._expect(f"EXIT {pid}").split()[2])
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
                return "killed", msg
            if word == "DONE":
                self._expect("EXIT")
                return "done", rest.split()[1]
            assert word != "ERROR", f"worker failed: {rest}"
        raise AssertionError("the worker ended unexpectedly")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def zygote_process() -> Iterator[Zygote]:
    """The body of the tests' ``zygote`` fixture: one worker for the module's tests."""
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


def verify(root: str, opts: Optional[dict[str, Any]], shm: str, newest: int) -> None:
    """``nebula-ckpt verify`` (every committed step of every tier, every checksum and reference)
    passes, every step listed reads back as saved, and the newest is ``newest``."""
    args = [] if opts is None else ["--storage-options", json.dumps(opts)]
    with knobs.override(shm_dir=shm):
        assert cli(["verify", root, *args]) == 0, "a committed step does not verify after the kill (see above)"
        with nc.Checkpointer(root, storage_options=opts, read_only=True) as ck:
            got, st = ck.read()
            assert got == newest and torch.equal(st["train"], value(got)) and torch.equal(st["frozen"], FROZEN)


def copy_root(src: str, dst: str, opts: Optional[dict[str, Any]]) -> None:
    """A copy of the checkpoint root ``src`` at ``dst`` (a local folder, or on the same blob store)."""
    if "://" not in src:
        shutil.copytree(src, dst)
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(src, **(opts or {}))
    dest = fsspec.core.url_to_fs(dst, **(opts or {}))[1]
    for f in fs.find(path):
        fs.copy(f, dest + f[len(path):])


def kill_everywhere(zygote: Zygote, tmp: str, tier: str, opts: Optional[dict[str, Any]] = None,
                    url: Optional[str] = None, steps: int = 6, every: int = 1, first: int = 1) -> int:
    """Save ``steps`` steps, restart keeping one, and kill the retention of step ``steps`` at each
    of its deletion points in turn (a fresh root each time); after each kill every committed step
    must restore. Returns how many points there were. The steps are saved once and the root
    copied for each kill, except with the memory tier (its folder is tied to its root's path).
    ``every``, ``first``: kill only at points ``first``, ``first + every``, ... (the last run,
    past the last point, finds how many there were)."""
    template = url + "/filled" if url else os.path.join(tmp, "filled")
    if tier != "memory":
        sc = {"root": template, "opts": opts, "tier": tier, "shm": tmp, "steps": steps}
        assert zygote.run({**sc, "phase": "fill"})[0] == "done"
    for n in range(first, MAX_POINTS, every):
        shm = os.path.join(tmp, f"shm-{n}")
        os.makedirs(shm)
        root = url + f"/run-{n}" if url else os.path.join(tmp, f"run-{n}")
        sc = {"root": root, "opts": opts, "tier": tier, "shm": shm, "steps": steps}
        if tier == "memory":
            assert zygote.run({**sc, "phase": "fill"})[0] == "done"
        else:
            copy_root(template, root, opts)
        how, what = zygote.run({**sc, "phase": "prune", "kill_at": n})
        verify(root, opts, shm, steps)
        if how == "done":
            assert n - every <= int(what) < n and int(what) > 2, f"{what} deletion point(s): too few deletions"
            return int(what)
    raise AssertionError("more deletion points than expected")


