"""The objects a restore loads into: checked before anything in them changes, then refilled in place.

**Checks** (first in this module): ``load_state_dict`` of a module or an optimizer refuses a
mismatching state only after it has copied what matches (and the objects before it in ``into`` were
loaded): these checks refuse it first, naming the key, where the object's loading is torch's own
(see :func:`predictable`). A destination on the meta device (no data: a copy into it is a no-op)
is refused too, strict or not (:func:`check_not_meta`).

**Restore into the tensors a running job already holds**, instead of new ones. A job that restores
into a running model and optimizer (a rollback, an evaluation loop, the benchmark's in-process
restore) already has its parameters and optimizer state: same shapes, dtypes and device, every page
faulted in. ``torch.optim.Optimizer.load_state_dict`` keeps the tensors it is given when their
dtype and device already suit their parameter, and ``torch.nn.Module.load_state_dict`` copies each
value into its parameter or buffer, which costs nothing when the value *is* that tensor. So the
restore copies the checked bytes straight into those tensors on the native copy threads
(:func:`refill`), then hands them over: no allocation, no page fault per 4 KiB, no intra-op
parallel region per tensor, and the state keeps its storages (a later save plans the same layout).

Only where the loading is torch's own (optimizers: no hooks, no override, torch.optim's own
``__setstate__``, and every parameter's saved state of the keys its live state has; modules: no
hooks and no loading from outside ``torch.nn``, :func:`predictable`), and each live tensor is a
plain contiguous CPU tensor of the saved dtype and shape, held by no other destination (or, in a
module, tied to keys saved as that very tensor); every other tensor gets an owned copy, or a copy by
``load_state_dict``, as before. The copies run when the restore is applied, after every checksum of
the checkpoint was checked (:func:`~nebula_ckpt.restore.apply.stage_apply`): nothing changes
before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.format.tree import decode
from nebula_ckpt.native import get_ops
from nebula_ckpt.restore.open import OpenCheckpoint, chunks

log = logging.getLogger(__name__)

# -- checks: the objects before anything in them changes ------------------------------------------

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
    anything else is left to the module (which may raise after a partial load, as with torch).

    With ``strict=False``, a state none of whose keys the module has (a model saved wrapped in
    DistributedDataParallel or ``torch.compile``, restored unwrapped: every key differs by a
    ``module.`` / ``_orig_mod.`` prefix) would restore nothing into it: that is logged at WARNING,
    naming ``shown``, a key of each side and the fix."""
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
                f"not in the module {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; "
                + (prefix_fix(list(saved), list(want), shown) or "build the model the checkpoint was saved from, "
                   "or pass strict=False to restore only the keys both have (shapes must match)"))
    elif want and not any(k in want for k in saved):
        s_key, w_key = next(iter(saved), None), next(iter(want))
        log.warning("nebula_ckpt: restore (strict=False) of step %d restores nothing into the %s under '%s': none "
                    "of the checkpoint's keys (%r, ...) is one of the module's (%r, ...); %s", ck.step,
                    type(target).__name__, shown, s_key, w_key, prefix_fix(list(saved), list(want), shown) or
                    "build the model the checkpoint was saved from, or leave it out of `into`")
    for k, v_node in saved.items():
        have = want.get(k)
        if not isinstance(v_node, dict) or v_node.get("t") != "tensor" or have is None or type(have) not in (
                torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            continue
        check_not_overlapping(have, f"{shown}/{k}", "restore", f"the {type(target).__name__}'s tensor",
                              "give the module a tensor that owns its memory (e.g. `.clone()`) and restore again")
        rec = ck.resolve(v_node["k"])
        if rec.dtensor is None and tuple(rec.shape) != tuple(have.shape):
            raise ValidationError(
                f"restore: key '{shown}/{k}': the checkpoint of step {ck.step} has shape {tuple(rec.shape)}, "
                f"the {type(target).__name__} has {tuple(have.shape)}; build the model the checkpoint was saved "
                "from, or use read() to look at it")


#: how to restore into a tensor on the meta device (which has no data: copying into it is a no-op)
META_FIX = ("materialise it first (a model: `model.to_empty(device='cpu')`, then build its optimizer over the new "
            "parameters; a tensor: `torch.empty_like(t, device='cpu')`) and restore again, or take fresh tensors "
            "with `ck.read()` (map_location=... for the device) and load them yourself "
            "(`model.load_state_dict(state, assign=True)` for a model built on the meta device)")


def is_meta(t: torch.Tensor) -> bool:
    """Whether ``t`` (or, for a DTensor, its local shard) is on the meta device: it has no data."""
    return t.is_meta or bool(getattr(getattr(t, "_local_tensor", None), "is_meta", False))


def check_not_meta(t: Any, shown: str, where: str, what: str = "the tensor in `into`") -> None:
    """Refuse restoring into ``t`` (at ``shown``) when it is a tensor on the meta device: the copy
    would be a no-op, the restore would report success and leave it without data. Strict or not."""
    if isinstance(t, torch.Tensor) and is_meta(t):
        raise ValidationError(f"{where}: key '{shown}': {what} is on the meta device (no data: nothing would be "
                              f"restored into it); {META_FIX}")


def overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of the strided tensor ``t`` lie at one memory location (an expanded
    view: a stride of 0; or strides that interleave): a copy into it cannot hold distinct values."""
    if t.numel() < 2 or t.layout != torch.strided or t.is_contiguous():
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    reach = 0  # the farthest element offset the dims with smaller strides reach
    for st, n in dims:
        if st <= reach:
            break
        reach += (n - 1) * st
    else:
        return False
    if dims[0][0] == 0:
        return True
    # strides that nest into one another cannot tell: compare every element's offset
    offsets = torch.zeros((), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return bool(offsets.unique().numel() < t.numel())


def check_not_overlapping(t: Any, shown: str, where: str, what: str = "the tensor in `into`",
                          fix: str = "pass a tensor that owns its memory (e.g. `t.clone()`) and restore again") -> None:
    """Refuse restoring into ``t`` (at ``shown``) when elements of it share memory (see
    :func:`overlapping`): torch's copy refuses it only once the keys before it were written, or
    keeps one value of several. Checked before anything changes."""
    if isinstance(t, torch.Tensor) and not is_meta(t) and overlapping(t):
        raise ValidationError(f"{where}: key '{shown}': {what} has elements that share memory (shape "
                              f"{tuple(t.shape)}, strides {tuple(t.stride())}: an expanded or overlapping view), so "
                              f"it cannot hold the saved values; {fix}")


def check_module_not_meta(ck: OpenCheckpoint, state: Mapping[str, Any], target: torch.nn.Module, shown: str,
                          where: str) -> None:
    """Refuse, strict or not, a module whose parameter or buffer that a key of its saved ``state``
    is loaded into is on the meta device (see :func:`check_not_meta`), before anything changes."""
    if state.get("t") not in ("dict", "odict") or \
            not any(is_meta(t) for t in [*target.parameters(), *target.buffers()]):
        return
    want = target.state_dict(keep_vars=True)
    for k_node, _ in state["v"]:
        k = decode(k_node, ck.view, False, shown)
        check_not_meta(want.get(k), f"{shown}/{k}", where, f"the {type(target).__name__}'s tensor")


def check_optimizer_not_meta(target: Any, shown: str, where: str) -> None:
    """Refuse an optimizer over parameters on the meta device (its loading moves the saved state
    onto them: lost) or holding state on it (see :func:`check_not_meta`)."""
    if not isinstance(target, torch.optim.Optimizer):
        return
    # a wrapper (accelerate's, Lightning's) may keep its groups and state on the optimizer it wraps
    groups, state = getattr(target, "param_groups", None), getattr(target, "state", None)
    params = [p for g in groups if isinstance(g, Mapping) for p in g.get("params", ())] \
        if isinstance(groups, list) else []
    for n, p in enumerate(params):
        check_not_meta(p, shown, where, f"parameter {n} of the {type(target).__name__} (where its loading puts "
                                        "the saved state)")
        for k, v in (state.get(p, {}) if isinstance(state, Mapping) else {}).items():
            check_not_meta(v, f"{shown}/state/{n}/{k}", where, f"the {type(target).__name__}'s state")


#: the prefixes a wrapper puts before its module's keys: DistributedDataParallel / DataParallel,
#: and torch.compile's OptimizedModule
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _unwrapped(key: str) -> tuple[str, str]:
    """``(prefix, rest)`` of a module key: the wrappers' prefixes it starts with, and the key after them."""
    rest = key
    while rest.startswith(_WRAPPER_PREFIXES):
        rest = rest.split(".", 1)[1]
    return key[:len(key) - len(rest)], rest


def prefix_fix(saved: list[str], live: list[str], shown: str) -> str:
    """When the saved keys and the module's differ only by a wrapper's prefix (``module.``,
    ``_orig_mod.``), what to do about it; ``""`` otherwise."""
    if not saved or not live:
        return ""
    (s_pre, _), (l_pre, _) = _unwrapped(saved[0]), _unwrapped(live[0])
    if s_pre == l_pre or {_unwrapped(k)[1] for k in saved}.isdisjoint(_unwrapped(k)[1] for k in live):
        return ""
    what = f"the checkpoint's keys start with '{s_pre}'" if s_pre else "the checkpoint's keys have no prefix"
    what += f" and the module's with '{l_pre}'" if l_pre else " and the module's have none"
    if s_pre.startswith(l_pre):  # saved wrapped, restored into the bare model
        fix = (f"restore into the model wrapped as when it was saved ('module.': DistributedDataParallel or "
               f"DataParallel, '_orig_mod.': torch.compile), or read() the state and strip '{s_pre}' from its keys "
               "(torch.nn.modules.utils.consume_prefix_in_state_dict_if_present)")
    else:
        fix = f"restore into the model the wrapper holds: `into={{'{shown}': model.module}}` ('module.') or " \
              "`model._orig_mod` ('_orig_mod.')"
    return f"{what} (a wrapper's prefix): {fix}; strict=False would restore nothing of it"


#: keys a parameter group may hold besides its optimizer's hyperparameters: the parameters and
#: their names, and what torch's learning-rate schedulers add (a run saved with a scheduler is
#: restored into an optimizer whose scheduler is built again after the restore)
_GROUP_EXTRAS = frozenset({"params", "param_names", "initial_lr", "max_lr", "min_lr", "max_momentum",
                           "base_momentum", "swa_lr"})


@dataclass(frozen=True)
class SavedOptimizer:
    """A saved optimizer state dict as the checks and the refill read it, its keys decoded once
    (:func:`read_optimizer`; no tensor is read): the step it was saved at, its parameter groups,
    and each parameter's saved state as ``(the id the groups give the parameter, [(key, node)])``."""

    step: int
    groups: list[dict[Any, Any]]
    states: list[tuple[Any, list[tuple[Any, Any]]]]

    def by_param(self, target: torch.optim.Optimizer) -> Optional[dict[Any, tuple[int, Any]]]:
        """Saved parameter id -> ``(n, the n-th parameter of target)`` (the groups in order, as
        torch's loading pairs them); None when the numbers differ or an id is no dict key."""
        params = [p for g in target.param_groups for p in g["params"]]
        ids = [i for g in self.groups for i in g["params"]]
        if len(ids) != len(params):
            return None
        try:
            return dict(zip(ids, enumerate(params), strict=True))
        except TypeError:  # ids that are no dict keys: not the layout torch writes
            return None


def read_optimizer(state: Mapping[str, Any], target: Any, view: Callable[[str], Any], step: int,
                   shown: str) -> Optional[SavedOptimizer]:
    """The saved state ``state`` (typed tree) of the optimizer ``target`` as :class:`SavedOptimizer`
    (``view(key)`` gives a tensor leaf, e.g. a tensor learning rate), for the checks and the refill
    of an optimizer whose loading is torch's own; None for any other object, or for a state that
    is not a dict with ``param_groups`` of the layout torch writes (its ``load_state_dict`` then
    says what it thinks)."""
    opt = torch.optim.Optimizer
    if not isinstance(target, opt) or type(target).load_state_dict is not opt.load_state_dict or \
            state.get("t") not in ("dict", "odict"):
        return None
    try:
        entries = {decode(k, view, False, shown): v for k, v in state["v"]}
        if "param_groups" not in entries:
            return None
        groups = decode(entries["param_groups"], view, False, shown)
        if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                   for g in groups):
            return None
        saved = entries.get("state")
        per_param = saved["v"] if isinstance(saved, dict) and saved.get("t") in ("dict", "odict") else []
        states = [(decode(pk, view, False, shown), [(decode(nk, view, False, shown), nv) for nk, nv in pv["v"]])
                  for pk, pv in per_param if isinstance(pv, dict) and pv.get("t") in ("dict", "odict")]
    except Exception:  # not the shape torch writes: let load_state_dict say what it thinks
        return None
    return SavedOptimizer(step, groups, states)


