"""Launch N real ranks (subprocesses, gloo on 127.0.0.1) of a test worker and collect their reports.

Both sides of a multi-rank test in one place. The test calls :func:`run_ranks` and reads what each
rank wrote with :func:`reports`; the worker (a script of this folder, which is on its ``sys.path``:
``from launch import gloo``) becomes a node of a simulated cluster with :func:`simulated_node`
(before it imports nebula_ckpt), joins the job with :func:`gloo` and writes its report with
:func:`write_report`. This module imports no torch at its top: a worker sets its environment first.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

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


def simulated_node(shm_base: str, node: str) -> str:
    """Make this process a rank of node ``node``: ``NEBULA_NODE_ID=node`` and a memory tier folder of
    the node's own, ``<shm_base>/<node>`` (created), as ``NEBULA_SHM_DIR``. Returns that folder.

    Ranks given the same ``node`` share a memory tier folder like the ranks of one machine do;
    call it before importing nebula_ckpt.
    """
    shm = os.path.join(shm_base, node)
    os.environ["NEBULA_NODE_ID"] = node
    os.environ["NEBULA_SHM_DIR"] = shm
    os.makedirs(shm, exist_ok=True)
    return shm


@contextlib.contextmanager
def gloo(**kw: Any) -> Iterator[int]:
    """The job's default process group (gloo, ``env://`` from :func:`run_ranks`), for the body's
    time; yields this process's rank. ``kw`` goes to ``init_process_group`` (e.g. ``timeout``).

    The group is destroyed when the body returns, not when it raises: a rank that fails ends with
    its traceback (its peers time out) instead of waiting in the teardown.
    """
    import torch.distributed as dist

    dist.init_process_group("gloo", **kw)
    yield dist.get_rank()
    dist.destroy_process_group()


def write_report(out: str | Path, scenario: str, rank: int, report: Any, **json_kw: Any) -> None:
    """Write a rank's report as ``<out>/<scenario>-r<rank>.json`` (what :func:`reports` reads);
    ``json_kw`` goes to ``json.dump`` (e.g. ``default=str``)."""
    with open(os.path.join(out, f"{scenario}-r{rank}.json"), "w") as f:
        json.dump(report, f, **json_kw)


@contextlib.contextmanager
def shm_folder(base: Path) -> Iterator[str]:
    """A fresh memory-tier folder for a job's ranks (``NEBULA_SHM_DIR``: under /dev/shm when it is
    writable, else under ``base``), removed afterwards."""
    import shutil
    import uuid

    shm = os.path.join("/dev/shm" if os.access("/dev/shm", os.W_OK) else str(base),
                       f"nebula-test-{uuid.uuid4().hex[:10]}")
    os.makedirs(shm)
    try:
        yield shm
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(world: int, script: str, args: list[str], out: Path, shm_dir: str, timeout: float = 240,
              env_extra: Optional[dict[str, str]] = None) -> list[subprocess.CompletedProcess[str]]:
    """Start ``world`` ranks of ``script`` like torchrun would (env://) and wait for all of them
    (started warm: tests/warm_python.py)."""
    import warm_python  # the test's side only: a worker imports this module too, without tests/ on its path

    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), NEBULA_SHM_DIR=shm_dir, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(HERE.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **(env_extra or {}))
        procs.append(warm_python.popen([sys.executable, str(HERE / script), *args], env=env, text=True,
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


def run_ok(world: int, script: str, args: list[str], out: Path, shm_dir: str,
           **kw: Any) -> list[subprocess.CompletedProcess[str]]:
    """:func:`run_ranks` (``kw``: its keywords), every rank required to end with 0: the failure
    shows the output of the rank that did not."""
    done = run_ranks(world, script, args, out, shm_dir, **kw)
    for r, p in enumerate(done):
        assert p.returncode == 0, f"rank {r} ended with {p.returncode}:\n{p.stdout[-6000:]}"
    return done


def run_mode(tmp: Path, script: str, mode: str, root: str, shm_dir: str, world: int = 2) -> Path:
    """Run ``world`` ranks of ``script`` as ``script MODE ROOT OUT`` (every rank must end with 0),
    ``OUT`` a new folder ``tmp/out-MODE`` for their reports; return it."""
    out = tmp / f"out-{mode}"
    out.mkdir()
    run_ok(world, script, [mode, root, str(out)], out, shm_dir, timeout=150)
    return out


def reports(out: Path, scenario: str, world: int) -> list[dict[str, Any]]:
    """The JSON each rank wrote (``<scenario>-r<rank>.json``)."""
    return [json.loads((out / f"{scenario}-r{r}.json").read_text()) for r in range(world)]
