"""Internal: a checkpoint root opened for one run: its tiers chosen, reached and opened, its run id, its fence.

:func:`open_root` is what a :class:`~nebula_ckpt.checkpointer.Checkpointer` does first: bind and
validate the tiers, reach each one (fail fast, before anything is left behind), read or take the
root's run id (``_nebula/run.json``), let each tier open for that run (the memory tier claims
its folder), and set up the writer fence; in a multi-rank job, the collectives every rank runs
while opening (one root for all ranks, the job's writer generation, the shared tiers' rounds).

Opening never creates the root: a root no run has written yet gets its run id at the first
write (:meth:`OpenRoot.create`, at the first save), so a restore, a listing or a typo in the
path leaves nothing behind. (A multi-rank job records it while opening: the ranks check there
that they share one root.) A root that cannot be written is named, with its tier and the fix,
at the first save (:func:`unwritable_root`), never as a bare ``PermissionError`` later.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import uuid
from typing import Any, Callable, Optional, Sequence

from nebula_ckpt.errors import NotFoundError, ValidationError
from nebula_ckpt.format.commit import Write
from nebula_ckpt.format.names import COMMIT, LOCK_FILE, MANIFEST, ROOT_FILE, RUN_FILE, parse_step_dir
from nebula_ckpt.format.owner import Owner, is_tier_folder, read_owner
from nebula_ckpt.ranks.coordinator import Coordinator
from nebula_ckpt.ranks.fencing import Fence, read_run_id, run_id
from nebula_ckpt.save.drain import own_part_drainer
from nebula_ckpt.save.uncut import run_uncut
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import canonical_root, local_path
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.factory import runtime_for
from nebula_ckpt.tiers.roots import default_tiers, tier_for_root
from nebula_ckpt.tiers.runtime import TierRuntime

log = logging.getLogger("nebula_ckpt")


class OpenRoot:
    """The tiers of a root opened for this run (see :func:`open_root`).

    Attributes:
        runtimes: the tiers opened (read only: those readable), fastest first.
        run_id: id of this incarnation of the root (None: read only, and no run ever opened it).
        fence: the writer fence on the root's persistent tier.
    """

    def __init__(self, runtimes: list[TierRuntime], root_storage: Storage, own_root_storage: bool,
                 run_id: Optional[str], coordinator: Coordinator, root: str = "", fresh: bool = False,
                 existed: bool = True) -> None:
        self.runtimes = runtimes
        self.run_id = run_id
        #: no run has written the root yet: ``run_id`` is recorded there by :meth:`create`
        self.fresh = fresh
        self.root = root
        self._create_lock = threading.Lock()
        self._ready = False  # create() has run
        #: a run had written the root (its run id was there) when it was opened
        self.existed = existed
        path = root_storage.local_path("")
        self._was_folder = path is not None and os.path.isdir(path)
        self.root_storage = root_storage
        self._own_root_storage = own_root_storage
        self.fence = Fence(root_storage, coordinator, canonical_root(root) if root else None)

        def give_back() -> None:  # fenced on one tier, fenced on all: the memory tier's lock goes
            for rt in runtimes:
                rt.fenced(handed_over=self.fence.handed_over)
        self.fence.on_fenced(give_back)

    def create(self) -> None:
        """Before the first write: record the run id on a root no run has written yet (which
        creates it), after checking that every local tier can be written. Idempotent.

        Raises:
            ValidationError: a tier cannot be written (:func:`unwritable_root`): nothing was saved.
        """
        with self._create_lock:
            if self._ready:
                return
            # an older Checkpointer of this process on this root finishes its saves and hands over
            self.fence.take_root()
            for rt in self.runtimes:
                if rt.persistent:
                    check_writable(rt)
            if not self.fresh:
                self._ready = True
                return
            try:
                rid = run_id(self.root_storage, self.run_id)
            except OSError as e:
                tier = next((rt.name for rt in self.runtimes if rt.storage is self.root_storage), "the root")
                raise unwritable_root(f"tier {tier} ({self.root_storage.display_url})", "the root", e) from e
            if rid != self.run_id:  # another process created the root meanwhile: its id is the run's
                owner = Owner(canonical_root(self.root), rid)
                for rt in self.runtimes:
                    rt.open(owner)
                self.run_id = rid
            self.fresh = False
            self._ready = True

    def create_once(self) -> Optional[str]:
        """:meth:`create`, the first time, on a thread of its own (a Ctrl-C cannot cut it half way,
        :func:`~nebula_ckpt.save.uncut.run_uncut`); the run id."""
        if not self._ready:
            run_uncut(self.create, f"nebula-create-{canonical_root(self.root)[-24:]}")
        return self.run_id

    def missing(self) -> Optional[str]:
        """What the root was when opened, if no run had written it (no run id recorded): "does
        not exist" or "holds nothing yet"; None when a run wrote it. What a resume from a
        mistyped path finds. A root this run has written since (its steps all removed, or none
        committed) is said to hold no committed checkpoint any more."""
        if self.existed:
            return None
        if self._ready:
            return ("holds no committed checkpoint any more (this run wrote it; its checkpoints were removed, or "
                    "none committed)")
        path = self.root_storage.local_path("")
        if path is not None and not self._was_folder:
            return "does not exist"
        return "holds no checkpoint (no run has written it)"

    def nothing_to_resume(self, must_exist: bool) -> Optional[int]:
        """``load_latest`` found nothing: say so where a run was expected (WARNING, naming the
        root); with ``must_exist`` raise :class:`~nebula_ckpt.errors.NotFoundError` instead.
        Returns None (what ``load_latest`` then returns)."""
        shown = canonical_root(self.root)
        missing = self.missing()
        if missing is None:
            if must_exist:
                raise NotFoundError(f"no checkpoint to resume from under {shown}: it holds no healthy committed "
                                    "checkpoint (load_latest(must_exist=True))")
            return None
        msg = f"no checkpoint to resume from: the root {shown} {missing}"
        if must_exist:
            raise NotFoundError(f"{msg}; check the path if a run should be there (must_exist=True)")
        log.warning("nebula_ckpt: %s, so training starts from scratch; check the path if a run should be there "
                    "(load_latest(..., must_exist=True) raises instead)", msg)
        return None

    def drainer(self) -> Optional[Callable[[Write, int, int, str], None]]:
        """What drains a step restored after a node loss to the root (each rank its own part);
        None when no run ever opened the root."""
        st = self.root_storage
        return None if self.run_id is None else own_part_drainer(st, st.display_url, self.run_id)

    def release(self) -> None:
        """Release every tier (and the root's storage, when it is no tier's)."""
        self.fence.retire()
        for rt in self.runtimes:
            rt.release()
        if self._own_root_storage:
            self.root_storage.close()


def choose_tiers(root: str, storage_options: Optional[dict[str, Any]], tiers: Optional[Sequence[Tier]],
                 memory_tier: bool, rank: int) -> tuple[list[Tier], Tier]:
    """The tiers to use (validated, bound to root and rank) and the persistent root's tier."""
    root_tier = tier_for_root(root, storage_options)
    if tiers is None:
        chosen: list[Tier] = default_tiers(root, storage_options, memory_tier, rank)
        root_tier = chosen[-1]
    else:
        try:
            if isinstance(tiers, (Tier, str)):
                raise TypeError
            chosen = list(tiers)
        except TypeError:
            raise ValidationError(f"tiers must be a list of tiers, fastest first (tiers=[nc.LocalTier(...)]), got "
                                  f"{type(tiers).__name__}") from None
        if not chosen:
            raise ValidationError("tiers must name at least one tier")
    for t in chosen:
        if not isinstance(t, Tier):
            raise ValidationError(f"tiers must be Tier objects (MemoryTier, LocalTier, RemoteTier), got {t!r}")
        t.bind(root, rank)
        t.validate()
    _refuse_shared_locations(chosen)
    return chosen, root_tier


