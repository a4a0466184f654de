"""A restart restores an incremental memory-tier step without a copy (nebula_ckpt/tiers/memory/adopt.py).

A LoRA-like state (a large frozen tensor, a small trained one) is saved twice by a real process
(step 0 whole, step 1 only what changed: its memory-tier manifest refers to step 0's shard), which
is then SIGKILLed. The restarted process restores step 1 from the memory tier: the trained bytes
are handed over (step 1's own shard, claimed), the frozen bytes are a copy-on-write view of step
0's shard, which stays the tier's. Checked: bit-exact, nothing copied, a write to a restored frozen
tensor never reaches the tier's file, damaged base bytes fall back before ``into`` changes, and no
in-place reuse of a memory-tier file (a spare slot file of a dead process) ever writes the file a
live process maps copy-on-write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt import knobs
from nebula_ckpt.tiers.memory.tier import memory_tier_path

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs memory tier")

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# argv: root, reference file prefix, steps to save, "kill" | "wait:<gate>:<more steps>"[, seed of frozen]
_SAVER = r"""
import os, signal, sys, time, torch, nebula_ckpt as nc
root, ref, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 3
frozen = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(seed))   # 4 MiB, never changes
train = torch.zeros(4096)
ck = nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier(root, keep_last=3)])
def save(step):
    train.add_(step + 0.5)
    ck.save(step, {"frozen": frozen, "train": train, "step": step})
    ck.wait()
    torch.save({"frozen": frozen, "train": train.clone()}, f"{ref}-{step}")
for step in range(steps):
    save(step)
if mode.startswith("wait:"):
    _, gate, more = mode.split(":")
    open(gate + ".ready", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.05)
    for step in range(steps, steps + int(more)):
        save(step)
    open(gate + ".saved", "w").close()
    while True:
        time.sleep(1)
os.kill(os.getpid(), signal.SIGKILL)
"""

_READER = r"""
import sys, torch, nebula_ckpt as nc
root, step, ref = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=2), nc.LocalTier(root, keep_last=3)], read_only=True) as ck:
    got, state = ck.read(step)
    tier = ck.last_restore["tier"].split(":")[0]
