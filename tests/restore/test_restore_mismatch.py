"""A restore into objects that cannot take the saved state changes nothing, and says so.

An optimizer saved as SGD and restored into an Adam used to get through every check: the model
was loaded, then torch's Adam raised a bare ``KeyError('step')`` from ``load_state_dict``, leaving
Adam holding SGD's state. Now the parameter groups' keys (and, for an optimizer with state, each
parameter's state keys) are compared before anything changes; what is legitimate still restores
(Adam and AdamW take each other's state, a checkpoint of an older torch lacks newer group keys, a
scheduler's ``initial_lr``, a fresh optimizer, an ``amsgrad`` switched). A load that fails all the
same (a custom ``__setstate__``) runs first, optimizers before modules, and is undone: the error
names the key in ``into`` and what holds. And ``strict=False`` on a model whose keys all differ by
a wrapper's prefix (``module.``: DistributedDataParallel) warns instead of restoring nothing
silently; the strict error gives the prefix fix first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.format.names import step_dir
from records_view import flat_manifest, seal


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _saved(root: str, make: Callable[[Any], torch.optim.Optimizer], extra: dict[str, Any] | None = None) -> \
        tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(0)
    opt = make(model.parameters())
    _step(model, opt)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model, "optim": opt, **(extra or {})})
    return model, opt


def _snapshot(model: torch.nn.Module, *opts: torch.optim.Optimizer) -> list[Any]:
    """Everything a restore could change: the model's tensors, each optimizer's state (values and
    the very tensors) and parameter groups."""
    out: list[Any] = [t.clone() for t in model.state_dict().values()]
    for o in opts:
        out.append(repr(o.param_groups))
        out.append({id(p): {k: (v.clone(), v.data_ptr()) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                    for p, s in o.state.items()})
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, tuple):
            return isinstance(y, tuple) and len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y, strict=True))
        return bool(x == y)
    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b, strict=True))


def _sgd(p: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def _adam(p: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(p, lr=1e-2)


def _adamw(p: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(p, lr=1e-2)


def _rmsprop(p: Any) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(p, lr=1e-2)


OTHER_KINDS = [("sgd-into-adam", _sgd, _adam, "momentum"), ("sgd-into-adamw", _sgd, _adamw, "nesterov"),
               ("adam-into-sgd", _adam, _sgd, "betas"), ("rmsprop-into-adam", _rmsprop, _adam, "alpha")]


@pytest.mark.parametrize("running", [False, True], ids=["fresh", "running"])
@pytest.mark.parametrize("what,saved_by,live_by,key", OTHER_KINDS, ids=[k[0] for k in OTHER_KINDS])
def test_an_optimizer_of_another_kind_is_refused_before_anything_changes(
        tmp_path: Path, what: str, saved_by: Callable[[Any], torch.optim.Optimizer],
        live_by: Callable[[Any], torch.optim.Optimizer], key: str, running: bool) -> None:
    root = str(tmp_path / "ck")
    model, opt, before = other_kind(root, saved_by, live_by, running)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.ValidationError) as e:
            ck.load_latest(into={"model": model, "optim": opt})
    assert_other_kind_refused(str(e.value), key, model, opt, before)


def other_kind(root: str, saved_by: Callable[[Any], torch.optim.Optimizer],
               live_by: Callable[[Any], torch.optim.Optimizer], running: bool) -> tuple[torch.nn.Module, Any, Any]:
    """A model and optimizer saved by ``saved_by`` under ``root``, and a live model and ``live_by``
    optimizer (``running``: after a step) to restore them into, with their snapshot."""
    _saved(root, saved_by)
    model, opt = live(live_by, running)
    return model, opt, _snapshot(model, opt)


def live(live_by: Callable[[Any], torch.optim.Optimizer], running: bool) -> tuple[torch.nn.Module, Any]:
    """A live model and its ``live_by`` optimizer (``running``: after a step)."""
    model = _model(1)
    opt = live_by(model.parameters())
    if running:
        _step(model, opt)
    return model, opt


def assert_other_kind_refused(msg: str, key: str, model: torch.nn.Module, opt: Any, before: Any) -> None:
    """The refusal of another optimizer kind names the key, the class and the fix; nothing changed."""
    assert "'optim'" in msg and f"'{key}'" in msg and type(opt).__name__ in msg, msg
    assert "restore into the optimizer class that saved it" in msg, msg
    assert _same(before, _snapshot(model, opt)), "the failed restore changed `into`"


def _older_torch(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` as torch 1.10 wrote it: parameter groups without the keys added since."""
    newer = {"foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay"}
    sd["param_groups"] = [{k: v for k, v in g.items() if k not in newer} for g in sd["param_groups"]]
    return sd