def _refuse_shared_locations(tiers: list[Tier]) -> None:
    """Two tiers in one folder (``LocalTier(p)`` beside ``LocalTier(p + "/")``, or a ``file://`` URL of
    it) would each commit, prune and sweep the other's steps: refused before anything is written."""
    seen: dict[str, str] = {}
    for t in tiers:
        url = t.display_url
        path = local_path(url)
        where = os.path.realpath(path) if path is not None else url.rstrip("/")
        if where in seen:
            raise ValidationError(f"tiers {seen[where]} and {t.name} are the same location ({where}): each tier "
                                  "needs a folder (or URL) of its own; drop one of them or give it another path")
        seen[where] = t.name


def refuse_nested_root(root: str, writing: bool = True) -> None:
    """Refuse a local root that is, or lies inside, a folder of another root: a step folder
    (``step-N`` holding ``COMMIT`` or ``manifest.json``, or right in a folder holding
    ``_nebula/run.json``), a root's ``_nebula/`` records, or (``writing``) a memory tier's folder,
    which may be read as a folder of steps (``nebula-ckpt ls`` of it), never written. A run there
    would write its checkpoints inside that step (which the root's retention deletes with them),
    or into that run's memory tier (whose next restore would take them for its own). Checked from
    the outermost folder down, so the message names the real root; nothing is created.

    Raises:
        ValidationError: naming the folder, the root it belongs to and what to open instead.
    """
    path = local_path(root)
    if path is None:
        return
    path = os.path.realpath(os.path.expanduser(path))
    chain = [path]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    for folder in reversed(chain):
        if not os.path.isdir(folder):
            return  # nothing below a missing folder exists
        why = _part_of_another_root(folder, writing)
        if why is not None:
            where = "is" if folder == path else f"lies inside {folder}, which is"
            raise ValidationError(f"{canonical_root(root)} {where} {why}")


