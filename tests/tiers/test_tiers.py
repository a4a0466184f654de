"""Tiers: memory tier ownership and lifetime, cadences, slow tiers never blocking fast ones, fencing."""

from __future__ import annotations

import os
import stat
import sys
import time

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from faults import FaultyTier
from memory_paths import memory_tier_path


def test_memory_tier_is_private_and_removed_on_clean_close(root: str) -> None:
    with nc.Checkpointer(root) as ck:
        mem = ck.tiers[0]
        assert mem.kind == "memory" and mem.display_url == memory_tier_path(root)
        ck.save(1, {"w": torch.ones(10)})
        d = os.path.join(mem.display_url, "step-1")
        assert stat.S_IMODE(os.stat(mem.display_url).st_mode) == 0o700
        for f in os.listdir(d):
            assert stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) == 0o600, f
    assert not os.path.exists(mem.display_url)
    with nc.Checkpointer(root) as again:
        assert again.list() == [1]  # still on the persistent tier


def test_new_process_finds_crashed_runs_memory_tier(root: str, shm_dir: str) -> None:
    code = f"""
import os, torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r}, tiers=[nc.MemoryTier()])
ck.save(7, {{"w": torch.full((4,), 7.0)}})
os._exit(0)   # no close(): as after a crash
"""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    warm_python.run([sys.executable, "-c", code], check=True, env=env, cwd=os.getcwd())
    w = torch.zeros(4)
    with nc.Checkpointer(root) as ck:   # same root, no other argument
        assert ck.load_latest(into={"w": w}) == 7
        assert ck.last_restore["tier"].startswith("memory:")
    assert torch.all(w == 7)
    other = root + "-other-run"
    with nc.Checkpointer(other) as ck:
        assert ck.tiers[0].display_url != memory_tier_path(root)
        assert ck.load_latest() is None  # never takes another run's memory tier


def test_slow_tier_never_blocks_fast_tier_or_training(tmp_path, shm_dir) -> None:  # noqa: ANN001
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    slow_tier = FaultyTier(slow, pause_at="shard", keep_last=10)
    ck = nc.Checkpointer(fast, tiers=[nc.LocalTier(fast, keep_last=10), slow_tier], host_memory_budget=None)
    w = torch.zeros(1000)
    h0 = ck.save_async(0, {"w": w})
    assert slow_tier.reached.wait(30)          # the slow tier is stuck writing step 0
    h0.wait_snapshot()
    handles = []
    for s in range(1, 6):
        w.add_(1)
        t0 = time.monotonic()
        handles.append(ck.save_async(s, {"w": w}))
        handles[-1].wait_snapshot()
        assert time.monotonic() - t0 < 10  # training is not held up by the stuck tier
        deadline = time.monotonic() + 30   # a "training step" longer than the fast tier's write
        while f"local:{fast}" not in handles[-1].tiers_written and time.monotonic() < deadline:
            time.sleep(0.01)
    # the fast tier committed every save while the slow one was stuck
    assert ck.list(detailed=True)[f"local:{fast}"] == [0, 1, 2, 3, 4, 5]
    slow_tier.gate.set()
    ck.wait()
    # the slow tier took step 0 and then only the newest pending one; the rest were dropped for it
    assert ck.list(detailed=True)[slow_tier.name] == [0, 5]
    dropped = [h.step for h in handles if slow_tier.name in h.tiers_dropped]
    assert dropped == [1, 2, 3, 4]
    assert h0.result() and all(h.result() for h in handles)
    ck.close()


def test_every_seconds_cadence(tmp_path) -> None:  # noqa: ANN001
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tiers = [nc.LocalTier(a, keep_last=50), nc.LocalTier(b, every_seconds=3600, keep_last=50)]
    with nc.Checkpointer(a, tiers=tiers) as ck:
        for s in range(5):
            ck.save(s, {"x": s})
        per = ck.list(detailed=True)
    assert per[f"local:{a}"] == [0, 1, 2, 3, 4] and per[f"local:{b}"] == [0]


