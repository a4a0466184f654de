"""Incremental checkpoints on the memory tier: a step holds in ``/dev/shm`` only what changed.

A save whose tensors match the previous memory-tier step (the base) in keys, dtypes and shapes
stores the tensors whose bytes differ from the base's (compared byte for byte with the base's
shard, still in the tmpfs) and refers to the base's shard for the rest. Real tmpfs files, real
restores (the SIGKILL runs are in tests/crash/test_sigkill.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import nebula_ckpt as nc
from incremental.test_incremental import _forge_same_crc
from nebula_ckpt import knobs

REPO = str(Path(__file__).resolve().parents[3])


def _frozen() -> torch.Tensor:
    return torch.randn(512, 512, generator=torch.Generator().manual_seed(3))  # 1 MiB


def _mem_ck(root: str, keep_last: int = 20, **kw: object) -> nc.Checkpointer:
    """A checkpointer whose only tier is the memory tier (every restore reads it)."""
    return nc.Checkpointer(root, tiers=[nc.MemoryTier(keep_last=keep_last)], **kw)  # type: ignore[arg-type]


def _folder(ck: nc.Checkpointer) -> str:
    path = next(t for t in ck.tiers if t.kind == "memory").path  # type: ignore[attr-defined]
    assert path is not None
    return path


def _man(folder: str, step: int) -> dict:
    with open(os.path.join(folder, f"step-{step}", "manifest.json")) as f:
        return json.load(f)


def _step_bytes(folder: str, step: int) -> int:
    """Bytes of the shard files in the step's own folder (what the step holds in the tmpfs)."""
    d = os.path.join(folder, f"step-{step}")
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".safetensors"))


