"""Benchmark suite of nebula_ckpt (``nebula-ckpt bench``, ``python -m benchmarks.run``).

Compares nebula_ckpt with torch.save (blocking and on a thread, as Lightning's
AsyncCheckpointIO does), safetensors, torch.distributed.checkpoint (save / async_save) and
torchsnapshot on the same state in one process, and checks the project's performance targets.

Modules: :mod:`~.workloads` (models + AdamW), :mod:`~.peers` (the systems), :mod:`~.limits`
(hardware limits and machine description), :mod:`~.report` (targets, markdown, plot),
:mod:`~.runner` (orchestration and the command line).

Example::

    from nebula_ckpt.bench.runner import main
    main(["--quick", "--out", "/tmp/bench"])
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see :func:`nebula_ckpt.bench.runner.main`)."""
    from .runner import main as _main

    return _main(argv)
