"""Modules and optimizers read through their internals, for the plan cache's check.

A module's or an optimizer's ``state_dict()`` builds its result in Python, one entry per tensor,
on every call: calling it at every save would cost more than the rest of the save. When the
object saves through PyTorch's own ``state_dict()`` (its class does not override ``state_dict``,
``_save_to_state_dict`` or ``get_extra_state``, the instance has no such attribute of its own and
no state-dict hook is registered), what that call returns is fixed by a few registries:

* a module: ``_parameters`` (those not None), ``_buffers`` (those not None nor in
  ``_non_persistent_buffers_set``) and ``_modules`` (recursively, those not None), in order;
* an optimizer: ``param_groups`` (each group's entries; its parameters, whose positions are the
  indices ``state_dict()`` packs) and ``state`` (per parameter, in order; each value is the dict
  ``state_dict()`` returns as it is).

:func:`model` turns the recorded ``("F", obj, node)`` of such an object (``node``: what its
``state_dict()`` returned, as walked) into an ``"M"`` / ``"O"`` node that reaches the same values
through those registries, after checking that reading them gives exactly what the call gave
(same keys, order and tensors); anything else stays an ``"F"`` node (the check calls
``state_dict()``). The native check (``csrc/plan_guard.cpp``) re-checks every condition above at
every save.

Program nodes (besides those of :class:`~nebula_ckpt.save.plan.Recording`):

* ``("M", module, params, buffers, children)``: ``params`` ``((name, ("T", slot, tensor) or None), ...)``,
  ``buffers`` ``((name, kind, ("T", ...) or None), ...)`` with kind 0 None, 1 saved, 2 not persistent,
  ``children`` ``((name, ("M", ...) or None), ...)``, each in registry order;
* ``("O", optimizer, groups, state_type, state)``: ``groups`` ``((keys, values, params_at, params), ...)``
  with ``values[params_at]`` None, ``state`` ``((parameter, node of its state dict), ...)``.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

_Module = torch.nn.Module
_Optimizer = torch.optim.Optimizer

#: what a module / optimizer must resolve these to (the native check compares by identity)
STOCK = {
    "module_state_dict": _Module.state_dict,
    "module_save_to_state_dict": _Module._save_to_state_dict,
    "module_get_extra_state": _Module.get_extra_state,
    "optimizer_state_dict": _Optimizer.state_dict,
}


class _NotModelled(Exception):
    """The object's registries do not give what its state_dict() gave."""


def model(node: Any) -> Any:
    """The program ``node`` with every ``"F"`` node of a stock module or optimizer replaced by an
    ``"M"`` / ``"O"`` node where its registries give exactly what its ``state_dict()`` gave."""
    tag = node[0]
    if tag == "D":
        return ("D", node[1], node[2], tuple(model(v) for v in node[3]))
    if tag == "S":
        return ("S", node[1], tuple(model(v) for v in node[2]))
    if tag != "F":
        return node
    obj, child = node[1], model(node[2])
    try:
        if isinstance(obj, _Module):
            return _model_module(obj, child)
        if isinstance(obj, _Optimizer):
            return _model_optimizer(obj, child)
    except _NotModelled:
        pass
    return ("F", obj, child)


def _stock_module(m: Any) -> bool:
    t, own = type(m), vars(m)
    return (getattr(t, "__getattribute__", None) is object.__getattribute__
            and getattr(t, "state_dict", None) is _Module.state_dict
            and getattr(t, "_save_to_state_dict", None) is _Module._save_to_state_dict
            and getattr(t, "get_extra_state", _Module.get_extra_state) is _Module.get_extra_state
            and "state_dict" not in own and "_save_to_state_dict" not in own
            and isinstance(own.get("_state_dict_hooks"), dict) and not own["_state_dict_hooks"]
            and isinstance(own.get("_state_dict_pre_hooks"), dict) and not own["_state_dict_pre_hooks"]
            and type(own.get("_parameters")) is dict and type(own.get("_buffers")) is dict
            and type(own.get("_modules")) is dict
            and isinstance(own.get("_non_persistent_buffers_set"), (set, frozenset)))


def _model_module(m: Any, child: Any) -> Any:
    if child[0] != "D":
        raise _NotModelled
    entries = iter(zip(child[2], child[3], strict=True))
    node = _module_node(m, "", entries)
    if next(entries, None) is not None:
        raise _NotModelled
    return node


