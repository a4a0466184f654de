"""One digest of a replica worker's training state (model, extra, frozen, optimizer moments)."""

from __future__ import annotations

import hashlib
from typing import Any


def digest(st: dict[str, Any]) -> str:
    """SHA-256 over every tensor of ``st`` (``model``, ``extra``, ``frozen`` when present, the
    optimizer's state), in a fixed order: equal digests mean bit-exact states."""
    h = hashlib.sha256()
    for k, v in sorted(st["model"].state_dict().items()):
        h.update(k.encode() + v.numpy().tobytes())
    h.update(st["extra"].numpy().tobytes())
    if "frozen" in st:
        h.update(st["frozen"].numpy().tobytes())
    for k, s in sorted(st["optim"].state_dict()["state"].items()):
        for name, t in sorted(s.items()):
            h.update(f"{k}/{name}".encode() + t.numpy().tobytes())
    return h.hexdigest()
