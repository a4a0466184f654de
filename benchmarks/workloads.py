"""Workloads: a model, its optimizer with materialised state, and one real training step.

Every workload is a real ``nn.Module`` trained by a real ``torch.optim.AdamW`` on a tiny
synthetic batch, so the throughput run is a genuine forward / backward / step loop and the
checkpointed state has the shapes a user's state has:

* ``124m`` / ``350m`` / ``1.3b`` / ``2.7b``: GPT-2-shaped transformers (token embedding 50257 x d
  tied to the LM head, learned positions, per layer: 2 LayerNorms, qkv d x 3d, attention
  projection d x d, MLP d x 4d and 4d x d). ``1.3b`` and ``2.7b`` are refused on CPU (about 21
  and 42 GB of training state).
* ``tiny``: the same GPT shape at d=128, 2 layers, vocab 8192, for ``--quick`` and tests.
* ``small-many``: 10,000 small parameters (64 x 64 by default) - the per-tensor overhead case.
* ``few-huge``: 4 parameters totalling ~1 GB (``few_huge_bytes``) - the pure bandwidth case.

AdamW runs one step at build time so its ``exp_avg`` / ``exp_avg_sq`` exist: the state is about
3x the parameter bytes (plus a scalar ``step`` tensor per parameter).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

#: Names accepted by ``--model``.
WORKLOADS = ("tiny", "124m", "350m", "1.3b", "2.7b", "small-many", "few-huge")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-like model."""

    d: int
    layers: int
    heads: int
    vocab: int = 50257
    block: int = 1024


GPT_CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d=128, layers=2, heads=4, vocab=8192, block=256),
    "124m": GPTConfig(d=768, layers=12, heads=12),
    "350m": GPTConfig(d=1024, layers=24, heads=16),
    "1.3b": GPTConfig(d=2048, layers=24, heads=16),
    "2.7b": GPTConfig(d=2560, layers=32, heads=32),
}


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln_1 = nn.LayerNorm(cfg.d)
        self.c_attn = nn.Linear(cfg.d, 3 * cfg.d)
        self.attn_proj = nn.Linear(cfg.d, cfg.d)
        self.ln_2 = nn.LayerNorm(cfg.d)
        self.c_fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.mlp_proj = nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """A small GPT-2: enough to run a real forward / backward, shaped like the real one."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.block, cfg.d)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        # GPT-2 ties the LM head to the token embedding: state_dict() holds both keys for one
        # storage, which every checkpointer has to handle (safetensors refuses shared tensors).
        self.lm_head.weight = self.wte.weight
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return the next-token cross-entropy loss of ``idx`` (shape ``[batch, seq]``)."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


class SmallMany(nn.Module):
    """``count`` small parameters; the loss touches every one of them."""

    def __init__(self, count: int = 10_000, shape: tuple[int, int] = (64, 64)) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(*shape) * 0.02) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``(p * x).mean()`` over every parameter."""
        return torch.stack([(p * x).mean() for p in self.params]).sum()


