"""MFUMonitor against hand-computed values on a virtual clock, and under a (dp=2, tp=2) layout."""

from __future__ import annotations

import os
import json

import pytest

from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy

import lightning_perf.perf.steps as steps
from lightning_perf.callbacks import MFUMonitor
from callback_toys import T, ToyLM, ToyLMWithFlops, VirtualClock, forward_flops_per_token, loader, trainer

STEP = 0.25  # virtual seconds of every training step


@pytest.fixture
def fake_clock(monkeypatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(steps, "host_clock", clock)
    return clock


def test_mfu_counted_flops_match_hand_values(tmp_path, fake_clock):
    B, peak = 4, 1e9
    mon = MFUMonitor(peak_flops=peak, window=3, warmup_steps=1)
    trainer(tmp_path, [mon], max_steps=7).fit(ToyLM(STEP, fake_clock), loader(batch_size=B))
    # 7 steps, 1 warm-up: logged after steps 1-3, and the final figures over steps 1-6 at the end
    assert len(mon.history) == 2 and mon.summary()["window"].startswith("steps 1-6: mean over 6 measured steps")
    assert mon.sampled_steps == [0]  # the FLOP count ran before step 0: that step leaves any window
    fpt = 3 * forward_flops_per_token()
    last = mon.history[-1]
    assert last.step_time_s == pytest.approx(STEP)
    assert last.tokens_per_sec == pytest.approx(B * T / STEP)
    assert last.samples_per_sec == pytest.approx(B / STEP)
    assert last.tflops_per_device == pytest.approx(fpt * B * T / STEP / 1e12)
    assert last.mfu == pytest.approx(fpt * B * T / STEP / peak)
    assert last.hfu is None
    assert mon.peak_name.startswith("user peak_flops")


def test_module_flops_per_token_is_used_and_hfu_counted(tmp_path, fake_clock):
    B, peak = 2, 1e9
    mon = MFUMonitor(peak_flops=peak, warmup_steps=0, window=1)
    trainer(tmp_path, [mon], max_steps=3).fit(ToyLMWithFlops(STEP, fake_clock), loader(batch_size=B))
    assert mon.history[-1].mfu == pytest.approx((1000 + T) * B * T / STEP / peak)

    mon = MFUMonitor(peak_flops=peak, warmup_steps=0, count_backward=True, window=1)
    trainer(tmp_path, [mon], max_steps=3).fit(ToyLM(STEP, fake_clock), loader(batch_size=B))
    last = mon.history[-1]
    # no recomputation: backward runs the 2 x forward matmuls, so HFU == MFU
    assert last.hfu == pytest.approx(last.mfu)


def test_cpu_without_a_peak_uses_the_measured_ceiling(tmp_path, fake_clock, monkeypatch):
    """No datasheet peak (a CPU) and no peak_flops=: with measure_ceiling the MFU is against the timed matmul."""
    import lightning_perf.callbacks.mfu as mfu_module

    B, ceiling = 4, 2e9
    monkeypatch.setattr(mfu_module, "measure_matmul_ceiling", lambda device, dtype: ceiling)
    mon = MFUMonitor(measure_ceiling=True, window=1, warmup_steps=0)
    trainer(tmp_path, [mon], max_steps=3).fit(ToyLM(STEP, fake_clock), loader(batch_size=B))
    assert mon.peak_name.startswith("measured matmul ceiling") and mon.peak_flops == ceiling
    fpt = 3 * forward_flops_per_token()
    assert mon.history[-1].mfu == pytest.approx(fpt * B * T / STEP / ceiling)
    with pytest.warns(UserWarning, match="measure_ceiling=True"):  # neither: no MFU, and it says how to get one
        plain = MFUMonitor(window=1, warmup_steps=0)
        trainer(tmp_path, [plain], max_steps=2).fit(ToyLM(STEP, fake_clock), loader(batch_size=B))
    assert plain.peak_flops is None


def test_full_attention_convention_is_logged_beside(tmp_path, fake_clock):
    class WithBoth(ToyLMWithFlops):
        def flops_per_token_full_attention(self, seq_len=None):
            return 2 * self.flops_per_token(seq_len)

    mon = MFUMonitor(peak_flops=1e9, warmup_steps=0, window=1)
    tr = trainer(tmp_path, [mon], max_steps=2)
    tr.fit(WithBoth(STEP, fake_clock), loader())
    assert tr.callback_metrics["perf/mfu_full_attention"].item() == pytest.approx(2 * mon.history[-1].mfu)
    assert mon.summary()["mfu_full_attention"] == pytest.approx(2 * mon.summary()["mfu"])


def test_logged_metrics_are_cpu_scalars(tmp_path, fake_clock):
    mon = MFUMonitor(peak_flops=1e9, warmup_steps=0, window=2)
    tr = trainer(tmp_path, [mon], max_steps=4)  # step 0 ran the FLOP count: steps 1-2 are logged in the loop
    tr.fit(ToyLM(STEP, fake_clock), loader())
    metrics = tr.callback_metrics
    assert {"perf/mfu", "perf/tokens_per_sec", "perf/tflops_per_process"} <= set(metrics)  # a CPU: per process
    assert "perf/mfu" in tr.progress_bar_metrics
    assert metrics["perf/mfu"].device.type == "cpu"


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="peak_flops"):
        MFUMonitor(peak_flops=0)
    with pytest.raises(ValueError, match="dtype"):
        MFUMonitor(dtype="int8")


class DP2TP2Strategy(DDPStrategy):
    """Four forked CPU ranks, two data-parallel replicas of two (tensor-parallel) ranks each."""

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": 2, "rank": self.global_rank // 2}


class DumpLast(Callback):
    """Each rank writes what its MFUMonitor measured (the monitor lives in the forked child)."""

    def __init__(self, mon: MFUMonitor, out_dir: str) -> None:
        self.mon, self.out_dir = mon, out_dir

    def on_train_end(self, trainer, pl_module):
        last = self.mon.history[-1]
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(dict(world=self.mon.layout.world_size, dp=self.mon.layout.data_parallel_size,
                           tokens_per_sec=last.tokens_per_sec, mfu=last.mfu), f)


@pytest.mark.slow
def test_mfu_under_dp2_tp2_layout(tmp_path, fake_clock):
    """4 forked gloo ranks; the strategy reports 2 data-parallel replicas (tp=2 inside each)."""
    B, peak = 2, 1e9
    mon = MFUMonitor(peak_flops=peak, warmup_steps=0, window=2)
    strategy = DP2TP2Strategy(process_group_backend="gloo", start_method="fork")
    tr = trainer(tmp_path, [mon, DumpLast(mon, str(tmp_path))], max_steps=3, devices=4, strategy=strategy,
                 use_distributed_sampler=False)
    tr.fit(ToyLMWithFlops(STEP, fake_clock), loader(batch_size=B, n=16))
    fpt = 1000 + T
    for rank in range(4):
        with open(tmp_path / f"rank{rank}.json") as f:
            r = json.load(f)
        assert r["world"] == 4 and r["dp"] == 2
        # tokens once per replica: 2 replicas x B x T per step; FLOPs spread over 4 GPUs
        assert r["tokens_per_sec"] == pytest.approx(2 * B * T / STEP)
        assert r["mfu"] == pytest.approx(fpt * 2 * B * T / STEP / 4 / peak)
