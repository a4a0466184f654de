"""Tiers: where checkpoints are persisted, in order from fastest to slowest.

A :class:`Checkpointer` writes every accepted snapshot to each tier whose cadence wants it, each
tier on its own writer thread, all from the same host snapshot. Restore looks at every tier.

Defaults (``Checkpointer(root)``): a :class:`MemoryTier` in ``/dev/shm`` (survives a process
crash, not a reboot) and the ``root`` itself (a :class:`LocalTier` for a path, a
:class:`RemoteTier` for any other fsspec URL).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import urlsplit, urlunsplit

from nebula_ckpt import knobs
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.storage.base import Storage

if TYPE_CHECKING:
    from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger(__name__)


@dataclass
class Tier:
    """Common settings of a tier.

    Args:
        every: persist every N-th save of the checkpointer (1 = every save).
        every_seconds: persist at most once per this many seconds (``None`` = no time limit).
        keep_last: committed checkpoints to keep on this tier (``None``: the checkpointer's).
        keep_every: also keep forever every step divisible by this (milestones).
        verify: restore check: ``"full"`` (sizes + every checksum), ``"size"`` (sizes only).
    """

    every: int = 1
    every_seconds: Optional[float] = None
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    verify: str = "full"
    kind: str = field(default="local", init=False)

    def bind(self, root_url: str, rank: int = 0) -> None:
        """Resolve settings that depend on the Checkpointer's root and rank (called by it)."""

    def validate(self) -> None:
        """Raise :class:`ValidationError` on bad settings."""
        if not isinstance(self.every, int) or self.every < 1:
            raise ValidationError(f"tier {self.name}: every must be an int >= 1, got {self.every!r}")
        if self.every_seconds is not None and self.every_seconds < 0:
            raise ValidationError(f"tier {self.name}: every_seconds must be >= 0")
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ValidationError(f"tier {self.name}: keep_last must be an int >= 1 (the newest "
                                  f"checkpoint is never deleted), got {self.keep_last!r}")
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise ValidationError(f"tier {self.name}: keep_every must be an int >= 1")
        if self.verify not in ("full", "size"):
            raise ValidationError(f"tier {self.name}: verify must be 'full' or 'size'")

    @property
    def persistent(self) -> bool:
        """Whether the tier survives a reboot (``close()`` leaves the newest step on every such tier)."""
        return True

    @property
    def shared(self) -> bool:
        """Whether every rank of a job sees this tier (one manifest for all ranks, committed by the
        coordinator) rather than each rank its own (the memory tier: keyed by root and rank)."""
        return True

    @property
    def name(self) -> str:
        """Short name for logs: ``memory``, ``local:/path``, ``remote:s3://b/p``."""
        return f"{self.kind}:{self.display_url}"

    @property
    def display_url(self) -> str:
        """Location without credentials."""
        raise NotImplementedError

    def make_storage(self) -> Storage:
        """Create the storage backend of this tier."""
        raise NotImplementedError

    def runtime(self, storage: Storage) -> "TierRuntime":
        """What this tier does while a Checkpointer runs (see :mod:`nebula_ckpt.tiers.runtime`)."""
        from nebula_ckpt.tiers.runtime import TierRuntime

        return TierRuntime(self, storage)


@dataclass
class LocalTier(Tier):
    """A directory on a local or network file system (NVMe, NFS, ...).

    Example::

        nc.LocalTier("/nvme/ckpt", every=1, keep_last=3)
    """

    path: str = ""

    def __init__(self, path: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.kind = "local"
        self.path = _local_path(path) or path

    @property
    def display_url(self) -> str:
        return os.path.abspath(self.path)

    def make_storage(self) -> Storage:
        from nebula_ckpt.storage.local import LocalStorage

        return LocalStorage(self.path)


@dataclass
class MemoryTier(Tier):
    """Host memory that survives a crash of the training process (``/dev/shm``, a tmpfs).

    Files are owner-only and removed by a clean ``close()``; after a crash a new process with the
    same ``root`` finds them (the folder name is a hash of the root URL, checked against a
    ``ROOT`` file inside, so another run's memory tier is never taken for this one's).

    Args:
        path: folder to use; default: ``<shm_dir>/nebula_ckpt-<uid>/<hash of root>``.
        keep_last: default 1 (the previous checkpoint is deleted only after the new one commits).
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
        self.path = path
        self.replicas = replicas
        self.default_layout = False

    def validate(self) -> None:
        super().validate()
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
    def shared(self) -> bool:
        """Each rank has its own memory tier."""
        return False

    def runtime(self, storage: Storage) -> "TierRuntime":
        """Claims, locks, slot files and links (see :class:`~nebula_ckpt.tiers.runtime.MemoryTierRuntime`)."""
        from nebula_ckpt.tiers.runtime import MemoryTierRuntime

        return MemoryTierRuntime(self, storage)

    def make_storage(self) -> Storage:
        from nebula_ckpt.storage.local import LocalStorage

        assert self.path is not None, "MemoryTier.bind() was not called"
        return LocalStorage(self.path, private=True, fsync=False, hold_reads=True)


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
        refuse_url_credentials(url, "RemoteTier")
        self.kind = "remote"
        self.url = url
        self.storage_options = storage_options
        self.compression = compression

    def validate(self) -> None:
        super().validate()
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
        from nebula_ckpt.storage.remote import FsspecStorage

        return FsspecStorage(self.url, self.storage_options, compression=self.compression)


#: ``scheme://rest`` of one URL (a chained fsspec URL ``a::b://...`` is checked part by part)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)


def _password_in(url: str) -> Optional[str]:
    """If ``url`` (or a part of a chained ``a::b`` URL) carries a password in its user info,
    a credential-free way to show it (``s3://***@bucket/run``); else None. Never parses the URL
    with :mod:`urllib` (whose errors quote the host part, the password included).

    The host part is the text after ``://`` up to the first ``/``, ``?`` or ``#``. A password is
    a ``:`` in the user info (before the host part's last ``@``), or a ``:`` in a host part
    without ``@`` that is not followed by a port number (``KEY:se/cr@et@bucket``: the password
    holds a ``/``), or a ``host:port`` followed by an ``@`` further on (``KEY:1234/abc@bucket``).
    A user name alone is no secret: Azure's ``abfs://container@account.dfs.core.windows.net``.
    """
    for part in url.split("::"):
        m = _URL.match(part)
        if m is None:
            continue
        scheme, rest = m.groups()
        head = re.split(r"[/?#]", rest, maxsplit=1)[0]
        bare = re.sub(r"\[[^\]]*\]", "", head)  # an IPv6 literal's colons are no password
        userinfo, at, host = bare.rpartition("@")
        _, colon, port = host.partition(":")
        if (at and ":" in userinfo) or (colon and not port.isdigit() and port) or \
                (colon and "@" in rest[len(head):]):
            tail = rest.rpartition("@")[2] if "@" in rest else ""
            return f"{scheme}://***@{tail}" if tail else f"{scheme}://***"
    return None


def refuse_url_credentials(url: Any, what: str = "root") -> None:
    """Refuse a URL with a password in its user info (``s3://KEY:SECRET@bucket/run``).

    The one check every entry point that takes a root or tier URL makes first, before the URL
    is parsed, logged, shown, or written to a file (run.json, pointers): a URL travels into all
    of these. A user name alone is allowed (Azure's ``container@account...`` form).

    Raises:
        ValidationError: saying to pass the credentials in ``storage_options``; the message
            never holds the user info.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        return
    shown = _password_in(url)
    if shown is not None:
        raise ValidationError(
            f"the {what} URL {shown} carries a password in its user info (user:password@ before the host; shown "
            "here as ***): a URL is logged, shown and written to files, so it must hold no secret. Give the URL "
            "without it and pass the credentials in storage_options, e.g. storage_options={'key': ..., "
            "'secret': ...} for s3://, {'account_name': ..., 'account_key': ...} (or 'sas_token', "
            "'connection_string') for az:// / abfs://; a user name alone (az://container@account...) is fine")


def strip_credentials(url: str) -> str:
    """Drop a password and the query string from a URL (they may carry secrets). A user name
    alone stays: it names the container in Azure's ``abfs://container@account...``."""
    hidden = _password_in(url)
    if hidden is not None:  # never parsed: the parser's errors would quote the password
        return hidden
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if not parts.scheme:
        return url
    netloc = (f"{parts.username}@" if parts.username else "") + (parts.hostname or "")
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _local_path(url: str) -> Optional[str]:
    """The local path of ``url`` if it is a path or a file:// URL, else None."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if "://" in url:
        return None
    return os.path.expanduser(url)


def canonical_root(root: str) -> str:
    """A stable identity for a root: absolute path for local roots, the credential-free URL otherwise."""
    p = _local_path(root)
    return os.path.realpath(p) if p is not None else strip_credentials(root).rstrip("/")


def memory_tier_path(root: str, rank: int = 0) -> str:
    """Default memory-tier folder for ``root`` and ``rank`` (ranks on one host never share one)."""
    ident = canonical_root(root) + (f"#rank={rank}" if rank else "")
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(knobs.get("shm_dir"), f"nebula_ckpt-{uid}", digest)


def tier_for_root(root: str, storage_options: Optional[dict[str, Any]] = None, **kw: Any) -> Tier:
    """The persistent tier of ``root``: local for a path / file:// URL, remote otherwise.

    Raises:
        ValidationError: ``root`` carries a password (:func:`refuse_url_credentials`).
    """
    refuse_url_credentials(root)
    p = _local_path(root)
    if p is not None:
        if storage_options:
            raise ValidationError(f"root '{root}' is a local path; storage_options are only for "
                                  "remote URLs (az://, s3://, ...)")
        return LocalTier(p, **kw)
    return RemoteTier(root, storage_options=storage_options, **kw)


def default_tiers(root: str, storage_options: Optional[dict[str, Any]] = None,
                  memory: bool = True, rank: int = 0) -> list[Tier]:
    """``[MemoryTier bound to root and rank, <root tier>]`` (or just the root tier)."""
    root_tier = tier_for_root(root, storage_options)
    if not memory:
        return [root_tier]
    mem = MemoryTier()
    mem.bind(root, rank)
    return [mem, root_tier]


def shm_available(path: str) -> Optional[str]:
    """``None`` if the memory tier can live at ``path``, else the reason it cannot."""
    base = os.path.dirname(os.path.dirname(path))
    if not os.path.isdir(base):
        return f"{base} does not exist"
    if not os.access(base, os.W_OK):
        return f"{base} is not writable"
    return None


def now() -> float:
    """Clock for cadences."""
    return time.monotonic()
