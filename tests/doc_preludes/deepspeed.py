"""Names the DeepSpeed snippet uses: a model, its optimizer and a ZeRO config, on one CPU rank."""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402

from integrations.ds_worker import Net, init_rank  # noqa: E402

init_rank()
torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "zero_optimization": {"stage": 1}}
