"""Azure ML Nebula's ``torch_nebula`` (``nebulaml``) API on nebula_ckpt.

Azure ML Nebula (``torch_nebula``, later ``nebulaml``) is no longer shipped. This module keeps
its documented API, so a training script moves over by changing its import::

    import nebula_ckpt.compat.torch_nebula as tn      # was: import torch_nebula as tn

    tn.init(persistent_storage_path="/ckpt/run-42", persistent_time_interval=100,
            num_of_version_in_retention=2)
    ckpt = tn.Checkpoint("global_step500", 2)          # a tag, and the number of parts it will hold
    ckpt.save("model", model)
    ckpt.save("optimizer", optimizer)                  # the 2nd part: the checkpoint commits itself
    ckpt.commit()                                      # True (or commit explicitly with num_of_files=-2)

    # after a crash, in the new process:
    tn.init(persistent_storage_path="/ckpt/run-42")
    latest = tn.get_latest_checkpoint()                # None when there is none
    if latest is not None:
        model.load_state_dict(latest.load("model"))
        optimizer.load_state_dict(latest.load("optimizer"))

How it maps (see README, "Moving from Azure ML Nebula"): ``init`` creates one
:class:`~nebula_ckpt.Checkpointer` on ``persistent_storage_path`` with the tiers
``[MemoryTier(), <persistent_storage_path>]`` (Nebula's in-memory tier and its persistent
tier); ``persistent_time_interval`` is the persistent tier's ``every_seconds`` and
``num_of_version_in_retention`` the ``keep_last`` of both tiers. The named parts of one
:class:`Checkpoint` form one nebula_ckpt checkpoint ``{name: obj, ...}``, saved when it commits
with its tag as ``tag``. Tags are the identity of checkpoints; the step numbers nebula_ckpt
needs are handed out in commit order (``step-<N>/`` on storage).
"""

from __future__ import annotations

import atexit
import csv
import hashlib
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Optional

import torch

from nebula_ckpt.checkpointer import Checkpointer
from nebula_ckpt.errors import NebulaError, NotFoundError, ValidationError
from nebula_ckpt.format.names import check_tag
from nebula_ckpt.handle import SaveHandle
from nebula_ckpt.integrations.pointers import safe_name
from nebula_ckpt.native import monotonic
from nebula_ckpt.tiers import MemoryTier, canonical_root, refuse_url_credentials, tier_for_root

log = logging.getLogger("nebula_ckpt")

__all__ = [
    "init", "Checkpoint", "get_latest_checkpoint", "get_checkpoint", "list_checkpoints",
    "get_latest_checkpoint_path", "flush_persistence", "checkpoint_histories", "write_checkpoint_histories",
    "shutdown", "checkpointer", "NebulaCheckpointIO", "NebulaCallback", "UnsupportedError",
    "HISTORY_FIELDS", "DEFAULT_RETENTION",
]

#: ``num_of_version_in_retention`` when not given (Nebula's default, as DeepSpeed's config documents it)
DEFAULT_RETENTION = 2

#: the fields of one entry of :func:`checkpoint_histories` (and the columns of
#: :func:`write_checkpoint_histories`), in order
HISTORY_FIELDS = ("tag", "step", "parts", "size_bytes", "start_time", "blocking_seconds", "duration_seconds",
                  "throughput_bytes_per_second", "tiers", "tiers_dropped", "status")

#: nebula_ckpt's own Checkpointer settings ``init`` passes on (beyond Nebula's three)
_CHECKPOINTER_OPTIONS = ("storage_options", "memory_tier", "max_host_bytes", "on_full", "allow_pickle",
                         "on_persist_error", "snapshot")


class UnsupportedError(NebulaError, NotImplementedError):
    """A part of Nebula's API that nebula_ckpt does not provide; the message says what to use instead."""


