"""``ZeroStrategy``: ZeRO stages 1-3 for any LightningModule, native (torch) or DeepSpeed.

A thin Lightning adapter over ``lightning_perf.parallel``; processes, precision,
collectives and DCP checkpoints come from ``PerfParallelStrategy``. Here: a ("dp",) mesh
over the world (HSDP: ("dp_replicate", "dp_shard"), ``parallel.layout.dims.build_zero_mesh``), the
model built on ``meta`` in ``configure_model`` (all ranks but 0 under ``init="rank0"``), then
in ``setup``: shard (``apply_fsdp`` / DDP / DeepSpeed), materialise shard by shard (in host
memory under native CPU offload), build the optimizer on the sharded parameters, and turn it
into a ``ZeroRedundancyOptimizer`` at stage 1. Gradient accumulation follows ``accumulation``
(``parallel.sharding.accumulation``): the non-final micro-batches Lightning wraps in
``block_backward_sync`` skip the reduction (and, under ``"gather_once"``, the resharding); the
DeepSpeed backend writes its engine's own checkpoint shards.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_perf.parallel.layout.dims import build_zero_mesh, fsdp_mesh
from lightning_perf.parallel.layout.validate import check_data_layout, data_shape
from lightning_perf.parallel.layout.zero_config import ZeroConfig
from lightning_perf.parallel.sharding import deepspeed_engine
from lightning_perf.parallel.sharding.accumulation import FSDPAccumulation, MemoryVerdict, resolve_accumulation
from lightning_perf.parallel.sharding.ddp import apply_ddp, shard_optimizer
from lightning_perf.parallel.sharding.fp8_all_gather import require_fp8_linears
from lightning_perf.parallel.sharding.fsdp import (
    FSDPUnit,
    apply_fsdp,
    cpu_offload_policy,
    find_blocks,
    find_model,
    fsdp_unit_plan,
    move_unsharded_,
)
from lightning_perf.parallel.sharding.init import (
    broadcast_module_,
    has_meta_tensors,
    materialize_from_rank0,
    materialize_local,
    take_full_state,
)
from lightning_perf.parallel.sharding.optim import localize_optimizers
from lightning_perf.perf.collection import DEFAULT_EVERY_N_STEPS
from lightning_perf.perf.memory_plan import MemoryLayout
from lightning_perf.perf.run_settings import PerfSettings
from lightning_perf.runtime.planning import PlanLayout
from lightning_perf.strategies.base import PerfParallelStrategy, builds_in_configure_model, config_from_arguments

__all__ = ["ZeroStrategy"]


def _require_parameters(module: nn.Module) -> None:
    if not any(p.numel() for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameters (0 elements): build the model in __init__ or "
            "configure_model() before training with a ZeRO strategy"
        )


class ZeroStrategy(PerfParallelStrategy):
    """ZeRO data parallelism: ``stage`` 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).

    Args:
        stage: 1, 2 or 3.
        backend: ``"native"`` (DDP + ZeroRedundancyOptimizer / FSDP2) or ``"deepspeed"``;
            ``None`` picks native (offload on FSDP2's ``CPUOffloadPolicy``), DeepSpeed only to offload
            at stage 1.
        offload_optimizer: keep optimizer state (and the step) on the CPU. Native (stage 2/3): FSDP2's
            ``CPUOffloadPolicy``, which keeps the sharded fp32 parameters and their gradients there too.
        offload_params: keep stage-3 parameters on the CPU between uses (native: with
            ``offload_optimizer=True``, the same policy).
        bucket_size_mb: DDP bucket / DeepSpeed reduce bucket size.
        prefetch: FSDP2 all-gather prefetch depth in blocks, forward and backward.
        reshard_after_forward: override the stage's default (True at stage 3).
        wrap_policy: FSDP units when the model exposes no blocks: a callable
            ``module -> bool`` or a set of module classes.
        gradient_compression: stage 1 all-reduce compression: ``"fp16"``, ``"bf16"``
            (CUDA only) or ``"powersgd"`` (rank ``powersgd_rank``).
        init: ``"rank0"``: rank 0 builds the model for real (same values as one process
            with the same seed) and sends each rank its shards; ``"meta"``: every rank
            initialises its own shards with the model's ``init_weights()`` (nothing whole
            anywhere: for models larger than one host).
        deepspeed_config: entries merged over the generated DeepSpeed config.
        fp8_all_gather: with FP8 linears (``GPTConfig(fp8=True)``) at stage 2/3, all-gather their
            weights in FP8, each shard quantised with the whole weight's scale (half the gather
            bytes of bf16; the same FP8 weights as quantising after the gather). The scales are
            reduced in one collective after each optimizer step and after a checkpoint load.
        blocks_per_unit: stage 2/3 native: consecutive blocks sharded as one FSDP2 unit (fewer,
            larger all-gathers and reduce-scatters, less host work per step; more memory gathered
            at once). Default 1: one unit per block.
        replicate_size: stage 2/3 native: HSDP. Shard over ``world / replicate_size`` consecutive ranks
            and replicate over ``replicate_size`` such groups (``"auto"``: the number of nodes, so
            parameters are gathered within a node and only gradients cross nodes). Default 1: shard
            over the whole world.
        timeout: how long a collective may wait (seconds or a ``timedelta``) before the ranks
            fail instead of hanging; pair it with ``RankWatchdog`` to name the rank at fault.
        async_checkpoint: write checkpoints in the background while training goes on (``None``:
            on CUDA devices with the native backend); the DeepSpeed backend writes its engine's
            checkpoint in the save call.
        accumulation: with ``Trainer(accumulate_grad_batches=k)``, how often one optimizer step's k
            micro-batches gather parameters and reduce gradients. ``"reduce_each"``: gradients
            reduce-scattered after every micro-batch (they stay sharded: the least memory);
            ``"reduce_once"``: gradients accumulate unsharded and are reduce-scattered once, at the last
            micro-batch, parameters gathered in every micro-batch; ``"gather_once"``: parameters also stay
            gathered across the k micro-batches (one all-gather and one reduce-scatter per unit and step,
            for the memory of the unsharded parameters and gradients). At stage 1 ``"reduce_each"``
            all-reduces every micro-batch, the other two only the last. ``"auto"``: settled in ``setup``
            by ``parallel.sharding.accumulation.resolve_accumulation`` from ``accumulate_grad_batches`` and
            the memory verdict given to :meth:`set_accumulation_verdict` (none: ``"reduce_once"``). The
            DeepSpeed backend takes ``"auto"`` or what its engine does (stage 1 ``"reduce_once"``, stages
            2 and 3 ``"reduce_each"``). A checkpoint saved between micro-batches holds the parameters of
            the last step, never the gradients accumulated since.

    Example::

        strategy = ZeroStrategy(stage=3, accumulation="gather_once")
        trainer = L.Trainer(strategy=strategy, accumulate_grad_batches=8, ...)
    """

    strategy_name = "zero"
    config: ZeroConfig

    def __init__(
        self,
        stage: int = 3,
        backend: Optional[Literal["native", "deepspeed"]] = None,
        *,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        bucket_size_mb: float = 25.0,
        prefetch: int = 1,
        reshard_after_forward: Optional[bool] = None,
        wrap_policy: Optional[Union[Callable[[nn.Module], bool], set]] = None,
        gradient_compression: Optional[Literal["fp16", "bf16", "powersgd"]] = None,
        powersgd_rank: int = 4,
        init: Literal["rank0", "meta"] = "rank0",
        deepspeed_config: Optional[dict[str, Any]] = None,
        fp8_all_gather: bool = False,
        blocks_per_unit: int = 1,
        replicate_size: Union[int, Literal["auto"]] = 1,
        accumulation: Literal["auto", "reduce_each", "reduce_once", "gather_once"] = "auto",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        async_checkpoint: Optional[bool] = None,
        gc_every_n_steps: Optional[int] = DEFAULT_EVERY_N_STEPS,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            async_checkpoint=async_checkpoint,
            gc_every_n_steps=gc_every_n_steps,
            config=config_from_arguments(ZeroConfig, locals()),  # validated before Lightning checks the precision
        )
        if async_checkpoint and self.config.backend == "deepspeed":
            raise ValueError(
                "async_checkpoint=True needs backend='native': the DeepSpeed backend writes its engine's "
                "checkpoint in the save call (pass async_checkpoint=False or None)"
            )
        self._sharded: Optional[nn.Module] = None  # the FSDP2 root
        self._engine: Optional[Any] = None  # the DeepSpeed engine
        self._prepared: Optional[nn.Module] = None  # the LightningModule already sharded
        self._ddp: Optional[nn.parallel.DistributedDataParallel] = None
        self._init_mode = self.config.init  # "rank0" may turn "meta" in setup (see _gather_init_state)
        self._fsdp_units: list[FSDPUnit] = []  # the FSDP2 units and their resharding (fsdp_unit_plan)
        self._accumulation_verdict: Optional[MemoryVerdict] = None
        self._accumulation_mode: Optional[str] = None  # "auto" settled in setup
        self._fsdp_accumulation: Optional[FSDPAccumulation] = None

    # ---- where ZeRO differs from the base ---------------------------------------------------------

    @override
    def _check_precision(self, precision: str, device_type: Optional[str] = None) -> None:
        self.config.check_precision(precision, device_type)

    @override
    def _check_before_launch(self, module: Optional["pl.LightningModule"], datamodule: Any) -> None:
        super()._check_before_launch(module, datamodule)
        if module is None:
            return
        if not builds_in_configure_model(module):
            _require_parameters(module)
        self._check_fp8_all_gather(module)
        if self.config.uses_fsdp:
            self._check_delayed_fp8(module, f"ZeroStrategy(stage={self.config.stage}) sharding them with FSDP2")
        _, seq_len = data_shape(datamodule)
        check_data_layout(seq_len=seq_len, model_config=getattr(module, "config", None))

    @override
    def _check_world_size(self, world_size: int) -> None:
        self.config.mesh_shape(world_size, self.num_nodes)  # raises with the arithmetic, before any launch

    @override
    def _build_device_mesh(self) -> Any:
        replicate, shard = self.config.mesh_shape(self.world_size, self.num_nodes)
        return build_zero_mesh(self.root_device.type, replicate, shard)

    @override
    def _fp8_gather_module(self) -> Optional[nn.Module]:
        return self._sharded if self.config.fp8_all_gather else None

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """The DeepSpeed backend's engine accumulates (and owns) the gradients between its steps."""
        return self.config.backend == "deepspeed"

    @override
    def perf_settings(self) -> PerfSettings:
        """The precision, the ZeRO stage and, where FSDP2 shards, the blocks per unit (no tensor or pipeline split)."""
        return replace(
            super().perf_settings(),
            zero_stage=self.config.stage,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            fsdp_blocks_per_unit=self.config.blocks_per_unit if self.config.uses_fsdp else None,
        )

    def memory_layout(self, module: Any, *, world_size: int, batch_size: int, seq_len: int) -> PlanLayout:
        """The memory planner's view of this strategy (``lightning_perf.estimate_memory``)."""
        c = self.config
        replicate, _ = c.mesh_shape(world_size, self.num_nodes)
        engine = "deepspeed" if c.backend == "deepspeed" else ("fsdp" if c.uses_fsdp else "ddp")
        accumulation = getattr(c, "accumulation", "reduce_once")
        return PlanLayout(layout=MemoryLayout(
            data_parallel_size=world_size, replicate_size=replicate, zero_stage=c.stage, engine=engine,
            reshard_after_forward=c.reshard_after_forward, blocks_per_unit=c.blocks_per_unit, prefetch=c.prefetch,
            fp8_all_gather=c.fp8_all_gather, offload=c.offload,
            accumulation="reduce_once" if accumulation in (None, "auto") else accumulation))

    # ---- model construction and sharding ------------------------------------------------------

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on ``meta`` (rank 0 builds for real under ``init="rank0"``)."""
        real = self.config.init == "rank0" and self.global_rank == 0
        with nullcontext() if real else torch.device("meta"):
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        _require_parameters(module)  # configure_model() has run now
        if self.config.fp8_all_gather:  # before the first collective (the init broadcast)
            require_fp8_linears(module)
        if self._prepared is not module:
            self._shard_and_materialize(module)
            self._prepared = module
        elif self._ddp is not None:  # a later fit/validate of the same module: reuse the wrapper
            self.model = self._ddp
        if self.config.native_offload:  # the shards stay in host memory
            move_unsharded_(module, self.root_device)
        else:
            module.to(self.root_device)  # what lives outside the sharded model (metrics, buffers)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.config.uses_fsdp:  # Adam steps the DTensor shards locally (same math, no dispatch cost)
                localize_optimizers(self.optimizers)
            if self.config.uses_ddp:
                self._shard_optimizers()
            elif self.config.backend == "deepspeed":
                self._setup_deepspeed(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.config.native_offload:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._setup_accumulation(trainer.accumulate_grad_batches)

    # ---- gradient accumulation ----------------------------------------------------------------

    def set_accumulation_verdict(self, verdict: Optional[MemoryVerdict]) -> None:
        """The memory planner's hook for ``accumulation="auto"``: its verdict (an ``AccumulationMemory``:
        predicted peak bytes per mode and the device's bytes) or a callable that answers an
        ``AccumulationQuery`` with one, read in ``setup`` by ``resolve_accumulation``. Set it before
        ``setup`` runs, e.g. from a callback's ``setup`` hook (callbacks set up before the strategy).
        ``None`` takes it back."""
        self._accumulation_verdict = verdict

    @property
    def accumulation_mode(self) -> Optional[str]:
        """The accumulation mode this fit runs (``"auto"`` settled); ``None`` before ``setup``."""
        return self._accumulation_mode

    def _setup_accumulation(self, accumulate_grad_batches: int) -> None:
        self._accumulation_mode = resolve_accumulation(
            accumulate_grad_batches, mode=self.config.accumulation, stage=self.config.stage,
            backend=str(self.config.backend), verdict=self._accumulation_verdict)
        self._fsdp_accumulation = (FSDPAccumulation(self._fsdp_units, self._accumulation_mode)
                                   if self._sharded is not None else None)

    def _shard_and_materialize(self, module: "pl.LightningModule") -> None:
        target = find_model(module)
        full = self._gather_init_state(target)
        target = self.precision_plugin.convert_module(target)  # bf16-true: cast before sharding
        if self.config.uses_fsdp:
            self._setup_fsdp(target, full)
        elif self.config.uses_ddp:
            self._materialize(target, full)
            self.model = self._ddp = apply_ddp(
                module,
                device_ids=[self.root_device.index] if self.root_device.type == "cuda" else None,
                bucket_size_mb=self.config.bucket_size_mb,
                gradient_compression=self.config.gradient_compression,
                powersgd_rank=self.config.powersgd_rank,
            )
        else:
            self._materialize(target, full)
        # rank 0's full copy (``full``) is released on return, before the optimizer exists

    def _gather_init_state(self, target: nn.Module) -> Optional[dict[str, Any]]:
        """Under ``init="rank0"``: rank 0 keeps its full state, every rank turns its module to meta."""
        mode = self.config.init
        if mode == "rank0":
            # agree on the path before any rank diverges: rank 0 must hold a real model
            mode = self.broadcast("rank0" if not has_meta_tensors(target) else "meta")
        self._init_mode = mode
        if mode != "rank0":
            return None
        if self.global_rank == 0:
            return take_full_state(target)
        target.to(torch.device("meta"))
        return None

    def _materialize(self, target: nn.Module, full: Optional[dict[str, Any]]) -> None:
        # FSDP2's CPU offload takes its shards from host memory
        device = torch.device("cpu") if self.config.native_offload else self.root_device
        if self._init_mode == "rank0":
            materialize_from_rank0(target, device, full, comm_device=self.root_device)
        elif has_meta_tensors(target):
            materialize_local(target, device)
            if not self.config.uses_fsdp:
                broadcast_module_(target)  # replicas start equal

    def _setup_fsdp(self, target: nn.Module, full: Optional[dict[str, Any]]) -> None:
        blocks = find_blocks(target, self.config.wrap_policy)
        self._fsdp_units = fsdp_unit_plan(target, blocks, reshard_after_forward=bool(self.config.reshard_after_forward),
                                          blocks_per_unit=self.config.blocks_per_unit)
        apply_fsdp(
            target,
            fsdp_mesh(self.device_mesh),
            blocks=blocks,
            reshard_after_forward=bool(self.config.reshard_after_forward),
            mp_policy=self.precision_plugin.mp_policy(),
            prefetch=self.config.prefetch,
            offload_policy=cpu_offload_policy(self.root_device) if self.config.native_offload else None,
            fp8_all_gather=self.config.fp8_all_gather,
            blocks_per_unit=self.config.blocks_per_unit,
        )
        self.precision_plugin.sharded_casting = self.precision_plugin.is_mixed and target is not None
        self._sharded = target
        self._materialize(target, full)
        self._refresh_fp8_scales()

    def _shard_optimizers(self) -> None:
        sharded = [shard_optimizer(o) for o in self.optimizers]
        for config in self.lr_scheduler_configs:
            for old, new in zip(self.optimizers, sharded):
                if getattr(config.scheduler, "optimizer", None) is old:
                    config.scheduler.optimizer = new
        self.optimizers = sharded

    def _setup_deepspeed(self, trainer: "pl.Trainer") -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"backend='deepspeed' takes one optimizer, configure_optimizers returned {len(self.optimizers)}"
            )
        precision = self.precision_plugin
        config = deepspeed_engine.deepspeed_config(
            self.config,
            precision=precision.precision,
            micro_batch_size=1,
            world_size=self.world_size,
            accumulate=trainer.accumulate_grad_batches,
            gradient_clip=trainer.gradient_clip_val,
        )
        # DeepSpeed casts the module, keeps fp32 master weights and scales fp16 losses itself
        precision.scaler = None
        precision.sharded_casting = True
        self._engine, ds_optimizer = deepspeed_engine.initialize(self.lightning_module, self.optimizers[0], config)
        self.model = self._engine
        self.optimizers = [ds_optimizer]

    # ---- training step pieces ----------------------------------------------------------------

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Around a non-final accumulation micro-batch (its forward and backward): what ``accumulation``
        defers to the last one (FSDP2: ``FSDPAccumulation.deferred``; DDP: ``no_sync`` unless
        ``"reduce_each"``)."""
        if self._fsdp_accumulation is not None:
            with self._fsdp_accumulation.deferred():
                yield None
        elif isinstance(self.model, nn.parallel.DistributedDataParallel) and self._accumulation_mode != "reduce_each":
            with self.model.no_sync():
                yield None
        else:
            yield None

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._engine is None:
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
            if self._fsdp_accumulation is not None:  # the step's last backward resharded: units back to normal
                self._fsdp_accumulation.after_backward()
            return loss
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # Lightning already divided the loss by accumulate_grad_batches
        self._engine.backward(closure_loss, scale_wrt_gas=False)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        from lightning.pytorch.trainer import call

        result = closure()
        trainer = self.lightning_module.trainer
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self._engine.step()  # steps at accumulation boundaries, clips per the config
        return result

    # ---- checkpoints: the DeepSpeed engine writes its own shards ---------------------------------

    @property
    @override
    def async_checkpoint(self) -> bool:
        return self.config.backend != "deepspeed" and super().async_checkpoint

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._fsdp_accumulation is not None:  # a fit stopped between micro-batches holds nothing gathered
            self._fsdp_accumulation.finish()

    @override
    def _write_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        if self._fsdp_accumulation is not None:  # DCP maps the optimizer's state through the sharded parameters
            self._fsdp_accumulation.release()
        if self._engine is None:
            return super()._write_checkpoint(path, extra)
        deepspeed_engine.save(self._engine, path, extra, rank=self.global_rank)

    @override
    def _read_checkpoint(self, path: Path, weights_only: bool) -> dict[str, Any]:
        if self._fsdp_accumulation is not None:  # the loaded shards must be what the next forward gathers
            self._fsdp_accumulation.release()
        if self._engine is None:
            return super()._read_checkpoint(path, weights_only)
        return deepspeed_engine.load(self._engine, path, weights_only=weights_only)
