"""Rotary position embedding (half-split convention of ``models.gpt.model.apply_rope``).

With x = (x1, x2) the two halves of the head dim and (cos, sin) of the position:
    y = (x1 * cos - x2 * sin,  x2 * cos + x1 * sin)
The backward is the inverse rotation (sin -> -sin):
    dx = (dy1 * cos + dy2 * sin,  dy2 * cos - dy1 * sin)
x is (B, H, T, hd) with any strides whose last dim is contiguous (q / k straight
from the projection's ``view(...).transpose(1, 2)``); cos / sin are (>= T, hd / 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_perf.kernels._utils import kernel_dtypes, can_launch, launch_device, next_power_of_2, cdiv
from lightning_perf.kernels.autotune import default_tuner, shape_bucket

__all__ = ["rotary_embedding", "rotary_embedding_reference", "RotaryFunction", "RotaryInplaceFunction",
           "rotary_supported"]


@triton.jit
def _rotary_kernel(X, Y, COS, SIN, H, T, HALF,
                   sxb, sxh, sxt, syb, syh, syt, scos,
                   INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program: BLOCK_T positions of BLOCK_H heads; the fp32 cos / sin tile (as many bytes as
    # the bf16 rows it rotates) is loaded once and reused for every head instead of once per head
    heads = tl.cdiv(H, BLOCK_H)
    b = tl.program_id(0) // heads
    h0 = (tl.program_id(0) % heads) * BLOCK_H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask = (t[:, None] < T) & (d[None, :] < HALF)
    cs_off = t[:, None] * scos + d[None, :]
    cos = tl.load(COS + cs_off, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + cs_off, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    x_row = X + b.to(tl.int64) * sxb + t[:, None].to(tl.int64) * sxt + d[None, :]
    y_row = Y + b.to(tl.int64) * syb + t[:, None].to(tl.int64) * syt + d[None, :]
    for i in range(BLOCK_H):
        h = h0 + i
        t_end = tl.where(h < H, T, 0)  # a head past H (tail program) writes nothing
        m = (t[:, None] < t_end) & (d[None, :] < HALF)
        x_base = x_row + h.to(tl.int64) * sxh
        y_base = y_row + h.to(tl.int64) * syh
        x1 = tl.load(x_base, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(y_base, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=m)
        tl.store(y_base + HALF, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=m)


_CONFIGS_GPU = tuple(dict(BLOCK_H=bh, BLOCK_T=bt, num_warps=w) for bh in (2, 4, 8) for bt in (16, 32, 64)
                     for w in (2, 4, 8))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, inplace: bool = False) -> torch.Tensor:
    """x rotated by the angles (inverse: backwards); ``inplace`` writes into x (last dim contiguous)."""
    if x.stride(-1) != 1:
        if inplace:
            raise ValueError("an in-place rotation needs x's last dimension contiguous")
        x = x.contiguous()
    B, H, T, D = x.shape
    half = D // 2
    if inplace:
        y = x  # each program reads both halves of its rows before writing them: no overlap between programs
    else:
        y = torch.empty_like(x)
        if y.stride(-1) != 1:
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    block_d = next_power_of_2(half)
    # interpreter: two heads per program, so head tails (odd H) are exercised by the tests
    configs = _CONFIGS_GPU if x.is_cuda else (dict(BLOCK_H=2, BLOCK_T=8 if T <= 64 else 64, num_warps=4),)

    def launch(cfg, out):
        grid = (B * cdiv(H, cfg["BLOCK_H"]), cdiv(T, cfg["BLOCK_T"]))
        _rotary_kernel[grid](x, out, cos, sin, H, T, half, *x.stride()[:3], *out.stride()[:3], cos.stride(0),
                             INVERSE=inverse, BLOCK_D=block_d, **cfg)

    scratch: list[torch.Tensor] = []

    def tune(cfg):  # the tuner may launch several times: never into x itself
        if inplace and not scratch:
            scratch.append(torch.empty_like(x))
        launch(cfg, scratch[0] if inplace else y)

    cfg = default_tuner().pick("rotary", (block_d, shape_bucket(T), shape_bucket(H), shape_bucket(B * H), x.dtype),
                               configs, tune, x.device)
    launch(cfg, y)
    return y


@torch.library.custom_op("lightning_perf::rotary", mutates_args=())
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return _rotate(x, cos, sin, inverse)


@_rotary_op.register_fake
def _(x, cos, sin, inverse):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.inverse = inverse
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return _rotary_op(dy, cos, sin, not ctx.inverse), None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup)


class RotaryInplaceFunction(torch.autograd.Function):
    """Eager in-place rotation: x is overwritten (marked dirty); the backward needs only cos / sin."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.mark_dirty(x)
        return _rotate(x, cos, sin, False, inplace=True)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, True), None, None


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, True), None, None


def rotary_embedding_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` in fp32, cast back."""
    T = x.shape[-2]
    c, s = cos[:T].float(), sin[:T].float()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


_ROTARY_DEVICE = launch_device(_rotary_kernel)  # decided at import: see launch_device


def rotary_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        x.dim() == 4 and x.shape[-1] % 2 == 0 and cos.shape == sin.shape and cos.dim() == 2
        and cos.shape[0] >= x.shape[-2] and cos.shape[1] == x.shape[-1] // 2
        and x.dtype in kernel_dtypes(x.device) and can_launch(_ROTARY_DEVICE, x, cos, sin)
    )


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Rotate x (B, H, T, hd) by the angles whose cos / sin are (>= T, hd / 2).

    ``inplace=True`` overwrites x and returns it where that is safe: in eager mode, with x's last
    dimension contiguous and x not a leaf that requires grad (q / k straight from their projections
    qualify: the projection's backward does not read its output). Elsewhere a new tensor is returned.
    Not inside selective activation checkpointing that keeps x (it keeps matmul outputs): the kept
    tensor would be rotated again on recomputation. The GPT therefore rotates out of place.
    """
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rotary_embedding needs x of shape (B, H, T, hd) with even hd, got {tuple(x.shape)}")
    T, half = x.shape[-2], x.shape[-1] // 2
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] < T or cos.shape[1] != half:
        raise ValueError(f"cos/sin must be (>= {T}, {half}), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if torch.compiler.is_compiling():
        return _rotary_op(x, cos, sin, False)
    if inplace and x.stride(-1) == 1 and not (x.is_leaf and x.requires_grad) and not _is_inference_view(x):
        return RotaryInplaceFunction.apply(x, cos, sin)
    return RotaryFunction.apply(x, cos, sin)


def _is_inference_view(x: torch.Tensor) -> bool:
    # an inference-mode tensor cannot be modified in place outside inference mode
    return x.is_inference() and not torch.is_inference_mode_enabled()
