"""The memory tier's retention never deletes the only copy of the newest healthy step while the
run saves a diverged state (docs/health.md, "Nothing is deleted").

A persistent tier with a cadence (``every=2``, ``every_seconds``) skips the healthy step, so the
memory tier holds its only copy; the loss goes NaN and the next save is suspect. Real roots, a
real tmpfs folder, a real SIGKILL; the restart is a new Checkpointer on the same root.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt import knobs

NAN = float("nan")
CADENCES = {"every": {"every": 2}, "every_seconds": {"every_seconds": 3600}}

_CHILD = r'''
import os, signal, sys, torch, nebula_ckpt as nc
root, cadence = sys.argv[1], sys.argv[2]
kw = {"every": 2} if cadence == "every" else {"every_seconds": 3600}
ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, keep_last=3, **kw)])
def save(i):
    ck.save(i, {"w": torch.full((64,), float(i))}); ck.wait()
save(2); ck.report(3, loss=1.0); ck.report(4, loss=1.0)
save(3 if cadence == "every" else 4)
ck.report(5, loss=1.0); ck.report(6, loss=1.0)     # confirmed healthy, on the memory tier alone
ck.report(7, loss=float("nan"))                    # the run diverges
save(8); ck.report(9, loss=float("nan"))           # suspect at once
print("MEM", ck.list(detailed=True)[ck.tiers[0].name], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
'''


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step))}


def _restart(root: str) -> tuple[Any, float]:
    into = _state(-1)
    with nc.Checkpointer(root) as ck:
        got = ck.load_latest(into=into)
    return got, float(into["w"][0])


def _diverge(ck: nc.Checkpointer, healthy: int) -> None:
    """Step 2 (both tiers), ``healthy`` (the memory tier alone) confirmed, then a NaN and step 8 saved."""
    ck.save(2, _state(2))
    ck.report(3, loss=1.0)
    ck.report(4, loss=1.0)
    ck.save(healthy, _state(healthy))
    ck.report(5, loss=1.0)
    ck.report(6, loss=1.0)
    ck.report(7, loss=NAN)
    ck.save(8, _state(8))
    ck.report(9, loss=NAN)


@pytest.mark.parametrize("cadence", sorted(CADENCES))
def test_a_sigkill_after_the_run_diverged_resumes_the_healthy_step_only_memory_held(
        root: str, shm_dir: str, cadence: str) -> None:
    healthy = 3 if cadence == "every" else 4
    r = warm_python.run([sys.executable, "-c", _CHILD, root, cadence], capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, NEBULA_SHM_DIR=shm_dir, OMP_NUM_THREADS="1"))
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert f"MEM [{healthy}, 8]" in r.stdout, r.stdout + r.stderr[-2000:]
    assert _restart(root) == (healthy, float(healthy))


@pytest.mark.parametrize("cadence", sorted(CADENCES))
def test_close_after_the_run_diverged_puts_the_healthy_step_only_memory_held_on_disk(
        root: str, cadence: str) -> None:
    healthy = 3 if cadence == "every" else 4
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, keep_last=1, **CADENCES[cadence])]) as ck:
        mem, disk = ck.tiers[0].name, ck.tiers[1].name
        _diverge(ck, healthy)
        assert ck.list(detailed=True)[mem] == [healthy, 8]
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root)], read_only=True) as rd:
        assert healthy in rd.list(detailed=True)[disk]     # the memory tier is gone after a clean close
    assert _restart(root) == (healthy, float(healthy))


def test_a_healthy_run_keeps_no_extra_step_in_memory(root: str) -> None:
    """Only a newer step marked suspect makes the memory tier keep an older one: a run that goes
    well holds ``keep_last`` steps there, as before."""
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2)]) as ck:
        mem = ck.tiers[0].name
        for step in range(10, 80, 10):
            ck.save(step, _state(step))
            ck.report(step + 1, loss=1.0)
            ck.report(step + 2, loss=1.0)                  # confirmed: the older ones go
            assert ck.list(detailed=True)[mem] == [step]


def test_a_tmpfs_without_room_for_the_healthy_step_lets_it_go_and_says_so(
        tmp_path, small_tmpfs: Callable[[str], str], caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """Keeping the step would leave no room for the next save beside it: retention deletes it
    (as ``keep_last`` says), with one warning; the saves go on in the memory tier."""
    shm = small_tmpfs("8m")
    root = str(tmp_path / "ckpt")
    big = 2**20 * 3 // 4                                   # 3 MiB: three of them do not fit, two do

    def state(step: int) -> dict[str, Any]:
        return {"w": torch.full((big,), float(step))}

    with knobs.override(shm_dir=shm), caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
        with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every=2)]) as ck:
            mem = ck.tiers[0].name
            ck.save(2, state(2))
            ck.report(3, loss=1.0)
            ck.report(4, loss=1.0)
            ck.save(3, state(3))
            ck.report(5, loss=1.0)
            ck.report(6, loss=1.0)
            ck.report(7, loss=NAN)
            ck.save(9, state(9))
            assert ck.list(detailed=True)[mem] == [9]
            assert ck.save(11, state(11)).tiers_written == [mem]
    assert sum("cannot keep step(s) [3]" in r.getMessage() for r in caplog.records) == 1


def test_every_ranks_memory_tier_keeps_the_healthy_step_and_the_ranks_resume_it(
        root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    """2 gloo ranks, each with its own memory tier: a multi-rank close copies nothing to the shared
    tier, so every rank's memory tier keeps the healthy step for the restart."""
    from dist.launch import reports, run_ok

    out = tmp_path / "out"
    out.mkdir()
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_ranks_worker.py")
    run_ok(2, worker, [root, str(out), "train"], out, shm_dir)
    assert [r["memory"] for r in reports(out, "train", 2)] == [[3, 8], [3, 8]]
    run_ok(2, worker, [root, str(out), "restart"], out, shm_dir)
    assert [(r["restored"], r["w"]) for r in reports(out, "restart", 2)] == [(3, 3.0), (3, 3.0)]


