"""ZeRO configuration and the choice of engine per stage (no Lightning here).

=========  ======================================  ==================================
stage      native engine                           what is sharded over N ranks
=========  ======================================  ==================================
1          DDP + ``ZeroRedundancyOptimizer``        optimizer state
2          FSDP2, ``reshard_after_forward=False``   optimizer state, gradients
3          FSDP2, ``reshard_after_forward=True``    optimizer state, gradients, params
=========  ======================================  ==================================

``backend="deepspeed"`` runs the same stages through DeepSpeed (needed for CPU offload of
the optimizer state and, at stage 3, of the parameters); ``deepspeed_engine`` turns a
``ZeroConfig`` into DeepSpeed's config dict.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from lightning_perf.parallel.ddp import COMPRESSIONS
from lightning_perf.parallel.fsdp import WrapPolicy

__all__ = ["ZeroConfig", "require_deepspeed", "DEEPSPEED_EXTRA"]

DEEPSPEED_EXTRA = "pip install 'lightning-perf[deepspeed]'"
_INITS = ("rank0", "meta")


def require_deepspeed(reason: str) -> None:
    """Raise an ImportError naming the extra when DeepSpeed is missing."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"{reason} needs DeepSpeed, which is not installed: {DEEPSPEED_EXTRA}")


@dataclass(kw_only=True)
class ZeroConfig:
    """Validated ZeRO options (see ``lightning_perf.strategies.ZeroStrategy`` for their meaning)."""

    stage: int = 3
    backend: Optional[Literal["native", "deepspeed"]] = None  # None: deepspeed if offloading, else native
    offload_optimizer: bool = False
    offload_params: bool = False
    bucket_size_mb: float = 25.0
    prefetch: int = 1
    reshard_after_forward: Optional[bool] = None  # None: stage == 3
    wrap_policy: Optional[WrapPolicy] = None
    gradient_compression: Optional[Literal["fp16", "bf16", "powersgd"]] = None
    powersgd_rank: int = 4
    init: Literal["rank0", "meta"] = "rank0"
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    fp8_all_gather: bool = False
    blocks_per_unit: int = 1

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got stage={self.stage!r}")
        if self.backend is None:
            self.backend = "deepspeed" if (self.offload_optimizer or self.offload_params) else "native"
        if self.backend not in ("native", "deepspeed"):
            raise ValueError(f"backend must be 'native' or 'deepspeed', got {self.backend!r}")
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"offload_params needs stage 3 (parameters are sharded only there), got stage={self.stage}"
            )
        if (self.offload_optimizer or self.offload_params) and self.backend != "deepspeed":
            raise ValueError("CPU offload runs through DeepSpeed: use backend='deepspeed' (or leave backend unset)")
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
        from lightning_perf.parallel.fsdp import check_blocks_per_unit

        check_blocks_per_unit(self.blocks_per_unit)
        if self.blocks_per_unit > 1 and not self.uses_fsdp:
            raise ValueError("blocks_per_unit groups FSDP2 units: it needs stage 2 or 3 with backend='native', "
                             f"got stage={self.stage}, backend={self.backend!r}")
        if self.reshard_after_forward is None:
            self.reshard_after_forward = self.stage == 3
        if self.reshard_after_forward and self.stage != 3:
            raise ValueError(f"reshard_after_forward=True is ZeRO-3; stage={self.stage} keeps parameters whole")

    @property
    def uses_fsdp(self) -> bool:
        return self.backend == "native" and self.stage in (2, 3)

    @property
    def uses_ddp(self) -> bool:
        return self.backend == "native" and self.stage == 1

    def check_precision(self, precision: str, device_type: Optional[str] = None) -> None:
        """Raise ValueError for a precision this backend cannot run (before any collective)."""
        if self.backend == "deepspeed":
            if precision == "bf16-true":
                raise ValueError(
                    "backend='deepspeed' keeps fp32 master weights: use 'bf16-mixed' instead of 'bf16-true'"
                )
            if precision == "16-mixed" and device_type == "cpu":
                raise ValueError("DeepSpeed's CPU accelerator has no fp16: use precision='bf16-mixed' or '32-true'")
