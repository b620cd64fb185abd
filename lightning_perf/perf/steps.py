"""The measured window of a run: step timing without host-device syncs, and sums over the steps.

One step, as every figure of the pack counts it, is the wall time from one batch start to the
next batch start: the step's forward, backward and optimizer, the hooks and logging after it, and
the wait for the next batch (data waits included). The last step of a run ends at its own batch
end (no batch follows it). Its ``gap`` is the part from the batch end to the next batch start,
where the device idles while the host loads data and runs hooks.

The window is the mean over the measured steps: every step after the warm-up, less the steps
that a diagnostic callback sampled (profiled, counted, re-measured), which run slower than the
others by the diagnostic's own cost. Rates are totals over totals (``tokens / seconds``), so a
rate always equals the per-step count divided by the window's mean step time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Collection, Optional

import torch

__all__ = ["host_clock", "EventPool", "StepRecord", "StepTimer", "StepRow", "StepLedger", "StepWindow"]


def host_clock() -> float:
    """Host seconds (monotonic); the one clock the pack's callbacks read on the host."""
    return time.perf_counter()


class EventPool:
    """Timing events recorded on the current stream, recycled once read (no per-step allocation).

    ``record()`` returns an event recorded now; ``release(event)`` hands back one whose time
    was read (it has completed, so reusing it cannot disturb a pending measurement).
    """

    def __init__(self) -> None:
        self._free: list[Any] = []

    def record(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def release(self, event: Any) -> None:
        if event is not None and len(self._free) < 64:
            self._free.append(event)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One timed step: ``payload`` as given at its start, ``after`` as given when the next step started."""

    index: int
    seconds: float
    gap_s: Optional[float]
    payload: Any = None
    after: Any = None


class StepTimer:
    """Wall time of every step (batch start to next batch start), read without host-device sync.

    On CUDA each ``start()``/``end()`` records an event and ``poll()`` returns the steps whose
    closing event has completed (``Event.query()``, non-blocking), a step or more later. On CPU the
    host clock is read and steps resolve at once. ``finish()`` closes the last step at its batch end
    and waits for the device: only for the end of a run.
    """

    def __init__(self, device: Optional[torch.device] = None, *, max_pending: int = 256) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.max_pending = max_pending
        self._events = EventPool() if self.cuda else None
        self._pending: deque[tuple[int, Any, Any, Any, Any, Any]] = deque()
        self._open: Optional[list[Any]] = None  # [index, start stamp, end stamp, payload]
        self._next = 0

    @property
    def index(self) -> int:
        """Index of the step running now (-1 before the first start)."""
        return self._next - 1

    def _stamp(self) -> Any:
        return self._events.record() if self._events is not None else host_clock()

    def start(self, payload: Any = None, *, after: Any = None) -> None:
        """A batch starts: the previous step closes here (carrying ``after``), a new one opens."""
        now = self._stamp()
        if self._open is not None:
            index, start, end, prev_payload = self._open
            self._pending.append((index, start, end, now, prev_payload, after))
            if len(self._pending) > self.max_pending:  # never read: drop the oldest, no sync
                dropped = self._pending.popleft()
                self._release(dropped[1], dropped[2])
        self._open = [self._next, now, None, payload]
        self._next += 1

    def end(self) -> None:
        """The running step's batch ends (its compute is queued)."""
        if self._open is not None:
            if self._open[2] is not None and self._events is not None:
                self._events.release(self._open[2])
            self._open[2] = self._stamp()

    def _release(self, *events: Any) -> None:
        if self._events is not None:
            for event in events:
                if event is not None:
                    self._events.release(event)

    def poll(self) -> list[StepRecord]:
        """Steps resolved since the last poll, in order; never blocks."""
        out: list[StepRecord] = []
        while self._pending:
            index, start, end, close, payload, after = self._pending[0]
            if self.cuda and not close.query():
                break
            self._pending.popleft()
            if self.cuda:
                seconds = start.elapsed_time(close) / 1e3
                gap = end.elapsed_time(close) / 1e3 if end is not None else 0.0
            else:
                seconds = close - start
                gap = close - end if end is not None else 0.0
            # ``close`` opens the next step (or, for the last step, is released with the pool)
            self._release(start, end)
            out.append(StepRecord(index, seconds, gap, payload, after))
        return out

    def finish(self, *, after: Any = None) -> list[StepRecord]:
        """Close the running step at its batch end (no gap; dropped if it never ended), wait, poll."""
        if self._open is not None:
            index, start, end, payload = self._open
            self._open = None
            if end is not None:
                self._pending.append((index, start, None, end, payload, after))
        if self.cuda and self._pending:
            self._pending[-1][3].synchronize()
        return self.poll()

    def reset(self) -> None:
        self._pending.clear()
        self._open = None
        self._next = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRow:
    """What one step did: its seconds, and what the recording callback counts (``None``: not counted)."""

    index: int
    seconds: float
    gap_s: Optional[float] = None
    data_wait_s: Optional[float] = None
    samples: int = 0
    tokens: Optional[int] = None  # None: the batch has no token dimension
    flops: Optional[float] = None  # model FLOPs of this process's batch
    hardware_flops: Optional[float] = None


def _sum(values: list[Optional[float]]) -> Optional[float]:
    return None if not values or any(v is None for v in values) else float(sum(values))  # type: ignore[arg-type]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]) of a sorted, non-empty list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass(frozen=True, kw_only=True)
class StepWindow:
    """Sums over the measured steps of a window (see the module docstring)."""

    steps: int
    steps_run: int  # every step recorded, warm-up and sampled ones included
    warmup: int
    left_out: int  # steps after the warm-up left out because a diagnostic sampled them
    first: Optional[int] = None
    last: Optional[int] = None
    seconds: float = 0.0
    median_step_s: Optional[float] = None
    p90_step_s: Optional[float] = None
    gap_s: Optional[float] = None
    data_wait_s: Optional[float] = None
    samples: int = 0
    tokens: Optional[int] = None
    flops: Optional[float] = None
    hardware_flops: Optional[float] = None

    @property
    def mean_step_s(self) -> Optional[float]:
        return self.seconds / self.steps if self.steps else None

    @property
    def data_wait_share(self) -> Optional[float]:
        """Data wait over wall time of the window (``None`` when not measured or empty)."""
        if self.data_wait_s is None or self.seconds <= 0:
            return None
        return self.data_wait_s / self.seconds

    def describe(self) -> str:
        """The window in words, as the report and the warnings state it."""
        if not self.steps:
            return (f"no step measured: {self.steps_run} step(s) ran and the first {self.warmup} are warm-up; "
                    f"run at least {self.warmup + 1 + self.left_out} steps or lower warmup_steps")
        left = f", {self.left_out} sampled by diagnostics left out" if self.left_out else ""
        span = f"step {self.first}" if self.first == self.last else f"steps {self.first}-{self.last}"
        plural = "s" if self.steps != 1 else ""
        return (f"{span}: mean over {self.steps} measured step{plural} after {self.warmup} warm-up{left}; "
                "wall time, data waits included")


class StepLedger:
    """Every timed step of a run, in order; ``window()`` sums the measured ones."""

    def __init__(self) -> None:
        self.rows: list[StepRow] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: StepRow) -> None:
        self.rows.append(row)

    def clear(self) -> None:
        self.rows = []

    def window(self, *, warmup: int, exclude: Collection[int] = (), last: Optional[int] = None) -> StepWindow:
        """Sums over the steps with ``index >= warmup`` not in ``exclude`` (only the ``last`` such
        steps when given)."""
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        after = [r for r in self.rows if r.index >= warmup]
        rows = [r for r in after if r.index not in exclude]
        left_out = len(after) - len(rows)
        if last is not None:
            rows = rows[-last:] if last > 0 else []
        if not rows:
            return StepWindow(steps=0, steps_run=len(self.rows), warmup=warmup, left_out=left_out)
        times = sorted(r.seconds for r in rows)
        tokens = _sum([r.tokens for r in rows])  # type: ignore[misc]
        return StepWindow(
            steps=len(rows), steps_run=len(self.rows), warmup=warmup, left_out=left_out,
            first=rows[0].index, last=rows[-1].index, seconds=float(sum(times)),
            median_step_s=_percentile(times, 0.5), p90_step_s=_percentile(times, 0.9),
            gap_s=_sum([r.gap_s for r in rows]), data_wait_s=_sum([r.data_wait_s for r in rows]),
            samples=sum(r.samples for r in rows), tokens=None if tokens is None else int(tokens),
            flops=_sum([r.flops for r in rows]), hardware_flops=_sum([r.hardware_flops for r in rows]),
        )
