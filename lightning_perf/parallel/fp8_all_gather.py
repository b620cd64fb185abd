"""FSDP2 all-gathers FP8 weights: half the bytes of a bf16 gather, and no cast after it.

With ``GPTConfig(fp8=True)`` every block projection quantises its weight to e4m3 before the
matmul (``kernels.fp8_linear``). Under ZeRO-2/3 the weight is first all-gathered in the
parameter dtype (bf16), then quantised. Here each rank quantises its own shard *before* the
gather, with the scale of the whole weight, so the gather moves one byte per element and the
matmul takes the gathered FP8 tensor as it is:

    s = fmax / max over ranks of amax(|shard|)      one all-reduce (see precompute_fp8_scales)
    shard -> fp8(clamp(shard * s))                  on every rank, from the fp32 master shard
    all-gather (1 byte per element)                 FSDP2, through the extension hooks below
    Float8GatheredWeight(q, s)                      what the Float8Linear sees as its weight

Quantising the shards with the global scale gives exactly the FP8 tensor that quantising the
gathered weight would (same scale, same elementwise rounding); the only difference from the
bf16 gather is that the values are rounded once, from the fp32 master weights, instead of twice.

Pieces:

- :class:`Float8AllGatherWeight`: the sharded parameter's local tensor (a wrapper around the
  master shard; every op runs on the wrapped tensor, so the optimizer, ``to_empty``, in-place
  initialisation and checkpoint loads behave as for a plain tensor). It implements FSDP2's
  ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``.
- :class:`Float8GatheredWeight`: the unsharded weight, logically the parameter dtype, holding the
  FP8 data and its scale; ``fp8_linear`` uses them directly, any other op sees the dequantised values.
- :func:`enable_fp8_all_gather` (before ``fully_shard``) and :func:`precompute_fp8_scales` (after
  each optimizer step: one all-reduce for every weight instead of one per weight and gather).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from lightning_perf.kernels.fp8_tensor import Float8GatheredWeight

__all__ = ["Float8AllGatherWeight", "Float8GatheredWeight", "enable_fp8_all_gather", "precompute_fp8_scales",
           "fp8_all_gather_weights", "plain_state_dict", "require_fp8_linears", "require_fp8_config"]

E4M3 = torch.float8_e4m3fn
_FMAX = float(torch.finfo(E4M3).max)
_TINY = 1e-12  # the same floor as kernels.ops.fp8_linear._scale_of
aten = torch.ops.aten

# ops whose outputs stay wrapped: FSDP2 sharding, padding, copies, views and empty_like of the shard
# (not zeros_like: the optimizer's state tensors are plain)
_KEEP_WRAPPED = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.slice.Tensor, aten.narrow.default,
    aten.clone.default, aten._to_copy.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_zeros.default, aten.new_empty_strided.default, aten.copy_.default,
    aten._pin_memory.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A weight shard (fp32 or bf16) that FSDP2 all-gathers as FP8 with the whole weight's scale."""

    _data: torch.Tensor
    _scale: Optional[torch.Tensor]

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: Optional[torch.Tensor] = None) -> "Float8AllGatherWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
        self._data = data
        self._scale = scale  # set by precompute_fp8_scales; None: the gather all-reduces the amax itself
        self._fp8: Optional[torch.Tensor] = None  # the quantised (padded) shard made with _scale
        self._writes = 0  # in-place ops applied so far (the optimizer's steps, loads)
        self._fp8_at = -1  # _writes when _fp8 was made

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self._data!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # saved as the plain tensor it wraps (torch.save of a state dict, weights_only loads)
        return self._data.detach().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        scale = next((a._scale for a in args if isinstance(a, Float8AllGatherWeight)), None)
        if func._schema.is_mutable:  # the wrapped tensor changes: a quantised copy made before is stale
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, Float8AllGatherWeight):
                    t._writes += 1
        args, kwargs = tree_map_only(Float8AllGatherWeight, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func in _KEEP_WRAPPED:
            return tree_map_only(torch.Tensor, lambda t: Float8AllGatherWeight(t, scale), out)
        return out

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> "Float8AllGatherWeight":
        return Float8AllGatherWeight(inner["_data"])

    # ---- FSDP2 all-gather extension --------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        rows = -(-outer_size[0] // mesh.size()) if len(outer_size) else 0
        if self._scale is None:  # never precomputed: every rank reduces this weight's amax now
            scale = _scale_from_amax(_local_amax(self._data.detach()), mesh.get_group())
            return (_quantize_padded(self._data.detach(), scale, rows),), (scale,)
        if self._fp8 is None or self._fp8_at != self._writes:
            # written since the last precompute (an optimizer stepped outside the strategy, say): the
            # current values with the last reduced scale (no collective here, so ranks cannot diverge)
            self._fp8 = _quantize_padded(self._data.detach(), self._scale, rows)
            self._fp8_at = self._writes
        return (self._fp8,), (self._scale,)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None) -> Any:
        (data,), (scale,) = all_gather_outputs, metadata
        if out is not None:  # FSDP2 re-gathered into the same storage: only the scale is new
            assert isinstance(out, Float8GatheredWeight), type(out)
            out._scale = scale
            return None
        return Float8GatheredWeight(data, scale, param_dtype), (data,)


# FSDP2 inspects the hook's signature at every gather; a stored signature makes that a lookup
Float8AllGatherWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    Float8AllGatherWeight.fsdp_pre_all_gather)


