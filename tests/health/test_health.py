"""Checkpoint health from the training signal: marks, demotion, retention, the CLI, hostile records.

Every run here is a real Checkpointer on a real root (files, fsync); runs follow each other on
one root as a job's restarts do. The crash tests (real processes, SIGKILL) are in
``tests/crash/test_health_restarts.py``, the ranks' in ``tests/dist/test_health_ranks.py``, blob
stores' in ``tests/blob/test_health_remote.py``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import time
from typing import Any, Callable, Optional

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt.cli import main
from nebula_ckpt.format.health import HEALTH_DIR
from nebula_ckpt.health import HealthPolicy, SpikeRule
from nebula_ckpt.health.book import HealthView
from nebula_ckpt.storage.local import LocalStorage
from tmpfs_mount import mounted_tmpfs

NAN = float("nan")


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "step": step}


def run(root: str, steps: range, losses: Optional[dict[int, float]] = None, every: int = 5, restore: bool = True,
        **kw: Any) -> tuple[Optional[int], Optional[dict[str, Any]]]:
    """One run of a job: restore the newest step (``restore``), then for each step report its loss
    (``losses``; 1.0 by default) and save every ``every`` steps; the step restored and
    ``last_restore``."""
    losses = losses or {}
    with nc.Checkpointer(root, **kw) as ck:
        got = ck.load_latest(into=_state(0)) if restore else None
        for step in steps:
            ck.report(step, loss=losses.get(step, 1.0))
            if step % every == 0:
                ck.save(step, _state(step))
        return got, ck.last_restore


def marks(root: str) -> dict[int, str]:
    """Step -> its health mark, as ``nebula-ckpt ls --json`` shows it on the root's own tier."""
    rows = [r for r in ls_rows(root) if r["tier"].startswith("local:")]
    return {r["step"]: r["health"] for r in rows if r["committed"]}


def ls_rows(root: str) -> list[dict[str, Any]]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["ls", root, "--json"])
    return json.loads(buf.getvalue())


