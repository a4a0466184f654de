"""Names the API page's loop uses: a model whose output has ``.loss``, an optimizer, a scheduler, a loader."""
import types

import torch


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, batch: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(loss=self.lin(batch).square().mean())


torch.manual_seed(0)
model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
loader = [torch.randn(4, 8) for _ in range(201)]
