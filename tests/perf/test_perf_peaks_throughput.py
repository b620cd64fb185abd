"""Peak table name resolution, precision -> dtype, throughput/MFU maths and the step clock."""

from __future__ import annotations

import pytest

import lightning_perf.perf.throughput as throughput
from lightning_perf.perf import (
    PEAKS,
    DevicePeak,
    ParallelLayout,
    StepClock,
    compute_dtype_name,
    compute_throughput,
    lookup_peak,
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
    assert t.tflops_per_gpu == pytest.approx(6e6 * 4096 / 4 / 1e12)
    assert t.mfu == pytest.approx(6e6 * 4096 / 4 / 1e12)
    assert t.hfu == pytest.approx(8e6 * 4096 / 4 / 1e12)
    assert t.mfu_ceiling == pytest.approx(2 * t.mfu)


def test_layout_errors_show_the_numbers():
    with pytest.raises(ValueError, match=r"world_size \(6\) is not a multiple of data_parallel_size \(4\)"):
        ParallelLayout(world_size=6, data_parallel_size=4)
    with pytest.raises(ValueError, match="step_time_s"):
        compute_throughput(step_time_s=0, local_tokens=1, local_samples=1,
                           layout=ParallelLayout(world_size=1, data_parallel_size=1), flops_per_token=1)


def test_step_clock_on_cpu_uses_the_host_clock(monkeypatch):
    times = iter([1.0, 1.5, 2.5, 2.75])
    monkeypatch.setattr(throughput, "host_clock", lambda: next(times))
    clock = StepClock()
    for payload in ("a", "b", "c", "d"):
        clock.mark(payload)
    assert clock.poll() == [(0.5, "b"), (1.0, "c"), (0.25, "d")]
    assert clock.poll() == []