class _Session:
    """What ``init`` set up: the checkpointer, the step counter, pending checkpoints, histories."""

    def __init__(self, root: str, settings: dict[str, Any], ck: Checkpointer) -> None:
        self.root = root
        self.settings = settings
        self.ck = ck
        self.lock = threading.RLock()
        #: uncommitted checkpoints that have a tag, by tag (``Checkpoint(tag)`` objects share them)
        self.pending: dict[str, _Parts] = {}
        self.histories: list[dict[str, Any]] = []
        self.watchers: list[threading.Thread] = []
        #: checkpointers that read another root (``persist_path=`` of the getters)
        self.readers: dict[str, Checkpointer] = {}
        self.export_dir: Optional[str] = None
        #: the newest commit's save (the next commit waits until the fastest tier took it)
        self.last_handle: Optional[SaveHandle] = None
        steps = ck.list()
        newest = max(steps) if steps else 0
        if ck.coordinator.world_size > 1:  # every rank hands out the same step numbers
            newest = max(ck.coordinator.exchange(newest))
        self.next_step = newest + 1


_session: Optional[_Session] = None
_session_lock = threading.Lock()


def _current() -> _Session:
    s = _session
    if s is None:
        raise NebulaError("torch_nebula: call init(persistent_storage_path=...) first (nebula_ckpt needs the "
                          "checkpoint root before any checkpoint is saved or looked up)")
    return s


# -- init ----------------------------------------------------------------------------------------
def _storage_path(path: Any) -> str:
    """``persistent_storage_path`` as a string (or the environment variable Nebula read)."""
    if path is None:
        path = os.environ.get("NEBULA_PERSISTENT_STORAGE_PATH") or None
    refuse_url_credentials(path[0] if isinstance(path, (tuple, list)) and len(path) == 1 else path,
                           "persistent_storage_path")
    if isinstance(path, (tuple, list)) and len(path) == 1:
        # Nebula's documentation writes `persistent_storage_path="/tmp/test",` (a trailing comma)
        log.warning("torch_nebula.init(): persistent_storage_path is a 1-tuple %r (a trailing comma?); using %r",
                    path, path[0])
        path = path[0]
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if path is None:
        raise ValidationError("torch_nebula.init(): persistent_storage_path is required (or the environment "
                              "variable NEBULA_PERSISTENT_STORAGE_PATH): nebula_ckpt keeps no checkpoint without a "
                              "root, which is the run's identity and its persistent tier (a path, az://, s3://)")
    if not isinstance(path, str) or not path:
        raise ValidationError(f"torch_nebula.init(): persistent_storage_path must be a non-empty path or URL "
                              f"string, got {path!r}")
    return path


def _interval(value: Any) -> Optional[float]:
    if value is None:
        env = os.environ.get("NEBULA_PERSISTENT_TIME_INTERVAL")
        if not env:
            return None
        value = env
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValidationError(f"torch_nebula.init(): persistent_time_interval must be a number of seconds >= 0, "
                              f"got {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValidationError(f"torch_nebula.init(): persistent_time_interval must be a number of seconds >= 0, "
                              f"got {value!r}")
    return seconds or None  # 0: every commit


def _retention(value: Any) -> int:
    if value is None:
        return DEFAULT_RETENTION
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"torch_nebula.init(): num_of_version_in_retention must be an int >= 1 (the newest "
                              f"checkpoint is always kept), got {value!r}")
    return value


