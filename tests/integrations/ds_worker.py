"""A one-rank DeepSpeed job on the CPU (gloo), run as a subprocess by ``test_deepspeed.py``.

    python ds_worker.py roundtrip STAGE ROOT SAVE_DIR OUT.json
        train a few steps, engine.save_checkpoint through nebula_ckpt, load it into a fresh
        engine (other seed) and compare everything bit for bit; write the verdict to OUT.json
    python ds_worker.py train STAGE ROOT SAVE_DIR OUT.json STEPS EVERY [KILL_AT] [resume] [durable_all]
        train STEPS steps (fixed seed, dropout), save_checkpoint every EVERY steps, append each
        step's loss (float.hex) to OUT.json lines; with KILL_AT: SIGKILL itself after that step;
        with "resume": load_checkpoint(SAVE_DIR) first and go on from the step it restored
    python ds_worker.py same_tag STAGE ROOT SAVE_DIR OUT.json
        save tag "keep" once and tag "last" four times through nebula_ckpt, and tag "last" four
        times with stock DeepSpeed (SAVE_DIR-stock): what each keeps
    python ds_worker.py pointer_alone 0|memory ROOT SAVE_DIR OUT.json
        one of 2 gloo ranks (env://): a multi-rank save (on the memory tiers only: ``memory``) and
        its pointer files, then a torch.load of one on rank 0 alone, in the job and after it (no
        DeepSpeed needed)

DeepSpeed is made to run without building any op: ``DS_ACCELERATOR=cpu`` and no JIT-built
shared-memory collective (one rank has nothing to share; gloo does the rest).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

HIDDEN = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank() -> None:
    """A rank of a gloo job as a launcher describes it (env://); alone, rank 0 of 1."""
    for k, v in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                     LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed.ops

    # Probing op compatibility runs the compiler and makes DeepSpeed JIT-build its shared-memory
    # collective (over a minute on 2 cores); a CPU job of one rank needs neither.
    deepspeed.ops.__compatible_ops__ = {}  # type: ignore[attr-defined]
    torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, HIDDEN)
        self.drop = torch.nn.Dropout(0.1)
        self.hid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hid(self.drop(torch.relu(self.inp(x))))))


