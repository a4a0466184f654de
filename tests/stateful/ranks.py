"""The model-based stateful test of a two-rank job on two simulated nodes, with memory-tier replicas.

Rank 0 runs on node ``n0`` and rank 1 on ``n1`` (``NEBULA_NODE_ID``, each node its own memory-tier
folder), gloo on 127.0.0.1; ``MemoryTier(replicas=1)``: each rank's memory-tier step is also held
by the other node. Operations: saves (new steps, steps again), a rank SIGKILLed at a named point
of a save (the shared tier's stages, its memory tier's, the replicas' round, receiving a copy),
at the keep round after a restore that pulled copies, the job killed or closed (its process group
destroyed first, or not), a node lost,
``gc`` and ``persist-memory`` on a node, restores in fresh processes. The model cannot read a
rank's memory tier on its own (a part of a multi-rank step), so it keeps what may be where and
checks every restore: every rank opens the same save, whole; none older than the newest save that
every rank surely still has on a tier or a replica it reaches.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Optional

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from stateful.damage_ops import RankDamageOps
from stateful.machine import SAVE_POINTS, refused_folder
from stateful.machine import Shared as _Shared
from stateful.model import ABSENT, Entry, Save, Truth, Violation
from stateful.procs import Pool, Proc, everyone, free_port

WORLD = 2
#: points without a log line of their own: ``module:function`` entered by the rank killed
CALL_POINTS = {
    "replicas' round": "nebula_ckpt.tiers.memory.replicas:replicate",
    "a copy received, not yet verified": "nebula_ckpt.tiers.memory.replica_store:verify_step",
    "a copy verified, not yet visible": "nebula_ckpt.tiers.memory.replica_store:ReplicaStore.publish",
}
#: the shared tier and a memory tier with replicas replace a step saved again old write first
#: ("disk, replacing a step" is reached on rank 0 only: it replaces)
RANK_SAVE_POINTS = {**{k: v for k, v in SAVE_POINTS.items() if "saved again" not in k},
                    "disk, replacing a step": ["replacing existing checkpoint", "tier local"],
                    "memory, replacing a step": ["replacing existing checkpoint", "tier memory"]}
ENV = {"NEBULA_REPLICA_TIMEOUT_S": "30", "NEBULA_COMMIT_TIMEOUT_S": "30"}
#: module constants the workers set (``module:NAME`` -> value): niced threads starve on a busy machine,
#: and a tier writer waits for the training thread's confirmation as long as the rounds wait
CONSTANTS = {"nebula_ckpt.tiers.memory.replicas:KEEP_AFTER_S": 0.5,
             "nebula_ckpt.tiers.memory.replica_channel:REPLICA_NICE": 0, "nebula_ckpt.save.incremental:HASH_NICE": 0,
             "nebula_ckpt.save.snapshot:CONFIRM_TIMEOUT_S": 30.0}


class Shared(_Shared):
    def __init__(self, base: Path, shm_base: Path) -> None:
        super().__init__(base, shm_base)
        self.pool.close()
        self.pool = Pool(base / "logs", spares=WORLD)


@dataclass
class Job:
    procs: list[Proc]
    writer: Optional[int] = None
    saves: int = 0
    cursor: int = -1
    saved_steps: tuple[int, ...] = ()
    pulled: bool = False


class Ranks(RankDamageOps, RuleBasedStateMachine):
    shared: Shared

    def __init__(self) -> None:
        super().__init__()
        sh = self.shared
        sh.examples += 1
        self.dir = sh.base / f"ex{sh.examples}-{uuid.uuid4().hex[:6]}"
        self.dir.mkdir()
        self.shm = sh.shm_base / self.dir.name
        self.root = str(self.dir / "ckpt")
        self.truth = Truth()
        self.job: Optional[Job] = None
        self.writers = self.sids = 0
        self.fid = 1
        self.log: list[str] = []
        self.t0 = time.monotonic()

    @initialize(memory_keep=st.integers(1, 2), disk_keep=st.integers(1, 2), disk_every=st.integers(1, 3))
    def configure(self, memory_keep: int, disk_keep: int, disk_every: int) -> None:
        self.tiers = {"memory_keep": memory_keep, "disk_keep": disk_keep, "disk_every": disk_every, "replicas": 1}

    # -- helpers -------------------------------------------------------------------------------
    def shm_of(self, node: int) -> str:
        return str(self.shm / f"n{node}")

    def note(self, text: str) -> None:
        self.log.append(f"{time.monotonic() - self.t0:6.1f} s  {text}")

    def fail(self, text: str) -> None:
        if text.split("\n")[0] not in self.shared.seen:  # at once, before Hypothesis shrinks it (minutes)
            self.shared.seen.add(text.split("\n")[0])
            print(f"stateful: violation (log folder {self.shared.base / 'logs'}): {text}", flush=True)
        raise Violation(f"{text}\n  root {self.root}; config {self.tiers}\n  operations so far:\n    "
                        + "\n    ".join(self.log[-40:]))

    def everyone(self, cmds: list[dict[str, Any]]) -> list[Optional[dict[str, Any]]]:
        """Each rank's command at once (collectives), then each answer (None: that rank died)."""
        assert self.job is not None
        return everyone(self.job.procs, cmds)

    def _kill_job(self) -> None:
        if self.job is not None:
            for p in self.job.procs:
                p.kill()
                p.end()
            self.job = None
            self.truth.job_ended()

    # what each rank may get a save from: its own memory tier and the copy its partner holds
    @staticmethod
    def own(rank: int) -> Hashable:
        return ("mem", rank)

    @staticmethod
    def copy(rank: int) -> Hashable:
        return ("rep", rank)

    def candidates(self, surely: bool) -> dict[tuple[int, int, int], Entry]:
        """(writer, step, save) -> a save every rank can restore from what it reaches (``surely``:
        without a doubt), on the shared disk tier or in the memory tiers and replicas (one save on
        every rank). Keyed by the save too: a step saved twice may have one save on the disk tier
        and the later one in the memory tiers, and a restore takes the later (as the library orders
        writes: generation, step, save)."""
        out: dict[tuple[int, int, int], Entry] = {}
        for s, p in self.truth.tier("disk").items():
            for e in p:
                if e is not None and (not surely or len(p) == 1) and self.disk_whole(s, e, surely):
                    out[(e.writer, s, e.sid)] = e
        per_rank = []
        for r in range(WORLD):
            have: dict[int, set[Entry]] = {}
            for key in (self.own(r), self.copy(r)):
                for s, p in self.truth.tier(key).items():
                    if surely and len(p) > 1:
                        continue
                    have.setdefault(s, set()).update(e for e in p if e is not None)
            per_rank.append(have)
        for s in set(per_rank[0]).intersection(*per_rank[1:]):
            for e in set.intersection(*(h[s] for h in per_rank)):
                out.setdefault((e.writer, s, e.sid), e)
        return out

    def disk_whole(self, step: int, e: Entry, surely: bool) -> bool:
        """Whether the disk tier's copy of ``e`` as ``step`` is whole (``surely``: without a doubt; else
        perhaps): not damaged there (``RankDamageOps``), nor perhaps, a later step referring to damaged bytes."""
        return ("disk", step, e.sid) not in self.truth.bad | (self.truth.maybe_bad if surely else set())

    def only_damaged(self, errors: list[str], disk_only: bool = False) -> bool:
        """Whether ``errors`` may be ``load_latest``'s when no step every rank reaches (``disk_only``:
        the caller checked the disk tier's) is surely whole and a copy on the disk tier is damaged
        (``RankDamageOps``): CorruptCheckpointError."""
        return (disk_only or not self.candidates(True)) and any(k[0] == "disk" for k in self.truth.bad) and \
            all(e.startswith("CorruptCheckpointError") for e in errors)

    # -- rules ---------------------------------------------------------------------------------
    @precondition(lambda self: self.job is None)
    @rule()
    def start_job(self) -> None:
        self.note("start the job (2 ranks) and restore")
        port = free_port()
        self.job = Job([self.shared.pool.take() for _ in range(WORLD)])
        got = self.everyone([{"op": "open", "root": self.root, "shm": self.shm_of(r), "node": f"n{r}", "dist": True,
                              "rank": r, "world": WORLD, "port": port, "tiers": self.tiers, "env": ENV,
                              "constants": CONSTANTS}
                             for r in range(WORLD)])
        if any(g is None for g in got):
            self.fail(f"a rank died while restoring: {got}\n{self.job.procs[0].tail()}\n{self.job.procs[1].tail()}")
        self.check_restore([g for g in got if g is not None])

    def check_restore(self, got: list[dict[str, Any]]) -> None:
        errors = [g["error"] for g in got if "error" in g]
        if errors and not (len(errors) == len(got) and self.only_damaged(errors)):
            self.fail(f"restore raised {errors}")
        if errors:
            return
        steps = {g["step"] for g in got}
        sure, maybe = self.candidates(True), self.candidates(False)
        newest_sure = max(sure, default=None)
        if steps == {None}:
            if newest_sure is not None:
                self.fail(f"the restore found nothing; step {newest_sure[1]} ({sure[newest_sure]}) is on every rank")
            return
        if len(steps) != 1:
            self.fail(f"the ranks restored different steps: {[g['step'] for g in got]}")
        sids = []
        for r, g in enumerate(got):
            try:
                sids.append(self.truth.check_parts(g["parts"], f"rank {r}'s restore"))
            except Violation as e:
                self.fail(str(e))
        if len(set(sids)) != 1:
            self.fail(f"the ranks restored different saves of step {steps}: {sids} (sources "
                      f"{[g.get('source') for g in got]}, tiers {[g.get('tier') for g in got]})")
        step, sid = steps.pop(), sids[0]
        match = [k for k, e in maybe.items() if k[1] == step and e.sid == sid]
        if not match:
            self.fail(f"the ranks restored step {step} (save #{sid}), which the model does not have on every rank: "
                      f"{maybe}")
        if newest_sure is not None and newest_sure > max(match):
            self.fail(f"the ranks restored step {step} (save #{sid}); the newer step {newest_sure[1]} "
                      f"({sure[newest_sure]}) is on every rank")
        assert self.job is not None
        self.job.cursor = step
        self.job.pulled = any(str(g.get("source", "")).startswith("replica") for g in got)
        e = maybe[max(match)]
        for r in range(WORLD):  # a copy pulled at the restore may be kept by the rank's memory tier
            p = self.truth.tier(self.own(r)).setdefault(step, {ABSENT})
            p.add(e)

    def _save(self, step: int, kill: Optional[tuple[str, int, int]] = None) -> None:
        job = self.job
        assert job is not None
        self.sids += 1
        sid = self.sids
        if job.writer is None:
            self.writers += 1
            job.writer = self.writers
        self.truth.saves[sid] = Save(step, self.fid, job.writer)
        disk = job.saves % self.tiers["disk_every"] == 0
        what = f"save step {step} (save #{sid})" + (f", rank {kill[2]} killed at {kill[0]}" if kill else "")
        self.note(what)
        if kill:
            name, skip, rank = kill
            arm = ({"op": "arm_call", "call": CALL_POINTS[name], "skip": skip} if name in CALL_POINTS
                   else {"op": "arm", "at": RANK_SAVE_POINTS[name], "skip": skip})
            job.procs[rank].call(arm)
        got = self.everyone([{"op": "save", "step": step, "sid": sid, "fid": self.fid} for _ in range(WORLD)])
        entry = Entry(sid, job.writer)
        if any(g is None for g in got) or not all(g["ok"] for g in got if g is not None):
            if not kill:
                self.fail(f"{what}: failed: {got}")
            for r in range(WORLD):
                self.truth.commit(self.own(r), step, entry, self.tiers["memory_keep"], surely=False)
                self.truth.commit(self.copy(r), step, entry, self.tiers["memory_keep"], surely=False)
            if disk:
                self.truth.commit("disk", step, entry, self.tiers["disk_keep"], surely=False)
            self._kill_job()  # a job that lost a rank is restarted
            return
        if kill:  # the point was not reached: the save went ahead
            self._kill_job()
            self.note("  (the point was not reached; the job is ended)")
        want = sorted(["memory", "replicas"] + (["local"] if disk else []))
        for r, g in enumerate(got):
            assert g is not None
            if sorted(g["written"]) != want:
                self.fail(f"{what}: rank {r} wrote {g['written']}, expected {want}")
        job.saves += 1
        job.cursor = step
        job.saved_steps = tuple(sorted(set(job.saved_steps) | {step}))
        for r in range(WORLD):
            self.truth.commit(self.own(r), step, entry, self.tiers["memory_keep"])
            self.truth.commit(self.copy(r), step, entry, self.tiers["memory_keep"])
        if disk:
            self.truth.commit("disk", step, entry, self.tiers["disk_keep"])

    @precondition(lambda self: self.job is not None)
    @rule(gap=st.integers(1, 2), new_frozen=st.booleans())
    def save_new(self, gap: int, new_frozen: bool) -> None:
        assert self.job is not None
        if new_frozen:
            self.fid += 1
        self._save(self.job.cursor + gap)

    @precondition(lambda self: self.job is not None and self.job.cursor >= 0)
    @rule()
    def save_again(self) -> None:
        assert self.job is not None
        self._save(self.job.cursor)

    @precondition(lambda self: self.job is not None)
    @rule(point=st.sampled_from(sorted(RANK_SAVE_POINTS) + sorted(CALL_POINTS)), rank=st.integers(0, WORLD - 1),
          again=st.booleans(), skip=st.integers(0, 1))
    def kill_in_save(self, point: str, rank: int, again: bool, skip: int) -> None:
        assert self.job is not None
        step = self.job.cursor if again and self.job.cursor >= 0 else self.job.cursor + 1
        self._save(step, (point, skip, rank))

    @precondition(lambda self: self.job is not None and self.job.pulled)
    @rule(rank=st.integers(0, WORLD - 1))
    def kill_in_keep_round(self, rank: int) -> None:
        """A rank killed in the keep round that follows a restore which pulled copies (run before
        the next save's round)."""
        assert self.job is not None
        self.job.procs[rank].call({"op": "arm_call", "call": "nebula_ckpt.tiers.memory.replicas:keep_pulled"})
        self._keep_then_save(rank)

    def _keep_then_save(self, rank: int) -> None:
        assert self.job is not None
        step = self.job.cursor + 1
        self.note(f"rank {rank} killed in the keep round (then a save of step {step})")
        self.sids += 1
        sid = self.sids
        job = self.job
        if job.writer is None:
            self.writers += 1
            job.writer = self.writers
        self.truth.saves[sid] = Save(step, self.fid, job.writer)
        got = self.everyone([{"op": "save", "step": step, "sid": sid, "fid": self.fid} for _ in range(WORLD)])
        entry = Entry(sid, job.writer)
        disk = job.saves % self.tiers["disk_every"] == 0
        for r in range(WORLD):
            self.truth.commit(self.own(r), step, entry, self.tiers["memory_keep"], surely=False)
            self.truth.commit(self.copy(r), step, entry, self.tiers["memory_keep"], surely=False)
        if disk:
            self.truth.commit("disk", step, entry, self.tiers["disk_keep"], surely=False)
        del got
        self._kill_job()

    @precondition(lambda self: self.job is not None)
    @rule(rank=st.integers(0, WORLD - 1))
    def restore_mismatched(self, rank: int) -> None:
        """``load_latest(into=...)`` on every rank of the live job, rank ``rank``'s ``into`` holding
        its ``extra`` tensor in another shape: where a step is there to restore, every rank raises
        ``ValidationError`` naming itself, the failing rank and the key (none restores, none hangs:
        the driver's command timeout fails the run); the job goes on. Where no step every rank
        reaches is surely whole and a copy on the disk tier is damaged, every rank may raise
        ``CorruptCheckpointError`` instead, as a plain restore does (``only_damaged``): no step opens
        on every rank, so none reaches the ``into`` check."""
        assert self.job is not None
        self.note(f"restore on every rank, rank {rank}'s `into` mismatched (its `extra` of 7 elements)")
        got = self.everyone([{"op": "restore", "into_extra": 7 if r == rank else 5} for r in range(WORLD)])
        if any(g is None for g in got):
            self.fail(f"a rank died in a mismatched restore: {got}\n{self.job.procs[0].tail()}\n"
                      f"{self.job.procs[1].tail()}")
        if all("error" not in g and g.get("step") is None for g in got if g is not None):
            if self.candidates(True):
                self.fail(f"a mismatched restore found nothing; the ranks hold {max(self.candidates(True))}")
            return  # nothing to restore into it
        errors = [g["error"] for g in got if g is not None and "error" in g]
        if len(errors) == len(got) and self.only_damaged(errors):
            return  # only damaged steps: nothing opens on every rank to restore into
        for r, g in enumerate(got):
            assert g is not None
            err = g.get("error", "")
            # every rank names itself, the failing rank and the key (the others quote its error)
            named = f"rank {r}" in err and f"rank {rank}" in err and "'extra'" in err
            if not err.startswith("ValidationError") or not named:
                self.fail(f"a restore with rank {rank}'s `into` mismatched: rank {r} gave "
                          f"{err or 'step ' + str(g.get('step'))}, not a ValidationError naming "
                          f"rank {r}, rank {rank} and 'extra'")

    @precondition(lambda self: self.job is not None)
    @rule(which=st.sampled_from(["newest", "another"]), pick=st.integers(0, 7))
    def remove(self, which: str, pick: int) -> None:
        """``ck.remove(step)`` on every rank (what the docs ask of a multi-rank job): the newest step
        the job's tiers may hold, or another. The step goes from the shared disk tier (the
        coordinator deletes it), from every rank's memory tier and from the copies the partners
        hold, but where a later checkpoint of that tier may refer to its bytes (it stays listed
        until none does): the newest step removed must never be restored again."""
        job = self.job
        assert job is not None
        keys = ["disk"] + [self.own(r) for r in range(WORLD)] + [self.copy(r) for r in range(WORLD)]
        steps = sorted(set().union(*(self.truth.maybe_steps(k) for k in keys)))
        if not steps:
            return
        step = steps[-1] if which == "newest" else steps[pick % len(steps)]
        self.note(f"remove step {step} on every rank")
        if job.writer is None:  # a remove is a write: the job takes its writer generation now if not yet
            self.writers += 1
            job.writer = self.writers
        got = self.everyone([{"op": "remove", "step": step} for _ in range(WORLD)])
        if any(g is None for g in got):
            self.fail(f"a rank died in remove({step}): {got}\n{job.procs[0].tail()}\n{job.procs[1].tail()}")
        errors = [g["error"] for g in got if g is not None and "error" in g]
        if errors:
            self.fail(f"remove({step}) raised {errors}")
        for k in keys:
            self.truth.removed(k, step)

    @precondition(lambda self: self.job is not None)
    @rule(how=st.sampled_from(["close", "destroy group, then close", "exit", "sigkill"]))
    def end_job(self, how: str) -> None:
        """``destroy group, then close``: the job's process group destroyed before close() (a slip
        of a first script); every save was waited for, so nothing is cut short and close() must
        still succeed, leaving the tiers as a plain close does."""
        assert self.job is not None
        self.note(f"end the job: {how}")
        if how in ("close", "destroy group, then close"):
            got = self.everyone([{"op": "close", "destroy_first": how != "close"} for _ in range(WORLD)])
            if any(g is None or g["error"] for g in got):
                self.fail(f"close() failed: {got}")
            # a multi-rank close leaves the memory tiers unless their newest step is on the root
            for r in range(WORLD):
                self.truth.may_drop_all(self.own(r))
                self.truth.may_drop_all(self.copy(r))
        elif how == "exit":
            self.everyone([{"op": "exit"} for _ in range(WORLD)])
        self._kill_job()

    @rule(node=st.integers(0, WORLD - 1))
    def lose_node(self, node: int) -> None:
        """A node is lost: the job dies (a rank of it was there), the node's memory is gone: rank
        ``node``'s own memory tier and the copies it held of the other rank's steps."""
        self.note(f"lose n{node}")
        self._kill_job()
        shutil.rmtree(self.shm_of(node), ignore_errors=True)
        self.truth.drop_all(self.own(node))
        self.truth.drop_all(self.copy(1 - node))

    @rule(node=st.integers(0, WORLD - 1), which=st.sampled_from(["gc", "persist-memory"]))
    def tool(self, node: int, which: str) -> None:
        """``gc`` (frees nothing a restore needs: a tier whose newest step is only in memory stays) or
        ``persist-memory`` (drains the newest step the node holds every part of to the root) on ``node``."""
        if not os.path.isdir(self.root):
            return
        self.note(f"{which} on n{node}")
        argv = ["gc", "--shm-dir", self.shm_of(node), "--json"] if which == "gc" else \
            ["persist-memory", self.root, "--json"]
        got = self.shared.tool().call({"op": "cli", "argv": argv, "shm": self.shm_of(node), "node": f"n{node}"})
        assert got is not None
        if which == "gc":
            if got["code"] != 0:
                self.fail(f"gc exited {got['code']}: {got['stderr']}")
            # a removed tier held only steps that are on the root: what the model counts on stays
            # reachable there; the tier's own copies may go
            disk = {e.sid for s, p in self.truth.tier("disk").items() for e in p
                    if e is not None and self.disk_whole(s, e, False)}
            for key in (self.own(node), self.copy(1 - node)):
                newest = self.truth.newest_write(key)
                if newest is None or newest[1].sid in disk:
                    self.truth.may_drop_all(key)
        else:
            if got["code"] == 1 and refused_folder(got["stderr"]):
                return  # the documented refusal: nothing written (docs/cli.md, persist-memory's exit 1)
            if got["code"] == 1 and "cannot be restored there" in got["stderr"]:
                # a multi-rank step the root holds damaged: its parts cannot replace it (nothing written)
                if not any(k[0] == "disk" for k in self.truth.bad):
                    self.fail(f"persist-memory on n{node} says a step is damaged on the root; none is: {got['stderr']}")
                return
            if got["code"] not in (0, 2):
                self.fail(f"persist-memory on n{node} exited {got['code']}: {got['stdout']} {got['stderr']}")
            # it may drain the newest step every rank's part of which this node holds (its own, and the
            # copy of the other rank's) to the shared tier, under that step's writer, deleting nothing
            on_disk = [(e.writer, s, e.sid) for s, p in self.truth.tier("disk").items() for e in p if e is not None]
            mem = [(w, s, e.sid, e) for (w, s, _), e in self.candidates(False).items()
                   if e not in self.truth.tier("disk").get(s, set())]
            if mem and max(mem, key=lambda c: c[:3])[:3] > max(on_disk, default=()):
                w, s, _, e = max(mem, key=lambda c: c[:3])
                self.truth.commit("disk", s, e, 0, surely=False, drops=False)

    @precondition(lambda self: os.path.isdir(self.root))
    @rule(which=st.sampled_from(["newest", "oldest"]))
    def export(self, which: str) -> None:
        """``nebula-ckpt export --step S`` of a step the disk tier surely holds, from a node whose
        memory holds nothing of the root (the disk tier answers): the two ranks' parts gathered
        into one ``.pt`` file, an incremental step's parts read from the earlier steps holding
        them. It must be rank 0's state of the save the model has there (every rank holds every
        key; the lowest rank's copy is the one gathered), frozen part included."""
        sure = {s: e for s, p in self.truth.tier("disk").items() if len(p) == 1 for e in p
                if e is not None and self.disk_whole(s, e, True)}
        if not sure:
            return
        step = max(sure) if which == "newest" else min(sure)
        want = sure[step]
        self.note(f"export step {step} ({want}) from the disk tier")
        got = self.shared.tool().call({"op": "export", "root": self.root, "step": step, "rank": 0,
                                       "to": str(self.dir / f"export-{uuid.uuid4().hex[:6]}.pt"),
                                       "shm": str(self.shm / "no-node"), "node": "nx"})
        assert got is not None
        if got.get("code") != 0 or "parts" not in got:
            self.fail(f"export of step {step} ({want}) failed: exit {got.get('code')}: {got.get('stderr')} "
                      f"{got.get('unreadable', '')}")
        try:
            sid = self.truth.check_parts(got["parts"], f"the export of step {step}")
        except Violation as e:
            self.fail(str(e))
        if sid != want.sid:
            self.fail(f"the export of step {step} holds save #{sid}; the disk tier holds {want}")

    @precondition(lambda self: os.path.isdir(self.root))
    @rule()
    def restore_alone(self) -> None:
        """One process restores the job's root at world size 1, read-only, from a node whose memory
        holds nothing of it (an evaluation run; the disk tier answers): the ranks' parts merged, so
        every key is rank 0's (each rank saved every key; the lowest rank's copy is the one taken).
        It must be one save's state, whole, the newest save the disk tier may hold or newer than
        every save it surely holds."""
        on_disk = {(e.writer, s, e.sid): e for s, p in self.truth.tier("disk").items() for e in p
                   if e is not None and self.disk_whole(s, e, False)}
        sure = {(e.writer, s, e.sid): e for s, p in self.truth.tier("disk").items() if len(p) == 1
                for e in p if e is not None and self.disk_whole(s, e, True)}
        self.note("restore the root in one process (world size 1, read-only)")
        got = self.shared.tool().call({"op": "restore_alone", "root": self.root, "rank": 0,
                                       "shm": str(self.shm / "no-node"), "node": "nx"})
        assert got is not None
        if "error" in got and not (self.only_damaged([got["error"]], disk_only=True) and not sure):
            self.fail(f"a one-process restore of the job raised {got['error']}")
        if "error" in got:
            return
        if got["step"] is None:
            if sure:
                self.fail(f"a one-process restore found nothing; the disk tier holds {max(sure)}")
            return
        try:
            sid = self.truth.check_parts(got["parts"], "the one-process restore")
        except Violation as e:
            self.fail(str(e))
        match = [k for k, e in on_disk.items() if k[1] == got["step"] and e.sid == sid]
        if not match:
            self.fail(f"a one-process restore gave step {got['step']} (save #{sid}, tier {got.get('tier')}), which "
                      f"the disk tier does not hold: {on_disk}")
        if sure and max(sure) > max(match):
            self.fail(f"a one-process restore gave step {got['step']} (save #{sid}); the disk tier surely holds the "
                      f"newer {max(sure)}")

    def teardown(self) -> None:
        self._kill_job()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)

