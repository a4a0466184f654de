"""Imported by every Python process whose ``PYTHONPATH`` holds this folder (``tests/peers/run.py``
puts it there for the frameworks' suites only). DeepSpeed's and DCP's multi-rank tests run each
rank in a process of their own, started by ``multiprocessing``, where the pytest plugin is not
loaded: the swap of :mod:`plugin` is made here too. Nothing happens outside
``NEBULA_PEER_MODE=nebula`` with ``NEBULA_PEER_SUITE`` ``deepspeed`` or ``dcp``."""

import os

if os.environ.get("NEBULA_PEER_MODE") == "nebula" and os.environ.get("NEBULA_PEER_SUITE") in ("deepspeed", "dcp"):
    import plugin

    plugin.swap()
