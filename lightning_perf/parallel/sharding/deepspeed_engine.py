"""The DeepSpeed engine as a ZeRO backend: its config, creation, atomic checkpoints (no Lightning here).

DeepSpeed is optional (``pip install 'lightning-perf[deepspeed]'``) and imported lazily.
It runs on CPU processes too (its CPU accelerator over an existing gloo process group),
which is how the pack tests this backend without GPUs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_perf.parallel.checkpointing import checkpoint as ckpt
from lightning_perf.parallel.layout.zero_config import DEEPSPEED_EXTRA, ZeroConfig

__all__ = ["deepspeed_config", "initialize", "save", "load", "TAG"]

TAG = "zero"


def _deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - exercised where deepspeed is absent
        raise ImportError(f"the DeepSpeed backend needs DeepSpeed: {DEEPSPEED_EXTRA}") from e
    return deepspeed


def deepspeed_config(
    cfg: ZeroConfig,
    *,
    precision: str,
    micro_batch_size: int,
    world_size: int,
    accumulate: int,
    gradient_clip: Optional[float] = None,
) -> dict[str, Any]:
    """A DeepSpeed config dict for ``cfg`` (user ``deepspeed_config`` entries win)."""
    bucket = int(cfg.bucket_size_mb * 2**20 / 4)  # elements of fp32
    zero: dict[str, Any] = {
        "stage": cfg.stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if cfg.stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket * max(cfg.prefetch, 1)
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulate,
        "train_batch_size": micro_batch_size * accumulate * world_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16-mixed":
        config["bf16"] = {"enabled": True}
    elif precision == "16-mixed":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if gradient_clip:
        config["gradient_clipping"] = float(gradient_clip)
    _merge(config, cfg.deepspeed_config)
    return config


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


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
    ckpt._barrier()  # every rank's files are written: each fsyncs a share before the rename
    ckpt.sync_files(tmp)
    ckpt.commit_tmp(tmp, path)
    return path


def load(engine: Any, path: Path, *, weights_only: bool = True, load_optimizer: bool = True) -> dict[str, Any]:
    """Load engine shards (same world size as the save) and return ``extra``.

    Not verified: DeepSpeed reads its own files (with ``torch.load(weights_only=False)``), with no
    size or CRC check; a warning says so. ``extra.pt`` is read with ``weights_only`` as given.
    """
    blob = ckpt.read_extra(path, weights_only=weights_only)
    if blob.get("backend") != "deepspeed":
        raise ValueError(f"{path} was not written by the DeepSpeed backend; resume it with backend='native'")
    if ckpt._rank() == 0:
        warnings.warn(
            f"{path} is a DeepSpeed-backend checkpoint: its files are not checked (no sizes or CRC-32 recorded) "
            "and DeepSpeed unpickles them with weights_only=False; load only checkpoints you trust "
            "(docs/reliability.md, 'What a load checks')",
            UserWarning, stacklevel=2,
        )
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
