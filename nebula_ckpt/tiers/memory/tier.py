"""The memory tier's settings: host memory in a tmpfs (``/dev/shm``) that outlives the process.

Its default folder is ``<shm_dir>/nebula_ckpt-<uid>/<hash of root and rank>``
(:func:`memory_tier_path`); what it does at run time (claims, locks, slot files, links) is
:class:`~nebula_ckpt.tiers.memory.runtime.MemoryTierRuntime`, and its storage, which says a full
tmpfs, is :class:`~nebula_ckpt.tiers.memory.runtime.MemoryStorage`: the one import of a runtime
module by settings (that module names these settings by their shape, never importing this one).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from nebula_ckpt import knobs
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import canonical_root
from nebula_ckpt.tiers.base import Capabilities, Tier
from nebula_ckpt.tiers.local import require_location
from nebula_ckpt.tiers.memory.runtime import MemoryStorage
from nebula_ckpt.tiers.memory.shm import user_dir_name


@dataclass
class MemoryTier(Tier):
    """Host memory that survives a crash of the training process (``/dev/shm``, a tmpfs).

    Files are owner-only and removed by a clean ``close()``; after a crash a new process with the
    same ``root`` finds them (the folder name is a hash of the root URL, checked against a
    ``ROOT`` file inside, so another run's memory tier is never taken for this one's).

    Args:
        path: folder to use; default: ``<shm_dir>/nebula_ckpt-<uid>/<hash of root>``.
        keep_last: default 1 (the previous checkpoint is deleted only after the new one commits);
            with ``replicas``, keep 2 (``docs/multi-rank.md``: a node lost mid-round may leave no
            step common to every rank with 1).
        replicas: copies of each rank's memory-tier step kept in the memory tier of ``replicas``
            partner ranks on other nodes, so that losing up to that many nodes loses no rank's
            newest step (:mod:`nebula_ckpt.tiers.memory.replicas`). Default 0: a copy costs the
            partner's RAM and a transfer per save, and a job on one node has no partner.
    """

    path: Optional[str] = None
    replicas: int = 0
    #: True when the folder is the default ``<shm_dir>/nebula_ckpt-<uid>/<hash>`` (set by bind)
    default_layout: bool = field(default=False, init=False)

    def __init__(self, path: Optional[str] = None, *, keep_last: int = 1, replicas: int = 0, **kw: Any) -> None:
        super().__init__(keep_last=keep_last, **kw)
        self.kind = "memory"
        self.path = None if path is None else _folder(path)
        self.replicas = replicas
        self.default_layout = False

    def validate(self) -> None:
        super().validate()
        if self.path is not None:
            _folder(self.path)
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 0:
            raise ValidationError(f"tier {self.name}: replicas must be an int >= 0 (copies on other nodes), "
                                  f"got {self.replicas!r}")

    def bind(self, root_url: str, rank: int = 0) -> None:
        """Resolve the default folder for ``root_url`` and ``rank`` (called by the Checkpointer)."""
        if self.path is None:
            self.path = memory_tier_path(root_url, rank)
            self.default_layout = True

    @property
    def display_url(self) -> str:
        return self.path or "<unbound>"

    @property
    def persistent(self) -> bool:
        """A tmpfs does not survive a reboot."""
        return False

    @property
    def capabilities(self) -> Capabilities:
        """Each rank has its own memory tier; its base stays in RAM; a restarted process may take
        its pages; ``replicas`` copies of it on partner nodes; a CPU save's shard is a link of the
        slot file it staged in."""
        return Capabilities(per_rank=True, keeps_base_in_ram=True, hands_pages_to_restart=True,
                            replicas=self.replicas, links_staged=True)

    def make_storage(self) -> Storage:
        assert self.path is not None, "MemoryTier.bind() was not called"
        return MemoryStorage(self.path, self.name)


def _folder(path: Any) -> str:
    """The folder ``path`` given to a memory tier, as a string; "" or another type is refused
    (None, not "", chooses the default folder)."""
    folder = require_location(path, "MemoryTier", "path", "nc.MemoryTier(path='/dev/shm/my-run'), or "
                              "nc.MemoryTier() for the default folder")
    if "://" in folder:
        raise ValidationError(f"MemoryTier: path must be a folder in a tmpfs (e.g. under /dev/shm), got {folder!r}; "
                              "pass a local folder, or no path for the default one")
    return folder


def memory_tier_path(root: str, rank: int = 0) -> str:
    """Default memory-tier folder for ``root`` and ``rank`` (ranks on one host never share one)."""
    ident = canonical_root(root) + (f"#rank={rank}" if rank else "")
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return os.path.join(knobs.get("shm_dir"), user_dir_name(), digest)
