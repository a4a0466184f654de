"""PyTorch Lightning: a ``CheckpointIO`` plugin that saves through nebula_ckpt's tiers.

One line in the user's script::

    from nebula_ckpt.integrations.lightning import NebulaCheckpointIO

    trainer = Trainer(plugins=[NebulaCheckpointIO("/ckpt/run-42")],
                      callbacks=[ModelCheckpoint(dirpath="ckpts", monitor="val_loss", save_top_k=3, save_last=True)])
    trainer.fit(model, ckpt_path="last")     # resumes from the newest committed "last.ckpt", if any

Works with ``pytorch_lightning`` (``pip install 'nebula_ckpt[lightning]'``) and with the unified
``lightning`` package (``lightning.pytorch``): the class is a ``CheckpointIO`` of whichever is
installed, and is registered as one of the other when both are.

Design: a checkpoint per path, a pointer file at the path
--------------------------------------------------------

Lightning addresses checkpoints by *file path* and keeps its own bookkeeping on the file system:
``ModelCheckpoint`` checks whether a name exists (version counters), globs its folder for
``last*.ckpt`` to resolve ``ckpt_path="last"`` (newest by modification time), symlinks ``last.ckpt``
with ``save_last="link"``, and asks the strategy to remove the files that fell out of the top k.
To keep all of that working unchanged, :meth:`NebulaCheckpointIO.save_checkpoint` does two things:

1. ``Checkpointer.save_async(step, checkpoint, tag=<path>)``: the checkpoint dict goes through the
   tiers (memory tier in ``/dev/shm``, then the root's disk or blob tier) under the tag of its
   path (:func:`tag_for_path`: the absolute path; characters a tag cannot hold are escaped).
   ``step`` is not Lightning's ``global_step`` (top-k and ``last.ckpt`` are two checkpoints of
   one global step, and a committed step is never overwritten) but a counter of this root's
   saves: one more than the newest committed step when the plugin starts.
2. A small JSON *pointer file* at ``path`` (``{"format", "root", "step", "tag", "path",
   "global_step", "epoch"}``; ``path``: where it was written, so a copy still names it), written
   to a temporary name, fsync'd and renamed over ``path``, so it is never torn.
   ``exists``, globbing, modification times and symlinks are Lightning's as before.

:meth:`~NebulaCheckpointIO.load_checkpoint` reads the pointer and restores the newest *committed*
checkpoint carrying its tag (``Checkpointer.read(tag=...)``, every checksum verified): after a
crash the pointer may name a save that never committed (it is written when the save starts),
and the tag then resolves to the previous checkpoint saved at that path, e.g. the ``last.ckpt``
before, which is exactly what survived. A path that is not a pointer (a ``torch.save`` file from
another run) is loaded with Lightning's ``TorchCheckpointIO``. The root a pointer names is opened
read-only unless it is the plugin's own root and the plugin already writes it: a load creates
nothing there, whatever a (crafted) pointer names.
:meth:`~NebulaCheckpointIO.remove_checkpoint` removes the tag's checkpoints from every tier
(``Checkpointer.remove(tag=...)``: commit marker first) and then the pointer; a symlink is only
unlinked (with ``save_last="link"`` it points at a checkpoint that stays). A pointer file may be a
*copy* (Lightning copies ``epoch=N.ckpt`` to ``last.ckpt`` where ``save_last="link"`` cannot link;
a user's ``cp``): it names the checkpoint of the path it was copied from. So the checkpoint is
removed only when no other pointer file names it: the file at the path it was written at, the
files in the folder of the one removed and in every folder the plugin saved to are looked at
(pointer-sized files only). While one does, only the file goes; once the last of them is gone
(removed through the plugin, or replaced behind its back as Lightning replaces ``last.ckpt``), the
checkpoint is removed at the plugin's next save, removal or teardown. A copy kept in another
folder is not seen (load it with :func:`load_checkpoint` and ``torch.save`` it to keep it).

Retention belongs to Lightning: the root's tier keeps every checkpoint (``keep_last`` is set
beyond reach) and only Lightning's ``remove_checkpoint`` deletes. A path saved again
(``last.ckpt`` at every save) gets a new step; the older step(s) with the same tag are removed
once the new one is durable, so a crash in between never leaves the path without a checkpoint.
The memory tier keeps its default of the newest checkpoint only (RAM): the other checkpoints
are read from the root's tier.

Blocking and ordering
---------------------

Lightning hands over a plain dict of ``state_dict()`` results (live parameter and optimizer
tensors), so the copy into host memory is synchronous (see README, "What can overlap the copy"):
``save_checkpoint`` returns once the state is copied (one parallel memcpy) and everything else
(checksums, shards, fsync, manifest, commit, pruning) runs in the background. Measured on the
project's 2-core CPU machine, a 151 MB checkpoint (12.6M parameters + AdamW): 32-45 ms per save
(the first one 1.2 s: it creates the tiers and the staging memory), against 0.8-0.9 s for
Lightning's ``TorchCheckpointIO``. Wrapping the plugin in Lightning's ``AsyncCheckpointIO`` adds
nothing (it clones every tensor first).

The core drops a save still *pending* for a busy tier when a newer one arrives (right for a
rolling checkpoint, wrong for Lightning's top-k files, each of which must reach the root), so
the plugin keeps **one save in flight**: a save that comes while the previous one is still being
persisted first waits for it. With checkpoints further apart than one persist takes, nothing
waits; ``ModelCheckpoint(save_top_k=k, save_last=True)`` saves two checkpoints at the same step,
and the second waits for the first (measured above: 136 ms instead of 36 ms; ``save_last="link"``
makes it one save).

Failures of a background persist are raised by the next ``save_checkpoint`` (so ``fit`` stops
with it) and by :meth:`~NebulaCheckpointIO.teardown` at the end of ``fit`` (which waits for every
save, removes superseded steps and closes the :class:`~nebula_ckpt.Checkpointer`; while another
exception is already propagating it is logged instead, never masking that one).

``LightningModule.load_from_checkpoint(path)`` reads ``path`` with ``torch.load`` and never asks
the ``CheckpointIO``, so it cannot read a pointer: use :func:`load_checkpoint` instead
(``model.load_state_dict(load_checkpoint(path)["state_dict"])``, or ``torch.save`` its dict to a
file first). ``trainer.fit / validate / test / predict(ckpt_path=...)`` go through the plugin.

Multi-process strategies: Lightning calls ``save_checkpoint`` / ``remove_checkpoint`` on global
rank 0 only (DDP's state is replicated), so the plugin's Checkpointer is a one-process writer
(``LocalCoordinator``) even when a process group exists; ``load_checkpoint`` runs on every rank
and reads from the root (and the memory tier, on rank 0's host); checked by hand with
``strategy="ddp"`` and ``"ddp_spawn"`` on 2 CPU processes (the plugin pickles without its
Checkpointer). Strategies that save sharded
state themselves (FSDP ``state_dict_type="sharded"``, DeepSpeed) do not go through a
``CheckpointIO`` for it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from nebula_ckpt.checkpointer import Checkpointer
from nebula_ckpt.errors import NebulaError, NotFoundError
from nebula_ckpt.format.names import MAX_TAG_CHARS, tag_problem
from nebula_ckpt.handle import SaveHandle
from nebula_ckpt.integrations.pointers import (
    MAX_POINTER_BYTES,
    TMP_SUFFIX,
    parse_pointer,
    read_pointer_head,
    write_local_pointer,
)
from nebula_ckpt.ranks.coordinator import LocalCoordinator
from nebula_ckpt.tiers import Tier, canonical_root, refuse_url_credentials

log = logging.getLogger(__name__)

#: ``format`` field of a pointer file (its version is the number after the slash)
POINTER_FORMAT = "nebula_ckpt.lightning/1"
#: a file larger than this is never taken for a pointer (a pointer is a few hundred bytes)
#: the root tier's retention: Lightning decides what is deleted, through remove_checkpoint
KEEP_ALL = 1 << 40

_TAG_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:@=+,/-")
_INSTALL_HINT = ("nebula_ckpt.integrations.lightning needs PyTorch Lightning: pip install 'nebula_ckpt[lightning]' "
                 "(pytorch-lightning) or pip install lightning")


def _lightning_bases() -> list[tuple[Any, Any]]:
    """``(CheckpointIO, TorchCheckpointIO)`` of each Lightning flavour installed, unified
    ``lightning`` first, then ``pytorch_lightning``'s ``lightning_fabric``."""
    found: list[tuple[Any, Any]] = []
    for pkg in ("lightning.fabric.plugins.io", "lightning_fabric.plugins.io"):
        try:
            base = importlib.import_module(f"{pkg}.checkpoint_io").CheckpointIO
            torch_io = importlib.import_module(f"{pkg}.torch_io").TorchCheckpointIO
        except ImportError:
            continue
        found.append((base, torch_io))
    if not found:
        raise ImportError(_INSTALL_HINT)
    return found


