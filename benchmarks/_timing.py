"""Step timing shared by the benchmarks: one CUDA event (or host clock) per step, read after the run."""

from __future__ import annotations

import time
from typing import Any

import torch


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


def graph_breaks() -> dict[str, Any]:
    """Dynamo's graph breaks in this process since its last ``counters.clear()``: the count and the
    three most frequent reasons (a compiled variant should show none)."""
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    return {"graph_breaks": sum(breaks.values()), "graph_break_reasons": sorted(breaks, key=lambda r: -breaks[r])[:3]}


def clear_graph_breaks() -> None:
    from torch._dynamo.utils import counters

    counters.clear()
