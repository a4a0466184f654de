"""What things are called on disk: folders, files, markers, tags, and the format's versions.

A checkpoint of step N on a tier is the folder ``step-N/`` holding::

    shard-g<G>-r<R>.safetensors   tensor bytes (safetensors layout, openable by any tool)
    manifest.json                 format version, step, tensor index with checksums, typed tree
    COMMIT                        written last; names the manifest's size and CRC32C
    REMOVED                       (sometimes) remove() asked for the step while later ones refer to it

``G`` is the writer generation, ``R`` the rank. A save of a step that is committed already writes
its files under names of their own, ``shard-g<G>-r<R>-v<V>.safetensors`` and
``manifest-v<V>.json`` (``V``: 8 hex digits drawn for that write, :func:`new_variant`), and then
replaces ``COMMIT`` by one naming that manifest: the step switches from one whole write to the
other in one atomic write. Beside the steps, a persistent root holds
``_nebula/run.json`` (the run id) and ``_nebula/writers/g-<G>.json`` (one record per writer
generation, see :mod:`nebula_ckpt.ranks.fencing`). A memory-tier folder also holds ``ROOT`` (whose
checkpoints these are), ``LOCK`` (held by the process writing it) and ``.slots/`` (staging slot
files ``slot-<pid>-<random>``, see :mod:`nebula_ckpt.tiers.memory.shm`).

Every name a reader builds from a parsed number is the very name it listed: numbers are ASCII
digits without leading zeros (``\\d`` also matches other scripts' digits).
"""

from __future__ import annotations

import os
import re
import uuid
from typing import Any, Optional

from nebula_ckpt.errors import ValidationError
from nebula_ckpt.format.checks import MAX_BYTES, MAX_STEP, short

# -- the format ---------------------------------------------------------------------------------

FORMAT = "nebula_ckpt"
#: manifests of one process (world_size 1): :func:`nebula_ckpt.format.manifest.build_manifest`
SINGLE_VERSION = 1
#: multi-rank manifests holding every record of the ranks they hold: written for a rank's own
#: memory tier (:mod:`nebula_ckpt.format.multi_rank`); several ranks' are read, no longer written
VERSION = 2
#: multi-rank manifests that hold only what grows with the tensors: each rank's records file
#: checks itself (embedded CRC32C, save id, rank) and the per-rank table is ``ranks.json``
#: (:mod:`nebula_ckpt.format.rank_index`, built by :mod:`nebula_ckpt.format.split`); the newest version
SPLIT_VERSION = 4
#: the manifest versions this nebula_ckpt reads (version 3, a layout of its development before
#: 0.1.0, is refused with the fix: save the state again)
READ_VERSIONS = (SINGLE_VERSION, VERSION, SPLIT_VERSION)

# -- a step folder --------------------------------------------------------------------------------

MANIFEST = "manifest.json"
#: format version 4: the per-rank table (each rank's shard and records file), written by rank 0
RANKS_FILE = "ranks.json"
COMMIT = "COMMIT"
#: ``remove()``'s request for a step later steps still refer to (:mod:`nebula_ckpt.format.removal`)
REMOVED = "REMOVED"
_STEP_RE = re.compile(r"step-(0|[1-9][0-9]*)")
_SHARD_RE = re.compile(r"shard-g(0|[1-9][0-9]*)-r(0|[1-9][0-9]*)(?:-v[0-9a-f]{8})?\.safetensors")
_SHARD_PREFIX_RE = re.compile(r"shard-g([0-9]+)-r[0-9]+(?:-v[0-9a-f]{8})?\.safetensors")
_SHARD_OWNER_RE = re.compile(r"(?:shard-g([0-9]+)-r([0-9]+)(?:-v[0-9a-f]{8})?\.safetensors"
                             r"|records-g([0-9]+)-r([0-9]+)\.json)")
_MANIFEST_RE = re.compile(r"manifest(?:-v([0-9a-f]{8}))?\.json")
#: the variant part of a write's file names (see :func:`new_variant`)
_VARIANT_RE = re.compile(r"(?:shard-g[0-9]+-r[0-9]+|manifest)-v([0-9a-f]{8})\.(?:safetensors|json)")


