"""The commit of one multi-rank save on a shared tier: three rounds among the ranks.

Every rank sees a *shared* tier, and the ranks commit one checkpoint of the step on it together
(:mod:`nebula_ckpt.ranks.coordinator` carries the rounds; metadata only):

1. digest, then index: every rank sends a hash of its replicable tensors' index (and of its
   tree; rank 0 also sends the save id it drew for this attempt, which every rank's records
   file carries: :mod:`nebula_ckpt.format.rank_index`); only when the hashes differ do the
   ranks send the index itself. Replicated tensors get one owner each
   (:func:`nebula_ckpt.ranks.shards.assign`); each rank also names the step its incremental
   save would build on, and the ranks build on it only when all name the same
   (:mod:`nebula_ckpt.save.incremental`). The coordinator has already removed an old checkpoint
   of the same step before it took part, so nobody writes into a folder being deleted; the other
   ranks look into the step's folder (for leftovers of their own) only after this round, never
   while the coordinator removes it;
2. durable: every rank writes its share (``shard-g<G>-r<R>``) and, beside it, its tensor records
   (``records-g<G>-r<R>.json``, sealed with its own CRC32C; an incremental share's shard holds
   only its changed tensors, its records file the references to the earlier shards holding the
   rest and the tensors' SHA-256), checks its snapshot, and sends a record of a size independent
   of its number of tensors: its shard (and the earlier ones it refers to), its records file's
   name, size and CRC32C, its tree only when it differs from rank 0's, its DTensor table only
   when no lower rank sent the same one (or its error; :mod:`nebula_ckpt.ranks.split`);
3. verdict: the coordinator writes ``ranks.json``, manifest and ``COMMIT``
   (:func:`nebula_ckpt.format.commit.commit_manifest`) only if every rank's shard is durable and
   verified, and tells every rank whether it did.
   Otherwise each rank removes its shard and the previous checkpoint stays the newest. A rank
   that hears no verdict (the coordinator died or timed out after it sent its record) cannot
   know whether the step committed: it looks for the ``COMMIT`` once (there: the save
   succeeded) and otherwise keeps its shard and reports :class:`CommitUncertain`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from nebula_ckpt.errors import PersistError
from nebula_ckpt.format.commit import CommitProgress, commit_manifest, is_committed
from nebula_ckpt.format.manifest import encode_manifest, tagged
from nebula_ckpt.format.multi_rank import digest
from nebula_ckpt.format.names import RANKS_FILE, step_dir
from nebula_ckpt.native import get_ops
from nebula_ckpt.ranks import shards as ranks
from nebula_ckpt.ranks.coordinator import PHASE_DIGEST, PHASE_DURABLE, PHASE_INDEX, PHASE_VERDICT, SKIP, Coordinator
from nebula_ckpt.ranks.distributed import GroupDestroyed
from nebula_ckpt.ranks.fencing import TierFence
from nebula_ckpt.ranks.split import first_of_class, new_save_id, signature, split_manifest, split_payload
from nebula_ckpt.save.incremental import Incremental
from nebula_ckpt.save.tier_image import Staged, TierStep, tier_image
from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger(__name__)


class CommitUncertain(PersistError):
    """A save whose ``COMMIT`` may exist although this rank could not confirm it (the
    coordinator died or timed out after every shard was durable, or the marker's own write
    reported an error). Nothing of the step is deleted: if it committed, it is whole; if not,
    its files are uncommitted leftovers that a later sweep removes."""


class PeerSkipped(PersistError):
    """Another rank did not write this save on a shared tier (its cadence skipped it, or a newer
    save replaced it there): the save is dropped on that tier, not failed."""


class SharedCommit:
    """The three rounds of the module docstring for one tier.

    Args:
        runtime: the tier's runtime (its storage, written directly, and its name).
        fence: the writer generation, checked on this tier's storage.
        coordinator: the ranks' agreement.
        incremental: this rank's base on the tier (:mod:`nebula_ckpt.save.incremental`), or None.
    """

    def __init__(self, runtime: TierRuntime, fence: TierFence, coordinator: Coordinator,
                 incremental: Optional[Incremental] = None) -> None:
        self.incremental = incremental
        self.storage = runtime.storage
        self.fence = fence
        self.coordinator = coordinator
        self.name = runtime.name

    def run(self, save: TierStep, ready: Callable[[], object], d: str, shard: str,
            on_shard: Optional[Callable[[str], None]], progress: CommitProgress) -> dict[str, Any]:
        """Commit ``save`` with every rank (this rank's shard: file ``shard`` of folder ``d``;
        ``meta``, ``hashes``, ``tag`` and ``index`` its metadata); return this rank's share of the
        committed step (what its next save builds on). ``ready``: a non-coordinator's clearing of
        the step's folder, after round 1.

        Raises:
            PeerSkipped: another rank did not write this save here (dropped, not failed).
            CommitUncertain: the step may have committed; nothing of it may be deleted.
            PersistError and others: it did not commit.
        """
        co = self.coordinator
        owners, peers, tree_digest = self._agree(save)
        bases = {p.get("base") for p in peers}
        base = bases.pop() if len(bases) == 1 else None  # every rank builds on the same step, or none does
        failure: Optional[BaseException] = None
        share: dict[str, Any] = {}
        try:
            if not co.is_coordinator:  # the coordinator's replacement of the step is done by now
                ready()
            mine, share = self._write_share(save, d, shard, owners, on_shard, peers, tree_digest, base)
        except BaseException as e:
            failure, mine = e, {"error": f"{type(e).__name__}: {e}"}
        if co.is_coordinator:
            verdict = self._lead(save, mine, owners, failure, progress, peers[0]["save_id"])
        else:
            got = self._follow(save, mine, failure, progress)
            if got is None:
                return share  # no verdict came, but the COMMIT is there
            verdict = got
        if failure is not None:
            raise failure
        if not verdict.get("ok"):
            why = verdict.get("why", f"rank 0 did not take part in committing step {save.step}")
            raise (CommitUncertain if verdict.get("uncertain") else PeerSkipped if verdict.get("skipped")
                   else PersistError)(why)
        return share

    def _agree(self, save: TierStep) -> tuple[dict[str, int], list[Any], str]:
        """Rounds 1 (digest, index): the owner of every replicated key, the peers' digests, and
        the digest of this rank's tree."""
        co, name, idx, meta = self.coordinator, self.name, save.index, self._meta(save)
        rep, sharded = ranks.summary(meta["tensors"])
        mine_digest = digest(rep)
        tree_digest = digest(meta["tree"])
        base = self.incremental.declare() if self.incremental is not None else None
        dt_digest = digest(signature(meta["tensors"]))  # what its DTensor records must agree on
        save_id = new_save_id() if co.is_coordinator else None  # rank 0's is this attempt's
        peers = co.round(name, idx, PHASE_DIGEST, {"step": save.step, "digest": mine_digest, "tree": tree_digest,
                                                  "sharded": sharded, "dt": dt_digest, "base": base,
                                                  "save_id": save_id})
        problem = ranks.peer_problem(peers, save.step, name)
        if problem is not None:
            co.abandon(name, idx)
            raise (PeerSkipped if problem[0] else PersistError)(problem[1])
        if all(p["digest"] == mine_digest for p in peers):  # the usual DDP case: a hash was enough
            co.round(name, idx, PHASE_INDEX, SKIP)  # every rank saw the same digests: no collective
            summaries = [rep] * len(peers)
        else:  # every rank sees the same digests, so every rank takes this branch
            got = co.round(name, idx, PHASE_INDEX, {"keys": rep})
            if any(g is None for g in got):
                raise PersistError(f"step {save.step}: a rank left the index round on tier {name}")
            summaries = [g["keys"] for g in got]
        return ranks.assign(summaries, [p["sharded"] for p in peers]), peers, tree_digest

    def _write_share(self, save: TierStep, d: str, shard: str, owners: dict[str, int],
                     on_shard: Optional[Callable[[str], None]], peers: list[Any], tree_digest: str,
                     base: Optional[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's share and its records file (durable), the snapshot confirmed: its record for
        round 2, and its share as its records file holds it (``shard``, ``refs``, ``tensors``,
        ``sha256``: what its next save builds on). With a ``base`` step every rank agreed on, the
        rank writes only its tensors that changed since (``refs``: the earlier shards holding the
        rest; its records point at them from 1 on)."""
        co, meta = self.coordinator, self._meta(save)
        tensors = meta["tensors"]
        keep = [k for k in tensors if owners.get(k, co.rank) == co.rank]
        hashes = save.hashes or {}
        claimed = self.incremental.claim() if base is not None and self.incremental is not None else None
        claimed = claimed if claimed is not None and claimed.step == base else None  # the step all agreed on
        staged = Staged(save.step, self.fence.generation, tensors, hashes, save.source.view())
        image = tier_image(staged, claimed, self.storage, self.name, keep=keep)
        log.debug("nebula_ckpt: phase=shard tier=%s step=%d (%d of %d tensors)", self.name, save.step,
                  len(image.write), len(tensors))
        info = self.storage.write_parts(f"{d}/{shard}", list(image.parts or ()))
        own = {"file": shard, "bytes": image.nbytes, "storage": info}
        refs = [r.to_json() for r in image.refs]
        sha = {k: hashes[k] for k in keep if k in hashes}
        inc = self.incremental
        since = inc.since_full(not refs) if inc is not None and inc.enabled else None  # rank 0's manifest records it
        name, data, payload = split_payload(
            step=save.step, generation=self.fence.generation, rank=co.rank, world=co.world_size,
            save_id=peers[0]["save_id"], shard=own, tree_digest=tree_digest,
            index=image.records, aliases=meta["aliases"], meta=meta,
            send_tree=co.is_coordinator or tree_digest != peers[0]["tree"],
            send_table=first_of_class(co.rank, [p["dt"] for p in peers]), crc=get_ops().crc32c_bytes,
            refs=refs, hashes=sha, since_full=since)
        self.storage.write_small(f"{d}/{name}", data)
        if on_shard is not None and image.full:
            on_shard(f"{d}/{shard}")
        save.before_commit()
        return payload, {"shard": own, "refs": refs, "tensors": image.records, "sha256": sha}

    @staticmethod
    def _meta(save: TierStep) -> dict[str, Any]:
        """``save``'s metadata: ``tensors`` (the staged snapshot's index), ``aliases``, ``tree``, ``stats``."""
        assert save.meta is not None, "a shared tier's step carries its metadata"
        return save.meta

    def _lead(self, save: TierStep, mine: dict[str, Any], owners: dict[str, int],
              failure: Optional[BaseException], progress: CommitProgress, save_id: str) -> dict[str, Any]:
        """The coordinator: rounds 2 and 3 (its commit, then the verdict to every rank); the verdict."""
        co, name, idx = self.coordinator, self.name, save.index
        verdict = self._coordinate(save, co.round(name, idx, PHASE_DURABLE, mine), owners, failure, progress,
                                   save_id)
        try:
            co.round(name, idx, PHASE_VERDICT, verdict)
        except PersistError as e:
            if not verdict.get("ok"):
                raise
            log.warning("nebula_ckpt: tier %s: step %d is committed, but the other ranks could not be told: %s",
                        name, save.step, e)
        return verdict

    def _follow(self, save: TierStep, mine: dict[str, Any], failure: Optional[BaseException],
                progress: CommitProgress) -> Optional[dict[str, Any]]:
        """Another rank: rounds 2 and 3; the verdict (None: none came, but the COMMIT is there)."""
        co, name, idx = self.coordinator, self.name, save.index
        # Once this rank's record may have reached the coordinator, the step may commit at
        # any moment: only a verdict (or the COMMIT itself) tells this rank whether it did.
        progress.may_commit = failure is None
        try:
            co.round(name, idx, PHASE_DURABLE, mine)
            verdict = co.round(name, idx, PHASE_VERDICT, {})[0] or {}
        except PersistError as e:
            if failure is not None:
                raise failure from e
            if is_committed(self.storage, save.step, self.fence.generation):
                log.warning("nebula_ckpt: tier %s: no verdict from rank 0 on step %d (%s), but its COMMIT is "
                            "there: the step is committed", name, save.step, e)
                return None
            why = str(e) if isinstance(e, GroupDestroyed) else \
                f"rank 0 died, left or timed out after this rank's shard was durable ({e})"
            raise CommitUncertain(f"step {save.step} may have committed on tier {name}: {why}, and no COMMIT was "
                                  "there yet; this rank keeps its files of it (a restart removes them if it never "
                                  "committed)") from e
        progress.may_commit = bool(verdict.get("ok") or verdict.get("uncertain"))
        return verdict

    def _coordinate(self, save: TierStep, parts: list[Any], owners: dict[str, int],
                    failure: Optional[BaseException], progress: CommitProgress, save_id: str) -> dict[str, Any]:
        """The coordinator's commit: ranks.json, manifest + COMMIT if every rank's share is in.

        The verdict: ``ok``, or not with ``why`` (and ``skipped`` when a rank only did not write
        it), or ``uncertain`` when the marker's write failed (it may exist: nobody deletes).
        """
        step, name = save.step, self.name
        if failure is not None:
            return {"ok": False, "why": f"step {step} failed on rank 0 (tier {name}): {failure}"}
        problem = ranks.peer_problem(parts, step, name)
        if problem is not None:
            return {"ok": False, "skipped": problem[0], "why": problem[1]}
        try:
            man, index = split_manifest(step=step, generation=self.fence.generation, save_id=save_id, parts=parts,
                                        owners=owners, crc=get_ops().crc32c_bytes)
            self.storage.write_small(f"{step_dir(step)}/{RANKS_FILE}", index)
            commit_manifest(self.storage, self.fence, step, encode_manifest(tagged(man, save.tag)), progress, name,
                            save.index)
        except BaseException as e:
            log.error("nebula_ckpt: tier %s: committing step %d failed: %s", name, step, e)
            if progress.may_commit:
                return {"ok": False, "uncertain": True,
                        "why": f"step {step} may have committed on tier {name}: rank 0's write of its COMMIT "
                               f"reported an error ({type(e).__name__}: {e}); every rank keeps its files of it"}
            return {"ok": False, "why": f"rank 0 could not commit step {step} on tier {name}: {e}"}
        return {"ok": True}
