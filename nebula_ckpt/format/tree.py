"""Typed JSON for the non-tensor part of a state tree.

Plain JSON loses types (tuples become lists, int keys become strings, ``inf`` is invalid), so
every node is stored as ``{"t": <type>, ...}``. Tensors appear as ``{"t": "tensor", "k": key}``
references into the shard index; objects with ``state_dict()`` as ``{"t": "stateful", ...}``.
A float is its ``float.hex()`` text; a NaN other than ``float("nan")`` also carries its IEEE 754
bits (``"bits"``: a sign or payload ``float.hex()`` drops). Only exact types are stored so: a
subclass (an ``IntEnum``, a ``str`` enum) would come back as its base type and needs pickle.

NumPy values need no pickle: an array of a numeric or bool dtype is stored as a tensor (its
bytes in the shard, checksummed like any tensor) under ``{"t": "ndarray", "dtype": "<f4",
"v": {"t": "tensor", "k": key}}`` and comes back as an array of the same dtype (byte order
included) and shape; a NumPy scalar is ``{"t": "npscalar", "dtype": "<f4", "v": base64 of its
bytes}``. So RNG states (``np.random.get_state()``, ``Generator.bit_generator.state``,
``random.getstate()``, ``torch.get_rng_state()``) round-trip bit-exact without pickle. Object,
string, structured and ``longdouble`` arrays still need ``allow_pickle=True``.

Nothing here ever executes code from a checkpoint: values typed JSON cannot hold are accepted, and
decoded, only with ``allow_pickle=True``. A tree read from storage is checked whole by
:func:`check_tree` (when its manifest is parsed) before :func:`decode` ever sees it.
"""

from __future__ import annotations

import base64
import binascii
import collections
import pickle
import re
import struct
import sys
from typing import Any, Callable, Mapping, Optional

import torch

from nebula_ckpt.errors import CorruptCheckpointError, PickleNotAllowedError, ValidationError
from nebula_ckpt.format.dtypes import DTYPES

Node = dict[str, Any]

#: Deepest tree (containers and stateful objects nested in each other) a checkpoint may hold:
#: the writer's bound (``plan.MAX_DEPTH``), counted the same way. Real state trees are a few
#: levels deep; the bound keeps decoding (one Python frame per level) far from the recursion limit.
MAX_DEPTH = 256
#: Largest int (leaf or dict key) a checkpoint may hold, in bits: the writer refuses larger ones
#: (JSON readers refuse integers of thousands of digits), the reader refuses them too.
MAX_INT_BITS = 4096
#: A ``torch.Size`` dimension is an int64 (``torch.Size`` refuses larger values when decoded).
MAX_DIM = 2**63 - 1
_CONTAINERS = ("dict", "odict", "list", "tuple")

#: NumPy dtype codes (``dtype.str`` without the byte-order character) stored without pickle, and
#: the torch dtype an array of each is stored as.
NUMPY_KINDS: dict[str, torch.dtype] = {
    "b1": torch.bool, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64,
    "u1": torch.uint8, "u2": torch.uint16, "u4": torch.uint32, "u8": torch.uint64,
    "f2": torch.float16, "f4": torch.float32, "f8": torch.float64, "c8": torch.complex64, "c16": torch.complex128,
}
# One-byte codes have no byte order ("|"); the others are little ("<") or big (">") endian.
_NUMPY_CODE_RE = re.compile(r"\|(b1|i1|u1)|[<>](i2|i4|i8|u2|u4|u8|f2|f4|f8|c8|c16)")
_NUMPY_SUPPORTED = "bool, int8-int64, uint8-uint64, float16/32/64, complex64/128"


def numpy_code(dtype: Any) -> Optional[str]:
    """``dtype.str`` (e.g. ``"<f4"``) of a NumPy dtype stored without pickle, else None."""
    code = getattr(dtype, "str", None)
    if type(code) is not str or not _NUMPY_CODE_RE.fullmatch(code) or dtype.fields is not None:
        return None
    return code


def _numpy() -> Any:
    """NumPy, imported on first need (only a checkpoint holding NumPy values needs it)."""
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - numpy is a dependency
        raise CorruptCheckpointError("this checkpoint holds NumPy values: install numpy to read it") from e
    return numpy


