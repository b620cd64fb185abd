"""The DeepSpeed engine as a ZeRO backend: creation, atomic checkpoints (no Lightning here).

DeepSpeed is optional (``pip install 'lightning-perf[deepspeed]'``) and imported lazily.
It runs on CPU processes too (its CPU accelerator over an existing gloo process group),
which is how the pack tests this backend without GPUs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_perf.parallel import checkpoint as ckpt
from lightning_perf.parallel.zero import DEEPSPEED_EXTRA

__all__ = ["initialize", "save", "load", "TAG"]

TAG = "zero"


def _deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - exercised where deepspeed is absent
        raise ImportError(f"the DeepSpeed backend needs DeepSpeed: {DEEPSPEED_EXTRA}") from e
    return deepspeed


def initialize(module: nn.Module, optimizer: Optimizer, config: dict[str, Any]) -> tuple[Any, Any]:
    """``deepspeed.initialize`` over the already initialised torch.distributed world."""
    deepspeed = _deepspeed()
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=config, dist_init_required=False
    )
    return engine, ds_optimizer


def save(engine: Any, path: Path, extra: dict[str, Any], *, rank: int) -> Path:
    """Engine shards into ``<path>.tmp``, ``extra.pt`` beside them, then an atomic rename to ``path``."""
    tmp = ckpt.prepare_tmp(path)
    engine.save_checkpoint(str(tmp), tag=TAG, client_state={}, save_latest=False)
    if rank == 0:
        blob = {"format": 1, "backend": "deepspeed", "extra": extra, "param_groups": [], "has_optim": True}
        torch.save(blob, tmp / ckpt.EXTRA_FILE)
    ckpt.commit_tmp(tmp, path)
    return path


def load(engine: Any, path: Path, *, weights_only: bool = True, load_optimizer: bool = True) -> dict[str, Any]:
    """Load engine shards (same world size as the save) and return ``extra``."""
    blob = ckpt.read_extra(path, weights_only=weights_only)
    if blob.get("backend") != "deepspeed":
        raise ValueError(f"{path} was not written by the DeepSpeed backend; resume it with backend='native'")
    load_path, _ = engine.load_checkpoint(
        str(ckpt.resolve(path)), tag=TAG, load_optimizer_states=load_optimizer, load_lr_scheduler_states=False
    )
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint under {path}")
    return blob["extra"]


def micro_batch_size(batch: Optional[Any]) -> int:
    """Leading dimension of the first tensor in ``batch`` (1 when unknown)."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return micro_batch_size(batch[0])
    return 1
