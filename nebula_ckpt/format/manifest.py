"""The on-disk format: directory names, the manifest and the commit marker.

A checkpoint of step N on a tier is the folder ``step-N/`` holding::

    shard-g<G>-r<R>.safetensors   tensor bytes (safetensors layout, openable by any tool)
    manifest.json                 format version, step, tensor index with checksums, typed tree
    COMMIT                        written last; names the manifest's size and CRC32C

``G`` is the writer generation (see :mod:`nebula_ckpt.ranks.fencing`), ``R`` the rank. A folder
without ``COMMIT`` is not a checkpoint: readers ignore it and writers clean it up.

A checkpoint of a multi-rank job (format version 2, ``world_size`` > 1) holds the state of
several ranks: ``ranks`` lists them (all of them on a shared tier, where the coordinator
writes one manifest for every rank's shard; one on a rank's own memory tier). Tensor keys are
prefixed ``r<R>/``; a replicated tensor is stored once and the other ranks' keys are aliases of
it; ``tree`` is a list of the distinct state trees and ``rank_tree`` names each rank's (trees
use unprefixed keys). A DTensor's local shard carries a ``dtensor`` record: global shape, the
shard's offsets in it, placements and mesh shape.

Everything read from storage is input, never truth: a manifest whose checksum matches its
commit marker can still be wrong (a buggy or hostile writer produces a valid checksum just as
easily). :meth:`Manifest.parse` checks every field — types, dtypes, shapes against byte ranges,
ranges against their shard and each other, aliases, shard file names, the typed tree, the ranks'
records of each DTensor (alike on every rank and, with every rank held, covering the global
tensor exactly) — and raises :class:`CorruptCheckpointError` naming the file and the field.
Readers use only the typed records it returns.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from nebula_ckpt.errors import CorruptCheckpointError, ValidationError

if TYPE_CHECKING:
    from nebula_ckpt.storage.base import Storage

FORMAT = "nebula_ckpt"
VERSION = 2
#: manifests of one process (world_size 1) are still written as version 1: any reader reads them
SINGLE_VERSION = 1
MANIFEST = "manifest.json"
COMMIT = "COMMIT"
# ASCII digits only (``\d`` also matches other scripts' digits) and no leading zeros, so the
# name a reader builds from a parsed number is the very name it listed.
_STEP_RE = re.compile(r"step-(0|[1-9][0-9]*)")
_SHARD_RE = re.compile(r"shard-g(0|[1-9][0-9]*)-r(0|[1-9][0-9]*)\.safetensors")
_SHARD_PREFIX_RE = re.compile(r"shard-g([0-9]+)-r[0-9]+\.safetensors")
_SHARD_OWNER_RE = re.compile(r"shard-g([0-9]+)-r([0-9]+)\.safetensors")
_PLACEMENT_RE = re.compile(r"R|S\((0|[1-9][0-9]?)\)")
_DEVICE_RE = re.compile(r"(cpu|cuda)(:(0|[1-9][0-9]{0,3}))?")
#: Bounds that keep hostile numbers cheap: no file of ours is anywhere near 2**62 bytes.
MAX_BYTES = 1 << 62
MAX_NDIM = 64
#: zstd blocks hold at most 128 KiB and the smallest (RLE) block takes 4 bytes: no frame can
#: decompress to more than 32768x its stored size, so a frame table claiming more is a lie.
_ZSTD_MAX_RATIO = 32768

# -- the dtype table of the library ----------------------------------------------------------

#: Every torch dtype by name (``"bfloat16"`` -> ``torch.bfloat16``): ``dtype`` leaves of the tree.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
#: Dtypes a stored tensor may have: a byte size, not quantized (saving those is refused).
TENSOR_DTYPES: dict[str, torch.dtype] = {
    n: d for n, d in DTYPES.items() if n not in _QUANTIZED and getattr(d, "itemsize", 0) > 0}
#: torch dtype -> safetensors dtype code. Dtypes safetensors lacks are stored as ``"U8"`` bytes.
SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}


def dtype_name(d: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name the manifest stores)."""
    return str(d).removeprefix("torch.")


# -- names -----------------------------------------------------------------------------------

def step_dir(step: int) -> str:
    """Folder name of ``step``."""
    return f"step-{step}"


def parse_step_dir(name: str) -> Optional[int]:
    """``"step-42"`` -> 42; anything else (``"step-042"``, ``"step-x"``) -> None."""
    m = _STEP_RE.fullmatch(name.rstrip("/"))
    return int(m.group(1)) if m else None


def step_dirs(storage: "Storage") -> list[int]:
    """Steps that have a folder on ``storage`` (committed or not), ascending."""
    return sorted(s for s in (parse_step_dir(n) for n in storage.list("")) if s is not None)


def committed_steps(storage: "Storage") -> list[int]:
    """Steps with a commit marker on ``storage``, ascending (the one listing of checkpoints)."""
    return [s for s in step_dirs(storage) if storage.exists(f"{step_dir(s)}/{COMMIT}")]


