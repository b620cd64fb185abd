"""DataLoaderStallDetector: the input wait per step that the accelerator queue did not hide."""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

import lightning_perf.perf.steps as _steps
from lightning_perf.callbacks._utils import device_of, log_scalars, sampled_steps_of
from lightning_perf.perf.dataloader import dataloader_advice, exposed_wait
from lightning_perf.perf.steps import StepLedger, StepRow, StepTimer, StepWindow

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

    The share is over the same window as ``MFUMonitor`` and ``PerfReport``: exposed wait over wall
    time of the measured steps so far (batch start to next batch start, after ``warmup_steps``,
    less the steps a diagnostic sampled). Every ``window`` measured steps it logs
    ``perf/data_stall`` (that share) and ``perf/data_stall_window`` (the last ``window`` steps),
    and warns once, stating the steps it covers, when the share is above ``threshold``, with
    advice derived from the DataLoader. The final share goes to the loggers at the end of
    training; ``PerfReport`` shows the same share.

    Args:
        threshold: stall share above which to warn (default 5%).
        window: measured steps between two logged values.
        warmup_steps: first steps left out (worker start-up, compilation).
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
        self.ledger = StepLedger()
        self.fractions: list[float] = []  # the last ``window`` steps' share, at each log
        self.excluded: set[int] = set()  # every diagnostic's sampled steps, as of the last share
        self.advice: list[str] = []
        self.warned = False
        self._cuda = False
        self._timer: Optional[StepTimer] = None
        self._fetch = 0.0
        self._fetch_t0: Optional[float] = None
        self._new_measured = 0
        self._restore: list[tuple[Any, str, Callable[..., Any]]] = []

    # ---- fetch timing through the trainer's profiler --------------------------------------------

    def _wrap_profiler(self, trainer: Trainer) -> None:
        profiler = getattr(trainer, "profiler", None)
        if profiler is None:
            return
        start, stop = profiler.start, profiler.stop

        def timed_start(action: str, *args: Any, **kwargs: Any) -> Any:
            if action.endswith(_FETCH_ACTION):
                self._fetch_t0 = _steps.host_clock()
            return start(action, *args, **kwargs)

        def timed_stop(action: str, *args: Any, **kwargs: Any) -> Any:
            if action.endswith(_FETCH_ACTION) and self._fetch_t0 is not None:
                self._fetch += _steps.host_clock() - self._fetch_t0
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
        self._timer = StepTimer(device)
        self.ledger.clear()
        self.fractions, self.excluded, self.warned, self._new_measured = [], set(), False, 0
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

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._timer is None:
            return
        fetch, self._fetch = self._fetch, 0.0
        self._timer.start(after=fetch)  # the fetch just timed ends the previous step
        self._record(self._timer.poll(), trainer)
        if self._new_measured >= self.window:
            self._new_measured = 0
            self._log(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._timer is not None:
            self._timer.end()

    def _record(self, records: list[Any], trainer: Trainer) -> None:
        skip = sampled_steps_of(trainer)
        for r in records:
            wait = exposed_wait(r.after or 0.0, r.gap_s if self._cuda else None)
            self.ledger.add(StepRow(index=r.index, seconds=r.seconds, gap_s=r.gap_s, data_wait_s=wait))
            if r.index >= self.warmup_steps and r.index not in skip:
                self._new_measured += 1

    def _log(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.excluded = sampled_steps_of(trainer)
        run = self.run_window()
        recent = self.ledger.window(warmup=self.warmup_steps, exclude=self.excluded, last=self.window)
        share, last = run.data_wait_share, recent.data_wait_share
        if share is None or last is None:
            return
        self.fractions.append(last)
        log_scalars(pl_module, {"perf/data_stall": share, "perf/data_stall_window": last})
        if share > self.threshold and not self.warned:
            self.warned = True
            tips = "; ".join(self.advice)
            rank_zero_warn(f"DataLoaderStallDetector: {100 * share:.1f}% of step time waits for data "
                           f"(threshold {100 * self.threshold:.0f}%; {run.describe()}). {tips}")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._unwrap_profiler()
        if self._timer is None:
            return
        self._record(self._timer.finish(after=0.0), trainer)
        self._timer = None
        self.excluded = sampled_steps_of(trainer)
        share = self.run_window().data_wait_share
        if share is not None:
            for logger in trainer.loggers:
                logger.log_metrics({"perf/data_stall": share}, step=trainer.global_step)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._unwrap_profiler()

    def run_window(self) -> StepWindow:
        """The measured window of this fit: after ``warmup_steps``, less every sampled step."""
        return self.ledger.window(warmup=self.warmup_steps, exclude=self.excluded)

    @property
    def stall_fraction(self) -> float:
        """Exposed wait over wall time of the measured window."""
        return self.run_window().data_wait_share or 0.0

    @property
    def mean_wait_s(self) -> float:
        run = self.run_window()
        return (run.data_wait_s or 0.0) / run.steps if run.steps else 0.0

    def summary(self) -> dict[str, Any]:
        run = self.run_window()
        return {"stall_fraction": self.stall_fraction, "mean_wait_s": self.mean_wait_s, "steps": run.steps,
                "window": run.describe(), "advice": self.advice, "warned": self.warned}
