"""Operations of the one-process machine where the root's copy of a step goes bad, or goes away
while another process reads it (a mixin of :class:`~stateful.machine.Single`).

* ``damage_root_copy``: between jobs, the disk tier's copy of a committed step is damaged the
  way a partial upload or a lost object leaves it: its own shard cut short (``truncate``) or
  gone (``delete shard``), or its manifest gone (``delete manifest``); its commit marker stays.
  The library tells each of these from the files' sizes
  (:func:`~nebula_ckpt.restore.intact.restore_problem`, ``latest()``'s and adoption's checks), so
  every reader must agree. The model keeps the copy as *damaged* (``Truth.bad``, per tier, step
  and save) and every later write of the disk tier (in a restore's order) as *maybe damaged* (an
  incremental step that refers to the damaged bytes is damaged too) until the audit right after
  reads them back.
  From then on: every audit finds a damaged copy unreadable and ``verify`` says so; a restore
  passes over it (to the memory tier's copy of that step when the node holds it, else the newest
  whole step; ``CorruptCheckpointError`` when nothing whole is left), and ``latest()`` names what
  it restores; ``verify --json`` lists it damaged (exit 1); ``gc`` keeps a memory tier whose newest
  write is whole only there; ``persist-memory`` replaces the damaged copy with the memory tier's
  when that write is the newest; a save of the step again, or a copy of it from the memory tier,
  replaces the damaged write (``Truth.commit``).
* ``read_beside_saves``: a read-only process on the other node reads the disk tier
  (``load_latest``, or ``latest()``) and is held at the first file of a step it reads (its commit
  marker, or another of its files) while the live job saves on and its disk retention may remove
  the very step being read; then the read goes on. It must give a whole step, one save's bytes,
  that the disk tier held at some moment of the read, never one older (in a restore's order) than
  the newest whole, unsuspect step there when it began; ``latest()`` a step so held.

:class:`RankDamageOps` damages a step between jobs on the two-rank machine too (see there).
Damage beside a live job is modelled with :data:`CLOSE_REPAIRS_DAMAGE` (see there).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

if TYPE_CHECKING:
    from stateful.machine import Single

#: ``close()`` replaces a damaged copy of its newest write on the disk tier (a shard cut short or
#: lost) and frees the memory tier only where a copy of that write restores: damage may land beside
#: a live job too (regression test:
#: ``test_regressions.py::test_close_keeps_or_repairs_the_only_whole_copy_of_a_step_damaged_on_the_root``).
#: False would model the old ``close()`` (marker only) and keep damage between jobs.
CLOSE_REPAIRS_DAMAGE = True

HOWS = ("truncate", "delete shard", "delete manifest")


class DamageOps:
    """The rules of this module; see the module docstring."""

    @precondition(lambda self: self.job is None or CLOSE_REPAIRS_DAMAGE)
    @rule(which=st.sampled_from(["newest", "another"]), pick=st.integers(0, 7), how=st.sampled_from(HOWS))
    def damage_root_copy(self: "Single", which: str, pick: int, how: str) -> None:
        """The disk tier's copy of a committed step damaged (``how``). See the module docstring."""
        if not os.path.isdir(self.path):
            return
        node = self.job.node if self.job is not None else 0
        self.audit(node)
        whole = self.truth.whole("disk")
        if not whole:
            return
        order = sorted(whole, key=lambda s: (whole[s].writer, s, whole[s].sid))
        step = order[-1] if which == "newest" else order[pick % len(order)]
        entry = whole[step]
        what = damage_step(os.path.join(self.path, f"step-{step}"), how)
        self.note(f"damage the disk tier's copy of step {step} ({entry}): {what}")
        self.truth.bad.add(("disk", step, entry.sid))
        if self.job is not None:  # its later saves on the disk tier may build on the damaged bytes
            self.truth.tainted.add("disk")
        for s, e in self.truth.entries("disk").items():  # a later write may refer to the damaged bytes
            if (e.writer, s, e.sid) > (entry.writer, step, entry.sid):
                self.truth.maybe_bad.add(("disk", s, e.sid))
        self.audit(node)  # each copy read back: which of them are damaged now

    @precondition(lambda self: self.job is not None and not self.job.health.bad)
    @rule(stage=st.sampled_from(["marker", "files"]), what=st.sampled_from(["load", "latest"]),
          saves=st.integers(1, 3))
    def read_beside_saves(self: "Single", stage: str, what: str, saves: int) -> None:
        """A reader held at a step's first file while the job saves ``saves`` new steps (its retention
        may remove that step). See the module docstring."""
        job = self.job
        assert job is not None
        if not os.path.isdir(self.path):
            return
        self.audit(job.node)  # the disk tier known
        start = self.truth.target(["disk"], frozenset(self.truth.suspect()))
        held_by_disk = _possible(self)
        other = 1 - job.node
        reader = self.shared.tool()  # another process than the job's (its storage hooked until read_end)
        begun = reader.call({"op": "read_begin", "root": self.path, "shm": self.shm_of(other), "node": f"n{other}",
                             "stage": stage, "what": what, "extra": self.tiers.get("extra", 5)})
        assert begun is not None, reader.tail()
        self.note(f"a reader of the disk tier on n{other} ({what}) held at {begun['held']}; the job saves on")
        try:
            for _ in range(saves):
                if self.job is None:
                    break
                self._save(self.job.cursor + 1)
                held_by_disk |= _possible(self)
        finally:  # the read is let go whatever the saves did (a failure of theirs is reported as it is)
            got = reader.call({"op": "read_end"})
        if got is None:
            self.shared.tool_died()
            self.fail(f"the reader on n{other} died (log: {reader.log_path}):\n{reader.tail()}")
        assert got is not None
        self.note(f"the reader found {({k: v for k, v in got.items() if k != 'parts'})}")
        self._check_read(got, start, held_by_disk, what)

    def _check_read(self: "Single", got: dict[str, Any], start: Any, held: set[tuple[int, int]], what: str) -> None:
        """The reader's answer: a whole step the disk tier held during the read, none older than ``start``."""
        where = f"a {what} of the disk tier beside the job's saves"
        if "error" in got and start is None and got["error"].startswith("CorruptCheckpointError"):
            return  # every step there suspect or damaged when it began (the saves came after it read)
        if "error" in got:
            self.fail(f"{where} raised {got['error']}; the disk tier held {sorted(held)} meanwhile")
        if what == "latest":
            named = got["latest"][0] if got.get("latest") else None
            if named is None and start is not None:
                self.fail(f"{where} named nothing; step {start[0]} ({start[1]}) was committed there")
            if named is not None and named not in {s for s, _ in held}:
                self.fail(f"{where} named step {named}, which the disk tier did not hold: {sorted(held)}")
            orders = [(self.truth.saves[sid].writer, s, sid) for s, sid in held if s == named]
            if named is not None and start is not None and max(orders) < (start[1].writer, start[0], start[1].sid):
                self.fail(f"{where} named step {named}, older than step {start[0]} ({start[1]}), whole there "
                          "when it began")
            return
        if got.get("step") is None:
            if start is not None:
                self.fail(f"{where} restored nothing; step {start[0]} ({start[1]}) was committed there")
            return
        sid = self.truth.check_parts(got["parts"], where)
        if (got["step"], sid) not in held:
            self.fail(f"{where} restored step {got['step']} (save #{sid}), which the disk tier did not hold: "
                      f"{sorted(held)}")
        if start is not None:
            w = self.truth.saves[sid].writer
            if (w, got["step"], sid) < (start[1].writer, start[0], start[1].sid):
                self.fail(f"{where} restored step {got['step']} (save #{sid}, writer {w}), older than step "
                          f"{start[0]} ({start[1]}), whole there when it began")


