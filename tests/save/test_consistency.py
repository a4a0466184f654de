"""A checkpoint is the state at the moment save_async was called, even though it returns early."""

from __future__ import annotations

import torch

import nebula_ckpt as nc
from conftest import make_training, train_step


def test_optimizer_step_right_after_save_async(root: str, ops_path: str) -> None:
    """optimizer.step() waits for the snapshot (step pre-hook): the checkpoint holds the old values."""
    model, opt, sched = make_training()
    # A larger model so the copy is still running when step() is called.
    big = torch.nn.Linear(1024, 1024)
    opt_big = torch.optim.SGD(big.parameters(), lr=1.0)
    train_step(model, opt, sched, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_big = {k: v.clone() for k, v in big.state_dict().items()}
    before_opt = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    with nc.Checkpointer(root) as ck:
        h = ck.save_async(1, {"model": model, "optim": opt, "big": big, "opt_big": opt_big})
        # mutate everything immediately, through the normal training path
        train_step(model, opt, sched, 1)
        big(torch.randn(2, 1024)).sum().backward()
        opt_big.step()
        h.result()
        _, back = ck.read(1)
    for k, v in before.items():
        assert torch.equal(back["model"][k], v), k
    for k, v in before_big.items():
        assert torch.equal(back["big"][k], v), k
    for k, s in before_opt.items():
        for n, t in s.items():
            assert torch.equal(back["optim"]["state"][k][n], t), (k, n)
    assert not torch.equal(big.weight, before_big["weight"])  # the step did happen afterwards


def test_wait_snapshot_then_mutate_raw_tensors(root: str, ops_path: str) -> None:
    tensors = {f"t{i}": torch.randn(256, 256) for i in range(16)}
    ref = {k: v.clone() for k, v in tensors.items()}
    with nc.Checkpointer(root) as ck:
        h = ck.save_async(1, tensors)
        h.wait_snapshot()
        for v in tensors.values():
            v.add_(1.0)
        h.result()
        _, back = ck.read(1)
    for k, v in ref.items():
        assert torch.equal(back[k], v)


def test_mutation_without_waiting_is_never_saved_torn(root: str, ops_path: str) -> None:
    """Breaking the rule is detected: the save holds the old values or fails with ConsistencyError."""
    outcomes = set()
    for trial in range(5):
        tensors = {f"t{i}": torch.full((512, 512), float(i)) for i in range(24)}
        with nc.Checkpointer(root + f"-{trial}") as ck:
            h = ck.save_async(1, tensors)
            for v in tensors.values():
                v.add_(100.0)  # no wait_snapshot(): against the documented rule
            try:
                h.result()
            except nc.ConsistencyError as e:
                assert "changed in place" in str(e) and "'t" in str(e)
                assert ck.list() == []
                outcomes.add("rejected")
                continue
            _, back = ck.read(1)
            for i in range(24):
                assert torch.all(back[f"t{i}"] == float(i)), "torn checkpoint"
            outcomes.add("clean")
    assert outcomes  # at least one trial ran to a verdict


def test_forward_of_module_with_buffers_waits(root: str, ops_path: str) -> None:
    """BatchNorm running stats change in forward(): the forward pre-hook waits for the snapshot."""
    model, opt, sched = make_training()
    model.train()
    before = model.bn.running_mean.clone()
    with nc.Checkpointer(root) as ck:
        h = ck.save_async(1, {"model": model})
        model(torch.randint(0, 32, (8,)))
        h.result()
        _, back = ck.read(1)
    assert torch.equal(back["model"]["bn.running_mean"], before)
    assert not torch.equal(model.bn.running_mean, before)
