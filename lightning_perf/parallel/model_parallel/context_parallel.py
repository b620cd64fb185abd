"""Context parallelism: each rank of the "cp" group holds a part of every sequence.

The sequence is cut into ``2 * cp`` chunks of ``c = T / (2 * cp)`` tokens and cp rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` (in that order). Under a causal mask a query at
position ``t`` attends to ``t + 1`` keys, so a rank holding an early and the mirrored late
chunk does the same attention work as every other rank::

    T = 16, cp = 2, c = 4     chunks  0 1 2 3       rank 0: tokens 0-3 and 12-15
                              ranks   0 1 1 0       rank 1: tokens 4-11

Inputs, targets and position ids are cut this way on every cp rank (all cp ranks of one
data-parallel replica load the same batch); the model runs on its ``2c`` tokens with their
global positions, and only attention needs the other ranks:

- :func:`context_parallel_attention` all-gathers K and V over the cp group (the custom op
  ``lightning_perf::cp_all_gather``; its backward reduce-scatters dK and dV), puts the chunks back
  in global order and computes each local query chunk's causal attention against the keys before
  and up to it: one SDPA call per chunk, keys ``[0, (g + 1) c)`` for global chunk ``g``, with a
  causal mask aligned to the bottom right (the query block is the last ``c`` rows, so its ``i``-th
  query sees keys up to ``g c + i``; on a GPU SDPA's flash kernel applies it without building a
  mask, elsewhere the boolean mask is built). Grouped-query attention gathers the ``n_kv_head``
  heads as they are.
- :class:`ContextParallelForward` wraps the model's ``forward(idx, targets)``: it cuts the
  batch, calls the model with ``positions=`` (the global positions of the local tokens, for
  rotary and learned position embeddings) and returns the mean loss over every token of the
  global sequences (the same value on every cp rank). Its gradient is this rank's share scaled
  so that averaging gradients over the flattened (dp, cp) ranks gives the global mean's
  gradient: parameters are replicated over "cp" and reduced with "dp"
  (:func:`lightning_perf.parallel.layout.dims.data_parallel_mesh`). Without targets it returns the
  whole sequence's logits, gathered in global order.

The model protocol: ``enable_context_parallel(attention)`` routes every attention core through
``attention(q, k, v)`` (q: (B, nh, 2c, hd), k / v: (B, nkv, 2c, hd), local chunks in the order
above), and ``forward(idx, targets=None, *, positions=None)`` takes the tokens' global positions.

Two ways to reach the other ranks' keys (``mode`` of :func:`apply_context_parallel`):
``"allgather"`` (above: each chunk waits for the whole all-gather, the default) and ``"ring"``
(:mod:`lightning_perf.parallel.model_parallel.ring_attention`: K / V pairs passed between neighbours while the
block already held is computed, partial outputs merged by their log-sum-exp).

Under selective activation checkpointing (``parallel.compute.activation_checkpointing``) the
policy keeps the ring op's output and log-sum-exp, or the all-gathered K / V and SDPA's outputs, so
a block's recomputation communicates nothing over "cp" and does not recompute attention; the
all-gather mode pays for it with the whole sequence's K / V kept per block. Under full
checkpointing the recomputation runs the forward's communication again. Both modes trace under
torch.compile without graph breaks (the communication runs inside the custom ops).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_perf.parallel.layout.dims import mesh_size
from lightning_perf.parallel.model_parallel.ring_attention import COLLECTIVE_TAGS
from lightning_perf.parallel.model_parallel.ring_attention import ring_attention
from lightning_perf.parallel.model_parallel.tensor_parallel import to_local_output

__all__ = [
    "CONTEXT_PARALLEL_MODES",
    "check_context_parallel_mode",
    "check_context_parallel_seq_len",
    "load_balanced_positions",
    "split_sequence",
    "gather_sequence",
    "context_parallel_attention",
    "ContextParallelForward",
    "apply_context_parallel",
]


CONTEXT_PARALLEL_MODES = ("allgather", "ring")


def check_context_parallel_mode(mode: str) -> None:
    if mode not in CONTEXT_PARALLEL_MODES:
        raise ValueError(f"context_parallel_mode={mode!r} is not one of {CONTEXT_PARALLEL_MODES}: 'allgather' "
                         "gathers K/V over the cp group, 'ring' passes them between neighbours")


def check_context_parallel_seq_len(seq_len: int, cp: int) -> None:
    """Raise ``ValueError`` unless ``seq_len`` cuts into ``2 * cp`` equal chunks (numbers only)."""
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism cuts each sequence into 2 * cp = {2 * cp} chunks (two per cp rank, for "
            f"an even causal load): seq_len={seq_len} / {2 * cp} = {seq_len / (2 * cp):.3g}; use a seq_len "
            f"divisible by {2 * cp}"
        )


def load_balanced_positions(seq_len: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions cp rank ``rank`` holds: chunk ``rank`` then chunk ``2 * cp - 1 - rank``."""
    check_context_parallel_seq_len(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's two chunks of ``x`` along ``dim`` (the sequence), in local order."""
    T = x.shape[dim]
    check_context_parallel_seq_len(T, cp)
    c = T // (2 * cp)
    first = x.narrow(dim, rank * c, c)
    second = x.narrow(dim, (2 * cp - 1 - rank) * c, c)
    return torch.cat([first, second], dim=dim)


def _global_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Every rank's local (chunk r, chunk 2cp-1-r) tensors -> the whole sequence in global order."""
    firsts, seconds = zip(*(p.chunk(2, dim=dim) for p in parts))
    return torch.cat(list(firsts) + list(reversed(seconds)), dim=dim)


def gather_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`split_sequence` over ``group``: the whole sequence on every rank (autograd-aware)."""
    import torch.distributed._functional_collectives as fc

    # the newer name where it exists (older torch has only all_gather_tensor_autograd)
    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    # (cp, *x.shape), rank-major; the backward reduce-scatters the gradient back to its rank
    parts = gather(x.contiguous().unsqueeze(0), gather_dim=0, group=group)
    return _global_order(list(parts.unbind(0)), dim)


# ---- the K / V all-gather of the "allgather" mode: a custom op -----------------------------------
#
# A custom op (rather than functional collectives) so selective activation checkpointing can keep its
# output by name (``parallel.compute.activation_checkpointing._SAVE_OP_NAMES``): a block's
# recomputation then reads the gathered K / V instead of gathering them again. torch.compile traces it
# as one call. The process group travels by name.


def _group(group_name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    # all_gather_single where it exists (all_gather_into_tensor is deprecated there)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


@torch.library.custom_op("lightning_perf::cp_all_gather", mutates_args=(), tags=COLLECTIVE_TAGS)
def _all_gather_op(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """(group_size, *x.shape): every rank's ``x``, rank-major."""
    x = x.contiguous()
    out = x.new_empty((group_size, *x.shape))
    _all_gather_into(out.view(group_size * x.shape[0], *x.shape[1:]), x, _group(group_name))
    return out


@_all_gather_op.register_fake
def _(x, group_name, group_size):
    return x.new_empty((group_size, *x.shape))


@torch.library.custom_op("lightning_perf::cp_reduce_scatter", mutates_args=(), tags=COLLECTIVE_TAGS)
def _reduce_scatter_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """x (group_size, *shape) on every rank -> the sum over ranks of their ``x[rank]`` (shape)."""
    x = x.contiguous()
    out = x.new_empty(x.shape[1:])
    _reduce_scatter_into(out, x.view(x.shape[0] * x.shape[1], *x.shape[2:]), _group(group_name))
    return out


@_reduce_scatter_op.register_fake
def _(x, group_name):
    return x.new_empty(x.shape[1:])


def _gather_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group_name = inputs[1]


def _gather_backward(ctx: Any, grad: torch.Tensor):
    return _reduce_scatter_op(grad, ctx.group_name), None, None


_all_gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)


