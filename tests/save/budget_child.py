"""A training process under a host-memory budget (tests/save/test_host_memory_budget.py).

``python budget_child.py SPEC_JSON``: builds a model + SGD-with-momentum state of ``mb`` MB,
saves it ``saves`` times (a training step between saves) with
``Checkpointer(root, host_memory_budget=budget, on_full=on_full)`` and, all along, samples what
checkpointing holds in host memory by the kernel's own counts, independently of the library:
the process's anonymous resident memory above what it held before the first save
(``RssAnon`` of ``/proc/self/status``) plus the RAM of the files under the memory tier's folder
(allocated blocks, each inode once). Prints one JSON line: the peaks, the steps committed, the
handles' outcomes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def rss_anon() -> int:
    """``RssAnon`` of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def folder_ram(path: str) -> int:
    """Allocated bytes of the files under ``path`` (a tmpfs), each inode once."""
    seen, total = set(), 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def main(spec: dict) -> None:
    import torch

    import nebula_ckpt as nc

    torch.manual_seed(0)
    n = spec["mb"] * (1 << 20) // 4 // 2  # parameters + momentum buffers: mb MB in all
    model = torch.nn.Linear(n // 1024, 1024, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    model(torch.randn(2, n // 1024)).sum().backward()
    opt.step()  # the momentum buffers exist from here on
    opt.zero_grad(set_to_none=True)

    def step() -> None:
        """A change of every byte without temporaries (a training step's own transient memory
        would blur what checkpointing holds)."""
        with torch.no_grad():
            for t in [model.weight] + [s["momentum_buffer"] for s in opt.state.values()]:
                t.add_(1.0)

    ck = nc.Checkpointer(spec["root"], host_memory_budget=spec["budget"], on_full=spec["on_full"])
    mem = next((t.path for t in ck.tiers if t.kind == "memory"), None)
    base = rss_anon()
    peak = {"anon": 0, "shm": 0, "total": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            a = max(0, rss_anon() - base)
            s = folder_ram(mem) if mem else 0
            peak["anon"], peak["shm"], peak["total"] = max(peak["anon"], a), max(peak["shm"], s), \
                max(peak["total"], a + s)
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    handles, error = [], None
    try:
        for s in range(spec["saves"]):
            handles.append(ck.save_async(s, {"model": model, "optim": opt, "step": s}))
            step()
        ck.wait()
    except Exception as e:  # reported to the parent
        error = f"{type(e).__name__}: {e}"
    time.sleep(0.05)
    stop.set()
    t.join()
    out = {"peak": peak, "error": error, "committed": ck.list(detailed=True)
           if error is None else {}, "stats": {k: v for k, v in ck.stats().items() if isinstance(v, int)},
           "skipped": {h.step: h.skipped for h in handles if h.skipped},
           "written": {h.step: sorted(h.tiers_written) for h in handles}}
    ck.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
