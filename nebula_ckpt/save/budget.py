"""The host-memory budget: the most host memory checkpointing holds in this process at once.

What counts (:meth:`~nebula_ckpt.save.buffers.StagingPool.used`): the staging buffers (anonymous,
pinned, the memory tier's slot files) and everything in the memory tier's folder (tmpfs is RAM):
its checkpoints, the bases its incremental steps refer to, the replicas it holds for partner
ranks, copies pulled back from partners. What does not: the state itself (the model and
optimizer, and what a restore creates for them: optimizer state copied or handed over from the
memory tier) and a restore's working memory beyond it, at most one chunk of mapped source pages
(``restore_chunk_bytes``) that it drops as it goes.

The budget (``Checkpointer(host_memory_budget=...)``) is:

* an ``int``: that many bytes;
* a ``float`` in (0, 1]: that share of this machine's memory (the container's memory limit, when
  a cgroup sets one lower), for this process;
* ``None`` (the default): *what is free*. Checkpointing may take memory only while the machine
  (or the container) keeps :data:`RESERVE_FRACTION` of its memory, at least
  :data:`RESERVE_MIN_BYTES`, available for training: a new staging buffer is made only when
  ``MemAvailable`` (or the cgroup's room) minus the buffer stays above that reserve. It follows
  what the job itself and the other ranks of the node take, at every save, so no number has to
  be guessed for a node shared by several ranks, and a job that fits without checkpoints is never
  pushed into the OOM killer by them.

A save that would exceed it first makes room where that loses nothing (idle buffers of other
sizes; the memory tier's steps that a persistent tier holds as the same write, and the replicas
it holds for partner ranks of writes a shared tier holds committed; or, with no save in flight,
its newest write once it is put there: :func:`~nebula_ckpt.save.drain.make_room`),
then waits or is skipped by ``on_full``, with a log line that names the budget. A save that
waits (``"wait"``) while nothing is in flight and nothing can be freed (:func:`note_held`: what
holds the memory) never would go ahead: it raises :class:`~nebula_ckpt.errors.ValidationError`
instead, naming the budget and what holds it (:meth:`HostMemoryBudget.held_error`). A partner rank's replica that
would exceed it (once such redundant replicas went) is refused before it is sent
(:meth:`~nebula_ckpt.save.buffers.StagingPool.room_for`; the partner's handle reports its replica
failed). A state that cannot fit even once
is refused at its first save, before anything is written (:meth:`HostMemoryBudget.check_fits`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Sequence, Union

from nebula_ckpt.arguments import check_budget
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.commit import Write, committed_steps, read_commit
from nebula_ckpt.restore.intact import restore_problem

log = logging.getLogger(__name__)

#: share of the machine's (or container's) memory the default budget leaves available for training
RESERVE_FRACTION = 0.10
#: ... and at least this much
RESERVE_MIN_BYTES = 1 << 30

Budget = Union[int, float, None]


def gib(n: float) -> str:
    """``n`` bytes as ``"1.50 GiB"`` (or MiB below one GiB)."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where it cannot be read)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_memory() -> Optional[tuple[int, int]]:
    """``(limit, available)`` of this process's memory cgroup when it sets a limit (v2, then v1);
    available = limit - usage + the inactive page cache it may reclaim. None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":  # cgroup v2
            base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            limit, usage = _read_int(os.path.join(base, "memory.max")), _read_int(os.path.join(base, "memory.current"))
            stat_file = os.path.join(base, "memory.stat")
        elif "memory" in controllers.split(","):  # cgroup v1
            base = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
            limit = _read_int(os.path.join(base, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(base, "memory.usage_in_bytes"))
            stat_file = os.path.join(base, "memory.stat")
        else:
            continue
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        inactive = 0
        try:
            with open(stat_file) as f:
                for s in f:
                    k, _, v = s.partition(" ")
                    if k in ("inactive_file", "total_inactive_file") and v.strip().isdigit():
                        inactive = int(v)
        except OSError:
            pass
        return limit, max(0, limit - usage + inactive)
    return None


def machine_memory() -> tuple[int, int]:
    """``(total, available)`` bytes of this machine's memory, or of the container's memory cgroup
    where it sets a lower limit (``MemTotal`` / ``MemAvailable`` of ``/proc/meminfo`` otherwise)."""
    info = _meminfo()
    total = info.get("MemTotal", 0)
    avail = info.get("MemAvailable", info.get("MemFree", 0))
    cg = _cgroup_memory()
    if cg is not None:
        total, avail = min(total, cg[0]) if total else cg[0], min(avail, cg[1]) if avail else cg[1]
    return total, avail


class HostMemoryBudget:
    """The resolved ``host_memory_budget`` of one Checkpointer (see the module docstring).

    Args:
        value: bytes (int), a share of the machine's memory (float in (0, 1]) or None (what is free).
    """

    def __init__(self, value: Budget) -> None:
        check_budget(value)
        self.value = value
        self._fixed: Optional[int] = None
        if isinstance(value, int):
            self._fixed = value
        elif isinstance(value, float):
            self._fixed = int(value * machine_memory()[0])

    def limit(self, used: int) -> int:
        """The most checkpointing may hold now, given that it holds ``used`` bytes: the fixed
        budget, or (the default) ``used`` + what is available beyond the reserve."""
        if self._fixed is not None:
            return self._fixed
        total, avail = machine_memory()
        if not total:
            return 1 << 62  # no /proc/meminfo (not Linux): nothing to go by
        reserve = max(int(RESERVE_FRACTION * total), RESERVE_MIN_BYTES)
        return used + max(0, avail - reserve)

    def describe(self, used: Optional[int] = None) -> str:
        """The budget in words, for log lines and errors."""
        if self._fixed is not None:
            shown = f"host_memory_budget {gib(self._fixed)}"
            return shown + (f" ({self.value:.0%} of this machine's memory)" if isinstance(self.value, float) else "")
        total, avail = machine_memory()
        reserve = max(int(RESERVE_FRACTION * total), RESERVE_MIN_BYTES)
        now = "" if used is None else f" (now {gib(self.limit(used))})"
        return (f"host_memory_budget None: what is free{now}: {gib(avail)} available of {gib(total)}, less a reserve "
                f"of {gib(reserve)} kept for training")

    def check_fits(self, nbytes: int, used: int, state: Optional[int] = None) -> None:
        """Refuse a save that needs ``nbytes`` and can never fit (before anything is written);
        ``state``: the state's size, when a save needs more than it (the memory tier alone
        keeps the newest step until the new one is in).

        Raises:
            ValidationError: naming the budget, the state's size and what to do.
        """
        limit = self.limit(used)
        if nbytes <= limit:
            return
        fix = ("Pass a larger host_memory_budget (bytes, or a share of the machine's memory such as 0.5)"
               if self._fixed is not None else
               "Free host memory, or pass host_memory_budget=<bytes> to take more than what is free (at the risk of "
               "the OOM killer)")
        why = f"this state needs {gib(nbytes)} of host memory to stage one save" if state is None else \
            (f"this state ({gib(state)}) needs {gib(nbytes)} of host memory: with the memory tier as the only tier "
             "written, a new step is staged beside the newest one, which it replaces only once it is in")
        extra = " (or add a persistent tier, which lets the memory tier give its step up)" if state is not None else ""
        raise ValidationError(
            f"{why}, but {self.describe(used)} allows {gib(limit)}"
            f"{f' (checkpointing holds {gib(used)} already)' if used else ''}; nothing was written. {fix}{extra}, "
            "or save less per process (shard the state over more ranks)")


    def say_short(self, need: int, held: dict[str, int], limit: int) -> str:
        """A shortage in words: ``need`` bytes more, ``held`` by kind (staging, memory tier), ``limit``."""
        used = sum(held.values())
        return (f"it needs {gib(need)} more host memory and checkpointing holds {gib(used)} (staging "
                f"{gib(held['staging'])}, memory tier {gib(held['memory_tier'])}) of {self.describe(used)} "
                f"(limit now {gib(limit)})")

    def held_error(self, what: str, short: str, held: Optional[str]) -> ValidationError:
        """The error of a save that waits for the budget (``what``) when nothing in flight can free
        memory and nothing more can be given up (``short``: what it needs and what is held;
        ``held``: why the memory tier keeps what it holds, when known)."""
        fix = "pass a larger host_memory_budget" if self._fixed is not None else \
            "free host memory, or pass host_memory_budget=<bytes>"
        return ValidationError(
            f"{what} cannot go ahead (on_full='wait'): {short}, and nothing in flight can free any of it"
            f"{f': {held}' if held else ''}. It was not written; {fix}, let a persistent tier take every save "
            "(every=1) and the memory tier keep one step (keep_last=1), or pass on_full='skip' to go on without "
            "such saves")

    def stuck(self, since: Optional[float], held: Optional[str], what: str, why: Callable[[], str]) -> Optional[float]:
        """Since when a save that waits for the budget (``what``) finds nothing in flight that could
        free memory and what holds the memory tier named (``held``, :func:`held_by`; None: something
        may free memory), or None. ``why``: the shortage in words.

        Raises:
            ValidationError: so for :data:`STUCK_S` (:meth:`held_error`): it would wait for ever.
        """
        if held is None:
            return None
        if since is None:
            return time.monotonic()
        if time.monotonic() - since < STUCK_S:
            return since
        e = self.held_error(what, why(), held)
        log.error("nebula_ckpt: %s", e)
        raise e


#: why nothing can be freed for a save short of the budget, by the slot folder of the memory tier
#: that holds it (``TierRuntime.staging_dir()``, the staging pool's ``slot_dir``): set by
#: :func:`~nebula_ckpt.save.drain.make_room` once no save is in flight, cleared while one is
_HELD: dict[str, str] = {}


#: how long a save that waits for the budget finds nothing in flight and nothing to give up before it
#: raises instead of waiting for ever (what the memory tier holds is re-examined meanwhile)
STUCK_S = 2.0


def note_held(slot_dir: Optional[str], why: Optional[str]) -> None:
    """Record why the memory tier of ``slot_dir`` can free nothing (None: a save in flight, or a
    step given up, may free memory: nothing is stuck)."""
    if slot_dir is None:
        return
    if why is None:
        _HELD.pop(slot_dir, None)
    else:
        _HELD[slot_dir] = why


def held_by(slot_dir: Optional[str]) -> Optional[str]:
    """What :func:`note_held` last recorded for ``slot_dir``: None unless nothing can be freed."""
    return None if slot_dir is None else _HELD.get(slot_dir)


def folder_ram_bytes(path: Optional[str]) -> int:
    """RAM the files under ``path`` (a tmpfs folder) take: the allocated blocks of each file once,
    however many names link it (a memory-tier shard is a link of a slot file). 0 without it."""
    if path is None:
        return 0
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def give_up_memory_steps(writers: Sequence[Any]) -> bool:
    """Make room in the budget where it loses nothing: delete the memory tier's committed steps
    that a persistent tier this process writes holds committed too, as the same write (writer
    generation, step and save number: :attr:`~nebula_ckpt.format.commit.Commit.write`; a step
    saved again that the persistent tier's cadence skipped is there only as its older write), while
    the memory tier's writer is idle (``TierWriter.remove``: marker first, a step a later one
    refers to once none does). The memory tier then holds nothing until the next save commits
    there; a crash meanwhile restores the same write from the persistent tier. The replicas the
    memory tier holds for partner ranks of writes a shared persistent tier holds committed go too
    (:func:`add_giver`). True if any step went."""
    persistent = [w for w in writers if w.tier.persistent]
    gone = False
    for w in writers:
        if w.tier.persistent or not persistent:
            continue
        giver = _GIVERS.get(str(getattr(w.runtime, "folder", "")))
        if giver is not None and giver():
            log.info("nebula_ckpt: memory tier %s gives up the replicas it held of steps a shared tier holds as the "
                     "same write, to stay within the host-memory budget", w.name)
            gone = True
        if w.in_flight():
            continue
        try:
            for step in committed_steps(w.storage):
                write = read_commit(w.storage, step, f"tier {w.name} step {step}").write
                if any(holds_write(p.storage, write) for p in persistent) and w.remove(step):
                    log.info("nebula_ckpt: memory tier %s gives step %d up to stay within the host-memory budget "
                             "(the same write of it is committed on a persistent tier too)", w.name, step)
                    gone = True
        except Exception as e:  # a failure here only keeps memory: the save waits or is skipped
            log.debug("nebula_ckpt: memory tier %s: steps not given up: %s", w.name, e)
    return gone


#: what else a memory tier gives up where that loses nothing, by its folder: the replicas it holds
#: for partner ranks whose write a shared tier holds committed (:func:`add_giver`)
_GIVERS: dict[str, Callable[[], bool]] = {}


def add_giver(folder: str, give_up: Callable[[], bool]) -> None:
    """Let :func:`give_up_memory_steps` call ``give_up()`` for the memory tier of ``folder`` (the
    replicas' :meth:`~nebula_ckpt.tiers.memory.replicas.Replicator.give_up`: True if it freed
    anything), until :func:`drop_giver`."""
    _GIVERS[folder] = give_up


def drop_giver(folder: str, give_up: Callable[[], bool]) -> None:
    """Undo :func:`add_giver` of ``give_up`` (another one added since for ``folder`` stays)."""
    if _GIVERS.get(folder) == give_up:
        del _GIVERS[folder]


def holds_write(storage: Any, write: Write) -> bool:
    """Whether ``storage`` holds ``write`` (generation, step, save) committed, and whole (:func:`restorable`):
    the first write of a step saved twice does not make the second safe, nor a copy a restore refuses."""
    try:
        return bool(read_commit(storage, write[1], f"step {write[1]}").write == write) and restorable(storage, write[1])
    except Exception:  # absent or unreadable: not held there
        return False


def restorable(storage: Any, step: int) -> bool:
    """Whether committed ``step`` on ``storage`` would restore, told from its files' sizes
    (:func:`~nebula_ckpt.restore.intact.restore_problem`): a marker alone does not show it (a
    partial upload, a lost object, a file cut short). Raises what the storage raises when it cannot tell."""
    return restore_problem(storage, step) is None
