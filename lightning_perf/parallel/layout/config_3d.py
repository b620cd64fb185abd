"""The layout of 3D parallelism (pp x dp x tp, with "cp" and HSDP over "dp") and its checks, before any process group exists.

:class:`Parallel3DConfig` is checked with numbers alone at construction; :func:`check_model`
and :func:`check_model_config` check a model against it before any collective. A model
states what it can do through the 3D model protocol: ``pipeline_stage`` and
``tensor_parallel_plan`` on the module, and optionally
``check_parallel_layout(tensor_parallel_size=..., pipeline_parallel_size=..., stages_per_rank=...)``
on its ``config``, which raises ``ValueError`` for a layout the model cannot be split into.
Context parallelism needs ``enable_context_parallel`` and a ``forward`` that takes ``positions=``
(see ``parallel.model_parallel.context_parallel``).

The pipeline's ``"auto"`` values (schedule, microbatches, stages per rank; the defaults) are settled by
:func:`settle_pipeline` from the model's blocks and, where known, the batch shape, with
``parallel.model_parallel.pipeline.choose_schedule``'s rules.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch.nn as nn

from lightning_perf.parallel.compute.activation_checkpointing import AC_MODES
from lightning_perf.parallel.compute.compile import COMPILE_MODES, TP_OVERLAP_MODES
from lightning_perf.parallel.layout.dims import ParallelDims, check_replicate_size, check_size, replicate_shape
from lightning_perf.parallel.model_parallel.context_parallel import check_context_parallel_mode
from lightning_perf.parallel.model_parallel.pipeline import (
    AUTO,
    INTERLEAVE_STAGES,
    MIN_MICROBATCH_TOKENS,
    PipelineChoice,
    PipelineConfig,
    check_pipeline_options,
    choose_schedule,
    settle_before_batch,
)
from lightning_perf.parallel.model_parallel.tensor_parallel import check_sequence_parallel, require_protocol
from lightning_perf.parallel.sharding.fsdp import check_blocks_per_unit, find_blocks, find_model

__all__ = ["Parallel3DConfig", "SettledPipeline", "check_model", "check_model_config", "settle_pipeline"]

# the zero-bubble schedules split each stage's backward into an input-gradient and a weight-gradient pass
SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", "zbv_zero_bubble")


@dataclass(kw_only=True)
class Parallel3DConfig:
    """Every layout option of the 3D strategy; validated at construction, with numbers only.

    ``Parallel3DStrategy`` builds it from its own constructor arguments, which carry the same names and
    defaults (see ``lightning_perf.strategies.Parallel3DStrategy`` for each option's meaning).

    ``pipeline`` is the checked :class:`PipelineConfig`, or ``None`` while a pipeline (pp > 1) still has
    ``"auto"`` values: :func:`settle_pipeline` gives a config without them.
    """

    data_parallel_size: Union[int, str] = "auto"
    replicate_size: Union[int, str] = 1  # HSDP over "dp"; "auto": see parallel.layout.dims.replicate_shape
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    context_parallel_mode: str = "allgather"
    zero_stage: int = 2
    pipeline_schedule: str = AUTO
    num_microbatches: Union[int, str, None] = AUTO
    stages_per_rank: Union[int, str] = AUTO
    min_microbatch_tokens: int = MIN_MICROBATCH_TOKENS
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
        # the schedule (with the pipeline's sizes) is checked even without pipeline parallelism, so a typo
        # never waits for a pp run; "auto" values are checked for what they can be combined with
        check_size("pipeline_parallel_size", self.pipeline_parallel_size)
        check_pipeline_options(self.pipeline_parallel_size, self.pipeline_schedule, self.num_microbatches,
                               self.stages_per_rank)
        check_size("min_microbatch_tokens", self.min_microbatch_tokens)
        stages, m = self.stages_per_rank, self.num_microbatches
        if self.pipeline_parallel_size == 1 and stages != AUTO and stages > 1:  # type: ignore[operator]
            raise ValueError(f"stages_per_rank={stages} needs pipeline_parallel_size > 1")
        self.pipeline = None
        if not self.pipeline_auto:  # nothing to settle; without a pipeline "auto" stands for the former defaults
            self.pipeline = PipelineConfig(
                pipeline_parallel_size=self.pipeline_parallel_size,
                schedule="1f1b" if self.pipeline_schedule == AUTO else self.pipeline_schedule,
                num_microbatches=None if m == AUTO else m,  # type: ignore[arg-type]
                stages_per_rank=1 if stages == AUTO else stages,  # type: ignore[arg-type]
            )
        for name in ("tensor_parallel_size", "context_parallel_size"):
            check_size(name, getattr(self, name))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r} is not one of {AC_MODES}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile={self.compile!r} is not one of {COMPILE_MODES}")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(f"compile_backend must be a torch.compile backend name, got {self.compile_backend!r}")
        check_sequence_parallel(self.sequence_parallel)
        if self.tp_overlap not in TP_OVERLAP_MODES:
            raise ValueError(f"tp_overlap={self.tp_overlap!r} is not one of {TP_OVERLAP_MODES}")
        if isinstance(self.tp_split, bool) or self.tp_split not in (1, 2):
            raise ValueError(f"tp_split must be 1 (off) or 2 (each compiled TP block runs two halves of its "
                             f"batch so one half's collectives overlap the other's compute), got {self.tp_split!r}")
        if self.fsdp_prefetch < 0:
            raise ValueError(f"fsdp_prefetch must be >= 0, got {self.fsdp_prefetch}")
        check_blocks_per_unit(self.fsdp_blocks_per_unit, "fsdp_blocks_per_unit")
        if self.fsdp_blocks_per_unit > 1 and self.zero_stage == 0:
            raise ValueError("fsdp_blocks_per_unit groups FSDP2 units over 'dp': it needs zero_stage 1-3, "
                             f"got zero_stage=0 (fsdp_blocks_per_unit={self.fsdp_blocks_per_unit})")
        if self.fp8_all_gather:
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "fp8_all_gather gathers whole FP8 weights over 'dp'; with tensor parallelism "
                    f"(tensor_parallel_size={self.tensor_parallel_size}) the weights are TP shards, which this "
                    "gather does not take: use tensor_parallel_size=1 or fp8_all_gather=False")
            if self.zero_stage == 0 or self.data_parallel_size == 1:
                raise ValueError(
                    "fp8_all_gather changes FSDP2's parameter all-gather: it needs data parallelism with ZeRO "
                    f"(zero_stage 1-3 and data_parallel_size > 1), got zero_stage={self.zero_stage}, "
                    f"data_parallel_size={self.data_parallel_size!r}")
        self._check_replicate_size()
        self._check_context_parallel()
        if (self.pipeline_parallel_size > 1 and self.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
                and self.activation_checkpointing == "selective"):
            # torch's selective checkpointing allows one backward per region; the failure came in the first step
            raise ValueError(
                f"pipeline_schedule={self.pipeline_schedule!r} runs each backward as two passes (input "
                "gradients, then weight gradients), which selective activation checkpointing does not allow: "
                "use activation_checkpointing='full' or 'none', or a schedule such as 'interleaved_1f1b'"
            )

    @property
    def pipeline_auto(self) -> bool:
        """A pipeline (pp > 1) with a schedule, microbatch count or stages per rank still ``"auto"``."""
        return self.pipeline_parallel_size > 1 and AUTO in (
            self.pipeline_schedule, self.num_microbatches, self.stages_per_rank)

    def with_pipeline(self, schedule: str, num_microbatches: Optional[int], stages_per_rank: int) -> "Parallel3DConfig":
        """This config with these pipeline values (checked again)."""
        return replace(self, pipeline_schedule=schedule, num_microbatches=num_microbatches,
                       stages_per_rank=stages_per_rank)

    def _check_replicate_size(self) -> None:
        check_replicate_size(
            self.replicate_size,
            fsdp_needs=None if self.zero_stage > 0 else "zero_stage 1-3, got zero_stage=0",
            fp8_all_gather=self.fp8_all_gather,
        )
        dp, r = self.data_parallel_size, self.replicate_size
        if isinstance(dp, int) and isinstance(r, int):  # both known: the arithmetic fails here already
            replicate_shape(dp, r, size_name="data_parallel_size", divides="the data-parallel size")

    def _check_context_parallel(self) -> None:
        check_context_parallel_mode(self.context_parallel_mode)  # a typo fails even without cp
        cp = self.context_parallel_size
        if cp == 1:
            return
        # the pipeline schedule calls the stages itself, with no global positions and no place to
        # combine the cp ranks' losses
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                f"context parallelism (context_parallel_size={cp}) does not combine with pipeline parallelism "
                f"(pipeline_parallel_size={self.pipeline_parallel_size}) yet: use one of them (each combines "
                "with data and tensor parallelism)"
            )

    def dims(self, world_size: int, num_nodes: int = 1) -> ParallelDims:
        """The layout on ``world_size`` processes over ``num_nodes`` nodes (raises with the arithmetic)."""
        return ParallelDims(
            data_parallel_size=self.data_parallel_size,  # type: ignore[arg-type]
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            context_parallel_size=self.context_parallel_size,
            world_size=world_size,
            replicate_size=self.replicate_size,  # type: ignore[arg-type]
            num_nodes=num_nodes,
        )


def check_model(model: nn.Module, config: Parallel3DConfig) -> nn.Module:
    """The protocol submodule to parallelise; raises before any collective if the layout cannot work.

    Without tensor or pipeline parallelism any model works (data parallelism needs
    nothing from it); with them, the model must implement the protocol method.
    A model whose ``config`` has ``check_parallel_layout`` is checked against the layout too.
    """
    tp, pp, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
    # the inner network (a LightningModule's ``model``), so FSDP2's root hooks fire on its forward
    target = find_model(model)
    if cp > 1:
        target = require_protocol(model, "enable_context_parallel", f"context parallelism (cp={cp})")
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
    """Ask the model's config whether it splits into this layout (``check_parallel_layout``, if it has one).

    Needs numbers only, so a strategy can call it before any process group exists
    (a LightningModule that carries its model config before ``configure_model``).
    A config without the method is left to the model's own protocol methods.
    """
    check = getattr(model_config, "check_parallel_layout", None)
    if not callable(check):
        return
    pp = config.pipeline_parallel_size
    stages = config.stages_per_rank
    check(
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=pp,
        # "auto" is at least 1 (the settled config is asked again with its own)
        stages_per_rank=stages if pp > 1 and stages != AUTO else 1,
    )


@dataclass(frozen=True)
class SettledPipeline:
    """What :func:`settle_pipeline` gives: a config whose pipeline has no ``"auto"`` left."""

    config: Parallel3DConfig  # stages per rank final; schedule and microbatches provisional unless ``final``
    choice: Optional[PipelineChoice] = None  # the choice, where the batch shape was known
    # chooses at the first batch, (batch, seq_len) -> PipelineChoice, keeping the stages; None: nothing was "auto"
    choose: Optional[Callable[[int, int], PipelineChoice]] = None
    final: bool = True  # the schedule and microbatch count are known now (else at the first batch)


def pipeline_blocks(target: Optional[nn.Module], model_config: Any, config: Parallel3DConfig) -> Optional[int]:
    """Blocks a pipeline can interleave over: the model's repeated blocks (its config's ``n_layer`` or
    ``num_hidden_layers`` before it is built), ``None`` where unknown or where the model's own
    ``check_parallel_layout`` refuses ``INTERLEAVE_STAGES`` stages per rank."""
    n: Optional[int] = len(find_blocks(target)) if target is not None else None
    if not n:
        for name in ("n_layer", "num_hidden_layers"):
            value = getattr(model_config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                n = value
                break
    check = getattr(model_config, "check_parallel_layout", None)
    if n and callable(check):
        try:
            check(tensor_parallel_size=config.tensor_parallel_size,
                  pipeline_parallel_size=config.pipeline_parallel_size, stages_per_rank=INTERLEAVE_STAGES)
        except ValueError:
            return None
    return n or None


def settle_pipeline(config: Parallel3DConfig, target: Optional[nn.Module] = None, model_config: Any = None, *,
                    batch_size: Optional[int] = None, seq_len: Optional[int] = None) -> SettledPipeline:
    """``config`` with its pipeline's ``"auto"`` values settled, from numbers every rank has.

    ``target``: the protocol module the pipeline splits (``None`` before it is built: ``model_config``
    tells its blocks). With the per-replica ``batch_size`` and ``seq_len`` everything is chosen now
    (``choose_schedule``). Without them the stages per rank are settled now (the model is split
    before the first batch: ``settle_before_batch``), and ``choose`` picks the schedule and
    microbatches at the first batch, keeping those stages. Called with the same numbers in the
    launching process (a check) and in every rank's setup, it settles alike.
    """
    if not config.pipeline_auto:
        return SettledPipeline(config)
    pp = config.pipeline_parallel_size
    n_blocks = pipeline_blocks(target, model_config if model_config is not None else getattr(target, "config", None),
                               config)
    schedule, m, s = config.pipeline_schedule, config.num_microbatches, config.stages_per_rank
    choice = None
    if batch_size is not None and seq_len is not None:
        choice = choose_schedule(pp, batch_size, seq_len, n_blocks, schedule=schedule, num_microbatches=m,
                                 stages_per_rank=s, min_microbatch_tokens=config.min_microbatch_tokens)
        with warnings.catch_warnings():  # a chosen pipeline's bubble is logged with the choice, not warned
            warnings.simplefilter("ignore")
            settled = config.with_pipeline(choice.schedule, choice.num_microbatches, choice.stages_per_rank)
    else:
        name, count, stages, _ = settle_before_batch(pp, n_blocks, schedule=schedule, num_microbatches=m,
                                                     stages_per_rank=s)
        settled = config.with_pipeline(name, count, stages)
    stages = settled.stages_per_rank

    def choose(batch: int, seq: int) -> PipelineChoice:
        # the same rules on the real batch, keeping the stages the model was split into
        return choose_schedule(pp, batch, seq, n_blocks, schedule=schedule, num_microbatches=m,
                               stages_per_rank=stages, min_microbatch_tokens=config.min_microbatch_tokens)

    # with an explicit microbatch count nothing waits for the batch
    return SettledPipeline(settled, choice, choose, final=choice is not None or m != AUTO)
