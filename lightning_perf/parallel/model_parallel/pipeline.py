"""Pipeline parallelism with ``torch.distributed.pipelining``.

:class:`PipelineConfig` validates a schedule with numbers only (no process group);
:func:`stage_indices` places stages on ranks; :func:`build_stage_modules` asks the
model for its stages (the ``pipeline_stage(i, n)`` protocol method) and
:func:`prune_to_stages` strips the original model down to what this rank runs, so
its ``state_dict()`` keeps the original names. :class:`PipelineRunner` wraps the
schedule: one call runs forward and backward over all microbatches and returns the
batch loss on every pipeline rank.

Placement: with ``s`` stages per rank and ``p`` ranks there are ``S = p * s`` stages.
"loop" placement gives rank ``r`` stages ``r, r + p, r + 2p, ...`` (GPipe, 1F1B and
the interleaved schedules); "v" placement gives rank ``r`` stages ``r`` and ``2p-1-r``
(the V-shaped zero-bubble schedule), so the first and the last stage share rank 0.

Bubble: with ``m`` microbatches a 1F1B/GPipe step idles ``(p-1)/(m+p-1)`` of the time;
interleaving ``s`` stages per rank divides the bubble by about ``s``.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lightning_perf.parallel.layout.dims import check_size

__all__ = [
    "SCHEDULES",
    "PipelineConfig",
    "PipelineRunner",
    "TiedGradients",
    "stage_indices",
    "build_stage_modules",
    "prune_to_stages",
    "lm_cross_entropy",
    "bubble_fraction",
]

# name -> (torch class name, placement, stages per rank: None = any, else exactly this)
SCHEDULES: dict[str, tuple[str, str, Optional[int]]] = {
    "gpipe": ("ScheduleGPipe", "single", 1),
    "1f1b": ("Schedule1F1B", "single", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop", None),
    "looped_bfs": ("ScheduleLoopedBFS", "loop", None),
    # InterleavedZeroBubble: loop placement; runs with gloo on every torch we support
    "zero_bubble": ("ScheduleInterleavedZeroBubble", "loop", None),
    # the V-shaped variant: NCCL only on torch 2.11 (its gloo path self-sends)
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "v", 2),
}


def bubble_fraction(pp: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a pipeline step in theory: ``(p-1) / (s*m + p-1)`` (s=1: GPipe/1F1B)."""
    return (pp - 1) / (stages_per_rank * num_microbatches + pp - 1)