def read_commit(storage: "Storage", step: int, where: str) -> "Commit":
    """The parsed commit marker of ``step`` on ``storage`` (the one reader of markers).

    Raises:
        FileNotFoundError / OSError: it cannot be read.
        CorruptCheckpointError: it is malformed (naming ``where``).
    """
    return Commit.parse(storage.read_small(f"{step_dir(step)}/{COMMIT}"), where)


def shard_name(generation: int, rank: int = 0) -> str:
    """File name of a shard."""
    return f"shard-g{generation}-r{rank}.safetensors"


def shard_owner(name: str) -> Optional[tuple[int, int]]:
    """``(generation, rank)`` of the writer of a shard file (or of a partial file named like one)."""
    m = _SHARD_OWNER_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


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


# -- tags ------------------------------------------------------------------------------------

#: longest tag (a file path used as a tag fits)
MAX_TAG_CHARS = 256
_TAG_RE = re.compile(r"[A-Za-z0-9_.~:@=+,/-]+")
_TAG_RULE = (f"1 to {MAX_TAG_CHARS} characters of A-Z a-z 0-9 and _ . ~ : @ = + , / - "
             "(no spaces, quotes or control characters)")


def tag_problem(tag: object) -> Optional[str]:
    """Why ``tag`` is not a valid checkpoint tag, or None when it is (see :func:`check_tag`)."""
    if type(tag) is not str:
        return f"must be a str, got {type(tag).__name__} {_short(tag)}"
    if not tag or len(tag) > MAX_TAG_CHARS or not _TAG_RE.fullmatch(tag):
        return f"{_short(tag)} is not {_TAG_RULE}"
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



# -- field checks ----------------------------------------------------------------------------

def _bad(where: str, what: str, fix: str = "") -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}" + (f"; {fix}" if fix else ""))


def _int(v: Any, where: str, name: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    """``v`` as an int in ``[lo, hi]`` (bools and floats refused)."""
    if type(v) is not int:
        raise _bad(where, f"{name} must be an integer, got {type(v).__name__} {_short(v)}")
    if not lo <= v <= hi:
        raise _bad(where, f"{name} = {_short(v)} is out of range [{lo}, {hi}]")
    return v


def _str(v: Any, where: str, name: str) -> str:
    if type(v) is not str:
        raise _bad(where, f"{name} must be a string, got {type(v).__name__} {_short(v)}")
    return v


def _obj(v: Any, where: str, name: str) -> dict[str, Any]:
    if type(v) is not dict:
        raise _bad(where, f"{name} must be a JSON object, got {type(v).__name__}")
    return v


def _list(v: Any, where: str, name: str) -> list[Any]:
    if type(v) is not list:
        raise _bad(where, f"{name} must be a JSON list, got {type(v).__name__}")
    return v


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"<{v.bit_length()}-bit int>"
    return text if len(text) <= 60 else text[:57] + "..."


def _only(d: dict[str, Any], allowed: tuple[str, ...], where: str, what: str) -> None:
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise _bad(where, f"{what} has unknown field(s) {extra[:5]} (allowed: {list(allowed)})",
                   "a newer format needs a newer manifest version")


# -- the commit marker -----------------------------------------------------------------------

@dataclass(frozen=True)
class Commit:
    """Content of the ``COMMIT`` marker."""

    step: int
    generation: int
    manifest_bytes: int
    manifest_crc32c: int

    def to_bytes(self) -> bytes:
        """Serialise."""
        return json.dumps({"format": FORMAT, "version": VERSION, "step": self.step,
                           "generation": self.generation, "manifest_bytes": self.manifest_bytes,
                           "manifest_crc32c": self.manifest_crc32c, "time": time.time()}).encode()

    @staticmethod
    def parse(data: bytes, where: str) -> "Commit":
        """Parse; raise :class:`CorruptCheckpointError` naming ``where`` and the bad field."""
        try:
            d = json.loads(data)
        except Exception as e:  # RecursionError and UnicodeDecodeError included
            raise _bad(where, f"commit marker is unreadable ({type(e).__name__}: {e})") from None
        w = f"{where}: {COMMIT}"
        try:
            d = _obj(d, w, "the commit marker")
            return Commit(_int(d.get("step"), w, "step"), _int(d.get("generation"), w, "generation"),
                          _int(d.get("manifest_bytes"), w, "manifest_bytes"),
                          _int(d.get("manifest_crc32c"), w, "manifest_crc32c", hi=2**32 - 1))
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"commit marker is unreadable: {e}") from None


