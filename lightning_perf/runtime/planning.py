"""The memory planner for a Lightning run: :func:`estimate_memory` and the ``"auto"`` training settings.

:func:`estimate_memory` reads the module (the pack's GPT: its config, compile and activation checkpointing),
the strategy (a name, an instance of the pack's strategies or of Lightning's single-device / DDP / FSDP /
model-parallel ones) and the batch, turns them into the numbers of
:mod:`lightning_perf.perf.memory_plan` and returns its :class:`~lightning_perf.perf.memory_plan.MemoryEstimate`.

:func:`plan_training` chooses what a run leaves at ``"auto"``: the micro-batch per GPU
(``TokenDataModule(batch_size="auto")``), activation checkpointing (``GPTLightningModule(
activation_checkpointing="auto")``), the gradient accumulation that reaches a global batch
(``TokenDataModule(global_batch_tokens=...)`` or ``global_batch_size``) and, under ZeRO, what the ranks keep
between micro-batches (``ZeroStrategy(accumulation="auto")``). Among the configurations predicted to fit the
card with headroom for fragmentation it takes the fastest by :func:`relative_speed`, a model of what each
choice costs: recomputation per checkpointing mode, a fixed cost per micro-batch, a fixed cost per optimizer
step that accumulation spreads. An explicit value always wins; a configuration predicted not to fit at all
is refused before the first step, naming the largest that fits (:func:`resolve_auto_settings`).

A strategy tells the planner its layout through ``memory_layout(module, world_size=..., batch_size=...,
seq_len=...)`` (the pack's strategies have it); Lightning's own strategies are read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_perf.parallel.sharding.accumulation import AccumulationMemory
from lightning_perf.perf.memory_plan import (
    GB,
    MemoryEstimate,
    MemoryLayout,
    ModelShape,
    StepShape,
    estimate_peak,
)

__all__ = [
    "AUTO",
    "PlanLayout",
    "TrainingPlan",
    "estimate_memory",
    "global_batch_sequences",
    "plan_run",
    "plan_training",
    "relative_speed",
    "resolve_auto_settings",
    "device_capacity",
    "HEADROOM",
    "RESERVED_OUTSIDE_ALLOCATOR",
]

AUTO = "auto"
#: share of the usable memory kept free for the allocator's fragmentation
HEADROOM = 0.06
#: memory a GPU process holds outside PyTorch's allocator (the CUDA context, NCCL's and cuBLAS's buffers)
RESERVED_OUTSIDE_ALLOCATOR = 2.0 * GB
#: a configuration predicted above the card by more than this share is refused; below it, it is tried
REFUSE_MARGIN = 0.10
#: relative cost of recomputation per checkpointing mode (share of a micro-batch's compute)
RECOMPUTE_COST = {"none": 0.0, "selective": 0.03, "full": 0.30}
#: speed factor of what ZeRO keeps between the micro-batches of a step (against one micro-batch per step)
ACCUMULATION_COST = {"gather_once": 0.995, "reduce_once": 0.99, "reduce_each": 0.985}
_AC_ORDER = ("none", "selective", "full")
_MAX_MICRO_BATCH = 64


@dataclass(kw_only=True)
class PlanLayout:
    """What a strategy tells the planner: its layout, and what it applies to the model itself."""

    layout: MemoryLayout
    stage_blocks: Optional[list[int]] = None  # blocks per pipeline stage, in stage order
    micro_batch: Optional[int] = None  # sequences per forward, where the strategy splits the batch (pipelines)
    activation_checkpointing: Optional[str] = None  # the strategy's own, over the module's
    compiled: Optional[bool] = None  # the strategy compiles the blocks itself


def _model_shape(module: Any) -> ModelShape:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "n_layer"):
        raise TypeError(
            f"estimate_memory covers the pack's GPT (a GPTLightningModule or a GPTConfig); "
            f"{type(module).__name__} has no GPTConfig-like .config"
        )
    return ModelShape.from_config(config)


def _module_settings(module: Any) -> tuple[str, bool]:
    hp = getattr(module, "hparams", {}) or {}
    ac = hp.get("activation_checkpointing", "none") or "none"
    return ac, hp.get("compile") is not None


def _compile_scope(module: Any) -> str:
    hp = getattr(module, "hparams", {}) or {}
    return str(hp.get("compile_scope", "block") or "block")


def _as_module(module: Any) -> Any:
    if isinstance(module, str):
        raise TypeError(f"estimate_memory takes a module or a config: GPTConfig.from_name({module!r}), not the name")
    if hasattr(module, "n_layer"):  # a bare config
        class _Bare:
            config = module
            hparams: dict[str, Any] = {}

        return _Bare()
    return module


def _strategy_object(strategy: Any) -> Any:
    if strategy is None or strategy == AUTO:
        return None
    if isinstance(strategy, str):
        if strategy not in StrategyRegistry:
            raise ValueError(f"unknown strategy name {strategy!r}; registered: {', '.join(sorted(StrategyRegistry))}")
        return StrategyRegistry.get(strategy)
    return strategy


def layout_of(strategy: Any, module: Any, *, world_size: int, batch_size: int, seq_len: int) -> PlanLayout:
    """The planner's view of ``strategy`` (a name, an instance, or None for one device)."""
    obj = _strategy_object(strategy)
    own = getattr(obj, "memory_layout", None)
    if callable(own):
        return own(module, world_size=world_size, batch_size=batch_size, seq_len=seq_len)
    if obj is None or isinstance(obj, SingleDeviceStrategy):
        return PlanLayout(layout=MemoryLayout(data_parallel_size=world_size, engine="none" if world_size == 1
                                              else "ddp"))
    if isinstance(obj, FSDPStrategy):
        stage = 3
        sharding = str(getattr(obj, "sharding_strategy", "FULL_SHARD"))
        if "SHARD_GRAD_OP" in sharding:
            stage = 2
        elif "NO_SHARD" in sharding:
            stage = 0
        return PlanLayout(layout=MemoryLayout(data_parallel_size=world_size, zero_stage=stage, engine="fsdp"))
    if isinstance(obj, ModelParallelStrategy):
        tp = obj._tensor_parallel_size if isinstance(getattr(obj, "_tensor_parallel_size", None), int) else 1
        dp = max(1, world_size // tp)
        return PlanLayout(layout=MemoryLayout(data_parallel_size=dp, tensor_parallel_size=tp, zero_stage=3,
                                              engine="fsdp"))
    if isinstance(obj, DDPStrategy):
        return PlanLayout(layout=MemoryLayout(data_parallel_size=world_size, engine="ddp"))
    raise TypeError(f"estimate_memory does not know the layout of {type(obj).__name__}")


def estimate_memory(
    module: Any,
    strategy: Any = None,
    *,
    devices: int,
    batch_size: int,
    seq_len: int,
    num_nodes: int = 1,
    precision: str = "bf16-mixed",
    accumulate_grad_batches: int = 1,
    activation_checkpointing: Optional[str] = None,
    accumulation: Optional[str] = None,
) -> MemoryEstimate:
    """Predicted peak allocated GPU memory per rank of training ``module`` under ``strategy``.

    Args:
        module: a ``GPTLightningModule`` (its config, ``compile`` and ``activation_checkpointing``) or a
            ``GPTConfig`` (``GPTConfig.from_name("llama-8b")``).
        strategy: a strategy name (``"zero3"``, ``"parallel3d"``, ``"ddp"``, ...), an instance (the pack's or
            Lightning's), or ``None`` / ``"auto"`` for one device.
        devices: GPUs per node; ``num_nodes``: nodes.
        batch_size: sequences per GPU per micro-batch (a pipeline's per-replica batch, which it splits).
        seq_len: tokens per sequence.
        precision: the Trainer's precision.
        accumulate_grad_batches: micro-batches per optimizer step.
        activation_checkpointing: over the module's own mode.
        accumulation: what ZeRO keeps between micro-batches (``"reduce_each"``, ``"reduce_once"``,
            ``"gather_once"``), over the strategy's.

    Returns a :class:`~lightning_perf.perf.memory_plan.MemoryEstimate`: ``.peak_gb`` (the largest rank),
    ``.per_rank_gb`` (rank order; one entry per pipeline rank), ``.parts_gb`` (parameters, gradients,
    optimizer state, gathered parameters, activations, logits and loss, backward temporaries, workspace).
    What it leaves out: see :mod:`lightning_perf.perf.memory_plan`.
    """
    module = _as_module(module)
    model = _model_shape(module)
    world = int(devices) * int(num_nodes)
    plan_layout = layout_of(strategy, module, world_size=world, batch_size=batch_size, seq_len=seq_len)
    ac, compiled = _module_settings(module)
    if plan_layout.activation_checkpointing not in (None, "none"):
        ac = plan_layout.activation_checkpointing
    if activation_checkpointing is not None:
        ac = activation_checkpointing
    if plan_layout.compiled:
        compiled = True
    layout = plan_layout.layout
    if accumulation is not None:
        layout = replace(layout, accumulation=accumulation)
    # a strategy that compiles the blocks itself compiles the head and the loss too
    scope = "model" if plan_layout.compiled else _compile_scope(module)
    step = StepShape(micro_batch=plan_layout.micro_batch or int(batch_size), seq_len=int(seq_len),
                     accumulate_grad_batches=int(accumulate_grad_batches), activation_checkpointing=ac,
                     compile=compiled, compile_scope=scope, precision=_normalize_precision(precision))
    estimate = estimate_peak(model, layout, step, stage_blocks=plan_layout.stage_blocks)
    if layout.world_size != world:
        estimate.notes.append(f"the layout covers {layout.world_size} of {world} ranks")
    return estimate


def _normalize_precision(precision: Any) -> str:
    text = str(precision)
    return {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true", "16-mixed": "16-mixed"}.get(text, text)


# ---- choosing the "auto" values -----------------------------------------------------------------------------

def relative_speed(model: ModelShape, *, micro_batch: int, seq_len: int, accumulate: int, ac: str,
                   data_parallel_size: int) -> float:
    """Tokens per unit of time, up to a constant: compute with recomputation, plus a fixed cost per micro-batch
    (launches, per-unit collectives a micro-batch cannot hide) and per optimizer step (the step itself over the
    rank's share of the weights, clipping, FP8 scale updates), in units of one token's compute."""
    flops_per_token = 6 * model.num_params() + 6 * model.n_layer * model.n_embd * seq_len
    per_micro = 0.05 * seq_len * flops_per_token  # ~5% of one sequence's compute
    # the optimizer step reads and writes ~28 bytes per local parameter: at ~1/300 of a FLOP's time per byte
    per_step = 28 * model.num_params() / max(1, data_parallel_size) * 300
    tokens = micro_batch * seq_len * accumulate
    time = accumulate * (tokens / accumulate * flops_per_token * (1 + RECOMPUTE_COST.get(ac, 0.0)) + per_micro) \
        + per_step
    return tokens / time


@dataclass(kw_only=True)
class TrainingPlan:
    """The settings chosen (or checked) for a run, with the prediction they rest on."""

    batch_size: int
    activation_checkpointing: str
    accumulate_grad_batches: int
    accumulation: Optional[str]  # ZeRO's mode between micro-batches; None where the strategy has none
    estimate: MemoryEstimate
    capacity_bytes: Optional[float]
    fits: bool
    auto: tuple[str, ...] = ()  # which settings were "auto"
    candidates: list[dict[str, Any]] = field(default_factory=list)
    largest_fitting: Optional[dict[str, Any]] = None

    @property
    def peak_gb(self) -> float:
        return self.estimate.peak_gb

    def as_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "peak_gb": self.peak_gb,
                "gpu_memory_gb": None if self.capacity_bytes is None else self.capacity_bytes / GB,
                "usable_gb": None if self.capacity_bytes is None else usable_bytes(self.capacity_bytes) / GB,
                "batch_size": self.batch_size, "activation_checkpointing": self.activation_checkpointing,
                "accumulate_grad_batches": self.accumulate_grad_batches, "accumulation": self.accumulation,
                "auto": list(self.auto), "parts_gb": self.estimate.parts_gb, "per_rank_gb": self.estimate.per_rank_gb,
                "moment": self.estimate.peak_rank.moment, "largest_fitting": self.largest_fitting,
                "notes": self.estimate.notes}

    def summary(self) -> str:
        """One line: the choice and its predicted peak."""
        cap = "" if self.capacity_bytes is None else f" of {self.capacity_bytes / GB:.0f} GB"
        mode = f", ZeRO accumulation {self.accumulation}" if self.accumulation and self.accumulate_grad_batches > 1 \
            else ""
        auto = f" (auto: {', '.join(self.auto)})" if self.auto else ""
        return (f"memory plan: batch_size {self.batch_size}, activation_checkpointing {self.activation_checkpointing}, "
                f"accumulate_grad_batches {self.accumulate_grad_batches}{mode}: predicted peak "
                f"{self.peak_gb:.1f} GB per GPU{cap}{auto}")


def usable_bytes(capacity_bytes: float) -> float:
    """What the allocated peak may reach on a card of ``capacity_bytes``: less what lives outside the
    allocator, less the fragmentation headroom."""
    return max(0.0, capacity_bytes - RESERVED_OUTSIDE_ALLOCATOR) * (1 - HEADROOM)


def device_capacity(device: Optional[torch.device]) -> Optional[float]:
    """Total bytes of the CUDA device ``device`` (None elsewhere: no device memory to plan for)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(device).total_memory)


def _micro_batches(per_replica: Optional[int]) -> list[int]:
    if per_replica is None:
        return list(range(1, 17))
    return [m for m in range(1, min(per_replica, _MAX_MICRO_BATCH) + 1) if per_replica % m == 0]


def plan_training(
    module: Any,
    strategy: Any = None,
    *,
    devices: int,
    seq_len: int,
    capacity_bytes: Optional[float],
    batch_size: Union[int, str] = AUTO,
    activation_checkpointing: Optional[str] = None,
    accumulate_grad_batches: Optional[int] = None,
    global_batch_sequences: Optional[int] = None,
    accumulation: Optional[str] = None,
    num_nodes: int = 1,
    precision: str = "bf16-mixed",
) -> TrainingPlan:
    """Choose the ``"auto"`` settings (or check the explicit ones) for ``capacity_bytes`` per GPU.

    ``activation_checkpointing``: ``"auto"``, a mode, or None (the module's). ``accumulate_grad_batches``: an
    explicit value, or None to derive it from ``global_batch_sequences`` (else 1). ``accumulation``: ZeRO's
    mode, ``"auto"`` or None (the strategy's). ``capacity_bytes`` None (no GPU): the fastest configuration
    is taken without a memory check.
    """
    module = _as_module(module)
    model = _model_shape(module)
    world = int(devices) * int(num_nodes)
    own_ac, _ = _module_settings(module)
    ac_auto = activation_checkpointing == AUTO or (activation_checkpointing is None and own_ac == AUTO)
    ac_fixed = None if ac_auto else (activation_checkpointing or own_ac)
    batch_auto = batch_size == AUTO
    probe = layout_of(strategy, module, world_size=world, batch_size=1 if batch_auto else int(batch_size),
                      seq_len=seq_len)
    dp = probe.layout.data_parallel_size
    pipelined = probe.layout.pipeline_parallel_size > 1
    strategy_accumulation = accumulation if accumulation is not None else (
        AUTO if probe.layout.engine == "fsdp" and _declares_auto_accumulation(strategy) else None)
    per_replica = None
    if global_batch_sequences is not None:
        if global_batch_sequences % dp:
            raise ValueError(f"the global batch of {global_batch_sequences} sequences does not split over "
                             f"{dp} data-parallel replicas: choose a multiple of {dp}")
        per_replica = global_batch_sequences // dp
    if not batch_auto and per_replica is not None and not pipelined and per_replica % int(batch_size):
        raise ValueError(f"the global batch gives each of the {dp} data-parallel replicas {per_replica} sequences per "
                         f"step, not a whole number of micro-batches of batch_size {batch_size}: choose a divisor "
                         f"of {per_replica} or batch_size 'auto'")
    all_micros = [per_replica] if (pipelined and per_replica) else _micro_batches(per_replica)
    micros = all_micros if batch_auto else [int(batch_size)]
    modes = list(_AC_ORDER) if ac_auto else [ac_fixed]
    candidates = []
    # the explicit choice, and every alternative (for the largest that fits when it does not)
    grid = [(ac, micro, ac in modes and micro in micros) for ac in _AC_ORDER for micro in sorted(set(all_micros + micros))]
    for ac, micro, allowed in grid:
        if accumulate_grad_batches is not None and accumulate_grad_batches >= 1 and (
                global_batch_sequences is None or not batch_auto):
            accum = int(accumulate_grad_batches)
        elif per_replica is not None and not pipelined:
            accum = per_replica // micro
        else:
            accum = 1
        acc_modes = _accumulation_modes(strategy_accumulation, accum)
        for acc in acc_modes:
            est = estimate_memory(module, strategy, devices=devices, num_nodes=num_nodes, batch_size=micro,
                                  seq_len=seq_len, precision=precision, accumulate_grad_batches=accum,
                                  activation_checkpointing=ac, accumulation=acc)
            fits = capacity_bytes is None or est.peak_bytes <= usable_bytes(capacity_bytes)
            speed = relative_speed(model, micro_batch=micro, seq_len=seq_len, accumulate=accum, ac=ac,
                                   data_parallel_size=dp)
            # what accumulation keeps between micro-batches costs against one micro-batch per step: a
            # reduce-scatter per micro-batch, or gathers per micro-batch; never a gain over no accumulation
            speed *= ACCUMULATION_COST.get(acc, 1.0)
            candidates.append({"batch_size": micro, "activation_checkpointing": ac, "accumulate_grad_batches": accum,
                               "accumulation": acc, "peak_gb": est.peak_gb, "fits": fits, "speed": speed,
                               "allowed": allowed, "_estimate": est})
    allowed_fitting = [c for c in candidates if c["fits"] and c["allowed"]]
    pool = allowed_fitting or [c for c in candidates if c["allowed"]]
    best = max(pool, key=lambda c: (c["speed"], -c["peak_gb"]))
    fitting = [c for c in candidates if c["fits"]]
    largest = max(fitting, key=lambda c: (c["speed"], c["batch_size"])) if fitting else None
    auto = tuple(name for name, flag in (("batch_size", batch_auto), ("activation_checkpointing", ac_auto),
                                         ("accumulate_grad_batches", accumulate_grad_batches is None
                                          and global_batch_sequences is not None),
                                         ("accumulation", strategy_accumulation == AUTO)) if flag)
    public = [{k: v for k, v in c.items() if not k.startswith("_")} for c in candidates if c["allowed"]]
    return TrainingPlan(batch_size=best["batch_size"], activation_checkpointing=best["activation_checkpointing"],
                        accumulate_grad_batches=best["accumulate_grad_batches"], accumulation=best["accumulation"],
                        estimate=best["_estimate"], capacity_bytes=capacity_bytes, fits=bool(allowed_fitting),
                        auto=auto, candidates=public,
                        largest_fitting=None if largest is None else {k: v for k, v in largest.items()
                                                                      if not k.startswith("_")})


def _declares_auto_accumulation(strategy: Any) -> bool:
    obj = _strategy_object(strategy)
    return getattr(getattr(obj, "config", None), "accumulation", None) == AUTO


def _accumulation_modes(mode: Optional[str], accum: int) -> list[Optional[str]]:
    if mode is None:
        return [None]
    if mode != AUTO:
        return [mode]
    if accum == 1:
        return ["reduce_once"]
    return ["gather_once", "reduce_once", "reduce_each"]


# ---- applying the plan to a run -----------------------------------------------------------------------------

def global_batch_sequences(datamodule: Any, world: int) -> Optional[int]:
    """The data module's global batch in sequences for ``world`` GPUs (None: none given)."""
    tokens = getattr(datamodule, "global_batch_tokens", None)
    sequences = getattr(datamodule, "global_batch_size", None)
    per_gpus = getattr(datamodule, "global_batch_per_gpus", None)
    seq_len = getattr(datamodule, "seq_len", None)
    if tokens is not None and seq_len:
        if tokens % seq_len:
            raise ValueError(f"global_batch_tokens={tokens} is not a whole number of {seq_len}-token sequences")
        sequences = tokens // seq_len
    if sequences is None:
        return None
    if per_gpus:
        scaled = sequences * world / per_gpus
        if scaled != int(scaled) or scaled < 1:
            raise ValueError(f"a global batch of {sequences} sequences per {per_gpus} GPUs does not scale to {world} "
                             f"GPUs in whole sequences")
        sequences = int(scaled)
    return int(sequences)


def _needs_plan(module: Any, datamodule: Any, strategy: Any) -> bool:
    hp = getattr(module, "hparams", {}) or {}
    return (getattr(datamodule, "batch_size", None) == AUTO or hp.get("activation_checkpointing") == AUTO
            or _declares_auto_accumulation(strategy)
            or getattr(datamodule, "global_batch_tokens", None) is not None
            or getattr(datamodule, "global_batch_size", None) is not None)


def plan_run(module: Any, strategy: Any, datamodule: Any, *, devices: int, num_nodes: int,
             accumulate_grad_batches: int, capacity_bytes: Optional[float], precision: str) -> TrainingPlan:
    """:func:`plan_training` for a run's data module and Trainer settings: an ``accumulate_grad_batches`` above 1 is
    the user's and wins; otherwise the data module's global batch (if any) sets the accumulation."""
    global_seqs = global_batch_sequences(datamodule, devices * num_nodes)
    explicit = accumulate_grad_batches > 1 or global_seqs is None
    return plan_training(module, strategy, devices=devices, num_nodes=num_nodes, seq_len=int(datamodule.seq_len),
                         capacity_bytes=capacity_bytes, batch_size=datamodule.batch_size,
                         accumulate_grad_batches=accumulate_grad_batches if explicit else None,
                         global_batch_sequences=global_seqs, precision=precision)


def resolve_auto_settings(trainer: Any, module: Any, datamodule: Any, *, check_fit: bool = True) -> Optional[TrainingPlan]:
    """Turn a run's ``"auto"`` settings into values (in place: ``datamodule.batch_size``, the module's
    ``activation_checkpointing``, ``trainer.accumulate_grad_batches``, the strategy's ``accumulation``).

    Runs in every process before the model is built; the same inputs give every rank the same plan. With
    ``check_fit``, explicit settings predicted to exceed the card by more than the planner's margin are
    refused (``ValueError``, naming the largest that fits). Returns the plan, or None where nothing was asked
    of the planner (no "auto", no global batch, and no GPU to check).
    """
    if module is None or not hasattr(getattr(module, "config", None), "n_layer"):
        return None
    strategy = trainer.strategy
    seq_len = getattr(datamodule, "seq_len", None)
    if not isinstance(seq_len, int):
        return None
    device = getattr(strategy, "root_device", None)
    capacity = device_capacity(device)
    asked = _needs_plan(module, datamodule, strategy)
    if not asked and (capacity is None or not check_fit):
        return None
    devices = max(1, len(getattr(strategy, "parallel_devices", None) or [None]))
    batch = datamodule.batch_size
    plan = plan_run(module, strategy, datamodule, devices=devices, num_nodes=int(getattr(trainer, "num_nodes", 1) or 1),
                    accumulate_grad_batches=int(trainer.accumulate_grad_batches), capacity_bytes=capacity,
                    precision=str(getattr(trainer, "precision", "bf16-mixed")))
    if capacity is not None and not plan.fits and check_fit:
        over = plan.estimate.peak_bytes / usable_bytes(capacity) - 1
        if over > REFUSE_MARGIN or asked:
            raise ValueError(_refusal(plan, capacity))
    changed = False
    if batch == AUTO:
        datamodule.batch_size, changed = plan.batch_size, True
    hp = getattr(module, "hparams", None)
    if hp is not None and hp.get("activation_checkpointing") == AUTO:
        hp["activation_checkpointing"], changed = plan.activation_checkpointing, True
    if trainer.accumulate_grad_batches != plan.accumulate_grad_batches:
        trainer.accumulate_grad_batches, changed = plan.accumulate_grad_batches, True
    hook = getattr(strategy, "set_accumulation_verdict", None)
    if callable(hook) and _declares_auto_accumulation(strategy) and capacity is not None:
        # the strategy settles "auto" in its setup from the predicted peak of each mode at the chosen settings
        peaks = {c["accumulation"]: int(c["peak_gb"] * GB) for c in plan.candidates
                 if c["accumulation"] and c["batch_size"] == plan.batch_size
                 and c["activation_checkpointing"] == plan.activation_checkpointing}
        if peaks:
            hook(AccumulationMemory(peak_bytes=peaks, capacity_bytes=int(usable_bytes(capacity))))
    if changed:  # once per process: a second call finds the values settled
        rank_zero_info(plan.summary())
    return plan


def _refusal(plan: TrainingPlan, capacity: float) -> str:
    usable = usable_bytes(capacity) / GB
    first = (f"this run needs about {plan.peak_gb:.0f} GB per GPU (batch_size {plan.batch_size}, "
             f"activation_checkpointing {plan.activation_checkpointing}), more than the {usable:.0f} GB a "
             f"{capacity / GB:.0f} GB GPU can give it.")
    fit = plan.largest_fitting
    if fit is not None:
        second = (f"The largest that fits: --data.batch_size {fit['batch_size']} --model.activation_checkpointing "
                  f"{fit['activation_checkpointing']} (~{fit['peak_gb']:.0f} GB), or batch_size / "
                  "activation_checkpointing 'auto'.")
    else:
        second = ("Nothing at this layout fits: shard more (more GPUs, zero3, tensor or pipeline parallelism) or "
                  "offload (strategy zero3_offload).")
    return f"{first}\n{second} Details: lightning-perf plan (same arguments)."

