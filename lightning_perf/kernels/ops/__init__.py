"""One file per op: Triton kernels, launchers, autograd function / custom op, PyTorch reference.

Import the files directly (``from lightning_perf.kernels.ops import swiglu``); the public
functions are re-exported lazily by ``lightning_perf.kernels``.
"""

__all__ = [
    "flash_attention",
    "fused_linear_cross_entropy",
    "rms_norm",
    "layer_norm",
    "rotary",
    "swiglu",
    "gelu",
    "fp8_linear",
]
