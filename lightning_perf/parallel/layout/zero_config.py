"""ZeRO configuration and the choice of engine per stage (no Lightning here).

=========  ======================================  ==================================
stage      native engine                           what is sharded over N ranks
=========  ======================================  ==================================
1          DDP + ``ZeroRedundancyOptimizer``        optimizer state
2          FSDP2, ``reshard_after_forward=False``   optimizer state, gradients
3          FSDP2, ``reshard_after_forward=True``    optimizer state, gradients, params
=========  ======================================  ==================================

``backend="deepspeed"`` runs the same stages through DeepSpeed; ``deepspeed_engine`` turns a
``ZeroConfig`` into DeepSpeed's config dict.

CPU offload: natively, FSDP2's ``CPUOffloadPolicy`` at stage 2 or 3 keeps the sharded fp32
parameters, their gradients and the optimizer state in host memory and the optimizer steps
there (the three cannot be separated, so ``offload_optimizer=True`` is the switch and
``offload_params`` may join it at stage 3); DeepSpeed offloads the optimizer state (stage 2/3)
and, at stage 3, the parameters separately.

Gradient accumulation: ``accumulation`` says how often, within one optimizer step, parameters are
all-gathered and gradients reduced (``parallel.sharding.accumulation``); ``"auto"`` is settled in the
strategy's setup, once ``accumulate_grad_batches`` is known.

HSDP: with ``replicate_size`` R > 1, FSDP2 shards over the ``world / R`` ranks of a group and
replicates over the R groups (a 2-D ("dp_replicate", "dp_shard") mesh): parameters are
gathered within a node and only the gradients cross nodes, in an all-reduce of each shard.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_perf.parallel.layout.dims import check_replicate_size, replicate_shape
from lightning_perf.parallel.sharding.accumulation import AccumulationMode, check_accumulation
from lightning_perf.parallel.sharding.ddp import COMPRESSIONS
from lightning_perf.parallel.sharding.fsdp import WrapPolicy, check_blocks_per_unit

__all__ = ["ZeroConfig", "require_deepspeed", "DEEPSPEED_EXTRA"]

DEEPSPEED_EXTRA = "pip install 'lightning-perf[deepspeed]'"
_INITS = ("rank0", "meta")


def require_deepspeed(reason: str) -> None:
    """Raise an ImportError naming the extra when DeepSpeed is missing."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"{reason} needs DeepSpeed, which is not installed: {DEEPSPEED_EXTRA}")


