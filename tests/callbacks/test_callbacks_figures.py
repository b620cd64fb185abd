"""One window, one set of figures: MFUMonitor, PerfReport, DataLoaderStallDetector and the progress bar
against hand counts on a virtual clock (known step times, a dataset that sleeps a known time), an
injected low matmul ceiling, units that say what they count, and runs too short to measure."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

import lightning as L
import lightning_perf.callbacks.mfu as mfu_module
import lightning_perf.perf.steps as steps
from callback_toys import (
    T,
    Diagnostic,
    ListLogger,
    TimedLM,
    ToyLMWithFlops,
    VirtualClock,
    VirtualTokens,
    WallTimes,
    loader,
    trainer,
)
from lightning_perf.callbacks import DataLoaderStallDetector, MFUMonitor, PerfReport
from lightning_perf.perf import breakdown

B = 4
STEP_TIMES = [0.1, 0.3, 0.2]  # virtual seconds of compute, by batch index
DATA_SLEEP = 0.0125  # virtual seconds per sample: 0.05 s per batch
FPT = 1000 + T  # TimedLM's FLOPs per token


@pytest.fixture
def clock(monkeypatch) -> VirtualClock:
    c = VirtualClock()
    monkeypatch.setattr(steps, "host_clock", c)
    return c


def _fit(tmp_path, clock, callbacks, *, max_steps=9, logger=None):
    ref = WallTimes(clock)
    tr = trainer(tmp_path, [ref, *callbacks], max_steps=max_steps, logger=logger or False, log_every_n_steps=1)
    tr.fit(TimedLM(clock, STEP_TIMES), DataLoader(VirtualTokens(clock, DATA_SLEEP), batch_size=B))
    return tr, ref


def test_mfu_report_stall_and_progress_bar_agree_with_a_hand_count(tmp_path, clock):
    """9 steps: 0-1 warm-up, step 5 sampled by a diagnostic that costs 2 s: the window is steps 2-4, 6-8."""
    peak = 1e6
    mon = MFUMonitor(peak_flops=peak, window=1, warmup_steps=2)
    stall = DataLoaderStallDetector(window=1, warmup_steps=2)
    report = PerfReport(print_report=False)
    logger = ListLogger()
    tr, ref = _fit(tmp_path, clock, [mon, stall, Diagnostic(clock, step=5, cost=2.0), report], logger=logger)

    measured = [2, 3, 4, 6, 7, 8]
    wall = sum(ref.step(i) for i in measured)
    # each step: its compute, then (all but the last) the 0.05 s fetch of the next batch
    assert wall == pytest.approx(sum(STEP_TIMES[i % 3] for i in measured) + 0.05 * 5)
    hand_mfu = FPT * B * T * len(measured) / wall / peak
    s = report.summary
    assert s.steps == 6 and s.window.startswith("steps 2-8: mean over 6 measured steps after 2 warm-up, "
                                                "1 sampled by diagnostics left out")
    assert s.step_time_s == pytest.approx(wall / 6, rel=1e-12)
    assert s.mfu == pytest.approx(hand_mfu, rel=1e-12)
    assert mon.summary()["mfu"] == pytest.approx(hand_mfu, rel=1e-12)
    assert logger.values("perf/mfu")[-1] == pytest.approx(hand_mfu, rel=1e-6)  # the final figure, logged
    # the progress bar's last update covered the steps resolved by then (2-4, 6, 7)
    bar = tr.progress_bar_metrics["perf/mfu"]
    assert bar == pytest.approx(FPT * B * T * 5 / sum(ref.step(i) for i in measured[:-1]) / peak, rel=1e-6)
    # tokens/s is tokens per step over the same mean step time
    assert s.tokens_per_sec == pytest.approx(B * T / s.step_time_s, rel=1e-12)
    # the data wait: one 0.05 s fetch after each measured step but the last, over the same wall time
    hand_share = 0.05 * 5 / wall
    assert stall.stall_fraction == pytest.approx(hand_share, rel=1e-12)
    assert breakdown(s)["data_wait"]["fraction"] == pytest.approx(stall.stall_fraction, rel=1e-12)
    assert logger.values("perf/data_stall")[-1] == pytest.approx(hand_share, rel=1e-6)
    md = open(report.files[0]).read()
    assert f"| MFU | {100 * hand_mfu:.3g}% |" in md and "Window: steps 2-8" in md


def test_a_low_ceiling_is_measured_again(tmp_path, clock, monkeypatch):
    """The ceiling timed at fit start came out 10x low (a busy host): the first window beats it, the
    ceiling is timed again in that step (which leaves the window), and no MFU above 100% is ever shown."""
    timings = iter([1e4, 1e6])
    monkeypatch.setattr(mfu_module, "measure_matmul_ceiling", lambda device, dtype: next(timings))
    mon = MFUMonitor(measure_ceiling=True, window=2, warmup_steps=2)
    report = PerfReport(print_report=False)
    logger = ListLogger()
    _, ref = _fit(tmp_path, clock, [mon, report], logger=logger)
    assert mon.ceiling_measurements == 2 and mon.peak_flops == 1e6 and mon.ceiling_note is None
    assert mon.sampled_steps == [4]  # the window of steps 2-3 resolved at the end of step 4
    measured = [2, 3, 5, 6, 7, 8]
    hand = FPT * B * T * len(measured) / sum(ref.step(i) for i in measured) / 1e6
    assert report.summary.mfu == pytest.approx(hand, rel=1e-12)
    assert all(0 < v <= 1 for v in logger.values("perf/mfu"))


def test_a_ceiling_that_stays_low_shows_mfu_as_unavailable(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(mfu_module, "measure_matmul_ceiling", lambda device, dtype: 1e4)
    mon = MFUMonitor(measure_ceiling=True, window=2, warmup_steps=2)
    report = PerfReport(print_report=False)
    logger = ListLogger()
    with pytest.warns(UserWarning, match="MFU n/a, ceiling unreliable"):
        tr, _ = _fit(tmp_path, clock, [mon, report], logger=logger)
    assert mon.ceiling_measurements == 3 and mon.ceiling_note.startswith("ceiling unreliable")
    assert report.summary.mfu is None and report.summary.mfu_note == mon.ceiling_note
    assert all(math.isnan(v) for v in logger.values("perf/mfu"))
    assert math.isnan(tr.progress_bar_metrics["perf/mfu"])
    md = open(report.files[0]).read()
    assert "| MFU | n/a (ceiling unreliable: " in md and "timed 3 times" in md


def test_mfu_above_a_datasheet_or_user_peak_is_not_a_value(tmp_path, clock):
    mon = MFUMonitor(peak_flops=1e3, window=2, warmup_steps=2)  # far below what the toy achieves
    report = PerfReport(print_report=False)
    with pytest.warns(UserWarning, match="over 100% of the peak"):
        _fit(tmp_path, clock, [mon, report])
    assert report.summary.mfu is None and "FLOP count (flops_per_token) or the peak is wrong" in report.summary.mfu_note


class Features(Dataset):
    """Float feature rows: samples, no tokens."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return torch.randn(6), torch.randn(1)


