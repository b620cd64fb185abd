"""Compose pipeline, tensor, context and data parallelism on one model, in a fixed order.

    1. pipeline split   model.pipeline_stage(i, n) for this rank's stages ("auto" schedule values settled
                        first: ``parallel.layout.config_3d.settle_pipeline``)
    2. activation ckpt  per block (parameter names unchanged)
    3. tensor parallel  model.tensor_parallel_plan(tp_mesh) on every stage
    4. context parallel attention over the "cp" ranks, forward cuts the sequence
                        (``parallel.model_parallel.context_parallel``)
    5. compile          torch.compile per block (with its TP hooks under TP: see ``parallel.compute.compile``)
    6. data parallel    FSDP2 over the "dp" mesh, flattened with "cp" (ZeRO 1-3; HSDP: the 2-D
                        (dp_replicate, dp_shard) mesh), or a plain gradient all-reduce over the
                        same ranks (ZeRO 0)
    7. materialise      meta tensors -> device, the model's own init (only if built on meta)
    8. tied copies      a parameter the first and the last stage share (a tied LM head): the last
                        stage's copy made equal to the first's, gradients summed after each step
                        (``parallel.model_parallel.tied``)

Each step is a small function below; :func:`parallelize_3d` calls them in this order.
The layout and its checks are in ``parallel.layout.config_3d``, the gradient all-reduce and
clipping of the ZeRO 0 path in ``parallel.sharding.gradients``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from lightning_perf.parallel.compute.activation_checkpointing import apply_activation_checkpointing
from lightning_perf.parallel.compute.compile import compile_blocks, compile_head_loss
from lightning_perf.parallel.layout.config_3d import Parallel3DConfig, check_model, check_model_config, settle_pipeline
from lightning_perf.parallel.layout.dims import fsdp_mesh, mesh_size
from lightning_perf.parallel.model_parallel.context_parallel import apply_context_parallel
from lightning_perf.parallel.model_parallel.pipeline import (
    PipelineRunner,
    build_stage_modules,
    prune_to_stages,
)
from lightning_perf.parallel.model_parallel.tensor_parallel import (
    apply_tp,
    enable_async_tp,
    register_batch_padding,
    unfuse_linear_biases,
)
from lightning_perf.parallel.model_parallel.tied import TiedParameters, check_tied_layout, tied_parameter_names
from lightning_perf.parallel.sharding.fsdp import FSDPUnit, apply_fsdp, find_blocks, fsdp_unit_plan
from lightning_perf.parallel.sharding.init import has_meta_tensors, materialize_local
from lightning_perf.perf.run_settings import PerfSettings

__all__ = [
    "Parallelized3D",
    "parallelize_3d",
    "apply_pipeline_split",
    "apply_tensor_parallel",
    "apply_compile_3d",
    "apply_data_parallel",
]


@dataclass
class Parallelized3D:
    """The result of :func:`parallelize_3d` on one rank."""

    target: nn.Module  # the (pruned) protocol module, original parameter names
    stages: dict[int, nn.Module]  # this rank's stage modules (``{0: target}`` without pp)
    runner: Optional[PipelineRunner]  # the schedule, with pp > 1
    fsdp: bool  # FSDP2 shards over "dp"
    tied: Optional[TiedParameters] = None  # this rank's copies of parameters the first and last stage share
    fsdp_units: list[FSDPUnit] = field(default_factory=list)  # every stage's FSDP2 units, as apply_fsdp made them


def parallelize_3d(
    model: nn.Module,
    config: Parallel3DConfig,
    mesh: Any,
    *,
    device: torch.device,
    mp_policy: Optional[Any] = None,
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
    batch_shape: tuple[Optional[int], Optional[int]] = (None, None),
) -> Parallelized3D:
    """Split, shard and (if built on meta) materialise ``model`` for this rank of ``mesh``.

    ``mesh`` is the (pp, dp, cp, tp) mesh of :meth:`ParallelDims.build_mesh`. With pipeline
    parallelism ``model`` is pruned in place to this rank's stages (names unchanged). A pipeline's
    ``"auto"`` values are settled from the model and ``batch_shape`` (sequences per replica, sequence
    length; ``None`` where not known: the runner then chooses at the first batch). ``loss_fn``: a
    microbatch's loss from the last stage's output (``None``: the stage's own, ``pipeline.stage_loss``).
    """
    target = check_model(model, config)
    if config.pipeline_auto:
        settled = settle_pipeline(config, target, batch_size=batch_shape[0], seq_len=batch_shape[1])
        config = settled.config
        check_model_config(getattr(target, "config", None), config)  # with the settled stages per rank
        choose = settled.choose
    else:
        choose = None
    assert config.pipeline is not None
    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    # parameters are replicated over "cp" as over "dp": FSDP2 shards over both
    use_fsdp = mesh_size(mesh, "dp", "cp") > 1 and config.zero_stage > 0
    if config.fp8_all_gather and not use_fsdp:  # "auto" resolved to one replica (every rank alike)
        raise ValueError(f"fp8_all_gather needs data parallelism with ZeRO; this layout has dp={mesh_size(mesh, 'dp')}")
    tied_names = tied_parameter_names(target, config.pipeline.num_stages) if pp > 1 else []
    if tied_names:  # every rank alike, before any collective here
        check_tied_layout(config.pipeline, zero_sharded=use_fsdp)
    # 1. every later step works on this rank's stages (the whole model without pp)
    stages = apply_pipeline_split(target, mesh, config)
    # 2. before compile: a checkpointed block changes what compile_targets picks under TP
    for stage in stages.values():
        apply_activation_checkpointing(find_blocks(stage), config.activation_checkpointing)
    # 3. before compile, so the TP hooks are traced into each block's graph; before FSDP2, which
    #    then shards the TP DTensors over "dp"
    if tp > 1:
        apply_tensor_parallel(stages, mesh["tp"], config, device=device, whole_model=pp == 1)
    # 4. the attention hook is read inside each block's forward, so compiled blocks trace it
    if config.context_parallel_size > 1:
        apply_context_parallel(target, mesh["cp"], config.context_parallel_mode)
    # 5. a module compiled by the user's code is re-scoped first (see _compile_mode)
    mode = _compile_mode(model, stages, config)
    if mode is not None:
        apply_compile_3d(stages, mode, config, device=device)
    # 6. data parallelism over "dp" x "cp" (without FSDP2 the strategy all-reduces gradients itself);
    #    under HSDP FSDP2 gets the 2-D (replicate, shard) mesh
    units = apply_data_parallel(stages, fsdp_mesh(mesh), config, mp_policy=mp_policy) if use_fsdp else []
    # 7. after sharding: each rank allocates only its own stages and shards
    if pp > 1:
        prune_to_stages(target, stages)
    if has_meta_tensors(target):
        materialize_local(target, device)
    # 8. every rank joins the embedding groups' creation; the last stage's copy starts as the first's
    tied = TiedParameters.build(target, tied_names, mesh, config.pipeline) if tied_names else None
    if tied is not None:
        tied.broadcast_()
    runner = None
    if pp > 1:
        runner = PipelineRunner(config.pipeline, stages, mesh["pp"].get_group(), device, loss_fn=loss_fn, tied=tied,
                                choose=choose)
    return Parallelized3D(target=target, stages=stages, runner=runner, fsdp=use_fsdp, tied=tied, fsdp_units=units)


def apply_pipeline_split(target: nn.Module, mesh: Any, config: Parallel3DConfig) -> dict[int, nn.Module]:
    """This rank's pipeline stages of ``target`` (``{0: target}`` without pipeline parallelism)."""
    if config.pipeline_parallel_size == 1:
        return {0: target}
    assert config.pipeline is not None
    return build_stage_modules(target, mesh["pp"].get_local_rank(), config.pipeline)


def apply_tensor_parallel(stages: dict[int, nn.Module], tp_mesh: Any, config: Parallel3DConfig, *,
                          device: torch.device, whole_model: bool) -> None:
    """Shard every stage over ``tp_mesh`` with the model's own plan (``whole_model``: no pipeline)."""
    if config.async_tensor_parallel:
        enable_async_tp(tp_mesh, device)
    for stage in stages.values():
        # a whole model is called by user code (plain tensors out); a stage feeds the pipeline loss
        apply_tp(stage, tp_mesh, sequence_parallel=config.sequence_parallel, local_output=whole_model)
        if config.sequence_parallel == "batch" and whole_model:
            # under pp the pipeline's forward checks each microbatch instead
            register_batch_padding(stage, config.tensor_parallel_size)
        if config.async_tensor_parallel:
            # async TP fuses collectives into bias-free matmuls only
            unfuse_linear_biases(stage, tp_mesh, sequence_parallel=config.sequence_parallel)


def apply_compile_3d(stages: dict[int, nn.Module], mode: str, config: Parallel3DConfig, *,
                     device: torch.device) -> None:
    """``torch.compile`` every stage's blocks and, on the last stage, the head and loss."""
    for stage in stages.values():
        compile_blocks(find_blocks(stage), mode, backend=config.compile_backend,
                       tensor_parallel=config.tensor_parallel_size > 1, tp_overlap=config.tp_overlap,
                       device_type=device.type, tp_split=config.tp_split)
        compile_head_loss(stage, mode, backend=config.compile_backend)


def apply_data_parallel(stages: dict[int, nn.Module], dp_mesh: Any, config: Parallel3DConfig, *,
                        mp_policy: Optional[Any] = None) -> list[FSDPUnit]:
    """FSDP2 over ``dp_mesh`` (``"dp"``, or ``"dp_cp"`` with context parallelism; for HSDP the 2-D
    ("dp_replicate", "dp_shard") mesh, see ``parallel.layout.dims.fsdp_mesh``) on every stage, one unit per
    ``fsdp_blocks_per_unit`` blocks; returns every stage's units (``fsdp_unit_plan``).

    Under pipeline parallelism no unit reshards after forward, at any ZeRO stage: torch's schedules turn
    FSDP2's resharding after backward and its gradient reduction off for every microbatch of a step and
    reduce-scatter once after the last (``PipelineStage.perform_reduce_grad``), so each unit is gathered
    once per step; resharding after forward would gather it again for every microbatch's forward and
    backward. Parameters are sharded again from the end of a step to the next step's first forward.
    """
    reshard = config.zero_stage == 3 and config.pipeline_parallel_size == 1
    units: list[FSDPUnit] = []
    for stage in stages.values():
        apply_fsdp(
            stage,
            dp_mesh,
            blocks=find_blocks(stage),
            reshard_after_forward=reshard,
            mp_policy=mp_policy,
            prefetch=config.fsdp_prefetch,
            fp8_all_gather=config.fp8_all_gather,
            blocks_per_unit=config.fsdp_blocks_per_unit,
        )
        units += fsdp_unit_plan(stage, find_blocks(stage), reshard_after_forward=reshard,
                                blocks_per_unit=config.fsdp_blocks_per_unit)
    return units


def _compile_mode(model: nn.Module, stages: dict[int, nn.Module], config: Parallel3DConfig) -> Optional[str]:
    """The compile mode to apply per block; a compile the module applied itself is re-scoped where needed.

    Under TP every compiled module (whole model or blocks) moves to the TP compile scope; under PP a
    whole-model compile would never run (the schedule calls the stages) and moves to the blocks.
    """
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp == 1 and pp == 1:
        return config.compile  # blocks or the model compiled by the module stay as they are
    blocks = {id(b) for b in find_blocks(model)} | {id(b) for s in stages.values() for b in find_blocks(s)}
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
    return config.compile or _stated_compile_mode(model) or "default"


def _stated_compile_mode(model: nn.Module) -> Optional[str]:
    """The compile mode the module says it applies (its ``perf_settings()``, see ``perf.run_settings``), if any."""
    stated = getattr(model, "perf_settings", None)
    settings = stated() if callable(stated) else None
    return settings.compile_mode if isinstance(settings, PerfSettings) else None
