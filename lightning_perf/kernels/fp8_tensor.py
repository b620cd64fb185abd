"""An FP8 weight with its scale, standing in for the higher-precision weight it approximates.

FSDP2 all-gathers FP8 shards into one (``lightning_perf.parallel.fp8_all_gather``) and
``fp8_linear`` takes its FP8 data and scale directly, without quantising the weight again.
It lives here, below both, so the kernels never import the parallel layer.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["Float8GatheredWeight"]

aten = torch.ops.aten


class Float8GatheredWeight(torch.Tensor):
    """An all-gathered weight in FP8 (``data / scale`` approximates it), logically of ``dtype``.

    ``fp8_linear`` multiplies with ``data`` and ``scale`` directly; views keep them; any other op
    runs on the dequantised values (``(data / scale).to(dtype)``), so code that does not know about
    FP8 still computes with the weight the matmuls use.
    """

    _data: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> "Float8GatheredWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self._data = data
        self._scale = scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Float8GatheredWeight({self._data!r}, scale={self._scale!r}, dtype={self.dtype})"

    def dequantize(self) -> torch.Tensor:
        return (self._data.float() / self._scale).to(self.dtype)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.dequantize().__reduce_ex__(protocol)  # saved as the values it stands for

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default,
                    aten.t.default, aten.transpose.int) and isinstance(args[0], Float8GatheredWeight):
            w = args[0]
            return Float8GatheredWeight(func(w._data, *args[1:], **kwargs), w._scale, w.dtype)
        args, kwargs = tree_map_only(Float8GatheredWeight, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> "Float8GatheredWeight":
        return Float8GatheredWeight(inner["_data"], inner["_scale"], meta)
