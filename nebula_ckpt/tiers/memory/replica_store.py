"""Replicas in a rank's memory tier: where they live, how one becomes visible, what is kept.

A rank's memory-tier folder ``M`` holds, beside its own ``step-N/`` checkpoints:

* ``M/replicas/r<R>/step-N/`` — a verified copy of rank ``R``'s memory-tier step ``N``: the same
  files (``COMMIT``, ``manifest.json``, the shard), byte for byte, or, for an incremental step,
  the same step made whole (:mod:`~nebula_ckpt.tiers.memory.replica_whole`);
* ``M/replicas/.incoming-<id>/step-N/`` — a copy being received. It becomes visible by one
  ``rename`` into place, and only after every file arrived whole and the copy opened with every
  checksum verified (commit marker, manifest, each tensor's CRC32C): a receiver killed at any
  moment leaves an ``.incoming-*`` folder, which no reader lists and the next start sweeps.

A step pulled back at restore (its owner lost its memory tier) lands in ``M/step-N/`` the same
way: received under ``.incoming-*``, verified, renamed into place.

Retention: per source rank, the newest ``keep`` replicas stay (the memory tier's ``keep_last``);
an older one goes once a newer one is visible. Replicas of ranks that are not this rank's sources
now (an earlier job's partners, another world size) go once this job's first replica is
visible here. An older replica's shard files are not freed but kept as that
rank's *spares* (``M/replicas/.spare-r<R>/``, never listed by a reader, removed by the next start):
the next copy of that rank is received into them, whose memory pages then exist already (on a
tmpfs, allocating and zeroing fresh pages costs more CPU than the bytes' transfer). A host-memory
budget that is short frees the spares and the replicas of writes a shared tier holds committed
(:meth:`ReplicaStore.give_up`). So a rank holds
at most ``keep + 1`` steps of each rank it is a partner of (the extra one: the spares, or the copy
being received into them).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from typing import Any, Callable, Collection, Mapping, Optional

import torch

from nebula_ckpt.format.commit import Write, committed_writes
from nebula_ckpt.format.names import COMMIT, step_dir
from nebula_ckpt.native import get_ops
from nebula_ckpt.restore.open import OpenCheckpoint, open_checkpoint, read_manifest
from nebula_ckpt.storage.holds import read_elsewhere
from nebula_ckpt.storage.local import LocalStorage

log = logging.getLogger(__name__)

REPLICA_DIR = "replicas"
INCOMING_PREFIX = ".incoming-"
SPARE_PREFIX = ".spare-"
#: the only file names a step folder sent between ranks may hold
_FILE_RE = re.compile(r"^(COMMIT|manifest\.json|shard-g\d+-r\d+\.safetensors)$")
_SOURCE_RE = re.compile(r"^r(0|[1-9]\d*)$")  # the name source_dir gives, nothing else ("r02" is not rank 2's)


def step_files(folder: str, step: int) -> list[tuple[str, int]]:
    """``(name, size)`` of the files of ``folder/step-N`` that a copy carries, commit marker last.

    Raises:
        FileNotFoundError: the step is not committed there.
    """
    d = os.path.join(folder, step_dir(step))
    if not os.path.isfile(os.path.join(d, COMMIT)):
        raise FileNotFoundError(f"{d} holds no committed step")
    names = sorted(n for n in os.listdir(d) if _FILE_RE.match(n) and n != COMMIT)
    return [(n, os.path.getsize(os.path.join(d, n))) for n in names + [COMMIT]]


def safe_name(name: str) -> bool:
    """Whether ``name`` may be written into a step folder received from another rank."""
    return bool(_FILE_RE.match(name))


def committed(folder: str) -> list[tuple[int, int]]:
    """``(writer generation, step)`` of the committed steps in ``folder`` (unreadable markers skipped),
    ascending: :func:`writes` without the save."""
    return [(g, s) for g, s, _ in writes(folder)]


def writes(folder: str) -> list[Write]:
    """``(writer generation, step, save)`` of the committed steps in ``folder``: which write of
    each step it holds (:attr:`~nebula_ckpt.format.commit.Commit.write`; unreadable markers skipped)."""
    return committed_writes(LocalStorage(folder, private=True, fsync=False)) if os.path.isdir(folder) else []


def of_world(folder: str, orders: list[Write], world: int) -> list[Write]:
    """Those of ``orders`` (the writes committed in ``folder``: :func:`writes`) saved by a job of
    ``world`` ranks: a rank's part of another world size is restored through the shared tiers,
    never from memory."""
    st = LocalStorage(folder, private=True, fsync=False)
    out = []
    try:
        for o in orders:
            s = o[1]
            try:
                man = read_manifest(st, s)
            except Exception as e:  # a damaged copy is no source
                log.debug("nebula_ckpt: %s step %d: %s", folder, s, e)
                continue
            if man.world_size == world:
                out.append(o)
    finally:
        st.close()
    return out


def verify_step(folder: str, step: int, rank: int, world: int, verify: str = "full",
                landed: Optional[Mapping[str, torch.Tensor]] = None) -> None:
    """Open ``folder/step-N`` as rank ``rank`` of ``world`` would, checking ``verify`` (every
    checksum with ``"full"``, file sizes with ``"size"``). ``landed``: the bytes of some of the
    step's own files, by name, as this process already maps them (a copy's files as received):
    their checksums are taken there, on every thread, instead of through a second mapping.

    Raises:
        CorruptCheckpointError / OSError / NotThisLayout: it is not a healthy copy.
    """
    st = LocalStorage(folder, private=True, fsync=False)
    try:
        ck = open_checkpoint(st, step, verify, f"{folder} step {step}", rank, world,
                             defer_verify=bool(landed) and verify == "full")
        if ck.unverified and landed:
            _verify_landed(ck, landed)
            ck.verify_rest()  # what was not landed (none for a whole step), through the files
    finally:
        st.close()


def _verify_landed(ck: OpenCheckpoint, landed: Mapping[str, torch.Tensor]) -> None:
    """Check the records of ``ck`` whose shard is one of ``landed`` against those bytes."""
    man = ck.manifest
    for si, recs in list(ck.unverified.items()):
        sh = man.shards[si]
        plain = set(sh.storage or {}) <= {"stored_bytes"} and sh.stored_bytes == sh.bytes  # stored as is
        buf = landed.get(sh.file) if sh.step is None and plain else None
        if buf is None or not recs or buf.numel() != sh.bytes:
            continue  # left to verify_rest
        ck.verified_by_copy(recs, get_ops().crc32c(buf, [r.start for r in recs], [r.nbytes for r in recs]))


def folder_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _planted_link(path: str) -> bool:
    """Whether ``path`` (an entry of the replica store, which only ever makes folders) is a
    symlink: not a replica, never listed, written or deleted through (it is logged)."""
    if not os.path.islink(path):
        return False
    log.warning("nebula_ckpt: %s is a symlink, not a replica folder; ignored", path)
    return True


def _remove(path: str) -> None:
    """Remove ``path``: a folder and what it holds, a symlink itself (never what it points to)."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError as e:
        log.debug("nebula_ckpt: cannot remove %s: %s", path, e)


