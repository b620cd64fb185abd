"""Read a run's settings (``perf.run_settings.RunSettings``) off the Trainer, its strategy and the module."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_perf.callbacks._utils import device_of, find_callback, layout_of
from lightning_perf.models.gpt.module import GPTLightningModule
from lightning_perf.parallel.config_3d import Parallel3DConfig
from lightning_perf.parallel.zero_config import ZeroConfig
from lightning_perf.perf.collection import scheduled_every
from lightning_perf.perf.run_settings import RunSettings

__all__ = ["run_settings_of", "compiled_modules"]

_FSDP1_STAGES = {"FULL_SHARD": 3, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}


def compiled_modules(module: nn.Module) -> list[str]:
    """Names of the submodules that run under ``torch.compile`` (``""``: the module itself)."""
    out = []
    for name, m in module.named_modules():
        if getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule":
            out.append(name)
    if getattr(module, "_compiler_ctx", None):  # Trainer.fit(torch.compile(module)): unwrapped by Lightning
        out.insert(0, "")
    return out


def _compile(pl_module: nn.Module, config: Any) -> tuple[Optional[bool], Optional[str], Optional[str]]:
    """(compiled, scope, mode)."""
    if isinstance(pl_module, GPTLightningModule):
        mode = pl_module.hparams.get("compile")
        if mode is not None:
            return True, pl_module.hparams.get("compile_scope", "block"), mode
    if isinstance(config, Parallel3DConfig) and config.compile is not None:
        return True, "block", config.compile
    names = compiled_modules(pl_module)
    if not names:
        return False, None, None
    if "" in names:
        return True, "model", None
    top = {n.split(".")[0] for n in names}
    children = {n for n, c in pl_module.named_children() if any(True for _ in c.parameters())}
    if len(names) == 1 and top == children:  # the one submodule that holds the whole model
        return True, "model", None
    return True, "submodules", None


def _checkpointing(pl_module: nn.Module, config: Any) -> str:
    if isinstance(pl_module, GPTLightningModule):
        return pl_module.hparams.get("activation_checkpointing", "none")
    if isinstance(config, Parallel3DConfig) and config.activation_checkpointing != "none":
        return config.activation_checkpointing
    for m in pl_module.modules():
        mode = getattr(m, "_lp_checkpointing", None)
        if mode is not None:
            return mode
        if type(m).__name__ == "CheckpointWrapper":
            return "full"
    return "none"


def _zero_stage(strategy: Any, config: Any) -> Optional[int]:
    if isinstance(config, ZeroConfig):
        return config.stage
    if isinstance(config, Parallel3DConfig):
        return config.zero_stage
    name = type(strategy).__name__
    if name in ("SingleDeviceStrategy", "DDPStrategy"):
        return 0
    if name == "FSDPStrategy":
        return _FSDP1_STAGES.get(getattr(getattr(strategy, "sharding_strategy", None), "name", ""), None)
    if name == "DeepSpeedStrategy" and isinstance(config, dict):
        stage = config.get("zero_optimization", {}).get("stage")
        return int(stage) if stage is not None else None
    return None


def _optimizer(trainer: Any) -> tuple[Optional[str], Optional[bool]]:
    optimizers = getattr(trainer, "optimizers", None) or []
    if not optimizers:
        return None, None
    opt = optimizers[0]
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer
    if isinstance(inner, torch.optim.Optimizer):
        opt = inner
    groups = getattr(opt, "param_groups", None) or [{}]
    fused = bool(groups[0]["fused"]) if "fused" in groups[0] else None
    return type(opt).__name__, fused


def _expandable_segments() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def run_settings_of(trainer: Any, pl_module: Optional[nn.Module] = None) -> RunSettings:
    """What this run has switched on, as far as the Trainer, the strategy and the module tell."""
    pl_module = pl_module if pl_module is not None else getattr(trainer, "lightning_module", None)
    strategy = getattr(trainer, "strategy", None)
    config = getattr(strategy, "config", None)
    device = device_of(trainer, pl_module) if pl_module is not None else torch.device("cpu")
    layout = layout_of(trainer)
    gpt = isinstance(pl_module, GPTLightningModule)
    out = RunSettings(
        device_type=device.type,
        precision=str(getattr(trainer, "precision", None) or "") or None,
        gpt=gpt,
        accumulate_grad_batches=int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
        strategy=type(strategy).__name__ if strategy is not None else None,
        zero_stage=_zero_stage(strategy, config),
        data_parallel_size=layout.data_parallel_size,
        gc_scheduled=scheduled_every() is not None,
    )
    if device.type == "cuda":
        out.device_name = torch.cuda.get_device_name(device)
        out.fp8_capable = torch.cuda.get_device_capability(device) >= (8, 9)
        out.expandable_segments = _expandable_segments()
    if isinstance(config, Parallel3DConfig):
        out.tensor_parallel_size = config.tensor_parallel_size
        out.pipeline_parallel_size = config.pipeline_parallel_size
        out.fsdp_blocks_per_unit = config.fsdp_blocks_per_unit if config.zero_stage >= 2 else None
    elif isinstance(config, ZeroConfig) and config.uses_fsdp:
        out.fsdp_blocks_per_unit = config.blocks_per_unit
    if pl_module is not None:
        out.compiled, out.compile_scope, out.compile_mode = _compile(pl_module, config)
        out.activation_checkpointing = _checkpointing(pl_module, config)
        out.n_params = sum(p.numel() for p in pl_module.parameters())
    if gpt:
        cfg = pl_module.config  # type: ignore[union-attr]
        out.kernels, out.attention, out.fp8 = cfg.kernels, cfg.attention, (cfg.fp8 or "none")
    loader = getattr(trainer, "train_dataloader", None)
    if loader is not None and hasattr(loader, "num_workers"):
        out.num_workers = int(loader.num_workers)
        out.pin_memory = bool(getattr(loader, "pin_memory", False))
        out.micro_batch = getattr(loader, "batch_size", None)
    out.optimizer, out.fused_optimizer = _optimizer(trainer)
    return out
