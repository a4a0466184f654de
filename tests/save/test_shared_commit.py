"""The commit protocol both writers share (:mod:`nebula_ckpt.format.commit`):
the same fault at the same stage has the same outcome through ``Checkpointer.save`` and through
DCP's ``NebulaStorageWriter``, and both sweep the same leftovers.

* a failure writing the manifest, or a ``COMMIT`` write that certainly created nothing: the
  step's files and folder are removed at once, the earlier checkpoint stays the newest;
* a ``COMMIT`` write that reports an error but whose request lands later (a lost response on a
  blob store): nothing of the step is removed, the error says it may have committed, and once
  the marker lands the step restores bit-exact;
* the next save removes the leftovers of an older writer that crashed mid-commit (its shard and
  its half-written manifest's temp file), never a newer writer's files.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nebula_ckpt as nc
from nebula_ckpt.dcp import NebulaStorageWriter
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.format.names import COMMIT, MANIFEST, shard_name
from nebula_ckpt.storage.local import LocalStorage

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

WRITERS = ("checkpointer", "dcp")


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 8), float(step)), "b": torch.arange(16.0) + step}


class _Writer:
    """One job saving through ``kind``: a Checkpointer open for the whole test (one generation), or
    DCP saves (one generation per process and root)."""

    def __init__(self, kind: str, root: str) -> None:
        self.kind, self.root = kind, root
        self.ck = None if kind == "dcp" else nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_last=5)],
                                                               on_persist_error="log")

    def save(self, step: int) -> None:
        """Save ``_state(step)`` as ``step``; the save's own error is raised."""
        if self.ck is not None:
            self.ck.save_async(step, _state(step)).result()
            return
        try:
            dcp.save(_state(step), storage_writer=NebulaStorageWriter(self.root, step=step))
        except CheckpointException as e:
            raise next(iter(e.failures.values()))[0] from None

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()


@pytest.fixture(params=WRITERS)
def job(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Writer]:
    w = _Writer(request.param, str(tmp_path / "ck"))
    yield w
    w.close()


def _restored(root: str, step: int) -> None:
    """Step ``step`` restores with exactly ``_state(step)``."""
    into = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with nc.Checkpointer(root, tiers=[nc.LocalTier(root, keep_last=5)]) as ck:
        assert ck.load(step, into=into) == step
    for k, v in _state(step).items():
        assert torch.equal(into[k], v), k


def _faulty_write_small(fail: Callable[[str], bool], landed: list[tuple[Any, str, bytes]]) -> Callable[..., None]:
    real = LocalStorage.write_small

    def write_small(self: LocalStorage, rel: str, data: bytes, *, create_only: bool = False) -> None:
        if fail(rel):
            if rel.endswith(COMMIT):
                landed.append((self, rel, data))
            raise OSError(errno.ETIMEDOUT, f"injected: writing {rel} failed")
        real(self, rel, data, create_only=create_only)

    return write_small


@pytest.mark.parametrize("stage", ["manifest", "commit"])
def test_a_failure_before_the_marker_exists_removes_the_step(job: _Writer, stage: str) -> None:
    job.save(1)
    name = MANIFEST if stage == "manifest" else COMMIT
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalStorage, "write_small", _faulty_write_small(lambda rel: rel == f"step-2/{name}", []))
        with pytest.raises((nc.NebulaError, OSError), match="injected") as ei:  # DCP: the storage's error
            job.save(2)
    assert "may have committed" not in str(ei.value)
    assert not (Path(job.root) / "step-2").exists()      # its shard and manifest, then the empty folder
    assert committed_steps(LocalStorage(job.root)) == [1]
    _restored(job.root, 1)


def test_a_commit_write_that_may_have_landed_deletes_nothing(job: _Writer) -> None:
    job.save(1)
    landed: list[tuple[Any, str, bytes]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalStorage, "failed_create_is_final", False, raising=False)  # as on a blob store
        mp.setattr(LocalStorage, "write_small", _faulty_write_small(lambda rel: rel == f"step-2/{COMMIT}", landed))
        with pytest.raises(nc.PersistError, match="may have committed"):
            job.save(2)
    d = Path(job.root) / "step-2"
    assert (d / MANIFEST).exists() and len(list(d.glob("shard-*"))) == 1   # nothing of it deleted
    assert committed_steps(LocalStorage(job.root)) == [1]
    assert len(landed) == 1
    for st, rel, data in landed:                                               # the request lands
        LocalStorage.write_small(st, rel, data, create_only=True)
    assert committed_steps(LocalStorage(job.root)) == [1, 2]
    _restored(job.root, 2)


def test_leftovers_of_an_older_writer_are_swept_and_a_live_peers_kept(job: _Writer) -> None:
    root = Path(job.root)
    # a writer of generation 1 (another process) crashed while committing step 5: its shard is
    # there, its manifest only as the temp file of a write that never finished
    writers = root / "_nebula" / "writers"
    writers.mkdir(parents=True)
    (writers / "g-1.json").write_text(json.dumps({"host": "elsewhere", "pid": 1, "time": 0.0}))
    crashed = root / "step-5"
    crashed.mkdir()
    (crashed / shard_name(1, 0)).write_bytes(b"\0" * 128)
    (crashed / f".{MANIFEST}.tmp-0123456789ab").write_bytes(b"{")
    job.save(1)                                   # this job: a newer generation, which sweeps them
    gen = json.loads((root / "step-1" / MANIFEST).read_bytes())["generation"]
    assert gen > 1
    assert not crashed.exists()
    # a peer rank of this very job still writing step 6: never its files
    peer = root / "step-6"
    peer.mkdir()
    (peer / shard_name(gen, 1)).write_bytes(b"\0" * 128)
    job.save(2)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1", "step-2", "step-6"]
    assert os.listdir(peer) == [shard_name(gen, 1)]
    _restored(job.root, 2)
