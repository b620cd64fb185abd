"""Lightning strategies of the pack, and their registration under short names."""

from typing import Any

from lightning_perf.strategies.base import PerfParallelStrategy
from lightning_perf.strategies.parallel3d import Parallel3DStrategy
from lightning_perf.strategies.zero import ZeroStrategy

__all__ = ["PerfParallelStrategy", "Parallel3DStrategy", "ZeroStrategy", "register_strategies", "STRATEGY_NAMES"]

# name -> (class, description, init arguments)
STRATEGY_NAMES: dict[str, tuple[type, str, dict[str, Any]]] = {
    "zero1": (ZeroStrategy, "ZeRO-1: DDP + sharded optimizer state (ZeroRedundancyOptimizer)", {"stage": 1}),
    "zero2": (ZeroStrategy, "ZeRO-2: FSDP2, gradients and optimizer state sharded", {"stage": 2}),
    "zero3": (ZeroStrategy, "ZeRO-3: FSDP2, parameters, gradients and optimizer state sharded", {"stage": 3}),
    "zero2_offload": (
        ZeroStrategy,
        "ZeRO-2 with optimizer state and its step on the CPU (FSDP2's CPUOffloadPolicy)",
        {"stage": 2, "backend": "native", "offload_optimizer": True},
    ),
    "zero3_offload": (
        ZeroStrategy,
        "ZeRO-3 with parameters, gradients, optimizer state and its step on the CPU (FSDP2's CPUOffloadPolicy)",
        {"stage": 3, "backend": "native", "offload_optimizer": True, "offload_params": True},
    ),
    "parallel3d": (
        Parallel3DStrategy,
        "3D parallelism: pipeline x data (ZeRO via FSDP2) x tensor parallel over one device mesh",
        {},
    ),
}


def register_strategies() -> None:
    """Add the pack's names to Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (cls, description, init_params) in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **init_params)
