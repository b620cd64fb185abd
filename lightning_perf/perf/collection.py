"""Python's cyclic garbage collector on a fixed step schedule, with one schedule in charge per process.

CPython starts a collection when allocations cross its thresholds. A training process holds
hundreds of thousands of tracked objects once its model is compiled, so an automatic full
collection can pause the host for a long time, and under data parallelism each rank pauses at its
own moment while the others wait for it in the next collective. A :class:`ScheduledCollection`
turns the automatic collector off for the duration of training, collects at the same global
steps on every rank, and moves what is alive at the start (and again after the first step,
once compilation and the first optimizer step are done) out of the collector's reach with
``gc.freeze``. The collector's previous state is restored at :meth:`ScheduledCollection.stop`.

Several parts of a program may each want a schedule: a callback the user attached, the
strategy's default and the model's default. Only one of them is in charge at a time, the one of
the highest :class:`Priority` that has started (later starters of a lower priority wait behind
it, a higher one takes over). A schedule with ``every_n_steps=None`` is a decision too: in
charge, it leaves Python's automatic collector as the program had it.
"""

from __future__ import annotations

import enum
import gc
import time
from typing import Any, Callable, Optional

__all__ = [
    "ScheduledCollection",
    "Priority",
    "CollectionTimer",
    "DEFAULT_EVERY_N_STEPS",
    "check_every_n_steps",
    "scheduled_every",
]

# global steps between scheduled collections when nobody says otherwise (a young-generation
# collection of what a few steps made: well under a millisecond once the long-lived objects are frozen)
DEFAULT_EVERY_N_STEPS = 10


class Priority(enum.IntEnum):
    """Who asked for a schedule; the highest that has started is in charge."""

    MODEL = 0  # a model's default (GPTLightningModule on any strategy)
    STRATEGY = 1  # a strategy's default or argument
    USER = 2  # a GarbageCollection callback the user attached


def check_every_n_steps(value: Any, *, allow_none: bool, name: str = "every_n_steps") -> Optional[int]:
    """``value`` if it is an int >= 1 (or None where allowed), else a ValueError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        off = " or None (Python's automatic collector, as the program has it)" if allow_none else ""
        raise ValueError(f"{name} must be an int >= 1{off}, got {value!r}")
    return value


class CollectionTimer:
    """Times every collection of Python's garbage collector while installed in ``gc.callbacks``:
    ``pauses`` holds ``(tag(), seconds)`` per collection (two clock reads each)."""

    def __init__(self, tag: Optional[Callable[[], Any]] = None) -> None:
        self.tag = tag
        self.pauses: list[tuple[Any, float]] = []
        self._t0: Optional[float] = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.pauses.append((self.tag() if self.tag is not None else None, time.perf_counter() - self._t0))
            self._t0 = None

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


class _Process:
    """What the process's collector looked like before the schedule in charge changed it."""

    started: list["ScheduledCollection"] = []  # every schedule between its start and its stop
    in_charge: Optional["ScheduledCollection"] = None
    was_enabled: Optional[bool] = None  # gc.isenabled() before the first schedule took charge
    froze = False  # the schedules froze objects (and will thaw them when the last one stops)


def scheduled_every() -> Optional[int]:
    """Steps between the scheduled collections of the schedule in charge now; None: Python's
    automatic collections (no schedule started, or the one in charge says so)."""
    return _Process.in_charge.every_n_steps if _Process.in_charge is not None else None


