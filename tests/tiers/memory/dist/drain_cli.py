"""``nebula-ckpt persist-memory ROOT --json`` as one node's epilogue runs it, in a process of its own
(run by tests/tiers/memory/dist/test_drain.py with that node's ``NEBULA_SHM_DIR``).

Usage: python drain_cli.py ROOT [KILL] [GATE]

``KILL`` kills the drain with SIGKILL at a named point: ``part:N`` once it wrote N ranks' parts,
``commit`` once the manifest is written and before the ``COMMIT`` (a fault injected at a named
stage, beside the real process and the real kill); ``-``: none. ``GATE``: a path; the process
writes ``GATE.ready-<pid>`` once imported, then waits for ``GATE`` to exist (drains of several
nodes started at once).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from nebula_ckpt.cli import main
from nebula_ckpt.save import drain

ROOT = sys.argv[1]
KILL = sys.argv[2] if len(sys.argv) > 2 else "-"
GATE = sys.argv[3] if len(sys.argv) > 3 else ""


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if KILL.startswith("part:"):
    real_put, count = drain.Drain._put, int(KILL.split(":")[1])

    def put(self: Any, c: Any) -> None:
        real_put(self, c)
        if len(self.written) >= count:
            _die()
    drain.Drain._put = put  # type: ignore[method-assign]
elif KILL == "commit":
    def commit(storage: Any, fence: Any, step: int, mbytes: bytes, *_: Any) -> None:
        storage.write_small(f"step-{step}/manifest.json", mbytes)
        _die()
    drain.commit_manifest = commit  # type: ignore[assignment]

if GATE:
    with open(f"{GATE}.ready-{os.getpid()}", "w"):
        pass
    while not os.path.exists(GATE):
        time.sleep(0.01)
sys.exit(main(["persist-memory", ROOT, "--json"]))