def check_optimizer_state(saved: Optional[SavedOptimizer], target: Any, shown: str, saved_cls: Any = None) -> None:
    """Refuse, before anything changes, an optimizer state ``target`` cannot take, which
    ``torch.optim.Optimizer.load_state_dict`` refuses (or its ``__setstate__`` fails on) only when
    it is applied, after the objects before it in ``into`` were loaded (``saved``: the state as
    :func:`read_optimizer` read it; None: nothing to check):

    - parameter groups of other numbers of parameters;
    - a parameter group with a key that ``target``'s group lacks (another kind of optimizer: an
      SGD's ``momentum`` in an Adam). Keys the saved group lacks are no mismatch (a checkpoint of
      an older torch lacks the newer ``foreach``, ``fused``, ``capturable``..., which torch fills
      in), nor are ``param_names`` and the keys schedulers add (``initial_lr``...). Adam and
      AdamW have the same keys and state in torch 2.x: either takes the other's state, as torch
      lets it;
    - when ``target`` has state already: a parameter's saved state keys and its live ones where
      neither holds the other (another kind of optimizer, a renamed key; one holding the other is
      a setting such as Adam's ``amsgrad``, which the saved groups bring along).

    A few comparisons per parameter group and per state key. Optimizers with loading of their
    own get no check (:func:`read_optimizer` gives None), those with load hooks (which may
    rewrite the state) the first only. Both a restore in place and a resharded one check so."""
    if saved is None or not isinstance(target, torch.optim.Optimizer):
        return
    sizes = [len(g["params"]) for g in saved.groups]
    have = [len(g["params"]) for g in target.param_groups]
    if sizes != have:
        raise ValidationError(
            f"restore: the {type(target).__name__} under '{shown}' does not match the checkpoint of step "
            f"{saved.step}: it has {len(have)} parameter group(s) of {have} parameters, the checkpoint "
            f"{len(sizes)} of {sizes}; build the optimizer over the same parameters, in the same groups, as when "
            "it was saved")
    if getattr(target, "_optimizer_load_state_dict_pre_hooks", None):
        return  # a hook may rename what was saved
    by = f" ({saved_cls.rsplit('.', 1)[-1]})" if isinstance(saved_cls, str) else ""
    for i, (group, live) in enumerate(zip(saved.groups, target.param_groups, strict=True)):
        keys = set(group)
        foreign = sorted(str(k) for k in keys - live.keys() - _GROUP_EXTRAS)
        if foreign:
            raise ValidationError(
                f"restore: the {type(target).__name__} under '{shown}' cannot take the optimizer state of step "
                f"{saved.step}: it was saved by an optimizer{by} whose parameter group {i} has key(s) {foreign} that "
                f"the live {type(target).__name__}'s lacks (saved: {sorted(map(str, keys - {'params'}))}; live: "
                f"{sorted(k for k in live if k != 'params')}); restore into the optimizer class that saved it, or "
                f"leave '{shown}' out of `into` and pass strict=False (the optimizer then starts afresh)")
    if target.state:
        _check_state_keys(saved, target, shown, by)


