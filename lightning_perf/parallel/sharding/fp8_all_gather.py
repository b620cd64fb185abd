"""FSDP2 all-gathers FP8 weights (torchao): half the bytes of a bf16 gather, and no cast after it.

With tensorwise FP8 linears (``GPTConfig(fp8="tensorwise")``, ``kernels.torchao_fp8``) every block
projection quantises its weight to e4m3 before the matmul. Under ZeRO-2/3 the weight would first be
all-gathered in the parameter dtype (bf16), then quantised. Instead each rank quantises its own
shard *before* the gather, with the scale of the whole weight, so the gather moves one byte per
element and the matmul takes the gathered FP8 tensor as it is:

    s = fmax / max over ranks of amax(|shard|)      one all-reduce for all weights (precompute_fp8_scales)
    shard -> fp8(clamp(shard * s))                  on every rank, from the fp32 master shard
    all-gather (1 byte per element)                 FSDP2's extension hooks, implemented by torchao

Quantising the shards with the global scale gives exactly the FP8 tensor that quantising the
gathered weight would. torchao's ``WeightWithDynamicFloat8CastTensor`` is the sharded parameter's
local tensor; this module switches it on for a model's FP8 linears (:func:`enable_fp8_all_gather`,
before ``fully_shard``), refreshes the scales after each optimizer step
(:func:`precompute_fp8_scales`), and saves the shards as plain tensors (:func:`plain_state_dict`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from lightning_perf.kernels.torchao_fp8 import fp8_recipe_of, is_fp8_linear

__all__ = ["enable_fp8_all_gather", "precompute_fp8_scales", "fp8_all_gather_weights", "plain_state_dict",
           "require_fp8_linears", "require_fp8_config"]


def _weight_class() -> type:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return WeightWithDynamicFloat8CastTensor


def require_fp8_linears(module: nn.Module) -> None:
    """Raise ValueError when ``module`` has no tensorwise FP8 linear layer to gather in FP8; no collective."""
    recipes = {fp8_recipe_of(m) for m in module.modules() if is_fp8_linear(m)}
    if not recipes:
        raise ValueError(
            f"fp8_all_gather=True, but {type(module).__name__} has no FP8 linear layers to gather in FP8 "
            "(torchao Float8Linear, e.g. GPTConfig(fp8='tensorwise'))")
    if "tensorwise" not in recipes:
        raise ValueError(
            f"fp8_all_gather=True needs tensorwise FP8 linears (one scale per weight); {type(module).__name__}'s "
            f"are {sorted(recipes)}: use fp8='tensorwise' or fp8_all_gather=False")


def require_fp8_config(module: nn.Module) -> None:
    """:func:`require_fp8_linears` for a module that builds its model in ``configure_model``: by its
    ``config.fp8`` (a GPTConfig or any config with that field; parallel/ does not import models/)."""
    config = getattr(module, "config", None)
    fp8 = getattr(config, "fp8", None)
    if fp8 is not None and not fp8:
        raise ValueError(
            f"fp8_all_gather=True, but {type(module).__name__}'s {type(config).__name__} has fp8=False, so its model has no "
            "FP8 linear layers to gather in FP8: build it with GPTConfig(fp8='tensorwise') or set fp8_all_gather=False")
    if fp8 not in (None, True, "tensorwise"):
        raise ValueError(
            f"fp8_all_gather=True needs tensorwise FP8 linears (one scale per weight); {type(module).__name__}'s "
            f"{type(config).__name__} has fp8={fp8!r}: use fp8='tensorwise' or fp8_all_gather=False")


def enable_fp8_all_gather(module: nn.Module) -> list[str]:
    """Make every tensorwise FP8 linear's weight in ``module`` gather in FP8; call before ``fully_shard``.

    Weights that are already DTensors (tensor parallelism) and rowwise linears are left alone.
    Returns the qualified names of the weights converted (empty when there are none).
    """
    wrapper = _weight_class()
    names = []
    for prefix, sub in module.named_modules():
        if fp8_recipe_of(sub) != "tensorwise" or sub.weight is None:
            continue
        w = sub.weight
        if isinstance(w, wrapper) or hasattr(w, "device_mesh"):
            continue
        sub.config = dataclasses.replace(sub.config, enable_fsdp_float8_all_gather=True)
        sub.weight = nn.Parameter(wrapper(w.data, sub.linear_mm_config, sub.config.cast_config_weight.target_dtype),
                                  requires_grad=w.requires_grad)
        names.append(f"{prefix}.weight" if prefix else "weight")
    return names


def fp8_all_gather_weights(module: nn.Module) -> list[Any]:
    """The sharded parameters (DTensors) whose local tensors gather as FP8."""
    wrapper = _weight_class()
    return [p for p in module.parameters() if isinstance(getattr(p, "_local_tensor", None), wrapper)]


def precompute_fp8_scales(module: nn.Module) -> int:
    """One all-reduce for the scales of every FP8-gathered weight (call after each optimizer step).

    Until the next call, the all-gathers quantise with these scales instead of reducing each
    weight's amax at every gather (twice a step at ZeRO-3: forward and backward). Anything that
    changes the weights outside the optimizer (a checkpoint load, a manual edit) should call it
    again; the strategies do so after the optimizer step and after loading. Every rank must call it
    (it is a collective). Returns the number of weights.
    """
    count = len(fp8_all_gather_weights(module))
    if count:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(module)
    return count


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with FP8-gathering shards replaced by DTensors of the plain master tensors they wrap.

    The replacements share storage with the parameters, so a checkpoint loads into them in place;
    saved files hold plain tensors (a plain or differently sharded model loads them).
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        local = getattr(v, "_local_tensor", None)
        # by name: a model without FP8 linears needs no torchao here
        if isinstance(v, DTensor) and type(local).__name__ == "WeightWithDynamicFloat8CastTensor":
            v = DTensor.from_local(local._tensor, v.device_mesh, v.placements, run_check=False, shape=v.shape,
                                   stride=v.stride())
        out[k] = v
    return out
