"""A restore problem that is not damage is the caller's error, never a damaged checkpoint.

``map_location`` naming a device this machine lacks (``"cuda"`` without CUDA), a malformed one,
a ``map_location`` function that raises, ``strict`` that is not a bool, an ``into`` of other
shapes: each is a :class:`ValidationError` (the first ones before any tier is read), while
``nebula-ckpt verify`` reports the checkpoints healthy. And no message advises deleting a
checkpoint that verifies: the all-damaged message sends to ``verify`` first.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main
from nebula_ckpt.errors import CorruptCheckpointError, ValidationError

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def saved(root: str) -> str:
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(3, {"w": torch.arange(6.0), "opt": {"m": torch.ones(2)}, "step": 3})
    return root


def _into() -> dict[str, Any]:
    return {"w": torch.zeros(6), "opt": {}, "step": 0}


BAD: list[tuple[str, Any, str]] = [
    ("a device name torch does not know", "bogus", "is not a device"),
    ("not a device at all", 3.5, "must be a device"),
    ("a dict naming a bad device", {"cpu": "nowhere:0"}, "map_location['cpu']"),
]
if NO_CUDA:
    BAD += [("cuda without CUDA", "cuda", "no usable CUDA"), ("cuda:0 without CUDA", torch.device("cuda", 0),
                                                                 "no usable CUDA"),
            ("a dict mapping the saved device to cuda without CUDA", {"cpu": "cuda"}, "no usable CUDA")]
else:
    BAD += [("a CUDA device index this machine lacks", f"cuda:{torch.cuda.device_count()}", "CUDA device(s)")]


@pytest.mark.parametrize("what,map_location,says", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("call", ["load_latest", "load", "read"])
def test_a_bad_map_location_is_a_validation_error_not_damage(saved: str, what: str, map_location: Any, says: str,
                                                             call: str, caplog: pytest.LogCaptureFixture) -> None:
    with nc.Checkpointer(saved, memory_tier=False) as ck:
        with pytest.raises(ValidationError, match="map_location") as e:
            if call == "load_latest":
                ck.load_latest(into=_into(), map_location=map_location, strict=False)
            elif call == "load":
                ck.load(3, into=_into(), map_location=map_location, strict=False)
            else:
                ck.read(map_location=map_location)
    assert says in str(e.value), e.value
    assert "damaged" not in caplog.text and "skipping" not in caplog.text, "a tier was read and blamed"
    assert main(["verify", saved]) == 0


def test_a_map_location_function_that_raises_is_the_callers_error(saved: str) -> None:
    def to_a_missing_gpu(storage: Any, location: str) -> Any:
        raise RuntimeError("no such device here")

    with nc.Checkpointer(saved, memory_tier=False) as ck, pytest.raises(ValidationError, match="not damaged"):
        ck.load_latest(into=_into(), map_location=to_a_missing_gpu, strict=False)


@pytest.mark.parametrize("strict", ["yes", 1, None])
def test_strict_must_be_a_bool(saved: str, strict: Any) -> None:
    into = {"w": torch.zeros(6), "opt": {"m": torch.zeros(2)}, "step": 0}  # matches: strict or not, it restores
    with nc.Checkpointer(saved, memory_tier=False) as ck, pytest.raises(ValidationError, match="strict must be"):
        ck.load_latest(into=into, strict=strict)
    assert torch.equal(into["w"], torch.zeros(6)), "into changed"


def test_an_into_of_other_shapes_is_a_validation_error(saved: str) -> None:
    with nc.Checkpointer(saved, memory_tier=False) as ck, pytest.raises(ValidationError, match="'w'"):
        ck.load_latest(into={"w": torch.zeros(7), "opt": {"m": torch.ones(2)}, "step": 0})


def test_the_all_damaged_message_never_advises_deleting_what_verifies(saved: str) -> None:
    import os

    shard = next(f"{saved}/step-3/{n}" for n in os.listdir(f"{saved}/step-3") if n.startswith("shard-"))
    with open(shard, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    with nc.Checkpointer(saved, memory_tier=False) as ck, pytest.raises(CorruptCheckpointError) as e:
        ck.load_latest(into=_into(), strict=False)
    msg = str(e.value)
    assert "nebula-ckpt verify" in msg and "delete them" not in msg, msg
    assert "Only a step that verify reports DAMAGED" in msg