_BASES = _lightning_bases()

if TYPE_CHECKING:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO
else:
    _CheckpointIO = _BASES[0][0]


def tag_for_path(path: str) -> str:
    """The tag a checkpoint saved at ``path`` carries: the absolute path (local paths through the
    real path of their folder, so ``ckpts/x.ckpt`` and ``./ckpts/x.ckpt`` agree; the file name
    itself is kept, so a ``last.ckpt`` symlink is not resolved), URLs as they are.

    Characters a tag cannot hold (and ``~``, the escape character) become ``~XX`` (UTF-8 bytes in
    hex); a result longer than a tag may be becomes ``~h<hash>~`` and its last characters. The
    mapping is deterministic, and injective up to the hash.
    """
    if "://" not in path:
        path = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(os.path.expanduser(path)))),
                            os.path.basename(path))
    out = []
    for ch in path:
        if ch in _TAG_CHARS:
            out.append(ch)
        else:
            out.extend(f"~{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))
    tag = "".join(out)
    if len(tag) > MAX_TAG_CHARS:
        digest = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:32]
        head = f"~h{digest}~"
        start = len(tag) - (MAX_TAG_CHARS - len(head))
        for back in (1, 2):  # never start inside an escape sequence (3 characters, "~" first)
            if tag[start - back] == "~":
                start += 3 - back
                break
        tag = head + tag[start:]
    assert tag_problem(tag) is None, tag
    return tag


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _fs(path: str) -> Any:
    import fsspec

    return fsspec.core.url_to_fs(path)[0]


