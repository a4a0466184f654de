"""DeepSpeed checkpoints through nebula_ckpt: ``engine.save_checkpoint`` / ``engine.load_checkpoint``
unchanged, the bytes in a :class:`~nebula_ckpt.Checkpointer` (memory tier, disk, blob).

Switch it on once, after ``deepspeed.initialize``::

    import deepspeed
    from nebula_ckpt.integrations import deepspeed as nds

    engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    nds.enable(engine, "/ckpt/run-42")            # or "az://c/run-42", tiers=[...], keep_last=...
    ...
    engine.save_checkpoint("/ckpt/ds", tag=f"global_step{engine.global_steps}")   # as before
    ...
    engine.load_checkpoint("/ckpt/ds")            # tag=None: `latest`'s, unless marked suspect

Why a function and not a config key: DeepSpeed 0.19.8 picks its checkpoint engine in
``DeepSpeedEngine._configure_checkpointing`` from a fixed list (no plug-in entry; its ``nebula``
config block is gone). ``enable`` replaces ``engine.checkpoint_engine``, the attribute every save /
load goes through, with a :class:`NebulaCkptEngine` (apart from DeepSpeed's former
``NebulaCheckpointEngine``), and ``engine.load_checkpoint`` by one that picks the tag when none is
given (below). Call it on every rank (the Checkpointer's constructor is a collective). Every
data-parallel rank includes the model states in its checkpoint (DeepSpeed has only rank 0 save
them), so each rank restores from its own memory tier; a shared tier stores those bytes once.

What happens on ``save_checkpoint(save_dir, tag)``:

* DeepSpeed calls ``create(tag)``, then ``save(state_dict, path)`` once per file (the model states
  ``<tag>/mp_rank_00_model_states.pt``, each ZeRO rank's
  ``<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, MoE expert files ...), then
  ``commit(tag)``. The engine collects the ``save`` calls and, at ``commit``, saves them as *one*
  checkpoint ``{path relative to save_dir/tag: state_dict}`` with ``save_async(step, parts,
  tag=tag)``. DeepSpeed's state dicts hold live tensors, so the copy into host memory is done
  when ``commit`` returns (no clone first: ``preserves_storage_sharing()`` is False, nebula_ckpt
  stores each tensor's own bytes); persisting runs in the background.
* ``commit`` returns once the checkpoint is committed on its first tier (the memory tier, in
  milliseconds; ``durable="all"`` waits for every tier, ``"snapshot"`` for none). Only then does
  it write, for every saved path, a small *pointer file* at that path (JSON naming the root, tag,
  step and part, written atomically), and DeepSpeed then writes its own ``latest`` file. So a
  process killed at any moment never leaves ``latest`` or a pointer naming a checkpoint that no
  tier holds. The pointers keep DeepSpeed's own file checks working (``load_checkpoint`` globs
  ``<tag>/mp_rank_*_model_states.pt``; ZeRO checks ``os.path.exists`` on partition files).
* The step number is ``engine.global_steps``, or the next free number when that step is already
  taken by a committed checkpoint (two tags saved at one global step stay two checkpoints). In a
  multi-rank job the ranks agree on it (the maximum).
* Files DeepSpeed writes *outside* the tag folder (``save_16bit_model``'s consolidated weights,
  meant for other tools) are written with ``torch.save`` as before.

What happens on ``load_checkpoint(save_dir, tag=None)``: the tag ``latest`` names, unless it was
passed over (newer than the newest checkpoint not marked suspect, docs/health.md): then that one
(:meth:`NebulaCkptEngine.latest_tag`; ``CorruptCheckpointError`` when every one is suspect); a
tag given by name is loaded whatever its mark (with a warning). DeepSpeed calls ``load(path)``
for each file; the engine reads the pointer, restores the checkpoint with that tag from the
fastest tier that has it (CRC32C-checked; a damaged copy falls back to the next tier, then to an
older checkpoint with the same tag) once per ``load_checkpoint``, and hands each part out. A path
holding an ordinary ``torch.save`` file (written before ``enable``) is loaded with ``torch.load``.

Things to know:

* Retention is DeepSpeed's by default: every checkpoint is kept, one per tag: a save with a tag
  saved before removes the older steps carrying it once it is durable on every tier (at the next
  commit, or at ``wait`` / ``close``; each rank its own copies). With ``keep_last=N`` (or
  ``keep_every``, or a Checkpointer of your own) nebula_ckpt's retention drops older checkpoints
  per tier, and the engine removes the pointer files (and empty tag folders) of every tag no tier
  holds any more, at each commit and at ``wait`` / ``close``.
* ``allow_pickle=True`` is the default here: DeepSpeed's states hold Python objects (its
  ``LossScaler``, ZeRO's ``fragment_address``), and it loads with ``weights_only=False`` itself.
* The pointer files are ``torch.save`` archives whose pickle calls :func:`open_pointer`: tools that
  ``torch.load(weights_only=False)`` them (``zero_to_fp32.py``, DeepSpeed without ``enable``) get
  the part named, read from the root. :func:`materialize` writes a tag's real ``torch.save`` files.
* A save folder moved or copied with its root (one run folder) still loads (the pointers name the
  root relative to themselves too). The root must not be ``save_dir`` itself. A lost ``save_dir``
  (the checkpoints survive on a slower tier): :meth:`NebulaCkptEngine.restore_pointers`.
* Not supported: features that read files other ranks wrote (ZeRO's ``elastic_checkpoint``,
  pipeline-parallel layer files with several data-parallel ranks, another data-parallel world
  size) or the folder directly (universal checkpoints; NVMe-offload folders are copied by DeepSpeed
  as real files): such a load raises ``NotFoundError`` naming the part; ``materialize`` first.
* Call :meth:`NebulaCkptEngine.close` (or let interpreter exit do it) to finish the background
  persists; DeepSpeed's ``engine.destroy()`` does not.
* Loads are read into host memory (a ``map_location`` that is not a device keeps them there);
  DeepSpeed copies them into the model and optimizer, as with ``torch.load``.

Install: ``pip install 'nebula_ckpt[deepspeed]'`` (DeepSpeed 0.19.8; on a machine without CUDA,
``DS_BUILD_OPS=0`` and ``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from typing import Any, Callable, Optional

import torch

from nebula_ckpt import Checkpointer, SaveHandle
from nebula_ckpt.adapters import canonical_root, write_file_atomic
from nebula_ckpt.errors import FencedError, NotFoundError, OtherRanksError, PersistError, ValidationError
from nebula_ckpt.integrations.deepspeed_files import (
    POINTER_FORMAT,
    check_tag_folder,
    materialize,
    open_pointer,
    pointers_in,
    read_pointer,
    remove_empty_folders,
    root_of,
    tag_folders,
    to_device,
    write_pointer,
)
from nebula_ckpt.integrations.deepspeed_resume import latest_tag, resume_tag
from nebula_ckpt.integrations.pointers import candidate_roots

log = logging.getLogger("nebula_ckpt")

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
except ImportError as _e:  # pragma: no cover - exercised only without deepspeed
    raise ImportError("nebula_ckpt.integrations.deepspeed needs DeepSpeed: pip install 'nebula_ckpt[deepspeed]' "
                      f"(DS_BUILD_OPS=0 on a machine without CUDA): {_e}") from _e

__all__ = ["NebulaCkptEngine", "enable", "materialize", "open_pointer", "POINTER_FORMAT", "KEEP_ALL"]

_DURABLE = ("first", "all", "snapshot")
#: the default ``keep_last``: every checkpoint is kept, as stock DeepSpeed does
KEEP_ALL = 1 << 40


class NebulaCkptEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` writing through a :class:`~nebula_ckpt.Checkpointer`.

    Usually made by :func:`enable`. See the module docstring for what each call does.

    Args:
        root: the Checkpointer's root (path or fsspec URL); or pass ``checkpointer``.
        checkpointer: an existing :class:`~nebula_ckpt.Checkpointer` to write through (not closed
            by :meth:`close` unless ``own=True``).
        step_fn: the step of the next checkpoint (``enable`` passes ``engine.global_steps``);
            without it, the next free number.
        durable: when ``commit`` returns: ``"first"`` (default) committed on the first tier (the
            memory tier: ``latest`` never names a checkpoint no tier holds), ``"all"`` on every
            tier, ``"snapshot"`` once the copy into host memory is done.
        **checkpointer_kwargs: for the Checkpointer made from ``root`` (``tiers``, ``keep_last``,
            ``storage_options`` ...; ``allow_pickle`` defaults to True here).
    """

    def __init__(self, root: Optional[str] = None, *, checkpointer: Optional[Checkpointer] = None,
                 step_fn: Optional[Callable[[], int]] = None, durable: str = "first", own: Optional[bool] = None,
                 **checkpointer_kwargs: Any) -> None:
        super().__init__(None)
        self.name = "NebulaCkptEngine"
        if durable not in _DURABLE:
            raise ValidationError(f"durable must be one of {_DURABLE}, got {durable!r}")
        if (root is None) == (checkpointer is None):
            raise ValidationError("NebulaCkptEngine: give either root or checkpointer (exactly one)")
        #: drop the pointer files of checkpoints retention removed (a retention the user chose)
        self.prune = checkpointer is not None or any(k in checkpointer_kwargs for k in ("keep_last", "tiers"))
        if checkpointer is None:
            checkpointer_kwargs.setdefault("allow_pickle", True)
            checkpointer_kwargs.setdefault("keep_last", KEEP_ALL)  # as stock DeepSpeed: keep every checkpoint
            checkpointer = Checkpointer(str(root), **checkpointer_kwargs)
            own = True if own is None else own
        elif checkpointer_kwargs:
            raise ValidationError(f"NebulaCkptEngine: {sorted(checkpointer_kwargs)} apply to a Checkpointer made "
                                  "from root; the one given is used as it is")
        #: the Checkpointer every save and load goes through
        self.checkpointer = checkpointer
        self._own = bool(own)
        self._root = canonical_root(checkpointer.root)
        self._step_fn = step_fn
        self.durable = durable
        self._info: Optional[CheckpointCommitInfo] = None
        self._parts: dict[str, Any] = {}
        self._paths: dict[str, str] = {}
        self._last_step: Optional[int] = None
        #: the save folders DeepSpeed saved into (whose tag folders prune() looks at)
        self._save_dirs: set[str] = set()
        #: saves whose older steps with the same tag go once they are durable; tag -> its steps
        self._pending: list[SaveHandle] = []
        self._tag_steps: dict[str, list[int]] = {}
        # (tag, step, {key: state_dict}) of the checkpoint being loaded; parts are dropped as served
        self._cache: Optional[tuple[str, int, dict[str, Any]]] = None

    def __repr__(self) -> str:
        return f"NebulaCkptEngine({self._root!r})"

    # -- saving -----------------------------------------------------------------------------------
    def _tag_dir(self) -> Optional[str]:
        if self._info is None:
            return None
        return os.path.abspath(os.path.join(self._info.save_dir, str(self._info.tag)))

    def create(self, info: CheckpointCommitInfo) -> None:
        """Start collecting the files of checkpoint ``info.tag`` (raises on a tag nebula_ckpt refuses)."""
        check_tag_folder(str(info.tag))
        if os.path.realpath(os.path.abspath(info.save_dir)) == self._root:
            raise ValidationError(f"DeepSpeed save_dir {info.save_dir!r} is the nebula_ckpt root itself: give "
                                  "enable() / NebulaCkptEngine a root of its own (it owns the step-<N> folders there)")
        if self._parts:
            log.warning("nebula_ckpt: DeepSpeed checkpoint %r was never committed; its %d part(s) are dropped",
                        self._info.tag if self._info else None, len(self._parts))
        self._info = info
        self._save_dirs.add(os.path.abspath(info.save_dir))
        self._parts = {}
        self._paths = {}
        self._cache = None

    def save(self, state_dict: Any, path: str) -> None:
        """Keep ``state_dict`` as the part ``path`` of the checkpoint being created (saved at commit)."""
        tag_dir = self._tag_dir()
        apath = os.path.abspath(path)
        if tag_dir is None or os.path.commonpath([tag_dir, apath]) != tag_dir or apath == tag_dir:
            # outside a checkpoint's folder (save_16bit_model): an ordinary file for other tools
            torch.save(state_dict, path)
            return
        key = os.path.relpath(apath, tag_dir).replace(os.sep, "/")
        if key in self._parts:
            log.warning("nebula_ckpt: DeepSpeed saved %s twice in checkpoint %r; the second one is kept", path,
                        self._info.tag if self._info else None)
        self._parts[key] = state_dict
        self._paths[key] = path

    def _next_step(self, parts: int) -> Optional[int]:
        """The step of the checkpoint being committed; None when no rank has anything to save."""
        if self._last_step is None:  # the first commit: what the root holds (a tag saved again supersedes it)
            self._last_step = max(self.checkpointer.list(), default=-1)
            for s, t in sorted(self.checkpointer.steps(check_shards=False).items()):
                if t is not None:
                    self._tag_steps.setdefault(t, []).append(s)
        step = max(int(self._step_fn()) if self._step_fn is not None else 0, self._last_step + 1)
        co = self.checkpointer.coordinator
        if co.world_size == 1:
            return step if parts else None
        # every rank commits (DeepSpeed calls it on all): the ranks save together or not at all, at
        # one step (a rank without parts of its own saves an empty state)
        got = co.exchange((parts, step))
        if not any(n for n, _ in got):
            return None
        return max(int(s) for _, s in got)

    def _wait(self, handle: Any) -> None:
        if self.durable == "all":
            handle.result()
        elif self.durable == "first":
            delay = 0.0005
            while not handle.tiers_written and not handle.done():
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        else:
            handle.wait_snapshot()
            return
        if not handle.tiers_written:
            handle.result()  # raises why no tier took it, if one failed
            raise PersistError(f"DeepSpeed checkpoint {handle.tag!r} (step {handle.step}) was written by no tier "
                               f"(skipped: {handle.skipped}; dropped by: {handle.tiers_dropped})")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Save the collected parts as one checkpoint tagged ``info.tag``; then write the pointers."""
        parts, paths = self._parts, self._paths
        self._parts, self._paths = {}, {}
        step = self._next_step(len(parts))
        if step is None:  # nothing was saved in a tag folder (save_16bit_model)
            return True
        tag = str(info.tag)
        handle = self.checkpointer.save_async(step, parts, tag=tag)
        self._last_step = step
        self._tag_steps.setdefault(tag, []).append(step)
        self._wait(handle)
        for key, path in paths.items():
            write_pointer(path, self._root, tag, step, key)
        log.info("nebula_ckpt: DeepSpeed checkpoint %r is step %d (%d part(s)) under %s", tag, step, len(parts),
                 self._root)
        self._pending.append(handle)
        self.drop_superseded()
        if self.prune:
            self.prune_pointers()
        return True

    def drop_superseded(self) -> list[int]:
        """Remove the older steps of each tag saved again, once its new save is durable on every tier
        (stock DeepSpeed overwrites ``save_dir/<tag>``: one copy per tag); return the steps removed.
        A save not finished yet is looked at again at the next commit and at :meth:`wait` / :meth:`close`;
        one a tier dropped or failed keeps the older steps. Every rank removes its own copies (the
        coordinator the shared ones), as :meth:`~nebula_ckpt.Checkpointer.remove` asks."""
        done = [h for h in self._pending if h.done()]
        self._pending = [h for h in self._pending if h not in done]
        removed: list[int] = []
        for h in done:
            if h.tag is None or not h.tiers_written or h.error() is not None or h.tiers_dropped or h.skipped:
                continue  # not on every tier: the older steps stay
            steps = self._tag_steps.get(h.tag, [])
            self._tag_steps[h.tag] = [s for s in steps if s >= h.step]
            for s in (s for s in steps if s < h.step):
                try:
                    removed += self.checkpointer.remove(step=s)
                except NotFoundError:
                    pass  # never committed, or gone meanwhile
                except FencedError as e:  # the root was handed over to a newer writer: its retention decides
                    log.info("nebula_ckpt: superseded step %d of %s is not removed: %s", s, self._root, e)
                    break
        if removed:
            log.info("nebula_ckpt: removed the DeepSpeed step(s) %s, superseded by a save with their tag, under %s",
                     removed, self._root)
        return removed

    def prune_pointers(self) -> list[str]:
        """Remove the pointer files (and tag folders left empty) of the checkpoints of this root no
        tier holds any more (dropped by retention); return the folders looked at and emptied.
        Runs at each commit and at :meth:`wait` / :meth:`close` when retention may drop checkpoints."""
        held = set(self.checkpointer.tags())
        emptied = []
        for save_dir in sorted(self._save_dirs):
            for tag_dir in tag_folders(save_dir):
                gone = [p for p, ptr in pointers_in(tag_dir).items()
                        if ptr["tag"] not in held and canonical_root(root_of(ptr, p)) == self._root]
                for p in gone:
                    os.remove(p)
                if gone and remove_empty_folders(tag_dir):
                    emptied.append(tag_dir)
        if emptied:
            log.info("nebula_ckpt: removed the DeepSpeed tag folder(s) of checkpoints retention dropped: %s", emptied)
        return emptied

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """True on every rank: each rank's checkpoint holds the parts it reads back (the model states
        too), so it restores from its own memory tier; a shared tier stores replicated bytes once."""
        return True

    def preserves_storage_sharing(self) -> bool:
        """False: nebula_ckpt stores each tensor's own bytes, so DeepSpeed need not clone views first."""
        return False

    # -- loading ----------------------------------------------------------------------------------
    def load(self, path: str, map_location: Any = None) -> Any:
        """The state dict DeepSpeed saved at ``path`` (from the newest healthy copy of its checkpoint)."""
        ptr = read_pointer(path)
        if ptr is None:  # an ordinary torch.save file (written before enable(), or outside a tag folder)
            return torch.load(path, map_location=map_location, weights_only=False)
        if all(canonical_root(r) != self._root for r in candidate_roots(ptr, path)):
            root = root_of(ptr, path)
            raise ValidationError(f"{path} points into the nebula_ckpt root {root!r}, but this engine uses "
                                  f"{self._root!r}: enable(engine, {root!r}) to load it")
        tag, key = ptr["tag"], ptr["key"]
        cache = self._cache
        if cache is None or cache[0] != tag or key not in cache[2]:
            try:
                step, tree = self.checkpointer.read(tag=tag, map_location="cpu")
            except OtherRanksError as e:  # held, but as a save of other ranks than this job's
                raise NotFoundError(f"{path}: DeepSpeed checkpoint {tag!r} (step {ptr['step']}) under {self._root} "
                                    f"was saved by other ranks than this engine reads it with: {e}. Load it with the "
                                    "data-parallel ranks that saved it, or materialize(save_dir, tag) on every rank "
                                    "of that job first (its files then load anywhere)") from e
            except NotFoundError as e:
                raise NotFoundError(f"{path}: DeepSpeed checkpoint {tag!r} (step {ptr['step']}) is no longer held "
                                    f"under {self._root} (deleted by retention? keep_last / keep_every decide): "
                                    f"{e}") from e
            if step != ptr["step"]:
                log.warning("nebula_ckpt: %s: step %d of tag %r is not restorable; loading step %d with that tag",
                            path, ptr["step"], tag, step)
            if not isinstance(tree, dict):
                raise ValidationError(f"checkpoint {tag!r} (step {step}) under {self._root} was not written by "
                                      "NebulaCkptEngine (no parts)")
            cache = self._cache = (tag, step, tree)
        tree = cache[2]
        if key not in tree:
            raise NotFoundError(f"{path}: checkpoint {tag!r} (step {cache[1]}) under {self._root} has no part "
                                f"{key!r} (parts: {sorted(tree)}): each rank's checkpoint holds the files that rank "
                                "saved, so a load that reads other ranks' files (ZeRO's elastic_checkpoint, another "
                                "data-parallel world size) is not supported; materialize(save_dir, tag) on every rank "
                                "of the job that saved it writes the real files first")
        part = tree.pop(key)
        if not tree:
            self._cache = None
        if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
            part = to_device(part, torch.device(map_location))
        return part

    def restore_pointers(self, save_dir: str, tag: Optional[str] = None) -> Optional[str]:
        """Write the pointer files of checkpoint ``tag`` (default: the one a restart resumes from,
        :func:`~.deepspeed_resume.resume_tag`) under ``save_dir`` where missing, and DeepSpeed's
        ``latest`` naming it (rank 0); return the tag, or None when no tagged checkpoint is held.
        For a ``save_dir`` lost while the checkpoints survive on a tier (a new machine, a node-local
        disk); ``engine.load_checkpoint(save_dir)`` then restores as usual (the parts read here are
        kept for it). Multi-rank: call it on every rank. Raises ``CorruptCheckpointError`` when no
        ``tag`` is given and every checkpoint is marked suspect.
        """
        tag = resume_tag(self.checkpointer, self._root) if tag is None else tag
        if tag is None:
            return None
        step = self.put_pointers(save_dir, tag)
        if self.checkpointer.coordinator.rank == 0:
            write_file_atomic(os.path.join(save_dir, "latest"), tag.encode(), strict_dir_fsync=False,
                              tmp_suffix=".nebula-tmp")
        log.info("nebula_ckpt: pointers of DeepSpeed checkpoint %r (step %d) restored under %s", tag, step, save_dir)
        return tag

    def put_pointers(self, save_dir: str, tag: str) -> int:
        """Write the pointer files of checkpoint ``tag`` under ``save_dir`` where they are missing
        (its parts are read, and kept for the next :meth:`load`); return its step."""
        check_tag_folder(tag)
        step, tree = self.checkpointer.read(tag=tag, map_location="cpu")
        if not isinstance(tree, dict):
            raise ValidationError(f"checkpoint {tag!r} (step {step}) under {self._root} was not written by "
                                  "NebulaCkptEngine (no parts)")
        for key in tree:
            for rel in (tag, key):  # names read back from a checkpoint: never a path out of save_dir
                if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/") or "\\" in rel:
                    raise ValidationError(f"checkpoint {tag!r} (step {step}) under {self._root}: part {rel!r} is not "
                                          "a relative path inside a tag folder")
            path = os.path.join(save_dir, tag, *key.split("/"))
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_pointer(path, self._root, tag, step, key)
        self._cache = (tag, step, tree)
        return step

    # -- the checkpoint a restart resumes from ------------------------------------------------------
    def latest_tag(self, load_dir: str) -> Optional[str]:
        """The tag ``engine.load_checkpoint(load_dir)`` loads without one (:func:`enable`), its pointers
        written where missing (:func:`~.deepspeed_resume.latest_tag`); None: DeepSpeed reads ``latest``."""
        tag, other = latest_tag(self.checkpointer, self._root, load_dir)
        if tag is not None and other:
            self.put_pointers(load_dir, tag)
        return tag

    # -- lifetime ---------------------------------------------------------------------------------
    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for the background persists (raises a failure not yet seen); then remove the steps
        superseded by a save with the same tag (:meth:`drop_superseded`) and the pointers of
        checkpoints retention removed (:meth:`prune_pointers`)."""
        self.checkpointer.wait(timeout)
        self.drop_superseded()
        if self.prune:
            self.prune_pointers()

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish the background persists; close the Checkpointer when this engine made it."""
        self._cache = None
        if self.checkpointer.closed:
            return
        self.wait(timeout)
        if self._own:
            self.checkpointer.close(timeout)


