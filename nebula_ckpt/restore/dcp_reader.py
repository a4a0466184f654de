"""Read nebula_ckpt checkpoints with ``torch.distributed.checkpoint`` (DCP).

:class:`NebulaStorageReader` is a DCP ``StorageReader`` over our format, so DCP's planner does
the resharding: a checkpoint written by N ranks (FSDP2, TP, DDP, or one process) loads into M
ranks of any mesh, or into one process::

    import torch.distributed.checkpoint as dcp
    from nebula_ckpt.dcp import NebulaStorageReader

    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
    dcp.load(sd, storage_reader=NebulaStorageReader("/ckpt/run-42"))   # newest committed step
    model.load_state_dict(sd["model"]); opt.load_state_dict(sd["optim"])

What DCP sees (:meth:`NebulaStorageReader.read_metadata`):

* every logical tensor under its saved key (``"model/0.weight"``: the state-tree path joined
  with ``/``, without the ``r<R>/`` rank prefix), with its **global** shape and one chunk per
  stored piece: a DTensor gives one chunk per rank's local shard (replicated copies once), a
  plain tensor one full chunk, from the lowest rank that has it (DCP semantics: one logical
  value per key);
* the same tensors under the names DCP's own flattening gives a nested state dict
  (``"model.0.weight"``, ``"optim.state.0.exp_avg"``), so nested state dicts load directly;
* non-tensor leaves (``"step"``, ``"optim.param_groups.0.lr"``, ...) as bytes entries under
  DCP's flattened names, with the value of the lowest rank. Values stored with pickle are
  only exposed with ``allow_pickle=True``.

Writing: :class:`NebulaStorageWriter` (:mod:`nebula_ckpt.dcp.writer`) is the matching
``StorageWriter``: ``dcp.save`` / ``dcp.async_save`` write a normal nebula_ckpt checkpoint.

Everything read is verified before DCP plans the load, by the check ``load_latest`` makes
(:func:`~nebula_ckpt.restore.select.find_and_open`): the commit marker and manifest
(:meth:`Manifest.parse`, which also checks that the ranks' records agree: global shapes, dtypes,
chunks covering each tensor exactly), the size of every shard and the CRC32C of every stored
tensor. Without an explicit step, the health marks are read as ``load_latest`` reads them
(:class:`~nebula_ckpt.restore.select.HealthChoice`): a newer step marked *suspect* is skipped,
as is a damaged one (a warning names each, the mark's reason or the damage), and the newest
healthy step not marked suspect is read (logged, and :attr:`NebulaStorageReader.step`). An
explicit step is read whatever its mark (a suspect one with a warning); a damaged one raises
:class:`~nebula_ckpt.errors.CorruptCheckpointError` naming the damage.

Incremental checkpoints read like full ones: a tensor the step refers to is read from the
earlier step's shard that holds it (its manifest lists that shard with ``step``), with the same
checks (the referenced step committed and listing that file, the tensor's CRC32C); errors name
the file as ``step-<S>/<shard>``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from nebula_ckpt.errors import CorruptCheckpointError, NotFoundError, ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import committed_steps, shard_path
from nebula_ckpt.format.dtensors import dtensor_chunks, logical_groups
from nebula_ckpt.format.names import COMMIT, parse_step_dir, step_dir
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.health.book import HealthView
from nebula_ckpt.native import get_ops
from nebula_ckpt.restore.dcp_names import ExposedValue, dcp_names
from nebula_ckpt.restore.dcp_roots import GivenStorage, partial_job, split_checkpoint_id, tier_for
from nebula_ckpt.restore.open import OpenCheckpoint, read_manifest
from nebula_ckpt.restore.select import HealthChoice, find_and_open, say
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import refuse_url_credentials
from nebula_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TensorRef:
    """Where one chunk of :attr:`NebulaStorageReader.metadata` lives: a stored manifest key."""

    key: str


@dataclass(frozen=True)
class _ChosenStep:
    """The step a rank's reader reads, carried in its local load plan."""

    step: int


@dataclass(frozen=True)
class BytesRef:
    """A non-tensor leaf exposed to DCP (served as ``torch.save`` bytes of its decoded value)."""

    fqn: str