def _part_of_another_root(folder: str, writing: bool) -> Optional[str]:
    """What ``folder`` is of another root (and what to open instead), or None when it is none of that."""
    parent, name = os.path.split(folder)
    if writing and is_tier_folder(folder):
        owner = read_owner(folder)
        if owner is None:
            return (f"a memory tier's folder (it holds {ROOT_FILE} and {LOCK_FILE}), not a checkpoint root: a memory "
                    "tier holds only the copies its own run writes. Open the root that run saved to instead (its "
                    "load_latest restores from this folder); `nebula-ckpt gc` lists memory tiers and their roots")
        return (f"the memory tier of the run at {owner.root}, not a checkpoint root: a memory tier holds only the "
                "copies its own run writes, and one opened as a root would mix its checkpoints with that run's. "
                f"Open {owner.root} instead (its load_latest restores from this memory tier; `nebula-ckpt ls "
                f"{owner.root}` lists it)")
    step = parse_step_dir(name)
    marked = step is not None and any(os.path.isfile(os.path.join(folder, n)) for n in (COMMIT, MANIFEST))
    if step is not None and (marked or os.path.isfile(os.path.join(parent, RUN_FILE))):
        return (f"step {step} of the checkpoint root {parent}, not a root of its own: saves there would go inside "
                "that step, and the root's retention would delete them with it. Open the root instead: "
                f"Checkpointer({parent!r}) and load(step={step}) (or read({step})) for this step; `nebula-ckpt "
                f"inspect {parent} --step {step}` shows it")
    if name == RUN_FILE.split("/")[0] and os.path.isfile(os.path.join(parent, RUN_FILE)):
        return (f"the records folder of the checkpoint root {parent}, not a root of its own: open {parent} "
                "instead")
    return None


