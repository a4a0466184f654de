"""Loopback blob servers for the tests: Azurite (Azure Blob) and moto (S3).

The launching (127.0.0.1, port 0, stop / start on the same port with the same data, moto's
signing helper) is :mod:`.emulators`, which the remote benchmark borrows. This module adds what only the tests need:

* each server starts at construction and holds a session container (``url_prefix``);
* :meth:`BlobServer.new_container` returns a :class:`BlobLocation`, plain data that can be
  passed to a subprocess (``json.dumps(loc.plain())``);
* :meth:`BlobServer.freeze` / :meth:`BlobServer.thaw`: SIGSTOP / SIGCONT, a hung endpoint;
* a missing server raises :class:`ServerUnavailable` (the tests skip with its message).

Install the servers with ``scripts/install_blob_servers.sh``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from .emulators import INSTALL_SCRIPT, AzuriteEmulator, Emulator, EmulatorUnavailable, MotoEmulator

REPO = Path(__file__).resolve().parents[2]

__all__ = ["REPO", "INSTALL_SCRIPT", "ServerUnavailable", "BlobLocation", "BlobServer",
           "AzuriteServer", "MotoServer"]

#: the server binary / package is not installed (tests skip with this message)
ServerUnavailable = EmulatorUnavailable


@dataclass(frozen=True)
class BlobLocation:
    """Where a test may write: plain data, usable from another process.

    Attributes:
        kind: ``"azure"`` or ``"s3"``.
        url_prefix: ``az://<container>`` or ``s3://<bucket>``.
        storage_options: fsspec storage options (credentials + endpoint).
        endpoint: ``http://127.0.0.1:PORT`` of the server.
    """

    kind: str
    url_prefix: str
    storage_options: dict[str, Any]
    endpoint: str

    def url(self, *parts: str) -> str:
        """``url_prefix`` joined with ``parts``."""
        return "/".join([self.url_prefix.rstrip("/"), *[p.strip("/") for p in parts if p]])

    def plain(self) -> dict[str, Any]:
        """JSON-serialisable dict (for a subprocess)."""
        return asdict(self)

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> "BlobLocation":
        """Inverse of :meth:`plain`."""
        return cls(**d)


class BlobServer(Emulator):
    """The test extras over an emulator; concrete servers mix this with its emulator class.

    Constructing one starts it and creates the session container.
    """

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._default: Optional[BlobLocation] = None
        try:
            self.start()
            self._default = self.new_container("session")
        except BaseException:
            self.close()
            raise

    @property
    def url_prefix(self) -> str:
        """URL prefix of the session's default container / bucket."""
        assert self._default is not None
        return self._default.url_prefix

    def location(self, url_prefix: str) -> BlobLocation:
        """Plain connection info for the container at ``url_prefix``."""
        return BlobLocation(self.kind, url_prefix, self.storage_options, self.endpoint)

    def new_container(self, prefix: str = "t") -> BlobLocation:
        """Create a fresh, uniquely named container / bucket and return its location."""
        return self.location(self.create_container(prefix))

    def freeze(self) -> None:
        """SIGSTOP the server process: connections are still accepted (by the kernel) but no
        request is ever answered -- a hung endpoint, unlike :meth:`stop`'s refused one."""
        os.kill(self._pid(), signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze` (harmless when not frozen or not running)."""
        try:
            os.kill(self._pid(), signal.SIGCONT)
        except (ProcessLookupError, RuntimeError):
            pass

    def _pid(self) -> int:
        pid = self.pid
        if pid is None:
            raise RuntimeError(f"{self.kind} server is not running")
        return pid


class AzuriteServer(BlobServer, AzuriteEmulator):
    """Azurite blob service (node process) on 127.0.0.1, started, with a session container."""


class MotoServer(BlobServer, MotoEmulator):
    """moto S3 (helper process keeping its state across stop()/start()), started, with a
    session container."""
