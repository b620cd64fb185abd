"""CommOverlapMonitor on 2 forked gloo ranks: DDP's gradient all-reduce found, sized and split."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy

from callback_toys import D, H, V, ToyLM, loader, trainer
from lightning_perf.callbacks import CommOverlapMonitor

TIMEOUT = timedelta(seconds=120)  # a collective only one rank enters fails the test instead of hanging it


class Dump(Callback):
    def __init__(self, mon: CommOverlapMonitor, out_dir: str) -> None:
        self.mon, self.out_dir = mon, out_dir

    def on_train_end(self, trainer, pl_module):
        with open(os.path.join(self.out_dir, f"comm{trainer.global_rank}.json"), "w") as f:
            json.dump({"results": self.mon.results, "summary": self.mon.summary()}, f)


@pytest.mark.slow
def test_ddp_allreduce_is_measured(tmp_path):
    from lightning_perf.callbacks import RooflineMonitor

    mon = CommOverlapMonitor(start_step=1, every_n_steps=0)
    # writes its files on rank 0 only (no collective may hide in that path: it would hang the job)
    roof = RooflineMonitor(start_step=2, peak_flops=1e11, peak_bandwidth=2e10)
    strategy = DDPStrategy(process_group_backend="gloo", start_method="fork", timeout=TIMEOUT)
    trainer(tmp_path, [mon, roof, Dump(mon, str(tmp_path))], max_steps=5, devices=2, strategy=strategy).fit(
        ToyLM(), loader(n=16))
    assert [p.name for p in tmp_path.glob("roofline_step*.json")] == ["roofline_step2.json"]
    param_bytes = 4 * (V * D + D * H + H * V)
    for rank in range(2):
        with open(tmp_path / f"comm{rank}.json") as f:
            data = json.load(f)
        (result,) = data["results"]
        assert result["step"] == 1
        assert result["comm_s"] > 0
        assert 0 <= result["exposed_s"] <= result["comm_s"] + 1e-12
        assert result["exposed_s"] + result["overlapped_s"] == pytest.approx(result["comm_s"])
        assert 0 <= result["exposed_fraction"] <= 1
        allreduce = result["collectives"]["all_reduce"]
        # DDP reduces every gradient once per step (in one or more buckets); Lightning adds none here
        assert allreduce["bytes"] == param_bytes
        assert allreduce["busbw"] == pytest.approx(allreduce["algbw"] * 2 * (2 - 1) / 2)


class SlowRankOne(ToyLM):
    """Rank 1's host pauses before every step's forward, like an automatic garbage collection."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1:
            import time

            time.sleep(0.3)
        return super().training_step(batch, batch_idx)


class DumpReport(Callback):
    def __init__(self, mon: CommOverlapMonitor, report, out_dir: str) -> None:
        self.mon, self.report, self.out_dir = mon, report, out_dir

    def on_fit_end(self, trainer, pl_module):
        from lightning_perf.perf.report import recommendations

        with open(os.path.join(self.out_dir, f"ranks{trainer.global_rank}.json"), "w") as f:
            json.dump({"per_rank": self.mon.exposed_fraction_per_rank,
                       "own": self.mon.summary()["exposed_fraction"],
                       "report_per_rank": self.report.summary.exposed_comm_per_rank,
                       "tips": recommendations(self.report.summary, top=10)}, f)


@pytest.mark.slow
def test_a_slow_rank_shows_as_uneven_exposure_and_is_reported(tmp_path):
    """Every rank learns every rank's exposed share at train end; a rank whose host pauses leaves
    its peer waiting inside the all-reduce, and the report names the imbalance."""
    from lightning_perf.callbacks import PerfReport

    mon = CommOverlapMonitor(start_step=1, every_n_steps=1)
    report = PerfReport(warmup_steps=1, print_report=False)
    strategy = DDPStrategy(process_group_backend="gloo", start_method="fork", timeout=TIMEOUT)
    trainer(tmp_path, [mon, report, DumpReport(mon, report, str(tmp_path))], max_steps=4, devices=2,
            strategy=strategy).fit(SlowRankOne(), loader(n=32))
    data = [json.load(open(tmp_path / f"ranks{rank}.json")) for rank in range(2)]
    per_rank = data[0]["per_rank"]
    assert data[1]["per_rank"] == per_rank and len(per_rank) == 2  # the same list everywhere
    assert [d["own"] for d in data] == pytest.approx(per_rank)  # rank order: each rank's own mean
    assert per_rank[0] - per_rank[1] > 0.3, per_rank  # rank 0 waits ~0.3 s per step for rank 1
    for d in data:
        assert d["report_per_rank"] == per_rank
        (tip,) = [t for t in d["tips"] if t.startswith("Ranks wait for each other")]
        assert "on rank 0" in tip and "pauses on rank 1's host" in tip  # rank 1 sleeps