@dataclass(kw_only=True)
class ZeroConfig:
    """Validated ZeRO options (see ``lightning_perf.strategies.ZeroStrategy`` for their meaning).

    ``ZeroStrategy`` builds it from its own constructor arguments, which carry the same names and defaults.
    """

    stage: int = 3
    backend: Optional[Literal["native", "deepspeed"]] = None  # None: native, deepspeed to offload at stage 1
    offload_optimizer: bool = False
    offload_params: bool = False
    bucket_size_mb: float = 25.0
    prefetch: int = 1
    reshard_after_forward: Optional[bool] = None  # None: stage == 3
    wrap_policy: Optional[WrapPolicy] = None
    gradient_compression: Optional[Literal["fp16", "bf16", "powersgd"]] = None
    powersgd_rank: int = 4
    init: Literal["rank0", "meta"] = "rank0"
    deepspeed_config: Optional[dict[str, Any]] = None  # entries merged over the generated config (a copy)
    fp8_all_gather: bool = False
    blocks_per_unit: int = 1
    replicate_size: Union[int, Literal["auto"]] = 1  # "auto": the number of nodes
    accumulation: AccumulationMode = "auto"

    def __post_init__(self) -> None:
        self.deepspeed_config = dict(self.deepspeed_config or {})
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got stage={self.stage!r}")
        if self.backend is None:
            # offload at stage 1 (no FSDP2 to carry CPUOffloadPolicy) only DeepSpeed does
            self.backend = "deepspeed" if self.offload and self.stage == 1 else "native"
        if self.backend not in ("native", "deepspeed"):
            raise ValueError(f"backend must be 'native' or 'deepspeed', got {self.backend!r}")
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"offload_params needs stage 3 (parameters are sharded only there), got stage={self.stage}"
            )
        if self.offload and self.backend == "native":
            if self.stage == 1:
                raise ValueError("native CPU offload is FSDP2's CPUOffloadPolicy: it needs stage 2 or 3, got stage=1 "
                                 "(or use backend='deepspeed')")
            if not self.offload_optimizer:
                raise ValueError(
                    "native CPU offload (FSDP2's CPUOffloadPolicy) keeps the optimizer state on the CPU with the "
                    "parameters: pass offload_optimizer=True with offload_params=True (or use backend='deepspeed')")
        if self.backend == "deepspeed":
            require_deepspeed("ZeroStrategy(backend='deepspeed')" if not (self.offload_optimizer or self.offload_params)
                              else "ZeRO CPU offload")
        if self.bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.gradient_compression is not None:
            if self.gradient_compression not in COMPRESSIONS:
                raise ValueError(f"gradient_compression={self.gradient_compression!r} is not one of {COMPRESSIONS}")
            if self.stage != 1 or self.backend != "native":
                raise ValueError(
                    "gradient_compression applies to the DDP all-reduce of stage 1 (native); "
                    f"got stage={self.stage}, backend={self.backend!r}"
                )
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if self.init not in _INITS:
            raise ValueError(f"init={self.init!r} is not one of {_INITS}")
        if self.fp8_all_gather and not self.uses_fsdp:
            raise ValueError(
                "fp8_all_gather changes FSDP2's parameter all-gather: it needs stage 2 or 3 with backend='native', "
                f"got stage={self.stage}, backend={self.backend!r}")
        check_blocks_per_unit(self.blocks_per_unit)
        if self.blocks_per_unit > 1 and not self.uses_fsdp:
            raise ValueError("blocks_per_unit groups FSDP2 units: it needs stage 2 or 3 with backend='native', "
                             f"got stage={self.stage}, backend={self.backend!r}")
        if self.fp8_all_gather and self.native_offload:
            raise ValueError("fp8_all_gather with native CPU offload is not supported: the FP8 shards are made on "
                             "the GPU; use one of them")
        self._check_replicate_size()
        check_accumulation(self.accumulation, stage=self.stage, backend=self.backend)
        if self.reshard_after_forward is None:
            self.reshard_after_forward = self.stage == 3
        if self.reshard_after_forward and self.stage != 3:
            raise ValueError(f"reshard_after_forward=True is ZeRO-3; stage={self.stage} keeps parameters whole")

    def _check_replicate_size(self) -> None:
        check_replicate_size(
            self.replicate_size,
            fsdp_needs=None if self.uses_fsdp else
            f"stage 2 or 3 with backend='native', got stage={self.stage}, backend={self.backend!r}",
            fp8_all_gather=self.fp8_all_gather,
        )

    def mesh_shape(self, world_size: int, num_nodes: int = 1) -> tuple[int, int]:
        """(replicate, shard): the HSDP mesh over ``world_size`` ranks; (1, world_size) without replication.

        ``"auto"`` replicates over the ``num_nodes`` nodes (sharding within each); raises with the
        arithmetic when the world does not divide (before any process group exists).
        """
        return replicate_shape(world_size, self.replicate_size, num_nodes=num_nodes)

    @property
    def offload(self) -> bool:
        return self.offload_optimizer or self.offload_params

    @property
    def native_offload(self) -> bool:
        """FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer state in host memory."""
        return self.offload and self.backend == "native"

    @property
    def uses_fsdp(self) -> bool:
        return self.backend == "native" and self.stage in (2, 3)

    @property
    def uses_ddp(self) -> bool:
        return self.backend == "native" and self.stage == 1

    def check_precision(self, precision: str, device_type: Optional[str] = None) -> None:
        """Raise ValueError for a precision this backend cannot run, of the training or of the gradient
        all-reduce (before any collective)."""
        if self.gradient_compression == "bf16" and device_type == "cpu":
            raise ValueError(
                "gradient_compression='bf16' is torch's bf16 all-reduce hook, which needs CUDA and NCCL: on the CPU "
                "use 'fp16', 'powersgd' or None"
            )
        if self.backend == "deepspeed":
            if precision == "bf16-true":
                raise ValueError(
                    "backend='deepspeed' keeps fp32 master weights: use 'bf16-mixed' instead of 'bf16-true'"
                )
            if precision == "16-mixed" and device_type == "cpu":
                raise ValueError("DeepSpeed's CPU accelerator has no fp16: use precision='bf16-mixed' or '32-true'")
