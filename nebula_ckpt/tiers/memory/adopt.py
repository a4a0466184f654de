"""Restore from the memory tier without a copy: the restarted process adopts the tier's pages.

After a crash, the memory tier (a tmpfs) still holds the newest checkpoint, byte for byte what
the restarted process needs. Copying it into fresh memory costs a page fault per page and
doubles the RAM the state takes. Instead, the tensors a restore *creates* (the optimizer state,
new tensors; not the model's parameters, which exist and are copied into) become views of a
shared mapping of the tier's shard file.

That is safe only if nothing else can ever read those bytes as a checkpoint, or write them:

* the checkpoint must be committed on a persistent tier too, same step and same writer
  generation (giving up the memory tier's copy loses nothing);
* this process must hold the memory tier's lock while it deletes the step (no other live
  process writes it; the lock is given back right after, so a process that only restores never
  keeps a restarted job from writing the tier) and must not have saved through this
  Checkpointer yet (none of its own slot files is involved);
* single process, CPU tensors only;
* the hand-over is a claim that one process alone can win: every process that reads a memory-tier
  file holds a reader lock on it for as long as it maps it (see
  :func:`nebula_ckpt.storage.holds.hold_read`), and the claim, under the tier's lock, takes the
  file over only when no other process holds one (:func:`~nebula_ckpt.storage.holds.hold_alone`),
  the step is still committed, no committed step of the tier refers to its bytes (an incremental
  step built on it: :mod:`nebula_ckpt.format.commit`) and its names still link the very
  files this process verified.
  Then the checkpoint is deleted from the memory tier (commit marker first) and no name may link
  the file any more. Once claimed, no other process can start reading the file, and none was
  reading it: the pages this process writes (an optimizer step) or gives back to the tmpfs are
  nobody else's. The claim comes at the end of staging, once everything is verified, before
  anything in ``into`` changes. A process that does not win it (another one holds or reads the
  file, the step is gone or was replaced, the tier's lock is held, another name links the file)
  copies the adopted tensors instead and checks the copies' checksums, still while staging: a
  mismatch skips the candidate as damaged, like any other.

The file stays alive, unnamed, as long as any adopted tensor does; its pages no adopted tensor
covers (the model's bytes, the header) are given back to the tmpfs once the restore is applied.
The checksums of the adopted bytes are checked (in parallel, a chunk at a time) before anything
in ``into`` changes, as for copies. Knob ``adopt_memory_tier`` turns it off.

**Incremental steps.** A memory-tier step that refers to an earlier step's shard (the base: the
tensors that did not change, :mod:`nebula_ckpt.format.commit`) cannot give those bytes up:
they are the base's, which the tier keeps. The tensors created from them become views of a
*copy-on-write* mapping of the base's shard file instead (``MAP_PRIVATE``, opened without
following links): they share the tmpfs pages at no extra memory, and a page training writes later
is copied privately by the kernel, never written to the file. So are the tensors of the step's
own shard when a newer committed step of the tier refers to it. Such a mapping would see a write
made to the file in place, so the descriptor holds a private-mapping reader lock
(:func:`nebula_ckpt.storage.holds.hold_private`) before anything is checked, and the name must
still link the very file afterwards (a base deleted meanwhile is copied from instead): from then
on no process, this one included, takes the file over (:func:`~nebula_ckpt.storage.holds.hold_alone`
fails) or stages into it (a spare slot file of a dead process that retention unlinked:
:func:`~nebula_ckpt.tiers.memory.runtime.sweep_slot_files` and the staging pool skip every file
:func:`~nebula_ckpt.storage.holds.read_elsewhere` reports). Retention may delete the base later:
the mapping keeps its inode alive, and its pages go when the last view does. A base's pages are
never punched, and the base is never claimed. The claim of the step's own shard is as above; when
it is not won, only the own shard's tensors are copied (the copy-on-write ones stay what they are:
nothing can write them). ``last_restore["copy_on_write_bytes"]`` counts them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch

from nebula_ckpt.format.commit import committed_steps, delete_checkpoint, read_commit, referrers, shard_path
from nebula_ckpt.format.names import COMMIT, step_dir
from nebula_ckpt.format.records import TensorRecord
from nebula_ckpt.native import get_ops
from nebula_ckpt.restore.open import OpenCheckpoint, chunks, read_main_manifest
from nebula_ckpt.storage.buffers import BufferStorage
from nebula_ckpt.storage.holds import hold_alone, hold_private, hold_read, let_go
from nebula_ckpt.tiers.memory.adopt_memory import MemoryAdoption

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage
    from nebula_ckpt.tiers.memory.runtime import MemoryTierRuntime

log = logging.getLogger(__name__)

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


class Adoption:
    """The pages of one memory-tier checkpoint, handed to this process (see the module docstring).

    Args:
        runtime: the memory tier's runtime (its lock and storage).
        ck: the checkpoint opened from that tier.
    """

    def __init__(self, runtime: "MemoryTierRuntime", ck: "OpenCheckpoint", private: "set[int]") -> None:
        self._runtime = runtime
        # weak: the checkpoint holds its adoption (``ck.adoption``), and a cycle would keep both,
        # with their mappings of the tier's files (tmpfs pages), alive until a garbage collection
        self._ck_ref = weakref.ref(ck)
        self._files: dict[int, tuple[int, mmap.mmap]] = {}  # shard -> (fd, shared mapping)
        self._used: dict[int, list[tuple[int, int]]] = {}   # shard -> byte ranges of adopted tensors
        #: shards mapped copy-on-write (a base's; the step's own when a newer step refers to it)
        self._private = private
        self._cow: dict[int, tuple[int, mmap.mmap]] = {}    # shard -> (fd, private mapping)
        self._cow_ids: dict[int, TensorRecord] = {}         # copy-on-write views (by id), their records
        self.given_up = False
        #: a shard could not be mapped for writing: nothing is handed over, adopted views get copied
        self.refused = False
        self._shared_ids: dict[int, TensorRecord] = {}

    @property
    def _ck(self) -> "OpenCheckpoint":
        """The checkpoint adopted from (alive while its restore runs)."""
        ck = self._ck_ref()
        if ck is None:
            raise RuntimeError("nebula_ckpt: the checkpoint of this adoption is gone")
        return ck

    @property
    def adopted(self) -> dict[int, TensorRecord]:
        """The views (by id, with their records) that must be copied when the claim is not won:
        those of the shared mappings, and the copy-on-write ones too once adoption was refused."""
        return {**self._shared_ids, **self._cow_ids} if self.refused else self._shared_ids

    @property
    def handed_bytes(self) -> int:
        """Bytes of tensors handed over without a copy (0 until the tier gave the step up)."""
        return sum(hi - lo for used in self._used.values() for lo, hi in used) if self.given_up else 0

    @property
    def cow_bytes(self) -> int:
        """Bytes of tensors restored as copy-on-write views of the tier's files (0 once refused)."""
        return 0 if self.refused else sum(r.nbytes for r in self._cow_ids.values())

    def map(self, shard: int) -> mmap.mmap:
        """A shared, writable mapping of shard ``shard`` (opened once), or a private one for a
        shard mapped copy-on-write."""
        private = shard in self._private
        files = self._cow if private else self._files
        if shard not in files:
            files[shard] = self._open_mapped(shard, private)
        return files[shard][1]

    def _open_mapped(self, shard: int, private: bool) -> tuple[int, mmap.mmap]:
        """The descriptor and mapping of shard ``shard``: shared and writable under a reader lock,
        or copy-on-write under a private-mapping reader lock taken before the name is checked to
        still link the file (see the module docstring)."""
        sh = self._ck.manifest.shards[shard]
        path = self._runtime.storage.local_path(shard_path(self._ck.manifest, shard))
        if path is None:
            raise OSError(errno.EXDEV, "the memory tier is not a local file system")
        # non-blocking: a FIFO planted where the shard belongs is refused by its size, never waited on
        fd = os.open(path, (os.O_RDONLY if private else os.O_RDWR) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not private and not hold_read(fd):
                raise OSError(errno.EBUSY, f"{path} was taken over by another process")
            if private and not hold_private(fd):
                raise OSError(errno.EBUSY, f"{path} cannot be mapped copy-on-write safely (taken over by "
                              "another process, or no open-file-description locks here)")
            have = os.fstat(fd)
            if private:
                st = os.stat(path, follow_symlinks=False)
                if (st.st_dev, st.st_ino) != (have.st_dev, have.st_ino):
                    raise OSError(errno.ESTALE, f"{path} is no longer the file the checkpoint names")
            if have.st_size != sh.bytes:
                raise OSError(errno.EINVAL, f"{path} has {have.st_size} bytes, the manifest says {sh.bytes}")
            mm = mmap.mmap(fd, have.st_size, flags=mmap.MAP_PRIVATE if private else mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if private:  # its pages stay the tier's file's: stats() tells when retention deletes it
                self._runtime.track_copy_on_write(mm, path, have)
            return fd, mm
        except BaseException:
            os.close(fd)
            raise

    def tensors(self, recs: list[TensorRecord]) -> list[torch.Tensor]:
        """Views of ``recs`` over the tier's mappings (shared, or copy-on-write for the shards
        of :attr:`_private`), after checking their checksums.

        Raises:
            CorruptCheckpointError: naming the tensor whose bytes differ (nothing handed out).
        """
        # No populate call first: the checksum pass maps the pages (tmpfs read faults map them
        # 16 at a time, and writable: the first optimizer step takes no fault); populating them
        # for writing cost more than the whole pass (0.18 s for 0.8 GB here).
        ops = get_ops()
        for si in sorted({r.shard for r in recs}):
            mm = self.map(si)
            whole = torch.frombuffer(mm, dtype=torch.uint8)
            for group in chunks([r for r in recs if r.shard == si]):
                crcs = ops.crc32c(whole, [r.start for r in group], [r.nbytes for r in group])
                self._ck.verified_by_copy(group, crcs)
        out = []
        for r in recs:
            numel = math.prod(r.shape)
            if numel == 0:
                out.append(torch.empty(r.shape, dtype=r.torch_dtype))
                continue
            out.append(torch.frombuffer(self.map(r.shard), dtype=r.torch_dtype, count=numel,
                                        offset=r.start).reshape(r.shape))
            if r.shard in self._private:
                self._cow_ids[id(out[-1])] = r
            else:
                self._shared_ids[id(out[-1])] = r
                self._used.setdefault(r.shard, []).append((r.start, r.end))
        return out

    def give_up(self) -> bool:
        """Claim the file(s): take them over and delete the checkpoint from the memory tier, so
        that they are this process's alone; False when the claim is not won (see the module
        docstring: the adopted tensors must then be copied)."""
        if self.refused or not self._used:
            return False  # nothing adopted (or not all of it could be): the tier keeps the step
        # This process has not saved (a condition of adoption): it holds the lock only for this.
        if not self._runtime.lock_for_adoption():
            return False
        held: list[int] = []
        try:
            why = self._not_ours()
            if why is None:
                for fd, _ in self._files.values():
                    if not hold_alone(fd):
                        why = "another process has it open"
                        break
                    held.append(fd)
            if why is None:
                delete_checkpoint(self._runtime.storage, self._ck.step)
                if any(os.fstat(fd).st_nlink for fd, _ in self._files.values()):
                    why = "a shard is still linked elsewhere"
        except OSError as e:
            why = str(e)
        finally:
            self._runtime.unlock_after_adoption()
        if why is not None:
            for fd in held:
                let_go(fd)
            log.info("nebula_ckpt: memory tier %s: step %d not handed over (%s); copying it instead",
                     self._runtime.name, self._ck.step, why)
            return False
        self.given_up = True
        log.info("nebula_ckpt: step %d handed over from memory tier %s without a copy (the tier holds the "
                 "next save; the step stays on the slower tiers)", self._ck.step, self._runtime.name)
        return True

    def _not_ours(self) -> "str | None":
        """Why the tier's step is no longer the one this process verified (None: it is): its commit
        marker is gone, or a shard's name links another file (deleted, replaced, re-saved)."""
        storage = self._runtime.storage
        d = step_dir(self._ck.step)
        if not storage.exists(f"{d}/{COMMIT}"):
            return "the step is gone from the tier (another process took it, or retention deleted it)"
        users = referrers(storage, committed_steps(storage), self._ck.step)
        if users:  # an incremental step of the tier refers to these bytes: they stay the tier's
            return f"step(s) {users[:8]} of the tier refer to its bytes"
        shards = self._ck.manifest.shards
        for si, (fd, _) in self._files.items():
            path = storage.local_path(shard_path(self._ck.manifest, si))
            try:
                st = os.stat(path, follow_symlinks=False) if path else None
            except FileNotFoundError:
                st = None
            have = os.fstat(fd)
            if st is None or (st.st_dev, st.st_ino) != (have.st_dev, have.st_ino):
                return f"shard {shards[si].file} is no longer the file this process verified"
        return None

    def finish(self) -> None:
        """After the restore was applied (or given up): close the files (the mappings live on in
        the tensors) and, once handed over, give the tmpfs back the pages no adopted tensor covers,
        on a background thread (it only frees memory)."""
        shards = self._ck.manifest.shards
        files = [(fd, shards[si].bytes, self._used.get(si, [])) for si, (fd, _) in self._files.items()]
        self._files.clear()
        for fd, _ in self._cow.values():  # never punched: a base's pages are the tier's
            os.close(fd)  # the private mapping keeps its own descriptor, and with it the reader lock
        self._cow.clear()
        if not self.given_up:
            for fd, _, _ in files:
                os.close(fd)
            return

        def free() -> None:
            for fd, size, used in files:
                try:
                    _punch_outside(fd, size, used)
                finally:
                    os.close(fd)
        threading.Thread(target=free, name="nebula-adopt-free", daemon=True).start()


def _punch_outside(fd: int, size: int, used: list[tuple[int, int]]) -> None:
    """Free the whole pages of the file ``fd`` that no range of ``used`` touches."""
    page = mmap.PAGESIZE
    holes, at = [], 0
    for lo, hi in sorted(used):
        start = -(-at // page) * page
        end = lo // page * page
        if end > start:
            holes.append((start, end - start))
        at = max(at, hi)
    start = -(-at // page) * page
    if size > start:
        holes.append((start, size - start))
    libc = ctypes.CDLL(None, use_errno=True)
    for off, n in holes:
        if libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, ctypes.c_long(off), ctypes.c_long(n)) != 0:
            log.debug("nebula_ckpt: punching a hole failed: %s", os.strerror(ctypes.get_errno()))
            return


def adoption_for(runtimes: list[Any], ck: "OpenCheckpoint", saved: bool,
                 world_size: int) -> "Optional[Adoption | MemoryAdoption]":
    """The adoption of ``ck`` if every condition of the module docstring holds, else None; for a
    copy held in this process's memory (pulled from a partner), always its
    :class:`~nebula_ckpt.tiers.memory.adopt_memory.MemoryAdoption`."""
    from nebula_ckpt import knobs

    if isinstance(ck.storage, BufferStorage):
        return MemoryAdoption(ck)
    if not knobs.get("adopt_memory_tier") or saved or world_size > 1 or ck.manifest.multi_rank:
        return None
    mem = next((rt for rt in runtimes if rt.capabilities.hands_pages_to_restart and rt.name == ck.tier_name), None)
    if mem is None or not _durable_elsewhere(runtimes, ck, mem.storage):
        return None
    # another step's bytes, or this step's when a newer one refers to them: the tier's to keep
    private = {i for i, sh in enumerate(ck.manifest.shards) if sh.step is not None}
    if len(private) < len(ck.manifest.shards):
        try:
            if referrers(mem.storage, committed_steps(mem.storage), ck.step):
                private = set(range(len(ck.manifest.shards)))
        except OSError as e:
            log.debug("nebula_ckpt: memory tier %s: referrers of step %d unknown (%s)", mem.name, ck.step, e)
            private = set(range(len(ck.manifest.shards)))
    return Adoption(mem, ck, private)


def _durable_elsewhere(runtimes: list[Any], ck: "OpenCheckpoint", mine_on: Storage) -> bool:
    """Whether a persistent tier holds the same checkpoint committed (the same write: writer
    generation, step and save number, so an older save of a step saved again never stands in for
    it), with a manifest that parses and every shard file at its recorded size (the bytes are
    not re-read: that would cost the full read adoption saves)."""
    try:
        mine = read_commit(mine_on, ck.step, f"tier {ck.tier_name} step {ck.step}").write
    except Exception:  # gone or unreadable since it was opened: nothing to hand over
        return False
    for rt in runtimes:
        if not rt.persistent:
            continue
        st: Storage = rt.storage
        try:
            if read_commit(st, ck.step, f"tier {rt.name} step {ck.step}").write != mine:
                continue
            man = read_main_manifest(st, ck.step, f"tier {rt.name} step {ck.step}")
            if man.generation != ck.manifest.generation:
                continue
            files = [(shard_path(man, i), sh.stored_bytes) for i, sh in enumerate(man.shards)] + \
                [(f"{step_dir(ck.step)}/{ref.file}", ref.bytes) for ref in (man.layout.records if man.layout else ())]
            if all(st.size(path) == n for path, n in files):
                return True
        except Exception:  # absent, unreadable, damaged: not this tier
            continue
    return False
