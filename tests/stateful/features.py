"""Operations of the one-process machine where features meet a job's own calls (a mixin of
:class:`~stateful.machine.Single`).

* A tight host-memory budget (``configure``'s ``budget``: smaller than two states, ``on_full="wait"``;
  the state then holds a 1 MiB tensor): before each save the memory tier may give up its steps the
  disk tier holds as the same write, and, with nothing in flight, put its newest write (not marked
  suspect by the job) on the disk tier first, then give it up (``save/drain.py``'s ``make_room``).
  A save that nothing can make room for (the memory tier holds a write no persistent tier holds:
  suspect, or an older one ``MemoryTier(keep_last>1)`` keeps) raises ``ValidationError`` naming the
  budget after a short wait, never hangs, and writes nothing; every earlier step stays (the audits).
* ``rollback``: an in-process rollback, ``ck.load(N, into=...)`` (step ``N`` perhaps marked suspect
  first by ``nebula-ckpt mark --suspect``): the newest write of step ``N`` whatever its mark; then
  perhaps a save of ``N`` again, a new write with no mark, which a restart restores while it is the
  newest, and the old suspect write never comes back (the restores' checks).
* ``loop_rollback``: a training loop under ``LoopState`` (a shuffled ``DataLoader``, draws from
  ``random``, NumPy and torch each batch) on a scratch root of the sequence's tiers, saving every
  step, in the live job's process beside its Checkpointer (or a tool's on a node), loads at step
  ``at`` an earlier step ``back`` its tiers surely hold (``ck.load(back, into=state)``: from the
  memory tier while its ``keep_last`` holds it, else from the disk tier, or from the memory tier
  where it keeps the step as a newer one's base) and goes on (``continue``
  or ``break``): the batches and draws that follow are those that followed step ``back`` in the
  same loop run without a checkpoint, then the loop ends where that run ended (docs/api.md).
* ``dcp_read``: ``torch.distributed.checkpoint.load`` through ``NebulaStorageReader(root)`` and a
  ``load_latest`` of the root's persistent tier agree: the same step, the same bytes, the step the
  model names (suspect writes skipped by both); with every step suspect both raise
  ``CorruptCheckpointError``, with nothing committed the reader raises ``NotFoundError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Optional

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from stateful.model import ABSENT, Entry, Violation

if TYPE_CHECKING:
    from stateful.machine import Job, Single

#: the elements of the state's plain tensor under a budget: a state of about 1 MiB
BUDGET_EXTRA = 1 << 18
#: the budget: one state and a half (smaller than two states, larger than one with its overhead)
BUDGET_BYTES = int(1.5 * 4 * BUDGET_EXTRA)


class FeatureOps:
    """The rules and save hooks of this module; see the module docstring."""

    # -- the host-memory budget --------------------------------------------------------------------
    def budget_room(self: "Single", job: "Job") -> None:
        """What the budget's make-room may do before a save (each a possibility: the audits close
        them): the memory tier gives up its steps the disk tier holds as the same write; its newest
        write not marked suspect by the job (what ``close()`` would put there) goes to the disk tier
        first when the disk lacks it or holds it damaged."""
        if not self.tiers.get("budget") or job.no_memory:
            return
        mem = self.mem(job.node)
        self._give_up(mem)
        want = self._close_target(job)
        if want is not None:
            step, entry, _ = want
            # also where the disk tier's copy of that write is damaged: the budget finds it so and
            # writes it there again (seed 1558952393)
            damaged = ("disk", step, entry.sid) in self.truth.bad | self.truth.maybe_bad
            if damaged or entry not in self.truth.tier("disk").get(step, set()):
                self.note(f"  (the budget may put step {step} ({entry}) on the disk tier first"
                          f"{', over its damaged copy' if damaged else ''})")
                self.truth.commit("disk", step, entry, self.tiers["disk_keep"], surely=False)
        self._give_up(mem)

    def _give_up(self: "Single", mem: Hashable) -> None:
        disk = self.truth.tier("disk")
        for s, p in self.truth.tier(mem).items():
            if any(e is not None and e in disk.get(s, set()) for e in p):
                p.add(ABSENT)

    def budget_stuck(self: "Single", job: "Job") -> Optional[str]:
        """A write the memory tier may hold that the disk tier may not (the budget cannot free it:
        suspect, or an older one ``keep_last`` keeps); None when the memory tier can give up all (or
        the job has none: its NEBULA_SHM_DIR is a file)."""
        if job.no_memory:
            return None
        disk = self.truth.tier("disk")
        for s, p in sorted(self.truth.tier(self.mem(job.node)).items()):
            for e in p:
                if e is not None and e not in disk.get(s, set()):
                    return f"step {s} ({e})"
        return None

    def budget_refused(self: "Single", job: "Job", got: dict[str, Any], what: str) -> bool:
        """Whether the save ``what`` was refused by the budget as documented (``ValidationError``
        naming ``host_memory_budget``, only when the memory tier holds what it cannot give up);
        then it counted as a save (its index is taken) and nothing of it is written."""
        err = got.get("error") or ""
        if got["ok"] or not self.tiers.get("budget") or not err.startswith("ValidationError"):
            return False
        if "host_memory_budget" not in err:
            self.fail(f"{what}: refused under the budget without naming it: {err}")
        held = self.budget_stuck(job)
        if held is None:
            self.fail(f"{what}: refused ({err}), but the memory tier holds only writes the disk tier holds")
        self.note(f"  refused by the budget ({held} held): {err[:160]}")
        if got["written"]:
            self.fail(f"{what}: refused, yet written on {got['written']}")
        job.saves += 1
        return True

    def load_in_job(self: "Single", job: "Job", keys: list[Hashable], want: Any, step: int, after: str) -> None:
        """``load(step)`` in the live ``job``: it must open ``want``, the newest write of ``step``
        on ``keys`` (``after``: what came before, in failures); the job's cursor and training
        signal follow it (the writes this Checkpointer marked stay its own)."""
        from stateful.machine import Signal

        assert want is not None
        entry, key = want
        got = job.proc.call({"op": "load", "step": step})
        if got is None or "error" in got:
            self.fail(f"load({step}) on n{job.node}{after} failed: {got if got else job.proc.tail()}")
        assert got is not None
        try:
            sid = self.truth.check_parts(got["parts"], f"load({step}){after}")
        except Violation as e:
            self.fail(str(e))
        if (got["step"], sid) != (step, entry.sid):
            self.fail(f"load({step}) opened step {got['step']} (save #{sid}, from {got.get('tier')}); the newest "
                      f"write of step {step} is {entry} on {key}")
        job.cursor = step
        job.health = Signal(restored=(entry.writer, step, entry.sid), marked=job.health.marked)
        disk = self.truth.whole("disk")  # a damaged copy there is no reason to hand the pages over
        if key == keys[0] and step in disk and disk[step].sid == entry.sid:
            self.truth.may_drop(keys[0], step)  # the memory tier's pages may be handed over

    # -- an in-process rollback ----------------------------------------------------------------
    @precondition(lambda self: self.job is not None)
    @rule(mark_first=st.booleans(), which=st.sampled_from(["newest", "another"]), pick=st.integers(0, 7),
          resave=st.booleans())
    def rollback(self: "Single", mark_first: bool, which: str, pick: int, resave: bool) -> None:
        """``ck.load(N, into=...)`` in the live job (after ``mark --suspect N`` when ``mark_first``),
        then a save of ``N`` again when ``resave``. See the module docstring."""
        job = self.job
        assert job is not None
        self.audit(job.node)
        keys = [self.mem(job.node), "disk"]
        steps = sorted({s for k in keys for s in self.truth.whole(k)})  # a step whole somewhere
        if not steps:
            return
        step = steps[-1] if which == "newest" else steps[pick % len(steps)]
        if mark_first:
            self.mark_step(job.node, True, step)
        want = self._write_of(keys, step)
        self.note(f"rollback: load({step}) on n{job.node}" + (", then save it again" if resave else ""))
        self.load_in_job(job, keys, want, step, "")
        if resave:
            self._save(step)

    def _write_of(self: "Single", keys: list[Hashable], step: int) -> Optional[tuple[Entry, Hashable]]:
        """The write of ``step`` that ``load(step)`` opens: the newest (writer, save), the fastest tier;
        a copy damaged there (DamageOps) passed over."""
        found = [((e.writer, e.sid, -i), e, k) for i, k in enumerate(keys)
                 for s, e in self.truth.whole(k).items() if s == step]
        if not found:
            return None
        _, e, k = max(found, key=lambda f: f[0])
        return e, k

    # -- a rollback inside a LoopState loop -------------------------------------------------------
    @rule(at=st.integers(2, 10), pick=st.integers(0, 7), mode=st.sampled_from(["continue", "break"]),
          node=st.sampled_from([0, 1]))
    def loop_rollback(self: "Single", at: int, pick: int, mode: str, node: int) -> None:
        """A loop under ``LoopState`` on a scratch root (the sequence's tiers), in the live job's
        process (beside its Checkpointer) or on ``node``: at step ``at`` it loads an earlier step its
        tiers surely hold, then goes on. See the module docstring."""
        t = self.tiers
        steps = range(1, at + 1)  # one save a step, save index = step - 1
        in_memory = set(steps[-t["memory_keep"]:])
        on_disk = set([s for s in steps if (s - 1) % t["disk_every"] == 0][-t["disk_keep"]:])
        backs = sorted((in_memory | on_disk) - {at})
        if not backs:
            return
        back = backs[pick % len(backs)]
        tier = "memory" if back in in_memory else "local"
        self.loops += 1
        root = str(self.dir / f"loop{self.loops}" / "ckpt")
        who = self.job.proc if self.job is not None else self.shared.tool()
        where = f"n{self.job.node}, in the job's process" if self.job is not None else f"n{node}"
        self.note(f"a LoopState loop on {where}: at step {at} load({back}) (on its {tier} tier), then {mode}")
        cmd: dict[str, Any] = {"op": "loop", "root": root, "tiers": t, "at": at, "back": back, "mode": mode}
        if self.job is None:
            cmd.update(shm=self.shm_of(node), node=f"n{node}")
        got = who.call(cmd)
        if got is None:
            self.fail(f"the process of the LoopState loop died (log: {who.log_path}):\n{who.tail()}")
        assert got is not None
        what = f"LoopState loop, load({back}) at step {at} then {mode}"
        if "error" in got:
            self.fail(f"{what}: raised {got['error']}")
        # the memory tier may still hold an older step as the base a newer one refers to (docs/tiers.md)
        read = str(got.get("tier")).split(":")[0]
        if got.get("step_after_load") != back or read not in ((tier,) if tier == "memory" else ("local", "memory")):
            self.fail(f"{what}: the loop is at step {got.get('step_after_load')} after the load, read from "
                      f"{got.get('tier')}; step {back} is on the {tier} tier")
        want = got["want"][:at] + got["want"][back:]
        if got["seen"] != want:
            seen = got["seen"]
            first = next(i for i in range(max(len(seen), len(want)))
                         if i >= min(len(seen), len(want)) or seen[i] != want[i])
            self.fail(f"{what}: other batches or draws from batch #{first}: saw {got['seen'][first:first + 2]}, "
                      f"the run without a rollback had {want[first:first + 2]}")

    # -- DCP's reader against load_latest ------------------------------------------------------
    @rule(node=st.sampled_from([0, 1]))
    def dcp_read(self: "Single", node: int) -> None:
        """``dcp.load`` through ``NebulaStorageReader(root)`` beside ``load_latest`` of the root's
        persistent tier, from ``node``. See the module docstring."""
        import os

        if not os.path.isdir(self.path):
            return
        self.audit(node)  # the disk tier known
        want = self.truth.target(["disk"], frozenset(self.truth.suspect()))
        anything = self.truth.target(["disk"])
        self.note(f"DCP read of the root and load_latest of its disk tier, on n{node}")
        got = self.shared.tool().call({"op": "dcp_read", "root": self.path, "shm": self.shm_of(node),
                                       "node": f"n{node}", "extra": BUDGET_EXTRA if self.tiers.get("budget") else 5})
        assert got is not None
        latest, dcp = got["latest"], got["dcp"]
        damaged = bool(self.truth.damaged("disk"))  # copies damaged there (DamageOps): passed over
        if want is None:
            if anything is None and not damaged:
                if latest.get("step") is not None or "error" in latest:
                    self.fail(f"load_latest of an empty disk tier gave {latest}")
                if not dcp.get("error", "").startswith("NotFoundError"):
                    self.fail(f"NebulaStorageReader of an empty disk tier gave {dcp}")
                return
            for who, out in (("load_latest", latest), ("NebulaStorageReader", dcp)):
                if not (out.get("error", "").startswith("CorruptCheckpointError") and
                        ("suspect" in out["error"] or damaged)):
                    self.fail(f"{who}, every step of the disk tier suspect or damaged: {out}")
            return
        step, entry, _ = want
        for who, out in (("load_latest", latest), ("NebulaStorageReader", dcp)):
            if "error" in out:
                self.fail(f"{who} of the disk tier raised {out['error']}; step {step} ({entry}) is there")
            try:
                sid = self.truth.check_parts(out["parts"], who)
            except Violation as e:
                self.fail(str(e))
            if (out["step"], sid) != (step, entry.sid):
                self.fail(f"{who} read step {out['step']} (save #{sid}); the newest write of the disk tier not "
                          f"suspect is step {step} ({entry})")
        if latest["parts"] != dcp["parts"]:
            self.fail(f"load_latest and the DCP reader read different bytes: {latest['parts']} / {dcp['parts']}")
