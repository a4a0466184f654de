"""Fixtures of the tier contract suite: one place to write, for every kind of tier.

``tier_factory`` is parametrized over ``memory``, ``local``, ``azure`` and ``s3``; each test gets a
fresh location (a private folder under the ``shm_dir`` fixture, a ``tmp_path`` folder, a fresh
Azurite container or moto bucket) and builds as many :class:`TierUnderTest` tiers and
Checkpointers on it as it likes. ``remote_tier_factory`` is the azure / s3 half only.

The blob servers are the session fixtures of ``tests/blob/conftest.py``, imported here (fixtures
are only visible below the conftest that defines them); ``pythonpath = . tests`` in pytest.ini
makes ``blob`` importable. Every test of the contract suite (``test_contract*.py`` here; not the tier
tests beside it nor those of ``memory/``) is bounded in time: a ``timeout`` mark of
pytest-timeout (:data:`TEST_TIME_LIMIT_S`, tighter than pytest.ini's suite-wide 600 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

import nebula_ckpt as nc
import warm_python
from blob.conftest import Store, _store, azurite, moto_s3  # noqa: F401  (re-exported fixtures)
from nebula_ckpt.storage.base import Storage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: wall-clock limit of one test (setup of function fixtures and teardown included), applied as a
#: pytest-timeout mark by :func:`pytest_collection_modifyitems`
TEST_TIME_LIMIT_S = 90
_HERE = Path(__file__).resolve().parent

KINDS = ["memory", "local", pytest.param("azure", marks=pytest.mark.blob),
         pytest.param("s3", marks=pytest.mark.blob)]
REMOTE_KINDS = [pytest.param("azure", marks=pytest.mark.blob), pytest.param("s3", marks=pytest.mark.blob)]


@dataclass
class TierUnderTest:
    """One place where a tier lives, and how to reach it again (new tier objects, raw storage, CLI).

    Attributes:
        kind: ``memory``, ``local``, ``azure`` or ``s3``.
        root: the ``Checkpointer`` root to use with this tier (its identity and fencing place).
        location: the tier's own folder or URL (what ``nebula-ckpt`` is pointed at).
        storage_options: fsspec options for remote tiers, else ``None``.
        store: the blob store (server handle) for remote tiers, else ``None``.
    """

    kind: str
    root: str
    location: str
    storage_options: Optional[dict[str, Any]] = None
    store: Optional[Store] = None
    _raw: Optional[Storage] = field(default=None, repr=False)

    @property
    def remote(self) -> bool:
        return self.kind in ("azure", "s3")

    def make(self, **kw: Any) -> nc.Tier:
        """A new tier object on this location (tier settings in ``kw``)."""
        if self.kind == "memory":
            return nc.MemoryTier(path=self.location, **kw)
        if self.kind == "local":
            return nc.LocalTier(self.location, **kw)
        return nc.RemoteTier(self.location, storage_options=self.storage_options, **kw)

    @property
    def name(self) -> str:
        """The tier's name as the library reports it (``list(detailed=True)``, ``last_restore``)."""
        return self.make().name

    def checkpointer(self, tier: Optional[nc.Tier] = None, **kw: Any) -> nc.Checkpointer:
        """A new Checkpointer whose only tier is ``tier`` (default: a fresh ``make()``)."""
        return nc.Checkpointer(self.root, storage_options=self.storage_options if self.remote else None,
                               tiers=[tier if tier is not None else self.make()], **kw)

    @contextlib.contextmanager
    def raw(self) -> Iterator[Storage]:
        """Direct access to the tier's files / objects (a storage object of its own, kept open
        until the test ends: an S3 client costs about a second to set up)."""
        if self._raw is None:
            self._raw = self.make().make_storage()
        yield self._raw

    def close(self) -> None:
        """Release the raw storage."""
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    def step_dirs(self) -> list[str]:
        """``step-N`` names present on the tier, committed or not, sorted by N."""
        with self.raw() as st:
            return sorted((n for n in st.list("") if n.startswith("step-")), key=lambda n: int(n[5:]))

    def cli_args(self, cmd: str, *extra: str) -> list[str]:
        """Arguments of ``nebula_ckpt.cli.main`` for ``cmd`` on this tier."""
        args = [cmd, self.location, *extra]
        if self.storage_options:
            args += ["--storage-options", json.dumps(self.storage_options)]
        return args

    def plain(self) -> dict[str, Any]:
        """JSON-serialisable description, for a subprocess (see :func:`tier_from_plain`)."""
        return {"kind": self.kind, "root": self.root, "location": self.location,
                "storage_options": self.storage_options}


def tier_from_plain(d: dict[str, Any]) -> TierUnderTest:
    """Inverse of :meth:`TierUnderTest.plain`."""
    return TierUnderTest(d["kind"], d["root"], d["location"], d["storage_options"])


def run_python(code: str, *args: str, timeout: float = 60, env: Optional[dict[str, str]] = None
               ) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (repo and tests/ importable); raise with its output on failure."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"),
                                              full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = warm_python.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                        timeout=timeout, env=full_env, cwd=REPO, check=False)
    assert r.returncode == 0, f"subprocess failed (rc={r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


def _make(request: pytest.FixtureRequest, kind: str, tmp_path: Any, shm_dir: str) -> Iterator[TierUnderTest]:
    if kind == "memory":
        # the same layout as the default (<shm_dir>/nebula_ckpt-<uid>/<run>), in the test's private shm
        loc = os.path.join(shm_dir, "nebula_ckpt-contract", "run")
        tk = TierUnderTest("memory", str(tmp_path / "run"), loc)
    elif kind == "local":
        loc = str(tmp_path / "run")
        tk = TierUnderTest("local", loc, loc)
    else:
        gen = _store(request, kind)
        store = next(gen)
        try:
            url = store.url("run")
            tk = TierUnderTest(kind, url, url, dict(store.storage_options), store)
            yield tk
            tk.close()
        finally:
            for _ in gen:  # the store's own teardown (restarts a stopped server)
                pass
        return
    yield tk
    tk.close()


@pytest.fixture(params=KINDS)
def tier_factory(request: pytest.FixtureRequest, tmp_path: Any, shm_dir: str) -> Iterator[TierUnderTest]:
    """Every kind of tier, each on a fresh location."""
    yield from _make(request, request.param, tmp_path, shm_dir)


@pytest.fixture(params=REMOTE_KINDS)
def remote_tier_factory(request: pytest.FixtureRequest, tmp_path: Any, shm_dir: str) -> Iterator[TierUnderTest]:
    """The remote kinds only (Azurite, moto S3)."""
    yield from _make(request, request.param, tmp_path, shm_dir)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Bound every test of the contract suite by TEST_TIME_LIMIT_S (pytest-timeout) unless it sets its own.

    A conftest cannot use ``pytestmark``, and this hook sees the items of the whole session, so
    it picks the suite's by path: the ``test_contract*.py`` files of this folder.
    """
    for item in items:
        path = item.path.resolve()
        if (path.parent == _HERE and path.name.startswith("test_contract")
                and item.get_closest_marker("timeout") is None):
            item.add_marker(pytest.mark.timeout(TEST_TIME_LIMIT_S))