def init(persistent_storage_path: Any = None, persistent_time_interval: Any = None,
         num_of_version_in_retention: Any = None, **options: Any) -> None:
    """Start checkpointing to ``persistent_storage_path`` (Nebula's ``torch_nebula.init``).

    Args:
        persistent_storage_path: the checkpoint root: a local path or an fsspec URL (``az://``,
            ``s3://``; credentials in ``storage_options``). Default: the environment variable
            ``NEBULA_PERSISTENT_STORAGE_PATH``, as Nebula read it. Required.
        persistent_time_interval: seconds between two checkpoints written to the persistent
            tier (the root tier's ``every_seconds``): a commit within that time after the last
            persisted one goes to the memory tier only; ``close`` / :func:`shutdown` puts the
            newest one on the persistent tier. Default: the environment variable
            ``NEBULA_PERSISTENT_TIME_INTERVAL``, else none: every commit is persisted (also with ``0``).
        num_of_version_in_retention: checkpoints kept on each tier (its ``keep_last``): in memory,
            as Nebula kept them, and on the persistent tier; default 2.
        **options: nebula_ckpt's own settings, passed to the :class:`~nebula_ckpt.Checkpointer`:
            ``storage_options``, ``memory_tier`` (default True), ``max_host_bytes``, ``on_full``,
            ``allow_pickle``, ``on_persist_error``, ``snapshot``.

    Calling ``init`` again with the same arguments does nothing; with other arguments it
    finishes the current checkpointer first (waits for its saves, as :func:`shutdown`).

    Raises:
        ValidationError: a missing or bad argument, or an argument neither Nebula documents nor
            nebula_ckpt knows (named, with the accepted ones); nothing is started.
    """
    global _session
    unknown = sorted(set(options) - set(_CHECKPOINTER_OPTIONS))
    if unknown:
        raise ValidationError(f"torch_nebula.init(): unknown argument(s) {unknown}; accepted: "
                              "persistent_storage_path, persistent_time_interval, num_of_version_in_retention "
                              f"(Nebula's) and {list(_CHECKPOINTER_OPTIONS)} (nebula_ckpt's)")
    root = _storage_path(persistent_storage_path)
    interval = _interval(persistent_time_interval)
    keep = _retention(num_of_version_in_retention)
    if os.environ.get("NEBULA_MEMORY_BUFFER_SIZE"):
        log.warning("torch_nebula.init(): NEBULA_MEMORY_BUFFER_SIZE is ignored: nebula_ckpt stages each checkpoint "
                    "whole in host memory (no smaller streaming buffer); init(..., max_host_bytes=N) caps that memory "
                    "(a larger checkpoint is then refused), memory_tier=False keeps no copy in /dev/shm")
    memory = options.pop("memory_tier", True)
    storage_options = options.pop("storage_options", None)
    settings = {"root": canonical_root(root), "interval": interval, "keep": keep, "memory": bool(memory),
                "storage_options": storage_options, **options}
    with _session_lock:
        if _session is not None:
            if _session.settings == settings:
                return
            log.info("torch_nebula.init(): settings changed; finishing the checkpointer of %s first",
                     _session.settings["root"])
            _close_session(_session)
            _session = None
        persistent = tier_for_root(root, storage_options, every_seconds=interval, keep_last=keep)
        tiers = [MemoryTier(keep_last=keep), persistent] if memory else [persistent]
        ck = Checkpointer(root, storage_options=storage_options, tiers=tiers, keep_last=keep, **options)
        try:
            _session = _Session(root, settings, ck)
        except BaseException:
            ck.close()
            raise


def checkpointer() -> Checkpointer:
    """The :class:`~nebula_ckpt.Checkpointer` ``init`` created (for nebula_ckpt's own API: ``load_latest``,
    ``remove``, ``stats`` ...)."""
    return _current().ck


# -- saving ----------------------------------------------------------------------------------------
class _Parts:
    """One checkpoint being assembled: its named parts until it commits, then its step."""

    def __init__(self, tag: Optional[str], num_of_files: int) -> None:
        self.tag = tag
        self.num_of_files = num_of_files
        self.parts: dict[str, Any] = {}
        self.names: list[str] = []
        self.step: Optional[int] = None
        self.handle: Optional[SaveHandle] = None
        self.confirmed = False  # commit() was called (after the commit, or making it)


