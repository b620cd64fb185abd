"""RooflineMonitor: FLOPs, bytes and kernel time per op group on a sampled step; chart + JSON; the
profiled steps' traces (Chrome and TensorBoard) on request."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from typing_extensions import override

from lightning_perf.callbacks._utils import device_of, log_dir_of
from lightning_perf.perf.flops import OpCounter
from lightning_perf.perf.peaks import DTYPES, compute_dtype_name, device_peak
from lightning_perf.perf.roofline import RooflineGroup, build_groups, plot_roofline, profiler_op_times
from lightning_perf.perf.trace import export_traces

__all__ = ["RooflineMonitor"]


class RooflineMonitor(Callback):
    """Where a step's time goes on the roofline, per op category and per module.

    On step ``start_step`` (and every ``every_n_steps`` after, 0 = once) the step runs
    under ``OpCounter`` (FLOPs and bytes per aten op, by module), and the next
    ``profile_steps`` steps under ``torch.profiler`` (self time per op: device kernels on GPU,
    CPU time on CPU; the mean over the profiled steps). The two are joined by op name, then
    grouped by category (matmul, attention, norm, elementwise, communication, copy) and by
    module; each group gets its arithmetic intensity, achieved FLOP/s and bandwidth, and a
    class: compute-, memory- or overhead-bound. The roofline chart (PNG) and the numbers
    (JSON) go to the trainer's log dir; the chart also goes to TensorBoard when a
    TensorBoardLogger is attached. Ops inside ``torch.compile`` regions are not seen by the
    counter (they show up only as profiler time).

    With ``traces=True`` the same profile is also saved, on rank 0, as a Chrome trace
    (``trace_step<N>.json.gz``, for Perfetto or ``chrome://tracing``) and a TensorBoard trace
    (``tb_trace/rank0.<time>.pt.trace.json.gz``, written by ``tensorboard_trace_handler``) in the
    log dir. Without known peaks (a CPU and no ``peak_flops``/``peak_bandwidth``) a monitor with
    ``traces=True`` profiles from ``start_step`` and saves the traces only. A step is not
    profiled while another ``torch.profiler`` runs (the next one is).

    Args:
        peak_flops, peak_bandwidth: device peaks (FLOP/s, bytes/s); from the table on GPU,
            required on CPU.
        dtype: compute dtype for the table lookup; default from ``Trainer(precision=...)``.
        start_step, every_n_steps: which steps to count (the following ones are profiled).
        profile_steps: how many consecutive steps each sample profiles.
        traces: save each profile as a Chrome trace and a TensorBoard trace.
        module_depth: module names are cut to this many components.
        overhead_fraction: below this share of its roof a group is overhead-bound.
        filename: stem of the PNG/JSON files (the step is appended).
    """

    def __init__(
        self,
        *,
        peak_flops: Optional[float] = None,
        peak_bandwidth: Optional[float] = None,
        dtype: Optional[str] = None,
        start_step: int = 20,
        every_n_steps: int = 0,
        profile_steps: int = 1,
        traces: bool = False,
        module_depth: int = 3,
        overhead_fraction: float = 0.05,
        filename: str = "roofline",
    ) -> None:
        super().__init__()
        for name, value in (("peak_flops", peak_flops), ("peak_bandwidth", peak_bandwidth)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if start_step < 0 or every_n_steps < 0 or module_depth < 1 or not 0 <= overhead_fraction < 1 \
                or profile_steps < 1:
            raise ValueError(f"need start_step >= 0 ({start_step}), every_n_steps >= 0 ({every_n_steps}), "
                             f"profile_steps >= 1 ({profile_steps}), module_depth >= 1 ({module_depth}), "
                             f"0 <= overhead_fraction < 1 ({overhead_fraction})")
        if every_n_steps and every_n_steps <= profile_steps:
            raise ValueError(f"every_n_steps ({every_n_steps}) must exceed profile_steps ({profile_steps}): a sample "
                             f"counts one step and profiles {profile_steps}")
        self.peak_flops_arg, self.peak_bandwidth_arg, self.dtype = peak_flops, peak_bandwidth, dtype
        self.start_step, self.every_n_steps = start_step, every_n_steps
        self.profile_steps, self.traces = profile_steps, traces
        self.module_depth, self.overhead_fraction, self.filename = module_depth, overhead_fraction, filename
        self.peak_flops: Optional[float] = None
        self.peak_bandwidth: Optional[float] = None
        self.results: list[dict[str, Any]] = []
        self.files: list[str] = []
        self.trace_files: list[str] = []
        self.sampled_steps: list[int] = []  # counted and profiled steps
        self._target = start_step
        self._step = 0
        self._counter: Optional[OpCounter] = None
        self._counted: Optional[OpCounter] = None
        self._profiler: Any = None
        self._profiled: list[int] = []  # steps of the profile in progress
        self._cuda = False
        self._enabled = True
        self._roofline = True  # peaks known: count and classify (else traces only)

    # ---- lifecycle --------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = device_of(trainer, pl_module)
        self._cuda = device.type == "cuda"
        dtype = self.dtype or compute_dtype_name(getattr(trainer, "precision", None), torch.get_float32_matmul_precision())
        table = device_peak(device)
        self.peak_flops = self.peak_flops_arg or (table.flops_for(dtype) if table else None)
        self.peak_bandwidth = self.peak_bandwidth_arg or (table.memory_bandwidth if table else None)
        self._roofline = bool(self.peak_flops and self.peak_bandwidth)
        self._enabled = self._roofline or self.traces
        if not self._roofline:
            what = "saving traces only" if self.traces else "RooflineMonitor is off for this fit"
            rank_zero_warn(f"RooflineMonitor: no peak FLOP/s or bandwidth known for {device}; pass peak_flops= and "
                           f"peak_bandwidth= ({what})")
        if not self._enabled:
            return
        self._step, self._target = 0, self.start_step
        self._profiled = []
        if self._target == 0:
            self._start_sample(pl_module)

    def _start_sample(self, pl_module: LightningModule) -> None:
        """Count this step (then profile the next ones), or with no roofline to draw, profile it."""
        if not self._roofline:
            self._start_profiler()
            return
        if _get_current_dispatch_mode() is not None:  # another detector owns this step: try the next one
            self._target += 1
            return
        self._counter = OpCounter(module_depth=self.module_depth, root=pl_module)
        self._counter.__enter__()

    def _start_profiler(self) -> bool:
        if torch.autograd._profiler_enabled():  # another profiler owns this step: try the next one
            self._target = self._step + 1
            return False
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        return True

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._enabled:
            return
        step = self._step
        self._step += 1
        if self._profiler is not None:  # a profiled step just ended
            self._profiled.append(step)
            if len(self._profiled) < self.profile_steps:
                return
            self._finish(trainer)
        elif self._counter is not None:  # the counted step just ended: profile the next ones
            self._counter.__exit__(None, None, None)
            self._counted, self._counter = self._counter, None
            if not self._start_profiler():
                self._counted = None  # the count is kept only with the profile of the steps after it
            return
        if self._profiler is None and self._step == self._target:
            self._start_sample(pl_module)

    def _finish(self, trainer: Trainer) -> None:
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        profiled, self._profiled = self._profiled, []
        counted, self._counted = self._counted, None
        first = profiled[0] - (1 if counted is not None else 0)
        self.sampled_steps += list(range(first, profiled[-1] + 1))
        self._target = max(first + self.every_n_steps, self._step) if self.every_n_steps else -1
        if self.traces and trainer.is_global_zero:
            steps = f"{profiled[0]}" if len(profiled) == 1 else f"{profiled[0]}-{profiled[-1]}"
            files = export_traces(prof, log_dir_of(trainer), f"trace_step{steps}",
                                  worker_name=f"rank{trainer.global_rank}")
            self.trace_files += files
            self.files += files
            rank_zero_info(f"RooflineMonitor: traces of step {steps}: " + ", ".join(files))
        if counted is None:
            return
        assert self.peak_flops and self.peak_bandwidth
        times = {op: t / len(profiled) for op, t in profiler_op_times(prof.key_averages(), device=self._cuda).items()}
        records = list(counted.records.values())
        kw = dict(peak_flops=self.peak_flops, peak_bandwidth=self.peak_bandwidth,
                  overhead_fraction=self.overhead_fraction)
        categories = build_groups(records, times, key="category", **kw)
        modules = build_groups(records, times, key="module", **kw)
        result = {
            "step": first,
            "profiled_steps": profiled,
            "device": str(device_of(trainer, trainer.lightning_module)),
            "peak_flops": self.peak_flops,
            "peak_bandwidth": self.peak_bandwidth,
            "bound": self.dominant_bound(categories),
            "categories": [g.as_dict() for g in categories],
            "modules": [g.as_dict() for g in modules],
            "unmatched_profiler_seconds": sum(t for k, t in times.items()
                                              if k not in {r.op for r in records} and k.startswith("aten::")),
        }
        self.results.append(result)
        if trainer.is_global_zero:
            self._write(trainer, result, categories)

    def _write(self, trainer: Trainer, result: dict[str, Any], categories: list[RooflineGroup]) -> None:
        out = log_dir_of(trainer)
        stem = os.path.join(out, f"{self.filename}_step{result['step']}")
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=2)
        png = plot_roofline(categories, peak_flops=self.peak_flops, peak_bandwidth=self.peak_bandwidth,
                            path=stem + ".png", title=f"step {result['step']}")
        self.files += [stem + ".json", png]
        rank_zero_info(f"RooflineMonitor: step {result['step']} is mostly {result['bound']}-bound; wrote {png}")
        self._log_image(trainer, png, result["step"])

    @staticmethod
    def _log_image(trainer: Trainer, png: str, step: int) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                import matplotlib.image as mpimg

                image = mpimg.imread(png)[..., :3]  # HWC float in [0, 1]
                logger.experiment.add_image("perf/roofline", image, global_step=step, dataformats="HWC")

    @staticmethod
    def dominant_bound(groups: list[RooflineGroup]) -> Optional[str]:
        """The class holding the largest share of time."""
        shares: dict[str, float] = {}
        for g in groups:
            shares[g.bound] = shares.get(g.bound, 0.0) + g.time_share
        return max(shares, key=shares.get) if shares else None

    def _abort(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None
        self._counted = None
        self._profiled = []

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._abort()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._abort()

    def summary(self) -> dict[str, Any]:
        last = self.results[-1] if self.results else {}
        return {"bound": last.get("bound"), "categories": last.get("categories", []), "files": list(self.files),
                "traces": list(self.trace_files)}
