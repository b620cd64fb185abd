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
from array import array
from bisect import bisect_left
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
    attention_flops: Optional[float] = None  # the attention part of ``flops``


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
    attention_flops: Optional[float] = None

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


_FIELDS = ("seconds", "gap_s", "data_wait_s", "samples", "tokens", "flops", "hardware_flops", "attention_flops")


class _Sums:
    """Totals of the ``_FIELDS`` over some rows, and how many rows left each one uncounted."""

    __slots__ = ("total", "missing", "rows")

    def __init__(self) -> None:
        self.total = [0.0] * len(_FIELDS)
        self.missing = [0] * len(_FIELDS)
        self.rows = 0

    def add(self, values: list[float], sign: int = 1) -> None:
        self.rows += sign
        for f, v in enumerate(values):
            if v != v:  # NaN: not counted in this row
                self.missing[f] += sign
            else:
                self.total[f] += sign * v

    def value(self, field: str) -> Optional[float]:
        f = _FIELDS.index(field)
        return None if self.missing[f] or not self.rows else self.total[f]


class StepLedger:
    """Every timed step of a run, in order of index, stored column-wise (a few bytes a step) with
    running totals: ``window()`` over the whole run costs the warm-up and the left-out steps, not
    the length of the run, so a callback can ask for it every few steps."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._index = array("q")
        self._columns = [array("d") for _ in _FIELDS]
        self._all = _Sums()

    def __len__(self) -> int:
        return len(self._index)

    def add(self, row: StepRow) -> None:
        if self._index and row.index <= self._index[-1]:
            raise ValueError(f"steps are added in order: index {row.index} after {self._index[-1]}")
        values = [math.nan if getattr(row, f) is None else float(getattr(row, f)) for f in _FIELDS]
        self._index.append(row.index)
        for column, v in zip(self._columns, values):
            column.append(v)
        self._all.add(values)

    def _values(self, pos: int) -> list[float]:
        return [column[pos] for column in self._columns]

    def indices(self, *, warmup: int, exclude: Collection[int] = ()) -> list[int]:
        """Indices of the measured steps."""
        return [i for i in self._index[bisect_left(self._index, warmup):] if i not in exclude]

    def window(self, *, warmup: int, exclude: Collection[int] = (), last: Optional[int] = None,
               spread: bool = False) -> StepWindow:
        """Sums over the steps with ``index >= warmup`` not in ``exclude`` (only the ``last`` such steps
        when given); ``spread`` adds the median and p90 step (a sort of the window's step times)."""
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        start = bisect_left(self._index, warmup)
        excluded = sorted({bisect_left(self._index, i) for i in exclude if i >= warmup and self._has(i)})
        sums = _Sums()
        if last is None:
            sums.total, sums.missing, sums.rows = list(self._all.total), list(self._all.missing), self._all.rows
            for pos in range(start):
                sums.add(self._values(pos), -1)
            for pos in excluded:
                sums.add(self._values(pos), -1)
            skip = set(excluded)
            first = next((p for p in range(start, len(self._index)) if p not in skip), None)
            final = next((p for p in range(len(self._index) - 1, start - 1, -1) if p not in skip), None)
        else:
            skip = set(excluded)
            taken: list[int] = []
            for pos in range(len(self._index) - 1, start - 1, -1):
                if len(taken) >= last:
                    break
                if pos not in skip:
                    taken.append(pos)
            for pos in taken:
                sums.add(self._values(pos))
            first, final = (taken[-1], taken[0]) if taken else (None, None)
        base = dict(steps_run=len(self._index), warmup=warmup, left_out=len(excluded))
        if not sums.rows or first is None or final is None:
            return StepWindow(steps=0, **base)
        median = p90 = None
        if spread:
            times = sorted(self._columns[0][p] for p in range(first, final + 1) if p not in skip)
            median, p90 = _percentile(times, 0.5), _percentile(times, 0.9)
        tokens = sums.value("tokens")
        return StepWindow(
            steps=sums.rows, **base, first=self._index[first], last=self._index[final],
            seconds=sums.total[0], median_step_s=median, p90_step_s=p90,
            gap_s=sums.value("gap_s"), data_wait_s=sums.value("data_wait_s"),
            samples=int(round(sums.total[_FIELDS.index("samples")])),
            tokens=None if tokens is None else int(round(tokens)),
            flops=sums.value("flops"), hardware_flops=sums.value("hardware_flops"),
            attention_flops=sums.value("attention_flops"),
        )

    def _has(self, index: int) -> bool:
        pos = bisect_left(self._index, index)
        return pos < len(self._index) and self._index[pos] == index
