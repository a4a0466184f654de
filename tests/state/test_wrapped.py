"""Wrapped optimizers (accelerate, Lightning, DeepSpeed) are hooked on the torch optimizer they wrap
and saved through the wrapper's own state_dict(); a save_async that raises leaves nothing in flight
(issue #13)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.save import snapshot as snapshot_mod
from nebula_ckpt.save.pipeline import SavePipeline
from nebula_ckpt.save.plan import inner_optimizer, make_plan


class AcceleratedLike(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer by isinstance, without PyTorch's hook
    machinery (no super().__init__), the real optimizer in ``.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__ on purpose
        self.optimizer = optimizer

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.optimizer.step(closure)


class ZeroLike:
    """Like DeepSpeed's optimizer wrappers: not an Optimizer, ``.optimizer`` inside, a state_dict of
    its own that holds the inner one and values of its own."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.loss_scale = 1024.0

    def state_dict(self) -> dict[str, Any]:
        return {"base_optimizer_state": self.optimizer.state_dict(), "loss_scale": self.loss_scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd["base_optimizer_state"])
        self.loss_scale = sd["loss_scale"]

    def step(self) -> None:
        self.optimizer.step()


class LightningLike:
    """Like Lightning's LightningOptimizer: the wrapped optimizer in ``._optimizer``."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(sd)

    def step(self) -> None:
        self._optimizer.step()


def _train(model: torch.nn.Module, step: Callable[[], None], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 256, generator=g)).sum().backward()
    step()


def _hooks(opt: torch.optim.Optimizer) -> int:
    return len(opt._optimizer_step_pre_hooks)


WRAPS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "accelerate-like": AcceleratedLike,
    "deepspeed-like": ZeroLike,
    "lightning-like": LightningLike,
    "nested": lambda o: LightningLike(ZeroLike(AcceleratedLike(o))),
}


@pytest.mark.parametrize("kind", list(WRAPS))
def test_wrapped_optimizer_is_hooked_on_the_inner_one(root: str, kind: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    wrapper = WRAPS[kind](inner)
    assert inner_optimizer(wrapper) is inner
    _train(model, wrapper.step, 1)
    before_w = model.weight.detach().clone()
    ref = {k: v.clone() for k, v in inner.state_dict()["state"][0].items()}
    with nc.Checkpointer(root, snapshot="async") as ck:
        h = ck.save_async(1, {"model": model, "optim": wrapper})
        assert _hooks(inner) == 1             # asynchronous: the inner optimizer's step is hooked
        _train(model, wrapper.step, 2)        # at once: inner.step() waits for the copy
        h.result()
        _, back = ck.read(1)
    assert torch.equal(back["model"]["weight"], before_w)
    assert not torch.equal(model.weight, before_w)
    saved_opt = back["optim"]
    if kind == "deepspeed-like":              # the wrapper's own state_dict, as the user passed it
        assert saved_opt["loss_scale"] == 1024.0
        saved_opt = saved_opt["base_optimizer_state"]
    if kind == "nested":
        saved_opt = saved_opt["base_optimizer_state"]
    for k, v in ref.items():
        assert torch.equal(saved_opt["state"][0][k], v), k
    # and it restores through the wrapper
    fresh = torch.nn.Linear(256, 256)
    fresh_opt = WRAPS[kind](torch.optim.AdamW(fresh.parameters(), lr=0.1))
    with nc.Checkpointer(root) as ck:
        ck.load_latest(into={"model": fresh, "optim": fresh_opt})
    assert torch.equal(fresh.weight, before_w)


def test_inner_optimizer_rules() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert inner_optimizer(opt) is opt
    assert inner_optimizer(sched) is None and inner_optimizer(plateau) is None   # schedulers are no wrappers
    assert inner_optimizer(model) is None and inner_optimizer({"optimizer": opt}) is None

    class Loop:  # a cycle of wrappers ends
        def __init__(self) -> None:
            self.optimizer: Any = self

    assert inner_optimizer(Loop()) is None
    a, b = ZeroLike(None), ZeroLike(None)
    a.optimizer, b.optimizer = b, a
    assert inner_optimizer(a) is None
    no_hooks = AcceleratedLike(None)  # type: ignore[arg-type]
    assert inner_optimizer(no_hooks) is no_hooks   # an Optimizer wrapping nothing: itself (cannot be hooked)

    class Raising:
        @property
        def optimizer(self) -> Any:
            raise RuntimeError("not ready")

        def state_dict(self) -> dict[str, Any]:
            return {}

    assert inner_optimizer(Raising()) is None
    deep: Any = opt
    for _ in range(20):
        deep = ZeroLike(deep)
    assert inner_optimizer(deep) is None            # deeper than any real wrapper chain: not followed
    plan = make_plan(1, {"o": ZeroLike(AcceleratedLike(opt)), "s": sched})
    assert plan.optimizers == [opt]


class Opaque(torch.optim.Optimizer):
    """An Optimizer without hook machinery that keeps what it drives under a private name."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__ on purpose
        self._impl = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self._impl.state_dict()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self._impl.step()


