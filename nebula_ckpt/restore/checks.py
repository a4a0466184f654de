"""Checks of the objects a restore loads into, before anything in them changes.

``load_state_dict`` of a module or an optimizer refuses a mismatching state only after it has
copied what matches (and the objects before it in ``into`` were loaded): these checks refuse it
first, naming the key, where the object's loading is torch's own (see :func:`predictable`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.tree import decode
from nebula_ckpt.restore.open import OpenCheckpoint

#: the load / state-dict machinery of torch.nn.Module; a module that changes it (a hook, an
#: override outside torch.nn) may load keys or shapes other than its state_dict() shows
_LOAD_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks")
_LOAD_METHODS = ("load_state_dict", "_load_from_state_dict", "state_dict", "_save_to_state_dict")


def predictable(module: torch.nn.Module) -> bool:
    """Whether ``module.load_state_dict`` does exactly what torch.nn's does: it accepts the keys
    of ``state_dict()`` with their shapes and nothing else (no hooks, no overrides outside torch.nn)."""
    for m in module.modules():
        if any(getattr(m, h, None) for h in _LOAD_HOOKS):
            return False
        for name in _LOAD_METHODS:
            owner = next((c for c in type(m).__mro__ if name in c.__dict__), None)
            if owner is not None and not owner.__module__.startswith("torch.nn."):
                return False
    return True


def check_module_state(ck: OpenCheckpoint, state: Mapping[str, Any], target: torch.nn.Module, shown: str,
                        strict: bool) -> None:
    """Refuse, before anything changes, a module state that ``load_state_dict`` would refuse only
    after it copied what matches: keys missing or unexpected (``strict``) and shapes that differ
    (always), named. Checked where the module's loading is torch.nn's own (see :func:`predictable`);
    anything else is left to the module (which may raise after a partial load, as with torch)."""
    if state.get("t") not in ("dict", "odict") or not predictable(target):
        return
    want = target.state_dict(keep_vars=True)
    saved: dict[str, Any] = {}
    for k_node, v_node in state["v"]:
        k = decode(k_node, ck.view, False, shown)
        saved[k] = v_node
    if strict:
        missing = [k for k in want if k not in saved]
        unexpected = [k for k in saved if k not in want]
        if missing or unexpected:
            raise ValidationError(
                f"restore: the {type(target).__name__} under '{shown}' does not match the checkpoint of step "
                f"{ck.step}: missing in the checkpoint {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                f"not in the module {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; build the model the "
                "checkpoint was saved from, or pass strict=False (keys only: shapes must match)")
    for k, v_node in saved.items():
        have = want.get(k)
        if not isinstance(v_node, dict) or v_node.get("t") != "tensor" or have is None or type(have) not in (
                torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            continue
        rec = ck.resolve(v_node["k"])
        if rec.dtensor is None and tuple(rec.shape) != tuple(have.shape):
            raise ValidationError(
                f"restore: key '{shown}/{k}': the checkpoint of step {ck.step} has shape {tuple(rec.shape)}, "
                f"the {type(target).__name__} has {tuple(have.shape)}; build the model the checkpoint was saved "
                "from, or use read() to look at it")


def check_optimizer_state(ck: OpenCheckpoint, state: Mapping[str, Any], target: Any, shown: str) -> None:
    """Refuse, before anything changes, an optimizer state whose parameter groups do not match
    ``target``'s (what ``torch.optim.Optimizer.load_state_dict`` refuses, but only when it is
    applied, after the objects before it in ``into`` were loaded). Optimizers with loading of
    their own are left to it."""
    if not isinstance(target, torch.optim.Optimizer) or state.get("t") not in ("dict", "odict") or \
            type(target).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return
    node = next((v for k, v in state["v"] if decode(k, ck.view, False, shown) == "param_groups"), None)
    if node is None:
        return
    try:
        groups = decode(node, ck.view, False, shown)
        saved = [len(g["params"]) for g in groups]
    except Exception:  # not the shape torch writes: let load_state_dict say what it thinks
        return
    have = [len(g["params"]) for g in target.param_groups]
    if saved != have:
        raise ValidationError(
            f"restore: the {type(target).__name__} under '{shown}' does not match the checkpoint of step {ck.step}: "
            f"it has {len(have)} parameter group(s) of {have} parameters, the checkpoint {len(saved)} of {saved}; "
            "build the optimizer over the same parameters, in the same groups, as when it was saved")