def _check_num_of_files(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n == 0:
        raise ValidationError(f"torch_nebula.Checkpoint: num_of_files must be an int >= 1 (the checkpoint commits "
                              f"itself when that many parts are saved) or negative (-2, as DeepSpeed passes it: "
                              f"commit() says when it is complete), got {n!r}")
    return n


class Checkpoint:
    """One checkpoint of named parts (Nebula's ``torch_nebula.Checkpoint``).

    ``Checkpoint(tag, num_of_files)``: ``tag`` names it (its identity: ``get_checkpoint(tag=...)``
    finds it; default ``"step-<N>"``, N its step); ``num_of_files``: how many parts it holds. With
    ``n >= 1`` (default 1) it commits itself when its n-th part is saved, and ``commit()`` then
    returns True; ``commit()`` before that raises. With a negative value (DeepSpeed passes ``-2``)
    it commits when ``commit()`` is called. Objects made with the same tag before it commits are
    the same checkpoint (DeepSpeed creates one per part).

    The parts are held by reference and copied when the checkpoint commits, as one nebula_ckpt
    checkpoint ``{name: obj, ...}``: do not change them between ``save`` and the commit.
    Committed checkpoints (also those :func:`get_latest_checkpoint` / :func:`get_checkpoint`
    return) are read with :meth:`load`.

    Attributes:
        tag: the tag (``None`` until an untagged checkpoint commits).
        step: nebula_ckpt's step number (``None`` until it commits).
        num_of_files: as given.
    """

    def __init__(self, tag: Optional[str] = None, num_of_files: int = 1) -> None:
        s = _current()
        check_tag(tag)
        n = _check_num_of_files(num_of_files)
        self._session = s
        self._cache: dict[str, Any] = {}
        self._cache_location: Any = None
        with s.lock:
            shared = s.pending.get(tag) if tag is not None else None
            if shared is not None and shared.num_of_files != n:
                raise ValidationError(f"torch_nebula.Checkpoint({tag!r}, {n}): checkpoint {tag!r} is already being "
                                      f"saved with num_of_files={shared.num_of_files} (parts {shared.names}); "
                                      "commit it first, or use the same num_of_files")
            self._p = shared or _Parts(tag, n)

    @classmethod
    def _committed(cls, s: _Session, tag: Optional[str], step: int) -> "Checkpoint":
        self = cls.__new__(cls)
        self._session = s
        self._cache = {}
        self._cache_location = None
        self._p = _Parts(tag, -1)
        self._p.step = step
        self._p.confirmed = True
        return self

    def __repr__(self) -> str:
        state = "committed" if self.committed else f"{len(self._p.names)} part(s) saved"
        return f"Checkpoint(tag={self.tag!r}, step={self.step}, {state})"

    @property
    def tag(self) -> Optional[str]:
        return self._p.tag

    @property
    def step(self) -> Optional[int]:
        return self._p.step

    @property
    def num_of_files(self) -> int:
        return self._p.num_of_files

    @property
    def committed(self) -> bool:
        """Whether it committed (its copy is taken; persisting may still run: :func:`flush_persistence`)."""
        return self._p.step is not None

    @property
    def handle(self) -> Optional[SaveHandle]:
        """The :class:`~nebula_ckpt.SaveHandle` of its commit in this process (``None`` otherwise)."""
        return self._p.handle

    def save(self, name: str, obj: Any) -> None:
        """Add part ``name`` (``obj``: a module, optimizer, state dict, tensor, plain values ...).

        Raises:
            ValidationError: an empty or repeated name, or a checkpoint already committed;
                the commit's own errors when this part completes ``num_of_files``.
        """
        s = self._session
        with s.lock:
            p = self._p
            where = f"checkpoint {p.tag!r}" if p.tag is not None else "this checkpoint"
            if p.step is not None:
                raise ValidationError(f"torch_nebula: {where} is committed (step {p.step}); parts cannot be added "
                                      "to it: create a new Checkpoint(tag) for the next one")
            if not isinstance(name, str) or not name:
                raise ValidationError(f"torch_nebula: a part's name must be a non-empty string, got {name!r}")
            if name in p.parts:
                raise ValidationError(f"torch_nebula: part {name!r} is already saved in {where} (parts {p.names})")
            p.parts[name] = obj
            p.names.append(name)
            if p.tag is not None:
                s.pending[p.tag] = p
            if 0 < p.num_of_files == len(p.names):
                try:
                    _commit(s, p)
                except BaseException:  # the part that completed it is taken back: nothing changed
                    del p.parts[name]
                    p.names.remove(name)
                    if not p.names and p.tag is not None and s.pending.get(p.tag) is p:
                        del s.pending[p.tag]
                    raise

    def commit(self) -> bool:
        """Commit the checkpoint: its parts are copied (``save_async``) and persisted in the background.

        Returns True. With ``num_of_files >= 1`` the n-th ``save`` committed it already; this
        confirms it (once).

        Raises:
            ValidationError: fewer parts than ``num_of_files`` (named), no part at all, or a
                second ``commit()``; the errors of :meth:`~nebula_ckpt.Checkpointer.save_async`
                (a part it cannot store, a failed earlier save), nothing committed then.
        """
        s = self._session
        with s.lock:
            p = self._p
            where = f"checkpoint {p.tag!r}" if p.tag is not None else "this checkpoint"
            if p.step is not None:
                if p.confirmed:
                    raise ValidationError(f"torch_nebula: {where} is already committed (step {p.step}); commit() "
                                          "is called once per checkpoint")
                p.confirmed = True
                return True
            if p.num_of_files > 0:
                raise ValidationError(f"torch_nebula: {where} has {len(p.names)} of its num_of_files="
                                      f"{p.num_of_files} parts ({p.names}); save the missing part(s) (it commits "
                                      "itself with the last one), or create it with num_of_files=-2 to commit "
                                      "whatever is saved")
            if not p.names:
                raise ValidationError(f"torch_nebula: {where} has no part to commit: save(name, obj) first")
            _commit(s, p)
            p.confirmed = True
            return True

    def load(self, name: str, map_location: Any = None) -> Any:
        """Part ``name`` of this committed checkpoint, as a fresh object.

        Modules and optimizers come back as their state dicts (``model.load_state_dict(...)``);
        tensors, NumPy values and plain values as saved. ``map_location`` as ``torch.load`` takes it.
        The checkpoint is read (and verified) once for all its parts: each other part is kept
        until it is loaded.

        Raises:
            ValidationError: the checkpoint is not committed yet.
            NotFoundError: no such part (the message lists the parts), or the checkpoint is gone.
            CorruptCheckpointError: every copy of it is damaged.
        """
        s = self._session
        p = self._p
        if p.step is None:
            raise ValidationError(f"torch_nebula: checkpoint {p.tag!r} is not committed; load() reads committed "
                                  "checkpoints")
        if name in self._cache and _same_location(self._cache_location, map_location):
            return self._cache.pop(name)
        _settle(s)
        _, tree = _reader_for(s, self._root)[1].read(p.step, map_location=map_location)
        if not isinstance(tree, dict) or name not in tree:
            names = sorted(tree) if isinstance(tree, dict) else []
            raise NotFoundError(f"torch_nebula: checkpoint {p.tag!r} (step {p.step}) has no part {name!r}; its parts: "
                                f"{names}")
        part = tree.pop(name)
        self._cache, self._cache_location = tree, map_location
        return part

    #: the root this checkpoint was found under (None: the one ``init`` named)
    _root: Optional[str] = None


def _same_location(a: Any, b: Any) -> bool:
    """Whether two ``map_location`` values are the same (callables and dicts: the same object)."""
    return a is b or (type(a) is type(b) and isinstance(a, (str, torch.device)) and a == b)


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in ``obj`` (objects with ``state_dict()`` through it)."""
    total, stack, seen = 0, [obj], set()
    views: set[tuple[Any, ...]] = set()
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            try:  # tied weights: one storage under several keys is stored (and counted) once
                view = (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape), o.dtype)
            except Exception:
                view = (id(o), 0, (), o.dtype)
            if view not in views:
                views.add(view)
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "nbytes") and hasattr(o, "dtype"):  # NumPy
            total += int(o.nbytes)
        elif callable(getattr(o, "state_dict", None)):
            try:
                stack.append(o.state_dict())
            except Exception:  # measuring never fails a save
                pass
    return total


def _commit(s: _Session, p: _Parts) -> None:
    """Save ``p``'s parts as one checkpoint with the next step (caller holds ``s.lock``)."""
    step = s.next_step
    tag = p.tag if p.tag is not None else f"step-{step}"
    state = {name: p.parts[name] for name in p.names}
    size = _nbytes(state)
    start = time.time()
    t0 = monotonic()
    _first_tier_took_the_last(s)
    handle = s.ck.save_async(step, state, tag=tag)  # raises before anything is written on bad input
    s.last_handle = handle
    blocking = monotonic() - t0
    s.next_step = step + 1
    p.tag, p.step, p.handle, p.parts = tag, step, handle, {}
    if s.pending.get(tag) is p:
        del s.pending[tag]
    entry: dict[str, Any] = {"tag": tag, "step": step, "parts": list(p.names), "size_bytes": size,
                             "start_time": start, "blocking_seconds": blocking, "duration_seconds": None,
                             "throughput_bytes_per_second": None, "tiers": [], "tiers_dropped": [],
                             "status": "pending"}
    s.histories.append(entry)
    w = threading.Thread(target=_watch, args=(s, handle, entry, t0), name=f"torch_nebula-history-{step}",
                         daemon=True)
    w.start()
    s.watchers = [t for t in s.watchers if t.is_alive()] + [w]


def _first_tier_took_the_last(s: _Session) -> None:
    """Wait until the previous commit is written on the fastest tier (the memory tier: a few ms
    after its copy). A tier drops a save it has not started when a newer one arrives; Nebula
    kept every commit in memory, so a commit must never be dropped there."""
    prev = s.last_handle
    if prev is None or not s.ck.tiers:
        return
    first = s.ck.tiers[0].name
    while not prev.done() and first not in prev.tiers_written and first not in prev.tiers_dropped:
        prev.wait(0.002)


def _watch(s: _Session, handle: SaveHandle, entry: dict[str, Any], t0: float) -> None:
    """Fill in a history entry once its save is over (never raises: the error stays the handle's)."""
    handle.wait()  # not result(): a failure stays unseen, so the next call raises it
    duration = monotonic() - t0
    err = handle.error()
    with s.lock:
        entry["duration_seconds"] = duration
        entry["tiers"] = list(handle.tiers_written)
        entry["tiers_dropped"] = list(handle.tiers_dropped)
        if handle.skipped:
            entry["status"] = f"skipped: {handle.skipped}"
        elif err is not None:
            entry["status"] = f"failed: {type(err).__name__}: {err}"
        else:
            entry["status"] = "ok"
            entry["throughput_bytes_per_second"] = entry["size_bytes"] / duration if duration > 0 else None


# -- finding and loading ---------------------------------------------------------------------------
def _settle(s: _Session) -> None:
    """Wait for this process's commits in flight, so that what they wrote is found (raises their errors)."""
    if any(t.is_alive() for t in s.watchers):
        s.ck.wait()


def _reader_for(s: _Session, persist_path: Optional[str]) -> tuple[str, Checkpointer]:
    """The checkpointer that reads ``persist_path`` (None or ``init``'s root: ``init``'s own)."""
    if persist_path is None:
        return s.root, s.ck
    if not isinstance(persist_path, (str, os.PathLike)) or not os.fspath(persist_path):
        raise ValidationError(f"torch_nebula: persist_path must be a path or URL string, got {persist_path!r}")
    path = os.fspath(persist_path)
    refuse_url_credentials(path, "persist_path")
    key = canonical_root(path)
    if key == s.settings["root"]:
        return s.root, s.ck
    with s.lock:
        ck = s.readers.get(key)
        if ck is None:
            if "://" not in path and not os.path.isdir(path):
                raise NotFoundError(f"torch_nebula: persist_path {path!r} does not exist")
            ck = Checkpointer(path, storage_options=s.settings["storage_options"] if "://" in path else None,
                              memory_tier=s.settings["memory"], read_only=True)
            s.readers[key] = ck
        return path, ck


def _tagged(s: _Session, persist_path: Optional[str]) -> tuple[Optional[str], Checkpointer, dict[str, int]]:
    _settle(s)
    path, ck = _reader_for(s, persist_path)
    return (None if ck is s.ck else path), ck, ck.tags()


def _found(s: _Session, root: Optional[str], tag: str, step: int) -> Checkpoint:
    c = Checkpoint._committed(s, tag, step)
    c._root = root
    return c


def get_latest_checkpoint(persist_path: Optional[str] = None) -> Optional[Checkpoint]:
    """The newest committed checkpoint (on any tier: memory first), or ``None`` when there is none.

    ``persist_path``: look under another root than ``init``'s (another run's).
    """
    s = _current()
    try:
        root, _, tags = _tagged(s, persist_path)
    except NotFoundError:
        return None
    if not tags:
        return None
    tag, step = max(tags.items(), key=lambda kv: kv[1])
    return _found(s, root, tag, step)


def get_checkpoint(tag: str, persist_path: Optional[str] = None) -> Checkpoint:
    """The committed checkpoint tagged ``tag`` (its newest commit, if saved several times).

    Raises:
        ValidationError: a malformed tag.
        NotFoundError: no committed checkpoint has that tag (the message lists the tags).
    """
    s = _current()
    check_tag(tag)
    if tag is None:
        raise ValidationError("torch_nebula.get_checkpoint(): give the tag of the checkpoint "
                              "(get_latest_checkpoint() gives the newest)")
    root, ck, tags = _tagged(s, persist_path)
    if tag not in tags:
        with s.lock:
            pending = tag in s.pending
        hint = " (it has parts saved but is not committed: commit() it)" if pending else ""
        raise NotFoundError(f"torch_nebula: no committed checkpoint tagged {tag!r} under "
                            f"{canonical_root(ck.root)}{hint}; tags: {sorted(tags, key=tags.__getitem__)[-20:]}")
    return _found(s, root, tag, tags[tag])


def list_checkpoints(persist_path: Optional[str] = None) -> list[dict[str, Any]]:
    """Every committed checkpoint, oldest first: ``[{"tag", "step", "tiers"}, ...]`` (JSON-serialisable;
    ``tiers``: the tiers holding it, fastest first). A tag saved several times is listed once
    (its newest commit)."""
    s = _current()
    _, ck, tags = _tagged(s, persist_path)
    per_tier = ck.list(detailed=True)
    return [{"tag": tag, "step": step, "tiers": [t for t, steps in per_tier.items() if step in steps]}
            for tag, step in sorted(tags.items(), key=lambda kv: kv[1])]


def get_latest_checkpoint_path(name: str = "checkpoint", persist_path: Optional[str] = None) -> Optional[str]:
    """A ``torch.load``-able file of part ``name`` of the newest checkpoint (``None`` without one).

    nebula_ckpt keeps no file per part, so the part is exported (``torch.save``) into a private
    temporary folder, removed by :func:`shutdown` / at exit; Lightning's
    ``load_from_checkpoint(path)`` and ``torch.load(path)`` read it.
    """
    latest = get_latest_checkpoint(persist_path)
    if latest is None:
        return None
    obj = latest.load(name)
    s = _current()
    with s.lock:
        if s.export_dir is None:
            s.export_dir = tempfile.mkdtemp(prefix="torch_nebula-export-")
        safe = "".join(c if c.isalnum() or c in "._-=" else "_" for c in f"{latest.tag}__{name}")
        # the readable part is lossy ("a/b" and "a_b"), so a hash of (tag, name) keeps two parts
        # apart; a name longer than NAME_MAX is cut and hashed whole (safe_name)
        digest = hashlib.sha256(f"{latest.tag}\0{name}".encode("utf-8", "surrogateescape")).hexdigest()[:12]
        path = os.path.join(s.export_dir, safe_name(f"{safe}~{digest}"))
    torch.save(obj, path)
    return path


# -- persistence, histories, shutdown --------------------------------------------------------------
def flush_persistence(tag: Optional[str] = None) -> bool:
    """Wait until every commit so far is durable on every tier that took it (``tag`` is accepted and
    ignored: everything is flushed). Returns True.

    Raises:
        PersistError: a save failed (the first failure not yet seen).
    """
    s = _current()
    s.ck.wait()
    for t in list(s.watchers):
        t.join()
    return True


def checkpoint_histories() -> list[dict[str, Any]]:
    """One entry per commit of this process, oldest first (what Nebula wrote to ``checkpointHistories.csv``).

    Fields (:data:`HISTORY_FIELDS`): ``tag``, ``step``, ``parts`` (names), ``size_bytes`` (of the
    tensors), ``start_time`` (``time.time()`` of the commit), ``blocking_seconds`` (the commit
    call), ``duration_seconds`` (commit until durable on every tier that took it),
    ``throughput_bytes_per_second`` (size / duration), ``tiers`` (written), ``tiers_dropped``
    (skipped while busy with an older save), ``status`` (``pending``, ``ok``, ``failed: ...``,
    ``skipped: ...``). Entries still ``pending`` have no duration yet.
    """
    s = _current()
    with s.lock:
        return [dict(e, parts=list(e["parts"]), tiers=list(e["tiers"]), tiers_dropped=list(e["tiers_dropped"]))
                for e in s.histories]


def write_checkpoint_histories(path: str) -> str:
    """Write :func:`checkpoint_histories` as CSV (Nebula's ``checkpointHistories.csv``) to ``path``; return it.

    Lists are joined with ``;``.
    """
    rows = checkpoint_histories()
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HISTORY_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ";".join(r[k]) if isinstance(r[k], list) else r[k] for k in HISTORY_FIELDS})
    return path


