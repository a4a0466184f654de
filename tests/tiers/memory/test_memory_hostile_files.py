"""The memory tier's own files are input too: a named pipe, a sparse file of a terabyte or a
folder where one of its files belongs is refused at once, naming it, never waited on or read whole.

Its folder is private (0700), but the user who runs the job can still plant a file there (another
of their processes, a script gone wrong). Every reader of it (the ``ROOT`` owner a Checkpointer
reads to claim the tier, the manifests a replica is made whole from, the shards it maps, the files a
rank sends its partners) goes through the same regular-file-only, non-blocking, bounded helpers as
the persistent tiers (:func:`~nebula_ckpt.storage.local.read_small_file`). The readers run under
the deadline of ``tests/format/test_hostile_files.py`` (``_within``), so a reader that blocks fails
the test instead of hanging the suite.

And a step a manifest records outside its step field (``stats.base_step``: the step an
incremental step was built on, which a partner looks for among its replicas) is read as every
step is, ``[0, 2**63-1]``: anything else is damage, ignored as its neighbour ``base_write`` is.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.checks import MAX_STEP
from nebula_ckpt.format.commit import read_commit
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.tiers.memory.replica_save import _mine
from nebula_ckpt.tiers.memory.replica_whole import holds_base, materialise, step_base
from nebula_ckpt.tiers.memory.tier import memory_tier_path
from records_view import flat_manifest, seal
from test_hostile_files import _within


def _fifo(path: str) -> str:
    os.unlink(path)
    os.mkfifo(path)
    return path


def _sparse(path: str) -> str:
    os.unlink(path)
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # 1 TiB, no pages
    return path


def _incremental(root: str) -> dict[int, int]:
    """Steps 1 (whole) and 2 (built on 1: it refers to step 1's shard) in the folder ``root``, laid
    out as a memory tier lays them out; their writer generations by step."""
    frozen = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    with knobs.override(incremental_full_every=10), nc.Checkpointer(root, memory_tier=False, keep_last=5) as ck:
        ck.save(1, {"frozen": frozen, "t": torch.zeros(8)})
        ck.save(2, {"frozen": frozen, "t": torch.ones(8)})
    st = LocalStorage(root)
    return {s: read_commit(st, s, f"step {s}").generation for s in (1, 2)}


def _crashed(root: str, shm_dir: str, steps: tuple[int, ...]) -> str:
    """Save ``steps`` (``w``: the step's value) on both tiers of ``root``, then be killed: the memory
    tier stays as a crash leaves it (a clean close frees it), holding the last step. Its folder."""
    code = f"""
import os, signal, torch, nebula_ckpt as nc
ck = nc.Checkpointer({root!r}, keep_last=5)
for s in {steps!r}:
    ck.save(s, {{"w": torch.full((64,), float(s))}})
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = warm_python.run([sys.executable, "-c", code], env=dict(os.environ, NEBULA_SHM_DIR=shm_dir),
                        capture_output=True, timeout=120, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    folder = memory_tier_path(root)
    assert f"step-{steps[-1]}" in os.listdir(folder)
    return folder


def _shard(folder: str, step: int) -> str:
    d = os.path.join(folder, f"step-{step}")
    return os.path.join(d, next(n for n in os.listdir(d) if n.endswith(".safetensors")))


# -- the ROOT file a Checkpointer reads to claim its memory tier -------------------------------------

@pytest.mark.parametrize("how", ["fifo", "sparse"])
def test_a_root_file_that_is_a_fifo_or_sparse_is_refused_and_the_job_saves_on(
        tmp_path: Any, shm_dir: str, caplog: pytest.LogCaptureFixture, how: str) -> None:
    root = str(tmp_path / "root")
    folder = _crashed(root, shm_dir, (1,))
    owner = os.path.join(folder, "ROOT")
    planted = _fifo(owner) if how == "fifo" else _sparse(owner)
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")

    def restart() -> tuple[list[str], Any]:
        w = torch.zeros(64)
        with nc.Checkpointer(root) as ck:
            kinds = [t.kind for t in ck.tiers]
            got = ck.load_latest(into={"w": w})
            ck.save(2, {"w": torch.full((64,), 2.0)})
        return kinds, (got, w)

    kinds, (got, w) = _within(planted, restart)
    assert "memory" not in kinds  # no readable owner: the tier is nobody's and is not used
    assert got == 1 and torch.equal(w, torch.ones(64))  # restored from the local tier
    what = "is a named pipe (FIFO), not a regular file" if how == "fifo" else "is 1099511627776 bytes, more than"
    assert f"'{planted}' {what}" in caplog.text, caplog.text
    with nc.Checkpointer(root, read_only=True) as ck:
        assert ck.list() == [1, 2]


# -- a replica made whole: the manifests and shards it reads ------------------------------------------

@pytest.mark.parametrize("how", ["fifo", "sparse", "folder"])
def test_step_base_refuses_a_manifest_that_is_no_regular_small_file(tmp_path: Any, how: str) -> None:
    """What a rank sends its partners for an incremental step is read from its manifest."""
    root = str(tmp_path / "mem")
    gens = _incremental(root)
    path = os.path.join(root, "step-2", "manifest.json")
    if how == "folder":
        os.unlink(path)
        os.mkdir(path)
        planted, what = path, "is a folder, not a regular file"
    elif how == "fifo":
        planted, what = _fifo(path), "is a named pipe (FIFO), not a regular file"
    else:
        planted, what = _sparse(path), "is 1099511627776 bytes, more than"
    with pytest.raises(CorruptCheckpointError) as ei:
        _within(planted, lambda: step_base(root, 2, gens))
    assert f"'{planted}' {what}" in str(ei.value)


@pytest.mark.parametrize("how", ["fifo", "sparse"])
def test_a_held_base_whose_manifest_is_no_regular_small_file_is_not_held(tmp_path: Any, how: str) -> None:
    root = str(tmp_path / "mem")
    gens = _incremental(root)
    need = step_base(root, 2, gens)
    assert need is not None and holds_base(root, need)
    path = os.path.join(root, "step-1", "manifest.json")
    planted = _fifo(path) if how == "fifo" else _sparse(path)
    assert _within(planted, lambda: holds_base(root, need)) is False


def test_materialise_refuses_a_held_shard_that_is_a_fifo(tmp_path: Any) -> None:
    """The partner maps its replica of the base to make the received step whole: a FIFO there is
    refused, naming it, and the copy is not made (the caller discards it)."""
    held = str(tmp_path / "held")
    gens = _incremental(held)
    need = step_base(held, 2, gens)
    inc = str(tmp_path / "incoming")
    os.makedirs(os.path.join(inc, "step-2"))
    for name in os.listdir(os.path.join(held, "step-2")):  # what the owner sends: the step's own files
        shutil.copy(os.path.join(held, "step-2", name), os.path.join(inc, "step-2", name))
    planted = _fifo(_shard(held, 1))
    with pytest.raises(CorruptCheckpointError, match=f"'{planted}' is a named pipe"):
        _within(planted, lambda: materialise(inc, 2, held, need))


def test_a_step_whose_shard_is_a_fifo_is_not_sent_to_partners(tmp_path: Any, caplog: pytest.LogCaptureFixture
                                                                ) -> None:
    """A rank opens its step's files before the round sends them: a FIFO among them is refused at
    once (the step is not replicated, a warning says why) and the round goes on."""
    root = str(tmp_path / "mem")
    _incremental(root)
    planted = _fifo(_shard(root, 2))
    rp = SimpleNamespace(folder=root)
    handle = SimpleNamespace(step=2, tiers_written=["memory:" + root])
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    assert _within(planted, lambda: _mine(rp, handle)) == (None, [])
    assert f"'{planted}' is a named pipe (FIFO)" in caplog.text, caplog.text


# -- the memory tier's steps at restore ---------------------------------------------------------------

@pytest.mark.parametrize("rel", ["COMMIT", "manifest.json", "shard"])
def test_a_fifo_in_a_memory_tier_step_is_skipped_at_restore(tmp_path: Any, shm_dir: str, rel: str) -> None:
    root = str(tmp_path / "root")
    folder = _crashed(root, shm_dir, (1, 2))
    planted = _fifo(_shard(folder, 2) if rel == "shard" else os.path.join(folder, "step-2", rel))

    def restore() -> tuple[Any, torch.Tensor]:
        w = torch.zeros(64)
        with nc.Checkpointer(root, read_only=True) as ck:
            return ck.load_latest(into={"w": w}), w

    got, w = _within(planted, restore)
    assert got == 2 and torch.equal(w, torch.full((64,), 2.0))  # the local tier's step 2


# -- stats.base_step: a step, read as every step is -----------------------------------------------------

def _set_base_step(root: str, value: Any) -> None:
    """Rewrite step 2's manifest with ``stats.base_step = value`` and commit it again (checksums valid)."""
    d = Path(root) / "step-2"
    man = flat_manifest(d)
    man["stats"]["base_step"] = value
    seal(d, man)


@pytest.mark.parametrize("value", [-1, MAX_STEP + 1, 2**80, True, 1.0, "1"])
def test_a_base_step_no_save_takes_is_ignored_as_damage(tmp_path: Any, caplog: pytest.LogCaptureFixture,
                                                        value: Any) -> None:
    """No base is looked for among a partner's replicas (it is sent the shards the step refers to
    instead), and a warning names the field; a valid one still names the base."""
    root = str(tmp_path / "mem")
    gens = _incremental(root)
    need = step_base(root, 2, gens)
    assert need is not None and need["base"] == 1
    _set_base_step(root, value)
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    need = step_base(root, 2, gens)
    assert need is not None and need["base"] is None and need["gen"] is None
    assert [r[0] for r in need["refs"]] == [1]  # what the partner is sent instead
    assert not holds_base(root, need)
    assert "stats.base_step" in caplog.text and "out of range [0, 9223372036854775807]" in caplog.text \
        or "stats.base_step must be an integer" in caplog.text, caplog.text
    _set_base_step(root, MAX_STEP)  # the largest step a save takes is a step (no replica of it here)
    need = step_base(root, 2, gens)
    assert need is not None and need["base"] == MAX_STEP
