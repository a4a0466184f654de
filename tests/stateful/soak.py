"""The long profile of the stateful test (``make soak``): new seeds until the time is up.

Usage: python tests/stateful/soak.py [--minutes M] [--examples N] [--machine single|ranks|both] [--steps S]

Each round runs every machine chosen with a fresh random seed for ``--examples`` sequences (default
10 a round). With ``--examples`` given and no ``--minutes``, or with ``NEBULA_STATEFUL_SEED`` set
(a replay), one round runs. A failure is reported with its seed, the shortest sequence Hypothesis
found, its ``@reproduce_failure`` blob and the command that replays it, and the soak goes on with
the next seed; the summary at the end counts the sequences run and lists every failure. The exit
status is 1 when anything failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from stateful.run import Outcome, run, shm_base  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--examples", type=int, default=None)
    p.add_argument("--steps", type=int, default=None,
                   help="operations per sequence (default: 30 one-process, 16 ranks)")
    p.add_argument("--machine", choices=["single", "ranks", "both"], default="both")
    p.add_argument("--no-shrink", action="store_true", help="report failures as found (shrinking can take minutes)")
    a = p.parse_args()
    replay = bool(os.environ.get("NEBULA_STATEFUL_SEED") or os.environ.get("NEBULA_STATEFUL_BLOB"))
    one_round = replay or (a.examples is not None and a.minutes is None)
    deadline = time.monotonic() + 60 * (a.minutes if a.minutes is not None else 10)
    names = ["single", "ranks"] if a.machine == "both" else [a.machine]
    outcomes: list[Outcome] = []
    while True:
        for name in names:
            outcomes.append(_one(name, a.examples or 10, a.steps, not a.no_shrink))
        if one_round or time.monotonic() >= deadline:
            break
    total = sum(o.examples for o in outcomes)
    failed = [o for o in outcomes if o.error is not None]
    print(f"\nstateful soak: {total} sequence(s) in {len(outcomes)} run(s), "
          f"{sum(o.seconds for o in outcomes) / 60:.1f} min; {len(failed)} failed")
    for o in failed:
        print(f"\n--- machine {o.machine}, seed {o.seed}: replay with\n    {o.replay()}")
        print("".join(traceback.format_exception_only(type(o.error), o.error))[-6000:])
    return 1 if failed else 0


def _one(name: str, examples: int, steps: int | None, shrink: bool) -> Outcome:
    base = Path(tempfile.mkdtemp(prefix=f"nebula-soak-{name}-"))
    shm = shm_base()
    if name == "single":
        from stateful.machine import Shared
        from stateful.machine import Single as machine
    else:
        from stateful.ranks import Ranks as machine
        from stateful.ranks import Shared  # type: ignore[no-redef]
    machine.shared = shared = Shared(base, shm)
    out = None
    try:
        out = run(machine, name, examples=examples, steps=steps or (30 if name == "single" else 16), shrink=shrink)
        return out
    finally:
        shared.close()
        shutil.rmtree(shm, ignore_errors=True)
        if out is not None and out.error is None:
            shutil.rmtree(base, ignore_errors=True)
        else:  # the workers' logs of a failure are kept
            print(f"stateful: the workers' logs are kept in {base / 'logs'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