class FewHuge(nn.Module):
    """``count`` large 1-D parameters totalling about ``total_bytes`` (fp32)."""

    def __init__(self, total_bytes: int = 1 << 30, count: int = 4) -> None:
        super().__init__()
        n = max(1, total_bytes // (4 * count))
        self.params = nn.ParameterList(nn.Parameter(torch.empty(n).normal_(0.0, 0.02))
                                       for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Loss on a slice of each parameter (the gradients still span the whole tensors)."""
        k = x.numel()
        return sum((p[:k] * x).sum() for p in self.params) / len(self.params)


@dataclass
class Workload:
    """A model + AdamW + a fixed synthetic batch.

    The benchmark calls :meth:`forward_backward` and :meth:`optimizer_step` separately so a
    checkpoint's snapshot can overlap the next forward / backward, as it does in real training.
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    batch: torch.Tensor
    description: str
    params: int = 0
    state_bytes: int = 0
    num_tensors: int = 0
    _loss: Optional[torch.Tensor] = field(default=None, repr=False)

    def forward_backward(self) -> None:
        """Forward and backward on the fixed batch (gradients accumulate until the step)."""
        loss = self.model(self.batch)
        loss.backward()
        self._loss = loss.detach()

    def optimizer_step(self) -> None:
        """``optimizer.step()`` then ``zero_grad()``."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self) -> None:
        """One whole training step."""
        self.forward_backward()
        self.optimizer_step()
        self.sync()

    def sync(self) -> None:
        """Wait for queued device work (no-op on CPU) so wall-clock timings are honest."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def state(self, step: int) -> dict[str, Any]:
        """The live state every system is asked to save: ``{"model", "optim", "step"}``."""
        return {"model": self.model, "optim": self.optimizer, "step": step}

    def fingerprint(self) -> list[float]:
        """A few float64 sums of parameters and optimizer moments, to verify a restore."""
        ps = [p for p in self.model.parameters()]
        picks = [ps[0], ps[-1]]
        out = [float(p.detach().double().sum()) for p in picks]
        for p in picks:
            st = self.optimizer.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out.append(float(st[k].double().sum()))
        return out

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for the results file."""
        return {"name": self.name, "description": self.description, "device": str(self.device),
                "params": self.params, "state_bytes": self.state_bytes,
                "num_tensors": self.num_tensors, "batch_shape": list(self.batch.shape)}


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the model + optimizer state, one per distinct storage (ties counted once)."""
    seen: set[tuple[int, int]] = set()
    out: list[torch.Tensor] = []
    tensors = list(model.state_dict(keep_vars=True).values())
    for st in optimizer.state.values():
        tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out.append(t)
    return out


def _finish(name: str, model: nn.Module, device: torch.device, batch: torch.Tensor,
            description: str, lr: float = 1e-4) -> Workload:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    w = Workload(name=name, model=model, optimizer=optimizer, device=device, batch=batch,
                 description=description)
    w.train_step()  # materialises exp_avg / exp_avg_sq: the state is now ~3x the parameters
    tensors = state_tensors(model, optimizer)
    w.params = sum(p.numel() for p in model.parameters())
    w.state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    w.num_tensors = len(tensors)
    return w


def build(name: str, device: Optional[torch.device] = None, *, batch_size: int = 1,
          seq_len: int = 64, small_many_count: int = 10_000,
          few_huge_bytes: int = 1 << 30, seed: int = 0) -> Workload:
    """Build workload ``name`` on ``device`` (default: CUDA if available, else CPU).

    Args:
        name: one of :data:`WORKLOADS`.
        device: where the model and optimizer state live.
        batch_size, seq_len: the synthetic token batch of the GPT workloads.
        small_many_count: number of parameters of ``small-many``.
        few_huge_bytes: parameter bytes of ``few-huge`` (the AdamW state adds 2x that).
        seed: RNG seed, so every run builds the same weights.

    Returns:
        The workload with one optimizer step taken.

    Raises:
        ValueError: unknown name, or ``1.3b`` on a CPU (it needs ~21 GB of training state).
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if name in ("1.3b", "2.7b") and device.type != "cuda":
        raise ValueError(f"workload '{name}' runs on a GPU only (its parameters, gradients and "
                         "AdamW state need ~21 GB and a CPU step takes minutes); use 124m or 350m")
    torch.manual_seed(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if name in GPT_CONFIGS:
        cfg = GPT_CONFIGS[name]
        with torch.device(device):
            model: nn.Module = GPT(cfg)
        batch = torch.randint(0, cfg.vocab, (batch_size, min(seq_len, cfg.block)), generator=gen)
        desc = (f"GPT-2 shape d={cfg.d}, {cfg.layers} layers, vocab {cfg.vocab} (tied head), "
                f"AdamW; batch {batch_size}x{min(seq_len, cfg.block)} tokens")
        return _finish(name, model, device, batch.to(device), desc)
    if name == "small-many":
        with torch.device(device):
            model = SmallMany(small_many_count)
        batch = torch.randn(64, 64, generator=gen).to(device)
        desc = f"{small_many_count} parameters of 64x64 fp32 + AdamW"
        return _finish(name, model, device, batch, desc)
    with torch.device(device):
        model = FewHuge(few_huge_bytes)
    batch = torch.randn(4096, generator=gen).to(device)
    desc = (f"4 fp32 parameters totalling {few_huge_bytes / 1e9:.2f} GB + AdamW "
            f"(state ~{3 * few_huge_bytes / 1e9:.1f} GB)")
    return _finish(name, model, device, batch, desc)


def estimate_state_bytes(name: str, *, small_many_count: int = 10_000,
                         few_huge_bytes: int = 1 << 30) -> int:
    """Rough parameter+AdamW bytes of a workload without building it (for sizing limits)."""
    if name in GPT_CONFIGS:
        c = GPT_CONFIGS[name]
        per_layer = 12 * c.d * c.d + 13 * c.d
        params = c.vocab * c.d + c.block * c.d + c.layers * per_layer + 2 * c.d
        return 12 * params
    if name == "small-many":
        return 12 * small_many_count * 64 * 64
    return 3 * few_huge_bytes


def human_bytes(n: float) -> str:
    """``1536000000`` -> ``"1.54 GB"`` (decimal units, as the results table uses)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} TB"
