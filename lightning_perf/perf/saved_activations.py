"""Bytes autograd keeps for the backward pass, and what activation checkpointing would drop.

While installed (``torch.autograd.graph.saved_tensors_hooks``), every tensor saved for the
backward is counted once per storage; parameters (and views of them) are not activations and are
left out. Tensors saved inside a block (forward hooks on the blocks mark the inside) are split by
the op that produced them, walking back through views:

- kept by ``activation_checkpointing="selective"``: outputs of matmuls and attention (the ops the
  pack's selective policy saves);
- recomputed by it: every other op's output (norms, activations, residual adds), except the
  block's input, which every mode keeps;
- unclassified: tensors with no autograd history (made without grad, or inside a compiled
  graph): the split is then unknown.

``activation_checkpointing="full"`` keeps only each block's input. Either mode recomputes one
block at a time in the backward, which holds one block's share again while it runs.

Works on any device (a CPU run measures what a GPU run would hold, at the same shapes and
dtypes). Under ``torch.compile`` the hooks make Dynamo run the compiled code eagerly, so the
callback does not install them there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["SavedActivations", "SavedTensorCounter", "producer_of", "KEPT_BY_SELECTIVE"]

# autograd node names of the ops whose outputs selective checkpointing saves
# (lightning_perf.parallel.compute.activation_checkpointing._SAVE_OPS and _SAVE_OP_NAMES: the custom
# ops' nodes are named after the op)
KEPT_BY_SELECTIVE = ("MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward", "ScaledMmBackward",
                     "ScaledDotProduct", "GeneratedBackwardFor_lightning_perf_ring_attention_",
                     "GeneratedBackwardFor_lightning_perf_cp_all_gather_",
                     "GeneratedBackwardFor_lightning_perf_flash_attn_")
_VIEWS = ("ViewBackward", "UnsafeViewBackward", "TransposeBackward", "TBackward", "PermuteBackward",
          "SplitBackward", "SplitWithSizesBackward", "SliceBackward", "SelectBackward", "ExpandBackward",
          "AsStridedBackward", "ReshapeAliasBackward", "UnsqueezeBackward", "SqueezeBackward", "UnbindBackward",
          "AliasBackward")


def producer_of(t: torch.Tensor) -> Optional[str]:
    """The autograd node that produced ``t``'s data, through views (``None``: no history)."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__.startswith(_VIEWS):
        parents = [f for f, _ in fn.next_functions if f is not None]
        if not parents:
            break
        fn = parents[0]
    return None if fn is None else type(fn).__name__


@dataclass(kw_only=True)
class SavedActivations:
    """Bytes saved for the backward by one forward (see the module docstring)."""

    total: int = 0  # every saved activation
    in_blocks: int = 0  # saved inside a block
    block_inputs: int = 0  # the blocks' inputs (what full checkpointing keeps)
    recomputed_by_selective: int = 0  # inside blocks, produced by ops other than matmul / attention
    unclassified_in_blocks: int = 0  # inside blocks, no autograd history
    blocks: int = 0

    @property
    def selective_saves(self) -> Optional[int]:
        """Bytes ``"selective"`` would free at the peak: what it drops, less one block's recomputation
        (``None`` when most of the blocks' bytes have no history to classify)."""
        if self.blocks == 0 or self.unclassified_in_blocks > 0.5 * self.in_blocks:
            return None
        return int(self.recomputed_by_selective * (1 - 1 / self.blocks))

    @property
    def full_saves(self) -> Optional[int]:
        """Bytes ``"full"`` would free at the peak: the blocks' saved bytes less their inputs (kept) and
        one block's recomputation."""
        if self.blocks == 0:
            return None
        return max(0, int(self.in_blocks - self.block_inputs - self.in_blocks / self.blocks))


def _storage_key(t: torch.Tensor) -> Optional[tuple[Any, int, int]]:
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.data_ptr() == 0:
        return None
    return (t.device, storage.data_ptr(), storage.nbytes())


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: the shard this rank holds
    return to_local() if callable(to_local) and hasattr(t, "device_mesh") else t


class SavedTensorCounter:
    """Counts the bytes saved for backward while installed; ``blocks`` marks what is inside a block.

    Use ``install()`` before the forward and ``remove()`` before the backward (or as a context
    manager around the forward); ``result`` holds the counts.
    """

    def __init__(self, blocks: Sequence[nn.Module] = ()) -> None:
        self.blocks = list(blocks)
        self.result = SavedActivations(blocks=len(self.blocks))
        self._seen: set[tuple[Any, int, int]] = set()
        self._inputs: set[tuple[Any, int, int]] = set()
        self._depth = 0
        self._context: Any = None
        self._handles: list[Any] = []

    def _enter_block(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._depth += 1
        if args and isinstance(args[0], torch.Tensor):
            key = _storage_key(_local(args[0]))
            if key is not None and key not in self._inputs:
                self._inputs.add(key)
                self.result.block_inputs += key[2]

    def _leave_block(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._depth -= 1

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t  # a weight saved by its op: not an activation
        producer = producer_of(t)
        if producer is not None and producer.startswith("AccumulateGrad"):
            return t  # a view of a weight (a linear saves weight.t())
        local = _local(t)
        key = _storage_key(local)
        if key is None or key in self._seen:
            return t
        self._seen.add(key)
        nbytes = key[2]
        r = self.result
        r.total += nbytes
        if self._depth > 0:
            r.in_blocks += nbytes
            if key in self._inputs:
                pass  # a block's input: every mode keeps it
            elif producer is None:
                r.unclassified_in_blocks += nbytes
            elif not producer.startswith(KEPT_BY_SELECTIVE):
                r.recomputed_by_selective += nbytes
        return t

    def install(self) -> None:
        if self._context is not None:
            return
        self._handles = [h for b in self.blocks
                         for h in (b.register_forward_pre_hook(self._enter_block),
                                   b.register_forward_hook(self._leave_block))]
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._context.__enter__()

    def remove(self) -> None:
        if self._context is None:
            return
        self._context.__exit__(None, None, None)
        self._context = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self._depth = 0

    def __enter__(self) -> "SavedTensorCounter":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