def _check_state_keys(saved: SavedOptimizer, target: torch.optim.Optimizer, shown: str, by: str) -> None:
    """Refuse a saved per-parameter state whose keys and the live one's hold none the other (see
    :func:`check_optimizer_state`)."""
    by_id = saved.by_param(target)
    if by_id is None:
        return
    for pid, named in saved.states:
        n, param = by_id.get(pid, (-1, None))
        live = target.state.get(param) if param is not None else None
        if not live:
            continue
        keys = {k for k, _ in named}
        if not keys <= live.keys() and not live.keys() <= keys:
            raise ValidationError(
                f"restore: the {type(target).__name__} under '{shown}' cannot take the optimizer state of step "
                f"{saved.step}: the state of its parameter {n} was saved by an optimizer{by} with key(s) "
                f"{sorted(map(str, keys - live.keys()))} the live one lacks, and lacks its "
                f"{sorted(map(str, live.keys() - keys))}; restore into the optimizer class that saved it, or leave "
                f"'{shown}' out of `into` and pass strict=False (the optimizer then starts afresh)")


# -- live tensors refilled in place ---------------------------------------------------------------

#: an optimizer's load / state-dict hooks: with any of them set, its tensors are not refilled in place
_HOOKS = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
          "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")


def live_destinations(ck: OpenCheckpoint, saved: Optional[SavedOptimizer], target: Any) -> dict[str, torch.Tensor]:
    """Tensor key of the saved optimizer state ``saved`` (:func:`read_optimizer`) -> the tensor
    ``target`` holds for it now, for the keys that may be refilled in place (see the module
    docstring); empty when none may."""
    opt = torch.optim.Optimizer
    if saved is None or not isinstance(target, opt) or type(target).state_dict is not opt.state_dict or \
            any(getattr(target, h, None) for h in _HOOKS) or not torch_setstate(target) or not target.state:
        return {}
    by_id = saved.by_param(target)
    if by_id is None:
        return {}
    out: dict[str, torch.Tensor] = {}
    for pid, named in saved.states:
        _, param = by_id.get(pid, (-1, None))
        live = target.state.get(param) if param is not None else None
        if not isinstance(live, dict) or not live:
            continue
        if {k for k, _ in named} != live.keys():
            return {}  # not the state this optimizer holds: owned copies, nothing changed if its loading fails
        for k, nv in named:
            have = live[k]
            if nv.get("t") == "tensor" and isinstance(have, torch.Tensor) and _suits(have, ck, nv["k"]):
                out[nv["k"]] = have
    return _distinct(ck, out)


