"""Activation checkpointing per block: recompute a block's activations in backward.

The block's ``forward`` is replaced on the instance (no wrapper module), so parameter
names do not change: checkpoints, FSDP wrapping and tensor-parallel plans keyed by
name keep working after it.

``"selective"`` runs torch's selective checkpointing with a policy that keeps the outputs of
matmuls and attention kernels (``_SAVE_OPS``) and of the pack's own ops whose recomputation would
repeat communication or attention (``_SAVE_OP_NAMES``): under context parallelism the ring
attention op (its output and log-sum-exp) and the K / V all-gather of the ``"allgather"`` mode
(``parallel.model_parallel.context_parallel``), so a block's recomputation runs no cp
communication. ``"full"`` keeps only the block input and recomputes everything, cp
communication included.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["AC_MODES", "apply_activation_checkpointing", "checkpointing_mode"]

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
# the pack's custom ops kept by name (their modules define them on import): recomputing them would
# pass K / V around the cp ring again, or all-gather them again, and recompute the attention
_SAVE_OP_NAMES = frozenset({
    "lightning_perf::ring_attention",  # output and LSE; its backward runs the ring itself
    "lightning_perf::cp_all_gather",  # the gathered K / V that the attention's backward reads
    "lightning_perf::flash_attn",  # the Triton attention's output and LSE, as SDPA's outputs above
})


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    if op in _SAVE_OPS or (getattr(op, "namespace", None) == "lightning_perf" and op.name() in _SAVE_OP_NAMES):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(module: nn.Module, original: Callable, mode: str, *args, **kwargs):  # noqa: ANN202
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    if mode == "selective":
        context_fn = partial(create_selective_checkpoint_contexts, _selective_policy)
        return checkpoint(original, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    return checkpoint(original, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str) -> None:
    """Recompute each block's activations in backward.

    ``full`` keeps only the block input; ``selective`` keeps matmul and attention outputs (and,
    under context parallelism, the cp attention's output and LSE, or its gathered K / V) and
    recomputes norms and elementwise ops. The block's ``forward`` is replaced on the
    instance, so parameter names do not change.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {AC_MODES}")
    if mode == "none":
        return
    for block in blocks:
        if checkpointing_mode(block) is not None:  # checkpointed already (by the module, say): kept as it is
            continue
        original = block.forward
        block.forward = partial(_checkpointed_forward, block, original, mode)  # type: ignore[method-assign]


def checkpointing_mode(module: nn.Module) -> Optional[str]:
    """``"full"`` or ``"selective"`` when :func:`apply_activation_checkpointing` checkpointed ``module``, else None.

    Read off the forward it installed on the instance, so the answer cannot drift from what runs.
    """
    forward = vars(module).get("forward")
    if isinstance(forward, partial) and forward.func is _checkpointed_forward:
        return forward.args[2]
    return None
