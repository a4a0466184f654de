"""The CUDA path on a real GPU: device-to-host snapshots into pinned staging, stream ordering,
the consistency guarantee of an overlapped (``snapshot="async"``) save, and restores into CUDA
parameters.

Marked ``gpu``: they skip without CUDA (CI). Races are pinned, not hoped for: a long
``torch.cuda._sleep`` kernel queued on a stream holds back everything queued after it there, so
the snapshot copy (ordered after the compute stream) is certainly still pending when the test
acts, and a kernel on another stream certainly runs before it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Iterator

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import native
from state.test_roundtrip import DTYPES, _bytes, _random

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_C = pytest.importorskip("nebula_ckpt._C")

_CUDA_OK = torch.cuda.is_available() and bool(_C.build_info()["cuda"])

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _CUDA_OK, reason="needs a GPU and the CUDA build of nebula_ckpt._C"),
]

MiB = 1 << 20


def _hold_stream(seconds: float = 0.5) -> None:
    """Queue a kernel that spins for about ``seconds`` on the current stream."""
    torch.cuda._sleep(int(seconds * 2e9))  # cycles; an H100 clocks at most ~2 GHz, so at least that long


def _cpu_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.element_size() == 1 and not t.is_neg() and not t.is_conj():
        t = t.view(torch.uint8)  # torch cannot copy the sub-byte shell dtypes (int1..7, uint1..7)
    return _bytes(t.cpu())


@pytest.fixture(autouse=True)
def _sync_after() -> Iterator[None]:
    yield
    torch.cuda.synchronize()


# --------------------------------------------------------------------------- the extension

def test_describe_reports_the_cuda_build() -> None:
    d = native.describe()
    assert d["path"] == "native" and d["cuda"] is True, d


def test_errors_that_stream_torch_types_do_not_crash_the_process() -> None:
    """The extension shares torch's C++ runtime: an error message built from a c10::Device or
    c10::Layout (c10's operator<< writing into the extension's std::ostringstream) is raised as
    RuntimeError. Linked with a private static libstdc++ (a toolchain default), this killed the
    process with SIGSEGV. Run in a child so that a crash fails this test, not the whole run."""
    code = (
        "import torch\n"
        "from nebula_ckpt import _C\n"
        "e = _C.CopyEngine(2)\n"
        "dst = torch.empty(100, dtype=torch.uint8)\n"
        "for bad in (torch.empty(3, device='meta'), torch.eye(3).to_sparse()):\n"
        "    try:\n"
        "        e.enqueue([torch.zeros(4, device='cuda'), bad], dst, [0, 16])\n"
        "    except RuntimeError as x:\n"
        "        print(str(x).splitlines()[0])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.stdout
    assert "srcs[1] is on meta" in lines[0]
    assert "srcs[1] has layout Sparse" in lines[1]


def test_copy_is_ordered_after_the_current_stream_and_returns_before_it() -> None:
    """enqueue returns while the compute stream is still busy; the copy sees what was queued before."""
    dev = torch.device("cuda")
    src = torch.zeros(8 * MiB // 4, device=dev)
    dst = _C.alloc_host_buffer(src.nbytes, pinned=True)
    _hold_stream()
    src.fill_(7.0)  # queued behind the sleep: the copy must wait for it
    eng = _C.CopyEngine(2)
    job = eng.enqueue([src], dst, [0])
    assert not job.done()  # asynchronous: the sleep still holds the stream
    job.wait()
    assert job.done() and job.modified() == []
    assert torch.equal(dst.view(torch.float32), torch.full_like(src, 7.0).cpu())


def test_in_place_change_during_the_copy_is_reported() -> None:
    """A version-counter change made while the device copy is pending is in modified()."""
    dev = torch.device("cuda")
    a, b = torch.ones(1 << 20, device=dev), torch.ones(1 << 20, device=dev)
    dst = _C.alloc_host_buffer(a.nbytes + b.nbytes, pinned=True)
    eng = _C.CopyEngine(2)
    # Load every kernel involved first: with CUDA's lazy module loading, the first launch of a
    # kernel may synchronize the context, which would let the held copy finish before add_.
    eng.enqueue([a, b], dst, [0, a.nbytes]).wait()
    b.add_(0.0)
    torch.cuda.synchronize()
    _hold_stream()
    job = eng.enqueue([a, b], dst, [0, a.nbytes])
    assert not job.done()  # the copy is still held back by the sleep
    b.add_(1.0)  # against the rule: no wait for the snapshot
    job.wait()
    assert job.modified() == [1]


def test_dropping_a_pending_job_waits_for_its_copies() -> None:
    """The job owns its sources: freeing them while the copy is queued must not let it read freed memory."""
    dev = torch.device("cuda")
    src = torch.full((4 * MiB // 4,), 3.0, device=dev)
    dst = _C.alloc_host_buffer(src.nbytes, pinned=True)
    _hold_stream()
    job = _C.CopyEngine(2).enqueue([src], dst, [0])
    del src  # the batch still holds the tensor, so the allocator cannot hand its memory out
    junk = torch.full((4 * MiB // 4,), -1.0, device=dev)  # would reuse the block if it were freed
    del job  # waits for the copy
    assert torch.equal(dst.view(torch.float32), torch.full((4 * MiB // 4,), 3.0))
    del junk


# --------------------------------------------------------------------------- round trips

_VIEW_CASES = {
    "transposed": lambda d: torch.randn(6, 8, device=d).t(),
    "strided": lambda d: torch.randn(6, 8, device=d)[::2, 1::3],
    "expanded": lambda d: torch.arange(3.0, device=d).expand(4, 3),
    "bf16_t": lambda d: torch.randn(5, 3, device=d).to(torch.bfloat16).t(),
    "conj": lambda d: torch.randn(7, dtype=torch.complex64, device=d).conj(),
    "neg": lambda d: torch.randn(7, dtype=torch.complex128, device=d).conj()._neg_view(),
    "offset": lambda d: torch.randn(100, device=d)[37:81],
    "zero_dim_slice": lambda d: torch.randn(4, device=d)[2],
}


def _gpu_state(dev: torch.device) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every dtype CUDA can hold, in several shapes, plus views; and the dtypes left out."""
    state: dict[str, torch.Tensor] = {}
    left_out = []
    for i, dt in enumerate(DTYPES):
        try:
            torch.zeros(2, dtype=dt).to(dev)
        except (RuntimeError, TypeError):
            left_out.append(str(dt))
            continue
        for shape in [(), (0,), (3, 0, 2), (5,), (4, 7), (33, 65)]:
            state[f"{dt}/{shape}"] = _random(dt, shape, seed=i * 10 + len(shape)).to(dev)
        # non-contiguous views of every dtype, the sub-byte shell dtypes included (byte copies)
        state[f"{dt}/transposed"] = _random(dt, (4, 7), seed=i * 10 + 7).to(dev).t()
        state[f"{dt}/strided"] = _random(dt, (6, 8), seed=i * 10 + 8).to(dev)[::2, 1::3]
    for name, make in _VIEW_CASES.items():
        state[f"views/{name}"] = make(dev)
    return state, left_out


