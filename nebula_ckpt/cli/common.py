"""What the ``nebula-ckpt`` commands share: output, the tiers of a root (read only), checks of
one step, rank summaries, human sizes and progress bars.

Nothing here writes to a checkpoint root: the commands look, verify and export.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable, Iterable, NoReturn, Optional, Sequence, TypeVar

from nebula_ckpt.errors import CorruptCheckpointError, NebulaError, ValidationError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.commit import Commit, read_commit, references
from nebula_ckpt.format.names import COMMIT, shard_owner, step_dir
from nebula_ckpt.format.owner import Owner
from nebula_ckpt.ranks.fencing import read_run_id
from nebula_ckpt.restore.open import NotThisLayout, OpenCheckpoint, open_checkpoint, read_manifest
from nebula_ckpt.restore.unreadable import outage, refused_here
from nebula_ckpt.root import refuse_nested_root
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import canonical_root, local_path, refuse_url_credentials
from nebula_ckpt.tiers.base import Tier
from nebula_ckpt.tiers.factory import runtime_for
from nebula_ckpt.tiers.roots import default_tiers

#: seconds a command works before it draws a progress bar (only on a terminal, never with --json)
PROGRESS_DELAY_S = 2.0
#: how often ``ls`` / ``verify`` list the root again when every step they listed was removed while
#: they ran (a job saving with retention): the steps that replaced them are checked instead
RELIST_ROUNDS = 3
#: how often ``ls`` / ``verify`` check a step again whose check failed because a job saved it again
#: meanwhile (its commit marker replaced by the new write's, then the old write's files removed)
RECHECKS = 1
#: the exit code of a command that could not read what it had to (an outage: the store did not
#: answer, a timeout; or this process was refused a file): nothing was found damaged for it, and
#: no other step was read in its place (0 ok, 1 damage or nothing found, 2 usage)
EXIT_UNREADABLE = 3

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
#: one step of one tier, as a command lists them
Listed = tuple[Tier, Storage, int]

#: storages a command opened; :func:`close_opened` (called by ``main`` however a command ends) closes them
OPENED: list[Storage] = []


class StdoutClosed(Exception):
    """The reader of the output went away (``nebula-ckpt ls ROOT | head``): the command stops quietly."""


def out(text: str) -> None:
    """One line of a command's output (stdout).

    Raises:
        StdoutClosed: the reader of stdout went away (a closed pipe).
    """
    try:
        sys.stdout.write(text + "\n")
    except BrokenPipeError:
        raise StdoutClosed() from None


def flush_out() -> None:
    """Write out what :func:`out` buffered, so that a reader gone away is found here.

    Raises:
        StdoutClosed: the reader of stdout went away (a closed pipe).
    """
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed() from None


def note(text: str) -> None:
    """One line for the user beside the output (stderr): a warning, a step skipped."""
    sys.stderr.write(f"nebula-ckpt: {text}\n")


def close_opened() -> None:
    """Close every storage the command opened."""
    while OPENED:
        OPENED.pop().close()


class NotChecked(NebulaError):
    """What a command had to read could not be read: the store did not answer (an outage, a
    timeout) or this process was refused its files (file descriptors, memory, permissions). Never
    damage, and never a reason to read an older step instead: exit :data:`EXIT_UNREADABLE`."""


def raise_if_outage(e: BaseException, where: str) -> None:
    """Raise :class:`NotChecked` naming ``where`` when ``e`` is an outage
    (:func:`~nebula_ckpt.restore.unreadable.outage`) rather than damage; else return.

    Raises:
        NotChecked: ``e`` says ``where`` could not be read though it may be whole.
    """
    if not outage(e):
        return
    cause = refused_here(e, where) or f"{where}: {type(e).__name__}: {e}"
    raise NotChecked(f"{cause} (could not be read: not damaged as far as this command can tell, and no other "
                     "step is read in its place; run it again once the store answers)") from e


class UsageError(NebulaError):
    """A ROOT no command can take (a malformed URL): exit 2, as argparse's usage errors."""


def check_root_url(root: Optional[str]) -> None:
    """Refuse a ROOT URL with a password in it or a broken scheme (``s3:/bucket/run``), before the
    root is parsed, logged or shown (:func:`~nebula_ckpt.storage.urls.refuse_url_credentials`).

    Raises:
        UsageError: saying what to write instead.
    """
    try:
        refuse_url_credentials(root)
    except ValidationError as e:
        raise UsageError(str(e)) from None