def newest_manifest(storage: Storage) -> mf.Manifest:
    """The manifest of the newest committed step whose manifest is healthy (damaged ones are
    skipped with a warning).

    Raises:
        NotFoundError: no committed step at all.
        CorruptCheckpointError: committed steps exist, but every manifest is damaged.
    """
    problems = []
    for step in reversed(committed_steps(storage)):
        try:
            return read_manifest(storage, step)
        except CorruptCheckpointError as e:
            log.warning("nebula_ckpt: skipping %s", e)
            problems.append(str(e))
    if problems:
        raise CorruptCheckpointError(f"no healthy checkpoint under {storage.display_url}: "
                                     + "; ".join(problems[:5]))
    raise NotFoundError(f"no committed checkpoint under {storage.display_url}")


def logical_tensors(man: mf.Manifest) -> dict[str, list[tuple[int, str, TensorRecord]]]:
    """Logical key (no ``r<R>/`` prefix) -> ``(rank, its manifest key, stored record)`` of every
    rank holding it, lowest rank first (aliases resolved to the record they name). A one-process
    manifest gives each key once, as rank 0."""
    groups = logical_groups(man.tensors, man.aliases, man.multi_rank)
    # the saved order (of the lowest rank's tree, then the others'), not the storage order
    from nebula_ckpt.restore.walk import tensor_keys

    order: list[str] = []
    trees = sorted(set(man.rank_tree.values()), key=lambda i: min(r for r, j in man.rank_tree.items() if j == i))
    for node in ([man.tree["v"][i] for i in trees] if man.multi_rank else [man.tree]):
        order.extend(tensor_keys(node, []))
    ordered = {k: groups[k] for k in order if k in groups}
    ordered.update(groups)
    return ordered


