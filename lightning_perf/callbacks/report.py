"""PerfReport: one end-of-fit table from what the performance callbacks measured."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_perf.callbacks._settings import perf_settings_of, run_settings_of
from lightning_perf.callbacks._utils import (
    batch_size_of,
    device_of,
    find_callback,
    layout_of,
    log_dir_of,
    sampled_steps_of,
)
from lightning_perf.callbacks.comm import CommOverlapMonitor
from lightning_perf.callbacks.memory import MemoryMonitor
from lightning_perf.callbacks.mfu import MFUMonitor
from lightning_perf.callbacks.roofline import RooflineMonitor
from lightning_perf.callbacks.stall import DataLoaderStallDetector
from lightning_perf.callbacks.sync import SyncPointWarner
from lightning_perf.perf.collection import CollectionTimer, scheduled_every
from lightning_perf.perf.dataloader import dataloader_advice
from lightning_perf.perf.report import PerfSummary, render_markdown
from lightning_perf.perf.steps import StepLedger, StepRow, StepTimer
from lightning_perf.perf.throughput import device_unit, window_throughput

__all__ = ["PerfReport"]


class PerfReport(Callback):
    """At the end of fit: step time split into compute / exposed communication / data wait /
    host overhead, throughput and MFU, the roofline bound, Python garbage-collection pauses, the sync
    sites and the top three recommendations.

    Every figure is over one window, stated in the report: the mean over the measured steps, where a
    step is the wall time from one batch start to the next (data waits included; the last step ends
    at its batch end), the first ``warmup_steps`` are left out, and so are the steps a diagnostic
    callback sampled. With ``MFUMonitor`` attached, step time, tokens/s and MFU are that monitor's
    measurement of the window (so they equal its logged figures; on packed documents its attention
    FLOPs are counted per document, and a row of the report says so); with
    ``DataLoaderStallDetector`` attached, the data-wait share is the detector's for the window.
    Otherwise steps are timed here (CUDA events read with ``query()``, or the host clock on CPU),
    as is the device's idle gap between steps. The rest comes from the other callbacks of the pack
    when attached (``CommOverlapMonitor``, ``RooflineMonitor``, ``SyncPointWarner``). Every garbage
    collection during the fit is timed through ``gc.callbacks`` (two clock reads per collection).
    The report is printed on rank 0 and saved as ``{filename}.md`` and ``{filename}.json`` in the
    log dir. A run with no step past the warm-up says so instead of showing figures.

    Args:
        warmup_steps: first steps left out of the window; default the largest ``warmup_steps`` of an
            attached ``MFUMonitor`` or ``DataLoaderStallDetector``, else 2.
        filename: stem of the saved files.
        print_report: print the Markdown at the end of fit.
    """

    def __init__(self, *, warmup_steps: Optional[int] = None, filename: str = "perf_report",
                 print_report: bool = True) -> None:
        super().__init__()
        if warmup_steps is not None and warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.filename = filename
        self.print_report = print_report
        self.summary: Optional[PerfSummary] = None
        self.files: list[str] = []
        self.ledger = StepLedger()
        self._cuda = False
        self._unit = "GPU"
        self._timer: Optional[StepTimer] = None
        self._on_gc = CollectionTimer(tag=self._step_index)  # (step index, seconds) per collection
        self._gc_every: Optional[int] = None  # the collection schedule in charge during training (None: automatic)

    def _step_index(self) -> int:
        return self._timer.index if self._timer is not None else -1

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = device_of(trainer, pl_module)
        self._cuda, self._unit = device.type == "cuda", device_unit(device)
        self._timer = StepTimer(device)
        self.ledger.clear()
        self._gc_every = None
        self._on_gc.pauses = []
        self._on_gc.install()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._on_gc.remove()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._on_gc.remove()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._timer is None:
            return
        samples, tokens, seq_len = batch_size_of(batch)
        self._timer.start((samples, tokens if seq_len is not None else None))
        self._record(self._timer.poll())

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._timer is not None:
            self._timer.end()
        if batch_idx == 0 or self._gc_every is None:  # every schedule has started by the first batch's end
            self._gc_every = scheduled_every()

    def _record(self, records: list[Any]) -> None:
        for r in records:
            samples, tokens = r.payload
            self.ledger.add(StepRow(index=r.index, seconds=r.seconds, gap_s=r.gap_s, samples=samples, tokens=tokens))

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._on_gc.remove()
        if self._timer is not None:
            self._record(self._timer.finish())
            self._timer = None
        self.summary = self.build_summary(trainer)
        if not trainer.is_global_zero:
            return
        out = log_dir_of(trainer)
        md, js = os.path.join(out, self.filename + ".md"), os.path.join(out, self.filename + ".json")
        text = render_markdown(self.summary)
        with open(md, "w") as f:
            f.write(text)
        with open(js, "w") as f:
            json.dump(self.summary.as_dict(), f, indent=2, default=str)
        self.files = [md, js]
        if self.print_report:
            print(text)

    def window_warmup(self, trainer: Trainer) -> int:
        """The warm-up of the report's window (see ``warmup_steps``)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        found = [cb.warmup_steps for cb in (find_callback(trainer, MFUMonitor),
                                            find_callback(trainer, DataLoaderStallDetector)) if cb is not None]
        return max(found, default=2)

    def build_summary(self, trainer: Trainer) -> PerfSummary:
        skip = sampled_steps_of(trainer)
        warmup = self.window_warmup(trainer)
        own = self.ledger.window(warmup=warmup, exclude=skip, spread=True)
        mfu = find_callback(trainer, MFUMonitor)
        if mfu is not None and (mfu.layout is None or not len(mfu.ledger)):
            mfu = None  # attached, but it timed no step of this fit
        window = mfu.run_window(warmup=warmup, exclude=skip, spread=True) if mfu is not None else own
        s = PerfSummary(step_time_s=window.mean_step_s or 0.0, steps=window.steps, window=window.describe(),
                        median_step_s=window.median_step_s, p90_step_s=window.p90_step_s, device_unit=self._unit)
        if window.steps and window.seconds > 0:
            if own.steps and own.gap_s is not None:
                s.between_steps_s = own.gap_s / own.steps
            if mfu is not None:
                t, s.mfu_note = mfu.figures(window)
                if mfu.attention_note is not None:
                    docs = mfu.mean_document_tokens
                    s.attention = mfu.attention_note + (f"; {docs:.4g} tokens per document" if docs else "")
                if mfu.peak_flops:
                    s.peak = f"{mfu.peak_name}: {mfu.peak_flops / 1e12:.4g} TFLOP/s"
            else:
                t = window_throughput(window, layout=layout_of(trainer))
            s.tokens_per_sec, s.samples_per_sec, s.tflops_per_device = (t.tokens_per_sec, t.samples_per_sec,
                                                                        t.tflops_per_device)
            s.mfu, s.hfu = t.mfu, t.hfu
        stall = find_callback(trainer, DataLoaderStallDetector)
        if stall is not None and len(stall.ledger):
            share = stall.ledger.window(warmup=warmup, exclude=skip).data_wait_share
            if share is not None and window.steps:
                s.data_wait_s = share * s.step_time_s  # the detector's share of the same window
            s.dataloader_advice = list(stall.advice)
        else:
            loader = getattr(trainer, "train_dataloader", None)
            if loader is not None and hasattr(loader, "num_workers"):
                s.dataloader_advice = dataloader_advice(loader, accelerator="cuda" if self._cuda else "cpu",
                                                        processes_per_node=int(getattr(trainer, "num_devices", 1)))
        comm = find_callback(trainer, CommOverlapMonitor)
        if comm is not None and comm.summary():
            c = comm.summary()
            s.exposed_comm_s, s.comm = c["exposed_s"], c
            s.exposed_comm_per_rank = list(c.get("exposed_fraction_per_rank") or [])
        roof = find_callback(trainer, RooflineMonitor)
        if roof is not None and roof.results:
            r = roof.summary()
            s.bound, s.roofline = r["bound"], r["categories"]
        measured = set(self.ledger.indices(warmup=warmup, exclude=skip))
        pauses = [dt for index, dt in self._on_gc.pauses if index in measured]
        steps = len(measured)
        if steps:
            s.gc_pause_s = sum(pauses) / steps
            s.gc_max_pause_s = max(pauses) if pauses else 0.0
            s.gc_collections = len(pauses)
            s.gc_scheduled = self._gc_every is not None
        s.fsdp_blocks_per_unit = perf_settings_of(trainer.strategy).fsdp_blocks_per_unit  # where FSDP2 shards
        sync = find_callback(trainer, SyncPointWarner)
        if sync is not None:
            s.user_sync_sites = [x.describe() for x in sync.user_sites()]
            s.framework_sync_sites = [x.describe() for x in sync.framework_sites()]
        s.settings = run_settings_of(trainer)
        s.settings.gc_scheduled = self._gc_every is not None
        memory = find_callback(trainer, MemoryMonitor)
        if memory is not None:
            s.memory = memory.report()
        return s
