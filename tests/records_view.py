"""Tests' view of a multi-rank checkpoint folder: the manifest with every rank's records merged in.

A version 4 checkpoint keeps each rank's tensor records in ``records-g<G>-r<R>.json`` beside its
shard; tests that look at every record at once read them through :func:`flat_manifest`, which
gives the JSON a version 2 manifest would hold (``tensors`` with ``r<R>/`` keys and ``shard``,
``aliases`` of replicated, replica and tied keys, ``sha256`` with ``r<R>/`` keys; an incremental share's
records pointing at ``refs[j - 1]`` get the index of that shard in the manifest's ``shards``),
straight from the files (no library code). The view also holds what its
``ranks.json`` lists (``shards``: every rank's own, then the earlier ones they refer to;
``records``; ``ranks`` and ``rank_tree``), and :func:`seal` splits such a view back into records
files sealed with their own CRC32C, ``ranks.json`` and the manifest; :func:`reseal` edits one
rank's records file in place, every checksum kept valid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def flat_manifest(step_folder: Path) -> dict[str, Any]:
    """The manifest of ``step_folder`` with the ranks' records merged into ``tensors`` / ``aliases``."""
    man = json.loads((step_folder / "manifest.json").read_text())
    if man["version"] < 3:
        return man
    if man["version"] >= 4:
        man = _index_view(step_folder, man)
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    hashes: dict[str, str] = {}
    own: list[dict[str, str]] = []
    replicas: list[dict[str, int]] = []
    at = {(s["step"], s["file"]): i for i, s in enumerate(man["shards"]) if "step" in s}
    for r, ref in enumerate(man["records"]):
        recs = json.loads((step_folder / ref["file"]).read_text())
        glob = [r] + [at[(x["step"], x["file"])] for x in recs.get("refs", [])]
        for k, v in recs["tensors"].items():
            i = glob[v.get("shard", 0)]
            tensors[f"r{r}/{k}"] = dict(v, shard=i) if i else {f: x for f, x in v.items() if f != "shard"}
        hashes.update({f"r{r}/{k}": h for k, h in recs.get("sha256", {}).items()})
        own.append(recs["aliases"])
        replicas.append(recs.get("replicas", {}))
    for r, mine in enumerate(own):
        for k, q in man["owners"].items():
            if q != r:
                aliases[f"r{r}/{k}"] = f"r{q}/{k}"
        for k, q in replicas[r].items():
            aliases[f"r{r}/{k}"] = f"r{q}/{own[q].get(k, k)}"
        for a, b in mine.items():
            aliases[f"r{r}/{a}"] = aliases.get(f"r{r}/{b}", f"r{r}/{b}")
    return dict(man, tensors=tensors, aliases=aliases, **({"sha256": hashes} if hashes else {}))


def _index_view(step_folder: Path, man: dict[str, Any]) -> dict[str, Any]:
    """A version 4 manifest with what its ranks.json lists, as a version 3 manifest holds it."""
    index = json.loads((step_folder / "ranks.json").read_text())
    digests = man["tree_digests"]
    return dict(man, shards=[e["shard"] for e in index["ranks"]] + index["refs"],
                records=[e["records"] for e in index["ranks"]], ranks=list(range(man["world_size"])),
                rank_tree={str(r): digests.index(e["tree"]) for r, e in enumerate(index["ranks"])})


def records_body(path: Path) -> dict[str, Any]:
    """A records file's object (a version 4 one without its ``crc32c`` seal)."""
    recs = json.loads(path.read_text())
    recs.pop("crc32c", None)
    return recs


def sealed(recs: dict[str, Any]) -> bytes:
    """The bytes of a records file: version 4 ones sealed with their own CRC32C (as the writer does)."""
    import crc32c

    text = json.dumps(recs, separators=(",", ":")).encode()
    if recs.get("version") != 4:
        return text
    return text[:-1] + b',"crc32c":"%08x"}' % crc32c.crc32c(text)


def recommit(step_folder: Path, man: dict[str, Any]) -> None:
    """Write ``man`` as the manifest of ``step_folder`` and a COMMIT naming its size and CRC32C."""
    import crc32c

    mb = json.dumps(man, separators=(",", ":")).encode()
    (step_folder / "manifest.json").write_bytes(mb)
    commit = json.loads((step_folder / "COMMIT").read_text())
    commit.update(manifest_bytes=len(mb), manifest_crc32c=crc32c.crc32c(mb))
    (step_folder / "COMMIT").write_text(json.dumps(commit))


