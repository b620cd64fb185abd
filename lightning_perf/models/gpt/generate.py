"""Autoregressive sampling from a GPT (temperature, top-k, early stop at an end token)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from lightning_perf.models.gpt.model import GPT

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    eos_id: Optional[int] = None,
    seed: Optional[int] = None,
) -> torch.Tensor:
    """Extend ``idx`` (B, T) by up to ``max_new_tokens`` sampled tokens.

    The context is cropped to the model's ``block_size``. ``temperature=0`` is greedy decoding (a negative
    or non-finite temperature is refused); ``top_k`` (None, or >= 1) samples among the likeliest tokens.
    Tokens beyond the tokenizer's ``vocab_size`` (the padding of the embedding) are never sampled.
    Sampling stops early once every sequence has produced ``eos_id``.
    """
    if idx.dim() != 2:
        raise ValueError(f"idx must be (batch, time), got shape {tuple(idx.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy decoding), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    cfg = model.config
    generator = None
    if seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    try:
        for _ in range(max_new_tokens):
            context = idx[:, -cfg.block_size :]
            logits = model(context)[:, -1, : cfg.vocab_size].float()  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
            if eos_id is not None:
                done |= nxt.squeeze(1) == eos_id
                if bool(done.all()):
                    break
    finally:
        model.train(was_training)
    return idx
