"""Peak table name resolution, precision -> dtype, throughput/MFU maths, the step timer, the measured
window and the matmul ceiling."""

from __future__ import annotations

import pytest

import torch

import lightning_perf.perf.steps as steps
import lightning_perf.perf.throughput as throughput
from lightning_perf.perf import (
    PEAKS,
    DevicePeak,
    ParallelLayout,
    StepLedger,
    StepRow,
    StepTimer,
    compute_dtype_name,
    compute_throughput,
    device_unit,
    lookup_peak,
    measure_matmul_ceiling,
    over_reference,
    window_throughput,
)


@pytest.mark.parametrize(
    "driver_name, key, bf16_tflops, tbps",
    [
        ("NVIDIA H200", "H200 SXM", 989.4, 4.8),
        ("NVIDIA H200 NVL", "H200 NVL", 835.5, 4.8),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 3.35),
        ("NVIDIA H100", "H100 SXM", 989.4, 3.35),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.0, 2.0),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5, 3.9),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 312.0, 2.039),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB", 312.0, 1.555),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB", 312.0, 1.555),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", 312.0, 1.935),
        ("NVIDIA B200", "B200", 2250.0, 8.0),
        ("NVIDIA L4", "L4", 121.0, 0.3),
        ("NVIDIA L40S", "L40S", 362.0, 0.864),
        ("NVIDIA A10G", "A10G", 125.0, 0.6),
        ("NVIDIA GeForce RTX 3090", "RTX 3090", 71.0, 0.936),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2, 1.008),
        ("AMD Instinct MI300X", "MI300X", 1307.4, 5.3),
        ("AMD Instinct MI250X", "MI250X", 191.5, 1.6),
    ],
)
def test_driver_names_resolve(driver_name, key, bf16_tflops, tbps):
    peak = lookup_peak(driver_name)
    assert peak is PEAKS[key]
    assert peak.flops_for("bf16") == pytest.approx(bf16_tflops * 1e12)
    assert peak.memory_bandwidth == pytest.approx(tbps * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA L40", "Tesla T4", "Intel(R) Xeon(R)", "NVIDIA GeForce RTX 2080"])
def test_unknown_devices_have_no_peak(name):
    assert lookup_peak(name) is None


def test_dtypes_and_validation():
    h100 = PEAKS["H100 SXM"]
    assert h100.flops_for("fp8") == pytest.approx(2 * h100.flops_for("bf16"), rel=1e-3)
    assert PEAKS["A100 SXM 80GB"].flops_for("fp8") is None
    with pytest.raises(ValueError, match="dtype"):
        h100.flops_for("int8")
    with pytest.raises(ValueError, match="unknown dtypes"):
        DevicePeak(name="x", flops={"int4": 1.0})


@pytest.mark.parametrize(
    "precision, matmul_precision, expected",
    [("bf16-mixed", "highest", "bf16"), ("16-mixed", "highest", "fp16"), ("32-true", "highest", "fp32"),
     ("32-true", "high", "tf32"), ("bf16-true", "high", "bf16"), ("transformer-engine", "highest", "fp8"),
     (None, "highest", "fp32")],
)
def test_precision_to_dtype(precision, matmul_precision, expected):
    assert compute_dtype_name(precision, matmul_precision) == expected


def test_unknown_precision_raises():
    with pytest.raises(ValueError, match="Unknown precision"):
        compute_dtype_name("12-weird")


def test_throughput_hand_values_under_dp2_tp2():
    layout = ParallelLayout(world_size=4, data_parallel_size=2)
    assert layout.model_parallel_size == 2
    t = compute_throughput(step_time_s=0.5, local_tokens=1024, local_samples=8, layout=layout,
                           flops_per_token=6e6, peak_flops=1e12, hardware_flops_per_token=8e6, ceiling_flops=5e11)
    assert t.tokens_per_sec == pytest.approx(2 * 1024 / 0.5)
    assert t.samples_per_sec == pytest.approx(2 * 8 / 0.5)
    assert t.tflops_per_device == pytest.approx(6e6 * 4096 / 4 / 1e12)
    assert t.mfu == pytest.approx(6e6 * 4096 / 4 / 1e12)
    assert t.hfu == pytest.approx(8e6 * 4096 / 4 / 1e12)
    assert t.mfu_ceiling == pytest.approx(2 * t.mfu)


def test_layout_errors_show_the_numbers():
    with pytest.raises(ValueError, match=r"world_size \(6\) is not a multiple of data_parallel_size \(4\)"):
        ParallelLayout(world_size=6, data_parallel_size=4)
    with pytest.raises(ValueError, match="step_time_s"):
        compute_throughput(step_time_s=0, local_tokens=1, local_samples=1,
                           layout=ParallelLayout(world_size=1, data_parallel_size=1), flops_per_token=1)


def test_step_timer_runs_from_batch_start_to_the_next_and_ends_the_last_step_at_its_batch_end(monkeypatch):
    #         start0 end0 start1 end1 start2 end2
    times = iter([1.0, 1.5, 2.5, 2.75, 3.0, 3.25])
    monkeypatch.setattr(steps, "host_clock", lambda: next(times))
    timer = StepTimer()
    timer.start("a")
    timer.end()
    timer.start("b", after=0.4)
    assert timer.index == 1
    timer.end()
    (first,) = timer.poll()
    assert (first.index, first.seconds, first.gap_s, first.payload, first.after) == (0, 1.5, 1.0, "a", 0.4)
    timer.start("c")
    timer.end()
    assert [(r.index, r.seconds, r.gap_s, r.payload) for r in timer.poll()] == [(1, 0.5, 0.25, "b")]
    assert [(r.index, r.seconds, r.gap_s, r.payload) for r in timer.finish()] == [(2, 0.25, 0.0, "c")]
    assert timer.poll() == []


def _ledger() -> StepLedger:
    ledger = StepLedger()
    for i, sec in enumerate([9.0, 8.0, 1.0, 2.0, 7.0, 1.0]):  # steps 0-1 warm-up, step 4 sampled
        ledger.add(StepRow(index=i, seconds=sec, gap_s=0.1 * sec, data_wait_s=0.05 * sec, samples=4, tokens=32,
                           flops=3.2e6))
    return ledger


def test_window_sums_the_measured_steps_and_states_them():
    w = _ledger().window(warmup=2, exclude={4}, spread=True)
    assert (w.steps, w.first, w.last, w.left_out, w.steps_run) == (3, 2, 5, 1, 6)
    assert w.seconds == pytest.approx(4.0) and w.mean_step_s == pytest.approx(4.0 / 3)
    assert w.median_step_s == 1.0 and w.p90_step_s == 2.0
    assert w.tokens == 96 and w.samples == 12 and w.flops == pytest.approx(9.6e6)
    assert w.data_wait_share == pytest.approx(0.05)
    assert w.describe() == ("steps 2-5: mean over 3 measured steps after 2 warm-up, 1 sampled by diagnostics left "
                            "out; wall time, data waits included")
    last = _ledger().window(warmup=2, exclude={4}, last=2)
    assert (last.steps, last.first, last.seconds) == (2, 3, pytest.approx(3.0))
    empty = _ledger().window(warmup=6)
    assert empty.steps == 0 and empty.mean_step_s is None and empty.data_wait_share is None
    assert "6 step(s) ran and the first 6 are warm-up; run at least 7 steps" in empty.describe()
    assert _ledger().window(warmup=5).describe().startswith("step 5: mean over 1 measured step after 5 warm-up")
    with pytest.raises(ValueError, match="in order"):
        _ledger().add(StepRow(index=3, seconds=1.0))


@pytest.mark.parametrize("warmup, exclude, last", [(0, set(), None), (3, {3, 7, 8, 40}, None), (5, {6, 19}, 4),
                                                    (2, {17, 18, 19}, 30), (25, set(), None)])
def test_window_running_totals_match_a_plain_sum(warmup, exclude, last):
    """The ledger keeps running totals; a window must equal the sum over its rows done by hand."""
    g = torch.Generator().manual_seed(0)
    ledger, rows = StepLedger(), []
    for i in range(20):
        sec = float(torch.rand(1, generator=g)) + 0.1
        row = StepRow(index=i, seconds=sec, gap_s=sec / 3, samples=i + 1, tokens=8 * (i + 1), flops=1e3 * sec,
                      hardware_flops=None if i == 1 else 2e3)
        ledger.add(row)
        rows.append(row)
    kept = [r for r in rows if r.index >= warmup and r.index not in exclude]
    kept = kept[-last:] if last is not None else kept
    w = ledger.window(warmup=warmup, exclude=exclude, last=last, spread=True)
    assert w.steps == len(kept)
    if not kept:
        return
    assert (w.first, w.last) == (kept[0].index, kept[-1].index)
    assert w.seconds == pytest.approx(sum(r.seconds for r in kept), rel=1e-12)
    assert w.gap_s == pytest.approx(sum(r.gap_s for r in kept), rel=1e-12)
    assert (w.samples, w.tokens) == (sum(r.samples for r in kept), sum(r.tokens for r in kept))
    assert w.flops == pytest.approx(sum(r.flops for r in kept), rel=1e-12)
    assert w.data_wait_s is None  # never counted
    assert w.hardware_flops == (None if any(r.index == 1 for r in kept) else pytest.approx(2e3 * len(kept)))
    times = sorted(r.seconds for r in kept)
    assert w.median_step_s == times[(len(times) + 1) // 2 - 1]


def test_window_throughput_is_totals_over_total_time():
    w = _ledger().window(warmup=2, exclude={4})
    layout = ParallelLayout(world_size=4, data_parallel_size=2)
    t = window_throughput(w, layout=layout, peak_flops=1e6)
    # tokens/s = tokens per step * dp / mean step time, exactly the window's totals
    assert t.tokens_per_sec == pytest.approx(32 * 2 / w.mean_step_s)
    assert t.step_time_s == pytest.approx(4.0 / 3)
    assert t.mfu == pytest.approx(9.6e6 * 2 / 4.0 / 4 / 1e6)  # model FLOPs of the window / wall time / devices
    samples_only = StepLedger()
    for i in range(3):
        samples_only.add(StepRow(index=i, seconds=0.5, samples=8, flops=800.0))
    t = window_throughput(samples_only.window(warmup=1), layout=ParallelLayout(world_size=1, data_parallel_size=1))
    assert t.tokens_per_sec is None and t.samples_per_sec == pytest.approx(16.0)
    assert t.tflops_per_device == pytest.approx(800 / 0.5 / 1e12)
    untimed = StepLedger()
    untimed.add(StepRow(index=0, seconds=1.0, samples=2, tokens=8))
    t = window_throughput(untimed.window(warmup=0), layout=ParallelLayout(world_size=1, data_parallel_size=1),
                          peak_flops=1e9)
    assert t.tflops_per_device is None and t.mfu is None and t.tokens_per_sec == 8.0
    with pytest.raises(ValueError, match="no measured step"):
        window_throughput(untimed.window(warmup=1), layout=layout)


def test_ceiling_is_the_best_of_its_trials(monkeypatch):
    # three trials of one matmul each: 1.0 s on a busy host, then 0.25 s and 0.5 s
    times = iter([0.0, 1.0, 2.0, 2.25, 3.0, 3.5])
    monkeypatch.setattr(throughput, "host_clock", lambda: next(times))
    n = 64
    assert measure_matmul_ceiling(torch.device("cpu"), torch.float32, n=n, repeats=1, trials=3) == 2 * n**3 / 0.25
    with pytest.raises(ValueError, match="trials"):
        measure_matmul_ceiling(torch.device("cpu"), torch.float32, trials=0)


def test_over_reference_and_units():
    assert over_reference(1.38) and not over_reference(0.985) and not over_reference(None)
    assert device_unit(torch.device("cpu")) == "process"
    assert device_unit(torch.device("cuda", 0)) == "GPU"