def torch_setstate(target: Any) -> bool:
    """Whether the optimizer ``target``'s ``__setstate__`` (what ``load_state_dict`` ends with) is
    torch.optim's own, which takes a state of the keys ``target`` holds: only then are its tensors
    refilled before it loads (a load that failed after that could not be undone, see
    :class:`~nebula_ckpt.restore.apply.ObjectLoads`)."""
    owner = next((c for c in type(target).__mro__ if "__setstate__" in c.__dict__), object)
    return owner.__module__.startswith("torch.optim.")


def module_destinations(ck: OpenCheckpoint, state: Mapping[str, Any], target: torch.nn.Module,
                        shown: str) -> dict[str, torch.Tensor]:
    """Tensor key of the saved module ``state`` -> the parameter or buffer of ``target`` that
    ``load_state_dict`` copies it into, for the keys that may be refilled first (see the module
    docstring); ``load_state_dict`` then gets those very tensors, whose copy onto themselves is
    nothing. Empty when none may."""
    if state.get("t") not in ("dict", "odict") or not predictable(target) or \
            torch.__future__.get_swap_module_params_on_conversion():  # it would swap, not copy
        return {}
    want = target.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for k_node, v_node in state["v"]:
        if isinstance(v_node, dict) and v_node.get("t") == "tensor":
            have = want.get(decode(k_node, ck.view, False, shown))
            if isinstance(have, torch.Tensor) and type(have) in _MODULE_TYPES and \
                    _suits(have, ck, v_node["k"], grad_ok=True):
                out[v_node["k"]] = have
    return _tied_once(ck, out)


