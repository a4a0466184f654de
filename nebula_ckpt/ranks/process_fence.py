"""One writer generation per process and root, for writers that are not one long-lived object.

The DCP writer (:class:`nebula_ckpt.dcp.writer.NebulaStorageWriter`) is made anew for every
save, but a job writing many steps keeps one generation: :func:`process_fence` hands it the
generation this process took on the root before, or the newest one when this very process took
it (a ``Checkpointer`` of the same job: they share it rather than fence each other), else a new
one (:mod:`nebula_ckpt.ranks.fencing`).
"""

from __future__ import annotations

import math
import os
import socket
import threading
from typing import Callable, Optional

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.names import writer_record
from nebula_ckpt.format.root_records import MAX_ROOT_RECORD_BYTES, parse_writer_record
from nebula_ckpt.ranks.coordinator import LocalCoordinator
from nebula_ckpt.ranks.fencing import Fence, generations
from nebula_ckpt.storage.base import Storage

#: writer generation per (process, root): one job writing many steps keeps one generation
_GENERATIONS: dict[str, int] = {}
_LOCK = threading.Lock()


def _process_start() -> float:
    """When this process started (seconds since the epoch); +inf where it cannot be told."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])   # field 22: starttime, in clock ticks
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return math.inf


def _taken_here(storage: Storage, g: int) -> bool:
    """Whether generation ``g`` was taken by this very process (a Checkpointer of it, say)."""
    try:
        rec = parse_writer_record(storage.read_small(writer_record(g), MAX_ROOT_RECORD_BYTES),
                                  f"{storage.display_url}: {writer_record(g)}")
    except (OSError, CorruptCheckpointError):
        return False
    return rec.host == socket.gethostname() and rec.pid == os.getpid() and rec.time >= _process_start() - 1.0


class _ProcessGeneration(LocalCoordinator):
    """Hands :class:`Fence` this process's generation on the root (or ``fixed``)."""

    def __init__(self, storage: Storage, fixed: Optional[int] = None) -> None:
        self.storage = storage
        self.fixed = fixed

    def shared_generation(self, take: Callable[[], int]) -> int:
        if self.fixed is not None:
            return self.fixed
        st = self.storage
        with _LOCK:
            g = _GENERATIONS.get(st.display_url)
            gens = generations(st)
            if gens and (g is None or gens[-1] > g) and _taken_here(st, gens[-1]):
                g = gens[-1]
            if g is None or g not in gens:  # none yet, or the root was deleted and made again
                g = take()
            _GENERATIONS[st.display_url] = g
            return g


def process_fence(storage: Storage, generation: Optional[int] = None) -> Fence:
    """The fence of this process on the root ``storage``: its generation there (see the module
    docstring), or ``generation`` when the caller already holds one (another rank's process
    told it)."""
    return Fence(storage, _ProcessGeneration(storage, generation))
