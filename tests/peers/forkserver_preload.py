"""Imported once by the ``multiprocessing`` fork server of DeepSpeed's test runs (``sitecustomize``
asks for it), so that every rank's process, forked from that server, starts with DeepSpeed
imported, its op probe done and its CPU ops loaded, instead of doing all three itself.

DeepSpeed's ``DistributedTest`` runs each rank of each test in a fresh process of a ``forkserver``
pool. Each such process imports DeepSpeed (about 35 s on 2 busy cores), probes which ops the
machine can build (compiler runs) and loads the C++ ops a CPU run needs: the shared-memory
collective ``deepspeed_shm_comm`` (every ``init_distributed``), ``fused_adam`` (every engine
with an ``Adam`` optimizer) and ``cpu_adam`` (ZeRO with the optimizer offloaded to the CPU); the
first load of each JIT-compiles it into
``~/.cache/torch_extensions`` (minutes). Done here once, the same for the stock and the
nebula_ckpt run: it changes how long a rank takes to start, not what it runs. The ranks also get
:func:`plugin.deepspeed_compat` here (both runs) and, in the nebula_ckpt run, the swap of
:func:`plugin.swap`.
"""

import os

if os.environ.get("NEBULA_PEER_SUITE") == "deepspeed":
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    _COMPATIBLE = deepspeed.ops.__compatible_ops__  # the probe, cached in the module
    for _name in ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"):
        _builder = get_accelerator().create_op_builder(_name)
        if _builder is not None and _COMPATIBLE.get(_builder.NAME, False):
            _builder.load()  # cached in the builder class: the ranks' load() returns it

    import plugin

    plugin.deepspeed_compat()
    plugin.swap()  # NEBULA_PEER_MODE=nebula: every rank forked from here writes through nebula_ckpt
