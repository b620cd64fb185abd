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

Choosing: :func:`choose_schedule` picks the schedule, the microbatches and the stages per rank from
numbers alone (pipeline size, batch shape, blocks); it is what ``"auto"`` means in
``Parallel3DConfig`` (see its docstring for each rule and why).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from lightning_perf.parallel.layout.dims import check_size
from lightning_perf.parallel.sharding.fsdp import is_fsdp_module

__all__ = [
    "SCHEDULES",
    "AUTO",
    "MIN_MICROBATCH_TOKENS",
    "PipelineConfig",
    "PipelineChoice",
    "choose_schedule",
    "settle_before_batch",
    "check_pipeline_options",
    "PipelineRunner",
    "ReducibleStage",
    "TiedGradients",
    "stage_indices",
    "build_stage_modules",
    "prune_to_stages",
    "lm_cross_entropy",
    "stage_loss",
    "bubble_fraction",
    "check_schedule_backend",
    "zbv_runs_on_gloo",
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


log = logging.getLogger(__name__)

#: the value of ``pipeline_schedule``, ``num_microbatches`` and ``stages_per_rank`` that asks :func:`choose_schedule`
AUTO = "auto"

#: The smallest microbatch (in tokens: sequences x sequence length) that ``num_microbatches="auto"`` cuts a
#: batch into. Measured on two H200 with gpt-1.3b (T=2048, 16 sequences per replica, pp2, eager): 1F1B with
#: 4 microbatches of 8192 tokens ran at 0.70x dp2's throughput and with 8 microbatches of 4096 tokens at
#: 0.69x, although its theoretical bubble fell from 20% to 11%: the extra microbatches' own cost ate the
#: smaller bubble.
MIN_MICROBATCH_TOKENS = 8192

#: stages per rank of an interleaved schedule chosen by "auto": the fewest that interleave (bubble halved)
INTERLEAVE_STAGES = 2

#: the schedules "auto" considers, in the order that breaks a tie of equal bubbles
AUTO_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


def zbv_runs_on_gloo() -> bool:
    """Whether this torch runs the V-shaped zero-bubble schedule on gloo: before 2.13 it sends to its own rank."""
    from torch.torch_version import TorchVersion

    return TorchVersion(str(torch.__version__)) >= (2, 13)


def check_schedule_backend(schedule: str, pipeline_parallel_size: int, backend: str) -> None:
    """Raise before any process group where torch's schedule cannot run on this backend
    (:func:`zbv_runs_on_gloo`)."""
    if pipeline_parallel_size <= 1 or schedule != "zbv_zero_bubble" or "gloo" not in backend.split(":")[-1]:
        return
    if not zbv_runs_on_gloo():
        raise ValueError(
            f"pipeline_schedule='zbv_zero_bubble' needs NCCL on torch {torch.__version__} (its gloo path sends to "
            f"the rank itself, which gloo refuses; torch 2.13 runs it): use a GPU, or 'zero_bubble' / "
            "'interleaved_1f1b' on CPU")


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


def _config_or_error(pp: int, schedule: str, m: Optional[int], s: int) -> Union[PipelineConfig, str]:
    """``PipelineConfig(...)`` of these numbers, or the reason it refuses them (its bubble warning silenced)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return PipelineConfig(pipeline_parallel_size=pp, schedule=schedule, num_microbatches=m, stages_per_rank=s)
    except ValueError as e:
        return str(e)


def _stage_options(pp: int, schedule: str, stages_per_rank: Union[int, str], n_blocks: Optional[int],
                   auto_schedule: bool) -> list[int]:
    """The stages per rank ``schedule`` may run here (``[]``: none)."""
    fixed = SCHEDULES[schedule][2]
    if stages_per_rank != AUTO:
        s = int(stages_per_rank)
        if fixed is not None and s != fixed:
            return []
        if auto_schedule and fixed is None and s == 1:
            return []  # an interleaving schedule on one stage per rank is 1F1B with more bookkeeping
        return [s]
    if fixed is not None:
        return [fixed]
    if n_blocks is not None and n_blocks % (pp * INTERLEAVE_STAGES) == 0:
        return [INTERLEAVE_STAGES]
    return [] if auto_schedule else [1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choose(pp: int, batch_size: Optional[int], seq_len: Optional[int], n_blocks: Optional[int], *,
            schedule: str, num_microbatches: Union[int, str, None], stages_per_rank: Union[int, str],
            min_microbatch_tokens: int) -> tuple[str, int, int]:
    """``(schedule, num_microbatches, stages_per_rank)``; see :func:`choose_schedule`.

    ``batch_size`` may be ``None`` only with an explicit ``num_microbatches``: then nothing else depends on it.
    """
    auto_schedule = schedule == AUTO
    names = AUTO_SCHEDULES if auto_schedule else (schedule,)
    best: Optional[tuple[tuple[bool, float, int], str, int, int]] = None
    reasons: list[str] = []
    for order, name in enumerate(names):
        for s in _stage_options(pp, name, stages_per_rank, n_blocks, auto_schedule):
            if num_microbatches != AUTO:
                m = num_microbatches if num_microbatches is not None else max(pp, pp * s)
                checked = _config_or_error(pp, name, m, s)
                if isinstance(checked, str):
                    reasons.append(checked)
                    continue
                if batch_size is not None and batch_size % m:
                    reasons.append(
                        f"batch size {batch_size} is not divisible by num_microbatches {m} ({batch_size} / {m} = "
                        f"{batch_size / m:.3g}); use a per-rank batch size that is a multiple of {m}")
                    continue
                meets = True
            else:
                assert batch_size is not None and seq_len is not None
                # at least pp microbatches where the batch has them: with fewer the bubble is at least half
                # the step, more than any per-microbatch cost measured here
                least = min(pp, batch_size)
                valid = [m for m in _divisors(batch_size)
                         if m >= least and not isinstance(_config_or_error(pp, name, m, s), str)]
                if not valid:
                    reasons.append(
                        f"pipeline_schedule={name!r} with {s} stage(s) per rank needs at least pp={pp} microbatches "
                        f"(and, interleaved, whole rounds of pp), which a batch of {batch_size} sequence(s) per "
                        "replica cannot give: use a larger batch, or pipeline_schedule='auto' / 'gpipe'")
                    continue
                floor = [m for m in valid if (batch_size // m) * seq_len >= min_microbatch_tokens]
                m, meets = (max(floor), True) if floor else (min(valid), False)
            key = (not meets, bubble_fraction(pp, m, s), order)
            if best is None or key < best[0]:
                best = (key, name, m, s)
    if best is None:
        if not reasons:  # no stage count the schedule runs: the explicit values disagree
            fixed = SCHEDULES[names[0]][2] if not auto_schedule else None
            reasons.append(f"pipeline_schedule={schedule!r} runs exactly {fixed} stage(s) per rank, got "
                           f"stages_per_rank={stages_per_rank}" if fixed is not None else
                           f"no pipeline schedule runs stages_per_rank={stages_per_rank} with pp={pp}")
        raise ValueError(reasons[0])
    return best[1], best[2], best[3]


@dataclass(frozen=True)
class PipelineChoice:
    """The schedule a pipeline runs, and the batch it was chosen for (see :func:`choose_schedule`)."""

    schedule: str
    num_microbatches: int
    stages_per_rank: int
    pipeline_parallel_size: int
    batch_size: int  # sequences per data-parallel replica
    seq_len: int
    auto: bool = True  # chosen by "auto" (False: every value as set)

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.num_microbatches

    @property
    def microbatch_tokens(self) -> int:
        return self.microbatch_size * self.seq_len

    @property
    def bubble(self) -> float:
        """The theoretical idle fraction of a step, :func:`bubble_fraction`."""
        return bubble_fraction(self.pipeline_parallel_size, self.num_microbatches, self.stages_per_rank)

    def config(self) -> PipelineConfig:
        """The :class:`PipelineConfig` of this choice (a chosen one without the few-microbatches warning:
        the choice's log line states the bubble)."""
        with warnings.catch_warnings():
            if self.auto:
                warnings.simplefilter("ignore")
            return PipelineConfig(pipeline_parallel_size=self.pipeline_parallel_size, schedule=self.schedule,
                                  num_microbatches=self.num_microbatches, stages_per_rank=self.stages_per_rank)

    def describe(self) -> str:
        """``pipeline: interleaved_1f1b, 2 stages per rank, 4 microbatches of 4 sequences (8192 tokens); ...``"""
        s, m, b = self.stages_per_rank, self.num_microbatches, self.microbatch_size
        return (f"pipeline{'' if self.auto else ' (as set)'}: {self.schedule}, {s} stage{'s' if s > 1 else ''} per "
                f"rank, {m} microbatch{'es' if m > 1 else ''} of {b} sequence{'s' if b > 1 else ''} "
                f"({self.microbatch_tokens} tokens); theoretical bubble {self.bubble:.0%}"
                + (" by the 1F1B formula (the split backward fills part of it)"
                   if self.schedule in ("zero_bubble", "zbv_zero_bubble") else ""))

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers, for a benchmark's record."""
        return {"schedule": self.schedule, "num_microbatches": self.num_microbatches,
                "stages_per_rank": self.stages_per_rank, "pipeline_parallel_size": self.pipeline_parallel_size,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "microbatch_tokens": self.microbatch_tokens,
                "bubble_theory": self.bubble, "auto": self.auto}


def choose_schedule(
    pp: int,
    batch_size: int,
    seq_len: int,
    n_blocks: Optional[int],
    *,
    schedule: str = AUTO,
    num_microbatches: Union[int, str, None] = AUTO,
    stages_per_rank: Union[int, str] = AUTO,
    min_microbatch_tokens: int = MIN_MICROBATCH_TOKENS,
) -> PipelineChoice:
    """The pipeline schedule, microbatches and stages per rank for batches of ``batch_size`` x ``seq_len``.

    A pure function of numbers every rank has, so every rank chooses alike. Values other than ``"auto"``
    are kept (``num_microbatches=None``: one per stage, at least pp, as :class:`PipelineConfig`); the
    rules fill in the rest:

    1. Microbatches: the most that divide the batch while each keeps at least ``min_microbatch_tokens``
       tokens (:data:`MIN_MICROBATCH_TOKENS`, measured: smaller microbatches cost more per microbatch
       than their smaller bubble saves). But at least ``pp`` of them where the batch has ``pp``
       sequences, even below that floor: with fewer than ``p`` the bubble ``(p-1)/(m+p-1)`` is at
       least half the step, far more than the per-microbatch cost measured (halving 8192-token
       microbatches cost about the 9 points of bubble it saved). Interleaved schedules also need
       whole rounds of ``pp`` (:class:`PipelineConfig`'s check); each schedule gets the most
       microbatches it accepts under these rules.
    2. Schedule: of 1F1B, GPipe and interleaved 1F1B, the one with the smallest theoretical bubble
       :func:`bubble_fraction`, preferring one whose microbatches keep the floor; at equal bubbles
       1F1B (it holds at most ``pp`` microbatches' activations, GPipe all of them), then GPipe,
       then interleaved. So GPipe runs only when the batch has fewer than ``pp`` sequences (1F1B
       needs ``pp`` microbatches), and interleaved 1F1B wins wherever it can run: at the same
       microbatch size it halves the bubble (measured, gpt-1.3b pp2 m=4 eager: 0.72x dp2 against
       1F1B's 0.70x).
    3. Stages per rank: interleaving runs ``INTERLEAVE_STAGES = 2`` per rank, the fewest that halve
       the bubble, where ``n_blocks`` fill ``pp * 2`` stages (``None``: the model cannot tell or
       refuses, so no interleaving). More stages per rank shrink the bubble further but add a
       send/recv and a stage call per microbatch each, unmeasured here.

    Not chosen by default: ``looped_bfs`` (GPipe's memory: every microbatch's activations at once)
    and the zero-bubble schedules. ``zero_bubble`` / ``zbv_zero_bubble`` split each backward into an
    input-gradient and a weight-gradient pass, which keeps more activations and gradients alive,
    refuses selective activation checkpointing, and (V placement) cannot shard a tied head under
    ZeRO; no GPU measurement of them exists here, so they stay an explicit choice. Since "auto"
    picks only single- or loop-placed schedules, a tied embedding and head (held by the first and
    the last stage's ranks) never constrains it.

    Raises ``ValueError`` (with the numbers) when the explicit values cannot run this batch.
    """
    check_pipeline_options(pp, schedule, num_microbatches, stages_per_rank)
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("min_microbatch_tokens",
                                                                           min_microbatch_tokens)):
        check_size(name, value)
    name, m, s = _choose(pp, batch_size, seq_len, n_blocks, schedule=schedule, num_microbatches=num_microbatches,
                         stages_per_rank=stages_per_rank, min_microbatch_tokens=min_microbatch_tokens)
    auto = AUTO in (schedule, num_microbatches, stages_per_rank)
    return PipelineChoice(schedule=name, num_microbatches=m, stages_per_rank=s, pipeline_parallel_size=pp,
                          batch_size=batch_size, seq_len=seq_len, auto=auto)


def settle_before_batch(pp: int, n_blocks: Optional[int], *, schedule: str = AUTO,
                        num_microbatches: Union[int, str, None] = AUTO,
                        stages_per_rank: Union[int, str] = AUTO) -> tuple[str, Optional[int], int, bool]:
    """``(schedule, num_microbatches, stages_per_rank, final)`` before the batch shape is known.

    The model is split before the first batch, so the stages per rank must be settled without it.
    With an explicit ``num_microbatches`` nothing depends on the batch (beyond dividing it): all three
    are :func:`choose_schedule`'s, ``final`` is True. Otherwise the stages per rank are the explicit
    value, or 2 for an explicit interleaving schedule where the blocks fill ``pp * 2`` stages, else 1,
    and the schedule (provisional: ``"gpipe"`` or ``"interleaved_1f1b"`` for "auto") and the
    microbatches (``None``) are chosen at the first batch with those stages. So "auto" interleaves by
    default only where the batch shape is known before the split (a data module with ``batch_size``
    and ``seq_len``), or with an explicit ``stages_per_rank``.
    """
    if num_microbatches != AUTO:
        name, m, s = _choose(pp, None, None, n_blocks, schedule=schedule, num_microbatches=num_microbatches,
                             stages_per_rank=stages_per_rank, min_microbatch_tokens=MIN_MICROBATCH_TOKENS)
        return name, m, s, True
    if stages_per_rank != AUTO:
        s = int(stages_per_rank)
    elif schedule != AUTO:
        s = _stage_options(pp, schedule, AUTO, n_blocks, auto_schedule=False)[0]
    else:
        s = 1
    if schedule == AUTO:
        schedule = "gpipe" if s == 1 else "interleaved_1f1b"
    return schedule, None, s, False


def check_pipeline_options(pp: int, schedule: str, num_microbatches: Union[int, str, None],
                           stages_per_rank: Union[int, str]) -> None:
    """Raise for pipeline options that no batch and no model can run, before anything is built.

    ``"auto"`` is allowed for each; explicit values must be valid alone and together.
    """
    if schedule != AUTO and schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline_schedule {schedule!r}; choose 'auto' or one of {sorted(SCHEDULES)}")
    if stages_per_rank != AUTO:
        check_size("stages_per_rank", stages_per_rank)
    m = num_microbatches
    if m != AUTO and m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"num_microbatches must be 'auto', None or a positive integer, got {m!r}")
    if pp == 1:
        return
    if m == AUTO:
        if schedule != AUTO and stages_per_rank != AUTO:
            checked = _config_or_error(pp, schedule, None, int(stages_per_rank))  # the schedule's stage count
            if isinstance(checked, str):
                raise ValueError(checked)
        return
    # an explicit count: some schedule must take it, on any number of blocks
    _choose(pp, None, None, pp * INTERLEAVE_STAGES, schedule=schedule, num_microbatches=m,
            stages_per_rank=stages_per_rank, min_microbatch_tokens=MIN_MICROBATCH_TOKENS)


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