def _quantize_padded(data: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``fp8(clamp(data * scale))``, dim 0 zero-padded to ``rows`` (FSDP2 gathers equal-sized shards:
    an uneven last shard is padded to ceil(rows / ranks))."""
    q = (data.float() * scale).clamp(-_FMAX, _FMAX).to(E4M3)
    if q.dim() and q.shape[0] < rows:
        padded = q.new_zeros((rows, *q.shape[1:]))
        padded[: q.shape[0]].copy_(q)
        q = padded
    return q


def _local_amax(data: torch.Tensor) -> torch.Tensor:
    if data.numel() == 0:  # an empty last shard
        return torch.zeros((), dtype=torch.float32, device=data.device)
    return data.abs().amax().float()


def _local_amaxes(datas: list[torch.Tensor]) -> torch.Tensor:
    """``max |t|`` of each tensor as one fp32 vector: one fused foreach pass (0 for an empty shard)."""
    full = [i for i, d in enumerate(datas) if d.numel()]
    norms = torch._foreach_norm([datas[i] for i in full], ord=float("inf")) if full else []
    if len(full) == len(datas):
        return torch.stack(norms).float()
    out = torch.zeros(len(datas), dtype=torch.float32, device=datas[0].device)
    for i, n in zip(full, norms):  # device copies, no host synchronisation
        out[i] = n
    return out


def _scale_from_amax(amax: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return _FMAX / torch.clamp(amax, min=_TINY)


def _is_fp8_linear(module: nn.Module) -> bool:
    from lightning_perf.kernels.ops.fp8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def require_fp8_linears(module: nn.Module) -> None:
    """Raise ValueError when ``module`` has no FP8 linear layer (nothing to gather in FP8); no collective."""
    if not any(_is_fp8_linear(m) for m in module.modules()):
        raise ValueError(
            f"fp8_all_gather=True, but {type(module).__name__} has no FP8 linear layers to gather in FP8 "
            "(Float8Linear outside tensor parallelism, e.g. GPTConfig(fp8=True))")


def require_fp8_config(module: nn.Module) -> None:
    """:func:`require_fp8_linears` for a module that builds its model in ``configure_model``: by its
    ``config.fp8`` (a GPTConfig or any config with that field; parallel/ does not import models/)."""
    config = getattr(module, "config", None)
    fp8 = getattr(config, "fp8", None)
    if fp8 is not None and not fp8:
        raise ValueError(
            f"fp8_all_gather=True, but {type(module).__name__}'s {type(config).__name__} has fp8=False, so its model has no "
            "FP8 linear layers to gather in FP8: build it with GPTConfig(fp8=True) or set fp8_all_gather=False")


def enable_fp8_all_gather(module: nn.Module) -> list[str]:
    """Make every ``Float8Linear`` weight in ``module`` an :class:`Float8AllGatherWeight`; call before ``fully_shard``.

    Weights that are already DTensors (tensor parallelism) are left alone. Returns the qualified
    names of the weights converted (empty when the model has no FP8 linears).
    """
    names = []
    for prefix, sub in module.named_modules():
        if not _is_fp8_linear(sub) or sub.weight is None:
            continue
        w = sub.weight
        if isinstance(w, Float8AllGatherWeight) or type(w).__name__ == "DTensor" or hasattr(w, "device_mesh"):
            continue
        sub.weight = nn.Parameter(Float8AllGatherWeight(w.data), requires_grad=w.requires_grad)
        names.append(f"{prefix}.weight" if prefix else "weight")
    return names


def fp8_all_gather_weights(module: nn.Module) -> list[Any]:
    """The sharded parameters (DTensors) whose local tensors gather as FP8."""
    found = []
    for p in module.parameters():
        local = getattr(p, "_local_tensor", None)
        if isinstance(local, Float8AllGatherWeight):
            found.append(p)
    return found


@torch.no_grad()
def precompute_fp8_scales(module: nn.Module) -> int:
    """One all-reduce for the scales of every FP8-gathered weight, and their FP8 shards (call after
    each optimizer step).

    Until the next call, the all-gathers send these FP8 shards instead of reducing each weight's
    amax and quantising it at every gather (twice a step at ZeRO-3: forward and backward). Anything
    that changes the weights outside the optimizer (a checkpoint load, a manual edit) should call it
    again; the strategies do so after the optimizer step and after loading. Every rank must call it
    (it is a collective). Returns the number of weights.
    """
    params = fp8_all_gather_weights(module)
    if not params:
        return 0
    by_group: dict[Any, list[Any]] = {}
    for p in params:
        by_group.setdefault(p.device_mesh.get_group(), []).append(p)
    for group, ps in by_group.items():
        amax = _local_amaxes([p._local_tensor._data.detach() for p in ps])
        scales = _scale_from_amax(amax, group)
        world = dist.get_world_size(group)
        for p, s in zip(ps, scales.unbind(0)):
            local = p._local_tensor
            local._scale = s
            local._fp8 = _quantize_padded(local._data.detach(), s, -(-p.shape[0] // world) if p.dim() else 0)
            local._fp8_at = local._writes
    return len(params)


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with FP8-gathering shards replaced by DTensors of their plain master tensors.

    The replacements share storage with the parameters, so a checkpoint loads into them in place;
    saved files hold plain tensors (a plain or differently sharded model loads them).
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        local = getattr(v, "_local_tensor", None)
        if isinstance(v, DTensor) and isinstance(local, Float8AllGatherWeight):
            v = DTensor.from_local(local._data, v.device_mesh, v.placements, run_check=False, shape=v.shape,
                                   stride=v.stride())
        out[k] = v
    return out