def reindex(step_folder: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``fn`` to a version 4 step's ranks.json; the manifest names its new size and CRC32C,
    the COMMIT the new manifest's."""
    import crc32c

    index = json.loads((step_folder / "ranks.json").read_text())
    fn(index)
    data = json.dumps(index, separators=(",", ":")).encode()
    (step_folder / "ranks.json").write_bytes(data)
    man = json.loads((step_folder / "manifest.json").read_text())
    man["ranks_file"].update(bytes=len(data), crc32c=crc32c.crc32c(data))
    recommit(step_folder, man)


def reseal(step_folder: Path, rank: int, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``fn`` to rank ``rank``'s records (version 4) and re-seal them: their embedded CRC32C,
    ranks.json's entry, the manifest's of ranks.json and the COMMIT's of the manifest are all
    valid; only the content lies (a buggy or hostile writer)."""
    import crc32c

    man = json.loads((step_folder / "manifest.json").read_text())
    path = step_folder / f"records-g{man['generation']}-r{rank}.json"
    recs = records_body(path)
    fn(recs)
    data = sealed(recs)
    path.write_bytes(data)
    reindex(step_folder, lambda i: i["ranks"][rank]["records"].update(bytes=len(data), crc32c=crc32c.crc32c(data)))


def seal(step_folder: Path, flat: dict[str, Any]) -> None:
    """Write ``flat`` (a :func:`flat_manifest` view, edited) back, every checksum valid (a buggy or
    hostile writer): a version 3 view is split into the ranks' records files again (each rank's
    own aliases kept as they were; size and CRC32C in the manifest), then the manifest and the
    COMMIT naming it. A view whose version was set below 3 is written as that manifest, whole."""
    import crc32c

    man = dict(flat)
    if man["version"] >= 3:
        per_rank: list[dict[str, Any]] = [{} for _ in man["records"]]
        sha: list[dict[str, str]] = [{} for _ in man["records"]]
        for k, h in man.pop("sha256", {}).items():
            head, _, key = k.partition("/")
            sha[int(head[1:])][key] = h
        for k, v in man["tensors"].items():
            head, _, key = k.partition("/")
            per_rank[int(head[1:])][key] = v
        for r, ref in enumerate(man["records"]):
            path = step_folder / ref["file"]
            recs = records_body(path) if path.exists() else {"aliases": {}}
            local = {r: 0} | {i: j for j, i in enumerate(
                [next(i for i, s in enumerate(man["shards"]) if (s.get("step"), s["file"]) == (x["step"], x["file"]))
                 for x in recs.get("refs", [])], start=1)}
            recs.update(tensors={k: _local_record(v, local) for k, v in per_rank[r].items()})
            if sha[r] or "sha256" in recs:
                recs["sha256"] = sha[r]
            data = sealed(recs)
            path.write_bytes(data)
            ref.update(bytes=len(data), crc32c=crc32c.crc32c(data))
        man.update(tensors={}, aliases={})
        if man["version"] >= 4:
            index = json.loads((step_folder / "ranks.json").read_text())
            for e, ref in zip(index["ranks"], man["records"], strict=True):
                e["records"] = ref
            data = json.dumps(index, separators=(",", ":")).encode()
            (step_folder / "ranks.json").write_bytes(data)
            man["ranks_file"].update(bytes=len(data), crc32c=crc32c.crc32c(data))
            for f in ("records", "ranks", "rank_tree"):
                man.pop(f)
            man["shards"] = []
    recommit(step_folder, man)


def _local_record(v: dict[str, Any], local: dict[int, int]) -> dict[str, Any]:
    """A flat view's record as its rank's records file holds it (``shard``: 0, left out, or j >= 1)."""
    j = local.get(v.get("shard", 0), 0)
    return {f: x for f, x in v.items() if f != "shard"} | ({"shard": j} if j else {})


def as_version_2(flat: dict[str, Any]) -> None:
    """Turn a :func:`flat_manifest` view into a version 2 manifest (every record inline)."""
    for f in ("records", "owners", "dtensors", "grid", "save_id", "tree_digests", "references", "ranks_file"):
        flat.pop(f, None)
    flat["version"] = 2
