"""Small helpers shared by the performance callbacks (layout, batch sizes, sampling, log dir)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch
from torch.utils._pytree import tree_flatten

from lightning_perf.perf.throughput import ParallelLayout

__all__ = ["layout_of", "batch_size_of", "doc_ids_of", "StepSampler", "log_dir_of", "find_callback", "device_of", "log_scalars",
           "sampled_steps_of"]

C = TypeVar("C")


def layout_of(trainer: Any) -> ParallelLayout:
    """World size from the trainer; data-parallel size from the strategy's sampler kwargs.

    The pack's strategies and Lightning's own set ``distributed_sampler_kwargs["num_replicas"]``
    to the number of data-parallel replicas; without it every rank is a replica.
    """
    world = int(getattr(trainer, "world_size", 1) or 1)
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None)
    dp = world
    if isinstance(kwargs, dict) and kwargs.get("num_replicas"):
        dp = int(kwargs["num_replicas"])
    return ParallelLayout(world_size=world, data_parallel_size=dp)


def batch_size_of(batch: Any) -> tuple[int, int, Optional[int]]:
    """``(samples, tokens, seq_len)`` of a local batch.

    The first tensor decides: samples = its first dimension; for an integer tensor of
    2+ dimensions (token ids, ``(B, T)``) tokens = B * T and seq_len = T, otherwise
    tokens = samples.
    """
    flat, _ = tree_flatten(batch)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            samples = int(t.shape[0])
            if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
                return samples, samples * int(t.shape[1]), int(t.shape[1])
            return samples, samples, None
    return 0, 0, None


def doc_ids_of(batch: Any) -> Optional[torch.Tensor]:
    """The ``doc_ids`` (B, T) of a packed batch, else None: a dict's ``"doc_ids"``, or the third item of
    ``(inputs, targets, doc_ids)``, an integer tensor of the inputs' shape (the data module's form)."""
    if isinstance(batch, dict):
        doc_ids = batch.get("doc_ids")
        inputs = batch.get("inputs")
    elif isinstance(batch, (tuple, list)) and len(batch) == 3:
        inputs, _, doc_ids = batch
    else:
        return None
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2 or doc_ids.is_floating_point():
        return None
    if isinstance(inputs, torch.Tensor) and inputs.shape[:2] != doc_ids.shape:
        return None
    return doc_ids


@dataclass(kw_only=True)
class StepSampler:
    """Which steps are sampled: ``start``, ``start + every``, ... (``every=0``: only ``start``)."""

    every: int = 100
    start: int = 10

    def __post_init__(self) -> None:
        if self.every < 0 or self.start < 0:
            raise ValueError(f"every ({self.every}) and start ({self.start}) must be >= 0")

    def __call__(self, step: int) -> bool:
        if step < self.start:
            return False
        if self.every == 0:
            return step == self.start
        return (step - self.start) % self.every == 0


def log_dir_of(trainer: Any) -> str:
    """The trainer's log dir (the first logger's version dir, or its save dir, else the default root
    dir), created. Worked out on this rank alone: ``Trainer.log_dir`` broadcasts from rank 0, a
    collective that hangs or fails when, as in the callbacks writing reports, only rank 0 asks."""
    loggers = getattr(trainer, "loggers", None) or []
    path = None
    if loggers:
        path = getattr(loggers[0], "log_dir", None) or getattr(loggers[0], "save_dir", None)
    path = path or getattr(trainer, "default_root_dir", None) or os.getcwd()
    os.makedirs(path, exist_ok=True)
    return path


def find_callback(trainer: Any, cls: type[C]) -> Optional[C]:
    for cb in getattr(trainer, "callbacks", []) or []:
        if isinstance(cb, cls):
            return cb
    return None


def sampled_steps_of(trainer: Any) -> set[int]:
    """Steps a diagnostic callback sampled (profiled, counted, re-measured): slower than the others by
    the diagnostic's own cost, so every measured window leaves them out. Indices count the fit's
    batches from 0, as every callback of the pack does."""
    out: set[int] = set()
    for cb in getattr(trainer, "callbacks", None) or []:
        out.update(getattr(cb, "sampled_steps", None) or [])
    return out


def device_of(trainer: Any, pl_module: Any) -> torch.device:
    strategy = getattr(trainer, "strategy", None)
    root = getattr(strategy, "root_device", None)
    if isinstance(root, torch.device):
        return root
    return torch.device(getattr(pl_module, "device", "cpu"))


def log_scalars(pl_module: Any, values: dict[str, float], *, prog_bar: tuple[str, ...] = ()) -> None:
    """``self.log`` host scalars as CPU tensors: no host-device copy, and the progress bar's
    ``.item()`` on them never waits for the device."""
    for name, value in values.items():
        pl_module.log(name, torch.tensor(float(value)), prog_bar=name in prog_bar, on_step=True, on_epoch=False,
                      sync_dist=False, batch_size=1)
