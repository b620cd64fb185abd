"""Garbage collection on a schedule is the default of the pack's strategies and of GPTLightningModule.

Inside ``training_step`` the automatic collector is off, collections run at the same global steps
on every rank, and the collector is back on after ``fit``; an argument changes the interval or turns
the schedule off, and a ``GarbageCollection`` the user attached decides over every default.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
from lightning.pytorch import Callback

from _spawn import spawn
from callback_toys import ToyLM, loader
from lightning_perf.perf.collection import (
    DEFAULT_EVERY_N_STEPS,
    Priority,
    ScheduledCollection,
    scheduled_every,
)

STEPS = 7


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()


class Watch(Callback):
    """The collector's state inside every training step, and which schedule collected when."""

    def __init__(self) -> None:
        self.enabled_in_step: list[bool] = []
        self.every: list[Optional[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.enabled_in_step.append(gc.isenabled())
        self.every.append(scheduled_every())


def _schedules(trainer: L.Trainer) -> list[Any]:
    return [getattr(c, "schedule") for c in trainer.callbacks if isinstance(getattr(c, "schedule", None),
                                                                            ScheduledCollection)]


def _collected(trainer: L.Trainer) -> list[int]:
    """The steps at which the schedule that was in charge collected (the others never collect)."""
    runs = [s.collected_at for s in _schedules(trainer) if s.collected_at]
    assert len(runs) <= 1, runs
    return runs[0] if runs else []


def _gpt(**kwargs: Any) -> L.LightningModule:
    from lightning_perf.models import GPTLightningModule

    return GPTLightningModule("tiny", warmup_steps=0, **kwargs)


def _data() -> Any:
    from lightning_perf.data import TokenDataModule

    return TokenDataModule(source="synthetic", vocab_size=260, seq_len=16, batch_size=2)


def _fit(module: L.LightningModule, strategy: Any = "auto", callbacks: Optional[list] = None, devices: int = 1,
         data: Any = None) -> tuple[L.Trainer, Watch]:
    watch = Watch()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS,
                        callbacks=[watch] + list(callbacks or []), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    if data is None:
        trainer.fit(module, loader())
    else:
        trainer.fit(module, datamodule=data)
    return trainer, watch


def _expected(every: int) -> list[int]:
    return [s for s in range(1, STEPS + 1) if s % every == 0]


def test_gpt_module_on_one_device_collects_on_schedule():
    trainer, watch = _fit(_gpt(gc_every_n_steps=3), data=_data())
    assert watch.enabled_in_step == [False] * STEPS and watch.every == [3] * STEPS
    assert _collected(trainer) == _expected(3)
    assert gc.isenabled() and gc.get_freeze_count() == 0 and scheduled_every() is None


def test_gpt_module_default_interval_and_off():
    assert _gpt().hparams.gc_every_n_steps == DEFAULT_EVERY_N_STEPS
    _, watch = _fit(_gpt(gc_every_n_steps=None), data=_data())
    assert watch.enabled_in_step == [True] * STEPS and watch.every == [None] * STEPS
    with pytest.raises(ValueError, match="gc_every_n_steps"):
        _gpt(gc_every_n_steps=0)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "parallel3d"])
def test_each_registered_strategy_collects_on_schedule_for_any_module(name):
    import lightning_perf  # noqa: F401  (registers the names)

    trainer, watch = _fit(ToyLM(), strategy=name)
    assert watch.enabled_in_step == [False] * STEPS and watch.every == [DEFAULT_EVERY_N_STEPS] * STEPS
    assert _collected(trainer) == _expected(DEFAULT_EVERY_N_STEPS)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_strategy_interval_beats_the_module_default_and_none_turns_both_off():
    from lightning_perf.strategies import Parallel3DStrategy, ZeroStrategy

    trainer, watch = _fit(_gpt(gc_every_n_steps=5), strategy=ZeroStrategy(stage=3, gc_every_n_steps=2), data=_data())
    assert watch.enabled_in_step == [False] * STEPS and watch.every == [2] * STEPS
    assert _collected(trainer) == _expected(2)
    _, watch = _fit(_gpt(), strategy=Parallel3DStrategy(gc_every_n_steps=None), data=_data())
    assert watch.enabled_in_step == [True] * STEPS and watch.every == [None] * STEPS
    assert gc.isenabled()
    with pytest.raises(ValueError, match="gc_every_n_steps"):
        ZeroStrategy(gc_every_n_steps=-1)


def test_an_attached_garbage_collection_wins_over_every_default():
    from lightning_perf.callbacks import GarbageCollection
    from lightning_perf.strategies import ZeroStrategy

    user = GarbageCollection(every_n_steps=4)
    trainer, watch = _fit(_gpt(gc_every_n_steps=2), strategy=ZeroStrategy(stage=2, gc_every_n_steps=3),
                          callbacks=[user], data=_data())
    assert watch.every == [4] * STEPS and user.collected_at == _expected(4)
    assert _collected(trainer) == _expected(4)  # the defaults never collected
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_failing_fit_restores_the_collector():
    class Failing(ToyLM):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("planted failure")
            assert not gc.isenabled()
            return super().training_step(batch, batch_idx)

    import lightning_perf  # noqa: F401

    with pytest.raises(RuntimeError, match="planted failure"):
        _fit(Failing(), strategy="zero3")
    assert gc.isenabled() and gc.get_freeze_count() == 0 and scheduled_every() is None


def test_the_highest_priority_started_is_in_charge():
    model = ScheduledCollection(5, priority=Priority.MODEL)
    strategy = ScheduledCollection(None, priority=Priority.STRATEGY)
    user = ScheduledCollection(3, priority=Priority.USER)
    assert model.start() and not gc.isenabled()
    assert strategy.start() and gc.isenabled()  # in charge, and says "automatic"
    assert not model.after_step(5)
    assert user.start() and not gc.isenabled() and not model.in_charge and not strategy.in_charge
    assert user.after_step(3) and user.collected_at == [3]
    user.stop()  # the strategy's decision is back in charge
    assert strategy.in_charge and gc.isenabled()
    strategy.stop()
    assert model.in_charge and not gc.isenabled() and model.after_step(5)
    model.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and scheduled_every() is None


def _two_ranks(rank: int, world: int, out: Path) -> dict:
    from lightning_perf.strategies import ZeroStrategy

    gc.enable()
    trainer, watch = _fit(_gpt(), strategy=ZeroStrategy(stage=3, gc_every_n_steps=2), devices=2, data=_data())
    return {"enabled_in_step": watch.enabled_in_step, "collected": _collected(trainer), "after": gc.isenabled()}


def test_two_ranks_collect_at_the_same_steps(tmp_path):
    results = spawn(_two_ranks, 2, tmp_path, timeout=180)
    for r in results:
        assert r["enabled_in_step"] == [False] * STEPS and r["after"]
        assert r["collected"] == _expected(2)