class NebulaStorageReader(StorageReader):
    """A DCP ``StorageReader`` over one committed nebula_ckpt checkpoint (any world size).

    Args:
        root_or_storage: the checkpoint root (a path or fsspec URL: its persistent tier is read),
            ``"<root>/step-N"``, or an open :class:`~nebula_ckpt.storage.base.Storage`.
        step: the step to read (never replaced by another: damaged, it raises; marked suspect, it
            is read with a warning); None: the newest healthy committed step not marked suspect.
        storage_options: fsspec options for a remote root.
        verify: check the CRC32C of every stored tensor when opening (False: sizes only).
        allow_pickle: also expose non-tensor leaves stored with pickle (trusted checkpoints only).
        manifest: the already validated manifest of ``step`` on this storage, whose shards the
            caller verified (skips the check; each tensor's CRC32C is then checked as it is read).

    The step is chosen and verified here with the health check of ``load_latest``
    (:func:`~nebula_ckpt.restore.select.find_and_open`: commit marker, manifest, every shard's size and,
    with ``verify``, every tensor's CRC32C) and its health marks (a step marked suspect is skipped
    as ``load_latest`` skips it), then turned into DCP metadata, so a damaged or hostile
    checkpoint is skipped or raises from the constructor, before DCP's planner runs. The whole
    step is verified (the planner decides only later which pieces this rank reads), on every
    rank; the verified shard bytes then serve the reads (mapped for a local root; held in memory
    for a remote one until :meth:`close`). Ranks whose readers chose different steps (a root
    that is not shared) fail the load in :meth:`prepare_global_plan`, before anything is read.
    A reader built from a root owns its storage: :meth:`close` it (or use ``with``).

    Attributes:
        step: the step read (logged at INFO when the reader opens; when newer steps were damaged
            or marked suspect, each was skipped with a WARNING naming the damage or the mark).
        manifest: its validated manifest.

    Raises:
        NotFoundError: no committed checkpoint (of ``step``).
        CorruptCheckpointError: the checkpoint is damaged or inconsistent; without ``step``, every
            committed step is damaged or marked suspect.
        ValidationError: the checkpoint holds only some ranks of its job (a rank's memory tier).
    """

    def __init__(self, root_or_storage: Union[str, "os.PathLike[str]", Storage], step: Optional[int] = None, *,
                 storage_options: Optional[dict[str, Any]] = None, verify: bool = True,
                 allow_pickle: bool = False, manifest: Optional[mf.Manifest] = None) -> None:
        super().__init__()
        self.verify = verify
        self.allow_pickle = allow_pickle
        self._storage_options = storage_options
        self._owned: Optional[Storage] = None
        self._verified: set[str] = set()
        #: referenced shards (an incremental checkpoint's) whose reference was checked
        self._refs_checked: set[int] = set()
        #: the step opened and verified up front (its shard bytes serve the reads); None when the
        #: caller gave the manifest
        self._ck: Optional[OpenCheckpoint] = None
        try:
            self._open(root_or_storage, step, manifest)
        except BaseException:
            self.close()
            raise

    # -- opening ---------------------------------------------------------------------------------

    def _open(self, root_or_storage: Union[str, "os.PathLike[str]", Storage], step: Optional[int],
              manifest: Optional[mf.Manifest]) -> None:
        self._ck = None
        if isinstance(root_or_storage, Storage):
            storage = root_or_storage
            tier: Tier = GivenStorage(storage)
        else:
            refuse_url_credentials(root_or_storage)  # before it is parsed or shown in any message
            root, id_step = split_checkpoint_id(root_or_storage)
            if step is None:
                step = id_step
            elif id_step is not None and id_step != step:
                raise ValidationError(f"NebulaStorageReader: {os.fspath(root_or_storage)!r} names step {id_step}, "
                                      f"but step={step} was given")
            tier = tier_for(root, self._storage_options)
            storage = tier.make_storage()
            self.close()
            self._owned = storage
        self.storage = storage
        if manifest is not None:
            if step is not None and manifest.step != step:
                raise ValidationError(f"NebulaStorageReader: the manifest given is of step {manifest.step}, "
                                      f"not {step}")
            man = manifest
            if man.multi_rank and len(man.ranks) != man.world_size:
                raise partial_job(storage, man)
        else:
            self._ck = self._open_healthy(tier, storage, step)
            man = self._ck.manifest
        self.manifest = man
        self.step = man.step
        self.where = f"{storage.display_url} step {man.step}"
        self._bytes_values: dict[str, Any] = {}
        self.metadata, self._keys = self._build_metadata()
        self.storage_data: dict[MetadataIndex, Any] = self.metadata.storage_data
        self._verified = set(man.tensors) if self._ck is not None and self.verify else set()

    def _open_healthy(self, tier: Tier, storage: Storage, step: Optional[int]) -> OpenCheckpoint:
        """Open and verify the step to read, with the health check of ``load_latest``
        (:func:`~nebula_ckpt.restore.select.find_and_open`: commit marker, manifest, the size of every
        shard and, with ``verify``, the checksum of every stored tensor), before DCP plans anything.

        Without ``step``: the newest healthy step not marked suspect (damaged and suspect newer ones
        are skipped with a warning, as ``load_latest`` skips them). With ``step``: that step
        (marked suspect: a warning says so) or an error naming what is damaged, never another step.
        """
        if step is not None and not storage.exists(f"{step_dir(step)}/{COMMIT}"):
            raise NotFoundError(f"no committed checkpoint of step {step} under {storage.display_url} "
                                f"(committed steps: {committed_steps(storage)[-8:]})")
        # The marks live on the root's storage, which every rank reads: the ranks' readers make the
        # same choice with no exchange here (a mark written while they open can part them: then
        # prepare_global_plan fails the load before anything is read, never a mix of steps).
        choice = HealthChoice(HealthView(storage), skip_suspect=step is None)
        try:
            # rank None: the whole job's checkpoint (DCP's planner decides which rank reads what)
            ck = find_and_open([(tier, storage)], step=step, verify="full" if self.verify else "size",
                               on_all_damaged="raise", skip=choice.skips)
        except CorruptCheckpointError as e:
            if not choice.skipped:
                raise
            raise _all_suspect(storage, choice, f"; the steps not marked suspect are damaged: {e}") from None
        if ck is None:
            steps = committed_steps(storage)
            if not steps:
                raise NotFoundError(f"no committed checkpoint under {storage.display_url}")
            if choice.skipped:
                raise _all_suspect(storage, choice, "")
            # every candidate was healthy but held only some ranks (find_and_open skipped it as such)
            raise partial_job(storage, read_manifest(storage, steps[-1] if step is None else step))
        say(choice.outcome((ck.manifest.generation, ck.step, ck.save)), ck.step, storage.display_url)
        newest = step is None and ck.step != committed_steps(storage)[-1]
        log.info("nebula_ckpt: NebulaStorageReader reads step %d of %s%s", ck.step, storage.display_url,
                 " (the newest healthy step not marked suspect: newer ones are damaged or marked suspect, see "
                 "the warnings above)" if newest else "")
        return ck

    def close(self) -> None:
        """Release the verified shard bytes and close the storage this reader opened (not one it
        was given)."""
        self._ck = None
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __enter__(self) -> "NebulaStorageReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def keys(self) -> list[str]:
        """The logical tensor keys (saved paths joined with ``/``, no rank prefix), in saved order."""
        return list(self._keys)

    @property
    def checkpoint_id(self) -> str:
        """``<root>/step-N`` (display form, never with credentials)."""
        return f"{self.storage.display_url.rstrip('/')}/{step_dir(self.step)}"

    # -- metadata --------------------------------------------------------------------------------

    def _logical(self) -> dict[str, list[tuple[int, TensorRecord]]]:
        """Logical key -> ``(rank, stored record)`` of every rank holding it, lowest rank first."""
        return {k: [(r, rec) for r, _, rec in v] for k, v in logical_tensors(self.manifest).items()}

    def _chunks(self, key: str, holders: list[tuple[int, TensorRecord]]
                ) -> tuple[TensorRecord, tuple[int, ...], list[tuple[tuple[int, ...], TensorRecord]]]:
        """(first record, global shape, [(offsets, record)]) of logical ``key``: the ranks' records
        were checked to agree and (every rank held) to cover the tensor exactly by :meth:`Manifest.parse`."""
        first = holders[0][1]
        if first.dtensor is None:
            return first, first.shape, [((0,) * len(first.shape), first)]
        shape, chunks = dtensor_chunks(key, holders, self.manifest.shards, self.where)
        if not chunks:  # an empty global tensor: one (empty) chunk describes it
            chunks = [(first.dtensor.offsets, first)]
        return first, shape, chunks

    def _file(self, rec: TensorRecord) -> str:
        """Where ``rec``'s bytes lie: ``step-<S>/<shard file>`` (an earlier step's folder for a
        tensor an incremental checkpoint refers to)."""
        return shard_path(self.manifest, rec.shard)

    def _build_metadata(self) -> tuple[Metadata, list[str]]:
        sdm: dict[str, Any] = {}
        data: dict[MetadataIndex, Any] = {}
        chunk_refs: dict[str, list[tuple[tuple[int, ...], TensorRef]]] = {}
        for key, holders in self._logical().items():
            first, shape, chunks = self._chunks(key, holders)
            sdm[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=first.torch_dtype), size=torch.Size(shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(rec.shape)) for o, rec in chunks])
            chunk_refs[key] = [(o, TensorRef(rec.key)) for o, rec in chunks]
            for o, ref in chunk_refs[key]:
                data[MetadataIndex(key, o)] = ref
        keys = list(sdm)
        for fqn, value in dcp_names(self.manifest, self.allow_pickle, self.where).items():
            if fqn in sdm:
                continue  # a saved key already (flat state dicts), or a name two leaves share
            if isinstance(value, str):
                sdm[fqn] = sdm[value]
                for o, ref in chunk_refs[value]:
                    data[MetadataIndex(fqn, o)] = ref
            elif isinstance(value, ExposedValue):
                sdm[fqn] = BytesStorageMetadata()
                data[MetadataIndex(fqn)] = BytesRef(fqn)
                self._bytes_values[fqn] = value.value
        meta = Metadata(state_dict_metadata=sdm, storage_data=data,
                        storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id, load_id=uuid.uuid4().hex))
        return meta, keys

    # -- the StorageReader protocol --------------------------------------------------------------

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        """Start a new load; with ``checkpoint_id`` (a root or ``<root>/step-N``), read that instead."""
        if checkpoint_id is not None:
            self._open(checkpoint_id, None, None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        """Whether ``checkpoint_id`` looks like a nebula_ckpt root or step folder (local paths are
        checked for a committed step; remote URLs are assumed readable)."""
        try:
            root, step = split_checkpoint_id(checkpoint_id)
        except TypeError:
            return False
        if "://" in root and not root.startswith("file://"):
            return True
        path = root.removeprefix("file://")
        if step is not None:
            return os.path.isfile(os.path.join(path, step_dir(step), COMMIT))
        try:
            return any(os.path.isfile(os.path.join(path, n, COMMIT))
                       for n in os.listdir(path) if parse_step_dir(n) is not None)
        except OSError:
            return False

    def read_metadata(self) -> Metadata:
        """DCP metadata of the checkpoint (built and checked when the reader was opened)."""
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Take the storage index of ``metadata`` (it must be this reader's)."""
        if not isinstance(metadata.storage_data, dict):
            raise ValidationError("NebulaStorageReader: the metadata given was not read by a NebulaStorageReader")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Tag the plan with the step this rank's reader chose (checked by :meth:`prepare_global_plan`)."""
        return dataclasses.replace(plan, storage_data=_ChosenStep(self.step))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Check that every rank's reader chose the same step (each picks the newest healthy one on
        its own: ranks that see different steps must not load a mix of them).

        Raises:
            ValidationError: naming the step of each rank.
        """
        steps = [p.storage_data.step if isinstance(p.storage_data, _ChosenStep) else None for p in plans]
        if len(set(steps)) > 1:
            raise ValidationError(
                f"NebulaStorageReader: the ranks chose different steps to load ({dict(enumerate(steps))}, by rank): "
                "their readers see different checkpoints under the root (a root that is not shared, a step "
                "damaged for some ranks, or a step marked suspect while the ranks opened their readers); pass "
                "the same step=... on every rank, or read a shared root")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Serve ``plan``'s read items: shard by shard, verify each stored tensor read (once),
        copy the requested part of each into the tensor the planner resolves."""
        per_shard: dict[int, list[tuple[ReadItem, TensorRecord]]] = {}
        for item in plan.items:
            ref = self.storage_data.get(item.storage_index)
            if ref is None:
                raise ValidationError(f"{self.where}: the load plan asks for {item.storage_index}, which this "
                                      "checkpoint does not hold (a plan made from other metadata?)")
            if item.type == LoadItemType.BYTE_IO:
                if not isinstance(ref, BytesRef):
                    raise ValidationError(f"{self.where}: '{item.storage_index.fqn}' is a tensor, not a value")
                buf = io.BytesIO()
                torch.save(self._bytes_values[ref.fqn], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            if not isinstance(ref, TensorRef):
                raise ValidationError(f"{self.where}: '{item.storage_index.fqn}' is a value, not a tensor")
            rec = self.manifest.tensors[ref.key]
            per_shard.setdefault(rec.shard, []).append((item, rec))
        for si in sorted(per_shard):
            self._read_from_shard(si, per_shard[si], planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_from_shard(self, si: int, items: list[tuple[ReadItem, TensorRecord]], planner: LoadPlanner) -> None:
        from nebula_ckpt.restore.open import check_references, read_shard

        if self._ck is None and self.manifest.shards[si].step is not None and si not in self._refs_checked:
            # a manifest handed over: what it refers to is checked here (open_checkpoint's check)
            recs = [r for r in self.manifest.tensors.values() if r.shard == si]
            check_references(self.storage, self.manifest, {si: recs}, self.where)
            self._refs_checked.add(si)
        buf = self._ck.buffer(si) if self._ck is not None else read_shard(self.storage, self.manifest, si,
                                                                          self.where)
        if self.verify:
            todo = list({rec.key: rec for _, rec in items if rec.key not in self._verified}.values())
            if todo:
                got = get_ops().crc32c(buf, [r.start for r in todo], [r.nbytes for r in todo])
                for rec, have in zip(todo, got, strict=True):
                    if have != rec.crc32c:
                        raise CorruptCheckpointError(
                            f"{self.where}: checksum mismatch in tensor '{rec.key}' of {self._file(rec)} "
                            f"(crc32c {have:#010x}, manifest {rec.crc32c:#010x})")
                    self._verified.add(rec.key)
        for item, rec in items:
            src = buf[rec.start:rec.end].view(rec.torch_dtype).reshape(rec.shape)
            src = _narrow(src, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != src.size():
                raise ValidationError(f"{self.where}: key '{item.dest_index.fqn}': the planner's target has shape "
                                      f"{list(target.size())}, the stored piece {list(src.size())}")
            target.copy_(src)
            planner.commit_tensor(item, target)
        if self._ck is not None:
            self._ck.drop([rec for _, rec in items])  # copied: unmap its pages (a mapped local shard)


def _all_suspect(storage: Storage, choice: HealthChoice, more: str) -> CorruptCheckpointError:
    """The error for a root whose every committed step that opens is marked suspect (``more``:
    what else was wrong), naming the steps and how to read one anyway."""
    steps = sorted({s for _, s in choice.skipped}, reverse=True)
    return CorruptCheckpointError(
        f"NebulaStorageReader: no step of {storage.display_url} to read as the newest: every committed step "
        f"that opens is marked suspect (steps {steps[:20]}; load_latest skips them too){more}. Read one anyway "
        "with step=N, or clear its mark with `nebula-ckpt mark ROOT --healthy N`")


def _narrow(t: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        if o != 0 or n != t.size(dim):
            t = t.narrow(dim, o, n)
    return t
