"""SwiGLU activation: ``silu(gate) * up``, forward and backward in one pass each.

Maths (s = sigmoid(g)):
    y  = g * s * u
    dg = dy * u * s * (1 + g * (1 - s))
    du = dy * g * s
Computed in fp32 registers, stored in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_perf.kernels._utils import kernel_dtypes, can_launch, launch_device, cdiv
from lightning_perf.kernels.autotune import default_tuner, shape_bucket

__all__ = ["swiglu", "swiglu_reference", "SwiGLUFunction", "swiglu_supported"]


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(Y + offs, (g * s * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(G, U, DY, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)


_CONFIGS_GPU = [dict(BLOCK=b, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)]
# interpreter: every program costs milliseconds, so few large blocks (small tests still cross blocks)
_CONFIGS_CPU_SMALL = [dict(BLOCK=128, num_warps=4)]
_CONFIGS_CPU = [dict(BLOCK=8192, num_warps=4)]


def _launch(kernel, name: str, n: int, ref: torch.Tensor, *args: torch.Tensor) -> None:
    configs = _CONFIGS_GPU if ref.is_cuda else (_CONFIGS_CPU_SMALL if n <= 2048 else _CONFIGS_CPU)

    def run(cfg):
        kernel[(cdiv(n, cfg["BLOCK"]),)](*args, n, **cfg)

    run(default_tuner().pick(name, (shape_bucket(n), ref.dtype), configs, run, ref.device))


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    _launch(_swiglu_fwd_kernel, "swiglu_fwd", gate.numel(), gate, gate, up, y)
    return y


def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up, dy = gate.contiguous(), up.contiguous(), dy.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    _launch(_swiglu_bwd_kernel, "swiglu_bwd", gate.numel(), gate, gate, up, dy, dg, du)
    return dg, du


@torch.library.custom_op("lightning_perf::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_fwd(gate, up)


@_swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("lightning_perf::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_bwd(gate, up, dy)


@_swiglu_bwd_op.register_fake
def _(gate, up, dy):
    return torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(
        up, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return tuple(_swiglu_bwd_op(gate, up, dy))


_swiglu_op.register_autograd(_backward, setup_context=_setup)


class SwiGLUFunction(torch.autograd.Function):
    """Eager autograd path (no custom-op dispatch overhead); ``torch.compile`` uses the custom op."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        return swiglu_bwd(gate, up, dy)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, cast back to the input dtype."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


_SWIGLU_FWD_DEVICE = launch_device(_swiglu_fwd_kernel)  # decided at import: see launch_device


def swiglu_supported(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (
        gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.dtype in kernel_dtypes(gate.device)
        and can_launch(_SWIGLU_FWD_DEVICE, gate, up)
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the Llama MLP), fused forward and backward."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu needs gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")
    if torch.compiler.is_compiling():
        return _swiglu_op(gate, up)
    return SwiGLUFunction.apply(gate, up)
