"""``nebula-ckpt gc ROOT --storage-options JSON``: a memory tier whose root is a blob store that needs
credentials is checked with the options given (its newest step durable there: removed); without
them the root cannot be checked, and the tier is kept. The options are shown nowhere."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

import warm_python

from .servers import BlobServer

pytestmark = [pytest.mark.blob, pytest.mark.timeout(600)]

JOB = """
import json, os, signal, sys, torch
import nebula_ckpt as nc
url, so = sys.argv[1], json.loads(sys.argv[2])
ck = nc.Checkpointer(url, storage_options=so, tiers=[nc.MemoryTier(), nc.RemoteTier(url, storage_options=so)])
ck.save(3, {"w": torch.full((16,), 3.0)})
os.kill(os.getpid(), signal.SIGKILL)
"""


def _gc(env: dict[str, str], *args: str) -> tuple[list[dict], str]:
    r = warm_python.run([sys.executable, "-m", "nebula_ckpt.cli", "gc", "--json", *args], env=env,
                        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stdout + r.stderr


def test_gc_checks_a_remote_root_with_the_storage_options_given(azurite: BlobServer, shm_dir: str) -> None:
    azurite.thaw()
    azurite.start()
    loc = azurite.new_container("gc")
    url, options = loc.url("run"), json.dumps(loc.storage_options)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "AZURE_STORAGE"))}
    env["NEBULA_SHM_DIR"] = shm_dir
    r = warm_python.run([sys.executable, "-c", JOB, url, options], env=env, capture_output=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    secrets = [str(v) for k, v in loc.storage_options.items() if "key" in k or "connection" in k]
    assert secrets

    (row,), text = _gc(env, url, "--root-timeout", "20")           # no credentials: the root is unknown
    assert not row["remove"] and "cannot check" in row["reason"], row
    (row,), text = _gc(env, url, "--dry-run", "--storage-options", options)
    assert row["remove"] and "durable" in row["reason"], row        # reached with the options: step 3 is there
    assert not any(s in text for s in secrets)
    (row,), text = _gc(env, url, f"--storage-options={options}")
    assert row["removed"] and "durable" in row["reason"], row
    assert not any(s in text for s in secrets)
