"""The GPT's swappable compute: attention, normalisation, activation and loss.

The model calls only these functions; each takes the implementation to use
(``"torch"`` reference paths or ``"triton"`` fused kernels from
``lightning_perf.kernels``), so kernels swap in without touching the model.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["attention", "norm", "rope", "mlp_activation", "lm_loss", "lm_logits"]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, impl: str = "sdpa",
    doc_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Scaled dot-product attention. q: (B, nh, T, hd); k, v: (B, nkv, T, hd) with nh % nkv == 0.

    ``impl``: "sdpa", or a backend of ``lightning_perf.kernels.attention_backends`` ("flex", "fa3",
    "fa4", "triton") or "auto" (the fastest, timed), each falling back to SDPA where it cannot run.
    ``doc_ids`` (B, T): packed documents, document-causal attention (token i sees j iff same document
    and j <= i) by a backend that takes the mask (``kernels.dispatch``; SDPA with a boolean mask)."""
    if doc_ids is not None:
        from lightning_perf.kernels import dispatch

        return dispatch.attention(q, k, v, causal=True, impl=impl, doc_ids=doc_ids)
    if impl != "sdpa":
        from lightning_perf.kernels import dispatch

        out = dispatch.attention(q, k, v, causal=causal, impl=impl)
        if out is not None:
            return out
    if k.shape[1] != q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    kind: str,
    eps: float,
    impl: str = "torch",
) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dimension, statistics in fp32."""
    if impl == "triton":
        from lightning_perf.kernels import dispatch

        out = dispatch.norm(x, weight, bias, kind=kind, eps=eps)
        if out is not None:
            return out
    if kind == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, impl: str = "torch") -> torch.Tensor:
    """Rotate pairs (x[..., :hd/2], x[..., hd/2:]) by the position angle. x: (B, nh, T, hd);
    cos / sin: (>= T, hd / 2), or (B, 1, T, hd / 2) for per-token positions. Never in place: selective
    activation checkpointing may keep x."""
    if impl == "triton":
        from lightning_perf.kernels import dispatch

        out = dispatch.rope(x, cos, sin)
        if out is not None:
            return out
    if cos.dim() == 2:  # a table (>= T, hd / 2); else per-token angles already gathered (B, 1, T, hd / 2)
        T = x.shape[-2]
        cos, sin = cos[:T], sin[:T]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mlp_activation(a: torch.Tensor, b: Optional[torch.Tensor], *, kind: str, impl: str = "torch") -> torch.Tensor:
    """``gelu_tanh(a)`` for the GPT-2 MLP, ``silu(a) * b`` for SwiGLU (a = gate, b = up)."""
    if impl == "triton":
        from lightning_perf.kernels import dispatch

        out = dispatch.mlp_activation(a, b, kind=kind)
        if out is not None:
            return out
    if kind == "swiglu":
        return F.silu(a) * b
    return F.gelu(a, approximate="tanh")


def lm_logits(x: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """(B, T, d) @ (V, d)^T -> (B, T, V)."""
    return F.linear(x, head_weight)


def lm_loss(
    x: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    impl: str = "torch",
) -> torch.Tensor:
    """Mean next-token cross-entropy of the LM head applied to ``x`` (B, T, d), targets (B, T)."""
    if impl == "triton":
        from lightning_perf.kernels import dispatch

        out = dispatch.lm_loss(x, head_weight, targets, ignore_index=ignore_index)
        if out is not None:
            return out
    logits = F.linear(x, head_weight)
    return F.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index
    )
