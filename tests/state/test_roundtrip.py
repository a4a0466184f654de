"""Bit-exact round trips of every dtype, shape and non-tensor leaf, on both hot paths."""

from __future__ import annotations

import collections
import math
import os
import sys

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from conftest import make_training, train_step


def _all_dtypes() -> list[torch.dtype]:
    out = []
    for d in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        if d in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
            continue  # quantized: rejected on purpose (test_validation)
        try:
            raw = torch.randint(0, 256, (6 * torch.empty(0, dtype=d).element_size(),), dtype=torch.uint8)
            raw.view(d)
        except Exception:
            continue  # quantized / bit-packed shell dtypes cannot be made from bytes
        out.append(d)
    return out


DTYPES = _all_dtypes()


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random *bytes* viewed as dtype: covers NaN payloads, subnormals, every bit pattern."""
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.element_size() == 1:
        t = t.view(torch.uint8)  # torch cannot copy the sub-byte shell dtypes (int1..7, uint1..7)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_dtype_list_is_complete() -> None:
    names = {str(d) for d in DTYPES}
    for must in ("torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.bool",
                 "torch.complex64", "torch.complex128", "torch.uint16", "torch.uint32", "torch.uint64",
                 "torch.float16", "torch.float64", "torch.int8"):
        assert must in names


def test_every_dtype_and_shape_bit_exact(root: str, ops_path: str) -> None:
    state: dict[str, object] = {}
    for i, d in enumerate(DTYPES):
        for shape in [(), (0,), (3, 0, 2), (5,), (4, 7)]:
            state[f"{d}/{shape}"] = _random(d, shape, seed=i * 10 + len(shape))
        state[f"{d}/transposed"] = _random(d, (4, 7), seed=i * 10 + 5).t()
        state[f"{d}/strided"] = _random(d, (6, 8), seed=i * 10 + 6)[::2, 1::3]
    base = _random(torch.float32, (6, 8), 99)
    state["views/transposed"] = base.t()
    state["views/strided"] = base[::2, 1::3]
    state["views/expanded"] = torch.arange(3.0).expand(4, 3)
    state["views/bf16_t"] = _random(torch.bfloat16, (5, 3), 7).t()
    with nc.Checkpointer(root) as ck:
        ck.save_async(7, state).result()
        step, back = ck.read(7)
        # and into live tensors of the same layouts (an expanded one cannot hold distinct values)
        live = {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) for k, v in state.items()
                if k != "views/expanded"}
        for t in live.values():
            t.untyped_storage().fill_(0xA5)
        ck.load(7, into=live, strict=False)
    assert step == 7
    assert set(back) == set(state)
    for k, v in state.items():
        got = back[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert _bytes(got) == _bytes(v), k
        assert k not in live or _bytes(live[k]) == _bytes(v), f"restored into: {k}"


def test_tied_weights_stored_once_and_restored_tied(root: str, ops_path: str) -> None:
    model, opt, sched = make_training()
    train_step(model, opt, sched, 0)
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"model": model})
        import json
        import os
        man = json.load(open(os.path.join(root, "step-1", "manifest.json")))
        assert man["aliases"] == {"model/head.weight": "model/emb.weight"}
        assert "model/head.weight" not in man["tensors"]
        m2, _, _ = make_training(seed=5)
        assert ck.load_latest(into={"model": m2}) == 1
        assert m2.head.weight is m2.emb.weight
        assert torch.equal(m2.emb.weight, model.emb.weight)
        _, tree = ck.read()
        assert tree["model"]["head.weight"] is tree["model"]["emb.weight"]


def test_non_tensor_leaves_exact(root: str) -> None:
    leaves = {
        "int": 2**70, "neg": -3, "float": 0.1, "inf": float("inf"), "ninf": float("-inf"),
        "nan": float("nan"), "tiny": 5e-324, "bool": True, "none": None, "str": "ünïcode/",
        "bytes": b"\x00\xff", "tuple": (1, (2.5, "x"), []), "list": [1, [2, {"a": 3}]],
        "intkeys": {0: "a", 7: "b"}, "odict": collections.OrderedDict([("z", 1), ("a", 2)]),
        "complex": 1 + 2j, "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "size": torch.Size([2, 3]), "empty": {}, "step_t": torch.tensor(5),
    }
    with nc.Checkpointer(root) as ck:
        ck.save(3, leaves)
        _, back = ck.read(3)
    for k, v in leaves.items():
        b = back[k]
        if k == "nan":
            assert math.isnan(b)
        elif isinstance(v, torch.Tensor):
            assert torch.equal(b, v)
        else:
            assert b == v and type(b) is type(v), k
    assert type(back["tuple"][1]) is tuple and isinstance(back["intkeys"], dict)
    assert list(back["intkeys"]) == [0, 7] and isinstance(back["odict"], collections.OrderedDict)
    assert list(back["odict"]) == ["z", "a"]


def test_training_state_resumes_identically(root: str, ops_path: str) -> None:
    """Optimizer, scheduler, GradScaler and model state: a resumed run matches an uninterrupted one."""
    model, opt, sched = make_training()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for s in range(4):
        train_step(model, opt, sched, s)
    state = {"model": model, "optim": opt, "sched": sched, "scaler": scaler, "step": 4}
    with nc.Checkpointer(root) as ck:
        ck.save(4, state)
    ref = [train_step(model, opt, sched, s) for s in range(4, 8)]

    m2, o2, s2 = make_training(seed=123)
    sc2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    into = {"model": m2, "optim": o2, "sched": s2, "scaler": sc2, "step": 0}
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into=into) == 4
    assert into["step"] == 4 and type(into["step"]) is int
    assert s2.last_epoch == 4 and sc2.get_scale() == 1024.0
    assert o2.state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)
    got = [train_step(m2, o2, s2, s) for s in range(4, 8)]
    assert got == ref  # bit-identical continuation


def test_load_into_tensors_in_place(root: str, ops_path: str) -> None:
    src = {"a": torch.randn(4, 4), "b": [torch.arange(5), 3]}
    with nc.Checkpointer(root) as ck:
        ck.save(1, src)
        a, b = torch.zeros(4, 4), torch.zeros(5, dtype=torch.int64)
        into = {"a": a, "b": [b, 0]}
        ck.load(1, into=into)
    assert into["a"] is a and torch.equal(a, src["a"])
    assert into["b"][0] is b and torch.equal(b, src["b"][0]) and into["b"][1] == 3
    with nc.Checkpointer(root) as ck:
        with pytest.raises(nc.ValidationError, match="'a'"):
            ck.load(1, into={"a": torch.zeros(2), "b": [b, 0]})


def test_read_result_can_be_torch_saved(root: str, ops_path: str) -> None:
    """Owned tensors share one buffer per dtype: torch.save of the tree must still work."""
    import io

    model, opt, sched = make_training()
    train_step(model, opt, sched, 0)
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"model": model, "optim": opt, "x": torch.arange(3, dtype=torch.int16)})
        _, tree = ck.read(1)
    buf = io.BytesIO()
    torch.save(tree, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=True)
    assert torch.equal(again["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


class _TwoStreams:
    """An object whose state is two RNG states (what a loop, a data loader or a framework keeps)."""

    def __init__(self) -> None:
        self.sd: dict[str, torch.Tensor] = {"a": torch.get_rng_state(), "b": torch.get_rng_state()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.sd

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd = sd


@pytest.mark.parametrize("tiers", ["local", "memory"])
def test_restored_rng_states_can_be_set(root: str, shm_dir: str, tiers: str) -> None:
    """Restored RNG states are handed to torch.set_rng_state / Generator.set_state as they are:
    those read a tensor's storage from its start and crash on a view at an offset of a shared
    buffer, so a small restored tensor owns its storage (load into an object, read(), and the
    memory tier's pages handed over to a new process alike)."""
    memory = tiers == "memory"
    with nc.Checkpointer(root, tiers=[nc.MemoryTier()] if memory else None, memory_tier=memory) as ck:
        ck.save(1, {"s": _TwoStreams(), "extra": torch.get_rng_state()})
    code = f"""
import torch, nebula_ckpt as nc
class S:
    sd = {{}}
    def state_dict(self): return self.sd
    def load_state_dict(self, d): self.sd = d
s = S()
tiers = dict(tiers=[nc.MemoryTier()] if {memory} else None, memory_tier={memory})
with nc.Checkpointer({root!r}, read_only=True, **tiers) as ck:  # a reader: copies
    _, tree = ck.read(1)
with nc.Checkpointer({root!r}, **tiers) as ck:  # the memory tier's pages are handed over
    ck.load_latest(into={{"s": s, "extra": None}}, strict=False)
    assert ck.last_restore["tier"].startswith("memory" if {memory} else "local"), ck.last_restore
for t in (s.sd["a"], s.sd["b"], tree["s"]["b"], tree["extra"]):
    torch.set_rng_state(t)
    assert torch.equal(torch.get_rng_state(), t)
    g = torch.Generator()
    g.set_state(t)
    assert torch.equal(g.get_state(), t)
print("set", s.sd["b"].storage_offset(), tree["extra"].storage_offset())
"""
    res = warm_python.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NEBULA_SHM_DIR": shm_dir})
    assert res.returncode == 0, f"exit {res.returncode}:\n{res.stderr[-3000:]}"
    assert res.stdout.split() == ["set", "0", "0"], res.stdout
