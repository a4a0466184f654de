"""The remote tier: any fsspec URL (Azure Blob, S3, GCS, ...), optionally zstd-compressed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import local_path, refuse_url_credentials, strip_credentials
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.local import require_location


@dataclass
class RemoteTier(Tier):
    """Any fsspec URL: ``az://container/prefix`` (adlfs), ``s3://bucket/prefix`` (s3fs), ...

    Args:
        url: the location.
        storage_options: passed to the fsspec file system (credentials, endpoint); never logged.
        compression: ``None`` or ``"zstd"`` (per upload part, so it stays parallel).
        verify: default ``"full"``.
    """

    url: str = ""
    storage_options: Optional[dict[str, Any]] = field(default=None, repr=False)  # credentials
    compression: Optional[str] = None

    def __init__(self, url: str, *, storage_options: Optional[dict[str, Any]] = None,
                 compression: Optional[str] = None, **kw: Any) -> None:
        super().__init__(**kw)
        url = require_location(url, "RemoteTier", "url", "nc.RemoteTier('s3://bucket/prefix')")
        refuse_url_credentials(url, "RemoteTier")
        if url.startswith("file://"):  # file://localhost/p is file:///p; another host is refused (a slip)
            url = f"file://{local_path(url)}"
        self.kind = "remote"
        self.url = url
        self.storage_options = storage_options
        self.compression = compression

    def validate(self) -> None:
        super().validate()
        require_location(self.url, "RemoteTier", "url", "nc.RemoteTier('s3://bucket/prefix')")
        if self.compression not in (None, "zstd"):
            raise ValidationError(f"tier {self.name}: compression must be None or 'zstd'")
        if self.compression == "zstd":
            try:
                import zstandard  # noqa: F401
            except ImportError:
                raise ValidationError("compression='zstd' needs the zstandard package: "
                                      "pip install 'nebula_ckpt[zstd]'") from None

    @property
    def display_url(self) -> str:
        return strip_credentials(self.url)

    def __repr__(self) -> str:
        opts = "<hidden>" if self.storage_options else None
        return (f"RemoteTier(url={self.display_url!r}, storage_options={opts}, compression={self.compression!r}, "
                f"every={self.every}, every_seconds={self.every_seconds}, keep_last={self.keep_last}, "
                f"keep_every={self.keep_every}, verify={self.verify!r})")

    def make_storage(self) -> Storage:
        from nebula_ckpt.storage.remote import FsspecStorage  # the backends load on first use

        return FsspecStorage(self.url, self.storage_options, compression=self.compression)