def ndarray_from_tensor(t: Any, code: str, path: str) -> Any:
    """The NumPy array an ``ndarray`` node stands for: an owned copy of tensor ``t``'s values as
    dtype ``code`` (its byte order restored). Raises :class:`CorruptCheckpointError` when the
    stored tensor's dtype is not the one ``code`` is stored as."""
    np = _numpy()
    want = NUMPY_KINDS[code[1:]]
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.dtype != want:
        raise CorruptCheckpointError(f"checkpoint key '{path or '<root>'}': a NumPy {code} array is stored as "
                                     f"{want}, but its tensor is {local.dtype}")
    arr = np.array(local.detach().cpu().numpy(), copy=True)  # owned: never a view of shard bytes
    return arr if arr.dtype.str == code else arr.astype(np.dtype(code))


def encode_float(x: float) -> str:
    """Exact text form of a float (``float.hex``), inf and nan included (every NaN is ``"nan"``:
    :func:`nan_bits` keeps which one)."""
    return float(x).hex()


#: The bits of ``float("nan")``: the NaN a float node needs no ``"bits"`` for.
_PLAIN_NAN = 0x7FF8000000000000
_NAN_BITS_RE = re.compile(r"[0-9a-f]{16}")


def nan_bits(x: float) -> Optional[str]:
    """The IEEE 754 bits of ``x`` as 16 lowercase hex digits, most significant first, when ``x``
    is a NaN other than ``float("nan")`` (a sign bit or a payload that ``float.hex`` drops), else None."""
    if x == x:
        return None
    bits: int = struct.unpack("<Q", struct.pack("<d", x))[0]
    return None if bits == _PLAIN_NAN else f"{bits:016x}"


def _from_bits(text: str) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", int(text, 16)))[0]
    return value


def _float_node(x: float) -> Node:
    bits = nan_bits(x)
    return {"t": "float", "v": "nan", "bits": bits} if bits else {"t": "float", "v": encode_float(x)}


def _complex_node(z: complex) -> Node:
    node: Node = {"t": "complex", "v": [encode_float(z.real), encode_float(z.imag)]}
    bits = [nan_bits(z.real), nan_bits(z.imag)]
    if bits != [None, None]:
        node["bits"] = bits
    return node


#: Subclasses of these come back as the base type; the hint says how to convert one.
_EXACT_LEAVES: tuple[tuple[type, str], ...] = (
    (int, "int(x)"), (float, "float(x)"), (complex, "complex(x)"), (str, "str(x)"), (bytes, "bytes(x)"),
    (bytearray, "bytes(x)"),
)


def _lossy_leaf(value: Any, path: str) -> None:
    """Refuse a leaf that typed JSON would bring back as another type: a subclass of int, float,
    complex, str or bytes (an ``IntEnum``, a ``str`` enum) or a ``bytearray``."""
    for base, fix in _EXACT_LEAVES:
        if isinstance(value, base):
            what = ("a bytearray would come back as bytes" if base is bytearray else
                    f"{type(value).__module__}.{type(value).__qualname__} (a subclass of {base.__name__}) would "
                    f"come back as a plain {base.__name__}")
            raise ValidationError(
                f"state key '{path}': {what}; convert it ({fix}), or pass allow_pickle=True to save it with "
                "pickle (loading will then also need allow_pickle=True).")


def encode_leaf(value: Any, path: str, allow_pickle: bool) -> Node:
    """Encode one non-container, non-tensor leaf; raise naming ``path`` when impossible.

    NumPy arrays are tensors (:mod:`nebula_ckpt.save.plan` stores them); a NumPy array reaching this
    function has a dtype that needs pickle.
    """
    if value is None:
        return {"t": "none"}
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic) and numpy_code(value.dtype) is not None:
        return {"t": "npscalar", "dtype": value.dtype.str, "v": base64.b64encode(value.tobytes()).decode("ascii")}
    # Exact types only: a subclass (an IntEnum, a str enum) would come back as its base type.
    tp = type(value)
    if tp is bool:
        return {"t": "bool", "v": value}
    if tp is int:
        return {"t": "int", "v": check_int(value, path)}
    if tp is float:
        return _float_node(value)
    if tp is complex:
        return _complex_node(value)
    if tp is str:
        return {"t": "str", "v": value}
    if tp is bytes:
        return {"t": "bytes", "v": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"t": "device", "v": str(value)}
    if np is not None and isinstance(value, np.ndarray) and not allow_pickle:
        raise ValidationError(
            f"state key '{path}': a NumPy array of dtype {value.dtype} ({type(value).__name__}) is stored without "
            f"pickle only as a plain ndarray of a numeric or bool dtype ({_NUMPY_SUPPORTED}); convert it "
            "(e.g. np.asarray(x).astype(np.float64)), or pass allow_pickle=True to save it with pickle "
            "(loading will then also need allow_pickle=True).")
    if not allow_pickle:
        _lossy_leaf(value, path)
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
        "torch.dtype, torch.device, dict, list, tuple, tensors, numeric NumPy arrays and scalars, and "
        "objects with state_dict()). "
        "Convert it, or pass allow_pickle=True to save it with pickle (loading will then also "
        "need allow_pickle=True).")


