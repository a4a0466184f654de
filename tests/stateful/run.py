"""Running the machines: the bounded profile (``make test``), the long one (``make soak``), replays.

Every run uses one seed per machine, printed first; a failure prints its seed, the shrunk
sequence of operations Hypothesis found and its ``@reproduce_failure`` blob, with the command
that replays it (tests/stateful/README.md). Environment:

* ``NEBULA_STATEFUL_SEED``: the seed (default: a fixed one in ``make test``, a random one in a soak);
* ``NEBULA_STATEFUL_BLOB``: a ``@reproduce_failure`` blob to replay (with the Hypothesis version
  it was printed by, ``VERSION:BLOB``);
* ``NEBULA_STATEFUL_DB``: the Hypothesis example database (default: a folder under the system's
  temporary folder; never in the repository).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hypothesis import HealthCheck, Phase, reproduce_failure, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import run_state_machine_as_test

#: the seed of the bounded profile: fixed, so that `make test` runs the same sequences every time
BOUNDED_SEED = 20261130


def shm_base() -> Path:
    """A private folder standing in for the nodes' /dev/shm (under /dev/shm when there is one)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    path = Path(base) / f"nebula-stateful-{uuid.uuid4().hex[:10]}"
    path.mkdir(mode=0o700)
    return path


def database() -> DirectoryBasedExampleDatabase:
    path = os.environ.get("NEBULA_STATEFUL_DB") or os.path.join(tempfile.gettempdir(), "nebula-stateful-db")
    return DirectoryBasedExampleDatabase(path)


@dataclass
class Outcome:
    machine: str
    seed: int
    examples: int
    seconds: float
    error: Optional[BaseException] = None
    report: list[str] = field(default_factory=list)

    def replay(self) -> str:
        blob = os.environ.get("NEBULA_STATEFUL_BLOB")
        how = f"NEBULA_STATEFUL_BLOB='{blob}'" if blob else f"NEBULA_STATEFUL_SEED={self.seed}"
        return f"{how} make soak MACHINE={self.machine} EXAMPLES={max(self.examples, 1)}"


def run(machine: Any, name: str, *, examples: int, steps: int, seed_: Optional[int] = None,
        shrink: bool = True) -> Outcome:
    """Run ``machine`` (a RuleBasedStateMachine whose ``shared`` is set) for ``examples`` sequences of
    up to ``steps`` operations; the outcome, with the failure (if any) and how to replay it."""
    env_seed = os.environ.get("NEBULA_STATEFUL_SEED")
    chosen = int(env_seed) if env_seed else (seed_ if seed_ is not None else random.SystemRandom().randrange(2**32))
    print(f"stateful: machine {name}, seed {chosen} (replay: NEBULA_STATEFUL_SEED={chosen})", flush=True)
    factory = seed(chosen)(machine)
    blob = os.environ.get("NEBULA_STATEFUL_BLOB")
    if blob:
        version, _, data = blob.partition(":")
        factory = reproduce_failure(version, data.encode())(factory)
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target] + ([Phase.shrink] if shrink else [])
    conf = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=database(),
                    print_blob=True, phases=phases, suppress_health_check=list(HealthCheck),
                    report_multiple_bugs=False)
    before = machine.shared.examples
    t0 = time.monotonic()
    out = Outcome(name, chosen, 0, 0.0)
    try:
        run_state_machine_as_test(factory, settings=conf)
    except BaseException as e:  # noqa: BLE001 - reported with its seed, then raised by the caller
        out.error = e
    out.examples = machine.shared.examples - before
    out.seconds = time.monotonic() - t0
    print(f"stateful: machine {name}: {out.examples} sequence(s) in {out.seconds:.0f} s"
          + (f"; FAILED (seed {chosen}; replay: {out.replay()})" if out.error else ""), flush=True)
    return out
