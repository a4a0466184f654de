"""A checkpoint held in this process's memory, read over a tier's storage
(nebula_ckpt/storage/buffers.py), and restored by handing its pages out as the tensors a restore
creates (nebula_ckpt/tiers/memory/adopt_memory.py): what a rank does with the copy it pulled from a
partner at restore. The pull itself runs on real ranks in tests/tiers/memory/dist/test_replicas*.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.restore.apply import stage_restore
from nebula_ckpt.restore.copies import OWN_STORAGE_BYTES
from nebula_ckpt.restore.select import find_and_open
from nebula_ckpt.storage.buffers import BufferStorage
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.tiers.memory.adopt import adoption_for


def _state(seed: int, stepped: bool = True) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.Linear(384, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stepped:  # else the optimizer of a job that restarts: no state yet
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
    return {"model": model, "optim": opt, "step": seed}


def _flat(st: dict[str, object]) -> dict[str, torch.Tensor]:
    model, opt = st["model"], st["optim"]
    assert isinstance(model, torch.nn.Module) and isinstance(opt, torch.optim.Optimizer)
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


def _saved(tmp_path: Path) -> tuple[dict[str, object], Path]:
    root = tmp_path / "root"
    st = _state(1)
    with nc.Checkpointer(str(root), tiers=[nc.LocalTier(str(root))]) as ck:
        ck.save(7, st)
    return st, root


def _in_memory(root: Path, step: int) -> dict[str, torch.Tensor]:
    """The step's files, read into this process's memory (as a pull lands them)."""
    d = root / f"step-{step}"
    return {f"step-{step}/{p.name}": torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
            for p in d.iterdir() if p.is_file()}


def test_the_buffers_hide_the_same_step_of_the_base_and_show_its_others(tmp_path: Path) -> None:
    st, root = _saved(tmp_path)
    files = _in_memory(root, 7)
    base_dir = tmp_path / "tier"
    (base_dir / "step-7").mkdir(parents=True)
    (base_dir / "step-7" / "COMMIT").write_bytes(b"damaged")      # a damaged copy of the same step
    (base_dir / "step-7" / "stray").write_bytes(b"x")
    (base_dir / "step-3").mkdir()
    (base_dir / "step-3" / "COMMIT").write_bytes(b"older")
    bs = BufferStorage(files, LocalStorage(str(base_dir)), "step 7 pulled")
    assert bs.read_small("step-7/COMMIT") == files["step-7/COMMIT"].numpy().tobytes()
    assert sorted(bs.list("step-7")) == sorted(p.split("/")[1] for p in files)  # not the base's "stray"
    assert not bs.exists("step-7/stray") and bs.exists("step-3/COMMIT") and bs.exists("step-7")
    with pytest.raises(FileNotFoundError):
        bs.read_small("step-7/stray")
    assert bs.read_small("step-3/COMMIT") == b"older"
    assert committed_steps(bs) == [3, 7]
    assert bs.local_path("step-7/COMMIT") is None and bs.local_path("step-3/COMMIT") == str(base_dir / "step-3/COMMIT")
    for write in (lambda: bs.write_small("step-9/COMMIT", b""), lambda: bs.remove("step-3/COMMIT"),
                  lambda: bs.remove_dir("step-7"), lambda: bs.write_buffer("x", memoryview(b"y"))):
        with pytest.raises(PermissionError, match="read-only"):
            write()
    assert (base_dir / "step-3" / "COMMIT").exists()


def test_a_restore_from_memory_hands_its_pages_out_and_restores_bit_exact(tmp_path: Path) -> None:
    st, root = _saved(tmp_path)
    files = _in_memory(root, 7)
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in files.values()]
    (tmp_path / "tier").mkdir()
    bs = BufferStorage(files, LocalStorage(str(tmp_path / "tier")), "step 7 pulled")
    into = _state(99, stepped=False)  # a restarted job: its optimizer holds no state to refill in place
    assert any(not torch.equal(into["model"].state_dict()[k], v)  # type: ignore[attr-defined]
               for k, v in st["model"].state_dict().items())  # type: ignore[attr-defined]
    stage = stage_restore(into, adopt=lambda ck: adoption_for([], ck, False, 4))
    ck = find_and_open([(nc.MemoryTier(), bs)], stage=stage, rank=None)
    assert ck is not None and ck.step == 7 and ck.pending is not None
    ck.pending()
    assert ck.adoption is not None and ck.adoption.handed_bytes > 0
    want, got = _flat(st), _flat(into)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    opt = into["optim"]
    assert isinstance(opt, torch.optim.Optimizer)
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    big = [m for m in moments if m.numel() * m.element_size() > OWN_STORAGE_BYTES]  # small ones get own storage
    assert big and all(any(lo <= m.data_ptr() < hi for lo, hi in spans) for m in big)  # no copy
    model = into["model"]
    assert isinstance(model, torch.nn.Module)
    assert not any(any(lo <= p.data_ptr() < hi for lo, hi in spans) for p in model.parameters())  # copied into
    # training goes on in those pages
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    assert all(torch.isfinite(m).all() for m in moments)


def test_a_damaged_copy_in_memory_is_refused_before_anything_changes(tmp_path: Path) -> None:
    st, root = _saved(tmp_path)
    files = _in_memory(root, 7)
    shard = next(t for p, t in files.items() if p.endswith(".safetensors"))
    shard[-5] ^= 0xFF
    (tmp_path / "tier").mkdir()
    bs = BufferStorage(files, LocalStorage(str(tmp_path / "tier")), "step 7 pulled")
    into = _state(99)
    before = _flat(into)
    stage = stage_restore(into, adopt=lambda ck: adoption_for([], ck, False, 4))
    assert find_and_open([(nc.MemoryTier(), bs)], stage=stage, rank=None, on_all_damaged="warn") is None
    after = _flat(into)
    assert all(torch.equal(before[k], after[k]) for k in before)
