"""Pure torch.distributed building blocks (no Lightning): mesh layout, ZeRO 1/2/3, TP/PP, loss scaling, checkpoints.

Imports here are light; the engines (FSDP2, DCP, DeepSpeed) are imported when used.
"""

from lightning_perf.parallel.async_checkpoint import AsyncCheckpointer
from lightning_perf.parallel.checkpoint import consolidate, load_checkpoint, save_checkpoint
from lightning_perf.parallel.dims import ParallelDims
from lightning_perf.parallel.fsdp import apply_fsdp, find_blocks
from lightning_perf.parallel.loss_scaler import DistributedLossScaler
from lightning_perf.parallel.ddp import apply_ddp, shard_optimizer

__all__ = [
    "AsyncCheckpointer",
    "DistributedLossScaler",
    "ParallelDims",
    "apply_ddp",
    "apply_fsdp",
    "consolidate",
    "find_blocks",
    "load_checkpoint",
    "save_checkpoint",
    "shard_optimizer",
]
