"""The local tier: a folder on a local or network file system (NVMe, NFS, ...)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.storage.urls import local_path
from nebula_ckpt.tiers.base import Tier

_EXAMPLE = "nc.LocalTier('/nvme/ckpt')"


@dataclass
class LocalTier(Tier):
    """A directory on a local or network file system (NVMe, NFS, ...).

    Example::

        nc.LocalTier("/nvme/ckpt", every=1, keep_last=3)
    """

    path: str = ""

    def __init__(self, path: "str | os.PathLike[str]", **kw: Any) -> None:
        super().__init__(**kw)
        self.kind = "local"
        path = require_location(path, "LocalTier", "path", _EXAMPLE)
        if not local_path(path):  # a URL of another scheme, or file:// with no path
            raise ValidationError(f"LocalTier: path must be a local folder (or a file:// URL of one), got {path!r}; "
                                  f"pass the folder the tier writes to, e.g. {_EXAMPLE}, or use "
                                  "nc.RemoteTier(url) for a remote URL")
        self.path = local_path(path) or path

    def validate(self) -> None:
        super().validate()
        require_location(self.path, "LocalTier", "path", _EXAMPLE)

    @property
    def display_url(self) -> str:
        return os.path.abspath(self.path)

    def make_storage(self) -> Storage:
        return LocalStorage(self.path)


def require_location(value: Any, cls: str, arg: str, example: str) -> str:
    """``value`` (a path or URL string, or an ``os.PathLike``) as a string; a tier given no
    location (``""``, None, another type) is refused: an empty path would be the current directory.

    Raises:
        ValidationError: naming ``cls``'s argument ``arg`` and the fix (``example``: the call).
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{cls}: {arg} must be a non-empty string, got {value!r} (an empty path would be the "
                              f"current directory); pass where the tier keeps its checkpoints, e.g. {example}")
    return value
