"""The plan cache never reuses a stale plan.

Every case builds a state, plans it once (the cache records its structure), changes it the way a
training script, a framework or an attacker would, and plans it again. The oracle is a plan made
from scratch of the changed state (:func:`make_plan`): the cached plan must equal it in every
part a save uses (layout, tree, tied keys, devices, the objects hooked, which tensors are
unguarded) and its sources must be the very memory the fresh plan copies (same data pointer,
dtype, shape, strides, offset and conj/neg bits), so a plan that kept an old tensor, an old
layout or an old leaf fails here. :func:`test_the_oracle_catches_a_stale_plan` shows that every
case that changes the structure or the memory would fail with a cache that does not check.
The end-to-end cases save through a real :class:`Checkpointer`, read the checkpoint back and
compare every byte with the state at the save.
"""

from __future__ import annotations

import collections
import copy
import inspect
import math
import sys
from typing import Any, Callable

import numpy as np
import pytest
import torch

import nebula_ckpt as nc
from conftest import make_training, train_step
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.native import native_available
from nebula_ckpt.save.plan import Plan, make_plan
from nebula_ckpt.save.plan_cache import PlanCache
from nebula_ckpt.tiers import LocalTier

pytestmark = pytest.mark.skipif(not native_available(), reason="the plan cache runs on the native path")


# --------------------------------------------------------------------------- states and changes

def _trained() -> dict[str, Any]:
    model, opt, sched = make_training()
    train_step(model, opt, sched, 0)
    return {"model": model, "optim": opt, "sched": sched, "step": 1}


def _flat() -> dict[str, Any]:
    base = torch.arange(32, dtype=torch.float32)
    return {"a": torch.arange(8.0), "b": torch.ones(3, 4).t(), "v": base[2:6], "base": base,
            "c": torch.randn(3, dtype=torch.complex64), "i": 1, "f": 0.5, "s": "x", "t": True, "n": None,
            "dt": torch.float32, "l": [1, 2.0, "three"], "sz": torch.Size([2, 3]), "np": np.arange(4)}


