"""Write nebula_ckpt checkpoints with ``torch.distributed.checkpoint`` (DCP).

:class:`NebulaStorageWriter` is a DCP ``StorageWriter``: ``dcp.save`` and ``dcp.async_save``
write a normal nebula_ckpt checkpoint, on one process or on N ranks::

    import torch.distributed.checkpoint as dcp
    from nebula_ckpt.dcp import NebulaStorageWriter

    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 100},
             storage_writer=NebulaStorageWriter("/ckpt/run-42", step=100))

What lands on storage is the layout every nebula_ckpt writer commits (:mod:`nebula_ckpt.format`):
every rank writes its share ``step-N/shard-g<G>-r<R>.safetensors`` (fsync'd, CRC32C of every
tensor), and the coordinator rank, in :meth:`finish`, which DCP calls only after every rank's
``write_data`` returned (after every shard is durable), writes the rest: for N ranks, format
version 4 (each rank's records file ``records-g<G>-r<R>.json``, ``ranks.json``), then
``manifest.json`` and the ``COMMIT`` marker, last. So
``Checkpointer(root).load_latest`` (same world size, or resharded) and
:class:`~nebula_ckpt.restore.dcp_reader.NebulaStorageReader` (any world size) read it, and
``nebula-ckpt verify`` checks it.

How DCP's items map onto the format:

* **keys**: DCP flattens a nested state dict to dotted FQNs and records each one's path
  (``planner_data``); the manifest stores the *path* joined with ``/`` (``"model/0.weight"``,
  ``"optim/state/0/exp_avg"``): the same keys ``Checkpointer.save`` gives the same state, and the
  typed tree is rebuilt from the paths. DCP turns every dict key into a string; the one int-keyed
  dict of real state dicts, a ``torch.optim`` state dict's ``state``, is recognised (its keys are
  the ints of ``param_groups[*]["params"]``) and gets its int keys back. Without path
  information (a planner that does not flatten) every FQN is a top-level key.
* **tensors** (``TENSOR`` items) are stored like any tensor; DCP stores a tensor several ranks
  hold once (its dedup: all ranks, or some, such as one pipeline stage's), and on every other rank
  holding it the key is a *replica* of that rank's copy (DCP semantics: one value per
  non-DTensor key). Tensors tied within one rank are stored once.
* **DTensor shards** (``SHARD`` items) become the rank's local shard with a ``dtensor`` record:
  global shape, the chunk's offsets, placements and mesh shape from the DTensor (``Shard`` /
  ``Replicate`` only: other placements are refused naming the key; a legacy ``ShardedTensor``
  chunk gets a one-dimensional placement derived from the chunk). One chunk per rank and key: a
  ``ShardedTensor`` holding several local shards on one rank is refused before anything is
  written (the format keeps one record per rank and key); convert it to a ``DTensor``, or save
  it with DCP's ``FileSystemWriter``.
  Replicated chunks DCP writes once are replicas on the other ranks holding them.
* **non-tensor values** (``BYTE_IO`` items, which DCP serialises with ``torch.save``) are
  loaded back with ``weights_only=True`` and stored in the typed tree when they are plain values
  (numbers, strings, bools, None, dtypes, devices, lists / tuples / dicts of them): no pickle.
  Anything else is refused (``ValidationError`` naming the key) unless
  ``allow_pickle=True``, which stores it as a pickled leaf of the tree; reading it back then
  needs ``allow_pickle=True`` as well (``Checkpointer(..., allow_pickle=True)``,
  ``NebulaStorageReader(..., allow_pickle=True)``). Empty dicts and lists leave no item in DCP's
  plan and so are not stored (as with DCP's own format).

Commit protocol and crash safety: the coordinator refuses a step that is already committed,
takes a writer generation on the root (once per process and root, :mod:`nebula_ckpt.ranks.process_fence`:
a newer writer on the same root fences this one), removes leftovers of failed writes (the sweep
of the tier writers' retention, :mod:`nebula_ckpt.save.sweep`), and hands
every rank ``(step, generation)`` through DCP's global plan. Each rank writes its shard and
returns one record per item (offsets, CRC32C taken before and re-checked after the write). In
:meth:`finish` the coordinator checks every rank's shard is there with its size, builds the
ranks' records files and ``ranks.json`` and writes them, checks their bytes with the manifest
as a reader does, checks that a :class:`~nebula_ckpt.restore.dcp_reader.NebulaStorageReader`
accepts it, then writes ``manifest.json`` and the create-only ``COMMIT`` last, as the tier writers
do (:func:`nebula_ckpt.format.commit.commit_manifest`, the one commit step). A failure on any
rank means DCP never calls :meth:`finish`: no ``COMMIT``, the step stays invisible; the failing
rank removes its own shard at once (and the step folder, if that emptied it), the others' are
removed by this process's next DCP save on the root (or by any later writer of a newer
generation, ``Checkpointer`` retention included). A ``COMMIT`` write that reports an error may
still have created the marker (a lost response on a blob store): then nothing of the step is
removed, and the error says the step may have committed.

A job that resumes with ``Checkpointer`` and saves with DCP (or saves with both) shares one
generation in each process: they do not fence each other. Do not run a ``Checkpointer`` save and
a DCP save of the same root at the same moment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from typing import Any, Optional, Union

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from nebula_ckpt.dcp.manifest import DcpSave, RankPlans, dcp_manifest
from nebula_ckpt.dcp.plans import GlobalPlanData, Held, LocalPlanData, Stored, Written
from nebula_ckpt.dcp.shard import tensor_parts, write_shard
from nebula_ckpt.dcp.values import check_keys, encode_value, fqn_paths, manifest_key
from nebula_ckpt.errors import FencedError, NebulaError, PersistError, ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import CommitProgress, clear_step, commit_manifest, scan_steps
from nebula_ckpt.format.dtypes import TENSOR_DTYPES, dtype_name
from nebula_ckpt.format.names import (
    COMMIT,
    MANIFEST,
    RANKS_FILE,
    check_step,
    parse_step_dir,
    shard_name,
    shard_owner,
    step_dir,
)
from nebula_ckpt.format.split_records import load_split, with_index
from nebula_ckpt.native import get_ops
from nebula_ckpt.ranks.process_fence import process_fence
from nebula_ckpt.restore.dcp_roots import storage_for
from nebula_ckpt.save import sweep
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import refuse_url_credentials
from nebula_ckpt.workers import Workers

log = logging.getLogger(__name__)

StepId = Union[int, str, "os.PathLike[str]"]

#: steps whose save this process (the coordinator) planned on a root and did not finish: DCP runs
#: one save at a time per process group, so when the next one is planned these have failed
_UNFINISHED: dict[str, set[int]] = {}
_LOCK = threading.Lock()


def _split_id(checkpoint_id: StepId) -> tuple[Optional[str], Optional[int]]:
    """``7`` / ``"step-7"`` -> ``(None, 7)``; ``"<root>/step-7"`` -> ``(root, 7)``; a root -> ``(root, None)``."""
    if isinstance(checkpoint_id, bool):
        raise ValidationError(f"NebulaStorageWriter: checkpoint_id must be a step or a path, got {checkpoint_id!r}")
    if isinstance(checkpoint_id, int):
        return None, check_step(checkpoint_id)
    text: Any = os.fspath(checkpoint_id)
    if not isinstance(text, str):
        raise ValidationError(f"NebulaStorageWriter: checkpoint_id must be a str path, got {type(text).__name__}")
    text = text.rstrip("/")
    step = parse_step_dir(text)
    if step is not None:
        return None, step
    head, _, tail = text.rpartition("/")
    step = parse_step_dir(tail) if head else None
    return (head, step) if step is not None else (text, None)


class NebulaStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes one nebula_ckpt checkpoint (any world size).

    Args:
        root: the checkpoint root (a path or fsspec URL), or ``"<root>/step-N"``.
        step: the step to write; or give it as ``checkpoint_id`` to ``dcp.save`` (an int,
            ``"step-N"`` or ``"<root>/step-N"``), or in ``root``.
        storage_options: fsspec options for a remote root.
        allow_pickle: store values typed JSON cannot hold with pickle (see the module docstring).

    Construct it on every rank with the same arguments. A step that is already committed under
    the root is refused (:class:`ValidationError` naming it); use a new writer, or pass a new
    ``checkpoint_id``, for every save. Errors raised inside DCP's phases reach the caller
    wrapped in DCP's ``CheckpointException`` (its ``failures`` hold each rank's error).
    """

    def __init__(self, root: Union[str, "os.PathLike[str]"], step: Optional[int] = None, *,
                 storage_options: Optional[dict[str, Any]] = None, allow_pickle: bool = False) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self._storage_options = storage_options
        self._storage: Optional[Storage] = None
        self._root: Optional[str] = None
        self.step: Optional[int] = None if step is None else check_step(step)
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self._plans = RankPlans()
        self._gen: Optional[int] = None
        self._wrote_manifest = self._wrote_index = False
        self._set_root_and_step(root, step)

    # -- where -----------------------------------------------------------------------------------

    def _set_root_and_step(self, root: Optional[StepId], step: Optional[int]) -> None:
        refuse_url_credentials(root)  # before it is parsed or shown in any message
        id_root, id_step = _split_id(root) if root is not None else (None, None)
        if step is not None and id_step is not None and id_step != step:
            raise ValidationError(f"NebulaStorageWriter: {root!r} names step {id_step}, but step={step} was given")
        if id_step is not None:
            self.step = id_step
        if id_root is not None and id_root != self._root:
            storage = storage_for(id_root, self._storage_options)
            self.close()
            self._storage, self._root = storage, id_root
        if self._storage is None:
            raise ValidationError(f"NebulaStorageWriter: {root!r} names a step but no root; pass the root first")

    @property
    def storage(self) -> Storage:
        """The root's storage."""
        assert self._storage is not None
        return self._storage

    @property
    def checkpoint_id(self) -> Optional[str]:
        """``<root>/step-N`` (display form, never with credentials); None before a step is set."""
        if self.step is None:
            return None
        return f"{self.storage.display_url.rstrip('/')}/{step_dir(self.step)}"

    @property
    def where(self) -> str:
        return f"{self.storage.display_url} step {self.step}"

    def close(self) -> None:
        """Release the root's storage (connections of a remote root)."""
        if self._storage is not None:
            self._storage.close()
            self._storage = None
            self._root = None

    def __enter__(self) -> "NebulaStorageWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the StorageWriter protocol --------------------------------------------------------------

    def reset(self, checkpoint_id: Optional[StepId] = None) -> None:
        """Start a new save; ``checkpoint_id``: the step (an int or ``"step-N"``) or ``"<root>/step-N"``
        (a bare root keeps the step given before)."""
        if checkpoint_id is not None:
            self._set_root_and_step(checkpoint_id, None)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: StepId) -> bool:
        """Whether ``checkpoint_id`` names a step (an int, ``"step-N"`` or ``"<path>/step-N"``)."""
        try:
            return _split_id(checkpoint_id)[1] is not None
        except (ValidationError, TypeError):
            return False

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Take this rank's role; refuse DCP's experimental saves without collectives."""
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if not kwargs.get("use_collectives", True):
            raise ValidationError("NebulaStorageWriter needs DCP's collectives (use_collectives=True): the "
                                  "coordinator commits one checkpoint for every rank")
        if self.step is None:
            raise ValidationError(f"NebulaStorageWriter({self.storage.display_url}): no step to write; pass "
                                  "step=N, or checkpoint_id=N (or 'step-N') to dcp.save")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Check the keys; record what this rank holds (before DCP drops its duplicates)."""
        paths = fqn_paths(plan.planner_data)
        fqns: list[str] = []
        held: list[Held] = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                held.append((fqn, None))
            else:
                td = item.tensor_data
                if td is None or td.chunk is None:
                    raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': a tensor item without bounds")
                dt = dtype_name(td.properties.dtype)
                if dt not in TENSOR_DTYPES:
                    raise ValidationError(f"NebulaStorageWriter: state key '{fqn}': dtype {dt} cannot be stored "
                                          "(quantized, or without a byte size)")
                held.append((fqn, tuple(int(o) for o in td.chunk.offsets)))
            fqns.append(fqn)
        counts: dict[str, int] = {}
        for f, _ in held:
            counts[f] = counts.get(f, 0) + 1
        dup = sorted(f for f, n in counts.items() if n > 1)
        if dup:
            raise ValidationError(f"NebulaStorageWriter: state key '{dup[0]}' has several chunks on rank {self.rank} "
                                  "(a ShardedTensor with several local shards?); one chunk per rank and key is "
                                  "supported: convert it to a DTensor (torch.distributed.tensor), or save it with "
                                  "DCP's FileSystemWriter; nothing was written")
        check_keys(fqns, paths)
        return dataclasses.replace(plan, storage_data=LocalPlanData(tuple(held)))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: refuse a committed step, take the generation, clear leftovers, and
        tell every rank what to write."""
        step = self.step
        assert step is not None
        self._plans = RankPlans()
        for r, p in enumerate(plans):
            if not isinstance(p.storage_data, LocalPlanData):
                raise ValidationError(f"NebulaStorageWriter: rank {r}'s plan was not prepared by a NebulaStorageWriter "
                                      "(every rank must save with one)")
            self._plans.held.append(p.storage_data.held)
            paths = fqn_paths(p.planner_data)
            self._plans.paths.append(paths)
            self._plans.keys.append({f: manifest_key(f, paths) for f, _ in p.storage_data.held})
        st = self.storage
        self._refuse_committed()
        fence = process_fence(st)
        gen = self._gen = fence.generation
        fence.for_tier(st).check(f"write step {step}")
        owner = sweep.Ownership(gen, self.rank, commits_here=True)
        # leftovers of failed writes of this step (older, or this generation's: none is in flight)
        clear_step(st, step, lambda n: owner.stale(n, ours_failed=True))
        self._sweep(owner, step)
        with _LOCK:
            _UNFINISHED.setdefault(st.display_url, set()).add(step)
        save_id = uuid.uuid4().hex
        world = len(plans)
        return [dataclasses.replace(p, storage_data=GlobalPlanData(step, gen, world, r, save_id))
                for r, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's shard (durable on return) and describe every item in it."""
        info = plan.storage_data
        if not isinstance(info, GlobalPlanData):
            raise ValidationError("NebulaStorageWriter: the plan carries no write instructions of the coordinator "
                                  "(a cached plan? DefaultSavePlanner(enable_plan_caching=True) is not supported)")
        if info.step != self.step or (info.rank != self.rank and info.world > 1):
            raise ValidationError(f"NebulaStorageWriter: rank {self.rank} was told to write step {info.step} as rank "
                                  f"{info.rank}, but it saves step {self.step} (a cached plan? plan caching is not "
                                  "supported)")
        if getattr(planner, "_enable_plan_caching", False):
            raise ValidationError("NebulaStorageWriter does not support DCP's plan caching "
                                  "(DefaultSavePlanner(enable_plan_caching=True))")
        st = self.storage
        d = step_dir(info.step)
        if st.exists(f"{d}/{COMMIT}"):
            raise ValidationError(f"NebulaStorageWriter: step {info.step} was committed under {st.display_url} "
                                  "while this save ran; nothing is overwritten")
        paths = fqn_paths(plan.planner_data)
        name = shard_name(info.generation, info.rank)
        shard: dict[str, Any] = {"file": name}
        out: list[tuple[WriteItem, Written, int]] = []
        # values first: a value that cannot be stored fails the save before any byte is written
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                node = encode_value(item.index.fqn, planner.resolve_data(item), self.allow_pickle)
                out.append((item, Written(info.save_id, info.rank, item.index.fqn, None,
                                           manifest_key(item.index.fqn, paths), None, None, node, shard), 0))
        tensors = tensor_parts(plan, planner, info, paths, shard, out)
        rel = f"{d}/{name}"
        try:
            shard.update(self._write_shard(rel, tensors))
        except BaseException:
            # DCP never calls finish() now: no COMMIT can come; the last rank out removes the folder
            sweep.discard_files(st, info.step, lambda n: n == name, self.where)
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([WriteResult(index=item.index, size_in_bytes=n, storage_data=w) for item, w, n in out])
        return fut

    def _write_shard(self, rel: str, tensors: list[Stored]) -> dict[str, Any]:
        """The rank's safetensors image, written straight from the tensors' memory and fsync'd
        (:func:`nebula_ckpt.dcp.shard.write_shard`)."""
        return write_shard(self.storage, rel, tensors, self.where)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator, once every rank's shard is durable: manifest, then ``COMMIT``, last."""
        try:
            self._finish(metadata, results)
        finally:
            with _LOCK:
                _UNFINISHED.get(self.storage.display_url, set()).discard(self.step or 0)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        step = self.step
        assert step is not None and self._plans.held
        world = len(results)
        if world != len(self._plans.held):
            raise PersistError(f"{self.where}: {world} ranks reported writes, {len(self._plans.held)} planned")
        st = self.storage
        self._wrote_manifest = self._wrote_index = False
        try:
            done = dcp_manifest(DcpSave(st, self.where, step, self._generation(), self._plans), metadata, results,
                                get_ops().crc32c_bytes)
            man = done.manifest
            mbytes = mf.encode_manifest(man)
            self._write_files(step, done.files)
            self._check_readable(step, mbytes, done.files)
        except NebulaError as e:
            self._abandon(step)
            raise PersistError(f"{self.where}: not committed: {e}") from e
        except BaseException:
            self._abandon(step)
            raise
        self._commit(step, man["generation"], mbytes)
        log.info("nebula_ckpt: DCP save of step %d committed under %s (%d rank(s), %.1f MiB)", step, st.display_url,
                 world, sum(man["stats"].get("ranks_bytes", [0])) / 2**20 if world > 1 else
                 man["shards"][0]["bytes"] / 2**20)

    def _write_files(self, step: int, files: list[tuple[str, bytes]]) -> None:
        """The ranks' records files (at once), then ``ranks.json`` (a multi-rank save's; none for one process)."""
        if not files:
            return
        d, st = step_dir(step), self.storage
        *records, (index_name, index) = files
        with Workers(min(16, len(records)), thread_name_prefix="nebula-dcp-records") as pool:
            list(pool.map(lambda f: st.write_small(f"{d}/{f[0]}", f[1]), records))
        self._wrote_index = True
        st.write_small(f"{d}/{index_name}", index)

    def _check_readable(self, step: int, mbytes: bytes, files: list[tuple[str, bytes]]) -> None:
        """The manifest parsed strictly, completed from the bytes of ``ranks.json`` and every records
        file just written (:mod:`nebula_ckpt.format.split_records`: checked as a reader checks them,
        without reading them back, whatever the number of ranks) and opened by a
        :class:`~nebula_ckpt.restore.dcp_reader.NebulaStorageReader`: DCP can read the step back
        once it commits."""
        from nebula_ckpt.restore.dcp_reader import NebulaStorageReader

        crc = get_ops().crc32c_bytes
        man = mf.Manifest.parse(mbytes, self.where, step)
        if man.layout is not None:
            written = dict(files)
            man = with_index(man, written[RANKS_FILE], crc, self.where)
            man = load_split(man, written.__getitem__, crc, man.ranks, self.where)
        NebulaStorageReader(self.storage, step, manifest=man, verify=False).close()

    def _commit(self, step: int, gen: int, mbytes: bytes) -> None:
        """Manifest, then ``COMMIT`` (:func:`nebula_ckpt.format.commit.commit_manifest`, the tier
        writers' own); a failure removes this save's files only while the marker certainly does
        not exist."""
        st = self.storage
        fence = process_fence(st, gen).for_tier(st)
        try:
            self._refuse_committed()
            fence.check(f"commit step {step}")
        except BaseException:
            self._abandon(step)
            raise
        progress = CommitProgress()
        self._wrote_manifest = True
        try:
            commit_manifest(st, fence, step, mbytes, progress, st.display_url)
        except FileExistsError:
            raise ValidationError(f"NebulaStorageWriter: step {step} was committed under {st.display_url} by another "
                                  "writer while this save ran; its checkpoint is left as it is") from None
        except BaseException as e:
            if progress.may_commit:  # the marker may exist, or still land: nothing of the step goes
                raise PersistError(f"{self.where}: step {step} may have committed: the write of its COMMIT reported "
                                   f"an error ({type(e).__name__}: {e}); its files are kept (a later save of a newer "
                                   "job removes them if it never committed)") from e
            self._abandon(step)
            raise

    def _generation(self) -> int:
        g = self._gen
        if g is None:
            raise PersistError(f"{self.where}: finish() without a generation (prepare_global_plan did not run)")
        return g

    # -- housekeeping --------------------------------------------------------------------------------

    def _refuse_committed(self) -> None:
        st = self.storage
        if st.exists(f"{step_dir(self.step or 0)}/{COMMIT}"):
            raise ValidationError(
                f"NebulaStorageWriter: step {self.step} is already committed under {st.display_url} "
                f"({step_dir(self.step or 0)}/{COMMIT}); a committed checkpoint is never overwritten: save "
                "another step, or delete that one first")

    def _abandon(self, step: int) -> None:
        """After a failed commit: remove this save's files of the step (its generation's shards, the
        manifest it wrote), never a committed step's nor another writer's."""
        def doomed(n: str) -> bool:
            owner = shard_owner(n)
            return (owner is not None and owner[0] == self._gen) or (n == MANIFEST and self._wrote_manifest) or \
                (n == RANKS_FILE and self._wrote_index)

        sweep.discard_files(self.storage, step, doomed, self.where)

    def _sweep(self, owner: sweep.Ownership, step: int) -> None:
        """Remove uncommitted step folders of failed saves (:mod:`nebula_ckpt.save.sweep`, as the
        tier writers' retention does): those holding only files no live writer owns, this
        process's earlier saves that never reached :meth:`finish` included."""
        st = self.storage
        with _LOCK:
            failed = _UNFINISHED.pop(st.display_url, set()) - {step}
        try:
            uncommitted = [s for s in scan_steps(st)[1] if s != step]
            leftovers = sweep.leftover_steps(st, uncommitted, owner, failed)
            sweep.remove_leftovers(st, leftovers, sweep.abandoned_uploads(st, owner.generation), st.display_url)
        except FencedError:
            raise
        except Exception as e:  # best effort: the save itself goes on
            log.warning("nebula_ckpt: %s: cannot remove uncommitted leftovers: %s", st.display_url, e)