def _restored_equal(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer) -> bool:
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    return got.keys() == want.keys() and all(
        got[i].keys() == want[i].keys() and all(torch.equal(got[i][k], want[i][k]) for k in want[i]) for i in want)


LEGIT = [("adam-into-adamw", _adam, _adamw), ("adamw-into-adam", _adamw, _adam), ("adam-into-adam", _adam, _adam)]


@pytest.mark.parametrize("running", [False, True], ids=["fresh", "running"])
@pytest.mark.parametrize("what,saved_by,live_by", LEGIT, ids=[k[0] for k in LEGIT])
def test_a_state_the_optimizer_can_take_still_restores(tmp_path: Path, what: str,
                                                       saved_by: Callable[[Any], torch.optim.Optimizer],
                                                       live_by: Callable[[Any], torch.optim.Optimizer],
                                                       running: bool) -> None:
    """Adam and AdamW have the same group keys and state in torch 2.x; torch's loading lets either
    take the other's state, and so does the restore (AdamW keeps decoupled weight decay)."""
    root = str(tmp_path / "ck")
    saved_model, saved_opt = _saved(root, saved_by)
    model, opt = live(live_by, running)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into={"model": model, "optim": opt}) == 1
    assert _restored_equal(opt, saved_opt)
    assert all(torch.equal(a, b) for a, b in
               zip(model.state_dict().values(), saved_model.state_dict().values(), strict=True))
    _step(model, opt)  # and it trains on


@pytest.mark.parametrize("running", [False, True], ids=["fresh", "running"])
def test_an_older_torchs_groups_a_schedulers_keys_and_a_switched_amsgrad_restore(tmp_path: Path,
                                                                                 running: bool) -> None:
    """What torch's loading takes is not refused: group keys the saved state lacks (an older
    torch's; torch fills them in), keys a scheduler added (``initial_lr``: the scheduler is built
    again after the restore), and state keys of a setting (``amsgrad`` adds one)."""
    root = str(tmp_path / "ck")
    model0 = _model(0)
    opt0 = torch.optim.Adam(model0.parameters(), lr=1e-2, amsgrad=True)
    torch.optim.lr_scheduler.StepLR(opt0, step_size=1, gamma=0.5)
    _step(model0, opt0)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model0, "optim": _older_torch(opt0.state_dict())})  # a plain dict, as torch.save'd
    model = _model(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # amsgrad=False, and no scheduler yet
    if running:
        _step(model, opt)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        assert ck.load_latest(into={"model": model, "optim": opt}) == 1
    assert _restored_equal(opt, opt0) and opt.param_groups[0]["amsgrad"] is True
    assert opt.param_groups[0]["foreach"] is None and opt.param_groups[0]["initial_lr"] == 1e-2
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5, last_epoch=0)  # needs initial_lr
    _step(model, opt)
    sched.step()


def _rename_state_key(root: Path, old: str, new: str) -> None:
    """Rename the per-parameter state key ``old`` of the saved optimizer (checksums kept valid:
    a buggy or hostile writer)."""
    d = root / step_dir(1)
    man = flat_manifest(d)
    optim = next(v for k, v in man["tree"]["v"] if k["v"] == "optim")
    state = next(v for k, v in optim["state"]["v"] if k["v"] == "state")
    for _, per_param in state["v"]:
        for k, _ in per_param["v"]:
            if k == {"t": "str", "v": old}:
                k["v"] = new
    seal(d, man)