def enable(engine: Any, root: Optional[str] = None, *, checkpointer: Optional[Checkpointer] = None,
           durable: str = "first", **checkpointer_kwargs: Any) -> NebulaCkptEngine:
    """Route ``engine.save_checkpoint`` / ``engine.load_checkpoint`` through nebula_ckpt; return the
    :class:`NebulaCkptEngine` now in ``engine.checkpoint_engine``.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (from ``deepspeed.initialize``).
        root: the nebula_ckpt root (path or fsspec URL; not the ``save_dir`` given to DeepSpeed),
            or ``checkpointer``: an existing :class:`~nebula_ckpt.Checkpointer`.
        durable: see :class:`NebulaCkptEngine`.
        **checkpointer_kwargs: for the Checkpointer made from ``root`` (``tiers``, ``keep_last`` ...).

    Example::

        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        ckpt_engine = nebula_ckpt.integrations.deepspeed.enable(engine, "/ckpt/run-42")
        engine.load_checkpoint("/ckpt/ds")        # resume (`latest`, unless marked suspect)
        ...
        engine.save_checkpoint("/ckpt/ds")        # tag global_step<N>
        ckpt_engine.close()
    """
    old = getattr(engine, "checkpoint_engine", None)
    if isinstance(old, NebulaCkptEngine):
        raise ValidationError(f"enable(): this DeepSpeed engine already writes through {old!r}")
    if old is not None and old.is_decoupled():
        raise ValidationError(f"enable(): DeepSpeed's {type(old).__name__} (decoupled checkpointing) is configured; "
                              "remove the `checkpoint.writer` section from the DeepSpeed config")
    if old is not None and type(old).__name__ != "TorchCheckpointEngine":
        log.warning("nebula_ckpt: replacing DeepSpeed's %s by NebulaCkptEngine", type(old).__name__)
    ref = weakref.ref(engine)

    def step() -> int:
        e = ref()
        return int(getattr(e, "global_steps", 0) or 0) if e is not None else 0

    ce = NebulaCkptEngine(root, checkpointer=checkpointer, step_fn=step, durable=durable, **checkpointer_kwargs)
    engine.checkpoint_engine = ce

    load = type(engine).load_checkpoint

    @functools.wraps(load)
    def load_checkpoint(load_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        e = ref()  # no tag: the checkpoint a restart resumes from, not blindly the one `latest` names
        if tag is None and e is not None and not e.load_universal_checkpoint():
            tag = ce.latest_tag(os.fspath(load_dir))
        return load(e, load_dir, tag, *args, **kwargs)

    engine.load_checkpoint = load_checkpoint
    # DeepSpeed chose at initialize() data-parallel rank 0 alone to save the model states; here every rank does
    engine.save_non_zero_checkpoint = True
    return ce


