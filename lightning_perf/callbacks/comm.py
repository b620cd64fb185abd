"""CommOverlapMonitor: exposed communication and achieved bus bandwidth on sampled steps."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_perf.callbacks._utils import StepSampler, device_of, log_scalars
from lightning_perf.perf.comm import CommAnalysis, analyze_comm_trace, expected_link
from lightning_perf.perf.peaks import device_peak

__all__ = ["CommOverlapMonitor"]


class CommOverlapMonitor(Callback):
    """How much of each collective compute hid, and how fast the link moved the data.

    With world size > 1, sampled steps run under ``torch.profiler``. From the trace:
    communication intervals (NCCL kernels on GPU; gloo's work on CPU) and compute
    intervals (every other kernel; the main thread's aten ops on CPU); exposed
    communication = |comm| - |comm and compute| as a share of the step (interval maths in
    ``lightning_perf.perf.intervals``); per collective kind the bus bandwidth (see
    ``lightning_perf.perf.comm``), against the link the GPU should use (NVLink, PCIe, or
    InfiniBand across nodes). Warns above ``exposed_threshold`` exposed, or when a link
    delivers under ``bandwidth_fraction`` of its expected bandwidth (GPU only).

    Args:
        start_step, every_n_steps: sampled steps (``every_n_steps=0``: only ``start_step``).
        exposed_threshold: warn above this exposed share of the step.
        bandwidth_fraction: warn when bus bandwidth is below this share of the link's.
    """

    def __init__(self, *, start_step: int = 10, every_n_steps: int = 100, exposed_threshold: float = 0.10,
                 bandwidth_fraction: float = 0.5) -> None:
        super().__init__()
        if not 0 < exposed_threshold < 1 or not 0 < bandwidth_fraction <= 1:
            raise ValueError(f"need 0 < exposed_threshold < 1 ({exposed_threshold}) and "
                             f"0 < bandwidth_fraction <= 1 ({bandwidth_fraction})")
        self.sampler = StepSampler(every=every_n_steps, start=start_step)
        self.exposed_threshold = exposed_threshold
        self.bandwidth_fraction = bandwidth_fraction
        self.results: list[dict[str, Any]] = []
        self.sampled_steps: list[int] = []
        self._profiler: Any = None
        self._step = 0
        self._enabled = False
        self._cuda = False
        self._ranks = 1
        self._link: tuple[str, float] = ("", 0.0)
        self._warned: set[str] = set()
        #: after fit with world size > 1: every rank's mean exposed share of its sampled steps (rank
        #: order; None where a rank sampled nothing). Uneven values mean ranks wait for each other.
        self.exposed_fraction_per_rank: Optional[list[Optional[float]]] = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ranks = int(trainer.world_size)
        self._enabled = self._ranks > 1
        if not self._enabled:
            rank_zero_info("CommOverlapMonitor: world size 1, nothing to measure")
            return
        device = device_of(trainer, pl_module)
        self._cuda = device.type == "cuda"
        peak = device_peak(device) if self._cuda else None
        self._link = expected_link(peak.name if peak else None, multi_node=int(getattr(trainer, "num_nodes", 1)) > 1)
        self._step = 0
        if self.sampler(0):
            self._start()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._enabled:
            return
        if self._profiler is not None:
            self._finish(trainer, pl_module, self._step)
        self._step += 1
        if self.sampler(self._step):
            self._start()

    def _finish(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        finally:
            os.remove(path)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        analysis = analyze_comm_trace(events, ranks=self._ranks)
        result = {"step": step, "rank": trainer.global_rank, **analysis.as_dict(),
                  "link": self._link[0], "link_bandwidth": self._link[1]}
        self.results.append(result)
        self.sampled_steps.append(step)
        log_scalars(pl_module, {"perf/exposed_comm": analysis.overlap.exposed_fraction,
                                "perf/comm_overlap": analysis.overlap.overlap_fraction})
        self._warn(analysis)

    def _warn(self, analysis: CommAnalysis) -> None:
        exposed = analysis.overlap.exposed_fraction
        if exposed > self.exposed_threshold and "exposed" not in self._warned:
            self._warned.add("exposed")
            rank_zero_warn(f"CommOverlapMonitor: {100 * exposed:.1f}% of the step is exposed communication "
                           f"({analysis.overlap.exposed * 1e3:.2f} ms of {analysis.overlap.comm * 1e3:.2f} ms "
                           f"communicating); overlap it with compute (bucket sizes, prefetch, micro-batches)")
        if not self._cuda:
            return
        link, expected = self._link
        for kind, stats in analysis.collectives.items():
            if stats.busbw and stats.busbw < self.bandwidth_fraction * expected and kind not in self._warned:
                self._warned.add(kind)
                rank_zero_warn(f"CommOverlapMonitor: {kind} reaches {stats.busbw / 1e9:.1f} GB/s bus bandwidth, under "
                               f"{100 * self.bandwidth_fraction:.0f}% of {link}'s {expected / 1e9:.0f} GB/s "
                               "(small messages, or a slower path than expected)")

    def _stop_profiler(self) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_profiler()
        if self._enabled:  # the same on every rank: every rank joins the gather
            self.exposed_fraction_per_rank = _gather_per_rank(self._mean_exposed())

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_profiler()  # no collective here: the other ranks may not be in this hook

    def _mean_exposed(self) -> Optional[float]:
        return sum(r["exposed_fraction"] for r in self.results) / len(self.results) if self.results else None

    def summary(self) -> Optional[dict[str, Any]]:
        if not self.results:
            return None
        n = len(self.results)
        return {
            "samples": n,
            "exposed_fraction": self._mean_exposed(),
            "exposed_fraction_per_rank": self.exposed_fraction_per_rank,
            "exposed_s": sum(r["exposed_s"] for r in self.results) / n,
            "overlap_fraction": sum(r["overlap_fraction"] for r in self.results) / n,
            "collectives": self.results[-1]["collectives"],
            "link": self._link[0],
        }


def _gather_per_rank(value: Optional[float]) -> Optional[list[Optional[float]]]:
    """``value`` from every rank of the default process group, in rank order (None without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    values: list[Optional[float]] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
