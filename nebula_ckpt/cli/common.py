"""What the ``nebula-ckpt`` commands share: output, the tiers of a root (read only), checks of
one step, rank summaries, human sizes and progress bars.

Nothing here writes to a checkpoint root: the commands look, verify and export.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Iterable, Optional, Sequence, TypeVar

from nebula_ckpt.errors import CorruptCheckpointError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import references
from nebula_ckpt.format.names import COMMIT, shard_owner, step_dir
from nebula_ckpt.format.owner import Owner
from nebula_ckpt.ranks.fencing import read_run_id
from nebula_ckpt.restore.open import NotThisLayout, OpenCheckpoint, open_checkpoint, read_manifest
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import canonical_root
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.factory import runtime_for
from nebula_ckpt.tiers.roots import default_tiers

#: seconds a command works before it draws a progress bar (only on a terminal, never with --json)
PROGRESS_DELAY_S = 2.0

log = logging.getLogger(__name__)

T = TypeVar("T")

#: storages a command opened; :func:`close_opened` (called by ``main`` however a command ends) closes them
OPENED: list[Storage] = []


def out(text: str) -> None:
    """One line of a command's output (stdout)."""
    sys.stdout.write(text + "\n")


def note(text: str) -> None:
    """One line for the user beside the output (stderr): a warning, a step skipped."""
    sys.stderr.write(f"nebula-ckpt: {text}\n")


def close_opened() -> None:
    """Close every storage the command opened."""
    while OPENED:
        OPENED.pop().close()


def open_tiers(root: str, storage_options: Optional[dict[str, Any]]) -> list[tuple[Tier, Storage]]:
    """The tiers of ``root`` a restart would read (read only: nothing is claimed or written)."""
    tiers = default_tiers(root, storage_options)
    root_storage = tiers[-1].make_storage()
    owner = Owner(canonical_root(root), read_run_id(root_storage))
    found = []
    for t in tiers:
        rt = runtime_for(t, root_storage if t is tiers[-1] else t.make_storage())
        why = rt.unreadable(owner)
        if why:
            log.info("nebula_ckpt: tier %s not shown: %s", t.name, why)
            rt.release()
            continue
        found.append((t, rt.storage))
        OPENED.append(rt.storage)
    return found


def dir_bytes(st: Storage, step: int) -> int:
    """Bytes stored in the folder of ``step``; a file that cannot be sized (gone, a folder, a
    symlink the storage refuses to follow) counts nothing: the step's check reports why."""
    d = step_dir(step)
    total = 0
    for n in st.list(d):
        try:
            total += st.size(f"{d}/{n}")
        except OSError:
            pass
    return total


def commit_state(st: Storage, tier: Tier, step: int) -> tuple[bool, Optional[str]]:
    """``(committed, problem)`` of ``step``: whether its commit marker is there, and why the step
    cannot be trusted when that cannot be checked safely. A marker or a step folder that is a
    symlink (never followed), or one that cannot be read, counts as committed and damaged: the
    step is there by name and must not pass for an uncommitted leftover."""
    try:
        st.size(f"{step_dir(step)}/{COMMIT}")
    except FileNotFoundError:
        return False, None
    except OSError as e:
        return True, f"tier {tier.name} step {step}: {type(e).__name__}: {e}"
    return True, None


def storage_options_arg(text: str) -> dict[str, Any]:
    """argparse type of ``--storage-options``: a JSON object. Errors never echo the value."""
    try:
        value = json.loads(text)
    except Exception:  # ValueError, RecursionError: the text may hold account keys, never show it
        raise argparse.ArgumentTypeError("not valid JSON (value not shown: it may hold credentials)") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object such as {\"account_name\": ...} "
                                         "(value not shown: it may hold credentials)")
    return value


def open_any(st: Storage, step: int, verify: str, where: str) -> OpenCheckpoint:
    """Open (and verify) ``step`` whatever it holds: a one-process checkpoint, a whole multi-rank
    job, or the ranks of one that a rank's own memory tier holds (each rank's part is checked).
    An incremental step's referenced bytes are checked too; a damaged one is named with the
    step whose folder holds it."""
    try:
        return _verified(open_checkpoint(st, step, verify, where, defer_verify=True))
    except NotThisLayout:
        man = read_manifest(st, step, where)
        ck = None
        for r in man.ranks:
            ck = _verified(open_checkpoint(st, step, verify, where, rank=r, world=man.world_size, defer_verify=True))
        assert ck is not None  # Manifest.parse: a multi-rank manifest holds at least one rank
        return ck


def _verified(ck: OpenCheckpoint) -> OpenCheckpoint:
    """``ck`` with every checksum checked (damage in bytes another step's folder holds, an
    incremental checkpoint's references, is named with that step by the check itself)."""
    ck.verify_rest()
    return ck


def references_json(man: Optional[mf.Manifest]) -> dict[str, Any]:
    """What an incremental checkpoint takes from earlier steps: the steps it needs and their bytes."""
    if man is None:
        return {"base_steps": None, "referenced_bytes": None}
    return {"base_steps": sorted(references(man)),
            "referenced_bytes": sum(sh.stored_bytes for sh in man.shards if sh.step is not None)}


def references_text(man: Optional[mf.Manifest]) -> str:
    """``"refers to step 5 (480.0 MiB)"``; ``""`` for a full checkpoint."""
    refs = references_json(man)
    if not refs["base_steps"]:
        return ""
    steps = ",".join(map(str, refs["base_steps"]))
    plural = "s" if len(refs["base_steps"]) > 1 else ""
    return f"refers to step{plural} {steps} ({human_bytes(refs['referenced_bytes'])})"


def check(st: Storage, tier: Tier, step: int, verify: str) -> tuple[bool, str, Optional[mf.Manifest]]:
    """``(healthy, "ok" or the problem, manifest or None)`` of ``step`` on one tier."""
    where = f"tier {tier.name} step {step}"
    try:
        ck = open_any(st, step, verify, where)
    except CorruptCheckpointError as e:
        return False, str(e), None
    except Exception as e:  # unreadable counts as damaged, with the reason
        return False, f"{where}: {type(e).__name__}: {e}", None
    return True, "ok", ck.manifest


def ranks_json(man: Optional[mf.Manifest]) -> dict[str, Any]:
    """World size, ranks held and shards (with the rank that wrote each) of a manifest."""
    if man is None:
        return {"world_size": None, "ranks": None, "shards": None}
    return {"world_size": man.world_size, "ranks": list(man.ranks),
            "shards": [{"file": sh.file, "rank": (shard_owner(sh.file) or (0, 0))[1], "bytes": sh.bytes,
                        "step": sh.folder_step(man.step)} for sh in man.shards]}


def ranks_text(man: Optional[mf.Manifest]) -> str:
    """``"4-rank job, 4 shards"`` / ``"rank 1 of a 4-rank job"``; ``""`` for one process."""
    if man is None or not man.multi_rank:
        return ""
    if len(man.ranks) == man.world_size:
        return f"{man.world_size}-rank job, {len(man.shards)} shard(s)"
    return f"rank(s) {','.join(map(str, man.ranks[:8]))} of a {man.world_size}-rank job"


def human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1: ``"999 B"``, ``"1.5 KiB"``, ``"3.0 TiB"``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def progress(items: Sequence[T], desc: str, unit: str, quiet: bool) -> Iterable[T]:
    """``items``, with a progress bar on stderr only where one helps: on a terminal, not ``quiet``
    (``--json``), and once the work has taken :data:`PROGRESS_DELAY_S` (trivial work draws none)."""
    if quiet or not items or not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, file=sys.stderr, delay=PROGRESS_DELAY_S)
