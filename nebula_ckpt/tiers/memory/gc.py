"""Garbage collection of memory tiers: RAM in ``/dev/shm`` whose checkpoints are safe on their root.

A memory tier outlives its process on purpose (a restart resumes from it), so a job that
crashed and is never restarted leaves its checkpoints in RAM. The policy (``nebula-ckpt gc``):

==============================================  ==============================================
memory tier                                     decision
==============================================  ==============================================
in use (a live process holds its lock)          kept
not safely ours (owner, mode, symlink)          kept, never touched (reported)
no committed step                               removed: nothing to lose
newest step committed and whole on the root     removed: durable there (whole: its shards
                                                and the referenced ones at their recorded sizes)
root that cannot be checked (see below)         kept, even with ``--force``
newest step only in memory: the root lacks it,  kept, unless ``--force`` (which says which
the root is gone, the root now belongs to       steps are lost; the command line takes it
another run, or no ``ROOT`` file names a root   only for one named run: ``gc ROOT --force``)
newest step durable but marked suspect, and     kept, unless ``--force``, as above: that step
the step a restart restores instead (the        is the one a restart resumes from
newest not marked suspect) only in memory
==============================================  ==============================================

The root is asked, never presumed. A root is *gone* only when that is known: a local root does
not exist and its nearest existing parent folder lists no such name; a remote root's store
answers "not found" and holds nothing there. Any other answer (a permission or I/O error, a
path that passes a file or a link loop, an existing root without its run record, as an
unmounted mount point shows, a failing or missing fsspec backend, no answer within the
deadline: ``nebula-ckpt gc --root-timeout``, :data:`ROOT_TIMEOUT_S` by default) leaves the root
*unknown*, and the tier is kept. A remote root is reached with the storage options given for it
(``nebula-ckpt gc ROOT --storage-options JSON``: only for the run named), else with the credentials
of the environment.

Nothing is removed on the strength of an earlier look: :func:`remove` takes the tier's lock,
looks at the tier again, decides again and removes only if that decision says so, so a job that
restarted and saved meanwhile keeps its steps.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from nebula_ckpt.format.commit import (
    Write,
    committed_steps,
    committed_writes,
    read_commit,
)
from nebula_ckpt.format.health import SUSPECT
from nebula_ckpt.format.names import COMMIT, RUN_FILE, step_dir
from nebula_ckpt.format.root_records import MAX_ROOT_RECORD_BYTES, parse_run_record
from nebula_ckpt.health.book import HealthView
from nebula_ckpt.restore.intact import restore_problem
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.local import LocalStorage
from nebula_ckpt.storage.urls import canonical_root
from nebula_ckpt.tiers.memory.shm import Found, look, scan, try_lock, unlist_steps

#: seconds a root may take to answer before it counts as unknown (``nebula-ckpt gc --root-timeout``)
ROOT_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)

#: what the root says about a memory tier's newest step
DURABLE, ONLY_HERE, UNKNOWN = "durable", "only-here", "unknown"


@dataclass(frozen=True)
class Decision:
    """What ``gc`` does with one memory tier, and why."""

    found: Found
    remove: bool
    reason: str
    #: ``--force`` was given (:func:`remove` decides again with it)
    forced: bool = False
    #: set by :func:`remove`: whether the folder was removed
    removed: Optional[bool] = None

    def as_dict(self) -> dict[str, object]:
        """For ``--json``."""
        f = self.found
        out: dict[str, object] = {
            "folder": f.folder, "root": f.owner.root if f.owner else None,
            "run_id": f.owner.run_id if f.owner else None, "in_use": f.in_use, "bytes": f.nbytes,
            "remove": self.remove, "reason": self.reason}
        if self.removed is not None:
            out["removed"] = self.removed
        return out


@dataclass(frozen=True)
class RootAnswer:
    """What a memory tier's root says about the tier's newest step."""

    verdict: str                          # DURABLE, ONLY_HERE or UNKNOWN
    why: str
    on_root: frozenset[int] = frozenset()  # steps of the same run committed on the root


def _committed(folder: str) -> list[int]:
    return committed_steps(LocalStorage(folder, private=True, fsync=False))


def _steps_text(steps: list[int]) -> str:
    """``"step 7"`` / ``"steps 3, 7"`` (the newest eight of a long list)."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    more = f"{len(steps)} in all, the newest " if len(steps) > 8 else ""
    return f"steps {more}{', '.join(map(str, steps[-8:]))}"


