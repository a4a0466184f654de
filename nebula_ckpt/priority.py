"""Internal: background work that yields to training: lower a thread's scheduling priority (Linux).

On Linux a thread's nice value is its own (and a thread inherits its creator's), so the hash and
compare threads of incremental saves and the replicas' threads can run niced while the training
thread keeps its priority: where no core is idle they take what training leaves.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Iterable, Optional

log = logging.getLogger(__name__)


def lower_priority(nice: int, tids: Optional[Iterable[int]] = None) -> None:
    """Add ``nice`` (clamped to 0..19) to the nice value of the threads ``tids`` (native ids;
    default: the calling thread). A thread that is gone, or an OS that refuses, is left as it is."""
    nice = max(0, min(19, int(nice)))
    if not nice or not hasattr(os, "setpriority"):
        return
    for tid in [threading.get_native_id()] if tids is None else tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError as e:
            log.debug("nebula_ckpt: cannot lower the priority of thread %d: %s", tid, e)
