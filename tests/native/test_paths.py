"""The C++ extension and the pure-PyTorch path write the same bytes and the same checksums."""

from __future__ import annotations

import os

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.native import describe, fallback_ops, get_ops, native_available

needs_native = pytest.mark.skipif(not native_available(), reason="C++ extension not built")


def test_extension_is_built_in_ci() -> None:
    """CI must exercise the native path: a build failure there is a failure, not a skip."""
    if os.environ.get("CI") != "true":
        pytest.skip("only enforced in CI (CI=true)")
    assert native_available(), describe()


@needs_native

def _files(root: str) -> dict[str, bytes]:
    d = os.path.join(root, "step-1")
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out[f] = open(os.path.join(d, f), "rb").read()
    return out


def test_native_and_fallback_shards_are_byte_identical(tmp_path, shm_dir) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    base = torch.randn(33, 17)
    state = {"a": base, "b": base.t(), "c": torch.arange(10, dtype=torch.int16)[::3],
             "d": torch.randn(4, 4).to(torch.bfloat16), "e": torch.tensor(3.5), "f": torch.empty(0, 3),
             "g": torch.randint(0, 2, (7,), dtype=torch.bool), "h": torch.randn(3, dtype=torch.complex128),
             "big": torch.randn(1 << 20)}
    shards, indexes = {}, {}
    for path in ("native", "fallback"):
        with knobs.override(disable_native=path == "fallback"):
            assert describe()["path"] == ("native" if path == "native" else "pure-pytorch")
            root = str(tmp_path / path)
            with nc.Checkpointer(root, memory_tier=False) as ck:
                ck.save(1, state)
            shards[path] = list(_files(root).values())
            import json
            man = json.load(open(os.path.join(root, "step-1", "manifest.json")))
            indexes[path] = man["tensors"]
    assert shards["native"] == shards["fallback"]
    assert indexes["native"] == indexes["fallback"]


@needs_native
def test_crc32c_agrees_between_paths() -> None:
    buf = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8)
    offs, lens = [0, 1, 4095, 100_000, 7], [0, 4096, 1 << 20, (4 << 20) + 3, 13]
    assert get_ops().crc32c(buf, offs, lens) == fallback_ops().crc32c(buf, offs, lens)
    data = bytes(range(256)) * 1000
    assert get_ops().crc32c_bytes(data) == fallback_ops().crc32c_bytes(data)


@needs_native
def test_copy_into_agrees_between_paths() -> None:
    src = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8)
    shapes = [((3, 5), torch.float32), ((0,), torch.float32), ((), torch.int64), ((5 << 20,), torch.uint8),
              ((7,), torch.bool), ((2, 2), torch.complex128), ((1001,), torch.bfloat16)]
    out = {}
    for name, ops in (("native", get_ops()), ("fallback", fallback_ops())):
        dsts = [torch.zeros(s, dtype=d) for s, d in shapes]
        offsets, at = [], 3
        for t in dsts:
            offsets.append(at)
            at += t.numel() * t.element_size()
        ops.copy_into(src, offsets, dsts)
        out[name] = [t.reshape(-1).view(torch.uint8).clone() for t in dsts]
    assert all(torch.equal(a, b) for a, b in zip(out["native"], out["fallback"], strict=True))
    with pytest.raises(RuntimeError, match="destination 1 is no contiguous"):
        fallback_ops().copy_into(src, [0, 0], [torch.zeros(2), torch.zeros(4, 4).t()])


def test_a_save_of_inference_tensors_works_on_both_paths(root: str, ops_path: str) -> None:
    """Tensors made under ``torch.inference_mode()`` have no version counter: both paths save them."""
    with torch.inference_mode():
        model = torch.nn.Linear(8, 8)  # e.g. an eval copy built there
        buf = torch.randn(1000)
    for snapshot in ("sync", "async"):
        with nc.Checkpointer(os.path.join(root, snapshot), memory_tier=False, snapshot=snapshot) as ck:
            ck.save_async(1, {"model": model, "buf": buf}).result()
            _, tree = ck.read(1)
        assert torch.equal(tree["buf"], buf) and torch.equal(tree["model"]["weight"], model.weight), snapshot


def test_a_snapshot_leaves_the_saved_tensors_resizable_on_both_paths(root: str, ops_path: str) -> None:
    """The snapshot only reads the state: a module's buffer grown in place afterwards (``resize_``,
    a growing ``out=``) still grows."""
    m = torch.nn.Linear(4, 4)
    m.register_buffer("hist", torch.zeros(3, 4))
    with nc.Checkpointer(root, memory_tier=False, snapshot="async") as ck:
        ck.save_async(1, {"model": m}).result()
        m.hist.resize_(6, 4)
        m.hist[3:] = 1.0
        torch.randn(8, 4, out=m.weight.data)  # an out= that grows its output
        ck.save_async(2, {"model": m}).result()
        _, tree = ck.read(2)
    assert tuple(m.hist.shape) == (6, 4) and torch.equal(tree["model"]["hist"], m.hist)
    assert torch.equal(tree["model"]["weight"], m.weight)


def test_the_path_follows_override_and_reads_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """get_ops() runs at every save: it reads NEBULA_DISABLE_NATIVE once, while knobs.override
    (how tests and benchmarks switch paths) takes effect at every call, both ways."""
    first = get_ops()
    with knobs.override(disable_native=True):
        assert get_ops() is fallback_ops()
    assert get_ops() is first
    if first is not fallback_ops():
        with knobs.override(disable_native=False):
            assert get_ops() is first
    monkeypatch.setenv("NEBULA_DISABLE_NATIVE", "0" if first is fallback_ops() else "1")
    assert get_ops() is first  # not read again
    assert describe()["path"] == first.name
