"""Ring attention: causal attention over the cp group with K / V passed between neighbours.

The layout is :mod:`lightning_perf.parallel.model_parallel.context_parallel`'s: the sequence is cut into ``2 n``
chunks of ``c`` tokens (n = cp size) and rank ``r`` holds chunks ``r`` and ``2n - 1 - r`` of
q, k and v. Instead of all-gathering K and V, the ranks pass their K / V pair around the ring
(rank r sends to ``r + 1`` and receives from ``r - 1``) in ``n`` steps; at step ``s`` rank ``r``
holds the keys of rank ``src = r - s (mod n)`` and sends them on while it computes with them.
With the load-balanced chunks, which (query half, key half) pairs are needed is fixed::

    step 0 (src = r):   q0 k0 causal,  q1 k0 full,  q1 k1 causal
    src < r:            q0 k0 full,    q1 k0 full        (chunk src precedes both query chunks)
    src > r:            q1 k0 full,    q1 k1 full        (only the late query chunk sees them)

the rest are fully masked and skipped, so every rank does the same work at every step. Each
block returns its output ``O_b`` and log-sum-exp ``L_b`` per query row; a query half's running
output and LSE are merged as ``L = logaddexp(L, L_b)``, ``O = O e^(L_old - L) + O_b e^(L_b - L)``.

The backward runs the ring again. With the merged ``O`` and ``L`` each block's gradients are the
flash-attention ones, ``P = exp(S - L)``, ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO O))``,
``dQ = scale dS K``, ``dK = scale dS^T Q``; dQ stays on the rank, while each key pair's dK / dV
(fp32) travel with it: rank r adds its share to the accumulator it received and passes it on, and
after ``n`` steps the accumulator of rank r's keys arrives back at rank r.

Blocks are c x c: on a GPU the pack's Triton flash-attention kernel (which returns the LSE and takes
it back in its backward) where it supports the shape, otherwise a float32 math block.

The forward and backward are the custom ops ``lightning_perf::ring_attention`` (returning the
output and the LSE) and ``lightning_perf::ring_attention_backward``: selective activation
checkpointing keeps the forward op's outputs, so recomputing a block neither runs the ring again nor
recomputes attention, and torch.compile calls the ops from inside a compiled graph (no graph break).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["ring_attention", "ring_forward", "ring_backward", "ring_steps", "block_attention",
           "block_attention_backward"]

_LN2 = math.log(2.0)

# the ops that communicate between the cp ranks are kept out of CUDA graphs (compile="reduce-overhead"):
# their send / receive and all-gather under graph capture have not been verified
COLLECTIVE_TAGS = (torch.Tag.cudagraph_unsafe,)


def ring_steps(rank: int, cp: int) -> list[tuple[int, list[tuple[int, int, bool]]]]:
    """Per step, the source rank of the held keys and the (query half, key half, causal) blocks to compute."""
    steps = []
    for s in range(cp):
        src = (rank - s) % cp
        if s == 0:
            blocks = [(0, 0, True), (1, 0, False), (1, 1, True)]
        elif src < rank:
            blocks = [(0, 0, False), (1, 0, False)]
        else:
            blocks = [(1, 0, False), (1, 1, False)]
        steps.append((src, blocks))
    return steps


# ---- one c x c block ---------------------------------------------------------------------------


def _use_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, use_triton: Optional[bool]) -> bool:
    if use_triton is not None:
        return use_triton
    if not q.is_cuda:
        return False
    from lightning_perf.kernels.ops.flash_attention import flash_attention_supported

    return flash_attention_supported(q, k, v)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """fp32 scale * q k^T with k's heads repeated for GQA; -inf above the diagonal when causal."""
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _sum_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, T, D) per query head -> (B, Hkv, T, D) summed over each kv head's group."""
    B, H, T, D = x.shape
    return x.view(B, kv_heads, H // kv_heads, T, D).sum(2)


def block_attention(q, k, v, causal: bool, scale: float,
                    use_triton: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_b fp32 (B, H, c, D), L_b fp32 (B, H, c), natural log) for q (B, H, c, D), k / v (B, Hkv, c, D).

    ``use_triton``: None picks the Triton kernel on a GPU where it takes the shape (tests force it)."""
    if _use_triton(q, k, v, use_triton):
        from lightning_perf.kernels.ops.flash_attention_launch import flash_attn_fwd

        o, lse2 = flash_attn_fwd(q, k, v, causal, scale)
        return o.float(), lse2 * _LN2
    s = _scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    vf = v.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (s - lse.unsqueeze(-1)).exp() @ vf, lse


def block_attention_backward(q, k, v, out, lse, dout, causal: bool, scale: float,
                             use_triton: Optional[bool] = None):
    """(dQ, dK, dV) fp32 of one block, given the merged output ``out`` and LSE ``lse`` of its query rows."""
    if _use_triton(q, k, v, use_triton):
        from lightning_perf.kernels.ops.flash_attention_launch import flash_attn_bwd

        dq, dk, dv = flash_attn_bwd(q, k, v, out, (lse / _LN2).contiguous(), dout, causal, scale)
        return dq.float(), dk.float(), dv.float()
    hkv = k.shape[1]
    p = (_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()  # (B, H, c, c)
    do = dout.float()
    vf = v.float().repeat_interleave(q.shape[1] // hkv, dim=1)
    kf = k.float().repeat_interleave(q.shape[1] // hkv, dim=1)
    dv = _sum_groups(p.transpose(-1, -2) @ do, hkv)
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (do @ vf.transpose(-1, -2) - delta)
    dq = (ds @ kf) * scale
    dk = _sum_groups((ds.transpose(-1, -2) @ q.float()) * scale, hkv)
    return dq, dk, dv


# ---- the ring ----------------------------------------------------------------------------------


class _Ring:
    """Point-to-point exchange with the ring neighbours: post a send to ``r + 1`` and a receive
    from ``r - 1`` together, wait for the receive later (the compute in between overlaps it)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, send: torch.Tensor) -> tuple[list, torch.Tensor, torch.Tensor]:
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        # the send buffer is held until the wait, so its memory is not reused while in flight
        return dist.batch_isend_irecv(ops), recv, send

    @staticmethod
    def wait(pending: tuple[list, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        reqs, recv, _ = pending
        for req in reqs:
            req.wait()
        return recv


def _halves(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.chunk(2, dim=2))


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's forward: (O (B, H, 2c, D) in q's dtype, L fp32 (B, H, 2c)), the merged output and LSE."""
    ring = _Ring(group)
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    qh = _halves(q)
    out: list[Optional[torch.Tensor]] = [None, None]
    lse: list[Optional[torch.Tensor]] = [None, None]
    kv = torch.stack([k, v]).contiguous()  # one message per step: (2, B, Hkv, 2c, D)
    for s, (_, blocks) in enumerate(ring_steps(rank, cp)):
        pending = ring.start(kv) if s + 1 < cp else None
        kh, vh = _halves(kv[0]), _halves(kv[1])
        for i, j, causal in blocks:
            o_b, l_b = block_attention(qh[i], kh[j], vh[j], causal, scale)
            if out[i] is None:
                out[i], lse[i] = o_b, l_b
            else:
                new = torch.logaddexp(lse[i], l_b)
                out[i] = out[i] * (lse[i] - new).exp().unsqueeze(-1) + o_b * (l_b - new).exp().unsqueeze(-1)
                lse[i] = new
        if pending is not None:
            kv = ring.wait(pending)
    # new tensors (never views of the inputs): the custom op's outputs may not alias them
    return torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)


def ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, group: Any, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring's backward from the merged output and LSE: (dQ, dK, dV) in the inputs' dtypes."""
    ring = _Ring(group)
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    qh, oh, lh, dh = _halves(q), _halves(o), _halves(lse), _halves(dout.contiguous())
    dq = [torch.zeros_like(t, dtype=torch.float32) for t in qh]
    kv = torch.stack([k, v]).contiguous()
    dkv_pending = None
    for s, (_, blocks) in enumerate(ring_steps(rank, cp)):
        kv_pending = ring.start(kv) if s + 1 < cp else None
        kh, vh = _halves(kv[0]), _halves(kv[1])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # this rank's share for these keys
        dk, dv = _halves(dkv[0]), _halves(dkv[1])
        for i, j, causal in blocks:
            dq_b, dk_b, dv_b = block_attention_backward(qh[i], kh[j], vh[j], oh[i], lh[i], dh[i], causal, scale)
            dq[i] += dq_b
            dk[j] += dk_b
            dv[j] += dv_b
        if dkv_pending is not None:  # the shares of the ranks before this one
            dkv += ring.wait(dkv_pending)
        dkv_pending = ring.start(dkv)
        if kv_pending is not None:
            kv = ring.wait(kv_pending)
    dkv = ring.wait(dkv_pending)  # this rank's own keys, every rank's share added
    # copies: dK and dV are two outputs of one op and may not share the received buffer
    return (torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True))


