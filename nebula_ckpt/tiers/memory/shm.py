"""The memory tier's home in a shared tmpfs (``/dev/shm``): safe folders, claims, garbage.

``/dev/shm`` is writable by every local user, so nothing found there is trusted:

* every folder on the memory tier's path below the tmpfs is created ``0700`` and, when it
  exists already, must be a real directory (not a symlink) owned by this user and not
  writable by anyone else (a folder that others may only read is tightened to ``0700``); the
  tmpfs itself must be owned by root or this user and, when others may write to it, carry the
  sticky bit (so nobody can rename our folders away);
* each folder is opened relative to its verified parent with ``O_NOFOLLOW``;
* a memory tier is *claimed* by a ``ROOT`` file naming the checkpoint root and its run id (a
  random id the persistent root records in ``_nebula/run.json``): a folder of another root, of
  an earlier run at the same path (a deleted and re-created root), or of unknown content is
  never restored from;
* a process writing the tier holds an exclusive ``flock`` on the folder's ``LOCK`` file, so
  ``gc`` and a second process on the same root can tell it is in use (the lock dies with the
  process); a process that only restores takes it just long enough to claim the folder.

:func:`scan` lists every memory tier of this user for ``nebula-ckpt gc``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from typing import Optional

from nebula_ckpt import knobs
from nebula_ckpt.format.names import COMMIT, LOCK_FILE, ROOT_FILE, RUN_FILE, parse_step_dir
from nebula_ckpt.format.owner import Owner, read_owner
from nebula_ckpt.storage.local import write_file_atomic

log = logging.getLogger(__name__)

#: the folder of the replicas a memory tier holds (``replica_store.REPLICA_DIR``, which imports the restore side)
REPLICAS = "replicas"


class UnsafeFolderError(OSError):
    """A folder on the memory tier's path is not safely ours (owner, mode or symlink)."""


def current_uid() -> int:
    """The user the memory tier belongs to: the effective uid, which owns the folders and files
    this process creates (0 where the system has no uids). The one uid of the memory tier: its
    folder's name, the ownership checks and the slot-file sweeps all use it."""
    return os.geteuid() if hasattr(os, "geteuid") else 0


def user_dir_name() -> str:
    """Name of this user's folder in the tmpfs (``nebula_ckpt-<uid>``)."""
    return f"nebula_ckpt-{current_uid()}"


