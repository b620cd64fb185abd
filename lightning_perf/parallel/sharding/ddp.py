"""ZeRO-1 over DDP: gradient all-reduce + an optimizer whose state is sharded over the ranks.

Built from torch's engines: ``DistributedDataParallel`` (bucketed all-reduce overlapped
with backward, optional compression through its communication hooks) and
``ZeroRedundancyOptimizer`` (each rank keeps the optimizer state of ~1/N of the
parameters, steps them, and broadcasts the updated parameters).
"""

from __future__ import annotations

import inspect
from typing import Any, Literal, Optional

import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

__all__ = ["apply_ddp", "register_compression", "shard_optimizer", "local_optimizer", "COMPRESSIONS"]

COMPRESSIONS = ("fp16", "bf16", "powersgd")


def apply_ddp(
    module: nn.Module,
    *,
    device_ids: Optional[list[int]] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    bucket_size_mb: float = 25.0,
    gradient_compression: Optional[Literal["fp16", "bf16", "powersgd"]] = None,
    powersgd_rank: int = 4,
    **ddp_kwargs: Any,
) -> nn.parallel.DistributedDataParallel:
    """Wrap ``module`` in DDP (rank 0's parameters are broadcast at construction)."""
    ddp = nn.parallel.DistributedDataParallel(
        module,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=bucket_size_mb,
        **ddp_kwargs,
    )
    if gradient_compression is not None:
        register_compression(ddp, gradient_compression, process_group=process_group, powersgd_rank=powersgd_rank)
    return ddp


def register_compression(
    ddp: nn.parallel.DistributedDataParallel,
    kind: str,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    powersgd_rank: int = 4,
    powersgd_start_iter: int = 2,
) -> None:
    """Compress DDP's gradient all-reduce with one of torch's communication hooks.

    ``fp16`` / ``bf16`` halve the bytes (gradients are cast for the all-reduce and back);
    ``powersgd`` sends a rank-``powersgd_rank`` approximation with error feedback after
    ``powersgd_start_iter`` plain all-reduce steps. ``bf16`` needs a CUDA + NCCL build.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if kind == "fp16":
        ddp.register_comm_hook(process_group, default_hooks.fp16_compress_hook)
    elif kind == "bf16":
        ddp.register_comm_hook(process_group, default_hooks.bf16_compress_hook)
    elif kind == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter,
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    else:
        raise ValueError(f"gradient_compression={kind!r} is not one of {COMPRESSIONS} or None")


def shard_optimizer(optimizer: Optimizer, *, process_group: Optional[dist.ProcessGroup] = None) -> Optimizer:
    """The same optimizer (class, param groups, hyper-parameters) as a ``ZeroRedundancyOptimizer``.

    State already present in ``optimizer`` is dropped (call this before the first step).
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    groups = []
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = list(group["params"])
        groups.append(g)
    # only what the constructor takes (AdamW's defaults carry Adam's decoupled_weight_decay flag)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    zero = ZeroRedundancyOptimizer(
        groups, optimizer_class=type(optimizer), process_group=process_group, parameters_as_bucket_view=True, **defaults
    )
    return zero


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The rank-local optimizer of a ``ZeroRedundancyOptimizer``, the optimizer itself otherwise."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return inner.optim if isinstance(inner, ZeroRedundancyOptimizer) else inner

