"""The memory tier at run time: a verified, claimed, locked ``/dev/shm`` folder whose shards are links.

Its storage (:class:`MemoryStorage`, which :meth:`~nebula_ckpt.tiers.memory.tier.MemoryTier.make_storage`
hands out) says a full tmpfs in :func:`no_room_error`; the settings module imports this one for it,
so this one names the settings by what it reads of them (:class:`MemorySettings`), and
:func:`shm_available` lives here.

Its slot files, at the end of this module: staging buffers that are files of the tier's
``slots/`` folder, so that a save's memory-tier step links them instead of copying. Those left by
processes that are gone are taken over (:func:`sweep_slot_files`), a process's idle ones are found
again (:func:`own_spare_slot_files`), and an idle one that only this process's garbage still maps is
freed for staging (:func:`mapped_by_garbage`)."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import mmap
import os
import stat
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, runtime_checkable

from nebula_ckpt import knobs
from nebula_ckpt.format.commit import committed_writes
from nebula_ckpt.format.names import LOCK_FILE, ROOT_FILE, SLOT_DIR, slot_file_name, slot_owner
from nebula_ckpt.format.owner import read_owner
from nebula_ckpt.storage.base import Buffer, Storage
from nebula_ckpt.storage.holds import read_elsewhere
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.memory.room import Room
from nebula_ckpt.tiers.memory.shm import (
    Claim,
    ClaimRefused,
    Owner,
    current_uid,
    held_here,
    remove_if_unused,
    secure_folder,
    secure_subfolder,
    unlist_steps,
)
from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger(__name__)


@runtime_checkable
class MemorySettings(Protocol):
    """What the runtime reads of the memory tier's settings beside a :class:`~nebula_ckpt.tiers.base.Tier`'s
    (:class:`~nebula_ckpt.tiers.memory.tier.MemoryTier`'s; that module imports this one for
    :class:`MemoryStorage`, so this one does not import it)."""

    path: Optional[str]
    default_layout: bool


class MemoryStorage(LocalStorage):
    """The memory tier's folder as storage: owner-only files, no fsync (a tmpfs), every mapping it
    reads holding a reader lock (``hold_reads``: a restart may take its files over); a shard write
    that finds the tmpfs full raises :func:`no_room_error` (tier, file, sizes, what to do) instead
    of a bare ``ENOSPC``.

    Args:
        folder: the tier's folder; tier: its name (for that error).
    """

    def __init__(self, folder: str, tier: str) -> None:
        super().__init__(folder, private=True, fsync=False, hold_reads=True)
        self.tier = tier

    def write_buffer(self, rel: str, data: Buffer) -> dict[str, Any]:
        with self._room_for(rel, memoryview(data).nbytes):
            return super().write_buffer(rel, data)

    def write_parts(self, rel: str, parts: list[memoryview]) -> dict[str, Any]:
        with self._room_for(rel, sum(memoryview(p).nbytes for p in parts)):
            return super().write_parts(rel, parts)

    @contextlib.contextmanager
    def _room_for(self, rel: str, needed: int) -> Iterator[None]:
        """An ``ENOSPC`` of the write inside becomes :func:`no_room_error` (``needed``: its bytes)."""
        try:
            yield
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise no_room_error(self.tier, self.root, rel, needed, e) from e


class MemoryTierRuntime(TierRuntime):
    """The memory tier (``/dev/shm``): a verified, claimed, locked folder whose shards are links.

    * ``open`` verifies the folder chain and claims it for the run (:mod:`nebula_ckpt.tiers.memory.shm`);
    * ``open_for_writing`` takes the folder's lock: a second live process on the same root reads
      this tier but never writes it;
    * CPU saves stage into files of its ``.slots/`` folder, and the shard is a hard link of the
      slot (one copy of the bytes); slower tiers then read the shard it wrote;
    * an incremental step needs room for its changed bytes beside the staged copy; where the
      tmpfs has none, the step is written whole instead (its staged file linked: no room needed),
      and only if that cannot fit either does the save fail there (:func:`no_room_error`);
    * ``close`` removes the folder when the newest step it holds is committed on a persistent
      tier (a clean end); otherwise it stays for a restart (``nebula-ckpt gc`` frees it later).
    """

    feeds_slower = True

    def __init__(self, tier: Tier, storage: Storage) -> None:
        super().__init__(tier, storage)
        assert isinstance(tier, MemorySettings), "a memory tier's settings (MemoryTier)"
        self._memory_tier = tier
        self._claim: Optional[Claim] = None
        self._slots: Optional[str] = None
        self._owner: Optional[Owner] = None
        self._created = False  # open() made the folder: release() removes it if nothing was put in
        self._whole_steps = 0  # incremental steps written whole for want of room (write_whole_instead)
        #: copy-on-write mappings of this tier's files a restore made: (mapping, path, inode, size)
        self._cow_maps: list[tuple[weakref.ref[mmap.mmap], str, tuple[int, int], int]] = []
        self._room: Optional[Room] = None

    @property
    def folder(self) -> str:
        """The tier's folder."""
        path = self._memory_tier.path
        assert path is not None, "MemoryTier.bind() was not called"
        return path

    def _secure(self, create: bool) -> None:
        """Create (or only verify) the folder chain; raises as :func:`~nebula_ckpt.tiers.memory.shm.secure_folder`."""
        secure_folder(self.folder, default_layout=self._memory_tier.default_layout, create=create)

    def open(self, owner: Owner) -> bool:
        why = shm_available(self.folder)
        if why:
            if knobs.chosen("shm_dir") or not self._memory_tier.default_layout:  # a place the user chose
                log.warning("nebula_ckpt: memory tier skipped: %s (the folder chosen for it: NEBULA_SHM_DIR "
                            "or MemoryTier(path=...)); saves go to the slower tiers only. Create it on a "
                            "tmpfs, or leave the default /dev/shm", why)
            else:  # no /dev/shm on this system (macOS): nothing to say beyond the info
                log.info("nebula_ckpt: memory tier skipped: %s", why)
            return False
        self._owner = owner
        try:
            self._created = not os.path.isdir(self.folder)
            self._secure(create=True)
            self._claim = Claim(self.folder, owner)
            if os.path.isdir(os.path.join(self.folder, SLOT_DIR)):
                # names of slot files of processes that are gone (their checkpoints keep the bytes)
                sweep_slot_files(secure_subfolder(self.folder, SLOT_DIR))
        except (OSError, ClaimRefused) as e:
            log.warning("nebula_ckpt: memory tier not used: %s", e)
            return False
        return True

    def open_for_writing(self) -> bool:
        assert self._claim is not None and self._owner is not None
        if not os.path.isdir(self.folder):
            # removed since open() (a reader on the same root closed, or `nebula-ckpt gc`): again
            self._claim.release()
            if not self.open(self._owner):
                return False
            self._created = False
        if not self._claim.lock():
            if held_here(self.folder):
                log.warning("nebula_ckpt: memory tier %s is written by another Checkpointer of this process on the "
                            "same root, which holds it until it is closed; this one saves without it. Close the "
                            "older Checkpointer (or engine) before a new one saves", self.folder)
            else:
                log.warning("nebula_ckpt: memory tier %s is written by another live process on the same "
                            "root (a second job on one root?); this one saves without it", self.folder)
            return False
        try:  # open() already swept the names of dead processes' slot files
            self._slots = secure_subfolder(self.folder, SLOT_DIR)
        except OSError as e:
            log.warning("nebula_ckpt: memory tier %s: no staging slot files (%s); copying instead", self.folder, e)
        return True

    def admits(self, nbytes: int, step: int) -> bool:
        """Whether the tmpfs has room for a state of ``nbytes`` (:mod:`nebula_ckpt.tiers.memory.room`)."""
        if self._room is None:
            self._room = Room(self.folder)
        return self._room.admits(nbytes, step)

    def affords(self, steps: set[int], ranked: list[int]) -> set[int]:
        """Of ``steps``, the steps beyond the newest one only while the tmpfs has room for them
        beside the next save (:meth:`~nebula_ckpt.tiers.memory.room.Room.keeps`) and a save short of
        the host-memory budget does not need their room (:attr:`tight`): kept steps never make the
        next save fail for want of room."""
        extra = steps - set(ranked[-1:])
        if not extra:
            return steps
        if self.tight:
            log.warning("nebula_ckpt: memory tier %s gives up step(s) %s, which no persistent tier holds, for a save "
                        "short of the host-memory budget; a restart may resume an older step if the newer ones are "
                        "marked suspect. Save to a persistent tier more often, or pass a larger host_memory_budget",
                        self.folder, sorted(extra))
            return steps - extra
        if self._room is None:
            self._room = Room(self.folder)
        return steps if self._room.keeps(sorted(extra), ranked[-1]) else steps - extra

    def staging_dir(self) -> Optional[str]:
        return self._slots

    def lock_for_adoption(self) -> bool:
        """Take the folder's lock, as a save would: True when this process may delete a
        checkpoint of the tier to hand its pages over (:mod:`nebula_ckpt.tiers.memory.adopt`). Give it back
        with :meth:`unlock_after_adoption`."""
        return self._claim is not None and os.path.isdir(self.folder) and self._claim.lock()

    def unlock_after_adoption(self) -> None:
        """Give the lock back once the handed-over step is deleted (its file has no name left, so
        nothing of the tier's protects it any more): a process that only restores (an evaluation
        script) must not keep a restarted job from writing the tier. A later save takes it again."""
        if self._claim is not None:
            self._claim.release()

    def track_copy_on_write(self, mm: mmap.mmap, path: str, st: os.stat_result) -> None:
        """Count the copy-on-write mapping ``mm`` of the tier's file ``path`` (``st``: its stat) in
        :meth:`dropped_cow_bytes` for as long as it lives (:mod:`nebula_ckpt.tiers.memory.adopt`)."""
        self._cow_maps.append((weakref.ref(mm), path, (st.st_dev, st.st_ino), st.st_size))

    def dropped_cow_bytes(self) -> int:
        live = [m for m in self._cow_maps if m[0]() is not None]
        self._cow_maps = live
        dropped: dict[tuple[int, int], int] = {}
        for _, path, ident, size in live:
            try:
                st = os.stat(path, follow_symlinks=False)
                named = (st.st_dev, st.st_ino) == ident
            except OSError:
                named = False
            if not named:  # retention deleted it: only the mappings keep its pages
                dropped[ident] = size
        return sum(dropped.values())

    def fenced(self, handed_over: bool = False) -> None:
        """Give the folder's lock back: a fenced writer writes the tier no more, and the newer
        writer (or its restart) may take it. The folder and its checkpoints stay."""
        if self._claim is not None and self._claim.locked:
            if handed_over:
                log.info("nebula_ckpt: memory tier %s: handed over to a newer Checkpointer of this process",
                         self.folder)
            else:
                log.warning("nebula_ckpt: memory tier %s: this writer was fenced; giving the tier up", self.folder)
            self._claim.release()

    def unreadable(self, owner: Owner) -> Optional[str]:
        try:
            self._secure(create=False)
        except FileNotFoundError:
            return "no memory tier"
        except OSError as e:
            return str(e)
        have = read_owner(self.folder)
        if have is None or have.root != owner.root:
            return "its ROOT file names no or another root"
        if have.run_id != owner.run_id:
            return f"it holds an earlier run of {owner.root} (cleared by the next job on this root)"
        return None

    def write_whole_instead(self, rel: str, write: Callable[[], dict[str, Any]],
                            error: OSError) -> Optional[dict[str, Any]]:
        """No room on the tmpfs for an incremental step's changed bytes beside its staged copy
        (``error``: ENOSPC): write the step whole (``write()``), as a full save does (its staged
        slot file linked, which takes no room; a copy otherwise). Logged at INFO the first time
        (later ones at DEBUG), counted in :meth:`whole_fallbacks`. Raises :func:`no_room_error`
        when the whole step cannot fit either; None for any other error (it stands)."""
        if error.errno != errno.ENOSPC:
            return None
        self.storage.remove(rel)  # what the failed write left of the step's own shard
        info = write()
        self._whole_steps += 1
        log.log(logging.INFO if self._whole_steps == 1 else logging.DEBUG,
                "nebula_ckpt: memory tier %s: no room for the changed bytes of an incremental step beside its "
                "staged copy (%s); %s written whole instead (its staged copy is the shard: no room needed). "
                "stats()['memory_tier_whole_fallbacks'] counts these", self.name, error, rel)
        return info

    def whole_fallbacks(self) -> int:
        return self._whole_steps

    def close(self, runtimes: list[TierRuntime]) -> None:
        if self._claim is None or not self._claim.locked:
            return  # never written by this process: not ours to remove
        persistent = [rt for rt in runtimes if rt.persistent]
        if not persistent:
            return
        try:  # writes, not step numbers: the first write of a step saved twice does not make the second safe
            mem = committed_writes(self.storage)
            safe: set[tuple[int, int, int]] = set()
            for rt in persistent:  # a copy counts when it would restore, not by its marker alone
                safe.update(w for w in committed_writes(rt.storage) if w != max(mem, default=None)
                            or self.restorable(rt.storage, w[1]))
        except Exception as e:
            log.warning("nebula_ckpt: memory tier %s kept: cannot check the slower tiers (%s)", self.folder, e)
            return
        if mem and max(mem) not in safe:
            log.warning("nebula_ckpt: memory tier %s kept: its newest step %d (save %d of writer generation %d) is "
                        "committed on no slower tier, or its copies there do not restore (a file missing or cut short)",
                        self.folder, max(mem)[1], max(mem)[2], max(mem)[0])
            return
        alone = sorted(self.keep_also([w[1] for w in mem]))  # the newest healthy step, if only here
        if alone:
            log.warning("nebula_ckpt: memory tier %s kept: step(s) %s, which a restart resumes before the newer ones "
                        "marked suspect, are committed on no slower tier", self.folder, alone)
            return
        unlist_steps(self.folder)  # markers first: a kill in the middle leaves no step listed half deleted
        self.storage.remove_dir("")  # a clean close: the state is safe on a slower tier; free the RAM
        log.debug("nebula_ckpt: memory tier %s removed", self.folder)

    def release(self) -> None:
        if self._claim is not None:
            wrote = self._claim.locked
            self._claim.release()
            if self._created and not wrote:
                # a Checkpointer that only read leaves no empty folder behind in /dev/shm
                remove_if_unused(self.folder, (LOCK_FILE, ROOT_FILE, SLOT_DIR))
            self._claim = None
        super().release()