def _check_base(path: str, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolderError(errno.ENOTDIR, f"{path} is not a directory")
    if st.st_uid not in (0, current_uid()):
        raise UnsafeFolderError(errno.EPERM, f"{path} is owned by uid {st.st_uid}, not by root or this user")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafeFolderError(errno.EPERM, f"{path} is writable by other users and has no sticky bit, "
                                "so they could replace our folders; use a private NEBULA_SHM_DIR")


def _check_private(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFolderError(errno.ELOOP, f"{path} is a symlink; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolderError(errno.ENOTDIR, f"{path} is not a directory")
    if st.st_uid != current_uid():
        raise UnsafeFolderError(errno.EPERM, f"{path} is owned by uid {st.st_uid}, not by this user "
                                f"({current_uid()}): another user created it, so it is not used. Remove it "
                                "(as its owner or root) or set NEBULA_SHM_DIR to a private folder")
    if st.st_mode & 0o022:
        raise UnsafeFolderError(errno.EPERM, f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users "
                                "may write into it, so it is not used. Remove it, or `chmod 700` it if "
                                "you trust its content")


def _open_private_child(parent_fd: int, parent: str, name: str, create: bool) -> int:
    """Open (creating ``0700`` if asked) folder ``name`` under ``parent_fd``; verify it is ours."""
    path = os.path.join(parent, name)
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            _check_private(path, os.lstat(name, dir_fd=parent_fd))
        raise
    try:
        st = os.fstat(fd)
        _check_private(path, st)
        if st.st_mode & 0o077:  # ours and nobody else may write it: only tighten reading (0755 of old)
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def secure_folder(path: str, *, default_layout: bool, create: bool = True) -> str:
    """Create or verify the memory-tier folder ``path``; return it.

    With ``default_layout`` (``<shm_dir>/nebula_ckpt-<uid>/<hash>``) the tmpfs is checked as a
    shared base and both folders below it as private; for a folder the user named, its parent
    chain is the user's choice and only the folder itself must be private.

    Raises:
        UnsafeFolderError: a folder is not safely this user's (the message says how to fix it).
        FileNotFoundError: ``create=False`` and a folder is missing.
    """
    path = os.path.abspath(path)
    if default_layout:
        user, leaf = os.path.split(path)
        base, user_name = os.path.split(user)
        names = [user_name, leaf]
    else:
        base, leaf = os.path.split(path)
        names = [leaf]
        if create:
            os.makedirs(base, mode=0o700, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if default_layout:
            _check_base(base, os.fstat(fd))
        cur = base
        for name in names:
            child = _open_private_child(fd, cur, name, create)
            os.close(fd)
            fd, cur = child, os.path.join(cur, name)
    finally:
        os.close(fd)
    return path


def secure_subfolder(parent: str, name: str) -> str:
    """Create or verify a private folder ``name`` inside the verified folder ``parent``."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.close(_open_private_child(fd, parent, name, True))
    finally:
        os.close(fd)
    return os.path.join(parent, name)


# -- claims -------------------------------------------------------------------------------------------

def _write_owner(folder: str, owner: Owner) -> None:
    write_file_atomic(os.path.join(folder, ROOT_FILE), owner.to_bytes(), mode=0o600, fsync=False, dir_mode=None)


#: the fds of the ``LOCK`` files this process holds to write memory tiers (see :func:`_forget_locks_in_child`)
_held_locks: set[int] = set()


def _forget_locks_in_child() -> None:
    """In a forked child (a DataLoader worker): stop sharing the parent's memory-tier locks.

    A ``flock`` belongs to the open file, which a fork shares: without this, a worker that outlives
    its killed parent for a few seconds (until its watchdog notices) would keep the tier locked,
    and the restarted job would find it "in use by another live process" and save without it.
    The fd number stays valid (it points to ``/dev/null``): nothing the child closes later can
    close another file instead. A child never writes its parent's memory tier."""
    if not _held_locks:
        return
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        for fd in _held_locks:
            os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
    _held_locks.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def held_here(folder: str) -> bool:
    """Whether this very process holds ``folder``'s ``LOCK`` (another Checkpointer of it writes
    the tier), as opposed to another live process."""
    try:
        st = os.stat(os.path.join(folder, LOCK_FILE), follow_symlinks=False)
    except OSError:
        return False
    for fd in list(_held_locks):
        try:
            held = os.fstat(fd)
        except OSError:
            continue
        if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def try_lock(folder: str) -> Optional[int]:
    """An exclusive, non-blocking lock on ``folder``'s ``LOCK`` file: its fd, or ``None`` if held."""
    fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_if_unused(folder: str, allowed: tuple[str, ...]) -> bool:
    """Remove ``folder`` if it holds nothing but ``allowed`` names (an empty ``.slots`` included) and
    no live process holds its lock; True if removed. Done under the lock, so a writer that takes
    it first keeps the folder; one that comes after finds it gone and makes it again."""
    try:
        fd = try_lock(folder)
    except OSError:  # already gone (another reader, `nebula-ckpt gc`), or not ours to lock
        return False
    if fd is None:
        return False
    try:
        names = os.listdir(folder)
        if any(n not in allowed for n in names):
            return False
        for n in names:
            p = os.path.join(folder, n)
            if os.path.isdir(p) and not os.path.islink(p):
                if os.listdir(p):
                    return False
                os.rmdir(p)
        for n in names:
            p = os.path.join(folder, n)
            if os.path.lexists(p) and not os.path.isdir(p):
                os.unlink(p)
        os.rmdir(folder)
        return True
    except OSError as e:
        log.debug("nebula_ckpt: memory tier %s not removed: %s", folder, e)
        return False
    finally:
        os.close(fd)


def _step_markers(folder: str) -> list[tuple[int, str]]:
    """``(step, path of its COMMIT)`` of the step folders right in ``folder`` (links not followed)."""
    out: list[tuple[int, str]] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:  # gone, or not a folder: nothing listed there
        return out
    for e in entries:
        step = parse_step_dir(e.name)
        if step is not None and e.is_dir(follow_symlinks=False):
            out.append((step, os.path.join(e.path, COMMIT)))
    return out


def unlist_steps(folder: str) -> None:
    """Remove the commit marker of every step the memory tier ``folder`` holds (its own steps,
    then the replicas it holds of other ranks), newest first, before its files go: whatever a kill
    leaves of a tier being removed lists no step that is not whole."""
    markers = _step_markers(folder)
    replicas = os.path.join(folder, REPLICAS)
    if os.path.isdir(replicas) and not os.path.islink(replicas):
        for e in os.scandir(replicas):
            if e.is_dir(follow_symlinks=False):
                markers += _step_markers(e.path)
    for _, marker in sorted(markers, reverse=True):
        log.debug("nebula_ckpt: gc: removing the commit marker %s", marker)
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass
    log.debug("nebula_ckpt: phase=gc-unlisted %s: no step listed; its files go next", folder)


def clear_folder(folder: str, keep: tuple[str, ...] = (LOCK_FILE,)) -> None:
    """Remove everything in ``folder`` but ``keep`` (never following symlinks)."""
    for name in os.listdir(folder):
        if name in keep:
            continue
        p = os.path.join(folder, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


class ClaimRefused(Exception):
    """The memory tier cannot be used by this checkpointer (the message says why)."""


class Claim:
    """This run's claim on a verified memory-tier folder; its lock is taken to write.

    Claiming reads the ``ROOT`` file: a folder of this root and run is used as is; a folder of
    an earlier run of the same root is cleared; an empty folder gets a ``ROOT`` file. Those two
    writes happen only under the folder's lock, never while another live process holds it. A
    folder of another root, or one with files but no ``ROOT``, is refused (never claimed blindly).

    Args:
        folder: the verified folder.
        owner: the root and run id to record.

    Raises:
        ClaimRefused: the message says why (and how to fix it).
    """

    def __init__(self, folder: str, owner: Owner) -> None:
        self.folder = folder
        self._fd: Optional[int] = None
        fd = try_lock(folder)
        try:
            self._take(owner, fd is not None)
        finally:
            if fd is not None:
                os.close(fd)

    def _take(self, owner: Owner, locked: bool) -> None:
        have = read_owner(self.folder)
        busy = "is in use by another live process on the same root (a second job on one root?)"
        if have is not None and have.root != owner.root:
            raise ClaimRefused(f"{self.folder} belongs to root {have.root!r}, not {owner.root!r} (hash "
                               "collision); pass MemoryTier(path=...) explicitly")
        if have is not None and have.run_id == owner.run_id and os.path.lexists(os.path.join(self.folder, RUN_FILE)):
            # a root's run record (a memory tier never holds one): the folder was opened as a
            # checkpoint root, and what that run saved there (another run's state, under writer
            # generations this root never issued) would be restored as this run's
            raise ClaimRefused(f"{self.folder} holds {RUN_FILE}, the run record of a checkpoint root: it was opened "
                               "as a root, so its steps may be another run's, and none is restored from it; it is not "
                               "used. Remove it (`nebula-ckpt gc --force`) so that a clean memory tier replaces it")
        if have is None:
            if any(n != LOCK_FILE for n in os.listdir(self.folder)):
                raise ClaimRefused(f"{self.folder} holds files but no readable {ROOT_FILE} file, so it "
                                   "is nobody's memory tier; it is not used. Remove it (nebula-ckpt gc; "
                                   "--force if it holds committed checkpoints)")
            if not locked:
                raise ClaimRefused(f"{self.folder} {busy}")
            _write_owner(self.folder, owner)
        elif have.run_id != owner.run_id:
            if not locked:
                raise ClaimRefused(f"{self.folder} holds an earlier run of {owner.root} and {busy}")
            log.warning("nebula_ckpt: memory tier %s holds checkpoints of an earlier run at %s (run %s, "
                        "this run is %s: the root was deleted or re-created); clearing them",
                        self.folder, owner.root, have.run_id, owner.run_id)
            clear_folder(self.folder)
            _write_owner(self.folder, owner)

    @property
    def locked(self) -> bool:
        """Whether this process holds the folder's lock (it may write the tier)."""
        return self._fd is not None

    def lock(self) -> bool:
        """Take the folder's lock for writing (idempotent); False if another process holds it."""
        if self._fd is None:
            self._fd = try_lock(self.folder)
            if self._fd is not None:
                _held_locks.add(self._fd)
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent); the folder and its checkpoints stay."""
        fd, self._fd = self._fd, None
        if fd is not None:
            _held_locks.discard(fd)
            os.close(fd)


# -- listing for gc -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Found:
    """A memory-tier folder of this user, as ``scan`` saw it."""

    folder: str
    owner: Optional[Owner]
    in_use: bool
    problem: Optional[str]   # not safely ours: never touched
    nbytes: int


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path``, each file once however many names link it."""
    seen: dict[tuple[int, int], int] = {}
    for dp, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dp, f))
            except FileNotFoundError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def scan(shm_dir: Optional[str] = None) -> list[Found]:
    """Every memory-tier folder of this user under ``shm_dir`` (default: the ``shm_dir`` knob)."""
    base = os.path.join(shm_dir or knobs.get("shm_dir"), user_dir_name())
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        try:
            out.append(look(os.path.join(base, name)))
        except FileNotFoundError:  # removed since the listing (a reader closing, another gc)
            continue
    return out


def look(folder: str, *, locked: bool = False) -> Found:
    """How the memory-tier folder ``folder`` (``<shm_dir>/nebula_ckpt-<uid>/<name>``) is now.

    ``locked``: this process holds the folder's lock (``gc`` deciding again before it removes),
    so the folder is not in use by anyone else and the lock is not probed.

    Raises:
        FileNotFoundError: the folder is gone.
    """
    try:
        secure_folder(folder, default_layout=True, create=False)
    except FileNotFoundError:
        raise
    except OSError as e:
        return Found(folder, None, False, str(e), 0)
    in_use = False
    if not locked:
        fd = try_lock(folder)
        if fd is not None:
            os.close(fd)
        in_use = fd is None
    return Found(folder, read_owner(folder), in_use, None, tree_bytes(folder))
