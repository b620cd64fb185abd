"""``torch._scaled_mm`` on CPU tensors at the speed of an fp32 matmul, for the test run.

PyTorch's CPU kernel of ``aten::_scaled_mm`` is an emulation some 300x slower than an fp32 matmul of
the same operands (a 256^3 product: 0.6 s against 1.5 ms on this suite's machines), which made the
FP8 tests the larger part of the suite's time. This kernel does the same arithmetic,

    out = (mat1 * scale_a) @ (mat2 * scale_b) in fp32 (+ bias), rounded once to out_dtype,

with fp32 accumulation in another order: results differ from PyTorch's kernel by fp32 rounding (as a
GPU's do). ``tests/kernels/test_cpu_scaled_mm.py`` checks it against PyTorch's kernel, run in a fresh
interpreter that never imported this module.

The replacement is registered for the CPU dispatch key of the same operator, so everything that
looks at operators (selective activation checkpointing, FLOP counting, the profiler, compiled graphs)
still sees ``aten._scaled_mm``. It also refuses what the CUDA kernel refuses and PyTorch's CPU kernel
lets through (operand layouts, sizes not divisible by 16, scale dtypes and shapes, bias and output
dtypes), so a call that would fail on a GPU fails in the CPU tests too.

Imported by ``conftest.py`` and by every process forked or spawned for a test (``_warm.enter``).
Processes started fresh as commands (``fresh=True``) run PyTorch's kernel.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check(mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
           bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> None:
    """The CUDA kernel's conditions on its arguments (torch 2.11-2.13, Hopper)."""
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise RuntimeError(f"_scaled_mm: both operands must be matrices, got {mat1.dim()}-D and {mat2.dim()}-D")
    if mat1.dtype not in _FP8 or mat2.dtype not in _FP8:
        raise RuntimeError(f"_scaled_mm: expected Float8 operands, got {mat1.dtype} and {mat2.dtype}")
    if mat1.dtype == mat2.dtype == torch.float8_e5m2:
        raise RuntimeError("_scaled_mm: two Float8_e5m2 operands are not supported")
    if mat1.size(1) != mat2.size(0):
        raise RuntimeError(f"_scaled_mm: shapes {tuple(mat1.shape)} and {tuple(mat2.shape)} cannot be multiplied")
    if mat1.size(1) % 16 or mat2.size(0) % 16 or mat2.size(1) % 16:
        raise RuntimeError(f"_scaled_mm: the contracted and output dimensions must be divisible by 16, "
                           f"got {tuple(mat1.shape)} @ {tuple(mat2.shape)}")
    if mat1.stride(1) != 1:
        raise RuntimeError(f"_scaled_mm: mat1 must be row-major, got strides {mat1.stride()}")
    if mat2.stride(0) != 1:
        raise RuntimeError(f"_scaled_mm: mat2 must be column-major, got strides {mat2.stride()}")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise RuntimeError(f"_scaled_mm: scales must be float32, got {scale_a.dtype} and {scale_b.dtype}")
    m, n = mat1.size(0), mat2.size(1)
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    if not (tensorwise or rowwise):
        raise RuntimeError(f"_scaled_mm: invalid scaling configuration, scales {tuple(scale_a.shape)} and "
                           f"{tuple(scale_b.shape)} for a ({m}, {n}) output")
    if rowwise and not tensorwise:
        if out_dtype != torch.bfloat16:
            raise RuntimeError(f"_scaled_mm: row-wise scaling writes bfloat16 only, asked for {out_dtype}")
        if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
            raise RuntimeError("_scaled_mm: row-wise scales must be contiguous")
    if bias is not None:
        if out_dtype == torch.float32:
            raise RuntimeError("_scaled_mm: a bias is not supported with a float32 output")
        if bias.dtype != out_dtype:
            raise RuntimeError(f"_scaled_mm: the bias must have the output's dtype {out_dtype}, got {bias.dtype}")


def scaled_mm(mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: Optional[torch.Tensor] = None, scale_result: Optional[torch.Tensor] = None,
              out_dtype: Optional[torch.dtype] = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``aten::_scaled_mm`` for CPU tensors: the operands scaled in fp32 (as PyTorch's kernel does), their
    product accumulated in fp32, biased, rounded once to ``out_dtype``."""
    if scale_result is not None:
        raise RuntimeError("_scaled_mm: scale_result (an FP8 output) is not used by the pack")
    out_dtype = mat1.dtype if out_dtype is None else out_dtype
    _check(mat1, mat2, scale_a, scale_b, bias, out_dtype)
    out = torch.mm(mat1.float() * scale_a, mat2.float() * scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# registered when this module is first imported, once per process; held so the registration stays
_LIBRARY = torch.library.Library("aten", "IMPL")
with warnings.catch_warnings():  # "Overriding a previously registered kernel ..." is the point
    warnings.simplefilter("ignore")
    _LIBRARY.impl("_scaled_mm", scaled_mm, "CPU")