class Extra(torch.nn.Module):
    """A module with extra state (saved through get_extra_state, which the cache calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.calls = 0

    def get_extra_state(self) -> Any:
        return {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


class Twin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)


def _with_module(cls: Callable[[], torch.nn.Module]) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        m = cls()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        sum(p.sum() for p in m.parameters()).backward()
        opt.step()
        return {"model": m, "optim": opt}
    return build


def _no_grad(f: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def g(s: dict[str, Any]) -> None:
        with torch.no_grad():
            f(s)
    return g


def _first_param(s: dict[str, Any]) -> torch.nn.Parameter:
    return s["optim"].param_groups[0]["params"][0]


class _Sub(torch.nn.Sequential):
    pass


def _reparent(s: dict[str, Any]) -> None:
    # the model's class becomes one that overrides state_dict()
    cls = type("Overrides", (type(s["model"]),), {"state_dict": lambda self, *a, **k: {"only": torch.ones(2)}})
    s["model"].__class__ = cls


def _own_classes() -> dict[str, Any]:
    """A model and an optimizer of classes made for this state alone (the cases change them)."""
    lin = type("OwnLinear", (torch.nn.Linear,), {})(4, 4)
    model = type("OwnModel", (torch.nn.Module,), {})()
    model.lin = lin
    opt = type("OwnSGD", (torch.optim.SGD,), {})(model.parameters(), lr=0.1, momentum=0.9)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    return {"model": model, "optim": opt}


def _class_attr(which: str, name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(s: dict[str, Any]) -> None:
        setattr(type(s[which] if which != "lin" else s["model"].lin), name, value)
    return change


def _conj_pair() -> dict[str, Any]:
    x = torch.randn(3, dtype=torch.complex64)
    return {"a": x, "b": x.conj()}


def _strided_pair() -> dict[str, Any]:
    base = torch.arange(8.0)
    return {"a": base[0:4], "b": base.as_strided((4,), (2,), 0)}


def _hide_bias(self: Any, name: str) -> Any:
    v = object.__getattribute__(self, name)
    return {k: p for k, p in v.items() if k != "bias"} if name == "_parameters" else v


def _two_buffers() -> dict[str, Any]:
    """A module with one non-persistent buffer ("a") and one persistent ("b")."""
    m = torch.nn.Module()
    m.register_buffer("a", torch.ones(2), persistent=False)
    m.register_buffer("b", torch.zeros(3))
    return {"model": m}


def _swap_persistence(s: dict[str, Any]) -> None:
    # the set keeps its size and _buffers is untouched: only the set's contents tell
    s["model"]._non_persistent_buffers_set.discard("a")
    s["model"]._non_persistent_buffers_set.add("b")


def _readd(d: dict[str, Any], key: str, new_key: str) -> None:
    d[new_key] = d.pop(key)


def _hook(m: Any, sd: Any, prefix: str, meta: Any) -> None:
    sd[prefix + "hooked"] = torch.full((2,), 7.0)


def _opt_hook(opt: Any, sd: Any) -> None:
    sd["param_groups"][0]["extra"] = 1


#: name -> (state builder, change, whether a plan kept from before the change would be wrong)
CASES: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], bool]] = {
    "nothing": (_trained, lambda s: None, False),
    "a training step": (_trained, lambda s: train_step(s["model"], s["optim"], s["sched"], 1), False),
    "p.data = same shape": (_trained, lambda s: setattr(s["model"].lin.weight, "data",
                                                         torch.randn(16, 16)), True),
    "p.data = other shape": (_trained, lambda s: setattr(s["model"].lin.weight, "data", torch.randn(16, 8)), True),
    "p.data = other dtype": (_trained, lambda s: setattr(s["model"].lin.weight, "data",
                                                         s["model"].lin.weight.data.double()), True),
    "p.data = a view at another offset": (_trained, lambda s: setattr(s["model"].lin.bias, "data",
                                                                      torch.arange(40.0)[8:24]), True),
    "parameter replaced": (_trained, lambda s: setattr(s["model"].lin, "weight",
                                                       torch.nn.Parameter(torch.randn(16, 16))), True),
    "load_state_dict(assign=True)": (_trained, lambda s: s["model"].load_state_dict(
        {k: v.clone() + 1 for k, v in s["model"].state_dict().items()}, assign=True), True),
    "load_state_dict copies in place": (_trained, lambda s: s["model"].load_state_dict(
        {k: v.clone() + 1 for k, v in s["model"].state_dict().items()}), False),
    "buffer moved to the meta device": (_trained, lambda s: setattr(s["model"].bn, "running_mean",
                                                                    s["model"].bn.running_mean.to("meta")), True),
    "tensor moved to the meta device": (_flat, lambda s: s.update(a=s["a"].to("meta")), True),
    "tied weights untied": (_trained, lambda s: setattr(
        s["model"].head, "weight", torch.nn.Parameter(s["model"].emb.weight.detach().clone())), True),
    "weights tied": (_with_module(Twin), lambda s: setattr(s["model"].b, "weight", s["model"].a.weight), True),
    "optimizer state created": (lambda: (lambda m, o, sc: {"model": m, "optim": o})(*make_training()),
                                lambda s: train_step(s["model"], s["optim"], torch.optim.lr_scheduler.StepLR(
                                    s["optim"], 3), 0), True),
    "optimizer state resized": (_trained, lambda s: s["optim"].state[_first_param(s)].update(
        exp_avg=torch.zeros(5)), True),
    "optimizer state replaced": (_trained, lambda s: s["optim"].state[_first_param(s)].update(
        exp_avg=torch.randn_like(_first_param(s))), True),
    "optimizer state entry added": (_trained, lambda s: s["optim"].state[_first_param(s)].update(
        extra=torch.ones(1)), True),
    "optimizer step became a float": (_trained, lambda s: s["optim"].state[_first_param(s)].update(step=3.0), True),
    "new param group": (_trained, lambda s: s["optim"].add_param_group(
        {"params": [torch.nn.Parameter(torch.ones(3))]}), True),
    "param group reordered": (_trained, lambda s: s["optim"].param_groups[0]["params"].reverse(), True),
    "param group hyper-parameters": (_trained, lambda s: s["optim"].param_groups[0].update(
        lr=0.5, betas=(0.8, 0.9), weight_decay=-0.0), True),
    "optimizer replaced": (_trained, lambda s: s.update(optim=torch.optim.AdamW(s["model"].parameters())), True),
    "model replaced by a copy": (_trained, lambda s: s.update(model=copy.deepcopy(s["model"])), True),
    "buffer made non-persistent": (_trained, lambda s: s["model"].bn._non_persistent_buffers_set.add(
        "running_mean"), True),
    "buffer set to None": (_trained, lambda s: s["model"].bn.register_buffer("running_var", None), True),
    "buffer added": (_trained, lambda s: s["model"].lin.register_buffer("extra", torch.ones(3)), True),
    "non-persistent buffers swapped": (_two_buffers, _swap_persistence, True),
    "buffer made persistent": (_two_buffers, lambda s: s["model"]._non_persistent_buffers_set.discard("a"), True),
    "parameter assigned in _parameters": (_trained, lambda s: s["model"].lin._parameters.__setitem__(
        "weight", torch.nn.Parameter(torch.randn(16, 16))), True),
    "parameter removed and added again": (_trained, lambda s: _readd(s["model"].lin._parameters, "weight", "weight"),
                                          True),
    "parameter renamed": (_trained, lambda s: _readd(s["model"].lin._parameters, "bias", "bias2"), True),
    "buffer removed and added again": (_trained, lambda s: _readd(s["model"].bn._buffers, "running_mean",
                                                                  "running_mean"), True),
    "submodule removed and added again": (_trained, lambda s: _readd(s["model"]._modules, "emb", "emb"), True),
    "eval()": (_trained, lambda s: s["model"].eval(), False),
    "submodule added": (_trained, lambda s: setattr(s["model"], "extra", torch.nn.Linear(2, 2)), True),
    "submodule replaced": (_trained, lambda s: setattr(s["model"], "lin", torch.nn.Linear(16, 16)), True),
    "submodule set to None": (_trained, lambda s: setattr(s["model"], "bn", None), True),
    "state_dict hook registered": (_trained, lambda s: s["model"].register_state_dict_post_hook(_hook), True),
    "optimizer state_dict hook": (_trained, lambda s: s["optim"].register_state_dict_post_hook(_opt_hook), True),
    "instance overrides state_dict": (_trained, lambda s: setattr(s["model"], "state_dict",
                                                                  lambda *a, **k: {"only": torch.ones(2)}), True),
    "class overrides state_dict": (_trained, _reparent, True),
    "its class gains state_dict": (_own_classes, _class_attr("model", "state_dict",
                                                             lambda self, *a, **k: {"only": torch.ones(2)}), True),
    "a submodule's class gains _save_to_state_dict": (_own_classes, _class_attr(
        "lin", "_save_to_state_dict", lambda self, d, prefix, keep: d.update({prefix + "x": torch.ones(1)})), True),
    "a submodule's class gains get_extra_state": (_own_classes, _class_attr("lin", "get_extra_state",
                                                                            lambda self: {"extra": 1}), True),
    "its class gains __getattribute__": (_own_classes, _class_attr("lin", "__getattribute__", _hide_bias), True),
    "the optimizer's class gains state_dict": (_own_classes, _class_attr(
        "optim", "state_dict", lambda self: {"state": {}, "param_groups": []}), True),
    "parametrized": (_trained, lambda s: torch.nn.utils.parametrize.register_parametrization(
        s["model"].lin, "weight", torch.nn.Identity()), True),
    "extra state changes": (_with_module(Extra), lambda s: setattr(s["model"], "calls", 5), True),
    "scheduler steps": (_trained, lambda s: [s["sched"].step() for _ in range(4)], True),
    "leaves change value and type": (_flat, lambda s: s.update(
        i=True, f=-0.0, s="y", t=1, n=0, dt=torch.int8, l=[1, 2.0, "four"]), True),
    "int becomes a float": (_flat, lambda s: s.update(i=1.0), True),
    "nan stays nan": (lambda: {"f": math.nan, "x": torch.ones(2)}, lambda s: s.update(f=-math.nan), False),
    "leaf becomes a tensor": (_flat, lambda s: s.update(i=torch.ones(2)), True),
    "leaf becomes a dict": (_flat, lambda s: s.update(i={"x": 1}), True),
    "leaf becomes an array": (_flat, lambda s: s.update(i=np.ones(2)), True),
    "leaf becomes a module": (_flat, lambda s: s.update(i=torch.nn.Linear(1, 1)), True),
    "list becomes a tuple": (_flat, lambda s: s.update(l=tuple(s["l"])), True),
    "list grows": (_flat, lambda s: s["l"].append(4), True),
    "keys reordered": (_flat, lambda s: [s.update({k: s.pop(k)}) for k in list(s)[:3]], True),
    "key added": (_flat, lambda s: s.update(new=torch.zeros(1)), True),
    "key removed": (_flat, lambda s: s.pop("b"), True),
    "int key and str key": (lambda: {1: torch.ones(1), "x": 2}, lambda s: s.update({"1": s.pop(1)}), True),
    "OrderedDict reordered": (lambda: {"od": collections.OrderedDict(a=torch.ones(1), b=torch.zeros(2))},
                              lambda s: s["od"].move_to_end("a"), True),
    "dict becomes an OrderedDict": (lambda: {"d": {"a": torch.ones(1)}},
                                    lambda s: s.update(d=collections.OrderedDict(s["d"])), True),
    "torch.Size changes": (_flat, lambda s: s.update(sz=torch.Size([3, 2])), True),
    "array written in place": (_flat, lambda s: s["np"].__setitem__(0, 9), True),
    "array dtype": (_flat, lambda s: s.update(np=s["np"].astype(np.float32)), True),
    "array shape": (_flat, lambda s: s.update(np=np.arange(5)), True),
    "resize_ smaller": (_flat, lambda s: s["a"].resize_(4), True),
    "resize_ larger (new memory)": (_flat, lambda s: s["a"].resize_(64), True),
    "set_ to another storage": (_flat, lambda s: s["a"].set_(torch.arange(8.0) + 100), True),
    "set_ at another offset": (_flat, lambda s: s["v"].set_(s["base"].untyped_storage(), 4, (4,), (1,)), True),
    "set_ to other strides": (_flat, lambda s: s["v"].set_(s["base"].untyped_storage(), 2, (4,), (2,)), True),
    "view reassigned": (_flat, lambda s: s.update(v=s["base"][5:9]), True),
    "two tensors become one view": (lambda: {"v": torch.arange(8.0)[2:6], "w": torch.arange(8.0)[0:4]},
                                    lambda s: s["v"].set_(s["w"].untyped_storage(), 0, (4,), (1,)), True),
    "a key now ties another": (_flat, lambda s: s.update(b2=s["b"]), True),
    "conj bit": (_flat, lambda s: s.update(c=s["c"].conj()), True),
    "a conjugate view becomes its base": (_conj_pair, lambda s: s.update(b=s["a"]), True),
    "a key becomes a conjugate view": (_conj_pair, lambda s: s.update(a=s["b"]), True),
    "strides change makes two views one": (_strided_pair, lambda s: s["b"].set_(
        s["a"].untyped_storage(), 0, (4,), (1,)), True),
    "made contiguous": (_flat, lambda s: s.update(b=s["b"].contiguous()), True),
    "fresh state_dict() each save": (lambda: {"sd": Twin().state_dict()}, lambda s: None, False),
}


# --------------------------------------------------------------------------- the oracle

def _ndarray_keys(node: Any, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        if node.get("t") == "ndarray":
            out.add(node["v"]["k"])
        for v in node.values():
            _ndarray_keys(v, out)
    elif isinstance(node, list):
        for v in node:
            _ndarray_keys(v, out)
    return out


def _view(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr() if t.numel() else 0, t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device,
            t.is_conj(), t.is_neg())


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same_plan(got: Plan, want: Plan, fresh: set[str]) -> None:
    """``got`` is what a save of the state would use now: equal to a fresh plan in every part
    (``fresh``: keys whose tensor is made anew at each plan, compared by value)."""
    assert got.layout == want.layout
    assert got.tree == want.tree
    assert got.aliases == want.aliases
    assert got.devices == want.devices
    assert got.unguarded == want.unguarded
    assert got.dtensors == want.dtensors
    assert [id(o) for o in got.optimizers] == [id(o) for o in want.optimizers]
    assert [id(m) for m in got.modules_with_buffers] == [id(m) for m in want.modules_with_buffers]
    copies = _ndarray_keys(want.tree, set()) | fresh
    gs, ws = got.sources.tensors(), want.sources.tensors()
    assert len(gs) == len(ws) == len(want.layout.entries)
    for e, g, w in zip(want.layout.entries, gs, ws, strict=True):
        if e.key in copies:  # a NumPy array (a copy taken at each plan), or made at each plan
            assert (g.dtype, g.shape) == (w.dtype, w.shape) and _bytes(g) == _bytes(w), e.key
        else:
            assert _view(g) == _view(w), e.key
    assert got.sources.changed() == want.sources.changed() == []


def _plan_or_error(f: Callable[[], Plan]) -> Any:
    try:
        return f()
    except ValidationError as e:
        return e


def _check(cache: PlanCache, step: int, state: Any) -> None:
    got = _plan_or_error(lambda: cache.plan(step, state))
    want = _plan_or_error(lambda: make_plan(step, state))
    if isinstance(want, ValidationError):
        assert isinstance(got, ValidationError) and str(got) == str(want)
    else:
        assert not isinstance(got, ValidationError), got
        # tensors an object's state_dict() makes at each call (a hook's, get_extra_state's) are new
        # memory at every plan: their bytes are compared; every other one must be the same memory
        again = make_plan(step, state)
        fresh = {e.key for e, a, b in zip(want.layout.entries, want.sources.tensors(), again.sources.tensors(),
                                          strict=True) if a.numel() and a.data_ptr() != b.data_ptr()}
        assert_same_plan(got, want, fresh)


@pytest.mark.parametrize("name", list(CASES))
def test_a_reused_plan_is_the_plan_made_afresh(name: str) -> None:
    build, change, _ = CASES[name]
    state = build()
    cache = PlanCache(allow_pickle=False)
    _check(cache, 0, state)  # recorded
    change(state)
    _check(cache, 1, state)  # after the change: reused or planned again, equal to a fresh plan
    _check(cache, 2, state)  # and once more (the changed leaves now the recorded ones)


@pytest.mark.parametrize("name", list(CASES))
def test_a_change_after_a_reuse_is_seen(name: str) -> None:
    """A reuse remembers what it found unchanged (csrc/plan_guard.cpp, Stamp: dicts unchanged since
    are not read again): a change made after a reuse must be seen as one made before the first."""
    build, change, _ = CASES[name]
    state = build()
    cache = PlanCache(allow_pickle=False)
    _check(cache, 0, state)  # recorded
    _check(cache, 1, state)  # reused: what the check found is remembered
    change(state)
    _check(cache, 2, state)
    _check(cache, 3, state)


class _Unchecked(PlanCache):
    """A cache that reuses its plan without checking anything: what the oracle must catch."""

    def plan(self, step: Any, state: Any, tag: Any = None) -> Plan:
        e = self._entry
        if e is None:
            plan = super().plan(step, state, tag)
            self.first = plan
            return plan
        first = self.first
        return Plan(step=step, layout=first.layout, sources=first.sources, tree=first.tree,
                    aliases=first.aliases, devices=first.devices, optimizers=first.optimizers,
                    modules_with_buffers=first.modules_with_buffers, dtensors=first.dtensors, tag=tag,
                    unguarded=first.unguarded)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2]])
def test_the_oracle_catches_a_stale_plan(name: str) -> None:
    build, change, _ = CASES[name]
    state = build()
    cache = _Unchecked(allow_pickle=False)
    _check(cache, 0, state)
    change(state)
    with pytest.raises(AssertionError):
        _check(cache, 1, state)


def test_the_plan_is_reused_while_the_structure_holds() -> None:
    state = _trained()
    cache = PlanCache(allow_pickle=False)
    for step in range(6):
        train_step(state["model"], state["optim"], state["sched"], step)
        state["step"] = step
        _check(cache, step, state)
    assert cache.hits == 5 and cache.misses == 0, cache.stats()
    state["model"].lin.weight = torch.nn.Parameter(torch.randn(16, 8))
    _check(cache, 6, state)
    assert cache.misses == 1 and "shape" in str(cache.last_miss), cache.stats()


def _state_dict_calls(f: Callable[[], Any]) -> list[str]:
    """The stock ``state_dict()`` functions of modules and optimizers that ``f()`` calls."""
    codes = {torch.nn.Module.state_dict.__code__: "module",
             inspect.unwrap(torch.optim.Optimizer.state_dict).__code__: "optimizer"}
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            seen.append(codes[frame.f_code])
    sys.setprofile(profile)
    try:
        f()
    finally:
        sys.setprofile(None)
    return seen


def test_a_stock_model_and_optimizer_are_not_asked_for_their_state_dict() -> None:
    """The point of the cache: a hit reads the registries, it never calls their state_dict()."""
    state = _trained()
    cache = PlanCache(allow_pickle=False)
    assert "module" in _state_dict_calls(lambda: cache.plan(0, state))  # the first plan walks them
    train_step(state["model"], state["optim"], state["sched"], 1)
    assert _state_dict_calls(lambda: cache.plan(1, state)) == []
    assert cache.hits == 1, cache.stats()


# --------------------------------------------------------------------------- end to end, bytes on disk

def _expected(value: Any) -> Any:
    """What a checkpoint of ``value`` must hold now (tensors cloned, stateful objects' state)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _expected(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_expected(v) for v in value)
    if hasattr(value, "state_dict") and not isinstance(value, type):
        return _expected(value.state_dict())
    return copy.deepcopy(value)


def assert_same_tree(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), where
        assert _bytes(got) == _bytes(want), where
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.tobytes() == want.tobytes(), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same_tree(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_tree(a, b, f"{where}/{i}")
    elif isinstance(want, float):
        assert type(got) is float and (got == want or math.isnan(want) and math.isnan(got)), where
        assert math.copysign(1, got) == math.copysign(1, want), where
    else:
        assert type(got) is type(want) and got == want, where


E2E = ["a conjugate view becomes its base", "a training step", "p.data = same shape",
       "p.data = a view at another offset", "parameter replaced",
       "load_state_dict(assign=True)", "optimizer state replaced", "tied weights untied", "weights tied",
       "p.data = other dtype", "param group hyper-parameters", "scheduler steps", "leaves change value and type",
       "array written in place", "resize_ larger (new memory)", "set_ to another storage", "set_ at another offset",
       "two tensors become one view", "a key now ties another", "conj bit", "extra state changes"]


@pytest.mark.parametrize("name", E2E)
def test_the_checkpoint_holds_the_state_at_the_save(tmp_path: Any, name: str) -> None:
    build, change, _ = CASES[name]
    state = build()
    root = str(tmp_path / "ckpt")
    with nc.Checkpointer(root, tiers=[LocalTier(root)]) as ck:
        ck.save(0, state)
        change(state)
        want = _expected(state)
        ck.save(1, state)
        got = ck.read(1)[1]
    assert_same_tree(got, want)


def test_a_conjugate_view_is_not_tied_to_its_base(tmp_path: Any) -> None:
    """x and x.conj() share memory but not values: each is stored with its own values."""
    x, z = torch.randn(3, dtype=torch.complex64), torch.randn(3, dtype=torch.complex64)
    state = {"a": x, "b": x.conj(), "im": z.imag, "neg": z.conj().imag}  # the last a negative view
    assert state["neg"].is_neg() and state["neg"].data_ptr() == state["im"].data_ptr()
    root = str(tmp_path / "ckpt")
    with nc.Checkpointer(root, tiers=[LocalTier(root)]) as ck:
        ck.save(0, state)
        got = ck.read(0)[1]
    assert_same_tree(got, _expected(state))


def test_a_tensor_whose_storage_was_resized_under_it_is_not_read(tmp_path: Any) -> None:
    """A storage resized below its tensor (FSDP frees parameters so) would be read past its end."""
    state = {"a": torch.ones(1024), "b": torch.zeros(4)}
    root = str(tmp_path / "ckpt")
    with nc.Checkpointer(root, tiers=[LocalTier(root)]) as ck:
        ck.save(0, state)
        state["a"].untyped_storage().resize_(0)
        with pytest.raises(RuntimeError, match="past the end of its storage"):
            ck.save_async(1, state)
        assert ck.list() == [0]


# --------------------------------------------------------------------------- the first save

def test_prepare_plans_the_state_so_the_first_save_reuses_the_plan(tmp_path: Any) -> None:
    state = _trained()
    root = str(tmp_path / "ckpt")
    with nc.Checkpointer(root, tiers=[LocalTier(root)]) as ck:
        ck.prepare(state, wait=True)
        assert _state_dict_calls(lambda: ck.save(1, state)) == []
        assert ck.stats()["plans"]["hits"] == 1
        got = ck.read(1)[1]
    assert_same_tree(got, _expected(state))


_CPU_PROCESS = """
import sys, torch, nebula_ckpt as nc
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
ck = nc.Checkpointer(sys.argv[1], tiers=[nc.LocalTier(sys.argv[1])])
ck.prepare({"model": model, "optim": opt}, wait=True)
ck.save(1, {"model": model, "optim": opt})
ck.close()
print(torch.cuda.is_initialized())
"""


def test_a_cpu_process_never_has_cuda_initialised_by_the_checkpointer(tmp_path: Any) -> None:
    """The copy path is set up ahead of the first save only in a process that already uses CUDA:
    initialising CUDA in a CPU job would cost it seconds and break a later fork (DataLoader)."""

    import warm_python

    res = warm_python.run([sys.executable, "-c", _CPU_PROCESS, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-1] == "False"
