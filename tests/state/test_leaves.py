"""NumPy arrays and scalars, and RNG states, round-trip bit-exact without pickle (issue #13)."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import nebula_ckpt as nc
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.tree import check_tree
from nebula_ckpt.save.plan import make_plan
from nebula_ckpt.save.plan_cache import PlanCache
from test_hostile_manifest import rewrite

NUMERIC = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
           np.float16, np.float32, np.float64, np.complex64, np.complex128]


def _random_array(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bytes reinterpreted: every bit pattern (NaN payloads, -0.0, denormals) included."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    a = raw.view(dtype).reshape(shape)
    return a.astype(bool) if dtype is np.bool_ else a


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a.dtype.str == b.dtype.str and a.shape == b.shape and a.tobytes() == b.tobytes()


def _no_pickle(root: str, step: int) -> None:
    text = open(os.path.join(root, f"step-{step}", "manifest.json")).read()
    assert '"pickle"' not in text


def test_arrays_of_every_numeric_dtype_and_layout_bit_exact(root: str, ops_path: str) -> None:
    state: dict[str, Any] = {}
    for i, dt in enumerate(NUMERIC):
        name = np.dtype(dt).name
        state[f"{name}/3d"] = _random_array(dt, (3, 4, 5), i)
        state[f"{name}/0d"] = _random_array(dt, (), 100 + i).reshape(())
        state[f"{name}/empty"] = np.zeros((0, 3), dtype=dt)
        state[f"{name}/strided"] = _random_array(dt, (6, 8), 200 + i)[::2, 1::3]      # not contiguous
        state[f"{name}/fortran"] = np.asfortranarray(_random_array(dt, (4, 3), 300 + i))
        if np.dtype(dt).itemsize > 1:
            state[f"{name}/swapped"] = _random_array(dt, (5,), 400 + i).astype(np.dtype(dt).newbyteorder(">"))
    ro = _random_array(np.float32, (7,), 9)
    ro.flags.writeable = False
    state["readonly"] = ro
    with nc.Checkpointer(root) as ck:
        ck.save(1, state)
        _, back = ck.read(1)
        into = {k: None for k in state}
        ck.load_latest(into=into)
    _no_pickle(root, 1)
    for k, v in state.items():
        assert _same(back[k], v), k
        assert _same(into[k], v), k
        assert back[k].flags.writeable and back[k].flags.c_contiguous   # owned, not a view of the shard


def test_numpy_scalars_keep_type_and_bits(root: str) -> None:
    state = {np.dtype(dt).name: dt(_random_array(dt, (), 7)[()]) for dt in NUMERIC}
    state["nan_payload"] = np.frombuffer(b"\x01\x00\xc0\x7f", dtype=np.float32)[0]
    state["neg_zero"] = np.float64(-0.0)
    with nc.Checkpointer(root) as ck:
        ck.save(1, state)
        _, back = ck.read(1)
    _no_pickle(root, 1)
    for k, v in state.items():
        assert type(back[k]) is type(v) and back[k].tobytes() == v.tobytes(), k
    assert type(back["float64"]) is np.float64      # not a plain float


def test_array_is_stored_as_a_tensor_in_the_shard(root: str) -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"a": a})
    d = os.path.join(root, "step-1")
    man = json.load(open(os.path.join(d, "manifest.json")))
    item = man["tree"]["v"][0][1]
    assert item == {"t": "ndarray", "dtype": "<i4", "v": {"t": "tensor", "k": "a"}}
    assert man["tensors"]["a"]["dtype"] == "int32" and man["tensors"]["a"]["shape"] == [2, 3]
    shard = next(os.path.join(d, f) for f in os.listdir(d) if f.startswith("shard"))
    with safe_open(shard, "pt") as f:
        assert torch.equal(f.get_tensor("a"), torch.from_numpy(a))


def test_array_changed_after_save_async_is_not_in_the_checkpoint(root: str) -> None:
    a = np.zeros(1 << 20, dtype=np.float32)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters())
    with nc.Checkpointer(root, snapshot="async") as ck:
        h = ck.save_async(1, {"model": model, "optim": opt, "a": a})
        a[:] = 1.0                                   # the array was copied when save_async was called
        h.result()
        _, back = ck.read(1)
    assert not back["a"].any()


def _rng_states() -> dict[str, Any]:
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
        "pcg64": np.random.default_rng(14).bit_generator.state,
        "mt19937": np.random.Generator(np.random.MT19937(15)).bit_generator.state,
        "philox": np.random.Generator(np.random.Philox(16)).bit_generator.state,
        "sfc64": np.random.Generator(np.random.SFC64(17)).bit_generator.state,
    }


def _draws(state: dict[str, Any]) -> list[Any]:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    out: list[Any] = [random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()]
    for name, cls in (("pcg64", np.random.PCG64), ("mt19937", np.random.MT19937), ("philox", np.random.Philox),
                      ("sfc64", np.random.SFC64)):
        bg = cls()
        bg.state = state[name]
        out.append(np.random.Generator(bg).integers(0, 2**62, 4).tolist())
    return out


def test_rng_states_round_trip_without_pickle(root: str) -> None:
    """np.random.get_state(), Generator states, random.getstate(), torch's, and Hugging Face's
    rng_state.pth layout: restored, they draw the same numbers."""
    state = _rng_states()
    hf = {"python": state["python"], "numpy": state["numpy"], "cpu": state["cpu"]}
    with nc.Checkpointer(root) as ck:                       # allow_pickle=False (the default)
        ck.save(1, {"rng": state, "rng_state.pth": hf})
        _, back = ck.read(1)
        into: dict[str, Any] = {"rng": {}, "rng_state.pth": {}}
        ck.load_latest(into=into, strict=False)
    _no_pickle(root, 1)
    assert type(back["rng"]["numpy"]) is tuple and back["rng"]["numpy"][0] == "MT19937"
    assert _same(back["rng"]["numpy"][1], state["numpy"][1])
    assert _draws(back["rng"]) == _draws(state) == _draws(into["rng"])
    assert back["rng_state.pth"]["python"] == state["python"]
    assert torch.equal(back["rng_state.pth"]["cpu"], state["cpu"])


@pytest.mark.parametrize("value, what", [
    (np.array([{"a": 1}, None], dtype=object), "dtype object"),
    (np.array(["ab", "c"]), "dtype <U2"),
    (np.zeros(2, dtype=[("x", "<i4"), ("y", "<f8")]), "dtype"),
    (np.zeros(3, dtype=np.longdouble), str(np.dtype(np.longdouble))),  # float128 on x86-64
    (np.ma.masked_array([1, 2], mask=[0, 1]), "MaskedArray"),
])
def test_arrays_that_need_pickle_name_the_key(root: str, value: Any, what: str) -> None:
    if value.dtype == np.float64:
        pytest.skip("longdouble is float64 on this platform: stored without pickle")
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.ValidationError, match="state key 'extra/bad'") as e:
            ck.save_async(1, {"extra": {"bad": value}})
        assert what in str(e.value) and "allow_pickle=True" in str(e.value)
        assert ck.list() == []
    with nc.Checkpointer(root + "-p", allow_pickle=True) as ck:       # with pickle, both ways
        ck.save(1, {"extra": {"bad": value}})
        _, back = ck.read(1)
    got = back["extra"]["bad"]
    assert type(got) is type(value) and got.dtype == value.dtype and got.tolist() == value.tolist()
    with nc.Checkpointer(root + "-p") as ck:
        with pytest.raises(nc.PickleNotAllowedError, match="extra/bad"):
            ck.read(1)


def _coded() -> dict[str, Any]:
    model = torch.nn.Linear(2, 2)
    model.register_buffer("codes", torch.arange(8, dtype=torch.uint8))
    return {"model": model, "q": torch.arange(4, dtype=torch.uint8)}


def _as_qint8(state: dict[str, Any]) -> None:
    state["q"] = state["q"].view(torch.qint8)


def _codes_as_quint8(state: dict[str, Any]) -> None:
    state["model"].codes.data = state["model"].codes.data.view(torch.quint8)  # in place, a stock module's buffer


@pytest.mark.parametrize("change, key", [(_as_qint8, "'q'"), (_codes_as_quint8, "'model/codes'")])
def test_a_byte_tensor_viewed_as_a_quantized_dtype_is_refused_before_anything_is_written(
        root: str, ops_path: str, change: Any, key: str) -> None:
    # no quantized tensor (is_quantized is False), but its dtype is none the format stores; the
    # save after a cached plan is refused too: a dtype change misses the cache (planned again)
    state = _coded()
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, state)
        ck.save(2, state)
        change(state)
        with pytest.raises(nc.ValidationError, match=f"state key {key}: dtype torch.q") as e:
            ck.save_async(3, state)
        assert "t.view(torch.uint8)" in str(e.value)
        assert ck.list() == [1, 2] and not os.path.exists(os.path.join(root, "step-3"))
    if ops_path == "native":
        state = _coded()
        cache = PlanCache(allow_pickle=False)
        cache.plan(1, state)
        cache.plan(2, state)
        change(state)
        with pytest.raises(nc.ValidationError, match=key):
            cache.plan(3, state)
        assert cache.hits == 1 and cache.misses == 1 and "dtype" in str(cache.last_miss), cache.stats()


def test_numpy_leaves_count_as_guarded_copies() -> None:
    """An array is copied while planning: it never makes an asynchronous save synchronous."""
    plan = make_plan(1, {"a": np.ones(3), "t": torch.ones(3)})
    keys = [e.key for e in plan.layout.entries]
    assert [keys[i] for i in plan.unguarded] == ["t"]


# -- a checkpoint read back is input, not truth ----------------------------------------------------

GOOD_ND = {"t": "ndarray", "dtype": "<f4", "v": {"t": "tensor", "k": "w"}}


@pytest.mark.parametrize("node, what", [
    ({**GOOD_ND, "dtype": "<f16"}, "NumPy dtype code"),
    ({**GOOD_ND, "dtype": "|f4"}, "NumPy dtype code"),
    ({**GOOD_ND, "dtype": "<b1"}, "NumPy dtype code"),
    ({**GOOD_ND, "dtype": "O"}, "NumPy dtype code"),
    ({**GOOD_ND, "dtype": 4}, "NumPy dtype code"),
    ({"t": "ndarray", "v": GOOD_ND["v"]}, "NumPy dtype code"),
    ({**GOOD_ND, "v": {"t": "tensor", "k": "nope"}}, "tensor reference"),
    ({**GOOD_ND, "v": {"t": "none"}}, "tensor reference"),
    ({**GOOD_ND, "v": "w"}, "tensor reference"),
    ({"t": "npscalar", "dtype": "<f4", "v": "AAAA"}, "base64 text of 4 bytes"),
    ({"t": "npscalar", "dtype": "<f4", "v": "not base64!"}, "base64"),
    ({"t": "npscalar", "dtype": "|O", "v": "AAAAAA=="}, "NumPy dtype code"),
    ({"t": "npscalar", "dtype": "<c16", "v": 3}, "base64"),
])
def test_malformed_numpy_nodes_are_refused(node: dict[str, Any], what: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=what):
        check_tree({"t": "dict", "v": [[{"t": "str", "v": "x"}, node]]}, {"w": "float32"}, "m")
    check_tree({"t": "list", "v": [GOOD_ND, {"t": "npscalar", "dtype": "|b1", "v": "AQ=="}]}, {"w": "float32"}, "m")


def test_ndarray_node_over_a_tensor_of_another_dtype_is_refused(tmp_path, shm_dir) -> None:  # noqa: ANN001
    root = str(tmp_path / "r")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"a": np.ones(4, dtype=np.float32)})

    def lie(man: dict[str, Any]) -> None:
        man["tree"]["v"][0][1]["dtype"] = "<i4"          # valid code, but the tensor is float32

    rewrite(root, lie)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(CorruptCheckpointError, match="node 'a': a NumPy <i4 array is stored as torch.int32, "
                                                         "but its tensor 'a' is float32"):
            ck.read(1)


def test_numpy_leaves_come_back_through_a_resharding_restore(tmp_path) -> None:  # noqa: ANN001
    """The resharding path (any world size, DCP underneath) restores NumPy leaves as arrays too:
    into a slot holding anything, and where ``into`` has no entry for them."""
    from nebula_ckpt.restore.dcp_reader import newest_manifest
    from nebula_ckpt.restore.reshard import load_resharded
    from nebula_ckpt.storage.local import LocalStorage

    root = str(tmp_path / "ck")
    arrays = {"f": _random_array(np.float64, (3, 5), 1), "i": _random_array(np.int16, (7,), 2),
              "b": (_random_array(np.uint8, (4, 2), 3) & 1).astype(bool)}  # canonical bools: DCP copies them
    w = torch.randn(6, 4)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(3, {"w": w, "arrays": arrays, "last": arrays["f"][0].copy(), "seed": np.random.get_state()})
    storage = LocalStorage(root)
    man = newest_manifest(storage)
    into: dict[str, Any] = {"w": torch.zeros(6, 4), "arrays": {"f": None, "i": None, "b": np.zeros(1)},
                            "seed": None}
    load_resharded(storage, man.step, man, into, strict=False)
    assert torch.equal(into["w"], w)
    for k, a in arrays.items():
        assert _same(into["arrays"][k], a), k
    assert _same(into["last"], arrays["f"][0])  # not in `into`: added, like any saved value
    want = np.random.get_state()
    assert into["seed"][0] == want[0] and _same(into["seed"][1], want[1]) and into["seed"][2:] == want[2:]
