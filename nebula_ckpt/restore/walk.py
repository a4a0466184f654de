"""The walk of a saved typed tree against the live objects it is restored into.

A restore in place (:mod:`nebula_ckpt.restore.apply`) and a resharded restore
(:mod:`nebula_ckpt.restore.reshard`) pair the same two trees the same way: an object with
``load_state_dict`` takes its saved state, a tensor is filled, dicts are matched key by key (keys
only one side has are collected in a :class:`KeyMismatch`), lists and tuples of the same length
item by item, and anything else is replaced by the saved value, unless ``into`` holds state there
that replacing would silently keep as it was. :class:`TreeWalk` is that pairing; each restore
says what happens at an object, a tensor, a dict, a sequence and a saved value.

Also the small readers of a typed tree both use (and the DCP reader): :func:`tensor_keys`,
:func:`holds_state`, :func:`describe`, :func:`describe_node`.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Mapping, Optional, TypeVar

import torch

from nebula_ckpt.errors import CorruptCheckpointError, ValidationError
from nebula_ckpt.format.tree import decode

#: what a walk makes of one node (a restore's thunk, or None for "filled in place")
R = TypeVar("R")


def tensor_keys(node: Any, out: list[str]) -> list[str]:
    """Every tensor key referenced under ``node`` (typed JSON), in order (no recursion)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("t") == "tensor":
                out.append(n["k"])
            else:
                stack.extend(reversed([v for v in n.values() if isinstance(v, (dict, list))]))
        elif isinstance(n, list):
            stack.extend(reversed(n))
    return out


def holds_state(x: Any) -> bool:
    """Whether ``x`` is, or contains (in dicts, lists, tuples), a tensor or an object with
    ``load_state_dict``: something a restore fills, which replacing would leave as it was."""
    stack, seen = [x], set()
    while stack:
        y = stack.pop()
        if id(y) in seen:
            continue
        seen.add(id(y))
        if isinstance(y, torch.Tensor) or (not isinstance(y, type) and callable(getattr(y, "load_state_dict", None))):
            return True
        if isinstance(y, dict):
            stack.extend(y.values())
        elif isinstance(y, (list, tuple)):
            stack.extend(y)
    return False


def describe(x: Any) -> str:
    """``x`` in a few words, for errors (``a list of 2 item(s)``, ``a Linear``)."""
    if isinstance(x, (list, tuple, dict)):
        return f"a {type(x).__name__} of {len(x)} item(s)"
    return f"a {type(x).__name__}"


def describe_node(node: Mapping[str, Any]) -> str:
    """A saved typed-JSON node in a few words (``a list of 3 item(s)``, ``a Linear state``)."""
    t = node["t"]
    if t in ("dict", "odict", "list", "tuple"):
        return f"a {'dict' if t == 'odict' else t} of {len(node['v'])} item(s)"
    if t == "stateful":
        return f"a {node.get('cls', 'object')} state"
    return f"a {t}"


class KeyMismatch:
    """The keys a restore found on one side only: held by the checkpoint but not by ``into``
    (they would not be restored: a forgotten scheduler) and held by ``into`` but not saved."""

    #: keys named in the error, of each side
    SHOWN = 10

    def __init__(self) -> None:
        self.saved_only: list[str] = []
        self.into_only: list[str] = []

    def check(self, what: str) -> None:
        """Raise :class:`ValidationError` naming the keys of either side (``what``: the checkpoint).

        Called after the whole tree is matched, before anything in ``into`` changes."""
        if not self.saved_only and not self.into_only:
            return
        parts, fixes = [], []
        if self.saved_only:
            parts.append(f"holds key(s) {_names(self.saved_only, self.SHOWN)} that `into` lacks (they would not be "
                         "restored)")
            fixes.append("add them to `into` (e.g. the scheduler or value saved under that key)")
        if self.into_only:
            parts.append(f"lacks key(s) {_names(self.into_only, self.SHOWN)} that `into` has")
            fixes.append("build `into` like the saved state")
        raise ValidationError(f"{what} " + " and ".join(parts) + "; " + ", or ".join(fixes)
                              + ", or pass strict=False to restore only the keys both have (a key only the "
                              "checkpoint has is then put into its dict as the saved value)")


def _names(keys: list[str], n: int) -> str:
    return f"{keys[:n]}" + (f" and {len(keys) - n} more" if len(keys) > n else "")


def sub_path(path: str, key: Any) -> str:
    """The path of ``key`` under ``path`` (``a/b``; the root's keys are bare)."""
    return f"{path}/{key}" if path else str(key)


