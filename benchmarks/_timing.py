"""Step timing shared by the benchmarks: the wall-clock window every throughput headline comes from
(:class:`Window`, and :class:`WallClockWindow` around a Trainer), and one CUDA event (or host clock)
per step, read after the run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch import Callback


class StepTimer:
    """``mark()`` at every step boundary; ``step_times()`` reads all marks once, at the end.

    On CUDA the marks are events recorded on the current stream, so marking never waits for the
    device; the single synchronisation happens in ``step_times``.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_times(self, skip: int = 0) -> list[float]:
        """Seconds between consecutive marks, the first ``skip`` intervals left out."""
        if self.cuda:
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            times = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return times[skip:]


class StepTimes(Callback):
    """A step mark at every batch start (a :class:`StepTimer` on the trainer's device); read after the fit."""

    def __init__(self) -> None:
        self.timer = StepTimer(False)

    def on_train_start(self, trainer, pl_module) -> None:
        self.timer = StepTimer(trainer.strategy.root_device.type == "cuda")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.timer.mark()

    def step_times(self, skip: int) -> list[float]:
        return self.timer.step_times(skip)


def graph_breaks() -> dict[str, Any]:
    """Dynamo's graph breaks in this process since its last ``counters.clear()``: the count and the
    three most frequent reasons (a compiled variant should show none)."""
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    return {"graph_breaks": sum(breaks.values()), "graph_break_reasons": sorted(breaks, key=lambda r: -breaks[r])[:3]}


def clear_graph_breaks() -> None:
    from torch._dynamo.utils import counters

    counters.clear()


def window_stats(wall_s: float, step_times: list[float], tokens: int) -> dict[str, Any]:
    """The headline (tokens over the window's wall time, and its mean step) with the median, p90 and
    slowest step beside it."""
    ordered = sorted(step_times)
    steps = len(ordered)
    return {
        "steps_timed": steps, "wall_s": wall_s, "tokens": tokens, "tokens_per_s": tokens / wall_s,
        "step_ms_mean": 1e3 * wall_s / steps, "step_ms_median": 1e3 * statistics.median(ordered),
        "step_ms_p90": 1e3 * ordered[min(steps - 1, int(0.9 * steps))], "step_ms_max": 1e3 * ordered[-1],
    }


class Window:
    """Wall-clock time over a window of steps, as the user pays it: ``open()`` before the first timed
    step, ``step(tokens)`` at the start of every timed step, ``close()`` after the last.

    The device is synchronised at both ends only, each time followed by ``barrier`` where one is
    given (a multi-rank run opens and closes its window together on every rank, so rank 0's clock
    spans every rank's steps); everything between counts. Per-step CUDA events (host marks on a CPU)
    give the median, p90 and slowest step; Python garbage collections and Dynamo recompilations and
    graph breaks inside the window are recorded beside them, so a slow window can be explained.
    """

    def __init__(self, cuda: bool, barrier: Callable[[], Any] | None = None, first_step: int = 0) -> None:
        self.cuda = cuda
        self.barrier = barrier
        self.first_step = first_step
        self.result: dict[str, Any] = {}
        self._host: list[float] = []
        self._events: list[Any] = []
        self._gc: list[tuple[int, float, Any]] = []
        self._gc_t0: float | None = None
        self._t0: float | None = None
        self._t1: float | None = None
        self._tokens = 0
        self._peak_before = 0

    @property
    def is_open(self) -> bool:
        return self._t0 is not None and self._t1 is None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        if self.barrier is not None:
            self.barrier()
            if self.cuda:
                torch.cuda.synchronize()

    def _gc_cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            step = self.first_step + max(0, len(self._host) - 1)
            self._gc.append((step, time.perf_counter() - self._gc_t0, info.get("generation")))
            self._gc_t0 = None

    def open(self) -> None:
        import gc

        from torch._dynamo.utils import counters

        if self._t0 is not None:
            raise RuntimeError("a window opens once; make a new Window for another")
        self._sync()
        self._graphs0 = int(counters["stats"].get("unique_graphs", 0))
        self._breaks0 = sum(counters.get("graph_break", {}).values())
        if self.cuda:
            self._peak_before = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        gc.callbacks.append(self._gc_cb)
        self._t0 = time.perf_counter()

    def step(self, tokens: int) -> None:
        """At the start of a timed step: its mark, and the tokens it trains on (over all replicas)."""
        if not self.is_open:
            raise RuntimeError("Window.step() between open() and close() only")
        self._host.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        self._tokens += int(tokens)

    def close(self) -> dict[str, Any]:
        """Ends the window (once; later calls return the same result): :func:`window_stats` and what
        explains a slow window."""
        import gc

        from torch._dynamo.utils import counters

        if self._t1 is not None:
            return self.result
        if not self._host:
            raise RuntimeError("a window needs at least one step() between open() and close()")
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        self._sync()
        self._t1 = time.perf_counter()
        self._host.append(self._t1)
        if self._gc_cb in gc.callbacks:
            gc.callbacks.remove(self._gc_cb)
        device = [a.elapsed_time(b) / 1e3 for a, b in zip(self._events, self._events[1:])]
        times = device or [b - a for a, b in zip(self._host, self._host[1:])]
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        self.result.update(
            window_stats(self._t1 - self._t0, times, self._tokens),
            slowest_steps=sorted(
                ({"step": self.first_step + i, "ms": round(1e3 * t, 2)} for i, t in enumerate(times)),
                key=lambda r: -r["ms"],
            )[:5],
            gc_in_window=[{"step": s, "ms": round(1e3 * d, 2), "generation": g} for s, d, g in self._gc],
            gc_count_in_window=len(self._gc),
            gc_ms_in_window=1e3 * sum(d for _, d, _ in self._gc),
            recompiles_in_window=int(counters["stats"].get("unique_graphs", 0)) - self._graphs0,
            graph_breaks_in_window=sum(counters.get("graph_break", {}).values()) - self._breaks0,
            peak_mem_gb=peak / 1e9 if peak is not None else None,
            peak_mem_gb_before_window=self._peak_before / 1e9 if self.cuda else None,
            # CUDA graph replays draw on memory their capture reserved before the window, which the
            # allocated peaks above do not see: the reserved peak over the whole run does
            peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9 if self.cuda else None,
        )
        return self.result