# -- manifest records ------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardRecord:
    """One shard file of a checkpoint: its validated plain name, raw size and storage info."""

    file: str
    bytes: int
    storage: Optional[Mapping[str, Any]] = None

    @property
    def stored_bytes(self) -> int:
        """Bytes the file takes in storage (differs from ``bytes`` when compressed)."""
        return int((self.storage or {}).get("stored_bytes", self.bytes))

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object for this shard."""
        out: dict[str, Any] = {"file": self.file, "bytes": self.bytes}
        if self.storage is not None:
            out["storage"] = json.loads(json.dumps(dict(self.storage)))
        return out

    @staticmethod
    def parse(d: Any, where: str) -> "ShardRecord":
        """Validate one entry of ``shards``; raise :class:`CorruptCheckpointError` naming the field."""
        d = _obj(d, where, "the shard entry")
        _only(d, ("file", "bytes", "storage"), where, "the shard entry")
        name = _str(d.get("file"), where, "file")
        if not is_shard_name(name):
            raise _bad(where, f"file {_short(name)} is not a shard name of this format "
                       "(shard-g<G>-r<R>.safetensors, a plain name inside the step folder)")
        n = _int(d.get("bytes"), where, "bytes")
        if n < 8:
            raise _bad(where, f"bytes = {n}: a shard holds at least its 8-byte header length")
        info = d.get("storage")
        if info is not None:
            info = types.MappingProxyType(_storage_info(info, n, f"{where}.storage"))
        return ShardRecord(name, n, info)


def _storage_info(info: Any, raw: int, where: str) -> dict[str, Any]:
    """Check the backend's storage info (other keys belong to the backend and pass through)."""
    info = dict(_obj(info, where, "storage"))
    stored = _int(info.get("stored_bytes", raw), where, "stored_bytes")
    comp = info.get("compression")
    if comp is None:
        if "frames" in info:
            raise _bad(where, "frames given without compression")
        if stored != raw:
            raise _bad(where, f"stored_bytes = {stored} but the shard has {raw} bytes uncompressed")
        return info
    if comp != "zstd":
        raise _bad(where, f"compression {_short(comp)} is unknown (this nebula_ckpt reads 'zstd')")
    frames = _list(info.get("frames"), where, "frames")
    total_raw = total_stored = 0
    for i, fr in enumerate(frames):
        fw = f"{where}.frames[{i}]"
        if type(fr) is not list or len(fr) != 2:
            raise _bad(fw, "a frame must be [raw_bytes, stored_bytes]")
        r, s = _int(fr[0], fw, "raw_bytes"), _int(fr[1], fw, "stored_bytes")
        if r > s * _ZSTD_MAX_RATIO:
            raise _bad(fw, f"{r} raw bytes cannot come from {s} zstd bytes")
        total_raw, total_stored = total_raw + r, total_stored + s
    if total_raw != raw or total_stored != stored:
        raise _bad(where, f"frame table sums to {total_raw} raw / {total_stored} stored bytes; the "
                   f"shard has {raw} raw / {stored} stored bytes")
    return info


@dataclass(frozen=True)
class DTensorInfo:
    """Where a DTensor's local shard lies in the global tensor (``dtensor`` of a tensor record)."""

    shape: tuple[int, ...]           # global shape
    offsets: tuple[int, ...]         # offsets of this shard in the global tensor
    placements: tuple[str, ...]      # "R" (replicate) or "S(d)" (shard on dim d), one per mesh dim
    mesh: tuple[int, ...]            # mesh shape

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object."""
        return {"shape": list(self.shape), "offsets": list(self.offsets),
                "placements": list(self.placements), "mesh": list(self.mesh)}

    @staticmethod
    def parse(d: Any, local: tuple[int, ...], where: str) -> "DTensorInfo":
        """Validate against the local shard's shape ``local``."""
        d = _obj(d, where, "dtensor")
        _only(d, ("shape", "offsets", "placements", "mesh"), where, "dtensor")
        shape = tuple(_int(x, where, "dtensor.shape[]") for x in _list(d.get("shape"), where, "dtensor.shape"))
        offs = tuple(_int(x, where, "dtensor.offsets[]") for x in _list(d.get("offsets"), where, "dtensor.offsets"))
        if len(shape) != len(local) or len(offs) != len(local):
            raise _bad(where, f"dtensor shape {list(shape)} / offsets {list(offs)} do not match the local "
                       f"shard's {len(local)} dimensions")
        for i, (g, o, n) in enumerate(zip(shape, offs, local, strict=True)):
            if o + n > g:
                raise _bad(where, f"dtensor dimension {i}: the shard [{o}, {o + n}) lies outside the global size {g}")
        pl = tuple(_str(x, where, "dtensor.placements[]") for x in _list(d.get("placements"), where,
                                                                             "dtensor.placements"))
        mesh = tuple(_int(x, where, "dtensor.mesh[]", lo=1, hi=2**31) for x in _list(d.get("mesh"), where,
                                                                                     "dtensor.mesh"))
        if len(pl) != len(mesh) or not mesh or len(mesh) > MAX_NDIM:
            raise _bad(where, f"dtensor has {len(pl)} placements for a mesh of shape {list(mesh)}")
        for p in pl:
            if not _PLACEMENT_RE.fullmatch(p) or (p != "R" and int(p[2:-1]) >= len(local)):
                raise _bad(where, f"dtensor placement {_short(p)} is not 'R' or 'S(<dim>)' of this tensor")
        if all(p == "R" for p in pl) and (offs != (0,) * len(local) or shape != local):
            raise _bad(where, f"dtensor is replicated (placements {list(pl)}), but its shard {list(local)} at "
                       f"{list(offs)} is not the whole global tensor {list(shape)}")
        return DTensorInfo(shape, offs, pl, mesh)


