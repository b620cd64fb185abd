"""End-of-run performance summary: step-time breakdown, recommendations, Markdown.

Breakdown of the mean step time (seconds per step):

    step = compute + exposed communication + data wait + host overhead

Data wait is the exposed input wait, host overhead the rest of the device idle gap
between steps; compute is what remains (it includes kernel launch gaps inside a
step, which the roofline reports as overhead-bound groups).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_perf.perf.advice import advise
from lightning_perf.perf.memory import MemoryReport, memory_advice, memory_markdown
from lightning_perf.perf.run_settings import RunSettings

__all__ = ["PerfSummary", "breakdown", "recommendations", "render_markdown"]


@dataclass(kw_only=True)
class PerfSummary:
    step_time_s: float  # mean wall time per measured step (0 when no step was measured)
    steps: int = 0
    window: Optional[str] = None  # which steps the figures are over, in words
    median_step_s: Optional[float] = None
    p90_step_s: Optional[float] = None
    data_wait_s: Optional[float] = None
    between_steps_s: Optional[float] = None  # device idle gap between steps (data wait + host work)
    exposed_comm_s: Optional[float] = None
    tokens_per_sec: Optional[float] = None  # None when the batches have no token dimension
    samples_per_sec: Optional[float] = None
    tflops_per_device: Optional[float] = None
    device_unit: str = "GPU"  # what per-device figures are per: "GPU", or "process" off a GPU
    mfu: Optional[float] = None
    mfu_note: Optional[str] = None  # why MFU is n/a (a reference it beat, an unreliable ceiling)
    hfu: Optional[float] = None
    attention: Optional[str] = None  # how attention FLOPs were counted when batches are packed documents
    peak: Optional[str] = None
    bound: Optional[str] = None  # the dominant roofline class by time
    roofline: list[dict[str, Any]] = field(default_factory=list)  # category groups (as_dict)
    user_sync_sites: list[str] = field(default_factory=list)
    framework_sync_sites: list[str] = field(default_factory=list)
    dataloader_advice: list[str] = field(default_factory=list)
    comm: dict[str, Any] = field(default_factory=dict)
    gc_pause_s: Optional[float] = None  # Python garbage collection, mean seconds per measured step
    gc_max_pause_s: Optional[float] = None  # the longest single collection in the measured steps
    gc_collections: int = 0
    gc_scheduled: bool = False  # collections run on a fixed schedule (GarbageCollection) rather than automatically
    fsdp_blocks_per_unit: Optional[int] = None  # blocks per FSDP2 unit where the strategy shards with FSDP2 (ZeRO-2/3)
    exposed_comm_per_rank: list[Optional[float]] = field(default_factory=list)  # exposed share of the step, per rank
    settings: Optional[RunSettings] = None  # what the run has switched on (the advice never repeats it)
    memory: Optional[MemoryReport] = None  # from MemoryMonitor

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["breakdown"] = breakdown(self)
        out["recommendations"] = recommendations(self)
        if self.memory is not None:
            out["memory_advice"] = [t.text for t in memory_advice(self.memory, self.settings)]
        return out


def breakdown(s: PerfSummary) -> dict[str, dict[str, float]]:
    """Seconds and fraction of the step for compute, exposed comm, data wait and host overhead."""
    step = max(s.step_time_s, 0.0)
    comm = min(s.exposed_comm_s or 0.0, step)
    data = min(s.data_wait_s or 0.0, step - comm)
    gap = s.between_steps_s if s.between_steps_s is not None else data
    host = min(max(0.0, gap - data), step - comm - data)
    compute = step - comm - data - host
    parts = {"compute": compute, "exposed_comm": comm, "data_wait": data, "host_overhead": host}
    return {k: {"seconds": v, "fraction": (v / step if step > 0 else 0.0)} for k, v in parts.items()}


def recommendations(s: PerfSummary, *, top: int = 3) -> list[str]:
    """The ``top`` suggestions, ranked by the share of the step they would save (``perf.advice``)."""
    return [a.text for a in advise(s, breakdown(s), s.settings, s.memory)[:top]]


def _fmt(v: Optional[float], scale: float = 1.0, unit: str = "", digits: int = 3) -> str:
    return "n/a" if v is None else f"{v * scale:.{digits}g}{unit}"


def _measured(s: PerfSummary) -> bool:
    return s.steps > 0 or s.step_time_s > 0


def _figures(s: PerfSummary) -> list[str]:
    """The window, the step-time breakdown and the throughput rows; a run with no measured step says so."""
    if not _measured(s):
        return [f"Too short to measure: {s.window or 'no step measured'}."]
    spread = (f" (median {_fmt(s.median_step_s, 1e3)}, p90 {_fmt(s.p90_step_s, 1e3)})"
              if s.median_step_s is not None else "")
    lines = [f"Steps measured: {s.steps}; mean step time {_fmt(s.step_time_s, 1e3, ' ms')}{spread}"]
    if s.window:
        lines.append(f"Window: {s.window}.")
    lines += ["", "| part | ms / step | share |", "| --- | --- | --- |"]
    for name, v in breakdown(s).items():
        lines.append(f"| {name.replace('_', ' ')} | {v['seconds'] * 1e3:.3f} | {100 * v['fraction']:.1f}% |")
    lines += ["", "| metric | value |", "| --- | --- |"]
    if s.tokens_per_sec is not None:
        lines.append(f"| tokens/s (global) | {_fmt(s.tokens_per_sec, digits=4)} |")
    if s.samples_per_sec is not None or s.tokens_per_sec is None:
        lines.append(f"| samples/s (global) | {_fmt(s.samples_per_sec, digits=4)} |")
    mfu = _fmt(s.mfu, 100, "%") if s.mfu is not None or not s.mfu_note else f"n/a ({s.mfu_note})"
    lines += [f"| TFLOP/s per {s.device_unit} | {_fmt(s.tflops_per_device, digits=4)} |",
              f"| MFU | {mfu} |",
              f"| HFU | {_fmt(s.hfu, 100, '%')} |",
              *([f"| attention FLOPs | {s.attention} |"] if s.attention else []),
              f"| peak used | {s.peak or 'n/a'} |",
              f"| bound | {s.bound or 'n/a'} |"]
    return lines


def render_markdown(s: PerfSummary) -> str:
    lines = ["## Performance report", ""] + _figures(s)
    if _measured(s) and any(x is not None for x in s.exposed_comm_per_rank):
        per_rank = " / ".join("n/a" if x is None else f"{100 * x:.1f}%" for x in s.exposed_comm_per_rank)
        lines.append(f"| exposed comm per rank | {per_rank} |")
    if _measured(s) and s.gc_pause_s is not None:
        kind = "scheduled" if s.gc_scheduled else "automatic"
        lines.append(f"| Python GC | {_fmt(s.gc_pause_s, 1e3, ' ms')} per step ({s.gc_collections} {kind} "
                     f"collections, longest {_fmt(s.gc_max_pause_s, 1e3, ' ms')}) |")
    if s.roofline:
        lines += ["", "| op group | time share | TFLOP/s | GB/s | bound |", "| --- | --- | --- | --- | --- |"]
        for g in s.roofline:
            lines.append(f"| {g['name']} | {100 * g['time_share']:.1f}% | {g['achieved_tflops']:.3g} | "
                         f"{g['achieved_gbps']:.4g} | {g['bound']} |")
    if s.user_sync_sites or s.framework_sync_sites:
        lines += ["", "Sync sites (user):"] + [f"- {x}" for x in s.user_sync_sites or ["none"]]
        lines += ["", "Sync sites (framework):"] + [f"- {x}" for x in s.framework_sync_sites or ["none"]]
    if s.memory is not None:
        lines += memory_markdown(s.memory, s.settings).rstrip("\n").split("\n")
    recs = recommendations(s)
    lines += ["", "Top recommendations:"] + ([f"{i + 1}. {r}" for i, r in enumerate(recs)] or ["- none"])
    return "\n".join(lines) + "\n"
