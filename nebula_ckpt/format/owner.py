"""Whose checkpoints a memory tier's folder holds: what its ``ROOT`` file says.

A memory-tier folder (:mod:`nebula_ckpt.tiers.memory.shm`) records the root and the run it
keeps checkpoints for, so a process of another root or run never takes them for its own. The
tier runtimes, the root opened for a run and the CLI all name the owner by this value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

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
