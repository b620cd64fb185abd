"""Throughput, MFU and HFU maths under any parallel layout, and a step clock that never syncs.

Layout rule: every rank of one data-parallel replica (its tensor and pipeline peers)
sees the same tokens, so tokens are counted once per replica
(``global tokens = local tokens * dp``), while the model's FLOPs are spread over every
GPU (``FLOP/s per GPU = flops_per_token * global tokens/s / world_size``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = [
    "ParallelLayout",
    "Throughput",
    "compute_throughput",
    "StepClock",
    "EventPool",
    "host_clock",
    "measure_matmul_ceiling",
]


def host_clock() -> float:
    """Host seconds (monotonic); the one clock the pack's callbacks read on the host."""
    return time.perf_counter()


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How the world splits: ``data_parallel_size`` replicas of ``world_size / dp`` GPUs each."""

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
        """GPUs per replica (tensor x pipeline x context parallel)."""
        return self.world_size // self.data_parallel_size


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """One throughput measurement (global rates; FLOP/s and utilisation per GPU)."""

    step_time_s: float
    tokens_per_sec: float
    samples_per_sec: float
    tflops_per_gpu: float
    mfu: Optional[float] = None
    hfu: Optional[float] = None
    mfu_ceiling: Optional[float] = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def compute_throughput(
    *,
    step_time_s: float,
    local_tokens: int,
    local_samples: int,
    layout: ParallelLayout,
    flops_per_token: float,
    peak_flops: Optional[float] = None,
    hardware_flops_per_token: Optional[float] = None,
    ceiling_flops: Optional[float] = None,
) -> Throughput:
    """Rates for one step of ``step_time_s`` in which each rank consumed its local batch.

    ``mfu = flops_per_token * local_tokens * dp / step_time / world_size / peak``;
    ``hfu`` uses the hardware FLOPs (recomputation included); ``mfu_ceiling`` divides by a
    measured matmul ceiling instead of the datasheet peak.
    """
    if step_time_s <= 0:
        raise ValueError(f"step_time_s must be > 0, got {step_time_s}")
    if local_tokens < 0 or local_samples < 0:
        raise ValueError(f"token ({local_tokens}) and sample ({local_samples}) counts must be >= 0")
    dp, world = layout.data_parallel_size, layout.world_size
    tokens_per_sec = local_tokens * dp / step_time_s
    flops_per_gpu = flops_per_token * tokens_per_sec / world

    def ratio(flops: Optional[float], denom: Optional[float]) -> Optional[float]:
        return None if flops is None or not denom else flops / denom

    hw_flops = None if hardware_flops_per_token is None else hardware_flops_per_token * tokens_per_sec / world
    return Throughput(
        step_time_s=step_time_s,
        tokens_per_sec=tokens_per_sec,
        samples_per_sec=local_samples * dp / step_time_s,
        tflops_per_gpu=flops_per_gpu / 1e12,
        mfu=ratio(flops_per_gpu, peak_flops),
        hfu=ratio(hw_flops, peak_flops),
        mfu_ceiling=ratio(flops_per_gpu, ceiling_flops),
    )


class EventPool:
    """Timing events recorded on the current stream, recycled once read (no per-step allocation).

    ``record()`` returns an event recorded now; ``release(event)`` hands back one whose time
    was read (it has completed, so reusing it cannot disturb a pending measurement).
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device
        self._free: list[Any] = []

    def record(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def release(self, event: Any) -> None:
        if event is not None and len(self._free) < 64:
            self._free.append(event)


class StepClock:
    """Durations between consecutive ``mark()`` calls, read without host-device sync.

    On CUDA each mark records an event; ``poll()`` returns the intervals whose end event
    has completed (``Event.query()``, non-blocking), so they are read a step or more
    later. On CPU the host clock is read at the mark and intervals resolve at once.
    Each mark carries a payload (e.g. the tokens of the step it ends) returned with it.
    """

    def __init__(self, device: Optional[torch.device] = None, *, max_pending: int = 256) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.max_pending = max_pending
        self._pending: deque[tuple[Any, Any]] = deque()
        self._last: Any = None  # the previous resolved mark (event or host time)
        self._events = EventPool(self.device) if self.cuda else None

    def reset(self) -> None:
        self._pending.clear()
        self._last = None

    def mark(self, payload: Any = None) -> None:
        if self.cuda:
            assert self._events is not None
            self._pending.append((self._events.record(), payload))
            if len(self._pending) > self.max_pending:  # never read: drop the oldest, no sync
                self._last = self._pending.popleft()[0]
        else:
            self._pending.append((host_clock(), payload))

    def poll(self) -> list[tuple[float, Any]]:
        """Resolved ``(seconds, payload)`` intervals since the last poll; never blocks."""
        out: list[tuple[float, Any]] = []
        while self._pending:
            stamp, payload = self._pending[0]
            if self.cuda and not stamp.query():
                break
            self._pending.popleft()
            if self._last is not None:
                seconds = self._last.elapsed_time(stamp) / 1e3 if self.cuda else stamp - self._last
                out.append((seconds, payload))
                if self._events is not None:
                    self._events.release(self._last)
            self._last = stamp
        return out

    def flush(self) -> list[tuple[float, Any]]:
        """Like ``poll`` but waits for the device: only for the end of a run."""
        if self.cuda and self._pending:
            self._pending[-1][0].synchronize()
        return self.poll()


def measure_matmul_ceiling(device: torch.device, dtype: torch.dtype, *, n: Optional[int] = None, repeats: int = 10) -> float:
    """Achieved FLOP/s of an ``n x n x n`` matmul (8192 on GPU, 512 on CPU); synchronises, call once."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
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
    return 2 * n**3 * repeats / seconds
