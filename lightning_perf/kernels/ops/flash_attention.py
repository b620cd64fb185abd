"""Flash attention in Triton, causal or not, with grouped-query attention and packed documents.

softmax(scale * Q K^T [mask]) V for q (B, H, T, D), k / v (B, Hkv, T, D) with H % Hkv == 0, D a power
of two in [16, 256], any T. The output is (B, H, T, D) laid out as (B, T, H, D) in memory, so the
model's ``transpose(1, 2).reshape(B, T, H * D)`` is free.

The op, one part per file:

    flash_attention_forward.py     the forward kernels (online softmax; pointers or tensor descriptors)
    flash_attention_backward.py    the backward kernels (dQ, dK / dV; two kernels or one fused pass)
    flash_attention_configs.py     the launch configurations the tuner chooses between
    flash_attention_launch.py      the launchers, ``flash_attn_fwd`` and ``flash_attn_bwd``
    flash_attention.py             this file: the autograd Function, the custom ops torch.compile
                                   traces, the reference and :func:`flash_attention`
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from lightning_perf.kernels._utils import can_launch, launch_device
from lightning_perf.kernels.ops.flash_attention_forward import _fwd_kernel
from lightning_perf.kernels.ops.flash_attention_launch import (
    _last_contiguous,
    _new_output,
    flash_attn_bwd,
    flash_attn_fwd,
)

__all__ = ["flash_attention", "attention_reference", "flash_attention_supported"]

_HEAD_DIMS = (16, 32, 64, 128, 256)


# ---- torch.compile: custom ops -----------------------------------------------------------------


@torch.library.custom_op("lightning_perf::flash_attn", mutates_args=())
def _flash_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
              doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_fwd(q, k, v, causal, scale, doc_ids=doc_ids)


@_flash_op.register_fake
def _(q, k, v, causal, scale, doc_ids=None):
    B, H, T, D = q.shape
    return _new_output(q), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("lightning_perf::flash_attn_bwd", mutates_args=())
def _flash_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  do: torch.Tensor, causal: bool, scale: float,
                  doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attn_bwd(q, k, v, o, lse, do, causal, scale, doc_ids=doc_ids)


@_flash_bwd_op.register_fake
def _(q, k, v, o, lse, do, causal, scale, doc_ids=None):
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, causal, scale, doc_ids = inputs
    o, lse = output
    ctx.causal, ctx.scale = causal, scale
    ctx.save_for_backward(q, k, v, o, lse, doc_ids)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, doc_ids = ctx.saved_tensors
    dq, dk, dv = _flash_bwd_op(q, k, v, o, lse, do, ctx.causal, ctx.scale, doc_ids)
    return dq, dk, dv, None, None, None


_flash_op.register_autograd(_backward, setup_context=_setup)


# ---- reference and public function -------------------------------------------------------------


def attention_reference(q, k, v, causal: bool = True, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Plain softmax(scale * Q K^T) V in fp32 with k / v heads repeated for GQA; cast back to q's dtype."""
    H, HK, T = q.shape[1], k.shape[1], q.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kf = k.float().repeat_interleave(H // HK, dim=1)
    vf = v.float().repeat_interleave(H // HK, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vf).to(q.dtype)


def _check(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention needs (B, H, T, D) tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B={B}, Hkv, T={T}, D={D})")
    if H % k.shape[1]:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({k.shape[1]})")
    if D not in _HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported; flash_attention takes {_HEAD_DIMS}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


_FWD_DEVICE = launch_device(_fwd_kernel)  # decided at import: see launch_device


def flash_attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    try:
        _check(q, k, v)
    except ValueError:
        return False
    dtypes = (torch.float16, torch.bfloat16) if q.is_cuda else (torch.float32, torch.float16)
    return q.dtype in dtypes and q.shape[2] > 0 and can_launch(_FWD_DEVICE, q, k, v)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    softmax_scale: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(scale * q k^T [causal mask]) v for q (B, H, T, D), k / v (B, Hkv, T, D); scale 1/sqrt(D) by default.

    ``doc_ids`` (B, T) integer: document-causal attention over packed documents (token i sees j iff
    ``doc_ids[b, i] == doc_ids[b, j]`` and j <= i; see ``kernels.document_mask``); it implies
    ``causal``. The same kernels run with the document mask compiled in (``HAS_DOCS``).
    """
    _check(q, k, v)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not (scale > 0 and math.isfinite(scale)):  # the kernels scale row maxima: a positive scale keeps them maxima
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    if doc_ids is not None:
        from lightning_perf.kernels.document_mask import check_doc_ids

        if not causal:
            raise ValueError("doc_ids gives document-causal attention; causal=False cannot be combined with it")
        check_doc_ids(doc_ids, q)
    # the custom op in eager mode too: selective activation checkpointing sees it and keeps its output and
    # LSE (an autograd.Function's kernels are invisible to it, so its forward would run again in the backward)
    return _flash_op(q, k, v, causal, scale, doc_ids)[0]
