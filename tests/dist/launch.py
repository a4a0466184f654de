"""Launch N real ranks (subprocesses, gloo on 127.0.0.1) of a test worker and collect their reports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent


def leave(code: int = 0) -> None:
    """End a worker that used FSDP2 / DTensors on gloo without the interpreter's teardown.

    FSDP2's device mesh keeps the gloo process group alive after ``destroy_process_group`` (torch
    holds it from C++), so its worker threads are not joined then. A worker thread that drops the
    last collective's work during the interpreter's teardown frees Python-owned tensors, needs the
    GIL, is ended by Python, and the process aborts ("terminate called without an active
    exception", a gloo runLoop thread in ``~AsyncBarrierWork``). Leaving with ``os._exit`` after
    flushing skips that teardown; every report file is closed before.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(world: int, script: str, args: list[str], out: Path, shm_dir: str, timeout: float = 240,
              env_extra: Optional[dict[str, str]] = None) -> list[subprocess.CompletedProcess[str]]:
    """Start ``world`` ranks of ``script`` like torchrun would (env://) and wait for all of them."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), NEBULA_SHM_DIR=shm_dir, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(HERE.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, str(HERE / script), *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    done = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


def reports(out: Path, scenario: str, world: int) -> list[dict[str, Any]]:
    """The JSON each rank wrote (``<scenario>-r<rank>.json``)."""
    return [json.loads((out / f"{scenario}-r{r}.json").read_text()) for r in range(world)]
