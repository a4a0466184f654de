"""Typed JSON for the non-tensor part of a state tree.

Plain JSON loses types (tuples become lists, int keys become strings, ``inf`` is invalid), so
every node is stored as ``{"t": <type>, ...}``. Tensors appear as ``{"t": "tensor", "k": key}``
references into the shard index; objects with ``state_dict()`` as ``{"t": "stateful", ...}``.

Nothing here ever executes code from a checkpoint: values that typed JSON cannot hold are only
accepted with ``allow_pickle=True``, and decoding them again requires ``allow_pickle=True``.
"""

from __future__ import annotations

import base64
import collections
import pickle
from typing import Any, Callable

import torch

from .errors import PickleNotAllowedError, ValidationError

Node = dict[str, Any]

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def encode_float(x: float) -> str:
    """Exact text form of a float (``float.hex``), inf and nan included."""
    return float(x).hex()


def encode_leaf(value: Any, path: str, allow_pickle: bool) -> Node:
    """Encode one non-container, non-tensor leaf; raise naming ``path`` when impossible."""
    if value is None:
        return {"t": "none"}
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    if isinstance(value, int):
        return {"t": "int", "v": int(value)}
    if isinstance(value, float):
        return {"t": "float", "v": encode_float(value)}
    if isinstance(value, complex):
        return {"t": "complex", "v": [encode_float(value.real), encode_float(value.imag)]}
    if isinstance(value, str):
        return {"t": "str", "v": value}
    if isinstance(value, (bytes, bytearray)):
        return {"t": "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"t": "device", "v": str(value)}
    if allow_pickle:
        try:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise ValidationError(f"state key '{path}': value of type {type(value).__name__} "
                                  f"cannot be pickled either: {e}") from e
        return {"t": "pickle", "v": base64.b64encode(blob).decode("ascii"),
                "type": f"{type(value).__module__}.{type(value).__qualname__}"}
    raise ValidationError(
        f"state key '{path}': a value of type {type(value).__module__}.{type(value).__qualname__} "
        "cannot be stored as typed JSON (supported: None, bool, int, float, complex, str, bytes, "
        "torch.dtype, torch.device, dict, list, tuple, tensors and objects with state_dict()). "
        "Convert it, or pass allow_pickle=True to save it with pickle (loading will then also "
        "need allow_pickle=True).")


def decode(node: Node, tensor: Callable[[str], Any], allow_pickle: bool, path: str = "") -> Any:
    """Rebuild a value from its typed JSON; ``tensor(key)`` supplies tensor leaves."""
    t = node["t"]
    if t == "dict" or t == "odict":
        items = []
        for k_node, v_node in node["v"]:
            k = decode(k_node, tensor, allow_pickle, path)
            items.append((k, decode(v_node, tensor, allow_pickle, f"{path}/{k}" if path else str(k))))
        return collections.OrderedDict(items) if t == "odict" else dict(items)
    if t == "list":
        return [decode(v, tensor, allow_pickle, f"{path}/{i}") for i, v in enumerate(node["v"])]
    if t == "tuple":
        return tuple(decode(v, tensor, allow_pickle, f"{path}/{i}") for i, v in enumerate(node["v"]))
    if t == "size":
        return torch.Size(node["v"])
    if t == "tensor":
        return tensor(node["k"])
    if t == "stateful":
        return decode(node["state"], tensor, allow_pickle, path)
    if t == "none":
        return None
    if t in ("bool", "int", "str"):
        return node["v"]
    if t == "float":
        return float.fromhex(node["v"])
    if t == "complex":
        return complex(float.fromhex(node["v"][0]), float.fromhex(node["v"][1]))
    if t == "bytes":
        return base64.b64decode(node["v"])
    if t == "dtype":
        return _DTYPES[node["v"]]
    if t == "device":
        return torch.device(node["v"])
    if t == "pickle":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"checkpoint key '{path}' holds a pickled {node.get('type', 'object')}; loading it "
                "would execute code from the checkpoint. Pass allow_pickle=True only if you trust it.")
        return pickle.loads(base64.b64decode(node["v"]))  # noqa: S301 - explicitly allowed by the caller
    raise ValueError(f"unknown node type {t!r} at '{path}' (checkpoint from a newer nebula_ckpt?)")

