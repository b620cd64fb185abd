"""PerfReport: one end-of-fit table from what the performance callbacks measured."""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

import lightning_perf.perf.throughput as _throughput
from lightning_perf.callbacks._settings import run_settings_of
from lightning_perf.callbacks._utils import batch_size_of, device_of, find_callback, layout_of, log_dir_of
from lightning_perf.callbacks.comm import CommOverlapMonitor
from lightning_perf.callbacks.garbage import CollectionTimer, GarbageCollection
from lightning_perf.callbacks.memory import MemoryMonitor
from lightning_perf.callbacks.mfu import MFUMonitor
from lightning_perf.callbacks.roofline import RooflineMonitor
from lightning_perf.callbacks.stall import DataLoaderStallDetector
from lightning_perf.callbacks.sync import SyncPointWarner
from lightning_perf.perf.dataloader import dataloader_advice
from lightning_perf.perf.report import PerfSummary, render_markdown

__all__ = ["PerfReport"]


class PerfReport(Callback):
    """At the end of fit: step time split into compute / exposed communication / data wait /
    host overhead, MFU, the roofline bound, Python garbage-collection pauses, the sync sites and the
    top three recommendations.

    Step time and the device's idle gap between steps are measured here (CUDA events read
    with ``query()``, or the host clock on CPU). The rest comes from the other callbacks of
    the pack when they are attached (``MFUMonitor``, ``DataLoaderStallDetector``,
    ``CommOverlapMonitor``, ``RooflineMonitor``, ``SyncPointWarner``). Every garbage collection
    during the fit is timed through ``gc.callbacks`` (two clock reads per collection). The report is printed
    on rank 0 and saved as ``{filename}.md`` and ``{filename}.json`` in the log dir.

    Args:
        warmup_steps: first steps left out of the averages.
        filename: stem of the saved files.
        print_report: print the Markdown at the end of fit.
    """

    def __init__(self, *, warmup_steps: int = 2, filename: str = "perf_report", print_report: bool = True) -> None:
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.filename = filename
        self.print_report = print_report
        self.summary: Optional[PerfSummary] = None
        self.files: list[str] = []
        self._cuda = False
        self._events = _throughput.EventPool()
        self._queue: deque[tuple[Any, Any, Any, int, int]] = deque()
        self._start: Any = None
        self._end: Any = None
        self._tokens = 0
        self._index = 0
        self._measured: list[tuple[int, float, float, int]] = []  # (step, step_s, gap_s, tokens)
        self._on_gc = CollectionTimer(tag=self._step_index)  # (step index, seconds) per collection

    def _step_index(self) -> int:
        return self._index - 1

    def _stamp(self) -> Any:
        if self._cuda:
            return self._events.record()
        return _throughput.host_clock()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._cuda = device_of(trainer, pl_module).type == "cuda"
        self._events = _throughput.EventPool()
        self._queue.clear()
        self._start = self._end = None
        self._index = 0
        self._measured = []
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
        start = self._stamp()
        if self._start is not None and self._end is not None:
            self._queue.append((self._start, self._end, start, self._tokens, self._index - 1))
        self._index += 1
        self._start, self._end = start, None
        self._tokens = batch_size_of(batch)[1]
        self._drain(block=False)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._end = self._stamp()

    def _drain(self, block: bool) -> None:
        if block and self._cuda and self._queue:
            self._queue[-1][2].synchronize()  # end of fit only
        while self._queue:
            prev_start, prev_end, start, tokens, index = self._queue[0]
            if self._cuda:
                if not start.query():
                    return
                step, gap = prev_start.elapsed_time(start) / 1e3, prev_end.elapsed_time(start) / 1e3
            else:
                step, gap = start - prev_start, start - prev_end
            self._queue.popleft()
            if self._cuda:
                self._events.release(prev_start)
                self._events.release(prev_end)
            if index >= self.warmup_steps:
                self._measured.append((index, step, gap, tokens))

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._on_gc.remove()
        self._drain(block=True)
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

    @staticmethod
    def _sampled_steps(trainer: Trainer) -> set[int]:
        """Steps another callback profiled or watched (slower than the others): left out of the means."""
        out: set[int] = set()
        for cb in getattr(trainer, "callbacks", []):
            out.update(getattr(cb, "sampled_steps", []) or [])
        return out

    def build_summary(self, trainer: Trainer) -> PerfSummary:
        skip = self._sampled_steps(trainer)
        rows = [r for r in self._measured if r[0] not in skip] or self._measured
        steps = len(rows)
        total = sum(r[1] for r in rows)
        layout = layout_of(trainer)
        s = PerfSummary(
            step_time_s=total / steps if steps else 0.0,
            steps=steps,
            between_steps_s=sum(r[2] for r in rows) / steps if steps else None,
            tokens_per_sec=(sum(r[3] for r in rows) * layout.data_parallel_size / total) if total else None,
        )
        mfu = find_callback(trainer, MFUMonitor)
        if mfu is not None and mfu.history:
            m = mfu.summary()  # the median window: robust to the slow steps other callbacks sample
            s.mfu, s.hfu, s.tflops_per_gpu = m.get("mfu"), m.get("hfu"), m.get("tflops_per_gpu")
            s.tokens_per_sec = m.get("tokens_per_sec", s.tokens_per_sec)
            s.peak = f"{m['peak']}: {m['peak_flops'] / 1e12:.4g} TFLOP/s" if m.get("peak_flops") else None
        stall = find_callback(trainer, DataLoaderStallDetector)
        if stall is not None and stall.stats.total_steps:
            s.data_wait_s = stall.mean_wait_s
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
        measured = {r[0] for r in rows}
        pauses = [dt for index, dt in self._on_gc.pauses if index in measured]
        if steps:
            s.gc_pause_s = sum(pauses) / steps
            s.gc_max_pause_s = max(pauses) if pauses else 0.0
            s.gc_collections = len(pauses)
            s.gc_scheduled = find_callback(trainer, GarbageCollection) is not None
        config = getattr(trainer.strategy, "config", None)  # ZeroStrategy's ZeroConfig
        if getattr(config, "uses_fsdp", False) and getattr(config, "backend", None) == "native":
            s.fsdp_blocks_per_unit = config.blocks_per_unit
        sync = find_callback(trainer, SyncPointWarner)
        if sync is not None:
            s.user_sync_sites = [x.describe() for x in sync.user_sites()]
            s.framework_sync_sites = [x.describe() for x in sync.framework_sites()]
        s.settings = run_settings_of(trainer)
        memory = find_callback(trainer, MemoryMonitor)
        if memory is not None:
            s.memory = memory.report()
        return s