def make_engine(stage: int, seed: int) -> Any:
    import deepspeed

    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 5}}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(engine: Any, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    """Every place where ``a`` and ``b`` differ (tensors bit for bit: dtype, shape, bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
        elif a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(_bytes(a), _bytes(b)):
            out.append(f"{path}: values differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            out.append(f"{path}: keys {list(a)} vs {list(b)}")
        for k in a:
            if k in b:
                _diff(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            out.append(f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _diff(x, y, f"{path}[{i}]", out)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        if type(a) is not type(b):
            out.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
        else:
            _diff(vars(a), vars(b), f"{path}.", out)
    elif a != b and not (a != a and b != b):  # NaN == NaN here
        out.append(f"{path}: {a!r} vs {b!r}")


def _snap(obj: Any) -> Any:
    """A copy of ``obj`` that later training cannot change (tensors cloned, containers rebuilt)."""
    import copy

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _snap(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_snap(v) for v in obj]
    if isinstance(obj, tuple):
        vals = [_snap(v) for v in obj]
        return type(obj)(*vals) if hasattr(obj, "_fields") else type(obj)(vals)
    return copy.deepcopy(obj)


def full_state(engine: Any) -> dict[str, Any]:
    return _snap({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                          "lr_scheduler": engine.lr_scheduler.state_dict(), "global_steps": engine.global_steps,
                          "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps})


def roundtrip(stage: int, root: str, save_dir: str, out: str) -> None:
    from nebula_ckpt.errors import NotFoundError
    from nebula_ckpt.integrations.deepspeed import NebulaCkptEngine, enable, materialize
    from nebula_ckpt.integrations.deepspeed_files import read_pointer

    init_rank()
    a = make_engine(stage, seed=0)
    ce = enable(a, root)
    for s in range(3):
        train_step(a, s)
    saved_first = full_state(a)
    a.save_checkpoint(save_dir, tag="first")
    for s in range(3, 5):
        train_step(a, s)
    saved = full_state(a)
    rng = torch.get_rng_state()
    a.save_checkpoint(save_dir, client_state={"rng": rng, "note": "x"})  # tag global_step5
    ce.wait()
    tag = open(os.path.join(save_dir, "latest")).read().strip()
    files = sorted(os.path.relpath(os.path.join(d, f), save_dir) for d, _, fs in os.walk(save_dir) for f in fs)
    pointers = {f: read_pointer(os.path.join(save_dir, f))["key"] for f in files if f.endswith(".pt")}
    tags = ce.checkpointer.tags()
    loss_a = train_step(a, 5)
    # DeepSpeed's own zero_to_fp32 reads the pointer files with torch.load (they redirect to the root)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32_mismatch: Any = "not run"
    if stage > 0 and int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process reads one rank's checkpoint
        fp32 = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
        fp32_mismatch = []
        _diff({k: v.float() for k, v in saved["module"].items()}, {k: fp32[k] for k in saved["module"]}, "fp32",
              fp32_mismatch)
    fp32_refused: Any = "not run"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torch.load of a pointer reads alone: refused, naming the fix
        try:
            get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
            fp32_refused = "not refused"
        except NotFoundError as e:
            fp32_refused = f"{type(e).__name__}: {e}"
        torch.distributed.barrier()

    b = make_engine(stage, seed=1)  # other weights, no optimizer state yet
    ceb = enable(b, root)
    assert isinstance(b.checkpoint_engine, NebulaCkptEngine)
    before: list[str] = []
    _diff(saved["module"], b.module.state_dict(), "module", before)
    load_path, client = b.load_checkpoint(save_dir)  # the tag `latest` names
    restored = full_state(b)
    mismatches: list[str] = []
    _diff(saved, restored, "", mismatches)
    client_ok = torch.equal(client["rng"], rng) and client["note"] == "x"
    tier = ceb.checkpointer.last_restore
    torch.set_rng_state(client["rng"])  # dropout goes on as in `a`
    loss_b = train_step(b, 5)
    # the torch.save files of tag "first" for other tools; DeepSpeed's own loader reads them
    written = materialize(save_dir, "first", checkpointer=ceb.checkpointer)
    real = [torch.load(p, weights_only=False)["global_steps"] for p in written if "model_states" in p]
    fp32_first: Any = "not run"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # materialized on every rank: zero_to_fp32 reads them all
        torch.distributed.barrier()
        fp32 = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="first")
        fp32_first = []
        _diff({k: v.float() for k, v in saved_first["module"].items()}, {k: fp32[k] for k in saved_first["module"]},
              "fp32", fp32_first)
    b.load_checkpoint(save_dir, tag="first")
    _diff(saved_first, full_state(b), "first", mismatches)
    ce.close()
    ceb.close()
    json.dump({"tag": tag, "files": files, "pointers": pointers, "tags": tags, "load_path": load_path,
               "differed_before": len(before), "mismatches": mismatches, "client_ok": client_ok,
               "restored_from": tier,
               "materialized": [os.path.relpath(p, save_dir) for p in written], "real": real,
               "next_loss": [loss_a.hex(), loss_b.hex()], "optimizer_type": type(a.optimizer).__name__,
               "fp32_mismatch": fp32_mismatch, "fp32_refused": fp32_refused, "fp32_first": fp32_first},
              open(out, "w"))


def train(stage: int, root: str, save_dir: str, out: str, steps: int, every: int, kill_at: int,
          resume: bool, durable: str = "first") -> None:
    from nebula_ckpt.integrations.deepspeed import enable

    init_rank()
    engine = make_engine(stage, seed=0)
    ce = enable(engine, root, durable=durable)
    start = 0
    with open(out, "a") as f:
        if resume:
            path, client = engine.load_checkpoint(save_dir)
            assert path is not None, "nothing to resume from"
            torch.set_rng_state(client["rng"])
            start = engine.global_steps
            f.write(json.dumps({"resumed": start, "tier": ce.checkpointer.last_restore}) + "\n")
        for step in range(start, steps):
            loss = train_step(engine, step)
            f.write(json.dumps({"step": engine.global_steps, "loss": loss.hex()}) + "\n")
            f.flush()
            if engine.global_steps % every == 0:
                engine.save_checkpoint(save_dir, client_state={"rng": torch.get_rng_state()})
                f.write(json.dumps({"saved": engine.global_steps}) + "\n")
                f.flush()
            if engine.global_steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    ce.close()


def units(root: str, save_dir: str, out: str) -> None:
    """The engine's contract without a DeepSpeed engine: what each call does at the edges."""
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    from nebula_ckpt.errors import NotFoundError, ValidationError
    from nebula_ckpt.integrations.deepspeed import POINTER_FORMAT, NebulaCkptEngine
    from nebula_ckpt.integrations.deepspeed_files import open_pointer, read_pointer
    from nebula_ckpt.integrations.pointers import encode_pointer

    res: dict[str, Any] = {}
    ce = NebulaCkptEngine(root, keep_last=1)
    ce.makedirs(save_dir, exist_ok=True)

    def save(tag: str, parts: dict[str, Any]) -> None:
        info = CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=True)
        ce.create(info)
        for rel, sd in parts.items():
            os.makedirs(os.path.dirname(os.path.join(save_dir, rel)), exist_ok=True)
            ce.save(state_dict=sd, path=os.path.join(save_dir, rel))
        ce.commit(info)

    t = torch.arange(6, dtype=torch.float32)
    save("a", {"a/m.pt": {"w": t, "n": 1}, "a/sub/z.pt": {"w": t * 2}, "fp16.bin": {"w": t * 3}})
    ptr = read_pointer(os.path.join(save_dir, "a/m.pt"))
    res["pointer"] = [ptr["format"] == POINTER_FORMAT, ptr["tag"], ptr["key"], ptr["step"]]
    res["outside_is_torch_save"] = torch.equal(torch.load(os.path.join(save_dir, "fp16.bin"))["w"], t * 3)
    res["nested_key"] = read_pointer(os.path.join(save_dir, "a/sub/z.pt"))["key"]
    res["load"] = [torch.equal(ce.load(os.path.join(save_dir, "a/sub/z.pt"))["w"], t * 2),
                   ce.load(os.path.join(save_dir, "a/m.pt"), map_location="cpu")["n"]]
    res["load_again"] = torch.equal(ce.load(os.path.join(save_dir, "a/m.pt"))["w"], t)  # re-read after served
    torch.save({"plain": t}, os.path.join(save_dir, "old.pt"))
    res["torch_save_file"] = torch.equal(ce.load(os.path.join(save_dir, "old.pt"))["plain"], t)
    save("b", {"b/m.pt": {"w": t + 1}})  # keep_last=1: "a" is gone, and its tag folder with it
    ce.wait()
    res["steps"] = ce.checkpointer.list()
    from nebula_ckpt.integrations.pointers import find_roots

    res["find_roots"] = [find_roots(save_dir), find_roots(os.path.join(save_dir, "b", "m.pt"))]
    res["tag_folders"] = sorted(n for n in os.listdir(save_dir) if os.path.isdir(os.path.join(save_dir, n)))
    # a pointer file of a dropped checkpoint (kept by hand) says so when loaded
    shutil.copytree(os.path.join(save_dir, "b"), os.path.join(save_dir, "a"))
    with open(os.path.join(save_dir, "a", "m.pt"), "wb") as f:
        f.write(encode_pointer({**read_pointer(os.path.join(save_dir, "b/m.pt")), "tag": "a"}, open_pointer))
    try:
        ce.load(os.path.join(save_dir, "a/m.pt"))
        res["retention"] = "loaded"
    except NotFoundError as e:
        res["retention"] = str(e)
    shutil.rmtree(os.path.join(save_dir, "a"))
    # the default keeps every checkpoint, as stock DeepSpeed does
    keep = NebulaCkptEngine(root + "-all")
    for tag in ("k1", "k2", "k3", "k4", "k5"):
        info = CheckpointCommitInfo(tag=tag, save_dir=save_dir + "-all", save_latest=True)
        keep.create(info)
        os.makedirs(os.path.join(save_dir + "-all", tag), exist_ok=True)
        keep.save(state_dict={"w": t}, path=os.path.join(save_dir + "-all", tag, "m.pt"))
        keep.commit(info)
        keep.wait()  # each one durable (a busy disk tier would skip a save for a newer one)
    keep.close()
    res["default_keeps"] = [sorted(keep.checkpointer.list()), sorted(os.listdir(save_dir + "-all"))]
    shutil.rmtree(save_dir)  # a lost save_dir: the checkpoints are still held by the tiers
    res["restore_pointers"] = ce.restore_pointers(save_dir)
    res["latest"] = open(os.path.join(save_dir, "latest")).read()
    res["after_restore"] = torch.equal(ce.load(os.path.join(save_dir, "b/m.pt"))["w"], t + 1)
    errors = {}
    for name, info in [("bad_tag", CheckpointCommitInfo(tag="has space", save_dir=save_dir, save_latest=True)),
                       ("root_is_save_dir", CheckpointCommitInfo(tag="c", save_dir=root, save_latest=True))]:
        try:
            ce.create(info)
            errors[name] = "accepted"
        except ValidationError as e:
            errors[name] = str(e)
    res["errors"] = errors
    ce.close()
    json.dump(res, open(out, "w"))


