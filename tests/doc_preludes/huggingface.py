"""Names the Hugging Face snippet uses: a tiny GPT-2, its TrainingArguments, a dataset."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
args = TrainingArguments(output_dir="hf_out", max_steps=4, save_steps=2, per_device_train_batch_size=2,
                         report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
ds = [{"input_ids": row, "labels": row} for row in ids]