def _expected(v: torch.Tensor) -> bytes:
    return _cpu_bytes(v.resolve_conj().resolve_neg())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_dtype_and_view_bit_exact_from_cuda(root: str, mode: str) -> None:
    dev = torch.device("cuda")
    state, left_out = _gpu_state(dev)
    for must in ("torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.bool",
                 "torch.complex64", "torch.complex128", "torch.float16", "torch.float64",
                 "torch.int8", "torch.uint8", "torch.int64"):
        assert any(k.startswith(must + "/") for k in state), (must, left_out)
    want = {k: _expected(v) for k, v in state.items()}
    # async: the tensors are buffers of a module (a mutation point the hooks guard), so the save
    # returns before the device copy; sync: a plain dict, copied before save_async returns.
    holder = torch.nn.Module()
    names = {}
    for j, (k, v) in enumerate(state.items()):
        holder.register_buffer(f"b{j}", v)
        names[f"b{j}"] = k
    to_save = {"m": holder} if mode == "async" else state
    with nc.Checkpointer(root, snapshot=mode) as ck:
        ck.save_async(3, to_save).result()
        _, back = ck.read(3)
        _, back_cpu = ck.read(3, map_location="cpu")
    flat = {names[n]: t for n, t in back["m"].items()} if mode == "async" else back
    flat_cpu = {names[n]: t for n, t in back_cpu["m"].items()} if mode == "async" else back_cpu
    assert set(flat) == set(state)
    for k, v in state.items():
        got, got_cpu = flat[k], flat_cpu[k]
        assert got.device.type == "cuda" and got_cpu.device.type == "cpu", k
        assert got.dtype == v.dtype and tuple(got.shape) == tuple(v.shape), k
        assert _cpu_bytes(got) == want[k], k
        assert _bytes(got_cpu) == want[k], k
    man = json.load(open(os.path.join(root, "step-3", "manifest.json")))
    assert {r["device"] for r in man["tensors"].values()} == {"cuda:0"}


