"""PyTorch Lightning: a ``CheckpointIO`` plugin that saves through nebula_ckpt's tiers.

One line in the user's script::

    from nebula_ckpt.integrations.lightning import NebulaCheckpointIO, NebulaSaveMetrics

    io = NebulaCheckpointIO("/ckpt/run-42")
    trainer = Trainer(plugins=[io], callbacks=[NebulaSaveMetrics(io),   # optional: save metrics to the loggers
                      ModelCheckpoint(dirpath="ckpts", monitor="val_loss", save_top_k=3, save_last=True)])
    trainer.fit(model, ckpt_path="last")     # resumes from the newest committed "last.ckpt", if any

Works with ``pytorch_lightning`` (``pip install 'nebula_ckpt[lightning]'``) and the unified ``lightning``.

Design: Lightning addresses checkpoints by file path and keeps its own bookkeeping on the file
system (``ModelCheckpoint``'s existence checks, its ``last*.ckpt`` glob, ``save_last="link"``
symlinks, removal of what fell out of the top k). To keep all of that,
:meth:`NebulaCheckpointIO.save_checkpoint` (1) saves the checkpoint dict with
``Checkpointer.save_async(step, checkpoint, tag=tag_for_path(path))`` (``step`` counts this root's
saves: top-k and ``last.ckpt`` are two checkpoints of one global step), and (2) writes a small
*pointer file* at ``path`` (atomically) naming the root, tag and step: a ``torch.save`` archive
whose pickle calls :func:`open_pointer`, so ``torch.load`` of it (``load_from_checkpoint``) returns
the checkpoint it names. It records the root's path relative to itself too, so a run folder moved
(``mv``) or copied (``cp -r``) still resumes, from its own root.

:meth:`~NebulaCheckpointIO.load_checkpoint` restores the newest *committed* checkpoint of the
pointer's tag, checksums verified (a read of a save in flight waits for it, whoever reads:
:mod:`~nebula_ckpt.integrations.inflight`; after a crash it is the path's previous one); a
``last*.ckpt`` path (``ckpt_path="last"``) the newest not marked suspect if that one went bad
(:mod:`~nebula_ckpt.integrations.lightning_resume`). :meth:`~NebulaCheckpointIO.remove_checkpoint`
removes the tag's checkpoints once no other pointer names them
(:mod:`~nebula_ckpt.integrations.lightning_refs`). Retention belongs to Lightning.

Blocking: ``save_checkpoint`` returns once the live tensors are copied into host memory, one save
in flight; background failures are raised by the next save and by :meth:`teardown`. A save or
removal outside a Trainer's running stage (no ``teardown`` follows) is finished and the
Checkpointer closed before the call returns.

Lightning saves and removes on global rank 0 only, so the plugin writes as one process; it loads
on every rank. Strategies saving sharded state themselves (FSDP sharded, DeepSpeed) bypass it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from nebula_ckpt import Checkpointer, SaveMetrics, Tier
from nebula_ckpt.adapters import LocalCoordinator, canonical_root, refuse_url_credentials
from nebula_ckpt.errors import NebulaError, NotFoundError
from nebula_ckpt.integrations.inflight import finished, started
from nebula_ckpt.integrations.lightning_metrics import NebulaSaveMetrics
from nebula_ckpt.integrations.lightning_refs import PointerRefs
from nebula_ckpt.integrations.lightning_resume import is_last, newest_pointer, other_rank
from nebula_ckpt.integrations.lightning_support import (
    BASES,
    POINTER_FIELDS,
    POINTER_FORMAT,
    InFlight,
    await_save,
    exists,
    in_trainer_stage,
    is_local,
    local,
    nothing_committed,
    plain_int,
    pointer_record,
    read_pointer,
    reader,
    remove_file,
    tag_for_path,
    write_pointer_file,
)
from nebula_ckpt.integrations.pointers import candidate_roots, check_record, loading_path

log = logging.getLogger(__name__)

#: the root tier's retention: Lightning decides what is deleted, through remove_checkpoint
KEEP_ALL = 1 << 40

if TYPE_CHECKING:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO
else:
    _CheckpointIO = BASES[0][0]


class NebulaCheckpointIO(_CheckpointIO):
    """Lightning ``CheckpointIO`` that saves asynchronously through nebula_ckpt's tiers.

    ``Trainer(plugins=[NebulaCheckpointIO("/ckpt/run-42")], callbacks=[ModelCheckpoint(...)])``:
    each checkpoint Lightning saves at a path is a nebula_ckpt checkpoint tagged with that path,
    and the path holds a small pointer file to it (see the module docstring for why).

    Args:
        root: the :class:`~nebula_ckpt.Checkpointer` root (path or fsspec URL): where the
            checkpoints' bytes live. It is not Lightning's ``dirpath``, where the pointers go.
        storage_options: fsspec options of a remote ``root`` (credentials).
        tiers: explicit tiers, fastest first (default: memory tier, then ``root``). Leave ``keep_last``
            unset on them: its retention would delete checkpoints Lightning still tracks (logged).
        memory_tier: add the default memory tier (``/dev/shm``; ignored with ``tiers``).
        host_memory_budget: the most host memory checkpointing holds (see ``Checkpointer``).
        allow_pickle: let values typed JSON cannot hold (unusual ``hyper_parameters``) go through pickle.
        snapshot: the ``Checkpointer``'s snapshot mode (Lightning's live tensors are copied at once anyway).

    Attributes:
        last_save_seconds: how long the last ``save_checkpoint`` blocked the training loop.
    """

    def __init__(self, root: "str | os.PathLike[str]", *, storage_options: Optional[dict[str, Any]] = None,
                 tiers: Optional[Sequence[Tier]] = None, memory_tier: bool = True,
                 host_memory_budget: "float | None" = None, allow_pickle: bool = False, snapshot: str = "auto") -> None:
        super().__init__()
        root = os.fspath(root) if isinstance(root, os.PathLike) else root
        if not isinstance(root, str) or not root:
            raise NebulaError(f"NebulaCheckpointIO: root must be a non-empty path or URL string, got {root!r}")
        refuse_url_credentials(root)  # before it is kept, logged or written into a pointer file
        self.root = root
        self._own_root = canonical_root(root)
        self._options: dict[str, Any] = {"storage_options": storage_options, "tiers": tiers,
                                         "memory_tier": memory_tier, "host_memory_budget": host_memory_budget,
                                         "allow_pickle": allow_pickle, "snapshot": snapshot}
        for t in tiers or ():
            if isinstance(t, Tier) and t.persistent and t.keep_last is not None:
                log.warning("nebula_ckpt: NebulaCheckpointIO: tier %s has keep_last=%d: its retention may delete "
                            "checkpoints Lightning's ModelCheckpoint still tracks (leave keep_last unset: "
                            "Lightning removes what it no longer needs)", t.name, t.keep_last)
        self._ckpt: Optional[Checkpointer] = None
        self._inflight: Optional[InFlight] = None
        self._next_step: Optional[int] = None
        #: committed (or in-flight) steps per tag known to this plugin, for removing superseded ones
        self._tag_steps: dict[str, list[int]] = {}
        #: the pointer files naming this root's checkpoints (copies, replaced ones)
        self._refs = PointerRefs(root)
        #: (global step, metrics) of the saves settled since take_metrics() last ran
        self._finished: list[tuple[Optional[int], SaveMetrics]] = []
        self._kinds: dict[str, str] = {}
        self.last_save_seconds: Optional[float] = None

    # -- the Checkpointer ---------------------------------------------------------------------------
    @property
    def checkpointer(self) -> Checkpointer:
        """The :class:`~nebula_ckpt.Checkpointer` on ``root`` (created at first use, closed by
        :meth:`teardown`; a later use creates a new one)."""
        if self._ckpt is None:
            o = self._options
            # a one-process writer even under DDP: Lightning saves and removes on global rank 0 only
            self._ckpt = Checkpointer(self.root, storage_options=o["storage_options"], tiers=o["tiers"],
                                      memory_tier=o["memory_tier"], host_memory_budget=o["host_memory_budget"],
                                      allow_pickle=o["allow_pickle"], snapshot=o["snapshot"], keep_last=KEEP_ALL,
                                      coordinator=LocalCoordinator())
            self._next_step = None
            self._tag_steps = {}
            kinds = [t.kind for t in self._ckpt.tiers]
            self._kinds = {t.name: t.kind if kinds.count(t.kind) == 1 else f"{t.kind}{i}"
                           for i, t in enumerate(self._ckpt.tiers)}
        return self._ckpt

    def _start_saving(self, ck: Checkpointer) -> int:
        """The step of the next save: one past every committed step on the first save, which also
        learns which steps carry which tag (older copies of a path, e.g. left by a crash)."""
        if self._next_step is None:
            by_step = ck.steps(check_shards=False)
            self._next_step = max(by_step, default=-1) + 1
            for s, t in sorted(by_step.items()):
                if t is not None:
                    self._tag_steps.setdefault(t, []).append(s)
        return self._next_step

    # -- CheckpointIO ---------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Snapshot ``checkpoint`` and persist it in the background under the tag of ``path``;
        write the pointer file at ``path``.

        Returns once the state is copied into host memory (after waiting for the previous save,
        if it is still being persisted: see the module docstring).

        Raises:
            TypeError: ``storage_options`` given (as Lightning's ``TorchCheckpointIO``: pass them to
                the plugin instead).
            PersistError / ConsistencyError: an earlier save failed in the background.
            ValidationError / PickleNotAllowedError: the checkpoint holds something that cannot be
                saved (the key is named); nothing was written.
        """
        if storage_options is not None:
            raise TypeError("NebulaCheckpointIO.save_checkpoint does not take storage_options (got "
                            f"{storage_options!r}); pass storage_options=... to NebulaCheckpointIO(...) instead")
        t0 = time.perf_counter()
        path = os.fspath(path)
        ck = self.checkpointer
        try:
            self._settle(ck)
            self._drop_unreferenced(ck)
            step = self._start_saving(ck)
            tag = tag_for_path(path)
            handle = ck.save_async(step, checkpoint, tag=tag)
            root = canonical_root(self.root)
            started(root, tag, handle)  # a read of this path in this process waits for it, whoever reads
            self._next_step = step + 1
            self._inflight = InFlight(handle, tag, path, plain_int(checkpoint.get("global_step")))
            self._tag_steps.setdefault(tag, []).append(step)
            self._refs.saved_at(path)
            write_pointer(path, pointer_record(root, step, tag, path, checkpoint, self._refs.replacing(path, tag)))
            self.last_save_seconds = time.perf_counter() - t0
            log.debug("nebula_ckpt: Lightning checkpoint %s -> step %d (%.1f ms)", path, step,
                      1e3 * self.last_save_seconds)
        finally:  # outside fit, finished and closed before returning, refused or not
            self._outside_run()

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's checkpoint dict saved at ``path``: the newest committed checkpoint carrying
        the pointer's tag (read from the fastest tier holding it, every checksum verified); for a
        ``last*.ckpt`` path that went bad, the newest one not marked suspect (:func:`.lightning_resume.newest_pointer`).

        The root is the one the pointer names (found where the pointer is now, if its run folder
        moved). Nothing is unpickled unless the plugin has ``allow_pickle=True``. A ``path`` that
        is not a pointer is loaded with Lightning's ``TorchCheckpointIO``.

        Raises:
            FileNotFoundError: nothing at ``path``; :class:`~nebula_ckpt.NotFoundError` (a
                ``FileNotFoundError``) when no checkpoint with its tag committed.
            CorruptCheckpointError: every copy is damaged (``last*.ckpt``: or every one is marked suspect).
        """
        path = os.fspath(path)
        ptr = read_pointer(path)
        if ptr is None:
            if not exists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            log.info("nebula_ckpt: %s is not a NebulaCheckpointIO pointer; loading it with torch.load", path)
            return dict(BASES[0][1]().load_checkpoint(path, map_location=map_location, weights_only=weights_only))
        if is_last(path):  # Lightning's name for the newest: the newest not marked suspect (lightning_resume)
            ptr = newest_pointer(self._reading, await_save(ptr, path, self._options, self._own_root), path)
        return self.load_pointer(ptr, path, map_location)

    def load_pointer(self, ptr: dict[str, Any], path: str, map_location: Optional[Any] = None) -> dict[str, Any]:
        """The checkpoint dict the pointer ``ptr`` (read at ``path``) names: its tag's newest committed
        checkpoint, else (never committed) the one it replaced under another tag (``prev_tag``)."""
        ptr = await_save(ptr, path, self._options, canonical_root(self.root))
        tried = []
        prev = ptr.get("prev_tag")
        for tag in [ptr["tag"], *([prev] if isinstance(prev, str) and prev != ptr["tag"] else [])]:
            for root in candidate_roots(ptr, path):
                got = self._read_from(root, tag, map_location)
                if isinstance(got, str):
                    tried.append(got)
                    continue
                step, tree, tier = got
                if step != ptr["step"]:
                    log.warning("nebula_ckpt: %s: its save of step %d never committed (the process was killed "
                                "first?); loaded step %d from tier %s, the newest committed checkpoint of this path",
                                path, ptr["step"], step, tier)
                else:
                    log.info("nebula_ckpt: loaded %s (step %d, from tier %s)", path, step, tier)
                if not isinstance(tree, dict):
                    raise NebulaError(f"{path}: step {step} does not hold a Lightning checkpoint dict")
                return tree
        raise nothing_committed(ptr, path, tried)

    def _read_from(self, root: str, tag: str, map_location: Any) -> Any:
        """``(step, tree, tier)`` of ``tag``'s newest committed checkpoint under ``root``, or why not (a str)."""
        if self._inflight is not None and self._inflight.tag == tag and canonical_root(root) == self._own_root:
            self._settle(self.checkpointer)  # the save being read: wait until it is durable
        ck, temporary = self._reading(root)
        try:
            step, tree = ck.read(tag=tag, map_location=map_location)
        except NotFoundError as e:
            return f"{tag} under {root}: {e}"
        finally:
            if temporary:
                ck.close()
        return step, tree, (ck.last_restore or {}).get("tier")

    def _reading(self, root: str) -> tuple[Checkpointer, bool]:
        """What a read of ``root`` goes through, and whether the caller closes it: the plugin's own
        Checkpointer when it exists or a Trainer run restores on rank 0 (its monitor judges that
        restore by the losses reported); else a reader creating nothing (the root may be gone)."""
        own = canonical_root(root) == self._own_root
        if own and (self._ckpt is not None or (in_trainer_stage(("_run",)) and not other_rank())):
            return self.checkpointer, False
        return reader(self.root if own else root, self._options, own), True

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer file at ``path``, and the checkpoint it names from every tier when
        no other pointer file still names it. A symlink (``save_last="link"``) is only unlinked;
        anything else is deleted as ``TorchCheckpointIO`` does (a folder with what is in it, links
        in it unlinked), with the checkpoints tagged with its path. Where copies of a pointer file
        are looked for: :mod:`~nebula_ckpt.integrations.lightning_refs`.
        """
        path = os.fspath(path)
        if is_local(path) and os.path.islink(local(path)):
            os.remove(local(path))
            return
        ptr = read_pointer(path)
        try:
            if ptr is not None and not self._refs.owns(ptr, path):
                log.warning("nebula_ckpt: %s points into another root (%s): only the pointer file is removed", path,
                            ptr["root"])
            else:
                tag = ptr["tag"] if ptr is not None else tag_for_path(path)
                folders = self._refs.folders_for(path, ptr)
                others = self._refs.referrers(tag, folders, skip=path)
                if others:
                    log.info("nebula_ckpt: %s: its checkpoint stays, %s still name(s) it; removing the file only",
                             path, others[:3])
                    self._refs.deferred.setdefault(tag, set()).update(folders)
                else:
                    self._remove_tag(self.checkpointer, tag, path)
            remove_file(path)
            if self._ckpt is not None:
                self._drop_unreferenced(self._ckpt)
        finally:  # outside fit, finished and closed before returning, failed or not
            self._outside_run()

    def _outside_run(self) -> None:
        """A save or removal no ``teardown`` follows (:func:`in_trainer_stage` is false): finish it
        now and close the Checkpointer, so that none of its threads outlives the call (run from a
        ``finally``: also when the call fails, ``teardown`` then logging its own failure)."""
        if self._ckpt is not None and not in_trainer_stage():
            self.teardown()

    def _remove_tag(self, ck: Checkpointer, tag: str, why: str) -> None:
        """Remove every checkpoint tagged ``tag`` from every tier (the save in flight with it first)."""
        if self._inflight is not None and self._inflight.tag == tag:
            self._settle(ck)
        try:
            removed = ck.remove(tag=tag)
            log.debug("nebula_ckpt: removed %s (step(s) %s)", why, removed)
        except NotFoundError:
            log.info("nebula_ckpt: %s: no committed checkpoint carries its tag; removing the file only", why)
        self._tag_steps.pop(tag, None)
        self._refs.deferred.pop(tag, None)

    def _drop_unreferenced(self, ck: Checkpointer) -> None:
        """Remove the checkpoints whose removal waited for a copy of their pointer, once no pointer
        file names them any more (the copy removed or replaced, e.g. Lightning's ``last.ckpt``).
        Never while a save is in flight: the path it replaces keeps its older checkpoint until then."""
        if self._inflight is not None:
            return
        for tag in self._refs.unreferenced():
            self._remove_tag(ck, tag, f"the checkpoint of {tag} (no pointer file names it any more)")

    def teardown(self) -> None:
        """End of ``fit`` / ``validate`` ...: wait for every save, remove superseded steps, close
        the Checkpointer (its memory tier is freed once the newest step is on the root).

        Raises:
            PersistError / ConsistencyError: a background failure not raised yet. While another
                exception is already propagating it is logged instead (never masking it).
        """
        ck, self._ckpt = self._ckpt, None
        if ck is None:
            return
        handling = sys.exc_info()[1]  # Lightning tears down from its `except` too
        try:
            try:
                self._settle(ck)
                self._drop_unreferenced(ck)
            finally:
                self._inflight = None
                ck.close()
        except BaseException as e:
            if handling is not None:
                log.error("nebula_ckpt: NebulaCheckpointIO.teardown() during another exception also failed: %s: %s",
                          type(e).__name__, e)
                return
            raise

    # -- beyond CheckpointIO --------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the save in flight is durable everywhere, its path's older steps removed (raises its failure)."""
        if self._ckpt is not None:
            self._settle(self._ckpt)

    def take_metrics(self) -> list[tuple[Optional[int], SaveMetrics]]:
        """``(global_step, metrics)`` of each save finished since the last call, oldest first (the
        save in flight counts once it is over on every tier). :class:`NebulaSaveMetrics` logs them."""
        if self._ckpt is not None and self._inflight is not None and self._inflight.handle.done():
            self._settle(self._ckpt)
        out, self._finished = self._finished, []
        return out

    def tier_kinds(self) -> dict[str, str]:
        """Tier name -> its short name in metrics (``memory``, ``local``, ``remote``; numbered if need be)."""
        return dict(self._kinds)

    def _settle(self, ck: Checkpointer) -> None:
        """Wait for the save in flight (raising its failure), then remove the steps it superseded."""
        done, self._inflight = self._inflight, None
        if done is None:
            return
        try:
            try:
                done.handle.result()
            finally:
                finished(canonical_root(self.root), done.tag, done.handle)
        except BaseException:
            steps = self._tag_steps.get(done.tag, [])
            if done.handle.step in steps:
                steps.remove(done.handle.step)
            raise
        finally:
            self._finished.append((done.global_step, done.handle.metrics))
        if done.handle.tiers_dropped or done.handle.skipped:
            log.warning("nebula_ckpt: %s (step %d) was not written to tier(s) %s; older checkpoints of this path are "
                        "kept", done.path, done.handle.step, done.handle.tiers_dropped or "any")
            return
        older = [s for s in self._tag_steps.get(done.tag, []) if s < done.handle.step]
        for s in older:
            try:
                ck.remove(step=s)
            except NotFoundError:
                pass  # already gone (removed by hand, or never committed)
        self._tag_steps[done.tag] = [s for s in self._tag_steps.get(done.tag, []) if s >= done.handle.step]
        if older:
            log.debug("nebula_ckpt: %s: removed superseded step(s) %s", done.path, older)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``ddp_spawn`` sends the plugin to its workers): without the live Checkpointer."""
        if self._inflight is not None:
            raise NebulaError("NebulaCheckpointIO cannot be pickled while a save is in flight; call wait() first")
        state = dict(self.__dict__)
        state.update(_ckpt=None, _inflight=None, _next_step=None, _tag_steps={}, _finished=[],
                     _refs=PointerRefs(self.root))
        return state


def load_checkpoint(path: Any, map_location: Optional[Any] = None, *,
                    storage_options: Optional[dict[str, Any]] = None, allow_pickle: bool = False) -> dict[str, Any]:
    """Lightning's checkpoint dict saved at ``path`` by :class:`NebulaCheckpointIO`, without a
    Trainer or a plugin (the pointer names the root). A file that is not a pointer is loaded with
    ``torch.load`` (Lightning's ``TorchCheckpointIO``).

    ``torch.load`` of a pointer file (what ``LightningModule.load_from_checkpoint`` does) comes
    here too, once this module is imported (see :func:`open_pointer`)::

        ckpt = load_checkpoint(trainer.checkpoint_callback.best_model_path)
        model = MyModule(**ckpt["hyper_parameters"])
        model.load_state_dict(ckpt["state_dict"])

    Args:
        storage_options: fsspec options of a remote root (credentials).
        allow_pickle: as the plugin's (needed if it was saved with ``allow_pickle=True``).
    """
    path = os.fspath(path)
    ptr = read_pointer(path)
    if ptr is None:
        if not exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return dict(BASES[0][1]().load_checkpoint(path, map_location=map_location))
    return _load_record(ptr, path, map_location, storage_options, allow_pickle)


def _load_record(ptr: dict[str, Any], path: str, map_location: Any, storage_options: Optional[dict[str, Any]],
                 allow_pickle: bool) -> dict[str, Any]:
    io = NebulaCheckpointIO(candidate_roots(ptr, path)[0], storage_options=storage_options, allow_pickle=allow_pickle)
    try:
        return io.load_pointer(ptr, path, map_location=map_location)
    finally:
        io.teardown()


def open_pointer(record: dict[str, Any]) -> dict[str, Any]:
    """What ``torch.load`` of a pointer file returns: the checkpoint dict it names (its pickle is
    the call ``open_pointer(record)``), so ``LightningModule.load_from_checkpoint(path)`` works.

    Runs under ``weights_only=False``, and under ``weights_only=True`` (torch's default) once it is
    an allowed global, which importing this module makes it; without that, torch refuses the file
    naming this function. It reads a local root only, read-only, without unpickling anything (as
    :func:`load_checkpoint` with ``allow_pickle=False``); tensors are on the CPU.
    """
    path = loading_path()
    where = path or "the file torch.load reads"
    ptr = check_record(record, where, POINTER_FORMAT, POINTER_FIELDS)
    if ptr is None:
        raise NebulaError(f"{where} is not a NebulaCheckpointIO pointer: {record!r}")
    if not is_local(ptr["root"]):  # never a network request from a file's content alone
        raise NebulaError(f"{where} is a NebulaCheckpointIO pointer into the remote root {ptr['root']}: load it with "
                          "nebula_ckpt.integrations.lightning.load_checkpoint(path, storage_options=...)")
    return _load_record(ptr, path or ptr.get("path") or ptr["root"], None, None, False)


def write_pointer(path: str, pointer: dict[str, Any]) -> None:
    """Write the pointer file of record ``pointer`` at ``path`` atomically (a local file under a
    temporary name, fsync'd and renamed over ``path``; a URL with one PUT). ``torch.load`` of the
    file calls :func:`open_pointer`."""
    write_pointer_file(path, pointer, open_pointer)


for _other, _ in BASES[1:]:
    _other.register(NebulaCheckpointIO)  # both Lightning flavours installed: a CheckpointIO of each

# torch.load(weights_only=True) of a pointer file (load_from_checkpoint) may call open_pointer
torch.serialization.add_safe_globals([open_pointer])

__all__ = ["NebulaCheckpointIO", "POINTER_FORMAT", "load_checkpoint", "open_pointer", "read_pointer", "tag_for_path",
           "write_pointer", "NebulaSaveMetrics"]
