"""A training job whose state goes bad, for tests/crash/test_health_restarts.py.

Usage: ``python health_worker.py ROOT jobs`` -- one run of the job: restore the newest step
(``RESTORED <step|none> <skipped steps as JSON>``), then train steps up to 30, saving every 5th,
reporting each step's loss (``LOSS <step> <loss>``). With ``HEALTH_FAULT_AT=S`` in the
environment, a "bad node" corrupts the state at step S: a countdown kept *in the state* makes the
loss NaN 4 steps later, so a checkpoint taken in between carries the fault. On a non-finite loss
the job reports it, says ``NAN <step>`` and dies by SIGKILL (no cleanup runs).

``python health_worker.py ROOT records`` -- for each line on stdin, fork a process that writes
health records of step 5 for ever (``WRITING <id>`` before each, ``WROTE <id> <name>`` once it is
durable) for the test to SIGKILL; a line ``link`` makes it kill itself inside its first write,
after the record's temporary file is written and fsync'd, right before it gets its name.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys

import torch

import nebula_ckpt as nc
from nebula_ckpt.health.book import HealthBook
from nebula_ckpt.storage.local import LocalStorage

STEPS = 30


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def jobs(root: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "step": -1, "fault": torch.tensor([-1])}
    fault_at = int(os.environ.get("HEALTH_FAULT_AT", "-1"))
    with nc.Checkpointer(root, memory_tier=False) as ck:
        got = ck.load_latest(into=state)
        skipped = [x["step"] for x in (ck.last_restore or {}).get("skipped", [])]
        print(f"RESTORED {'none' if got is None else got} {json.dumps(skipped)}", flush=True)
        for step in range(state["step"] + 1, STEPS):
            if step == fault_at:
                state["fault"].fill_(4)                       # the bad node: NaN four steps from now
            x, y = batch(step)
            loss = (model(x) - y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            value = float(loss)
            if int(state["fault"]) > 0:
                state["fault"] -= 1
                if int(state["fault"]) == 0:
                    value = math.nan
            print(f"LOSS {step} {value!r}", flush=True)
            ck.report(step, loss=value)
            if not math.isfinite(value):
                print(f"NAN {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step % 5 == 0:
                state["step"] = step
                ck.save(step, state)
                print(f"SAVED {step}", flush=True)
    print("FINISHED", flush=True)


def _line(text: str) -> None:
    """One line in one write: the parent's and the forked writer's lines never interleave."""
    os.write(1, (text + "\n").encode())


def records(root: str) -> None:
    """For each line on stdin (``plain`` or ``link``), fork a writer of records (``CHILD <pid>``)
    and wait until it is killed (``REAPED <pid>``): one import of torch for every kill."""
    book = HealthBook(LocalStorage(root))
    for cycle, line in enumerate(sys.stdin):
        pid = os.fork()
        if pid == 0:
            _write_records(book, cycle, line.strip() == "link")
        _line(f"CHILD {pid}")
        os.waitpid(pid, 0)
        _line(f"REAPED {pid}")


def _write_records(book: HealthBook, cycle: int, staged: bool) -> None:
    """The forked writer: records of step 5 for ever, until it is killed (``staged``: it kills
    itself after its first record's temporary file is written and fsync'd, before the ``link``
    that names it)."""
    if staged:
        real = os.link

        def dying(src: str, dst: str) -> None:
            if "_nebula/health" in dst:
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst)
        os.link = dying  # type: ignore[assignment]
    i = 0
    while True:
        _line(f"WRITING {cycle}-{i}")
        rec = book.append(step=5, generation=1, state="suspect" if i % 2 else "healthy", by="user", rank=None,
                          reason=f"record {cycle}-{i}")
        _line(f"WROTE {cycle}-{i} {rec.name}")
        i += 1


if __name__ == "__main__":
    {"jobs": jobs, "records": records}[sys.argv[2]](sys.argv[1])
