"""Saves that are still being written when the program ends are written, whatever stage they are in.

Python refuses new work on ``concurrent.futures`` pools once interpreter shutdown has begun, before
any ``atexit`` handler runs. A save accepted just before the end is written by the checkpointer's
exit hook, so every stage it goes through (hashing the staged bytes, comparing with the base of an
incremental save, uploading parts) must work there. These tests put *every* stage after that point:
the saves are made from the script's own ``atexit`` handler, which runs after the pools' shutdown
flag is set and before nebula_ckpt's exit hooks. Real subprocesses, real files. The one-liners'
Checkpointer is closed at exit by design: its saves are written the same way, without the warning
of a forgotten ``close()``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main as cli_main

SCRIPT = """
import atexit, sys, torch, nebula_ckpt as nc

def late():
    ck = None if {how!r} == "one_liner" else nc.Checkpointer({root!r}, incremental={incremental!r})
    frozen = torch.arange(200_000, dtype=torch.float32)
    for s in range(4):
        state = {{"frozen": frozen, "w": torch.full((300_000,), float(s))}}
        if ck is None:      # nc.save_async: the one-liners' Checkpointer, closed at exit
            nc.save_async({root!r}, s, state, incremental={incremental!r})
        else:
            ck.save_async(s, state)
    if {how!r} == "closed_in_atexit":
        ck.close()          # the user's own exit hook closes it
    # else: never closed; nebula_ckpt's exit hook writes what is pending

atexit.register(late)       # registered after nebula_ckpt's hook: runs first, after pool shutdown
"""


def _child(root: str, shm_dir: str, *, incremental: bool, how: str) -> subprocess.CompletedProcess[str]:
    code = SCRIPT.format(root=root, incremental=incremental, how=how)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, NEBULA_SHM_DIR=shm_dir))


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental_default"])
@pytest.mark.parametrize("how", ["forgotten", "closed_in_atexit", "one_liner"])
def test_saves_made_during_exit_are_all_written(root: str, shm_dir: str, incremental: bool, how: str) -> None:
    r = _child(root, shm_dir, incremental=incremental, how=how)
    assert r.returncode == 0, r.stderr
    assert "failed" not in r.stderr.lower(), r.stderr
    assert ("was not closed" in r.stderr) is (how == "forgotten"), r.stderr
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.list()[-1] == 3, r.stderr
        got = {"frozen": torch.zeros(200_000), "w": torch.zeros(300_000)}
        assert ck.load_latest(into=got) == 3
    assert torch.equal(got["frozen"], torch.arange(200_000, dtype=torch.float32))
    assert torch.equal(got["w"], torch.full((300_000,), 3.0))
    assert cli_main(["verify", root]) == 0
