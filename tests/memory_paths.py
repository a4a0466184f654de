"""Where a root's memory tier lives, for tests whose subject is not the memory tier.

Commit faults, fencing, the CLI, first contact and the multi-rank jobs check the memory tier's
folder of a root (what it holds, whether its lock is free) without testing the tier itself. This
module is the one test module outside ``tests/tiers/memory/`` allowed to import
``nebula_ckpt.tiers.memory`` (``tests/api/test_architecture.py``,
``test_memory_tier_tests_live_in_one_folder``); the memory tier's own tests live in that folder.
Where the public API answers, this module asks it: the folder comes from ``MemoryTier.bind``, as
a :class:`~nebula_ckpt.Checkpointer` binds its memory tier. Tests import it as ``memory_paths``
(``tests/`` is on pytest's path), spawned workers as ``tests.memory_paths`` (the repository is on
their ``PYTHONPATH``).
"""

from __future__ import annotations

import nebula_ckpt as nc
from nebula_ckpt.tiers.memory.shm import try_lock, user_dir_name

__all__ = ["memory_tier_path", "try_lock", "user_dir_name"]


def memory_tier_path(root: str, rank: int = 0) -> str:
    """The folder of ``root``'s memory tier for ``rank`` (under the current ``NEBULA_SHM_DIR``), as
    ``Checkpointer(root)`` of that rank uses by default."""
    tier = nc.MemoryTier()
    tier.bind(root, rank)
    assert tier.path is not None
    return tier.path
