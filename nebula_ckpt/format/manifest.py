"""The manifest: the typed, strictly parsed index of one checkpoint.

``manifest.json`` holds the format version, the step, the writer generation, the shard files
(:class:`~nebula_ckpt.format.records.ShardRecord`), every tensor's dtype, shape, byte range and
checksum (:class:`~nebula_ckpt.format.records.TensorRecord`), tied keys (aliases) and the typed
tree of the rest of the state (:mod:`nebula_ckpt.format.tree`). File and folder names are in
:mod:`nebula_ckpt.format.names`, the commit marker in :mod:`nebula_ckpt.format.commit`.

A manifest of format version 2 (``world_size`` > 1) holds the state of the ranks ``ranks``
lists (one: a rank's own memory tier; several: read, no longer written). Tensor keys are
prefixed ``r<R>/``; a replicated tensor is stored once and the other ranks' keys are aliases of
it; ``tree`` is a list of the distinct state trees and ``rank_tree`` names each rank's (trees
use unprefixed keys). A DTensor's local shard carries a ``dtensor`` record: global shape, the
shard's offsets in it, placements and mesh shape (checked across ranks by
:mod:`nebula_ckpt.format.dtensors`).

Everything read from storage is input, never truth: a manifest whose checksum matches its
commit marker can still be wrong (a buggy or hostile writer produces a valid checksum just as
easily). :meth:`Manifest.parse` checks every field — types, dtypes, shapes against byte ranges,
ranges against their shard and each other, aliases, shard file names, the typed tree, the ranks'
records of each DTensor (alike on every rank and, with every rank held, covering the global
tensor exactly) — and raises :class:`CorruptCheckpointError` naming the file and the field.
Readers use only the typed records it returns.

Format version 4 (every checkpoint of several ranks) keeps each rank's records in a file
beside its shard (:mod:`nebula_ckpt.format.rank_index`): its manifest parses to a :class:`Manifest` whose
``layout`` names those files and whose ``tensors`` are empty until
:func:`~nebula_ckpt.format.split_records.load_split` loads the records of the ranks a reader needs.
Version 3 (a layout of the development before 0.1.0) is refused, naming the fix.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import types
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from nebula_ckpt.format.checks import as_hashes, as_int, as_list, as_obj, as_step, as_str, bad, short
from nebula_ckpt.format.dtensors import check_dtensors
from nebula_ckpt.format.names import (
    FORMAT,
    MANIFEST,
    READ_VERSIONS,
    SINGLE_VERSION,
    SPLIT_VERSION,
    VERSION,
    step_dir,
    tag_problem,
)
from nebula_ckpt.format.rank_index import SPLIT_FIELDS, parse_split
from nebula_ckpt.format.rank_records import LAYOUT_FIELDS, RanksLayout
from nebula_ckpt.format.records import ShardRecord, TensorRecord
from nebula_ckpt.format.tree import check_tree, merged
from nebula_ckpt.storage.base import MAX_SMALL_BYTES

_REQUIRED = ("format", "version", "step", "generation", "shards", "tensors", "tree")
_KNOWN = (_REQUIRED + ("time", "checksum", "aliases", "stats", "world_size", "ranks", "rank_tree", "tag", "sha256")
          + LAYOUT_FIELDS + SPLIT_FIELDS)
#: most ranks a manifest may name (bounds the work a hostile manifest can ask for)
MAX_WORLD = 1 << 20
#: largest magnitude of ``time`` (seconds since the epoch): a number a float holds exactly, far
#: beyond any clock, so a hostile value (``10**400``, NaN, an infinity) is refused, never converted
MAX_TIME = 2**53
#: the rank prefix of a version 2 tensor key: ASCII digits only (``str.isdigit`` also takes ``²``)
_RANK_PREFIX = re.compile(r"r(0|[1-9][0-9]{0,8})")
#: the largest manifest (or ranks' records file) a reader reads, some 25 million tensor records: a
#: larger file (a crafted or sparse one) is refused before any of it is read
MAX_MANIFEST_BYTES = MAX_SMALL_BYTES


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
    ranks: Sequence[int] = (0,)
    rank_tree: Mapping[int, int] = field(default_factory=dict)
    tag: Optional[str] = None
    #: tensor key -> SHA-256 (hex) of its bytes, for the tensors whose hash the writer took
    hashes: Mapping[str, str] = field(default_factory=dict)
    #: version 4: the ranks' records files (and which of them ``tensors`` holds); None before
    layout: Optional[RanksLayout] = None

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

    def distinct_trees(self) -> list[Mapping[str, Any]]:
        """The distinct state trees of the ranks held, lowest rank first (one: a one-process checkpoint)."""
        if not self.multi_rank:
            return [self.tree]
        firsts: dict[int, int] = {}
        for r in sorted(self.rank_tree):
            firsts.setdefault(self.rank_tree[r], r)
        return [self.tree["v"][i] for i in firsts]

    def job_tree(self) -> Mapping[str, Any]:
        """The state of the whole job: the ranks' trees merged (:func:`~nebula_ckpt.format.tree.merged`,
        lowest rank first), so a key only some ranks hold (a pipeline stage's) is in it."""
        return merged(self.distinct_trees())

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
               "tensors": {} if self.layout else {k: t.to_json() for k, t in self.tensors.items()},
               "aliases": {} if self.layout else dict(self.aliases),
               "tree": self.tree, "stats": dict(self.stats)}
        if self.layout is not None:  # version 4: shards, ranks and their trees are in ranks.json and the records files
            out.update(shards=[], world_size=self.world_size)
        elif self.multi_rank:
            out.update(world_size=self.world_size, ranks=list(self.ranks),
                       rank_tree={str(r): i for r, i in self.rank_tree.items()})
        if self.layout is not None:
            out.update(self.layout.to_json())
        if self.tag is not None:
            out["tag"] = self.tag
        if self.hashes and self.layout is None:  # version 4: the hashes are in the ranks' records files
            out["sha256"] = dict(self.hashes)
        out.update(self.extra)
        return out

    def check_data_start(self, shard: int, data_start: int, where: str) -> None:
        """Refuse tensor ranges of shard ``shard`` that reach into its safetensors header.

        ``data_start`` is 8 + the header length read from the shard's first 8 bytes.
        """
        sh = self.shards[shard]
        if not 8 <= data_start <= sh.bytes:
            raise bad(where, f"shard {sh.file}: its header claims {data_start - 8} bytes, the "
                       f"file has {sh.bytes}: not a safetensors file written by nebula_ckpt")
        for t in self.tensors.values():
            if t.shard == shard and t.nbytes and t.start < data_start:
                raise bad(where, f"{MANIFEST}: tensors[{t.key!r}].offsets start at {t.start}, inside "
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
                raise bad(where, f"{MANIFEST} is not valid JSON ({type(e).__name__}: {e})") from None
        w = f"{where}: {MANIFEST}"
        m = as_obj(data, w, "the manifest")
        if m.get("format") != FORMAT:
            raise bad(w, f"format is {short(m.get('format'))}, not {FORMAT!r}: not a nebula_ckpt manifest")
        version = as_int(m.get("version"), w, "version", lo=1, hi=2**31)
        if version > SPLIT_VERSION:
            raise bad(w, f"version {version} is newer than this nebula_ckpt understands ({SPLIT_VERSION})",
                       "upgrade nebula_ckpt")
        if version not in READ_VERSIONS:
            raise bad(w, f"version {version} is a layout of nebula_ckpt's development before 0.1.0, which this "
                       f"nebula_ckpt does not read (it reads versions {list(READ_VERSIONS)})",
                       "load it with the nebula_ckpt that wrote it and save the state again with this one")
        missing = [k for k in _REQUIRED if k not in m]
        if missing:
            raise bad(w, f"lacks field(s) {missing}")
        got = as_step(m["step"], w)
        if step is not None and got != step:
            raise bad(w, f"step is {got}, but the manifest lies in {step_dir(step)}/ (moved or replaced)")
        return _parse_body(m, w, got, version)


def _parse_body(m: dict[str, Any], w: str, step: int, version: int) -> Manifest:
    shards = tuple(ShardRecord.parse(s, f"{w}: shards[{i}]") for i, s in enumerate(as_list(m["shards"], w, "shards")))
    names = [(s.folder_step(step), s.file) for s in shards]
    if len(set(names)) != len(names):
        raise bad(w, f"shards lists a file twice ({names})")
    for i, s in enumerate(shards):
        if s.step is not None and s.step >= step:
            raise bad(w, f"shards[{i}] ({s.file}) refers to step {s.step}, not an earlier step than {step}: "
                       "an incremental checkpoint refers only to the bytes of earlier checkpoints")
    tensors = {as_str(k, w, "tensor key"): TensorRecord.parse(k, v, shards, f"{w}: tensors[{short(k)}]")
               for k, v in as_obj(m["tensors"], w, "tensors").items()}
    _check_overlaps(tensors, shards, w)
    aliases = _aliases(m.get("aliases", {}), tensors, w)
    layout: Optional[RanksLayout] = None
    if version >= SPLIT_VERSION:  # no per-rank field: ranks, tree indices and shards are in the ranks' files
        world, layout = parse_split(m, w, step, shards, tensors, aliases, MAX_WORLD)
        ranks: Sequence[int] = range(world)
        rank_tree: dict[int, int] = {}
    else:
        world, ranks, rank_tree = _ranks(m, w, version)
    if layout is None:  # version 4: checked when the ranks' records are loaded
        _check_trees(m["tree"], tensors, aliases, world, rank_tree, w)
        check_dtensors(tensors, aliases, shards, world, len(ranks) == world, w)
    t = m.get("time", 0.0)
    if type(t) not in (int, float):
        raise bad(w, f"time must be a number, got {type(t).__name__}")
    if not -MAX_TIME <= t <= MAX_TIME:  # also false for NaN (json.loads reads NaN and Infinity)
        raise bad(w, f"time = {short(t)} is not a finite number in [-2**53, 2**53] (seconds since the epoch)")
    if m.get("checksum", "crc32c") != "crc32c":
        raise bad(w, f"checksum {short(m.get('checksum'))} is unknown (this nebula_ckpt uses 'crc32c')")
    tag = m.get("tag")
    if "tag" in m and tag_problem(tag) is not None:  # optional, but when present a valid tag
        raise bad(w, f"tag {tag_problem(tag)}")
    hashes = as_hashes(m.get("sha256", {}), tensors, w)
    return Manifest(step=step, generation=as_int(m["generation"], w, "generation"), shards=shards,
                    tensors=types.MappingProxyType(tensors), aliases=types.MappingProxyType(aliases),
                    tree=m["tree"], version=version, time=float(t),
                    stats=types.MappingProxyType(as_obj(m.get("stats", {}), w, "stats")),
                    extra=types.MappingProxyType({k: v for k, v in m.items() if k not in _KNOWN}),
                    world_size=world, ranks=ranks, rank_tree=types.MappingProxyType(rank_tree), tag=tag,
                    hashes=types.MappingProxyType(hashes), layout=layout)



def _ranks(m: dict[str, Any], w: str, version: int) -> tuple[int, tuple[int, ...], dict[int, int]]:
    """``world_size``, the ranks held and rank -> tree index (one-process manifests: 1, (0,), {})."""
    world = as_int(m.get("world_size", 1), w, "world_size", lo=1, hi=MAX_WORLD)
    if world == 1:
        if "ranks" in m or "rank_tree" in m:
            raise bad(w, "ranks / rank_tree given for a one-process checkpoint (world_size 1)")
        return 1, (0,), {}
    if version < 2:
        raise bad(w, f"world_size {world} needs format version 2, the manifest says {version}")
    ranks = tuple(as_int(r, w, "ranks[]", hi=world - 1) for r in as_list(m.get("ranks"), w, "ranks"))
    if not ranks or len(set(ranks)) != len(ranks):
        raise bad(w, f"ranks must list distinct ranks of the job, got {short(list(ranks))}")
    tree = as_obj(m["tree"], w, "tree")
    if tree.get("t") != "list" or type(tree.get("v")) is not list or not tree["v"]:
        raise bad(w, "tree of a multi-rank checkpoint must be a list node of the ranks' state trees")
    raw = as_obj(m.get("rank_tree"), w, "rank_tree")
    rank_tree: dict[int, int] = {}
    for r in ranks:
        rank_tree[r] = as_int(raw.get(str(r)), w, f"rank_tree[{r}]", hi=len(tree["v"]) - 1)
    if len(raw) != len(ranks):
        raise bad(w, f"rank_tree names {len(raw)} ranks, ranks lists {len(ranks)}")
    return world, ranks, rank_tree


def _check_trees(tree: Any, tensors: dict[str, TensorRecord], aliases: dict[str, str], world: int,
                 rank_tree: dict[int, int], w: str) -> None:
    """Check the tree(s): each rank's tree against the keys that rank has, and their dtypes."""
    dtypes = {k: tensors[aliases.get(k, k)].dtype for k in itertools.chain(tensors, aliases)}
    if world == 1:
        check_tree(tree, dtypes, f"{w}: tree")
        return
    own: dict[int, dict[str, str]] = {}
    for k, dtype in dtypes.items():
        head, sep, rest = k.partition("/")
        prefix = _RANK_PREFIX.fullmatch(head) if sep else None
        r = int(prefix.group(1)) if prefix else None
        if r is None or r not in rank_tree:
            raise bad(w, f"tensor key {short(k)} does not start with the prefix of a rank it holds (r<R>/)")
        own.setdefault(r, {})[rest] = dtype
    users: dict[int, list[int]] = {}
    for r, i in rank_tree.items():
        users.setdefault(i, []).append(r)
    for i, node in enumerate(tree["v"]):
        if i not in users:
            raise bad(w, f"tree[{i}] is the tree of no rank")
        held = [own.get(r, {}) for r in users[i]]
        # a key every rank of this tree holds; its dtype, or None where the ranks' dtypes differ
        shared = {k: (dt if all(h[k] == dt for h in held) else None)
                  for k, dt in held[0].items() if all(k in h for h in held)}
        check_tree(node, shared, f"{w}: tree[{i}] (rank {users[i][0]})")


def _check_overlaps(tensors: dict[str, TensorRecord], shards: tuple[ShardRecord, ...], w: str) -> None:
    """No two tensors share a byte: the sum of tensor bytes can then never exceed a shard's bytes."""
    spans = sorted((t.shard, t.start, t.end, k) for k, t in tensors.items() if t.nbytes)
    for (s0, _, e0, k0), (s1, b1, _, k1) in itertools.pairwise(spans):
        if s0 == s1 and b1 < e0:
            raise bad(w, f"tensors {k0!r} and {k1!r} overlap in {shards[s0].file} (bytes {b1}..{e0}); "
                       "every tensor must own its bytes")


def _aliases(raw: Any, tensors: dict[str, TensorRecord], w: str) -> dict[str, str]:
    """Tied key -> stored key; the target must be a stored tensor (so no chains, no cycles)."""
    out: dict[str, str] = {}
    both = [a for a in as_obj(raw, w, "aliases") if a in tensors]
    if both:
        raise bad(w, f"aliases[{short(both[0])}]: {both[0]!r} is also a stored tensor key")
    for a, b in raw.items():
        b = as_str(b, w, f"aliases[{short(a)}]")
        if b in raw:
            raise bad(w, f"aliases[{short(a)}] -> {short(b)} is itself an alias (chains and cycles "
                       "are not written by nebula_ckpt)")
        if b not in tensors:
            raise bad(w, f"aliases[{short(a)}] -> {short(b)}: no such tensor in the manifest")
        out[a] = b
    return out


def build_manifest(*, step: int, generation: int, shards: list[dict[str, Any]],
                   tensors: dict[str, dict[str, Any]], aliases: dict[str, str], tree: Any,
                   stats: dict[str, Any], ranks: Optional[dict[str, Any]] = None,
                   tag: Optional[str] = None, hashes: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The manifest dict (see the README's format section); :meth:`Manifest.parse` reads it back.

    ``ranks``: for a multi-rank checkpoint, ``{"world_size", "ranks", "rank_tree"}`` (and
    ``tree`` is then the list node of the distinct trees). ``tag``: written only when given (an
    optional field, so untagged manifests are byte for byte what they were before tags).
    ``hashes``: tensor key -> SHA-256 hex of its bytes (``sha256``, written only when given).
    """
    out = {"format": FORMAT, "version": VERSION if ranks else SINGLE_VERSION, "step": step,
           "generation": generation, "time": time.time(), "checksum": "crc32c", "shards": shards,
           "tensors": tensors, "aliases": aliases, "tree": tree, "stats": stats}
    if ranks:
        out.update(ranks)
    if tag is not None:
        out["tag"] = tag
    if hashes:
        out["sha256"] = hashes
    return out


def finish_manifest(draft: dict[str, Any], *, generation: int, shards: list[dict[str, Any]],
                    tensors: dict[str, dict[str, Any]], stats: Optional[dict[str, Any]] = None,
                    restamp: bool = True) -> dict[str, Any]:
    """``draft`` (a manifest :func:`build_manifest` made before its shard was written, or one
    copied from another tier) as committed: its writer ``generation``, ``shards`` (the own shard's
    record first) and ``tensors``, ``stats`` added to its statistics, and (``restamp``) the time of
    the commit. Every field keeps its place, so the bytes are those of one built at the commit."""
    out = dict(draft, generation=generation, shards=shards, tensors=tensors)
    if restamp:
        out["time"] = time.time()
    if stats:
        out["stats"] = dict(out["stats"], **stats)
    return out


def tagged(manifest: dict[str, Any], tag: Optional[str]) -> dict[str, Any]:
    """``manifest`` (a built manifest dict) with the optional ``tag`` field (only when there is a tag)."""
    if tag is not None:
        manifest["tag"] = tag
    return manifest


#: the ``stats`` key of a step's count of its tier's saves since its chain's last full one, the
#: step's own included (0: the step is full); a restarted job's cadence of full saves goes on from it
SINCE_FULL = "saves_since_full"

#: statistics of an incremental step that a step written whole no longer has
_INCREMENTAL_STATS = ("base_step", "reused_bytes", "base_write", SINCE_FULL)


def whole_manifest(stored: Mapping[str, Any], *, shard: dict[str, Any], tensors: dict[str, dict[str, Any]],
                   generation: Optional[int] = None) -> dict[str, Any]:
    """The manifest ``stored`` (a manifest dict: :func:`stored_json` or :meth:`Manifest.to_json`) of
    a step written whole into one shard: its own ``shard`` record, the ``tensors`` of that shard, no
    incremental statistics, and (``generation``) the writer generation of the copy. Every field
    keeps its place."""
    out = dict(stored, shards=[shard], tensors=tensors)
    if generation is not None:
        out["generation"] = generation
    out["stats"] = {k: v for k, v in dict(out.get("stats") or {}).items() if k not in _INCREMENTAL_STATS}
    return out


def stored_json(raw: bytes) -> dict[str, Any]:
    """The manifest ``raw`` as the dict it stores, to write back with changes; only for bytes
    :meth:`Manifest.parse` accepted (read through the typed :class:`Manifest`, never this)."""
    out = json.loads(raw)
    assert type(out) is dict
    return out


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The bytes of ``manifest`` as stored (compact JSON; NaN and infinities refused)."""
    return json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()
