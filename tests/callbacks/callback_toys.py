"""A tiny token LM and datasets with known FLOPs and timings, for the callback tests."""

from __future__ import annotations

import time

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

V, D, H, T = 32, 16, 24, 8  # vocab, embedding, hidden, sequence length


class TokenDataset(Dataset):
    """Random (inputs, targets) token rows; ``sleep`` seconds per sample fetched."""

    def __init__(self, n: int = 64, seq_len: int = T, sleep: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, V, (n, seq_len + 1), generator=g)
        self.sleep = sleep

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if self.sleep:
            time.sleep(self.sleep)
        row = self.data[i]
        return row[:-1], row[1:]


def forward_flops_per_token() -> int:
    """Hand count: two matmuls per token, (D x H) and (H x V), 2 FLOPs per multiply-add."""
    return 2 * D * H + 2 * H * V


class ToyLM(L.LightningModule):
    """Embedding -> Linear(D, H) -> GELU -> Linear(H, V); ``step_sleep`` seconds of fake compute."""

    def __init__(self, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, V, bias=False)
        self.step_sleep = step_sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.emb(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep)
        logits = self(x)
        return F.cross_entropy(logits.view(-1, V), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ToyLMWithFlops(ToyLM):
    """Declares its FLOPs per token (a deliberately different number, to see it is used)."""

    def flops_per_token(self, seq_len=None) -> int:
        return 1000 + (seq_len or 0)


def loader(batch_size: int = 4, **kwargs) -> DataLoader:
    return DataLoader(TokenDataset(**kwargs), batch_size=batch_size)


def trainer(tmp_path, callbacks, max_steps: int = 8, **kwargs) -> L.Trainer:
    opts = dict(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    opts.update(kwargs)
    return L.Trainer(callbacks=callbacks, **opts)
