"""A resharded restore refuses an optimizer of another kind as a restore in place does.

A checkpoint of another layout (saved by N ranks, loaded by M, or by one process) is restored by
:func:`~nebula_ckpt.restore.reshard.load_resharded`, which matched the saved tree against
``into`` key by key but never asked whether the optimizer could take the state: with
``strict=False`` an SGD's state went into an Adam silently (its groups got ``momentum``, its state
``momentum_buffer`` beside its own ``exp_avg``), and with ``strict=True`` the refusal was a list
of missing keys that never said why. Now it runs the in-place restore's check
(:func:`~nebula_ckpt.restore.inplace.check_optimizer_state`) on each optimizer before anything
changes, strict or not: the same :class:`~nebula_ckpt.errors.ValidationError`, naming the
optimizer, the keys and the fix. A state the optimizer can take (Adam and AdamW) still restores.

The resharding path is the same whatever wrote the checkpoint: a one-process checkpoint given to
``load_resharded`` goes through it as a multi-rank one does (``tests/dist/test_reshard.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.restore.open import read_manifest
from nebula_ckpt.restore.reshard import load_resharded
from nebula_ckpt.storage.local import LocalStorage
from restore.test_restore_mismatch import (
    LEGIT,
    OTHER_KINDS,
    _restored_equal,
    _same,
    _saved,
    _snapshot,
    _step,
    assert_other_kind_refused,
    live,
    other_kind,
    renamed_state_key,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _resharded(root: str, into: dict[str, Any], strict: bool) -> None:
    st = LocalStorage(root)
    load_resharded(st, 1, read_manifest(st, 1), into, strict=strict)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("running", [False, True], ids=["fresh", "running"])
@pytest.mark.parametrize("what,saved_by,live_by,key", OTHER_KINDS, ids=[k[0] for k in OTHER_KINDS])
def test_an_optimizer_of_another_kind_is_refused_by_a_resharded_restore(
        tmp_path: Path, what: str, saved_by: Callable[[Any], torch.optim.Optimizer],
        live_by: Callable[[Any], torch.optim.Optimizer], key: str, running: bool, strict: bool) -> None:
    root = str(tmp_path / "ck")
    model, opt, before = other_kind(root, saved_by, live_by, running)
    with pytest.raises(nc.ValidationError) as e:
        _resharded(root, {"model": model, "optim": opt}, strict)
    msg = str(e.value)
    assert_other_kind_refused(msg, key, model, opt, before)
    with pytest.raises(nc.ValidationError) as in_place, nc.Checkpointer(root, memory_tier=False) as ck:
        ck.load_latest(into={"model": model, "optim": opt})
    assert str(in_place.value) == msg  # the very error of a restore in place


def test_a_renamed_state_key_is_refused_by_a_resharded_restore(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    model, opt, before = renamed_state_key(root)
    with pytest.raises(nc.ValidationError, match=r"'optim'.*\['stepX'\] the live one lacks, and lacks its "
                                                 r"\['step'\]"):
        _resharded(str(root), {"model": model, "optim": opt}, strict=False)
    assert _same(before, _snapshot(model, opt)), "the failed restore changed `into`"


@pytest.mark.parametrize("running", [False, True], ids=["fresh", "running"])
@pytest.mark.parametrize("what,saved_by,live_by", LEGIT, ids=[k[0] for k in LEGIT])
def test_a_state_the_optimizer_can_take_still_restores_resharded(
        tmp_path: Path, what: str, saved_by: Callable[[Any], torch.optim.Optimizer],
        live_by: Callable[[Any], torch.optim.Optimizer], running: bool) -> None:
    root = str(tmp_path / "ck")
    saved_model, saved_opt = _saved(root, saved_by)
    model, opt = live(live_by, running)
    _resharded(root, {"model": model, "optim": opt}, strict=False)
    assert all(torch.equal(a, b) for a, b in
               zip(model.state_dict().values(), saved_model.state_dict().values(), strict=True))
    assert _restored_equal(opt, saved_opt)
    _step(model, opt)  # it trains on