class ScheduledCollection:
    """Collect every ``every_n_steps`` global steps instead of when CPython decides.

    Call :meth:`start` when training starts, :meth:`after_step` after each training batch with
    the global step, and :meth:`stop` when training ends (also after an exception: it is safe to
    call twice). Each rank collects at the same steps, so ranks pause together and briefly.

    Args:
        every_n_steps: global steps between collections (>= 1); ``None``: no schedule, Python's
            automatic collector stays as the program had it (a decision that still overrides the
            defaults of lower priority).
        generation: the generation collected on schedule: 0, 1 (young objects only, fast) or 2.
        freeze: move the objects alive at the start, and again after the first step, to the
            permanent generation so later collections skip them (skipped when the program froze
            objects itself: the end of training could not thaw ours alone).
        priority: who asks (:class:`Priority`).
    """

    def __init__(self, every_n_steps: Optional[int] = DEFAULT_EVERY_N_STEPS, *, generation: int = 1,
                 freeze: bool = True, priority: Priority = Priority.USER) -> None:
        self.every_n_steps = check_every_n_steps(every_n_steps, allow_none=True)
        if generation not in (0, 1, 2) or isinstance(generation, bool):
            raise ValueError(f"generation must be 0, 1 or 2, got {generation!r}")
        self.generation = generation
        self.freeze = bool(freeze)
        self.priority = Priority(priority)
        self.collected_at: list[int] = []  # global steps at which a scheduled collection ran
        self.refrozen_at: Optional[int] = None  # the step after which the first step's objects were frozen
        self.timer = CollectionTimer()  # every collection while started (scheduled or not)

    # ---- state ---------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Between :meth:`start` and :meth:`stop`."""
        return self in _Process.started

    @property
    def in_charge(self) -> bool:
        """This schedule decides the process's collections now."""
        return _Process.in_charge is self

    @property
    def pauses_ms(self) -> list[float]:
        """Milliseconds of every collection while this schedule was started."""
        return [1e3 * seconds for _, seconds in self.timer.pauses]

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> bool:
        """Begin (a second start without a stop does nothing); whether this schedule is in charge."""
        if self.active:
            return self.in_charge
        self.collected_at, self.timer.pauses, self.refrozen_at = [], [], None
        self.timer.install()
        _Process.started.append(self)
        current = _Process.in_charge
        if current is None or self.priority > current.priority:
            self._take_charge()
        return self.in_charge

    def after_step(self, step: int) -> bool:
        """After a training batch at global step ``step``: collect if due; whether it collected."""
        if not self.in_charge or self.every_n_steps is None:
            return False
        if step >= 1 and self.refrozen_at is None:
            # compilation, kernel tuning and the first optimizer step are done: one full collection
            # moves what they left to the oldest generation (and a freeze, when ours, out of reach)
            gc.collect()
            if _Process.froze:
                gc.freeze()
            self.refrozen_at = step
        if step < 1 or step % self.every_n_steps or (self.collected_at and self.collected_at[-1] == step):
            return False  # (with gradient accumulation the global step holds for several batches)
        gc.collect(self.generation)
        self.collected_at.append(step)
        return True

    def stop(self) -> None:
        """End this schedule; the next one of the highest priority takes charge, or, when none is
        left, the collector is back as it was before the first schedule started."""
        if not self.active:
            return
        self.timer.remove()
        _Process.started.remove(self)
        if not self.in_charge:
            return
        _Process.in_charge = None
        if _Process.started:
            max(_Process.started, key=lambda s: s.priority)._take_charge()
        else:
            _restore()

    # ---- internals -------------------------------------------------------------------------

    def _take_charge(self) -> None:
        if _Process.in_charge is None and _Process.was_enabled is None:
            _Process.was_enabled = gc.isenabled()
        _Process.in_charge = self
        if self.every_n_steps is None:  # automatic collection, as the program had it
            if _Process.froze:
                gc.unfreeze()
                _Process.froze = False
            if _Process.was_enabled:
                gc.enable()
            return
        gc.collect()
        # freezing is undone with gc.unfreeze() at the end, which would also thaw objects someone else
        # froze: with a permanent generation already in use, leave it alone
        if self.freeze and not _Process.froze and gc.get_freeze_count() == 0:
            gc.freeze()
            _Process.froze = True
        gc.disable()


def _restore() -> None:
    if _Process.froze:
        gc.unfreeze()  # back into the oldest generation: collectable again
        _Process.froze = False
    if _Process.was_enabled:
        gc.enable()
    elif _Process.was_enabled is not None:
        gc.disable()
    _Process.was_enabled = None
