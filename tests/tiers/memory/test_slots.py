"""Slot files: CPU saves stage straight into the memory tier's files, which it links (no second copy).

These tests pin the promises that make that safe: a slot a committed memory-tier checkpoint
links is never written again until retention drops that checkpoint; slot names of finished
processes are swept without losing the checkpoints they back; without room in the tmpfs the
memory tier falls back to copying.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt.format.names import SLOT_DIR, slot_owner
from nebula_ckpt.save import buffers


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"a": torch.full((64, 1024), float(step)), "b": torch.arange(5000, dtype=torch.int64) + step}


def _slot_dir(ck: nc.Checkpointer) -> str:
    return os.path.join(ck.tiers[0].display_url, SLOT_DIR)


def _memory_shard(ck: nc.Checkpointer, step: int) -> str:
    d = os.path.join(ck.tiers[0].display_url, f"step-{step}")
    [shard] = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    return os.path.join(d, shard)


def test_memory_tier_links_the_slot_file(root: str) -> None:
    with nc.Checkpointer(root) as ck:
        ck.save(1, _state(1))
        shard = _memory_shard(ck, 1)
        slots = [os.path.join(_slot_dir(ck), f) for f in os.listdir(_slot_dir(ck))]
        assert os.stat(shard).st_nlink == 2, "the memory tier copied instead of linking"
        assert os.stat(shard).st_ino in {os.stat(p).st_ino for p in slots}
        stats = ck.stats()
        assert stats["memory_tier_slot_bytes"] == os.path.getsize(shard)
        assert stats["staging_bytes"] == 0  # the only slot is the memory tier's checkpoint now
        out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        assert ck.load_latest(into=out) == 1
        assert ck.last_restore["tier"].startswith("memory:")
        assert all(torch.equal(out[k], v) for k, v in _state(1).items())
        # the disk tier got the same bytes
        disk = nc.Checkpointer(root, tiers=[nc.LocalTier(root)])
        assert disk.read(1)[1]["a"].equal(_state(1)["a"])
        disk.close()


def test_live_slot_is_never_reused(root: str, shm_dir: str) -> None:
    """Every memory-tier checkpoint still committed holds its own step's values after each save."""
    mem = nc.MemoryTier(keep_last=2)
    with nc.Checkpointer(root, tiers=[mem, nc.LocalTier(root)]) as ck:
        for step in range(1, 9):
            ck.save_async(step, _state(step))
            ck.wait()
            per = ck.list(detailed=True)
            mem_steps = per[ck.tiers[0].name]
            assert mem_steps[-1] == step and len(mem_steps) <= 2, per
            for s in mem_steps:
                got = ck.read(s)[1]  # newest-first, fastest tier first: the memory tier's copy
                assert ck.last_restore["tier"].startswith("memory:")
                assert torch.equal(got["a"], _state(s)["a"]) and torch.equal(got["b"], _state(s)["b"]), \
                    f"memory-tier checkpoint of step {s} was overwritten by a later save"
        stats = ck.stats()
        # two live checkpoints + at most two staging slots, reused: no growth over 8 saves
        assert stats["staging_allocations"] <= 4, stats
        assert len(os.listdir(_slot_dir(ck))) == stats["staging_allocations"]


def test_close_removes_own_slot_names_and_keeps_checkpoints(root: str, shm_dir: str) -> None:
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier()])  # memory only: kept on close
    ck.save(3, _state(3))
    slot_dir = _slot_dir(ck)
    ck.close()
    assert os.listdir(slot_dir) == []
    with nc.Checkpointer(root, tiers=[nc.MemoryTier()]) as again:
        assert torch.equal(again.read()[1]["a"], _state(3)["a"])


