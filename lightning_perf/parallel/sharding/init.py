"""Materialising a model built on the meta device, after it was sharded.

Two ways, chosen by the caller:

- ``"rank0"``: rank 0 built the model for real on the host (so its random stream is
  exactly that of a single-process run with the same seed) and the other ranks built
  it on ``meta``. :func:`take_full_state` keeps rank 0's tensors and turns its module
  to ``meta`` too; after sharding, :func:`materialize_from_rank0` allocates each rank's
  shards on the device and scatters rank 0's values into them tensor by tensor
  (``set_model_state_dict(..., broadcast_from_rank0=True)``). Peak device memory is
  one shard plus one full tensor; rank 0 holds one full copy in host memory.
- ``"meta"``: every rank built the model on ``meta``; :func:`materialize_local` allocates
  the local shards on the device and runs the model's own ``init_weights()`` (or each
  submodule's ``reset_parameters()``) on them. Nothing is ever whole, so a model larger
  than one device (or one host) starts, but the values differ from a single-process run.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "is_meta_module",
    "has_meta_tensors",
    "take_full_state",
    "materialize_from_rank0",
    "materialize_local",
    "init_module",
    "broadcast_module_",
]


def is_meta_module(module: nn.Module) -> bool:
    """Every parameter and buffer is on ``meta``."""
    tensors = list(module.parameters()) + list(module.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def init_module(module: nn.Module) -> None:
    """Run the model's initialisation on (possibly sharded) materialised tensors.

    ``module.init_weights()`` when the module (or one submodule, outermost first) has it,
    else ``reset_parameters()`` of every submodule that has one.
    """
    with torch.no_grad():
        for sub in module.modules():
            fn = getattr(sub, "init_weights", None)
            if callable(fn):
                fn()
                return
        for sub in module.modules():
            fn = getattr(sub, "reset_parameters", None)
            if callable(fn):
                fn()


def take_full_state(module: nn.Module) -> dict[str, Any]:
    """On a materialised module: keep its full state (persistent and not) and move it to ``meta``.

    Returns ``{"state_dict": ..., "buffers": {name: tensor}}`` for
    :func:`materialize_from_rank0`.
    """
    state = {"state_dict": dict(module.state_dict()), "buffers": {n: b for n, b in module.named_buffers()}}
    module.to(torch.device("meta"))
    return state


def _backend_device(device: torch.device, group: Optional[dist.ProcessGroup]) -> torch.device:
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device


def materialize_from_rank0(
    module: nn.Module,
    device: torch.device,
    full_state: Optional[dict[str, Any]],
    *,
    group: Optional[dist.ProcessGroup] = None,
    comm_device: Optional[torch.device] = None,
) -> None:
    """Allocate ``module``'s (sharded) tensors on ``device`` and fill them from rank 0's full state.

    ``full_state`` is :func:`take_full_state`'s result on rank 0 and ``None`` elsewhere.
    Works for FSDP2 / DTensor modules and plain replicated ones. ``comm_device``: where the
    broadcasts run when it is not ``device`` (the GPU of an NCCL group whose shards live on the CPU).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    module.to_empty(device=device)
    rank = dist.get_rank(group)
    sd = full_state["state_dict"] if (rank == 0 and full_state is not None) else {}
    set_model_state_dict(module, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # non-persistent buffers (RoPE tables, Hugging Face inv_freq) are not in the state dict:
    # rank 0 announces their shapes (the other ranks' meta copies may differ) and sends them
    if rank == 0 and full_state is not None:
        persistent = set(full_state["state_dict"])
        spec = {n: (tuple(b.shape), b.dtype) for n, b in full_state["buffers"].items() if n not in persistent}
    else:
        spec = None
    objs = [spec]
    dist.broadcast_object_list(objs, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    spec = objs[0] or {}
    comm_device = _backend_device(comm_device or device, group)
    for name, (shape, dtype) in spec.items():
        if rank == 0:
            buf = full_state["buffers"][name].to(comm_device)
        else:
            buf = torch.empty(shape, dtype=dtype, device=comm_device)
        dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        setattr(owner, attr, buf.to(device))


def materialize_local(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s local (sharded) tensors on ``device`` and initialise them in place."""
    module.to_empty(device=device)
    init_module(module)


@torch.no_grad()
def broadcast_module_(module: nn.Module, *, src: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (replicated modules only)."""
    for t in list(module.parameters()) + list(module.buffers()):
        comm = _backend_device(t.device, group)
        buf = t.detach().to(comm)
        dist.broadcast(buf, src=src, group=group)
        if buf is not t:
            t.copy_(buf)
