"""Azure ML Nebula's ``torch_nebula`` (``nebulaml``) API on nebula_ckpt.

Azure ML Nebula (``torch_nebula``, later ``nebulaml``) is no longer shipped. This module keeps
its documented API, so a training script moves over by changing its import::

    import nebula_ckpt.compat.torch_nebula as tn      # was: import torch_nebula as tn

    tn.init(persistent_storage_path="/ckpt/run-42", persistent_time_interval=100,
            num_of_version_in_retention=2)
    ckpt = tn.Checkpoint("global_step500", 2)          # a tag, and the number of parts it will hold
    ckpt.save("model", model)
    ckpt.save("optimizer", optimizer)                  # the 2nd part: the checkpoint commits itself
    ckpt.commit()                                      # True (or commit explicitly with num_of_files=-2)

    # after a crash, in the new process:
    tn.init(persistent_storage_path="/ckpt/run-42")
    latest = tn.get_latest_checkpoint()                # None when there is none
    if latest is not None:
        model.load_state_dict(latest.load("model"))
        optimizer.load_state_dict(latest.load("optimizer"))

How it maps (see README, "Moving from Azure ML Nebula"): ``init`` creates one
:class:`~nebula_ckpt.Checkpointer` on ``persistent_storage_path`` with the tiers
``[MemoryTier(), <persistent_storage_path>]`` (Nebula's in-memory tier and its persistent
tier); ``persistent_time_interval`` is the persistent tier's ``every_seconds`` and
``num_of_version_in_retention`` the ``keep_last`` of both tiers. The named parts of one
:class:`Checkpoint` form one nebula_ckpt checkpoint ``{name: obj, ...}``, saved when it commits
with its tag as ``tag``. Tags are the identity of checkpoints; the step numbers nebula_ckpt
needs are handed out in commit order (``step-<N>/`` on storage).

The API is in :mod:`nebula_ckpt.compat.nebula` (session, checkpoint, commit, lookup, history);
this module is the one a script imports.
"""

from __future__ import annotations

from nebula_ckpt.compat.nebula.checkpoint import Checkpoint
from nebula_ckpt.compat.nebula.history import (
    HISTORY_FIELDS,
    checkpoint_histories,
    flush_persistence,
    write_checkpoint_histories,
)
from nebula_ckpt.compat.nebula.lookup import (
    get_checkpoint,
    get_latest_checkpoint,
    get_latest_checkpoint_path,
    list_checkpoints,
)
from nebula_ckpt.compat.nebula.session import DEFAULT_RETENTION, checkpointer, init, shutdown
from nebula_ckpt.compat.nebula.unsupported import NebulaCallback, NebulaCheckpointIO, UnsupportedError

__all__ = [
    "init", "Checkpoint", "get_latest_checkpoint", "get_checkpoint", "list_checkpoints",
    "get_latest_checkpoint_path", "flush_persistence", "checkpoint_histories", "write_checkpoint_histories",
    "shutdown", "checkpointer", "NebulaCheckpointIO", "NebulaCallback", "UnsupportedError",
    "HISTORY_FIELDS", "DEFAULT_RETENTION",
]

_shutdown = shutdown  # the name DeepSpeed's tests call
