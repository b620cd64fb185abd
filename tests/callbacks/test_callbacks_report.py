"""PerfReport alone (own step timing, files) and with every other callback attached."""

from __future__ import annotations

import json
import os

import pytest
import torch.nn.functional as F

import lightning_perf.perf.steps as steps
from callback_toys import T, V, ToyLM, loader, trainer
from lightning_perf.callbacks import (
    DataLoaderStallDetector,
    MFUMonitor,
    PerfReport,
    RooflineMonitor,
    SyncPointWarner,
    SyncPointWarning,
)


class SlowAndSyncing(ToyLM):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).view(-1, V), y.reshape(-1))
        self.last_loss = float(loss)  # a sync: float() on a tensor
        return loss


def test_report_alone_times_steps_with_the_clock(tmp_path, monkeypatch, capsys):
    ticks = iter(range(10_000))
    monkeypatch.setattr(steps, "host_clock", lambda: next(ticks) * 0.5)  # start and end each read once
    B = 2
    report = PerfReport(warmup_steps=1)
    trainer(tmp_path, [report], max_steps=5).fit(ToyLM(), loader(batch_size=B))
    s = report.summary
    assert s.steps == 4  # 5 steps, 1 warm-up
    # two clock reads per step (1.0 s, of which 0.5 s between its end and the next start); the last
    # step ends at its batch end (0.5 s, no gap)
    assert s.step_time_s == pytest.approx((3 * 1.0 + 0.5) / 4)
    assert s.between_steps_s == pytest.approx(3 * 0.5 / 4)
    assert s.tokens_per_sec == pytest.approx(B * T / s.step_time_s)
    data = json.load(open(os.path.join(str(tmp_path), "perf_report.json")))
    parts = data["breakdown"]
    assert sum(p["fraction"] for p in parts.values()) == pytest.approx(1.0)
    # no stall detector: the gap is host time
    assert parts["host_overhead"]["fraction"] == pytest.approx(1.5 / 3.5)
    assert "Performance report" in capsys.readouterr().out
    assert os.path.exists(os.path.join(str(tmp_path), "perf_report.md"))


def test_report_collects_the_other_callbacks(tmp_path):
    mfu = MFUMonitor(peak_flops=1e9, warmup_steps=1, window=2)
    stall = DataLoaderStallDetector(window=2, warmup_steps=1)
    roof = RooflineMonitor(start_step=4, peak_flops=1e9, peak_bandwidth=1e9)
    warner = SyncPointWarner(every_n_steps=0, start_step=2)
    report = PerfReport(warmup_steps=1, print_report=False)
    with pytest.warns(SyncPointWarning):
        trainer(tmp_path, [mfu, stall, roof, warner, report], max_steps=8).fit(
            SlowAndSyncing(step_sleep=0.01), loader(batch_size=2, sleep=0.02))
    s = report.summary
    assert s.mfu == pytest.approx(mfu.summary()["mfu"])
    assert min(h.mfu for h in mfu.history) <= s.mfu <= max(h.mfu for h in mfu.history)
    assert set(warner.sampled_steps) | set(roof.sampled_steps) == {2, 4, 5}
    assert s.peak.startswith("user peak_flops")
    from lightning_perf.perf import breakdown

    # the detector's share of the same window
    assert breakdown(s)["data_wait"]["fraction"] == pytest.approx(stall.stall_fraction) and s.data_wait_s > 0.02
    assert s.bound in ("compute", "memory", "overhead")
    assert any("test_callbacks_report.py" in site for site in s.user_sync_sites)
    md = open(os.path.join(str(tmp_path), "perf_report.md")).read()
    assert "Top recommendations" in md and "Input pipeline" in md and "test_callbacks_report.py" in md


class CollectingLM(ToyLM):
    """Holds many tracked Python objects and runs a full collection in one step (as CPython would
    on its own, at a moment of its choosing)."""

    def __init__(self, at: int = 3) -> None:
        super().__init__()
        self.ballast = [[i] for i in range(300_000)]
        self.at = at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.at:
            import gc

            gc.collect()
        return super().training_step(batch, batch_idx)


def test_report_times_garbage_collection_and_recommends_scheduling_it(tmp_path):
    from lightning_perf.perf.report import recommendations

    report = PerfReport(warmup_steps=1, print_report=False)
    trainer(tmp_path, [report], max_steps=8).fit(CollectingLM(), loader())
    s = report.summary
    assert s.gc_collections >= 1 and not s.gc_scheduled
    assert s.gc_max_pause_s > 0.002  # a full pass over 300k lists
    assert s.gc_pause_s * s.steps >= s.gc_max_pause_s
    assert any("GarbageCollection" in tip for tip in recommendations(s, top=10))
    assert "| Python GC |" in open(report.files[0]).read()
    import gc

    assert report._on_gc not in gc.callbacks  # timing removed after fit


def test_report_with_scheduled_collections_does_not_recommend_them(tmp_path):
    from lightning_perf.callbacks import GarbageCollection
    from lightning_perf.perf.report import recommendations

    report = PerfReport(warmup_steps=1, print_report=False)
    trainer(tmp_path, [GarbageCollection(every_n_steps=2), report], max_steps=8).fit(CollectingLM(at=-1), loader())
    s = report.summary
    assert s.gc_scheduled and s.gc_collections >= 3  # steps 2, 4, 6 (8 is past the last measured interval)
    assert not any("GarbageCollection" in tip for tip in recommendations(s, top=10))


def test_report_knows_the_fsdp_units_of_a_zero_strategy(tmp_path):
    """Under native ZeRO-2/3 the summary carries the strategy's blocks per FSDP2 unit (what the
    communication advice is keyed on); under a plain strategy, or ZeRO-1, it stays None. The ZeRO
    trainers are only built (a fit would start a process group in this test process)."""
    import lightning as L

    from lightning_perf.strategies import ZeroStrategy

    def build(strategy):
        report = PerfReport(warmup_steps=1, print_report=False)
        t = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, callbacks=[report], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
        return t, report

    for strategy, expected in ((ZeroStrategy(stage=3, blocks_per_unit=2), 2), (ZeroStrategy(stage=2), 1),
                               (ZeroStrategy(stage=1), None)):
        t, report = build(strategy)
        assert report.build_summary(t).fsdp_blocks_per_unit == expected
    t, report = build("auto")
    t.fit(ToyLM(), loader(batch_size=2))
    assert report.summary.steps >= 1 and report.summary.fsdp_blocks_per_unit is None