def _file_in_the_way(root: str) -> None:
    """Refuse a local ROOT that is a file, or lies under one: no checkpoint is there (a checkpoint
    root is a folder), which is exit 1 (nothing found), said plainly rather than as the error of
    the first read below it (``[Errno 20] Not a directory: '.../_nebula/run.json'``).

    Raises:
        NebulaError: naming the file and what to give instead.
    """
    path = local_path(root)
    if path is None:
        return
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.exists(probe) or os.path.isdir(probe):
        return
    where = "is a file" if probe == os.path.abspath(path) else f"lies under {probe!r}, which is a file"
    raise NebulaError(f"ROOT {root!r} {where}, not a checkpoint root: give the folder the checkpoints were saved "
                     "to (the one holding the step-N folders), or a URL such as s3://bucket/prefix")


def root_tiers(root: str, storage_options: Optional[dict[str, Any]]) -> tuple[list[Tier], Storage]:
    """The tiers of ``root`` and the root tier's storage (opened, nothing read yet).

    Raises:
        UsageError: ROOT is a URL that names no store (a scheme fsspec does not know, no bucket
            or container).
        NebulaError: ROOT is a file, or lies under one (nothing can be found there).
    """
    _file_in_the_way(root)
    refuse_nested_root(root, writing=False)  # a step folder (or _nebula/): named with the real root
    tiers = default_tiers(root, storage_options)
    try:
        return tiers, tiers[-1].make_storage()
    except ValueError as e:  # the URL: an unknown scheme, no bucket (ImportError: a backend to install)
        raise UsageError(f"{e}; ROOT is a local folder or an fsspec URL such as s3://bucket/prefix") from None


def open_tiers(root: str, storage_options: Optional[dict[str, Any]]) -> list[tuple[Tier, Storage]]:
    """The tiers of ``root`` a restart would read (read only: nothing is claimed or written), the
    root's own last.

    Raises:
        UsageError / NebulaError: ROOT cannot be a checkpoint root (:func:`root_tiers`).
    """
    tiers, root_storage = root_tiers(root, storage_options)
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
    step is there by name and must not pass for an uncommitted leftover. A marker that the store
    does not answer for is neither (:func:`raise_if_outage`).

    Raises:
        NotChecked: the store did not answer, or this process was refused the marker.
    """
    try:
        st.size(f"{step_dir(step)}/{COMMIT}")
    except FileNotFoundError:
        return False, None
    except OSError as e:
        raise_if_outage(e, f"tier {tier.name} step {step}")
        return True, f"tier {tier.name} step {step}: {type(e).__name__}: {e}"
    return True, None


def listed_committed(st: Storage, tier: Tier, step: int) -> bool:
    """Whether a command lists ``step`` as committed (:func:`commit_state`): its marker is there, or
    cannot be checked now (an outage), which the step's own check then says, never as damage."""
    try:
        return commit_state(st, tier, step)[0]
    except NotChecked:
        return True


def removed_meanwhile(st: Storage, tier: Tier, step: int) -> bool:
    """Whether ``step``, committed when the command listed it, was removed since (retention,
    ``remove()``, ``gc``): its commit marker is gone now. Each of them deletes a step's marker
    before its files (a check that failed while the marker is still there: :func:`check_whole`)."""
    return commit_state(st, tier, step) == (False, None)


class SavedAgain(Exception):
    """A step that a job saved again each time it was checked (:func:`check_whole`): left out."""


def _marker(st: Storage, step: int) -> "Commit | str | None":
    """The commit marker of ``step`` as it is now: None when it is gone, why when it cannot be read."""
    try:
        return read_commit(st, step, f"step {step}")
    except FileNotFoundError:
        return None
    except Exception as e:  # unreadable: the same reason twice is the same marker (an outage: raised)
        raise_if_outage(e, f"step {step}")
        return f"{type(e).__name__}: {e}"


def check_whole(st: Storage, tier: Tier, step: int,
                verify: str) -> Optional[tuple[bool, str, Optional[mf.Manifest]]]:
    """:func:`check` of committed ``step``, or None when it was removed while it was checked
    (retention, ``remove()``, ``gc``: its commit marker is gone now).

    A check that fails while the marker it started from is still there found damage: each
    deletion takes a step's marker before its files, and a job saving the step again replaces
    the marker with its new write's before it removes the old write's files. A step whose marker
    changed under a failed check is checked again, its new write, :data:`RECHECKS` times.

    Raises:
        SavedAgain: the step was saved again while each of those checks ran.
    """
    for _ in range(1 + RECHECKS):
        first = _marker(st, step)
        result = check(st, tier, step, verify)
        if result[0]:
            return result
        now = _marker(st, step)
        if now is None:
            return None
        if now == first:
            return result
    raise SavedAgain(f"{tier.name} step {step}")


