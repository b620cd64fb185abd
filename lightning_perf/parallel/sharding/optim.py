"""Elementwise optimizers stepping sharded (DTensor) parameters through their local shards.

Adam / AdamW over FSDP2 or tensor-parallel parameters send every list they build (parameters,
gradients, both moments) through DTensor's dispatch, which plans the sharding of the fused
``_fused_adamw_`` / ``_foreach_*`` ops again on every step. With hundreds of parameters that
host work takes longer than the kernels themselves, so the GPU waits for the host.

Adam's update is elementwise, so when a parameter, its gradient and its state share one
placement on one mesh (no pending ``Partial`` reduction), updating the local shards is the same
computation. :func:`localize_optimizer` swaps an optimizer's class for a subclass whose
``_init_group`` hands the step those local tensors (views of the same storage, so the DTensor
parameters and state are updated in place; state dicts and checkpoints are unchanged); any
group with a tensor that does not qualify keeps the DTensor path. The step method itself is
the optimizer's own, so learning-rate schedulers (which wrap it) and the fused or foreach
kernels it picks are untouched.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["localize_optimizer", "localize_optimizers", "is_localized"]

_LOCALIZED: dict[type, type] = {}


def _local_lists(lists: list[list[Any]]) -> bool:
    """Replace DTensors by their local shards in ``lists`` (in place) if every tensor qualifies."""
    from torch.distributed.tensor import DTensor, Partial

    n = len(lists[0])
    for i in range(n):
        ref = lists[0][i]
        if not isinstance(ref, DTensor):
            return False
        spec = ref._spec
        for lst in lists[1:]:
            if i >= len(lst):
                continue  # max_exp_avg_sqs is empty without amsgrad
            t = lst[i]
            if isinstance(t, DTensor):
                if t._spec.mesh != spec.mesh or t._spec.placements != spec.placements:
                    return False
                if any(isinstance(p, Partial) for p in t._spec.placements):
                    return False
            elif t.dim() != 0:  # only scalar step counters may be plain tensors
                return False
    for lst in lists:
        lst[:] = [t._local_tensor if isinstance(t, DTensor) else t for t in lst]
    return True


class _LocalShardStep:
    """Mixin placed before an Adam-family optimizer class (see :func:`localize_optimizer`)."""

    #: parameter groups stepped through their local shards so far (a group that did not qualify is not counted)
    local_groups: int = 0

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        out = super()._init_group(  # type: ignore[misc]
            group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
        if params_with_grad:
            self.local_groups += int(_local_lists([params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]))
        return out


def _supported(optimizer: Any) -> bool:
    import inspect

    from torch.optim import Adam

    cls = type(optimizer)
    # Adam and AdamW (a subclass sharing Adam's step) whose step and group set-up nobody overrode
    # (torch wraps ``step`` in profiling hooks per class: compare what the wrappers wrap)
    same_step = inspect.unwrap(cls.step) is inspect.unwrap(Adam.step)
    return isinstance(optimizer, Adam) and cls._init_group is Adam._init_group and same_step


def is_localized(optimizer: Any) -> bool:
    return isinstance(optimizer, _LocalShardStep)


def localize_optimizer(optimizer: Any) -> bool:
    """Make ``optimizer`` step DTensor parameters through their local shards; True if it now does.

    Applies to ``torch.optim.Adam`` / ``AdamW`` (or subclasses that keep their step and group
    set-up); other optimizers are left as they are (False).
    """
    if is_localized(optimizer):
        return True
    if not _supported(optimizer):
        return False
    base = type(optimizer)
    if base not in _LOCALIZED:
        _LOCALIZED[base] = type(base.__name__, (_LocalShardStep, base), {"__module__": base.__module__,
                                                                            "__qualname__": base.__qualname__})
    optimizer.__class__ = _LOCALIZED[base]
    return True


def localize_optimizers(optimizers: list[Any]) -> int:
    """:func:`localize_optimizer` for each (Lightning's ``LightningOptimizer`` wrappers unwrapped)."""
    done = 0
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        if isinstance(opt, torch.optim.Optimizer):
            done += int(localize_optimizer(opt))
    return done
