"""What a save accepts reads back as the type saved, and floats keep their bits.

* A subclass of a type typed JSON stores (a ``Counter`` or ``defaultdict``, an ``IntEnum`` leaf or
  dict key, a ``str`` enum, a ``bytearray``) would come back as the base type: the save refuses it
  before anything is written, naming the key, the type and the fix; with ``allow_pickle=True`` it
  is pickled and comes back as saved. What is supported keeps its type (bool, OrderedDict, NumPy
  scalars, dtypes, devices, sizes, parameters, objects with ``state_dict()``).
* A float NaN keeps its sign bit and payload (as a complex part too).
* The plan cache (a later save of a state of the same structure) refuses a leaf that became
  such a subclass, and writes a leaf that went from one NaN to another with its new bits.
"""

from __future__ import annotations

import collections
import enum
import json
import os
import struct
from typing import Any

import numpy as np
import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.native import native_available


class Phase(enum.IntEnum):
    WARMUP = 0
    DECAY = 1


class Mode(str, enum.Enum):
    TRAIN = "train"


class Meters(list):  # type: ignore[type-arg]
    pass


class Ordered(collections.OrderedDict):  # type: ignore[type-arg]
    pass


class Scale(float):
    pass


class WithState(dict):  # type: ignore[type-arg]
    """A dict subclass with state_dict(): saved through it, as any object with state_dict()."""

    def state_dict(self) -> dict[str, Any]:
        return {"n": len(self)}


def _bits(x: float) -> str:
    return struct.pack(">d", x).hex()


def _float(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value


NEG_NAN = -float("nan")
PAYLOAD_NAN = _float(0x7FF8000000000BAD)
SIGNALING_NAN = _float(0x7FF0000000000001)
NEG_PAYLOAD_NAN = _float(0xFFF4000000C0FFEE)


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for dp, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(dp, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dp, f), path)] = fh.read()
    return out


# (id, value under key "v", text the error names besides the key: the type and the fix)
SUBCLASSES: list[tuple[str, Any, tuple[str, ...]]] = [
    ("counter", collections.Counter({"seen": 3}), ("collections.Counter", "dict(x)")),
    ("defaultdict", collections.defaultdict(int, {"seen": 3}), ("collections.defaultdict", "dict(x)")),
    ("odict_subclass", Ordered(a=1), ("Ordered", "OrderedDict(x)")),
    ("list_subclass", Meters([1, 2]), ("Meters", "list(x)")),
    ("intenum", Phase.DECAY, ("Phase", "int(x)")),
    ("str_enum", Mode.TRAIN, ("Mode", "str(x)")),
    ("float_subclass", Scale(0.5), ("Scale", "float(x)")),
    ("bytearray", bytearray(b"\x01\x02"), ("bytearray", "bytes(x)")),
    ("numpy_str", np.str_("x"), ("numpy.str_", "str(x)")),
    ("intenum_key", {Phase.DECAY: 1.0}, ("Phase", "int(k)")),
    ("str_enum_key", {Mode.TRAIN: 1.0}, ("Mode", "str(k)")),
]


@pytest.mark.parametrize("value,names", [c[1:] for c in SUBCLASSES], ids=[c[0] for c in SUBCLASSES])
def test_a_subclass_of_a_stored_type_is_refused_before_anything_is_written(root: str, ops_path: str, value: Any,
                                                                          names: tuple[str, ...]) -> None:
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"w": torch.ones(2)})
        before = _files(root)
        with pytest.raises(nc.ValidationError) as ei:
            ck.save(2, {"w": torch.ones(2), "cfg": {"v": value}})
        ck.wait()
        assert _files(root) == before and ck.list() == [1]
    msg = str(ei.value)
    assert "'cfg/v'" in msg or "'cfg'" in msg, msg
    assert all(n in msg for n in names) and "would come back as" in msg, msg
    if not names[1].endswith("(k)"):  # a dict key is never pickled: it must be converted
        assert "allow_pickle=True" in msg, msg


def test_with_allow_pickle_subclasses_come_back_as_saved(root: str, ops_path: str) -> None:
    state = {c[0]: c[1] for c in SUBCLASSES if not c[0].endswith("_key")}
    state["w"] = torch.arange(3.0)
    with nc.Checkpointer(root, memory_tier=False, allow_pickle=True) as ck:
        ck.save(1, state)
        _, back = ck.read(1)
    for k, v in state.items():
        assert type(back[k]) is type(v), k
        assert torch.equal(back[k], v) if k == "w" else back[k] == v, k
    back["defaultdict"]["new"] += 1  # the default factory came back
    assert back["defaultdict"]["new"] == 1


def test_supported_types_keep_their_type(root: str, ops_path: str) -> None:
    param = torch.nn.Parameter(torch.ones(2))
    state = {
        "bool": True, "odict": collections.OrderedDict([("z", 1), ("a", 2)]), "f64": np.float64(-0.0),
        "c128": np.complex128(1 - 2j), "b": np.bool_(True), "i64": np.int64(-5), "dtype": torch.bfloat16,
        "device": torch.device("cpu"), "size": torch.Size([2, 3]), "param": param, "lin": torch.nn.Linear(2, 2),
        "with_state": WithState(a=1, b=2), "keys": {0: "a", "s": [1, (2, None)]}, "bytes": b"\x00",
    }
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, state)
        _, back = ck.read(1)
    assert '"pickle"' not in open(os.path.join(root, "step-1", "manifest.json")).read()
    for k in ("bool", "odict", "f64", "c128", "b", "i64", "dtype", "device", "size", "keys", "bytes"):
        assert type(back[k]) is type(state[k]) and back[k] == state[k], k
    assert list(back["odict"]) == ["z", "a"] and _bits(back["f64"]) == _bits(-0.0)
    assert torch.equal(back["param"], param) and set(back["lin"]) == {"weight", "bias"}
    assert back["with_state"] == {"n": 2}