# ---- the op: one node for autograd, selective checkpointing and torch.compile --------------------
#
# The ring is a custom op rather than an autograd.Function so that (a) selective activation
# checkpointing (``parallel.compute.activation_checkpointing``) recognises it and keeps its output
# and LSE: the recomputation of a block then neither passes K / V around the ring again nor
# recomputes attention; and (b) torch.compile traces it as one opaque call instead of breaking the
# graph around point-to-point requests. The process group travels by name.


def _group(group_name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@torch.library.custom_op("lightning_perf::ring_attention", mutates_args=(), tags=COLLECTIVE_TAGS)
def _ring_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ring_forward(q, k, v, _group(group_name), scale)


@_ring_op.register_fake
def _(q, k, v, group_name, scale):
    B, H, T, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("lightning_perf::ring_attention_backward", mutates_args=(), tags=COLLECTIVE_TAGS)
def _ring_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                      dout: torch.Tensor, group_name: str,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ring_backward(q, k, v, o, lse, dout, _group(group_name), scale)


@_ring_backward_op.register_fake
def _(q, k, v, o, lse, dout, group_name, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, group_name, scale = inputs
    o, lse = output
    ctx.group_name, ctx.scale = group_name, scale
    ctx.save_for_backward(q, k, v, o, lse)


def _backward(ctx: Any, dout: torch.Tensor, dlse: Optional[torch.Tensor]):
    q, k, v, o, lse = ctx.saved_tensors
    # the LSE is returned for saving, never used downstream: its gradient is zero
    dq, dk, dv = _ring_backward_op(q, k, v, o, lse, dout, ctx.group_name, ctx.scale)
    return dq, dk, dv, None, None


_ring_op.register_autograd(_backward, setup_context=_setup)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any,
                   softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this rank's query chunks over the whole sequence, K / V passed around the ring.

    Same contract as :func:`lightning_perf.parallel.model_parallel.context_parallel.context_parallel_attention`:
    q (B, nh, 2c, hd), k / v (B, nkv, 2c, hd) with nh % nkv == 0, this rank's chunks ``r`` and
    ``2 cp - 1 - r``; returns (B, nh, 2c, hd) in the local order.
    """
    if q.dim() != 4 or k.shape != v.shape or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention needs q (B, nh, 2c, hd) and k, v (B, nkv, 2c, hd) with nh % nkv == 0, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"each rank holds two chunks of equal length: local length {q.shape[2]} is odd")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if dist.get_world_size(group) == 1:
        from lightning_perf.kernels.ops.flash_attention import attention_reference

        return attention_reference(q, k, v, causal=True, softmax_scale=scale)
    return _ring_op(q, k, v, group.group_name, scale)[0]