def _possible(m: "Single") -> set[tuple[int, int]]:
    """(step, save id) of every copy the disk tier may hold now, but those known damaged."""
    return {(s, e.sid) for s, p in m.truth.tier("disk").items() for e in p
            if e is not None and ("disk", s, e.sid) not in m.truth.bad}


def damage_step(folder: str, how: str) -> str:
    """Damage the committed step in ``folder`` (its commit marker stays): its own shard (not one it
    refers to) cut short or removed, or its manifest removed; what was done."""
    with open(os.path.join(folder, "manifest.json"), "rb") as f:
        man = json.loads(f.read())
    own = [sh["file"] for sh in man["shards"] if sh.get("step") is None]
    if how == "delete manifest" or not own:
        os.unlink(os.path.join(folder, "manifest.json"))
        return "manifest.json removed"
    path = os.path.join(folder, own[0])
    if how == "delete shard":
        os.unlink(path)
        return f"{own[0]} removed"
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    return f"{own[0]} cut from {size} to {size // 2} bytes"


class RankDamageOps:
    """``damage_root_copy`` on the two-rank machine (:class:`~stateful.ranks.Ranks`), between jobs:
    one rank's own shard of a step the disk tier surely holds cut short or removed (a partial
    upload, a lost object; the marker stays). The ranks' model reads no tier alone, so nothing
    resolves which later steps of the disk tier refer to the damaged bytes: every later one is
    held *maybe damaged* (``Truth.maybe_bad``) until committed again. A restore of the job or by
    one process, and an export, never give the damaged write from the disk tier (the memory tiers
    may still hold it: a restore may take it there) and are held to no later step but as maybe
    there; ``gc`` keeps a node's memory tier whose newest write the disk tier holds damaged;
    ``persist-memory`` of a damaged multi-rank step refuses (exit 1, naming it), writes nothing
    and keeps the memory copies."""

    @precondition(lambda self: self.job is None and os.path.isdir(self.root))
    @rule(which=st.sampled_from(["newest", "oldest"]), rank=st.integers(0, 1), cut=st.booleans())
    def damage_root_copy(self: Any, which: str, rank: int, cut: bool) -> None:
        from nebula_ckpt.restore.open import read_main_manifest
        from nebula_ckpt.storage.local import LocalStorage

        sure = {s: e for s, p in self.truth.tier("disk").items() if len(p) == 1
                for e in p if e is not None and ("disk", s, e.sid) not in self.truth.bad | self.truth.maybe_bad}
        if not sure:
            return
        step = max(sure) if which == "newest" else min(sure)
        entry = sure[step]
        try:
            man = read_main_manifest(LocalStorage(self.root, private=True, fsync=False), step)
        except Exception as e:  # noqa: BLE001 - the model holds it whole: that is the failure
            self.fail(f"the manifest of step {step} ({entry}), surely whole on the disk tier, cannot be read: {e}")
            raise
        own = sorted(sh.file for sh in man.shards if sh.step is None)
        mine = [f for f in own if f"-r{rank}." in f or f"-r{rank}-" in f] or own
        path = os.path.join(self.root, f"step-{step}", mine[0])
        if cut:
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            os.unlink(path)
        self.note(f"damage the disk tier's copy of step {step} ({entry}): {mine[0]} "
                  f"{'cut short' if cut else 'removed'}")
        self.truth.bad.add(("disk", step, entry.sid))
        for s, p in self.truth.tier("disk").items():
            for e in p:  # a later write (in a restore's order) may refer to the damaged bytes
                if e is not None and (e.writer, s, e.sid) > (entry.writer, step, entry.sid):
                    self.truth.maybe_bad.add(("disk", s, e.sid))