def shm_available(path: str) -> Optional[str]:
    """``None`` if the memory tier can live at ``path``, else the reason it cannot."""
    base = os.path.dirname(os.path.dirname(path))
    if not os.path.isdir(base):
        return f"{base} is not a folder" if os.path.exists(base) else f"{base} does not exist"
    if not os.access(base, os.W_OK):
        return f"{base} is not writable"
    return None


def no_room_error(tier: str, folder: str, rel: str, needed: int, error: OSError) -> OSError:
    """The ``ENOSPC`` error of a memory-tier write, saying which tier and file, how many bytes it
    needed and how many its tmpfs has free, that nothing saved before is lost, and what to do."""
    try:
        st = os.statvfs(folder)
        room = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
    except OSError:
        room = "free space unknown"
    where = os.path.join(folder, rel)
    return OSError(errno.ENOSPC, f"memory tier {tier}: no room on its tmpfs for {where}: it needs {needed} "
                   f"bytes, its file system has {room} ({error}). The steps it holds before stay intact and the "
                   "slower tiers still take this save. Free room there (other jobs' files, `nebula-ckpt gc`), "
                   "keep fewer steps (MemoryTier(keep_last=...)), or put the memory tier on a bigger tmpfs "
                   "(NEBULA_SHM_DIR, or a larger /dev/shm)")


