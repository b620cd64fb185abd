"""Whether tensors are DTensors (tensor parallelism, FSDP2 parameters).

The kernels take local tensors only: a call with a DTensor argument takes another path (PyTorch,
or torchao for FP8 layers). The models ask the same question of their parameters.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_dtensor"]


def is_dtensor(*tensors: Any) -> bool:
    """Whether any argument is a DTensor (tensor parallelism): the kernels see local shards only."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without distributed
        return False
    return any(isinstance(t, DTensor) for t in tensors)
