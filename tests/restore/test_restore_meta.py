"""A restore into a tensor on the meta device is refused before anything changes, and says the fix.

A meta tensor has no data: copying into it is a no-op. A restore into one (a tensor of ``into``,
the parameters of a model built under ``with torch.device("meta")``, an optimizer over such
parameters or holding state on it) used to restore nothing there, torch's "copying ... to a meta
parameter is a no-op" warning aside, and ``load_latest`` returned the step as if it had. Now the
restore in place and the resharded one refuse it, strict or not, with a
:class:`~nebula_ckpt.errors.ValidationError` naming the key and the fix (materialise it first, or
take fresh tensors with ``ck.read()``), before anything in ``into`` changes. A model materialised
with ``to_empty`` restores.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.restore.open import read_manifest
from nebula_ckpt.restore.reshard import load_resharded
from nebula_ckpt.storage.local import LocalStorage
from restore.test_restore_mismatch import _adam, _model, _step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return _model(1)


def _running_adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = _adam(model.parameters())
    _step(model, opt)
    return opt


def _leaf() -> dict[str, Any]:
    model = _model(1)
    return {"model": model, "optim": _running_adam(model), "t": torch.empty(3, device="meta")}


def _meta_built_model() -> dict[str, Any]:
    return {"model": _meta_model(), "optim": _running_adam(_model(2)), "t": torch.zeros(3)}


def _partly_meta_model() -> dict[str, Any]:
    model = _model(1)
    with torch.device("meta"):
        model[1] = torch.nn.Linear(8, 2)  # a submodule left on the meta device
    return {"model": model, "optim": _running_adam(_model(2)), "t": torch.zeros(3)}


def _optimizer_over_meta_parameters() -> dict[str, Any]:
    return {"model": _model(1), "optim": _adam(_meta_model().parameters()), "t": torch.zeros(3)}


def _optimizer_state_on_meta() -> dict[str, Any]:
    model = _model(1)
    opt = _running_adam(model)
    first = opt.param_groups[0]["params"][0]
    opt.state[first]["exp_avg"] = torch.empty_like(opt.state[first]["exp_avg"], device="meta")
    return {"model": model, "optim": opt, "t": torch.zeros(3)}


#: (case, `into` with something on the meta device, the key the error names)
CASES: list[tuple[str, Callable[[], dict[str, Any]], str]] = [
    ("tensor-leaf", _leaf, "'t'"),
    ("meta-built-model", _meta_built_model, "'model/0.weight'"),
    ("partly-meta-model", _partly_meta_model, "'model/1.weight'"),
    ("optimizer-over-meta-parameters", _optimizer_over_meta_parameters, "'optim'"),
    ("optimizer-state-on-meta", _optimizer_state_on_meta, "'optim/state/0/exp_avg'"),
]


def _save(root: str) -> None:
    model = _model(0)
    opt = _running_adam(model)
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"model": model, "optim": opt, "t": torch.ones(3)})


def _snapshot(into: dict[str, Any]) -> list[Any]:
    """Everything a restore could change in ``into``: each tensor (its device, its values unless
    on the meta device, the very tensor), the optimizer's state and groups."""
    def of(t: torch.Tensor) -> Any:
        return (t.device.type, None if t.is_meta else t.clone(), id(t))
    opt = into["optim"]
    return [[of(t) for t in into["model"].state_dict(keep_vars=True).values()], of(into["t"]), repr(opt.param_groups),
            [{k: of(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in opt.state.values()]]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _in_place(memory_tier: bool) -> Callable[[str, dict[str, Any], bool], Any]:
    def run(root: str, into: dict[str, Any], strict: bool) -> Any:
        with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
            return ck.load_latest(into=into, strict=strict)
    return run


def _resharded(root: str, into: dict[str, Any], strict: bool) -> Any:
    st = LocalStorage(root)
    load_resharded(st, 1, read_manifest(st, 1), into, strict=strict)


RESTORES = {"in-place": _in_place(False), "in-place-memory-tier": _in_place(True), "resharded": _resharded}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("how", list(RESTORES))
@pytest.mark.parametrize("what,make,key", CASES, ids=[c[0] for c in CASES])
def test_a_meta_destination_is_refused_before_anything_changes(root: str, what: str,
                                                               make: Callable[[], dict[str, Any]], key: str,
                                                               how: str, strict: bool) -> None:
    _save(root)
    into = make()
    before = _snapshot(into)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(nc.ValidationError) as e:
        warnings.simplefilter("always")
        RESTORES[how](root, into, strict)
    msg = str(e.value)
    assert key in msg and "meta device" in msg, msg
    assert "to_empty" in msg and "ck.read()" in msg, msg
    assert _same(before, _snapshot(into)), "the refused restore changed `into`"
    assert not [w for w in seen if "meta parameter" in str(w.message)], "torch was asked to copy into meta"


def test_a_meta_built_model_materialised_first_restores(root: str) -> None:
    _save(root)
    model = _meta_model()
    model.to_empty(device="cpu")  # the fix the error gives, then the optimizer over its new parameters
    into = {"model": model, "optim": _adam(model.parameters()), "t": torch.empty(3)}
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into=into) == 1
    saved = _model(0)
    _running_adam(saved)  # as _save made it
    for a, b in zip(model.state_dict().values(), saved.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(into["t"], torch.ones(3)) and len(into["optim"].state) == 4