def _local_root_gone(root: str) -> bool:
    """Whether local ``root`` is known to be gone: it does not exist and its nearest existing
    parent folder can be listed and lists no such name. False when it exists.

    Raises:
        OSError: when that cannot be told (a permission or I/O error, a path passing a file or a
            link loop, a name listed that cannot be found): the root is unknown.
    """
    try:
        os.stat(root)
        return False
    except FileNotFoundError:
        pass
    path = root
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            raise OSError(f"{root} cannot be found, yet no parent folder of it lacks it")
        try:
            names = os.listdir(parent)
        except FileNotFoundError:
            path = parent
            continue
        if os.path.basename(path) in names:  # a dangling link, or a folder that does not answer
            raise OSError(f"{path} is listed in {parent} but cannot be reached")
        return True


def _root_url(root: str) -> str:
    """The URL to reach a remote root recorded in canonical form (``memory:/x`` -> ``memory:///x``)."""
    scheme, _, rest = root.partition(":")
    return root if rest.startswith("//") else f"{scheme}://{rest}"


def _run_record(st: Storage) -> tuple[bool, Optional[str]]:
    """``(present, run id)`` of the root's run record; raises when it cannot be read or parsed."""
    try:
        raw = st.read_small(RUN_FILE, MAX_ROOT_RECORD_BYTES)
    except FileNotFoundError:
        return False, None
    return True, parse_run_record(raw, f"{st.display_url}: {RUN_FILE}")


def _ask_root(root: str, run_id: Optional[str], step: int, write: Optional[Write] = None,
              storage_options: Optional[dict[str, Any]] = None, held: tuple[Write, ...] = ()) -> RootAnswer:
    """What ``root`` says about ``step`` of run ``run_id`` (the write ``write`` of it, when given:
    an older write of the same step on the root does not make it durable; raises when it cannot tell).
    A remote root is reached with ``storage_options`` (None: the credentials of the environment).
    ``held``: every write the memory tier holds (see :func:`_restored_write`)."""
    local = os.path.isabs(root)
    if local and _local_root_gone(root):
        return RootAnswer(ONLY_HERE, f"its root {root} is gone")
    st: Storage
    if local:
        st = LocalStorage(root)
    else:
        from nebula_ckpt.storage.remote import FsspecStorage

        st = FsspecStorage(_root_url(root), storage_options)
    try:
        present, have = _run_record(st)
        if not present and not st.list(""):
            if local:  # an existing empty folder is what an unmounted mount point shows
                raise OSError(f"{root} is an empty folder: a mount point that is not mounted?")
            return RootAnswer(ONLY_HERE, f"its root {root} is gone (the store holds nothing there)")
        if not present and run_id is not None:
            raise OSError(f"{root} holds no run record ({RUN_FILE}): a mount point that is not mounted, "
                          "or a root emptied or re-created and not used since")
        if have != run_id:
            return RootAnswer(ONLY_HERE, f"its root {root} now belongs to another run")
        try:
            st.size(f"{step_dir(step)}/{COMMIT}")
        except FileNotFoundError:
            return RootAnswer(ONLY_HERE, f"its root {root} does not hold step {step}", _committed_but(st, step))
        on_root = read_commit(st, step, f"{root} step {step}").write
        if write is not None and on_root < write:  # the step saved twice: the root holds the first write
            return RootAnswer(ONLY_HERE, f"its root {root} holds an older write of step {step} (save "
                                         f"{on_root[2]} of writer generation {on_root[0]}, this tier's is save "
                                         f"{write[2]} of generation {write[0]})", _committed_but(st, step))
        lacking = _lacking_on_root(st, step)
        if lacking is not None:
            return RootAnswer(ONLY_HERE, f"its root {root} holds step {step} but cannot restore it ({lacking})",
                              _committed_but(st, step))
        return _restored_write(st, root, step, held)
    finally:
        st.close()


