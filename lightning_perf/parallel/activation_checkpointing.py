"""Activation checkpointing per block: recompute a block's activations in backward.

The block's ``forward`` is replaced on the instance (no wrapper module), so parameter
names do not change: checkpoints, FSDP wrapping and tensor-parallel plans keyed by
name keep working after it.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["AC_MODES", "apply_activation_checkpointing"]

AC_MODES = ("none", "full", "selective")

# ops whose outputs selective checkpointing keeps: recomputing them costs FLOPs, keeping them costs
# little memory relative to the elementwise/norm activations that are recomputed instead
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_mm.default,  # FP8 linears
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(module: nn.Module, original: Callable, mode: str, *args, **kwargs):  # noqa: ANN202
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    if mode == "selective":
        context_fn = partial(create_selective_checkpoint_contexts, _selective_policy)
        return checkpoint(original, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    return checkpoint(original, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str) -> None:
    """Recompute each block's activations in backward.

    ``full`` keeps only the block input; ``selective`` keeps matmul and attention outputs
    and recomputes norms and elementwise ops. The block's ``forward`` is replaced on the
    instance, so parameter names do not change.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {AC_MODES}")
    if mode == "none":
        return
    for block in blocks:
        if getattr(block, "_lp_checkpointing", None) is not None:
            continue
        original = block.forward
        block.forward = partial(_checkpointed_forward, block, original, mode)  # type: ignore[method-assign]
        block._lp_checkpointing = mode