def test_optimizer_without_hooks_inside_makes_the_save_wait(root: str) -> None:
    """The innermost optimizer a wrapper leads to cannot be hooked: the save waits for its copy."""
    model = torch.nn.Linear(256, 256)
    wrapper = ZeroLike(Opaque(torch.optim.SGD(model.parameters(), lr=1.0)))
    assert inner_optimizer(wrapper) is wrapper.optimizer
    _train(model, wrapper.step, 1)
    before = model.weight.detach().clone()
    with nc.Checkpointer(root, snapshot="async") as ck:
        h = ck.save_async(1, {"model": model, "optim": wrapper})
        _train(model, wrapper.step, 2)
        h.result()
        _, back = ck.read(1)
    assert torch.equal(back["model"]["weight"], before)


def test_real_accelerate_optimizer(root: str) -> None:
    accelerate = pytest.importorskip(
        "accelerate", reason="accelerate is not installed (scripts/bootstrap.sh installs accelerate==1.15.0)")
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState, GradientState

    try:
        acc = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
        assert isinstance(opt, AcceleratedOptimizer)
        inner = opt.optimizer
        assert inner_optimizer(opt) is inner
        _train(model, opt.step, 1)
        before = model.weight.detach().clone()
        with nc.Checkpointer(root, snapshot="async") as ck:
            h = ck.save_async(1, {"model": model, "optim": opt})
            assert _hooks(inner) == 1
            _train(model, opt.step, 2)
            h.result()
            _, back = ck.read(1)
        assert torch.equal(back["model"]["weight"], before)
        assert set(back["optim"]) == {"state", "param_groups"}
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


# -- a save_async that raises leaves nothing in flight ----------------------------------------------

def _interrupt_once(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    real = getattr(owner, name)
    calls = {"n": 0}

    def boom(*a: Any, **k: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt("interrupted inside save_async")
        return real(*a, **k)

    monkeypatch.setattr(owner, name, boom)


def _in_thread(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # reported to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung: something of the failed save stayed in flight"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("where", ["confirm", "hooks", "queued"])
def test_save_async_that_raises_leaves_nothing_in_flight(root: str, monkeypatch: pytest.MonkeyPatch,
                                                         where: str) -> None:
    """An interrupt inside ``save_async`` before its snapshot is handed to the stager takes the
    save back (nothing in flight, the slot free); one right after the hand-over (the queueing is
    one C call: nothing can land inside it) lets the save go on, written like an accepted one."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = nc.Checkpointer(root, snapshot="sync" if where == "confirm" else "async", memory_tier=False)
    ck.save(1, {"model": model, "optim": opt})
    if where == "confirm":
        _interrupt_once(monkeypatch, snapshot_mod.Snapshot, "confirm")
    elif where == "hooks":
        _interrupt_once(monkeypatch, SavePipeline, "_install_hooks")
    else:
        stager = ck._saves._stager
        assert stager is not None
        put = stager.submit

        def queued_then_interrupted(snap: Any) -> None:
            put(snap)
            stager.submit = put
            raise KeyboardInterrupt("interrupted right after the hand-over")
        stager.submit = queued_then_interrupted
    with pytest.raises(KeyboardInterrupt):
        ck.save_async(2, {"model": model, "optim": opt})
    _in_thread(ck.wait, 30)
    assert ck._saves.inflight == [] and all(h.done() for h in ck._saves.handles)
    # the one staging slot came back: the next save goes through (on_full="wait" would hang)
    h = _in_thread(lambda: ck.save(3, {"model": model, "optim": opt}))
    assert h.tiers_written
    _in_thread(ck.close, 30)
    with nc.Checkpointer(root, memory_tier=False) as again:
        assert again.list() == ([1, 2, 3] if where == "queued" else [1, 3])
