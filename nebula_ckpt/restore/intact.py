"""Whether a committed step can be restored, told from its files' sizes, no shard byte read.

A memory tier may be freed (``nebula-ckpt gc``), or its step called "on the root already"
(``nebula-ckpt persist-memory``), only when the persistent copy would restore. A commit marker
alone does not show that: a partial upload, a lost object or a truncated file leaves the marker
and the manifest of a step whose shards a restore refuses. :func:`restore_problem` checks what a
restore with ``verify="size"`` checks (:func:`~nebula_ckpt.restore.open.open_checkpoint`): the
marker, the manifest it names (and a version 4 step's ``ranks.json``), every rank's records file
and shard file at the recorded size, and each earlier step it refers to committed and listing
that very shard. It reads no shard byte, so its cost is the small files and one size query per
file, whatever the checkpoint's size: a cron job or an epilogue can afford it on a remote root.
The checksums of the bytes are not read; a shard altered at its own size is a restore's
``verify="full"`` to find.
"""

from __future__ import annotations

from typing import Optional

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format.commit import shard_path
from nebula_ckpt.format.manifest import Manifest
from nebula_ckpt.format.names import step_dir
from nebula_ckpt.restore.open import check_references, read_main_manifest
from nebula_ckpt.storage.base import Storage


def restore_problem(storage: Storage, step: int, where: Optional[str] = None) -> Optional[str]:
    """What keeps committed ``step`` on ``storage`` from being restored, checked by sizes (see the
    module): its marker, manifest or a records file unreadable or missing, a shard (its own or an
    earlier step's it refers to) missing or of another size than recorded, or a referenced step
    not committed or not listing that shard. None when nothing is known to lack.

    Raises:
        OSError: any other failure to read (a permission or I/O error): the storage cannot tell.
    """
    where = where or f"{storage.display_url} step {step}"
    try:
        man = read_main_manifest(storage, step, where)  # a version 4 step: every rank's shard, from ranks.json
    except CorruptCheckpointError as e:
        return str(e)
    return files_problem(storage, man, where)


def files_problem(storage: Storage, man: Manifest, where: str) -> Optional[str]:
    """:func:`restore_problem` of the step whose main manifest ``man`` was read and checked: its
    records files and shards at their recorded sizes, the steps it refers to committed and
    listing those shards. None when nothing is known to lack.

    Raises:
        OSError: any other failure to read (a permission or I/O error): the storage cannot tell.
    """
    step = man.step
    files = [(f"{step_dir(step)}/{r.file}", r.bytes, f"records file {r.file}")
             for r in (man.layout.records if man.layout is not None else ())]
    files += [(shard_path(man, i), sh.stored_bytes, f"shard {sh.file}" if sh.step is None else
               f"shard {sh.file} of step {sh.step} (referenced)") for i, sh in enumerate(man.shards)]
    for rel, want, name in files:
        try:
            have = storage.size(rel)
        except FileNotFoundError:
            return f"{where}: {name} is missing"
        if have != want:
            return f"{where}: {name} has {have} bytes, the manifest says {want} (truncated or torn write)"
    refs = {i: [t for t in man.tensors.values() if t.shard == i] for i, sh in enumerate(man.shards)
            if sh.step is not None}
    try:
        check_references(storage, man, refs, where)
    except CorruptCheckpointError as e:
        return str(e)
    return None
