"""The FP8 GELU MLP's hidden operand where it is cast: gelu_tanh(u + b) and its gradient.

With u = x W_up^T the first matmul's output and b its bias, the operand of the second matmul is
h = gelu_tanh(u + b), and the backward's operand is dL/du = dL/dh * gelu_tanh'(u + b). The Triton
helpers here compute one tile of either from u, b (and dL/dh) in fp32 registers; the FP8 amax and
cast-transpose kernels call them (``fp8_casts``, ``fp8_gelu_mlp``), so the operand is never stored in
high precision. Beside them, the references: the maths in float64 (what the kernels are checked
against) and PyTorch's fp32 GELU ops (what runs where a kernel cannot).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["gelu_operand_reference"]

_C = 0.7978845608028654  # sqrt(2 / pi)


@triton.jit
def _gelu_parts(a):
    """(gelu_tanh(a), gelu_tanh'(a)) in fp32. With t = tanh(z), z = c (a + 0.044715 a^3), the factors 1 + t
    and 1 - t come from e = exp(2z) as 2e / (1 + e) and 2 / (1 + e): no cancellation where t is near -1
    or 1, so both stay accurate relative to their own size in the tails."""
    z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    e = tl.exp(tl.minimum(2.0 * z, 60.0))  # below: underflows to 0 (h, gelu' -> 0); above: keeps e finite
    r = 1.0 / (1.0 + e)
    p = 2.0 * e * r  # 1 + t
    m = 2.0 * r  # 1 - t
    d = 0.5 * p + 0.5 * a * p * m * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * a * a)
    return 0.5 * a * p, d


@triton.jit
def _gelu_operand(U, BIAS, DH, rows, cols, mask, stride_um, stride_dm, HAS_BIAS: tl.constexpr, GRAD: tl.constexpr):
    """One tile of gelu(u + b) (forward) or dL/dh * gelu'(u + b) (GRAD), fp32, zero outside ``mask``;
    ``rows`` and ``cols`` broadcast to the tile (either may be the transposed index)."""
    a = tl.load(U + rows.to(tl.int64) * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    h, d = _gelu_parts(a)
    if GRAD:
        h = d * tl.load(DH + rows.to(tl.int64) * stride_dm + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, h, 0.0)



def _gelu_parts_reference(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = a.double()  # float64: the fp32 kernel is checked against these to its own rounding
    e = torch.exp(torch.clamp(2 * _C * (a + 0.044715 * a * a * a), max=600.0))  # 1 +- tanh as the kernel forms them
    p, m = 2.0 * e / (1.0 + e), 2.0 / (1.0 + e)
    return 0.5 * a * p, 0.5 * p + 0.5 * a * p * m * _C * (1.0 + 3.0 * 0.044715 * a * a)


def gelu_operand_reference(u: torch.Tensor, bias: Optional[torch.Tensor], dh: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """``gelu_tanh(u + b)`` or, with ``dh``, ``dh * gelu_tanh'(u + b)``: u + b in fp32, the rest in float64,
    returned in fp32."""
    a = u.float() if bias is None else u.float() + bias.float()
    h, d = _gelu_parts_reference(a)
    return (h if dh is None else dh.double() * d).float()


def _gelu_operand_fp32(u: torch.Tensor, bias: Optional[torch.Tensor], dh: Optional[torch.Tensor]) -> torch.Tensor:
    """The operand as PyTorch's fp32 GELU ops compute it (what the unfused layers compute off the GPU)."""
    a = u.float() if bias is None else u.float() + bias.float()
    if dh is None:
        return F.gelu(a, approximate="tanh")
    return torch.ops.aten.gelu_backward(dh.float(), a, approximate="tanh")
