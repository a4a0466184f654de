"""Plain dicts of live tensors, what frameworks hand over (issue #13): nothing can be hooked, so the
save is taken synchronously whatever ``snapshot`` says, and changes made right after save_async
returns never reach the checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.save import pipeline
from nebula_ckpt.save.plan import make_plan


def _framework_state() -> dict[str, object]:
    """Lightning-style checkpoint dict: state dicts (live tensors), not the objects."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])   # 8 MiB of weights
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 1}


def _tensors(state: dict[str, object]) -> dict[str, torch.Tensor]:
    sd, (osd,) = state["state_dict"], state["optimizer_states"]
    out = {f"model/{k}": v for k, v in sd.items()}  # type: ignore[attr-defined]
    out.update({f"opt/{i}/{n}": t for i, s in osd["state"].items() for n, t in s.items()})  # type: ignore[index]
    return out


@pytest.mark.parametrize("snapshot", ["auto", "async"])
@pytest.mark.parametrize("how", ["in_place", "data", "numpy"])
def test_plain_dict_changes_after_save_async_never_reach_the_checkpoint(root: str, snapshot: str, how: str) -> None:
    state = _framework_state()
    live = _tensors(state)
    ref = {k: t.clone() for k, t in live.items()}
    with nc.Checkpointer(root, snapshot=snapshot) as ck:
        h = ck.save_async(1, state)
        for t in reversed(live.values()):          # at once, last-copied tensors first
            if how == "in_place":
                with torch.no_grad():
                    t.add_(1)
            elif how == "data":
                t.data.add_(1)
            else:
                t.detach().numpy()[...] += 1
        assert h.result()                          # never a ConsistencyError: the copy was done
        _, back = ck.read(1)
    saved = _tensors(back)
    assert saved.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(saved[k], v), k


def test_which_tensors_count_as_guarded() -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)

    class Custom:
        def __init__(self) -> None:
            self.t = torch.ones(2)

        def state_dict(self) -> dict[str, torch.Tensor]:
            return {"t": self.t}

    plan = make_plan(1, {"model": model, "optim": opt, "sched": sched, "sd": model.state_dict(),
                         "loose": torch.zeros(3), "custom": Custom(), "nested": {"t": torch.ones(1)}})
    keys = [e.key for e in plan.layout.entries]
    assert sorted(keys[i] for i in plan.unguarded) == ["custom/t", "loose", "nested/t"]  # sd ties to model's
    assert plan.optimizers == [opt] and plan.modules_with_buffers == []


def test_small_unguarded_tensors_are_copied_and_the_rest_overlaps(root: str) -> None:
    """An RNG state beside a model and optimizer: copied on the spot; the save stays asynchronous."""
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])   # 32 MiB: copied after
    opt = torch.optim.SGD(model.parameters(), lr=1.0)                                # save_async returns
    rng = torch.get_rng_state()
    before = rng.clone()
    with nc.Checkpointer(root, snapshot="async") as ck:
        h = ck.save_async(1, {"model": model, "optim": opt, "rng": rng})
        assert len(opt._optimizer_step_pre_hooks) == 1           # asynchronous: step() is hooked
        rng.numpy()[:] = 0                                        # no version counter sees this
        h.result()
        _, back = ck.read(1)
    assert torch.equal(back["rng"], before)


def test_large_unguarded_state_is_synchronous_and_says_so(root: str, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    big = torch.zeros(pipeline.SMALL_UNGUARDED_BYTES // 4 + 1)
    with caplog.at_level(logging.INFO, logger="nebula_ckpt"):
        with nc.Checkpointer(root, snapshot="async") as ck:
            h = ck.save_async(1, {"model": model, "optim": opt, "ema": {"big": big}})
            assert ck._saves.inflight == [] and len(opt._optimizer_step_pre_hooks) == 0   # taken synchronously
            big.numpy()[:] = 1
            h.result()
            ck.save(2, {"model": model, "optim": opt, "ema": {"big": big}})
            _, back = ck.read(1)
    assert not back["ema"]["big"].any()
    told = [r for r in caplog.records if "no hook" in r.getMessage()]
    assert len(told) == 1 and "'ema/big'" in told[0].getMessage()    # once per checkpointer


def test_small_unguarded_bytes_is_the_bound(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound on unguarded tensors copied on the spot is ``SMALL_UNGUARDED_BYTES``:
    set below the RNG state's size, the same save that overlaps by default is taken synchronously."""
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    rng = torch.get_rng_state()
    monkeypatch.setattr(pipeline, "SMALL_UNGUARDED_BYTES", rng.numel() - 1)
    with nc.Checkpointer(root, snapshot="async") as ck:
        h = ck.save_async(1, {"model": model, "optim": opt, "rng": rng})
        assert ck._saves.inflight == [] and len(opt._optimizer_step_pre_hooks) == 0   # synchronous
        h.result()
    monkeypatch.setattr(pipeline, "SMALL_UNGUARDED_BYTES", rng.numel())
    with nc.Checkpointer(root, snapshot="async") as ck:
        h = ck.save_async(2, {"model": model, "optim": opt, "rng": rng})
        assert len(opt._optimizer_step_pre_hooks) == 1                                # overlapped
        h.result()
