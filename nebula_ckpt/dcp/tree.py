"""The typed tree of a DCP save, rebuilt from the paths DCP's flattening records.

Every stored item is inserted at its path (:func:`insert`); :func:`optimizer_keys` gives a
``torch.optim`` state dict's ``state`` its int keys back (DCP turns every dict key into a
string); :func:`to_node` is the typed-JSON tree of the manifest.
"""

from __future__ import annotations

from typing import Any, Optional

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.tree import Node


class Box:
    """A container being rebuilt from paths: ``kind`` "dict" or "list", children by key / index."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.items: dict[Any, Any] = {}     # key -> Box or a leaf (node, value)


Leaf = tuple[Node, Any]   # (typed-JSON node, python value for values / None for tensors)


def insert(root: Box, path: tuple[Any, ...], leaf: Leaf, fqn: str) -> None:
    box = root
    for i, part in enumerate(path):
        last = i == len(path) - 1
        want = "list" if type(part) is int else "dict"
        if box.kind != want:
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': its path {list(path)} mixes list "
                                  "indices and dict keys at one level")
        if last:
            if part in box.items:
                raise ValidationError(f"NebulaStorageWriter: state key '{fqn}' occurs twice in the state")
            box.items[part] = leaf
            return
        nxt = box.items.get(part)
        if nxt is None:
            nxt = box.items[part] = Box("list" if type(path[i + 1]) is int else "dict")
        elif not isinstance(nxt, Box):
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}' lies under another value's key")
        box = nxt


def _params_of(groups: Any) -> Optional[list[Any]]:
    """The ``params`` of every ``param_groups`` entry (a torch.optim state dict), or None."""
    if not isinstance(groups, Box) or groups.kind != "list" or not groups.items:
        return None
    out: list[Any] = []
    for g in groups.items.values():
        params = g.items.get("params") if isinstance(g, Box) and g.kind == "dict" else None
        if params is None or isinstance(params, Box):
            return None
        value = params[1]
        if not isinstance(value, list):
            return None
        out.extend(value)
    return out


def optimizer_keys(box: Box) -> None:
    """Give a torch.optim state dict's ``state`` its int keys back (DCP made them strings), and
    its ``state`` back when it was empty (DCP stores no item for an empty dict)."""
    for child in box.items.values():
        if isinstance(child, Box):
            optimizer_keys(child)
    if box.kind != "dict":
        return
    params = _params_of(box.items.get("param_groups"))
    if params is None:
        return
    state = box.items.get("state")
    if state is None:
        new = Box("dict")
        box.items = {"state": new, **box.items}
        return
    if not isinstance(state, Box) or state.kind != "dict":
        return
    ints = {str(p): p for p in params if type(p) is int}
    if ints and state.items and all(type(k) is str and k in ints for k in state.items):
        state.items = {ints[k]: v for k, v in state.items.items()}


def to_node(box: Box) -> Node:
    if box.kind == "list":
        n = max(box.items) + 1 if box.items else 0
        return {"t": "list", "v": [_child(box.items[i]) if i in box.items else {"t": "none"} for i in range(n)]}
    return {"t": "dict", "v": [[{"t": "int" if type(k) is int else "str", "v": k}, _child(v)]
                               for k, v in box.items.items()]}


def _child(v: Any) -> Node:
    return to_node(v) if isinstance(v, Box) else v[0]
