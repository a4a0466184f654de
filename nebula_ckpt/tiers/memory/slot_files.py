"""Slot files in the memory tier's ``slots/`` folder: staging buffers that are tmpfs files, so that
a save's memory-tier step links them instead of copying. Those left by processes that are gone
are taken over (:func:`sweep_slot_files`), and a process's idle ones are found again
(:func:`own_spare_slot_files`)."""

from __future__ import annotations

import logging
import os
import stat

from nebula_ckpt.format.names import slot_file_name, slot_owner
from nebula_ckpt.storage.local import read_elsewhere
from nebula_ckpt.tiers.memory.shm import current_uid

log = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
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
    retention dropped since: :func:`~nebula_ckpt.storage.local.read_elsewhere`) is never made a
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
