"""Operations of the one-process machine that meet a live job mid-way (a mixin of :class:`~stateful.machine.Single`).

* ``close_racing_save``: ``close()`` from another thread while the training thread is inside
  ``save_async``: the save is accepted and written whole (its handle finishes), or refused with a
  ``NebulaError``; the close returns either way (docs/guarantees.md, "Nothing silent at exit").
* ``close_in_step_hook``: the preemption handler's ``close()`` (a SIGTERM handler) landing while
  ``optimizer.step()``'s pre-hook confirms the overlapped copy (``snapshot="async"``) of the save
  just accepted, or inside ``save_async``: deferred until that call returns; the save is written
  whole, nothing hangs.
* ``operator_mid_save``: a save held at a named point of one tier's writer thread while the
  operator runs ``nebula-ckpt verify --json``, ``ls --json`` and ``gc`` (``ROOT``, ``--root-timeout``)
  beside it: the read-only commands never report damage on a committed step, list only what may be
  committed and every step surely committed, and change no file of the root (nor of the memory
  tier while its writer is held); ``gc`` never frees the live job's memory tier, nor one whose root
  did not answer in time.

The model learns what happened from the worker's answer (accepted or refused). After a close the
job's process goes on with a new Checkpointer (no new process: a close costs no restart).
"""

from __future__ import annotations

import copy
import json
import os
from typing import TYPE_CHECKING, Any, Optional

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from stateful.model import Entry, Truth, Violation

if TYPE_CHECKING:
    from stateful.machine import Job, Single
    from stateful.procs import Proc

def _holds(kind: str, tag: str) -> dict[str, list[str]]:
    """The points of one tier's writer thread where a save may be held: name -> the strings its
    log line holds (as :data:`stateful.machine.SAVE_POINTS`)."""
    again = f"{kind}, a step saved again:"
    return {f"{kind} shard": ["phase=shard", f"tier={tag}"], f"{kind} manifest": ["phase=manifest", f"tier={tag}"],
            f"{kind} commit": ["phase=commit", f"tier={tag}"], f"{kind} retention": ["phase=prune", f"tier={tag}"],
            f"{kind} retention, a step deleted": ["retention deletes step", f"tier {tag}"],
            f"{again} the marker replaced": ["phase=replace ", f"tier={tag}"],
            f"{again} its manifest renamed": ["phase=settle", f"tier {tag}"],
            f"{again} the old files removed": ["phase=replaced", f"tier {tag}"]}


#: where ``operator_mid_save`` holds a save: a point of the disk tier's writer when the save writes
#: the disk tier (the root then stands still: the memory tier's writer touches only its own
#: folder), else of the memory tier's (nothing writes the root; the memory tier stands still)
DISK_HOLDS = _holds("disk", "local")
MEMORY_HOLDS = _holds("memory", "memory")
#: seconds an operator's command may wait for a held save before the save is let go (a command
#: that waits for the writer's lock is no defect: it answers once the save moved on)
TOOL_WAIT_S = 60.0
#: what ``close_racing_save`` draws: seconds the closing thread waits after both start (negative:
#: the save waits that long instead, so the close comes first)
RACE_DELAYS = [-0.005, 0.0, 0.0002, 0.001, 0.003, 0.01]


def tree(path: str) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``path``: relative name -> (size, mtime in ns); folders (-1, 0)."""
    out: dict[str, tuple[int, int]] = {}
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(top, name)
            try:
                st_ = os.lstat(full)
            except FileNotFoundError:
                continue
            out[os.path.relpath(full, path)] = (-1, 0) if name in dirs else (st_.st_size, st_.st_mtime_ns)
    return out


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return [f"removed {k}" for k in gone] + [f"created {k}" for k in new] + [f"changed {k}" for k in changed]


class LiveOps:
    """The rules of this module; see the module docstring."""

    # -- close() racing a save -------------------------------------------------------------------
    @precondition(lambda self: self.job is not None and not self.job.health.bad and not self.tiers.get("budget"))
    @rule(delay=st.sampled_from(RACE_DELAYS), gap=st.integers(1, 2), closers=st.integers(1, 2))
    def close_racing_save(self: "Single", delay: float, gap: int, closers: int) -> None:
        """``save_async`` of a new step on the training thread while one or two other threads call
        ``close()`` (``delay`` s later, or the save that much later): accepted and written whole
        before every close returns, then the job's
        newest step goes to the disk tier as any close puts it there; or refused with a
        ``NebulaError`` that says the Checkpointer was closed. The job goes on with a new Checkpointer."""
        job = self.job
        assert job is not None
        want = self._close_target(job)  # what the close keeps when the save is refused
        step = self._top_step(job) + gap
        sid, entry, disk, what = self._new_save(step)
        self.note(f"{what}, while {closers} other thread(s) close ({delay:+g} s)")
        got = job.proc.call({"op": "save_close_race", "step": step, "sid": sid, "fid": self.fid, "delay": delay,
                             "closers": closers})
        if got is None:
            self.fail(f"the job on n{job.node} died in a save racing close() (log: {job.proc.log_path}):\n"
                      f"{job.proc.tail()}")
        assert got is not None
        if got["close"] == "hung":
            self.fail(f"{what}: close() from another thread did not return (log: {job.proc.log_path})")
        if got["close"] or got["older"]:
            self.fail(f"{what}: close() raised {got['close'] or got['older']}")
        if got.get("early"):
            self.fail(f"{what}: accepted, and a close() returned before it was written")
        self.note(f"  the save was {'accepted' if got['accepted'] else 'refused: ' + got['error']}")
        if got["accepted"]:
            self._accepted_then_closed(job, step, entry, disk, got, what)
        else:
            if not got["nebula_error"] or "closed" not in got["error"]:
                self.fail(f"{what}: refused with {got['error']}, not a NebulaError saying the Checkpointer was closed")
            self._closed(job, want)
        self._open_again(job)

    def _top_step(self: "Single", job: "Job") -> int:
        """Above every step the job's tiers may hold: a save of it is the newest (writer, step)."""
        steps = self.truth.maybe_steps(self.mem(job.node)) + self.truth.maybe_steps("disk")
        return max([job.cursor, *steps])

    def _accepted_then_closed(self: "Single", job: "Job", step: int, entry: Entry, disk: bool, got: dict[str, Any],
                              what: str) -> None:
        """A save of the job's newest step accepted, then the job closed: the save is committed
        where its cadence says, and the close puts it on the disk tier when the cadence skipped it
        (the rules that come here save after no bad report: the save is not suspect, so it is the
        write the close puts there)."""
        if not got["done"]:
            self.fail(f"{what}: accepted, its handle never finished: {got['error']}")
        self._saved(step, entry, disk, got, what)
        if not disk:
            self.truth.commit("disk", step, entry, self.tiers["disk_keep"])
        self.truth.may_drop_all(self.mem(job.node))

    def _open_again(self: "Single", job: "Job") -> None:
        """The job's process goes on with a new Checkpointer on the root (no new process: what a
        framework that closes its plugin and makes another does); it restores, then saves as a new
        writer."""
        self.audit(job.node)  # what the restore must open: every tier's steps known
        self.note(f"a new Checkpointer in the job on n{job.node}, its first closed")
        got = job.proc.call({"op": "open_again"})
        if got is None:
            self.fail(f"the job on n{job.node} died while a new Checkpointer restored (log: {job.proc.log_path}):\n"
                      f"{job.proc.tail()}")
        assert got is not None
        from stateful.machine import Signal

        job.health = Signal()  # the new Checkpointer's own training signal
        job.writer, job.saves = None, 0
        self.check_restore(got, job.node)

    # -- close() from the SIGTERM handler inside optimizer.step() --------------------------------
    @precondition(lambda self: self.job is not None and not self.job.health.bad and not self.tiers.get("budget"))
    @rule(gap=st.integers(1, 2), at=st.sampled_from(["before", "after", "save_async"]))
    def close_in_step_hook(self: "Single", gap: int, at: str) -> None:
        """A save of a new step, then ``optimizer.step()`` on its state, and the preemption handler's
        ``close()`` (SIGTERM) landing in the step's pre-hook just before or after it waits for the
        overlapped copy (``snapshot="async"``), or (``at="save_async"``) inside ``save_async`` as it
        confirms the copy of the save before; where that code does not run (``"auto"``: the copy was
        made on the spot) it lands after the step. The close is deferred until the interrupted call
        returns, the save is written whole (the bytes from before the step), nothing hangs (the
        driver's command timeout fails the run). The job goes on with a new Checkpointer."""
        job = self.job
        assert job is not None
        step = self._top_step(job) + gap
        sid, entry, disk, what = self._new_save(step)
        self.note(f"{what}, then optimizer.step() and a SIGTERM handler's close() "
                  + ("in save_async()" if at == "save_async" else f"{at} the step hook's wait for the copy")
                  + f" (snapshot {self.tiers['snapshot']})")
        got = job.proc.call({"op": "close_in_step", "step": step, "sid": sid, "fid": self.fid, "at": at})
        if got is None:
            self.fail(f"the job on n{job.node} died in a close() from the step hook (log: {job.proc.log_path}):\n"
                      f"{job.proc.tail()}")
        assert got is not None
        if not got["accepted"]:
            self.fail(f"{what}: refused: {got['error']}")
        self.note(f"  the SIGTERM landed {got['where']}")
        if got["close"] or got["older"] or not got["closed"]:
            self.fail(f"{what}: the handler's close() {got['close'] or got['older'] or 'left it open'} "
                      f"(it landed {got['where']})")
        self._accepted_then_closed(job, step, entry, disk, got, what)
        self._open_again(job)

    # -- the operator's commands beside a save held mid-way ---------------------------------------
    @precondition(lambda self: self.job is not None and not self.tiers.get("budget"))
    @rule(tools=st.lists(st.sampled_from(["verify", "ls", "gc here", "gc there"]), min_size=1, max_size=3,
                         unique=True),
          hold=st.integers(0, 7), again=st.booleans(), gap=st.integers(1, 2), scoped=st.booleans(),
          timeout=st.sampled_from([None, 1e-9, 30.0]))
    def operator_mid_save(self: "Single", tools: list[str], hold: int, again: bool, gap: int, scoped: bool,
                          timeout: Optional[float]) -> None:
        """A save (of a new step, or of the current one again) held at a point of one tier's writer
        while the operator runs ``tools`` beside it (``gc`` on the job's node or the other one, with
        ``ROOT`` when ``scoped``, ``--root-timeout`` when ``timeout``). See the module docstring."""
        job = self.job
        assert job is not None
        self.audit(job.node)  # every tier known: what the commands may list, what gc may free
        step = job.cursor if again and job.cursor >= 0 else job.cursor + gap
        sid, entry, disk, what = self._new_save(step)
        holds = DISK_HOLDS if disk else MEMORY_HOLDS
        point = sorted(holds)[hold % len(holds)]
        self.note(f"{what}, held at {point}; meanwhile {', '.join(tools)}")
        spec = copy.deepcopy(self.truth)  # the save in flight may or may not be committed (and retained)
        spec.commit(self.mem(job.node), step, entry, self.tiers["memory_keep"], surely=False)
        if disk:
            spec.commit("disk", step, entry, self.tiers["disk_keep"], surely=False)
        gc_may_free = {n: self._gc_may_free(n, (step, entry) if disk else None) for n in (0, 1)}
        got = job.proc.call({"op": "save_begin", "step": step, "sid": sid, "fid": self.fid,
                             "pause": holds[point]})
        if got is None or not got["accepted"]:
            self.fail(f"{what}: {'the job died' if got is None else got['error']} (log: {job.proc.log_path})")
        assert got is not None
        if not got["paused"]:
            self.note(f"  the save finished without reaching {point}")
        still = [self.path] + ([] if disk or "gc here" in tools else [self.shm_of(job.node)])
        before = {p: tree(p) for p in still}
        outs, let_go = self._tools_beside(job, tools, scoped, timeout)
        after = {p: tree(p) for p in still}
        end = job.proc.recv({"op": "save_end"}) if let_go else job.proc.call({"op": "save_end"})
        if end is None:
            self.fail(f"the job on n{job.node} died in a held save (log: {job.proc.log_path}):\n{job.proc.tail()}")
        assert end is not None
        if not let_go:  # nothing wrote these while the writer was held (or the save was done)
            for p in still:
                if changes(before[p], after[p]):
                    self.fail(f"{', '.join(tools)} beside {what} held at {point} changed {p}: "
                              f"{changes(before[p], after[p])[:8]}")
        self._check_tools(outs, spec, f"beside {what} held at {point}")
        self._saved(step, entry, disk, end, what)
        for n in (0, 1):
            if f"gc {'here' if n == job.node else 'there'}" in tools:
                for key in gc_may_free[n]:
                    self.truth.may_drop_all(key)

    def _tools_beside(self: "Single", job: "Job", tools: list[str], scoped: bool, timeout: Optional[float]
                      ) -> tuple[dict[str, dict[str, Any]], bool]:
        """Run ``tools`` in the tool process while the job's save is held. A command that does not
        answer within :data:`TOOL_WAIT_S` (it waits for the writer) has the save let go (``save_end``
        sent; the caller reads its answer) and is waited for again. Their answers, and whether the
        save was let go early."""
        outs: dict[str, dict[str, Any]] = {}
        let_go = False
        for t in tools:
            node = job.node if t != "gc there" else 1 - job.node
            cmd = self.gc_command(node, scoped, timeout) if t.startswith("gc") else \
                {"op": "cli", "argv": [t, self.path, "--json"], "shm": self.shm_of(node), "node": f"n{node}"}
            argv = cmd["argv"]
            tool: Proc = self.shared.tool()
            assert tool.send(cmd)
            if not let_go and not tool.ready(TOOL_WAIT_S):
                self.note(f"  {' '.join(argv[:2])} waits for the held save: let go")
                let_go = True
                assert job.proc.send({"op": "save_end"})
            got = tool.recv(cmd)
            assert got is not None
            outs[t] = got
        return outs, let_go

    def _check_tools(self: "Single", outs: dict[str, dict[str, Any]], spec: Truth, where: str) -> None:
        """``verify`` and ``ls`` report no damage on a committed step, list every step surely
        committed and only steps that may be (``spec``: the model with the save in flight open);
        ``gc`` exits 0."""
        for t, got in outs.items():
            if t.startswith("gc"):
                assert self.job is not None
                self.check_gc(got, self.job.node if t == "gc here" else 1 - self.job.node, f" {where}")
                continue
            text = got["stdout"].strip() or "[]"  # with nothing committed a line of text follows the JSON
            rows = [r for r in json.JSONDecoder().raw_decode(text)[0] if r.get("committed", True)]
            # a copy damaged on the disk tier before (DamageOps) is reported so, and makes the exit 1
            known = {("local", s) for s in self.truth.damaged("disk")}
            if got["code"] != (0 if rows and all(r["healthy"] for r in rows) else 1):
                self.fail(f"{t} {where} exited {got['code']} with {len(rows)} committed step(s): {got['stderr']}")
            bad = [f"{r['tier']} step {r['step']}: {r.get('problem')}" for r in rows
                   if not r["healthy"] and (r["tier"].split(":")[0], int(r["step"])) not in known]
            if bad:
                self.fail(f"{t} {where} reports damage on committed steps: {bad}")
            listed: dict[str, list[int]] = {"memory": [], "local": []}
            for r in rows:
                listed[r["tier"].split(":")[0]].append(int(r["step"]))
            assert self.job is not None
            try:
                spec_ = copy.deepcopy(spec)
                spec_.observe_listing(self.mem(self.job.node), listed["memory"], f"{t} of the memory tier {where}")
                spec_.observe_listing("disk", listed["local"], f"{t} of the disk tier {where}")
            except Violation as e:
                self.fail(str(e))
            if rows:
                newest = max(rows, key=lambda r: int(r["step"]))
                self.note(f"  {t}: {len(rows)} committed, newest step {newest['step']} "
                          f"on {newest['tier'].split(':')[0]}")
