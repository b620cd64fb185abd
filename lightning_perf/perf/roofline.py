"""Roofline maths: arithmetic intensity, attainable FLOP/s, bound classification, chart.

For a group of ops with F FLOPs, B bytes moved and measured time t:

    intensity  I = F / B                      (FLOP per byte)
    ridge        = peak_flops / peak_bandwidth
    attainable   = min(peak_flops, I * peak_bandwidth)
    achieved     = F / t

The group is compute-bound when ``I >= ridge``, memory-bound below it, and
overhead-bound (launch latency, host, synchronisation) when it reaches less than
``overhead_fraction`` of what its roof allows. Groups that move bytes but do no
arithmetic (copies) are judged on achieved bandwidth against the bandwidth roof.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from lightning_perf.perf.flops import OpRecord, category_of_name

__all__ = ["RooflineGroup", "classify", "build_groups", "attribute_times", "profiler_op_times", "plot_roofline"]


@dataclass(kw_only=True)
class RooflineGroup:
    name: str
    flops: float
    bytes: float
    seconds: float
    calls: int = 0
    bound: str = "unknown"
    time_share: float = 0.0

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes > 0 else math.inf

    @property
    def achieved_flops(self) -> float:
        return self.flops / self.seconds if self.seconds > 0 else 0.0

    @property
    def achieved_bandwidth(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "flops": self.flops, "bytes": self.bytes, "seconds": self.seconds,
            "calls": self.calls, "intensity": None if math.isinf(self.intensity) else self.intensity,
            "achieved_tflops": self.achieved_flops / 1e12, "achieved_gbps": self.achieved_bandwidth / 1e9,
            "bound": self.bound, "time_share": self.time_share,
        }


def classify(flops: float, nbytes: float, seconds: float, *, peak_flops: float, peak_bandwidth: float,
             overhead_fraction: float = 0.05) -> str:
    """``"compute"``, ``"memory"``, ``"overhead"`` or ``"unknown"`` (nothing measured)."""
    if peak_flops <= 0 or peak_bandwidth <= 0:
        raise ValueError(f"peaks must be > 0, got peak_flops={peak_flops}, peak_bandwidth={peak_bandwidth}")
    if seconds <= 0 or (flops <= 0 and nbytes <= 0):
        return "unknown"
    if flops <= 0:  # pure data movement
        return "overhead" if nbytes / seconds < overhead_fraction * peak_bandwidth else "memory"
    intensity = flops / nbytes if nbytes > 0 else math.inf
    attainable = min(peak_flops, intensity * peak_bandwidth)
    if flops / seconds < overhead_fraction * attainable:
        return "overhead"
    return "compute" if intensity >= peak_flops / peak_bandwidth else "memory"


def profiler_op_times(key_averages: Iterable[Any], *, device: bool) -> dict[str, float]:
    """Self time per op name (seconds) from ``prof.key_averages()``: device time on GPU, CPU time on CPU."""
    out: dict[str, float] = defaultdict(float)
    for evt in key_averages:
        if device:
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = getattr(evt, "self_cuda_time_total", 0.0)
        else:
            us = evt.self_cpu_time_total
        if us:
            out[evt.key] += us / 1e6
    return dict(out)


def attribute_times(records: Sequence[OpRecord], op_times: Mapping[str, float], *, peak_flops: float,
                    peak_bandwidth: float) -> list[float]:
    """Split each op name's measured time over its records (one per module) by their ideal roofline time."""
    ideal = [max(r.flops / peak_flops, r.bytes / peak_bandwidth) or float(r.calls) for r in records]
    per_op: dict[str, float] = defaultdict(float)
    for r, w in zip(records, ideal):
        per_op[r.op] += w
    return [op_times.get(r.op, 0.0) * (w / per_op[r.op] if per_op[r.op] else 0.0) for r, w in zip(records, ideal)]


def build_groups(records: Sequence[OpRecord], op_times: Mapping[str, float], *, key: str, peak_flops: float,
                 peak_bandwidth: float, overhead_fraction: float = 0.05) -> list[RooflineGroup]:
    """Roofline groups by ``"category"`` or ``"module"``, sorted by time, classified.

    By category, the self time of profiled aten ops that no record names is added to the
    category of their name (module groups only get matched time).
    """
    if key not in ("category", "module"):
        raise ValueError(f"key must be 'category' or 'module', got {key!r}")
    times = attribute_times(records, op_times, peak_flops=peak_flops, peak_bandwidth=peak_bandwidth)
    groups: dict[str, RooflineGroup] = {}
    for r, t in zip(records, times):
        name = getattr(r, key)
        g = groups.setdefault(name, RooflineGroup(name=name, flops=0.0, bytes=0.0, seconds=0.0))
        g.flops += r.flops
        g.bytes += r.bytes
        g.seconds += t
        g.calls += r.calls
    if key == "category":
        # Profiled ops the counter never saw: inner ops that launch the kernels of an outer op it
        # counted (``_flash_attention_forward`` under ``_scaled_dot_product_flash_attention``), or
        # ops outside the counted step's Python view. Their time goes to their category.
        seen = {r.op for r in records}
        for op, t in op_times.items():
            if op not in seen and t > 0 and op.startswith(("aten::", "c10d::", "_c10d_functional::")):
                name = category_of_name(op)
                g = groups.setdefault(name, RooflineGroup(name=name, flops=0.0, bytes=0.0, seconds=0.0))
                g.seconds += t
    total_time = sum(g.seconds for g in groups.values())
    for g in groups.values():
        g.time_share = g.seconds / total_time if total_time > 0 else 0.0
        if g.name == "communication":
            g.bound = "communication"
        else:
            g.bound = classify(g.flops, g.bytes, g.seconds, peak_flops=peak_flops, peak_bandwidth=peak_bandwidth,
                               overhead_fraction=overhead_fraction)
    return sorted(groups.values(), key=lambda g: -g.seconds)


def plot_roofline(groups: Sequence[RooflineGroup], *, peak_flops: float, peak_bandwidth: float, path: str,
                  title: str = "Roofline") -> Optional[str]:
    """Write a log-log roofline PNG (one point per group, area by time share); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - matplotlib is a dependency of the package
        raise ImportError("RooflineMonitor charts need matplotlib: pip install 'lightning-perf' (or matplotlib)") from err

    pts = [g for g in groups if g.flops > 0 and g.bytes > 0 and g.seconds > 0]
    ridge = peak_flops / peak_bandwidth
    xs = [g.intensity for g in pts] + [ridge]
    lo, hi = min(xs) / 10, max(xs) * 10
    fig, ax = plt.subplots(figsize=(7, 5), dpi=100)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak_flops, x * peak_bandwidth) for x in grid], color="black", lw=1.5, label="roof")
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    for g in pts:
        ax.scatter([g.intensity], [g.achieved_flops], s=30 + 1500 * g.time_share, alpha=0.6)
        ax.annotate(f"{g.name} ({g.bound}, {100 * g.time_share:.0f}%)", (g.intensity, g.achieved_flops), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"{title}  (peak {peak_flops / 1e12:.3g} TFLOP/s, {peak_bandwidth / 1e9:.4g} GB/s)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