def write_pointer(path: str, pointer: dict[str, Any]) -> None:
    """Write the pointer file at ``path`` atomically: a local file under a temporary name in the
    same folder, fsync'd and renamed over ``path`` (its temporary name never matches Lightning's
    ``last*.ckpt`` glob); a URL with one PUT (blob stores replace an object atomically)."""
    if not _is_local(path):
        data = (json.dumps(pointer, indent=1, sort_keys=True) + "\n").encode()
        fs = _fs(path)
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)
        return
    write_local_pointer(_local(path), pointer)


def read_pointer(path: str) -> Optional[dict[str, Any]]:
    """The pointer at ``path``, or ``None`` when ``path`` is not one (missing, too large, not our
    JSON: e.g. a ``torch.save`` file). A pointer with our format but bad fields raises
    :class:`NebulaError` naming the field."""
    try:
        if _is_local(path):
            data = read_pointer_head(_local(path))  # never blocks on a FIFO, never follows a link loop
        else:
            fs = _fs(path)
            if not fs.exists(path) or fs.size(path) > MAX_POINTER_BYTES:
                return None
            data = fs.cat_file(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    ptr = parse_pointer(data, path, POINTER_FORMAT, {"root": str, "tag": str, "step": int})
    if ptr is None:
        return None
    why = tag_problem(ptr["tag"])
    if why is not None:
        raise NebulaError(f"{path}: pointer field 'tag': {why}")
    return ptr


def _remove_file(path: str) -> None:
    """Delete ``path`` (a pointer, a link or a foreign checkpoint file) if it exists."""
    if _is_local(path):
        p = _local(path)
        if os.path.islink(p) or os.path.isfile(p):
            os.remove(p)
        return
    fs = _fs(path)
    if fs.exists(path):
        fs.rm(path)


@dataclass
class _InFlight:
    """The one save in flight: its handle, its tag and path."""

    handle: SaveHandle
    tag: str
    path: str


class NebulaCheckpointIO(_CheckpointIO):
    """Lightning ``CheckpointIO`` that saves asynchronously through nebula_ckpt's tiers.

    ``Trainer(plugins=[NebulaCheckpointIO("/ckpt/run-42")], callbacks=[ModelCheckpoint(...)])``:
    each checkpoint Lightning saves at a path is a nebula_ckpt checkpoint tagged with that path,
    and the path holds a small pointer file to it (see the module docstring for why).

    Args:
        root: the :class:`~nebula_ckpt.Checkpointer` root (path or fsspec URL): where the
            checkpoints' bytes live. It is not Lightning's ``dirpath``, where the pointers go.
        storage_options: fsspec options of a remote ``root`` (credentials).
        tiers: explicit tiers, fastest first (default: memory tier, then ``root``). A
            ``keep_last`` set on a persistent tier lets its retention delete checkpoints
            Lightning still tracks (logged); leave it unset.
        memory_tier: add the default memory tier (``/dev/shm``; ignored with ``tiers``).
        max_host_bytes: cap on host staging memory (see ``Checkpointer``).
        allow_pickle: let values typed JSON cannot hold (unusual ``hyper_parameters``) be saved and
            loaded through pickle.
        snapshot: the ``Checkpointer``'s snapshot mode (Lightning's dict of live tensors is
            copied synchronously whatever it says, see the module docstring).

    Attributes:
        last_save_seconds: how long the last ``save_checkpoint`` blocked the training loop.
    """

    def __init__(self, root: str, *, storage_options: Optional[dict[str, Any]] = None,
                 tiers: Optional[Sequence[Tier]] = None, memory_tier: bool = True,
                 max_host_bytes: Optional[int] = None, allow_pickle: bool = False, snapshot: str = "auto") -> None:
        super().__init__()
        if not isinstance(root, str) or not root:
            raise NebulaError(f"NebulaCheckpointIO: root must be a non-empty path or URL string, got {root!r}")
        refuse_url_credentials(root)  # before it is kept, logged or written into a pointer file
        self.root = root
        self._options: dict[str, Any] = {"storage_options": storage_options, "tiers": tiers,
                                         "memory_tier": memory_tier, "max_host_bytes": max_host_bytes,
                                         "allow_pickle": allow_pickle, "snapshot": snapshot}
        for t in tiers or ():
            if isinstance(t, Tier) and t.persistent and t.keep_last is not None:
                log.warning("nebula_ckpt: NebulaCheckpointIO: tier %s has keep_last=%d: its retention may delete "
                            "checkpoints Lightning's ModelCheckpoint still tracks (leave keep_last unset: "
                            "Lightning removes what it no longer needs)", t.name, t.keep_last)
        self._ckpt: Optional[Checkpointer] = None
        self._inflight: Optional[_InFlight] = None
        self._next_step: Optional[int] = None
        #: committed (or in-flight) steps per tag known to this plugin, for removing superseded ones
        self._tag_steps: dict[str, list[int]] = {}
        #: folders this plugin wrote pointer files in (where copies of them are looked for)
        self._folders: set[str] = set()
        #: tag -> folders: checkpoints whose pointer was removed while a copy still named them
        self._deferred: dict[str, set[str]] = {}
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
                                      memory_tier=o["memory_tier"], max_host_bytes=o["max_host_bytes"],
                                      allow_pickle=o["allow_pickle"], snapshot=o["snapshot"], keep_last=KEEP_ALL,
                                      coordinator=LocalCoordinator())
            self._next_step = None
            self._tag_steps = {}
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
        self._settle(ck)
        self._drop_unreferenced(ck)
        step = self._start_saving(ck)
        tag = tag_for_path(path)
        handle = ck.save_async(step, checkpoint, tag=tag)
        self._next_step = step + 1
        self._inflight = _InFlight(handle, tag, path)
        self._tag_steps.setdefault(tag, []).append(step)
        self._folders.add(_folder(path))
        write_pointer(path, {"format": POINTER_FORMAT, "root": canonical_root(self.root), "step": step, "tag": tag,
                             "path": _abs(path), "global_step": _plain_int(checkpoint.get("global_step")),
                             "epoch": _plain_int(checkpoint.get("epoch"))})
        self.last_save_seconds = time.perf_counter() - t0
        log.debug("nebula_ckpt: Lightning checkpoint %s -> step %d (%.1f ms blocking)", path, step,
                  1e3 * self.last_save_seconds)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's checkpoint dict saved at ``path``: the newest committed checkpoint carrying
        the pointer's tag (read from the fastest tier holding it, every checksum verified).

        ``weights_only`` has nothing to guard here (nothing is unpickled unless the plugin was
        made with ``allow_pickle=True``). A ``path`` that is not a pointer is loaded with
        Lightning's ``TorchCheckpointIO`` (a ``torch.save`` checkpoint from elsewhere).

        Raises:
            FileNotFoundError: nothing at ``path``; :class:`~nebula_ckpt.NotFoundError` (a
                ``FileNotFoundError``) when no checkpoint with its tag committed.
            CorruptCheckpointError: every copy of it is damaged.
        """
        path = os.fspath(path)
        ptr = read_pointer(path)
        if ptr is None:
            if not _exists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            log.info("nebula_ckpt: %s is not a NebulaCheckpointIO pointer; loading it with torch.load", path)
            return dict(_BASES[0][1]().load_checkpoint(path, map_location=map_location, weights_only=weights_only))
        own = canonical_root(ptr["root"]) == canonical_root(self.root)
        if own and self._inflight is not None and self._inflight.tag == ptr["tag"]:
            self._settle(self.checkpointer)  # the save being read: wait until it is durable
        # the writer when this plugin already writes the root; else a reader that creates nothing
        # (the root a file names may not exist, or be another run's)
        ck = self._ckpt if own and self._ckpt is not None else self._reader(ptr["root"], own)
        try:
            try:
                step, tree = ck.read(tag=ptr["tag"], map_location=map_location)
            except NotFoundError as e:
                raise NotFoundError(f"{path}: no committed checkpoint of this path under {ptr['root']} (its save of "
                                    f"step {ptr['step']} never committed and there is no earlier one): {e}") from e
        finally:
            if ck is not self._ckpt:
                ck.close()
        tier = (ck.last_restore or {}).get("tier")
        if step != ptr["step"]:
            log.warning("nebula_ckpt: %s: its save of step %d never committed (the process was killed first?); "
                        "loaded step %d from tier %s, the newest committed checkpoint of this path", path,
                        ptr["step"], step, tier)
        else:
            log.info("nebula_ckpt: loaded %s (step %d, from tier %s)", path, step, tier)
        if not isinstance(tree, dict):
            raise NebulaError(f"{path}: step {step} does not hold a Lightning checkpoint dict")
        return tree

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer file at ``path``, and the checkpoint it names from every tier when
        no other pointer file still names it. A symlink (``save_last="link"``) is only unlinked;
        a file that is not a pointer is deleted (with the checkpoints tagged with its path).

        A pointer file may be a copy (Lightning copies ``epoch=N.ckpt`` to ``last.ckpt`` where
        ``save_last="link"`` cannot make a link; a user's ``cp``): its content names the checkpoint
        of the path it was written at. The checkpoint stays while a pointer file at that path, in
        the folder of ``path`` or in a folder this plugin saved to still names it; it is removed
        once the last of them is gone (at this plugin's next save, removal or teardown, when the
        last one was replaced behind its back, as Lightning replaces ``last.ckpt``).
        """
        path = os.fspath(path)
        if _is_local(path) and os.path.islink(_local(path)):
            os.remove(_local(path))
            return
        ptr = read_pointer(path)
        if ptr is not None and canonical_root(ptr["root"]) != canonical_root(self.root):
            log.warning("nebula_ckpt: %s points into another root (%s): only the pointer file is removed", path,
                        ptr["root"])
        else:
            tag = ptr["tag"] if ptr is not None else tag_for_path(path)
            folders = {_folder(path), *self._folders}
            written_at = (ptr or {}).get("path")
            if isinstance(written_at, str) and _is_local(written_at) == _is_local(path):
                folders.add(_folder(written_at))  # where the original is (never another kind of store)
            others = self._referrers(tag, folders, skip=path)
            if others:
                log.info("nebula_ckpt: %s: its checkpoint stays, %s still name(s) it; removing the file only", path,
                         others[:3])
                self._deferred.setdefault(tag, set()).update(folders)
            else:
                self._remove_tag(tag, path)
        _remove_file(path)
        if self._ckpt is not None:
            self._drop_unreferenced(self._ckpt)

    def _remove_tag(self, tag: str, why: str) -> None:
        """Remove every checkpoint tagged ``tag`` from every tier (the save in flight with it first)."""
        ck = self.checkpointer
        if self._inflight is not None and self._inflight.tag == tag:
            self._settle(ck)
        try:
            removed = ck.remove(tag=tag)
            log.debug("nebula_ckpt: removed %s (step(s) %s)", why, removed)
        except NotFoundError:
            log.info("nebula_ckpt: %s: no committed checkpoint carries its tag; removing the file only", why)
        self._tag_steps.pop(tag, None)
        self._deferred.pop(tag, None)

    def _referrers(self, tag: str, folders: set[str], skip: Optional[str] = None) -> list[str]:
        """Pointer files in ``folders`` (but ``skip``) naming the checkpoint tagged ``tag`` of this root."""
        mine = canonical_root(self.root)
        skip_abs = _abs(skip) if skip is not None else None
        out = []
        for folder in sorted(folders):
            for p in _small_files(folder):
                if p == skip_abs or p.endswith(TMP_SUFFIX):  # a pointer being written (or left by a crash)
                    continue
                try:
                    ptr = read_pointer(p)
                except (NebulaError, OSError):
                    continue  # not a readable pointer: names nothing
                if ptr is not None and ptr["tag"] == tag and canonical_root(ptr["root"]) == mine:
                    out.append(p)
        return out

    def _drop_unreferenced(self, ck: Checkpointer) -> None:
        """Remove the checkpoints whose removal waited for a copy of their pointer, once no pointer
        file names them any more (the copy removed or replaced, e.g. Lightning's ``last.ckpt``)."""
        for tag, folders in list(self._deferred.items()):
            if self._inflight is not None and self._inflight.tag == tag:
                continue  # saved again: its path names it
            if not self._referrers(tag, folders):
                self._remove_tag(tag, f"the checkpoint of {tag} (no pointer file names it any more)")

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
        """Block until the save in flight is durable on every tier and older steps of its path are
        removed (what the next save and :meth:`teardown` do first). Raises its failure."""
        if self._ckpt is not None:
            self._settle(self._ckpt)

    def _settle(self, ck: Checkpointer) -> None:
        """Wait for the save in flight (raising its failure), then remove the steps it superseded."""
        done, self._inflight = self._inflight, None
        if done is None:
            return
        try:
            done.handle.result()
        except BaseException:
            steps = self._tag_steps.get(done.tag, [])
            if done.handle.step in steps:
                steps.remove(done.handle.step)
            raise
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

    def _reader(self, root: str, own: bool = False) -> Checkpointer:
        """A read-only Checkpointer on the root a pointer names (``own``: this plugin's root, read
        through its tiers): it creates nothing there, not even the root's folder."""
        o = self._options
        if own:
            return Checkpointer(self.root, storage_options=o["storage_options"], tiers=o["tiers"],
                                memory_tier=o["memory_tier"], allow_pickle=o["allow_pickle"],
                                coordinator=LocalCoordinator(), read_only=True)
        return Checkpointer(root, storage_options=o["storage_options"] if not _is_local(root) else None,
                            allow_pickle=o["allow_pickle"], coordinator=LocalCoordinator(), read_only=True)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``ddp_spawn`` sends the plugin to its workers): without the live Checkpointer."""
        if self._inflight is not None:
            raise NebulaError("NebulaCheckpointIO cannot be pickled while a save is in flight; call wait() first")
        state = dict(self.__dict__)
        state.update(_ckpt=None, _inflight=None, _next_step=None, _tag_steps={}, _deferred={})
        return state


def load_checkpoint(path: Any, map_location: Optional[Any] = None, *,
                    storage_options: Optional[dict[str, Any]] = None, allow_pickle: bool = False) -> dict[str, Any]:
    """Lightning's checkpoint dict saved at ``path`` by :class:`NebulaCheckpointIO`, without a
    Trainer or a plugin (the pointer names the root). A file that is not a pointer is loaded with
    ``torch.load`` (Lightning's ``TorchCheckpointIO``).

    For what reads checkpoint files itself, e.g. ``LightningModule.load_from_checkpoint``::

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
        if not _exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return dict(_BASES[0][1]().load_checkpoint(path, map_location=map_location))
    io = NebulaCheckpointIO(ptr["root"], storage_options=storage_options, allow_pickle=allow_pickle)
    try:
        return io.load_checkpoint(path, map_location=map_location)
    finally:
        io.teardown()


for _other, _ in _BASES[1:]:
    _other.register(NebulaCheckpointIO)  # both Lightning flavours installed: a CheckpointIO of each


def _plain_int(v: Any) -> Optional[int]:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _abs(path: str) -> str:
    """``path`` as the pointer files record it: local paths absolute (folder resolved, as
    :func:`tag_for_path`), URLs as they are."""
    if _is_local(path):
        p = _local(path)
        return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(os.path.expanduser(p)))),
                            os.path.basename(p))
    return path


def _folder(path: str) -> str:
    return os.path.dirname(_abs(path))


def _small_files(folder: str) -> list[str]:
    """Paths of the files in ``folder`` small enough to be pointers (none when it is missing)."""
    if _is_local(folder):
        try:
            with os.scandir(_local(folder)) as it:
                # a symlink is not a copy: it names whatever its target names (save_last="link")
                return [os.path.join(folder, e.name) for e in it if e.is_file(follow_symlinks=False)
                        and e.stat(follow_symlinks=False).st_size <= MAX_POINTER_BYTES]
        except OSError:
            return []
    try:
        entries = _fs(folder).ls(folder, detail=True)
    except (OSError, ValueError):
        return []
    return [e["name"] if "://" in e["name"] else f"{folder.split('://')[0]}://{e['name']}" for e in entries
            if e.get("type") == "file" and (e.get("size") or 0) <= MAX_POINTER_BYTES]


def _exists(path: str) -> bool:
    if _is_local(path):
        return os.path.exists(_local(path))
    return bool(_fs(path).exists(path))


__all__ = ["NebulaCheckpointIO", "POINTER_FORMAT", "load_checkpoint", "read_pointer", "tag_for_path", "write_pointer"]
