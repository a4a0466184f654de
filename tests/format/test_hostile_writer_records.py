"""A root's writer generations: a new writer outranks every checkpoint on the root, and a record
name no writer writes is no generation.

A writer takes the generation above the newest one recorded in ``_nebula/writers/`` *and* the
newest one a committed step on the root names: step folders copied into a root without its
``_nebula/`` folder (a sync of ``step-*`` only, a root handed over) carry the generations of the
run that wrote them, and a new writer below them would see retention delete each of its saves
and a restart restore the copied step. A record name whose number has leading zeros, other
scripts' digits or is beyond the largest generation (what every reader of a ``generation``
field takes) is ignored, a warning naming it; no writer ever takes a generation past that bound.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.format.commit import Commit
from nebula_ckpt.format.names import MAX_GENERATION, writer_generation
from nebula_ckpt.ranks.fencing import Fence
from nebula_ckpt.storage.local import LocalStorage


def _writers(root: str) -> list[str]:
    return sorted(os.listdir(os.path.join(root, "_nebula", "writers")))


def _shards(root: str, step: int) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(root, f"step-{step}")) if n.endswith(".safetensors"))


def _copied_steps(tmp_path: Any) -> str:
    """A root holding steps 1, 2, 3 of a run that restarted twice (writer generations 1, 2, 3),
    copied without its ``_nebula/`` folder."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for s in (1, 2, 3):
        with nc.Checkpointer(a, memory_tier=False) as ck:
            ck.save(s, {"x": torch.full((4,), float(s))})
    os.makedirs(b)
    for s in (1, 2, 3):
        shutil.copytree(os.path.join(a, f"step-{s}"), os.path.join(b, f"step-{s}"))
    return b


def test_steps_copied_in_without_their_writer_records_never_outrank_a_new_runs_saves(tmp_path: Any,
                                                                                      shm_dir: str) -> None:
    root = _copied_steps(tmp_path)
    assert _shards(root, 3) == ["shard-g3-r0.safetensors"]
    with nc.Checkpointer(root, memory_tier=False, keep_last=2) as ck:
        x = torch.zeros(4)
        assert ck.load_latest(into={"x": x}) == 3
        for s in (4, 5, 6):
            ck.save(s, {"x": torch.full((4,), float(s))})
        assert ck.list() == [5, 6]  # retention let the copied steps go, not the new saves
    assert _writers(root) == ["g-4.json"] and _shards(root, 6) == ["shard-g4-r0.safetensors"]
    with nc.Checkpointer(root, read_only=True) as ck:  # the job restarts
        assert ck.latest() == (6, None) and ck.load_latest(into={"x": x}) == 6
    assert torch.equal(x, torch.full((4,), 6.0))


def test_a_past_generation_sees_steps_copied_in_newer_than_it(tmp_path: Any, shm_dir: str) -> None:
    """``persist-memory`` writes under the generation that made a memory step: it refuses once a
    newer generation committed a step on the root, recorded there or not."""
    st = LocalStorage(_copied_steps(tmp_path))
    with pytest.raises(nc.FencedError, match="step 3 of writer generation 3 is committed there, newer than "
                                             "generation 2"):
        Fence.past(st, 2).for_tier(st).check("commit step 9")
    Fence.past(st, 3).for_tier(st).check("commit step 9")  # nothing newer: it writes


def test_writer_record_names_are_ascii_numbers_in_range() -> None:
    assert [writer_generation(n) for n in ("g-0.json", "g-7.json", f"g-{MAX_GENERATION}.json")] == \
        [0, 7, MAX_GENERATION]
    foreign = [f"g-{MAX_GENERATION + 1}.json", "g-" + "9" * 240 + ".json", "g-07.json", "g-\u0663.json",
               "g-7.json.tmp", "g-.json", "g--1.json"]
    assert [writer_generation(n) for n in foreign] == [None] * len(foreign)


FOREIGN = [f"g-{MAX_GENERATION + 1}.json", "g-" + "9" * 240 + ".json", "g-007.json"]


@pytest.mark.parametrize("name", FOREIGN, ids=["2**62+1", "240-digits", "leading-zeros"])
def test_a_writer_record_name_no_writer_writes_is_ignored_naming_it(tmp_path: Any, shm_dir: str,
                                                                    caplog: pytest.LogCaptureFixture,
                                                                    name: str) -> None:
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"x": torch.ones(4)})
    open(os.path.join(root, "_nebula", "writers", name), "w").close()
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(2, {"x": torch.full((4,), 2.0)})
        assert ck.list() == [1, 2]
    assert f"_nebula/writers/{name} is no writer generation record" in caplog.text
    assert _writers(root) == sorted(["g-1.json", "g-2.json", name])  # the next generation, in range
    assert _shards(root, 2) == ["shard-g2-r0.safetensors"]


def test_a_root_at_the_largest_generation_refuses_a_writer_naming_the_file(tmp_path: Any, shm_dir: str) -> None:
    """A writer record (or a committed step) of the largest generation leaves no newer one to
    take: the save fails naming that file and the fix, before anything is written."""
    root = str(tmp_path / "root")
    with nc.Checkpointer(root, memory_tier=False) as ck:
        ck.save(1, {"x": torch.ones(4)})
    top = f"g-{MAX_GENERATION}.json"
    open(os.path.join(root, "_nebula", "writers", top), "w").close()
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.PersistError, match=f"_nebula/writers/{top} names writer generation "
                                                  f"{MAX_GENERATION}.*remove that file"):
            ck.save(2, {"x": torch.full((4,), 2.0)})
    assert _writers(root) == ["g-1.json", top] and not os.path.exists(os.path.join(root, "step-2"))
    os.remove(os.path.join(root, "_nebula", "writers", top))
    shutil.copytree(os.path.join(root, "step-1"), os.path.join(root, "step-5"))
    with open(os.path.join(root, "step-5", "COMMIT"), "wb") as f:
        f.write(Commit(5, MAX_GENERATION, 10, 0, 0).to_bytes())
    with nc.Checkpointer(root, memory_tier=False) as ck:
        with pytest.raises(nc.PersistError, match=f"step-5/COMMIT names writer generation {MAX_GENERATION}.*"
                                                  "move step 5 out of the root"):
            ck.save(2, {"x": torch.full((4,), 2.0)})
    assert _writers(root) == ["g-1.json"] and not os.path.exists(os.path.join(root, "step-2"))


@pytest.mark.parametrize("t", ["1e400", "NaN", "Infinity", str(10**400)])
def test_a_writer_records_time_beyond_a_float_is_refused_naming_the_field(t: str) -> None:
    """A writer record whose ``time`` no float holds (``json.loads`` reads NaN, Infinity and huge
    ints) is a CorruptCheckpointError naming the file and the field, not a bare OverflowError."""
    from nebula_ckpt.errors import CorruptCheckpointError
    from nebula_ckpt.format.root_records import parse_writer_record

    raw = ('{"host": "h", "pid": 1, "time": %s}' % t).encode()
    with pytest.raises(CorruptCheckpointError, match="g-3.json.*time"):
        parse_writer_record(raw, "_nebula/writers/g-3.json")