def _flash_lower_right(q: torch.Tensor) -> bool:
    """Whether SDPA's CUDA flash kernel takes ``q``: its ``is_causal`` aligns the mask to the bottom right."""
    hd = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and hd % 8 == 0 and hd <= 256
            and torch.cuda.get_device_properties(q.device).major >= 8)


def _causal_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q`` (the last ``Tq`` of the ``Tk`` positions) over ``k`` / ``v``: query ``i``
    sees keys up to ``Tk - Tq + i``. GQA heads as they are.

    Without torch's ``CausalBias`` tensor subclass, which can be built neither under selective
    checkpointing's dispatch mode nor inside a compiled graph: on a GPU SDPA's flash kernel (its
    ``is_causal`` is bottom-right aligned when the lengths differ; an op selective checkpointing keeps),
    otherwise SDPA with the boolean mask built.
    """
    Tq, Tk = q.shape[2], k.shape[2]
    kw = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    if _flash_lower_right(q):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any) -> torch.Tensor:
    """Causal attention of this rank's query chunks over the whole sequence's keys.

    q: (B, nh, 2c, hd), k / v: (B, nkv, 2c, hd) with nh % nkv == 0, this rank's chunks
    (``r`` and ``2 cp - 1 - r``). For global chunk ``g`` with queries ``q_g``:
    ``out_g = softmax(q_g K[:(g+1)c]^T / sqrt(hd) + M) V[:(g+1)c]`` with ``M[i, j] = -inf`` for
    ``j > g c + i``. Returns (B, nh, 2c, hd) in the local order.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    # one collective for K and V: (2, B, nkv, 2c, hd) per rank -> (cp, 2, B, nkv, 2c, hd); the
    # backward reduce-scatters dK and dV
    parts = _all_gather_op(torch.stack([k, v]), group.group_name, cp)
    kv = _global_order(list(parts.unbind(0)), dim=3)  # (2, B, nkv, T, hd)
    k_all, v_all = kv[0], kv[1]
    out = []
    for i, g in enumerate((rank, 2 * cp - 1 - rank)):
        end = (g + 1) * c
        out.append(_causal_lower_right(q[:, :, i * c : (i + 1) * c], k_all[:, :, :end], v_all[:, :, :end]))
    return torch.cat(out, dim=2)


