"""``Parallel3DStrategy``: data x tensor x pipeline (x context) parallelism inside the Lightning Trainer.

A thin adapter: the layout maths, the model split and the schedule live in
``lightning_perf.parallel`` (``parallelize_3d``); this class wires them to the
Trainer's hooks. Processes, precision, collectives and DCP checkpoints come from
``PerfParallelStrategy``.

Under pipeline parallelism the protocol model's ``forward(inputs, targets)`` runs the
whole schedule (forward and backward of every microbatch) and returns the batch loss,
detached and broadcast from the last stage, so a LightningModule whose
``training_step`` does ``loss = self.model(x, y)`` works unchanged. Lightning's
closure calls ``optimizer.zero_grad()`` *after* ``training_step`` and before
``backward``, so the gradients the schedule made are set
aside in ``training_step`` and put back in ``backward``, which skips autograd but
still fires the precision and callback hooks. Gradient accumulation scales each
microbatch loss by ``1 / accumulate_grad_batches``. Validation runs forward only.

Under data parallelism gradients are reduced once per optimizer step: with
``accumulate_grad_batches > 1`` the non-final micro-batches (``block_backward_sync``) keep them unreduced
(FSDP2 with a pipeline: unsharded inside FSDP2, the stages resharded after each schedule step; FSDP2
without one: ``FSDPAccumulation`` in ``"reduce_once"``; ZeRO 0: no all-reduce until the last). Within one
schedule step torch's pipelining gathers each FSDP2 unit once and reduce-scatters once, whatever the
number of microbatches. A pipeline's own microbatches are cheaper than accumulation on top of it: each
schedule step fills and drains the pipeline, so ``k`` accumulated batches of ``m`` microbatches pay ``k``
bubbles of ``(p-1)/(m+p-1)``, one batch of ``k * m`` microbatches one of ``(p-1)/(k*m+p-1)``.

Under context parallelism the protocol model's ``forward(inputs, targets)`` cuts the sequence,
runs this rank's part and returns the loss over the whole sequences (``parallel.model_parallel.context_parallel``),
so a ``training_step`` needs no change there either.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_perf.parallel.layout.config_3d import Parallel3DConfig, check_model, check_model_config, settle_pipeline
from lightning_perf.parallel.layout.dims import ParallelDims, data_parallel_mesh
from lightning_perf.parallel.layout.validate import check_data_layout, data_shape
from lightning_perf.parallel.model_parallel.parallelize_3d import Parallelized3D, parallelize_3d
from lightning_perf.parallel.model_parallel.pipeline import (
    AUTO,
    MIN_MICROBATCH_TOKENS,
    PipelineChoice,
    check_schedule_backend,
)
from lightning_perf.parallel.model_parallel.tensor_parallel import tp_sequence_check
from lightning_perf.parallel.model_parallel.tied import check_tied_layout, tied_parameter_names
from lightning_perf.parallel.sharding.accumulation import FSDPAccumulation
from lightning_perf.parallel.sharding.fp8_all_gather import require_fp8_linears
from lightning_perf.parallel.sharding.gradients import allreduce_gradients, clip_grad_norm_3d
from lightning_perf.parallel.sharding.optim import localize_optimizers
from lightning_perf.perf.collection import DEFAULT_EVERY_N_STEPS
from lightning_perf.perf.memory_plan import MemoryLayout
from lightning_perf.perf.run_settings import PerfSettings
from lightning_perf.runtime.planning import PlanLayout
from lightning_perf.strategies.base import PerfParallelStrategy, builds_in_configure_model, config_from_arguments

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Parallel3DStrategy"]


class Parallel3DStrategy(PerfParallelStrategy):
    """Pipeline x data (ZeRO) x context x tensor parallelism over one ("pp", "dp", "cp", "tp") device mesh.

    Args:
        data_parallel_size: replicas of the model (``"auto"``: world size / (tp * pp * cp)).
        replicate_size: HSDP over the dp ranks (needs zero_stage 1-3): FSDP2 shards over groups of
            ``dp / replicate_size`` and replicates over ``replicate_size`` such groups, the mesh's
            "dp" dimension becoming ("dp_replicate", "dp_shard"), replicate outermost, so a shard
            group's ranks are neighbours (one node) and only the replicas' gradient all-reduce crosses
            nodes. ``"auto"``: the fewest replicas whose shard groups each stay inside one node (the
            number of nodes, or ``num_nodes / gcd(num_nodes, pp)`` when pipeline stages share a
            node). 1: one flat "dp" dimension. The data is split over all dp ranks either way.
        tensor_parallel_size: ranks sharing each layer (the model's ``tensor_parallel_plan``).
        pipeline_parallel_size: ranks holding consecutive stages (the model's ``pipeline_stage``).
        context_parallel_size: ranks sharing each sequence: the sequence is cut into ``2 * cp``
            chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (equal causal work);
            attention reaches the other ranks' keys as ``context_parallel_mode`` says. Parameters are
            replicated over "cp": gradients are averaged, and ZeRO shards, over "dp" and "cp"
            together. The sequence length must divide by ``2 * cp``; combines with data and tensor
            parallelism, not with pipeline parallelism yet.
        context_parallel_mode: ``"allgather"`` (default): keys and values all-gathered over "cp";
            ``"ring"``: passed between neighbouring cp ranks while the block already held is
            computed (``parallel.model_parallel.ring_attention``).
        zero_stage: 0 = replicated parameters, gradients all-reduced over "dp" after backward;
            1 and 2 = FSDP2 with parameters kept gathered between forward and backward
            (gradients and optimizer state sharded: stage 1 gives stage 2 here);
            3 = FSDP2 resharding after forward (kept gathered under pipeline parallelism,
            where each microbatch would otherwise re-gather).
        pipeline_schedule: ``"auto"`` (default, see below), ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``,
            ``"looped_bfs"``, ``"zero_bubble"`` (interleaved zero bubble) or ``"zbv_zero_bubble"`` (V placement).
        num_microbatches: per step; ``"auto"`` (default, see below); ``None`` = the number of stages (at least pp).
        stages_per_rank: model stages per pipeline rank (interleaved schedules); ``"auto"`` (default, see below).
        min_microbatch_tokens: the smallest microbatch (sequences x sequence length) ``"auto"`` cuts a
            batch into (default ``MIN_MICROBATCH_TOKENS`` = 8192, measured on H200 with gpt-1.3b).

            ``"auto"`` (``parallel.model_parallel.pipeline.choose_schedule``): the most microbatches that
            keep ``min_microbatch_tokens`` each (at least pp where the batch has pp sequences), then the
            schedule of smallest theoretical bubble among 1F1B, GPipe and interleaved 1F1B on 2 stages
            per rank (where the blocks fill ``2 * pp`` stages). Values set explicitly are kept. The stages
            per rank are settled when the model is split, from the data module's ``batch_size`` and
            ``seq_len`` where it has them (else 1 stage per rank unless set); the schedule and the
            microbatches at the first batch, logged once at INFO with the theoretical bubble, and kept
            in :attr:`pipeline_choice`. A later batch of another shape is refused (``drop_last=True``).
        sequence_parallel: under TP, shard the norms and the residual stream along the sequence
            (True), along the batch (``"batch"``: whole sequences per rank, so the all-gathers and
            reduce-scatters need no re-layout copies; a batch should divide by the TP size, a
            ragged one is padded with ignored targets when the model names one, e.g. the GPT's),
            or not at all (False).
        async_tensor_parallel: micro-pipelined TP (CUDA and torch.compile only).
        tp_overlap: with ``compile`` under TP, how Inductor orders each block's collectives so the
            backward's reduce-scatters and all-gathers run under the weight-gradient matmuls:
            ``"reorder"`` (default: collectives early, waits late, independent compute moved
            between them), ``"reorder_peak_memory"`` (collectives moved only where the graph's
            peak memory allows), ``"schedule"`` (Inductor's runtime-estimated overlap scheduler;
            CUDA, ``"reorder"`` elsewhere) or ``"none"`` (each collective waited where issued).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"`` per block.
        meta_init: build the model on the meta device in ``configure_model`` and
            initialise only the local shards after sharding (for models larger than a device).
        fsdp_prefetch: blocks all-gathered ahead by FSDP2.
        fsdp_blocks_per_unit: consecutive blocks of a stage sharded as one FSDP2 unit over "dp"
            (fewer all-gathers / reduce-scatters and less FSDP2 hook work per step; see
            ``ZeroStrategy(blocks_per_unit=...)``); needs zero_stage 1-3.
        fp8_all_gather: with FP8 linears, all-gather their weights over "dp" in FP8 (each shard
            quantised with the whole weight's scale; see ``ZeroStrategy``); needs ZeRO with
            dp > 1 and tensor_parallel_size=1.
        compile: ``torch.compile`` mode (``"default"``, ``"max-autotune"``, ...) applied after
            tensor parallelism and before FSDP2: per block, or under TP per attention/MLP
            sublayer (removes the eager DTensor dispatch cost). ``None``: off; blocks the
            module compiled itself are kept (re-scoped to sublayers under TP).
        compile_backend: the ``torch.compile`` backend (``"aot_eager"`` isolates inductor).
        timeout: how long a collective may wait (seconds or a ``timedelta``) before the ranks
            fail instead of hanging; pair it with ``RankWatchdog`` to name the rank at fault.
        async_checkpoint: write checkpoints in the background while training goes on (``None``:
            on CUDA devices); see ``PerfParallelStrategy``.
        gc_every_n_steps: Python's garbage collector on a fixed schedule, the same steps on every
            rank (``None``: automatic); see ``PerfParallelStrategy``.

    The 3D model protocol: data parallelism and ZeRO need nothing from the model; tensor and
    pipeline parallelism need methods on the network (the LightningModule or a submodule, such
    as its ``model``):

    - ``tensor_parallel_plan(self, tp_mesh) -> dict``: a ``parallelize_module`` plan (for
      ``tensor_parallel_size > 1``);
    - ``pipeline_stage(self, stage_idx, num_stages) -> nn.Module``: this stage's part, the first
      stage owning the embedding and the last the final norm, head and loss (for
      ``pipeline_parallel_size > 1``); a parameter both of these stages use (a tied embedding and
      LM head) is held by both stage ranks and kept equal (``parallel.model_parallel.tied``), one the config
      declares with ``tie_embeddings`` where the network is built in ``configure_model``; optionally, on the
      last stage, ``pipeline_loss(output, targets)``: one microbatch's loss from what the stage returns (the
      GPT's last stage returns the final norm's output and applies the head and the cross-entropy there, in
      its compiled or fused ``lm_head_loss``), else the stage returns logits and the pipeline takes their
      mean cross-entropy;
    - ``enable_context_parallel(self, attention)``: route every attention core through
      ``attention(q, k, v)``, with ``forward(idx, targets=None, *, positions=None)`` taking the
      tokens' global positions (for ``context_parallel_size > 1``);
    - optionally, on the model's ``config``, ``check_parallel_layout(tensor_parallel_size=...,
      pipeline_parallel_size=..., stages_per_rank=...)``, raising ``ValueError`` for a layout the
      model cannot be split into;
    - with ``meta_init=True``, ``init_weights()`` (else each submodule's ``reset_parameters()``)
      to initialise the local shards.

    The pack's GPT (``lightning_perf.models.GPT``) implements it. The model and the layout are
    checked in the launching process, before any other process or a process group starts; a
    module that builds its network in ``configure_model`` has its ``config`` checked there and
    the protocol methods in ``setup``.
    """

    strategy_name = "parallel3d"
    config: Parallel3DConfig

    def __init__(
        self,
        data_parallel_size: Union[int, str] = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        zero_stage: int = 2,
        pipeline_schedule: str = AUTO,
        num_microbatches: Union[int, str, None] = AUTO,
        stages_per_rank: Union[int, str] = AUTO,
        min_microbatch_tokens: int = MIN_MICROBATCH_TOKENS,
        sequence_parallel: Union[bool, str] = True,
        async_tensor_parallel: bool = False,
        tp_overlap: str = "reorder",
        tp_split: int = 1,
        activation_checkpointing: str = "none",
        meta_init: bool = False,
        fsdp_prefetch: int = 1,
        fsdp_blocks_per_unit: int = 1,
        fp8_all_gather: bool = False,
        compile: Optional[str] = None,
        compile_backend: str = "inductor",
        context_parallel_size: int = 1,
        context_parallel_mode: str = "allgather",
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        async_checkpoint: Optional[bool] = None,
        replicate_size: Union[int, str] = 1,
        gc_every_n_steps: Optional[int] = DEFAULT_EVERY_N_STEPS,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout, async_checkpoint=async_checkpoint,
            gc_every_n_steps=gc_every_n_steps,
            # numbers only: a bad layout fails here, long before any process group exists
            config=config_from_arguments(Parallel3DConfig, locals()), **kwargs
        )
        self.meta_init = meta_init
        self._parallel: Optional[Parallelized3D] = None
        self._pp_grads: Optional[list[Optional[Tensor]]] = None
        self._accumulation: Optional[FSDPAccumulation] = None  # FSDP2 without a pipeline: reduce once per step
        self._deferring = False  # inside a non-final accumulation micro-batch (block_backward_sync)

    # ---- layout ------------------------------------------------------------------------------

    @property
    def parallel(self) -> Parallelized3D:
        if self._parallel is None:
            raise RuntimeError("the model is parallelised in setup()")
        return self._parallel

    @property
    def pipeline_choice(self) -> Optional[PipelineChoice]:
        """What the pipeline runs (schedule, microbatches, stages per rank, the batch it was chosen for, the
        theoretical bubble), chosen or as set; ``None`` without a pipeline or before its first batch."""
        runner = self._parallel.runner if self._parallel is not None else None
        return runner.choice if runner is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Each dp replica loads its own part of the data; tp, pp and cp ranks of a replica load the same.

        Under HSDP "dp" is the flattened (dp_replicate, dp_shard) dimension: every dp rank, whichever
        group, loads its own part. Read off the layout, whose coordinates are the mesh's (no mesh needed)."""
        dims = self.layout()
        return {"num_replicas": dims.data_parallel_size, "rank": dims.coordinates(self.global_rank)["dp"]}

    def layout(self) -> ParallelDims:
        """The layout on this strategy's processes (``num_nodes`` x ``num_processes``), from the config's numbers."""
        return self.config.dims(self.num_nodes * self.num_processes, self.num_nodes)

    def memory_layout(self, module: Any, *, world_size: int, batch_size: int, seq_len: int) -> PlanLayout:
        """The memory planner's view of this strategy (``lightning_perf.estimate_memory``): the layout, the
        pipeline schedule "auto" settles for ``batch_size`` sequences per replica, and the checkpointing and
        compile the strategy applies itself."""
        c = self.config
        dims = c.dims(world_size, self.num_nodes)
        settled = settle_pipeline(c, None, getattr(module, "config", None), batch_size=batch_size,
                                  seq_len=seq_len).config if c.pipeline_parallel_size > 1 else c
        pipeline = settled.pipeline
        schedule = pipeline.schedule if pipeline is not None else "1f1b"
        m = (pipeline.num_microbatches if pipeline is not None else None) or c.pipeline_parallel_size
        stages = pipeline.stages_per_rank if pipeline is not None else 1
        micro = max(1, batch_size // m) if c.pipeline_parallel_size > 1 else batch_size
        engine = "fsdp" if c.zero_stage >= 2 else ("ddp" if dims.data_parallel_size > 1 else "none")
        replicate = dims.replicate_size if isinstance(dims.replicate_size, int) else 1
        return PlanLayout(
            layout=MemoryLayout(
                data_parallel_size=int(dims.data_parallel_size), replicate_size=replicate,
                tensor_parallel_size=c.tensor_parallel_size, pipeline_parallel_size=c.pipeline_parallel_size,
                context_parallel_size=c.context_parallel_size, zero_stage=c.zero_stage, engine=engine,
                blocks_per_unit=c.fsdp_blocks_per_unit, prefetch=c.fsdp_prefetch, fp8_all_gather=c.fp8_all_gather,
                # under a pipeline no unit reshards after forward, at any stage (apply_data_parallel)
                reshard_after_forward=False if c.pipeline_parallel_size > 1 else None,
                sequence_parallel=c.sequence_parallel is not False, pipeline_schedule=schedule,
                num_microbatches=m if c.pipeline_parallel_size > 1 else 1, stages_per_rank=stages,
                # a pipeline's stages stay gathered over a step's microbatches, their gradients unsharded until
                # the optimizer step's last micro-batch (block_backward_sync); without a pipeline FSDP2 reduces
                # once per optimizer step and gathers for every micro-batch
                accumulation="gather_once" if c.pipeline_parallel_size > 1 else "reduce_once"),
            micro_batch=micro,
            activation_checkpointing=None if c.activation_checkpointing == "none" else c.activation_checkpointing,
            compiled=c.compile is not None or None)

    @override
    def perf_settings(self) -> PerfSettings:
        """The precision, the layout (ZeRO stage, tensor and pipeline sizes, blocks per FSDP2 unit where
        FSDP2 shards) and the per-block compile and activation checkpointing the strategy applies."""
        c = self.config
        return replace(
            super().perf_settings(),
            zero_stage=c.zero_stage,
            tensor_parallel_size=c.tensor_parallel_size,
            pipeline_parallel_size=c.pipeline_parallel_size,
            fsdp_blocks_per_unit=c.fsdp_blocks_per_unit if self._fsdp_shards() else None,
            compile_mode=c.compile,
            compile_scope="block" if c.compile is not None else None,
            activation_checkpointing=c.activation_checkpointing,
        )

    def _fsdp_shards(self) -> bool:
        """Whether FSDP2 shards the model: ZeRO 1-3 over more than one rank of dp x cp (False before the
        strategy knows its processes)."""
        if self._parallel is not None:
            return self._parallel.fsdp
        if not self.num_processes or self.config.zero_stage == 0:
            return False
        return self.layout().dp_cp_size > 1

    @override
    def _check_world_size(self, world_size: int) -> None:
        self.config.dims(world_size, self.num_nodes)  # raises on a bad layout, in the launching process

    @override
    def _check_before_launch(self, module: Optional["pl.LightningModule"], datamodule: Any) -> None:
        super()._check_before_launch(module, datamodule)
        if module is None:
            return
        model_config = getattr(module, "config", None)
        # the data module's numbers (a batch the pipeline cannot split would fail in a collective; "auto"
        # settles the pipeline with them, as setup() will)
        batch_size, seq_len = data_shape(datamodule)
        if not builds_in_configure_model(module):  # the network it will split: the protocol methods, as setup() checks them
            target = check_model(module, self.config)
            settled = settle_pipeline(self.config, target, batch_size=batch_size, seq_len=seq_len)
            config = settled.config
            assert config.pipeline is not None  # settled
            pp_stages = config.pipeline.num_stages if config.pipeline_parallel_size > 1 else 1
            tied = bool(tied_parameter_names(target, pp_stages))
            check_model_config(getattr(target, "config", None), config)
        else:  # built later: its config tells (GPTConfig.tie_embeddings)
            settled = settle_pipeline(self.config, None, model_config, batch_size=batch_size, seq_len=seq_len)
            config = settled.config
            tied = bool(getattr(model_config, "tie_embeddings", False))
        # a module that builds its network later still carries its numbers (GPTLightningModule.config)
        check_model_config(model_config, config)
        if tied:
            check_tied_layout(config.pipeline, zero_sharded=self._fsdp_shards())  # type: ignore[arg-type]
        self._check_fp8_all_gather(module)
        self._check_delayed_fp8(module, self._dtensor_weights())
        check_data_layout(
            batch_size=batch_size,
            seq_len=seq_len,
            model_config=getattr(module, "config", None),
            tensor_parallel_size=config.tensor_parallel_size,
            sequence_parallel=config.sequence_parallel,
            # microbatches still "auto" (no batch shape here) are checked at the first batch
            pipeline=config.pipeline if settled.final else None,
            context_parallel_size=config.context_parallel_size,
        )

    def _dtensor_weights(self) -> Optional[str]:
        """What makes this layout's weights DTensors (tensor parallelism, FSDP2 over dp x cp), or None."""
        tp, zero = self.config.tensor_parallel_size, self.config.zero_stage
        if tp > 1:
            return f"tensor_parallel_size={tp}"
        if self._fsdp_shards():
            dims = self.layout()
            return (f"zero_stage={zero} over dp({dims.data_parallel_size}) * cp({dims.context_parallel_size}) = "
                    f"{dims.dp_cp_size} ranks (FSDP2)")
        return None

    @override
    def _check_before_process_group(self) -> None:
        super()._check_before_process_group()
        assert self._process_group_backend is not None  # resolved before this check (setup_environment)
        check_schedule_backend(self.config.pipeline_schedule, self.config.pipeline_parallel_size,
                               self._process_group_backend)
        dims = self.layout()
        if (
            self.root_device.type == "cuda"
            and (dims.dp_enabled or dims.pp_enabled)
            and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
        ):
            # one hardware queue serialises every stream: FSDP's all-gather/reduce-scatter and the
            # pipeline's send/recv then wait behind compute kernels instead of overlapping them
            rank_zero_warn(
                "CUDA_DEVICE_MAX_CONNECTIONS=1 serialises CUDA streams, so data-parallel and pipeline "
                "communication cannot overlap compute; Parallel3DStrategy does not need it (unset it)"
            )

    @override
    def _build_device_mesh(self) -> Any:
        return self.layout().build_mesh(self.root_device.type)

    @override
    def _fp8_gather_module(self) -> Optional[nn.Module]:
        if self.config.fp8_all_gather and self._parallel is not None:
            return self._parallel.target
        return None

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        meta = torch.device("meta") if (self.meta_init or empty_init) else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    # ---- setup -------------------------------------------------------------------------------

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        precision = self.precision_plugin
        if self.config.fp8_all_gather and self._parallel is None:  # before any collective
            require_fp8_linears(module)
        if self._parallel is None:  # once per strategy: fit then validate/test reuse the split model
            self._parallel = parallelize_3d(
                module, self.config, self.device_mesh, device=self.root_device, mp_policy=precision.mp_policy(),
                batch_shape=data_shape(trainer.datamodule),  # settles "auto" pipeline values as the launch check did
            )
        self._refresh_fp8_scales()
        precision.sharded_casting = self._parallel.fsdp and precision.is_mixed
        # norm clipping must see every stage's and every shard's gradients (not one rank's)
        precision.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if self._parallel.runner is not None:
            self._parallel.runner.announce = rank_zero_info  # the pipeline's choice, once, on the Trainer's console
            self._install_pipeline_forward(self._parallel)
        elif self._parallel.fsdp:  # what memory_layout tells the planner: gradients reduced once per step
            self._accumulation = FSDPAccumulation(self._parallel.fsdp_units, "reduce_once")
        self.model = precision.convert_module(module)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # Adam steps DTensor parameters through their local shards (same math, no dispatch cost)
            localize_optimizers(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _install_pipeline_forward(self, parallel: Parallelized3D) -> None:
        """``target(inputs, targets)`` runs the schedule; names and state dict stay the model's."""
        runner = parallel.runner
        assert runner is not None
        strategy = self

        def pipeline_forward(inputs: Tensor, targets: Optional[Tensor] = None,
                             doc_ids: Optional[Tensor] = None) -> Tensor:
            if doc_ids is not None:
                raise ValueError(
                    "packed documents (doc_ids) are not supported under pipeline parallelism: the schedule sends"
                    " only the tokens between stages; use TokenDataModule(pack_documents=False) or no pipeline"
                )
            if targets is None:
                raise ValueError(
                    "under pipeline parallelism the model is called as model(inputs, targets) and returns the "
                    "loss; logits of the last stage never reach the other ranks"
                )
            # the schedule for this batch shape (chosen at the first batch; an evaluation batch of another
            # shape gets a forward-only one of its own), before any send/recv
            if torch.is_grad_enabled():
                microbatches = runner.prepare(inputs.shape[0], inputs.shape[-1]).num_microbatches or 1
            else:
                microbatches = runner.eval_microbatches(inputs.shape[0], inputs.shape[-1])
            tp_sequence_check(inputs.shape[-1], strategy.config.tensor_parallel_size, strategy.config.sequence_parallel,
                              batch=inputs.shape[0], microbatches=microbatches)
            with strategy._tp_loss_context():
                if torch.is_grad_enabled():
                    scale = strategy.precision_plugin.scale_loss
                    trainer = strategy.lightning_module.trainer if strategy.lightning_module else None
                    accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
                    return runner.train_step(inputs, targets, loss_factor=1.0 / accumulate, scale_loss=scale,
                                             reduce_grads=not strategy._deferring)
                return runner.eval_step(inputs, targets)

        parallel.target.forward = pipeline_forward  # type: ignore[method-assign]

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        tied = self.parallel.tied
        clip_grad_norm_3d(params, float(clip_val), self.device_mesh["pp"].get_group(),
                          counted_elsewhere=tied.counted_elsewhere if tied is not None else ())

    @contextmanager
    def _tp_loss_context(self) -> Generator[None, None, None]:
        # reentrant: a pipeline's forward enters it again inside validation_step, and torch's
        # loss_parallel cannot nest (its exit unregisters the handlers a second time)
        if self.config.tensor_parallel_size <= 1 or getattr(self, "_in_loss_parallel", False):
            yield
            return
        from torch.distributed.tensor.parallel import loss_parallel

        self._in_loss_parallel = True
        try:
            with loss_parallel():
                yield
        finally:
            self._in_loss_parallel = False

    # ---- steps -------------------------------------------------------------------------------

    def _params(self) -> list[Tensor]:
        assert self.lightning_module is not None
        return list(self.lightning_module.parameters())

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._parallel is None or self._parallel.runner is None:
            with self._tp_loss_context():
                return super().training_step(*args, **kwargs)
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            # manual optimisation: the schedule's gradients are in .grad for the user's optimizer.step()
            return super().training_step(*args, **kwargs)
        params = self._params()
        earlier = [p.grad for p in params]  # accumulated by earlier micro-steps, if any
        for p in params:
            p.grad = None
        try:
            out = super().training_step(*args, **kwargs)
        finally:
            # set this step's gradients aside: Lightning calls zero_grad() before backward()
            self._pp_grads = [p.grad for p in params]
            for p, g in zip(params, earlier):
                p.grad = g
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._tp_loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._tp_loss_context():
            return super().test_step(*args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Around a non-final accumulation micro-batch (its forward and backward): gradients are reduced over
        data parallelism at the optimizer step's last micro-batch only. A pipeline's FSDP2 stages keep them
        unsharded inside FSDP2 (``PipelineRunner.train_step(reduce_grads=False)``), FSDP2 without a pipeline
        turns its reduce-scatter off (``FSDPAccumulation`` in ``"reduce_once"``), replicated parameters
        (ZeRO 0) skip their all-reduce."""
        self._deferring = True
        try:
            if self._accumulation is not None:
                with self._accumulation.deferred():
                    yield None
            else:
                yield None
        finally:
            self._deferring = False

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._parallel is not None and self._parallel.runner is not None:
            # the schedule already ran backward: put its gradients back (autograd is skipped)
            grads, self._pp_grads = self._pp_grads or [], None
            for p, g in zip(self._params(), grads):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
        else:
            with self._tp_loss_context():
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if not self.parallel.fsdp and not self._deferring:  # replicated over "dp" and "cp": one average over both
            allreduce_gradients(self._params(), data_parallel_mesh(self.device_mesh).get_group())
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss
