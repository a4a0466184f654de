"""The model-based stateful test of one-process jobs on simulated nodes (Hypothesis's rule machine).

Each example is a run folder (a root) and two simulated nodes (``n0``, ``n1``: each its own
memory-tier folder). Jobs are real processes (:mod:`stateful.worker`) on one node at a time: a job
starts by restoring (``load_latest`` in a fresh process), then saves new steps and steps again (a
second Checkpointer in the same process may take the root over from the first, which stays open),
and ends by ``close()``, a crash (``os._exit``), a SIGKILL at a random idle moment or a SIGKILL
at a named point inside a save. Between jobs: ``nebula-ckpt gc`` and ``nebula-ckpt persist-memory``
(also killed at named points), a node lost (its memory tier gone, its job killed), the run folder
moved (and moved back). The operations that meet a live job mid-way (a close racing a save, a
close from the step hook, the operator's commands beside a held save) are :mod:`stateful.live`'s;
those where the job's surroundings go wrong (a restore out of file descriptors, a NEBULA_SHM_DIR
that is a file, a wall clock that steps back) :mod:`stateful.env_ops`'; those that reach the
root from outside a job's saves (a removal later steps refer to, then every step loaded; the
operator's ``verify`` / ``mark`` as subprocesses; zstd on the disk tier toggled between jobs)
:mod:`stateful.extra_ops`'.
:class:`~stateful.model.Truth` says what every restore must open and what every tier may hold;
audits read every committed step of every tier back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Optional

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from stateful.damage_ops import CLOSE_REPAIRS_DAMAGE, DamageOps
from stateful.env_ops import SECONDS_APART, EnvOps
from stateful.extra_ops import ExtraOps
from stateful.features import BUDGET_BYTES, BUDGET_EXTRA, FeatureOps
from stateful.live import LiveOps
from stateful.model import ABSENT, Entry, Save, Truth, Violation
from stateful.procs import Pool, Proc

NODES = (0, 1)

#: where a save may be killed: (name, strings every one of which the log line holds)
SAVE_POINTS = {
    "staging": ["phase=snapshot"],
    "memory shard": ["phase=shard", "tier=memory"],
    "memory commit": ["phase=commit", "tier=memory"],
    "disk shard": ["phase=shard", "tier=local"],
    "disk manifest": ["phase=manifest", "tier=local"],
    "disk commit": ["phase=commit", "tier=local"],
    "memory retention": ["phase=prune", "tier=memory"],
    "disk retention": ["phase=prune", "tier=local"],
    "memory retention, a step deleted": ["retention deletes step", "tier memory"],
    "disk retention, a step deleted": ["retention deletes step", "tier local"],
    # a step saved again: its new write replaces the committed one's marker, then renames its
    # manifest back, then the old write's files go (docs/format.md, "A step saved again")
    "disk, a step saved again: the marker replaced": ["phase=replace ", "tier=local"],
    "disk, a step saved again: its manifest renamed": ["phase=settle", "tier local"],
    "disk, a step saved again: the old files removed": ["phase=replaced", "tier local"],
    "memory, a step saved again: the marker replaced": ["phase=replace ", "tier=memory"],
    "memory, a step saved again: its manifest renamed": ["phase=settle", "tier memory"],
    "memory, a step saved again: the old files removed": ["phase=replaced", "tier memory"],
}


def refused_folder(stderr: str) -> bool:
    """Whether ``persist-memory`` refused because the root's folder of that step cannot take it
    (a newer write of the step committed there, or a newer generation's files in it): its
    documented exit 1, nothing written. An older write of the step there is replaced instead."""
    return "is committed there by another write" in stderr or \
        bool(re.search(r"writer generation \d+ is writing step \d+ there", stderr))


def save_points() -> list[str]:
    return sorted(SAVE_POINTS)


#: where ``persist-memory`` may be killed
PERSIST_POINTS = {
    "shard": ["phase=shard"],
    "manifest": ["phase=manifest"],
    "commit": ["phase=commit"],
    "retention": ["phase=prune"],
    "retention, a step deleted": ["retention deletes step"],
}


class Shared:
    """What the examples of one test share: the process pool, the tool process, a scratch folder."""

    def __init__(self, base: Path, shm_base: Path) -> None:
        self.base, self.shm_base = base, shm_base
        (base / "logs").mkdir(parents=True, exist_ok=True)
        self.pool = Pool(base / "logs", spares=1)
        self._tool: Optional[Proc] = None
        self.examples = 0
        self.seen: set[str] = set()
        #: each node's wall clock (``"n0"`` -> ns it runs behind the machine's: ``EnvOps.clock_steps_back``)
        #: and the clocks the tool process was told
        self.clocks: dict[str, int] = {}
        self._tool_clocks: dict[str, int] = {}

    def tool(self) -> Proc:
        if self._tool is None or not self._tool.alive:
            self._tool = self.pool.take()
            self._tool_clocks = {}
        if self._tool_clocks != self.clocks:  # its commands on a node read that node's clock
            self._tool.call({"op": "clock", "offsets": self.clocks})
            self._tool_clocks = dict(self.clocks)
        return self._tool

    def tool_died(self) -> None:
        if self._tool is not None:
            self._tool.end()
        self._tool = None

    def close(self) -> None:
        if self._tool is not None:
            self._tool.end()
        self.pool.close()


@dataclass
class Job:
    proc: Proc
    node: int
    path: str
    writer: Optional[int] = None
    saves: int = 0          # saves that went ahead (the disk tier's cadence counts them)
    cursor: int = -1        # the step the job is at (restored or saved last)
    saved_steps: tuple[int, ...] = ()
    health: "Signal" = field(default_factory=lambda: Signal())
    #: the node's NEBULA_SHM_DIR is a file: the job has no memory tier (``EnvOps.job_without_shm``)
    no_memory: bool = False


@dataclass
class Signal:
    """What the job's Checkpointer knows of the training signal (``report()``, docs/health.md): the
    checkpoint it restored, the reported steps since, the steps it saved since, whether the last
    report was bad."""

    restored: Optional[tuple[int, int, int]] = None   # the write restored: (writer, step, save id)
    since: int = 0
    descendants: list[tuple[int, int]] = field(default_factory=list)  # the writes saved since: (step, save id)
    bad: bool = False
    last: Optional[int] = None
    #: the writes (writer, step, save id) this Checkpointer marked suspect: its close() copies none
    #: of them to the disk tier (docs/health.md)
    marked: set[tuple[int, int, int]] = field(default_factory=set)


class Single(EnvOps, LiveOps, FeatureOps, ExtraOps, DamageOps, RuleBasedStateMachine):
    """One-process jobs; see the module docstring. ``Single.shared`` is set by the test."""

    shared: Shared

    def __init__(self) -> None:
        super().__init__()
        sh = self.shared
        sh.examples += 1
        sh.clocks = {}  # every node's clock right at the start of a sequence
        self.dir = sh.base / f"ex{sh.examples}-{uuid.uuid4().hex[:6]}"
        self.dir.mkdir()
        self.shm = sh.shm_base / self.dir.name
        self.paths = [str(self.dir / "run" / "ckpt")]
        self.path = self.paths[0]
        self.truth = Truth()
        self.job: Optional[Job] = None
        self.writers = 0
        self.sids = 0
        self.fid = 1
        self.log: list[str] = []
        self.loops = 0  # scratch roots of LoopState loops (FeatureOps.loop_rollback)
        self.t0 = time.monotonic()

    # -- set-up --------------------------------------------------------------------------------
    @initialize(memory_keep=st.integers(1, 3), disk_keep=st.sampled_from([1, 2, 3, 5]), disk_every=st.integers(1, 3),
                full_every=st.integers(2, 4), snapshot=st.sampled_from(["auto", "async"]), budget=st.booleans(),
                disk_seconds=st.sampled_from([None, SECONDS_APART]))
    def configure(self, memory_keep: int, disk_keep: int, disk_every: int, full_every: int, snapshot: str,
                  budget: bool, disk_seconds: Optional[float]) -> None:
        self.tiers: dict[str, Any] = {"memory_keep": memory_keep, "disk_keep": disk_keep, "disk_every": disk_every,
                                      "snapshot": snapshot}
        if disk_seconds:  # the disk tier's every_seconds, shorter than any two saves are apart (EnvOps)
            self.tiers["disk_seconds"] = disk_seconds
        if budget:  # a host-memory budget smaller than two states (stateful.features)
            self.tiers.update(budget=BUDGET_BYTES, extra=BUDGET_EXTRA)
        self.note(f"configure {self.tiers}, full every {full_every}")
        self.full_every = full_every
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    # -- helpers -------------------------------------------------------------------------------
    def shm_of(self, node: int) -> str:
        return str(self.shm / f"n{node}")

    def mem(self, node: int, path: Optional[str] = None) -> Hashable:
        return ("mem", node, path or self.path)

    def new_writer(self) -> int:
        self.writers += 1
        return self.writers

    def note(self, text: str) -> None:
        self.log.append(f"{time.monotonic() - self.t0:6.1f} s  {text}")
        if os.environ.get("NEBULA_STATEFUL_VERBOSE"):  # every operation as it runs (a soak's progress)
            print(f"stateful: ex{self.shared.examples} {self.log[-1]}", flush=True)

    def fail(self, text: str) -> None:
        if text.split("\n")[0] not in self.shared.seen:  # at once, before Hypothesis shrinks it (minutes)
            self.shared.seen.add(text.split("\n")[0])
            print(f"stateful: violation (log folder {self.shared.base / 'logs'}): {text}", flush=True)
        raise Violation(f"{text}\n  root {self.path}; config {self.tiers}, full every {self.full_every}\n"
                        f"  operations so far:\n    " + "\n    ".join(self.log[-40:]))

    def audit(self, node: int) -> None:
        """Read every committed step of the root's tiers as ``node`` sees them; check them against the model."""
        got = self.shared.tool().call({"op": "audit", "root": self.path, "shm": self.shm_of(node), "node": f"n{node}"})
        assert got is not None
        tiers = got["tiers"]
        try:
            if "memory" in tiers:
                self.truth.observe(self.mem(node), {int(s): e for s, e in tiers["memory"].items()},
                                   f"audit of the memory tier of n{node}")
            if "local" in tiers:
                self.truth.observe("disk", {int(s): e for s, e in tiers["local"].items()}, "audit of the disk tier")
            for v in got.get("verify", []):
                kind = v["tier"].split(":")[0]
                found = tiers.get("local" if kind == "local" else "memory", {}).get(str(v["step"]))
                if found is not None and ("error" in found) == v["healthy"]:
                    self.fail(f"verify says step {v['step']} on {kind} is {'healthy' if v['healthy'] else 'damaged'}, "
                              f"reading it {'fails: ' + found['error'] if 'error' in found else 'works'}")
        except Violation as e:
            self.fail(str(e))

    def open_command(self, node: int, **extra: Any) -> dict[str, Any]:
        """The command that makes a fresh process a job on ``node`` (it restores): ``extra`` added."""
        env = {"NEBULA_INCREMENTAL_FULL_EVERY": str(self.full_every)}
        tiers = {**self.tiers, "zstd": True} if self.zstd else self.tiers  # ExtraOps.toggle_zstd
        return {"op": "open", "root": self.path, "shm": self.shm_of(node), "node": f"n{node}",
                "tiers": tiers, "env": env, "clocks": self.shared.clocks, **extra}

    def _start(self, node: int) -> Job:
        proc = self.shared.pool.take()
        job = Job(proc, node, self.path)
        got = proc.call(self.open_command(node))
        if got is None:
            self.fail(f"the job on n{node} died while restoring (log: {proc.log_path}):\n{proc.tail()}")
        assert got is not None
        self.job = job
        self.check_restore(got, node)
        return job

    def check_restore(self, got: dict[str, Any], node: int) -> None:
        no_memory = self.job is not None and self.job.no_memory  # the node's memory tier stands aside
        keys: list[Hashable] = ["disk"] if no_memory else [self.mem(node), "disk"]
        want = self.truth.target(keys, frozenset(self.truth.suspect()))
        where = f"restore on n{node}"
        # Checkpointer.latest() names, without reading it, the step load_latest restores (no step of
        # this machine is damaged after its commit: the two must agree, suspect marks included)
        named = got["latest"][0] if got.get("latest") else None
        if named != (got.get("step") if "error" not in got else None):
            self.fail(f"{where}: latest() named step {named}, load_latest "
                      f"{'raised ' + got['error'] if 'error' in got else 'restored step ' + str(got.get('step'))}")
        if "error" in got:
            # every step it could open is marked suspect: load_latest raises, naming them (docs/health.md);
            # or every committed step is suspect or damaged (DamageOps): it raises, naming the damage
            damaged = any(self.truth.damaged(k) for k in keys)
            if not (want is None and (self.truth.target(keys) is not None or damaged) and
                    got["error"].startswith("CorruptCheckpointError") and
                    ("marked suspect" in got["error"] or damaged)):
                self.fail(f"{where} raised {got['error']}")
        if want is None:
            if got.get("step") is not None:
                self.fail(f"{where} opened step {got['step']} where nothing is committed")
            if "error" not in got and any(self.truth.damaged(k) for k in keys):
                self.fail(f"{where} restored nothing and raised nothing; the root holds only damaged steps")
        else:
            step, entry, key = want
            if got["step"] is None:
                self.fail(f"{where} found nothing; step {step} ({entry}) is committed on {key}")
            try:
                sid = self.truth.check_parts(got["parts"], where)
            except Violation as e:
                self.fail(str(e))
            if (got["step"], sid) != (step, entry.sid):
                self.fail(f"{where} opened step {got['step']} (save #{sid}, from {got.get('tier')}); the newest "
                          f"committed on a tier it reaches is step {step}, {entry} on {key}")
            assert self.job is not None
            self.job.cursor = step
            # a new Checkpointer's restore: reports judge it
            self.job.health = Signal(restored=(entry.writer, step, entry.sid))
            # a restore from the memory tier may hand its pages over (the step leaves the memory
            # tier) when the root holds that very save of the step
            disk = self.truth.whole("disk")  # not where the copy there is damaged
            if key == keys[0] and not no_memory and step in disk and disk[step].sid == entry.sid:
                self.truth.may_drop(keys[0], step)
        listed = got["listed"]
        if no_memory and "memory" in listed:
            self.fail(f"{where}: NEBULA_SHM_DIR is a file, yet list() shows a memory tier: {listed}")
        try:
            if not no_memory:
                self.truth.observe_listing(keys[0], listed.get("memory", []), f"list() of the memory tier of n{node}")
            self.truth.observe_listing("disk", listed.get("local", []), "list() of the disk tier")
        except Violation as e:
            self.fail(str(e))

    def _new_save(self, step: int) -> tuple[int, Entry, bool, str]:
        """A save of ``step`` the job is about to make: its id, entry, whether its cadence writes
        the disk tier, and its name for the log."""
        job = self.job
        assert job is not None
        self.sids += 1
        sid = self.sids
        if job.writer is None:
            job.writer = self.new_writer()
        self.truth.saves[sid] = Save(step, self.fid, job.writer)
        disk = job.saves % self.tiers["disk_every"] == 0
        return sid, Entry(sid, job.writer), disk, f"save step {step} (save #{sid}, frozen #{self.fid}) on n{job.node}"

    def _save(self, step: int, kill: Optional[tuple[str, int]] = None) -> None:
        job = self.job
        assert job is not None
        sid, entry, disk, what = self._new_save(step)
        what += f", killed at {kill}" if kill else ""
        self.note(what)
        self.budget_room(job)
        if kill:
            job.proc.call({"op": "arm", "at": SAVE_POINTS[kill[0]], "skip": kill[1]})
        got = job.proc.call({"op": "save", "step": step, "sid": sid, "fid": self.fid})
        if got is None:  # killed at the point: each tier may or may not have committed it
            if not job.no_memory:
                self.truth.commit(self.mem(job.node), step, entry, self.tiers["memory_keep"], surely=False)
            if disk:
                self.truth.commit("disk", step, entry, self.tiers["disk_keep"], surely=False)
            job.proc.end()
            self.job = None
            self.truth.job_ended()
            return
        if kill:
            job.proc.call({"op": "arm", "at": None})
        if self.budget_refused(job, got, what):
            return
        self._saved(step, entry, disk, got, what)

    def _saved(self, step: int, entry: Entry, disk: bool, got: dict[str, Any], what: str) -> None:
        """The save ``what`` answered ``got``: it must have succeeded on the tiers its cadence names;
        the model then has it committed there."""
        job = self.job
        assert job is not None
        if not got["ok"] or got["dropped"]:
            self.fail(f"{what}: failed: {got['error']} (written {got['written']}, dropped {got['dropped']})")
        want = (["local"] if disk else []) + ([] if job.no_memory else ["memory"])
        if got["written"] != want:
            self.fail(f"{what}: written on {got['written']}, expected {want} (disk every {self.tiers['disk_every']}, "
                      f"save {job.saves} of this job)")
        self.check_zstd(got, what)
        job.saves += 1
        job.cursor = step
        if job.health.bad:  # saved after a bad report and before any finite one: suspect at once
            self.truth.marks[(entry.writer, step, entry.sid)] = "suspect"
            job.health.marked.add((entry.writer, step, entry.sid))
        elif job.health.restored is not None:
            job.health.descendants.append((step, entry.sid))
        job.saved_steps = tuple(sorted(set(job.saved_steps) | {step}))
        if not job.no_memory:
            self.truth.commit(self.mem(job.node), step, entry, self.tiers["memory_keep"])
        if disk:
            self.truth.commit("disk", step, entry, self.tiers["disk_keep"])

    def _end_job(self) -> None:
        if self.job is not None:
            self.job.proc.end()
            self.job = None
            self.truth.job_ended()

    # -- rules ---------------------------------------------------------------------------------
    @precondition(lambda self: self.job is None)
    @rule(node=st.sampled_from(NODES))
    def start_job(self, node: int) -> None:
        """A job starts on ``node`` (a fresh process) and restores."""
        self.audit(node)
        self.note(f"start a job on n{node}")
        self._start(node)

    @precondition(lambda self: self.job is not None)
    @rule(saves=st.integers(1, 4), gap=st.integers(1, 2), new_frozen=st.booleans())
    def save_new(self, saves: int, gap: int, new_frozen: bool) -> None:
        """``saves`` saves of new steps (the frozen part changes before the first when ``new_frozen``)."""
        if new_frozen:
            self.fid += 1
        for _ in range(saves):
            assert self.job is not None
            self._save(self.job.cursor + gap)

    @precondition(lambda self: self.job is not None)
    @rule(current=st.booleans(), pick=st.integers(0, 7))
    def save_again(self, current: bool, pick: int) -> None:
        """Save a step that exists again (different bytes): the job's current step, or another."""
        job = self.job
        assert job is not None
        known = sorted(set(job.saved_steps) | set(self.truth.maybe_steps("disk"))
                       | set(self.truth.maybe_steps(self.mem(job.node))))
        if not known:
            return
        self._save(job.cursor if current and job.cursor in known else known[pick % len(known)])

    @precondition(lambda self: self.job is not None and not self.job.health.bad)
    @rule(point=st.sampled_from(save_points()), skip=st.integers(0, 1), again=st.booleans(), gap=st.integers(1, 2))
    def kill_in_save(self, point: str, skip: int, again: bool, gap: int) -> None:
        """A save (of a new step, or of the current one again) killed with SIGKILL at ``point``."""
        job = self.job
        assert job is not None
        step = job.cursor if again and job.cursor >= 0 else job.cursor + gap
        self._save(step, (point, skip))

    @precondition(lambda self: self.job is not None)
    @rule(gap=st.integers(1, 2))
    def reopen(self, gap: int) -> None:
        """A second Checkpointer in the job's process on the same root while the first stays open
        (a framework that re-creates its plugin): it restores what the first committed, then saves a
        new step as a new writer, taking the root and the memory tier over (the first one hands
        over); the first is closed after it when the job closes."""
        job = self.job
        assert job is not None
        self.audit(job.node)  # what the restore must open: every tier's steps known
        self.note(f"a second Checkpointer in the job on n{job.node}")
        job.health = Signal()  # the new Checkpointer's own training signal
        got = job.proc.call({"op": "reopen"})
        if got is None:
            self.fail(f"the job on n{job.node} died while a second Checkpointer restored (log: {job.proc.log_path}):\n"
                      f"{job.proc.tail()}")
        assert got is not None
        self.check_restore(got, job.node)
        job.writer, job.saves = None, 0  # a new writer, whose disk cadence counts from its first save
        self._save(job.cursor + gap)

    @precondition(lambda self: self.job is not None)
    @rule(losses=st.lists(st.booleans(), min_size=1, max_size=3), repeat=st.booleans())
    def report(self, losses: list[bool], repeat: bool) -> None:
        """``ck.report(step, loss=...)`` for the steps after the job's (``losses``: finite or NaN; a
        step reported twice when ``repeat``, as gradient accumulation does). A bad loss within
        ``suspect_within`` (50) reported steps of the restore from step S marks S suspect and every
        step the job saved since; a save after a bad loss and before a finite one is suspect at
        once (docs/health.md). The next restore of the newest step must skip them."""
        job = self.job
        assert job is not None
        steps = [job.cursor + 1 + i for i in range(len(losses))]
        if repeat:
            steps, losses = [steps[0], *steps], [losses[0], *losses]
        pairs = list(zip(steps, losses, strict=True))
        self.note("report " + ", ".join(f"{s}: {'finite' if ok else 'NaN'}" for s, ok in pairs))
        got = job.proc.call({"op": "report", "reports": [[s, ok] for s, ok in pairs]})
        if got is None or "error" in got:
            self.fail(f"report() on n{job.node} failed: {got}")
        sig = job.health
        for step, ok in pairs:
            new = step != sig.last
            sig.last = step
            if new and sig.restored is not None:
                sig.since += 1
                if sig.since > 50:  # the restore passed its window
                    sig.restored, sig.descendants = None, []
            if not ok:
                if sig.restored is not None:
                    self.truth.marks[sig.restored] = "suspect"
                    sig.marked.add(sig.restored)
                    for d, sid in sig.descendants:
                        self.truth.marks[(job.writer, d, sid)] = "suspect"  # type: ignore[index]
                        sig.marked.add((job.writer, d, sid))  # type: ignore[arg-type]
                    sig.restored, sig.descendants = None, []
                sig.bad = True
            elif new:
                sig.bad = False

    @precondition(lambda self: self.job is not None)
    @rule(which=st.sampled_from(["newest", "another"]), pick=st.integers(0, 7))
    def remove(self, which: str, pick: int) -> None:
        """``ck.remove(step)`` from the job (a framework's "remove checkpoint"): the newest step the
        job's tiers may hold, or another. It is deleted from the tiers this process writes (its
        node's memory tier and the disk tier), except where a later checkpoint of that tier refers
        to its bytes (it stays listed until none does); the newest step is then gone for good, so no
        restore may open it. Other nodes' memory tiers keep theirs (documented)."""
        job = self.job
        assert job is not None
        keys = [self.mem(job.node), "disk"]
        steps = sorted(set(self.truth.maybe_steps(keys[0])) | set(self.truth.maybe_steps("disk")))
        if not steps:
            return
        step = steps[-1] if which == "newest" else steps[pick % len(steps)]
        surely = any(len(p) == 1 and ABSENT not in p for p in (self.truth.tier(k).get(step, {ABSENT}) for k in keys))
        self.note(f"remove step {step} on n{job.node}")
        got = self.remove_in_job(job, step)
        if "error" in got:
            if surely or not got["error"].startswith("NotFoundError"):
                self.fail(f"remove({step}) raised {got['error']}")
        elif got["removed"] != [step]:
            self.fail(f"remove({step}) returned {got['removed']}")
        for k in keys:
            self.truth.removed(k, step)

    @precondition(lambda self: self.job is not None)
    @rule(how=st.sampled_from(["close", "exit", "sigkill"]))
    def end_job(self, how: str) -> None:
        job = self.job
        assert job is not None
        self.note(f"end the job on n{job.node}: {how}")
        if how == "sigkill":
            job.proc.kill()
        elif how == "exit":
            job.proc.call({"op": "exit"})
        else:
            self._close(job)
        self._end_job()

    def remove_in_job(self, job: Job, step: int) -> dict[str, Any]:
        """``remove(step)`` in the live ``job`` (a remove is a write: the job takes its writer
        generation now if not yet); what the worker answered."""
        if job.writer is None:
            job.writer = self.new_writer()
        got = job.proc.call({"op": "remove", "step": step})
        if got is None:
            self.fail(f"the job on n{job.node} died in remove({step}) (log: {job.proc.log_path}):\n{job.proc.tail()}")
        assert got is not None
        return got

    def _close(self, job: Job) -> None:
        want = self._close_target(job)
        got = job.proc.call({"op": "close"})
        if got is None or got["error"]:
            self.fail(f"close() on n{job.node} failed: {got}")
        self._closed(job, want)

    def _close_target(self, job: Job) -> Optional[tuple[int, Entry, Hashable]]:
        """What a close of ``job`` now puts on the disk tier (the tiers audited first when the model
        is not sure of them): the newest write its tiers hold that this Checkpointer did not mark
        suspect, unless the disk tier holds a newer (suspect) write, which it keeps as its newest
        (docs/health.md, ``save/drain.py``'s ``flush_newest``). None: it puts nothing there."""
        keys = [self.mem(job.node), "disk"]
        if not all(self.truth.certain(k) for k in keys):
            self.audit(job.node)
        want = self.truth.target(keys, frozenset(job.health.marked)) if job.writer is not None else None
        if want is None:
            return None
        step, entry, _ = want
        if any((e.writer, s, e.sid) > (entry.writer, step, entry.sid) for s, e in self.truth.entries("disk").items()):
            return None
        return want

    def _closed(self, job: Job, want: Optional[tuple[int, Entry, Hashable]]) -> None:
        if job.writer is None:
            return
        mem = self.mem(job.node)
        newest = self.truth.newest_write(mem)
        if want is not None:
            step, entry, key = want
            disk = self.truth.entries("disk")
            if step not in disk or disk[step].sid != entry.sid or \
                    (CLOSE_REPAIRS_DAMAGE and ("disk", step, entry.sid) in self.truth.bad):
                # close() puts the newest step on the disk tier when its cadence skipped it (or, with the
                # defect of DamageOps fixed, where its copy there is damaged)
                self.truth.commit("disk", step, entry, self.tiers["disk_keep"])
        disk_now = self.truth.tier("disk")
        if want is not None or (newest is not None and newest[1] in disk_now.get(newest[0], set())):
            self.truth.may_drop_all(mem)  # the newest is safe on the root: the memory tier may go

    @rule(node=st.sampled_from(NODES), scoped=st.booleans(), timeout=st.sampled_from([None, 1e-9, 30.0]))
    def gc(self, node: int, scoped: bool, timeout: Optional[float]) -> None:
        """``nebula-ckpt gc`` on ``node`` (``gc ROOT``, this run's tiers only, when ``scoped``; with
        ``--root-timeout`` when ``timeout``: a root that does not answer in time keeps its tier): it
        may free a memory tier whose newest save is on its root, or superseded there by a newer
        write of that step (a newer writer's, or a later save: what a restore takes over it; the
        policy in ``tiers/memory/gc.py``), never one a live job writes."""
        if os.path.isdir(self.path):
            self.audit(node)
        self.note(f"gc on n{node}" + (" of the root" if scoped else "") +
                  ("" if timeout is None else f", --root-timeout {timeout:g}"))
        got = self.shared.tool().call(self.gc_command(node, scoped, timeout))
        assert got is not None
        self.check_gc(got, node, "")
        for key in self._gc_may_free(node):
            self.truth.may_drop_all(key)

    def gc_command(self, node: int, scoped: bool, timeout: Optional[float]) -> dict[str, Any]:
        """The tool's command for ``nebula-ckpt gc`` on ``node`` (of the root only when ``scoped``)."""
        argv = ["gc", "--shm-dir", self.shm_of(node), "--json"] + ([self.path] if scoped else []) + \
            ([] if timeout is None else ["--root-timeout", f"{timeout:g}"])
        return {"op": "cli", "argv": argv, "shm": self.shm_of(node), "node": f"n{node}"}

    def check_gc(self, got: dict[str, Any], node: int, where: str) -> None:
        """``gc`` exits 0 and removes no memory tier it says is in use or whose root did not answer
        in time (``--root-timeout``: the root is unknown, the tier kept)."""
        if got["code"] != 0:
            self.fail(f"gc on n{node}{where} exited {got['code']}: {got['stderr']}")
        for d in json.loads(got["stdout"] or "[]"):
            if d.get("removed") and (d["in_use"] or "no answer within" in d["reason"]):
                self.fail(f"gc on n{node}{where} removed {d['folder']} ({d['reason']}; in use: {d['in_use']})")

    def _gc_may_free(self, node: int, writing: Optional[tuple[int, Entry]] = None) -> list[Hashable]:
        """The memory tiers of ``node`` that ``gc`` may free (the model audited): those whose newest
        save is on the root (or superseded there, also by ``writing``: a save in flight to the disk
        tier), none a live job writes, none whose root is not there to check."""
        out: list[Hashable] = []
        for key in [k for k in self.truth.tiers if isinstance(k, tuple) and k[1] == node]:
            live = self.job is not None and self.job.node == node and self.job.path == key[2] and self.job.writer
            if live or key[2] != self.path or not os.path.isdir(self.path):
                continue  # in use, or its root is not there to check: kept
            newest = self.truth.newest_write(key)
            if newest is None:
                continue
            disk = [(e.writer, e.sid) for s, e in self.truth.whole("disk").items() if s == newest[0]]
            if writing is not None and writing[0] == newest[0]:
                disk.append((writing[1].writer, writing[1].sid))
            if disk and max(disk) >= (newest[1].writer, newest[1].sid):
                out.append(key)
        return out

    @rule(node=st.sampled_from(NODES), kill=st.one_of(st.none(), st.sampled_from(sorted(PERSIST_POINTS))))
    def persist_memory(self, node: int, kill: Optional[str]) -> None:
        """``nebula-ckpt persist-memory ROOT`` on ``node`` (a job epilogue), perhaps killed at ``kill``:
        the newest save of the node's memory tier goes to the root under its own writer, only when
        it is newer (in a restore's order) than everything there; it deletes nothing, and does
        nothing while a live job writes that memory tier."""
        if not os.path.isdir(self.path):
            return
        self.audit(node)
        self.note(f"persist-memory on n{node}" + (f", killed at {kill}" if kill else ""))
        tool = self.shared.tool()
        if kill:
            tool.call({"op": "arm", "at": PERSIST_POINTS[kill], "skip": 0})
        got = tool.call({"op": "cli", "argv": ["persist-memory", self.path, "--json"], "shm": self.shm_of(node),
                         "node": f"n{node}"})
        live = self.job is not None and self.job.node == node and self.job.path == self.path and self.job.writer
        newest = self.truth.newest_write(self.mem(node))
        # a damaged copy of a write the memory tier holds is not there (its memory copy replaces it)
        held = {(s, e.sid) for s, e in self.truth.entries(self.mem(node)).items()}
        on_root = [(e.writer, s, e.sid) for s, e in self.truth.entries("disk").items()
                   if ("disk", s, e.sid) not in self.truth.bad or (s, e.sid) not in held]
        copy = not live and newest is not None and \
            (newest[1].writer, newest[0], newest[1].sid) > max(on_root, default=())
        if got is None:
            self.shared.tool_died()
            if copy:
                assert newest is not None
                self.truth.commit("disk", newest[0], newest[1], 0, surely=False, drops=False)
            return
        if kill:
            tool.call({"op": "arm", "at": None})
        if got["code"] == 1 and refused_folder(got["stderr"]):
            return  # the documented refusal: nothing written (docs/cli.md, persist-memory's exit 1)
        if got["code"] not in ((0, 2) if live else (0,)):
            self.fail(f"persist-memory on n{node} exited {got['code']}: {got['stdout']} {got['stderr']}")
        if copy:
            assert newest is not None
            self.truth.commit("disk", newest[0], newest[1], 0, drops=False)

    @rule(node=st.sampled_from(NODES), suspect=st.booleans(), which=st.sampled_from(["newest", "another"]),
          pick=st.integers(0, 7))
    def mark(self, node: int, suspect: bool, which: str, pick: int) -> None:
        """A person's health mark, ``nebula-ckpt mark ROOT --suspect STEP`` (or ``--healthy``) on
        ``node``: every write of the step committed on the tiers the node reads (its memory tier, the
        disk tier) is marked (one record per write: its writer generation and save number; a copy
        of one write on both tiers is one); from then on a restore of the newest step skips the
        suspect ones (``--healthy`` clears the mark), a save of the step again is another write with
        no mark, and ``load_latest`` raises when every step it could open is suspect (docs/health.md)."""
        if not os.path.isdir(self.path):
            return
        self.audit(node)  # every copy known, with its writer's generation
        keys = [self.mem(node), "disk"]
        steps = sorted({s for k in keys for s in self.truth.entries(k)})
        self.mark_step(node, suspect, (steps[-1] if which == "newest" else steps[pick % len(steps)]) if steps else pick)

    def mark_step(self, node: int, suspect: bool, step: int,
                  runner: Optional[Callable[[list[str], int], dict[str, Any]]] = None) -> None:
        """``nebula-ckpt mark ROOT --suspect STEP`` (or ``--healthy``) on ``node`` (the tiers audited):
        see :meth:`mark`; in the tool process, or by ``runner(argv, node)`` (a subprocess)."""
        keys = [self.mem(node), "disk"]
        copies = {(e.writer, e.sid) for k in keys for s, e in self.truth.entries(k).items() if s == step}
        flag = "--suspect" if suspect else "--healthy"
        self.note(f"mark {flag} {step} on n{node}")
        argv = ["mark", self.path, flag, str(step), "--json"]
        got = runner(argv, node) if runner else \
            self.shared.tool().call({"op": "cli", "argv": argv, "shm": self.shm_of(node), "node": f"n{node}"})
        assert got is not None
        if not copies:
            if got["code"] != 1:
                self.fail(f"mark {flag} {step} of a step committed nowhere exited {got['code']}: {got['stderr']}")
            return
        if got["code"] != 0:
            self.fail(f"mark {flag} {step} on n{node} exited {got['code']}: {got['stdout']} {got['stderr']}")
        marked = sorted(r["generation"] for r in json.loads(got["stdout"]))
        want = sorted(self.truth.gens[w] for w, _ in copies)
        if marked != want:
            self.fail(f"mark {flag} {step} on n{node} marked writes of writer generations {marked}; the step's "
                      f"writes there carry {want}")
        for w, sid in copies:
            self.truth.marks[(w, step, sid)] = "suspect" if suspect else "healthy"

    @rule(node=st.sampled_from(NODES))
    def lose_node(self, node: int) -> None:
        """``node`` is lost: its job dies, its memory (every memory tier on it) is gone."""
        self.note(f"lose n{node}")
        if self.job is not None and self.job.node == node:
            self.job.proc.kill()
            self._end_job()
        shutil.rmtree(self.shm_of(node), ignore_errors=True)
        for key in [k for k in self.truth.tiers if isinstance(k, tuple) and k[1] == node]:
            self.truth.drop_all(key)

    @precondition(lambda self: self.job is None)
    @rule(back=st.booleans())
    def move_root(self, back: bool) -> None:
        """The run folder is moved (``mv``) to a new path, or back to one it had."""
        olds = [p for p in self.paths if p != self.path]
        if back and olds:
            dst = olds[-1]
        else:
            dst = str(self.dir / f"run{len(self.paths)}" / "ckpt")
            self.paths.append(dst)
        self.note(f"move the root {self.path} -> {dst}")
        if os.path.isdir(self.path):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(self.path, dst)
        self.path = dst

    def teardown(self) -> None:
        try:
            if self.job is not None:
                self.job.proc.kill()
                self._end_job()
            if os.path.isdir(self.path):
                for node in NODES:
                    self.audit(node)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            shutil.rmtree(self.shm, ignore_errors=True)
