"""GarbageCollection: Python's cyclic collector on a fixed step schedule, the same on every rank."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_perf.callbacks._utils import log_scalars
from lightning_perf.perf.collection import (
    DEFAULT_EVERY_N_STEPS,
    CollectionTimer,
    Priority,
    ScheduledCollection,
    check_every_n_steps,
)

__all__ = ["GarbageCollection", "DefaultCollection", "CollectionTimer"]


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

    The pack's strategies (every ``zero*`` name, ``parallel3d``) and ``GPTLightningModule`` run the
    same schedule by default (their ``gc_every_n_steps`` argument changes the interval or, as
    ``None``, turns it off); an attached ``GarbageCollection`` takes precedence over both.

    Args:
        every_n_steps: global steps between collections (>= 1).
        generation: the generation collected on schedule: 0, 1 (default: young objects only, fast)
            or 2 (everything not frozen).
        freeze: move the objects alive at the start (and after the first step) to the
            permanent generation, so later collections skip them (skipped when the program froze
            objects itself: the end of fit could not thaw ours alone).
    """

    def __init__(self, every_n_steps: int = DEFAULT_EVERY_N_STEPS, *, generation: int = 1, freeze: bool = True) -> None:
        super().__init__()
        check_every_n_steps(every_n_steps, allow_none=False)
        self.schedule = ScheduledCollection(every_n_steps, generation=generation, freeze=freeze, priority=Priority.USER)
        self._logged = 0  # collections already counted in a logged perf/gc_ms

    @property
    def every_n_steps(self) -> Optional[int]:
        return self.schedule.every_n_steps

    @property
    def generation(self) -> int:
        return self.schedule.generation

    @property
    def freeze(self) -> bool:
        return self.schedule.freeze

    @property
    def collected_at(self) -> list[int]:
        """Global steps at which a scheduled collection ran in the last fit."""
        return self.schedule.collected_at

    @property
    def refrozen_at(self) -> Optional[int]:
        """The step after which the objects of compilation and the first step were frozen."""
        return self.schedule.refrozen_at

    @property
    def pauses_ms(self) -> list[float]:
        """Milliseconds of every collection during the last fit."""
        return self.schedule.pauses_ms

    @property
    def _on_gc(self) -> CollectionTimer:
        return self.schedule.timer

    # ---- hooks -------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logged = 0
        self.schedule.start()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.schedule.active:
            self.schedule.after_step(trainer.global_step)
            self._log_pauses(pl_module)

    def _log_pauses(self, pl_module: LightningModule) -> None:
        pauses = self.pauses_ms
        if len(pauses) == self._logged:
            return
        log_scalars(pl_module, {"perf/gc_ms": sum(pauses[self._logged:])})
        self._logged = len(pauses)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.schedule.stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.schedule.stop()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.schedule.stop()


class DefaultCollection(GarbageCollection):
    """The collection schedule a strategy of the pack attaches when the user attached no
    :class:`GarbageCollection`: the same behaviour at the strategy's priority, so a user's callback
    still decides; ``every_n_steps=None`` leaves Python's automatic collector as the program had it."""

    def __init__(self, every_n_steps: Optional[int] = DEFAULT_EVERY_N_STEPS) -> None:
        Callback.__init__(self)
        self.schedule = ScheduledCollection(every_n_steps, priority=Priority.STRATEGY)
        self._logged = 0
