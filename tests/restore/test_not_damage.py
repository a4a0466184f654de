"""A checkpoint this process cannot read is not a damaged one.

A restore passes a damaged candidate over for an older one. A process out of file descriptors
(``EMFILE``) that fails to open the newest step's shards says nothing about the step: the restore
raises, naming the step and the fix, and never resumes silently from an older step (a job would
then overwrite the newer steps). Real files, a real child process with a low ``RLIMIT_NOFILE``.
"""

from __future__ import annotations

import os
import sys
import textwrap

import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt import knobs

LOAD = textwrap.dedent("""
    import os, resource, sys, torch, nebula_ckpt as nc
    x = {f"t{i}": torch.zeros(64) for i in range(24)}
    c = nc.Checkpointer(sys.argv[1], memory_tier=False)
    c.list()
    if sys.argv[2] == "low":  # a few more descriptors than this process holds
        lim = len(os.listdir("/proc/self/fd")) + 12
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        print("RESULT", c.load_latest(into=x), float(x["t23"][0]))
    except OSError as e:
        print("ERROR", e.errno, e)
""")


def test_a_process_out_of_file_descriptors_raises_and_never_restores_an_older_step(root: str, shm_dir: str) -> None:
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(24)}
    with knobs.override(incremental_full_every=1000), \
            nc.Checkpointer(root, keep_last=100, memory_tier=False, incremental=True) as ck:
        for s in range(24):  # one tensor changes per save: step 23 refers to the shards of every step
            state[f"t{s}"] = torch.full((64,), 1000.0 + s)
            ck.save(s, state)
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    low = warm_python.run([sys.executable, "-c", LOAD, root, "low"], env=env, capture_output=True, text=True,
                          timeout=120)
    out = [line for line in low.stdout.splitlines() if line.startswith(("RESULT", "ERROR"))]
    assert out and out[-1].startswith("ERROR 24 "), low.stdout + low.stderr[-2000:]
    assert "step 23" in out[-1] and "ulimit -n" in out[-1] and "not damaged" in out[-1], out[-1]
    enough = warm_python.run([sys.executable, "-c", LOAD, root, "enough"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert "RESULT 23 1023.0" in enough.stdout, enough.stdout + enough.stderr[-2000:]
