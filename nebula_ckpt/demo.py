"""``make demo``: train, crash hard, resume from the newest healthy checkpoint, compare with torch.save.

1. A reference run trains a small transformer on generated text without interruption.
2. A training run saves with ``save_async`` every few steps and kills itself with SIGKILL mid-run.
3. A new process resumes with ``load_latest`` (from the memory tier; ``--wipe-memory`` deletes it
   first, so the resume comes from the persistent tier) and trains to the end.
4. The demo shows the loss curve continuing exactly where the checkpoint left it (bit-identical to
   the reference run), then the blocking time of ``save_async`` next to ``torch.save`` of the same
   state, measured in the same run.

Run: ``python -m nebula_ckpt.demo [--wipe-memory] [--steps 300] [--every 20] [--root DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple

import torch

VOCAB, SEQ, BATCH = 48, 32, 8


class TinyGPT(torch.nn.Module):
    """A small decoder-only transformer."""

    def __init__(self, d: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, d)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        mask: torch.Tensor = self.mask  # type: ignore[assignment]
        h = self.blocks(h, mask=mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def batch(step: int) -> torch.Tensor:
    """Generated 'text': noisy arithmetic sequences, a deterministic function of the step."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(BATCH, SEQ + 1, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g), seq)


def make(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    return model, opt, sched


def train_step(model: TinyGPT, opt: torch.optim.Optimizer, sched: Any, step: int) -> float:
    xy = batch(step)
    logits = model(xy[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), xy[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss.item()


# -- child processes ------------------------------------------------------------------------------

def child(args: argparse.Namespace) -> None:
    import nebula_ckpt as nc

    torch.set_num_threads(1)  # bit-exact continuation across processes
    model, opt, sched = make()
    log = open(args.log, "a", buffering=1)
    if args.child == "reference":
        for step in range(args.steps):
            log.write(json.dumps({"step": step, "loss": train_step(model, opt, sched, step)}) + "\n")
        return
    ckpt = nc.Checkpointer(args.root, keep_last=2)
    start = 0
    state = {"model": model, "optim": opt, "sched": sched, "step": 0}
    if args.child == "resume":
        t0 = time.perf_counter()
        got = ckpt.load_latest(into=state)
        info = dict(ckpt.last_restore or {})
        info.update({"event": "resumed", "seconds": time.perf_counter() - t0})
        log.write(json.dumps(info) + "\n")
        start = state["step"] + 1 if got is not None else 0
    blocking = []
    for step in range(start, args.steps):
        loss = train_step(model, opt, sched, step)
        log.write(json.dumps({"step": step, "loss": loss}) + "\n")
        if step % args.every == 0:
            state["step"] = step
            t0 = time.perf_counter()
            ckpt.save_async(step, state)
            blocking.append(time.perf_counter() - t0)
        if args.child == "crash" and step == args.kill_at:
            log.write(json.dumps({"event": "SIGKILL", "step": step}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.wait()
    # torch.save of the same state, in the same process, for comparison (fsync'd, like ours).
    ts = []
    path = os.path.join(args.root, "torch_save.pt")
    for _ in range(3):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                        "step": state["step"]}, f)
            f.flush()
            os.fsync(f.fileno())
        ts.append(time.perf_counter() - t0)
    os.unlink(path)
    h = ckpt.save_async(args.steps, state)
    t_durable0 = time.perf_counter()
    h.result()
    durable = time.perf_counter() - t_durable0
    ckpt.close()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    log.write(json.dumps({"event": "timing", "save_async_ms": [b * 1e3 for b in blocking],
                          "torch_save_ms": [t * 1e3 for t in ts], "durable_after_ms": durable * 1e3,
                          "state_mb": nbytes / 2**20}) + "\n")


# -- the parent -------------------------------------------------------------------------------------

def _run(args: argparse.Namespace, mode: str, log: str) -> int:
    cmd = [sys.executable, "-m", "nebula_ckpt.demo", "--child", mode, "--root", args.root, "--log", log,
           "--steps", str(args.steps), "--every", str(args.every), "--kill-at", str(args.kill_at)]
    return subprocess.call(cmd)


def _read(log: str) -> list[dict[str, Any]]:
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def _curve(points: list[tuple[int, float]], width: int = 50) -> list[str]:
    lo, hi = min(v for _, v in points), max(v for _, v in points)
    return [f"  step {s:4d}  {v:7.4f}  " + "#" * (1 + int((v - lo) / (hi - lo + 1e-12) * (width - 1)))
            for s, v in points]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's command line (the child-process flags are hidden); fills in the default ``--kill-at``."""
    p = argparse.ArgumentParser(prog="python -m nebula_ckpt.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=os.path.abspath("demo_ckpt"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=None, help="step at which the run kills itself")
    p.add_argument("--wipe-memory", action="store_true",
                   help="delete the memory tier after the crash: resume from the persistent tier")
    p.add_argument("--child", choices=["reference", "crash", "resume"], help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kill_at is None:
        args.kill_at = int(args.steps * 0.55) + 7  # between two saves
    return args


def _run_all(args: argparse.Namespace, logs: dict[str, str], say: Callable[..., None]) -> bool:
    """Steps 1-3 in fresh directories: reference run, crashing run, resumed run; False if the resume failed."""
    from nebula_ckpt.tiers.memory.tier import memory_tier_path

    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    shm = memory_tier_path(args.root)
    shutil.rmtree(shm, ignore_errors=True)
    say(f"nebula_ckpt demo: {args.steps} steps of a small transformer, save_async every {args.every} steps,"
        f" checkpoints in {args.root}")
    say("[1/3] reference run, no interruption ...")
    _run(args, "reference", logs["reference"])
    say(f"[2/3] training run, kills itself with SIGKILL at step {args.kill_at} ...")
    rc = _run(args, "crash", logs["crash"])
    say(f"      process ended with {'SIGKILL' if rc == -signal.SIGKILL else rc}")
    if args.wipe_memory:
        shutil.rmtree(shm, ignore_errors=True)
        say(f"      --wipe-memory: deleted the memory tier {shm} (as on a new machine)")
    say("[3/3] new process: load_latest() and train to the end ...")
    rc2 = _run(args, "resume", logs["resume"])
    if rc2 != 0:
        say(f"resume run failed with exit code {rc2}")
        return False
    return True


class _Logs(NamedTuple):
    """What the three runs logged, as the report needs it."""

    ref: dict[int, float]  # step -> loss of the uninterrupted reference run
    crash: list[dict[str, Any]]  # loss records of the run that killed itself
    resumed: dict[str, Any]  # the resumed run's "resumed" event (step, tier, seconds)
    timing: dict[str, Any]  # the resumed run's "timing" event
    after: list[dict[str, Any]]  # loss records of the resumed run


def _read_logs(logs: dict[str, str]) -> _Logs:
    """Read the three runs' logs (raises if the resumed run logged no resume or timing event)."""
    ref = {r["step"]: r["loss"] for r in _read(logs["reference"]) if "loss" in r}
    crash = [r for r in _read(logs["crash"]) if "loss" in r]
    resume = _read(logs["resume"])
    ev = next(r for r in resume if r.get("event") == "resumed")
    timing = next(r for r in resume if r.get("event") == "timing")
    after = [r for r in resume if "loss" in r]
    return _Logs(ref, crash, ev, timing, after)


def _show_resume(args: argparse.Namespace, got: _Logs, say: Callable[..., None]) -> bool:
    """Print where the resume came from and the loss curve; True if the resumed losses match the reference."""
    ev, after = got.resumed, got.after
    say(f"\nresumed from step {ev.get('step')} on tier {ev.get('tier')} in {ev['seconds'] * 1e3:.0f} ms"
        f" (crashed at step {args.kill_at}; {args.kill_at - ev.get('step', 0)} steps redone)")
    pts = [(r["step"], r["loss"]) for r in got.crash if r["step"] % 25 == 0]
    pts += [(r["step"], r["loss"]) for r in after if r["step"] % 25 == 0 or r is after[0]]
    say("loss curve (crashed run, then resumed run):")
    for line in _curve(sorted(set(pts))):
        say(line)
    same = all(got.ref[r["step"]] == r["loss"] for r in after)
    say(f"resumed losses identical to the uninterrupted reference run: {'YES' if same else 'NO'}"
        f" ({len(after)} steps compared)")
    return same


def _show_timing(args: argparse.Namespace, timing: dict[str, Any], say: Callable[..., None]) -> None:
    """Print save_async's blocking time next to torch.save's, as the resumed run measured them."""
    sa, ts = statistics.median(timing["save_async_ms"]), statistics.median(timing["torch_save_ms"])
    say(f"\nstate: {timing['state_mb']:.1f} MiB (model + AdamW)")
    say(f"  save_async blocking (median of {len(timing['save_async_ms'])}): {sa:8.2f} ms")
    say(f"  torch.save + fsync   (median of 3):  {ts:8.2f} ms")
    say(f"  -> training blocked {ts / max(sa, 1e-6):.0f}x less; durable {timing['durable_after_ms']:.0f} ms later"
        " in the background")
    cli = cli_command()
    say(f"\nTry: {cli} ls {shlex.quote(args.root)}   |   {cli} verify {shlex.quote(args.root)}")


def cli_command(cwd: str | None = None) -> str:
    """How to run ``nebula-ckpt`` from ``cwd`` (default: here) as typed in a shell: the bare name when
    it is on PATH as this Python's console script, else that script's path (``.venv/bin/nebula-ckpt``
    for ``make demo``), else ``python -m nebula_ckpt.cli`` with this Python."""
    script = os.path.join(os.path.dirname(sys.executable), "nebula-ckpt")
    if not os.path.isfile(script):
        return f"{shlex.quote(sys.executable)} -m nebula_ckpt.cli"
    found = shutil.which("nebula-ckpt")
    if found and os.path.realpath(found) == os.path.realpath(script):
        return "nebula-ckpt"
    rel = os.path.relpath(script, cwd or os.getcwd())
    if rel.startswith(".."):
        rel = script
    elif os.sep not in rel:
        rel = os.path.join(os.curdir, rel)  # a bare name would be looked up on PATH
    return shlex.quote(rel)


def main(argv: list[str] | None = None) -> int:
    """Run the demo (or, with the hidden ``--child``, one of its training processes); 0 on success."""
    args = _parse_args(argv)
    if args.child:
        child(args)
        return 0
    logs = {m: os.path.join(args.root, f"{m}.jsonl") for m in ("reference", "crash", "resume")}
    say = print
    if not _run_all(args, logs, say):
        return 1
    got = _read_logs(logs)
    same = _show_resume(args, got, say)
    _show_timing(args, got.timing, say)
    return 0 if same and got.resumed.get("step") is not None else 1


if __name__ == "__main__":
    sys.exit(main())
