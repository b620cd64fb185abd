"""A tiny token LM and datasets with known FLOPs and timings, for the callback tests."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
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
    """Embedding -> Linear(D, H) -> GELU -> Linear(H, V); ``step_sleep`` seconds of fake compute (on
    ``clock``, a ``VirtualClock``, when given)."""

    def __init__(self, step_sleep: float = 0.0, clock: Optional["VirtualClock"] = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, V, bias=False)
        self.step_sleep = step_sleep
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.emb(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.step_sleep:
            (self.clock.sleep if self.clock is not None else time.sleep)(self.step_sleep)
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


class VirtualClock:
    """A clock that moves only when told to: ``sleep(dt)`` advances it, reading it does not. Patched
    in as the pack's host clock, every step time and data wait is a known sum."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class VirtualTokens(TokenDataset):
    """Token rows whose fetch takes ``sleep`` virtual seconds per sample."""

    def __init__(self, clock: VirtualClock, sleep: float, n: int = 64) -> None:
        super().__init__(n=n)
        self.clock, self.virtual_sleep = clock, sleep

    def __getitem__(self, i: int):
        self.clock.sleep(self.virtual_sleep)
        return super().__getitem__(i)


class TimedLM(ToyLM):
    """Declares its FLOPs per token and spends ``step_times[batch_idx % len]`` virtual seconds per step."""

    def __init__(self, clock: VirtualClock, step_times: Sequence[float]) -> None:
        super().__init__(clock=clock)
        self.step_times = list(step_times)

    def flops_per_token(self, seq_len=None) -> int:
        return 1000 + (seq_len or 0)

    def training_step(self, batch, batch_idx):
        self.clock.sleep(self.step_times[batch_idx % len(self.step_times)])
        return super().training_step(batch, batch_idx)


class WallTimes(L.Callback):
    """Reference wall time per step read from a clock: batch start to the next batch start, the last
    step to its batch end. Registered first, so it reads the clock at the same moments as the pack."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(self.clock())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(self.clock())

    def step(self, i: int) -> float:
        stop = self.starts[i + 1] if i + 1 < len(self.starts) else self.ends[i]
        return stop - self.starts[i]


class Diagnostic(L.Callback):
    """Stands for a profiling callback: costs ``cost`` virtual seconds at the end of ``step`` and lists it
    in ``sampled_steps``."""

    def __init__(self, clock: VirtualClock, step: int, cost: float) -> None:
        self.clock, self.step, self.cost = clock, step, cost
        self.sampled_steps: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.step:
            self.clock.sleep(self.cost)
            self.sampled_steps.append(batch_idx)


class ListLogger(Logger):
    """Keeps every ``log_metrics`` call: ``values(name)`` is what a dashboard would plot."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[Optional[int], dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    def values(self, name: str) -> list[float]:
        return [m[name] for _, m in self.rows if name in m]
