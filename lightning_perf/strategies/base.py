"""``PerfParallelStrategy``: a pack strategy over torch.distributed with DCP checkpoints.

What every strategy of the pack shares, so that ``ZeroStrategy`` and ``Parallel3DStrategy``
keep only what differs:

- precision: always a ``PerfPrecision`` (Lightning would install its generic plugin, which
  knows neither FSDP2's mixed-precision policy nor world-consistent fp16 loss scaling);
- processes: one per device, started by Lightning's subprocess launcher once the strategy's
  checks of the model, the data module and the options pass in the launching process
  (``_check_before_launch``, so a bad input raises there, once); each process repeats them
  before its process group starts (with a collective timeout) and the strategy then builds
  its device mesh. Just before the group is created, every callback of the fit that has a
  ``prepare_process_group(trainer, backend)`` method is called (``RankWatchdog`` sets the NCCL
  flight recorder's variables there, which torch reads when the group is created);
- collectives over the whole world: ``barrier``, ``broadcast``, ``reduce``;
- checkpoints: a sharded DCP directory (``lightning_perf.parallel.checkpointing.checkpoint``) that every
  rank writes and reads, model and optimizer state together, resharded on load; written in the
  background with ``async_checkpoint`` (``lightning_perf.parallel.checkpointing.async_checkpoint``): the save
  in flight is polled at each batch start, waited for before the next save, a load, the end of
  the fit and on an exception, and ``remove_checkpoint`` waits for it to be final before deleting.
  Once the first optimizer step has made the optimizer's state, the host memory the saves stage
  into is reserved (pinned on CUDA), where the host can hold it (``AsyncCheckpointer.reserve``).
  ``foreground_checkpoints()`` makes the saves inside it write in the calling thread (what a
  preemption falls back to when a background save failed).
  ``ModelCheckpoint(save_last="link")`` moves its ``last`` link through ``link_checkpoint``: in one
  rename, once the checkpoint it points at is final; a checkpoint a link points at is deleted only
  after the link has moved (``lightning_perf.runtime.resume``);
- resuming: before the fit runs (in the launcher, so before Lightning resolves ``ckpt_path``), one
  process repairs what a crash left in the checkpoint folders, and ``ckpt_path="last"`` without a
  complete ``last`` resumes from the newest complete checkpoint or refuses
  (:func:`lightning_perf.runtime.resume.resume_path`), never silently from step 0;
- preemption: a :class:`~lightning_perf.callbacks.PreemptionCheckpoint` joins the fit's callbacks
  unless it has one: SIGTERM, SIGUSR1 and SIGINT stop every rank at the same step with a final
  checkpoint;
- dead ranks: a :class:`~lightning_perf.callbacks.RankWatchdog` joins the fit's callbacks unless it
  has one: a failed collective names the rank at fault and the flight recorder's dumps, and a rank
  left blocked by a dead peer ends itself a collective ``timeout`` later instead of hanging the job
  (attach your own ``RankWatchdog(...)`` for other settings).

A strategy names where it differs by overriding the small methods below:
``_build_device_mesh`` (required), ``_check_world_size``, ``_check_before_launch``,
``_check_before_process_group``, ``_check_precision``, ``_fp8_gather_module``,
``_write_checkpoint`` / ``_read_checkpoint``, and ``perf_settings`` (what it tells the
performance callbacks).

Options: each strategy's constructor takes its options as typed parameters (what LightningCLI and
the recipes instantiate) and hands them to the base as one validated dataclass, ``config``
(``ZeroConfig``, ``Parallel3DConfig``), built by :func:`config_from_arguments` from the
constructor's own arguments: the dataclass's fields are the parameters of the same names, so no
option is copied by hand, and every other method reads ``self.config``.

Checkpoint layout: the checkpoint's ``extra`` is Lightning's checkpoint dict itself (loop
state, callbacks, schedulers, the precision plugin's loss scaler, ...) without
``state_dict`` and ``optimizer_states``, which are the DCP shards. Checkpoints that hold
that dict nested as ``extra["lightning"]`` load too.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from abc import abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, TypeVar, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_perf.callbacks.garbage import DefaultCollection, GarbageCollection
from lightning_perf.callbacks.watchdog import RankWatchdog
from lightning_perf.kernels.torchao_fp8 import uses_delayed_fp8
from lightning_perf.parallel.checkpointing import checkpoint as ckpt
from lightning_perf.parallel.checkpointing.async_checkpoint import AsyncCheckpointer, async_save_supported
from lightning_perf.parallel.sharding.fp8_all_gather import (
    precompute_fp8_scales,
    require_fp8_config,
    require_fp8_linears,
)
from lightning_perf.perf.collection import DEFAULT_EVERY_N_STEPS, check_every_n_steps
from lightning_perf.perf.run_settings import PerfSettings
from lightning_perf.plugins.precision import PRECISIONS, PerfPrecision
from lightning_perf.runtime import resume
from lightning_perf.runtime.planning import resolve_auto_settings
from lightning_perf.runtime.preemption import attach_preemption

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PerfParallelStrategy", "StrategyConfig", "config_from_arguments"]

# Lightning's checkpoint entries that the DCP shards hold instead
_SHARDED_KEYS = ("state_dict", "optimizer_states")

C = TypeVar("C")


class StrategyConfig(Protocol):
    """What the base reads of every strategy's options (``ZeroConfig``, ``Parallel3DConfig``)."""

    fp8_all_gather: bool