def test_a_chain_of_memory_tier_saves_holds_only_changes_and_restores_bit_exact(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(1024)
    want = {}
    with knobs.override(incremental_full_every=4), _mem_ck(root) as ck:
        folder = _folder(ck)
        for step in range(9):
            train += step + 0.5
            h = ck.save(step, {"frozen": frozen, "train": train, "step": step})
            want[step] = train.clone()
            written = h.metrics.written_bytes[next(iter(h.metrics.written_bytes))]
            if step % 4 == 0:
                assert written == h.metrics.bytes, step
            else:  # only the trained tensor (4 KiB) and a header
                assert written < 0.02 * h.metrics.bytes, (step, written, h.metrics.bytes)
        full = _step_bytes(folder, 0)
        for step in range(9):
            man = _man(folder, step)
            refs = [s.get("step") for s in man["shards"][1:]]
            assert refs == ([] if step % 4 == 0 else [step - step % 4]), (step, man["shards"])
            held = _step_bytes(folder, step)
            assert (held == full) if step % 4 == 0 else (held < 0.02 * full), (step, held, full)
        for step in range(9):  # every step of the chain, read back from the tmpfs
            got_step, got = ck.read(step)
            assert got_step == step
            assert torch.equal(got["frozen"], frozen) and torch.equal(got["train"], want[step]), step
    # a new process (here: a new checkpointer on the same root) restores the newest from the tier
    with _mem_ck(root) as ck:
        into = {"frozen": torch.zeros(512, 512), "train": torch.zeros(1024), "step": -1}
        assert ck.load_latest(into=into) == 8
        assert ck.last_restore is not None and ck.last_restore["tier"].startswith("memory")
        assert torch.equal(into["frozen"], frozen) and torch.equal(into["train"], want[8])


@pytest.mark.parametrize("how", ["data", "numpy", "same_crc"])
def test_a_frozen_tensor_changed_behind_autograd_or_with_an_equal_crc_is_stored(tmp_path, shm_dir, how) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen = torch.nn.Parameter(_frozen(), requires_grad=False)
    train = torch.zeros(64)
    with _mem_ck(root) as ck:
        folder = _folder(ck)
        ck.save(0, {"frozen": frozen, "train": train})
        train += 1
        ck.save(1, {"frozen": frozen, "train": train})
        assert len(_man(folder, 1)["shards"]) == 2  # incremental: frozen came from step 0
        if how == "data":
            frozen.data[7, 7] += 1.0
        elif how == "numpy":
            frozen.detach().numpy()[3, 5] = 42.0
        else:  # bytes differ, CRC32C equal: only a byte compare can tell
            raw = frozen.detach().numpy().view(np.uint8).reshape(-1)
            forged = _forge_same_crc(raw.tobytes(), 1000, 2000)
            raw[:] = np.frombuffer(forged, dtype=np.uint8)
            assert _man(folder, 1)["tensors"]["frozen"]["crc32c"] == nc.native.get_ops().crc32c(
                frozen.detach().reshape(-1).view(torch.uint8), [0], [frozen.nbytes])[0]
        train += 1
        ck.save(2, {"frozen": frozen, "train": train})
        assert "frozen" in _man(folder, 2)["tensors"] and _man(folder, 2)["tensors"]["frozen"].get("shard", 0) == 0
        assert _step_bytes(folder, 2) > frozen.nbytes  # stored in step 2's own shard
        got_step, got = ck.read(2)
        assert got_step == 2 and torch.equal(got["frozen"], frozen.detach())


def test_retention_keeps_a_memory_tier_base_while_a_step_refers_to_it(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with knobs.override(incremental_full_every=3), _mem_ck(root, keep_last=1) as ck:
        folder = _folder(ck)
        for step in range(3):
            train += 1
            ck.save(step, {"frozen": frozen, "train": train})
        # keep_last=1, but steps 1 and 2 were built on step 0: step 0 stays while step 2 is kept
        assert sorted(ck.list()) == [0, 2]
        assert os.path.exists(os.path.join(folder, "step-0", "COMMIT"))
        ck.remove(0)  # deferred, not done: step 2 refers to its bytes
        assert sorted(ck.list()) == [0, 2]
        got_step, got = ck.read(2)
        assert got_step == 2 and torch.equal(got["frozen"], frozen) and torch.equal(got["train"], train)
        train += 1
        ck.save(3, {"frozen": frozen, "train": train})  # full (every 3rd): nothing refers to 0 any more
        assert _man(folder, 3)["shards"][1:] == []
        assert sorted(ck.list()) == [3]


def test_a_dense_save_stays_whole_and_linked(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """Every tensor changed: the save is full and the memory tier links the staged slot file."""
    root = str(tmp_path / "ck")
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with _mem_ck(root) as ck:
        folder = _folder(ck)
        for step in range(3):
            a += 1
            b += 1
            ck.save(step, {"a": a, "b": b})
            assert len(_man(folder, step)["shards"]) == 1
            d = os.path.join(folder, f"step-{step}")
            shard = next(n for n in os.listdir(d) if n.endswith(".safetensors"))
            assert os.stat(os.path.join(d, shard)).st_nlink == 2  # the slot file's second name


def test_memory_tier_with_replicas_is_incremental_too(tmp_path, shm_dir) -> None:  # noqa: ANN001
    """A partner makes each replica whole (tests/tiers/memory/dist/test_replicas_incremental.py), so a memory
    tier with replicas is incremental like any other. Replicas need several ranks; here the tier
    asks for them after the (one-process) Checkpointer started, so that its writer's choice is
    what is seen."""
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with _mem_ck(root) as ck:
        folder = _folder(ck)
        ck.tiers[0].replicas = 1  # type: ignore[attr-defined]
        for step in range(3):
            train += 1
            ck.save(step, {"frozen": frozen, "train": train})
            assert len(_man(folder, step)["shards"]) == (1 if step == 0 else 2), step
            assert (_step_bytes(folder, step) >= frozen.nbytes) == (step == 0), step


def test_incremental_false_keeps_the_memory_tier_whole(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with _mem_ck(root, incremental=False) as ck:
        folder = _folder(ck)
        for step in range(3):
            train += 1
            ck.save(step, {"frozen": frozen, "train": train})
            assert len(_man(folder, step)["shards"]) == 1
            assert _step_bytes(folder, step) >= frozen.nbytes


_SAVER = r"""
import os, signal, sys, torch, nebula_ckpt as nc
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
model.register_parameter("frozen", torch.nn.Parameter(torch.randn(512, 512), requires_grad=False))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
ck = nc.Checkpointer(sys.argv[1], tiers=[nc.MemoryTier(keep_last=5), nc.LocalTier(sys.argv[1])])
for step in range(2):
    model(torch.randn(4, 64)).square().mean().backward(); opt.step(); opt.zero_grad()
    ck.save(step, {"model": model, "optim": opt, "step": step})
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{sys.argv[2]}-{step}")
os.kill(os.getpid(), signal.SIGKILL)
"""


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    model.register_parameter("frozen", torch.nn.Parameter(torch.zeros(512, 512), requires_grad=False))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _same(model: torch.nn.Module, opt: torch.optim.Optimizer, want: dict) -> bool:
    got_m, got_o = model.state_dict(), opt.state_dict()
    return all(torch.equal(got_m[k], v) for k, v in want["model"].items()) and all(
        torch.equal(got_o["state"][i][k], v) for i, st in want["optim"]["state"].items() for k, v in st.items())


def test_after_a_crash_the_chain_restores_from_the_memory_tier_and_a_base_is_never_adopted_away(
        tmp_path, shm_dir) -> None:  # noqa: ANN001
    """A SIGKILLed saver leaves step 0 (full) and step 1 (incremental on it) in the memory tier.
    Loading step 0 would hand its pages over (zero-copy adoption deletes the step from the tier),
    but step 1 refers to its bytes: it is copied instead, and step 1 still restores from memory."""
    import signal
    import sys

    import warm_python

    root, ref = str(tmp_path / "ck"), str(tmp_path / "ref")
    env = dict(os.environ, NEBULA_SHM_DIR=shm_dir, PYTHONPATH=os.pathsep.join(
        [REPO, os.environ.get("PYTHONPATH", "")]))
    r = warm_python.run([sys.executable, "-c", _SAVER, root, ref], env=env, capture_output=True, timeout=180)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-3000:]
    want = [torch.load(f"{ref}-{s}", weights_only=True) for s in range(2)]
    tiers = [nc.MemoryTier(keep_last=5), nc.LocalTier(root)]
    with nc.Checkpointer(root, tiers=tiers) as ck:
        folder = _folder(ck)
        assert [s.get("step") for s in _man(folder, 1)["shards"]] == [None, 0]  # incremental in memory
        model, opt = _model()
        assert ck.load(0, into={"model": model, "optim": opt, "step": -1}) == 0
        assert ck.last_restore is not None and ck.last_restore["tier"].startswith("memory")
        assert _same(model, opt, want[0])
        assert os.path.exists(os.path.join(folder, "step-0", "COMMIT"))  # not handed over: step 1 needs it
        model, opt = _model()
        assert ck.load_latest(into={"model": model, "optim": opt, "step": -1}) == 1
        assert ck.last_restore is not None and ck.last_restore["tier"].startswith("memory")
        assert _same(model, opt, want[1])


def test_persist_memory_writes_an_incremental_memory_step_whole_on_the_root(tmp_path, shm_dir) -> None:  # noqa: ANN001
    from nebula_ckpt.tiers.memory.epilogue import persist_memory

    root = str(tmp_path / "ck")
    frozen, train = _frozen(), torch.zeros(64)
    with _mem_ck(root) as ck:
        for step in range(2):
            train += 1
            ck.save(step, {"frozen": frozen, "train": train})
        assert len(_man(_folder(ck), 1)["shards"]) == 2  # incremental in memory
    got = persist_memory(root)
    assert got["step"] == 1 and got["copied"], got
    with open(os.path.join(root, "step-1", "manifest.json")) as f:
        assert len(json.load(f)["shards"]) == 1  # whole on the root: no reference to a step it lacks
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        got_step, state = ck.read(1)
        assert got_step == 1 and torch.equal(state["frozen"], frozen) and torch.equal(state["train"], train)