def _take(entries: Iterator[tuple[Any, Any]], key: str, t: Any) -> tuple[str, int, Any]:
    """The next entry of the walked state_dict(): must be ``key`` and a view of ``t``'s memory."""
    k, g = next(entries, (None, None))
    if k != key or g is None or g[0] != "T" or not isinstance(t, torch.Tensor):
        raise _NotModelled
    rec = g[2]
    if (rec.dtype, rec.shape, rec.stride(), rec.device) != (t.dtype, t.shape, t.stride(), t.device) or \
            (rec.numel() and rec.data_ptr() != t.data_ptr()):
        raise _NotModelled
    return ("T", g[1], t)


def _module_node(m: Any, prefix: str, entries: Iterator[tuple[Any, Any]]) -> Any:
    if not _stock_module(m):
        raise _NotModelled
    own = vars(m)  # the registries state_dict() reads
    params = tuple((name, None if p is None else _take(entries, prefix + name, p))
                   for name, p in own["_parameters"].items())
    buffers: list[tuple[Any, int, Any]] = []
    for name, b in own["_buffers"].items():
        if b is None:
            buffers.append((name, 0, None))
        elif name in own["_non_persistent_buffers_set"]:
            buffers.append((name, 2, None))
        else:
            buffers.append((name, 1, _take(entries, prefix + name, b)))
    children = tuple((name, None if c is None else _module_node(c, f"{prefix}{name}.", entries))
                     for name, c in own["_modules"].items())
    return ("M", m, params, tuple(buffers), children)


def _stock_optimizer(o: Any) -> bool:
    own = vars(o)
    return (getattr(type(o), "__getattribute__", None) is object.__getattribute__
            and getattr(type(o), "state_dict", None) is _Optimizer.state_dict and "state_dict" not in own
            and isinstance(own.get("_optimizer_state_dict_pre_hooks"), dict)
            and not own["_optimizer_state_dict_pre_hooks"]
            and isinstance(own.get("_optimizer_state_dict_post_hooks"), dict)
            and not own["_optimizer_state_dict_post_hooks"]
            and type(own.get("param_groups")) is list and isinstance(own.get("state"), dict))


def _model_optimizer(o: Any, child: Any) -> Any:
    if not _stock_optimizer(o) or child[0] != "D" or child[1] is not dict \
            or tuple(child[2]) != ("state", "param_groups"):
        raise _NotModelled
    state_g, groups_g = child[3]
    if groups_g[0] != "S" or groups_g[1] is not list or len(groups_g[2]) != len(o.param_groups):
        raise _NotModelled
    groups, index = _model_groups(o.param_groups, groups_g[2])
    if state_g[0] != "D" or state_g[1] is not dict or len(state_g[2]) != len(o.state):
        raise _NotModelled
    state = []
    for (p, s), k, g in zip(o.state.items(), state_g[2], state_g[3], strict=True):
        if not isinstance(p, torch.Tensor) or index.get(id(p)) != k or type(s) is not dict:
            raise _NotModelled
        state.append((p, g))
    return ("O", o, groups, type(o.state), tuple(state))


def _model_groups(param_groups: list[Any], walked: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[int, int]]:
    """The ``"O"`` node's groups, and the index ``state_dict()`` packs for each parameter (by id)."""
    groups = []
    index: dict[int, int] = {}
    start = 0
    for g, w in zip(param_groups, walked, strict=True):
        if type(g) is not dict or type(g.get("params")) is not list:
            raise _NotModelled
        keys = tuple(g.keys())
        if w[0] != "D" or w[1] is not dict or tuple(w[2]) != tuple(k for k in keys if k != "params") + ("params",):
            raise _NotModelled
        values = dict(zip(w[2], w[3], strict=True))
        params = tuple(g["params"])
        for i, p in enumerate(params, start):
            index.setdefault(id(p), i)
        start += len(params)
        groups.append((keys, tuple(None if k == "params" else values[k] for k in keys), keys.index("params"), params))
    return tuple(groups), index


def stock_functions() -> dict[str, Any]:
    """:data:`STOCK`, for the native check."""
    return dict(STOCK)


def optional_numpy_type() -> Optional[type]:
    """``numpy.ndarray`` when NumPy imports, else None."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return np.ndarray