def config_from_arguments(config_cls: type[C], arguments: dict[str, Any]) -> C:
    """``config_cls`` (a dataclass of options) built from a constructor's own arguments (its ``locals()``).

    Every field of the dataclass is taken from the argument of the same name, so an option is written
    once in the constructor's signature (typed, for LightningCLI) and once in the dataclass (where it is
    validated), and never copied field by field. A field without an argument of its name is an error
    of the strategy's code, raised at once.
    """
    names = [f.name for f in fields(config_cls) if f.init]  # type: ignore[arg-type]
    missing = [n for n in names if n not in arguments]
    if missing:
        raise TypeError(f"{config_cls.__name__} fields {missing} are not arguments of the strategy's constructor")
    return config_cls(**{n: arguments[n] for n in names})


def _as_perf_precision(plugin: Precision, strategy: str) -> PerfPrecision:
    """``plugin`` itself if a ``PerfPrecision``, else a ``PerfPrecision`` of the same precision."""
    if isinstance(plugin, PerfPrecision):
        return plugin
    precision = getattr(plugin, "precision", None)
    if precision not in PRECISIONS:
        raise ValueError(
            f"{strategy} does not support precision={precision!r} ({type(plugin).__name__}); the supported "
            f"precisions are {', '.join(PRECISIONS)}: pass one of them as Trainer(precision=...) "
            "or as a PerfPrecision plugin"
        )
    return PerfPrecision(precision)


def builds_in_configure_model(module: Any) -> bool:
    """Whether ``module`` may build (part of) its network in ``configure_model``, after the launch.

    Such a module is not yet the network it trains when the processes start: checks that look
    at its submodules wait for ``setup``, checks of its numbers (``module.config``) need not.
    """
    if not isinstance(module, LightningModule):
        return False
    # Lightning still calls the deprecated configure_sharded_model in its place
    return is_overridden("configure_model", module) or is_overridden("configure_sharded_model", module)


def _find_instance(cls: type, args: tuple, kwargs: dict[str, Any]) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, cls):
            return value
    return None


