"""Adapters for the frameworks users already train with; each is a thin layer over
:class:`~nebula_ckpt.Checkpointer` (tags, named parts, removal and plain state dicts are in the core).

Import the one you need (each imports its framework lazily and names the pip extra to install):

* :mod:`nebula_ckpt.integrations.lightning` — a Lightning ``CheckpointIO`` plugin;
* :mod:`nebula_ckpt.integrations.huggingface` — Hugging Face ``Trainer`` checkpointing and resume;
* :mod:`nebula_ckpt.integrations.deepspeed` — a DeepSpeed ``CheckpointEngine``;
* :mod:`nebula_ckpt.compat.torch_nebula` — Azure ML Nebula's ``torch_nebula`` API.

:func:`nebula_ckpt.integrations.pointers.find_roots` tells which checkpoint roots a framework's path
refers to (a Lightning or DeepSpeed pointer file, Lightning's ``dirpath``, a DeepSpeed save folder,
a Hugging Face ``output_dir``).
"""
