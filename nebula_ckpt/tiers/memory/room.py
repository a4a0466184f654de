"""Whether the memory tier's tmpfs has room for the state: checked before a save goes there.

The memory tier holds its newest step while the next one is written beside it, so a state of
``n`` bytes needs ``2 n`` in its tmpfs (plus the free fraction the library always leaves there,
``NEBULA_SHM_MIN_FREE``). A container's ``/dev/shm`` is often far smaller than a state (Docker
gives 64 MiB): without this check every save would fail there with ``ENOSPC``, an error per save.
So before each save (a ``statvfs`` and a listing of the tier's folder: microseconds), the room is
counted: the tmpfs's free bytes plus what the tier itself holds (its older steps and staging files
make way for the new ones). A state that does not fit makes the memory tier stand aside for that
save, with one warning per run that names the fix (``docker run --shm-size``, Kubernetes'
``emptyDir`` with ``medium: Memory``, ``NEBULA_SHM_DIR``); the other tiers take the save as
usual. Because the room is counted at every save, a state that grows later, or room that other
processes take meanwhile (or give back), is seen at the next save: the tier stands aside while
the state does not fit and takes saves again once it does (logged).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from nebula_ckpt import knobs
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.tiers.memory.shm import tree_bytes

__all__ = ["Room"]

log = logging.getLogger("nebula_ckpt")


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fix_text(shm_dir: str, need: int) -> str:
    """How to give the memory tier the room ``need`` (bytes) asks for."""
    gib = max(1, -(-need // 2**30))
    return (f"give it a larger tmpfs: docker run --shm-size={gib}g (Docker gives /dev/shm 64 MiB), in Kubernetes "
            f"a volume emptyDir: {{medium: Memory, sizeLimit: {gib}Gi}} mounted on /dev/shm, or NEBULA_SHM_DIR=<a "
            f"tmpfs with room> (now {shm_dir})")


class Room:
    """The room check of one memory tier (its folder ``folder`` in a tmpfs)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._warned = False
        self._warned_keep = False
        #: whether the last check let the tier take the save (None: no check yet)
        self._admitted: Optional[bool] = None

    def needed(self, nbytes: int) -> tuple[int, int, int]:
        """``(need, room, size)``: the bytes a state of ``nbytes`` needs, the room there is for it
        (free bytes, plus what the tier holds, less the free fraction always left), the tmpfs size."""
        st = os.statvfs(os.path.dirname(os.path.dirname(self.folder)))
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        held = tree_bytes(self.folder) if os.path.isdir(self.folder) else 0
        room = free + held - int(float(knobs.get("shm_min_free_fraction")) * total)
        return 2 * nbytes, room, total

    def admits(self, nbytes: int, step: int) -> bool:
        """Whether a save of ``nbytes`` (step ``step``) goes to the memory tier; says it once when
        it does not, and when it does again."""
        try:
            need, room, total = self.needed(nbytes)
        except OSError:  # the tier's writes say what is wrong with the folder
            return True
        fits = need <= room
        if not fits and not self._warned:
            self._warned = True
            shm_dir = os.path.dirname(os.path.dirname(self.folder))
            log.warning("nebula_ckpt: the memory tier stands aside from step %d on: the state is %s and the tier needs "
                        "%s (its newest step beside the next one) where %s has room for %s (%s in all); saves go to "
                        "the other tiers. To keep a copy in memory, %s", step, _size(nbytes), _size(need), shm_dir,
                        _size(max(room, 0)), _size(total), fix_text(shm_dir, need + total // 10))
        elif not fits and self._admitted is not False:
            log.info("nebula_ckpt: the memory tier stands aside from step %d on (state %s, room %s)", step,
                     _size(nbytes), _size(max(room, 0)))
        elif fits and self._admitted is False:
            log.info("nebula_ckpt: the memory tier takes saves again from step %d on (state %s, room %s)", step,
                     _size(nbytes), _size(room))
        self._admitted = fits
        return fits

    def keeps(self, steps: list[int], newest: int) -> bool:
        """Whether the tier has room to keep ``steps`` (the newest healthy step, those waiting for
        their confirmation, :mod:`nebula_ckpt.health`) beside its newest step ``newest`` and a next
        save as large, as :meth:`admits` counts it; says once when it does not (retention then
        deletes them as ``keep_last`` says)."""
        try:
            held = sum(tree_bytes(os.path.join(self.folder, step_dir(s))) for s in steps)
            need, room, total = self.needed(tree_bytes(os.path.join(self.folder, step_dir(newest))))
        except OSError:  # the tier's writes say what is wrong with the folder
            return True
        if need + held <= room:
            return True
        if not self._warned_keep:
            self._warned_keep = True
            shm_dir = os.path.dirname(os.path.dirname(self.folder))
            log.warning("nebula_ckpt: the memory tier cannot keep step(s) %s (%s), which no persistent tier holds, "
                        "beside its newest step %d and the next save: %s has room for %s; retention deletes them, and "
                        "a restart may resume an older step if the newer ones are marked suspect. Save to a persistent "
                        "tier more often, or %s", steps, _size(held), newest, shm_dir, _size(max(room, 0)),
                        fix_text(shm_dir, need + held + total // 10))
        return False
