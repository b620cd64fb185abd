"""Dynamic loss scaling for fp16 training whose overflow check agrees on every rank.

``torch.amp.GradScaler`` checks for inf/NaN per device. Under sharding (FSDP2, ZeRO,
tensor or pipeline parallelism) each rank only sees its own gradient shard, so one
rank may overflow while the others do not; if they then disagree about skipping the
step, the replicas drift apart. :class:`DistributedLossScaler` reduces the overflow
flag with ``MAX`` over a process group (the whole world by default, i.e. every rank
of every mesh dimension), so all ranks skip the same steps and keep the same scale.

Usage, one optimizer step::

    loss = scaler.scale(loss)
    loss.backward()
    found_inf = scaler.unscale_(optimizer)   # grads /= scale; flag all-reduced
    if not found_inf:
        optimizer.step()
    scaler.update(found_inf)                # halve on overflow, grow after N good steps

The scale is a Python float so ``scale(loss)`` never synchronises the host; the one
host synchronisation per step is reading the reduced overflow flag, which any
skip decision needs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["DistributedLossScaler"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _grads_of(params_or_optimizer: Union[Optimizer, Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    if isinstance(params_or_optimizer, Optimizer) or hasattr(params_or_optimizer, "param_groups"):
        params = [p for group in params_or_optimizer.param_groups for p in group["params"]]
    else:
        params = list(params_or_optimizer)
    return [_local(p.grad) for p in params if p.grad is not None]


class DistributedLossScaler:
    """fp16 dynamic loss scaler with a process-group-wide overflow decision.

    Args:
        init_scale: first scale (``2**16`` as in ``GradScaler``).
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps.
        backoff_factor: multiply the scale by this on an overflow step.
        growth_interval: clean steps between growths.
        group: process group the overflow flag is reduced over; ``None`` is the world.
        min_scale: the scale never backs off below this.
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        group: Optional[dist.ProcessGroup] = None,
        min_scale: float = 1.0,
    ) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.group = group
        self._scale = float(init_scale)
        self._growth_tracker = 0  # clean steps since the last growth or backoff
        self.skipped_steps = 0
        self.total_steps = 0

    # ---- the three calls of a step -------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``; safe to call inside a pipeline schedule's loss function."""
        return loss * self._scale

    @torch.no_grad()
    def unscale_(self, params_or_optimizer: Union[Optimizer, Iterable[torch.Tensor]]) -> bool:
        """Divide every gradient by the scale in place; return whether any rank saw inf/NaN.

        Gradients may be plain tensors or DTensors (their local shards are checked).
        The flag is all-reduced (MAX) over ``group`` when torch.distributed is running.
        """
        grads = _grads_of(params_or_optimizer)
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv_scale = torch.full((1,), 1.0 / self._scale, dtype=torch.float32, device=device)
        by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_device_dtype[(g.device, g.dtype)].append(g)
        for (dev, _), group_grads in by_device_dtype.items():
            local_inf = found_inf if dev == device else torch.zeros_like(found_inf, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(group_grads, local_inf, inv_scale.to(dev))
            if local_inf is not found_inf:
                found_inf += local_inf.to(device)
        return self._reduce_flag(found_inf)

    def _reduce_flag(self, found_inf: torch.Tensor) -> bool:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            backend = dist.get_backend(self.group)
            flag = found_inf.cpu() if backend == "gloo" else found_inf
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            found_inf = flag
        return bool(found_inf.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Back off on overflow (the step was skipped), grow after ``growth_interval`` clean steps."""
        self.total_steps += 1
        if found_inf:
            self.skipped_steps += 1
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._scale *= self.growth_factor
            self._growth_tracker = 0

    # ---- checkpointing -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "skipped_steps": self.skipped_steps,
            "total_steps": self.total_steps,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.total_steps = int(state.get("total_steps", 0))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))

    def __repr__(self) -> str:
        return (
            f"DistributedLossScaler(scale={self._scale}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
            f"skipped_steps={self.skipped_steps})"
        )