def step_dir(step: int) -> str:
    """Folder name of ``step``."""
    return f"step-{step}"


def parse_step_dir(name: str) -> Optional[int]:
    """``"step-42"`` -> 42; anything else (``"step-042"``, ``"step-x"``) -> None."""
    m = _STEP_RE.fullmatch(name.rstrip("/"))
    return int(m.group(1)) if m else None


def shard_name(generation: int, rank: int = 0, variant: Optional[str] = None) -> str:
    """File name of a shard (``variant``: of a write that replaces a committed step, :func:`new_variant`)."""
    return f"shard-g{generation}-r{rank}{'' if variant is None else f'-v{variant}'}.safetensors"


def new_variant() -> str:
    """A new variant for the files of a write that replaces a committed step (8 hex digits): its
    files never collide with the committed write's, which stays whole until ``COMMIT`` names the new one."""
    return uuid.uuid4().hex[:8]


def manifest_name(variant: Optional[str] = None) -> str:
    """File name of a step's manifest: ``manifest.json``, or ``manifest-v<V>.json`` for a write of
    variant ``V`` (its ``COMMIT`` names it)."""
    return MANIFEST if variant is None else f"manifest-v{variant}.json"


def is_manifest_name(name: str) -> bool:
    """Whether ``name`` is exactly a manifest file name of this format (a plain name, no path)."""
    return _MANIFEST_RE.fullmatch(name) is not None


def name_variant(name: str) -> Optional[str]:
    """The variant of a shard or manifest file name (or of a partial file named like one), None
    for a plain one (or another file)."""
    m = _VARIANT_RE.match(name)
    return m.group(1) if m else None


def records_name(generation: int, rank: int) -> str:
    """File name of a rank's tensor records (beside its shard, format version 4)."""
    return f"records-g{generation}-r{rank}.json"


def drain_part_name(generation: int, rank: int) -> str:
    """File name of the part record a drain of the memory tiers leaves beside rank ``rank``'s
    shard until the step commits (:mod:`nebula_ckpt.format.drain`); named like that rank's records
    file, so sweeps know whose it is."""
    return f"{records_name(generation, rank)}.drain"


def shard_owner(name: str) -> Optional[tuple[int, int]]:
    """``(generation, rank)`` of the writer of a shard or records file (or of a partial file
    named like one)."""
    m = _SHARD_OWNER_RE.match(name)
    if not m:
        return None
    g, r = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
    return int(g), int(r)