@dataclass(frozen=True)
class TensorRecord:
    """One stored tensor: dtype, shape and where its bytes lie (``[start, end)`` of shard ``shard``)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    crc32c: int
    device: str = "cpu"
    shard: int = 0
    dtensor: Optional[DTensorInfo] = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return TENSOR_DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object for this tensor (``shard`` only when not 0)."""
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape),
                               "offsets": [self.start, self.end], "crc32c": self.crc32c,
                               "device": self.device}
        if self.shard:
            out["shard"] = self.shard
        if self.dtensor is not None:
            out["dtensor"] = self.dtensor.to_json()
        return out

    @staticmethod
    def parse(key: str, d: Any, shards: tuple[ShardRecord, ...], where: str) -> "TensorRecord":
        """Validate one tensor entry against its shard; raise naming the key and the field."""
        d = _obj(d, where, "the tensor entry")
        _only(d, ("dtype", "shape", "offsets", "crc32c", "device", "shard", "dtensor"), where, "the tensor entry")
        if not shards:
            raise _bad(where, "refers to a shard, but the manifest lists none")
        si = _int(d.get("shard", 0), where, "shard", hi=len(shards) - 1)
        dtype = _str(d.get("dtype"), where, "dtype")
        if dtype not in TENSOR_DTYPES:
            raise _bad(where, f"dtype {_short(dtype)} is not a storable torch dtype")
        shape = _list(d.get("shape"), where, "shape")
        if len(shape) > MAX_NDIM:
            raise _bad(where, f"shape has {len(shape)} dimensions (at most {MAX_NDIM})")
        dims = tuple(_int(x, where, f"shape[{i}]") for i, x in enumerate(shape))
        offs = _list(d.get("offsets"), where, "offsets")
        if len(offs) != 2:
            raise _bad(where, "offsets must be [start, end]")
        size = shards[si].bytes
        start, end = _int(offs[0], where, "offsets[0]", hi=size), _int(offs[1], where, "offsets[1]", hi=size)
        want = math.prod(dims) * TENSOR_DTYPES[dtype].itemsize
        if end - start != want:
            raise _bad(where, f"offsets [{start}, {end}) hold {end - start} bytes, but {dtype} "
                       f"{_short(list(dims))} needs {want} (shard {shards[si].file} has {size} bytes)")
        if want and start % TENSOR_DTYPES[dtype].itemsize:
            raise _bad(where, f"offset {start} is not aligned to the {dtype} element size")
        device = _str(d.get("device", "cpu"), where, "device")
        if not _DEVICE_RE.fullmatch(device):
            raise _bad(where, f"device {_short(device)} is not 'cpu', 'cuda' or 'cuda:<n>'")
        crc = _int(d.get("crc32c"), where, "crc32c", hi=2**32 - 1)
        dt = None if d.get("dtensor") is None else DTensorInfo.parse(d["dtensor"], dims, where)
        return TensorRecord(key, dtype, dims, start, end, crc, device, si, dt)


_REQUIRED = ("format", "version", "step", "generation", "shards", "tensors", "tree")
_KNOWN = _REQUIRED + ("time", "checksum", "aliases", "stats", "world_size", "ranks", "rank_tree", "tag")
#: most ranks a manifest may name (bounds the work a hostile manifest can ask for)
MAX_WORLD = 1 << 20