def _close_session(s: _Session) -> None:
    with s.lock:
        left = {t: p.names for t, p in s.pending.items()}
        s.pending.clear()
    if left:
        log.warning("torch_nebula: checkpoint(s) never committed, dropped: %s", left)
    try:
        s.ck.close()
        for t in s.watchers:
            t.join()
    finally:
        for r in s.readers.values():
            r.close()
        s.readers.clear()
        if s.export_dir is not None:
            shutil.rmtree(s.export_dir, ignore_errors=True)


def shutdown() -> None:
    """Finish: wait for every commit to be durable, put the newest on the persistent tier (one that
    ``persistent_time_interval`` skipped), close. ``init`` may be called again afterwards.

    Raises:
        PersistError: a save failed (not seen before).
    """
    global _session
    with _session_lock:
        s, _session = _session, None
    if s is not None:
        _close_session(s)


_shutdown = shutdown  # the name DeepSpeed's tests call


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except BaseException as e:  # at exit nobody can catch it
        log.error("torch_nebula: shutdown at exit failed: %s: %s", type(e).__name__, e)


atexit.register(_shutdown_at_exit)


# -- what is not provided --------------------------------------------------------------------------
class NebulaCheckpointIO:
    """Nebula's Lightning plugin: not provided here (see :mod:`nebula_ckpt.integrations.lightning`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedError("torch_nebula.NebulaCheckpointIO() is not provided by nebula_ckpt's torch_nebula API: "
                               "use nebula_ckpt.integrations.lightning.NebulaCheckpointIO(root), Lightning's "
                               "CheckpointIO plugin, with a root of its own (not the one tn.init() writes: two "
                               "checkpointers writing one root fence each other)")


class NebulaCallback:
    """Nebula's Lightning ``ModelCheckpoint`` replacement: not provided here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedError("torch_nebula.NebulaCallback is not provided: keep Lightning's own ModelCheckpoint "
                               "callback (same arguments) and add the plugin "
                               "nebula_ckpt.integrations.lightning.NebulaCheckpointIO(root), which stores what it "
                               "writes with nebula_ckpt")
