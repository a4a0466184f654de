"""Metadata at thousands of ranks, simulated in one process: what each step of a save's commit and
a restore's planning costs as the number of ranks grows, with no tensor data.

    python -m benchmarks.scale_sim --out benchmarks/results/scale-sim-$(date +%F)   # 256 to 16,384 ranks

It runs the library's real metadata code (format version 4: each rank's self-checking records
beside its shard, rank 0's ``manifest.json`` without per-rank fields, the per-rank table in ``ranks.json``)
on synthetic per-rank tensor indexes shaped like the ones the snapshot stage records (dtype, shape,
byte range, CRC32C, DTensor placement):

* ``fsdp``: every rank holds a ``Shard(0)`` piece of every parameter and of its two AdamW moments,
  plus a replicated 0-dim step count per parameter (what ``fully_shard`` + AdamW records);
* ``ddp``: every rank holds the same full tensors (the replicas the commit writes once), owned by
  the first ``REPLICA_OWNER_RANKS`` ranks (:mod:`nebula_ckpt.ranks.shards`, its default);
* ``ddp-spread``: the same, with ``REPLICA_OWNER_RANKS`` 0 (the replicas spread over every rank):
  the trade-off between the records files a restoring rank reads and the bytes the busiest rank writes.

Per size it measures, on the paths a real job runs:

1. one rank's part of the rounds (:mod:`nebula_ckpt.save.rounds`): the digest round's payload
   (``summary`` / ``digest`` of the replicas, tree and DTensor table), ``assign`` of the owners,
   and its durable-round payload with its records file
   (:func:`nebula_ckpt.ranks.split.split_payload`: subset image index, sealed records JSON,
   CRC32C, table, grid check); the bytes rank 0 receives in both rounds (``all_gather_object``
   pickles); the bytes the busiest rank writes (its shard);
2. rank 0's commit: :func:`~nebula_ckpt.ranks.split.split_manifest` and the manifest's encoding,
   the bytes it writes (``manifest.json`` and ``ranks.json``);
3. a restoring rank (the last one) at the same world size:
   :func:`nebula_ckpt.restore.open.read_manifest` of its rank on a real folder (commit marker,
   manifest, its records and the owners', every one checked and validated; never ``ranks.json``),
   the bytes and the number of records files it reads;
4. a rank resharding into half the ranks: :func:`nebula_ckpt.format.rank_records.ranks_for` of
   its regions on the grid, then reading those ranks' records, the bytes it reads;
5. beside it, DCP's own planner: ``DefaultSavePlanner.create_global_plan`` over the same number of
   local plans of the same items, and the size of the metadata DCP writes; above
   ``--dcp-max-ranks`` (its local plans alone take GBs of memory) its time is extrapolated with
   the exponent fitted below, and the report says so.

The simulated ranks' payloads are real for every rank whose records any measured step reads
(rank 0, the restoring rank, the owners of replicas, the resharding rank's sources); the others
are copies of a real one under their own file names with a placeholder checksum, and their
records files are not written: a step that read one would fail.

Each figure is fitted to ``a * ranks**k`` (least squares on the logs): ``k`` is the growth
exponent printed in the report. A step is skipped at sizes where the previous ones predict more
than ``--budget-s`` seconds (the report then extrapolates it, saying so).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from nebula_ckpt import native
from nebula_ckpt.format import names as fnames
from nebula_ckpt.format.commit import Commit
from nebula_ckpt.format.manifest import encode_manifest
from nebula_ckpt.format.multi_rank import digest
from nebula_ckpt.format.rank_records import ranks_for
from nebula_ckpt.ranks import shards as ranks
from nebula_ckpt.ranks.split import first_of_class, signature, split_manifest, split_payload
from nebula_ckpt.restore.open import read_main_manifest, read_manifest
from nebula_ckpt.storage.local import LocalStorage

ROWS, COLS = 64, 1024  # a rank's piece of each parameter (fp32): the bytes do not matter here
NO_BYTES = memoryview(b"")
WHOLE = "whole metadata path: every step above (s)"
EXTRAPOLATED = "extrapolated: "  # subset_image slices the staged snapshot: nothing to slice here
SAVE_ID = "5a7e1d" * 5 + "00"


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


class Job:
    """One simulated job: each rank's index on demand (FSDP ranks differ; DDP ranks are alike)."""

    def __init__(self, kind: str, world: int, tensors: int) -> None:
        self.kind, self.world, self.tensors = kind, world, tensors
        self._ddp = rank_index(kind, 0, world, tensors) if kind == "ddp" else None

    def index(self, rank: int) -> dict[str, dict[str, Any]]:
        return self._ddp if self._ddp is not None else rank_index(self.kind, rank, self.world, self.tensors)