# --------------------------------------------------------------------------- consistency

def _mlp(dev: torch.device, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512),
                                torch.nn.LayerNorm(512)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(100 + k)
    x = torch.randn(64, 512, device="cuda", generator=g)
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _snap(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    out = {f"model/{k}": _cpu_bytes(v) for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for n, t in s.items():
            out[f"optim/{i}/{n}"] = _cpu_bytes(t)
    return out


def _saved(back: dict) -> dict[str, bytes]:
    out = {f"model/{k}": _cpu_bytes(v) for k, v in back["model"].items()}
    for i, s in back["optim"]["state"].items():
        for n, t in s.items():
            out[f"optim/{i}/{n}"] = _cpu_bytes(t)
    return out


def test_optimizer_step_waits_for_the_device_copy(root: str) -> None:
    """save_async returns while the copy is held back; optimizer.step() (step pre-hook) waits for it."""
    dev = torch.device("cuda")
    model, opt = _mlp(dev)
    _step(model, opt, 0)
    before = _snap(model, opt)
    with nc.Checkpointer(root) as ck:
        assert ck.snapshot == "auto"
        _hold_stream()
        h = ck.save_async(1, {"model": model, "optim": opt})
        with pytest.raises(TimeoutError):
            h.wait_snapshot(timeout=0)  # overlapped: the copy is still queued behind the sleep
        _step(model, opt, 1)  # forward/backward overlap the copy; step() waits for it
        h.result()
        _, back = ck.read(1, map_location="cpu")
    assert _saved(back) == before
    assert _snap(model, opt) != before  # the step did happen, after the copy


def test_copy_sees_work_queued_before_save_async_on_the_current_stream(root: str) -> None:
    """The producing (current) stream may be a side stream: the copy is ordered after it."""
    dev = torch.device("cuda")
    model, opt = _mlp(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with nc.Checkpointer(root) as ck, torch.cuda.stream(s):
        _hold_stream()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.25)  # queued on s behind the sleep
        h = ck.save_async(1, {"model": model, "optim": opt})
        h.result()
        _, back = ck.read(1, map_location="cpu")
    assert back["model"] and all(torch.all(v == 1.25) for v in back["model"].values())


@pytest.mark.parametrize("where", ["current", "other"])
def test_in_place_change_after_save_async_never_reaches_the_checkpoint(root: str, where: str) -> None:
    """Against the rule: an in-place change right after save_async, on the compute stream (racing
    the copy) or on another stream (running before the held-back copy). The save must fail with
    ConsistencyError and write nothing; the old checkpoint stays."""
    dev = torch.device("cuda")
    model, opt = _mlp(dev)
    _step(model, opt, 0)
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"model": model, "optim": opt})
        good = _snap(model, opt)
        _hold_stream()
        h = ck.save_async(2, {"model": model, "optim": opt})
        other = torch.cuda.Stream()  # does not wait for the sleeping compute stream
        with torch.no_grad(), torch.cuda.stream(other if where == "other" else torch.cuda.current_stream()):
            model[0].weight.mul_(-3.0)
        with pytest.raises(nc.ConsistencyError, match=r"model/0\.weight.*changed in place"):
            h.result()
        assert ck.list() == [1]
        _, back = ck.read(map_location="cpu")
    assert _saved(back) == good