def _restored_write(st: Storage, root: str, newest: int, held: tuple[Write, ...]) -> RootAnswer:
    """What the root says once the tier's newest step ``newest`` is durable there: whether the
    write a restart restores is too. That is the newest write, of the tier's (``held``) and the
    root's (``st``), not marked suspect on the root (a restore of the newest step skips those):
    when the tier's newest write is marked suspect, an older one the tier alone holds may be it."""
    durable = RootAnswer(DURABLE, f"newest step {newest} is durable on {root}")
    suspect = _suspect_marks(st)
    if not held or not suspect(held[-1]):
        return durable
    on_root = set(committed_writes(st))
    pick = next((w for w in sorted(set(held) | on_root, reverse=True) if not suspect(w)), None)
    if pick is None:
        return RootAnswer(DURABLE, f"{durable.why}; every step here is marked suspect")
    if pick not in held:  # a restart restores none of this tier's steps
        return RootAnswer(DURABLE, f"{durable.why}, and so is step {pick[1]}, the newest not marked suspect")
    ahead = f"newest step {newest} is on {root} but marked suspect, so a restart restores step {pick[1]}"
    others = frozenset(s for _, s, _ in on_root) - {pick[1]}
    if pick not in on_root:
        return RootAnswer(ONLY_HERE, f"{ahead}, which its root does not hold (nebula-ckpt persist-memory ROOT "
                                     "puts it there)", others)
    lacking = _lacking_on_root(st, pick[1])
    if lacking is not None:
        return RootAnswer(ONLY_HERE, f"{ahead}, which its root holds but cannot restore ({lacking})", others)
    return RootAnswer(DURABLE, f"{ahead}, durable there too")


def _suspect_marks(st: Storage) -> Callable[[Write], bool]:
    """``suspect(write)``: whether the root's health records mark that checkpoint suspect, read as
    a restore reads them (:class:`~nebula_ckpt.health.book.HealthView`: a record that cannot be
    listed or read is no mark, and a restore then restores as without it)."""
    view = HealthView(st)
    return lambda w: view.mark(w[0], w[1], None if w[2] < 0 else w[2]).state == SUSPECT


def _committed_but(st: Storage, step: int) -> frozenset[int]:
    """The root's committed steps but ``step`` (empty when they cannot be listed: they only refine
    the list of lost steps)."""
    try:
        return frozenset(committed_steps(st)) - {step}
    except Exception:  # noqa: BLE001 - only refines the list of lost steps
        return frozenset()


def _lacking_on_root(st: Storage, step: int) -> Optional[str]:
    """What keeps committed ``step`` on ``st`` from being restored without this memory tier, told
    as a restore tells it from the files' sizes (:func:`~nebula_ckpt.restore.intact.restore_problem`:
    its marker and manifest, its shards and those of the earlier steps it refers to, present at
    their recorded sizes); None when nothing is known to lack. Other errors propagate (the root
    cannot tell)."""
    return restore_problem(st, step, f"step {step}")  # the caller names the root


