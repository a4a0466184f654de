"""Operations of the one-process machine that reach the root from outside a job's own saves (a mixin
of :class:`~stateful.machine.Single`).

* ``remove_referenced``: the live job's ``remove(step)`` of a step a later step of the same tier
  may refer to (an incremental step whose base it is): the request is deferred there while a
  later step refers to it (``Truth.removed``); then the job ends (``close`` or ``exit``), a new job
  restores on the same node and ``load(N)``s every step the audit found on its tiers: each reads
  back whole, the newest write of that step (the fastest tier for one write): a removal must
  never take bytes a remaining step needs.
* ``cli_verify_mark``: the operator's ``nebula-ckpt verify ROOT --json`` and then
  ``nebula-ckpt mark ROOT --suspect STEP --json`` run as subprocesses on a node (a job live there
  or not, idle between its operations): verify lists exactly the steps the model holds on the
  node's memory tier and the disk tier, each healthy; the mark is then checked as a person's
  mark (:meth:`~stateful.machine.Single.mark_step`), and the next ``load_latest`` must skip it:
  with ``restart`` at once (the live job crashes, a new one restores on the node), else whenever
  the next restore comes.
* ``toggle_zstd``: between jobs, the disk tier of the jobs from now on is a
  ``RemoteTier("file://ROOT", compression="zstd")`` on the same root folder, or again the plain
  ``LocalTier(ROOT)``: a root whose steps were written compressed and uncompressed, incremental
  steps of one referring to the other's bytes. Every restore, audit (a ``LocalTier`` opened
  alone), export and DCP read must read both; each save of a compressing job that writes the disk
  tier leaves zstd frames in the step's shard (``op_save``'s ``zstd`` answer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Hashable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import warm_python
from stateful.procs import REPO

if TYPE_CHECKING:
    from stateful.machine import Single

#: the command line tool of the interpreter running the driver (the venv's; PYTHONPATH is passed on)
CLI = os.path.join(os.path.dirname(sys.executable), "nebula-ckpt")


class ExtraOps:
    """The rules of this module; see the module docstring."""

    zstd: bool = False

    # -- remove a step later steps refer to, restart, load every step --------------------------------
    @precondition(lambda self: self.job is not None)
    @rule(pick=st.integers(0, 7), end=st.sampled_from(["close", "exit"]))
    def remove_referenced(self: "Single", pick: int, end: str) -> None:
        """``remove(S)`` of a step with later steps on its tier, a restart on the node, then
        ``load(N)`` of every step left. See the module docstring."""
        job = self.job
        assert job is not None
        node = job.node
        self.audit(node)
        keys: list[Hashable] = [self.mem(node), "disk"]
        cands = sorted({s for k in keys for s in self.truth.entries(k)
                        if any(t > s for t in self.truth.entries(k))})
        if not cands:
            return
        step = cands[pick % len(cands)]
        self.note(f"remove step {step} on n{node} (a later step may refer to it)")
        got = self.remove_in_job(job, step)
        if "error" in got:
            self.fail(f"remove({step}) of a committed step raised {got['error']}")
        if got["removed"] != [step]:
            self.fail(f"remove({step}) returned {got['removed']}")
        for k in keys:
            self.truth.removed(k, step)
        self.end_job(end)
        self.start_job(node)
        self.load_every_step()

    def load_every_step(self: "Single") -> None:
        """The live job ``load(N)``s each step its tiers hold (the tiers audited): each the newest
        write of ``N``, whole; the job is left at the newest step it loaded, as a rollback leaves it."""

        job = self.job
        assert job is not None
        self.audit(job.node)
        keys: list[Hashable] = [self.mem(job.node), "disk"]
        wants = {s: self._write_of(keys, s) for s in sorted({s for k in keys for s in self.truth.whole(k)})}
        self.note(f"load every step on n{job.node}: {sorted(wants)}")
        for step, want in wants.items():
            self.load_in_job(job, keys, want, step, " after a removal")

    # -- the operator's verify and mark, as subprocesses -----------------------------------------
    @rule(node=st.sampled_from([0, 1]), which=st.sampled_from(["newest", "another"]), pick=st.integers(0, 7),
          restart=st.booleans())
    def cli_verify_mark(self: "Single", node: int, which: str, pick: int, restart: bool) -> None:
        """``nebula-ckpt verify --json``, then ``mark --suspect STEP``, as subprocesses on ``node``;
        with ``restart``, the next ``load_latest`` at once. See the module docstring."""
        if not os.path.isdir(self.path):
            return
        self.audit(node)
        keys: list[Hashable] = [self.mem(node), "disk"]
        self.note(f"nebula-ckpt verify --json on n{node} (a subprocess)")
        got = self.cli_subprocess(["verify", self.path, "--json"], node)
        rows = json.JSONDecoder().raw_decode(got["stdout"].strip() or "[]")[0]
        # nothing committed, or a step damaged (DamageOps): exit 1 (docs/cli.md)
        if got["code"] != (0 if rows and all(r["healthy"] for r in rows) else 1):
            self.fail(f"verify --json on n{node} exited {got['code']} with {len(rows)} step(s): "
                      f"{got['stdout'][-2000:]} {got['stderr']}")
        for kind, key in (("memory", keys[0]), ("local", "disk")):
            seen = sorted(r["step"] for r in rows if r["tier"].split(":")[0] == kind)
            held = sorted(self.truth.entries(key))
            if seen != held:
                self.fail(f"verify --json on n{node} lists steps {seen} on the {kind} tier; the model holds {held}")
            bad = sorted(r["step"] for r in rows if r["tier"].split(":")[0] == kind and not r["healthy"])
            if bad != sorted(self.truth.damaged(key)):
                self.fail(f"verify --json on n{node} reports steps {bad} on the {kind} tier damaged; the model "
                          f"knows {sorted(self.truth.damaged(key))} damaged: {rows}")
        steps = sorted({s for k in keys for s in self.truth.entries(k)})
        if not steps:
            return
        step = steps[-1] if which == "newest" else steps[pick % len(steps)]
        self.mark_step(node, True, step, runner=self.cli_subprocess)
        if restart:
            if self.job is not None and self.job.node != node:
                return  # the next restore on this node comes when its job ends
            if self.job is not None:
                self.end_job("exit")
            self.start_job(node)

    def cli_subprocess(self: "Single", argv: list[str], node: int) -> dict[str, Any]:
        """``nebula-ckpt ARGV`` in a fresh process on ``node``: its exit code, stdout and stderr."""
        env = {**os.environ, "NEBULA_SHM_DIR": self.shm_of(node), "NEBULA_NODE_ID": f"n{node}",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # the workers' library
        if not os.path.lexists(self.shm_of(node)):
            os.makedirs(self.shm_of(node))
        try:
            r = warm_python.run([CLI, *argv], capture_output=True, text=True, timeout=300, env=env)
        except subprocess.TimeoutExpired:
            self.fail(f"nebula-ckpt {' '.join(argv)} on n{node} hung (300 s)")
            raise
        return {"code": r.returncode, "stdout": r.stdout, "stderr": r.stderr[-4000:]}

    # -- zstd on the disk tier, toggled between jobs -----------------------------------------------
    @precondition(lambda self: self.job is None)
    @rule()
    def toggle_zstd(self: "Single") -> None:
        """The jobs from now on write the disk tier zstd-compressed (a ``file://`` ``RemoteTier`` on
        the root folder), or plainly again. See the module docstring."""
        self.zstd = not self.zstd
        self.note("the disk tier of the next jobs: " + ("RemoteTier(file://ROOT, compression='zstd')" if self.zstd
                                                        else "LocalTier(ROOT)"))

    def check_zstd(self: "Single", got: dict[str, Any], what: str) -> None:
        """A save of a compressing job that wrote the disk tier left zstd frames in its shard."""
        if self.zstd and "local" in got.get("written", []) and got.get("zstd") is False:
            self.fail(f"{what}: written on the disk tier with compression='zstd', yet its step's shard holds "
                      f"no zstd frame")