def test_under_the_host_memory_budget_the_ranks_kept_step_never_takes_the_next_saves_room(
        root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    """2 gloo ranks under ``host_memory_budget`` (``on_full="wait"``), room for two steps: the kept
    healthy step goes for the next save (a multi-rank job copies nothing to the shared tier to make
    room), which is written instead of raising ``ValidationError``."""
    from dist.launch import reports, run_ok

    out = tmp_path / "out"
    out.mkdir()
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_ranks_worker.py")
    run_ok(2, worker, [root, str(out), "budget"], out, shm_dir)
    assert [r["saves"] for r in reports(out, "budget", 2)] == [{str(s): "ok" for s in (2, 3, 8, 9, 10)}] * 2


def test_the_partner_nodes_replicas_keep_the_healthy_step_so_a_lost_node_resumes_it(
        root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    """2 gloo ranks on 2 simulated nodes, ``MemoryTier(replicas=1)``: the replicas a partner holds
    follow the memory tier's rule (never only ``keep_last``); the job is killed, a node's memory
    is lost, and the restart pulls the kept healthy step from the partner, not step 2 from disk."""
    import shutil

    from dist.launch import reports, run_ok

    out = tmp_path / "out"
    out.mkdir()
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_ranks_worker.py")
    run_ok(2, worker, [root, str(out), "replicas", shm_dir], out, shm_dir)
    held = reports(out, "replicas", 2)
    assert [r["memory"] for r in held] == [[3, 8], [3, 8]]
    assert [sorted(s for _, s in r["replicas"][str(1 - r["rank"])]) for r in held] == [[3, 8], [3, 8]]
    shutil.rmtree(os.path.join(shm_dir, "n1"))                     # node 1 lost
    run_ok(2, worker, [root, str(out), "restart", shm_dir], out, shm_dir)
    assert [(r["restored"], r["w"]) for r in reports(out, "restart", 2)] == [(3, 30.0), (3, 31.0)]


def test_close_puts_a_step_a_person_marked_healthy_while_the_job_ran_on_disk(root: str, shm_dir: str) -> None:
    """Step 8 was marked suspect by the NaN; a person runs ``nebula-ckpt mark --healthy 8`` (a
    false alarm) while the job runs: ``close()`` puts step 8 on the disk tier its cadence skipped,
    as it does any newest step, and a restart resumes it."""
    with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, every_seconds=3600)]) as ck:
        disk = ck.tiers[1].name
        _diverge(ck, 4)
        r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", "mark", root, "--healthy", "8", "--reason",
                            "false alarm"], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, NEBULA_SHM_DIR=shm_dir))
        assert r.returncode == 0, r.stdout + r.stderr
        ck.report(10, loss=1.0)
        ck.report(11, loss=1.0)
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root)], read_only=True) as rd:
        assert 8 in rd.list(detailed=True)[disk]
    assert _restart(root) == (8, 8.0)
