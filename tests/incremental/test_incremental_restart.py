"""A restarted job's first save builds on the checkpoint it restored (incremental across a restart).

A real process saves a frozen base and a small trainable tensor and is SIGKILLed; a second process
restores the newest step from the disk tier, trains the small tensor and saves: that save writes
only what changed and refers to the bytes the killed process committed. A third process restores
it bit-exact. The tier a restore did not read (and verify) is never built on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the first job: two saves (full, then incremental), committed, then SIGKILL
FIRST_JOB = textwrap.dedent("""
    import os, signal, sys
    import torch
    import nebula_ckpt as nc
    root = sys.argv[1]
    frozen = torch.randn(512, 512, generator=torch.Generator().manual_seed(1))
    train = torch.zeros(256)
    ck = nc.Checkpointer(root, memory_tier=sys.argv[2] == "memory", keep_last=1)
    for step in (1, 2):
        train += step
        ck.save(step, {"frozen": frozen, "train": train, "step": step}).result()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _first_job(root: str, shm_dir: str, memory: bool = False) -> None:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), NEBULA_SHM_DIR=shm_dir)
    p = subprocess.run([sys.executable, "-c", FIRST_JOB, root, "memory" if memory else "disk"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr


def _man(root: str, step: int) -> dict:
    with open(os.path.join(root, f"step-{step}", "manifest.json")) as f:
        return json.load(f)


def _committed(root: str) -> list[int]:
    return sorted(int(d.split("-")[1]) for d in os.listdir(root)
                  if d.startswith("step-") and os.path.exists(os.path.join(root, d, "COMMIT")))


def _read(root: str, step: int) -> dict:
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        got, state = ck.read(step)
    assert got == step
    return state


def test_the_first_save_after_a_restart_writes_only_what_changed(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _first_job(root, shm_dir)
    into = {"frozen": torch.zeros(512, 512), "train": torch.zeros(256), "step": -1}
    with nc.Checkpointer(root, memory_tier=False, keep_last=1) as ck:
        assert ck.load_latest(into) == 2
        into["train"] += 3
        h = ck.save(3, into)
        disk = next(t for t in h.metrics.written_bytes if t.startswith("local:"))
        assert h.metrics.written_bytes[disk] < 4096 + 2 * into["train"].nbytes, h.metrics.written_bytes
        h.result()
        refs = [s.get("step") for s in _man(root, 3)["shards"][1:]]
        assert refs == [1], _man(root, 3)["shards"]  # the step that physically holds the frozen bytes
        assert _committed(root) == [1, 3]  # keep_last=1 keeps step 1 while step 3 needs its bytes
        into["frozen"].data[7, 7] += 1.0  # a change to the "frozen" tensor through .data is written
        into["train"] += 4
        h = ck.save(4, into)
        assert h.metrics.written_bytes[disk] > into["frozen"].nbytes
    assert _committed(root) == [4]  # a full step: nothing older is needed
    got = _read(root, 4)
    assert torch.equal(got["frozen"], into["frozen"]) and torch.equal(got["train"], into["train"])


def test_a_restarted_save_reads_back_bit_exact_in_a_new_process(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    _first_job(root, shm_dir)
    into = {"frozen": torch.zeros(512, 512), "train": torch.zeros(256), "step": -1}
    with nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.load_latest(into)
        into["train"] += 3
        ck.save(3, into).result()
    assert [s.get("step") for s in _man(root, 3)["shards"][1:]] == [1]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = ("import sys, torch, nebula_ckpt as nc\n"
              "ck = nc.Checkpointer(sys.argv[1], memory_tier=False, read_only=True)\n"
              "step, s = ck.read(3)\n"
              "torch.save({'frozen': s['frozen'], 'train': s['train']}, sys.argv[2])\n")
    out = str(tmp_path / "got.pt")
    p = subprocess.run([sys.executable, "-c", script, root, out], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    got = torch.load(out)
    assert torch.equal(got["frozen"], into["frozen"]) and torch.equal(got["train"], into["train"])


def test_a_tier_the_restore_did_not_verify_is_not_built_on(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Restored from the memory tier (the killed job's step 2 is still there): the disk tier's copy
    of that step was not read, so a flipped byte in it must not become part of a new checkpoint.
    The disk tier's first save after the restart is full; the one after builds on it."""
    root = str(tmp_path / "ck")
    _first_job(root, shm_dir, memory=True)
    into = {"frozen": torch.zeros(512, 512), "train": torch.zeros(256), "step": -1}
    with knobs.override(incremental_full_every=10), nc.Checkpointer(root, keep_last=5) as ck:
        assert ck.load_latest(into) == 2
        assert ck.last_restore["tier"].startswith("memory"), ck.last_restore
        sizes = []
        for step in (3, 4):
            into["train"] += step
            h = ck.save(step, into)
            disk = next(t for t in h.metrics.written_bytes if t.startswith("local:"))
            sizes.append((h.metrics.written_bytes[disk], h.metrics.bytes))
    assert sizes[0][0] == sizes[0][1], sizes                      # full: the disk copy was not verified
    assert sizes[1][0] < 4096 + 2 * into["train"].nbytes, sizes     # then incremental on step 3