def check_int(value: int, path: str) -> int:
    """``value`` if it has at most :data:`MAX_INT_BITS` bits, else a :class:`ValidationError`
    naming ``path`` (a leaf or dict key being saved)."""
    if value.bit_length() > MAX_INT_BITS:
        raise ValidationError(f"state key '{path or '<root>'}': int with {value.bit_length()} bits is too "
                              f"large to store (limit {MAX_INT_BITS} bits); store it as str or bytes")
    return value


def decode(node: Mapping[str, Any], tensor: Callable[[str], Any], allow_pickle: bool, path: str = "") -> Any:
    """Rebuild a value from its typed JSON; ``tensor(key)`` supplies tensor leaves.

    ``node`` must have passed :func:`check_tree` (every tree of a parsed manifest has). The nodes
    naming one stored tensor as one NumPy dtype give one array: memory is bounded by the bytes stored.

    Raises:
        PickleNotAllowedError: a pickled leaf without ``allow_pickle=True``.
    """
    return _Decoder(tensor, allow_pickle).decode(node, path)


class _Decoder:
    """One :func:`decode`: its NumPy arrays by (tensor key, dtype code)."""

    def __init__(self, tensor: Callable[[str], Any], allow_pickle: bool) -> None:
        self.tensor, self.allow_pickle = tensor, allow_pickle
        self.arrays: dict[tuple[str, str], Any] = {}

    def decode(self, node: Mapping[str, Any], path: str) -> Any:
        t = node["t"]
        if t == "dict" or t == "odict":
            items = []
            for k_node, v_node in node["v"]:
                k = self.decode(k_node, path)
                items.append((k, self.decode(v_node, f"{path}/{k}" if path else str(k))))
            return collections.OrderedDict(items) if t == "odict" else dict(items)
        if t == "list":
            return [self.decode(v, f"{path}/{i}") for i, v in enumerate(node["v"])]
        if t == "tuple":
            return tuple(self.decode(v, f"{path}/{i}") for i, v in enumerate(node["v"]))
        if t == "size":
            return torch.Size(node["v"])
        if t == "tensor":
            return self.tensor(node["k"])
        if t == "ndarray":
            key = (node["v"]["k"], node["dtype"])
            if key not in self.arrays:
                self.arrays[key] = ndarray_from_tensor(self.tensor(key[0]), key[1], path)
            return self.arrays[key]
        if t == "npscalar":
            np = _numpy()
            return np.frombuffer(base64.b64decode(node["v"]), dtype=np.dtype(node["dtype"]))[0]
        if t == "stateful":
            return self.decode(node["state"], path)
        if t == "none":
            return None
        if t in ("bool", "int", "str"):
            return node["v"]
        if t == "float":
            return _from_bits(node["bits"]) if "bits" in node else float.fromhex(node["v"])
        if t == "complex":
            parts = node.get("bits", (None, None))
            re_im = [float.fromhex(v) if b is None else _from_bits(b) for v, b in zip(node["v"], parts, strict=True)]
            return complex(re_im[0], re_im[1])
        if t == "bytes":
            return base64.b64decode(node["v"])
        if t == "dtype":
            return DTYPES[node["v"]]
        if t == "device":
            return torch.device(node["v"])
        if t == "pickle":
            if not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"checkpoint key '{path}' holds a pickled {node.get('type', 'object')}; loading it "
                    "would execute code from the checkpoint. Pass allow_pickle=True only if you trust it.")
            return pickle.loads(base64.b64decode(node["v"]))  # noqa: S301 - explicitly allowed by the caller
        raise CorruptCheckpointError(f"tree node '{path or '<root>'}': unknown node type {t!r} "
                                     "(checkpoint from a newer nebula_ckpt?)")