def open_root(root: str, storage_options: Optional[dict[str, Any]], tiers: Optional[Sequence[Tier]],
              memory_tier: bool, coordinator: Coordinator, read_only: bool) -> OpenRoot:
    """Reach every tier (fail fast), take the root's run id, let each tier open for this run.

    Read only: the run id is only read (None: no run ever opened the root) and a tier is used
    when :meth:`~nebula_ckpt.tiers.runtime.TierRuntime.unreadable` allows it, which creates,
    claims and writes nothing. Multi-rank (not read only): the constructor's collectives.

    Raises:
        ValidationError: bad tiers, ranks that see different roots (nothing is kept open), or a
            root that is part of another root or of a memory tier (:func:`refuse_nested_root`).
    """
    refuse_nested_root(root, writing=not read_only)
    chosen, root_tier = choose_tiers(root, storage_options, tiers, memory_tier, coordinator.rank)
    runtimes = [runtime_for(t, t.make_storage()) for t in chosen]
    for rt in runtimes:  # fail fast, before leaving anything behind (a listing: nothing written)
        if rt.persistent:  # a memory tier that cannot be used stands aside (warning) in open() / unreadable()
            rt.storage.check_access()
    by_name = {rt.name: rt.storage for rt in runtimes}
    root_storage = by_name.get(root_tier.name) or root_tier.make_storage()
    own = root_tier.name not in by_name
    if own:
        root_storage.check_access()
    rid = read_run_id(root_storage)
    existed = rid is not None
    fresh = not existed and not read_only and coordinator.world_size == 1
    if fresh:
        rid = uuid.uuid4().hex  # recorded on the root at the first write (OpenRoot.create), not now
    elif not read_only:
        rid = run_id(root_storage)
    owner = Owner(canonical_root(root), rid)
    opened: list[TierRuntime] = []
    for rt in runtimes:
        why = (rt.unreadable(owner) or None) if read_only else (None if rt.open(owner) else "refused")
        if why is None:
            opened.append(rt)
        else:
            if read_only:
                log.debug("nebula_ckpt: tier %s not read: %s", rt.name, why)
            rt.release()
    out = OpenRoot(opened, root_storage, own, rid, coordinator, root, fresh, existed)
    if coordinator.world_size > 1 and not read_only:
        # Collectives belong here, where every rank is (the constructor): one root for all
        # ranks, the job's writer generation, and the rounds of each shared tier. An older
        # Checkpointer of a rank's process on this root hands over first, on every rank: the
        # exchange of run ids that follows is the barrier before rank 0 takes the new generation.
        out.fence.take_root()
        _check_shared_root(out, root, coordinator)
        _ = out.fence.generation
        for rt in opened:
            if rt.tier.shared:
                coordinator.open_tier(rt.name, rt.tier.every)
    return out


def _check_shared_root(opened: OpenRoot, root: str, coordinator: Coordinator) -> None:
    """Every rank must see the same root: on a root that is not shared (a node-local path in a
    multi-node job) each node would hold a part of every checkpoint and none would restore."""
    ids = coordinator.exchange(opened.run_id)
    if len(set(ids)) > 1:
        groups: dict[str, list[int]] = {}
        for r, i in enumerate(ids):
            groups.setdefault(i, []).append(r)
        opened.release()
        raise ValidationError(
            f"root {canonical_root(root)} is not the same place for every rank: ranks see "
            f"{len(groups)} different roots (by run id: {[g[:4] for g in groups.values()]}); use a path "
            "on a file system every node mounts, or a blob URL (az://, s3://), for a multi-rank job")


def unwritable_root(where: str, what: str, error: OSError) -> ValidationError:
    """The error for a tier that cannot be written: which tier and path, why, and the fix."""
    return ValidationError(
        f"{where}: cannot write {what} ({type(error).__name__}: {error.strerror or error}). Checkpoints cannot be "
        "saved there: pick a folder this process can write (not on a read-only mount, under /proc or /sys, or "
        "below a file), or fix its permissions (`chmod`, `chown`, `chattr -i` on the immutable folder). Nothing "
        "was saved")


def check_writable(rt: TierRuntime) -> None:
    """Refuse a local tier that certainly cannot be written (checked without writing: the
    nearest existing folder of its path is read-only, immutable or not writable by this process)."""
    path = rt.storage.local_path("")
    if path is None:
        return
    probe = path
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    why = _why_unwritable(probe)
    if why is not None:
        what = "its folder" if probe == path else f"its folder ({probe} is the nearest that exists)"
        raise unwritable_root(f"tier {rt.name} ({path})", what, why)


def _why_unwritable(folder: str) -> Optional[OSError]:
    """Why nothing can be created in ``folder``, or None when that looks possible."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return OSError(errno.EROFS, "on a read-only mount", folder)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            flags = struct.unpack("l", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("l", 0)))[0]
        finally:
            os.close(fd)
    except OSError:  # no such flags on this file system
        flags = 0
    if flags & _FS_IMMUTABLE_FL:
        return OSError(errno.EPERM, "immutable (chattr +i): nothing can be created in it", folder)
    if not os.access(folder, os.W_OK | os.X_OK):
        return OSError(errno.EACCES, "not writable by this process", folder)
    return None


_FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h
_FS_IMMUTABLE_FL = 0x00000010
