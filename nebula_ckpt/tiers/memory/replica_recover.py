"""The recover round of the replicas at restore: lost memory-tier copies come back from partners.

Run by the :class:`~nebula_ckpt.tiers.memory.replicas.Replicator`'s thread while the training
thread waits (a collective). The ranks gather one *view* each (own steps, replicas held with
their files, the shared tiers' steps: :mod:`~nebula_ckpt.tiers.memory.recovery` plans from them
alike on every rank) and agree on the newest step every rank can get. Then pull rounds: each rank
whose own copy is gone receives it from a holder over the replicas' channel into an
``.incoming-*`` folder of its memory tier, in chunks, checking each tensor as its bytes land
(:mod:`~nebula_ckpt.tiers.memory.replica_pull`); meanwhile every rank that has its own copy checks all
its checksums (so a copy with flipped bytes is pulled like a lost one, in the next round). A
pulled copy becomes visible in the memory tier only once every checksum of it passed; nothing of
``into`` has changed at any point. One gather per round tells every rank who succeeded; a failed
pull tries the next holder, then the shared tiers. The normal restore then opens the step
agreed here (no second exchange of candidates), and reads a memory-tier copy checked here
without checking its checksums a second time.

Two exchanges in all when nothing is damaged: the views (a gather of objects), then the outcome
of the one pull round (two flags per rank, one small collective).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

from nebula_ckpt.format.names import step_dir
from nebula_ckpt.tiers.memory import recovery
from nebula_ckpt.tiers.memory.replica_channel import Replication, Works
from nebula_ckpt.tiers.memory.replica_pull import Pull, chunk_bytes, land_and_check, receive_pull, send_pull
from nebula_ckpt.tiers.memory.replica_store import committed, of_world, step_files, verify_step

log = logging.getLogger(__name__)

Order = tuple[int, int]


def recover(rp: Replication, shared: list[Order], step: Optional[int],
            among: Optional[Sequence[int]]) -> dict[str, Any]:
    """Make the newest step every rank can get present in every rank's memory tier or a shared
    tier (a collective; see the module docstring).

    Returns:
        ``{"step", "generation", "sources", "checked"}``: ``sources[r]`` says where rank ``r``'s
        copy is (``"memory"``, ``"replica from rank H"``, ``"shared tier"``); ``step`` None when no
        step is available to every rank; ``checked``: whether this rank's memory-tier copy had
        every checksum checked here (its own copy, or the one it pulled).
    """
    views = rp.channel.gather(_view(rp, shared))
    excluded: set[Order] = set()
    while True:
        target = recovery.choose_target(views, step, among, excluded)
        if target is None:
            return {"step": None, "generation": None, "sources": [None] * rp.world, "checked": False}
        got = _get_everywhere(rp, views, target)
        if target in recovery.shared_orders(views):
            got.update({r: "shared tier" for r in range(rp.world) if r not in got})
        if len(got) == rp.world:
            log.info("nebula_ckpt: rank %d: step %d is on every rank (%s)", rp.rank, target[1],
                     ", ".join(f"rank {r}: {got[r]}" for r in sorted(got)))
            # every copy in a memory tier now had every checksum checked this round: the restore
            # need not check them again
            return {"step": target[1], "generation": target[0], "sources": [got[r] for r in range(rp.world)],
                    "checked": got[rp.rank] != "shared tier"}
        log.warning("nebula_ckpt: step %d cannot be had by rank(s) %s (every holder lost or damaged); "
                    "trying an older step", target[1], [r for r in range(rp.world) if r not in got])
        excluded.add(target)


def _get_everywhere(rp: Replication, views: list[dict[str, Any]], target: Order) -> dict[int, str]:
    """Pull rounds for ``target`` until every rank has it or no holder is left; rank -> where
    its copy is now (ranks missing: none of their holders delivered a healthy copy)."""
    got: dict[int, str] = {r: "memory" for r, v in enumerate(views) if target in {tuple(o) for o in v["own"]}}
    unchecked = set(got)  # own copies whose checksums are checked during the first round
    attempts = {r: 0 for r in range(rp.world) if r not in got}
    while True:
        assign = recovery.assignments(views, target, attempts)
        if not assign and not unchecked:
            return got
        outcome = _pull_round(rp, views, assign, target, rp.rank in unchecked)
        for r, h in assign.items():
            attempts[r] += 1
            if outcome[r][0]:
                got[r] = f"replica from rank {h}"
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
    own = [o for o in of_world(folder, committed(folder), rp.world) if own_ok(rp, o)] if folder else []
    held: dict[int, list[Order]] = {}
    files: dict[int, dict[int, list[tuple[str, int]]]] = {}
    if store is not None:
        for r, orders in store.held().items():
            for g, s in of_world(store.source_dir(r), orders, rp.world):
                try:
                    files.setdefault(r, {})[s] = step_files(store.source_dir(r), s)
                except OSError as e:  # gone meanwhile: not offered
                    log.debug("nebula_ckpt: rank %d: replica of rank %d step %d: %s", rp.rank, r, s, e)
                    continue
                held.setdefault(r, []).append((g, s))
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


def _pull_round(rp: Replication, views: list[dict[str, Any]], assign: dict[int, int], target: Order,
                check_own: bool) -> list[tuple[bool, bool]]:
    """Each requester ``r`` receives its ``target`` from holder ``assign[r]`` while this rank
    checks every checksum of its own copy when ``check_own``; ``(pulled, own copy damaged)``
    of every rank."""
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
        pull = receive_pull(ch, rp.store, step, files, assign[rp.rank])
    damaged = check_own and not own_ok(rp, target, "full")  # while the bytes move
    ok = pull is not None and _keep_pulled(rp, pull, target, assign[rp.rank])
    ch.wait(works)
    if ok:
        rp.counters.add("pulled_bytes", sum(n for _, n in files))
    return [(a, b) for a, b in ch.gather_flags((ok, damaged))]


def _keep_pulled(rp: Replication, pull: Pull, target: Order, holder: int) -> bool:
    """Check the copy ``pull`` brings (every checksum, as its bytes land) and make it this
    rank's memory-tier step; whether it was. A copy refused or damaged is dropped."""
    assert rp.store is not None and rp.folder is not None
    try:
        why = land_and_check(pull, target[1], rp.rank, rp.world, target[0])
    finally:
        pull.close()
    if why is None:
        try:
            rp.store.publish(pull.inc, target[1], rp.folder)
            return True
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
    if os.path.isabs(pull.inc):
        rp.store.discard(pull.inc)
    log.warning("nebula_ckpt: rank %d: the copy of step %d from rank %d cannot be kept (%s); trying "
                "the next source", rp.rank, target[1], holder, why)
    return False