def test_nan_leaves_keep_sign_and_payload(root: str, ops_path: str) -> None:
    nans = {"neg": NEG_NAN, "payload": PAYLOAD_NAN, "signaling": SIGNALING_NAN, "neg_payload": NEG_PAYLOAD_NAN,
            "plain": float("nan")}
    state: dict[str, Any] = dict(nans)
    state["c"] = complex(NEG_NAN, 1.0)
    state["c2"] = complex(float("nan"), PAYLOAD_NAN)
    state["in_list"] = [NEG_NAN, (SIGNALING_NAN,)]
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, state)
        _, back = ck.read(1)
    for k, x in nans.items():
        assert type(back[k]) is float and _bits(back[k]) == _bits(x), k
    for k in ("c", "c2"):
        got, want = back[k], state[k]
        assert (_bits(got.real), _bits(got.imag)) == (_bits(want.real), _bits(want.imag)), k
    assert _bits(back["in_list"][0]) == _bits(NEG_NAN) and _bits(back["in_list"][1][0]) == _bits(SIGNALING_NAN)
    tree = json.load(open(os.path.join(root, "step-1", "manifest.json")))["tree"]
    nodes = {k["v"]: v for k, v in tree["v"]}
    assert nodes["neg"] == {"t": "float", "v": "nan", "bits": "fff8000000000000"}
    assert nodes["plain"] == {"t": "float", "v": "nan"}  # float("nan") is written as before
    assert nodes["c2"] == {"t": "complex", "v": ["nan", "nan"], "bits": [None, "7ff8000000000bad"]}


needs_cache = pytest.mark.skipif(not native_available(), reason="the plan cache runs on the native path")


@needs_cache
def test_the_plan_cache_writes_a_leaf_that_went_from_one_nan_to_another(root: str) -> None:
    """NaN != NaN and -nan == nan: a cached encoding must follow the bits, whichever NaN comes next."""
    seq = [float("nan"), NEG_NAN, PAYLOAD_NAN, PAYLOAD_NAN, float("nan"), SIGNALING_NAN, NEG_NAN, -0.0, 0.0,
           float("nan")]
    state: dict[str, Any] = {"w": torch.ones(2), "x": 0.0, "c": 0j, "np": np.float64(0.0)}
    with nc.Checkpointer(root, memory_tier=False, keep_last=100) as ck:
        for step, x in enumerate(seq, 1):
            state["x"] = x
            state["c"] = complex(1.0, x)
            state["np"] = np.float64(x)
            ck.save(step, state)
        assert ck.stats()["plans"]["hits"] == len(seq) - 1  # every later save reused the plan
        for step, x in enumerate(seq, 1):
            _, back = ck.read(step)
            assert _bits(back["x"]) == _bits(x), (step, _bits(back["x"]), _bits(x))
            assert _bits(back["c"].imag) == _bits(x) and _bits(float(back["np"])) == _bits(x), step


@needs_cache
@pytest.mark.parametrize("allow_pickle", [False, True])
def test_the_plan_cache_refuses_a_leaf_that_became_a_subclass(root: str, allow_pickle: bool) -> None:
    """A later save of the same structure whose leaf, dict or key became a subclass is refused
    (nothing written, the cached plan still good for the next save), or pickled with allow_pickle."""
    def state() -> dict[str, Any]:
        return {"w": torch.ones(2), "phase": 1, "mode": "train", "blob": b"x", "scale": 0.5, "d": {"n": 1},
                "k": {1: 2.0}, "l": [1, 2]}

    changes = {"phase": Phase.DECAY, "mode": Mode.TRAIN, "blob": bytearray(b"x"), "scale": Scale(0.5),
               "d": collections.defaultdict(int, n=1), "k": {Phase.WARMUP: 2.0}, "l": Meters([1, 2])}
    with nc.Checkpointer(root, memory_tier=False, keep_last=100, allow_pickle=allow_pickle) as ck:
        s = state()
        ck.save(1, s)
        ck.save(2, s)
        assert ck.stats()["plans"]["hits"] == 1
        step = 2
        for key, value in changes.items():
            s[key] = value
            if allow_pickle and key != "k":
                step += 1
                ck.save(step, s)
                _, back = ck.read(step)
                assert type(back[key]) is type(value) and back[key] == value, key
            else:
                before = _files(root)
                with pytest.raises(nc.ValidationError, match=f"'{key}'") as ei:
                    ck.save(step + 1, s)
                ck.wait()
                assert type(value).__name__ in str(ei.value) and _files(root) == before, key
            s[key] = state()[key]
            step += 1
            ck.save(step, s)  # the state as it was: saved, from the cached plan or a new one
            _, back = ck.read(step)
            assert back == {**state(), "w": back["w"]} and type(back[key]) is type(state()[key]), key
