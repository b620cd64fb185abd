"""The ops: Triton kernels, their launchers, the autograd Function or custom op, the PyTorch reference.

A small op is one file (``rms_norm``, ``swiglu``, ...). The larger ones are one file per part, named
after the op:

    flash_attention            the autograd Function, custom ops, reference and ``flash_attention``
    flash_attention_forward    its forward kernels
    flash_attention_backward   its backward kernels
    flash_attention_configs    its launch configurations
    flash_attention_launch     its launchers (``flash_attn_fwd``, ``flash_attn_bwd``)

    fp8_casts                  FP8 casts: amax and scale-cast-transpose kernels with their launchers
    fp8_amax_history           delayed FP8 scaling: the amax history and the scales taken from it
    fp8_linear                 the FP8 linear: autograd Function and ``fp8_linear``
    fp8_gelu_operand           gelu(u + b) and its gradient as the FP8 cast kernels compute them
    fp8_gelu_mlp               the GELU MLP of two delayed FP8 linears, GELU fused into the casts

(``_row_norm`` holds the kernels that ``rms_norm`` and ``layer_norm`` share.) Import the files
directly (``from lightning_perf.kernels.ops import swiglu``); the public functions are re-exported
lazily by ``lightning_perf.kernels``.
"""

__all__ = [
    "flash_attention",
    "flash_attention_forward",
    "flash_attention_backward",
    "flash_attention_configs",
    "flash_attention_launch",
    "fused_linear_cross_entropy",
    "rms_norm",
    "layer_norm",
    "rotary",
    "swiglu",
    "gelu",
    "fp8_casts",
    "fp8_amax_history",
    "fp8_linear",
    "fp8_gelu_operand",
    "fp8_gelu_mlp",
]