class ReplicaStore:
    """The replicas a rank holds in its memory-tier folder ``folder`` (see the module docstring)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.base = os.path.join(folder, REPLICA_DIR)

    def source_dir(self, rank: int) -> str:
        """Folder of the replicas of ``rank``."""
        return os.path.join(self.base, f"r{rank}")

    def sweep(self) -> None:
        """Remove copies a killed receiver left half-done (never visible; no reader lists them)."""
        if not os.path.isdir(self.base):
            return
        for n in os.listdir(self.base):
            if n.startswith((INCOMING_PREFIX, SPARE_PREFIX)):
                _remove(os.path.join(self.base, n))

    def spare(self, rank: int, name: str) -> Optional[str]:
        """The path of a spare file ``name`` of ``rank`` (a shard of a replica pruned before, to
        receive the next copy into), or None; never one a process still reads or maps copy-on-write."""
        path = os.path.join(self.base, f"{SPARE_PREFIX}r{rank}", name)
        return path if os.path.isfile(path) and not os.path.islink(path) and not read_elsewhere(path) else None

    def incoming(self, step: int) -> str:
        """A new private folder ``.incoming-<id>/step-N`` to receive a copy into."""
        os.makedirs(self.base, mode=0o700, exist_ok=True)
        root = os.path.join(self.base, f"{INCOMING_PREFIX}{uuid.uuid4().hex[:12]}")
        os.mkdir(root, 0o700)
        os.mkdir(os.path.join(root, step_dir(step)), 0o700)
        return root

    def discard(self, incoming: str) -> None:
        """Drop a copy that failed (its folder, whatever it holds)."""
        shutil.rmtree(incoming, ignore_errors=True)

    def publish(self, incoming: str, step: int, dest: str) -> None:
        """Make the verified copy in ``incoming`` visible as ``dest/step-N`` (one rename; a damaged
        copy already there is moved aside first and removed after)."""
        if os.path.islink(dest):  # never write through a link planted in the store
            os.unlink(dest)
        os.makedirs(dest, mode=0o700, exist_ok=True)
        target = os.path.join(dest, step_dir(step))
        old = None
        if os.path.lexists(target):
            old = os.path.join(self.base, f"{INCOMING_PREFIX}old-{uuid.uuid4().hex[:12]}")
            os.rename(target, old)
        os.rename(os.path.join(incoming, step_dir(step)), target)
        shutil.rmtree(incoming, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def held(self) -> dict[int, list[tuple[int, int]]]:
        """Source rank -> ``(generation, step)`` of the visible replicas of it."""
        out: dict[int, list[tuple[int, int]]] = {}
        if not os.path.isdir(self.base):
            return out
        for n in os.listdir(self.base):
            m = _SOURCE_RE.match(n)
            if m and not _planted_link(os.path.join(self.base, n)):
                have = committed(os.path.join(self.base, n))
                if have:
                    out[int(m.group(1))] = have
        return out

    def prune(self, rank: int, keep: int, also: Optional[Callable[[Any, list[int]], set[int]]] = None) -> None:
        """Keep the newest ``keep`` replicas of ``rank``, in a restore's order (writer generation, then
        step, as retention ranks a tier's checkpoints: :meth:`~nebula_ckpt.save.writer.TierWriter.prune`),
        and those ``also(storage, steps)`` names (the memory tier's retention rule, on a storage
        of the folder), commit marker first."""
        d = self.source_dir(rank)
        if _planted_link(d):  # never delete through a link planted in the store
            return
        ranked = [s for _, s in committed(d)]  # sorted by (generation, step)
        doomed = ranked[:-keep] if keep > 0 else ranked
        kept: set[int] = set()
        if doomed and also is not None:
            try:
                kept = also(LocalStorage(d, private=True, fsync=False), ranked)
            except Exception as e:  # the rule cannot be had: keep as keep says
                log.debug("nebula_ckpt: replicas of rank %d: retention rule failed: %s", rank, e)
        for s in doomed:
            if s not in kept:
                self._drop(rank, s)

    def forget(self, steps: Collection[int]) -> list[tuple[int, int]]:
        """Remove the replicas of ``steps`` held of every source rank (``remove()``), commit markers
        first; ``(rank, step)`` of each removed. Planted links are left alone."""
        gone = []
        for rank, have in sorted(self.held().items()):  # held(): planted links are not listed
            for s in sorted({s for _, s in have} & set(steps)):
                self._drop(rank, s)
                gone.append((rank, s))
        return gone

    def give_up(self, holds: Callable[[Write], bool]) -> bool:
        """Free the replicas whose write ``(generation, step, save)`` ``holds`` says a shared tier
        holds committed (they protect nothing against a node loss), commit markers first, their
        files freed (not kept as spares), and every rank's spares (a host-memory budget that is
        short needs the room more than the next copy needs their pages); whether anything went.
        Every replica is whole, so none needs another that goes. The caller keeps
        the rounds away meanwhile (:meth:`~nebula_ckpt.tiers.memory.replicas.Replicator.give_up`)."""
        gone = []
        for rank in sorted(self.held()):  # held(): planted links are not listed
            d = self.source_dir(rank)
            for g, s, w in writes(d):
                if holds((g, s, w)):
                    sd = os.path.join(d, step_dir(s))
                    try:
                        os.unlink(os.path.join(sd, COMMIT))
                    except OSError:
                        pass
                    shutil.rmtree(sd, ignore_errors=True)
                    gone.append((rank, s))
        spares = [n for n in (os.listdir(self.base) if os.path.isdir(self.base) else []) if n.startswith(SPARE_PREFIX)]
        for n in spares:
            _remove(os.path.join(self.base, n))
        if gone or spares:
            log.info("nebula_ckpt: %s: gave up the replicas (rank, step) %s, which a shared tier holds as the same "
                     "write, and %d rank(s)' spare files, to stay within the host-memory budget", self.base, gone,
                     len(spares))
        return bool(gone or spares)

    def _drop(self, rank: int, step: int) -> None:
        """Remove the replica of ``step`` of ``rank``: its commit marker first (no reader takes it from
        then on), its shard files kept as spares for the next copy."""
        sd = os.path.join(self.source_dir(rank), step_dir(step))
        try:
            os.unlink(os.path.join(sd, COMMIT))
        except OSError:
            pass
        self._keep_spares(rank, sd)
        shutil.rmtree(sd, ignore_errors=True)

    def drop_others(self, sources: set[int]) -> list[int]:
        """Remove the replicas of every rank not in ``sources`` (held for an earlier job whose
        ranks had other partners, or another world size: no round of this job refreshes or prunes
        them), commit markers first; the ranks whose copies went. Planted links are left alone."""
        dropped = []
        for rank in sorted(set(self.held()) - sources):
            d = self.source_dir(rank)
            for _, s in committed(d):
                try:
                    os.unlink(os.path.join(d, step_dir(s), COMMIT))
                except OSError:
                    pass
            _remove(d)
            dropped.append(rank)
        if dropped:
            log.info("nebula_ckpt: %s: dropped the replicas of rank(s) %s, no longer this rank's sources",
                     self.base, dropped)
        return dropped

    def _keep_spares(self, rank: int, step_folder: str) -> None:
        """Move the shard files of a pruned (no longer committed) copy of ``rank`` to its spares,
        in place of the spares before."""
        spares = os.path.join(self.base, f"{SPARE_PREFIX}r{rank}")
        try:
            shutil.rmtree(spares, ignore_errors=True)
            os.mkdir(spares, 0o700)
            for n in os.listdir(step_folder):
                if n.startswith("shard-") and _FILE_RE.match(n):
                    os.rename(os.path.join(step_folder, n), os.path.join(spares, n))
        except OSError as e:  # no spares: the next copy is received into new files
            log.debug("nebula_ckpt: cannot keep the files of %s as spares: %s", step_folder, e)

    def held_bytes(self) -> int:
        """Bytes of every replica held (and copies being received)."""
        return folder_bytes(self.base)

    def free_after(self, nbytes: int) -> Optional[float]:
        """Fraction of the tmpfs left free after ``nbytes`` more (None if unknown)."""
        try:
            sv = os.statvfs(self.folder)
        except OSError:
            return None
        total = sv.f_blocks * sv.f_frsize
        return None if total <= 0 else (sv.f_bavail * sv.f_frsize - nbytes) / total
