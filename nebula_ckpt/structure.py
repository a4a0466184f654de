"""Typed JSON for the non-tensor part of a state tree.

Plain JSON loses types (tuples become lists, int keys become strings, ``inf`` is invalid), so
every node is stored as ``{"t": <type>, ...}``. Tensors appear as ``{"t": "tensor", "k": key}``
references into the shard index; objects with ``state_dict()`` as ``{"t": "stateful", ...}``.

Nothing here ever executes code from a checkpoint: values that typed JSON cannot hold are only
accepted with ``allow_pickle=True``, and decoding them again requires ``allow_pickle=True``.
A tree read from storage is checked whole by :func:`check_tree` (when its manifest is parsed)
before :func:`decode` ever sees it.
"""

from __future__ import annotations

import base64
import binascii
import collections
import pickle
from typing import Any, Callable, Mapping

import torch

from .errors import CorruptCheckpointError, PickleNotAllowedError, ValidationError
from .manifest import DTYPES

Node = dict[str, Any]

#: Deepest tree (containers and stateful objects nested in each other) a checkpoint may hold:
#: the writer's bound (``plan.MAX_DEPTH``), counted the same way. Real state trees are a few
#: levels deep; the bound keeps decoding (one Python frame per level) far from the recursion limit.
MAX_DEPTH = 256
_CONTAINERS = ("dict", "odict", "list", "tuple")


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


def decode(node: Mapping[str, Any], tensor: Callable[[str], Any], allow_pickle: bool, path: str = "") -> Any:
    """Rebuild a value from its typed JSON; ``tensor(key)`` supplies tensor leaves.

    ``node`` must have passed :func:`check_tree` (every tree of a parsed manifest has).

    Raises:
        PickleNotAllowedError: a pickled leaf without ``allow_pickle=True``.
    """
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
        return DTYPES[node["v"]]
    if t == "device":
        return torch.device(node["v"])
    if t == "pickle":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"checkpoint key '{path}' holds a pickled {node.get('type', 'object')}; loading it "
                "would execute code from the checkpoint. Pass allow_pickle=True only if you trust it.")
        return pickle.loads(base64.b64decode(node["v"]))  # noqa: S301 - explicitly allowed by the caller
    raise CorruptCheckpointError(f"tree node '{path or '<root>'}': unknown node type {t!r} "
                                 "(checkpoint from a newer nebula_ckpt?)")


def _fail(where: str, path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: node '{path or '<root>'}': {what}")


def _b64(v: Any) -> bool:
    try:
        base64.b64decode(v, validate=True)
        return True
    except (binascii.Error, ValueError, TypeError):
        return False


def _hex(v: Any) -> bool:
    try:
        float.fromhex(v)
        return True
    except (ValueError, TypeError):
        return False


def _device(v: Any) -> bool:
    try:
        torch.device(v)
        return type(v) is str
    except (RuntimeError, TypeError, ValueError):
        return False


_LEAF_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: type(v) is bool, "a JSON boolean"),
    "int": (lambda v: type(v) is int, "a JSON integer"),
    "str": (lambda v: type(v) is str, "a string"),
    "float": (lambda v: type(v) is str and _hex(v), "a float.hex() string"),
    "complex": (lambda v: type(v) is list and len(v) == 2 and all(type(x) is str and _hex(x) for x in v),
                "two float.hex() strings"),
    "bytes": (lambda v: type(v) is str and _b64(v), "base64 text"),
    "pickle": (lambda v: type(v) is str and _b64(v), "base64 text"),
    "dtype": (lambda v: type(v) is str and v in DTYPES, "a torch dtype name"),
    "device": (_device, "a torch device string"),
    "size": (lambda v: type(v) is list and all(type(x) is int and x >= 0 for x in v),
             "a list of non-negative integers"),
}


def check_tree(tree: Any, tensor_keys: "set[str] | frozenset[str]", where: str) -> None:
    """Check a whole typed-JSON tree in one pass, without recursion.

    Args:
        tree: the ``tree`` of a manifest, as loaded from JSON.
        tensor_keys: the keys ``{"t": "tensor"}`` nodes may name (stored tensors and aliases).
        where: names the manifest in errors.

    Raises:
        CorruptCheckpointError: naming the path in the tree of the first malformed node: unknown
            node type, missing or ill-typed field, bad base64 / hex float / dtype / device, a
            tensor reference to a key that does not exist, a dict key that is not a str/int
            node, or nesting deeper than :data:`MAX_DEPTH`.
    """
    stack: list[tuple[Any, str, int]] = [(tree, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if type(node) is not dict or type(node.get("t")) is not str:
            raise _fail(where, path, f"a node must be a JSON object with a string 't', got {_kind(node)}")
        t = node["t"]
        if t in _CONTAINERS or t == "stateful":
            if depth >= MAX_DEPTH:
                raise _fail(where, path, f"nested deeper than {MAX_DEPTH} levels")
            stack.extend(_children(node, t, path, depth, where))
        elif t == "tensor":
            if type(node.get("k")) is not str or node["k"] not in tensor_keys:
                raise _fail(where, path, f"tensor reference {str(node.get('k'))[:80]!r} names no "
                            "tensor of the manifest")
        elif t in _LEAF_CHECKS:
            ok, want = _LEAF_CHECKS[t]
            if "v" not in node or not ok(node["v"]):
                raise _fail(where, path, f"a {t!r} node needs 'v' as {want}, got {_kind(node.get('v'))}")
        elif t != "none":
            raise _fail(where, path, f"unknown node type {t[:40]!r} (checkpoint from a newer nebula_ckpt?)")


def _kind(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _children(node: Node, t: str, path: str, depth: int, where: str) -> list[tuple[Any, str, int]]:
    """The sub-nodes of a container or stateful node, with their paths."""
    if t == "stateful":
        if "state" not in node or ("cls" in node and type(node["cls"]) is not str):
            raise _fail(where, path, "a 'stateful' node needs 'state' (and 'cls' as a string)")
        return [(node["state"], path, depth + 1)]
    items = node.get("v")
    if type(items) is not list:
        raise _fail(where, path, f"a {t!r} node needs 'v' as a JSON list, got {_kind(items)}")
    prefix = f"{path}/" if path else ""
    if t in ("list", "tuple"):
        return [(v, f"{prefix}{i}", depth + 1) for i, v in enumerate(items)]
    out, seen = [], set()
    for i, pair in enumerate(items):
        if type(pair) is not list or len(pair) != 2:
            raise _fail(where, path, f"dict item {i} must be a [key, value] pair, got {_kind(pair)}")
        k = pair[0]
        if type(k) is not dict or (k.get("t"), type(k.get("v"))) not in (("str", str), ("int", int)):
            raise _fail(where, path, f"dict item {i}: a key must be a str or int node, got {_kind(k)}")
        if k["v"] in seen:
            raise _fail(where, path, f"dict key {str(k['v'])[:80]!r} occurs twice")
        seen.add(k["v"])
        out.append((pair[1], f"{prefix}{k['v']}", depth + 1))
    return out
