"""One causal GQA attention case and its reference, shared by the context-parallel tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_gqa_case(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``q`` (2, 4 heads, T = 16, 8), ``k`` and ``v`` with 2 heads, a gradient for the output, and SDPA's
    causal attention over the whole sequence with its backward run: ``(q, k, v, grad_out, ref)``, the
    reference gradients in ``q.grad``, ``k.grad``, ``v.grad``."""
    q = torch.randn(2, 4, 16, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 16, 8, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, 4, 16, 8, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.backward(grad_out)
    return q, k, v, grad_out, ref
