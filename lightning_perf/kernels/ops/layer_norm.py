"""LayerNorm with an optional fused residual add, forward and backward in Triton.

    h = x (+ residual);  y = (h - mean(h)) / sqrt(var(h) + eps) * w + b   (statistics in fp32)

The kernels (shared with RMSNorm) live in ``_row_norm.py``; this file holds the
public function, its module and the reference.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from lightning_perf.kernels.ops._row_norm import apply_norm, norm_supported
from lightning_perf.kernels.ops.rms_norm import _check

__all__ = ["layer_norm", "layer_norm_reference", "LayerNorm", "layer_norm_supported"]


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
    residual: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """LayerNorm of ``x`` (or of ``x + residual``) over the last dimension.

    Returns ``y``, or ``(y, x + residual)`` when ``residual`` is given.
    """
    _check(x, weight, bias, residual)
    return apply_norm(x, weight, bias, residual, float(eps), False)


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
    residual: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    h = x if residual is None else x + residual
    y = torch.nn.functional.layer_norm(
        h.float(), (h.shape[-1],), weight.float(), bias.float() if bias is not None else None, eps
    ).to(x.dtype)
    return y if residual is None else (y, h)


def layer_norm_supported(x, weight, bias=None, residual=None) -> bool:
    return norm_supported(x, weight, bias, residual)


class LayerNorm(nn.Module):
    """``nn.Module`` around :func:`layer_norm` (weight ones, bias zeros)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual)