def _tree(top: str) -> set[str]:
    return {os.path.join(d, n) for d, dirs, files in os.walk(top) for n in dirs + files}


def _error(fn: Any, seconds: float = 20) -> str:
    """``"<Type>: <message>"`` of what ``fn()`` raises (in a thread: a blocking read shows as such)."""
    import threading

    box: list[str] = ["returned"]

    def run() -> None:
        try:
            fn()
        except Exception as e:
            box[0] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return "blocked" if t.is_alive() else box[0]


def hostile(root: str, save_dir: str, out: str) -> None:
    """Hostile pointers and tags: a pointer naming a root that does not exist, a FIFO at a
    DeepSpeed path, a valid tag too long for a folder name."""
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    import nebula_ckpt as nc
    from nebula_ckpt.integrations.deepspeed import POINTER_FORMAT, NebulaCkptEngine, materialize

    res: dict[str, Any] = {}
    top = os.path.dirname(os.path.abspath(save_dir))
    shm = os.environ["NEBULA_SHM_DIR"]
    os.makedirs(os.path.join(save_dir, "t"))
    victim = os.path.join(top, "victim", "root")
    with open(os.path.join(save_dir, "t", "mp_rank_00_model_states.pt"), "w") as f:
        json.dump({"format": POINTER_FORMAT, "root": victim, "tag": "t", "key": "mp_rank_00_model_states.pt",
                   "step": 0}, f)
    before = _tree(top) | _tree(shm)
    res["materialize"] = _error(lambda: materialize(save_dir, "t"))
    res["created"] = sorted((_tree(top) | _tree(shm)) - before)

    ce = NebulaCkptEngine(root)
    fifo = os.path.join(save_dir, "t", "fifo.pt")
    os.mkfifo(fifo)
    res["fifo"] = _error(lambda: ce.load(fifo))
    long_tag = "g" * 256
    before = _tree(top)
    info = CheckpointCommitInfo(tag=long_tag, save_dir=save_dir, save_latest=True)
    res["long_tag_create"] = _error(lambda: ce.create(info))
    res["long_tag_written"] = sorted(_tree(top) - before)
    ce.close()
    with nc.Checkpointer(root, allow_pickle=True) as other:  # a valid tag, written by another tool
        other.save(5, {"mp_rank_00_model_states.pt": {"w": torch.ones(2)}}, tag=long_tag)
    ce = NebulaCkptEngine(root)
    res["long_tag_restore"] = _error(lambda: ce.restore_pointers(os.path.join(top, "ds2")))
    ce.close()
    json.dump(res, open(out, "w"))