class _CheckingLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, running the strategy's checks before it starts any process.

    A bad model or layout then raises once, in the launching process, instead of once per rank.
    """

    def __init__(self, strategy: "PerfParallelStrategy", *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        # fit/validate/test/predict set the module before launching; the data module is an argument
        module = self._strategy.lightning_module or _find_instance(LightningModule, args, kwargs)
        datamodule = _find_instance(LightningDataModule, args, kwargs)
        self._strategy._check_before_launch(module, datamodule)
        args, kwargs = self._strategy._prepare_resume(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _InPlaceLauncher(_Launcher):
    """For processes a cluster started (torchrun, SLURM): the function runs in place, after the resume
    preparation that ``_CheckingLauncher`` does where Lightning starts the processes."""

    def __init__(self, strategy: "PerfParallelStrategy") -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        args, kwargs = self._strategy._prepare_resume(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        pass  # the cluster started the processes and stops them


def _link_through_strategy(trainer: "pl.Trainer", filepath: str, linkpath: str) -> None:
    """``ModelCheckpoint._link_checkpoint`` while a pack strategy trains: see ``link_checkpoint``."""
    strategy = trainer.strategy
    if isinstance(strategy, PerfParallelStrategy):
        strategy.link_checkpoint(filepath, linkpath)
    else:
        ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)


def _lightning_checkpoint(extra: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict from a checkpoint's ``extra``, in either layout."""
    nested = extra.get("lightning")
    if len(extra) == 1 and isinstance(nested, dict):
        return nested
    return extra