class WallClockWindow(Callback):
    """A Lightning callback: a :class:`Window` over the ``steps`` steps after ``warmup`` (default: to
    the end of the fit), as the user pays it.

    The window opens at the start of step ``warmup`` and closes at the end of its last step, after a
    device synchronisation and the strategy's barrier at both ends only; everything between (the
    loop, logging, callbacks, garbage collection, data) counts. One validation pass and one
    checkpoint save (``checkpoint``) are timed beside it. ``warmup`` and ``out`` default to
    ``BENCH_WINDOW_WARMUP`` and ``BENCH_WINDOW_OUT``, ``checkpoint`` to ``BENCH_WINDOW_CHECKPOINT``
    (environment variables, so a recipe run needs no extra arguments); the result is written there
    as JSON. A step is an optimizer step: under gradient accumulation its mark is at its first
    micro-batch and its tokens those of all its micro-batches.
    """

    def __init__(self, warmup: int | None = None, out: str | None = None, steps: int | None = None,
                 checkpoint: bool | None = None) -> None:
        import os

        super().__init__()
        self.warmup = int(warmup if warmup is not None else os.environ.get("BENCH_WINDOW_WARMUP", 10))
        self.out = out or os.environ.get("BENCH_WINDOW_OUT")
        self.steps = steps
        self.checkpoint = (checkpoint if checkpoint is not None
                           else os.environ.get("BENCH_WINDOW_CHECKPOINT", "1") != "0")
        self.result: dict[str, Any] = {}
        self.window: Window | None = None
        self._val_s: list[float] = []
        self._marked_step: Optional[int] = None
        profiled = int(os.environ.get("BENCH_PROFILE_STEPS", 0))
        self._profile = StepProfile(profiled) if profiled else None

    def _sync(self, trainer: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def _last_step(self, trainer: Any) -> int:
        return self.warmup + self.steps if self.steps is not None else trainer.max_steps

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.max_steps < 0:
            raise ValueError("WallClockWindow needs Trainer(max_steps=...): the window ends at a known step")
        if self._last_step(trainer) > trainer.max_steps or self.warmup >= self._last_step(trainer):
            raise ValueError(f"WallClockWindow times steps {self.warmup} to {self._last_step(trainer) - 1}, "
                             f"but the fit runs steps 0 to {trainer.max_steps - 1}: raise max_steps or lower "
                             f"warmup / steps")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.warmup and self.window is None:
            self.window = Window(trainer.strategy.root_device.type == "cuda", barrier=trainer.strategy.barrier,
                                 first_step=step)
            self.window.open()
        # one mark per optimizer step, at its first micro-batch (with gradient accumulation Lightning calls this
        # hook once per micro-batch, all of a step's under one global_step)
        if self.window is not None and self.window.is_open and step != self._marked_step:
            self._marked_step = step
            if self._profile is not None and step == self._last_step(trainer) - self._profile.steps:
                self._profile.start()
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            # every data-parallel replica sees its own batch; tensor / pipeline ranks share one
            replicas = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)
            micro_batches = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
            self.window.step(int(x.numel()) * max(1, int(replicas)) * micro_batches)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.window is not None and self.window.is_open and trainer.global_step >= self._last_step(trainer):
            self._close(trainer)

    def _close(self, trainer: Any) -> None:
        import os

        if self.window is None or not self.window.is_open:
            return
        self.result.update(self.window.close())
        if self._profile is not None and trainer.is_global_zero:
            trace = os.path.join(os.path.dirname(self.out), "profile_" + os.path.basename(self.out)) if self.out else None
            self.result["profile"] = self._profile.stop(trace)
        if os.environ.get("BENCH_GC_CENSUS") == "1":
            self.result["gc_census"] = gc_census()
        if self.out and trainer.is_global_zero:  # the measurement is complete: kept should the fit not end
            import json

            with open(f"{self.out}.window", "w") as f:
                json.dump(dict(self.result, finished=False), f, indent=2)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        self._sync(trainer)
        self._v0 = time.perf_counter()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        self._sync(trainer)
        self._val_s.append(time.perf_counter() - self._v0)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        import json
        import shutil
        import tempfile

        self._close(trainer)
        self.result["validation_s"] = self._val_s
        self.result["checkpoint_save_s"] = None
        if self.checkpoint:
            # one directory for every rank: a sharded checkpoint is one directory written by all of them
            tmp = trainer.strategy.broadcast(tempfile.mkdtemp() if trainer.is_global_zero else None)
            self._sync(trainer)
            t = time.perf_counter()
            trainer.save_checkpoint(f"{tmp}/bench.ckpt")
            self._sync(trainer)
            self.result["checkpoint_save_s"] = time.perf_counter() - t
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                shutil.rmtree(tmp, ignore_errors=True)
        self.result["precision_plugin"] = type(trainer.precision_plugin).__name__
        self.result["strategy"] = type(trainer.strategy).__name__
        if self.out and trainer.is_global_zero:
            with open(self.out, "w") as f:
                json.dump(self.result, f, indent=2)


