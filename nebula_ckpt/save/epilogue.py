"""Nothing left only in RAM: put the memory tier's newest step on the persistent root.

A job that ends for good (its epilogue, or a node agent before the node is given back) may hold
its newest checkpoint only in the memory tier (``/dev/shm``), which does not survive a reboot:
the persistent tiers are written less often. :func:`persist_memory` copies the newest committed
memory-tier step of a root to the root's own tier (the same commit protocol as a save: shard,
manifest, commit marker last, under a new writer generation), verifying its checksums first.
``nebula-ckpt persist-memory ROOT`` runs it.

One process (a root written by one rank): done as described. A multi-rank root: each rank's
memory tier holds only its own part of a step, and the root's checkpoint of a step is one
manifest for every rank, written by the job's ranks together; an epilogue on one node cannot
build it, so it refuses (exit status 2) and says which steps are only in RAM, on whichever node
it runs: every memory-tier folder of the root's run on this host is looked at (each rank's own
steps, and the replicas it holds of other ranks' steps), not only rank 0's. Restart the job
once (same world size: it restores from the memory tiers and replicas) and let it save to the
persistent tier, or give its disk or blob tier ``every=1``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from nebula_ckpt.errors import NebulaError, ValidationError
from nebula_ckpt.format.commit import committed_steps
from nebula_ckpt.ranks.fencing import Fence, read_run_id
from nebula_ckpt.restore.open import open_checkpoint, read_manifest
from nebula_ckpt.save.writer import TierWriter
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.storage.urls import canonical_root
from nebula_ckpt.tiers.factory import runtime_for
from nebula_ckpt.tiers.memory.replica_store import ReplicaStore, committed
from nebula_ckpt.tiers.memory.shm import Owner, scan
from nebula_ckpt.tiers.memory.tier import MemoryTier
from nebula_ckpt.tiers.roots import tier_for_root

log = logging.getLogger(__name__)


def persist_memory(root: str, storage_options: Optional[dict[str, Any]] = None, *,
                   keep_last: int = 3) -> dict[str, Any]:
    """Copy the newest memory-tier step of ``root`` (this host's, rank 0) to the root's tier.

    Returns:
        ``{"step": N or None, "copied": bool, "why": str}``: what was done and why (nothing to
        do: no memory tier of this run, or its newest step is on the root already).

    Raises:
        ValidationError: ``root``'s memory tier holds a part of a multi-rank checkpoint (see the
            module docstring), or it is written by a live process now.
        CorruptCheckpointError: the memory tier's newest step fails its checksums (nothing written).
    """
    root_tier = tier_for_root(root, storage_options)
    root_storage = root_tier.make_storage()
    mem = MemoryTier()
    mem.bind(root, 0)
    rt = runtime_for(mem, mem.make_storage())
    try:
        rid = read_run_id(root_storage)
        if rid is None:
            return {"step": None, "copied": False, "why": f"{canonical_root(root)} was never written"}
        _refuse_multi_rank_parts(root, rid, set(committed_steps(root_storage)))
        if not rt.open(Owner(canonical_root(root), rid)):
            return {"step": None, "copied": False, "why": "no memory tier of this root's run on this host"}
        steps = committed_steps(rt.storage)
        if not steps:
            return {"step": None, "copied": False, "why": "the memory tier holds no committed step"}
        newest = max(steps)
        if newest in committed_steps(root_storage):
            return {"step": newest, "copied": False, "why": f"step {newest} is on {root_tier.name} already"}
        _check_copyable(rt, newest, steps)
        _copy(rt, root_tier, root_storage, newest, keep_last)
        log.info("nebula_ckpt: persist-memory: step %d copied from %s to %s", newest, rt.name, root_tier.name)
        return {"step": newest, "copied": True, "why": f"step {newest} was only in memory"}
    finally:
        rt.release()
        root_storage.close()


def _refuse_multi_rank_parts(root: str, run_id: str, on_root: set[int]) -> None:
    """Raise when a memory-tier folder of ``root``'s run on this host holds a part of a
    multi-rank step that the root lacks (a rank's own step, or a replica of another rank's)."""
    parts, world = [], 0
    for found in scan():
        owner = found.owner
        if found.problem or owner is None or owner.root != canonical_root(root) or owner.run_id != run_id:
            continue
        store = ReplicaStore(found.folder)
        folders = [("", found.folder)] + [("a replica of ", store.source_dir(r)) for r in sorted(store.held())]
        for what, folder in folders:
            for ranks, size, steps in _parts_of(folder, on_root):
                world = max(world, size)
                parts.append(f"{found.folder} ({what}rank {ranks}'s part of step(s) {steps})")
    if parts:
        raise ValidationError(
            f"this host's memory tier holds parts of a {world}-rank job's checkpoints that are only in memory: "
            f"{'; '.join(parts[:8])}{' ...' if len(parts) > 8 else ''}. A multi-rank checkpoint on the root is "
            "written by every rank together, so persist-memory cannot build it from one node. Restart the job "
            "once with the same world size (it restores from the memory tiers and replicas) and let it save to "
            "the persistent tier, or give that tier every=1")


def _parts_of(folder: str, on_root: set[int]) -> list[tuple[list[int], int, list[int]]]:
    """``(ranks, world size, steps)`` of the multi-rank steps committed in ``folder`` that the root lacks."""
    st = LocalStorage(folder, private=True, fsync=False)
    found: dict[tuple[tuple[int, ...], int], list[int]] = {}
    try:
        for _, s in committed(folder):
            if s in on_root:
                continue
            try:
                man = read_manifest(st, s)
            except Exception as e:  # a damaged copy is no part of anything
                log.debug("nebula_ckpt: persist-memory: %s step %d: %s", folder, s, e)
                continue
            if man.multi_rank:
                found.setdefault((tuple(man.ranks), man.world_size), []).append(s)
    finally:
        st.close()
    return [(list(r), w, steps) for (r, w), steps in found.items()]


def _check_copyable(rt: Any, step: int, steps: list[int]) -> None:
    """Refuse a multi-rank part and a tier a live process writes; verify the step's checksums."""
    man = read_manifest(rt.storage, step)
    if man.multi_rank:
        raise ValidationError(
            f"{rt.name} holds rank {list(man.ranks)[:8]}'s part of step(s) {steps} of a {man.world_size}-rank job: "
            "a multi-rank checkpoint on the root is written by every rank together, so persist-memory cannot "
            "build it from one node. Restart the job once with the same world size (it restores from the memory "
            "tiers and replicas) and let it save to the persistent tier, or give that tier every=1")
    if not rt.lock_for_adoption():
        raise ValidationError(f"{rt.name} is written by a live process: run persist-memory after the job ended")
    open_checkpoint(rt.storage, step, "full", f"{rt.name} step {step}")


def _copy(rt: Any, root_tier: Any, root_storage: Any, step: int, keep_last: int) -> None:
    fence = Fence(root_storage)
    writer = TierWriter(runtime_for(root_tier, root_storage), fence.for_tier(root_storage), keep_last)
    try:
        writer.copy_from(rt.storage, step)
    except Exception as e:
        raise NebulaError(f"persist-memory: copying step {step} to {root_tier.name} failed: {e}") from e
    finally:
        writer.close()
