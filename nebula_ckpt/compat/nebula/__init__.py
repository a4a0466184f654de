"""Azure ML Nebula's ``torch_nebula`` API, in parts (:mod:`nebula_ckpt.compat.torch_nebula` is the
module users import; it re-exports these):

* :mod:`.session` — ``init``: the one :class:`~nebula_ckpt.Checkpointer`, the step counter, the
  checkpoints being assembled (``shutdown``, the readers of other roots);
* :mod:`.checkpoint` — ``Checkpoint(tag, num_of_files)``: ``save`` parts, ``commit``, ``load``;
* :mod:`.commit` — one commit: the parts saved as one checkpoint, its history entry filled in;
* :mod:`.lookup` — ``get_latest_checkpoint``, ``get_checkpoint``, ``list_checkpoints``, ...;
* :mod:`.history` — ``flush_persistence``, the checkpoint histories (Nebula's CSV);
* :mod:`.unsupported` — the parts of Nebula's API not provided, saying what to use instead.
"""
