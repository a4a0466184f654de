"""Moving from Azure ML Nebula: Nebula's documented ``torch_nebula`` calls, unchanged, on nebula_ckpt.

    python examples/nebula_compat.py                       # a temporary root
    python examples/nebula_compat.py --root /tmp/ckpt/nebula-run

The only change to a Nebula script is the import (or ``nebula_ckpt.compat.install_aliases()``
before it, which makes ``import torch_nebula`` / ``import nebulaml`` resolve here). The run trains
a small model, commits a checkpoint of two parts (model, optimizer) every few steps, lists them,
prints the checkpoint histories Nebula wrote to ``checkpointHistories.csv``, then "restarts"
(shutdown + init) and resumes from the latest checkpoint, checking it bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

import nebula_ckpt.compat.torch_nebula as tn  # was: import torch_nebula as tn


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
    (model(x) - x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def same(a: dict, b: dict) -> bool:
    """Bit-exact equality of two state dicts (tensors by their bytes)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not (isinstance(y, dict) and same(x, y)):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y)):
                return False
        elif x != y:
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help="checkpoint root (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    args = ap.parse_args()
    root = args.root or os.path.join(tempfile.mkdtemp(prefix="nebula-compat-"), "ckpt")

    # Nebula: tn.init(persistent_storage_path, persistent_time_interval=2)
    tn.init(persistent_storage_path=root, persistent_time_interval=2, num_of_version_in_retention=2)
    model, opt = build()
    for step in range(1, args.steps + 1):
        train_step(model, opt, step)
        if step % args.every == 0:
            checkpoint = tn.Checkpoint(f"global_step{step}", 2)   # tag, num_of_files
            checkpoint.save("model", model)
            checkpoint.save("optimizer", opt)                      # the 2nd part commits it
            checkpoint.commit()                                    # confirms it (True)
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    tn.flush_persistence()

    print("list_checkpoints():", json.dumps(tn.list_checkpoints(), indent=1))
    print("get_checkpoint(tag='global_step8'):", tn.get_checkpoint(tag="global_step8"))
    for h in tn.checkpoint_histories():
        print(f"history: {h['tag']}: {h['size_bytes']} B, blocking {h['blocking_seconds'] * 1e3:.1f} ms, "
              f"durable after {h['duration_seconds'] * 1e3:.1f} ms on {len(h['tiers'])} tier(s), {h['status']}")
    csv_path = tn.write_checkpoint_histories(os.path.join(os.path.dirname(root), "checkpointHistories.csv"))
    print("histories written to", csv_path)
    tn.shutdown()

    # a new process would do this (same root): resume from the latest checkpoint
    tn.init(persistent_storage_path=root)
    model2, opt2 = build()
    latest = tn.get_latest_checkpoint()
    assert latest is not None, "no checkpoint found"
    model2.load_state_dict(latest.load("model"))
    opt2.load_state_dict(latest.load("optimizer"))
    ok = same(model2.state_dict(), saved_model) and same(opt2.state_dict(), saved_opt)
    print(f"resumed from {latest.tag} (step {latest.step}): {'bit-exact' if ok else 'MISMATCH'}")
    tn.shutdown()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
