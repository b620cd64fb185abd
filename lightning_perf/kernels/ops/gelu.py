"""GELU with the tanh approximation, alone (GPT-2 MLP) and gated (``gelu_tanh(a) * b``, GeGLU).

Maths (c = sqrt(2 / pi), z = c * (x + 0.044715 x^3), t = tanh(z)):
    gelu(x)  = 0.5 * x * (1 + t)
    gelu'(x) = 0.5 * (1 + t) + 0.5 * x * (1 - t^2) * c * (1 + 3 * 0.044715 x^2)
Gated: y = gelu(a) * b, da = dy * b * gelu'(a), db = dy * gelu(a).
Computed in fp32 registers, stored in the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_perf.kernels._utils import kernel_dtypes, can_launch, launch_device, cdiv
from lightning_perf.kernels.autotune import default_tuner, shape_bucket

__all__ = [
    "gelu_tanh",
    "gelu_tanh_mul",
    "gelu_tanh_reference",
    "gelu_tanh_mul_reference",
    "GeluTanhFunction",
    "GeluTanhMulFunction",
    "gelu_supported",
]

_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _tanh(z):
    # 1 - 2 / (exp(2z) + 1): exact limits +-1 for large |z|; the clamp keeps exp finite
    return 1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * z, 60.0)) + 1.0)


@triton.jit
def _gelu_fwd_kernel(A, B, Y, n, HAS_MUL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))
    y = 0.5 * a * (1.0 + t)
    if HAS_MUL:
        y = y * tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(A, B, DY, DA, DB, n, HAS_MUL: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))
    dgelu = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * a * a)
    if HAS_MUL:
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DB + offs, (dy * 0.5 * a * (1.0 + t)).to(DB.dtype.element_ty), mask=mask)
        dy = dy * b
    tl.store(DA + offs, (dy * dgelu).to(DA.dtype.element_ty), mask=mask)


_CONFIGS_GPU = [dict(BLOCK=b, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)]
# interpreter: every program costs milliseconds, so few large blocks (small tests still cross blocks)
_CONFIGS_CPU_SMALL = [dict(BLOCK=128, num_warps=4)]
_CONFIGS_CPU = [dict(BLOCK=8192, num_warps=4)]


def _launch(kernel, name: str, ref: torch.Tensor, *args, has_mul: bool) -> None:
    n = ref.numel()
    configs = _CONFIGS_GPU if ref.is_cuda else (_CONFIGS_CPU_SMALL if n <= 2048 else _CONFIGS_CPU)

    def run(cfg):
        kernel[(cdiv(n, cfg["BLOCK"]),)](*args, n, HAS_MUL=has_mul, **cfg)

    run(default_tuner().pick(name, (shape_bucket(n), ref.dtype, has_mul), configs, run, ref.device))


def gelu_fwd(a: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    a = a.contiguous()
    b = b.contiguous() if b is not None else None
    y = torch.empty_like(a)
    _launch(_gelu_fwd_kernel, "gelu_fwd", a, a, b if b is not None else a, y, has_mul=b is not None)
    return y


def gelu_bwd(a: torch.Tensor, b: Optional[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, dy = a.contiguous(), dy.contiguous()
    da = torch.empty_like(a)
    if b is None:
        _launch(_gelu_bwd_kernel, "gelu_bwd", a, a, a, dy, da, da, has_mul=False)
        return da, torch.empty(0, dtype=a.dtype, device=a.device)
    b = b.contiguous()
    db = torch.empty_like(b)
    _launch(_gelu_bwd_kernel, "gelu_bwd", a, a, b, dy, da, db, has_mul=True)
    return da, db


# ---- torch.compile: custom ops (opaque to Dynamo, no graph break) ------------------------------


@torch.library.custom_op("lightning_perf::gelu_tanh", mutates_args=())
def _gelu_op(a: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return gelu_fwd(a, b)


@_gelu_op.register_fake
def _(a, b):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.custom_op("lightning_perf::gelu_tanh_bwd", mutates_args=())
def _gelu_bwd_op(a: torch.Tensor, b: Optional[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gelu_bwd(a, b, dy)


@_gelu_bwd_op.register_fake
def _(a, b, dy):
    da = torch.empty_like(a, memory_format=torch.contiguous_format)
    db = torch.empty_like(b, memory_format=torch.contiguous_format) if b is not None else a.new_empty(0)
    return da, db


def _setup(ctx, inputs, output):
    a, b = inputs
    ctx.has_mul = b is not None
    ctx.save_for_backward(a, b if b is not None else a)


def _backward(ctx, dy):
    a, b = ctx.saved_tensors
    da, db = _gelu_bwd_op(a, b if ctx.has_mul else None, dy)
    return da, (db if ctx.has_mul else None)


_gelu_op.register_autograd(_backward, setup_context=_setup)


# ---- eager autograd ----------------------------------------------------------------------------


class GeluTanhFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return gelu_fwd(a, None)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (a,) = ctx.saved_tensors
        return gelu_bwd(a, None, dy)[0]


class GeluTanhMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return gelu_fwd(a, b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, b = ctx.saved_tensors
        return gelu_bwd(a, b, dy)


# ---- references and public functions -----------------------------------------------------------


def gelu_tanh_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x.float(), approximate="tanh").to(x.dtype)


def gelu_tanh_mul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.gelu(a.float(), approximate="tanh") * b.float()).to(a.dtype)


_GELU_FWD_DEVICE = launch_device(_gelu_fwd_kernel)  # decided at import: see launch_device


def gelu_supported(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> bool:
    if b is not None and (b.shape != a.shape or b.dtype != a.dtype):
        return False
    return a.dtype in kernel_dtypes(a.device) and can_launch(_GELU_FWD_DEVICE, a, *(() if b is None else (b,)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, fused forward and backward."""
    if torch.compiler.is_compiling():
        return _gelu_op(x, None)
    return GeluTanhFunction.apply(x)


def gelu_tanh_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(a) * b`` (GeGLU), fused forward and backward."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"gelu_tanh_mul needs a and b of one shape and dtype, got {tuple(a.shape)} {a.dtype} "
                         f"and {tuple(b.shape)} {b.dtype}")
    if torch.compiler.is_compiling():
        return _gelu_op(a, b)
    return GeluTanhMulFunction.apply(a, b)