#: the tensor types a module holds that torch's loading copies into (a subclass may load otherwise)
_MODULE_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def _tied_once(ck: OpenCheckpoint, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``out`` without destinations whose storage another key's destination shares, unless all
    of them are the same tensor saved as one tensor (a tied weight: refilled once). Keys of one
    saved tensor whose destinations are separate tensors stay: :func:`refill` fills each."""
    by_storage: dict[int, list[str]] = {}
    for k, t in out.items():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(k)
    return {k: out[k] for keys in by_storage.values()
            if all(out[k] is out[keys[0]] and ck.resolve(k).key == ck.resolve(keys[0]).key for k in keys)
            for k in keys}


def _suits(have: torch.Tensor, ck: OpenCheckpoint, key: str, grad_ok: bool = False) -> bool:
    """Whether the live tensor ``have`` can take the saved tensor ``key``'s bytes as they are
    (``grad_ok``: also a tensor that requires grad, which a module's loading copies into under
    ``no_grad``)."""
    rec = ck.resolve(key)
    return (type(have) is torch.Tensor or grad_ok) and have.device.type == "cpu" and \
        have.layout == torch.strided and (grad_ok or not have.requires_grad) and not have.is_inference() and \
        have.is_contiguous() and \
        not have.is_conj() and not have.is_neg() and have.dtype == rec.torch_dtype and \
        tuple(have.shape) == tuple(rec.shape) and rec.dtensor is None and have.numel() > 0


def _distinct(ck: OpenCheckpoint, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``out`` without destinations that share a storage, or saved tensors named more than once
    (tied in the checkpoint: ``load_state_dict`` would give them one tensor)."""
    storages: dict[int, int] = {}
    records: dict[str, int] = {}
    for k, t in out.items():
        ptr = t.untyped_storage().data_ptr()
        storages[ptr] = storages.get(ptr, 0) + 1
        records[ck.resolve(k).key] = records.get(ck.resolve(k).key, 0) + 1
    return {k: t for k, t in out.items()
            if storages[t.untyped_storage().data_ptr()] == 1 and records[ck.resolve(k).key] == 1}


def refill(ck: OpenCheckpoint, dests: Mapping[str, torch.Tensor]) -> None:
    """Copy the checked bytes of each key of ``dests`` into its live tensor, shard by shard in
    order, a chunk at a time (the mapped pages of each chunk dropped once copied).

    The copies run on the native copy threads (:meth:`~nebula_ckpt.native.FallbackOps.copy_into`),
    which also take the page faults of the mapped source between them: no tensor-by-tensor
    ``copy_`` (an intra-op parallel region each, whose idle threads spin after it), no Python
    per tensor. A tensor named by several keys (tied) is copied once; a saved tensor whose keys
    name several tensors (saved tied, restored into separate ones) is copied into each of them, as
    ``load_state_dict`` does.
    """
    ops = get_ops()
    by_shard: dict[int, dict[str, tuple[TensorRecord, dict[int, torch.Tensor]]]] = {}
    for k, t in dests.items():
        rec = ck.resolve(k)
        by_shard.setdefault(rec.shard, {}).setdefault(rec.key, (rec, {}))[1][id(t)] = t
    for si in sorted(by_shard):
        into = by_shard[si]
        for group in chunks([r for r, _ in into.values()]):
            pairs = [(r.start, t) for r in group for t in into[r.key][1].values()]
            ops.copy_into(ck.buffer(si), [o for o, _ in pairs], [t for _, t in pairs])
            ck.drop(group)