def each_step(listing: Callable[[], list[Listed]], check_one: Callable[[Tier, Storage, int], Optional[R]],
              command: str, desc: str, quiet: bool) -> list[R]:
    """``check_one`` of every step ``listing`` names, in order, under a progress bar ``desc``
    (:func:`progress`; none when ``quiet``). ``check_one`` returns None for a step removed while
    the command ran, and raises :class:`SavedAgain` for one saved again while each of its checks
    ran (:func:`check_whole`): it is left out and named on stderr, never reported as damage. When
    every step listed was left out so (a job saving with retention), the root is listed again and
    the steps that replaced them are checked, at most :data:`RELIST_ROUNDS` times in all."""
    results: list[R] = []
    seen: set[tuple[str, int]] = set()
    for _ in range(RELIST_ROUNDS):
        todo = [(t, st, s) for t, st, s in listing() if (t.name, s) not in seen]
        removed = False
        for tier, st, step in progress(todo, desc, "ckpt", quiet=quiet):
            seen.add((tier.name, step))
            try:
                result = check_one(tier, st, step)
            except SavedAgain:
                removed = True
                note(f"{tier.name} step {step} was saved again while {command} checked it, each time; left out "
                     f"(run {command} again to check it)")
                continue
            if result is None:
                removed = True
                note(f"{tier.name} step {step} was removed while {command} ran (retention, remove() or gc); "
                     "left out")
            else:
                results.append(result)
        if results or not removed:
            break
    return results


#: the option whose value may hold credentials (account keys): no command-line error shows it
SECRET_OPTION = "--storage-options"
#: what an error shows instead of that value
HIDDEN = "<value hidden: it may hold credentials>"


def secret_values(argv: Sequence[str]) -> list[str]:
    """The values ``argv`` gives ``--storage-options`` (``--storage-options JSON``,
    ``--storage-options=JSON``, or an abbreviation argparse would take, such as ``--storage``),
    longest first: what a command-line error must never show, whichever parser reports it."""
    found = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if len(name) < 3 or not SECRET_OPTION.startswith(name):
            continue
        if eq:
            found.append(value)
        elif i + 1 < len(argv):
            found.append(argv[i + 1])
    return sorted({v for v in found if v}, key=len, reverse=True)


def redact(message: str, secrets: Sequence[str]) -> str:
    """``message`` with every one of ``secrets`` (as given, or as ``repr`` shows it) replaced by
    :data:`HIDDEN`."""
    for value in secrets:
        for shown in (value, repr(value)[1:-1], json.dumps(value)[1:-1]):
            message = message.replace(shown, HIDDEN)
    return message


class CliParser(argparse.ArgumentParser):
    """The parser of ``nebula-ckpt`` and of each of its commands (``add_subparsers`` makes its
    parsers of the parent's class): an error (an unknown argument, an invalid value, an
    ambiguous abbreviation) never shows the value of ``--storage-options``, however it was given."""

    secrets: Sequence[str] = ()

    def parse_known_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                         namespace: Optional[argparse.Namespace] = None) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, remembering the values of ``--storage-options`` in ``args`` for :meth:`error`."""
        argv = list(sys.argv[1:] if args is None else args)
        self.secrets = secret_values(argv)
        return super().parse_known_args(argv, namespace)

    def error(self, message: str) -> NoReturn:
        """argparse's usage error (exit 2), without the values of ``--storage-options``."""
        super().error(redact(message, self.secrets))


def add_storage_options(sp: argparse.ArgumentParser) -> None:
    """``--storage-options JSON`` of a command that takes a ROOT (fsspec options for a remote root)."""
    sp.add_argument(SECRET_OPTION, type=storage_options_arg, default=None, metavar="JSON",
                    help="fsspec storage options for a remote root, as JSON (credentials, endpoint); never shown")


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
    """``(healthy, "ok" or the problem, manifest or None)`` of ``step`` on one tier.

    Raises:
        NotChecked: a file of it could not be read though it may be whole (an outage).
    """
    where = f"tier {tier.name} step {step}"
    try:
        ck = open_any(st, step, verify, where)
    except CorruptCheckpointError as e:
        return False, str(e), None
    except Exception as e:  # unreadable counts as damaged, with the reason; an outage does not
        raise_if_outage(e, where)
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
