"""DCP's flattened names of a saved tree (``"model.0.weight"``, ``"optim.param_groups.0.lr"``).

The reader (:class:`nebula_ckpt.restore.dcp_reader.NebulaStorageReader`) exposes every tensor and plain
value of a checkpoint under the names DCP's own flattening gives a nested state dict, so nested
state dicts load directly. Values stored with pickle are only exposed with ``allow_pickle``.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.tree import decode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExposedValue:
    """A non-tensor value of a saved tree (wrapped, so a str value is never taken for a key)."""

    value: Any


#: stands in for a pickled leaf when DCP names are derived without allow_pickle
_PICKLE_MARK = f"\0nebula_ckpt pickled value {uuid.uuid4().hex}\0"


def _without_pickles(tree: Mapping[str, Any]) -> Mapping[str, Any]:
    """A copy of ``tree`` whose pickled leaves are replaced by a marker (they are not exposed)."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("t") == "pickle":
                return {"t": "str", "v": _PICKLE_MARK}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out: Mapping[str, Any] = walk(tree)
    return out


def _holds(value: Any, marks: Mapping[int, str]) -> bool:
    """Whether ``value`` holds a tensor or a pickled leaf (such values are not exposed)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor) or (isinstance(v, str) and v == _PICKLE_MARK):
            return True
        if isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return False


def dcp_names(man: mf.Manifest, allow_pickle: bool, where: str) -> dict[str, Any]:
    """DCP's flattened name -> logical tensor key (str) or :class:`ExposedValue` value, from the
    saved trees (lowest rank first). Empty when DCP's flattening is unavailable."""
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # private API of DCP: without it, only the saved keys are exposed
        return {}
    trees: list[Mapping[str, Any]] = []
    if man.multi_rank:
        seen: set[int] = set()
        for r in sorted(man.ranks):
            if man.rank_tree[r] not in seen:
                seen.add(man.rank_tree[r])
                trees.append(man.rank_tree_of(r))
    else:
        trees.append(man.tree)
    from nebula_ckpt.restore.walk import tensor_keys

    out: dict[str, Any] = {}
    named: set[str] = set()
    for n, tree in enumerate(trees):
        if n and named.issuperset(tensor_keys(tree, [])):
            continue  # another rank's tree with the same tensors: its values are not the lowest rank's
        marks: dict[int, str] = {}
        keep: list[torch.Tensor] = []

        def mark(key: str, marks: dict[int, str] = marks, keep: list[torch.Tensor] = keep) -> torch.Tensor:
            t = torch.empty(0)
            keep.append(t)
            marks[id(t)] = key
            return t

        try:
            value = decode(_without_pickles(tree) if not allow_pickle else tree, mark, allow_pickle)
            if not isinstance(value, Mapping):
                continue
            flat, _ = flatten_state_dict(dict(value))
        except Exception as e:  # duplicate flattened names etc.: expose the saved keys only
            log.info("nebula_ckpt: %s: DCP-style names not exposed (%s: %s)", where, type(e).__name__, e)
            continue
        for fqn, v in flat.items():
            if fqn in out:
                continue
            if isinstance(v, torch.Tensor):
                if id(v) in marks:
                    out[fqn] = marks[id(v)]
                    named.add(marks[id(v)])
            elif not _holds(v, marks):
                out[fqn] = ExposedValue(v)
    return out