def merged(trees: list[Mapping[str, Any]]) -> Mapping[str, Any]:
    """One tree holding what each of ``trees`` holds (the ranks' trees of a job, lowest rank
    first): dicts of one kind are merged key by key (in first-seen order), anything else is the
    first tree's (so a value several ranks hold, a pipeline stage's or a per-rank one, is the
    lowest rank's)."""
    first = trees[0]
    if len(trees) == 1 or first["t"] not in ("dict", "odict") or any(t["t"] != first["t"] for t in trees):
        return first
    return {"t": first["t"], "v": [[k_node, merged(nodes)] for k_node, nodes in _by_key(trees)]}


def held_by_some(trees: list[Mapping[str, Any]], path: str = "") -> set[str]:
    """The paths (``a/b``, keys decoded) of :func:`merged` ``trees`` that some of the trees holding
    their dict lack: a pipeline stage's keys, which a restore of another stage does not take."""
    if len(trees) < 2 or any(t["t"] not in ("dict", "odict") for t in trees):
        return set()
    out: set[str] = set()
    for k_node, nodes in _by_key(trees):
        key = decode(k_node, _no_tensor_key, False, path)
        sub = f"{path}/{key}" if path else str(key)
        if len(nodes) < len(trees):
            out.add(sub)
        out |= held_by_some(nodes, sub)
    return out


def _by_key(trees: list[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], list[Mapping[str, Any]]]]:
    """The keys of dict nodes ``trees`` in first-seen order, each with its value in every tree holding it."""
    groups: dict[str, tuple[Mapping[str, Any], list[Mapping[str, Any]]]] = {}
    for tree in trees:
        for k_node, v_node in tree["v"]:
            groups.setdefault(repr(sorted(k_node.items())), (k_node, []))[1].append(v_node)
    return list(groups.values())


def _no_tensor_key(key: str) -> Any:
    raise CorruptCheckpointError(f"a dict key of the saved tree names tensor '{key}' (keys are plain values)")


def _fail(where: str, path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: node '{path or '<root>'}': {what}")


def _b64(v: Any) -> bool:
    try:
        base64.b64decode(v, validate=True)
        return True
    except (binascii.Error, ValueError, TypeError):
        return False


def _hex(v: Any) -> bool:
    """Whether ``v`` is a float exactly as the writer writes it (``float.hex()``: one text per value,
    none that overflows or rounds)."""
    try:
        return type(v) is str and float.fromhex(v).hex() == v
    except (ValueError, TypeError, OverflowError):
        return False


def _device(v: Any) -> bool:
    """Whether ``v`` is a device string as the writer writes it (``str(torch.device)``): torch
    parses other spellings into other devices (``"cuda:128"`` reads as a negative index)."""
    try:
        return type(v) is str and str(torch.device(v)) == v
    except (RuntimeError, TypeError, ValueError):
        return False


def _int_ok(v: Any) -> bool:
    return type(v) is int and v.bit_length() <= MAX_INT_BITS


def _size_ok(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and 0 <= x <= MAX_DIM for x in v)


_LEAF_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: type(v) is bool, "a JSON boolean"),
    "int": (_int_ok, f"a JSON integer of at most {MAX_INT_BITS} bits"),
    "str": (lambda v: type(v) is str, "a string"),
    "float": (_hex, "a float.hex() string of a float"),
    "complex": (lambda v: type(v) is list and len(v) == 2 and all(_hex(x) for x in v),
                "two float.hex() strings of floats"),
    "bytes": (lambda v: type(v) is str and _b64(v), "base64 text"),
    "pickle": (lambda v: type(v) is str and _b64(v), "base64 text"),
    "dtype": (lambda v: type(v) is str and v in DTYPES, "a torch dtype name"),
    "device": (_device, "a torch device string as str(torch.device) gives it"),
    "size": (_size_ok, "a list of non-negative int64 dimensions"),
}


