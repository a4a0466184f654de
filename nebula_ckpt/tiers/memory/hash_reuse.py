"""The SHA-256 a persistent tier needs, known from the memory tier's byte compare instead of hashed.

A disk or remote tier knows a tensor unchanged by the SHA-256 of its staged bytes
(:mod:`nebula_ckpt.save.incremental`); hashing a large frozen state on every save is most of an
incremental save's cost. The memory tier compares the staged bytes with its base's bytes, byte
for byte (:mod:`nebula_ckpt.tiers.memory.compare`), at memory speed. When the memory tier's base and a
persistent tier's base were both committed *from the same snapshot* of this process (the same
:attr:`~nebula_ckpt.save.snapshot.Snapshot.write_id`, so the same step and the same staged bytes),
the SHA-256 of a tensor the compare found equal is known without hashing it:

* its staged bytes equal the memory base's bytes of it (``memcmp``, just now, on the stager thread);
* the memory base's bytes of it are that snapshot's staged bytes (written from them, or referred to
  after an equal compare of them);
* the persistent base recorded the SHA-256 of that snapshot's staged bytes of it (hashed then, or
  known the same way).

So that recorded SHA-256 *is* the SHA-256 of the new staged bytes, and it goes into the
snapshot's ``hashes`` as if it had been taken now: every tier then decides as before (CRC32C,
device and DTensor record, and the SHA-256 against its own base's), and the manifest records a
SHA-256 for the tensor. A tensor the compare found changed (a change through ``.data`` or NumPy,
one with an unchanged CRC32C) or did not compare, one whose SHA-256 the persistent base did not
record, and every tensor when the bases are not from the same snapshot (a restored base, a tier
that dropped a save) are hashed as before. The compare's answer is kept on the snapshot
(:class:`~nebula_ckpt.tiers.memory.compare.Compared`), so the memory tier's own save does not compare
those bytes again.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from nebula_ckpt.ranks.shards import prefixed
from nebula_ckpt.save.incremental import hash_staged, same_kind, same_record, wanted_keys
from nebula_ckpt.tiers.memory.compare import BaseBytes, Compared

log = logging.getLogger(__name__)


def staged_hashes(targets: list[Any], view: memoryview,
                  index: dict[str, dict[str, Any]]) -> tuple[dict[str, str], Optional[Compared]]:
    """The SHA-256 of the staged tensors that the tiers ``targets`` (tier writers) need, and the
    memory tier's compare of them with its base when it was made (see the module)."""
    known: dict[str, str] = {}
    compared: Optional[Compared] = None
    mem = next((t for t in targets if t.incremental.enabled and t.incremental.compare), None)
    if mem is not None:
        compared, origin = _compare(mem, targets, view, index)
        if compared is not None:
            known = _recorded(compared, origin, mem.key_prefix, targets)
    want = wanted_keys(targets, index) - set(known)
    got = hash_staged(view, index, want)
    if known:
        log.debug("nebula_ckpt: %d tensor(s) found unchanged by the memory tier's compare: their SHA-256 are the "
                  "base's, %d hashed", len(known), len(got))
    return {**known, **got}, compared


def _peers(mem: Any, targets: list[Any], origin: str) -> list[Any]:
    """The persistent tiers among ``targets`` whose base was committed from snapshot ``origin``."""
    return [t for t in targets if t is not mem and t.incremental.enabled and not t.incremental.compare
            and t.incremental.current()[1] == origin]


def _compare(mem: Any, targets: list[Any], view: memoryview,
             index: dict[str, dict[str, Any]]) -> tuple[Optional[Compared], str]:
    """The memory tier's compare of the staged bytes with its base, made only when a persistent
    tier's base comes from the same snapshot (else ``(None, "")``)."""
    base, origin = mem.incremental.current()
    if base is None or origin is None or not _peers(mem, targets, origin):
        return None, ""
    keyed = prefixed(index, mem.key_prefix)
    cands = {k: old for k, rec in keyed.items()
             if (old := base.tensors.get(k)) is not None and same_kind(rec, old) and same_record(rec, old)}
    if not cands:
        return None, ""
    try:
        with BaseBytes(mem.storage, view, keyed) as bb:
            same = bb.same(base, cands)
    except OSError as e:  # the memory tier's own save reports it; here the tensors are hashed
        log.debug("nebula_ckpt: tier %s: its base cannot be compared: %s", mem.name, e)
        return None, ""
    return Compared(base, frozenset(cands), frozenset(same)), origin


def _recorded(compared: Compared, origin: str, prefix: str, targets: list[Any]) -> dict[str, str]:
    """Key -> the SHA-256 a persistent base from snapshot ``origin`` recorded, for the keys the
    compare found equal (keys of the snapshot: ``prefix`` removed)."""
    out: dict[str, str] = {}
    for t in targets:  # checked again: a writer thread may have moved its base on since the compare
        base, got = t.incremental.current()
        if base is None or got != origin or t.incremental.compare:
            continue
        for k in compared.same:
            key = k[len(prefix):]
            h = base.hashes.get(key)
            if h is not None:
                out[key] = h
    return out
