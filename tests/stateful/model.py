"""The model of the truth: which save's bytes are committed where, and what may change them.

A *tier* here is one place checkpoints live: the root's disk tier (it moves with the root
folder: key ``"disk"``) or the memory tier of one node for one root path (key ``("mem", node,
path)``: a root moved elsewhere leaves it behind, moved back finds it again). For each tier the
model holds, per step, the set of what may be committed there: an :class:`Entry` (a save's id and
the writer that committed it) or :data:`ABSENT`. One element: known. Several: a kill, or a
retention that may or may not have dropped the step, left it open; an audit (every committed step
of the tier read back, :meth:`Truth.observe`) closes it, and fails when what it finds is not one
of the possibilities.

What may remove a committed step, and nothing else (each is documented behaviour):

* retention: steps outside a tier's ``keep_last`` newest after a commit there, in a restore's
  order (writer, then step);
* a step saved again: the committed steps after it on that tier (they may refer to its bytes:
  the run went back to it);
* ``close()``, ``nebula-ckpt gc`` and a restore that hands the memory tier's pages over: the
  memory tier's steps, but only while the newest save it holds is committed on the root too;
* losing a node: its memory tiers.

Writers are numbered in the order they take a writer generation (a job at its first save, a
``persist-memory`` that copies), which is the order of their generations: a restore must open
the newest (writer, step) committed on a tier it can reach, the fastest tier first for one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Optional


@dataclass(frozen=True)
class Entry:
    """A committed checkpoint: the save whose bytes it holds and the writer that committed it."""

    sid: int
    writer: int

    def __repr__(self) -> str:
        return f"save#{self.sid}/w{self.writer}"


#: "not committed there"
ABSENT: Optional[Entry] = None


@dataclass
class Save:
    """One call of ``save_async``: its step, frozen part and writer."""

    step: int
    fid: int
    writer: int


class Violation(AssertionError):
    """What the library did is none of what the model allows."""


@dataclass
class Truth:
    saves: dict[int, Save] = field(default_factory=dict)
    tiers: dict[Hashable, dict[int, set[Optional[Entry]]]] = field(default_factory=dict)
    #: health marks (a person's ``nebula-ckpt mark``, the training signal's), per write: (writer,
    #: step, save id) -> "suspect" or "healthy"; a step saved again is another write, with no mark
    marks: dict[tuple[int, int, int], str] = field(default_factory=dict)
    #: each writer's generation, as audits read it from the commit markers
    gens: dict[int, int] = field(default_factory=dict)
    #: steps ``remove()`` left in place while a later step refers to them, with the entries it was
    #: asked to remove (the commit its record on the tier names): the request outlives the job, and
    #: any later deletion on that tier (retention, ``remove()``, by this job or a later one) deletes
    #: the step once nothing refers to it, so an audit that finds one still there cannot close that;
    #: a save that commits the step again (another entry) is never taken by it
    deferred: dict[Hashable, dict[int, set[Entry]]] = field(default_factory=dict)
    #: copies (tier, step, save id) whose files were damaged after their commit (a shard cut short or
    #: lost, the manifest lost: ``DamageOps.damage_root_copy``) and that an audit found so; ``maybe_bad``:
    #: those that may be (a later incremental step may refer to the damaged bytes; a replacement
    #: killed part way), until an audit reads them back
    bad: set[tuple[Hashable, int, int]] = field(default_factory=set)
    maybe_bad: set[tuple[Hashable, int, int]] = field(default_factory=set)
    #: the tiers damaged beside the live job: its later saves there may build on the damaged bytes
    tainted: set[Hashable] = field(default_factory=set)

    # -- reading ---------------------------------------------------------------------------------
    def tier(self, key: Hashable) -> dict[int, set[Optional[Entry]]]:
        return self.tiers.setdefault(key, {})

    def certain(self, key: Hashable) -> bool:
        return all(len(p) == 1 for p in self.tier(key).values())

    def entries(self, key: Hashable) -> dict[int, Entry]:
        """The steps known committed on ``key`` (call when :meth:`certain`; a step whose removal is
        deferred counts as there, which the audit before found it)."""
        out = {}
        waiting = self.deferred.get(key, {})
        for s, p in self.tier(key).items():
            (e,) = p - {ABSENT} if len(p - {ABSENT}) == 1 and p - {ABSENT} <= waiting.get(s, set()) else p
            if e is not None:
                out[s] = e
        return out

    def whole(self, key: Hashable) -> dict[int, Entry]:
        """:meth:`entries` but the copies known damaged: what a restore, ``gc`` and ``persist-memory``
        may count on (their files at their recorded sizes)."""
        return {s: e for s, e in self.entries(key).items() if (key, s, e.sid) not in self.bad}

    def damaged(self, key: Hashable) -> dict[int, Entry]:
        """The steps known committed on ``key`` whose copy there is known damaged."""
        return {s: e for s, e in self.entries(key).items() if (key, s, e.sid) in self.bad}

    def maybe_steps(self, key: Hashable) -> list[int]:
        return sorted(s for s, p in self.tier(key).items() if p - {ABSENT})

    def suspect(self) -> set[tuple[int, int, int]]:
        """The writes (writer, step, save id) marked suspect: a restore of the newest step skips them."""
        return {ws for ws, m in self.marks.items() if m == "suspect"}

    def target(self, keys: list[Hashable], skip: frozenset[tuple[int, int, int]] = frozenset()
               ) -> Optional[tuple[int, Entry, Hashable]]:
        """What a restore reading ``keys`` (fastest first) must open: the newest (writer, step), the
        later save of a step saved twice, the fastest tier for one save; none of ``skip``'s
        writes (writer, step, save id)."""
        best: Optional[tuple[tuple[int, int, int, int], int, Entry, Hashable]] = None
        for i, k in enumerate(keys):
            for s, e in self.whole(k).items():  # a damaged copy is passed over
                if (e.writer, s, e.sid) in skip:
                    continue
                order = (e.writer, s, e.sid, -i)  # of two saves of one step, the later one
                if best is None or order > best[0]:
                    best = (order, s, e, k)
        return None if best is None else best[1:]

    def newest_write(self, key: Hashable) -> Optional[tuple[int, Entry]]:
        """The newest (writer, step) entry that may be on ``key`` (uncertain ones included)."""
        cands = [(e.writer, s, e.sid, e) for s, p in self.tier(key).items() for e in p if e is not None]
        if not cands:
            return None
        *_, s, _sid, e = max(cands, key=lambda c: c[:3])
        return s, e

    # -- changes ---------------------------------------------------------------------------------
    def commit(self, key: Hashable, step: int, entry: Entry, keep_last: int, *, surely: bool = True,
               drops: bool = True) -> None:
        """``entry`` committed as ``step`` on ``key`` (``surely=False``: perhaps, a kill came
        around it), then that tier's retention (``drops=False``: a copy with no retention of its
        own, ``persist-memory``); either way a step saved again, or copied over an older write of it,
        may take the later steps that refer to the old write's bytes with it."""
        t = self.tier(key)
        before = t.get(step, {ABSENT})
        again = bool(before - {ABSENT})
        if (key, step, entry.sid) in self.bad | self.maybe_bad:  # the same write copied over its damaged copy
            self.bad.discard((key, step, entry.sid))
            self.maybe_bad.discard((key, step, entry.sid))
            if not surely:
                self.maybe_bad.add((key, step, entry.sid))
        if key in self.tainted:
            self.maybe_bad.add((key, step, entry.sid))
        if surely:
            t[step] = {entry}
        else:
            t[step] = before | {entry, ABSENT}  # the old one goes before the new one is written
        for s in list(t):
            if s == step:
                continue
            if again and s > step:  # may refer to the bytes of the step saved again
                t[s] = t[s] | {ABSENT}
        if not drops:
            return
        # retention: the keep_last newest in a restore's order, (writer, step); a step may go when
        # keep_last others may rank above it (the step just committed always stays)
        orders = {s: [(e.writer, s) for e in p if e is not None] for s, p in t.items()}
        for s in [s for s in t if s != step and orders[s]]:
            low = min(orders[s])
            if sum(1 for o, os_ in orders.items() if o != s and os_ and max(os_) > low) >= keep_last:
                t[s] = t[s] | {ABSENT}

    def may_drop_all(self, key: Hashable) -> None:
        for p in self.tier(key).values():
            p.add(ABSENT)

    def drop_all(self, key: Hashable) -> None:
        self.tiers[key] = {}

    def removed(self, key: Hashable, step: int) -> None:
        """``remove(step)`` ran on a tier ``key`` the job writes: the step is gone there, unless a
        later checkpoint of that tier may refer to its bytes (it stays listed until none does)."""
        t = self.tier(key)
        if step in t:
            if any(s > step for s in self.maybe_steps(key)):
                entries = {e for e in t[step] if e is not None}
                t[step] = t[step] | {ABSENT}
                self.deferred.setdefault(key, {}).setdefault(step, set()).update(entries)
            else:
                t[step] = {ABSENT}

    def job_ended(self) -> None:
        """The job's writers are gone; the removals they deferred are recorded on the tiers, so a
        later job's deletions still do them; the next job builds on no damaged bytes (its first
        save on a tier is full, or built on the step it restored there, read whole)."""
        self.tainted.clear()

    def may_drop(self, key: Hashable, step: int) -> None:
        self.tier(key).setdefault(step, {ABSENT}).add(ABSENT)

    # -- checks ----------------------------------------------------------------------------------
    def check_parts(self, parts: dict[str, Any], where: str) -> int:
        """The save whose bytes every part of a restored state holds (it must be one save's, whole)."""
        sids = {v for k, v in parts.items() if k not in ("frozen", "meta.fid")}
        if len(sids) != 1 or not isinstance(next(iter(sids)), int):
            raise Violation(f"{where}: the state is not one save's bytes: {parts}")
        sid = sids.pop()
        if sid not in self.saves:
            raise Violation(f"{where}: save #{sid} was never made: {parts}")
        fid = self.saves[sid].fid
        if parts["frozen"] != fid or parts["meta.fid"] != fid:
            raise Violation(f"{where}: the frozen part is not save #{sid}'s (frozen #{fid}): {parts}")
        return sid

    def observe(self, key: Hashable, found: dict[int, dict[str, Any]], where: str) -> None:
        """An audit of ``key``: every committed step there (``{step: {"gen", "parts"} or {"error"}}``).
        Each must be one of the model's possibilities; the model then knows the tier exactly."""
        t = self.tier(key)
        for s, p in sorted(t.items()):
            if s not in found and ABSENT not in p:
                raise Violation(f"{where}: step {s} ({_show(p)}) was committed and is gone, though no retention, "
                                "no save of it again and no clean end could drop it")
        for s, got in sorted(found.items()):
            p = t.get(s, {ABSENT})
            if "error" in got:
                broken = [e for e in p if e is not None and (key, s, e.sid) in self.bad | self.maybe_bad
                          and self.gens.get(e.writer, got.get("gen")) == got.get("gen")]
                if len(broken) != 1:
                    raise Violation(f"{where}: step {s} is listed but does not restore: {got['error']} "
                                    f"(the model has {_show(p)}, none of it damaged)")
                t[s] = {broken[0]}
                self.bad.add((key, s, broken[0].sid))
                self.maybe_bad.discard((key, s, broken[0].sid))
                continue
            sid = self.check_parts(got["parts"], f"{where} step {s}")
            match = [e for e in p if e is not None and e.sid == sid]
            if not match:
                raise Violation(f"{where}: step {s} holds save #{sid}; the model allows only {_show(p)}")
            if (key, s, sid) in self.bad:
                raise Violation(f"{where}: step {s} ({match[0]}) reads back whole, though its files were damaged")
            self.maybe_bad.discard((key, s, sid))
            t[s] = {match[0]}
            gen = self.gens.setdefault(match[0].writer, got["gen"]) if "gen" in got else None
            if gen is not None and gen != got["gen"]:
                raise Violation(f"{where}: step {s} ({match[0]}) carries writer generation {got['gen']}; that "
                                f"writer's other checkpoints carry {gen}")
        for s in [s for s in t if s not in found]:
            del t[s]
        self._keep_deferred(key)

    def _keep_deferred(self, key: Hashable) -> None:
        """After an audit or a listing of ``key``: a deferred removal may still take a step found there."""
        t, waiting = self.tier(key), self.deferred.get(key, {})
        for s, entries in list(waiting.items()):
            if t.get(s, set()) & entries:  # the commit removed may still be there
                t[s] = t[s] | {ABSENT}
            else:  # gone, or committed again by another save: the request is spent
                del waiting[s]

    def observe_listing(self, key: Hashable, listed: Iterable[int], where: str) -> None:
        """``list()``'s steps of ``key``: those the model knows committed must be there, and every one
        listed must be possible."""
        listed = set(listed)
        t = self.tier(key)
        for s, p in t.items():
            if s not in listed and ABSENT not in p:
                raise Violation(f"{where}: list() lacks step {s} ({_show(p)}), which is committed there")
        for s in listed:
            p = t.get(s, {ABSENT})
            if not p - {ABSENT}:
                raise Violation(f"{where}: list() shows step {s}, which no save committed there")
            if len(p) > 1:
                t[s] = p - {ABSENT}
        for s in [s for s in t if s not in listed]:
            del t[s]
        self._keep_deferred(key)


def _show(p: set[Optional[Entry]]) -> str:
    return " or ".join(sorted("absent" if e is None else repr(e) for e in p))
