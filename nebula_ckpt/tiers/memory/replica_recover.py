"""The recover round of the replicas at restore: lost memory-tier copies come back from partners.

Run by the :class:`~nebula_ckpt.tiers.memory.replicas.Replicator`'s thread while the training
thread waits (a collective). The ranks gather one *view* each (own steps, replicas held with
their files, the shared tiers' steps: :mod:`~nebula_ckpt.tiers.memory.recovery` plans from them
alike on every rank) and agree on the newest step every rank can get. Then pull rounds: each rank
whose own copy is gone receives it from a holder over the replicas' channel into anonymous
memory, in chunks, checking each tensor as its bytes land
(:mod:`~nebula_ckpt.tiers.memory.replica_pull`); meanwhile every rank that has its own copy checks all
its checksums (so a copy with flipped bytes is pulled like a lost one, in the next round). Nothing
of ``into`` has changed at any point. One gather per round tells every rank who succeeded; a
failed pull tries the next holder, then the shared tiers. The normal restore then opens the step
agreed here (no second exchange of candidates): a rank's own memory-tier copy checked here without
checking its checksums a second time, a pulled copy from the memory it landed in (over the memory
tier's storage: :class:`~nebula_ckpt.storage.buffers.BufferStorage`), whose pages the restore
hands out as its tensors instead of copying them.

**The memory tier keeps a pulled copy** (so that the next failure is survivable too): a *keep
round* (:func:`keep_pulled`) on the replicas' thread, niced like every round after the restore,
pulls each such copy once more, from the same holder, into an ``.incoming-*`` folder of the rank's
memory tier (tmpfs pages allocated before each chunk lands, an ``ENOSPC`` refuses it), checks every
checksum and publishes it. It runs once the first training steps had the cores to themselves
(:data:`~nebula_ckpt.tiers.memory.replicas.KEEP_AFTER_S`, 1 s), or as soon as a save's round, another
restore or ``close()`` is queued on any rank; a rank that saved to its memory tier meanwhile takes no
copy. The pulled memory cannot serve:
the restore's tensors are those pages, and training changes them. Not kept (warned and counted in
``stats()["replicas"]["keep_failed"]``) when the tmpfs has no room, the holder is gone, or a save
reached this rank's memory tier first (that save's round makes new copies).

Two exchanges in all when nothing is damaged: the views (a gather of objects), then the outcome
of the one pull round (two flags per rank, one small collective); the keep round adds one, and so
does a restore of the newest step that leaves suspect steps out (the writes rank 0 leaves out,
which are then neither planned nor pulled: :func:`choose`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Optional, Sequence

import torch

from nebula_ckpt.format.commit import Write
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.tiers.memory import recovery
from nebula_ckpt.tiers.memory.replica_channel import Replication, Works
from nebula_ckpt.tiers.memory.replica_pull import Pull, chunk_bytes, land_and_check, receive_pull, send_pull
from nebula_ckpt.tiers.memory.replica_store import of_world, step_files, verify_step, writes

log = logging.getLogger(__name__)

#: ``(writer generation, step, save)``: one write of a step (:attr:`~nebula_ckpt.format.commit.Commit.write`)
Order = Write
#: ``(generation, step, save) -> bool``: whether a restore leaves that write out (a suspect step)
Skip = Callable[[int, int, int], bool]


def recover(rp: Replication, shared: list[Order], step: Optional[int],
            among: Optional[Sequence[int]], skip: Optional[Skip] = None) -> dict[str, Any]:
    """Make the newest step every rank can get present in every rank's memory tier or a shared
    tier (a collective; see the module docstring). ``skip(generation, step, save)``: whether
    this rank leaves that write out (rank 0 with the health marks: a suspect step); every rank
    passes one, or none, alike (:func:`choose`).

    Returns:
        ``{"step", "generation", "save", "sources", "checked", "pulled", "keep"}`` (``generation``,
        ``step`` and ``save``: the one write every rank restores): ``sources[r]`` says
        where rank ``r``'s copy is (``"memory"``, ``"replica from rank H"``, ``"shared tier"``);
        ``step`` None when no step is available to every rank; ``checked``: whether this rank's
        memory-tier copy had every checksum checked here (its own copy, or the one it pulled);
        ``pulled``: the files of this rank's pulled copy in memory (``"step-N/name" -> uint8
        tensor``), or None; ``keep``: what :func:`keep_pulled` needs (the same on every rank).
    """
    views = rp.channel.gather(_view(rp, shared))
    excluded: set[Order] = set()
    while True:
        target = choose(rp, views, step, among, excluded, skip)
        if target is None:
            return {"step": None, "generation": None, "save": None, "sources": [None] * rp.world,
                    "checked": False, "pulled": None, "keep": None}
        landed: dict[str, torch.Tensor] = {}
        holders: dict[int, int] = {}
        got = _get_everywhere(rp, views, target, landed, holders)
        if target in recovery.shared_orders(views):
            got.update({r: "shared tier" for r in range(rp.world) if r not in got})
        if len(got) == rp.world:
            log.info("nebula_ckpt: rank %d: step %d is on every rank (%s)", rp.rank, target[1],
                     ", ".join(f"rank {r}: {got[r]}" for r in sorted(got)))
            # every copy in a memory tier now had every checksum checked this round: the restore
            # need not check them again
            return {"step": target[1], "generation": target[0], "save": target[2],
                    "sources": [got[r] for r in range(rp.world)],
                    "checked": got[rp.rank] != "shared tier", "pulled": landed or None,
                    "keep": (views, holders, target) if holders else None}
        log.warning("nebula_ckpt: step %d cannot be had by rank(s) %s (every holder lost or damaged); "
                    "trying an older step", target[1], [r for r in range(rp.world) if r not in got])
        excluded.add(target)


def choose(rp: Replication, views: list[dict[str, Any]], step: Optional[int], among: Optional[Sequence[int]],
           excluded: set[Order], skip: Optional[Skip]) -> Optional[Order]:
    """The write the ranks try next: the newest every rank can get, less ``excluded`` and, with
    ``skip``, the writes a rank leaves out. Those are asked in a restore's order, newest first,
    and only down to the first write no rank leaves out (what ``skip`` is asked about is what
    the restore skipped), then gathered (a collective: with ``skip``, every rank calls it alike)
    and added to ``excluded``. So the round never pulls a step the restore would not open, and
    an older step every rank can get is pulled instead."""
    if skip is not None:
        mine: list[Order] = []
        while True:
            o = recovery.choose_target(views, step, among, excluded | set(mine))
            if o is None or not skip(*o):
                break
            mine.append(o)
        excluded |= {(int(g), int(s), int(w)) for seen in rp.channel.gather(mine) for g, s, w in seen}
    return recovery.choose_target(views, step, among, excluded)


def _get_everywhere(rp: Replication, views: list[dict[str, Any]], target: Order,
                    landed: dict[str, torch.Tensor], holders: dict[int, int]) -> dict[int, str]:
    """Pull rounds for ``target`` until every rank has it or no holder is left; rank -> where
    its copy is now (ranks missing: none of their holders delivered a healthy copy). This rank's
    pulled copy, in memory, goes into ``landed``; each rank that pulled -> its holder, into
    ``holders``."""
    got: dict[int, str] = {r: "memory" for r, v in enumerate(views) if target in {tuple(o) for o in v["own"]}}
    unchecked = set(got)  # own copies whose checksums are checked during the first round
    attempts = {r: 0 for r in range(rp.world) if r not in got}
    while True:
        assign = recovery.assignments(views, target, attempts)
        if not assign and not unchecked:
            return got
        outcome = _pull_round(rp, views, assign, target, rp.rank in unchecked, landed)
        for r, h in assign.items():
            attempts[r] += 1
            if outcome[r][0]:
                got[r], holders[r] = f"replica from rank {h}", h
                del attempts[r]
        for r in unchecked:
            if outcome[r][1]:  # flipped bytes: pulled like a lost copy, from its first holder
                del got[r]
                attempts[r] = 0
        unchecked = set()


def _view(rp: Replication, shared: list[Order]) -> dict[str, Any]:
    """What this rank can offer: own steps and replicas of this world size (with their files,
    so a pull needs no further exchange), the shared tiers'."""
    folder, store = rp.folder, rp.store
    own = [o for o in of_world(folder, writes(folder), rp.world) if own_ok(rp, o)] if folder else []
    held: dict[int, list[Order]] = {}
    files: dict[int, dict[int, list[tuple[str, int]]]] = {}
    if store is not None:
        for r in store.held():
            for g, s, w in of_world(store.source_dir(r), writes(store.source_dir(r)), rp.world):
                try:
                    files.setdefault(r, {})[s] = step_files(store.source_dir(r), s)
                except OSError as e:  # gone meanwhile: not offered
                    log.debug("nebula_ckpt: rank %d: replica of rank %d step %d: %s", rp.rank, r, s, e)
                    continue
                held.setdefault(r, []).append((g, s, w))
    return {"own": own, "shared": shared, "held": held, "files": files, "can_pull": store is not None,
            "chunk": chunk_bytes()}


