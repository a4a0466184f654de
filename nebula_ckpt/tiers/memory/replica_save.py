"""One save round of the replicas: each rank's committed memory-tier step goes to its partners.

Run by the :class:`~nebula_ckpt.tiers.memory.replicas.Replicator`'s thread, in the same order on
every rank, once this rank's memory tier is done with the save: the ranks exchange what they
committed (file names and sizes; ``None`` for a rank whose memory tier did not commit it), each
receiver says which copies it has room for (knob ``shm_min_free_fraction``) and, for an incremental step,
whether it lacks the replica of its base, each rank sends its files to its partners straight from
the memory tier (a read-only mapping of the staged shard: no second snapshot), plus the shards the
step refers to to a partner that lacks its base, each receiver writes them into an ``.incoming-*``
folder, makes an incremental step whole (:mod:`~nebula_ckpt.tiers.memory.replica_whole`), verifies
every checksum and only then renames the copy into place, prunes older replicas of that rank, and
the ranks exchange the outcome.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional

import torch

from nebula_ckpt import knobs
from nebula_ckpt.errors import CorruptCheckpointError, PersistError
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.storage.local import open_regular_fd
from nebula_ckpt.tiers.memory import replica_store
from nebula_ckpt.tiers.memory.replica_channel import Replication, Works
from nebula_ckpt.tiers.memory.replica_store import committed, step_files
from nebula_ckpt.tiers.memory.replica_whole import holds_base, materialise, step_base

log = logging.getLogger(__name__)


def replicate(rp: Replication, handle: Any) -> Optional[list[str]]:
    """One save round (``handle``: this rank's save, None when it sends nothing this round); the
    errors of this rank's replicas (None: this rank sent nothing)."""
    ch = rp.channel
    mine, fds = _mine(rp, handle)
    incoming: dict[int, str] = {}
    landed: dict[int, dict[str, torch.Tensor]] = {}
    try:
        infos = ch.gather(mine)
        accept = {s: _room_for(rp, infos[s]) for s in rp.sources if infos[s] is not None}
        # an incremental step's partner that lacks its base asks for the shards it refers to
        lacks = {s: _lacks(rp, s, infos[s]) for s, ok in accept.items() if ok is True}
        # by rank: whether it takes this rank's copy, whether it lacks its base (a receiver's
        # reasons to refuse one come back with the outcomes)
        asks = ch.gather_flags(tuple(f for r in range(rp.world) for f in (accept.get(r) is True, lacks.get(r, False))))
        works: Works = []
        sent = 0
        if mine is not None:
            paths = [f"/proc/self/fd/{fd}" for fd in fds]
            refs = (mine["base"] or {}).get("refs", [])
            for p in rp.partners:
                if asks[p][2 * rp.rank]:
                    files = mine["files"] + ([(n, size) for _, n, size in refs] if asks[p][2 * rp.rank + 1] else [])
                    ch.send(paths[:len(files)], files, p, works)
                    sent += sum(n for _, n in files)
        assert rp.store is not None or not any(v is True for v in accept.values())
        for s, ok in accept.items():
            if ok is True and rp.store is not None:
                refs = infos[s]["base"]["refs"] if lacks[s] else []
                rp.counters.peak("peak_incoming_bytes", int(infos[s]["bytes"]) + sum(n for *_, n in refs))
                # a whole step's files are verified where they land (an incremental one is made whole first)
                landed[s] = {}
                incoming[s] = ch.receive(rp.store, infos[s], s, works, refs,
                                         landed[s] if infos[s].get("base") is None else None)
        ch.wait(works)
    finally:
        for fd in fds:
            os.close(fd)
    outcome = {s: commit_replica(rp, s, infos[s], inc, landed.pop(s, None)) for s, inc in incoming.items()}
    outcome.update({s: why for s, why in accept.items() if why is not True})
    outcomes = _outcomes(rp, outcome)
    if mine is None:
        return None
    rp.counters.add("sent_bytes", sent)
    return [f"partner rank {p}: {outcomes[p].get(rp.rank)}" for p in rp.partners
            if outcomes[p].get(rp.rank) is not None]


def _outcomes(rp: Replication, outcome: dict[int, Optional[str]]) -> list[dict[int, Optional[str]]]:
    """Every rank's ``outcome`` (source rank -> why its copy is not kept, None: kept), by rank:
    one collective of a few bytes when every copy was kept, the reasons gathered only when not."""
    failed = rp.channel.gather_flags(tuple(outcome.get(r) is not None for r in range(rp.world)))
    if any(any(f) for f in failed):  # the same answer on every rank: they gather alike
        return rp.channel.gather(outcome)
    return [{} for _ in range(rp.world)]


def _lacks(rp: Replication, src: int, info: dict[str, Any]) -> bool:
    """Whether this rank needs the shards ``src``'s incremental step refers to (it holds no
    replica of the step it was built on)."""
    return info.get("base") is not None and (rp.store is None or not holds_base(rp.store.source_dir(src),
                                                                                   info["base"]))


def _mine(rp: Replication, handle: Any) -> tuple[Optional[dict[str, Any]], list[int]]:
    """What this rank sends for the save of ``handle`` (its committed memory-tier step: its own
    files, and when it refers to earlier steps, what a partner needs to make it whole) and its
    files, opened now (the referenced shards after the step's own): retention may unlink them
    while they are sent, never unmap them."""
    if handle is None or rp.folder is None or not any(t.startswith("memory") for t in handle.tiers_written):
        return None, []
    fds: list[int] = []
    try:
        gens = {s: g for g, s in committed(rp.folder)}
        gen = gens[handle.step]
        d = os.path.join(rp.folder, step_dir(handle.step))
        files = step_files(rp.folder, handle.step)
        base = step_base(rp.folder, handle.step, gens)
        for name, _ in files:  # regular files only: a FIFO planted there is never waited on
            fds.append(open_regular_fd(os.path.join(d, name)))
        for s, name, _ in (base or {}).get("refs", []):
            fds.append(open_regular_fd(os.path.join(rp.folder, step_dir(s), name)))
    except (KeyError, OSError, CorruptCheckpointError) as e:  # retention took it already: a newer step is on its way
        for fd in fds:
            os.close(fd)
        if isinstance(e, CorruptCheckpointError):  # not retention: a damaged or planted file
            log.warning("nebula_ckpt: step %d is not replicated: %s", handle.step, e)
        return None, []
    return {"step": handle.step, "gen": gen, "files": files, "bytes": sum(n for _, n in files), "base": base}, fds


def _room_for(rp: Replication, info: dict[str, Any]) -> Any:
    """True, or why this rank cannot hold that copy."""
    if rp.store is None:
        return "it has no usable memory tier"
    # an incremental step is held whole: its own bytes and at most those of the shards it refers to
    nbytes = int(info["bytes"]) + sum(n for *_, n in (info.get("base") or {}).get("refs", []))
    left = rp.store.free_after(nbytes)
    floor = float(knobs.get("shm_min_free_fraction"))
    if left is not None and left < floor:
        return (f"its memory tier would keep less than {floor:.0%} free with {nbytes} more bytes "
                "(NEBULA_SHM_MIN_FREE)")
    short = rp.budget_room(nbytes) if rp.budget_room is not None else None
    return True if short is None else f"the copy does not fit in its host-memory budget: {short}"


def commit_replica(rp: Replication, src: int, info: dict[str, Any], inc: str,
                   landed: Optional[Mapping[str, torch.Tensor]] = None) -> Optional[str]:
    """Verify the copy of ``src``'s step in ``inc`` and make it visible; None, or why not.
    ``landed``: its files as received (by name), whose checksums are taken there."""
    assert rp.store is not None
    step = int(info["step"])
    if not os.path.isabs(inc):  # it could not be received into the memory tier: why
        return inc
    try:
        if info.get("base") is not None:  # an incremental step: made whole here before it is checked
            materialise(inc, step, rp.store.source_dir(src), info["base"])
        check_copy(inc, step, src, rp.world, int(info["gen"]), landed)
        rp.store.publish(inc, step, rp.store.source_dir(src))
        rp.store.prune(src, rp.keep, rp.keep_also)
        if not rp.dropped_others:  # this job's first copy is here: an earlier job's go
            rp.dropped_others = True
            rp.store.drop_others(set(rp.sources))
    except Exception as e:
        rp.store.discard(inc)
        log.warning("nebula_ckpt: rank %d: the replica of rank %d's step %d is not kept: %s", rp.rank, src, step, e)
        return f"{type(e).__name__}: {e}"
    rp.counters.add("received_bytes", int(info["bytes"]))
    return None


def check_copy(inc: str, step: int, rank: int, world: int, gen: int,
               landed: Optional[Mapping[str, torch.Tensor]] = None) -> None:
    """Raise unless the copy of ``rank``'s ``step`` received into ``inc`` opens with every
    checksum verified (those of ``landed``'s files on those bytes) and carries writer generation ``gen``."""
    replica_store.verify_step(inc, step, rank, world, "full", landed=landed)
    if (gen, step) not in committed(inc):
        raise PersistError(f"the copy of step {step} does not carry writer generation {gen}")
