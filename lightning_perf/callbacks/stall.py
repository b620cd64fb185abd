"""DataLoaderStallDetector: the input wait per step that the accelerator queue did not hide."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

import lightning_perf.perf.throughput as _throughput
from lightning_perf.callbacks._utils import device_of, log_scalars
from lightning_perf.perf.dataloader import StallWindow, dataloader_advice, exposed_wait

__all__ = ["DataLoaderStallDetector"]

_FETCH_ACTION = "train_dataloader_next"


class DataLoaderStallDetector(Callback):
    """Exposed data-loading wait as a share of step time, with advice from the actual DataLoader.

    The host time of each batch fetch is taken from the Trainer's own
    ``train_dataloader_next`` profiler action (the profiler's ``start``/``stop`` are wrapped
    for the fit and restored after it). On CUDA, events at the end of a step and the
    start of the next give the device's idle gap; only ``min(fetch, gap)`` is exposed (the
    rest ran while the GPU was still busy). Events are read with ``query()`` once
    complete, never waited on. On CPU the fetch time is all exposed.

    Logs ``perf/data_stall`` (fraction of step time, per window) and warns once when it
    is above ``threshold`` with advice derived from the DataLoader.

    Args:
        threshold: stall fraction above which to warn (default 5%).
        window: steps per reported value.
        warmup_steps: first steps ignored (worker start-up, compilation).
    """

    def __init__(self, *, threshold: float = 0.05, window: int = 20, warmup_steps: int = 2) -> None:
        super().__init__()
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        if window < 1 or warmup_steps < 0:
            raise ValueError(f"window ({window}) must be >= 1 and warmup_steps ({warmup_steps}) >= 0")
        self.threshold = threshold
        self.window = window
        self.warmup_steps = warmup_steps
        self.stats = StallWindow(size=window)
        self.fractions: list[float] = []
        self.advice: list[str] = []
        self.warned = False
        self._cuda = False
        self._events = _throughput.EventPool()
        self._fetch = 0.0
        self._fetch_t0: Optional[float] = None
        self._end: Any = None  # host time or event at the previous batch end
        self._start: Any = None  # host time or event at the previous batch start
        self._pending: deque[tuple[float, Any, Any, Any]] = deque()
        self._seen = 0
        self._restore: list[tuple[Any, str, Callable[..., Any]]] = []

    # ---- fetch timing through the trainer's profiler --------------------------------------------

    def _wrap_profiler(self, trainer: Trainer) -> None:
        profiler = getattr(trainer, "profiler", None)
        if profiler is None:
            return
        start, stop = profiler.start, profiler.stop

        def timed_start(action: str, *args: Any, **kwargs: Any) -> Any:
            if action.endswith(_FETCH_ACTION):
                self._fetch_t0 = _throughput.host_clock()
            return start(action, *args, **kwargs)

        def timed_stop(action: str, *args: Any, **kwargs: Any) -> Any:
            if action.endswith(_FETCH_ACTION) and self._fetch_t0 is not None:
                self._fetch += _throughput.host_clock() - self._fetch_t0
                self._fetch_t0 = None
            return stop(action, *args, **kwargs)

        self._restore = [(profiler, "start", start), (profiler, "stop", stop)]
        profiler.start, profiler.stop = timed_start, timed_stop

    def _unwrap_profiler(self) -> None:
        for owner, attr, _ in self._restore:
            if attr in vars(owner):
                delattr(owner, attr)  # the instance attribute shadowed the method
        self._restore = []

    # ---- hooks -----------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = device_of(trainer, pl_module)
        self._cuda = device.type == "cuda"
        self._events = _throughput.EventPool()
        self.stats = StallWindow(size=self.window)
        self.fractions, self.warned, self._seen = [], False, 0
        self._pending.clear()
        self._end = self._start = None
        self._fetch = 0.0
        self._wrap_profiler(trainer)
        loader = trainer.train_dataloader
        loaders = loader if isinstance(loader, (list, tuple)) else list(loader.values()) if isinstance(loader, dict) \
            else [loader]
        procs = max(1, int(getattr(trainer, "num_devices", 1) or 1))
        self.advice = []
        for dl in loaders:
            if dl is not None:
                self.advice += dataloader_advice(dl, accelerator=device.type, processes_per_node=procs)

    def _stamp(self) -> Any:
        if self._cuda:
            return self._events.record()
        return _throughput.host_clock()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        start = self._stamp()
        if self._start is not None and self._end is not None:
            self._pending.append((self._fetch, self._start, self._end, start))
        self._fetch = 0.0
        self._start = start
        self._drain(pl_module)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._end = self._stamp()

    def _drain(self, pl_module: LightningModule) -> None:
        while self._pending:
            fetch, prev_start, prev_end, start = self._pending[0]
            if self._cuda:
                if not start.query():
                    return
                gap = prev_end.elapsed_time(start) / 1e3
                step = prev_start.elapsed_time(start) / 1e3
            else:
                gap, step = None, start - prev_start
            self._pending.popleft()
            if self._cuda:
                self._events.release(prev_start)
                self._events.release(prev_end)
            self._seen += 1
            if self._seen <= self.warmup_steps:
                continue
            fraction = self.stats.add(exposed_wait(fetch, gap), step)
            if fraction is not None:
                self.fractions.append(fraction)
                log_scalars(pl_module, {"perf/data_stall": fraction})
                if fraction > self.threshold and not self.warned:
                    self.warned = True
                    tips = "; ".join(self.advice)
                    rank_zero_warn(f"DataLoaderStallDetector: {100 * fraction:.1f}% of step time waits for data "
                                   f"(threshold {100 * self.threshold:.0f}%). {tips}")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._unwrap_profiler()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._unwrap_profiler()

    @property
    def stall_fraction(self) -> float:
        """Exposed wait over step time across every measured step of the fit."""
        return self.stats.overall_fraction

    @property
    def mean_wait_s(self) -> float:
        return self.stats.total_wait_s / self.stats.total_steps if self.stats.total_steps else 0.0

    def summary(self) -> dict[str, Any]:
        return {"stall_fraction": self.stall_fraction, "mean_wait_s": self.mean_wait_s,
                "steps": self.stats.total_steps, "advice": self.advice, "warned": self.warned}
