"""Remote-tier throughput against a plain fsspec transfer of the same bytes to the same server.

For each target (a URL, or the local emulators Azurite and moto of
``tests/blob/emulators.py``, the ones the test suite uses), in one run:

* **upload**: time until a checkpoint is durable on a remote-only ``Checkpointer`` (shard +
  manifest + commit) versus ``fs.put_file`` of the very same shard file;
* **download**: ``load`` from the remote tier alone (ranged parallel reads + full CRC32C
  verification + copy into the model) versus ``fs.cat_file`` of the same object.

Reported as MB/s and as a ratio (target: >= 90 %). Run: ``python -m benchmarks.remote
--emulators`` (after ``scripts/install_blob_servers.sh``) or ``--url URL
--storage-options JSON``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any, Iterator, Optional

import torch

log = logging.getLogger(__name__)


def _state(mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = mb * (1 << 20) // 4 // 8
    return {f"w{i}": torch.randn(n, generator=g) for i in range(8)}


def measure(url: str, storage_options: dict[str, Any], mb: int, reps: int) -> dict[str, Any]:
    """Upload / download throughput of nebula_ckpt's remote tier vs plain fsspec, same bytes."""
    import fsspec

    import nebula_ckpt as nc
    from nebula_ckpt.storage.remote import FsspecStorage

    state = _state(mb)
    up_nc, up_fs, down_nc, down_fs = [], [], [], []
    root = f"{url.rstrip('/')}/bench-{uuid.uuid4().hex[:8]}"
    fs, _ = fsspec.core.url_to_fs(root, **storage_options)
    tier = nc.RemoteTier(root, storage_options=storage_options, keep_last=2)
    st = FsspecStorage(root, storage_options)
    with nc.Checkpointer(root, tiers=[tier]) as ck:
        ck.save(0, state)  # warm-up: staging buffer, writer generation, connections
        shard_rel = next(f"step-0/{n}" for n in st.list("step-0") if n.endswith(".safetensors"))
        data = bytes(st.read_buffer(shard_rel))
        nbytes = len(data)
        with tempfile.NamedTemporaryFile(dir=os.getcwd(), suffix=".safetensors") as f:
            f.write(data)
            f.flush()
            for rep in range(1, reps + 1):
                t0 = time.perf_counter()
                ck.save(rep, state)   # shard + manifest + commit marker + retention
                up_nc.append(time.perf_counter() - t0)
                path = fs._strip_protocol(f"{root}/plain-{rep}.bin")
                t0 = time.perf_counter()
                fs.put_file(f.name, path)
                up_fs.append(time.perf_counter() - t0)
                into = {k: torch.empty_like(v) for k, v in state.items()}
                t0 = time.perf_counter()
                ck.load(rep, into=into)  # ranged parallel reads + CRC32C of every tensor + copy
                down_nc.append(time.perf_counter() - t0)
                if not all(torch.equal(into[k], state[k]) for k in state):
                    raise AssertionError("remote restore is not bit-exact")
                t0 = time.perf_counter()
                got = fs.cat_file(path)  # the same bytes, put above with fs.put_file
                down_fs.append(time.perf_counter() - t0)
                if len(got) != nbytes:
                    raise AssertionError("fs.cat_file returned a different size")
    st.close()
    mbs = nbytes / 1e6

    def rate(ts: list[float]) -> float:
        return mbs / statistics.median(ts)

    out = {"bytes": nbytes, "reps": reps,
           "upload_nebula_MBps": rate(up_nc), "upload_put_file_MBps": rate(up_fs),
           "download_nebula_MBps": rate(down_nc), "download_cat_file_MBps": rate(down_fs)}
    out["upload_ratio"] = out["upload_nebula_MBps"] / out["upload_put_file_MBps"]
    out["download_ratio"] = out["download_nebula_MBps"] / out["download_cat_file_MBps"]
    return out


def _emulators() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(name, container URL, storage options)`` per emulator, each closed after its turn."""
    # the launchers belong to the test suite (tests/blob/emulators.py); a checkout has both
    from tests.blob.emulators import AzuriteEmulator, Emulator, MotoEmulator

    for name, cls in (("azurite", AzuriteEmulator), ("moto_s3", MotoEmulator)):
        emulator: Emulator = cls()
        with emulator:
            yield name, emulator.create_container("bench"), emulator.storage_options


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The results as a markdown table with the >= 90 % target."""
    lines = ["| server | state MB | upload nebula MB/s | fs.put_file MB/s | ratio | download nebula MB/s "
             "| fs.cat_file MB/s | ratio |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['bytes'] / 1e6:.0f} | {r['upload_nebula_MBps']:.0f} | "
                     f"{r['upload_put_file_MBps']:.0f} | {r['upload_ratio']:.0%} "
                     f"{'met' if r['upload_ratio'] >= 0.9 else 'NOT met'} | {r['download_nebula_MBps']:.0f} | "
                     f"{r['download_cat_file_MBps']:.0f} | {r['download_ratio']:.0%} "
                     f"{'met' if r['download_ratio'] >= 0.9 else 'NOT met'} |")
    lines.append("\nnebula upload = time to durable (shard + manifest + commit marker); nebula download = "
                 "load() with full CRC32C verification, into existing tensors.")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.remote", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--storage-options", type=json.loads, default={})
    p.add_argument("--emulators", action="store_true", help="start Azurite and moto_server on 127.0.0.1")
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="folder for remote.json / remote.md")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.emulators and not args.url:
        p.error("give --url or --emulators")
    targets = _emulators() if args.emulators else iter([("remote", args.url, args.storage_options)])
    results: dict[str, dict[str, Any]] = {}
    for name, url, so in targets:  # each emulator is closed right after its measurement
        results[name] = measure(url, so, args.mb, args.reps)
    text = markdown(results)
    sys.stdout.write(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "remote.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "remote.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
