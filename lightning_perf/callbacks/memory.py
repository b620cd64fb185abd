"""MemoryMonitor: peak memory per step by category, allocation snapshots, and what to do on an OOM."""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_perf.callbacks._settings import run_settings_of
from lightning_perf.callbacks._utils import batch_size_of, device_of, log_dir_of, log_scalars
from lightning_perf.parallel.sharding.fsdp import find_blocks
from lightning_perf.perf.memory import (
    GB,
    AllocatorStats,
    MemoryReport,
    count_categories,
    memory_advice,
    oom_markdown,
    tensor_bytes,
)
from lightning_perf.perf.memory_snapshot import (
    block_allocations,
    oom_event,
    sites_markdown,
    top_sites,
    trace_peak_allocations,
)
from lightning_perf.perf.saved_activations import SavedTensorCounter

__all__ = ["MemoryMonitor"]

_NEEDS_GPU = ("peak allocated / reserved, fragmentation and the allocator's activation figure need a CUDA device; "
              "parameters, gradients, optimizer state and the activations saved for backward are counted from the "
              "tensors")


class MemoryMonitor(Callback):
    """Device memory of every training step, split into parameters, gradients, optimizer state,
    activations and the rest, with advice sized from the figures.

    On CUDA, each step: the allocator's peak statistics are reset at the batch start and read at its
    end (host-side counters: no synchronisation), giving ``perf/mem_peak_allocated_gb``,
    ``perf/mem_peak_reserved_gb``, ``perf/mem_activations_gb`` (allocated after the forward less
    before it) and ``perf/mem_fragmentation_gb`` (reserved less allocated at the peak). On
    ``sample_step`` the parameters, gradients and optimizer state are summed from the tensors
    (sharded layouts count this rank's shard), and, unless the model is compiled, the activations
    autograd saves for the backward are counted and split by what ``activation_checkpointing``
    ``"selective"`` / ``"full"`` would free (logged as ``perf/mem_*_gb`` on that step). A CPU run
    reports those counts; the peak figures need a GPU.

    With ``record_history=True`` on CUDA the allocator records every allocation with its Python stack
    from the start of fit through ``sample_step``; at that step's end the snapshot is written to the
    log dir (``memory_snapshot_step{N}.pickle``) with the largest allocation sites at the recorded
    peak (``memory_sites_step{N}.md`` / ``.json``). On ``torch.OutOfMemoryError`` a snapshot is
    written (``memory_snapshot_oom.pickle``) with the sites live at the failure, the categories and
    the advice (``memory_sites_oom.md`` / ``.json``); the error's message gets a note naming the files.
    An OOM after ``sample_step`` has no stacks unless ``record_history="always"``.

    ``report()`` returns the figures (``perf.memory.MemoryReport``); ``PerfReport`` includes them.

    Args:
        sample_step: the global step whose tensors are counted and whose snapshot is written.
        record_history: ``True`` (through ``sample_step``), ``"always"`` (the whole fit, at the cost of
            recording a stack on every allocation) or ``False``.
        max_entries: allocation events the recording keeps (the newest).
        top: allocation sites listed.
        log: log the figures as metrics.
    """

    def __init__(self, *, sample_step: int = 1, record_history: Any = True, max_entries: int = 100_000,
                 top: int = 10, log: bool = True) -> None:
        super().__init__()
        if isinstance(sample_step, bool) or not isinstance(sample_step, int) or sample_step < 0:
            raise ValueError(f"sample_step must be an int >= 0, got {sample_step!r}")
        if record_history not in (True, False, "always"):
            raise ValueError(f"record_history must be True, False or 'always', got {record_history!r}")
        if max_entries < 1 or top < 1:
            raise ValueError(f"max_entries ({max_entries}) and top ({top}) must be >= 1")
        self.sample_step = sample_step
        self.record_history = record_history
        self.max_entries = max_entries
        self.top = top
        self.log = log
        self.files: list[str] = []
        self.oom_message: Optional[str] = None
        self.sampled_steps: list[int] = []  # steps slowed by recording or counting (PerfReport leaves them out)
        self._reset()

    def _reset(self) -> None:
        self._report: Optional[MemoryReport] = None
        self._device = torch.device("cpu")
        self._cuda = False
        self._recording = False
        self._counter: Optional[SavedTensorCounter] = None
        self._step = 0
        self._start_alloc = 0
        self._after_forward: Optional[int] = None
        self._counted = False
        self._grads = 0

    # ---- helpers ------------------------------------------------------------------------------------

    def _path(self, trainer: Trainer, stem: str, ext: str) -> str:
        rank = f"_rank{trainer.global_rank}" if int(getattr(trainer, "world_size", 1) or 1) > 1 else ""
        return os.path.join(log_dir_of(trainer), f"{stem}{rank}.{ext}")

    def _stats(self) -> AllocatorStats:
        return AllocatorStats.from_stats(torch.cuda.memory_stats_as_nested_dict(self._device))

    def _start_recording(self) -> None:
        if self._cuda and self.record_history and not self._recording:
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=self.max_entries)
            self._recording = True

    def _stop_recording(self) -> None:
        if self._recording:
            self._recording = False
            torch.cuda.memory._record_memory_history(enabled=None)

    def _count(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._report is not None
        cats = count_categories(pl_module.parameters(), trainer.optimizers, device=self._device)
        self._report.parameters, self._report.gradients = cats.parameters, cats.gradients
        self._report.optimizer_state = cats.optimizer_state
        self._report.gradients = max(cats.gradients, self._grads)

    def _dump(self, trainer: Trainer, tag: str) -> tuple[Optional[str], Optional[dict]]:
        """Write the allocator's snapshot; ``(path, snapshot)`` or ``(None, None)`` without one."""
        path = self._path(trainer, f"memory_snapshot_{tag}", "pickle")
        try:
            torch.cuda.memory._dump_snapshot(path)
            with open(path, "rb") as f:
                snapshot = pickle.load(f)
        except Exception:  # no CUDA allocator in this build, or the dump failed: report without it
            return None, None
        if not snapshot.get("segments") and not any(snapshot.get("device_traces") or []):
            os.remove(path)  # a CUDA build on a run without CUDA memory dumps an empty snapshot: nothing to show
            return None, None
        return path, snapshot

    def _write_sites(self, trainer: Trainer, tag: str, title: str, snapshot: dict, *, at_peak: bool,
                     extra: Optional[dict] = None) -> list[str]:
        if at_peak:
            total, allocations = trace_peak_allocations(snapshot, device=self._device.index or 0)
        else:
            allocations = block_allocations(snapshot)
            total = sum(size for size, _ in allocations)
        sites = top_sites(allocations, top=self.top)
        md, js = self._path(trainer, f"memory_sites_{tag}", "md"), self._path(trainer, f"memory_sites_{tag}", "json")
        body = sites_markdown(sites, title=title, total=total)
        if extra and extra.get("markdown"):
            body += "\n" + extra["markdown"]
        with open(md, "w") as f:
            f.write(body)
        with open(js, "w") as f:
            json.dump({"title": title, "total_bytes": total, "sites": [s.as_dict() for s in sites],
                       **{k: v for k, v in (extra or {}).items() if k != "markdown"}}, f, indent=2, default=str)
        return [md, js]

    # ---- hooks --------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()
        self.files, self.oom_message, self.sampled_steps = [], None, []
        self._device = device_of(trainer, pl_module)
        self._cuda = self._device.type == "cuda"
        total = torch.cuda.get_device_properties(self._device).total_memory if self._cuda else None
        self._report = MemoryReport(device_type=self._device.type, device_total=total,
                                    notes=[] if self._cuda else [_NEEDS_GPU])
        self._start_recording()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._report is None:
            return
        self._step = trainer.global_step
        self._report.micro_batch = batch_size_of(batch)[0] or self._report.micro_batch
        self._after_forward = None
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
            self._start_alloc = self._stats().allocated
        if self._step == self.sample_step and self._counter is None and not self._counted:
            if not run_settings_of(trainer, pl_module).compiled:
                self._counter = SavedTensorCounter(find_blocks(pl_module))
                self._counter.install()
        if self._recording or self._counter is not None:
            if not self.sampled_steps or self.sampled_steps[-1] != self._step:
                self.sampled_steps.append(self._step)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._cuda and self._after_forward is None:
            self._after_forward = self._stats().allocated
        if self._counter is not None:
            self._counter.remove()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # gradients are complete here; a module may free them right after the step
        if self._step == self.sample_step and not self._counted and self._report is not None:
            self._grads = tensor_bytes((p.grad for p in pl_module.parameters()), device=self._device)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        r = self._report
        if r is None:
            return
        values: dict[str, float] = {}
        if self._cuda:
            stats = self._stats()
            if r.peak_allocated is None or stats.peak_allocated > r.peak_allocated:
                r.peak_allocated, r.peak_reserved, r.peak_step = stats.peak_allocated, stats.peak_reserved, self._step
                r.inactive_split = stats.peak_inactive_split
                if self._after_forward is not None:
                    r.activations = max(0, self._after_forward - self._start_alloc)
            values = {"perf/mem_peak_allocated_gb": stats.peak_allocated / GB,
                      "perf/mem_peak_reserved_gb": stats.peak_reserved / GB,
                      "perf/mem_fragmentation_gb": max(0, stats.peak_reserved - stats.peak_allocated) / GB}
            if self._after_forward is not None:
                values["perf/mem_activations_gb"] = max(0, self._after_forward - self._start_alloc) / GB
        stepped = trainer.global_step > self._step  # the optimizer ran: gradients and its state exist
        if self._step == self.sample_step and stepped and not self._counted:
            self._counted = True
            self._count(trainer, pl_module)
            values.update({"perf/mem_params_gb": r.parameters / GB, "perf/mem_grads_gb": r.gradients / GB,
                           "perf/mem_optimizer_gb": r.optimizer_state / GB})
            if self._counter is not None:
                saved = self._counter.result
                self._counter = None
                r.saved_activations = saved.total
                r.selective_saves, r.full_saves = saved.selective_saves, saved.full_saves
                if not self._cuda:
                    r.activations = saved.total
                values["perf/mem_saved_activations_gb"] = saved.total / GB
            if self._recording:
                path, snapshot = self._dump(trainer, f"step{self._step}")
                if self.record_history is True:
                    self._stop_recording()
                if path is not None and snapshot is not None:
                    self.files += [path] + self._write_sites(
                        trainer, f"step{self._step}", f"Allocation sites at the recorded peak, steps 0-{self._step}",
                        snapshot, at_peak=True)
                    r.files = list(self.files)
        if self.log and values:
            log_scalars(pl_module, values)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._counter is not None:
            self._counter.remove()
            self._counter = None
        if isinstance(exception, torch.OutOfMemoryError) and self._report is not None:
            self._on_oom(trainer, pl_module, exception)
        self._stop_recording()

    def _on_oom(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        r = self._report
        assert r is not None
        recorded = self._recording
        try:
            self._count(trainer, pl_module)
        except Exception:  # counting must never hide the out-of-memory error itself
            pass
        if self._cuda:
            stats = self._stats()
            r.peak_allocated, r.peak_reserved, r.peak_step = stats.peak_allocated, stats.peak_reserved, self._step
            r.inactive_split = stats.peak_inactive_split
        path, snapshot = self._dump(trainer, "oom")
        settings = run_settings_of(trainer, pl_module)
        tips = memory_advice(r, settings)
        lines = [f"MemoryMonitor: out of memory at step {self._step}."]
        if path is not None and snapshot is not None:
            oom = oom_event(snapshot)
            md = oom_markdown(r, tips, requested=oom and oom["size"], device_free=oom and oom["device_free"])
            files = self._write_sites(trainer, "oom", f"Allocation sites live at the out-of-memory error (step "
                                      f"{self._step})", snapshot, at_peak=False,
                                      extra={"markdown": md, "memory": r.as_dict(), "oom": oom,
                                             "advice": [t.text for t in tips]})
            self.files += [path] + files
            r.files = list(self.files)
            lines.append(f"Memory snapshot: {path} (view it: python -m torch.cuda._memory_viz trace_plot {path} "
                         f"-o {os.path.splitext(path)[0]}.html).")
            lines.append(f"Largest allocation sites, categories and advice: {files[0]} (and {files[1]}).")
            if not recorded:
                lines.append("Allocations have no stack traces: history was not being recorded at this step; "
                             "MemoryMonitor(record_history='always') records it through the whole fit.")
        else:
            lines.append("No CUDA memory snapshot could be taken (the fit does not run on a CUDA device, or this "
                         "process has no CUDA allocator).")
        lines += [f"- {t.text}" for t in tips[:3]]
        self.oom_message = "\n".join(lines)
        if hasattr(exception, "add_note"):
            exception.add_note(self.oom_message)
        print(self.oom_message, file=sys.stderr)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_recording()
        if self._counter is not None:
            self._counter.remove()
            self._counter = None

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_recording()

    def report(self) -> Optional[MemoryReport]:
        """The run's memory figures (``None`` before a fit)."""
        if self._report is not None:
            self._report.files = list(self.files)
        return self._report
