"""A replica of an incremental memory-tier step, made whole at the partner that holds it.

A rank's own memory tier is incremental: a step whose tensors mostly equal its base step's
stores only what changed and refers to the base's shard(s) for the rest
(:mod:`nebula_ckpt.format.commit`). A replica stays a whole, self-contained step (restore,
pull, recover planning, prune and verification know nothing else), so the partner *materialises*
it: the owner sends its step folder's own files (manifest, commit marker, its small shard), and
the receiver builds the whole shard from them plus the bytes the step refers to, taken either

* by key from its own verified replica of the step the owner built on (``stats.base_step`` of
  the manifest, same writer generation, and the same write of it: ``stats.base_write`` names the
  base's ``stats.write_id``, a random name each write records): each reused tensor's bytes equal the base's, so the
  base's record of that key names them, whatever layout the base replica has; or
* from the referenced shard files themselves, which the owner then sent too (beside the step's
  own files, into ``.incoming-*/step-<B>/``) because the partner said it lacks that base.

The whole shard, a whole manifest (no references; the owner's step, generation, rank layout and
records) and a commit marker naming that manifest replace the received ones in the ``.incoming-*``
folder (marker last); the caller then verifies every checksum before the copy becomes visible.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
from typing import Any, Optional

from nebula_ckpt.errors import CorruptCheckpointError, PersistError
from nebula_ckpt.format.checks import as_step
from nebula_ckpt.format.commit import Commit, read_commit, references, shard_path
from nebula_ckpt.format.manifest import MAX_MANIFEST_BYTES, Manifest, encode_manifest, stored_json, whole_manifest
from nebula_ckpt.format.names import COMMIT, MANIFEST, step_dir
from nebula_ckpt.native import get_ops
from nebula_ckpt.save.incremental import whole_image
from nebula_ckpt.storage.local import LocalStorage, open_regular, read_small_file
from nebula_ckpt.tiers.memory.replica_store import committed

log = logging.getLogger(__name__)


def step_base(folder: str, step: int, gens: dict[int, int]) -> Optional[dict[str, Any]]:
    """What a partner needs to make the committed ``folder/step-N`` whole (None when it is whole):
    ``base`` (the step it was built on) and its ``gen`` (writer generation, from ``gens``: step ->
    generation of the committed steps there; for a base that retention took since, the step's
    own: a partner's replica of that step and generation is the base, the newest write of that
    step, or the partner holds none and is sent ``refs``), and ``refs``: ``(step, file, size)`` of each shard of an
    earlier step it refers to.

    Raises:
        OSError / CorruptCheckpointError: the step cannot be read (retention took it), or its
            manifest is no regular file of at most :data:`MAX_MANIFEST_BYTES` (never read then).
    """
    raw = read_small_file(os.path.join(folder, step_dir(step), MANIFEST), MAX_MANIFEST_BYTES)
    man = Manifest.parse(raw, f"{folder} step {step}", step)
    if not references(man):
        return None
    refs = [(int(sh.step), sh.file, os.path.getsize(os.path.join(folder, shard_path(man, i))))
            for i, sh in enumerate(man.shards) if sh.step is not None and sh.step != step]
    base = _base_step(man, f"{folder} step {step}")
    write = man.stats.get("base_write")
    return {"base": base, "gen": gens.get(base, gens[step]) if base is not None else None, "refs": refs,
            "write": write if isinstance(write, str) else None}


def _base_step(man: Manifest, where: str) -> Optional[int]:
    """The step ``man`` records it was built on (``stats.base_step``): a step as a save takes it,
    ``[0, 2**63-1]``; None when it records none, or anything else (damage, ignored as a
    ``base_write`` that is no string is: no replica is then taken for the base, whose shards the
    partner is sent instead)."""
    base = man.stats.get("base_step")
    if base is None:
        return None
    try:
        return as_step(base, where, "stats.base_step")
    except CorruptCheckpointError as e:
        log.warning("nebula_ckpt: %s; the step's base is not looked for among the replicas", e)
        return None


def holds_base(held: str, need: dict[str, Any]) -> bool:
    """Whether the replicas in ``held`` (a source rank's folder) include the base ``need`` names:
    that step, of that writer generation, and that very write of it (its manifest's
    ``stats.write_id`` is the one the step was built on: the same step saved twice in one
    generation is never mistaken for the other, whatever their checksums)."""
    if need["base"] is None or need.get("write") is None or (need["gen"], need["base"]) not in committed(held):
        return False
    try:
        raw = read_small_file(os.path.join(held, step_dir(int(need["base"])), MANIFEST), MAX_MANIFEST_BYTES)
        man = Manifest.parse(raw, f"{held} step {need['base']}", int(need["base"]))
    except (OSError, CorruptCheckpointError):  # a damaged, replaced or planted file holds no base
        return False
    return man.stats.get("write_id") == need["write"]


def materialise(inc: str, step: int, held: str, need: dict[str, Any]) -> int:
    """Make the incremental copy of ``step`` received into ``inc`` whole, in place (see the module
    docstring); ``held``: the folder of the sender's replicas here. The bytes of the whole shard.

    Raises:
        PersistError: a referenced base is neither received nor held here.
        OSError / CorruptCheckpointError: the received or held files are unreadable.
    """
    st = LocalStorage(inc, private=True, fsync=False)
    try:
        d = step_dir(step)
        raw = st.read_small(f"{d}/{MANIFEST}")
        received = read_commit(st, step, f"{inc} step {step}")  # its generation and save: the same write
        man = Manifest.parse(raw, f"{inc} step {step}", step)
        maps: list[Any] = []
        try:
            if all(os.path.isfile(os.path.join(inc, shard_path(man, i))) for i in range(len(man.shards))):
                shards = [_map(os.path.join(inc, shard_path(man, i)), maps) for i in range(len(man.shards))]
            elif holds_base(held, need):
                man, shards = _on_base(man, inc, held, int(need["base"]), maps)
            else:
                raise PersistError(f"step {step} refers to step(s) {sorted(references(man))}, which were "
                                   f"neither sent nor held here (base {need['base']} of generation {need['gen']})")
            own = next(sh.file for sh in man.shards if sh.step is None)
            st.remove(f"{d}/{COMMIT}")  # the received marker names the incremental manifest
            info, nbytes = _write_whole(st, f"{d}/{own}.whole", man, shards)
        finally:
            for m in maps:
                m.close()
        os.replace(os.path.join(inc, d, f"{own}.whole"), os.path.join(inc, d, own))
        tensors = info.pop("tensors")
        doc = whole_manifest(stored_json(raw), shard={"file": own, "bytes": nbytes, "storage": info}, tensors=tensors)
        mbytes = encode_manifest(doc)
        st.write_small(f"{d}/{MANIFEST}", mbytes)
        st.write_small(f"{d}/{COMMIT}", Commit(step, received.generation, len(mbytes), get_ops().crc32c_bytes(mbytes),
                                               received.save).to_bytes(), create_only=True)
        return nbytes
    finally:
        st.close()


def _write_whole(st: LocalStorage, rel: str, man: Manifest, shards: list[Any]) -> tuple[dict[str, Any], int]:
    """Write the one-shard image of ``man`` (its shards' bytes: ``shards``) at ``rel``: the
    storage record with the image's tensor records under ``tensors``, and its bytes. No view
    into ``shards`` outlives the call (their mappings are closed after it)."""
    parts, tensors, nbytes = whole_image(man, shards)
    try:
        info = st.write_parts(rel, parts)
    finally:
        for p in parts:
            p.release()
    return dict(info, tensors=tensors), nbytes


def _on_base(man: Manifest, inc: str, held: str, base: int,
             maps: list[Any]) -> tuple[Manifest, list[Any]]:
    """``man`` with each tensor it refers to an earlier step for taken by key from the whole
    replica of ``base`` in ``held`` (its shard appended after ``man``'s own), and the shards' bytes."""
    st = LocalStorage(held, private=True, fsync=False)
    try:
        bman = Manifest.parse(st.read_small(f"{step_dir(base)}/{MANIFEST}"), f"{held} step {base}", base)
    finally:
        st.close()
    own = next(i for i, sh in enumerate(man.shards) if sh.step is None)
    shards = [_map(os.path.join(inc, shard_path(man, own)), maps)]
    shards += [_map(os.path.join(held, shard_path(bman, i)), maps) for i in range(len(bman.shards))]
    tensors = {}
    for k, rec in man.tensors.items():
        if rec.shard == own:
            tensors[k] = dataclasses.replace(rec, shard=0)
            continue
        old = bman.tensors.get(k)
        if old is None or (old.nbytes, old.dtype, old.shape, old.crc32c) != \
                (rec.nbytes, rec.dtype, rec.shape, rec.crc32c):
            raise PersistError(f"the replica of base step {base} holds no tensor {k!r} as the step records it")
        tensors[k] = dataclasses.replace(rec, shard=1 + old.shard, start=old.start, end=old.end)
    return dataclasses.replace(man, tensors=tensors), shards


def _map(path: str, maps: list[Any]) -> Any:
    """A read-only mapping of the regular file ``path`` (kept in ``maps`` to close), or empty bytes.

    Raises:
        CorruptCheckpointError: ``path`` is no regular file (a FIFO is never waited on).
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return b""
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    maps.append(m)
    return m
