"""RooflineMonitor: FLOPs, bytes and kernel time per op group on a sampled step; chart + JSON."""

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

__all__ = ["RooflineMonitor"]


class RooflineMonitor(Callback):
    """Where a step's time goes on the roofline, per op category and per module.

    On step ``start_step`` (and every ``every_n_steps`` after, 0 = once) the step runs
    under ``OpCounter`` (FLOPs and bytes per aten op, by module), and the next step under
    ``torch.profiler`` (self time per op: device kernels on GPU, CPU time on CPU). The two
    are joined by op name, then grouped by category (matmul, attention, norm,
    elementwise, communication, copy) and by module; each group gets its arithmetic
    intensity, achieved FLOP/s and bandwidth, and a class: compute-, memory- or
    overhead-bound. The roofline chart (PNG) and the numbers (JSON) go to the trainer's
    log dir; the chart also goes to TensorBoard when a TensorBoardLogger is attached.
    Ops inside ``torch.compile`` regions are not seen by the counter (they show up only as
    profiler time).

    Args:
        peak_flops, peak_bandwidth: device peaks (FLOP/s, bytes/s); from the table on GPU,
            required on CPU.
        dtype: compute dtype for the table lookup; default from ``Trainer(precision=...)``.
        start_step, every_n_steps: which steps to count (the following one is profiled).
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
        if start_step < 0 or every_n_steps < 0 or module_depth < 1 or not 0 <= overhead_fraction < 1:
            raise ValueError(f"need start_step >= 0 ({start_step}), every_n_steps >= 0 ({every_n_steps}), "
                             f"module_depth >= 1 ({module_depth}), 0 <= overhead_fraction < 1 ({overhead_fraction})")
        self.peak_flops_arg, self.peak_bandwidth_arg, self.dtype = peak_flops, peak_bandwidth, dtype
        self.start_step, self.every_n_steps = start_step, every_n_steps
        self.module_depth, self.overhead_fraction, self.filename = module_depth, overhead_fraction, filename
        self.peak_flops: Optional[float] = None
        self.peak_bandwidth: Optional[float] = None
        self.results: list[dict[str, Any]] = []
        self.files: list[str] = []
        self.sampled_steps: list[int] = []  # counted and profiled steps
        self._target = start_step
        self._step = 0
        self._counter: Optional[OpCounter] = None
        self._counted: Optional[OpCounter] = None
        self._profiler: Any = None
        self._cuda = False
        self._enabled = True

    # ---- lifecycle --------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = device_of(trainer, pl_module)
        self._cuda = device.type == "cuda"
        dtype = self.dtype or compute_dtype_name(getattr(trainer, "precision", None), torch.get_float32_matmul_precision())
        table = device_peak(device)
        self.peak_flops = self.peak_flops_arg or (table.flops_for(dtype) if table else None)
        self.peak_bandwidth = self.peak_bandwidth_arg or (table.memory_bandwidth if table else None)
        self._enabled = bool(self.peak_flops and self.peak_bandwidth)
        if not self._enabled:
            rank_zero_warn(f"RooflineMonitor: no peak FLOP/s or bandwidth known for {device}; pass peak_flops= and "
                           "peak_bandwidth= (RooflineMonitor is off for this fit)")
            return
        self._step, self._target = 0, self.start_step
        if self._target == 0:
            self._start_count(pl_module)

    def _start_count(self, pl_module: LightningModule) -> None:
        if _get_current_dispatch_mode() is not None:  # another detector owns this step: try the next one
            self._target += 1
            return
        self._counter = OpCounter(module_depth=self.module_depth, root=pl_module)
        self._counter.__enter__()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._enabled:
            return
        step = self._step
        self._step += 1
        if self._profiler is not None:  # the profiled step just ended
            self._finish(trainer, step)
        if self._counter is not None:  # the counted step just ended: profile the next one
            self._counter.__exit__(None, None, None)
            self._counted, self._counter = self._counter, None
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        elif self._profiler is None and self._counted is None and self._step == self._target:
            self._start_count(pl_module)

    def _finish(self, trainer: Trainer, step: int) -> None:
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        counted, self._counted = self._counted, None
        counted_step = step - 1
        self.sampled_steps += [counted_step, step]
        self._target = max(counted_step + self.every_n_steps, self._step) if self.every_n_steps else -1
        assert counted is not None and self.peak_flops and self.peak_bandwidth
        times = profiler_op_times(prof.key_averages(), device=self._cuda)
        records = list(counted.records.values())
        kw = dict(peak_flops=self.peak_flops, peak_bandwidth=self.peak_bandwidth,
                  overhead_fraction=self.overhead_fraction)
        categories = build_groups(records, times, key="category", **kw)
        modules = build_groups(records, times, key="module", **kw)
        result = {
            "step": step - 1,
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

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._abort()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._abort()

    def summary(self) -> dict[str, Any]:
        last = self.results[-1] if self.results else {}
        return {"bound": last.get("bound"), "categories": last.get("categories", []), "files": list(self.files)}