@dataclass(kw_only=True)
class PipelineConfig:
    """A pipeline schedule, checked with numbers only.

    Args:
        pipeline_parallel_size: pipeline-parallel ranks.
        schedule: one of :data:`SCHEDULES`.
        num_microbatches: microbatches per step (``None``: the number of stages, at least ``pp``).
        stages_per_rank: model stages each rank runs (interleaved schedules use more than one).
    """

    pipeline_parallel_size: int
    schedule: str = "1f1b"
    num_microbatches: Optional[int] = None
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline_schedule {self.schedule!r}; choose one of {sorted(SCHEDULES)}")
        for name in ("pipeline_parallel_size", "stages_per_rank"):
            check_size(name, getattr(self, name))
        pp = self.pipeline_parallel_size
        _, placement, fixed = SCHEDULES[self.schedule]
        if fixed is not None and self.stages_per_rank != fixed:
            raise ValueError(
                f"pipeline_schedule={self.schedule!r} runs exactly {fixed} stage(s) per rank, got "
                f"stages_per_rank={self.stages_per_rank}"
                + ("; use 'interleaved_1f1b' or 'zero_bubble' for several" if fixed == 1 else "")
            )
        if self.num_microbatches is None:
            self.num_microbatches = max(pp, self.num_stages)
        m = self.num_microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"num_microbatches must be a positive integer, got {m!r}")
        if pp > 1 and m < pp and self.schedule != "gpipe":
            raise ValueError(
                f"pipeline_schedule={self.schedule!r} needs num_microbatches >= pp: {m} < {pp} "
                f"(each of the {pp} ranks must have a microbatch in flight)"
            )
        if placement != "single" and pp > 1:
            rounds = max(1, m // pp)
            if m % rounds:
                raise ValueError(
                    f"pipeline_schedule={self.schedule!r} runs microbatches in rounds of pp={pp}: "
                    f"num_microbatches {m} is not a multiple of {rounds} rounds (m // pp = {m} // {pp})"
                )
        if pp > 1 and m < self.num_stages:
            warnings.warn(
                f"num_microbatches ({m}) < total pipeline stages (pp {pp} * stages_per_rank "
                f"{self.stages_per_rank} = {self.num_stages}): the bubble is "
                f"{bubble_fraction(pp, m, self.stages_per_rank):.0%} of the step",
                stacklevel=2,
            )

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def placement(self) -> str:
        return SCHEDULES[self.schedule][1]

    def check_batch(self, batch_size: int) -> None:
        m = self.num_microbatches
        assert m is not None
        if batch_size % m:
            raise ValueError(
                f"batch size {batch_size} is not divisible by num_microbatches {m} "
                f"({batch_size} / {m} = {batch_size / m:.3g}); use a per-rank batch size that is a multiple of {m} "
                f"(and drop_last=True so the last batch is full)"
            )

    def last_stage_rank(self) -> int:
        """The pipeline rank that holds the last stage."""
        return stage_owner(self.num_stages - 1, self.pipeline_parallel_size, self.placement)


def stage_indices(pp_rank: int, pp: int, stages_per_rank: int, placement: str) -> list[int]:
    """Global stage indices run by ``pp_rank``, in increasing order."""
    if placement == "v":
        if stages_per_rank != 2:
            raise ValueError(f"V placement needs 2 stages per rank, got {stages_per_rank}")
        return sorted((pp_rank, 2 * pp - 1 - pp_rank))
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_owner(stage: int, pp: int, placement: str) -> int:
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def build_stage_modules(model: nn.Module, pp_rank: int, config: PipelineConfig) -> dict[int, nn.Module]:
    """``{stage_index: model.pipeline_stage(stage_index, num_stages)}`` for this rank's stages."""
    ids = stage_indices(pp_rank, config.pipeline_parallel_size, config.stages_per_rank, config.placement)
    return {i: model.pipeline_stage(i, config.num_stages) for i in ids}  # type: ignore[operator]


def prune_to_stages(root: nn.Module, stage_modules: dict[int, nn.Module]) -> nn.Module:
    """Drop from ``root`` every submodule whose parameters no local stage uses (in place).

    What remains keeps its original names, so ``root.state_dict()`` holds exactly this
    rank's parameters under the names a single-process checkpoint uses.
    """
    keep = {id(p) for m in stage_modules.values() for p in m.parameters()}

    def visit(module: nn.Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            params = [id(p) for p in child.parameters()]
            if params and not any(p in keep for p in params):
                if isinstance(module, nn.ModuleDict):
                    del module[name]
                else:
                    module._modules[name] = None
            else:
                visit(child)

    visit(root)
    return root


def lm_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T), in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class TiedGradients(Protocol):
    """What the runner needs of parameters two stages share (``parallel.model_parallel.tied.TiedParameters``): their
    gradients set aside before a training step's backward, and summed over both stages after it."""

    def hold_grads(self) -> list[Optional[torch.Tensor]]: ...

    def reduce_grads_(self, held: list[Optional[torch.Tensor]]) -> None: ...


class PipelineRunner:
    """Runs one schedule over this rank's stages.

    Args:
        config: the validated schedule.
        stage_modules: ``{stage_index: module}`` for this rank (from :func:`build_stage_modules`).
        pp_group: the pipeline process group (``mesh["pp"].get_group()``).
        device: where activations live.
        loss_fn: ``(last stage output, targets) -> mean loss`` of one microbatch.
        tied: the copies of parameters the first and the last stage share (``parallel.model_parallel.tied``): their
            gradients are summed over the embedding group after each training step's backward.
    """

    def __init__(
        self,
        config: PipelineConfig,
        stage_modules: dict[int, nn.Module],
        pp_group: Any,
        device: torch.device,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = lm_cross_entropy,
        tied: Optional[TiedGradients] = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        self.config = config
        self.loss_fn = loss_fn
        self.tied = tied
        self.pp_group = pp_group
        self.device = device
        n = config.num_stages
        self.stages = [
            PipelineStage(mod, idx, n, device, group=pp_group) for idx, mod in sorted(stage_modules.items())
        ]
        self.has_first = any(idx == 0 for idx in stage_modules)
        self.has_last = any(idx == n - 1 for idx in stage_modules)
        self.last_global_rank = dist.get_global_rank(pp_group, config.last_stage_rank())
        cls_name, placement, _ = SCHEDULES[config.schedule]
        cls = getattr(schedules, cls_name)
        kwargs: dict[str, Any] = {"n_microbatches": config.num_microbatches, "loss_fn": self._loss}
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            kwargs["scale_grads"] = False  # the loss is scaled here, identically on every torch version
        self.schedule = cls(self.stages[0] if placement == "single" else self.stages, **kwargs)
        self._factor = 1.0
        self._scale: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self._raw: list[torch.Tensor] = []

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        raw = self.loss_fn(output, target)
        self._raw.append(_local(raw.detach()).float())
        return self._scale(raw * self._factor)

    def _batch_loss(self) -> torch.Tensor:
        if self.has_last:
            # the first step may also call the loss on a shape-inference dry run: keep the real m
            loss = torch.stack(self._raw[-(self.config.num_microbatches or 1) :]).mean().to(self.device)
        else:
            loss = torch.zeros((), device=self.device, dtype=torch.float32)
        self._raw = []
        dist.broadcast(loss, src=self.last_global_rank, group=self.pp_group)
        return loss

    def _run(self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.config.check_batch(inputs.shape[0])
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": targets if self.has_last else None}
        if "return_outputs" in inspect.signature(run).parameters:
            # only the loss is needed: by default the last stage keeps every microbatch's logits
            # (B/m, T, V) until the step ends and concatenates them (GBs at a 50k vocabulary)
            kwargs["return_outputs"] = False
        run(*args, **kwargs)

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        loss_factor: float = 1.0,
        scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Forward and backward over all microbatches; gradients accumulate into ``.grad``.

        Each microbatch's loss is multiplied by ``loss_factor / num_microbatches`` (so the
        gradients are those of the batch mean times ``loss_factor``) and then passed through
        ``scale_loss`` (fp16 loss scaling). Tied copies (``tied``) get the sum of both stages'
        gradients. Returns the unscaled batch-mean loss (detached) on every pipeline rank.
        """
        self._raw = []
        self._factor = loss_factor / float(self.config.num_microbatches or 1)
        self._scale = scale_loss or (lambda t: t)
        held = self.tied.hold_grads() if self.tied is not None else []
        try:
            self._run(self.schedule.step, inputs, targets)
        finally:
            self._scale = lambda t: t
        if self.tied is not None:
            # the copies of a tied parameter: this step's gradients summed, so both take one update
            self.tied.reduce_grads_(held)
        return self._batch_loss()

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only over all microbatches; the batch-mean loss on every pipeline rank."""
        self._raw = []
        self._factor = 1.0
        if hasattr(self.schedule, "eval"):
            self._run(self.schedule.eval, inputs, targets)
        else:  # older torch: no eval(); a step without backward
            has_backward = self.schedule._has_backward
            self.schedule._has_backward = False
            try:
                self._run(self.schedule.step, inputs, targets)
            finally:
                self.schedule._has_backward = has_backward
        return self._batch_loss()
