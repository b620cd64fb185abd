"""Throughput, MFU and HFU maths under any parallel layout, and the matmul ceiling.

Layout rule: every rank of one data-parallel replica (its tensor and pipeline peers)
sees the same tokens, so tokens are counted once per replica
(``global tokens = local tokens * dp``), while the model's FLOPs are spread over every
device (``FLOP/s per device = flops_per_token * global tokens/s / world_size``). A device is
one GPU, or on a CPU one process.

A utilisation above 100% is not a measurement: either the reference is wrong (a matmul
ceiling timed on a busy host comes out low) or the FLOP count is. ``over_reference`` names
that case, and the callbacks show such a figure as "n/a" with the reason, never as a value.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from lightning_perf.perf.steps import StepWindow, host_clock

__all__ = [
    "ParallelLayout",
    "Throughput",
    "compute_throughput",
    "window_throughput",
    "measure_matmul_ceiling",
    "over_reference",
    "device_unit",
]


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How the world splits: ``data_parallel_size`` replicas of ``world_size / dp`` devices each."""

    world_size: int
    data_parallel_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.data_parallel_size < 1:
            raise ValueError(
                f"world_size ({self.world_size}) and data_parallel_size ({self.data_parallel_size}) must be >= 1"
            )
        if self.world_size % self.data_parallel_size:
            raise ValueError(
                f"world_size ({self.world_size}) is not a multiple of data_parallel_size "
                f"({self.data_parallel_size}): {self.world_size} / {self.data_parallel_size} = "
                f"{self.world_size / self.data_parallel_size:.3f}"
            )

    @property
    def model_parallel_size(self) -> int:
        """Devices per replica (tensor x pipeline x context parallel)."""
        return self.world_size // self.data_parallel_size


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """One throughput measurement (global rates; FLOP/s and utilisation per device).

    ``tokens_per_sec`` is ``None`` when the batches have no token dimension (then only samples
    are counted); ``tflops_per_device`` is ``None`` when no FLOPs were counted.
    """

    step_time_s: float
    tokens_per_sec: Optional[float]
    samples_per_sec: float
    tflops_per_device: Optional[float]
    mfu: Optional[float] = None
    hfu: Optional[float] = None
    mfu_ceiling: Optional[float] = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def compute_throughput(
    *,
    step_time_s: float,
    local_tokens: float,
    local_samples: float,
    layout: ParallelLayout,
    flops_per_token: float,
    peak_flops: Optional[float] = None,
    hardware_flops_per_token: Optional[float] = None,
    ceiling_flops: Optional[float] = None,
) -> Throughput:
    """Rates for one step of ``step_time_s`` in which each rank consumed its local batch.

    ``mfu = flops_per_token * local_tokens * dp / step_time / world_size / peak`` (per device);
    ``hfu`` uses the hardware FLOPs (recomputation included); ``mfu_ceiling`` divides by a
    measured matmul ceiling instead of the datasheet peak.
    """
    if step_time_s <= 0:
        raise ValueError(f"step_time_s must be > 0, got {step_time_s}")
    if local_tokens < 0 or local_samples < 0:
        raise ValueError(f"token ({local_tokens}) and sample ({local_samples}) counts must be >= 0")
    dp, world = layout.data_parallel_size, layout.world_size
    tokens_per_sec = local_tokens * dp / step_time_s
    flops_per_device = flops_per_token * tokens_per_sec / world

    def ratio(flops: Optional[float], denom: Optional[float]) -> Optional[float]:
        return None if flops is None or not denom else flops / denom

    hw_flops = None if hardware_flops_per_token is None else hardware_flops_per_token * tokens_per_sec / world
    return Throughput(
        step_time_s=step_time_s,
        tokens_per_sec=tokens_per_sec,
        samples_per_sec=local_samples * dp / step_time_s,
        tflops_per_device=flops_per_device / 1e12,
        mfu=ratio(flops_per_device, peak_flops),
        hfu=ratio(hw_flops, peak_flops),
        mfu_ceiling=ratio(flops_per_device, ceiling_flops),
    )


def window_throughput(window: StepWindow, *, layout: ParallelLayout, peak_flops: Optional[float] = None,
                      ceiling_flops: Optional[float] = None) -> Throughput:
    """Rates of a measured window: totals over its total wall time, so that
    ``tokens_per_sec == tokens per step * dp / mean step time`` holds exactly."""
    if not window.steps or window.seconds <= 0:
        raise ValueError(f"the window has no measured step ({window.describe()})")
    n = window.steps
    count = window.tokens if window.tokens is not None else window.samples  # what the FLOPs are spread over
    flops = window.flops
    t = compute_throughput(
        step_time_s=window.seconds / n,
        local_tokens=count / n,
        local_samples=window.samples / n,
        layout=layout,
        flops_per_token=(flops or 0.0) / count if count else 0.0,
        peak_flops=peak_flops if flops is not None else None,
        hardware_flops_per_token=(window.hardware_flops / count
                                  if window.hardware_flops is not None and count else None),
        ceiling_flops=ceiling_flops if flops is not None else None,
    )
    return replace(t, tokens_per_sec=t.tokens_per_sec if window.tokens is not None else None,
                   tflops_per_device=t.tflops_per_device if flops is not None else None)


def over_reference(utilisation: Optional[float]) -> bool:
    """A utilisation above 100% of its reference: the reference (or the FLOP count) is wrong."""
    return utilisation is not None and utilisation > 1.0


def device_unit(device: torch.device) -> str:
    """What per-device rates are per: ``"GPU"`` on a CUDA/ROCm device, else ``"process"``."""
    return "GPU" if torch.device(device).type == "cuda" else "process"


def measure_matmul_ceiling(device: torch.device, dtype: torch.dtype, *, n: Optional[int] = None, repeats: int = 10,
                           trials: int = 5) -> float:
    """Achieved FLOP/s of an ``n x n x n`` matmul (8192 on GPU, 512 on CPU), the best of ``trials``
    timings of ``repeats`` matmuls each (a busy host or a clock change slows some trials, never
    speeds one up); synchronises, call outside the timed steps."""
    if repeats < 1 or trials < 1:
        raise ValueError(f"repeats ({repeats}) and trials ({trials}) must be >= 1")
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(trials):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = host_clock()
            for _ in range(repeats):
                a @ b
            seconds = host_clock() - t0
        if seconds > 0:
            best = max(best, 2 * n**3 * repeats / seconds)
    return best
