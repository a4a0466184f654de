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