def test_stale_writer_is_fenced(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    old = nc.Checkpointer(root, memory_tier=False, keep_last=1)
    old.save(1, {"w": torch.ones(3)})
    new = nc.Checkpointer(root, memory_tier=False, keep_last=1)
    new.save(10, {"w": torch.full((3,), 10.0)})
    h = old.save_async(2, {"w": torch.full((3,), 2.0)})
    with pytest.raises(nc.PersistError, match="newer writer"):
        h.result()
    # the stale writer neither committed nor pruned the new run's checkpoint
    assert new.list() == [10]
    assert not os.path.exists(os.path.join(root, "step-2", "COMMIT"))
    new.save(11, {"w": torch.full((3,), 11.0)})
    assert new.list() == [11]
    w = torch.zeros(3)
    assert new.load_latest(into={"w": w}) == 11 and torch.all(w == 11)
    old.close()   # the failure was already seen through its handle: close does not raise it again
    new.close()
    with nc.Checkpointer(root, memory_tier=False) as again:
        assert again.list() == [11]


@pytest.fixture
def tiny_fs(tmp_path):  # noqa: ANN001, ANN201
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = warm_python.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 4 MiB tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield str(mnt)
    warm_python.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_fails_clearly_and_keeps_earlier_checkpoints(tiny_fs: str, shm_dir: str) -> None:
    root = os.path.join(tiny_fs, "ck")
    w = torch.zeros(300_000)  # 1.2 MB per checkpoint
    with nc.Checkpointer(root, memory_tier=False, keep_last=5, on_persist_error="log") as ck:
        ck.save(1, {"w": w.add_(1)})
        ck.save(2, {"w": w.add_(1)})
        ck.save(3, {"w": w.add_(1)})
        h = ck.save_async(4, {"w": w.add_(1)})   # does not fit
        with pytest.raises(nc.PersistError, match="No space left on device"):
            h.result()
        for _ in range(3):   # training goes on
            w.add_(1)
        assert ck.list() == [1, 2, 3]
        out = torch.zeros(300_000)
        assert ck.load_latest(into={"w": out}) == 3 and torch.all(out == 3)
    from nebula_ckpt.cli import main
    assert main(["verify", root]) == 0


@pytest.mark.parametrize("make,names", [
    (lambda: nc.LocalTier(""), "LocalTier: path"), (lambda: nc.LocalTier(None), "LocalTier: path"),
    (lambda: nc.LocalTier("file://"), "LocalTier: path"), (lambda: nc.RemoteTier(""), "RemoteTier: url"),
    (lambda: nc.RemoteTier(None), "RemoteTier: url"), (lambda: nc.MemoryTier(path=""), "MemoryTier: path"),
    (lambda: nc.MemoryTier(path=5), "MemoryTier: path"),
], ids=["local-empty", "local-none", "local-file-url-without-path", "remote-empty", "remote-none", "memory-empty",
        "memory-int"])
def test_a_tier_without_a_location_is_refused_naming_the_argument(tmp_path, shm_dir, monkeypatch,  # noqa: ANN001
                                                                  make, names) -> None:  # noqa: ANN001
    """``LocalTier("")`` used to be accepted and wrote step-N/ and _nebula/ into the current
    directory (``Checkpointer("")`` is refused); ``LocalTier(None)`` was a raw AttributeError."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(nc.ValidationError) as e:
        make()
    msg = str(e.value)
    assert msg.startswith(names) and "e.g. nc." in msg, msg
    assert os.listdir(tmp_path) == []


def test_a_tier_whose_location_was_emptied_is_refused_before_anything_is_written(tmp_path, shm_dir,  # noqa: ANN001
                                                                                 monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    tier = nc.LocalTier(str(tmp_path / "disk"))
    tier.path = ""
    with pytest.raises(nc.ValidationError, match="LocalTier: path must be a non-empty string"):
        nc.Checkpointer(str(tmp_path / "root"), tiers=[tier], memory_tier=False)
    assert os.listdir(tmp_path) == []