def durable(job: Job, rank: int, owners: dict[str, int], tree: Any, tree_digest: str,
            dts: list[str]) -> tuple[str, bytes, dict[str, Any]]:
    """What ``rank`` writes (its records file) and sends in the durable round, as the rounds make them."""
    idx = job.index(rank)
    keep = [k for k in idx if owners.get(k, rank) == rank]
    _, index, nbytes = ranks.subset_image(idx, keep, NO_BYTES)
    meta = {"tensors": idx, "tree": tree, "stats": {"tensor_bytes": nbytes, "copy_seconds": 0.1}}
    shard = {"file": fnames.shard_name(1, rank), "bytes": nbytes, "storage": {"stored_bytes": nbytes}}
    return split_payload(step=1, generation=1, rank=rank, world=job.world, save_id=SAVE_ID, shard=shard,
                         index=index, aliases={}, meta=meta, send_tree=rank == 0, tree_digest=tree_digest,
                         send_table=first_of_class(rank, dts), crc=native.get_ops().crc32c_bytes)


def every_payload(job: Job, owners: dict[str, int], tree: Any, tree_digest: str, dts: list[str], real: set[int],
                  template: dict[str, Any], step_dir: str) -> list[dict[str, Any]]:
    """What rank 0 receives in the durable round: real payloads (and records files written) for
    the ranks in ``real``, placeholders for the others."""
    parts: list[dict[str, Any]] = []
    for r in range(job.world):
        if r in real:
            name, data, payload = durable(job, r, owners, tree, tree_digest, dts)
            with open(os.path.join(step_dir, name), "wb") as f:
                f.write(data)
        else:
            payload = placeholder(template, r)
        parts.append(payload)
    return parts


def placeholder(template: dict[str, Any], rank: int) -> dict[str, Any]:
    """A rank whose records no measured step reads: a real payload's copy under its own names."""
    p = copy.deepcopy(template)
    p["shard"]["file"] = fnames.shard_name(1, rank)
    p["records"].update(file=fnames.records_name(1, rank), crc32c=0)
    p.update(tree=None, table=None)
    return p


def commit(step_dir: str, text: bytes, index: bytes) -> None:
    """Write ``ranks.json`` (``index``), the manifest ``text`` and its commit marker into ``step_dir``."""
    with open(os.path.join(step_dir, fnames.RANKS_FILE), "wb") as f:
        f.write(index)
    with open(os.path.join(step_dir, fnames.MANIFEST), "wb") as f:
        f.write(text)
    with open(os.path.join(step_dir, fnames.COMMIT), "wb") as f:
        f.write(Commit(1, 1, len(text), native.get_ops().crc32c_bytes(text)).to_bytes())