def gc_census(limit: int = 15) -> dict[str, Any]:
    """The objects Python's collector tracks outside the frozen set, by type and function name; then
    one timed collection of them."""
    import collections
    import gc

    objs = gc.get_objects()
    types = collections.Counter(type(o).__name__ for o in objs)
    funcs = collections.Counter(f"{getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', '?')}"
                                for o in objs if type(o).__name__ == "function")
    n = len(objs)
    del objs
    t = time.perf_counter()
    freed = gc.collect(1)
    pause = time.perf_counter() - t
    return {"tracked": n, "collected": freed, "collect_ms": 1e3 * pause, "types": types.most_common(limit),
            "functions": funcs.most_common(limit)}


class StepProfile:
    """``torch.profiler`` over the last ``steps`` steps of a window (``BENCH_PROFILE_STEPS``), summarised
    so two runs of the same model can be compared kernel by kernel: the GPU's busy time (the union of
    kernel intervals) against the span, the largest idle gaps with the host op running when each
    began, and kernel time by name. The profiler's overhead lands in those steps, so a profiled run's
    window figures are not a measurement; run it as its own variant."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._prof = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()

    def stop(self, trace_path: Optional[str] = None) -> dict[str, Any]:
        import collections
        import gzip
        import json
        import os
        import tempfile

        if self._prof is None:
            return {}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        path = trace_path or os.path.join(tempfile.mkdtemp(), "trace.json")
        self._prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if trace_path and trace_path.endswith(".json"):
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                g.write(f.read())
            os.remove(path)
        kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                         if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
        host = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                      if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation"))
        by_name: collections.Counter = collections.Counter()
        calls: collections.Counter = collections.Counter()
        busy, gaps, end = 0.0, [], None
        for s, e, name in kernels:
            by_name[name[:90]] += e - s
            calls[name[:90]] += 1
            if end is None or s > end:
                if end is not None:
                    gaps.append((s - end, end))
                busy += e - s
                end = e
            elif e > end:
                busy += e - end
                end = e
        span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0

        def host_op_at(t: float) -> str:
            running = [n for s, e, n in host if s <= t <= e]
            return " > ".join(running[-3:]) if running else "?"

        top_gaps = sorted(gaps, reverse=True)[:8]
        return {
            "steps": self.steps, "kernels": len(kernels), "span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3,
            "gpu_idle_ms": (span - busy) / 1e3, "idle_gaps_over_50us_ms": sum(g for g, _ in gaps if g > 50) / 1e3,
            "largest_gaps": [{"ms": round(g / 1e3, 3), "host": host_op_at(t)} for g, t in top_gaps],
            "kernel_ms_by_name": [{"name": n, "ms": round(t / 1e3, 3), "calls": calls[n]}
                                  for n, t in by_name.most_common(40)],
        }


def gpu_time_of(fn: Callable[[], Any], *, top: int = 25) -> dict[str, Any]:
    """Where one call of ``fn`` spends GPU time (``perf.gpu_time.gpu_time_breakdown`` of a profiled call,
    synchronised before the profiler stops); ``{}`` where no GPU kernel ran."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from lightning_perf.perf.gpu_time import gpu_time_breakdown

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = f"{tmp}/trace.json"
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f).get("traceEvents", [])
    return gpu_time_breakdown(events, steps=1, top=top)