def check_tree(tree: Any, tensor_keys: Mapping[str, Optional[str]], where: str) -> None:
    """Check a whole typed-JSON tree in one pass, without recursion.

    Args:
        tree: the ``tree`` of a manifest, as loaded from JSON.
        tensor_keys: the keys ``{"t": "tensor"}`` nodes may name (stored tensors and aliases),
            each with the dtype name of its stored tensor (None: not one dtype; no NumPy array
            may then be stored in it).
        where: names the manifest in errors.

    Raises:
        CorruptCheckpointError: naming the path in the tree of the first malformed node: unknown
            node type, missing or ill-typed field, a value the writer never writes (see
            ``_LEAF_CHECKS``), a tensor reference to a key that does not exist, a NumPy array
            over a tensor of another dtype, a dict key that is not a str/int node, or nesting
            deeper than :data:`MAX_DEPTH`.
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
        elif t == "ndarray":
            code = _check_numpy_code(node, where, path)
            inner = node.get("v")
            if type(inner) is not dict or inner.get("t") != "tensor" or type(inner.get("k")) is not str \
                    or inner["k"] not in tensor_keys:
                raise _fail(where, path, f"an 'ndarray' node needs 'v' as a tensor reference to a tensor of the "
                            f"manifest, got {_kind(inner)}")
            stored = tensor_keys[inner["k"]]
            if stored is None or DTYPES.get(stored) != NUMPY_KINDS[code[1:]]:
                raise _fail(where, path, f"a NumPy {code} array is stored as {NUMPY_KINDS[code[1:]]}, but its tensor "
                            f"{inner['k'][:80]!r} is {stored or 'of other dtypes on the ranks sharing this tree'}")
        elif t == "npscalar":
            code = _check_numpy_code(node, where, path)
            v = node.get("v")
            size = int(code[2:])
            if type(v) is not str or not _b64(v) or len(base64.b64decode(v)) != size:
                raise _fail(where, path, f"an 'npscalar' node of dtype {code} needs 'v' as base64 text of "
                            f"{size} bytes, got {_kind(v)}")
        elif t in _LEAF_CHECKS:
            ok, want = _LEAF_CHECKS[t]
            if "v" not in node or not ok(node["v"]):
                raise _fail(where, path, f"a {t!r} node needs 'v' as {want}, got {_kind(node.get('v'))}")
            if "bits" in node and t in ("float", "complex"):
                _check_nan_bits(node, where, path)
        elif t != "none":
            raise _fail(where, path, f"unknown node type {t[:40]!r} (checkpoint from a newer nebula_ckpt?)")


def _nan_bits_ok(v: Any, text: Any) -> bool:
    """Whether ``v`` is the ``"bits"`` of a NaN exactly as the writer writes them (:func:`nan_bits`)
    for the float text ``text``: 16 lowercase hex digits of a NaN other than ``float("nan")``."""
    return type(v) is str and _NAN_BITS_RE.fullmatch(v) is not None and text == "nan" \
        and nan_bits(_from_bits(v)) == v


def _check_nan_bits(node: Node, where: str, path: str) -> None:
    """The ``"bits"`` of a float node (one NaN's bits) or a complex node (one per part, null for a
    part that needs none, not both null)."""
    bits, v = node["bits"], node["v"]
    if node["t"] == "float":
        if not _nan_bits_ok(bits, v):
            raise _fail(where, path, "a 'float' node's 'bits' must be 16 lowercase hex digits of a NaN other "
                        f"than float('nan'), with 'v' \"nan\", got {_kind(bits)}")
        return
    if type(bits) is not list or len(bits) != 2 or bits == [None, None] \
            or not all(b is None or _nan_bits_ok(b, x) for b, x in zip(bits, v, strict=True)):
        raise _fail(where, path, "a 'complex' node's 'bits' must be a list of two entries, each null or 16 "
                    "lowercase hex digits of a NaN other than float('nan') (its part \"nan\"), not both null, "
                    f"got {_kind(bits)}")


def _check_numpy_code(node: Node, where: str, path: str) -> str:
    code = node.get("dtype")
    if type(code) is not str or not _NUMPY_CODE_RE.fullmatch(code):
        raise _fail(where, path, f"a {node['t']!r} node needs 'dtype' as a NumPy dtype code of "
                    f"{_NUMPY_SUPPORTED} (e.g. '<f4', '|b1'), got {_kind(code)}")
    return code


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
        if not (k["t"] == "str" or _int_ok(k["v"])):
            raise _fail(where, path, f"dict item {i}: an int key must have at most {MAX_INT_BITS} bits, "
                        f"got one of {k['v'].bit_length()} bits")
        if k["v"] in seen:
            raise _fail(where, path, f"dict key {str(k['v'])[:80]!r} occurs twice")
        seen.add(k["v"])
        out.append((pair[1], f"{prefix}{k['v']}", depth + 1))
    return out
