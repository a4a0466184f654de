"""The local tier: a folder on a local or network file system (NVMe, NFS, ...)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.storage.urls import local_path
from nebula_ckpt.tiers.base import Tier


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
        path = os.fspath(path) if isinstance(path, os.PathLike) else path
        self.path = local_path(path) or path

    @property
    def display_url(self) -> str:
        return os.path.abspath(self.path)

    def make_storage(self) -> Storage:
        return LocalStorage(self.path)