def renamed_state_key(root: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """An Adam saved under ``root`` whose per-parameter state key ``step`` reads ``stepX``, and a
    running model and Adam to restore it into, with their snapshot before the restore."""
    _saved(str(root), _adam)
    _rename_state_key(root, "step", "stepX")
    model = _model(1)
    opt = _adam(model.parameters())
    _step(model, opt)
    return model, opt, _snapshot(model, opt)


def test_a_renamed_state_key_is_refused_before_a_running_optimizer_changes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    model, opt, before = renamed_state_key(root)
    with nc.Checkpointer(str(root), memory_tier=False) as ck:
        with pytest.raises(nc.ValidationError, match=r"'optim'.*\['stepX'\] the live one lacks, and lacks its "
                                                     r"\['step'\]"):
            ck.load_latest(into={"model": model, "optim": opt})
    assert _same(before, _snapshot(model, opt)), "the failed restore changed `into`"


def test_a_load_that_fails_anyway_is_undone_and_named(tmp_path: Path) -> None:
    """A fresh Adam given a state without ``step`` passes every check (nothing to compare its
    state with) and torch's Adam raises ``KeyError('step')`` as it loads: the optimizers load
    before the model, and that one is put back: nothing in `into` changed, and the error says so."""
    root = tmp_path / "ck"
    _saved(str(root), _adam)
    _rename_state_key(root, "step", "stepX")
    model = _model(1)
    opt = _adam(model.parameters())
    before = _snapshot(model, opt)
    with nc.Checkpointer(str(root), memory_tier=False) as ck:
        with pytest.raises(nc.ValidationError, match=r"into the Adam under 'optim' failed \(KeyError: 'step'\); "
                                                     r"nothing in `into` changed") as e:
            ck.load_latest(into={"model": model, "optim": opt})
    assert isinstance(e.value.__cause__, KeyError)
    assert _same(before, _snapshot(model, opt)) and not opt.state, "the failed restore changed `into`"
    _step(model, opt)  # the optimizer works as it did


class _Picky(torch.optim.SGD):
    """An optimizer whose own ``__setstate__`` refuses what it was given, after torch's took it."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        raise RuntimeError("picky: refused")


@pytest.mark.parametrize("first_running", [False, True], ids=["fresh", "running"])
def test_an_optimizer_whose_own_loading_fails_puts_the_optimizers_back(tmp_path: Path, first_running: bool) -> None:
    """Two optimizers (a GAN's): the second one's ``__setstate__`` raises. Both load before the
    model; the one that failed, and the first one unless its own tensors were refilled (a running
    Adam: it keeps the checkpoint's state whole, and the error names it), get their state and
    parameter groups back."""
    root = str(tmp_path / "ck")
    model0 = _model(0)
    adam0, sgd0 = _adam(list(model0[0].parameters())), _sgd(list(model0[1].parameters()))
    _step(model0, adam0)
    _step(model0, sgd0)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model0, "opt_g": adam0, "opt_d": sgd0})
    model = _model(1)
    adam, picky = _adam(list(model[0].parameters())), _Picky(list(model[1].parameters()), lr=0.1, momentum=0.9)
    if first_running:
        _step(model, adam)
    _step(model, picky)
    before_model, before_picky, before_adam = _snapshot(model), _snapshot(model, picky), _snapshot(model, adam)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.ValidationError, match=r"_Picky under 'opt_d' failed \(RuntimeError: picky: refused\)") \
                as e:
            ck.load_latest(into={"model": model, "opt_g": adam, "opt_d": picky})
    assert _same(before_model, _snapshot(model)), "the model was loaded"
    assert _same(before_picky, _snapshot(model, picky)), "the failed optimizer was not put back"
    if first_running:
        assert "the live objects under ['opt_g'] may be partly restored" in str(e.value), e.value
        assert _restored_equal(adam, adam0), "the refilled optimizer does not hold the checkpoint's state whole"
    else:
        assert "nothing in `into` changed" in str(e.value), e.value
        assert _same(before_adam, _snapshot(model, adam)), "the first optimizer was not put back"


class _Stubborn(torch.nn.Linear):
    """A module whose own loading raises after it copied its weight."""

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        with torch.no_grad():
            self.weight.copy_(state_dict[prefix + "weight"])
        raise RuntimeError("stubborn: refused")


def test_a_module_whose_own_loading_fails_is_named_with_what_was_restored(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    torch.manual_seed(0)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": _Stubborn(4, 4), "note": 1})
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.ValidationError, match=r"into the _Stubborn under 'model' failed \(RuntimeError: "
                                                     r"stubborn: refused\); the live objects under \['model'\] may be "
                                                     r"partly restored"):
            ck.load_latest(into={"model": _Stubborn(4, 4), "note": 0})


# -- strict=False never restores nothing into a model silently -------------------------------------
class _Wrapper(torch.nn.Module):
    """What DistributedDataParallel and DataParallel look like to a state dict: ``module.`` keys."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def test_a_wrapped_models_keys_name_the_prefix_fix_and_strict_false_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "ck")
    saved = _model(0)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": _Wrapper(saved)})
    bare = _model(1)
    before = _snapshot(bare)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.ValidationError) as e:
            ck.load_latest(into={"model": bare})
        msg = str(e.value)
        assert "start with 'module.'" in msg and "restore into the model wrapped as when it was saved" in msg, msg
        assert "strict=False would restore nothing" in msg, msg
        with caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
            assert ck.load_latest(into={"model": bare}, strict=False) == 1
    assert _same(before, _snapshot(bare))
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "restores nothing" in r.getMessage()]
    assert len(warned) == 1 and "'model'" in warned[0] and "'module.0.weight'" in warned[0] and \
        "'0.weight'" in warned[0] and "strip 'module.'" in warned[0], warned
    # the other way round: saved bare, restored into the wrapper
    root2 = str(tmp_path / "ck2")
    with nc.Checkpointer(root2, memory_tier=False) as ck:
        ck.save(1, {"model": saved})
        wrapped = _Wrapper(bare)
        with pytest.raises(nc.ValidationError, match=r"into=\{'model': model.module\}"):
            ck.load_latest(into={"model": wrapped})
        assert ck.load_latest(into={"model": wrapped.module}) == 1  # what the fix says
    assert all(torch.equal(a, b) for a, b in zip(bare.state_dict().values(), saved.state_dict().values(), strict=True))


def test_strict_false_that_restores_some_keys_does_not_warn(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "ck")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 4)})
        grown = torch.nn.Linear(4, 4)
        grown.register_buffer("extra", torch.zeros(2))  # a key the checkpoint lacks: the others restore
        with caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
            assert ck.load_latest(into={"model": grown}, strict=False) == 1
    assert not [r for r in caplog.records if "restores nothing" in r.getMessage()]