def pointer_alone(root: str, save_dir: str, out: str, memory_only: bool = False) -> None:
    """Rank r of a 2-rank gloo job saves its part of checkpoint "t" and writes its pointer file;
    then rank 0 alone ``torch.load``-s its pointer, as DeepSpeed does when it reads on one rank,
    and once more after leaving the job (``zero_to_fp32.py`` after training). ``memory_only``:
    the save is on the ranks' memory tiers only (each holds its own rank's part, as right after
    a save whose disk write is still going)."""
    import torch.distributed as dist

    import nebula_ckpt as nc
    from nebula_ckpt.integrations.deepspeed_files import write_pointer

    dist.init_process_group("gloo")  # env:// as the test sets it
    rank = dist.get_rank()
    key = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    path = os.path.join(save_dir, "t", key)
    tiers = [nc.MemoryTier()] if memory_only else None
    with nc.Checkpointer(root, allow_pickle=True, tiers=tiers) as ck:
        ck.save(1, {key: {"w": torch.full((4,), float(rank))}}, tag="t")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_pointer(path, root, "t", 1, key)
    dist.barrier()
    res: dict[str, Any] = {}
    if rank == 0:
        res["in_job"] = _error(lambda: torch.load(path, weights_only=False), seconds=30)
        if res["in_job"] == "blocked":  # waiting for rank 1 in a collective: nothing more to learn
            json.dump(res, open(out, "w"))
            os._exit(0)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        res["alone"] = _error(lambda: torch.load(path, weights_only=False), seconds=60)
        # a pointer refused for another reason (its tag is not one nebula_ckpt takes) says that reason
        bad = os.path.join(save_dir, "bad", key)
        os.makedirs(os.path.dirname(bad), exist_ok=True)
        write_pointer(bad, root, "bad tag", 1, key)
        res["bad_tag"] = _error(lambda: torch.load(bad, weights_only=False), seconds=60)
    json.dump(res, open(out, "w"))


