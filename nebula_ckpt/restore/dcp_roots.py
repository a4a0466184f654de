"""Where DCP's reader and writer find a checkpoint: a root (path or URL) and its step.

A root is opened as its persistent tier would be (:func:`nebula_ckpt.tiers.roots.tier_for_root`,
validated); ``"<root>/step-N"`` names a step under a root.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.names import parse_step_dir
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.roots import tier_for_root


def tier_for(root: Union[str, "os.PathLike[str]"], storage_options: Optional[dict[str, Any]]) -> Tier:
    """The (validated) persistent tier of ``root``."""
    tier = tier_for_root(os.fspath(root), storage_options)
    tier.validate()
    return tier


def partial_job(storage: Storage, man: mf.Manifest) -> ValidationError:
    """The error for a checkpoint that holds only some ranks of its job (a rank's memory tier)."""
    return ValidationError(f"{storage.display_url} step {man.step}: holds rank(s) {list(man.ranks)[:8]} of a "
                           f"{man.world_size}-rank job only (a rank's own memory tier); read the shared root, "
                           "which holds every rank")


def storage_for(root: Union[str, "os.PathLike[str]"], storage_options: Optional[dict[str, Any]]) -> Storage:
    """The storage of ``root``'s persistent tier (the caller closes it)."""
    return tier_for(root, storage_options).make_storage()


class GivenStorage(Tier):
    """The tier of a :class:`Storage` handed to the reader (for :func:`find_and_open`'s logs)."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.kind = "storage"
        self._url = storage.display_url

    @property
    def display_url(self) -> str:
        """The storage's display URL (never with credentials)."""
        return self._url


def split_checkpoint_id(checkpoint_id: Union[str, "os.PathLike[str]"]) -> tuple[str, Optional[int]]:
    """``"/ckpt/run/step-12"`` -> ``("/ckpt/run", 12)``; a root -> ``(root, None)``."""
    text = os.fspath(checkpoint_id).rstrip("/")
    head, _, tail = text.rpartition("/")
    step = parse_step_dir(tail) if head else None
    return (head, step) if step is not None else (text, None)
