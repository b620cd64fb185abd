"""Compose pipeline, tensor and data parallelism on one model, in a fixed order.

    1. pipeline split   model.pipeline_stage(i, n) for this rank's stages
    2. activation ckpt  per block (parameter names unchanged)
    3. tensor parallel  model.tensor_parallel_plan(tp_mesh) on every stage
    4. compile          torch.compile per block (per attention/MLP sublayer under TP), see below
    5. data parallel    FSDP2 over the "dp" mesh (ZeRO 1-3), or a plain gradient all-reduce (ZeRO 0)
    6. materialise      meta tensors -> device, the model's own init (only if built on meta)

Compile under tensor parallelism: eager DTensor dispatch costs host time on every
op (the GPU idles between small launches), so TP wants compiled blocks. A compiled
region must not begin with ``DTensor.from_local`` of a plain-tensor graph input: the
sequence-parallel norm does exactly that with the residual stream, and AOTAutograd
then hands the embedding's redistribution a plain gradient in backward (an
``AttributeError: '_local_tensor'``). So under TP each block's sublayers that own
matrices (attention, MLP: their inputs arrive as DTensors) are compiled, and the
norms and residual adds stay eager; without TP whole blocks are compiled. Blocks the
module compiled itself (``GPTLightningModule(compile=...)``) are re-scoped the same way.

:class:`Parallel3DConfig` is checked with numbers alone (no process group);
:func:`check_model` checks a model against it before any collective.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_perf.parallel.dims import ParallelDims
from lightning_perf.parallel.pipeline import (
    PipelineConfig,
    PipelineRunner,
    build_stage_modules,
    lm_cross_entropy,
    prune_to_stages,
)
from lightning_perf.parallel.tensor_parallel import apply_tp, require_protocol

__all__ = [
    "AC_MODES",
    "Parallel3DConfig",
    "Parallelized3D",
    "parallelize_3d",
    "check_model",
    "check_model_config",
    "allreduce_gradients",
    "clip_grad_norm_3d",
    "compile_blocks",
    "compile_targets",
    "compile_head_loss",
    "tp_sublayers",
]

AC_MODES = ("none", "full", "selective")


@dataclass(kw_only=True)
class Parallel3DConfig:
    """Every layout option of the 3D strategy; validated at construction."""

    data_parallel_size: Union[int, str] = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    zero_stage: int = 2
    pipeline_schedule: str = "1f1b"
    num_microbatches: Optional[int] = None
    stages_per_rank: int = 1
    sequence_parallel: Union[bool, str] = True
    async_tensor_parallel: bool = False
    tp_overlap: str = "reorder"
    tp_split: int = 1
    activation_checkpointing: str = "none"
    fsdp_prefetch: int = 1
    fsdp_blocks_per_unit: int = 1
    compile: Optional[str] = None
    compile_backend: str = "inductor"
    fp8_all_gather: bool = False
    pipeline: Optional[PipelineConfig] = field(default=None, init=False)

    def __post_init__(self) -> None:
        dp = self.data_parallel_size
        if dp != "auto" and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1):
            raise ValueError(f"data_parallel_size must be 'auto' or a positive integer, got {dp!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "stages_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r} is not one of {AC_MODES}")
        from lightning_perf.models.gpt.transforms import COMPILE_MODES

        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile={self.compile!r} is not one of {COMPILE_MODES}")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(f"compile_backend must be a torch.compile backend name, got {self.compile_backend!r}")
        from lightning_perf.parallel.tensor_parallel import check_sequence_parallel

        check_sequence_parallel(self.sequence_parallel)
        if self.tp_overlap not in TP_OVERLAP_MODES:
            raise ValueError(f"tp_overlap={self.tp_overlap!r} is not one of {TP_OVERLAP_MODES}")
        if isinstance(self.tp_split, bool) or self.tp_split not in (1, 2):
            raise ValueError(f"tp_split must be 1 (off) or 2 (each compiled TP block runs two halves of its "
                             f"batch so one half's collectives overlap the other's compute), got {self.tp_split!r}")
        if self.fsdp_prefetch < 0:
            raise ValueError(f"fsdp_prefetch must be >= 0, got {self.fsdp_prefetch}")
        from lightning_perf.parallel.fsdp import check_blocks_per_unit

        check_blocks_per_unit(self.fsdp_blocks_per_unit, "fsdp_blocks_per_unit")
        if self.fsdp_blocks_per_unit > 1 and self.zero_stage == 0:
            raise ValueError("fsdp_blocks_per_unit groups FSDP2 units over 'dp': it needs zero_stage 1-3, "
                             f"got zero_stage=0 (fsdp_blocks_per_unit={self.fsdp_blocks_per_unit})")
        if self.fp8_all_gather:
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "fp8_all_gather gathers whole FP8 weights over 'dp'; under tensor parallelism "
                    f"(tensor_parallel_size={self.tensor_parallel_size}) the FP8 linears quantise each rank's "
                    "shard instead: use tensor_parallel_size=1 or fp8_all_gather=False")
            if self.zero_stage == 0 or self.data_parallel_size == 1:
                raise ValueError(
                    "fp8_all_gather changes FSDP2's parameter all-gather: it needs data parallelism with ZeRO "
                    f"(zero_stage 1-3 and data_parallel_size > 1), got zero_stage={self.zero_stage}, "
                    f"data_parallel_size={self.data_parallel_size!r}")
        # the schedule is checked even without pipeline parallelism, so a typo never waits for a pp run
        self.pipeline = PipelineConfig(
            pp=self.pipeline_parallel_size,
            schedule=self.pipeline_schedule,
            num_microbatches=self.num_microbatches,
            stages_per_rank=self.stages_per_rank,
        )
        if self.pipeline_parallel_size == 1 and self.stages_per_rank > 1:
            raise ValueError(f"stages_per_rank={self.stages_per_rank} needs pipeline_parallel_size > 1")

    def dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(
            dp=self.data_parallel_size,  # type: ignore[arg-type]
            tp=self.tensor_parallel_size,
            pp=self.pipeline_parallel_size,
            world_size=world_size,
        )


def check_model(model: nn.Module, config: Parallel3DConfig) -> nn.Module:
    """The protocol submodule to parallelise; raises before any collective if the layout cannot work.

    Without tensor or pipeline parallelism any model works (data parallelism needs
    nothing from it); with them, the model must implement the protocol method.
    A model exposing ``config`` with GPT fields is checked for divisibility too.
    """
    from lightning_perf.parallel.zero import find_model

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    # the inner network (a LightningModule's ``model``), so FSDP2's root hooks fire on its forward
    target = find_model(model)
    if pp > 1:
        target = require_protocol(model, "pipeline_stage", f"pipeline parallelism (pp={pp})")
    if tp > 1:
        tp_target = require_protocol(
            target if pp > 1 else model, "tensor_parallel_plan", f"tensor parallelism (tp={tp})"
        )
        target = target if pp > 1 else tp_target
    check_model_config(getattr(target, "config", None), config)
    return target


def check_model_config(model_config: Any, config: Parallel3DConfig) -> None:
    """Check a GPT-shaped model config (heads, kv heads, layers, tied head) against the layout.

    Needs numbers only, so a strategy can call it before any process group exists
    (a LightningModule that carries its model config before ``configure_model``).
    Anything that is not GPT-shaped is left to the model's own protocol methods.
    """
    fields = ("n_head", "n_kv_head", "n_layer", "tie_embeddings", "intermediate_size", "padded_vocab_size")
    if model_config is None or not all(hasattr(model_config, a) for a in fields):
        return
    from lightning_perf.models.gpt.parallelize import check_gpt_layout

    pp = config.pipeline_parallel_size
    check_gpt_layout(
        model_config, tp=config.tensor_parallel_size, pp=pp, stages_per_rank=config.stages_per_rank if pp > 1 else 1
    )


@dataclass
class Parallelized3D:
    """The result of :func:`parallelize_3d` on one rank."""

    target: nn.Module  # the (pruned) protocol module, original parameter names
    stages: dict[int, nn.Module]  # this rank's stage modules (``{0: target}`` without pp)
    runner: Optional[PipelineRunner]  # the schedule, with pp > 1
    fsdp: bool  # FSDP2 shards over "dp"


def _blocks(module: nn.Module) -> list[nn.Module]:
    from lightning_perf.parallel.fsdp import find_blocks

    return find_blocks(module)


def _apply_ac(blocks: list[nn.Module], mode: str) -> None:
    if mode == "none":
        return
    from lightning_perf.models.gpt.transforms import apply_activation_checkpointing

    apply_activation_checkpointing(blocks, mode)


def parallelize_3d(
    model: nn.Module,
    config: Parallel3DConfig,
    mesh: Any,
    *,
    device: torch.device,
    mp_policy: Optional[Any] = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = lm_cross_entropy,
) -> Parallelized3D:
    """Split, shard and (if built on meta) materialise ``model`` for this rank of ``mesh``.

    ``mesh`` is the (pp, dp, tp) mesh of :meth:`ParallelDims.build_mesh`. With pipeline
    parallelism ``model`` is pruned in place to this rank's stages (names unchanged).
    """
    target = check_model(model, config)
    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    dp = mesh["dp"].size()
    pcfg = config.pipeline
    assert pcfg is not None
    if pp > 1:
        stages = build_stage_modules(target, mesh["pp"].get_local_rank(), pcfg)
    else:
        stages = {0: target}
    for stage in stages.values():
        _apply_ac(_blocks(stage), config.activation_checkpointing)
    if tp > 1:
        if config.async_tensor_parallel:
            _enable_async_tp(mesh["tp"], device)
        for stage in stages.values():
            # a whole model is called by user code (plain tensors out); a stage feeds the pipeline loss
            apply_tp(stage, mesh["tp"], sequence_parallel=config.sequence_parallel, local_output=pp == 1)
            if config.sequence_parallel == "batch" and pp == 1:
                # an uneven batch would give the ranks shards of different sizes: pad it (a model
                # whose loss ignores padded targets) or refuse it, before the first collective
                # (under pp the pipeline's forward checks each microbatch)
                stage.register_forward_pre_hook(functools.partial(_pad_batch_for_tp, tp), with_kwargs=True)
                stage.register_forward_hook(_strip_batch_padding, with_kwargs=True)
            if config.async_tensor_parallel:
                # async TP fuses collectives into bias-free matmuls only
                from lightning_perf.parallel.tensor_parallel import unfuse_linear_biases

                unfuse_linear_biases(stage, mesh["tp"], sequence_parallel=config.sequence_parallel)
    mode = _compile_mode(model, stages, config)
    if mode is not None:
        for stage in stages.values():
            compile_blocks(_blocks(stage), mode, backend=config.compile_backend, tensor_parallel=tp > 1,
                           tp_overlap=config.tp_overlap, device_type=device.type, tp_split=config.tp_split)
            compile_head_loss(stage, mode, backend=config.compile_backend)
    use_fsdp = dp > 1 and config.zero_stage > 0
    if config.fp8_all_gather and not use_fsdp:  # "auto" resolved to one replica (every rank alike)
        raise ValueError(f"fp8_all_gather needs data parallelism with ZeRO; this layout has dp={dp}")
    if use_fsdp:
        from lightning_perf.parallel.fsdp import apply_fsdp

        # under pp every microbatch would re-gather a resharded stage: keep it gathered (ZeRO-2 memory)
        reshard = config.zero_stage == 3 and pp == 1
        for stage in stages.values():
            apply_fsdp(
                stage,
                mesh["dp"],
                blocks=_blocks(stage),
                reshard_after_forward=reshard,
                mp_policy=mp_policy,
                prefetch=config.fsdp_prefetch,
                fp8_all_gather=config.fp8_all_gather,
                blocks_per_unit=config.fsdp_blocks_per_unit,
            )
    if pp > 1:
        prune_to_stages(target, stages)
    if any(t.is_meta for t in list(target.parameters()) + list(target.buffers())):
        from lightning_perf.parallel.init import materialize_local

        materialize_local(target, device)
    runner = None
    if pp > 1:
        runner = PipelineRunner(pcfg, stages, mesh["pp"].get_group(), device, loss_fn=loss_fn)
    return Parallelized3D(target=target, stages=stages, runner=runner, fsdp=use_fsdp)


def _compile_mode(model: nn.Module, stages: dict[int, nn.Module], config: Parallel3DConfig) -> Optional[str]:
    """The compile mode to apply per block; a compile the module applied itself is re-scoped where needed.

    Under TP every compiled module (whole model or blocks) moves to sublayer scope; under PP a
    whole-model compile would never run (the schedule calls the stages) and moves to the blocks.
    """
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp == 1 and pp == 1:
        return config.compile  # blocks or the model compiled by the module stay as they are
    blocks = {id(b) for b in _blocks(model)} | {id(b) for s in stages.values() for b in _blocks(s)}
    compiled = [
        m
        for m in list(model.modules()) + [m for s in stages.values() for m in s.modules()]
        if getattr(m, "_compiled_call_impl", None) is not None and (tp > 1 or id(m) not in blocks)
    ]
    compiled = list({id(m): m for m in compiled}.values())
    if not compiled:
        return config.compile
    for module in compiled:
        module._compiled_call_impl = None
    scope = "each block, with its tensor-parallel hooks" if tp > 1 else "each pipeline stage's blocks"
    warnings.warn(
        f"{'tensor' if tp > 1 else 'pipeline'} parallelism: the model's torch.compile ({len(compiled)} compiled "
        f"modules) is re-applied to {scope}",
        stacklevel=3,
    )
    hparams = getattr(model, "hparams", None)
    module_mode = hparams.get("compile") if hasattr(hparams, "get") else None
    return config.compile or module_mode or "default"


def compile_targets(block: nn.Module, *, tensor_parallel: bool) -> list[nn.Module]:
    """What to compile in ``block``: the whole block, or under TP with activation checkpointing its sublayers.

    Under TP the block is compiled with every submodule's hooks inside (see :func:`compile_blocks`):
    measured on 2x H200 (gpt-1.3b tp2), compiling only the attention / MLP sublayers left the
    sequence-parallel norms and the residual adds to eager DTensor / ATen kernels, 4-7% slower.
    A checkpointed block under TP keeps the sublayer scope: Dynamo tracing the checkpoint together
    with the DTensor redistributions inside it fails (AOTAutograd finds DTensors among the tensors
    it saves for the recomputation), while compiled sublayers inside an eager checkpoint are exact.
    """
    if tensor_parallel and getattr(block, "_lp_checkpointing", None) is not None:
        return tp_sublayers(block)
    return [block]


def tp_sublayers(block: nn.Module) -> list[nn.Module]:
    """The attention / MLP sublayers of ``block`` (children owning matrices): the narrower TP compile scope."""
    subs = [c for c in block.children() if any(p.dim() >= 2 for p in c.parameters())]
    return subs or [block]


def _pad_batch_for_tp(tp: int, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """Forward pre-hook of a batch-sharded TP model: a batch that does not divide by ``tp`` (the last,
    ragged batch of a validation set, say) is padded to the next multiple, when the model says how
    its loss ignores a target (``batch_padding_target``, e.g. the GPT's -100): the padding repeats
    the last sequence and its targets are ignored, so the loss is the unpadded batch's; outputs
    with a batch dimension are cut back (:func:`_strip_batch_padding`). Otherwise a ValueError."""
    module._lp_unpadded_batch = None
    x = args[0] if args else kwargs.get("idx")
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] % tp == 0:
        return None
    fill = getattr(module, "batch_padding_target", None)
    if fill is None:
        from lightning_perf.parallel.tensor_parallel import tp_sequence_check

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
    module._lp_unpadded_batch = batch
    return tuple(args), kwargs


def _strip_batch_padding(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    batch = getattr(module, "_lp_unpadded_batch", None)
    if batch is None:
        return output
    module._lp_unpadded_batch = None
    if isinstance(output, torch.Tensor) and output.dim() >= 1 and output.shape[0] > batch:
        return output[:batch]
    return output


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # traced by Dynamo as one frame: the hooks of the module and its submodules (the TP styles'
    # all-gather / reduce-scatter, sequence-parallel norms) are inlined into the same graph as the
    # matmuls; the module is an input, so every block shares a single compiled graph
    return module._call_impl(*args, **kwargs)


def _call_module_split(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    # two independent halves of the batch through the same module in one traced graph: the
    # scheduler can run one half's TP collectives while the other half computes (forward and
    # backward); per-token and per-sequence maths make the halves exact pieces of the whole
    outs = [module._call_impl(part, *args, **kwargs) for part in x.chunk(2, dim=0)]
    return torch.cat(outs, dim=0)


def _splittable(x: Any, parts: int) -> bool:
    from torch.distributed.tensor import DTensor

    # a DTensor input (the batch-sharded first block with a position table) is left whole: chunking
    # its sharded batch dimension would redistribute it
    return (isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() >= 1
            and x.shape[0] >= parts and x.shape[0] % parts == 0)


def _run_hooked_split(whole: Any, split: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    chosen = split if args and _splittable(args[0], 2) else whole
    return _run_hooked(chosen, module, *args, **kwargs)


def _run_hooked(compiled: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # A graph input that is a view, e.g. the output of DTensor.to_local() (the vocab-parallel embedding
    # feeding the first block directly), gets a wrong gradient or a plain tensor where DTensor's
    # backward expects a DTensor (torch 2.11-2.13, aot_eager and inductor alike); a copy, made only
    # for such inputs that need a gradient (one (B, T/tp, d) tensor per step; sliced RoPE tables
    # pass as they are), gives the graph an input of its own
    args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad and a._is_view() else a
                 for a in args)
    return compiled(module, *args, **kwargs)


_HOOKED_COMPILES: dict[tuple[str, str, str, bool], Any] = {}

TP_OVERLAP_MODES = ("none", "reorder", "reorder_peak_memory", "schedule")

# Inductor scheduler passes, in order, per tp_overlap mode
_REORDER_PASSES = {
    # waits as late as their first user, collectives as early as their inputs, then independent
    # compute (the weight-gradient matmuls) moved between a collective and its wait
    "reorder": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"],
    # torch's recommended list: collectives moved early only where the graph's peak memory allows
    "reorder_peak_memory": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}


def inductor_overlap_options(tp_overlap: str, device_type: str) -> dict[str, Any]:
    """``torch.compile(options=...)`` that let Inductor overlap a TP block's collectives with its compute.

    Within a compiled block the backward's weight-gradient matmuls depend on no collective, so
    the reduce-scatter of the input gradient and the next sublayer's all-gather can run under
    them; by default Inductor waits on each collective right where it is issued. ``"reorder"`` and
    ``"reorder_peak_memory"``: the scheduler passes above (any device); ``"schedule"``: the
    runtime-estimated overlap scheduler on the ATen graph (CUDA only: it times ops on the GPU;
    ``"reorder"`` elsewhere).
    """
    if tp_overlap == "none":
        return {}
    if tp_overlap == "schedule":
        if device_type == "cuda":
            return {"aten_distributed_optimizations.enable_overlap_scheduling": True}
        tp_overlap = "reorder"
    return {"reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": list(_REORDER_PASSES[tp_overlap])}


def _hooked_compile(mode: str, backend: str, tp_overlap: str = "none", device_type: str = "cpu",
                    split: bool = False) -> Any:
    options = inductor_overlap_options(tp_overlap, device_type) if backend == "inductor" else {}
    key = (mode, backend, repr(sorted(options.items())), split)
    fn = _call_module_split if split else _call_module
    if key not in _HOOKED_COMPILES:
        if backend == "inductor":
            # mode and options are exclusive in torch.compile: a mode's own options join ours
            if mode != "default":
                from torch._inductor import list_mode_options

                options = {**list_mode_options(mode), **options}
            _HOOKED_COMPILES[key] = torch.compile(fn, options=options or None)
        else:
            _HOOKED_COMPILES[key] = torch.compile(fn, backend=backend)
    return _HOOKED_COMPILES[key]


def compile_blocks(blocks: list[nn.Module], mode: str, *, backend: str = "inductor", tensor_parallel: bool,
                   tp_overlap: str = "none", device_type: str = "cpu", tp_split: int = 1) -> None:
    """``torch.compile`` per block (names and state dict unchanged); after TP, before FSDP.

    Under TP each block is compiled together with its submodules' forward hooks, so the
    sequence-parallel norms, the all-gathers, the matmuls, the reduce-scatters and the residual
    adds land in one graph (what Inductor fuses, and what its micro-pipelined async TP rewrites);
    every block shares that graph (the module is an input, not a constant).
    """
    for block in blocks:
        for target in compile_targets(block, tensor_parallel=tensor_parallel):
            if getattr(target, "_compiled_call_impl", None) is not None:
                continue
            if tensor_parallel:
                compiled = _hooked_compile(mode, backend, tp_overlap, device_type)
                if tp_split == 2:
                    split = _hooked_compile(mode, backend, tp_overlap, device_type, split=True)
                    target._compiled_call_impl = functools.partial(_run_hooked_split, compiled, split, target)
                else:
                    target._compiled_call_impl = functools.partial(_run_hooked, compiled, target)
            elif backend == "inductor":
                target.compile(mode=None if mode == "default" else mode)
            else:  # another backend (e.g. "aot_eager" to isolate inductor): modes are inductor's
                target.compile(backend=backend)


def compile_head_loss(stage: nn.Module, mode: str, *, backend: str = "inductor") -> bool:
    """Compile the stage's ``lm_head_loss(x, targets)`` (the GPT's head matmul + cross-entropy), if it has one.

    Under TP the head is vocab-parallel and ``loss_parallel`` computes the cross-entropy from
    DTensor ops: eagerly a dozen full passes over the fp32 (tokens x vocab/tp) logits; compiled,
    Inductor fuses them around the two small all-reduces (row max and sum). Without TP it
    fuses the logits' cast into the loss. True if compiled (a stage without the head: False).
    """
    fn = getattr(stage, "lm_head_loss", None)
    if not callable(fn) or getattr(stage, "norm", None) is None or getattr(fn, "_lp_compiled", False):
        return False
    if backend == "inductor":
        compiled = torch.compile(fn, mode=None if mode == "default" else mode)
    else:
        compiled = torch.compile(fn, backend=backend)
    compiled._lp_compiled = True
    stage.lm_head_loss = compiled
    return True


def _enable_async_tp(tp_mesh: Any, device: torch.device) -> None:
    """Micro-pipelined TP (torch.compile + symmetric memory); CUDA only, a warning elsewhere."""
    if device.type != "cuda":
        warnings.warn("async_tensor_parallel needs CUDA (symmetric memory); running synchronous TP", stacklevel=3)
        return
    try:
        from torch._inductor import config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    except ImportError:  # pragma: no cover - torch builds without symmetric memory
        warnings.warn("this torch build has no symmetric memory: running synchronous TP", stacklevel=3)
        return
    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


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


@torch.no_grad()
def clip_grad_norm_3d(params: list[torch.Tensor], max_norm: float, pp_group: Any = None) -> torch.Tensor:
    """Clip by the global 2-norm of every gradient of every rank; returns that norm.

    Squared norms are summed locally and reduced once per group of gradients that share
    a mesh and sharded mesh dimensions (a few collectives per step, not one per
    parameter): shards add up over the dimensions they are sharded on, replicated
    pieces count once; pipeline stages hold disjoint parameters, so their squared
    norms add up over ``pp_group``.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[int, tuple[int, ...]], tuple[Any, list[torch.Tensor]]] = {}
    device = None
    for p in params:
        g = p.grad
        if g is None:
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
