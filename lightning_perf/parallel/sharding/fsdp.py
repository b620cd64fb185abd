"""FSDP2 per transformer block, with explicit all-gather prefetch.

``apply_fsdp`` shards each block as its own FSDP unit (one all-gather / reduce-scatter
per block), then the root (embedding, final norm, head and anything left over).
Communication overlaps compute three ways:

- forward: while block i computes, block i+1..i+prefetch parameters are all-gathered
  (``set_modules_to_forward_prefetch``);
- backward: while block i computes gradients, block i-1..i-prefetch are all-gathered
  (``set_modules_to_backward_prefetch``);
- backward: each block's gradients are reduce-scattered as soon as they are complete.

ZeRO-2 is ``reshard_after_forward=False`` (parameters stay gathered between forward and
backward, gradients and optimizer state are sharded); ZeRO-3 is ``True`` (parameters are
sharded at rest as well). Given a 2-D (replicate, shard) mesh, FSDP2 does HSDP: parameters
are sharded over the second dimension and replicated over the first, gradients are
reduce-scattered within a shard group and all-reduced across the replicas.

With :func:`cpu_offload_policy`, FSDP2 keeps the sharded parameters, their gradients (and so
the optimizer state the optimizer creates beside them) in host memory: each unit's shards are
copied to the device for its all-gather and its reduced gradients copied back. Parameters must
be materialised on the CPU; :func:`move_unsharded_` then moves what FSDP2 does not manage.

The module to shard is found with :func:`find_model` (the network inside a
LightningModule), its blocks with :func:`find_blocks`: our GPT's ``model.blocks`` (an
``nn.ModuleDict``), else the largest ``nn.ModuleList``/``nn.ModuleDict`` of identical
module classes (Hugging Face ``model.layers`` / ``transformer.h``), or a user policy
(a callable ``module -> bool`` or a set of module classes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.nn as nn

from lightning_perf.parallel.sharding.fp8_all_gather import enable_fp8_all_gather, require_fp8_linears

__all__ = ["apply_fsdp", "find_blocks", "find_model", "WrapPolicy", "set_gradient_sync", "is_fsdp_module",
           "cpu_offload_policy", "move_unsharded_", "FSDPUnit", "fsdp_unit_plan"]

WrapPolicy = Union[Callable[[nn.Module], bool], set, frozenset, tuple, list]


def _fsdp_api() -> tuple[Any, Any, Any]:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    return fully_shard, FSDPModule, MixedPrecisionPolicy


def is_fsdp_module(module: nn.Module) -> bool:
    _, FSDPModule, _ = _fsdp_api()
    return isinstance(module, FSDPModule)


def _policy_matches(policy: WrapPolicy) -> Callable[[nn.Module], bool]:
    if callable(policy) and not isinstance(policy, (set, frozenset, tuple, list)):
        return policy
    classes = tuple(policy)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(f"wrap_policy must be a callable module -> bool or a set of nn.Module classes, got {policy!r}")
    return lambda m: isinstance(m, classes)


def find_model(module: nn.Module) -> nn.Module:
    """The submodule to shard: ``module.model`` (or the one child) when it holds every parameter.

    Sharding the inner network rather than a LightningModule makes FSDP2's root hooks
    fire on the network's own forward, whatever the training step calls.
    """
    total = sum(1 for _ in module.parameters())
    candidates = []
    inner = getattr(module, "model", None)
    if isinstance(inner, nn.Module):
        candidates.append(inner)
    candidates += [c for c in module.children() if c is not inner]
    for child in candidates:
        if total and sum(1 for _ in child.parameters()) == total:
            return child
    return module


def find_blocks(module: nn.Module, policy: Optional[WrapPolicy] = None) -> list[nn.Module]:
    """The repeated blocks of ``module`` in forward order.

    With a ``policy``: every submodule it matches, outermost first (a match inside a
    match is left to its parent unit). Without: ``module.blocks`` when present (our GPT),
    else the longest ``nn.ModuleList``/``nn.ModuleDict`` whose children all share one
    class (Hugging Face decoder layers), else an empty list.
    """
    if policy is not None:
        matches = _policy_matches(policy)
        found: list[nn.Module] = []
        inside: set[int] = set()
        for sub in module.modules():
            if sub is module or id(sub) in inside:
                continue
            if matches(sub):
                found.append(sub)
                inside.update(id(m) for m in sub.modules())
        return found
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, (nn.ModuleDict, nn.ModuleList)) and len(blocks) > 0:
        return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    best: list[nn.Module] = []
    for sub in module.modules():
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            children = list(sub.values() if isinstance(sub, nn.ModuleDict) else sub)
            if len(children) > len(best) and len({type(c) for c in children}) == 1:
                best = children
    return best


def apply_fsdp(
    module: nn.Module,
    dp_mesh: Any,
    *,
    blocks: Optional[Sequence[nn.Module]] = None,
    reshard_after_forward: bool = True,
    mp_policy: Optional[Any] = None,
    prefetch: int = 1,
    offload_policy: Optional[Any] = None,
    wrap_policy: Optional[WrapPolicy] = None,
    fp8_all_gather: bool = False,
    blocks_per_unit: int = 1,
) -> nn.Module:
    """Shard ``module`` with FSDP2 over ``dp_mesh``: one unit per block (or per ``blocks_per_unit``
    consecutive blocks), then the root.

    Args:
        module: the model (parameters may be on ``meta``; materialise after with
            ``to_empty`` + init, see ``parallel.sharding.init``). Already TP-sharded DTensors are fine:
            FSDP2 composes over the "dp" sub-mesh.
        dp_mesh: the 1-D data-parallel ``DeviceMesh``, or a 2-D (replicate, shard) one for HSDP.
        blocks: the units; ``None`` = :func:`find_blocks` (with ``wrap_policy``).
        reshard_after_forward: ``True`` = ZeRO-3, ``False`` = ZeRO-2.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (or ``None``: fp32).
        prefetch: how many blocks ahead to all-gather in forward and backward (0 = FSDP2's
            implicit one-ahead behaviour only).
        offload_policy: FSDP2 ``CPUOffloadPolicy`` (:func:`cpu_offload_policy`) or ``None``.
        fp8_all_gather: all-gather the ``Float8Linear`` weights in FP8, quantised per shard with the
            whole weight's scale (``parallel.sharding.fp8_all_gather``); call ``precompute_fp8_scales`` after
            each optimizer step to reduce all the scales in one collective.
        blocks_per_unit: consecutive blocks sharded as one FSDP unit (one all-gather and one
            reduce-scatter for the group): fewer, larger collectives and a fraction of FSDP2's
            per-unit host work per step, for more memory held gathered at a time. Prefetch depth
            counts units.
    Returns the same module object, now an FSDP module.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    check_blocks_per_unit(blocks_per_unit)
    if not any(True for _ in module.parameters()):
        raise ValueError(f"{type(module).__name__} has no parameters: nothing to shard")
    if fp8_all_gather:
        if offload_policy is not None:
            raise ValueError("fp8_all_gather with CPU offload is not supported: the FP8 shards are made on the GPU")
        require_fp8_linears(module)
        if not enable_fp8_all_gather(module):
            raise ValueError(f"fp8_all_gather=True, but every FP8 linear layer of {type(module).__name__} is "
                             "tensor-parallel (its shards are quantised per rank): nothing to gather in FP8")
    fully_shard, _, MixedPrecisionPolicy = _fsdp_api()
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    plan = fsdp_unit_plan(module, blocks if blocks is not None else find_blocks(module, wrap_policy),
                          reshard_after_forward=reshard_after_forward, blocks_per_unit=blocks_per_unit)
    for unit in plan:
        modules = list(unit.modules)
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=unit.reshard_after_forward,
                    **kwargs)
    groups = plan[:-1]
    if prefetch > 0 and len(groups) > 1:
        _set_prefetch([g.modules[0] for g in groups], prefetch)  # a group's modules share one FSDP state
    return module