@dataclass(frozen=True)
class Manifest:
    """A validated ``manifest.json``: every reader works from this, never from the raw JSON.

    ``tensors`` keeps the stored order; ``tree`` is the typed-JSON structure, already checked
    by :func:`nebula_ckpt.format.tree.check_tree` (so decoding it cannot meet a malformed node).
    ``extra`` holds top-level fields this version does not know; they are written back as is.
    ``tag``: the name given to ``save_async(..., tag=...)``, or None (an optional field: manifests
    without it, all those written before tags existed included, read as untagged).
    A multi-rank manifest (``world_size`` > 1) holds the ranks ``ranks``; use :meth:`rank_tree_of`
    and :meth:`resolve` with a rank (see the module docstring).
    """

    step: int
    generation: int
    shards: tuple[ShardRecord, ...]
    tensors: Mapping[str, TensorRecord]
    aliases: Mapping[str, str]
    tree: Mapping[str, Any]
    version: int = SINGLE_VERSION
    time: float = 0.0
    checksum: str = "crc32c"
    stats: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    world_size: int = 1
    ranks: tuple[int, ...] = (0,)
    rank_tree: Mapping[int, int] = field(default_factory=dict)
    tag: Optional[str] = None

    @property
    def multi_rank(self) -> bool:
        """Whether this is the checkpoint of a multi-rank job (keys prefixed by rank)."""
        return self.world_size > 1

    def prefix(self, rank: int) -> str:
        """Key prefix of ``rank``'s tensors (``""`` in a one-process checkpoint)."""
        return f"r{rank}/" if self.multi_rank else ""

    def rank_tree_of(self, rank: int) -> Mapping[str, Any]:
        """The state tree ``rank`` saved (its tensor keys without the rank prefix)."""
        if not self.multi_rank:
            return self.tree
        if rank not in self.rank_tree:
            raise KeyError(f"rank {rank} is not in this checkpoint (it holds ranks {list(self.ranks)[:8]})")
        return self.tree["v"][self.rank_tree[rank]]

    def resolve(self, key: str, rank: Optional[int] = None) -> TensorRecord:
        """The record of ``key`` (of ``rank``, for a multi-rank manifest) or of the key it is tied
        to; ``KeyError`` if neither exists."""
        if rank is not None and self.multi_rank:
            key = f"r{rank}/{key}"
        return self.tensors[self.aliases.get(key, key)]

    def to_json(self) -> dict[str, Any]:
        """The manifest as the writer's JSON dict (see :func:`build_manifest`)."""
        out = {"format": FORMAT, "version": self.version, "step": self.step, "generation": self.generation,
               "time": self.time, "checksum": self.checksum, "shards": [s.to_json() for s in self.shards],
               "tensors": {k: t.to_json() for k, t in self.tensors.items()}, "aliases": dict(self.aliases),
               "tree": self.tree, "stats": dict(self.stats)}
        if self.multi_rank:
            out.update(world_size=self.world_size, ranks=list(self.ranks),
                       rank_tree={str(r): i for r, i in self.rank_tree.items()})
        if self.tag is not None:
            out["tag"] = self.tag
        out.update(self.extra)
        return out

    def check_data_start(self, shard: int, data_start: int, where: str) -> None:
        """Refuse tensor ranges of shard ``shard`` that reach into its safetensors header.

        ``data_start`` is 8 + the header length read from the shard's first 8 bytes.
        """
        sh = self.shards[shard]
        if not 8 <= data_start <= sh.bytes:
            raise _bad(where, f"shard {sh.file}: its header claims {data_start - 8} bytes, the "
                       f"file has {sh.bytes}: not a safetensors file written by nebula_ckpt")
        for t in self.tensors.values():
            if t.shard == shard and t.nbytes and t.start < data_start:
                raise _bad(where, f"{MANIFEST}: tensors[{t.key!r}].offsets start at {t.start}, inside "
                           f"the header of {sh.file} (tensor data starts at {data_start})")

    @staticmethod
    def parse(data: Any, where: str, step: Optional[int] = None) -> "Manifest":
        """Parse and validate a manifest (bytes, str or an already loaded dict).

        Args:
            data: the content of ``manifest.json``.
            where: names the checkpoint in errors (e.g. ``"tier local:/ckpt step 12"``).
            step: the step the manifest must belong to (its folder's), or None.

        Raises:
            CorruptCheckpointError: naming ``where``, the file and the field for any malformation.
        """
        if isinstance(data, (bytes, bytearray, memoryview, str)):
            try:
                data = json.loads(bytes(data) if not isinstance(data, str) else data)
            except Exception as e:  # RecursionError (deep nesting), UnicodeDecodeError, ...
                raise _bad(where, f"{MANIFEST} is not valid JSON ({type(e).__name__}: {e})") from None
        w = f"{where}: {MANIFEST}"
        m = _obj(data, w, "the manifest")
        if m.get("format") != FORMAT:
            raise _bad(w, f"format is {_short(m.get('format'))}, not {FORMAT!r}: not a nebula_ckpt manifest")
        version = _int(m.get("version"), w, "version", lo=1, hi=2**31)
        if version > VERSION:
            raise _bad(w, f"version {version} is newer than this nebula_ckpt understands ({VERSION})",
                       "upgrade nebula_ckpt")
        missing = [k for k in _REQUIRED if k not in m]
        if missing:
            raise _bad(w, f"lacks field(s) {missing}")
        got = _int(m["step"], w, "step")
        if step is not None and got != step:
            raise _bad(w, f"step is {got}, but the manifest lies in {step_dir(step)}/ (moved or replaced)")
        return _parse_body(m, w, got, version)


