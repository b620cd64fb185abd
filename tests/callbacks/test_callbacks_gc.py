"""GarbageCollection: the collector off during fit, collections at the scheduled steps, state restored."""

from __future__ import annotations

import gc
import weakref

import pytest
from lightning.pytorch import Callback

from callback_toys import ToyLM, loader, trainer
from lightning_perf.callbacks import GarbageCollection


class _Node:
    """An object with a ``__dict__`` and no behaviour: two of them pointing at each other form a cycle
    that only the cyclic collector frees (a weak reference tells when it has)."""


class CyclicLM(ToyLM):
    """Makes one reference cycle per training step (freed only by the cyclic collector)."""

    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        self.cycles: list[weakref.ref] = []
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("planted failure")
        node = _Node()
        node.self = node
        self.cycles.append(weakref.ref(node))
        return super().training_step(batch, batch_idx)


class Probe(Callback):
    """After each batch (and after GarbageCollection's hook): collector state and live cycles."""

    def __init__(self) -> None:
        self.enabled: list[bool] = []
        self.alive: list[list[bool]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.enabled.append(gc.isenabled())
        self.alive.append([r() is not None for r in pl_module.cycles])


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()


def test_collects_on_schedule_with_the_collector_off_and_restores_it(tmp_path):
    cb, probe = GarbageCollection(every_n_steps=3), Probe()
    model = CyclicLM()
    trainer(tmp_path, [cb, probe], max_steps=10).fit(model, loader())
    assert probe.enabled == [False] * 10
    assert cb.collected_at == [3, 6, 9] and cb.refrozen_at == 1
    # the first step's cycle goes in the one full collection after it (before the freeze); later
    # ones live until the next scheduled collection
    assert probe.alive[0] == [False] and probe.alive[1] == [False, True]
    assert probe.alive[2] == [False, False, False]  # step 3 collected steps 2-3
    assert probe.alive[4] == [False] * 3 + [True, True]
    assert probe.alive[5] == [False] * 6  # step 6 (a generation-1 collection) freed steps 4-6
    assert len(cb.pauses_ms) >= 5 and all(ms >= 0 for ms in cb.pauses_ms)  # start, step 1, three scheduled
    assert gc.isenabled() and gc.get_freeze_count() == 0 and cb._on_gc not in gc.callbacks
    gc.collect()
    assert not any(r() is not None for r in model.cycles)  # the last step's cycle: collectable after fit


def test_logs_the_collection_time(tmp_path):
    t = trainer(tmp_path, [GarbageCollection(every_n_steps=2)], max_steps=4)
    t.fit(ToyLM(), loader())
    assert float(t.callback_metrics["perf/gc_ms"]) >= 0


def test_a_failing_fit_restores_the_collector(tmp_path):
    cb = GarbageCollection(every_n_steps=1)
    with pytest.raises(RuntimeError, match="planted failure"):
        trainer(tmp_path, [cb], max_steps=10).fit(CyclicLM(fail_at=3), loader())
    assert cb.collected_at == [1, 2, 3]
    assert gc.isenabled() and gc.get_freeze_count() == 0 and cb._on_gc not in gc.callbacks


def test_a_collector_turned_off_before_fit_stays_off(tmp_path):
    gc.disable()
    trainer(tmp_path, [GarbageCollection(every_n_steps=2)], max_steps=3).fit(ToyLM(), loader())
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_gradient_accumulation_collects_once_per_step(tmp_path):
    cb = GarbageCollection(every_n_steps=2)
    trainer(tmp_path, [cb], max_steps=4, accumulate_grad_batches=2).fit(ToyLM(), loader())
    assert cb.collected_at == [2, 4]


@pytest.mark.parametrize("kwargs", [dict(every_n_steps=0), dict(every_n_steps=2.5), dict(every_n_steps=True),
                                    dict(generation=3), dict(generation=True)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        GarbageCollection(**kwargs)


def test_the_same_callback_serves_two_fits(tmp_path):
    cb = GarbageCollection(every_n_steps=2)
    trainer(tmp_path, [cb], max_steps=4).fit(ToyLM(), loader())
    assert cb.collected_at == [2, 4] and gc.isenabled()
    trainer(tmp_path, [cb], max_steps=2).fit(ToyLM(), loader())
    assert cb.collected_at == [2] and gc.isenabled() and gc.get_freeze_count() == 0


def test_objects_frozen_by_the_program_stay_frozen(tmp_path):
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        cb = GarbageCollection(every_n_steps=2)
        trainer(tmp_path, [cb], max_steps=4).fit(ToyLM(), loader())
        assert cb.collected_at == [2, 4] and 0 < gc.get_freeze_count() <= frozen  # not thawed, none added
    finally:
        gc.unfreeze()


def test_objects_made_by_the_first_step_are_frozen_after_it(tmp_path):
    counts, before = [], []

    class Count(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            before.append(gc.get_freeze_count())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            counts.append(gc.get_freeze_count())
            pl_module.made = getattr(pl_module, "made", []) + [[object() for _ in range(1000)]]

    cb = GarbageCollection(every_n_steps=50)
    trainer(tmp_path, [cb, Count()], max_steps=3).fit(ToyLM(), loader())
    assert cb.refrozen_at == 1 and cb.collected_at == []
    # the start froze what existed; after step 1 what the step made is frozen too, and nothing later
    assert 0 < before[0] < counts[0] and counts[2] <= counts[1] <= counts[0]
    assert gc.get_freeze_count() == 0  # thawed at the end
