"""RMSNorm with an optional fused residual add, forward and backward in Triton.

    h = x (+ residual);  y = h / sqrt(mean(h^2) + eps) * w   (statistics in fp32)

The kernels (shared with LayerNorm) live in ``_row_norm.py``; this file holds the
public function, its module and the reference.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from lightning_perf.kernels.ops._row_norm import apply_norm, norm_supported

__all__ = ["rms_norm", "rms_norm_reference", "RMSNorm", "rms_norm_supported"]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm of ``x`` (or of ``x + residual``) over the last dimension.

    Returns ``y``, or ``(y, x + residual)`` when ``residual`` is given (the new residual
    stream, written by the same kernel).
    """
    _check(x, weight, None, residual)
    return apply_norm(x, weight, None, residual, float(eps), True)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    h = x if residual is None else x + residual
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else (y, h)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None) -> bool:
    return norm_supported(x, weight, None, residual)


def _check(x, weight, bias, residual) -> None:
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"norm weight has shape {tuple(weight.shape)}, expected ({N},) for input {tuple(x.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"norm bias has shape {tuple(bias.shape)}, expected ({N},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")


class RMSNorm(nn.Module):
    """``nn.Module`` around :func:`rms_norm` (weight initialised to ones)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return rms_norm(x, self.weight, self.eps, residual)
