"""Pure torch.distributed building blocks (no Lightning): mesh layout, ZeRO 1/2/3, TP/PP, loss scaling, checkpoints.

Imports here are light; the engines (FSDP2, DCP, DeepSpeed) are imported when used.

- ``layout``: the device mesh, the 3D and ZeRO options, and their checks before any process group;
- ``sharding``: ZeRO 1/2/3 (DDP, FSDP2, DeepSpeed), FP8 all-gather, meta-model materialisation,
  gradient reduction and clipping, optimizers on local shards, distributed loss scaling;
- ``model_parallel``: tensor, context (ring attention) and pipeline parallelism, and their composition;
- ``compute``: activation checkpointing and ``torch.compile`` per block;
- ``checkpointing``: sharded, atomic checkpoints (synchronous and in the background) and what a load trusts;
- ``reliability``: dead-rank / hang diagnosis, the NCCL flight recorder, non-finite flags.
"""

from lightning_perf.parallel.checkpointing.async_checkpoint import AsyncCheckpointer
from lightning_perf.parallel.checkpointing.checkpoint import consolidate, load_checkpoint, save_checkpoint
from lightning_perf.parallel.layout.dims import ParallelDims
from lightning_perf.parallel.sharding.ddp import apply_ddp, shard_optimizer
from lightning_perf.parallel.sharding.fsdp import apply_fsdp, find_blocks
from lightning_perf.parallel.sharding.loss_scaler import DistributedLossScaler

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
