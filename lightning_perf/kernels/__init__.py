"""Triton kernels for LLM training, each with a pure-PyTorch reference beside it.

Functional API (autograd-aware, ``torch.compile``-friendly through custom ops):
``flash_attention``, ``fused_linear_cross_entropy``, ``rms_norm``, ``layer_norm``,
``rotary_embedding``, ``swiglu``, ``gelu_tanh``, ``gelu_tanh_mul``; ``fp8_linear`` (a tensorwise FP8
matmul through ``torch._scaled_mm``, Triton for the casts; current or delayed scaling). FP8 linear
layers: ``kernels.torchao_fp8`` (torchao.float8). ``kernels.dtensor.is_dtensor``: whether tensors are
DTensors, which the kernels do not take.

Submodules are imported on first use: importing this package does not import
Triton, so CPU-only installs (Triton is the ``triton`` extra) and other modules are
unaffected. On CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``
set before first use); ``lightning_perf.kernels.dispatch`` falls back to the references
elsewhere, and where Triton is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "flash_attention",
    "fused_linear_cross_entropy",
    "rms_norm",
    "layer_norm",
    "rotary_embedding",
    "swiglu",
    "gelu_tanh",
    "gelu_tanh_mul",
    "fp8_linear",
    "RMSNorm",
    "LayerNorm",
    "configure",
    "AutotuneCache",
    "KernelTuner",
]

_WHERE = {
    "flash_attention": "flash_attention",
    "fused_linear_cross_entropy": "fused_linear_cross_entropy",
    "rms_norm": "rms_norm",
    "RMSNorm": "rms_norm",
    "layer_norm": "layer_norm",
    "LayerNorm": "layer_norm",
    "rotary_embedding": "rotary",
    "swiglu": "swiglu",
    "gelu_tanh": "gelu",
    "gelu_tanh_mul": "gelu",
    "fp8_linear": "fp8_linear",
    "configure": "autotune",
    "AutotuneCache": "autotune",
    "KernelTuner": "autotune",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        where = _WHERE[name]
        try:
            module = importlib.import_module(f"{__name__}.{where}" if where == "autotune" else f"{__name__}.ops.{where}")
        except ModuleNotFoundError as err:
            if err.name != "triton":
                raise
            raise ModuleNotFoundError(f"{__name__}.{name} needs Triton: pip install 'lightning-perf[triton]' (Linux)",
                                      name="triton") from err
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