class FSDPUnit(NamedTuple):
    """One ``fully_shard`` call of :func:`apply_fsdp`: its modules (several for a group of blocks, which
    share one FSDP state) and the ``reshard_after_forward`` it was given."""

    modules: tuple[nn.Module, ...]
    reshard_after_forward: bool


def fsdp_unit_plan(module: nn.Module, blocks: Sequence[nn.Module], *, reshard_after_forward: bool,
                   blocks_per_unit: int = 1) -> list[FSDPUnit]:
    """The units :func:`apply_fsdp` makes of ``module`` and ``blocks``, in forward order, the root last.

    Blocks without parameters are left to the root; every ``blocks_per_unit`` consecutive blocks form
    one unit. The last unit and the root keep their parameters gathered after forward (backward needs
    them at once); the other units reshard as ``reshard_after_forward`` says. Called again on the
    sharded module with the same arguments it returns the same plan (what changes the units'
    resharding at run time restores from it).
    """
    check_blocks_per_unit(blocks_per_unit)
    units = [b for b in blocks if any(True for _ in b.parameters())]
    groups = [tuple(units[i:i + blocks_per_unit]) for i in range(0, len(units), blocks_per_unit)]
    plan = [FSDPUnit(g, reshard_after_forward and i < len(groups) - 1) for i, g in enumerate(groups)]
    plan.append(FSDPUnit((module,), False if units else reshard_after_forward))
    return plan


def cpu_offload_policy(device: torch.device) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for training on ``device``: host copies pinned when ``device`` is an
    accelerator (asynchronous copies), unpinned on a CPU device (pinning needs an accelerator)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


@torch.no_grad()
def move_unsharded_(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s buffers and plain (non-DTensor) parameters to ``device``, leaving FSDP2's
    sharded parameters where they are (``module.to(device)`` would move offloaded shards too)."""
    from torch.distributed.tensor import DTensor

    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)
        for name, param in sub._parameters.items():
            if param is not None and not isinstance(param, DTensor) and param.device != device:
                param.data = param.data.to(device)


def check_blocks_per_unit(blocks_per_unit: object, name: str = "blocks_per_unit") -> None:
    if isinstance(blocks_per_unit, bool) or not isinstance(blocks_per_unit, int) or blocks_per_unit < 1:
        raise ValueError(f"{name} must be an int >= 1, got {blocks_per_unit!r}")


def _set_prefetch(units: Sequence[nn.Module], depth: int) -> None:
    n = len(units)
    for i, unit in enumerate(units):
        ahead = [units[j] for j in range(i + 1, min(i + 1 + depth, n))]
        behind = [units[j] for j in range(i - 1, max(i - 1 - depth, -1), -1)]
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        if behind:
            unit.set_modules_to_backward_prefetch(behind)


def set_gradient_sync(modules: Iterable[nn.Module], enabled: bool) -> None:
    """Turn FSDP2 gradient reduce-scatter on/off (off on non-final accumulation micro-steps)."""
    for m in modules:
        if is_fsdp_module(m):
            m.set_requires_gradient_sync(enabled, recurse=True)
