"""Operations of the one-process machine where a job's surroundings go wrong (a mixin of
:class:`~stateful.machine.Single`): what the process, the node or the wall clock does to it.

* ``start_out_of_fds``: a job whose restore runs out of file descriptors (``RLIMIT_NOFILE`` set a
  few above what the process holds, for ``load_latest`` only). ``load_latest`` raises
  ``OSError(EMFILE)`` naming the step the model says it must open and the fix (``ulimit -n``),
  never an older step nor ``None`` (``restore/unreadable.py``, docs/guarantees.md); or, where the
  few descriptors sufficed, restores that very step. Then the limit is raised and the same
  Checkpointer restores the true newest step (``retry``), or the job ends (``exit``, ``close``:
  it wrote nothing) and the next job's restore is checked as any.
* ``job_without_shm``: a whole job on a node whose ``NEBULA_SHM_DIR`` is a file: the memory tier
  stands aside with a warning (``memory tier skipped: ... is not a folder``), ``list()`` shows the
  disk tier alone, the restore opens the newest write of the disk tier, each save goes to the disk
  tier where its cadence names it (and nowhere else: the tier that stood aside takes none), and
  ``close()`` adds nothing. The node's folder then comes back as it was (``kept``) or empty
  (``emptied``: its memory tiers gone, as a lost node's).
* ``clock_steps_back``: a node's wall clock (``time.time()`` / ``time.time_ns()`` of every process
  on it: its jobs and the operator's commands, ``worker.py``'s shim, set before nebula_ckpt is
  imported) steps back an hour or a day; a later mark (a person's ``nebula-ckpt mark``, a job's
  ``report()``) still decides over every earlier one (docs/health.md: the order they were
  written in), which every restore checks; ``flip`` marks a step the other way at once, from the
  node whose clock just stepped back. The disk tier's ``every_seconds`` (drawn per sequence:
  :data:`SECONDS_APART`, shorter than any two saves are apart) keeps taking every save its
  ``every`` names, whatever the wall clock does (each save's check).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable, Optional

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from stateful.model import Violation

if TYPE_CHECKING:
    from stateful.machine import Job, Single
    from stateful.model import Entry

#: the disk tier's ``every_seconds`` when drawn: far shorter than two saves are ever apart (each
#: waits for the one before), so that the cadence takes every save ``every`` names
SECONDS_APART = 1e-4

#: what a worker's log says when the memory tier stands aside for a NEBULA_SHM_DIR that is a file
SKIPPED = ("memory tier skipped", "is not a folder")


class EnvOps:
    """The rules of this module; see the module docstring."""

    # -- a restore out of file descriptors ---------------------------------------------------------
    @precondition(lambda self: self.job is None)
    @rule(node=st.sampled_from([0, 1]), spare=st.integers(1, 3), then=st.sampled_from(["retry", "exit", "close"]))
    def start_out_of_fds(self: "Single", node: int, spare: int, then: str) -> None:
        """A job on ``node`` whose ``load_latest`` may open only ``spare`` file descriptors more than
        the process holds. See the module docstring."""
        from stateful.machine import Job

        self.audit(node)
        keys: list[Hashable] = [self.mem(node), "disk"]
        want = self.truth.target(keys, frozenset(self.truth.suspect()))
        # every step suspect (or damaged: DamageOps): a plain start
        if want is None and (self.truth.target(keys) is not None or any(self.truth.damaged(k) for k in keys)):
            self.note(f"start a job on n{node} (every step suspect or damaged: no descriptor limit)")
            self._start(node)
            return
        self.note(f"start a job on n{node}, its restore with {spare} file descriptor(s) to spare; then {then}")
        proc = self.shared.pool.take()
        job = Job(proc, node, self.path)
        got = proc.call(self.open_command(node, nofile=spare))
        if got is None:
            self.fail(f"the job on n{node} died while restoring out of file descriptors (log: {proc.log_path}):\n"
                      f"{proc.tail()}")
        assert got is not None
        self.job = job
        if "error" in got:
            self._refused_here(got, node, want)
        elif want is None:  # nothing committed: nothing it could not open
            self.check_restore(got, node)
        else:
            self.note(f"  the {spare} descriptor(s) sufficed")
            self.check_restore(got, node)  # the very step it must open, or a violation
        if then == "retry":  # the limit raised, the same Checkpointer
            self.audit(node)
            self.note(f"  load_latest again on n{node}, the limit raised")
            again = proc.call({"op": "restore"})
            if again is None:
                self.fail(f"the job on n{node} died in load_latest (log: {proc.log_path}):\n{proc.tail()}")
            assert again is not None
            self.check_restore(again, node)
        elif then == "exit":
            proc.call({"op": "exit"})
            self._end_job()
        else:
            self._close(job)  # it wrote nothing: nothing changes
            self._end_job()

    def _refused_here(self: "Single", got: dict[str, Any], node: int,
                      want: Optional[tuple[int, "Entry", Hashable]]) -> None:
        """``load_latest`` raised out of descriptors: an ``OSError`` (EMFILE) that names the step the
        model says it must open and the fix; ``latest()``, asked before, named that step. With nothing
        committed (``want`` None) the EMFILE of a listing may come as it is."""
        err = got["error"]
        where = f"restore on n{node} out of file descriptors"
        self.note(f"  raised {err[:200]}")
        if not err.startswith("OSError") or "Errno 24" not in err:
            self.fail(f"{where} raised {err}; the model has {want or 'nothing committed'}: not the EMFILE it met")
        if want is None:
            self._observe_listed(got, node)
            return
        step, entry, key = want
        named = re.search(r"\bstep (\d+)\b", err)
        # a health record it could not read counts as none (docs/health.md): it may have met a newer
        # write marked suspect first
        keys: list[Hashable] = [self.mem(node), "disk"]
        suspect, order = self.truth.suspect(), (entry.writer, step, entry.sid)
        newer = {s for k in keys for s, e in self.truth.entries(k).items()
                 if (e.writer, s, e.sid) in suspect and (e.writer, s, e.sid) > order}
        if named is None or int(named.group(1)) not in newer | {step} or "ulimit -n" not in err:
            self.fail(f"{where} raised {err}: it must name step {step} ({entry}, on {key}) and the fix (ulimit -n)")
        if not got.get("latest") or got["latest"][0] != step:
            self.fail(f"{where}: latest() named {got.get('latest')}; step {step} ({entry}) is the newest on {key}")
        disk = self.truth.whole("disk")  # a damaged copy there is no reason to hand the pages over
        if key == self.mem(node) and step in disk and disk[step].sid == entry.sid:
            self.truth.may_drop(key, step)  # the memory tier's pages may have been handed over first
        self._observe_listed(got, node)

    def _observe_listed(self: "Single", got: dict[str, Any], node: int) -> None:
        """``list()`` after a failed restore (the limit raised again): what the model knows is there."""
        listed = got["listed"]
        try:
            self.truth.observe_listing(self.mem(node), listed.get("memory", []),
                                       f"list() of the memory tier of n{node}")
            self.truth.observe_listing("disk", listed.get("local", []), "list() of the disk tier")
        except Violation as e:
            self.fail(str(e))

    # -- a node whose NEBULA_SHM_DIR is a file -----------------------------------------------------
    # also under the sequence's host-memory budget (its saves then go ahead: no memory tier holds anything)
    @precondition(lambda self: self.job is None)
    @rule(node=st.sampled_from([0, 1]), saves=st.integers(0, 3), end=st.sampled_from(["close", "exit", "sigkill"]),
          back=st.sampled_from(["kept", "emptied"]))
    def job_without_shm(self: "Single", node: int, saves: int, end: str, back: str) -> None:
        """A job on ``node`` whose NEBULA_SHM_DIR is a file: restore, ``saves`` saves, its end; then
        the node's folder back (``kept``) or empty (``emptied``). See the module docstring."""
        from stateful.machine import Job

        self.audit(node)
        shm = self.shm_of(node)
        aside = shm + ".aside"
        if os.path.lexists(shm):
            os.rename(shm, aside)
        else:
            os.makedirs(aside)
        Path(shm).write_text("not a folder\n")
        self.note(f"start a job on n{node}, its NEBULA_SHM_DIR a file; {saves} save(s), then {end}; "
                  f"the folder then {back}")
        try:
            proc = self.shared.pool.take()
            job = Job(proc, node, self.path, no_memory=True)
            got = proc.call(self.open_command(node))
            if got is None:
                self.fail(f"the job on n{node} died while restoring without a memory tier (log: {proc.log_path}):\n"
                          f"{proc.tail()}")
            assert got is not None
            self.job = job
            said = proc.log_path.read_text()
            if not all(s in said for s in SKIPPED):
                self.fail(f"restore on n{node}: NEBULA_SHM_DIR is a file, and no warning says the memory tier is "
                          f"skipped (log: {proc.log_path}):\n{said[-2000:]}")
            self.check_restore(got, node)
            if got.get("step") is not None and not str(got.get("tier")).startswith("local"):
                self.fail(f"restore on n{node} without a memory tier opened step {got['step']} from {got.get('tier')}")
            for _ in range(saves):
                self._save(job.cursor + 1)
            self._end_without_shm(job, end)
        finally:
            self._shm_back(node, aside, back)

    def _end_without_shm(self: "Single", job: "Job", end: str) -> None:
        """The job without a memory tier ends: its close adds nothing (its tiers hold nothing the disk
        tier lacks), nor does a crash."""
        self.note(f"end the job on n{job.node} (no memory tier): {end}")
        if end == "close":
            got = job.proc.call({"op": "close"})
            if got is None or got["error"]:
                self.fail(f"close() on n{job.node} without a memory tier failed: {got}")
        elif end == "exit":
            job.proc.call({"op": "exit"})
        else:
            job.proc.kill()
        self._end_job()

    def _shm_back(self: "Single", node: int, aside: str, back: str) -> None:
        """The node's memory-tier folder comes back: as it was, or empty (its memory tiers gone)."""
        shm = self.shm_of(node)
        if os.path.isfile(shm):
            os.unlink(shm)
        if back == "kept":
            os.rename(aside, shm)
            return
        shutil.rmtree(aside, ignore_errors=True)
        os.makedirs(shm, exist_ok=True)
        for key in [k for k in self.truth.tiers if isinstance(k, tuple) and k[1] == node]:
            self.truth.drop_all(key)

    # -- a wall clock that steps back --------------------------------------------------------------
    @rule(node=st.sampled_from([0, 1]), hours=st.sampled_from([1, 25]), flip=st.booleans())
    def clock_steps_back(self: "Single", node: int, hours: int, flip: bool) -> None:
        """``node``'s wall clock steps back ``hours`` (its live job's too, at once); with ``flip``, a
        person then marks a step the other way from that node. See the module docstring."""
        name = f"n{node}"
        clocks = self.shared.clocks
        clocks[name] = clocks.get(name, 0) - hours * 3600 * 10**9
        self.note(f"the wall clock of n{node} steps back {hours} h (now {clocks[name] / 3.6e12:+.0f} h)")
        job = self.job
        if job is not None:
            got = job.proc.call({"op": "clock", "offsets": clocks})
            if got is None:
                self.fail(f"the job on n{job.node} died when its clock was set (log: {job.proc.log_path})")
            assert got is not None
            if job.node == node and abs(got["time"] - (time.time() + clocks[name] / 1e9)) > 600:
                self.fail(f"the job on n{node} reads time.time() {got['time']:.0f}; its clock is "
                          f"{clocks[name] / 1e9:+.0f} s off {time.time():.0f}")
        if flip and os.path.isdir(self.path):
            self._flip_mark(node)

    def _flip_mark(self: "Single", node: int) -> None:
        """From ``node`` (its clock just stepped back): mark the newest step that carries a mark the
        other way (suspect -> healthy, else suspect), or the newest step suspect."""
        self.audit(node)
        keys: list[Hashable] = [self.mem(node), "disk"]
        writes = {(e.writer, s, e.sid) for k in keys for s, e in self.truth.entries(k).items()}
        if not writes:
            return
        marked = sorted((s, w) for w, s, _ in writes if (w, s, _) in self.truth.marks)
        step = marked[-1][0] if marked else max(s for _, s, _ in writes)
        suspect = not any(self.truth.marks.get(ws) == "suspect" for ws in writes if ws[1] == step)
        self.mark_step(node, suspect, step)
