"""Tests' view of a multi-rank checkpoint folder: the manifest with every rank's records merged in.

A version 3 checkpoint keeps each rank's tensor records in ``records-g<G>-r<R>.json`` beside its
shard; tests that look at every record at once read them through :func:`flat_manifest`, which
gives the JSON a version 2 manifest would hold (``tensors`` with ``r<R>/`` keys and ``shard``,
``aliases`` of replicated and tied keys), straight from the files (no library code).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def flat_manifest(step_folder: Path) -> dict[str, Any]:
    """The manifest of ``step_folder`` with the ranks' records merged into ``tensors`` / ``aliases``."""
    man = json.loads((step_folder / "manifest.json").read_text())
    if man["version"] < 3:
        return man
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    own: list[dict[str, str]] = []
    for r, ref in enumerate(man["records"]):
        recs = json.loads((step_folder / ref["file"]).read_text())
        for k, v in recs["tensors"].items():
            tensors[f"r{r}/{k}"] = dict(v, shard=r) if r else v
        own.append(recs["aliases"])
    for r, mine in enumerate(own):
        for k, q in man["owners"].items():
            if q != r:
                aliases[f"r{r}/{k}"] = f"r{q}/{k}"
        for a, b in mine.items():
            aliases[f"r{r}/{a}"] = aliases.get(f"r{r}/{b}", f"r{r}/{b}")
    return dict(man, tensors=tensors, aliases=aliases)


def seal(step_folder: Path, flat: dict[str, Any]) -> None:
    """Write ``flat`` (a :func:`flat_manifest` view, edited) back, every checksum valid (a buggy or
    hostile writer): a version 3 view is split into the ranks' records files again (each rank's
    own aliases kept as they were; size and CRC32C in the manifest), then the manifest and the
    COMMIT naming it. A view whose version was set below 3 is written as that manifest, whole."""
    import crc32c

    man = dict(flat)
    if man["version"] >= 3:
        per_rank: list[dict[str, Any]] = [{} for _ in man["records"]]
        for k, v in man["tensors"].items():
            head, _, key = k.partition("/")
            per_rank[int(head[1:])][key] = {f: x for f, x in v.items() if f != "shard"}
        for r, ref in enumerate(man["records"]):
            path = step_folder / ref["file"]
            recs = json.loads(path.read_text()) if path.exists() else {"aliases": {}}
            recs.update(tensors=per_rank[r])
            data = json.dumps(recs, separators=(",", ":")).encode()
            path.write_bytes(data)
            ref.update(bytes=len(data), crc32c=crc32c.crc32c(data))
        man.update(tensors={}, aliases={})
    mb = json.dumps(man, separators=(",", ":")).encode()
    (step_folder / "manifest.json").write_bytes(mb)
    commit = json.loads((step_folder / "COMMIT").read_text())
    commit.update(manifest_bytes=len(mb), manifest_crc32c=crc32c.crc32c(mb))
    (step_folder / "COMMIT").write_text(json.dumps(commit))


def as_version_2(flat: dict[str, Any]) -> None:
    """Turn a :func:`flat_manifest` view into a version 2 manifest (every record inline)."""
    for f in ("records", "owners", "dtensors", "grid"):
        flat.pop(f, None)
    flat["version"] = 2
