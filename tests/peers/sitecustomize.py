"""Imported by every Python process whose ``PYTHONPATH`` holds this folder (``tests/peers/run.py``
puts it there for the frameworks' suites only).

* DCP's multi-rank tests run each rank in a process of their own, started by ``multiprocessing``,
  where the pytest plugin is not loaded: the swap of :mod:`plugin` is made here too
  (``NEBULA_PEER_MODE=nebula``, ``NEBULA_PEER_SUITE=dcp``).
* DeepSpeed's ranks are forked from a ``forkserver``: in both runs of that suite the server
  preloads :mod:`forkserver_preload` (DeepSpeed imported, its CPU ops loaded once, not per rank,
  and the swap made there, so every rank has it). Nothing is imported here for that suite: every
  other Python process it starts (DeepSpeed runs ``cpuinfo.py`` as one, to build its ops) stays
  as quick to start as on stock.
"""

import multiprocessing
import os

if os.environ.get("NEBULA_PEER_SUITE") == "deepspeed":
    multiprocessing.set_forkserver_preload(["__main__", "forkserver_preload"])

if os.environ.get("NEBULA_PEER_MODE") == "nebula" and os.environ.get("NEBULA_PEER_SUITE") == "dcp":
    import plugin

    plugin.swap()
