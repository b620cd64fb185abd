"""Gradient reduction and clipping across a (pp, dp, tp) mesh, for layouts without FSDP2.

:func:`allreduce_gradients` averages plain data-parallel gradients (ZeRO 0);
:func:`clip_grad_norm_3d` clips by the global norm over every rank's (sharded,
replicated or pipeline-stage) gradients with a few collectives per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["allreduce_gradients", "clip_grad_norm_3d"]


@torch.no_grad()
def allreduce_gradients(params: list[torch.Tensor], group: Any) -> None:
    """Average gradients over ``group`` (data parallelism without sharding, ZeRO 0).

    Gradients are flattened into one buffer per dtype so there is one all-reduce per
    dtype; DTensor gradients are reduced through their local shards.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        local = g.to_local() if hasattr(g, "to_local") else g
        grads.setdefault(local.dtype, []).append(local)
    for tensors in grads.values():
        flat = torch.cat([t.reshape(-1) for t in tensors]).div_(size)
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def _local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def clip_grad_norm_3d(params: list[torch.Tensor], max_norm: float, pp_group: Any = None, *,
                      counted_elsewhere: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Clip by the global 2-norm of every gradient of every rank; returns that norm.

    Squared norms are summed locally and reduced once per group of gradients that share
    a mesh and sharded mesh dimensions (a few collectives per step, not one per
    parameter): shards add up over the dimensions they are sharded on, replicated
    pieces count once; pipeline stages hold disjoint parameters, so their squared
    norms add up over ``pp_group``. ``counted_elsewhere``: parameters of ``params`` whose
    gradient another pipeline rank holds too and counts (the last stage's copy of a tied
    embedding): clipped here, left out of the norm.
    """
    from torch.distributed.tensor import DTensor

    skip = {id(p) for p in counted_elsewhere}
    groups: dict[tuple[int, tuple[int, ...]], tuple[Any, list[torch.Tensor]]] = {}
    device = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        if id(p) in skip:
            device = device or _local_of(g).device
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):  # not reduced yet: let DTensor reduce it
                n = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32).full_tensor()
                key, mesh, sq = (0, ()), None, n * n
            else:
                mesh = g.device_mesh
                # Shard and _StridedShard (FSDP2 over TP; not a Shard subclass on newer torch)
                dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
                key = (id(mesh), dims) if dims else (0, ())
                local = g.to_local()
                sq = torch.linalg.vector_norm(local, 2.0, dtype=torch.float32).square()
        else:
            key, mesh = (0, ()), None
            sq = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32).square()
        device = sq.device
        groups.setdefault(key, (mesh, []))[1].append(sq)
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for (_, dims), (mesh, squares) in groups.items():
        part = torch.stack(squares).sum()
        for dim in dims:
            if mesh.size(dim) > 1:
                dist.all_reduce(part, group=mesh.get_group(dim))
        total_sq = total_sq + part
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            g = p.grad
            (g.to_local() if hasattr(g, "to_local") else g).mul_(coef.to(g.dtype))
    return total
