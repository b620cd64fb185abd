"""GarbageCollection: Python's cyclic collector on a fixed step schedule, the same on every rank."""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_perf.callbacks._utils import log_scalars

__all__ = ["GarbageCollection", "CollectionTimer"]


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


class GarbageCollection(Callback):
    """Run Python's cyclic garbage collector every ``every_n_steps`` steps instead of when it decides.

    CPython starts a collection when allocations cross its thresholds; a full collection walks every
    tracked object, and a training process holds hundreds of thousands of them once models are
    compiled, so one full collection can pause the host for hundreds of milliseconds. Under
    data parallelism each rank pauses at its own moment and the others wait for it inside the next
    collective: the pause shows up as one rank's "exposed communication" and as lost throughput on
    all of them. With this callback the automatic collector is off during ``fit``; every rank
    collects at the same global steps (so the ranks pause together, and briefly), and everything
    alive when training starts is moved out of the collector's reach (``gc.freeze``), once at the
    start and again after the first step (one full collection, then a freeze of what compilation,
    kernel tuning and the first optimizer step created: a pause paid inside the warm-up, not
    later). The collector's previous state is restored when
    ``fit`` ends, also after an exception.

    Reference cycles made during training are freed at the next scheduled collection rather than at
    an arbitrary moment; tensors without cycles are freed by reference counting as always.

    Logs ``perf/gc_ms`` (milliseconds spent collecting at that step, automatic collections included
    when another part of the program turned the collector back on) on the steps that collect.

    Args:
        every_n_steps: global steps between collections (>= 1).
        generation: the generation collected on schedule: 0, 1 (default: young objects only, fast)
            or 2 (everything not frozen).
        freeze: move the objects alive at the start (and after the first step) to the
            permanent generation, so later collections skip them (skipped when the program froze
            objects itself: the end of fit could not thaw ours alone).
    """

    def __init__(self, every_n_steps: int = 50, *, generation: int = 1, freeze: bool = True) -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if generation not in (0, 1, 2) or isinstance(generation, bool):
            raise ValueError(f"generation must be 0, 1 or 2, got {generation!r}")
        self.every_n_steps = every_n_steps
        self.generation = generation
        self.freeze = bool(freeze)
        self.collected_at: list[int] = []  # global steps at which a scheduled collection ran
        self._on_gc = CollectionTimer()  # every collection during fit (scheduled or not)
        self._logged = 0  # collections already counted in a logged perf/gc_ms
        self._was_enabled: Optional[bool] = None
        self._froze = False
        self._refrozen = False
        self.refrozen_at: Optional[int] = None  # the step after which compilation's objects were frozen

    @property
    def pauses_ms(self) -> list[float]:
        """Milliseconds of every collection during the last fit."""
        return [1e3 * seconds for _, seconds in self._on_gc.pauses]

    def _start(self) -> None:
        if self._was_enabled is not None:  # already active (a second start without an end)
            return
        self._was_enabled = gc.isenabled()
        self.collected_at, self._on_gc.pauses, self._logged = [], [], 0
        self._on_gc.install()
        gc.collect()
        # freezing is undone with gc.unfreeze() at the end, which would also thaw objects someone else
        # froze: with a permanent generation already in use, leave it alone
        if self.freeze and gc.get_freeze_count() == 0:
            gc.freeze()
            self._froze = True
        self._refrozen = False
        gc.disable()

    def _stop(self) -> None:
        if self._was_enabled is None:
            return
        self._on_gc.remove()
        if self._froze:
            gc.unfreeze()  # back into the oldest generation: collectable again
            self._froze = False
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    # ---- hooks -------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._was_enabled is None:
            return
        step = trainer.global_step
        if step >= 1 and not self._refrozen:
            # compilation, kernel tuning and the first optimizer step are done: one full collection
            # moves what they left to the oldest generation (and a freeze, when ours, out of reach),
            # so no scheduled young-generation collection walks those objects again
            gc.collect()
            if self._froze:
                gc.freeze()
            self._refrozen, self.refrozen_at = True, step
        if step < 1 or step % self.every_n_steps or (self.collected_at and self.collected_at[-1] == step):
            self._log_pauses(pl_module)
            return  # (with gradient accumulation global_step holds for several batches: collect once)
        gc.collect(self.generation)
        self.collected_at.append(step)
        self._log_pauses(pl_module)

    def _log_pauses(self, pl_module: LightningModule) -> None:
        if len(self._on_gc.pauses) == self._logged:
            return
        pauses = self.pauses_ms
        log_scalars(pl_module, {"perf/gc_ms": sum(pauses[self._logged:])})
        self._logged = len(pauses)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()
