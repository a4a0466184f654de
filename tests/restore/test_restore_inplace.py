"""A restore into a running optimizer refills the state tensors it holds, after every check.

``load_state_dict`` keeps the tensors it is given when their dtype and device suit their
parameter, so the restore copies the checked bytes into the optimizer's own state tensors (no
new buffer, no page faults, the storages a later save planned stay) and hands those over. These
tests pin the promise: the values are the saved ones, bit for bit, in the very tensors; nothing
changes when a byte is damaged; where torch's own loading is not what runs (a hook), or shapes
differ, owned copies are made as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.restore.open import read_manifest
from nebula_ckpt.tiers.local import LocalTier


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _opt_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}/{k}": v for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


@pytest.mark.parametrize("memory_tier", [False, True])
def test_a_running_optimizer_is_refilled_in_its_own_tensors(tmp_path: Path, shm_dir: str, memory_tier: bool) -> None:
    model, opt = _trained()
    with nc.Checkpointer(str(tmp_path / "ck"), memory_tier=memory_tier) as ck:
        ck.save(1, {"model": model, "optim": opt})
        saved = {k: v.clone() for k, v in _opt_state(opt).items()}
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        _step(model, opt)
        before = {k: v.data_ptr() for k, v in _opt_state(opt).items()}
        assert ck.load_latest(into={"model": model, "optim": opt}) == 1
    after = _opt_state(opt)
    assert after.keys() == saved.keys() and all(torch.equal(after[k], saved[k]) for k in saved)
    assert all(after[k].dtype == saved[k].dtype for k in saved)
    assert {k: v.data_ptr() for k, v in after.items()} == before, "the optimizer's tensors were replaced"
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    _step(model, opt)  # and it trains on


def test_a_damaged_byte_leaves_the_running_optimizer_untouched(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    model, opt = _trained()
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model, "optim": opt})
    st = LocalTier(root).make_storage()
    man = read_manifest(st, 1)
    st.close()
    rec = max((r for k, r in man.tensors.items() if "exp_avg_sq" in k), key=lambda r: r.start)  # the last one
    with open(Path(root, step_dir(1), man.shards[rec.shard].file), "r+b") as f:
        f.seek(rec.end - 1)
        b = f.read(1)
        f.seek(rec.end - 1)
        f.write(bytes([b[0] ^ 0x01]))
    _step(model, opt)
    live = {k: v.clone() for k, v in _opt_state(opt).items()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.CorruptCheckpointError, match="exp_avg_sq"):
            ck.load_latest(into={"model": model, "optim": opt})
    assert all(torch.equal(v, live[k]) for k, v in _opt_state(opt).items()), "the optimizer changed"
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()), "the model changed"


def test_owned_copies_where_torch_loading_is_not_what_runs(tmp_path: Path) -> None:
    model, opt = _trained()
    with nc.Checkpointer(str(tmp_path / "ck"), memory_tier=False) as ck:
        ck.save(1, {"model": model, "optim": opt})
        saved = {k: v.clone() for k, v in _opt_state(opt).items()}
        _step(model, opt)
        seen: list[int] = []
        opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(len(sd["state"])))
        before = {k: v.data_ptr() for k, v in _opt_state(opt).items()}
        ck.load_latest(into={"model": model, "optim": opt})
    after = _opt_state(opt)
    assert seen == [len(opt.state)] and all(torch.equal(after[k], saved[k]) for k in saved)
    assert all(after[k].data_ptr() != before[k] for k in before if after[k].numel()), "a hook's optimizer got refilled"
