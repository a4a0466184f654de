"""A PEFT (LoRA) model saved and restored through every integration: the plain Checkpointer,
PyTorch Lightning's NebulaCheckpointIO (the Hugging Face Trainer's run with SIGKILL is in
``test_huggingface_engines.py``). Real ``peft`` on the tiny GPT-2 of ``hf_worker``: the whole
state (frozen base weights too) comes back bit for bit and training goes on identically.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
pytest.importorskip("transformers", reason="transformers is not installed")

import nebula_ckpt as nc  # noqa: E402
from integrations import hf_worker  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(i: int) -> torch.Tensor:
    return hf_worker.TinyData(4, seed=100 + i).ids


def _step(model: Any, opt: torch.optim.Optimizer, i: int) -> float:
    loss = model(input_ids=_batch(i), labels=_batch(i)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def _lora_and_optimizer(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    model = hf_worker.make_peft_model(seed)
    model.eval()  # no dropout: two models step identically
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_plain_checkpointer_saves_and_restores_a_lora_model(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    model, opt = _lora_and_optimizer(0)
    assert any("lora_A" in k for k in model.state_dict())
    for i in range(3):
        _step(model, opt, i)
    with nc.Checkpointer(str(tmp_path / "root")) as ck:
        ck.save(3, {"model": model, "optim": opt})
    other, other_opt = _lora_and_optimizer(1)   # another seed: other adapter weights, no optimizer state
    with nc.Checkpointer(str(tmp_path / "root")) as ck:
        assert ck.load_latest(into={"model": other, "optim": other_opt}) == 3
    _same(model.state_dict(), other.state_dict())    # base (frozen) and adapter weights
    assert other_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    assert _step(other, other_opt, 3) == _step(model, opt, 3)
    _same(model.state_dict(), other.state_dict())


def test_lightning_checkpoint_io_saves_and_restores_a_lora_model(tmp_path, shm_dir: str) -> None:  # noqa: ANN001
    pl = pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed")
    from nebula_ckpt.integrations.lightning import NebulaCheckpointIO

    class Lora(pl.LightningModule):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.net = hf_worker.make_peft_model(seed)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return self.net(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(hf_worker.TinyData(8).ids), batch_size=4)
    io = NebulaCheckpointIO(str(tmp_path / "root"))
    trainer = pl.Trainer(max_steps=3, plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    module = Lora(0)
    trainer.fit(module, data)
    path = str(tmp_path / "lora.ckpt")
    trainer.save_checkpoint(path)
    io.checkpointer.wait()
    ckpt = io.load_checkpoint(path)
    assert os.path.getsize(path) < 4096      # a pointer: the weights are in the tiers
    other = Lora(1)
    other.load_state_dict(ckpt["state_dict"])
    _same(module.state_dict(), other.state_dict())
    assert ckpt["global_step"] == 3 and len(ckpt["optimizer_states"][0]["state"]) == sum(
        p.requires_grad for p in module.parameters())
    io.teardown()