class Regression(L.LightningModule):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.net = nn.Linear(6, 1)
        self.clock = clock

    def flops_per_token(self, seq_len=None) -> int:  # per sample here: the batch has no tokens
        return 36

    def training_step(self, batch, batch_idx):
        self.clock.sleep(0.5)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_units_say_what_they_count(tmp_path, clock):
    """Batches without tokens give samples/s, never tokens/s; on a CPU figures are per process, not per GPU."""
    mon = MFUMonitor(peak_flops=1e6, window=1, warmup_steps=1)
    report = PerfReport(print_report=False)
    tr = trainer(tmp_path, [mon, report], max_steps=4, log_every_n_steps=1)
    tr.fit(Regression(clock), DataLoader(Features(), batch_size=8))
    s = report.summary
    assert s.tokens_per_sec is None and s.samples_per_sec == pytest.approx(8 / 0.5)
    assert s.device_unit == "process" and s.tflops_per_device == pytest.approx(36 * 8 / 0.5 / 1e12)
    assert "perf/tokens_per_sec" not in tr.callback_metrics and "perf/tflops_per_gpu" not in tr.callback_metrics
    assert {"perf/samples_per_sec", "perf/tflops_per_process"} <= set(tr.callback_metrics)
    assert "perf/samples_per_sec" in tr.progress_bar_metrics
    md = open(report.files[0]).read()
    assert "tokens/s" not in md and "| samples/s (global) | 16 |" in md
    assert "| TFLOP/s per process |" in md and "per GPU" not in md


def test_report_tokens_per_second_equals_tokens_per_step_over_its_mean_step(tmp_path, clock):
    report = PerfReport(warmup_steps=1, print_report=False)
    _, ref = _fit(tmp_path, clock, [report], max_steps=6)
    s = report.summary
    assert s.step_time_s == pytest.approx(sum(ref.step(i) for i in range(1, 6)) / 5, rel=1e-12)
    assert s.tokens_per_sec == pytest.approx(B * T / s.step_time_s, rel=1e-12)
    assert s.samples_per_sec == pytest.approx(B / s.step_time_s, rel=1e-12)


@pytest.mark.parametrize("max_steps, measured", [(2, 0), (3, 1)])
def test_a_run_shorter_than_the_warmup_says_so(tmp_path, max_steps, measured):
    mon = MFUMonitor(peak_flops=1e9, warmup_steps=2)
    report = PerfReport(print_report=False)
    trainer(tmp_path, [mon, report], max_steps=max_steps).fit(ToyLMWithFlops(), loader())
    md = open(os.path.join(str(tmp_path), "perf_report.md")).read()
    assert report.summary.steps == measured
    if measured:
        assert "Too short" not in md and report.summary.mfu > 0
    else:
        assert ("Too short to measure: no step measured: 2 step(s) ran and the first 2 are warm-up; run at least "
                "3 steps or lower warmup_steps." in md)
        assert "| MFU |" not in md and "| compute | 0.000 |" not in md
        assert mon.summary()["steps"] == 0 and "mfu" not in mon.summary()
