"""Document-causal attention for packed sequences: the mask, positions and the reference.

A packed window holds several documents back to back. ``doc_ids`` (B, T) int32 numbers them
inside each row (0, 0, 0, 1, 1, 2, ...: non-decreasing, a new id where a document starts), and
token i may attend to token j iff

    doc_ids[b, i] == doc_ids[b, j]  and  j <= i.

Why per-token ids rather than cu_seqlens offsets: every row has the same shape (B, T), so ids
collate, shard over data parallelism and pin like the tokens; FlexAttention's ``mask_mod`` reads
them by index (``doc[b, q] == doc[b, kv]``); a Triton kernel loads the ids of a query block and a
key block and skips the pair when their ranges do not meet (sound for any ids, tight for sorted
ones). Offsets are derivable on the device (:func:`document_positions`), the reverse needs a
ragged list per row.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

__all__ = [
    "check_doc_ids",
    "document_attention_reference",
    "document_block_mask",
    "document_mask",
    "document_mask_mod",
    "document_positions",
]


def check_doc_ids(doc_ids: torch.Tensor, q: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``doc_ids`` is an integer (B, T) tensor matching q (B, nh, T, hd)."""
    if doc_ids.dim() != 2 or doc_ids.shape[0] != q.shape[0] or doc_ids.shape[1] != q.shape[-2]:
        raise ValueError(f"doc_ids must be (B={q.shape[0]}, T={q.shape[-2]}), got {tuple(doc_ids.shape)}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must hold integers, got {doc_ids.dtype}")
    if doc_ids.device != q.device:
        raise ValueError(f"doc_ids is on {doc_ids.device} but q on {q.device}")


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64 position of each token inside its document: 0 where a document starts.

    A document starts at t = 0 and wherever ``doc_ids[:, t] != doc_ids[:, t - 1]``; the start of
    each token's document is the running maximum of the start indices.
    """
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_of = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_of


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where attention is allowed (same document, key not after query):
    the explicit mask for ``F.scaled_dot_product_attention``."""
    T = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal).unsqueeze(1)


def document_mask_mod(doc_ids: torch.Tensor) -> Callable:
    """FlexAttention ``mask_mod`` for document-causal attention over ``doc_ids`` (B, T)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


def document_block_mask(doc_ids: torch.Tensor, block_size: int = 128) -> Any:
    """FlexAttention ``BlockMask`` of one batch (heads broadcast): blocks with no pair in the same
    document are skipped, blocks inside one document below the diagonal run without a mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape
    return create_block_mask(document_mask_mod(doc_ids), B, None, T, T, device=doc_ids.device,
                             BLOCK_SIZE=block_size)


def document_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
                                 softmax_scale: Optional[float] = None) -> torch.Tensor:
    """softmax(scale * q k^T masked to same-document j <= i) v in fp32, k / v heads repeated for GQA;
    q (B, H, T, D), k / v (B, Hkv, T, D); cast back to q's dtype."""
    check_doc_ids(doc_ids, q)
    H, HK = q.shape[1], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kf = k.float().repeat_interleave(H // HK, dim=1)
    vf = v.float().repeat_interleave(H // HK, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~document_mask(doc_ids), float("-inf"))
    return (s.softmax(-1) @ vf).to(q.dtype)
