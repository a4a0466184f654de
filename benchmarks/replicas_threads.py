"""Where a rank's time goes in the replicas benchmark's training loop: per-thread CPU and waits.

Read by each rank of :mod:`benchmarks.replicas` (Linux ``/proc``; elsewhere the numbers are
absent, never made up):

* each live thread's CPU seconds (``/proc/self/task/<tid>/schedstat``), by thread kind: the training
  thread, the library's named threads (stager, memory-tier writer, replicas, ...; numbers and ids
  dropped from their names) and the native ones Python does not know (gloo's transport and workers);
* the training thread's run-queue delay (``/proc/thread-self/schedstat``): time it was ready to
  run but waited for a core, the cost of other threads' CPU while training needs one;
* from the loop itself: how much longer the iterations took than their compute (``step_over_s``)
  and the ``save_async`` calls' wall time; what is neither CPU nor run-queue delay nor the
  planned sleep is waiting on something shared (the GIL, a lock, the save pipeline).
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Optional


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads so far, summed by kind of thread (empty
    where ``/proc`` does not list them)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    # the main thread's id is the process's (Linux, as /proc here): main_thread().native_id is the
    # parent's in a forked process (Python 3.11 does not renew it at fork)
    main = os.getpid()
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9  # ns on a core (stat's utime + stime: 10 ms ticks)
        except (OSError, ValueError, IndexError):  # it ended meanwhile
            continue
        name = names.get(int(tid))
        kind = "training" if int(tid) == main else \
            re.sub(r"(-ot)?([-_]\d+)+$", "", name) if name else "native (gloo, torch)"
        out[kind] = out.get(kind, 0.0) + cpu
    return out


def sched() -> Optional[tuple[float, float]]:
    """The calling thread's ``(CPU s, run-queue delay s)`` so far (None without schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, delay, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(cpu) / 1e9, int(delay) / 1e9


def breakdown(loop_s: float, iters: int, compute_s: float, step_s: float, save_s: float,
              s0: Optional[tuple[float, float]], s1: Optional[tuple[float, float]]) -> dict[str, Any]:
    """The training thread's loop wall time split: planned sleep, its own CPU, run-queue delay,
    and the rest (waits on something shared), with the iterations' and saves' wall times."""
    out: dict[str, Any] = {"step_over_s": step_s - iters * compute_s, "save_call_s": save_s}
    if s0 is not None and s1 is not None:
        cpu, delay = s1[0] - s0[0], s1[1] - s0[1]
        out.update(train_runq_s=delay, other_wait_s=loop_s - iters * compute_s - cpu - delay)
    return out


#: the numbers of :func:`breakdown`, averaged over a job's ranks by :func:`rank_means`
WAITS = ("step_over_s", "save_call_s", "train_runq_s", "other_wait_s")


def rank_means(got: list[dict[str, Any]]) -> dict[str, float]:
    """A job's :data:`WAITS` and per-kind thread CPU (``cpu:<kind>``), averaged over its ranks
    (what a rank lacks counts as 0)."""
    out = {k: sum(float(g.get(k, 0.0)) for g in got) / len(got) for k in WAITS}
    kinds = sorted({k for g in got for k in g.get("threads_cpu", {})})
    out.update({f"cpu:{k}": sum(float(g.get("threads_cpu", {}).get(k, 0.0)) for g in got) / len(got) for k in kinds})
    return out


def report_lines(loop: dict[Any, dict[str, Any]]) -> list[str]:
    """The report's table of where the training thread's time and each kind of thread's CPU go
    (medians of the jobs' rank means), replicas=0 beside replicas=1."""
    lines = ["Where the time goes (per rank, mean of the ranks; medians of the runs): the iterations' wall time "
             "beyond their compute, the `save_async` calls' wall time, the training thread's run-queue delay "
             "(ready, waiting for a core) and its other waits (neither running nor runnable nor in its planned "
             "sleep: the GIL, a lock), and CPU seconds by thread from the loop's start until the saves are done:",
             "", "| ranks | replicas | iterations over compute s | save_async s | run-queue delay s | other waits s |"
             " CPU s by thread |", "|---|---:|---:|---:|---:|---:|---|"]
    for w, c in loop.items():
        for k in sorted(c["median"]):
            m = c["median"][k]
            cpu = ", ".join(f"{n[4:]} {v:.3f}" for n, v in sorted(m.items(), key=lambda kv: -kv[1])
                            if n.startswith("cpu:") and v >= 0.0005)
            lines.append(f"| {w} | {k} | {m.get('step_over_s', 0):.3f} | {m.get('save_call_s', 0):.3f} | "
                         f"{m.get('train_runq_s', 0):.3f} | {m.get('other_wait_s', 0):.3f} | {cpu} |")
    return lines + [""]
