"""A restarted job's first save builds on the checkpoint it restored (incremental across a restart).

A real process saves a frozen base and a small trainable tensor and is SIGKILLed; a second process
restores the newest step from the disk tier, trains the small tensor and saves: that save writes
only what changed and refers to the bytes the killed process committed. A third process restores
it bit-exact. The tier a restore did not read (and verify) is never built on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import textwrap

import torch

import nebula_ckpt as nc
import warm_python
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
    p = warm_python.run([sys.executable, "-c", FIRST_JOB, root, "memory" if memory else "disk"], env=env,
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
    p = warm_python.run([sys.executable, "-c", script, root, out], env=env, capture_output=True, text=True,
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


def _chain(root: str, steps: list[int]) -> list[int]:
    """The steps of ``steps`` whose manifest refers to no other step (full saves)."""
    return [s for s in steps if not any("step" in sh for sh in _man(root, s)["shards"])]


def test_a_job_restarted_every_few_saves_keeps_the_full_save_cadence(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """A job with a frozen part, restarted every 3 saves (full_every=4), writes every 4th save full,
    as one long process does: the cadence goes on from the restored manifest's
    ``stats.saves_since_full``, so the frozen bytes move to a newer full step and retention can
    drop the old one. Restarted after every save (full_every=3), the same."""
    for per_life, every, total, fulls in ((3, 4, 12, [1, 5, 9]), (1, 3, 7, [1, 4, 7])):
        root = str(tmp_path / f"ck-{per_life}")
        state = {"frozen": torch.randn(64 * 1024), "w": torch.zeros(256)}
        step, full, counts = 0, [], []
        with knobs.override(incremental_full_every=every):
            while step < total:
                with nc.Checkpointer(root, memory_tier=False, keep_last=2) as ck:
                    assert ck.load_latest(into=state) == (step or None)
                    for _ in range(per_life):
                        step += 1
                        state["w"] += 1.0
                        ck.save(step, state).result()
                        full += _chain(root, [step])
                        counts.append(_man(root, step)["stats"].get("saves_since_full"))
        assert full == fulls, full
        assert counts == [(s - 1) % every for s in range(1, total + 1)], counts
        # keep_last=2 and the full step the older of them refers to: step 1 went long ago
        assert _committed(root) == sorted({total - 1, total, max(f for f in fulls if f < total)}), _committed(root)
        got = _read(root, total)
        assert torch.equal(got["frozen"], state["frozen"]) and torch.equal(got["w"], state["w"])


def test_a_restored_step_without_the_count_bounds_it_from_its_chain(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """A manifest that does not record ``saves_since_full`` (a multi-rank step's share, an older
    step): the count is bounded by the distance to the chain's last full save, found by following
    the oldest step referred to; where a step on the way does not open, it is not known (None: the
    next save is full)."""
    from nebula_ckpt.restore.open import read_main_manifest
    from nebula_ckpt.save.incremental import Incremental
    from nebula_ckpt.save.seeding import saves_since_full
    from nebula_ckpt.storage.local import LocalStorage

    root = str(tmp_path / "ck")
    state = {**{k: torch.randn(64 * 1024) for k in "abcd"}, "w": torch.zeros(256)}
    with knobs.override(incremental_full_every=10), nc.Checkpointer(root, memory_tier=False, keep_last=10) as ck:
        ck.save(10, state).result()  # full
        for step, k in zip((20, 30, 40, 50, 60), "wabcd", strict=True):
            state[k] = state[k] + 1  # a quarter of the bytes or less: incremental
            ck.save(step, state).result()
    st = LocalStorage(root)
    man = read_main_manifest(st, 60, "step 60")
    assert man.stats["saves_since_full"] == 5 and saves_since_full(st, man, "t") == 5
    bare = dataclasses.replace(man, stats={})
    refs = {s.step for s in man.shards if s.step is not None}
    assert refs and 10 not in refs, refs  # the full step is found through the oldest step referred to
    assert saves_since_full(st, bare, "t") == 50  # 60 - 10: at least the 5 saves since step 10
    os.remove(os.path.join(root, f"step-{min(refs)}", "manifest.json"))
    assert saves_since_full(st, bare, "t") is None
    inc = Incremental(True, full_every=10)
    assert inc.seed(bare, None) and inc.claim() is None  # not known: the next save is full
    inc = Incremental(True, full_every=10)
    assert inc.seed(man, 5) and inc.claim() is man
