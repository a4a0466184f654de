"""The parts of Azure ML Nebula's API that nebula_ckpt does not provide: each raises, saying what
to use instead."""

from __future__ import annotations

from typing import Any

from nebula_ckpt.errors import NebulaError


class UnsupportedError(NebulaError, NotImplementedError):
    """A part of Nebula's API that nebula_ckpt does not provide; the message says what to use instead."""


class NebulaCheckpointIO:
    """Nebula's Lightning plugin: not provided here (see :mod:`nebula_ckpt.integrations.lightning`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedError("torch_nebula.NebulaCheckpointIO() is not provided by nebula_ckpt's torch_nebula API: "
                               "use nebula_ckpt.integrations.lightning.NebulaCheckpointIO(root), Lightning's "
                               "CheckpointIO plugin, with a root of its own (not the one tn.init() writes: two "
                               "checkpointers writing one root fence each other)")


class NebulaCallback:
    """Nebula's Lightning ``ModelCheckpoint`` replacement: not provided here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedError("torch_nebula.NebulaCallback is not provided: keep Lightning's own ModelCheckpoint "
                               "callback (same arguments) and add the plugin "
                               "nebula_ckpt.integrations.lightning.NebulaCheckpointIO(root), which stores what it "
                               "writes with nebula_ckpt")
