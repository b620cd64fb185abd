"""Read a run's settings (``perf.run_settings.RunSettings``) off the Trainer, its strategy and the module.

A strategy or a module that defines ``perf_settings()`` states what it knows of itself (a
``perf.run_settings.PerfSettings``); what neither states is read from Lightning's public attributes
and from the model itself (compiled submodules, checkpointed blocks). Nothing here knows a strategy
or a module class: any of them works, and the pack's own say what they know through the method.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_perf.callbacks._utils import device_of, layout_of
from lightning_perf.parallel.compute.activation_checkpointing import checkpointing_mode
from lightning_perf.perf.collection import scheduled_every
from lightning_perf.perf.run_settings import PerfSettings, RunSettings

__all__ = ["run_settings_of", "perf_settings_of", "compiled_modules"]

_FSDP1_STAGES = {"FULL_SHARD": 3, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}


def perf_settings_of(obj: Any) -> PerfSettings:
    """What ``obj`` (a strategy or a LightningModule) states through ``perf_settings()``; nothing without it."""
    method = getattr(obj, "perf_settings", None)
    if not callable(method):
        return PerfSettings()
    stated = method()
    if not isinstance(stated, PerfSettings):  # another meaning of the name: read the public attributes instead
        warnings.warn(f"{type(obj).__name__}.perf_settings() returned a {type(stated).__name__}, not a "
                      "lightning_perf.perf.PerfSettings: the performance callbacks ignore it", stacklevel=2)
        return PerfSettings()
    return stated


def compiled_modules(module: nn.Module) -> list[str]:
    """Names of the submodules that run under ``torch.compile`` (``""``: the module itself)."""
    out = []
    for name, m in module.named_modules():
        if getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule":
            out.append(name)
    if getattr(module, "_compiler_ctx", None):  # Trainer.fit(torch.compile(module)): unwrapped by Lightning
        out.insert(0, "")
    return out


def _compile(pl_module: nn.Module,
             stated: tuple[PerfSettings, ...]) -> tuple[Optional[bool], Optional[str], Optional[str]]:
    """(compiled, scope, mode): the first compile stated (the module's, then the strategy's), else what the
    model's own submodules show."""
    for s in stated:
        if s.compile_mode is not None:
            return True, s.compile_scope or "block", s.compile_mode
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


def _checkpointing(pl_module: nn.Module, stated: tuple[PerfSettings, ...]) -> str:
    """The first activation checkpointing stated (the module's, then the strategy's: blocks the module
    checkpointed keep their mode), else what the model's blocks show."""
    for s in stated:
        if s.activation_checkpointing not in (None, "none"):
            return s.activation_checkpointing  # type: ignore[return-value]
    for m in pl_module.modules():
        mode = checkpointing_mode(m)
        if mode is not None:
            return mode
        if type(m).__name__ == "CheckpointWrapper":
            return "full"
    return "none"


def _zero_stage(strategy: Any) -> Optional[int]:
    """Lightning's own strategies, by their public attributes."""
    name = type(strategy).__name__
    if name in ("SingleDeviceStrategy", "DDPStrategy"):
        return 0
    if name == "FSDPStrategy":
        return _FSDP1_STAGES.get(getattr(getattr(strategy, "sharding_strategy", None), "name", ""), None)
    config = getattr(strategy, "config", None)
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
    by_strategy = perf_settings_of(strategy)
    by_module = perf_settings_of(pl_module)
    device = device_of(trainer, pl_module) if pl_module is not None else torch.device("cpu")
    layout = layout_of(trainer)
    precision = by_strategy.precision or str(getattr(trainer, "precision", None) or "") or None
    out = RunSettings(
        device_type=device.type,
        precision=precision,
        gpt=bool(by_module.gpt),
        accumulate_grad_batches=int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
        strategy=type(strategy).__name__ if strategy is not None else None,
        zero_stage=by_strategy.zero_stage if by_strategy.zero_stage is not None else _zero_stage(strategy),
        data_parallel_size=layout.data_parallel_size,
        tensor_parallel_size=by_strategy.tensor_parallel_size or 1,
        pipeline_parallel_size=by_strategy.pipeline_parallel_size or 1,
        fsdp_blocks_per_unit=by_strategy.fsdp_blocks_per_unit,
        kernels=by_module.kernels,
        attention=by_module.attention,
        fp8=by_module.fp8,
        gc_scheduled=scheduled_every() is not None,
    )
    if device.type == "cuda":
        out.device_name = torch.cuda.get_device_name(device)
        out.fp8_capable = torch.cuda.get_device_capability(device) >= (8, 9)
        out.expandable_segments = _expandable_segments()
    if pl_module is not None:
        stated = (by_module, by_strategy)
        out.compiled, out.compile_scope, out.compile_mode = _compile(pl_module, stated)
        out.activation_checkpointing = _checkpointing(pl_module, stated)
        out.n_params = sum(p.numel() for p in pl_module.parameters())
    loader = getattr(trainer, "train_dataloader", None)
    if loader is not None and hasattr(loader, "num_workers"):
        out.num_workers = int(loader.num_workers)
        out.pin_memory = bool(getattr(loader, "pin_memory", False))
        out.micro_batch = getattr(loader, "batch_size", None)
    out.optimizer, out.fused_optimizer = _optimizer(trainer)
    return out