def same_tag(stage: int, root: str, save_dir: str, out: str) -> None:
    """One tag saved again and again: stock DeepSpeed overwrites ``save_dir/<tag>``, so does nebula_ckpt."""
    from nebula_ckpt.integrations.deepspeed import enable

    init_rank()
    res: dict[str, Any] = {}
    for label in ("nebula", "stock"):
        engine = make_engine(stage, seed=0)
        ce = enable(engine, root) if label == "nebula" else None
        where = save_dir if ce is not None else save_dir + "-stock"
        engine.save_checkpoint(where, tag="keep")
        for s in range(4):  # no wait between the saves: each one supersedes the one before
            train_step(engine, s)
            engine.save_checkpoint(where, tag="last", client_state={"s": s})
        saved = full_state(engine)
        res[label] = {"files": sorted(os.listdir(os.path.join(where, "last"))), "latest": open(
            os.path.join(where, "latest")).read()}
        if ce is not None:
            ce.wait()
            res["steps"] = {str(k): v for k, v in ce.checkpointer.steps().items()}
            res["per_tier"] = {t: sorted(v) for t, v in ce.checkpointer.list(detailed=True).items()}
            ce.close()
            fresh = make_engine(stage, seed=1)
            cf = enable(fresh, root)
            _, client = fresh.load_checkpoint(where, tag="last")
            mismatches: list[str] = []
            _diff(saved, full_state(fresh), "", mismatches)
            res["load"] = [client["s"], mismatches]
            train_step(fresh, 4)
            fresh.save_checkpoint(where, tag="last")  # a new process: supersedes the step the last one saved
            cf.wait()
            res["after_resume"] = {str(k): v for k, v in cf.checkpointer.steps().items()}
            cf.close()
    json.dump(res, open(out, "w"))


if __name__ == "__main__":
    mode, stage_s, root_a, save_dir_a, out_a = sys.argv[1:6]
    if mode == "pointer_alone":
        pointer_alone(root_a, save_dir_a, out_a, memory_only=stage_s == "memory")
    elif mode == "units":
        units(root_a, save_dir_a, out_a)
    elif mode == "same_tag":
        same_tag(int(stage_s), root_a, save_dir_a, out_a)
    elif mode == "hostile":
        hostile(root_a, save_dir_a, out_a)
    elif mode == "roundtrip":
        roundtrip(int(stage_s), root_a, save_dir_a, out_a)
    else:
        rest = sys.argv[6:]
        train(int(stage_s), root_a, save_dir_a, out_a, int(rest[0]), int(rest[1]),
              int(rest[2]) if len(rest) > 2 else -1, "resume" in rest[3:],
              "all" if "durable_all" in rest[3:] else "first")
