"""``verify`` and ``ls`` while a job's retention removes steps: a step removed between the listing
and its check is left out (named on stderr), never reported ``DAMAGED``; a step whose commit marker
is still there and whose files are damaged stays ``DAMAGED``. A step a job saves again while it is
checked (its marker replaced by the new write's, then the old write's files removed) is checked
again, its new write, never reported ``DAMAGED`` either.

No race: the removal happens at a named stage of the check, from inside the storage the command
reads (a :class:`LocalStorage` whose reads of one step run a hook first), on real files.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import build_parser, main
from nebula_ckpt.cli.listing import ls_tiers
from nebula_ckpt.cli.verify import verify_tiers
from nebula_ckpt.format.commit import delete_checkpoint
from nebula_ckpt.storage.local import LocalStorage


class HookedStorage(LocalStorage):
    """A local storage that runs ``hook`` the first ``times`` times the check reads ``step``'s commit
    marker (``stage="marker"``) or one of its shards (``stage="shard"``), then reads as usual."""

    def __init__(self, root: str, step: int, stage: str, hook: Callable[[LocalStorage], None],
                 times: int = 1) -> None:
        super().__init__(root)
        self.step, self.stage, self.hook, self.times = step, stage, hook, times

    @property
    def fired(self) -> bool:
        return self.times == 0

    def _maybe(self, rel: str, stage: str) -> None:
        if self.times and stage == self.stage and rel.startswith(f"step-{self.step}/"):
            self.times -= 1
            self.hook(self)

    def read_small(self, rel: str, *args: Any, **kwargs: Any) -> bytes:
        self._maybe(rel, "marker" if rel.endswith("/COMMIT") else "small")
        return super().read_small(rel, *args, **kwargs)

    def read_buffer(self, rel: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe(rel, "shard")
        return super().read_buffer(rel, *args, **kwargs)


def _saved(root: str, steps: int = 2) -> None:
    """``steps`` full checkpoints (none refers to another: retention may drop any of them)."""
    with nc.Checkpointer(root, memory_tier=False, incremental=False) as ck:
        for s in range(1, steps + 1):
            ck.save(s, {"w": torch.full((1000,), float(s)), "step": s})


def _run(cmd: str, root: str, storage: LocalStorage, *extra: str) -> int:
    args = build_parser().parse_args([cmd, root, *extra])
    pairs = [(nc.LocalTier(root), storage)]
    return (verify_tiers if cmd == "verify" else ls_tiers)(pairs, args)


def _retention(step: int) -> Callable[[LocalStorage], None]:
    """What retention does to ``step``: its marker first, then its files (the library's own deletion)."""
    return lambda st: delete_checkpoint(st, step)


@pytest.mark.parametrize("stage", ["marker", "shard"])
@pytest.mark.parametrize("cmd", ["verify", "ls"])
def test_a_step_removed_while_it_is_checked_is_left_out_not_damaged(
        root: str, stage: str, cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    _saved(root)
    assert _run(cmd, root, HookedStorage(root, 1, stage, _retention(1)), "--json") == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [(r["step"], r["healthy"]) for r in rows] == [(2, True)], rows
    assert f"step 1 was removed while {cmd} ran" in captured.err, captured.err
    assert not os.path.exists(os.path.join(root, "step-1"))
    assert _run(cmd, root, HookedStorage(root, 2, stage, _retention(2))) == 1  # nothing left to check
    captured = capsys.readouterr()
    assert "DAMAGED" not in captured.out, captured.out
    assert ("no committed checkpoint" if cmd == "verify" else "no checkpoints") in captured.out, captured.out
    assert f"step 2 was removed while {cmd} ran" in captured.err


@pytest.mark.parametrize("cmd", ["verify", "ls"])
def test_a_step_damaged_while_it_is_checked_whose_marker_stays_is_damaged(
        root: str, cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    _saved(root)

    def damage(st: LocalStorage) -> None:  # the files change under the check; the marker stays
        d = os.path.join(root, "step-1")
        shard = next(f for f in os.listdir(d) if f.endswith(".safetensors"))
        os.truncate(os.path.join(d, shard), 100)

    assert _run(cmd, root, HookedStorage(root, 1, "shard", damage)) == 1
    captured = capsys.readouterr()
    line = next(ln for ln in captured.out.splitlines() if "step 1" in ln or ln.split()[1:2] == ["1"])
    assert "DAMAGED" in line, captured.out
    assert "removed" not in captured.err
    os.remove(os.path.join(root, "step-1", "manifest.json"))  # marker there, manifest gone: damage too
    assert _run(cmd, root, LocalStorage(root)) == 1
    assert "DAMAGED" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["verify", "ls"])
def test_when_every_listed_step_is_removed_the_root_is_listed_again(
        root: str, tmp_path, cmd: str, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """A job with keep_last=1 replaced the only step listed while it was checked: the new one is checked."""
    _saved(root)
    aside = str(tmp_path / "step-2")
    shutil.move(os.path.join(root, "step-2"), aside)

    def replaced(st: LocalStorage) -> None:
        shutil.move(aside, os.path.join(root, "step-2"))  # the next save committed ...
        delete_checkpoint(st, 1)                          # ... and retention dropped the older step

    assert _run(cmd, root, HookedStorage(root, 1, "marker", replaced), "--json") == 0
    captured = capsys.readouterr()
    assert [(r["step"], r["healthy"]) for r in json.loads(captured.out)] == [(2, True)]
    assert f"step 1 was removed while {cmd} ran" in captured.err


def _save_again(root: str, step: int, value: float) -> Callable[[LocalStorage], None]:
    """What a resumed job does to ``step``: saves it again, with other bytes (a new writer
    generation: its marker replaces the old write's, then the old write's files go)."""
    def hook(st: LocalStorage) -> None:
        with nc.Checkpointer(root, memory_tier=False, incremental=False) as ck:
            ck.save(step, {"w": torch.full((1000,), value), "step": step})
    return hook


def _read_w(root: str, step: int) -> float:
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        return float(ck.read(step)[1]["w"][0])


@pytest.mark.parametrize("cmd", ["verify", "ls"])
def test_a_step_saved_again_while_it_is_checked_is_checked_again_not_damaged(
        root: str, cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The check read step 2's marker and manifest; a job then saves step 2 again, and the old
    shard the check turns to next is gone: the step is whole throughout (old write, then new)."""
    _saved(root)
    storage = HookedStorage(root, 2, "shard", _save_again(root, 2, 20.0))
    assert _run(cmd, root, storage, "--json") == 0
    assert storage.fired
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [(r["step"], r["healthy"]) for r in rows] == [(1, True), (2, True)], rows
    assert "DAMAGED" not in captured.out and "left out" not in captured.err, captured
    assert _read_w(root, 2) == 20.0  # the check of step 2 was of its new write


@pytest.mark.parametrize("cmd", ["verify", "ls"])
def test_a_step_saved_again_during_each_check_is_left_out_not_damaged(
        root: str, cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    _saved(root)
    storage = HookedStorage(root, 2, "shard", _save_again(root, 2, 20.0), times=2)
    assert _run(cmd, root, storage) == 0  # step 1 is checked and healthy; step 2 is left out
    assert storage.fired
    captured = capsys.readouterr()
    assert "DAMAGED" not in captured.out, captured.out
    assert f"step 2 was saved again while {cmd} checked it, each time; left out" in captured.err, captured.err


@pytest.mark.parametrize("cmd", ["inspect", "export"])
def test_inspect_and_export_of_a_step_saved_again_while_it_is_read_read_its_new_write(
        root: str, cmd: str, tmp_path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str]) -> None:
    """They read step 2's marker and manifest; a job then saves step 2 again before they read its shard."""
    _saved(root)
    resave, original, fired = _save_again(root, 2, 20.0), LocalStorage.read_buffer, []

    def read_buffer(self: LocalStorage, rel: str, *args: Any, **kwargs: Any) -> Any:
        if not fired and rel.startswith("step-2/shard-"):
            fired.append(rel)
            resave(self)
        return original(self, rel, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "read_buffer", read_buffer)
    to = str(tmp_path / "out.pt")
    assert main([cmd, root, "--json", *(["--to", to] if cmd == "export" else [])]) == 0
    captured = capsys.readouterr()
    assert fired and "skipped" not in captured.err, captured.err
    assert json.loads(captured.out)["step"] == 2  # not step 1, the older one
    if cmd == "export":
        assert float(torch.load(to)["w"][0]) == 20.0  # the new write


def _hook_reads(monkeypatch: pytest.MonkeyPatch, step: int, stage: str,
                hook: Callable[[LocalStorage], None]) -> list[str]:
    """Run ``hook`` the first time the command reads ``step``'s commit marker (``stage="marker"``)
    or its manifest (``"manifest"``, once the marker named it); what it fired on."""
    fired: list[str] = []
    original = LocalStorage.read_small

    def read_small(self: LocalStorage, rel: str, *args: Any, **kwargs: Any) -> bytes:
        if not fired and rel.startswith(f"step-{step}/") and rel.endswith("/COMMIT") == (stage == "marker"):
            fired.append(rel)
            hook(self)
        return original(self, rel, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "read_small", read_small)
    return fired


@pytest.mark.parametrize("stage", ["marker", "manifest"])
@pytest.mark.parametrize("cmd", ["inspect", "export"])
def test_inspect_and_export_beside_retention_read_the_step_that_replaced_the_one_listed(
        root: str, tmp_path, cmd: str, stage: str, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str]) -> None:
    """They listed step 1 alone; before they read it, the next save committed step 2 and retention
    removed step 1: the root is listed again and step 2 read, never "no healthy checkpoint"."""
    _saved(root)
    aside = str(tmp_path / "step-2")
    shutil.move(os.path.join(root, "step-2"), aside)

    def replaced(st: LocalStorage) -> None:
        shutil.move(aside, os.path.join(root, "step-2"))
        delete_checkpoint(st, 1)

    fired = _hook_reads(monkeypatch, 1, stage, replaced)
    to = str(tmp_path / "out.pt")
    assert main([cmd, root, "--json", *(["--to", to] if cmd == "export" else [])]) == 0
    captured = capsys.readouterr()
    assert fired and json.loads(captured.out)["step"] == 2
    assert "damaged" not in captured.err and "step 1 was removed while it was read" in captured.err, captured.err
    if cmd == "export":
        assert float(torch.load(to)["w"][0]) == 2.0


@pytest.mark.parametrize("cmd", ["inspect", "export"])
def test_inspect_and_export_say_when_what_they_read_was_removed_each_time(
        root: str, tmp_path, cmd: str, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str]) -> None:
    _saved(root, steps=1)
    fired = _hook_reads(monkeypatch, 1, "manifest", _retention(1))
    assert main([cmd, root, *(["--to", str(tmp_path / "out.pt")] if cmd == "export" else [])]) == 1
    err = capsys.readouterr().err
    assert fired and "step 1 was removed while it was read, each time the root was listed" in err, err
    assert "retention" in err and "no healthy" not in err and "damaged" not in err