def own_ok(rp: Replication, target: Order, verify: str = "size") -> bool:
    """Whether this rank's own memory-tier copy of ``target`` passes ``verify`` (``"size"``:
    markers and file sizes, for every step offered; ``"full"``: every checksum too, for the
    step agreed on)."""
    if rp.folder is None:
        return False
    try:
        verify_step(rp.folder, target[1], rp.rank, rp.world, verify)
        return True
    except Exception as e:
        log.warning("nebula_ckpt: rank %d: own memory-tier copy of step %d is damaged: %s", rp.rank, target[1], e)
        return False


def keep_pulled(rp: Replication, keep: Any, saved: bool,
                may_publish: Callable[[int, Callable[[], None]], bool]) -> None:
    """The keep round (see the module docstring; a collective: every rank calls it after a
    recover that answered ``keep``): each rank that pulled its copy into memory, and has not
    saved to its memory tier since (``saved``), pulls it again, from the same holder, into its
    memory tier. ``may_publish(step, publish)`` runs ``publish`` when the copy may still become
    the tier's step (no save reached the tier meanwhile), and says whether it did."""
    views, holders, target = keep
    wanted = rp.channel.gather_flags((rp.rank in holders and not saved,))
    holders = {r: h for r, h in holders.items() if wanted[r][0]}
    if not holders:
        return
    outcome = _pull_round(rp, views, holders, target, False, None, may_publish)
    if rp.rank in holders and not outcome[rp.rank][0]:
        rp.counters.add("keep_failed", 1)
        log.warning("nebula_ckpt: rank %d: its memory tier does not keep the copy of step %d it restored from "
                    "rank %d (see the warning above); the next save's replicas make new copies", rp.rank,
                    target[1], holders[rp.rank])


