"""Names the Nebula page uses: a model and its optimizer."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(2, 8)).sum().backward()
opt.step()
