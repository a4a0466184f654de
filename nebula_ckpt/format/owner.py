"""Whose checkpoints a memory tier's folder holds: what its ``ROOT`` file says.

A memory-tier folder (:mod:`nebula_ckpt.tiers.memory.shm`) records the root and the run it
keeps checkpoints for, so a process of another root or run never takes them for its own. The
tier runtimes, the root opened for a run and the CLI all name the owner by this value.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass
from typing import Optional

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.names import LOCK_FILE, ROOT_FILE
from nebula_ckpt.storage.local import read_small_file

log = logging.getLogger(__name__)

#: the largest ``ROOT`` file a reader reads (one names a root path or URL: at most a few KiB); a
#: larger file (a crafted or sparse one) is refused unread, like a garbled one
MAX_OWNER_BYTES = 1 << 16


@dataclass(frozen=True)
class Owner:
    """What a memory tier's ``ROOT`` file says: whose checkpoints these are."""

    root: str
    run_id: Optional[str]

    def to_bytes(self) -> bytes:
        """Serialise."""
        return json.dumps({"root": self.root, "run_id": self.run_id}).encode()

    @staticmethod
    def parse(data: bytes) -> Optional["Owner"]:
        """Parse; ``None`` when unreadable. A pre-run-id ``ROOT`` (the bare root) has no run id."""
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            try:
                text = data.decode()
            except UnicodeDecodeError:
                return None
            return Owner(text, None) if text and "\n" not in text else None
        if not isinstance(d, dict) or not isinstance(d.get("root"), str):
            return None
        run = d.get("run_id")
        return Owner(d["root"], run if isinstance(run, str) else None)


def read_owner(folder: str) -> Optional[Owner]:
    """The owner recorded in ``folder``, or ``None`` (no ``ROOT`` file, or unreadable). A ``ROOT``
    that is no regular file (a FIFO is never waited on), a symlink, or larger than
    :data:`MAX_OWNER_BYTES` is never read: no owner (a warning names it)."""
    try:
        data = read_small_file(os.path.join(folder, ROOT_FILE), MAX_OWNER_BYTES)
    except CorruptCheckpointError as e:
        log.warning("nebula_ckpt: memory tier %s: its %s file is unreadable: %s", folder, ROOT_FILE, e)
        return None
    except OSError:
        return None
    return Owner.parse(data)


def is_tier_folder(folder: str) -> bool:
    """Whether ``folder`` is a memory tier's folder: it holds the ``ROOT`` and ``LOCK`` files a
    claim leaves (regular files, links not followed), which no checkpoint root holds."""
    for name in (ROOT_FILE, LOCK_FILE):
        try:
            if not stat.S_ISREG(os.lstat(os.path.join(folder, name)).st_mode):
                return False
        except OSError:
            return False
    return True