def ask_root(root: str, run_id: Optional[str], step: int, write: Optional[Write] = None,
             timeout: float = ROOT_TIMEOUT_S, storage_options: Optional[dict[str, Any]] = None,
             held: tuple[Write, ...] = ()) -> RootAnswer:
    """What ``root`` says about ``step`` of run ``run_id`` (its write ``write``, when given), a
    remote root reached with ``storage_options`` (None: the credentials of the environment):
    :data:`DURABLE` (committed there, that write or a newer one, and so is the write a restart
    restores, when it is one of ``held``, the memory tier's writes, ascending),
    :data:`ONLY_HERE` (known not to be there: the root lacks it, is gone, or belongs to another
    run) or :data:`UNKNOWN` (any error, or no answer within ``timeout`` seconds).

    The root is asked on a daemon thread, so a mount or a store that hangs costs the deadline,
    not the command.
    """
    box: list[RootAnswer] = []

    def run() -> None:
        try:
            box.append(_ask_root(root, run_id, step, write, storage_options, held))
        except Exception as e:  # noqa: BLE001 - any failure leaves the root unknown
            box.append(RootAnswer(UNKNOWN, f"cannot check its root {root} ({type(e).__name__}: {e})"))

    t = threading.Thread(target=run, name="nebula-gc-root", daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        return RootAnswer(UNKNOWN, f"cannot check its root {root}: no answer within {timeout:g} s "
                                   "(nebula-ckpt gc --root-timeout)")
    return box[0]


def _only_copy(f: Found, force: bool, why: str, lost: list[int]) -> Decision:
    """Keep a tier whose ``lost`` steps exist nowhere else; ``--force`` removes it, saying so."""
    steps = _steps_text(lost)
    if force:
        return Decision(f, True, f"{why}; --force: {steps}, only in memory, lost", force)
    return Decision(f, False, f"{why}; {steps} only in memory: kept (restart the job to resume from it, "
                              f"or --force to remove the tier and lose {'it' if len(lost) == 1 else 'them'})", force)


def decide(f: Found, force: bool = False, timeout: float = ROOT_TIMEOUT_S,
           storage_options: Optional[dict[str, Any]] = None) -> Decision:
    """Apply the module's policy to one memory tier (the root is asked, for at most ``timeout``
    seconds, with ``storage_options``: see :func:`ask_root`)."""
    if f.problem:
        return Decision(f, False, f"not safely ours, not touched: {f.problem}", force)
    if f.in_use:
        return Decision(f, False, "in use by a live process", force)
    try:
        steps = _committed(f.folder)
    except OSError as e:
        return Decision(f, False, f"cannot list its checkpoints ({e}); kept", force)
    if not steps:
        return Decision(f, True, "holds no committed checkpoint", force)
    if f.owner is None:
        return _only_copy(f, force, "no ROOT file: nobody's memory tier, never restored from", steps)
    held = tuple(committed_writes(LocalStorage(f.folder, private=True, fsync=False)))
    newest = held[-1] if held else None
    answer = ask_root(f.owner.root, f.owner.run_id, steps[-1] if newest is None else newest[1], newest, timeout,
                      storage_options, held)
    if answer.verdict == DURABLE:
        return Decision(f, True, answer.why, force)
    if answer.verdict == UNKNOWN:
        return Decision(f, False, f"{answer.why}: newest step {steps[-1]} may exist only in memory; kept, "
                                  "even with --force (remove the folder by hand once the root is known to "
                                  "be gone)", force)
    return _only_copy(f, force, answer.why, [s for s in steps if s not in answer.on_root])


def collect(shm_dir: Optional[str] = None, force: bool = False, root: Optional[str] = None,
            timeout: float = ROOT_TIMEOUT_S, storage_options: Optional[dict[str, Any]] = None) -> list[Decision]:
    """Decisions for every memory tier of this user, or (``root``) for the memory tiers of that run
    only (every rank's on this host), each root asked for at most ``timeout`` seconds; nothing is
    removed: :func:`remove` acts. ``storage_options`` (only with ``root``, a remote one) reach it."""
    if storage_options is not None and root is None:
        raise ValueError("gc: storage_options are those of one root: name it (nebula-ckpt gc ROOT "
                         "--storage-options JSON); without a root, each is reached with the environment's credentials")
    found = scan(shm_dir)
    if root is not None:
        mine = canonical_root(root)
        found = [f for f in found if f.owner is not None and f.owner.root == mine]
    return [decide(f, force, timeout, storage_options) for f in found]


def remove(d: Decision, timeout: float = ROOT_TIMEOUT_S, storage_options: Optional[dict[str, Any]] = None) -> Decision:
    """Remove the memory tier of ``d`` if that is still right: under the tier's lock, look at it
    again, decide again (with ``d``'s ``--force``, the root asked for at most ``timeout`` seconds,
    with ``storage_options`` as :func:`collect` was) and remove only if that decision says so.

    Returns:
        The decision made under the lock, its ``removed`` set; a tier a live process holds, or
        one that vanished meanwhile, is reported kept.
    """
    folder = d.found.folder
    try:
        before = look(folder)  # still safely ours before its LOCK file is opened
        if before.problem or before.in_use:
            return replace(decide(before, d.forced, timeout, storage_options), removed=False)
        fd = try_lock(folder)
    except FileNotFoundError:
        return replace(d, remove=False, reason="gone meanwhile (removed by another process)", removed=False)
    except OSError as e:
        return replace(d, remove=False, reason=f"cannot take its lock ({e}); kept", removed=False)
    if fd is None:
        return replace(d, remove=False, reason="taken by a live process meanwhile; kept", removed=False)
    try:
        now = decide(look(folder, locked=True), d.forced, timeout, storage_options)
        if not now.remove:
            log.info("nebula_ckpt: gc: %s kept after all: %s", folder, now.reason)
            return replace(now, removed=False)
        unlist_steps(folder)  # markers first: a kill in the middle leaves no step listed half deleted
        shutil.rmtree(folder, ignore_errors=True)
        return replace(now, removed=not os.path.lexists(folder))
    finally:
        os.close(fd)
