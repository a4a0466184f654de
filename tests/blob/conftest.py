"""Fixtures for the blob-store tests: Azurite and moto S3 on 127.0.0.1, started once per session.

* ``azurite`` / ``moto_s3``: the session's server objects (:mod:`.servers`) with
  ``url_prefix``, ``storage_options``, ``stop()`` / ``start()`` (same port, same data).
* ``blob_store``: parametrized over ``["azure", "s3"]``; a fresh, uniquely named container /
  bucket per test (:class:`.servers.BlobLocation`, plain data) with its ``server`` alongside.
* ``any_store``: like ``blob_store`` plus a ``memory://`` variant, for the tests that need no
  server (fast).

If a server cannot be had, its tests skip with a loud reason naming the install script.
"""

from __future__ import annotations

import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pytest

from .servers import INSTALL_SCRIPT, AzuriteServer, BlobLocation, BlobServer, MotoServer, ServerUnavailable


def _session_server(request: pytest.FixtureRequest, factory: type) -> Iterator[BlobServer]:
    try:
        server = factory()
    except ServerUnavailable as e:
        msg = f"!!! BLOB SERVER UNAVAILABLE: {e} -- these tests are SKIPPED; run {INSTALL_SCRIPT} !!!"
        warnings.warn(msg, stacklevel=1)
        tr = request.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(msg, red=True, bold=True)
        pytest.skip(msg)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def azurite(request: pytest.FixtureRequest) -> Iterator[BlobServer]:
    """Azurite (Azure Blob emulator) on 127.0.0.1, once per session."""
    yield from _session_server(request, AzuriteServer)


@pytest.fixture(scope="session")
def moto_s3(request: pytest.FixtureRequest) -> Iterator[BlobServer]:
    """moto S3 on 127.0.0.1, once per session."""
    yield from _session_server(request, MotoServer)


@dataclass
class Store:
    """A fresh place to write for one test.

    Attributes:
        kind: ``"azure"``, ``"s3"`` or ``"memory"``.
        url_prefix: container / bucket URL (``memory://<unique>`` for memory).
        storage_options: fsspec options (plain data).
        server: the server (``None`` for memory) -- ``stop()`` / ``start()``.
    """

    kind: str
    url_prefix: str
    storage_options: dict[str, Any]
    server: Optional[BlobServer] = None

    def url(self, *parts: str) -> str:
        """``url_prefix`` joined with ``parts``."""
        return "/".join([self.url_prefix.rstrip("/"), *[p.strip("/") for p in parts if p]])

    def location(self) -> Optional[BlobLocation]:
        """Plain connection info (for subprocesses); ``None`` for memory."""
        if self.server is None:
            return None
        return BlobLocation(self.kind, self.url_prefix, self.storage_options, self.server.endpoint)


def _store(request: pytest.FixtureRequest, kind: str) -> Iterator[Store]:
    if kind == "memory":
        url = f"memory://nebula-{uuid.uuid4().hex[:12]}"
        yield Store("memory", url, {})
        import fsspec
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
        return
    server: BlobServer = request.getfixturevalue("azurite" if kind == "azure" else "moto_s3")
    server.thaw()  # a previous test may have left it frozen or stopped
    server.start()
    loc = server.new_container()
    yield Store(kind, loc.url_prefix, loc.storage_options, server)
    server.thaw()
    server.start()


@pytest.fixture(params=["azure", "s3"])
def blob_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A fresh container (Azurite) / bucket (moto) per test."""
    yield from _store(request, request.param)


@pytest.fixture(params=["memory", "azure", "s3"])
def any_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """``blob_store`` plus a fast ``memory://`` variant."""
    yield from _store(request, request.param)