def shard_generation(name: str) -> Optional[int]:
    """Writer generation encoded in a shard file name (or a name starting like one), or None.

    Prefix match on purpose: cleanup must also see the generation of a writer's partial files.
    Readers check names with :func:`is_shard_name`.
    """
    m = _SHARD_PREFIX_RE.match(name)
    return int(m.group(1)) if m else None


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is exactly a shard file name of this format (a plain name, no path)."""
    return _SHARD_RE.fullmatch(name) is not None


# -- a persistent root's records ------------------------------------------------------------------

#: folder of the writer generation records
WRITERS_DIR = "_nebula/writers"
#: the root's run record (its run id)
RUN_FILE = "_nebula/run.json"
#: the largest writer generation: what every reader of a ``generation`` field takes (the commit
#: marker's, the manifest's), so no writer takes a larger one
MAX_GENERATION = MAX_BYTES
_WRITER_RE = re.compile(r"g-(0|[1-9][0-9]{0,18})\.json")
#: named like a writer record, but no writer wrote it (leading zeros, or beyond MAX_GENERATION)
_WRITER_LIKE_RE = re.compile(r"g-[0-9]+\.json")


def writer_record(generation: int) -> str:
    """Path (in the root) of the record of writer generation ``generation``."""
    return f"{WRITERS_DIR}/g-{generation}.json"


def writer_generation(name: str) -> Optional[int]:
    """The generation a file name listed in :data:`WRITERS_DIR` records (``"g-7.json"`` -> 7), or
    None: another name, or one no writer writes (:func:`is_foreign_writer_record`)."""
    m = _WRITER_RE.fullmatch(name)
    g = int(m.group(1)) if m else None
    return g if g is not None and g <= MAX_GENERATION else None


def is_foreign_writer_record(name: str) -> bool:
    """Whether ``name`` looks like a writer record (``g-<digits>.json``) that no writer wrote: its
    number has leading zeros or is beyond :data:`MAX_GENERATION`. Such a name counts as no
    generation (a writer never takes one past the bound, and readers refuse it in markers)."""
    return _WRITER_LIKE_RE.fullmatch(name) is not None and writer_generation(name) is None


# -- a memory-tier folder -----------------------------------------------------------------------------

#: names the root and run whose checkpoints the folder holds
ROOT_FILE = "ROOT"
#: locked (``flock``) by the process that writes the folder
LOCK_FILE = "LOCK"
#: the folder of staging slot files (see :mod:`nebula_ckpt.save.buffers`)
SLOT_DIR = ".slots"
#: the largest pid a slot file name may carry (``pid_t`` is a signed 32-bit int)
MAX_PID = 2**31 - 1
_SLOT_RE = re.compile(r"slot-([1-9][0-9]{0,9})-[^-]*")


def slot_file_name() -> str:
    """A new slot file name: ``slot-<pid>-<random>`` (the pid tells sweeps whose it is)."""
    return f"slot-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def slot_owner(name: str) -> Optional[int]:
    """The pid a slot file name carries, or None for another name (a pid that is not ASCII digits
    without a leading zero, or beyond :data:`MAX_PID`, is no process's: the name is not ours)."""
    m = _SLOT_RE.fullmatch(name)
    pid = int(m.group(1)) if m else None
    return pid if pid is not None and pid <= MAX_PID else None


# -- tags ---------------------------------------------------------------------------------------------

#: longest tag (a file path used as a tag fits)
MAX_TAG_CHARS = 256
_TAG_RE = re.compile(r"[A-Za-z0-9_.~:@=+,/-]+")
_TAG_RULE = (f"1 to {MAX_TAG_CHARS} characters of A-Z a-z 0-9 and _ . ~ : @ = + , / - "
             "(no spaces, quotes or control characters)")


def tag_problem(tag: object) -> Optional[str]:
    """Why ``tag`` is not a valid checkpoint tag, or None when it is (see :func:`check_tag`)."""
    if type(tag) is not str:
        return f"must be a str, got {type(tag).__name__} {short(tag)}"
    if not tag or len(tag) > MAX_TAG_CHARS or not _TAG_RE.fullmatch(tag):
        return f"{short(tag)} is not {_TAG_RULE}"
    return None


def check_tag(tag: object) -> Optional[str]:
    """Validate a tag given to ``save_async`` / ``load`` / ``read`` / ``remove`` (None passes).

    A tag names a checkpoint the way a framework does (Lightning's path, DeepSpeed's ``tag``,
    Azure ML Nebula's tag): 1 to 256 characters of ``A-Z a-z 0-9`` and ``_ . ~ : @ = + , / -``
    (no spaces, quotes or control characters), so a file path or name is a valid tag.

    Raises:
        ValidationError: naming the field and the rule.
    """
    if tag is None:
        return None
    why = tag_problem(tag)
    if why is not None:
        raise ValidationError(f"tag {why}; e.g. 'epoch=3-step=1200.ckpt' or 'global_step1200' "
                              "(a path's characters are allowed)")
    assert isinstance(tag, str)
    return tag


def check_step(step: Any) -> int:
    """Validate a step number."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValidationError(f"step must be a non-negative int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValidationError(f"step must be a non-negative int, got {step}")
    if step > MAX_STEP:
        raise ValidationError(f"step must be a non-negative int of at most 2**63-1 (it names the checkpoint "
                              f"folder and must fit int64 readers), got one with {step.bit_length()} bits")
    return step
