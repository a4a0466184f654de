"""Drain: a multi-rank step that lives only in RAM becomes one committed checkpoint on the shared tier.

A job that saves to the memory tiers more often than to the shared tier (disk, blob) holds its
newest step only in RAM: each rank's own copy in its node's memory tier and, with
``MemoryTier(replicas=k)``, the copies partners hold. When the job ends for good, or its nodes are
lost and the scheduler moves it to fresh nodes without a memory tier, that step is lost unless it
reaches the shared tier. ``nebula-ckpt persist-memory ROOT`` (every surviving node's epilogue, or
the scheduler's cleanup) drains it (:func:`drain`), with no process group and no other channel
between the nodes than the shared tier itself:

1. **What this node holds.** Every memory-tier folder of the root's run on this host (each rank's
   own steps, and the replicas it holds of other ranks), locked against a live writer for the
   whole drain, grouped by *write*: ``(generation, step, save)`` of the commit markers
   (:attr:`~nebula_ckpt.format.commit.Commit.write`), never by step number alone.
2. **What is worth writing.** A write is a *target* only when it is newer, in the order a restore
   prefers (:func:`~nebula_ckpt.restore.select.list_candidates`), than every step committed on
   the shared tier: so a drain never hides a newer step, and never writes over the root of a
   newer job (whose generation outranks it) or fences it (it takes no generation: the step is
   written under the generation that made it, :meth:`~nebula_ckpt.ranks.fencing.Fence.past`).
3. **Each rank's part, once, alike everywhere.** For each target, newest first, the node writes
   the part of every rank it holds a healthy copy of (every checksum verified first; its own
   ranks before the replicas, and no part the shared tier has already): the rank's whole state
   as ``shard-g<G>-r<R>.safetensors`` (a canonical image: tensors by size then key, so every
   node builds the same bytes from an own copy or a replica), then its part record, then its
   records file last (:mod:`nebula_ckpt.format.drain`). A shard reaches its name whole (a
   temporary name renamed into place on a file system; an object upload on a blob store).
4. **One commit, when every rank's part is there.** The node then reads every rank's part from
   the shared tier; when all are there (whoever wrote them), it builds ``ranks.json`` and the
   manifest from them (the same bytes on every node), checks again that nothing newer was
   committed, and creates ``COMMIT`` (create-only, last, naming the save number). Of drains
   that race, one creates it; the others find it and are done. The node whose parts land last
   sees every part, so drains of complementary nodes, in any order or at once, commit it. A
   node that lacks parts another node holds leaves its own on the shared tier and says which
   ranks it waits for; the other node's drain completes the step.

Nothing is visible before ``COMMIT``: a drain killed at any moment leaves an uncommitted folder
(parts, temporary files) that the next drain completes, or a newer generation's sweep removes.
Running it again is a no-op once the step is committed. Every rank's whole state is written (a
save's deduplication of replicated tensors needs the ranks together; a drained step of a DDP
job is world-size times the size of a saved one).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from nebula_ckpt.errors import CorruptCheckpointError, FencedError, NebulaError, PersistError
from nebula_ckpt.format.commit import (
    CommitProgress,
    Write,
    commit_manifest,
    committed_writes,
    read_commit,
    shard_path,
)
from nebula_ckpt.format.drain import check_records, drain_save_id, encode_part, parse_part
from nebula_ckpt.format.header import safetensors_header
from nebula_ckpt.format.manifest import Manifest, encode_manifest
from nebula_ckpt.format.names import (
    RANKS_FILE,
    drain_part_name,
    records_name,
    shard_name,
    step_dir,
)
from nebula_ckpt.native import get_ops
from nebula_ckpt.ranks.fencing import Fence
from nebula_ckpt.ranks.split import split_manifest, split_payload
from nebula_ckpt.restore.open import open_checkpoint, read_manifest
from nebula_ckpt.save.budget import give_up_memory_steps, note_held, restorable
from nebula_ckpt.save.resave import copy_as_written, folder_problem, write_whole
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.local import LocalStorage

if TYPE_CHECKING:
    from nebula_ckpt.save.writer import TierWriter

log = logging.getLogger(__name__)

#: seconds :func:`make_room` waits for the tier writers to go idle once no save is in flight
IDLE_WAIT_S = 5.0
#: the memory tier's newest write that :func:`make_room` could not put on (or give up for) the
#: persistent tiers, by memory-tier writer, with why: not tried again until a newer write is there
_NOT_PUT: "weakref.WeakKeyDictionary[Any, tuple[Write, str]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Copy:
    """One rank's part of one write, in this host's RAM: the memory-tier folder holding it (a
    rank's own tier, or the ``replicas/r<R>`` folder of a holder)."""

    write: Write
    rank: int
    world: int
    folder: str
    own: bool


def not_newer(write: Write, have: set[Write], tier: str, skip: frozenset[Write] = frozenset()) -> Optional[str]:
    """Why ``write`` is not worth writing to a tier holding ``have`` (None: it is newer than all of
    them but ``skip``, the writes a restore passes over: marked suspect)."""
    have = have - skip
    top = max(have, default=None)
    if top is None or write > top:
        return None
    g, s, _ = write
    if write in have:
        return f"step {s} (writer generation {g}) is on {tier} already"
    if top[0] > g:
        return (f"{tier} holds step {top[1]} of writer generation {top[0]}, newer than generation {g} that made "
                f"step {s}: a newer job wrote it, and its steps supersede the memory tier's (nothing written)")
    return f"{tier} holds step {top[1]} of the same writer generation {g}, newer than step {s} (nothing written)"


class Drain:
    """The drain of one multi-rank write from this host (see the module docstring).

    Args:
        storage: the shared tier (the root).
        tier: its name, in messages.
        run_id: the root's run id (the save id of a drained write derives from it).
        write: ``(generation, step, save)``.
        world: the job's world size.
        on_part: told ``(rank, bytes)`` after each part this host writes (a progress bar).
        skip: committed writes of the shared tier newer than ``write`` that a restore passes over
            (marked suspect): they do not keep it off the tier, as the step a restart restores.
    """

    def __init__(self, storage: Storage, tier: str, run_id: str, write: Write, world: int,
                 on_part: Optional[Callable[[int, int], None]] = None, skip: frozenset[Write] = frozenset()) -> None:
        self.storage, self.tier, self.write, self.world = storage, tier, write, world
        self.skip = skip
        self.save_id = drain_save_id(run_id, *write)
        self.dir = step_dir(write[1])
        self._on_part = on_part
        #: the ranks whose part this drain wrote
        self.written: list[int] = []
        #: rank -> why this host's copy of its part was not used (damaged, unreadable)
        self.unusable: dict[int, str] = {}

    def run(self, copies: list[Copy]) -> tuple[bool, list[int]]:
        """Write this host's parts, then commit when every rank's part is on the shared tier:
        ``(committed by some drain, ranks whose part is missing)``.

        Raises:
            FencedError: a newer generation committed a step meanwhile (nothing committed).
            NebulaError: the step's folder cannot take it (:func:`folder_problem`).
        """
        why = folder_problem(self.storage, self.write)
        if why is not None:
            raise NebulaError(why)
        done, missing = self._run(copies)
        if done:  # by this drain or another: the part records are of no use any more (best effort)
            for r in range(self.world):
                try:
                    self.storage.remove(f"{self.dir}/{drain_part_name(self.write[0], r)}")
                except OSError as e:
                    log.debug("nebula_ckpt: persist-memory: %s", e)
        return done, missing

    def _run(self, copies: list[Copy]) -> tuple[bool, list[int]]:
        """:meth:`run` but for its tidying up."""
        if self._committed():
            return True, []
        for c in sorted(copies, key=lambda c: (not c.own, c.rank)):  # own ranks first: a replica's
            if c.rank in self.written or self.part(c.rank) is not None:  # owner node may drain it too
                continue
            if self._committed():
                return True, []
            try:
                self._put(c)
                self.unusable.pop(c.rank, None)
            except (CorruptCheckpointError, OSError, ValueError, KeyError) as e:  # the next copy of it, if any
                self.unusable[c.rank] = f"{c.folder}: {type(e).__name__}: {e}"
                log.warning("nebula_ckpt: persist-memory: rank %d's copy of step %d in %s is not used: %s",
                            c.rank, self.write[1], c.folder, e)
        parts = [self.part(r) for r in range(self.world)]
        missing = [r for r, p in enumerate(parts) if p is None]
        if missing:
            return self._committed(), missing
        self._commit([p for p in parts if p is not None])
        return True, []

    def part(self, rank: int) -> Optional[dict[str, Any]]:
        """The payload of ``rank``'s part on the shared tier, when it is there whole; else None."""
        g, s, w = self.write
        crc = get_ops().crc32c_bytes
        where = f"{self.tier} step {s} rank {rank}"
        try:
            p = parse_part(self.storage.read_small(f"{self.dir}/{drain_part_name(g, rank)}"), crc, where, step=s,
                           generation=g, save=w, rank=rank, world=self.world, save_id=self.save_id)
            data = self.storage.read_small(f"{self.dir}/{records_name(g, rank)}")
            if len(data) != p["records"]["bytes"] or crc(data) != p["records"]["crc32c"]:
                return None
            check_records(data, crc, where, step=s, generation=g, rank=rank, world=self.world, save_id=self.save_id)
            shard = p["shard"]
            stored = (shard.get("storage") or {}).get("stored_bytes", shard["bytes"])
            if shard.get("file") != shard_name(g, rank) or self.storage.size(f"{self.dir}/{shard['file']}") != stored:
                return None
            return p
        except (FileNotFoundError, CorruptCheckpointError) as e:
            log.debug("nebula_ckpt: persist-memory: %s: no whole part yet (%s)", where, e)
            return None

    def _committed(self) -> bool:
        """Whether this write's ``COMMIT`` is on the shared tier (another drain made it)."""
        try:
            return read_commit(self.storage, self.write[1], self.tier).write == self.write
        except Exception:  # no marker (yet): not committed
            return False

    def _put(self, c: Copy) -> None:
        """Write rank ``c.rank``'s part from the copy ``c`` (every checksum verified first)."""
        g, s, w = self.write
        crc = get_ops().crc32c_bytes
        src = LocalStorage(c.folder, private=True, fsync=False)
        try:
            open_checkpoint(src, s, "full", f"{c.folder} step {s}", c.rank, self.world)
            man = read_manifest(src, s, f"{c.folder} step {s}")
            data = [src.read_buffer(shard_path(man, i), dict(sh.storage or {})) for i, sh in enumerate(man.shards)]
            image, records, nbytes = canonical_share(man, c.rank, data)
            rel = f"{self.dir}/{shard_name(g, c.rank)}"
            info = write_whole(self.storage, rel, image)
            prefix = man.prefix(c.rank)
            meta = {"tensors": records, "tree": man.rank_tree_of(c.rank),
                    "stats": {"tensor_bytes": sum(r["offsets"][1] - r["offsets"][0] for r in records.values()),
                              "copy_seconds": float(man.stats.get("copy_seconds", 0.0))}}
            name, rbytes, payload = split_payload(
                step=s, generation=g, rank=c.rank, world=self.world, save_id=self.save_id,
                shard={"file": shard_name(g, c.rank), "bytes": nbytes, "storage": info}, index=records,
                aliases={a[len(prefix):]: b[len(prefix):] for a, b in man.aliases.items()}, meta=meta,
                send_tree=True, send_table=True, crc=crc)
            payload["time"] = man.time
            self.storage.write_small(f"{self.dir}/{drain_part_name(g, c.rank)}", encode_part(
                step=s, generation=g, save=w, rank=c.rank, world=self.world, save_id=self.save_id,
                payload=payload, crc=crc))
            self.storage.write_small(f"{self.dir}/{name}", rbytes)  # last: the part is whole
        finally:
            src.close()
        self.written.append(c.rank)
        log.info("nebula_ckpt: persist-memory: rank %d's part of step %d (%d bytes, from %s) is on %s", c.rank, s,
                 nbytes, "its memory tier" if c.own else "a replica", self.tier)
        if self._on_part is not None:
            self._on_part(c.rank, nbytes)

    def _commit(self, parts: list[dict[str, Any]]) -> None:
        """``ranks.json``, the manifest and ``COMMIT`` from every rank's part (the same bytes on
        every node); nothing when a newer write was committed meanwhile.

        Raises:
            FencedError: a newer generation committed a step since the drain began.
        """
        g, s, w = self.write
        crc = get_ops().crc32c_bytes
        man, index = split_manifest(step=s, generation=g, save_id=self.save_id, parts=parts, owners={}, crc=crc)
        man["time"] = max(float(p["time"]) for p in parts)  # not the time of building it: alike on every node
        mbytes = encode_manifest(man)
        Manifest.parse(mbytes, f"{self.tier} step {s} (drained)", s)  # the parts' trees and tables, checked
        why = not_newer(self.write, set(committed_writes(self.storage)), self.tier, self.skip) or \
            folder_problem(self.storage, self.write)
        if why is not None:
            if self._committed():
                return
            raise FencedError(f"step {s} is not committed: {why}")
        self.storage.write_small(f"{self.dir}/{RANKS_FILE}", index)
        try:
            commit_manifest(self.storage, Fence.past(self.storage, g).for_tier(self.storage), s, mbytes,
                            CommitProgress(), self.tier, w)
        except FileExistsError:
            if not self._committed():  # another write's marker appeared: raised as it is
                raise
        log.info("nebula_ckpt: persist-memory: step %d (writer generation %d, %d ranks) committed on %s", s, g,
                 self.world, self.tier)


def canonical_share(man: Manifest, rank: int, data: list[Any]) -> tuple[list[memoryview], dict[str, dict[str, Any]],
                                                                            int]:
    """Rank ``rank``'s whole state in ``man`` (a memory-tier step; ``data[i]``: the bytes of its
    shard ``i``, which may lie in earlier steps) as one shard image: ``(parts, tensor records
    without the rank prefix, bytes)``. Canonical: tensors by element size, then key, so every
    copy of one write (a rank's own, incremental or not, and a partner's whole replica) gives
    the same bytes."""
    prefix = man.prefix(rank)
    if any(not k.startswith(prefix) for k in man.tensors):
        raise CorruptCheckpointError(f"step {man.step}: a tensor key lacks rank {rank}'s prefix {prefix!r}")
    keys = sorted(man.tensors, key=lambda k: (-man.tensors[k].torch_dtype.itemsize, k))
    head, spans = safetensors_header([(k[len(prefix):], man.tensors[k].torch_dtype, man.tensors[k].shape,
                                       man.tensors[k].nbytes) for k in keys])
    parts: list[memoryview] = [memoryview(head)]
    records: dict[str, dict[str, Any]] = {}
    for k, (p, e) in zip(keys, spans, strict=True):
        rec = man.tensors[k]
        if rec.nbytes:
            parts.append(memoryview(data[rec.shard]).cast("B")[rec.start:rec.end])
        out = rec.to_json()
        out.pop("shard", None)
        records[k[len(prefix):]] = dict(out, offsets=[len(head) + p, len(head) + e])
    return parts, records, len(head) + (spans[-1][1] if spans else 0)


def own_part_drainer(storage: Storage, tier: str, run_id: str) -> Callable[[Write, int, int, str], None]:
    """What a rank of a restarted job runs once a restore pulled lost ranks' copies from their
    partners (a node was lost) and its memory tier kept its copy: ``drain(write, rank, world,
    folder)`` puts that rank's part of ``write`` (its own copy, in ``folder``) on the shared tier
    ``storage``, and the step is committed by whichever rank's part lands last (:class:`Drain`):
    the step no longer lives only in RAM. It does nothing when the shared tier holds that write or
    a newer one already (the job's own saves since, say)."""
    def drain(write: Write, rank: int, world: int, folder: str) -> None:
        why = not_newer(write, set(committed_writes(storage)), tier)
        if why is not None:
            log.info("nebula_ckpt: rank %d: step %d not drained: %s", rank, write[1], why)
            return
        done, missing = Drain(storage, tier, run_id, write, world).run([Copy(write, rank, world, folder, True)])
        log.info("nebula_ckpt: rank %d: its part of step %d (only in RAM since a node was lost) is on %s%s", rank,
                 write[1], tier, "; the step is committed" if done else f"; waiting for rank(s) {missing[:8]}")
    return drain


def flush_newest(writers: "list[TierWriter]", monitor: Any = None, who: str = "close()") -> Optional[str]:
    """One process's drain at ``close()``: put the newest committed step on every persistent tier of
    ``writers`` that lacks it (cadence, drops). A disk or remote tier with ``every=N`` (or one that
    dropped saves while busy) would otherwise end the job older than the memory tier, which does
    not survive a reboot. A copy is the same write (an earlier writer's keeps its generation, and
    with it its marks, and replaces an older write of its step there: :func:`copy_as_written`). A
    step this process marked suspect
    (or failed to mark so far: its mark is tried again first; ``monitor``: the Checkpointer's
    :class:`~nebula_ckpt.health.monitor.HealthMonitor`, None when read only; a step a person marked
    healthy since is copied as any other) is never copied: the newest
    step not marked suspect is put there instead, on a tier holding the newer suspect ones too (the
    memory tier's retention keeps that step while it is its only copy). ``who``: what asks, in log lines (a save short
    of the host-memory budget asks too: :func:`make_room`). Why a step was not put there (marked
    suspect, a failed copy), or None."""
    # writes, not step numbers: a tier holding the first write of a step saved twice lacks the second
    have = {w.name: set(committed_writes(w.storage)) for w in writers}
    if monitor is not None:
        monitor.settle()  # a mark that failed before lands now, before any copy of its step
    newest, why = None, None
    for write in sorted(set().union(*have.values()), reverse=True):
        if monitor is None or not monitor.suspect(write[0], write[1], None if write[2] < 0 else write[2]):
            newest = write
            break
        if any(w.tier.persistent and write not in have[w.name] for w in writers):
            why = why or f"step {write[1]} is marked suspect: it is never copied to a persistent tier"
            log.warning("nebula_ckpt: %s puts no copy of step %d on the persistent tiers: this process marked "
                        "it suspect", who, write[1])
    if newest is None:
        return why
    src, damaged = _source(writers, have, newest, who)
    for w in writers:
        # a tier holding a newer write (one this process marked suspect) gets it too: the step a
        # restart restores instead, which the memory tier may hold alone (its retention kept it)
        if not w.tier.persistent or (newest in have[w.name] and w.name not in damaged):
            continue
        try:  # a writer fenced or handed over to a newer Checkpointer writes nothing more, a copy neither;
            w.fence.check(f"put step {newest[1]} there at {who}")  # nor one with no generation to write under
        except (FencedError, PersistError) as e:
            log.info("nebula_ckpt: %s puts no copy of step %d on %s: %s", who, newest[1], w.name, e)
            why = why or str(e)
            continue
        try:
            if src is None:
                raise NebulaError("no tier with a local copy of it")
            if (newest[0] == w.fence.generation or w.coordinator.world_size > 1) and w.name not in damaged:
                w.copy_from(src, newest[1])
                if max(have[w.name], default=newest) > newest:  # not the base a next save builds on
                    w.incremental.forget()
            else:  # an earlier writer's step (a restart that restored it): under its own generation
                copy_as_written(w.storage, w.name, newest, src)
                if any(s >= newest[1] for s in w.incremental.pinned()):  # its base may be a write replaced
                    w.incremental.forget()  # there (or a step that referred to one): the next save is full
            log.info("nebula_ckpt: %s put the newest step %d on %s", who, newest[1], w.name)
        except Exception as e:
            why = f"the copy of step {newest[1]} to {w.name} failed: {type(e).__name__}: {e}"
            log.error("nebula_ckpt: %s could not put the newest step %d on %s (its newest is step %s): %s: %s",
                      who, newest[1], w.name, max(have[w.name], default=(0, None))[1], type(e).__name__, e)
    return why


def _source(writers: "list[TierWriter]", have: dict[str, set[Write]], newest: Write,
            who: str) -> tuple[Optional[Storage], set[str]]:
    """Where :func:`flush_newest` copies ``newest`` from (a local tier holding it whole, or None),
    and the persistent tiers whose copy of it a restore refuses (cut short, missing: replaced)."""
    damaged = {w.name for w in writers if w.tier.persistent and newest in have[w.name]
               and w.coordinator.world_size == 1 and not _restores(w.storage, newest[1], who)}
    src = next((w.storage for w in writers if newest in have[w.name] and w.storage.is_local
                and w.name not in damaged), None)
    return src, damaged


def _restores(storage: Any, step: int, who: str) -> bool:
    """Whether committed ``step`` on ``storage`` would restore (:func:`~nebula_ckpt.save.budget.restorable`);
    a storage that cannot tell counts as whole (the copy over it would fail the same way)."""
    try:
        if restorable(storage, step):
            return True
    except OSError as e:
        log.warning("nebula_ckpt: %s cannot check step %d on %s: %s", who, step, storage.display_url, e)
        return True
    log.warning("nebula_ckpt: %s finds the copy of step %d on %s damaged (a file missing or cut short): it is "
                "replaced by a whole copy", who, step, storage.display_url)
    return False


def make_room(writers: Sequence[Any], handles: Iterable[Any], monitor: Any = None) -> bool:
    """What a save short of the host-memory budget frees where that loses nothing: the memory
    tier's steps that a persistent tier holds as the same write
    (:func:`~nebula_ckpt.save.budget.give_up_memory_steps`). Where there is none such and no save
    is in flight (every one of ``handles``, the process's save handles, is done: no tier writes
    meanwhile, and nothing else will free memory), the memory tier holds a write the persistent
    tiers' cadence skipped: the newest one is put on them first, as ``close()`` does
    (:func:`flush_newest`: never a step marked suspect; ``monitor``: the Checkpointer's health
    monitor), then given up. So the save goes ahead rather than wait for ever or be skipped until
    ``close()``, and never at the cost of that write. A multi-rank job's step would need every
    rank: there the save waits or is skipped. Last, the steps the memory tier keeps beside
    ``keep_last`` only for the health rule go (:func:`_give_up_kept`). Where nothing can be freed,
    why is recorded for the waiting save (:func:`~nebula_ckpt.save.budget.note_held`). True if any step went."""
    memory = next((w for w in writers if not w.tier.persistent), None)
    slots = None if memory is None else memory.runtime.staging_dir()
    if give_up_memory_steps(writers):
        note_held(slots, None)
        return True
    # with no save in flight a writer is at most finishing its loop (its handle is done already)
    if memory is None or not all(h.done() for h in list(handles)) or \
            not all(w.wait_idle(IDLE_WAIT_S) for w in writers):
        note_held(slots, None)  # what is in flight may free memory
        return False
    why = _flush_for_room(writers, memory, monitor)
    if why is not None and _give_up_kept(memory):
        why = None
    note_held(slots, why)
    return why is None


def _give_up_kept(memory: Any) -> bool:
    """:func:`make_room`'s very last resort: the steps the memory tier's retention keeps beside
    ``keep_last`` (the newest healthy step while newer ones are suspect, :mod:`nebula_ckpt.health`)
    deleted, as ``keep_last`` says: kept steps never take the room of the next save. Whether any went."""
    memory.runtime.tight = True
    try:
        return bool(memory.prune())
    except Exception as e:  # a failure here only keeps memory: the save waits or is skipped
        log.debug("nebula_ckpt: memory tier %s: kept steps not given up: %s", memory.name, e)
        return False
    finally:
        memory.runtime.tight = False


def _flush_for_room(writers: Sequence[Any], memory: Any, monitor: Any) -> Optional[str]:
    """:func:`make_room`'s last resort, no save in flight: the memory tier's newest write put on the
    persistent tiers, then given up. None once a step went; else why the memory tier keeps what
    it holds."""
    if give_up_memory_steps(writers) or memory.prune():  # or what a killed writer left there went
        return None
    try:
        mine = set(committed_writes(memory.storage))
    except Exception as e:  # unreadable: nothing is put anywhere; the save waits or is skipped
        return f"memory tier {memory.name} cannot be read ({e})"
    newest = max(mine, default=None)
    persistent = [w for w in writers if w.tier.persistent]
    held = sorted({s for _, s, _ in mine})
    why = f"memory tier {memory.name} holds step(s) {held[:8]} that no persistent tier holds as the same write"
    if not persistent:
        return f"{why} (it is the only tier written: it keeps its newest step(s) until a newer one is in)"
    if any(w.coordinator.world_size > 1 for w in writers):
        return (f"{why} (a multi-rank job's step reaches the shared tier only as a save of every rank there, its "
                "every=; it is never copied there to make room)")
    tried = _NOT_PUT.get(memory)
    if newest is None or (tried is not None and tried[0] == newest):
        return why + (tried[1] if tried is not None else "")  # tried already: a failure is logged once
    failed = flush_newest(list(writers), monitor, who="a save short of the host-memory budget")
    if give_up_memory_steps(writers):
        return None
    k = getattr(memory, "keep_last", 1)
    cause = f" ({failed})" if failed else \
        f" (only the newest one is put there to make room; MemoryTier(keep_last={k}) keeps the others)"
    _NOT_PUT[memory] = newest, cause
    return why + cause