def _parse_body(m: dict[str, Any], w: str, step: int, version: int) -> Manifest:
    shards = tuple(ShardRecord.parse(s, f"{w}: shards[{i}]") for i, s in enumerate(_list(m["shards"], w, "shards")))
    names = [s.file for s in shards]
    if len(set(names)) != len(names):
        raise _bad(w, f"shards lists a file twice ({names})")
    tensors = {_str(k, w, "tensor key"): TensorRecord.parse(k, v, shards, f"{w}: tensors[{_short(k)}]")
               for k, v in _obj(m["tensors"], w, "tensors").items()}
    _check_overlaps(tensors, shards, w)
    aliases = _aliases(m.get("aliases", {}), tensors, w)
    world, ranks, rank_tree = _ranks(m, w, version)
    _check_trees(m["tree"], tensors, aliases, world, rank_tree, w)
    _check_dtensors(tensors, aliases, shards, world, len(ranks) == world, w)
    t = m.get("time", 0.0)
    if type(t) not in (int, float):
        raise _bad(w, f"time must be a number, got {type(t).__name__}")
    if m.get("checksum", "crc32c") != "crc32c":
        raise _bad(w, f"checksum {_short(m.get('checksum'))} is unknown (this nebula_ckpt uses 'crc32c')")
    tag = m.get("tag")
    if "tag" in m and tag_problem(tag) is not None:  # optional, but when present a valid tag
        raise _bad(w, f"tag {tag_problem(tag)}")
    return Manifest(step=step, generation=_int(m["generation"], w, "generation"), shards=shards,
                    tensors=types.MappingProxyType(tensors), aliases=types.MappingProxyType(aliases),
                    tree=m["tree"], version=version, time=float(t),
                    stats=types.MappingProxyType(_obj(m.get("stats", {}), w, "stats")),
                    extra=types.MappingProxyType({k: v for k, v in m.items() if k not in _KNOWN}),
                    world_size=world, ranks=ranks, rank_tree=types.MappingProxyType(rank_tree), tag=tag)


def _ranks(m: dict[str, Any], w: str, version: int) -> tuple[int, tuple[int, ...], dict[int, int]]:
    """``world_size``, the ranks held and rank -> tree index (one-process manifests: 1, (0,), {})."""
    world = _int(m.get("world_size", 1), w, "world_size", lo=1, hi=MAX_WORLD)
    if world == 1:
        if "ranks" in m or "rank_tree" in m:
            raise _bad(w, "ranks / rank_tree given for a one-process checkpoint (world_size 1)")
        return 1, (0,), {}
    if version < 2:
        raise _bad(w, f"world_size {world} needs format version 2, the manifest says {version}")
    ranks = tuple(_int(r, w, "ranks[]", hi=world - 1) for r in _list(m.get("ranks"), w, "ranks"))
    if not ranks or len(set(ranks)) != len(ranks):
        raise _bad(w, f"ranks must list distinct ranks of the job, got {_short(list(ranks))}")
    tree = _obj(m["tree"], w, "tree")
    if tree.get("t") != "list" or type(tree.get("v")) is not list or not tree["v"]:
        raise _bad(w, "tree of a multi-rank checkpoint must be a list node of the ranks' state trees")
    raw = _obj(m.get("rank_tree"), w, "rank_tree")
    rank_tree: dict[int, int] = {}
    for r in ranks:
        rank_tree[r] = _int(raw.get(str(r)), w, f"rank_tree[{r}]", hi=len(tree["v"]) - 1)
    if len(raw) != len(ranks):
        raise _bad(w, f"rank_tree names {len(raw)} ranks, ranks lists {len(ranks)}")
    return world, ranks, rank_tree


def _check_trees(tree: Any, tensors: dict[str, TensorRecord], aliases: dict[str, str], world: int,
                 rank_tree: dict[int, int], w: str) -> None:
    """Check the tree(s): each rank's tree against the keys that rank has, and their dtypes."""
    from nebula_ckpt.format.tree import check_tree  # structure imports the dtype table from here

    dtypes = {k: tensors[aliases.get(k, k)].dtype for k in itertools.chain(tensors, aliases)}
    if world == 1:
        check_tree(tree, dtypes, f"{w}: tree")
        return
    own: dict[int, dict[str, str]] = {}
    for k, dtype in dtypes.items():
        head, sep, rest = k.partition("/")
        r = int(head[1:]) if sep and head[:1] == "r" and head[1:].isdigit() and len(head) < 12 else None
        if r is None or r not in rank_tree or head != f"r{r}":
            raise _bad(w, f"tensor key {_short(k)} does not start with the prefix of a rank it holds (r<R>/)")
        own.setdefault(r, {})[rest] = dtype
    users: dict[int, list[int]] = {}
    for r, i in rank_tree.items():
        users.setdefault(i, []).append(r)
    for i, node in enumerate(tree["v"]):
        if i not in users:
            raise _bad(w, f"tree[{i}] is the tree of no rank")
        held = [own.get(r, {}) for r in users[i]]
        # a key every rank of this tree holds; its dtype, or None where the ranks' dtypes differ
        shared = {k: (dt if all(h[k] == dt for h in held) else None)
                  for k, dt in held[0].items() if all(k in h for h in held)}
        check_tree(node, shared, f"{w}: tree[{i}] (rank {users[i][0]})")


