"""What a training run has switched on: the settings the advice reads before suggesting a change.

Collected from the LightningModule, the Trainer and its strategy by the callbacks
(``lightning_perf.callbacks.run_settings_of``) and handed to the pure advice (``perf.advice``,
``perf.memory``). ``None`` means "not known": the advice never suggests a setting whose current
state it does not know, so it cannot suggest what is already on.

A strategy or a LightningModule tells the callbacks what it knows of itself through one method,
``perf_settings() -> PerfSettings``: the pack's strategies state their precision and layout (ZeRO
stage, tensor and pipeline sizes, blocks per FSDP2 unit) and what they apply to the model (compile,
activation checkpointing); ``GPTLightningModule`` states what it builds. The callbacks call it where
it exists and otherwise read Lightning's public attributes and the model itself, so any strategy
and any LightningModule work, and one that knows more can say so by defining the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["RunSettings", "PerfSettings", "CHANGES"]


@dataclass(frozen=True, kw_only=True)
class PerfSettings:
    """What a strategy or a LightningModule states about itself (``None``: it does not say).

    Attributes:
        precision: Lightning's precision string the strategy trains in.
        zero_stage: 0 for replicated parameters, 1-3 for ZeRO (3 = parameters sharded).
        tensor_parallel_size, pipeline_parallel_size: the layout's sizes.
        fsdp_blocks_per_unit: blocks per FSDP2 unit, where FSDP2 shards the model.
        compile_mode: the ``torch.compile`` mode it applies (``None``: it compiles nothing itself).
        compile_scope: what that compiles: ``"block"`` (each block) or ``"model"`` (one graph).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``, as it applies it.
        gpt: the module is the pack's GPT (its kernels, FP8 and compile scope are arguments of it).
        kernels, attention, fp8: the GPT's ``GPTConfig`` fields (``fp8``: its recipe or ``"none"``).
    """

    precision: Optional[str] = None
    zero_stage: Optional[int] = None
    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: Optional[int] = None
    fsdp_blocks_per_unit: Optional[int] = None
    compile_mode: Optional[str] = None
    compile_scope: Optional[str] = None
    activation_checkpointing: Optional[str] = None
    gpt: Optional[bool] = None
    kernels: Optional[str] = None
    attention: Optional[str] = None
    fp8: Optional[str] = None


# what a piece of advice may ask to switch on; RunSettings.already_on tells whether it is
CHANGES = (
    "bf16",                 # bf16 autocast (precision="bf16-mixed")
    "compile",              # torch.compile at all
    "compile_model_scope",  # one graph for the whole model instead of one per block
    "cuda_graphs",          # compile mode "reduce-overhead"
    "fused_optimizer",      # fused Adam/AdamW
    "triton_kernels",       # GPTConfig(kernels="triton")
    "fp8",                  # GPTConfig(fp8="tensorwise")
    "activation_checkpointing",
    "dataloader_workers",
    "pin_memory",
    "gc_schedule",          # lightning_perf.callbacks.GarbageCollection
    "fsdp_larger_units",    # ZeroStrategy(blocks_per_unit=2)
    "zero1",                # optimizer state sharded
    "zero2",                # optimizer state and gradients sharded
    "zero3",                # parameters sharded too
    "expandable_segments",  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
)


@dataclass(kw_only=True)
class RunSettings:
    """The run's settings as far as they are known (``None``: unknown).

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ...
        device_name: e.g. ``"NVIDIA H100 80GB HBM3"``.
        fp8_capable: the GPU has FP8 tensor cores (compute capability 8.9 or higher).
        precision: Lightning's precision string (``"bf16-mixed"``, ``"32-true"``, ...).
        compiled: some part of the model runs under ``torch.compile``.
        compile_scope: ``"model"`` (one graph), ``"block"`` (one per block), ``"submodules"``
            (some compiled submodules of another model).
        compile_mode: ``torch.compile`` mode (``"default"``, ``"reduce-overhead"``, ...).
        gpt: the module is the pack's ``GPTLightningModule`` (kernels / fp8 / compile scope apply).
        kernels, attention: the GPT's ``GPTConfig`` fields; fp8: its FP8 recipe or ``"none"``.
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
        micro_batch: samples per device per forward; accumulate_grad_batches: micro-batches per step.
        num_workers, pin_memory: the training DataLoader's.
        strategy: the strategy's class name.
        zero_stage: 0 for plain data parallelism, 1-3 for ZeRO / FSDP (3 = parameters sharded).
        data_parallel_size, tensor_parallel_size, pipeline_parallel_size: the layout.
        fsdp_blocks_per_unit: blocks per FSDP2 unit under the pack's native ZeRO-2/3.
        optimizer: the optimizer's class name; fused_optimizer: whether it runs fused.
        n_params: parameters of the model (global count, not a shard's).
        gc_scheduled: ``GarbageCollection`` is attached.
        expandable_segments: ``PYTORCH_CUDA_ALLOC_CONF`` has ``expandable_segments:True``.
    """

    device_type: Optional[str] = None
    device_name: Optional[str] = None
    fp8_capable: Optional[bool] = None
    precision: Optional[str] = None
    compiled: Optional[bool] = None
    compile_scope: Optional[str] = None
    compile_mode: Optional[str] = None
    gpt: bool = False
    kernels: Optional[str] = None
    attention: Optional[str] = None
    fp8: Optional[str] = None
    activation_checkpointing: Optional[str] = None
    micro_batch: Optional[int] = None
    accumulate_grad_batches: int = 1
    num_workers: Optional[int] = None
    pin_memory: Optional[bool] = None
    strategy: Optional[str] = None
    zero_stage: Optional[int] = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    fsdp_blocks_per_unit: Optional[int] = None
    optimizer: Optional[str] = None
    fused_optimizer: Optional[bool] = None
    n_params: Optional[int] = None
    gc_scheduled: Optional[bool] = None
    expandable_segments: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "accumulate_grad_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")

    @property
    def bf16(self) -> Optional[bool]:
        if self.precision is None:
            return None
        return str(self.precision).startswith("bf16")

    @property
    def low_precision(self) -> Optional[bool]:
        """bf16 or fp16 compute (mixed or true)."""
        if self.precision is None:
            return None
        return str(self.precision).startswith(("bf16", "16", "fp16", "half", "transformer-engine"))

    @property
    def sharded_per_block(self) -> bool:
        """The strategy splits the model per block (FSDP units, TP, PP): per-block compile composes with it."""
        return (self.zero_stage or 0) >= 2 or self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1

    def state(self, change: str) -> Optional[bool]:
        """Whether ``change`` (one of :data:`CHANGES`) is already on: True, False, or None (unknown)."""
        if change not in CHANGES:
            raise ValueError(f"unknown change {change!r}; one of {CHANGES}")
        if change == "bf16":
            return self.low_precision
        if change == "compile":
            return self.compiled
        if change == "compile_model_scope":
            return None if self.compile_scope is None else self.compile_scope == "model"
        if change == "cuda_graphs":
            if not self.compiled:
                return self.compiled
            return None if self.compile_mode is None else self.compile_mode == "reduce-overhead"
        if change == "fused_optimizer":
            return self.fused_optimizer
        if change == "triton_kernels":
            return None if self.kernels is None else self.kernels == "triton"
        if change == "fp8":
            return None if self.fp8 is None else self.fp8 != "none"
        if change == "activation_checkpointing":
            return None if self.activation_checkpointing is None else self.activation_checkpointing != "none"
        if change == "dataloader_workers":
            return None if self.num_workers is None else self.num_workers > 0
        if change == "pin_memory":
            return self.pin_memory
        if change == "gc_schedule":
            return self.gc_scheduled
        if change == "fsdp_larger_units":
            return None if self.fsdp_blocks_per_unit is None else self.fsdp_blocks_per_unit > 1
        if change == "expandable_segments":
            return self.expandable_segments
        stage = {"zero1": 1, "zero2": 2, "zero3": 3}[change]
        return None if self.zero_stage is None else self.zero_stage >= stage

    def off(self, change: str) -> bool:
        """``change`` is known to be off (the only state in which advice may suggest it)."""
        return self.state(change) is False