def reshard_regions(job: Job, man: Any) -> dict[str, Any]:
    """The regions the last rank of a job of half the ranks restores (its dim-0 rows of each DTensor)."""
    half = max(1, job.world // 2)
    q = half - 1
    out = {}
    for key, spec in man.layout.dtensors.items():
        rows = -(-spec.shape[0] // half)
        out[key] = ((q * rows, 0), (min(spec.shape[0], (q + 1) * rows) - q * rows, spec.shape[1]))
    return out


def simulate(kind: str, world: int, tensors: int, workdir: str, budget_s: float,
             predict: Callable[[str, int], Optional[float]], dcp_max: int) -> Sample:
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

    job = Job(kind.split("-")[0], world, tensors)
    reader = world - 1
    idx = job.index(reader)
    tree = rank_tree(idx)

    def digest_round() -> tuple[Any, int, dict[str, Any]]:
        rep, sharded = ranks.summary(idx)
        return rep, sharded, {"step": 1, "digest": digest(rep), "tree": digest(tree), "sharded": sharded,
                              "dt": digest(signature(idx)), "base": None, "save_id": SAVE_ID}
    rep, sharded, p1 = run("rank: digest round payload (s)", digest_round)
    s.values["rank 0 receives: digest round (B)"] = float(world * len(pickle.dumps(p1)))
    owners = run("rank: assign owners (s)", lambda: ranks.assign([rep] * world, [sharded] * world))
    dts = [p1["dt"]] * world
    # the ranks whose records a measured step reads: real payloads and files
    half = max(1, world // 2)
    real = {0, reader, *owners.values(), *range(max(0, 2 * (half - 1) - 1), world)} if kind == "fsdp" else \
        {0, reader, *owners.values()}
    s.values["busiest rank writes: its shard (B)"] = float(busiest(job, owners))
    td = p1["tree"]
    _, _, mine = run("rank: durable payload + records file (s)", lambda: durable(job, reader, owners, tree, td, dts))
    s.values["rank: sends in durable round (B)"] = float(len(pickle.dumps(mine)))
    root = os.path.join(workdir, f"{kind}-{world}")
    step_dir = os.path.join(root, fnames.step_dir(1))
    os.makedirs(step_dir, exist_ok=True)
    parts = every_payload(job, owners, tree, td, dts, real, mine, step_dir)
    s.values["rank 0 receives: durable round (B)"] = float(sum(len(pickle.dumps(p)) for p in parts))
    man, index = run("rank 0: build manifest + ranks.json (s)", lambda: split_manifest(
        step=1, generation=1, save_id=SAVE_ID, parts=parts, owners=owners, crc=native.get_ops().crc32c_bytes))
    text = run("rank 0: encode manifest (s)", lambda: encode_manifest(man))
    parts.clear()
    s.values["rank 0 writes: manifest.json (B)"] = float(len(text))
    s.values["rank 0 writes: ranks.json (B)"] = float(len(index))
    commit(step_dir, text, index)
    restore_side(job, LocalStorage(root), len(text), s, run)
    shutil.rmtree(root, ignore_errors=True)
    s.values[WHOLE] = sum(v for n, v in s.values.items() if n.startswith("rank") and n.endswith("(s)"))
    if dcp_max:
        dcp_planner(job, s, run, predict, budget_s, dcp_max)
    name = "dcp rank 0: create_global_plan (s)"
    dcp = s.values.get(name, s.values.get(EXTRAPOLATED + name))
    if dcp:
        s.values["dcp planner / whole metadata path (x)"] = dcp / s.values[WHOLE]
    return s


def restore_side(job: Job, st: LocalStorage, main_bytes: int, s: Sample,
                 run: Callable[[str, Callable[[], Any]], Any]) -> None:
    """Steps 3 and 4 of the module docstring, on the committed folder of ``st``."""
    reader = job.world - 1
    got = run("rank: restore plan: manifest + its records (s)", lambda: read_manifest(st, 1, "sim", ranks=[reader]))
    assert got.layout is not None and not got.layout.indexed, "a same-size restore reads no ranks.json"
    read = got.layout.providers([reader])
    s.values["rank reads at restore (B)"] = float(main_bytes + files_bytes(st, read))
    s.values["rank reads at restore: records files (n)"] = float(len(read))
    if job.kind != "fsdp":
        return  # plain replicated tensors reshard from their owners: the restore above

    def reshard() -> int:
        main = read_main_manifest(st, 1, "sim", index=False)  # on the grid: no ranks.json
        assert main.layout is not None, "the simulated job writes format version 4"
        need = ranks_for(main.layout, reshard_regions(job, main))
        assert need is not None
        loaded = read_manifest(st, 1, "sim", ranks=sorted(need - set(main.layout.owners.values())))
        assert loaded.layout is not None
        return main_bytes + files_bytes(st, loaded.layout.providers(loaded.layout.loaded))
    got_bytes = run("rank: reshard plan: find + read its sources' records (s)", reshard)
    if got_bytes is not None:
        s.values["rank reads to reshard (B)"] = float(got_bytes)


def files_bytes(st: LocalStorage, ranks_read: set[int]) -> int:
    """Bytes of the records files of ``ranks_read`` (what a reader of them reads)."""
    return sum(st.size(f"{fnames.step_dir(1)}/{fnames.records_name(1, r)}") for r in ranks_read)


def busiest(job: Job, owners: dict[str, int]) -> int:
    """Bytes of the largest shard: a rank's unreplicated tensors plus the replicas it owns."""
    load: dict[int, int] = {}
    indexes = {r: job.index(r) for r in set(owners.values())}
    for k, r in owners.items():
        rec = indexes[r][k]
        load[r] = load.get(r, 0) + rec["offsets"][1] - rec["offsets"][0]
    own = sum(rec["offsets"][1] - rec["offsets"][0] for k, rec in job.index(job.world - 1).items() if k not in owners)
    return own + max(load.values(), default=0)


def dcp_planner(job: Job, s: Sample, run: Callable[[str, Callable[[], Any]], Any],
                predict: Callable[[str, int], Optional[float]], budget_s: float, max_ranks: int) -> None:
    """DCP's save planner over ``world`` local plans of the same items (what ``dcp.save`` runs on rank 0)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    name = "dcp rank 0: create_global_plan (s)"
    guess = predict(name, job.world)
    if guess is not None and (guess > budget_s or job.world > max_ranks):  # its plans alone take as long
        s.skipped[name] = (f"not run above {max_ranks:,} ranks (--dcp-max-ranks) or over {budget_s:.0f} s: "
                           f"{guess:.1f} s extrapolated with its exponent")
        s.values[EXTRAPOLATED + name] = guess
        return

    def plan(r: int) -> SavePlan:
        items = []
        for key, rec in job.index(r).items():
            dt = rec.get("dtensor")
            size = torch.Size(dt["shape"] if dt else rec["shape"])
            offs = torch.Size(dt["offsets"] if dt else [0] * len(rec["shape"]))
            items.append(WriteItem(index=MetadataIndex(key.replace("/", "."), offs), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(
                                       chunk=ChunkStorageMetadata(offsets=offs, sizes=torch.Size(rec["shape"])),
                                       properties=TensorProperties(dtype=torch.float32), size=size)))
        return SavePlan(items, planner_data={})

    plans = [plan(r) for r in range(job.world)]
    s.values["dcp rank 0 receives: local plans (B)"] = float(sum(len(pickle.dumps(p)) for p in plans))
    planner = DefaultSavePlanner()
    out = run(name, lambda: planner.create_global_plan(plans))
    if out is not None:
        s.values["dcp rank 0 writes: metadata (B)"] = float(len(pickle.dumps(out[1])))


@contextlib.contextmanager
def owner_ranks(n: int) -> Iterator[None]:
    """Within the block, replicated tensors are written by ranks 0..n-1 (0: by every rank)."""
    saved, ranks.REPLICA_OWNER_RANKS = ranks.REPLICA_OWNER_RANKS, n
    try:
        yield
    finally:
        ranks.REPLICA_OWNER_RANKS = saved


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
    if name.endswith("(x)"):
        return f"{v:.1f}x"
    if name.endswith("(n)"):
        return f"{v:,.0f}"
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
        if n.startswith(EXTRAPOLATED):
            continue
        row = [fmt(n, s.values[n]) if n in s.values else
               f"~{fmt(n, s.values[EXTRAPOLATED + n])} (extrapolated)" if EXTRAPOLATED + n in s.values else "skipped"
               for s in samples]
        f = fit([(s.ranks, s.values[n]) for s in samples if n in s.values])
        fits[n] = None if f is None else {"k": f[0], "a": f[1]}
        lines.append(f"| {n} | " + " | ".join(row) + f" | {'' if f is None else f'{f[0]:.2f}'} |")
    skipped = [f"- {s.ranks:,} ranks, {n}: {why}" for s in samples for n, why in s.skipped.items()]
    return "\n".join(lines + ([""] + skipped if skipped else [])) + "\n", fits


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="256,1024,4096,16384", help="comma-separated simulated world sizes")
    p.add_argument("--dcp-max-ranks", type=int, default=1024,
                   help="run DCP's planner up to this size (its local plans take GBs beyond), extrapolate above")
    p.add_argument("--tensors", type=int, default=1000, help="tensors per rank")
    p.add_argument("--kinds", default="fsdp,ddp,ddp-spread")
    p.add_argument("--budget-s", type=float, default=120.0, help="skip a step predicted to take longer")
    p.add_argument("--out", default=None, help="folder for results.md / results.json")
    a = p.parse_args(argv)
    started = time.monotonic()
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

            spread = kind.endswith("-spread")
            for n in sizes:
                with owner_ranks(0 if spread else ranks.REPLICA_OWNER_RANKS):
                    samples.append(simulate(kind, n, a.tensors, work, a.budget_s, predict,
                                            0 if spread else a.dcp_max_ranks))
                print(f"{kind} {n} ranks: " + ", ".join(f"{k} {fmt(k, v)}" for k, v in samples[-1].values.items()),
                      flush=True)
            text, fits = report(kind, a.tensors, samples)
            md.append(text)
            doc["kinds"][kind] = {"samples": [{"ranks": s.ranks, "values": s.values, "skipped": s.skipped}
                                              for s in samples], "fits": fits}
    md.append(f"Wall time of the whole run: {time.monotonic() - started:.0f} s.\n")
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
