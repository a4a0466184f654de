"""Run an example script several times, each run a child forked from this one process, which
imported torch and nebula_ckpt once (a new interpreter per run would pay the imports each time).

    python tests/example_runs.py SCRIPT OUT_DIR RUN [RUN ...]

Each RUN is ``name:arg,arg,...`` (``clean:--root,clean``). A run whose name starts with ``bg-``
is started and left running beside the others; every other run is waited for before the next
starts. Each child writes its stdout and stderr to ``OUT_DIR/<name>.out`` and runs the script as
``__main__`` with those arguments, from the current folder. This process prints one line per run,
``<name> <exit status>`` (``-9`` for a run killed with SIGKILL), once every run is over.

Nothing of nebula_ckpt runs here before a fork (no thread, no Checkpointer): each child starts
from freshly imported modules, as a new process would.
"""

from __future__ import annotations

import os
import runpy
import sys

import numpy  # noqa: F401  (imported once, here)
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (what the first optimizer a program makes imports: seconds)

import nebula_ckpt  # noqa: F401


def _child(script: str, out: str, args: list[str]) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)  # atexit handlers run, as at the end of a program


def _status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> None:
    script, out_dir, *runs = sys.argv[1:]
    background: dict[int, str] = {}
    results: dict[str, int] = {}
    for run in runs:
        name, _, args = run.partition(":")
        pid = os.fork()
        if pid == 0:
            _child(script, os.path.join(out_dir, f"{name}.out"), [a for a in args.split(",") if a])
        if name.startswith("bg-"):
            background[pid] = name
        else:
            results[name] = _status(os.waitpid(pid, 0)[1])
    for pid, name in background.items():
        results[name] = _status(os.waitpid(pid, 0)[1])
    for name, code in results.items():
        print(name, code)


if __name__ == "__main__":
    main()