class _GlobalMean(torch.autograd.Function):
    """Forward: the global mean loss (given). Backward: the local mean's gradient times ``weight``."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, global_value: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return global_value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        (weight,) = ctx.saved_tensors
        return grad * weight.to(grad.dtype), None, None


def _local(out: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel model's DTensor output (a replicated loss, vocabulary-sharded logits) as a plain tensor."""
    if type(out) is torch.Tensor:
        return out
    return to_local_output(out)


class ContextParallelForward:
    """``model.forward`` under context parallelism: cut the batch, run the local tokens, combine.

    ``forward(idx, targets)`` returns the mean loss over every (not ignored) target of the
    whole sequences. Rank ``r`` with ``n_r`` counted targets out of ``N`` over the cp group
    back-propagates ``cp * n_r / N`` times its local mean: the sum over cp ranks of those
    gradients (the all-gather's backward carries the cross-rank terms) is ``cp`` times the
    global mean's, and gradients are then averaged over the (dp, cp) ranks.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], group: Any, *, ignore_index: int = -100) -> None:
        self.forward = forward
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ignore_index = ignore_index

    def __call__(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        T = idx.shape[1]
        if kwargs.get("doc_ids") is not None:
            raise ValueError("packed documents (doc_ids) are not supported under context parallelism")
        check_context_parallel_seq_len(T, self.cp)  # every cp rank raises alike, before a collective
        positions = load_balanced_positions(T, self.cp, self.rank, device=idx.device)
        local_idx = split_sequence(idx, self.cp, self.rank)
        if targets is None:
            logits = _local(self.forward(local_idx, positions=positions, **kwargs))  # (B, 2c, V)
            return gather_sequence(logits, self.group, dim=1)  # (B, T, V)
        local_targets = split_sequence(targets, self.cp, self.rank)
        loss = _local(self.forward(local_idx, local_targets, positions=positions, **kwargs))
        count = (local_targets != self.ignore_index).sum().to(torch.float32)
        # (sum of this rank's losses, its target count), summed over cp; a rank whose targets are all
        # ignored has a NaN mean and adds nothing
        local_sum = torch.where(count > 0, loss.detach().float() * count, torch.zeros_like(count))
        totals = torch.stack([local_sum, count])
        dist.all_reduce(totals, group=self.group)
        global_mean = (totals[0] / totals[1]).to(loss.dtype)
        weight = self.cp * count / totals[1]
        return _GlobalMean.apply(loss, global_mean, weight)


def apply_context_parallel(model: Any, cp_mesh: Any, mode: str = "allgather") -> None:
    """Route ``model``'s attention over ``cp_mesh`` (``mode``: ``"allgather"`` or ``"ring"``) and wrap its
    forward (see the module docstring)."""
    check_context_parallel_mode(mode)
    if mesh_size(cp_mesh) == 1:
        return
    group = cp_mesh.get_group()
    if mode == "ring":
        model.enable_context_parallel(partial(ring_attention, group=group))
    else:
        model.enable_context_parallel(partial(context_parallel_attention, group=group))
    ignore_index = getattr(model, "batch_padding_target", -100)
    model.forward = ContextParallelForward(model.forward, group, ignore_index=ignore_index)