def _until(done: Callable[[], bool], timeout: float = 120.0) -> None:
    """Wait for ``done()`` (a background write), failing only after a generous ``timeout``."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_job_that_never_reports_writes_no_record_and_restores_as_before(root: str) -> None:
    with nc.Checkpointer(root, keep_last=2) as ck:
        for step in range(4):
            ck.save(step, _state(step))
    assert not os.path.exists(os.path.join(root, HEALTH_DIR))
    with nc.Checkpointer(root, keep_last=2) as ck:
        assert ck.load_latest(into=_state(0)) == 3
        assert ck.last_restore is not None and ck.last_restore["health"] == "unknown"
        assert ck.last_restore["skipped"] == []
        ck.save(4, _state(4))
        assert ck.list(detailed=True)[next(t.name for t in ck.tiers if t.kind == "local")] == [3, 4]
    assert not os.path.exists(os.path.join(root, HEALTH_DIR))
    assert set(marks(root).values()) == {"unknown"}


def test_a_step_is_healthy_once_k_reported_steps_after_it_were_finite(root: str) -> None:
    run(root, range(0, 7), restore=False)          # saves 0 and 5; reports 1, 2 confirm 0; only 6 follows 5
    assert marks(root) == {0: "healthy", 5: "unknown"}
    run(os.path.join(root, "k3"), range(0, 7), restore=False, health=HealthPolicy(healthy_after=3))
    assert marks(os.path.join(root, "k3")) == {0: "healthy", 5: "unknown"}
    run(os.path.join(root, "k9"), range(0, 7), restore=False, health=HealthPolicy(healthy_after=9))
    assert marks(os.path.join(root, "k9")) == {0: "unknown", 5: "unknown"}


def test_a_nan_after_a_restore_demotes_the_step_and_the_fallback_after_a_second_failure(
        root: str, caplog: pytest.LogCaptureFixture) -> None:
    run(root, range(0, 13), restore=False)          # 0, 5, 10 saved and confirmed
    assert marks(root) == {0: "healthy", 5: "healthy", 10: "healthy"}
    got, _ = run(root, range(11, 14), {12: NAN})   # restored 10; NaN two steps later
    assert got == 10 and marks(root)[10] == "suspect"
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    got, last = run(root, range(6, 9), {7: math.inf})  # 10 is skipped: 5 restored, and fails too
    assert got == 5 and last is not None and last["health"] == "healthy"
    assert [(x["step"], x["reason"]) for x in last["skipped"]] == [
        (10, "loss nan at step 12, 2 reported steps after a restore from it")]
    assert "skipped 1 step(s) marked suspect: step 10" in caplog.text
    got, last = run(root, range(1, 2))             # both skipped: 0 restored
    assert got == 0 and last is not None and [x["step"] for x in last["skipped"]] == [10, 5]
    assert "loss inf at step 7" in last["skipped"][1]["reason"]
    run(root, range(1, 2), {1: NAN})               # 0 fails as well: nothing is left to restore
    with pytest.raises(nc.CorruptCheckpointError, match="every committed step that opens is marked suspect"):
        run(root, range(0))
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(on_damaged="warn") is None
    assert main(["mark", root, "--healthy", "5"]) == 0  # a person says 5 is fine after all
    got, last = run(root, range(0))
    assert got == 5 and last is not None and last["health"] == "healthy"


def test_steps_saved_from_a_step_that_went_bad_are_suspect_with_it(root: str) -> None:
    run(root, range(0, 3), every=2, restore=False, keep_last=9)     # 0 and 2 saved, 0 confirmed
    got, _ = run(root, range(3, 8), {7: NAN}, every=2, keep_last=9)  # from 2: saves 4, 6 (4 confirmed), then NaN
    assert got == 2
    assert marks(root) == {0: "healthy", 2: "suspect", 4: "suspect", 6: "suspect"}
    got, last = run(root, range(0), keep_last=9)
    assert got == 0 and last is not None
    why = {x["step"]: x["reason"] for x in last["skipped"]}
    assert why[4] == "saved from step 2, which went bad (loss nan at step 7)"


def test_a_nan_long_after_the_restore_blames_no_checkpoint(root: str) -> None:
    run(root, range(0, 3), restore=False)
    got, _ = run(root, range(1, 60), {59: NAN}, every=100, health=HealthPolicy(suspect_within=50))
    assert got == 0 and marks(root) == {0: "healthy"}  # the 58th reported step after it: not the checkpoint


def test_a_step_saved_after_a_bad_loss_is_suspect_at_once_and_a_first_run_nan_blames_nothing(root: str) -> None:
    run(root, range(0, 7), {5: NAN, 6: NAN}, every=3, restore=False)  # 0 healthy, 3 not confirmed, 6 saved at a NaN
    assert marks(root) == {0: "healthy", 3: "unknown", 6: "suspect"}
    got, last = run(root, range(0))
    assert got == 3 and last is not None and last["health"] == "unknown"  # the unconfirmed step gets its one try
    assert last["skipped"][0]["reason"] == "saved after a bad report (loss nan at step 6) and before any finite one"


def _bad_save_after_a_confirmed_step(ck: nc.Checkpointer, before_bad: Callable[[], None]) -> None:
    """Step 1 saved and confirmed healthy; ``before_bad()``; a NaN at step 4 and step 4 saved after it."""
    ck.save(1, _state(1))
    for step in (1, 2, 3):
        ck.report(step, loss=1.0)
    before_bad()
    ck.report(4, loss=NAN)
    h = ck.save_async(4, _state(4))
    try:
        h.result()
    except nc.PersistError:
        pass  # a full root: the memory tier has the step


def test_a_suspect_mark_that_failed_on_a_full_disk_is_written_later_and_its_step_never_restored(
        tmp_path: Any, shm_dir: str) -> None:
    """The mark of a step saved after a bad loss fails (ENOSPC, a real full tmpfs): it is kept, and
    written once there is room again, before close() would put the step on the disk; the restart
    skips the step."""
    with mounted_tmpfs(str(tmp_path / "small"), "16m") as mnt:
        root, filler = os.path.join(mnt, "ckpt"), os.path.join(mnt, "filler")

        def fill() -> None:
            _until(lambda: marks(root).get(1) == "healthy")
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 16))
                except OSError as e:
                    assert e.errno == errno.ENOSPC

        ck = nc.Checkpointer(root, on_persist_error="log")
        _bad_save_after_a_confirmed_step(ck, fill)
        view = HealthView(LocalStorage(root))
        assert view.mark(1, 1).state == "healthy" and view.mark(1, 4).state == "unknown"  # the mark failed
        os.unlink(filler)                                                                  # room again
        ck.close()
        assert HealthView(LocalStorage(root)).mark(1, 4).state == "suspect"
        assert 4 not in marks(root)  # nor was the step put on the disk
        got, last = run(root, range(0))
        assert got == 1 and last is not None and last["skipped"][0]["step"] == 4


def test_close_puts_no_copy_of_a_step_whose_suspect_mark_cannot_be_written(
        root: str, caplog: pytest.LogCaptureFixture) -> None:
    """While the suspect mark of a step cannot be written, close() does not put that step on a
    persistent tier whose cadence skipped it, but the newest step before it, and says how to mark
    the step by hand."""
    health = os.path.join(root, HEALTH_DIR)

    def block_records() -> None:  # the records' folder is taken by a file: every mark fails
        _until(lambda: marks(root).get(1) == "healthy")
        ck.save(3, _state(3))  # not confirmed before the NaN: unknown
        os.rename(health, health + ".aside")
        open(health, "wb").close()

    tiers = [nc.MemoryTier(keep_last=2), nc.LocalTier(root, every=10)]   # steps 3 and 4: the memory tier only
    ck = nc.Checkpointer(root, tiers=tiers)
    _bad_save_after_a_confirmed_step(ck, block_records)
    with caplog.at_level(logging.ERROR, logger="nebula_ckpt"):
        ck.close()
    assert not os.path.exists(os.path.join(root, "step-4"))
    assert "nebula-ckpt mark ROOT --suspect 4" in caplog.text
    os.unlink(health)
    os.rename(health + ".aside", health)
    got, _ = run(root, range(0), memory_tier=False)  # after a reboot: the disk only
    assert got == 3


def test_a_skipped_amp_step_neither_confirms_nor_blames(root: str) -> None:
    with nc.Checkpointer(root) as ck:
        ck.save(0, _state(0))
        ck.report(1, loss=1.0, grad_norm=math.inf)   # the loss scaler skipped this step
        ck.report(2, loss=torch.tensor(1.0), grad_norm=torch.tensor(3.0))
    assert marks(root) == {0: "unknown"}
    with nc.Checkpointer(root) as ck:
        ck.load_latest(into=_state(0))
        ck.report(1, loss=1.0, grad_norm=math.nan)
        ck.report(2, loss=1.0)
        ck.report(2, loss=1.0)                        # the same step again counts once
    assert marks(root) == {0: "unknown"}
    run(root, range(3, 5))
    assert marks(root) == {0: "healthy"}


def test_a_spike_rule_counts_as_a_bad_loss_and_a_broken_rule_is_ignored(
        root: str, caplog: pytest.LogCaptureFixture) -> None:
    run(root, range(0, 3), restore=False)
    policy = HealthPolicy(rule=SpikeRule(factor=5, window=10, warmup=3))
    got, _ = run(root, range(1, 6), {1: 2.0, 2: 2.1, 3: 1.9, 4: 2.0, 5: 30.0}, every=100, health=policy)
    assert got == 0 and marks(root) == {0: "suspect"}
    reason = ls_rows(root)[-1]["health_reason"]
    assert "loss 30 is over 5x the median 2 of the last 4 reported losses" in reason, reason

    def broken(step: int, loss: float, grad_norm: Optional[float]) -> Optional[str]:
        raise RuntimeError("rule bug")
    other = os.path.join(root, "broken")
    run(other, range(0, 4), restore=False, health=HealthPolicy(rule=broken))
    assert marks(other) == {0: "healthy"} and caplog.text.count("the health rule raised RuntimeError") == 1


def test_retention_keeps_the_newest_healthy_step_while_newer_ones_are_suspect(root: str) -> None:
    with nc.Checkpointer(root, keep_last=2) as ck:
        local = next(t.name for t in ck.tiers if t.kind == "local")
        ck.save(0, _state(0))
        for s in (1, 2):
            ck.report(s, loss=1.0)
        ck.wait()
        ck.save(1, _state(1))                         # unconfirmed when the run diverges
        ck.report(3, loss=NAN)
        for s in (4, 5, 6):                           # the run goes on and saves the bad state
            ck.save(s, _state(s))
            ck.report(s, loss=NAN)
        _until(lambda: HealthView(LocalStorage(root)).mark(1, 0).state == "healthy")  # written in the background
        ck.save(7, _state(7))
        assert ck.list(detailed=True)[local] == [0, 6, 7]  # keep_last=2, and 0: the only good step
    assert marks(root) == {0: "healthy", 6: "suspect", 7: "suspect"}
    got, last = run(root, range(0))
    assert got == 0 and last is not None and [x["step"] for x in last["skipped"]] == [7, 6]


def test_the_restored_step_saved_again_goes_suspect_with_it(root: str) -> None:
    """A run that restored step 5 and saved step 5 again (its own checkpoint of that step replaces
    the restored one) carries the restored state forward: a bad loss marks that save too, so the
    next restart does not restore the same state again."""
    run(root, range(0, 6), restore=False)                       # steps 0 and 5
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into=_state(0)) == 5
        ck.save(5, _state(5))
        ck.report(6, loss=NAN)
    got, last = run(root, range(0))
    assert got == 0 and last is not None and [x["step"] for x in last["skipped"]] == [5]


def test_a_restarted_job_drops_the_records_of_deleted_steps_whatever_each_run_confirms(root: str) -> None:
    """Each run confirms far fewer steps than the records are pruned after: the records of the
    steps retention deleted still go (at each run's first healthy mark), so a job restarted
    every few saves does not gain one record folder per step forever."""
    step = 0
    for _ in range(5):
        with nc.Checkpointer(root, keep_last=2, memory_tier=False) as ck:
            on_root = ck.list()
            ck.load_latest(into=_state(0))
            for _ in range(3):
                ck.report(step, loss=1.0)
                ck.save(step, _state(step))
                step += 1
            for _ in range(2):                        # the last save is confirmed too
                ck.report(step, loss=1.0)
                step += 1
        folders = sorted(int(n[len("step-"):]) for n in os.listdir(os.path.join(root, HEALTH_DIR)))
        assert folders and (not on_root or folders[0] >= on_root[0]), (on_root, folders)


@pytest.mark.parametrize("keep_last, report_every, bad_from", [(1, 1, 6), (3, 5, 25)])
def test_retention_never_deletes_every_good_step_before_it_could_be_confirmed(
        root: str, keep_last: int, report_every: int, bad_from: int) -> None:
    """A step is confirmed healthy only ``healthy_after`` reports after its save: a job that keeps
    one checkpoint, or saves more often than it reports, must not delete each step before that,
    or a divergence leaves nothing but suspect steps to restore."""
    with nc.Checkpointer(root, keep_last=keep_last, memory_tier=False) as ck:
        for step in range(bad_from + 15):
            if step % report_every == 0:
                ck.report(step, loss=1.0 if step < bad_from else NAN)
            ck.save(step, _state(step))
            ck.wait()
    healthy = [s for s, m in marks(root).items() if m == "healthy"]
    assert healthy and max(healthy) < bad_from
    got, last = run(root, range(0))
    assert got == max(healthy) and last is not None and last["health"] == "healthy"
    assert len(marks(root)) <= keep_last + 3  # what is held beyond keep_last stays bounded


def test_a_step_asked_for_is_restored_even_when_suspect_and_says_so(
        root: str, caplog: pytest.LogCaptureFixture) -> None:
    run(root, range(0, 3), restore=False)
    run(root, range(1, 2), {1: NAN})
    with nc.Checkpointer(root) as ck:
        assert ck.load(0, into=_state(0)) == 0
        assert ck.last_restore is not None and ck.last_restore["health"] == "suspect"
        assert ck.read(step=0)[0] == 0
    assert "which is marked suspect" in caplog.text


def test_report_checks_its_arguments_and_a_reader_cannot_report(root: str) -> None:
    with nc.Checkpointer(root) as ck:
        for bad in ("1.0", None, torch.ones(2), torch.tensor(1j), True):
            with pytest.raises(nc.ValidationError, match="loss must be a real number"):
                ck.report(1, loss=bad)
        with pytest.raises(nc.ValidationError, match="step must be a non-negative int"):
            ck.report(-1, loss=1.0)
        with pytest.raises(nc.ValidationError, match="grad_norm must be"):
            ck.report(1, loss=1.0, grad_norm="x")
        ck.save(0, _state(0))
    with nc.Checkpointer(root, read_only=True) as r, pytest.raises(nc.NebulaError, match="read-only"):
        r.report(1, loss=1.0)
    with pytest.raises(nc.ValidationError, match="HealthPolicy.healthy_after"):
        nc.Checkpointer(root, health=HealthPolicy(healthy_after=0))
    with pytest.raises(nc.ValidationError, match="health must be"):
        nc.Checkpointer(root, health={"healthy_after": 2})  # type: ignore[arg-type]


# -- the command line -------------------------------------------------------------------------------

def test_ls_shows_health_and_mark_sets_and_clears_it(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(root, range(0, 8), {7: NAN}, restore=False)   # 0 healthy, 5 unknown
    run(root, range(6, 7), {6: NAN})                  # restored 5, bad at once: 5 suspect
    capsys.readouterr()
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    header, *lines = out.splitlines()
    assert header.split()[-2:] == ["state", "health"]
    by_step = {ln.split()[1]: ln for ln in lines if ln.startswith("local:")}
    assert by_step["0"].split()[-2:] == ["verified", "healthy"]
    assert "suspect (loss nan at step 6, 1 reported step after a restore from it)" in by_step["5"]
    assert main(["mark", root, "--suspect", "0", "--reason", "bad data in shard 7"]) == 0
    assert "step 0 (writer generation 1) marked suspect: bad data in shard 7" in capsys.readouterr().out
    assert marks(root) == {0: "suspect", 5: "suspect"}
    assert main(["mark", root, "--healthy", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["health"] == "healthy"
    assert marks(root) == {0: "suspect", 5: "healthy"}
    assert main(["mark", root, "--healthy", "3"]) == 1   # no such committed step: nothing written
    assert "no committed step 3" in capsys.readouterr().err
    assert main(["mark", root, "--healthy", "-1"]) == 2
    with pytest.raises(SystemExit):
        main(["mark", root])                              # --healthy or --suspect is required


# -- hostile records ---------------------------------------------------------------------------------

def _records(root: str, step: int) -> str:
    d = os.path.join(root, HEALTH_DIR, f"step-{step}")
    os.makedirs(d, exist_ok=True)
    return d


def _record(step: int, generation: int, t: int, **over: Any) -> bytes:
    rec = {"format": "nebula_ckpt.health", "version": 1, "step": step, "generation": generation, "time_ns": t,
           "state": "suspect", "by": "report", "rank": 0, "reason": "crafted"}
    rec.update(over)
    return json.dumps(rec).encode()


def test_torn_crafted_and_foreign_records_never_fail_a_restore(root: str, caplog: pytest.LogCaptureFixture) -> None:
    run(root, range(0, 11), restore=False)
    d = _records(root, 10)
    t = 2_000_000_000_000_000_000
    files = {
        f"g1-t{t}-r0.json": _record(10, 1, t)[:-9],                          # torn: cut short
        f"g1-t{t + 1}-r0.json": _record(10, 99, t + 1),                      # content names another generation
        f"g1-t{t + 2}-r0.json": _record(10, 1, t + 2) + b" " * 5000,         # too large to be a record
        f"g1-t{t + 3}-r0.json": _record(10, 1, t + 3, version=2, extra=1),    # a newer format: ignored
        f"g1-t{t + 4}-r0.json": b"\xff\xfe\x00garbage",                       # not text
        f"g1-t{t + 5}-r0.json": _record(10, 1, t + 5, state="evil"),         # a state that does not exist
        f"g1-t{t + 6}-user.json": _record(10, 1, t + 6, rank=3, by="user"),  # a user's mark with a rank
        f"g2-t{t + 7}-r0.json": _record(10, 2, t + 7),                       # another checkpoint's mark
        f".g1-t{t + 8}-r0.json.abc.tmp": _record(10, 1, t + 8),             # a temporary file
        "notes.txt": b"hello",
    }
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    os.symlink("/etc/hostname", os.path.join(d, f"g1-t{t + 9}-r0.json"))  # a link: never followed
    os.makedirs(os.path.join(d, f"g1-t{t + 10}-r0.json"))                 # a folder named like a record
    shutil.rmtree(os.path.join(root, HEALTH_DIR, "step-0"))
    with open(os.path.join(root, HEALTH_DIR, "step-0"), "wb") as f:        # a file where a folder belongs
        f.write(b"x")
    caplog.set_level(logging.WARNING, logger="nebula_ckpt")
    got, last = run(root, range(0))
    assert got == 10 and last is not None and last["health"] == "unknown" and last["skipped"] == []
    assert "ignoring health record" in caplog.text
    assert marks(root) == {0: "unknown", 5: "healthy", 10: "unknown"}


def test_a_crafted_record_can_mark_a_step_and_nothing_more(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(root, range(0, 11), restore=False)
    t = 2_000_000_000_000_000_000
    evil = "\x1b[2J\x1b]0;pwned\x07 line\nbreak " + "x" * 5000
    with open(os.path.join(_records(root, 10), f"g1-t{t}-r0.json"), "wb") as f:
        f.write(_record(10, 1, t, reason=evil[:300]))
    got, last = run(root, range(0))
    assert got == 5 and last is not None
    reason = last["skipped"][0]["reason"]
    assert "\x1b" not in reason and "\n" not in reason and "\x07" not in reason and "pwned" in reason
    capsys.readouterr()
    main(["ls", root])
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown
    view = HealthView(LocalStorage(root))
    assert view.mark(1, 10).state == "suspect" and view.mark(1, 5).state == "healthy"


def test_a_step_saved_again_after_an_in_process_rollback_sheds_the_mark_of_the_write_it_replaced(root: str) -> None:
    """A mark names the write it was made for (its save number): step 5, saved after a bad loss,
    is suspect; the job goes back in process (``load(3)``), trains again with finite losses and
    saves step 5 again: that new write carries no mark of the old one, is confirmed healthy by
    the reports after it, and is what ``load_latest`` and ``ls`` take."""
    with nc.Checkpointer(root, memory_tier=False, keep_last=10) as ck:
        for s in range(4):
            ck.report(s, loss=1.0)
            ck.save(s, _state(s))
        ck.report(4, loss=NAN)
        ck.save(5, _state(999))  # saved after a bad loss: suspect at once
        assert marks(root)[5] == "suspect"
        ck.load(3, into=_state(0))
        ck.report(4, loss=1.0)
        ck.save(5, _state(5))  # the good state replaces step 5
        for s in (6, 7, 8):
            ck.report(s, loss=1.0)
    assert marks(root)[5] == "healthy"
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        into = _state(0)
        assert ck.load_latest(into=into) == 5 and float(into["w"][0]) == 5.0
        assert not ck.last_restore["skipped"]


def test_a_persons_mark_applies_to_the_write_it_was_made_for_not_to_a_later_one(root: str) -> None:
    """``nebula-ckpt mark --suspect 5`` marks the write of step 5 there now; when the job saves step 5
    again (it went back in process), the new write is not suspect, while a mark made afterwards
    applies to it."""
    with nc.Checkpointer(root, memory_tier=False, keep_last=10) as ck:
        for s in range(6):
            ck.save(s, _state(s))
        assert main(["mark", root, "--suspect", "5"]) == 0
        assert marks(root)[5] == "suspect"
        ck.load(3, into=_state(0))
        ck.save(5, _state(50))
    assert marks(root)[5] == "unknown"
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        into = _state(0)
        assert ck.load_latest(into=into) == 5 and float(into["w"][0]) == 50.0
    assert main(["mark", root, "--suspect", "5"]) == 0
    with nc.Checkpointer(root, memory_tier=False, read_only=True) as ck:
        assert ck.load_latest(into=_state(0)) == 4


def test_a_persons_mark_decides_over_a_mark_stamped_by_a_clock_that_ran_ahead(
        root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose wall clock runs an hour ahead (skew, or NTP later steps it back) marks step 5
    suspect; a person's ``mark --healthy 5``, made after it on a right clock, decides (each record
    is stamped after those of its checkpoint already there), and so does the training signal's
    next suspect mark after that."""
    run(root, range(0, 6), restore=False)                      # 0 healthy, 5 saved
    real = time.time_ns
    with monkeypatch.context() as m:
        m.setattr(time, "time_ns", lambda: real() + 3600 * 10**9)
        got, _ = run(root, range(6, 7), {6: NAN})              # restored 5, bad at once
    assert got == 5 and marks(root)[5] == "suspect"
    assert main(["mark", root, "--healthy", "5"]) == 0
    assert marks(root)[5] == "healthy"
    got, _ = run(root, range(6, 7), {6: NAN})                  # restored 5 again, bad again
    assert got == 5 and marks(root)[5] == "suspect"
    assert run(root, range(0))[0] == 0