want = torch.load(ref, weights_only=True)
print(tier, "SAME" if torch.equal(state["frozen"], want["frozen"]) else "DIFFERENT")
"""


def _env(shm_dir: str, full_every: int = 10) -> dict[str, str]:
    return dict(os.environ, NEBULA_SHM_DIR=shm_dir, NEBULA_INCREMENTAL_FULL_EVERY=str(full_every),
                PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))


def _crash(root: str, shm_dir: str, ref: str, steps: int = 2) -> list[dict[str, Any]]:
    r = warm_python.run([sys.executable, "-c", _SAVER, root, ref, str(steps), "kill"], env=_env(shm_dir),
                        capture_output=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-3000:]
    return [torch.load(f"{ref}-{s}", weights_only=True) for s in range(steps)]


def _tiers(root: str, keep: int = 2) -> list[Any]:
    return [nc.MemoryTier(keep_last=keep), nc.LocalTier(root, keep_last=3)]


def _into() -> dict[str, Any]:
    return {"frozen": None, "train": None, "step": None}


def _shard(folder: str, step: int) -> str:
    d = os.path.join(folder, f"step-{step}")
    return os.path.join(d, next(n for n in os.listdir(d) if n.endswith(".safetensors")))


def _private_maps_of(path: str) -> bool:
    """Whether this process maps the file at ``path`` (by inode) and it still has that name."""
    ino = os.stat(path).st_ino
    with open("/proc/self/maps") as f:
        return any(line.split()[4] == str(ino) for line in f if len(line.split()) >= 6)


def test_an_incremental_memory_step_is_restored_without_a_copy(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref"))
    folder = memory_tier_path(root)
    base_file = _shard(folder, 0)
    with nc.Checkpointer(root, tiers=_tiers(root)) as ck:
        into = _into()
        assert ck.load_latest(into=into) == 1
        lr = ck.last_restore
        assert lr is not None and lr["tier"].startswith("memory:"), lr
        assert torch.equal(into["frozen"], want[1]["frozen"]) and torch.equal(into["train"], want[1]["train"])
        assert lr["copy_on_write_bytes"] == into["frozen"].numel() * 4, lr  # the frozen bytes: the base's pages
        assert lr["adopted_bytes"] == into["train"].numel() * 4, lr         # step 1's own shard: handed over
        assert _private_maps_of(base_file), "the frozen tensor is not a mapping of the base's shard"
        assert os.path.exists(os.path.join(folder, "step-0", "COMMIT"))    # the base stays the tier's
        # training writes the frozen tensor (or anything else does): a private page, never the tier's file
        into["frozen"].add_(1.0)
        r = warm_python.run([sys.executable, "-c", _READER, root, "0", str(tmp_path / "ref-0")], env=_env(shm_dir),
                            capture_output=True, timeout=300)
        assert r.stdout.decode().strip() == "memory SAME", r.stderr.decode()[-3000:]
        assert torch.equal(into["frozen"], want[1]["frozen"] + 1.0)
        _, again = ck.read(0)  # and this process reads the tier's base unchanged too
        assert torch.equal(again["frozen"], want[0]["frozen"])


def test_damaged_base_bytes_fall_back_before_into_changes(root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref"))
    base_file = _shard(memory_tier_path(root), 0)
    with open(base_file, "r+b") as f:  # a byte of the frozen tensor (the shard's last bytes are its data)
        f.seek(os.path.getsize(base_file) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with nc.Checkpointer(root, tiers=_tiers(root)) as ck:
        into = _into()
        assert ck.load_latest(into=into) == 1
        lr = ck.last_restore
        assert lr is not None and lr["tier"].startswith("local:"), lr   # the next candidate: step 1 on disk
        assert lr["adopted_bytes"] == 0 and lr["copy_on_write_bytes"] == 0, lr
        assert torch.equal(into["frozen"], want[1]["frozen"]) and torch.equal(into["train"], want[1]["train"])


def test_restart_adopts_keeps_saving_and_retention_drops_the_base_bit_exact(root: str, shm_dir: str,
                                                                           tmp_path) -> None:  # noqa: ANN001
    want = _crash(root, shm_dir, str(tmp_path / "ref"))
    folder = memory_tier_path(root)
    base = os.stat(_shard(folder, 0))
    # the restarted memory tier builds on the base it kept (step 0): a full save every 3rd lets
    # retention drop the base while the restored frozen tensor still maps it copy-on-write
    with knobs.override(incremental_full_every=3), nc.Checkpointer(root, tiers=_tiers(root)) as ck:
        into = _into()
        assert ck.load_latest(into=into) == 1
        assert ck.last_restore is not None and ck.last_restore["copy_on_write_bytes"] > 0, ck.last_restore
        frozen, train = into["frozen"], into["train"]
        for step in range(2, 8):
            train.add_(step + 0.5)
            ck.save(step, {"frozen": frozen, "train": train, "step": step})
            ck.wait()
            assert torch.equal(frozen, want[0]["frozen"]), f"the frozen tensor changed at save {step}"
            _, got = ck.read(step)
            assert torch.equal(got["frozen"], want[0]["frozen"]) and torch.equal(got["train"], train), step
        assert 0 not in ck.list(detailed=True)[ck.tiers[0].name]  # retention dropped the base
        # no file of the tier (steps, slot files, spares) is the base's file: it was never staged into
        for d, _, names in os.walk(folder):
            for n in names:
                st = os.stat(os.path.join(d, n))
                assert (st.st_dev, st.st_ino) != (base.st_dev, base.st_ino), os.path.join(d, n)
        assert torch.equal(frozen, want[0]["frozen"])


def _wait_for(path: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while not os.path.exists(path):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.05)


def test_a_spare_slot_file_is_never_staged_into_while_a_process_maps_it_copy_on_write(
        root: str, shm_dir: str, tmp_path) -> None:  # noqa: ANN001
    """The job keeps saving while this process restores beside it (its claim is not won: the job
    holds the tier), so step 0's shard is the job's slot file; a full save (every 3rd) lets
    retention drop step 0, the job is SIGKILLed, and a restarted job's full saves could stage into
    that slot file (a spare of a dead process, of exactly the size of a full save) in place: the
    copy-on-write frozen tensor here would change under it."""
    ref, gate = str(tmp_path / "ref"), str(tmp_path / "gate")
    job = warm_python.popen([sys.executable, "-c", _SAVER, root, ref, "2", f"wait:{gate}:4"],
                            env=_env(shm_dir, full_every=3), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for(gate + ".ready", job)
        want = torch.load(f"{ref}-0", weights_only=True)
        with nc.Checkpointer(root, tiers=_tiers(root)) as ck:
            into = _into()
            assert ck.load_latest(into=into) == 1
            lr = ck.last_restore
            assert lr is not None and lr["tier"].startswith("memory:"), lr
            assert lr["adopted_bytes"] == 0 and lr["copy_on_write_bytes"] == into["frozen"].numel() * 4, lr
            base = os.stat(_shard(memory_tier_path(root), 0))
            open(gate, "w").close()
            _wait_for(gate + ".saved", job)  # steps 2..5 saved (3 full): retention dropped step 0
            assert not os.path.exists(os.path.join(memory_tier_path(root), "step-0"))
            job.kill()
            job.wait()
            # every save of the restarted job (of another model) is full: it takes every spare of that size
            r = warm_python.run([sys.executable, "-c", _SAVER, root, str(tmp_path / "ref2"), "4", "kill", "4"],
                                env=_env(shm_dir, full_every=1), capture_output=True, timeout=300)
            assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-3000:]
            assert torch.equal(into["frozen"], want["frozen"]), "a save staged into the copy-on-write base's file"
            for d, _, names in os.walk(memory_tier_path(root)):
                for n in names:
                    st = os.stat(os.path.join(d, n))
                    assert (st.st_dev, st.st_ino) != (base.st_dev, base.st_ino), os.path.join(d, n)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_a_private_mapping_keeps_every_process_this_one_included_from_taking_or_reusing_the_file(
        tmp_path) -> None:  # noqa: ANN001
    """The lock a copy-on-write mapping holds is seen by a claim (hold_alone) and by the spare
    checks (read_elsewhere) of this process too, not only of others, and it lives as long as the
    mapping does (the descriptor it was taken on closed at once)."""
    import gc
    import mmap

    from nebula_ckpt.storage.holds import hold_alone, hold_private, let_go, read_elsewhere

    path = str(tmp_path / "base")
    with open(path, "wb") as f:
        f.write(b"x" * 8192)
    claim = os.open(path, os.O_RDWR)
    try:
        assert not read_elsewhere(path) and hold_alone(claim)  # nothing maps it: it can be taken over
        let_go(claim)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        assert hold_private(fd)
        mm = mmap.mmap(fd, 8192, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        view = torch.frombuffer(mm, dtype=torch.uint8)
        assert read_elsewhere(path) and not hold_alone(claim)
        view[0] = 7  # a private page: the file is unchanged
        with open(path, "rb") as f:
            assert f.read(1) == b"x"
        del view
        mm.close()
        gc.collect()
        assert not read_elsewhere(path) and hold_alone(claim)  # the mapping is gone, and with it the lock
    finally:
        os.close(claim)