def test_restore_into_cuda_parameters_continues_bit_exact(root: str) -> None:
    dev = torch.device("cuda")
    model, opt = _mlp(dev)
    for k in range(3):
        _step(model, opt, k)
    with nc.Checkpointer(root) as ck:
        ck.save_async(3, {"model": model, "optim": opt, "step": 3}).result()
    ref = [_step(model, opt, k) for k in range(3, 6)]

    m2, o2 = _mlp(dev, seed=7)
    params = list(m2.parameters())
    into = {"model": m2, "optim": o2, "step": 0}
    with nc.Checkpointer(root) as ck:
        assert ck.load_latest(into=into) == 3
    assert into["step"] == 3
    assert all(a is b for a, b in zip(m2.parameters(), params, strict=True))  # restored in place
    assert all(p.device.type == "cuda" for p in m2.parameters())
    for s in o2.state_dict()["state"].values():
        assert s["exp_avg"].device.type == "cuda" and s["exp_avg_sq"].device.type == "cuda"
    got = [_step(m2, o2, k) for k in range(3, 6)]
    assert got == ref
    assert _snap(m2, o2) == _snap(model, opt)


# --------------------------------------------------------------------------- the first save, the plan cache

_FIRST_SAVE = """
import sys, torch, nebula_ckpt as nc
torch.zeros(1, device="cuda")                      # a CUDA process: the Checkpointer sets up its copy path
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).cuda()
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(8, 512, device="cuda")).sum().backward()
opt.step()
root = sys.argv[1]
ck = nc.Checkpointer(root, tiers=[nc.LocalTier(root)])
if sys.argv[2] == "prepare":
    ck.prepare({"model": model, "optim": opt}, wait=True)
torch.cuda.synchronize()
torch.cuda._sleep(int(3 * 2e9))                    # seconds of work queued on the compute stream
queued = torch.cuda.Event()
queued.record()
h = ck.save_async(1, {"model": model, "optim": opt})
print("pending" if not queued.query() else "drained", flush=True)
h.result()
ck.close()
"""


@pytest.mark.parametrize("how", ["prepare", "creation"])
def test_the_first_save_of_a_process_does_not_wait_for_the_gpu_to_drain(tmp_path: str, how: str) -> None:
    """The copy path's one-time CUDA setup (side stream, events, host function, a page-locked
    copy) is done when the Checkpointer is made in a CUDA process and in prepare(): the first
    save_async returns while work queued before it still runs. A fresh process: the setup is
    once per process. (``creation``: no prepare(), so the first save also allocates its
    page-locked staging; that it does not drain the GPU either is what this case checks.)"""
    res = subprocess.run([sys.executable, "-c", _FIRST_SAVE, str(tmp_path) + "/ckpt", how], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-1] == "pending", res.stdout


def test_a_plan_is_not_reused_after_a_tensor_moved_between_devices(root: str) -> None:
    """The plan cache compares each tensor's device: a parameter moved to the CPU is planned
    again, and the checkpoint holds its new bytes."""
    dev = torch.device("cuda")
    model, opt = _mlp(dev)
    _step(model, opt, 0)
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"model": model, "optim": opt})
        model[0].weight.data = model[0].weight.data.cpu() * 2
        want = _cpu_bytes(model[0].weight)
        ck.save(2, {"model": model, "optim": opt})
        assert ck.stats()["plans"]["misses"] == 1
        _, back = ck.read(2, map_location="cpu")
    assert _cpu_bytes(back["model"]["0.weight"]) == want