def test_slot_names_of_a_killed_process_are_swept(root: str, shm_dir: str) -> None:
    """A dead writer's slot names go: the one its newest checkpoint links is unlinked (the
    checkpoint keeps the bytes), its idle staging file becomes a spare of the new process, which
    the next save of that size stages in (no new tmpfs pages), and close() leaves no name."""
    code = f"""
import os, torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r})
for s in (1, 2):
    ck.save(s, {{"a": torch.full((64, 1024), float(s)), "b": torch.arange(5000, dtype=torch.int64) + s}})
print(os.getpid())
os._exit(0)   # no close(): as after a crash
"""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    dead = warm_python.run([sys.executable, "-c", code], check=True, env=env, cwd=os.getcwd(),
                           capture_output=True, text=True).stdout.split()[-1]
    ck = nc.Checkpointer(root)
    try:
        slot_dir = _slot_dir(ck)
        left = os.listdir(slot_dir)
        assert not [n for n in left if n.startswith(f"slot-{dead}-")], "slot names of the dead writer were not swept"
        assert [n for n in left if n.startswith(f"slot-{os.getpid()}-")] == left and len(left) == 1, left
        spare = os.path.join(slot_dir, left[0])
        assert os.stat(spare).st_nlink == 1  # the idle staging file: linked by no checkpoint
        assert os.stat(_memory_shard(ck, 2)).st_nlink == 1  # the checkpoint holds its bytes alone
        step, got = ck.read()
        assert step == 2 and ck.last_restore["tier"].startswith("memory:")
        assert torch.equal(got["a"], _state(2)["a"])
        inode = os.stat(spare).st_ino
        ck.save(3, _state(3))  # and the new writer stages in the spare
        assert os.stat(_memory_shard(ck, 3)).st_ino == inode
        assert ck.stats()["staging_allocations"] == 1
        assert torch.equal(ck.read(3)[1]["b"], _state(3)["b"])
        assert torch.equal(ck.read(2)[1]["b"], _state(2)["b"]) or ck.list() == [3]
    finally:
        ck.close()


def test_unused_spares_are_removed_at_close(root: str, shm_dir: str) -> None:
    code = f"""
import os, torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r}, tiers=[nc.MemoryTier(), nc.LocalTier({root!r})])
for s in (1, 2):
    ck.save(s, {{"a": torch.full((64, 1024), float(s))}})
os._exit(0)
"""
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir)
    warm_python.run([sys.executable, "-c", code], check=True, env=env, cwd=os.getcwd())
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root)])
    slot_dir = _slot_dir(ck)
    assert len(os.listdir(slot_dir)) == 1  # the spare
    ck.save(3, {"a": torch.zeros(10)})  # another size: the spare is not used
    ck.close()
    assert not os.path.isdir(slot_dir) or os.listdir(slot_dir) == []


