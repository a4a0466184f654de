"""Metadata at thousands of ranks, simulated in one process: what each step of a save's commit and
a restore's planning costs as the number of ranks grows, with no tensor data.

    python -m benchmarks.scale_sim                         # 64..1,024 ranks x 1,000 tensors
    python -m benchmarks.scale_sim --ranks 256,1024,4096 --tensors 1000 --out benchmarks/results/scale-sim

It runs the library's real metadata code on synthetic per-rank tensor indexes shaped like the ones
the snapshot stage records (dtype, shape, byte range, CRC32C, DTensor placement):

* ``fsdp``: every rank holds a ``Shard(0)`` piece of every parameter and of its two AdamW moments,
  plus a replicated 0-dim step count per parameter (what ``fully_shard`` + AdamW records);
* ``ddp``: every rank holds the same full tensors (the replicas the commit writes once).

Per size it measures, on the paths a real job runs:

1. the rounds (:mod:`nebula_ckpt.save.rounds`): one rank's ``summary`` / ``digest`` / ``assign`` (CPU),
   the bytes rank 0 receives in the digest and durable rounds (``all_gather_object`` pickles);
2. rank 0's commit: ``ranks.global_manifest`` + serialising it (CPU), the bytes it writes;
3. a restoring rank: the bytes it reads and its CPU to parse the manifest (``Manifest.parse``) and
   to build the resharding plan's metadata (:class:`nebula_ckpt.dcp.reader.NebulaStorageReader` opened
   on a real folder whose shards are sparse files);
4. beside it, DCP's own planner: ``DefaultSavePlanner.create_global_plan`` over the same number of
   local plans of the same items, and the size of the metadata DCP writes.

Each figure is fitted to ``a * ranks**k`` (least squares on the logs): ``k`` is the growth
exponent printed in the report. A step is skipped at sizes where the previous one predicts more
than ``--budget-s`` seconds, and the report says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from nebula_ckpt import native
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format import names as fnames
from nebula_ckpt.format.commit import Commit
from nebula_ckpt.ranks import shards as ranks

ROWS, COLS = 64, 1024  # a rank's piece of each parameter (fp32): the bytes do not matter here


@dataclass
class Sample:
    ranks: int
    values: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def rank_index(kind: str, rank: int, world: int, tensors: int) -> dict[str, dict[str, Any]]:
    """One rank's tensor index as the snapshot stage records it (offsets into its staged image)."""
    out: dict[str, dict[str, Any]] = {}
    off = 4096
    params = max(1, tensors // 4)  # fsdp: param + exp_avg + exp_avg_sq + step per parameter
    for i in range(params if kind == "fsdp" else tensors):
        names = ([f"model/layers.{i}.weight", f"optim/state/{i}/exp_avg", f"optim/state/{i}/exp_avg_sq"]
                 if kind == "fsdp" else [f"model/layers.{i}.weight"])
        for key in names:
            nbytes = ROWS * COLS * 4
            rec: dict[str, Any] = {"dtype": "float32", "shape": [ROWS, COLS], "offsets": [off, off + nbytes],
                                   "crc32c": (hash((key, rank if kind == "fsdp" else 0)) & 0xFFFFFFFF),
                                   "device": "cpu"}
            if kind == "fsdp":
                rec["dtensor"] = {"shape": [ROWS * world, COLS], "offsets": [ROWS * rank, 0],
                                  "placements": ["S(0)"], "mesh": [world]}
            out[key] = rec
            off += nbytes
        if kind == "fsdp":
            out[f"optim/state/{i}/step"] = {"dtype": "float32", "shape": [], "offsets": [off, off + 4],
                                            "crc32c": 1234567, "device": "cpu"}
            off += 4
    return out


def rank_tree(index: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A typed tree referencing every tensor (the same on every rank, as in a real job)."""
    return {"t": "dict", "v": [[{"t": "str", "v": k}, {"t": "tensor", "k": k}] for k in index]}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    gc.collect()
    t = time.process_time()
    out = fn()
    return out, time.process_time() - t


def durable_part(rank: int, idx: dict[str, dict[str, Any]], owners: dict[str, int],
                 tree: Optional[dict[str, Any]]) -> dict[str, Any]:
    """What ``rank`` sends in the durable round: its share of ``idx``, laid out as
    ``ranks.subset_image`` lays it out (``tree``: rank 0's only)."""
    mine, off = {}, 4096
    for k in (k for k in idx if owners.get(k, rank) == rank):
        n = idx[k]["offsets"][1] - idx[k]["offsets"][0]
        mine[k] = dict(idx[k], offsets=[off, off + n])
        off += n
    return {"step": 1, "shard": {"file": fnames.shard_name(1, rank), "bytes": off, "storage": {"stored_bytes": off}},
            "tensors": mine, "aliases": {}, "tree": tree, "stats": {"tensor_bytes": 0}}


def write_step(root: str, man: dict[str, Any], text: bytes) -> None:
    """Step 1 of ``root`` committed on disk: sparse shards of the manifest's sizes (the reader
    checks sizes, never reads bytes here), the manifest ``text`` and its commit marker."""
    step_dir = os.path.join(root, fnames.step_dir(1))
    os.makedirs(step_dir, exist_ok=True)
    for sh in man["shards"]:
        with open(os.path.join(step_dir, sh["file"]), "wb") as f:
            f.truncate(sh["bytes"])
    with open(os.path.join(step_dir, fnames.MANIFEST), "wb") as f:
        f.write(text)
    with open(os.path.join(step_dir, fnames.COMMIT), "wb") as f:
        f.write(Commit(1, 1, len(text), native.get_ops().crc32c_bytes(text)).to_bytes())


def simulate(kind: str, world: int, tensors: int, workdir: str, budget_s: float,
             predict: Callable[[str, int], Optional[float]]) -> Sample:
    """One simulated job of ``world`` ranks: every cost named in the module docstring."""
    s = Sample(world)

    def run(name: str, fn: Callable[[], Any]) -> Any:
        guess = predict(name, world)
        if guess is not None and guess > budget_s:
            s.skipped[name] = f"predicted {guess:.0f} s > budget {budget_s:.0f} s"
            return None
        out, cpu = timed(fn)
        s.values[name] = cpu
        return out

    # every rank's index differs only in offsets / checksums: build each one (rank 0 receives them all)
    indexes = [rank_index(kind, r, world, tensors) for r in range(world)]
    tree = rank_tree(indexes[0])
    rep, sharded = run("rank: summary+digest (s)", lambda: ranks.summary(indexes[0]))
    digest = ranks.digest(rep)
    payload1 = {"step": 1, "digest": digest, "tree": ranks.digest(tree), "sharded": sharded}
    s.values["rank 0 receives: digest round (B)"] = world * len(pickle.dumps(payload1))
    owners = run("rank: assign owners (s)", lambda: ranks.assign([rep] * world, [sharded] * world)) or {}
    parts = [durable_part(r, idx, owners, tree if r == 0 else None) for r, idx in enumerate(indexes)]
    s.values["rank 0 receives: durable round (B)"] = sum(len(pickle.dumps(p)) for p in parts)
    s.values["rank: sends in durable round (B)"] = float(len(pickle.dumps(parts[-1])))
    man = run("rank 0: build manifest (s)", lambda: ranks.global_manifest(step=1, generation=1, parts=parts,
                                                                         owners=owners))
    indexes.clear()  # free: rank 0 keeps only the parts
    if man is None:
        return s
    text = run("rank 0: serialise manifest (s)", lambda: json.dumps(man, separators=(",", ":")).encode())
    if text is None:
        return s
    s.values["rank 0 writes (B)"] = float(len(text))
    s.values["rank reads at restore (B)"] = float(len(text))
    root = os.path.join(workdir, f"{kind}-{world}")
    write_step(root, man, text)
    man, parts = {}, []  # free before the restore side
    run("rank: parse manifest (s)", lambda: mf.Manifest.parse(json.loads(text), "sim", 1))
    text = b""

    def reshard_plan() -> Any:
        from nebula_ckpt.dcp.reader import NebulaStorageReader
        with NebulaStorageReader(root, step=1, verify=False) as reader:
            return len(reader.read_metadata().state_dict_metadata)
    run("rank: reshard plan metadata (s)", reshard_plan)
    shutil.rmtree(root, ignore_errors=True)
    dcp_planner(kind, world, tensors, s, run)
    return s


def dcp_planner(kind: str, world: int, tensors: int, s: Sample, run: Callable[[str, Callable[[], Any]], Any]) -> None:
    """DCP's save planner over ``world`` local plans of the same items (what ``dcp.save`` runs on rank 0)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    def plan(r: int) -> SavePlan:
        items = []
        for key, rec in rank_index(kind, r, world, tensors).items():
            dt = rec.get("dtensor")
            size = torch.Size(dt["shape"] if dt else rec["shape"])
            offs = torch.Size(dt["offsets"] if dt else [0] * len(rec["shape"]))
            items.append(WriteItem(index=MetadataIndex(key.replace("/", "."), offs), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(
                                       chunk=ChunkStorageMetadata(offsets=offs, sizes=torch.Size(rec["shape"])),
                                       properties=TensorProperties(dtype=torch.float32), size=size)))
        return SavePlan(items, planner_data={})

    plans = [plan(r) for r in range(world)]
    s.values["dcp rank 0 receives: local plans (B)"] = float(sum(len(pickle.dumps(p)) for p in plans))
    planner = DefaultSavePlanner()
    out = run("dcp rank 0: create_global_plan (s)", lambda: planner.create_global_plan(plans))
    if out is not None:
        s.values["dcp rank 0 writes: metadata (B)"] = float(len(pickle.dumps(out[1])))


def fit(points: list[tuple[int, float]]) -> Optional[tuple[float, float]]:
    """``(k, a)`` of ``y = a * x**k`` by least squares on the logs (None with fewer than 2 points)."""
    pts = [(math.log(x), math.log(y)) for x, y in points if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    k = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
    return k, math.exp(my - k * mx)


def fmt(name: str, v: float) -> str:
    if name.endswith("(s)"):
        return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= div:
            return f"{v / div:.2f} {unit}"
    return f"{v:.0f} B"


def report(kind: str, tensors: int, samples: list[Sample]) -> tuple[str, dict[str, Any]]:
    names = list(dict.fromkeys(n for s in samples for n in [*s.values, *s.skipped]))
    lines = [f"### {kind}: {tensors} tensors per rank", "",
             "| cost | " + " | ".join(f"{s.ranks:,} ranks" for s in samples) + " | growth k (y ~ ranks^k) |",
             "|---|" + "---:|" * len(samples) + "---:|"]
    fits: dict[str, Any] = {}
    for n in names:
        row = [fmt(n, s.values[n]) if n in s.values else "skipped" for s in samples]
        f = fit([(s.ranks, s.values[n]) for s in samples if n in s.values])
        fits[n] = None if f is None else {"k": f[0], "a": f[1]}
        lines.append(f"| {n} | " + " | ".join(row) + f" | {'' if f is None else f'{f[0]:.2f}'} |")
    skipped = [f"- {s.ranks:,} ranks, {n}: {why}" for s in samples for n, why in s.skipped.items()]
    return "\n".join(lines + ([""] + skipped if skipped else [])) + "\n", fits


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="64,256,1024", help="comma-separated simulated world sizes")
    p.add_argument("--tensors", type=int, default=1000, help="tensors per rank")
    p.add_argument("--kinds", default="fsdp,ddp")
    p.add_argument("--budget-s", type=float, default=120.0, help="skip a step predicted to take longer")
    p.add_argument("--out", default=None, help="folder for results.md / results.json")
    a = p.parse_args(argv)
    sizes = sorted(int(x) for x in a.ranks.split(","))
    md = ["# Metadata at scale (simulated, one process, no tensor data)", "",
          f"`python -m benchmarks.scale_sim --ranks {a.ranks} --tensors {a.tensors}`; CPU seconds "
          "(process time) of one call; bytes as sent (pickled) or written (JSON).", ""]
    doc: dict[str, Any] = {"ranks": sizes, "tensors": a.tensors, "kinds": {}}
    with tempfile.TemporaryDirectory(prefix="nebula-scale-") as work:
        for kind in a.kinds.split(","):
            samples: list[Sample] = []

            def predict(name: str, world: int, samples: list[Sample] = samples) -> Optional[float]:
                f = fit([(s.ranks, s.values[name]) for s in samples if name in s.values])
                return None if f is None else f[1] * world ** f[0]

            for n in sizes:
                samples.append(simulate(kind, n, a.tensors, work, a.budget_s, predict))
                print(f"{kind} {n} ranks: " + ", ".join(f"{k} {fmt(k, v)}" for k, v in samples[-1].values.items()),
                      flush=True)
            text, fits = report(kind, a.tensors, samples)
            md.append(text)
            doc["kinds"][kind] = {"samples": [{"ranks": s.ranks, "values": s.values, "skipped": s.skipped}
                                              for s in samples], "fits": fits}
    out = "\n".join(md)
    print(out)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write(out)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
