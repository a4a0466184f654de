"""The model-based stateful test, bounded profile (``make test``; the long one is ``make soak``).

Random sequences of saves, saves of a step again, a second Checkpointer taking the root over in
the same process, SIGKILLs at named points, ``gc`` (also ``gc ROOT --root-timeout``),
``persist-memory``, lost nodes, moved run folders and restores in fresh processes, ``close()``
racing a save from another thread or landing in the optimizer's step hook from a SIGTERM handler,
a host-memory budget smaller than two states, in-process rollbacks (``load(N)``) and DCP reads,
a restore with one rank's ``into`` mismatched, the operator's ``verify`` / ``ls`` / ``gc``
beside a save held mid-way, ``verify`` / ``mark`` as subprocesses, a removal later steps refer to
(then every step loaded) and zstd toggled on the disk tier between jobs, checked after every
restore and every audit against a model of which save is committed where (tests/stateful/README.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stateful.machine import Shared, Single
from stateful.run import BOUNDED_SEED, run, shm_base

pytestmark = [pytest.mark.crash, pytest.mark.timeout(900)]


def test_one_process_jobs_on_two_nodes(tmp_path: Path) -> None:
    shm = shm_base()
    Single.shared = shared = Shared(tmp_path, shm)
    try:
        out = run(Single, "single", examples=3, steps=14, seed_=BOUNDED_SEED, shrink=False)
    finally:
        shared.close()
        shutil.rmtree(shm, ignore_errors=True)
    if out.error is not None:
        raise AssertionError(f"seed {out.seed}; replay: {out.replay()}") from out.error
    assert out.examples >= 3


def test_a_two_rank_job_with_replicas_on_two_nodes(tmp_path: Path) -> None:
    from stateful.ranks import Ranks
    from stateful.ranks import Shared as RankShared

    shm = shm_base()
    Ranks.shared = shared = RankShared(tmp_path, shm)
    try:
        out = run(Ranks, "ranks", examples=1, steps=10, seed_=BOUNDED_SEED, shrink=False)
    finally:
        shared.close()
        shutil.rmtree(shm, ignore_errors=True)
    if out.error is not None:
        raise AssertionError(f"seed {out.seed}; replay: {out.replay()}") from out.error
    assert out.examples >= 1