# -- DTensor records across ranks ---------------------------------------------------------------

#: Work the exact coverage check of one tensor may do, per chunk: 2**6 (six dimensions split in a
#: layout nothing cancels); the grids DTensor writes take a few steps per chunk whatever their size.
_TILING_WORK_PER_CHUNK = 64

Chunks = list[tuple[tuple[int, ...], TensorRecord]]


def logical_groups(tensors: Mapping[str, TensorRecord], aliases: Mapping[str, str],
                   multi_rank: bool) -> dict[str, list[tuple[int, str, TensorRecord]]]:
    """Logical key (no ``r<R>/`` prefix) -> ``(rank, manifest key, stored record)`` of every rank
    holding it, lowest rank first (aliases resolved). A one-process manifest gives each key once, as
    rank 0. Keys must have passed :func:`_check_trees` (every key starts with a held rank's prefix)."""
    groups: dict[str, list[tuple[int, str, TensorRecord]]] = {}
    for full in itertools.chain(tensors, aliases):
        rec = tensors[aliases.get(full, full)]
        if multi_rank:
            head, _, key = full.partition("/")
            rank = int(head[1:])
        else:
            rank, key = 0, full
        groups.setdefault(key, []).append((rank, full, rec))
    for holders in groups.values():
        holders.sort(key=lambda x: x[0])
    return groups


def dtensor_chunks(key: str, holders: list[tuple[int, TensorRecord]], shards: tuple[ShardRecord, ...],
                   where: str) -> tuple[tuple[int, ...], Chunks]:
    """Global shape and the distinct non-empty chunks ``[(offsets, record)]`` (sorted by offsets) of
    logical tensor ``key``, of which ``holders`` are ``(rank, record)``, lowest rank first, the first
    a DTensor record. Replicas (same offsets and shape on several ranks) count once: the lowest rank's.

    Raises:
        CorruptCheckpointError: the ranks' records disagree: a plain tensor on one rank, a DTensor
            on another; other global shapes or dtypes; two chunks at the same offsets of other shapes.
    """
    first_rank, first = holders[0]
    assert first.dtensor is not None
    shape = first.dtensor.shape
    by_offsets: dict[tuple[int, ...], TensorRecord] = {}
    for rank, rec in holders:
        info = rec.dtensor
        if info is None or info.shape != shape or rec.dtype != first.dtype:
            what = "a plain tensor" if info is None else f"{rec.dtype} of global shape {list(info.shape)}"
            raise _bad(where, f"key '{key}' is {what} on rank {rank} but {first.dtype} of global shape "
                       f"{list(shape)} on rank {first_rank}: the ranks' records disagree")
        if not math.prod(rec.shape):
            continue  # an empty shard (uneven sharding) holds no element
        have = by_offsets.setdefault(info.offsets, rec)
        if have.shape != rec.shape:
            raise _bad(where, f"key '{key}': two shards start at {list(info.offsets)} with different shapes "
                       f"({list(have.shape)} in {shards[have.shard].file}, {list(rec.shape)} in "
                       f"{shards[rec.shard].file})")
    return shape, sorted(by_offsets.items())


def _check_dtensors(tensors: Mapping[str, TensorRecord], aliases: Mapping[str, str],
                    shards: tuple[ShardRecord, ...], world: int, complete: bool, where: str) -> None:
    """The ranks' records of each DTensor agree (:func:`dtensor_chunks`) and, when the manifest holds
    every rank of its job (``complete``), their chunks cover the global tensor exactly: every
    element in exactly one chunk (a hole would be read as whatever memory held; an overlap hides one)."""
    for key, held in logical_groups(tensors, aliases, world > 1).items():
        if all(rec.dtensor is None for _, _, rec in held):
            continue
        holders = [(r, rec) for r, _, rec in held]
        if holders[0][1].dtensor is None:
            rank = next(r for r, rec in holders if rec.dtensor is not None)
            raise _bad(where, f"key '{key}' is a plain tensor on rank {holders[0][0]} but a DTensor on rank "
                       f"{rank}: the ranks' records disagree")
        shape, chunks = dtensor_chunks(key, holders, shards, where)
        if complete:
            _check_coverage(key, shape, chunks, where)


def _check_coverage(key: str, shape: tuple[int, ...], chunks: Chunks, where: str) -> None:
    """Raise unless ``chunks`` (inside ``shape``, checked by :meth:`DTensorInfo.parse`) tile it."""
    numel = math.prod(shape)
    if not numel:
        return  # an empty tensor: nothing to cover
    covered = sum(math.prod(rec.shape) for _, rec in chunks)
    if covered == numel and _tiles(shape, [tuple(zip(o, (a + n for a, n in zip(o, rec.shape, strict=True)),
                                                     strict=True)) for o, rec in chunks], key, where):
        return
    how = "overlap and leave a hole" if covered == numel else "leave a hole" if covered < numel else "overlap"
    raise _bad(where, f"key '{key}': the ranks' shards ({len(chunks)} distinct) cover {covered} elements of a "
               f"global tensor of {numel} {list(shape)} and {how}: a shard is missing or misplaced")


