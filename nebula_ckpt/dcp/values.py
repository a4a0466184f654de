"""Keys and values of a DCP save: FQNs to manifest keys, non-tensor values to typed JSON.

DCP flattens a nested state dict to dotted FQNs and records each one's path (``planner_data``);
the manifest key of an FQN is its path joined with ``/``. Values DCP serialises with
``torch.save`` (``BYTE_IO`` items) are stored as typed JSON when they are plain, with pickle only
when the writer allows it (:mod:`nebula_ckpt.dcp.writer`).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from nebula_ckpt.errors import NebulaError, ValidationError
from nebula_ckpt.format.header import RESERVED_KEYS
from nebula_ckpt.format.tree import MAX_DEPTH, MAX_INT_BITS, Node, decode, encode_leaf


def fqn_paths(planner_data: Any) -> dict[str, tuple[Any, ...]]:
    """FQN -> its path in the nested state dict (DCP's flattening mappings), when there are any."""
    if not isinstance(planner_data, dict):
        return {}
    return {k: tuple(v) for k, v in planner_data.items() if isinstance(k, str) and isinstance(v, (tuple, list)) and v}


def manifest_key(fqn: str, paths: dict[str, tuple[Any, ...]]) -> str:
    return "/".join(str(p) for p in paths.get(fqn, (fqn,)))


def check_keys(fqns: list[str], paths: dict[str, tuple[Any, ...]]) -> None:
    """Every FQN gets a distinct, storable manifest key (raised before anything is written)."""
    seen: dict[str, str] = {}
    for fqn in fqns:
        key = manifest_key(fqn, paths)
        if not key or key in RESERVED_KEYS:
            raise ValidationError(f"NebulaStorageWriter: state key '{fqn}' maps to the key {key!r}, which the "
                                  "format cannot store (empty, or reserved by safetensors); rename it")
        other = seen.setdefault(key, fqn)
        if other != fqn:
            raise ValidationError(f"NebulaStorageWriter: state keys '{other}' and '{fqn}' both become '{key}' "
                                  "(paths are joined with '/'): rename one of them")


class _NotPlain(Exception):
    """A value typed JSON cannot hold (the message says why)."""


def _encode_plain(value: Any, path: str, depth: int = 0) -> Node:
    """Typed JSON of a plain value (no tensors, no pickle); :class:`_NotPlain` otherwise."""
    if depth > MAX_DEPTH:
        raise _NotPlain(f"nested more than {MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        raise _NotPlain("it holds a tensor")
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if type(k) is str:
                kn: Node = {"t": "str", "v": k}
            elif type(k) is int and k.bit_length() <= MAX_INT_BITS:
                kn = {"t": "int", "v": k}
            else:
                raise _NotPlain(f"dict key {k!r} of type {type(k).__name__}")
            items.append([kn, _encode_plain(v, f"{path}/{k}", depth + 1)])
        return {"t": "odict" if type(value) is not dict else "dict", "v": items}
    if isinstance(value, torch.Size):
        return {"t": "size", "v": list(value)}
    if type(value) in (list, tuple):
        return {"t": "list" if type(value) is list else "tuple",
                "v": [_encode_plain(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, (list, tuple)):
        raise _NotPlain(f"{type(value).__name__} (a subclass of list / tuple) would come back as a plain one")
    if type(value) is int and value.bit_length() > MAX_INT_BITS:
        raise _NotPlain(f"an int of {value.bit_length()} bits")
    try:
        return encode_leaf(value, path, False)
    except ValidationError:
        raise _NotPlain(f"a value of type {type(value).__module__}.{type(value).__qualname__}") from None


def encode_value(fqn: str, data: Any, allow_pickle: bool) -> Node:
    """The typed-JSON node of a DCP bytes item (``torch.save`` bytes of the value)."""
    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:
        if not allow_pickle:
            raise ValidationError(
                f"NebulaStorageWriter: state key '{fqn}' is not a plain value (torch.load(weights_only=True) "
                f"refuses it: {type(e).__name__}: {str(e)[:200]}); typed JSON cannot hold it. Convert it, or pass "
                "NebulaStorageWriter(..., allow_pickle=True) to store it with pickle (reading it back will need "
                "allow_pickle=True too)") from None
        # our own bytes, made from the live object a moment ago in this process
        value = torch.load(io.BytesIO(raw), weights_only=False)
    try:
        return _encode_plain(value, fqn)
    except _NotPlain as why:
        if not allow_pickle:
            raise ValidationError(
                f"NebulaStorageWriter: state key '{fqn}' cannot be stored as typed JSON ({why}). Convert it, or "
                "pass NebulaStorageWriter(..., allow_pickle=True) to store it with pickle (reading it back will "
                "need allow_pickle=True too)") from None
        return encode_leaf(value, fqn, True)



def decoded(node: Node) -> Any:
    """The python value of a typed-JSON value node (pickled leaves stay undecoded: None)."""
    try:
        return decode(node, lambda k: None, False)
    except NebulaError:
        return None
