"""Tensor (and sequence) parallelism through ``parallelize_module``.

The model supplies the plan (``model.tensor_parallel_plan(tp_mesh)``, the 3D model
protocol); :func:`apply_tp` applies it. :class:`ReplicatedOutputNorm` is the one style
torch does not ship: the final norm before a vocab-parallel head, whose output must be
a replicated DTensor so that ``F.linear(x, head_weight)`` yields vocab-sharded logits
that ``loss_parallel`` turns into a loss without gathering the vocabulary.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_perf.parallel.layout.dims import mesh_size

__all__ = [
    "ReplicatedModule",
    "ReplicatedOutputNorm",
    "apply_tp",
    "find_protocol_module",
    "require_protocol",
    "to_local_output",
    "tp_sequence_check",
    "local_tensor",
    "unfuse_linear_biases",
    "cast_before_gather",
    "SEQUENCE_PARALLEL_MODES",
    "check_sequence_parallel",
    "residual_layout",
    "register_batch_padding",
    "enable_async_tp",
]

#: ``sequence_parallel`` values: False (replicated residual stream), True (the stream and norms
#: sharded along the sequence, dim 1 of (B, T, d)) or "batch" (sharded along the batch, dim 0)
SEQUENCE_PARALLEL_MODES = (False, True, "batch")


def check_sequence_parallel(value: Any) -> Any:
    """``value`` if it is one of :data:`SEQUENCE_PARALLEL_MODES`, else a ``ValueError``."""
    if not any(value is m or (isinstance(m, str) and value == m) for m in SEQUENCE_PARALLEL_MODES):
        raise ValueError(f"sequence_parallel={value!r} is not one of {SEQUENCE_PARALLEL_MODES} (True shards the "
                         "sequence, 'batch' shards whole sequences of the batch)")
    return value


def residual_layout(sequence_parallel: Any) -> Any:
    """The placement of the residual stream between TP regions: ``Shard(1)``, ``Shard(0)`` or ``Replicate()``.

    Sharding the batch dimension (``"batch"``) gives each rank whole sequences between the TP
    regions: the norms and residual adds are per token either way, but the all-gathers and
    reduce-scatters then run along the leading dimension of a contiguous (B, T, d) tensor, where
    sharding the sequence (dim 1) makes each collective's output or input a strided re-layout
    that costs a full extra copy of the gathered tensor (every gather and scatter of every block).
    It needs the (micro)batch divisible by the tensor-parallel size.
    """
    from torch.distributed.tensor import Replicate, Shard

    check_sequence_parallel(sequence_parallel)
    if sequence_parallel == "batch":
        return Shard(0)
    return Shard(1) if sequence_parallel else Replicate()

_PROTOCOL_HINT = {
    "tensor_parallel_plan": "tensor_parallel_plan(self, tp_mesh) -> dict (a parallelize_module plan)",
    "pipeline_stage": "pipeline_stage(self, stage_idx, num_stages) -> nn.Module (this stage's part)",
    "enable_context_parallel": "enable_context_parallel(self, attention) (route attention through it) and "
                               "forward(idx, targets=None, *, positions=None)",
}


def _style_base() -> type:
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle


class ReplicatedOutputNorm(_style_base()):  # type: ignore[misc]
    """A norm whose input is the residual stream and whose output is a replicated DTensor.

    Parameters become replicated DTensors. The input is a local tensor sharded on the
    sequence (``sequence_parallel=True``, normalised locally as in ``SequenceParallel``)
    or replicated; the output is all-gathered along the sequence and kept as a DTensor
    (backward: the partial gradient from the vocab-parallel head is reduce-scattered).
    """

    def __init__(self, *, sequence_parallel: Any = True) -> None:
        super().__init__()
        self.sequence_parallel = check_sequence_parallel(sequence_parallel)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                dparam = nn.Parameter(distribute_tensor(param.data, device_mesh, [Replicate()]), param.requires_grad)
                module.register_parameter(name, dparam)
        layout = residual_layout(self.sequence_parallel)

        def to_dtensor(mod: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [layout], run_check=False)
            return (x, *args[1:])

        def gather(mod: nn.Module, args: tuple, out: Any) -> Any:
            # the head's linear consumes the gathered copy at the autocast width: gather it at that width
            dtype = _autocast_dtype(out)
            if dtype is not None:
                out = out.to(dtype)
            return out.redistribute(device_mesh, [Replicate()])

        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(gather)
        return module


class ReplicatedModule(_style_base()):  # type: ignore[misc]
    """A module computed in full on every TP rank with replicated DTensor parameters and output.

    Inputs become replicated DTensors, so the output is one too and can meet sharded DTensors in
    the caller's arithmetic (e.g. a (T, d) position table added to batch-sharded (B, T, d) token
    rows); the gradient of the parameters then sums over every rank's shard of that arithmetic
    (a partial sum, reduced like a sequence-parallel norm's weight gradient).
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        def to_dtensor(mod: nn.Module, inputs: tuple, mesh: Any) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        return distribute_module(module, device_mesh, input_fn=to_dtensor)


def find_protocol_module(root: nn.Module, method: str) -> Optional[nn.Module]:
    """The outermost submodule of ``root`` (``root`` included) that has a callable ``method``."""
    for _, sub in root.named_modules():
        if callable(getattr(sub, method, None)):
            return sub
    return None


def require_protocol(root: nn.Module, method: str, why: str) -> nn.Module:
    """:func:`find_protocol_module`, raising a ``ValueError`` that names the missing method."""
    found = find_protocol_module(root, method)
    if found is None:
        raise ValueError(
            f"{why} needs the model to implement `{_PROTOCOL_HINT.get(method, method)}`; "
            f"no submodule of {type(root).__name__} defines `{method}`. Implement it (the 3D model protocol: "
            f"help(lightning_perf.strategies.Parallel3DStrategy)) or use data parallelism / ZeRO only "
            f"(tensor, pipeline and context sizes 1)."
        )
    return found


def _call_plan(model: nn.Module, tp_mesh: Any, sequence_parallel: Any) -> dict[str, Any]:
    method = model.tensor_parallel_plan  # type: ignore[attr-defined]
    params = inspect.signature(method).parameters
    if "sequence_parallel" in params:
        return method(tp_mesh, sequence_parallel=sequence_parallel)
    return method(tp_mesh)


def to_local_output(output: Any) -> Any:
    """DTensor outputs back to plain tensors: a replicated one (a loss) locally, a sharded one gathered."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(output, DTensor):
        if all(isinstance(p, Replicate) for p in output.placements):
            return output.to_local()
        return output.full_tensor()
    if isinstance(output, tuple):
        return tuple(to_local_output(o) for o in output)
    return output


def apply_tp(
    model: nn.Module, tp_mesh: Any, *, sequence_parallel: Any = True, local_output: bool = False
) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` with its own plan; returns the same module.

    ``local_output=True`` converts the model's DTensor outputs back to plain tensors
    (for code that calls the model directly, e.g. a LightningModule's ``training_step``);
    a pipeline stage keeps DTensor logits for the vocab-parallel loss instead.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    require_protocol(model, "tensor_parallel_plan", f"tensor parallelism (tp={mesh_size(tp_mesh)})")
    if not callable(getattr(model, "tensor_parallel_plan", None)):
        raise ValueError(f"apply_tp needs the module that defines tensor_parallel_plan, got {type(model).__name__}")
    plan = cast_before_gather(_call_plan(model, tp_mesh, sequence_parallel))
    parallelize_module(model, tp_mesh, plan)
    if local_output:
        model.register_forward_hook(lambda mod, args, out: to_local_output(out))
    return model


def _autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype for ``t``'s device when autocast is on there and ``t`` is wider, else None."""
    if not t.is_floating_point():
        return None
    device = t.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if t.element_size() > dtype.itemsize else None


def _cast_args(args: tuple, indices: tuple[int, ...]) -> tuple:
    out = list(args)
    for i in indices:
        if i < len(out) and isinstance(out[i], torch.Tensor):
            dtype = _autocast_dtype(out[i])
            if dtype is not None:
                out[i] = out[i].to(dtype)
    return tuple(out)


def _gathered_indices(style: Any) -> tuple[int, ...]:
    """Positions a ``PrepareModuleInput`` turns from a shard into a replicated (gathered) tensor."""
    from torch.distributed.tensor import Replicate, Shard

    pairs = zip(style.input_layouts or (), style.desired_input_layouts or ())
    return tuple(i for i, (src, dst) in enumerate(pairs) if isinstance(src, Shard) and isinstance(dst, Replicate))


@functools.lru_cache(maxsize=None)
def _casting_prepare_module_input() -> type:
    from torch.distributed.tensor.parallel import PrepareModuleInput

    class CastThenGather(PrepareModuleInput):
        """``PrepareModuleInput`` that casts the inputs it gathers to the autocast dtype first."""

        def _prepare_input_fn(self, inputs: Any, device_mesh: Any) -> Any:
            if isinstance(inputs, tuple):
                inputs = _cast_args(inputs, self._gathered)
            return super()._prepare_input_fn(inputs, device_mesh)

    return CastThenGather


def cast_before_gather(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan with each sequence-gathering ``PrepareModuleInput`` casting to the autocast dtype first.

    With ``bf16-mixed`` by autocast (no FSDP casting the parameters), the residual stream and the
    norms' outputs are fp32; a ``PrepareModuleInput`` that all-gathers a sequence shard would move
    fp32 over the link, and the column-parallel linears behind it would each cast the gathered
    copy to bf16 again. In the GPT's plans every consumer of a gathered input is such a linear,
    so casting the shard first computes the same forward with half the all-gather bytes (and half
    the reduce-scatter bytes of its gradient in backward). A user's plan gets the same cast: its
    module then sees a bf16 input under bf16 autocast, as it would under FSDP2's mixed precision.
    Outside autocast, or for tensors already at or below the autocast width, nothing changes.
    Other styles are returned as they are.
    """
    from torch.distributed.tensor.parallel import PrepareModuleInput

    cls = _casting_prepare_module_input()
    out: dict[str, Any] = {}
    for path, style in plan.items():
        gathered = _gathered_indices(style) if type(style) is PrepareModuleInput else ()
        if gathered:
            casting = cls.__new__(cls)
            casting.__dict__.update(style.__dict__)
            casting._gathered = gathered
            style = casting
        out[path] = style
    return out


class _ColumnParallelBiasAfterMatmul(nn.Linear):
    """A column-parallel ``Linear`` computing ``mm`` then ``+ bias`` (not ``addmm``).

    ``bias_after_matmul`` says so to code that computes with the weights directly (the GPT's fused
    q/k/v matmul), which then adds the bias the same way.
    """

    bias_after_matmul = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight) + self.bias


class _RowParallelBiasAfterReduction(nn.Linear):
    """A row-parallel ``Linear`` whose bias a forward hook adds after the output's reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def unfuse_linear_biases(model: nn.Module, tp_mesh: Any, *, sequence_parallel: Any = True) -> int:
    """Split each tensor-parallel ``Linear``'s bias from its matmul; returns how many were changed.

    Inductor's async TP fuses an all-gather into the matmul that consumes it and a reduce-scatter
    into the matmul that produces it, but only a bias-free ``mm``: ``F.linear`` with a bias lowers to
    ``addmm`` and is left unfused (GPT-2-style models have a bias on every projection). A column-
    parallel linear becomes ``mm`` then ``+ bias`` (same shard, no communication); a row-parallel one
    drops the bias from the matmul and adds it after the output's reduce-scatter (or all-reduce),
    on the sequence shard, as a DTensor so the bias gradient is reduced over the TP group like a
    sequence-parallel norm's weight. Parameter names do not change, and every block's linears share
    one class (a compiled sublayer is not recompiled per block). Plain ``nn.Linear`` only (a subclass
    keeps its own forward). Call after :func:`apply_tp`.
    """
    from torch.distributed.tensor import DTensor, Shard

    out_layout = residual_layout(sequence_parallel)

    def add_bias_after_reduction(mod: nn.Module, args: tuple, out: Any) -> Any:
        local = isinstance(out, torch.Tensor) and not isinstance(out, DTensor)
        d = DTensor.from_local(out, tp_mesh, [out_layout], run_check=False) if local else out
        d = d + mod.bias
        return d.to_local() if local else d

    changed = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.bias is None or not isinstance(module.weight, DTensor):
            continue
        placement = module.weight.placements[0]
        if placement == Shard(0):  # column-parallel: the output features are sharded, the bias with them
            module.__class__ = _ColumnParallelBiasAfterMatmul
        elif placement == Shard(1):  # row-parallel: the matmul output is a partial sum
            module.__class__ = _RowParallelBiasAfterReduction
            module.register_forward_hook(add_bias_after_reduction)
        else:
            continue
        changed += 1
    return changed


def tp_sequence_check(seq_len: int, tensor_parallel_size: int, sequence_parallel: Any, batch: Optional[int] = None,
                      microbatches: int = 1) -> None:
    """Sequence parallelism splits the sequence (or with ``"batch"`` each microbatch) evenly over the TP ranks."""
    tp = tensor_parallel_size
    if sequence_parallel == "batch":
        if batch is not None and tp > 1:
            per = batch // max(1, microbatches)
            if per % tp:
                raise ValueError(
                    f"sequence_parallel='batch' shards each (micro)batch over tensor_parallel_size {tp}, but a "
                    f"batch of {batch} in {microbatches} microbatch(es) gives {per} sequences ({per} / {tp} = "
                    f"{per / tp:.3g}); use a batch size whose microbatches are multiples of {tp} or "
                    "sequence_parallel=True"
                )
        return
    if sequence_parallel and tp > 1 and seq_len % tp:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by tensor_parallel_size {tp} "
            f"({seq_len} / {tp} = {seq_len / tp:.3g}); sequence parallelism shards the sequence: "
            f"use a seq_len that is a multiple of {tp} or sequence_parallel=False"
        )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class _BatchPadding:
    """The forward hooks of a batch-sharded TP model that pad a ragged batch and cut the outputs back.

    A batch that does not divide by ``tensor_parallel_size`` (the last, ragged batch of a validation
    set, say) is padded to the next multiple when the model says how its loss ignores a target
    (``batch_padding_target``, e.g. the GPT's -100): the padding repeats the last sequence and its
    targets are ignored, so the loss is the unpadded batch's; outputs with a batch dimension are cut
    back. Otherwise a ValueError, before the first collective.
    """

    def __init__(self, tensor_parallel_size: int) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        self.unpadded: Optional[int] = None  # the batch before padding, between the two hooks of one call

    def pad(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        tp = self.tensor_parallel_size
        self.unpadded = None
        x = args[0] if args else kwargs.get("idx")
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] % tp == 0:
            return None
        fill = getattr(module, "batch_padding_target", None)
        if fill is None:
            tp_sequence_check(x.shape[1], tp, "batch", batch=x.shape[0])
        batch = x.shape[0]
        pad = -batch % tp
        x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
        args, kwargs = list(args), dict(kwargs)
        if args:
            args[0] = x
        else:
            kwargs["idx"] = x
        in_args = len(args) > 1
        targets = args[1] if in_args else kwargs.get("targets")
        if isinstance(targets, torch.Tensor) and targets.dim() >= 1 and targets.shape[0] == batch:
            targets = torch.cat([targets, targets.new_full((pad, *targets.shape[1:]), fill)])
            if in_args:
                args[1] = targets
            else:
                kwargs["targets"] = targets
        self.unpadded = batch
        return tuple(args), kwargs

    def strip(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        batch, self.unpadded = self.unpadded, None
        if batch is None:
            return output
        if isinstance(output, torch.Tensor) and output.dim() >= 1 and output.shape[0] > batch:
            return output[:batch]
        return output


def register_batch_padding(module: nn.Module, tensor_parallel_size: int) -> None:
    """Let a batch-sharded TP model (``sequence_parallel="batch"``) take a batch that does not divide by
    ``tensor_parallel_size``.

    An uneven batch would give the ranks shards of different sizes: it is padded (a model whose
    loss ignores padded targets) or refused, before the first collective (see :class:`_BatchPadding`).
    """
    hooks = _BatchPadding(tensor_parallel_size)
    module.register_forward_pre_hook(hooks.pad, with_kwargs=True)
    module.register_forward_hook(hooks.strip, with_kwargs=True)


def enable_async_tp(tp_mesh: Any, device: torch.device) -> None:
    """Micro-pipelined TP (torch.compile + symmetric memory); CUDA only, a warning elsewhere."""
    if device.type != "cuda":
        warnings.warn("async_tensor_parallel needs CUDA (symmetric memory); running synchronous TP", stacklevel=2)
        return
    try:
        from torch._inductor import config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    except ImportError:  # pragma: no cover - torch builds without symmetric memory
        warnings.warn("this torch build has no symmetric memory: running synchronous TP", stacklevel=2)
        return
    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)