def test_no_room_in_shm_falls_back_to_copying(root: str, caplog, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """No room for a slot file (the staging buffer) in the tmpfs, room for the tier's step: the save
    stages in process memory and the memory tier copies from it. (The knob that leaves room free
    also makes the memory tier stand aside for a state it cannot hold: tests/tiers/memory/test_shm_room.py.)"""
    from nebula_ckpt.save import buffers

    monkeypatch.setattr(buffers, "shm_room", lambda slot_dir, nbytes: False)
    with caplog.at_level(logging.WARNING, "nebula_ckpt"):
        with nc.Checkpointer(root) as ck:
            ck.save(1, _state(1))
            ck.save(2, _state(2))
            assert os.stat(_memory_shard(ck, 2)).st_nlink == 1  # copied, not linked
            assert not os.path.isdir(_slot_dir(ck)) or os.listdir(_slot_dir(ck)) == []
            assert torch.equal(ck.read(2)[1]["a"], _state(2)["a"])
            assert ck.stats()["memory_tier_slot_bytes"] == 0
    assert any("no slot file" in r.getMessage() for r in caplog.records)


# -- slot files made ahead of need (off the training thread) ------------------------------------------

def _wait_ahead(ck: nc.Checkpointer, timeout: float = 30.0) -> None:
    """Wait until no slot file is being made in the background."""
    deadline = time.monotonic() + timeout
    while ck._saves.pool._preparer is not None:
        assert time.monotonic() < deadline, "slot file made ahead never finished"
        time.sleep(0.01)


def test_large_first_save_stages_anonymously_and_the_next_links_a_file_made_ahead(
        root: str, shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state of at least SLOT_AHEAD_BYTES never creates a slot file on the training thread:
    the first save copies through an anonymous buffer, the next ones link files made ahead."""
    monkeypatch.setattr(buffers, "SLOT_AHEAD_BYTES", 0)
    with nc.Checkpointer(root) as ck:
        ck.save(1, _state(1))
        assert os.stat(_memory_shard(ck, 1)).st_nlink == 1  # no slot file yet: the memory tier copied
        _wait_ahead(ck)
        assert len(os.listdir(_slot_dir(ck))) == 1
        for step in range(2, 7):
            ck.save(step, _state(step))
            assert os.stat(_memory_shard(ck, step)).st_nlink == 2, f"step {step} was copied, not linked"
            _wait_ahead(ck)
            got = ck.read(step)[1]
            assert ck.last_restore["tier"].startswith("memory:")
            assert torch.equal(got["a"], _state(step)["a"]) and torch.equal(got["b"], _state(step)["b"])
        # steady state: the memory tier's checkpoint and the next save's staging, nothing more
        assert len(os.listdir(_slot_dir(ck))) == 2
        assert ck.stats()["staging_allocations"] == 3  # the anonymous buffer of save 1 + two files
        # ... and save 1's anonymous buffer was freed once a slot file replaced it: the staging
        # left is the one slot file the memory tier does not link
        nbytes = os.path.getsize(_memory_shard(ck, 6))
        assert ck.stats()["staging_bytes"] == nbytes, ck.stats()
        assert [s.path is not None for s in ck._saves.pool._slots] == [True, True]


def test_files_made_ahead_never_overwrite_a_live_checkpoint(root: str, shm_dir: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    mem = nc.MemoryTier(keep_last=2)
    monkeypatch.setattr(buffers, "SLOT_AHEAD_BYTES", 0)
    with nc.Checkpointer(root, tiers=[mem, nc.LocalTier(root)]) as ck:
        for step in range(1, 9):
            ck.save(step, _state(step))
            for s in ck.list(detailed=True)[ck.tiers[0].name]:
                got = ck.read(s)[1]
                assert torch.equal(got["a"], _state(s)["a"]), f"memory-tier step {s} was overwritten"
        assert ck.stats()["staging_allocations"] <= 5, ck.stats()


def test_prepare_makes_the_first_saves_find_their_slot_files(root: str, shm_dir: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare() makes both files of the steady state: the memory tier links the first save's
    file as its checkpoint, the second save stages in the other; nothing is made meanwhile."""
    monkeypatch.setattr(buffers, "SLOT_AHEAD_BYTES", 0)
    with nc.Checkpointer(root) as ck:
        ck.prepare(_state(0), wait=True)
        assert ck._saves.pool._preparer is None
        assert ck.stats()["staging_allocations"] == 2
        files = sorted(os.listdir(_slot_dir(ck)))
        assert len(files) == 2
        for step in (1, 2, 3, 4):
            ck.save(step, _state(step))
            assert os.stat(_memory_shard(ck, step)).st_nlink == 2  # linked: staged in a prepared file
            assert ck._saves.pool._preparer is None, f"save {step} had a file made meanwhile"
            assert torch.equal(ck.read(step)[1]["a"], _state(step)["a"])
        assert ck.stats()["staging_allocations"] == 2 and sorted(os.listdir(_slot_dir(ck))) == files
        assert ck.stats()["staging_bytes"] == os.path.getsize(_memory_shard(ck, 4))  # the other file


def test_prepare_without_a_memory_tier_makes_an_anonymous_buffer(root: str) -> None:
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root)]) as ck:
        ck.prepare(_state(0))
        _wait_ahead(ck)
        ck.save(1, _state(1))
        ck.save(2, _state(2))
        assert ck.stats()["staging_allocations"] == 1  # both saves staged in the prepared buffer
        assert torch.equal(ck.read(2)[1]["b"], _state(2)["b"])