Box = tuple[tuple[int, int], ...]


def _tiles(shape: tuple[int, ...], boxes: list[Box], key: str, where: str) -> bool:
    """Whether the non-empty ``boxes`` (``(start, end)`` per dimension) cover ``[0, shape)`` with
    every point in exactly one, exactly, for any number of boxes.

    The sum of the boxes' indicator functions minus the global box's must vanish. Along one
    dimension, that function is zero iff its finite difference is, at every coordinate where a box
    starts or ends: there the difference is the signed sum of the boxes' faces, a problem of one
    dimension less. Equal faces of opposite signs cancel first (in a grid, every inner face), so a
    DTensor grid costs a few steps per chunk; the work is bounded all the same (a layout beyond it
    is refused as too irregular to check, which no writer produces).
    """
    budget = _TILING_WORK_PER_CHUNK * (len(boxes) + 1)

    def vanishes(items: list[tuple[int, Box]]) -> bool:
        nonlocal budget
        acc: dict[Box, int] = {}
        for sign, box in items:
            acc[box] = acc.get(box, 0) + sign
        live = [(sign, box) for box, sign in acc.items() if sign]
        if len(live) <= 1:
            return not live  # one distinct non-empty box, a non-zero number of times: not zero
        budget -= len(live)
        if budget < 0:
            raise _bad(where, f"key '{key}': the ranks' {len(boxes)} shards form a layout too irregular to "
                       "check for exact coverage")
        head = live[0][1]
        dim = next(d for d in range(len(head)) if any(box[d] != head[d] for _, box in live))
        faces: dict[int, list[tuple[int, Box]]] = {}
        for sign, box in live:
            rest = box[:dim] + box[dim + 1:]
            faces.setdefault(box[dim][0], []).append((sign, rest))
            faces.setdefault(box[dim][1], []).append((-sign, rest))
        return all(vanishes(f) for f in faces.values())

    whole: Box = tuple((0, n) for n in shape)
    return vanishes([(1, b) for b in boxes] + [(-1, whole)])


def _check_overlaps(tensors: dict[str, TensorRecord], shards: tuple[ShardRecord, ...], w: str) -> None:
    """No two tensors share a byte: the sum of tensor bytes can then never exceed a shard's bytes."""
    spans = sorted((t.shard, t.start, t.end, k) for k, t in tensors.items() if t.nbytes)
    for (s0, _, e0, k0), (s1, b1, _, k1) in itertools.pairwise(spans):
        if s0 == s1 and b1 < e0:
            raise _bad(w, f"tensors {k0!r} and {k1!r} overlap in {shards[s0].file} (bytes {b1}..{e0}); "
                       "every tensor must own its bytes")


def _aliases(raw: Any, tensors: dict[str, TensorRecord], w: str) -> dict[str, str]:
    """Tied key -> stored key; the target must be a stored tensor (so no chains, no cycles)."""
    out: dict[str, str] = {}
    both = [a for a in _obj(raw, w, "aliases") if a in tensors]
    if both:
        raise _bad(w, f"aliases[{_short(both[0])}]: {both[0]!r} is also a stored tensor key")
    for a, b in raw.items():
        b = _str(b, w, f"aliases[{_short(a)}]")
        if b in raw:
            raise _bad(w, f"aliases[{_short(a)}] -> {_short(b)} is itself an alias (chains and cycles "
                       "are not written by nebula_ckpt)")
        if b not in tensors:
            raise _bad(w, f"aliases[{_short(a)}] -> {_short(b)}: no such tensor in the manifest")
        out[a] = b
    return out


def build_manifest(*, step: int, generation: int, shards: list[dict[str, Any]],
                   tensors: dict[str, dict[str, Any]], aliases: dict[str, str], tree: Any,
                   stats: dict[str, Any], ranks: Optional[dict[str, Any]] = None,
                   tag: Optional[str] = None) -> dict[str, Any]:
    """The manifest dict (see the README's format section); :meth:`Manifest.parse` reads it back.

    ``ranks``: for a multi-rank checkpoint, ``{"world_size", "ranks", "rank_tree"}`` (and
    ``tree`` is then the list node of the distinct trees). ``tag``: written only when given (an
    optional field, so untagged manifests are byte for byte what they were before tags).
    """
    out = {"format": FORMAT, "version": VERSION if ranks else SINGLE_VERSION, "step": step,
           "generation": generation, "time": time.time(), "checksum": "crc32c", "shards": shards,
           "tensors": tensors, "aliases": aliases, "tree": tree, "stats": stats}
    if ranks:
        out.update(ranks)
    if tag is not None:
        out["tag"] = tag
    return out