def _pull_round(rp: Replication, views: list[dict[str, Any]], assign: dict[int, int], target: Order,
                check_own: bool, landed: Optional[dict[str, torch.Tensor]],
                may_publish: Optional[Callable[[int, Callable[[], None]], bool]] = None) -> list[tuple[bool, bool]]:
    """Each requester ``r`` receives its ``target`` from holder ``assign[r]`` (into memory, then
    into ``landed``, when that is given; else into the memory tier) while this rank checks every
    checksum of its own copy when ``check_own``; ``(pulled, own copy damaged)`` of every rank."""
    ch, step = rp.channel, target[1]
    works: Works = []
    for r, h in assign.items():
        if h == rp.rank and rp.store is not None:
            files = views[h]["files"][r][step]
            d = os.path.join(rp.store.source_dir(r), step_dir(step))
            send_pull(ch, [os.path.join(d, n) for n, _ in files], files, r, int(views[r]["chunk"]), works)
    pull, files = None, []
    if rp.rank in assign and rp.store is not None:
        files = views[assign[rp.rank]]["files"][rp.rank][step]
        pull = receive_pull(ch, rp.store, step, files, assign[rp.rank], into_memory=landed is not None)
    damaged = check_own and not own_ok(rp, target, "full")  # while the bytes move
    ok = pull is not None and _keep_pulled(rp, pull, target, assign[rp.rank], landed, may_publish)
    ch.wait(works)
    if ok:
        rp.counters.add("pulled_bytes", sum(n for _, n in files))
    return [(a, b) for a, b in ch.gather_flags((ok, damaged))]


def _keep_pulled(rp: Replication, pull: Pull, target: Order, holder: int,
                 landed: Optional[dict[str, torch.Tensor]],
                 may_publish: Optional[Callable[[int, Callable[[], None]], bool]]) -> bool:
    """Check the copy ``pull`` brings (every checksum, as its bytes land) and hand its files to
    ``landed`` (in memory) or make it this rank's memory-tier step (through ``may_publish``,
    when given); whether it was. A copy refused or damaged is dropped."""
    store, folder = rp.store, rp.folder
    assert store is not None and folder is not None
    try:
        why = land_and_check(pull, rp.rank, rp.world, target)
        if why is None and landed is not None:
            landed.update(pull.hand_over(target[1]))
            return True
    finally:
        pull.close()
    if why is None:
        publish = functools.partial(store.publish, pull.inc, target[1], folder)
        try:
            if may_publish is None:
                publish()
            elif not may_publish(target[1], publish):
                log.info("nebula_ckpt: rank %d: the copy of step %d is not kept in its memory tier: a save "
                         "reached the tier first", rp.rank, target[1])
                store.discard(pull.inc)
            return True
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
    if os.path.isabs(pull.inc):
        store.discard(pull.inc)
    if may_publish is not None:
        log.warning("nebula_ckpt: rank %d: the copy of step %d from rank %d is not kept in its memory tier "
                    "(%s)", rp.rank, target[1], holder, why)
    else:
        log.warning("nebula_ckpt: rank %d: the copy of step %d from rank %d cannot be kept (%s); trying "
                    "the next source", rp.rank, target[1], holder, why)
    return False