@pytest.mark.parametrize("memory_tier", [True, False])
def test_state_dicts_given_for_saved_objects_are_refused_naming_the_fix(root: str, memory_tier: bool,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """``into={"model": model.state_dict(), ...}`` (the ``torch.load`` habit) for a checkpoint that
    saved the objects: strict, a ValidationError that names the fix (pass the object itself) with
    nothing changed; ``strict=False``, a WARNING that the live object was not restored into."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        ck.save(1, {"model": model, "optim": opt})
    live = _model(1)
    before = [p.detach().clone() for p in live.parameters()]
    live_opt = torch.optim.AdamW(live.parameters())
    with nc.Checkpointer(root, memory_tier=memory_tier) as ck:
        with pytest.raises(nc.ValidationError, match=r"Pass the \w+ itself .*load_state_dict\(\) is called"):
            ck.load_latest({"model": live.state_dict(), "optim": live_opt.state_dict()})
        assert all(torch.equal(a, b) for a, b in zip(before, live.parameters(), strict=True))
        with caplog.at_level(logging.WARNING, logger="nebula_ckpt"):
            into: dict[str, Any] = {"model": live.state_dict(), "optim": live_opt.state_dict()}
            assert ck.load_latest(into, strict=False) == 1
    assert "nothing was restored into the object it came from" in caplog.text and "'model'" in caplog.text
    assert isinstance(into["model"], dict) and torch.equal(into["model"]["0.weight"], model[0].weight)
