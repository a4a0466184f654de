"""``torch_nebula.init`` and what it sets up: one :class:`~nebula_ckpt.Checkpointer` on
``persistent_storage_path``, the step numbers handed out in commit order, the checkpoints being
assembled, the readers of other roots; ``shutdown`` (also at exit) finishes it."""

from __future__ import annotations

import atexit
import logging
import math
import os
import shutil
import threading
from typing import Any, Optional

from nebula_ckpt import Checkpointer, MemoryTier, SaveHandle
from nebula_ckpt.adapters import canonical_root, refuse_url_credentials, tier_for_root
from nebula_ckpt.compat.nebula import environment
from nebula_ckpt.errors import NebulaError, NotFoundError, ValidationError

log = logging.getLogger("nebula_ckpt")

#: ``num_of_version_in_retention`` when not given (Nebula's default, as DeepSpeed's config documents it)
DEFAULT_RETENTION = 2

#: nebula_ckpt's own Checkpointer settings ``init`` passes on (beyond Nebula's three)
CHECKPOINTER_OPTIONS = ("storage_options", "memory_tier", "host_memory_budget", "on_full", "allow_pickle",
                        "on_persist_error", "snapshot")


class Session:
    """What ``init`` set up: the checkpointer, the step counter, pending checkpoints, histories."""

    def __init__(self, root: str, settings: dict[str, Any], ck: Checkpointer) -> None:
        self.root = root
        self.settings = settings
        self.ck = ck
        #: the process that made the session: a forked child never closes it nor removes its exports
        self.pid = os.getpid()
        self.lock = threading.RLock()
        #: uncommitted checkpoints that have a tag, by tag (``Checkpoint(tag)`` objects share them)
        self.pending: dict[str, Parts] = {}
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


_session: Optional[Session] = None
_session_lock = threading.Lock()


def current_session() -> Session:
    """The session ``init`` started; raises when there is none."""
    s = _session
    if s is None:
        raise NebulaError("torch_nebula: call init(persistent_storage_path=...) first (nebula_ckpt needs the "
                          "checkpoint root before any checkpoint is saved or looked up)")
    return s


class Parts:
    """One checkpoint being assembled: its named parts until it commits, then its step."""

    def __init__(self, tag: Optional[str], num_of_files: int) -> None:
        self.tag = tag
        self.num_of_files = num_of_files
        self.parts: dict[str, Any] = {}
        self.names: list[str] = []
        self.step: Optional[int] = None
        self.handle: Optional[SaveHandle] = None
        self.confirmed = False  # commit() was called (after the commit, or making it)


# -- init ------------------------------------------------------------------------------------------
def _storage_path(path: Any) -> str:
    """``persistent_storage_path`` as a string (or the environment variable Nebula read)."""
    if path is None:
        path = environment.storage_path()
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
        env = environment.time_interval()
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
            ``storage_options``, ``memory_tier`` (default True), ``host_memory_budget``, ``on_full``,
            ``allow_pickle``, ``on_persist_error``, ``snapshot``.

    Calling ``init`` again with the same arguments does nothing; with other arguments it
    finishes the current checkpointer first (waits for its saves, as :func:`shutdown`).

    Raises:
        ValidationError: a missing or bad argument, or an argument neither Nebula documents nor
            nebula_ckpt knows (named, with the accepted ones); nothing is started.
    """
    global _session
    unknown = sorted(set(options) - set(CHECKPOINTER_OPTIONS))
    if unknown:
        raise ValidationError(f"torch_nebula.init(): unknown argument(s) {unknown}; accepted: "
                              "persistent_storage_path, persistent_time_interval, num_of_version_in_retention "
                              f"(Nebula's) and {list(CHECKPOINTER_OPTIONS)} (nebula_ckpt's)")
    root = _storage_path(persistent_storage_path)
    interval = _interval(persistent_time_interval)
    keep = _retention(num_of_version_in_retention)
    if environment.memory_buffer_size():
        log.warning("torch_nebula.init(): NEBULA_MEMORY_BUFFER_SIZE is ignored: nebula_ckpt stages each checkpoint "
                    "whole in host memory (no smaller streaming buffer); init(..., host_memory_budget=N) caps that "
                    "memory (a larger checkpoint is then refused), memory_tier=False keeps no copy in /dev/shm")
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
            _session = Session(root, settings, ck)
        except BaseException:
            ck.close()
            raise


def checkpointer() -> Checkpointer:
    """The :class:`~nebula_ckpt.Checkpointer` ``init`` created (for nebula_ckpt's own API: ``load_latest``,
    ``remove``, ``stats`` ...)."""
    return current_session().ck


# -- reading ---------------------------------------------------------------------------------------
def settle(s: Session) -> None:
    """Wait for this process's commits in flight, so that what they wrote is found (raises their errors)."""
    if any(t.is_alive() for t in s.watchers):
        s.ck.wait()


def reader_for(s: Session, persist_path: Optional[str]) -> tuple[str, Checkpointer]:
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


def _close_session(s: Session) -> None:
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
    if s is not None and s.pid != os.getpid():  # a forked child (a DataLoader worker, a helper): the parent's
        log.debug("torch_nebula: shutdown() in a process forked from %d: the parent's session is left alone", s.pid)
    elif s is not None:
        _close_session(s)


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except BaseException as e:  # at exit nobody can catch it
        log.error("torch_nebula: shutdown at exit failed: %s: %s", type(e).__name__, e)


atexit.register(_shutdown_at_exit)