class TreeWalk(Generic[R]):
    """Pairs a saved typed tree with ``into``, node by node; subclasses say what each pair does.

    :meth:`walk` dispatches: an object of ``into`` restored through ``load_state_dict``
    (:meth:`is_object`, :meth:`on_object`) first, then a saved tensor (:meth:`on_tensor`), a dict against a dict
    (:meth:`on_dict`, with keys only one side has recorded in :attr:`unmatched`), a list or tuple
    against one of the same type and length (:meth:`on_sequence`); anything else is a saved value
    replacing ``into``'s (:meth:`on_value`), refused with ``strict`` where ``into`` holds state
    there (:meth:`refuse`).

    Args:
        strict: keys must match both ways; a value must not replace state of ``into``.
        where: names the checkpoint in errors.
    """

    def __init__(self, strict: bool, where: str) -> None:
        self.strict = strict
        self.where = where
        #: keys only one side has (raised together, after the walk, with ``strict``)
        self.unmatched = KeyMismatch()
        #: > 0 while walking the state dict of an object (its keys are the object's to check)
        self.inside_object = 0
        #: saved keys (paths) only some ranks hold (another pipeline stage's): where ``into`` lacks
        #: one, it is not restored and no mismatch (:func:`~nebula_ckpt.format.tree.held_by_some`)
        self.others: frozenset[str] = frozenset()

    #: a saved list matches only a list of ``into``, a tuple only a tuple (else: either)
    exact_sequences = True

    # -- what each pair does (subclasses) ------------------------------------------------------
    def is_object(self, node: Mapping[str, Any], target: Any) -> bool:
        """Whether ``target`` is an object that takes ``node`` through ``load_state_dict``."""
        return False

    def on_object(self, node: Mapping[str, Any], target: Any, path: str) -> R:
        """``node`` restored into the object ``target`` (see :meth:`is_object`)."""
        raise NotImplementedError

    def unwrap(self, node: Mapping[str, Any]) -> Mapping[str, Any]:
        """The node matched structurally when ``target`` is no object (default: ``node`` itself)."""
        return node

    def on_tensor(self, node: Mapping[str, Any], target: Any, path: str) -> R:
        """A saved tensor (``node["k"]``) against ``target``."""
        raise NotImplementedError

    def on_dict(self, node: Mapping[str, Any], target: dict[Any, Any], children: list[tuple[Any, R]],
                path: str) -> R:
        """A dict filled in place: ``children`` are ``(key, result)`` of the keys both have or
        that go into it (see :meth:`on_missing`)."""
        raise NotImplementedError

    def on_sequence(self, node: Mapping[str, Any], target: Any, children: list[R], path: str) -> R:
        """A list or tuple of the saved length: ``children`` are its items' results."""
        raise NotImplementedError

    def on_value(self, node: Mapping[str, Any], target: Any, path: str) -> R:
        """``node`` restored as a saved value (it replaces ``target`` in its parent)."""
        raise NotImplementedError

    def on_missing(self, node: Mapping[str, Any], path: str) -> Optional[R]:
        """A saved key a dict of ``into`` lacks (not strict, or inside an object's state dict):
        what goes into the dict, or None to leave it out."""
        return self.walk(node, None, path)

    def refuse(self, node: Mapping[str, Any], target: Any, path: str) -> bool:
        """Whether ``strict`` refuses replacing ``target`` by the saved value of ``node``."""
        return self.strict and holds_state(target)

    # -- the walk -------------------------------------------------------------------------------
    def walk(self, node: Mapping[str, Any], target: Any, path: str) -> R:
        """What restores ``node`` into ``target`` (at ``path``); validates as it goes."""
        if self.is_object(node, target):
            return self.on_object(node, target, path)
        node = self.unwrap(node)
        t = node["t"]
        if t == "tensor":
            return self.on_tensor(node, target, path)
        if t in ("dict", "odict") and isinstance(target, dict):
            return self.on_dict(node, target, self._dict_children(node, target, path), path)
        kind = (list if t == "list" else tuple) if self.exact_sequences else (list, tuple)
        if t in ("list", "tuple") and isinstance(target, kind) and len(target) == len(node["v"]):
            items = [self.walk(v, target[i], f"{path}/{i}") for i, v in enumerate(node["v"])]
            return self.on_sequence(node, target, items, path)
        return self.replace(node, target, path)

    def replace(self, node: Mapping[str, Any], target: Any, path: str) -> R:
        """``node``'s saved value in place of ``target``, refused with ``strict`` where ``target``
        holds state (the saved value would replace it, and what it holds keep its old state)."""
        if self.refuse(node, target, path):
            raise ValidationError(
                f"{self.where}: checkpoint key '{path or '<root>'}' holds {describe_node(node)}, `into` holds "
                f"{describe(target)} there, which it cannot be restored into; build `into` like the saved state, "
                "or pass strict=False to replace it by the saved value")
        return self.on_value(node, target, path)

    def _dict_children(self, node: Mapping[str, Any], target: dict[Any, Any], path: str) -> list[tuple[Any, R]]:
        saved: set[Any] = set()
        out: list[tuple[Any, R]] = []
        for k_node, v_node in node["v"]:
            k = decode(k_node, self._key_tensor, False, path)
            saved.add(k)
            sub = sub_path(path, k)
            if k in target:
                out.append((k, self.walk(v_node, target[k], sub)))
                continue
            if sub in self.others:
                continue  # another rank's (a pipeline stage's): not this restore's
            if not self.inside_object:
                self.unmatched.saved_only.append(sub)
                if self.strict:
                    continue  # refused once every key is known (see KeyMismatch)
            got = self.on_missing(v_node, sub)
            if got is not None:
                out.append((k, got))
        self.unmatched.into_only.extend(sub_path(path, k) for k in target if k not in saved)
        return out

    def _key_tensor(self, key: str) -> Any:
        raise CorruptCheckpointError(f"{self.where}: a dict key of the saved tree names tensor '{key}' "
                                     "(keys are plain values)")


#: a restore's deferred action: makes the value stored in the parent
Thunk = Callable[[], Any]