def test_prepare_checks_the_state_and_writes_nothing(root: str, shm_dir: str) -> None:
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.ValidationError, match="bad"):
            ck.prepare({"bad": object()})
        assert ck.list() == []


def test_close_while_a_file_is_made_ahead_leaves_nothing(root: str, shm_dir: str) -> None:
    ck = nc.Checkpointer(root, tiers=[nc.MemoryTier()])
    big = {"a": torch.zeros(64 << 20, dtype=torch.uint8)}
    ck.prepare(big)
    slot_dir = _slot_dir(ck)
    ck.close()  # joins the background thread, then frees what it made
    assert ck._saves.pool._preparer is None
    assert not os.path.isdir(slot_dir) or os.listdir(slot_dir) == []
    assert not any(t.name == "nebula-slot-ahead" for t in threading.enumerate())


#: names in ``.slots/`` that look like slot files but carry no pid of a process: beyond pid_t, a
#: non-ASCII digit, a leading zero, pid 0
STRAY_SLOT_NAMES = ["slot-99999999999999-abc", f"slot-{2**31}-abc", "slot-\u00b2-abc", "slot-\u0663-abc",
                    "slot-007-abc", "slot-0-abc"]


def test_slot_owner_takes_only_pids_a_process_has() -> None:
    assert slot_owner(f"slot-{os.getpid()}-0123456789ab") == os.getpid()
    assert slot_owner(f"slot-{2**31 - 1}-x") == 2**31 - 1
    assert [slot_owner(n) for n in STRAY_SLOT_NAMES] == [None] * len(STRAY_SLOT_NAMES)


def test_stray_slot_names_are_left_alone_and_the_job_restores_and_saves(root: str, shm_dir: str) -> None:
    """Names in the tier's ``.slots/`` that are no slot file of a process (a pid beyond pid_t, a
    non-ASCII digit) are not ours: a restarted job opens the root, restores the dead job's step
    from memory and saves, leaving them as they are."""
    code = f"""
import os, torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r})
ck.save(1, {{"a": torch.full((64, 1024), 1.0), "b": torch.arange(5000, dtype=torch.int64) + 1}})
os._exit(0)   # no close(): as after a crash
"""
    warm_python.run([sys.executable, "-c", code], check=True, env=dict(os.environ, NEBULA_SHM_DIR=shm_dir),
                    cwd=os.getcwd())
    [slot_dir] = [os.path.join(d, SLOT_DIR) for d in _memory_folders(shm_dir)]
    for name in STRAY_SLOT_NAMES:
        with open(os.path.join(slot_dir, name), "wb") as f:
            f.write(b"not a slot")
    with nc.Checkpointer(root) as ck:
        got = {"a": torch.zeros(64, 1024), "b": torch.zeros(5000, dtype=torch.int64)}
        assert ck.load_latest(into=got) == 1 and ck.last_restore["tier"].startswith("memory:")
        assert torch.equal(got["b"], _state(1)["b"])
        ck.save(2, _state(2))
        assert ck.list() == [1, 2]
        for name in STRAY_SLOT_NAMES:
            with open(os.path.join(slot_dir, name), "rb") as f:
                assert f.read() == b"not a slot", name


def _memory_folders(shm_dir: str) -> list[str]:
    """The memory tier folders under ``shm_dir`` (those holding a ``.slots`` folder)."""
    return [dp for dp, dirs, _ in os.walk(shm_dir) if SLOT_DIR in dirs]
