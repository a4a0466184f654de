"""A container's small ``/dev/shm`` (Docker gives 64 MiB): a real small tmpfs (``small_tmpfs``,
skipped where mounting is not permitted) and a state that does not fit it. The memory tier
stands aside, said once with the fix (``docker run --shm-size``, Kubernetes' memory-backed
``emptyDir``, ``NEBULA_SHM_DIR``); every save goes to the other tiers without an error, ``wait``
and ``close`` raise nothing. The room is counted at every save: a state that grows past the tmpfs
later, or room another process takes, makes the tier stand aside then; it takes saves again once
they fit."""

from __future__ import annotations

import logging
import os
from typing import Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs

MiB = 1 << 20


def _state(mib: float, seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(int(mib * MiB) // 4, generator=torch.Generator().manual_seed(seed))}


def _stands_aside(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "stands aside" in r.getMessage()]


def test_a_state_larger_than_the_tmpfs_goes_to_the_other_tiers_without_an_error(
        tmp_path, small_tmpfs: Callable[[str], str], caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    shm = small_tmpfs("4m")
    root = str(tmp_path / "ckpt")
    with knobs.override(shm_dir=shm), caplog.at_level(logging.INFO, logger="nebula_ckpt"):
        with nc.Checkpointer(root) as ck:
            mem, disk = ck.tiers[0].name, ck.tiers[1].name
            assert mem.startswith("memory:")
            for step in range(4):
                h = ck.save_async(step, _state(6, step))
                assert h.result() == [disk] and h.error() is None, step
            ck.wait()
            into = _state(6, 99)
            assert ck.load_latest(into=into) == 3 and ck.last_restore["tier"] == disk
            assert torch.equal(into["w"], _state(6, 3)["w"])
    (said,) = _stands_aside(caplog)
    assert "from step 0 on" in said and "6.0 MiB" in said and shm in said, said
    for fix in ("docker run --shm-size=1g", "emptyDir", "medium: Memory", "NEBULA_SHM_DIR"):
        assert fix in said, said
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert not any(n.startswith("step-") for _d, _s, files in os.walk(shm) for n in _s + files)  # nothing partial


def test_a_state_that_grows_later_and_room_others_take(
        tmp_path, small_tmpfs: Callable[[str], str], caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """A state that fits, then grows past the tmpfs, then shrinks; then another process fills the
    tmpfs, then frees it: the memory tier takes exactly the saves that fit, one warning in all."""
    shm = small_tmpfs("8m")
    root = str(tmp_path / "ckpt")
    other = os.path.join(shm, "someone-elses-file")
    with knobs.override(shm_dir=shm), caplog.at_level(logging.INFO, logger="nebula_ckpt"):
        with nc.Checkpointer(root, tiers=[nc.MemoryTier(), nc.LocalTier(root, keep_last=10)]) as ck:
            mem, disk = ck.tiers[0].name, ck.tiers[1].name

            def saved(step: int, mib: float) -> list[str]:
                return sorted(ck.save(step, _state(mib, step)).tiers_written)
            sizes = {1: 1, 2: 2, 3: 2, 4: 5, 5: 1}
            assert saved(1, sizes[1]) == sorted([mem, disk])
            with open(other, "wb") as f:                      # another process takes room that the
                f.write(os.urandom(4 * MiB))                  # 2 MiB state needs (its step beside the next)
            assert saved(2, sizes[2]) == [disk]               # stands aside
            os.unlink(other)                                  # ... and gives it back
            assert saved(3, sizes[3]) == sorted([mem, disk])  # takes saves again
            assert saved(4, sizes[4]) == [disk]               # grew past the tmpfs: stands aside
            assert saved(5, sizes[5]) == sorted([mem, disk])  # fits again
            for step, mib in sizes.items():
                into = _state(mib, 99)
                assert ck.load(step, into=into) == step
                assert torch.equal(into["w"], _state(mib, step)["w"]), step
    assert len(_stands_aside(caplog)) == 1
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    for said in ("takes saves again from step 3", "stands aside from step 4 on", "takes saves again from step 5"):
        assert any(said in m for m in infos), (said, infos)
