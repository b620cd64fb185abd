"""Non-finite loss / gradient flags computed on the device and read without waiting for them.

:func:`nonfinite_flag` reduces the loss and every gradient to one 0-dim float32 tensor on
the device (1.0 if anything is NaN/inf), with one fused norm per (device, dtype) group;
under a process group it is max-reduced over the ranks (sharded gradients and per-rank
losses), so every rank reaches the same verdict and acts in step.

:class:`FlagQueue` keeps one flag per step and hands it out once it can be read for free:
a CUDA flag is copied to pinned host memory with ``non_blocking=True`` behind an event,
and :meth:`FlagQueue.ready` returns it only after ``event.query()`` says the copy landed
(never a ``synchronize``); a CPU flag is ready at once. :meth:`FlagQueue.drain` waits
(for the end of training or before a checkpoint, which wait anyway).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["FlagQueue", "local_tensor", "nonfinite_flag"]


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _norms(tensors: list[Tensor]) -> list[Tensor]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    out: list[Tensor] = []
    for group in groups.values():
        if hasattr(torch, "_foreach_norm"):
            out.extend(n.float() for n in torch._foreach_norm(group))
        else:  # pragma: no cover - every supported torch has _foreach_norm
            out.extend(torch.linalg.vector_norm(t).float() for t in group)
    return out


def nonfinite_flag(
    loss: Optional[Tensor],
    grads: Iterable[Optional[Tensor]],
    *,
    device: Optional[torch.device] = None,
    group: Optional[Any] = None,
    reduce: bool = True,
) -> Tensor:
    """1.0 if ``loss`` or any gradient holds a NaN or inf, else 0.0 (0-dim float32, on the device).

    The norm of a tensor with a NaN/inf is NaN/inf, so one fused norm per group and a sum
    suffice. ``reduce``: max over the ranks of ``group`` (the default group) when one exists.
    """
    parts = [local_tensor(g) for g in grads if g is not None]
    parts = [g for g in parts if g.numel() > 0]
    terms = _norms(parts)
    if loss is not None:
        terms.append(local_tensor(loss).detach().float().sum())
    if device is None:
        device = terms[0].device if terms else torch.device("cpu")
    if terms:
        total = torch.stack([t.to(device) for t in terms]).sum()
        flag = (~torch.isfinite(total)).float()
    else:
        flag = torch.zeros((), device=device)
    if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


class FlagQueue:
    """Per-step device flags, handed out as ``(step, is_bad)`` once readable without a sync.

    Args:
        max_pending: flags kept in flight; the oldest is waited for beyond that (bounds the
            detection delay on a device that runs far behind the host).
    """

    def __init__(self, max_pending: int = 8) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._pending: deque[tuple[int, Tensor, Optional[Any]]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, step: int, flag: Tensor) -> None:
        if flag.device.type == "cuda":
            host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((step, host, event))
        else:
            self._pending.append((step, flag.detach().to("cpu"), None))

    def ready(self) -> list[tuple[int, bool]]:
        """Flags whose copy has landed (``Event.query()``), oldest first; never blocks, except
        to keep at most ``max_pending`` in flight."""
        out = []
        while self._pending:
            step, host, event = self._pending[0]
            if event is not None and not event.query():
                if len(self._pending) <= self.max_pending:
                    break
                event.synchronize()
            self._pending.popleft()
            out.append((step, bool(host.item())))
        return out

    def drain(self) -> list[tuple[int, bool]]:
        """Every pending flag (waits for the device)."""
        out = []
        while self._pending:
            step, host, event = self._pending.popleft()
            if event is not None:
                event.synchronize()
            out.append((step, bool(host.item())))
        return out
