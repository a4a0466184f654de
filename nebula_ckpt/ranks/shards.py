"""Multi-rank checkpoints: who writes which tensor, and each rank's shard image.

Pure functions over metadata (no I/O, no collectives), used by the tier writers and the DCP writer:

* :func:`summary` / :func:`assign` — deduplication of replicated state, as DCP's save planner
  does it: a tensor every rank holds under the same key with the same dtype, shape and
  checksum (DDP parameters and optimizer state, replicated buffers, a DTensor placed
  ``Replicate`` everywhere) is written once, by one rank; the owners are chosen so the bytes
  each rank writes are balanced (largest first, to the rank with the fewest bytes so far). The
  checksums were taken while copying, so a tensor that *differs* between ranks (per-rank RNG
  state, say) is never mistaken for a replica: each rank then writes its own.
* :func:`subset_image` — the safetensors image of a rank's share: a new header and the byte
  ranges of the staged snapshot (no copy).
* :func:`peer_problem` — why a save cannot commit, from the ranks' phase payloads.

The manifests themselves are built in :mod:`nebula_ckpt.format` (version 2, a rank's own:
:mod:`nebula_ckpt.format.multi_rank`; version 4: :mod:`nebula_ckpt.format.rank_index`), and the
digest the ranks compare is :func:`nebula_ckpt.format.multi_rank.digest`.
"""

from __future__ import annotations

import heapq
from typing import Any, Optional

from nebula_ckpt.format.dtypes import TENSOR_DTYPES
from nebula_ckpt.format.header import safetensors_header

#: multi-rank: replicated tensors smaller than this are all written by rank 0 (larger ones are
#: spread over the ranks)
SMALL_REPLICA_BYTES = 64 << 10
#: multi-rank: replicated tensors are written by ranks 0..N-1 only (0: by every rank); a restoring
#: rank then reads at most N+1 records files, and each of those ranks writes about 1/N of the
#: replicated bytes
REPLICA_OWNER_RANKS = 64

Entry = tuple[int, int, str, tuple[int, ...]]


def summary(tensor_index: dict[str, dict[str, Any]]) -> tuple[dict[str, Entry], int]:
    """What the ranks compare before writing: the replicable tensors (plain ones and DTensors
    placed ``Replicate`` everywhere) as key -> (bytes, crc32c, dtype, shape), and the bytes of
    the others (sharded: this rank's own, never a replica)."""
    out: dict[str, Entry] = {}
    sharded = 0
    for k, rec in tensor_index.items():
        start, end = rec["offsets"]
        dt = rec.get("dtensor")
        if dt is None or all(p == "R" for p in dt["placements"]):
            out[k] = (end - start, rec["crc32c"], rec["dtype"], tuple(rec["shape"]))
        else:
            sharded += end - start
    return out, sharded


def assign(summaries: list[dict[str, Entry]], base: Optional[list[int]] = None) -> dict[str, int]:
    """Owner rank of every replicated key (every rank computes the same answer from the same input).

    A key is replicated when every rank has it with equal bytes, checksum, dtype and shape. Keys
    not in the result are written by every rank that has them. ``base``: bytes each rank writes
    anyway (its sharded state), so owners balance the total. Replicas under
    :data:`SMALL_REPLICA_BYTES` (optimizer step counts, scalars) all belong to rank 0: a rank that
    restores a sharded (FSDP) state then reads its own shard and rank 0's, not a piece of every
    rank's (a whole download each, on a blob store). Larger replicas go to the first
    :data:`REPLICA_OWNER_RANKS` ranks only (a contiguous block; 0: every rank), so that a restoring
    rank reads the records files of that many owners at most, whatever the number of ranks.
    """
    small = int(SMALL_REPLICA_BYTES)
    block = int(REPLICA_OWNER_RANKS)
    if len(summaries) < 2:
        return {}
    first = summaries[0]
    if all(s is first for s in summaries):  # equal digests (DDP): every key is replicated, no rank holds more
        replicated = list(first)
        load = [base[i] if base else 0 for i in range(len(summaries))]
    else:
        replicated = [k for k, v in first.items() if all(s.get(k) == v for s in summaries[1:])]
        rep = set(replicated)
        load = [(base[i] if base else 0) + sum(v[0] for k, v in s.items() if k not in rep)
                for i, s in enumerate(summaries)]
    eligible = len(load) if block <= 0 else min(block, len(load))
    heap = [(n, i) for i, n in enumerate(load[:eligible])]  # the least loaded owner, lowest first: O(log) a key
    heapq.heapify(heap)
    owners: dict[str, int] = {}
    for k in sorted(replicated, key=lambda k: (-first[k][0], k)):
        nbytes = first[k][0]
        if nbytes < small:
            owners[k] = 0
            load[0] += nbytes
            continue
        while heap[0][0] != load[heap[0][1]]:  # an entry made stale by a small replica on rank 0
            heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
        r = heap[0][1]
        owners[k] = r
        load[r] += nbytes
        heapq.heapreplace(heap, (load[r], r))
    return owners


def subset_image(tensor_index: dict[str, dict[str, Any]], keep: list[str],
                 view: memoryview) -> tuple[list[memoryview], dict[str, dict[str, Any]], int]:
    """The safetensors image of the tensors ``keep`` of a staged snapshot ``view``.

    Returns ``(parts, index, nbytes)``: the image as parts to write back to back (the new header,
    then ranges of ``view``: no bytes are copied), the tensor index of the image (offsets in it,
    checksums unchanged) and its size. Tensors keep their order in the snapshot, so each stays
    naturally aligned.
    """
    keys = sorted(keep, key=lambda k: tensor_index[k]["offsets"][0])
    items = [(k, TENSOR_DTYPES[tensor_index[k]["dtype"]], tuple(tensor_index[k]["shape"]),
              tensor_index[k]["offsets"][1] - tensor_index[k]["offsets"][0]) for k in keys]
    head, spans = safetensors_header(items)
    parts: list[memoryview] = [memoryview(head)]
    index: dict[str, dict[str, Any]] = {}
    for k, (p, e) in zip(keys, spans, strict=True):
        rec = tensor_index[k]
        start, end = rec["offsets"]
        if end > start:
            parts.append(view[start:end])
        index[k] = dict(rec, offsets=[len(head) + p, len(head) + e])
    return parts, index, len(head) + (spans[-1][1] if spans else 0)


def prefixed(mapping: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``mapping`` with every key under ``prefix`` (``r<R>/``: a rank's keys in a multi-rank
    manifest); ``mapping`` itself for an empty prefix."""
    return {prefix + k: v for k, v in mapping.items()} if prefix else mapping


def peer_problem(entries: list[Any], step: int, tier: str) -> Optional[tuple[bool, str]]:
    """Why a save cannot commit on ``tier`` from the ranks' phase payloads, or None.

    Returns ``(skipped, why)``: ``skipped`` when a rank only did not write it (its cadence, a
    newer save, no staging buffer) rather than failed.
    """
    missing = [r for r, e in enumerate(entries) if e is None]
    if missing:
        return True, (f"rank(s) {missing[:8]} did not write step {step} on tier {tier} (skipped or dropped "
                      "there); it is not committed on that tier")
    failed = [(r, e["error"]) for r, e in enumerate(entries) if "error" in e]
    if failed:
        return False, f"step {step} failed on rank(s) {[r for r, _ in failed][:8]} (tier {tier}): {failed[0][1]}"
    steps = {e["step"] for e in entries if "step" in e}
    if len(steps) > 1:
        return False, (f"the ranks saved different steps as one save ({sorted(steps)[:8]}): every rank must "
                       "call save_async with the same step in the same order")
    return None
