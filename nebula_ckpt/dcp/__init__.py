"""``torch.distributed.checkpoint`` (DCP) over nebula_ckpt checkpoints: a reader and a writer.

``dcp.load(sd, storage_reader=NebulaStorageReader(root))`` reads the newest healthy committed step
not marked suspect (as ``load_latest``) into any mesh (DCP's planner reshards);
``dcp.save(sd, storage_writer=NebulaStorageWriter(root, step=N))`` writes a normal nebula_ckpt
checkpoint. The reader is restore's own
(:mod:`~nebula_ckpt.restore.dcp_reader`: a resharded restore reads through it too), the writer
:mod:`~nebula_ckpt.dcp.writer`.
"""

from nebula_ckpt.dcp.writer import NebulaStorageWriter
from nebula_ckpt.restore.dcp_reader import NebulaStorageReader

__all__ = ["NebulaStorageReader", "NebulaStorageWriter"]