# -- slot files: staging buffers in the tier's slots/ folder --------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # beyond pid_t: no process has it
        return False
    except PermissionError:
        return True
    return True


def sweep_slot_files(slot_dir: str) -> int:
    """Take over the slot files left by processes that are gone; return how many names were removed.

    A name whose file a checkpoint still links is removed (the checkpoint keeps the bytes until
    its own retention removes it). A file nothing links any more is an idle staging buffer whose
    tmpfs pages already exist: it is renamed to this process (a *spare*, see
    :func:`own_spare_slot_files`) instead of being freed, so the next save can stage in it
    without paying for new pages, and freeing it costs the restore nothing. A file that a process
    still reads or maps copy-on-write (an incremental step's base a restore mapped, whose step
    retention dropped since: :func:`~nebula_ckpt.storage.holds.read_elsewhere`) is never made a
    spare, since a save would stage into it in place: only its name goes.
    """
    removed = 0
    try:
        names = os.listdir(slot_dir)
    except FileNotFoundError:
        return 0
    for name in names:
        pid = slot_owner(name)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        path = os.path.join(slot_dir, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == current_uid() \
                    and not read_elsewhere(path):
                os.rename(path, os.path.join(slot_dir, slot_file_name()))
            else:
                os.unlink(path)
                removed += 1
        except FileNotFoundError:
            pass
    if removed:
        log.info("nebula_ckpt: removed %d slot file name(s) of finished processes in %s", removed, slot_dir)
    return removed


def own_spare_slot_files(slot_dir: str, exclude: set[str]) -> list[tuple[str, int]]:
    """``(path, size)`` of this process's slot files in ``slot_dir`` not in ``exclude`` that no
    checkpoint links and no process reads or maps copy-on-write: spares taken over by
    :func:`sweep_slot_files`, free to stage in."""
    out: list[tuple[str, int]] = []
    try:
        names = os.listdir(slot_dir)
    except FileNotFoundError:
        return out
    for name in names:
        path = os.path.join(slot_dir, name)
        if slot_owner(name) != os.getpid() or path in exclude:
            continue
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == current_uid() \
                and not read_elsewhere(path):
            out.append((path, st.st_size))
    return out


def mapped_by_garbage(paths: Iterable[str], collected: set[str]) -> bool:
    """Whether a garbage collection let go of the last mapping of one of ``paths`` (this process's
    idle slot files) that no checkpoint links any more but a mapping still reads; each is collected
    for once (``collected``: those collected for already, updated).

    A copy of a memory-tier step to a slower tier (``close()``, or a save short of the host-memory
    budget putting the newest step there before it is given up) maps the step's shard, a slot
    file. A reference cycle can keep that mapping after the copy returned (a caught exception's
    traceback holds the copy's frames), until the collector runs: the file would count as held
    memory and never be staged in again, and a save short of the budget would find nothing to
    free. A mapping that something still uses (a restore's tensors) stays, and so does the file.
    """
    held = []
    for path in paths:
        try:
            unlinked = path not in collected and os.lstat(path).st_nlink == 1
        except FileNotFoundError:
            continue
        if unlinked and read_elsewhere(path):
            held.append(path)
    if not held:
        return False
    collected.update(held)
    gc.collect()
    freed = [p for p in held if not read_elsewhere(p)]
    if freed:
        log.debug("nebula_ckpt: slot file(s) %s: their last mappings were garbage; staged in again", freed)
    return bool(freed)