def stage_loss(last_stage: Optional[nn.Module]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss of one microbatch from the last stage's output: the stage's ``pipeline_loss`` (the protocol's
    optional hook: the stage computes its loss itself, e.g. head and cross-entropy in one compiled region),
    else :func:`lm_cross_entropy` of the logits it returns. ``None`` (a rank without the last stage, which
    never computes a loss): :func:`lm_cross_entropy`."""
    own = getattr(last_stage, "pipeline_loss", None)
    return own if callable(own) else lm_cross_entropy


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _log_on_rank_zero(message: str) -> None:
    if dist.get_rank() == 0:
        log.info(message)


class ReducibleStage(PipelineStage):
    """A pipeline stage whose gradient reduction after a schedule's step can be left to a later step.

    Over one step torch's schedules keep an FSDP2-sharded stage gathered and its gradients unreduced for every
    microbatch, then reduce-scatter once and reshard (``perform_reduce_grad``). With :attr:`reduce_grads` off
    (a non-final micro-batch of gradient accumulation) the step ends resharded but with the gradients still
    unsharded inside FSDP2, so the next step adds to them and the step that reduces reduce-scatters them all
    once. A stage without FSDP2 is unaffected. The runner's schedules never scale gradients (the loss is
    scaled), so there is nothing else to leave out.
    """

    reduce_grads: bool = True

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.reduce_grads:
            super().perform_reduce_grad(grad_scale_factor)
            return
        for module in self.submod.modules():
            if is_fsdp_module(module):
                module.reshard()


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
        loss_fn: ``(last stage output, targets) -> mean loss`` of one microbatch; ``None``: the last stage
            module's own ``pipeline_loss`` where it has one (the pack's GPT: its head and cross-entropy on the
            final norm's output, compiled or fused with the stage's ``lm_head_loss``), else
            :func:`lm_cross_entropy` of its logits.
        tied: the copies of parameters the first and the last stage share (``parallel.model_parallel.tied``): their
            gradients are summed over the embedding group after each training step's backward.
        choose: ``(batch_size, seq_len) -> PipelineChoice``, called at the first batch where the schedule and the
            microbatches are chosen then (``"auto"``); ``config`` is then provisional, its stages and placement
            final. Without it the schedule is ``config``'s, built here.

    The first batch fixes the batch shape: the stages' send/recv buffers are sized for its microbatches, so a
    training batch of another shape later (a shorter last batch) is refused with a ``ValueError`` on every
    pipeline rank, before any send/recv; an evaluation batch of another shape runs through a forward-only
    schedule of its own (:meth:`eval_step`). :attr:`choice` holds what runs (``None`` before the first batch); its line
    (:meth:`PipelineChoice.describe`) goes to :attr:`announce`, by default this module's logger at INFO on
    global rank 0.
    """

    def __init__(
        self,
        config: PipelineConfig,
        stage_modules: dict[int, nn.Module],
        pp_group: Any,
        device: torch.device,
        loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
        tied: Optional[TiedGradients] = None,
        choose: Optional[Callable[[int, int], PipelineChoice]] = None,
    ) -> None:
        self.config = config
        self.loss_fn = loss_fn or stage_loss(stage_modules.get(config.num_stages - 1))
        self.tied = tied
        self.pp_group = pp_group
        self.device = device
        n = config.num_stages
        self.stages = [
            ReducibleStage(mod, idx, n, device, group=pp_group) for idx, mod in sorted(stage_modules.items())
        ]
        # FSDP2 keeps these stages' gradients itself until a step reduces them (ReducibleStage)
        self.sharded = any(is_fsdp_module(mod) for mod in stage_modules.values())
        self.has_first = any(idx == 0 for idx in stage_modules)
        self.has_last = any(idx == n - 1 for idx in stage_modules)
        self.last_global_rank = dist.get_global_rank(pp_group, config.last_stage_rank())
        self._choose = choose
        self.announce: Callable[[str], None] = _log_on_rank_zero
        self.choice: Optional[PipelineChoice] = None
        self._shape: Optional[tuple[int, int]] = None
        self._eval_schedules: dict[tuple[int, int], tuple[Any, int]] = {}
        self.schedule: Any = None if choose is not None else self._build_schedule(config)
        self._factor = 1.0
        self._scale: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self._raw: list[torch.Tensor] = []

    def _build_schedule(self, config: PipelineConfig) -> Any:
        from torch.distributed.pipelining import schedules

        cls_name, placement, _ = SCHEDULES[config.schedule]
        cls = getattr(schedules, cls_name)
        kwargs: dict[str, Any] = {"n_microbatches": config.num_microbatches, "loss_fn": self._loss}
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            kwargs["scale_grads"] = False  # the loss is scaled here, identically on every torch version
        return cls(self.stages[0] if placement == "single" else self.stages, **kwargs)

    def prepare(self, batch_size: int, seq_len: int) -> PipelineConfig:
        """The schedule for batches of this shape: chosen (and logged) at the first batch, checked after.

        Raises ``ValueError`` for a batch the microbatches do not divide and for a batch shape other than
        the first batch's; every pipeline rank sees the same batch, so all raise alike, before any send/recv.
        """
        shape = (int(batch_size), int(seq_len))
        if self._shape is not None:
            if shape != self._shape:
                b, t = self._shape
                raise ValueError(
                    f"a batch of {shape[0]} sequences x {shape[1]} tokens after batches of {b} x {t}: the pipeline's "
                    f"stages were set up for microbatches of the first batch's shape ({self.config.num_microbatches} "
                    f"microbatches of {b // (self.config.num_microbatches or 1)} x {t}) and cannot take another; use "
                    "one batch shape for training and validation (drop_last=True, so the last batch is full)"
                )
            return self.config
        if self._choose is not None:
            choice = self._choose(*shape)
            config = choice.config()
            if (config.num_stages, config.placement) != (self.config.num_stages, self.config.placement):
                raise RuntimeError(f"the pipeline chosen at the first batch ({config}) does not run the stages "
                                   f"built at setup ({self.config})")
            self.config = config
            self.schedule = self._build_schedule(config)
            self._choose = None
        else:
            assert self.config.num_microbatches is not None
            choice = PipelineChoice(schedule=self.config.schedule, num_microbatches=self.config.num_microbatches,
                                    stages_per_rank=self.config.stages_per_rank,
                                    pipeline_parallel_size=self.config.pipeline_parallel_size,
                                    batch_size=shape[0], seq_len=shape[1], auto=False)
        self.config.check_batch(shape[0])
        self.choice, self._shape = choice, shape
        self.announce(choice.describe())
        return self.config

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        raw = self.loss_fn(output, target)
        self._raw.append(_local(raw.detach()).float())
        return self._scale(raw * self._factor)

    def _batch_loss(self, num_microbatches: Optional[int] = None) -> torch.Tensor:
        if self.has_last:
            # the first step may also call the loss on a shape-inference dry run: keep the real m
            m = num_microbatches or self.config.num_microbatches or 1
            loss = torch.stack(self._raw[-m:]).mean().to(self.device)
        else:
            loss = torch.zeros((), device=self.device, dtype=torch.float32)
        self._raw = []
        dist.broadcast(loss, src=self.last_global_rank, group=self.pp_group)
        return loss

    def _run(self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor) -> None:
        # contiguous: torch 2.11's first stage checks each microbatch's strides against the first one's copy on
        # the meta device, which is contiguous where the batch is a strided slice (x[:, :T])
        args = (inputs.contiguous(),) if self.has_first else ()
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
        reduce_grads: bool = True,
    ) -> torch.Tensor:
        """Forward and backward over all microbatches; gradients accumulate into ``.grad``.

        Each microbatch's loss is multiplied by ``loss_factor / num_microbatches`` (so the
        gradients are those of the batch mean times ``loss_factor``) and then passed through
        ``scale_loss`` (fp16 loss scaling). Tied copies (``tied``) get the sum of both stages'
        gradients. Returns the unscaled batch-mean loss (detached) on every pipeline rank.

        ``reduce_grads=False``, for a non-final micro-batch of gradient accumulation: stages sharded by FSDP2
        keep this step's gradients unsharded and unreduced inside FSDP2 (:class:`ReducibleStage`), their
        parameters resharded; the next call adds to them and the first call with ``reduce_grads=True``
        reduce-scatters them all at once (and sums the tied copies then). Stages without FSDP2 leave their
        gradients in ``.grad`` either way (reducing them over data parallelism is the caller's).
        """
        self.prepare(inputs.shape[0], inputs.shape[-1])  # before any send/recv
        self._raw = []
        self._factor = loss_factor / float(self.config.num_microbatches or 1)
        self._scale = scale_loss or (lambda t: t)
        # sharded and deferred: no gradient in .grad to sum over the tied copies until the reducing step
        sum_tied = self.tied is not None and (reduce_grads or not self.sharded)
        held = self.tied.hold_grads() if sum_tied else []  # type: ignore[union-attr]
        for stage in self.stages:
            stage.reduce_grads = reduce_grads
        try:
            self._run(self.schedule.step, inputs, targets)
        finally:
            self._scale = lambda t: t
            for stage in self.stages:
                stage.reduce_grads = True
        if sum_tied:
            # the copies of a tied parameter: this step's gradients summed, so both take one update
            self.tied.reduce_grads_(held)  # type: ignore[union-attr]
        return self._batch_loss()

    def _eval_schedule(self, batch_size: int, seq_len: int) -> tuple[Any, int]:
        """A forward-only schedule of its own for an evaluation batch of another shape than the training
        batches (a shorter last validation batch, or any before training's first): new stages (their
        buffers sized for this shape) over the same modules, microbatches of equal size (the most that
        divide the batch, at most the training schedule's, or pp before it is chosen). Built once per
        shape; every pipeline rank sees the same batch, so all build alike."""
        shape = (int(batch_size), int(seq_len))
        cached = self._eval_schedules.get(shape)
        if cached is not None:
            return cached
        from torch.distributed.pipelining import schedules

        limit = max(1, min(self.config.num_microbatches or self.config.pipeline_parallel_size, shape[0]))
        m = max(d for d in range(1, limit + 1) if shape[0] % d == 0)
        n = self.config.num_stages
        stages = [PipelineStage(s.submod, s.stage_index, n, self.device, group=self.pp_group) for s in self.stages]
        if self.config.placement == "single":
            schedule = schedules.ScheduleGPipe(stages[0], n_microbatches=m, loss_fn=self._loss)
        else:  # loop placement: every microbatch through the local stages in turn, forward only
            schedule = schedules.ScheduleLoopedBFS(stages, n_microbatches=m, loss_fn=self._loss)
        self._eval_schedules[shape] = (schedule, m)
        return schedule, m

    def _eval_target(self, batch_size: int, seq_len: int) -> tuple[Any, int]:
        """The schedule and microbatches for an evaluation batch: the training schedule's for the training
        batches' shape; for any other shape, and before the first training batch (Lightning's sanity
        check validates first), a forward-only schedule of its own, so that evaluation never fixes the
        shape (or, under "auto", the schedule) training runs with."""
        shape = (int(batch_size), int(seq_len))
        if self._shape is not None and shape == self._shape:
            return self.schedule, self.config.num_microbatches or 1
        if self.config.placement == "v":  # only its own schedule runs V-placed stages: the first batch decides
            if self._shape is None:
                return self.schedule, self.prepare(*shape).num_microbatches or 1
            b, t = self._shape
            raise ValueError(
                f"an evaluation batch of {shape[0]} sequences x {shape[1]} tokens after batches of {b} x {t}: "
                f"pipeline_schedule={self.config.schedule!r} places its stages in a V, which only its own schedule "
                "runs, and that was set up for the first batch's shape; use one batch shape for training and "
                "validation (drop_last=True, so the last batch is full)")
        return self._eval_schedule(*shape)

    def eval_microbatches(self, batch_size: int, seq_len: int) -> int:
        """The microbatches :meth:`eval_step` cuts a batch of this shape into (its schedule set up, before any
        send/recv)."""
        return self._eval_target(batch_size, seq_len)[1]

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only over all microbatches; the batch-mean loss on every pipeline rank.

        A batch of another shape than training's (a shorter last validation batch), or any batch before
        the first training batch, runs through a forward-only schedule built for its shape
        (:meth:`_eval_schedule`), so validation needs no ``drop_last`` and never decides the training
        schedule; the loss is the mean over microbatches of equal size, as for a full batch."""
        schedule, m = self._eval_target(inputs.shape[0], inputs.shape[-1])  # before any send/recv
        self._raw = []
        self._factor = 1.0
        if hasattr(schedule, "eval"):
            self._run(schedule.eval, inputs, targets)
        else:  # older torch: no eval(); a step without backward
            has_backward = schedule._has_backward
            schedule._has_backward = False
            try:
                self._run(schedule.step, inputs, targets)
            finally:
                schedule._has_backward = has_backward
        return self._batch_loss(m)