class PerfParallelStrategy(ParallelStrategy):
    """The base of the pack's strategies: one process per device, PerfPrecision, DCP checkpoints.

    Args:
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` picks the device's default.
        timeout: how long a collective may wait (seconds or a ``timedelta``) before the ranks
            fail instead of hanging; pair it with ``RankWatchdog`` to name the rank at fault.
        async_checkpoint: write checkpoints in the background (``True``) or in the save call
            (``False``); ``None``: in the background on CUDA devices, where a save's state is
            staged to host memory and training goes on while it is written (only the staging
            copy holds the step up), in the save call on the CPU, where the staging copy is the
            write's own cost.
        gc_every_n_steps: Python's garbage collector runs every this many global steps on every
            rank, with its automatic collections off during ``fit`` (so no rank pauses at its own
            moment while the others wait in the next collective; see
            ``lightning_perf.callbacks.GarbageCollection``); ``None``: Python's automatic collector,
            as the program has it. A ``GarbageCollection`` callback attached to the Trainer decides
            instead.
        config: the strategy's validated options (see :func:`config_from_arguments`), set before
            anything else reads them (Lightning's constructor already checks the precision with them).
        The others are Lightning's ``ParallelStrategy`` arguments.
    """

    #: the strategy's options, one validated dataclass (``ZeroConfig``, ``Parallel3DConfig``)
    config: StrategyConfig

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
        async_checkpoint: Optional[bool] = None,
        gc_every_n_steps: Optional[int] = DEFAULT_EVERY_N_STEPS,
        *,
        config: StrategyConfig,
    ) -> None:
        self.config = config
        check_every_n_steps(gc_every_n_steps, allow_none=True, name="gc_every_n_steps")
        if async_checkpoint and not async_save_supported():
            raise ValueError(
                "async_checkpoint=True needs torch.distributed's state-dict copies (_state_dict_utils) and the gloo backend, "
                "which this torch build lacks: pass async_checkpoint=False or None"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._device_mesh: Optional[DeviceMesh] = None
        self.num_nodes = 1
        self._async_option = async_checkpoint
        self._checkpointer: Optional[AsyncCheckpointer] = None
        self._foreground = False  # inside foreground_checkpoints()
        self._staging_reserved = False  # AsyncCheckpointer.reserve was called this fit
        self._collection = DefaultCollection(gc_every_n_steps)
        self._held_removals: list[Path] = []  # checkpoints a link still points at (rank 0)

    # ---- what each strategy names ------------------------------------------------------------

    @abstractmethod
    def _build_device_mesh(self) -> "DeviceMesh":
        """This strategy's mesh over the world (the process group exists)."""

    def _check_world_size(self, world_size: int) -> None:
        """Raise if the strategy cannot run on ``world_size`` processes (runs before any is launched)."""

    def _check_before_launch(self, module: Optional["pl.LightningModule"], datamodule: Any) -> None:
        """Raise for a model, data module or option this strategy cannot run: every check that needs no process.

        Runs in the launching process before any other process starts, and again in every
        process before its process group (where no launcher ran: torchrun, SLURM). ``module`` is
        as constructed: see :func:`builds_in_configure_model` for what can be checked in it.
        """
        self._check_precision(self.precision_plugin.precision, self.root_device.type)
        trainer = getattr(module, "_trainer", None)
        if isinstance(trainer, Trainer) and datamodule is not None:
            # "auto" settings and a configuration too large for the card are settled before any process starts
            resolve_auto_settings(trainer, module, datamodule)

    def _check_fp8_all_gather(self, module: "pl.LightningModule") -> None:
        """With ``fp8_all_gather``, the model must have FP8 linears (or, built later, an FP8 config)."""
        if not self.config.fp8_all_gather:
            return
        require_fp8_config(module) if builds_in_configure_model(module) else require_fp8_linears(module)

    def _check_delayed_fp8(self, module: Optional["pl.LightningModule"], dtensors: Optional[str]) -> None:
        """Refuse delayed FP8 scaling where ``dtensors`` (what makes the weights DTensors; None: nothing) applies.

        Its amax history belongs to the pack's FP8 matmul, which takes plain weights only.
        """
        if module is None or dtensors is None:
            return
        if uses_delayed_fp8(module):
            raise ValueError(
                f"fp8='delayed' keeps an amax history in each FP8 linear for plain weights, but {dtensors} "
                f"makes {type(module).__name__}'s weights DTensors: use fp8='tensorwise' (scales from the current "
                "amax) with this layout, or fp8='delayed' on one device or with replicated weights "
                "(ZeroStrategy(stage=1), Parallel3DStrategy with zero_stage=0 and tensor_parallel_size=1)")

    def _check_before_process_group(self) -> None:
        """Raise for a configuration that would fail in a collective: every check that needs no other rank."""
        module = self.lightning_module
        self._check_before_launch(module, getattr(getattr(module, "_trainer", None), "datamodule", None))

    def _check_precision(self, precision: str, device_type: Optional[str] = None) -> None:
        """Raise for a precision of ``PerfPrecision`` that this strategy cannot run (``device_type``: once known)."""

    def _fp8_gather_module(self) -> Optional[nn.Module]:
        """The module whose FP8 all-gathers need their scales recomputed when its weights change (None: none)."""
        return None

    def _write_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        """Every rank writes its model and optimizer shards to ``path``, rank 0 ``extra`` beside them."""
        assert self.lightning_module is not None
        if self.async_checkpoint and not self._foreground:
            self._async_checkpointer().save(path, self.lightning_module, self.optimizers, extra=extra)
        elif self._checkpointer is not None:  # in this thread, on the saves' gloo group (no device memory)
            self._checkpointer.save_now(path, self.lightning_module, self.optimizers, extra=extra)
        else:
            ckpt.save_checkpoint(path, self.lightning_module, self.optimizers, extra=extra)

    def _async_checkpointer(self) -> AsyncCheckpointer:
        """The background saver (every rank calls this together: it may create its group now)."""
        if self._checkpointer is None:
            self._checkpointer = AsyncCheckpointer(timeout=self._timeout, device=self.root_device)
        return self._checkpointer

    @contextlib.contextmanager
    def foreground_checkpoints(self) -> Iterator[None]:
        """Saves inside write in the calling thread and are final when ``save_checkpoint`` returns.

        The save in flight is waited for first (its error, if any, is raised). Where saves are
        asynchronous they still coordinate on the background saver's gloo group, so their collectives
        need no device memory.
        """
        self.wait_for_checkpoint()
        previous, self._foreground = self._foreground, True
        try:
            yield
        finally:
            self._foreground = previous

    def _read_checkpoint(self, path: Path, weights_only: bool) -> dict[str, Any]:
        """Every rank loads its shards from ``path`` (resharding as needed); returns the saved ``extra``."""
        assert self.lightning_module is not None
        return ckpt.load_checkpoint(
            path,
            self.lightning_module,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )

    @property
    def async_checkpoint(self) -> bool:
        """Whether ``save_checkpoint`` writes in the background (``None``: on CUDA devices)."""
        if self._async_option is not None:
            return bool(self._async_option)
        return self.root_device.type == "cuda" and async_save_supported()

    def wait_for_checkpoint(self) -> Optional[Path]:
        """Block until the checkpoint being written in the background is final; its path (None: none was)."""
        return self._checkpointer.wait() if self._checkpointer is not None else None

    # ---- what the performance callbacks are told ------------------------------------------------

    def perf_settings(self) -> PerfSettings:
        """What this strategy tells the performance callbacks (``lightning_perf.perf.PerfSettings``):
        here its precision; each strategy adds its layout and what it applies to the model."""
        return PerfSettings(precision=self.precision_plugin.precision)

    # ---- precision: one rule for every strategy of the pack ------------------------------------

    @property
    @override
    def precision_plugin(self) -> PerfPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = PerfPrecision("32-true")
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Trainer(precision=...) arrives as Lightning's plugin of that precision
        if plugin is not None:
            plugin = _as_perf_precision(plugin, type(self).__name__)
            self._check_precision(plugin.precision)
        self._precision_plugin = plugin

    # ---- processes -----------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning then adds a DistributedSampler to the loaders

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def device_mesh(self) -> "DeviceMesh":
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists only after setup_environment()")
        return self._device_mesh

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards load into the sharded model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # loaded with the model in load_checkpoint (one DCP read reshards both)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._check_world_size(self.num_nodes * self.num_processes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _CheckingLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _InPlaceLauncher(self)

    def _launching_rank(self) -> int:
        """This process's global rank, from the cluster environment (before ``set_world_ranks``)."""
        env = self.cluster_environment
        try:
            return int(env.node_rank()) * self.num_processes + int(env.local_rank())  # type: ignore[union-attr]
        except Exception:
            return 0

    def _prepare_resume(self, function: Callable, args: tuple, kwargs: dict[str, Any],
                        trainer: Optional["pl.Trainer"]) -> tuple[tuple, dict[str, Any]]:
        """Before Lightning reads ``ckpt_path``: rank 0 repairs the checkpoint folders, and ``"last"``
        becomes what :func:`lightning_perf.runtime.resume.resume_path` finds."""
        if trainer is None:
            return args, kwargs
        try:
            bound = inspect.signature(function).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return args, kwargs
        if "ckpt_path" not in bound.arguments:
            return args, kwargs
        first = self._launching_rank() == 0
        ckpt_path = bound.arguments["ckpt_path"]
        if not first and ckpt_path != "last":
            return args, kwargs
        bound.arguments["ckpt_path"] = resume.resume_path(trainer, ckpt_path, repair=first, announce=first)
        return bound.args, bound.kwargs

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._check_before_process_group()  # a bad configuration never reaches a collective
        self._join_trainer(getattr(self.lightning_module, "_trainer", None))
        self.precision_plugin.device_type = self.root_device.type
        reset_seed()
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        assert self.cluster_environment is not None
        self._attach_collection()
        self._prepare_process_group(self._process_group_backend)
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._device_mesh = self._build_device_mesh()
        if self.lightning_module is not None:  # LightningModule.device_mesh, for configure_model
            self.lightning_module._device_mesh = self._device_mesh

    @property
    def gc_every_n_steps(self) -> Optional[int]:
        """Global steps between the strategy's scheduled garbage collections (None: Python's automatic ones)."""
        return self._collection.every_n_steps

    def _attach_collection(self) -> None:
        """The strategy's collection schedule joins the fit's callbacks, unless the user attached one."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if not isinstance(trainer, Trainer):
            return
        callbacks = trainer.callbacks
        if any(isinstance(c, GarbageCollection) and c is not self._collection for c in callbacks):
            return  # the user's schedule decides
        if self._collection not in callbacks:
            callbacks.append(self._collection)

    def _join_trainer(self, trainer: Optional["pl.Trainer"]) -> None:
        """A ``PreemptionCheckpoint`` and a ``RankWatchdog`` for the fit unless it has them; ``last`` links
        moved by ``link_checkpoint``."""
        if not isinstance(trainer, Trainer):
            return
        attach_preemption(trainer)
        if not any(isinstance(c, RankWatchdog) for c in trainer.callbacks):
            trainer.callbacks.append(RankWatchdog())
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):  # an instance attribute in place of the static method
                callback._link_checkpoint = _link_through_strategy  # type: ignore[method-assign]

    def _prepare_process_group(self, backend: str) -> None:
        """Let the fit's callbacks set what torch reads when the group is created (module docstring)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        for callback in getattr(trainer, "callbacks", None) or []:
            prepare = getattr(callback, "prepare_process_group", None)
            if callable(prepare):
                prepare(trainer, backend)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._reset_optimizers_and_schedulers()  # a later fit builds them on the sharded parameters again
        super().setup_optimizers(trainer)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._refresh_fp8_scales()  # the weights just changed
        return result

    def _refresh_fp8_scales(self) -> None:
        module = self._fp8_gather_module()
        if module is not None:
            precompute_fp8_scales(module)

    # ---- collectives ---------------------------------------------------------------------------

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._checkpointer is not None:
            self._checkpointer.poll()  # no wait: finishes the bookkeeping of a save that became final
        self._reserve_staging()

    def _reserve_staging(self) -> None:
        """Once per fit, after the first optimizer step (every rank at the same batch): the staging buffers."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._staging_reserved or not self.async_checkpoint or trainer is None or trainer.global_step < 1:
            return
        self._staging_reserved = True
        assert self.lightning_module is not None
        kept = self._async_checkpointer().reserve(self.lightning_module, self.optimizers,
                                                  ranks_on_host=max(1, self.num_processes))
        if not kept:
            rank_zero_warn("async_checkpoint: the host cannot hold a staging copy of every rank's shards beside "
                           "the run, so each save stages into memory of its own (allocated at the save)",
                           category=RuntimeWarning)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._staging_reserved = False

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.wait_for_checkpoint()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        try:  # a save whose write completed still becomes final; one that cannot, fails within the timeout
            self.wait_for_checkpoint()
        except Exception as e:
            rank_zero_warn(f"{e}", category=RuntimeWarning)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.wait_for_checkpoint()
        self._release_held_removals()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- checkpoints: sharded DCP directories --------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # saved shard by shard in save_checkpoint

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}  # saved shard by shard in save_checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options (it writes DCP shards)")
        path = Path(self.broadcast(str(filepath)))  # rank 0's path: every rank writes into one directory
        extra = {k: v for k, v in checkpoint.items() if k not in _SHARDED_KEYS}
        self._write_checkpoint(path, extra)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.wait_for_checkpoint()  # the newest checkpoint may still be in flight
        path = Path(self.broadcast(str(checkpoint_path)))
        extra = self._read_checkpoint(path, weights_only=True if weights_only is None else weights_only)
        self._refresh_fp8_scales()  # the weights just changed
        return _lightning_checkpoint(extra)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        path = Path(filepath)
        if self._checkpointer is not None:  # deferred while the newer checkpoint is being written
            self._checkpointer.after_final(lambda: self._remove_now(path), removes=path)
            return
        self._remove_now(path)

    def link_checkpoint(self, filepath: Any, linkpath: Any) -> None:
        """Point the link ``linkpath`` at checkpoint ``filepath`` (every rank calls it; rank 0 moves it).

        The link moves in one rename (never missing), and only once ``filepath`` is final: with a save
        in flight, when it is (never dangling). What a link pointed at and was asked to go goes after.
        """
        target, link = Path(filepath), Path(linkpath)
        if os.path.abspath(target) != os.path.abspath(link):
            if self._checkpointer is not None:
                self._checkpointer.after_final(lambda: self._link_now(target, link))
            else:
                self._link_now(target, link)
        self.barrier()

    def _link_now(self, target: Path, link: Path) -> None:
        if self.is_global_zero:
            resume.point_link(link, target)
            self._release_held_removals()

    def _remove_now(self, path: Path) -> None:
        """Rank 0 deletes ``path`` (renamed to ``.del`` first), unless a link of its folder points at it."""
        if not self.is_global_zero:
            return
        if resume.linked_to(path):  # deleted once the link has moved on
            if path not in self._held_removals:
                self._held_removals.append(path)
            return
        resume.discard(path)

    def _release_held_removals(self) -> None:
        held, self._held_removals = self._held_removals, []
        for path in held:
            self._remove_now(path)
