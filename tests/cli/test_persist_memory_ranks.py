"""``nebula-ckpt persist-memory`` puts a multi-rank job's step a restart restores on the root when
the root's newest step, newer, is marked suspect: a drain passes over the suspect writes as a restore
does (``Drain(skip=...)``). Real ranks (2, gloo; ``persist_memory_ranks_worker.py``) save, a suspect
mark is set with ``nebula-ckpt mark``, persist-memory runs as the node's epilogue, and a restart from
the root alone restores that step bit-exact on every rank."""

from __future__ import annotations

import json
import shutil
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest

from nebula_ckpt.cli import main
from tests.dist.launch import run_mode

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "persist_memory_ranks_worker.py")

pytestmark = [pytest.mark.timeout(400)]


def _cli(*args: str) -> tuple[int, str]:
    buf = StringIO()
    with redirect_stdout(buf):
        rc = main(list(args))
    return rc, buf.getvalue()


def _steps(root: str) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in Path(root).glob("step-*/COMMIT"))


def test_persist_memory_writes_a_multi_rank_restored_step_behind_a_suspect_newest(tmp_path: Path,
                                                                                  shm_dir: str) -> None:
    root = str(tmp_path / "ck")
    run_mode(tmp_path, WORKER, "save", root, shm_dir)
    assert _steps(root) == [1, 5]  # the memory tiers hold steps 4 and 5
    assert _cli("mark", root, "--suspect", "5", "--reason", "loss went NaN")[0] == 0
    rc, out = _cli("persist-memory", root, "--json")
    got = json.loads(out)
    assert rc == 0 and got["copied"] and got["step"] == 4, got
    assert "step a restart restores" in got["why"], got
    assert _steps(root) == [1, 4, 5]
    shutil.rmtree(shm_dir)  # the nodes' RAM is gone: a restart has the root alone
    Path(shm_dir).mkdir()
    out_dir = run_mode(tmp_path, WORKER, "restore", root, shm_dir)
    for r in range(2):
        rep = json.loads((out_dir / f"r{r}.json").read_text())
        assert rep == {"step": 4, "exact": True}, (r, rep)
