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

__all__ = ["PerfSummary", "breakdown", "recommendations", "render_markdown"]


@dataclass(kw_only=True)
class PerfSummary:
    step_time_s: float
    steps: int = 0
    data_wait_s: Optional[float] = None
    between_steps_s: Optional[float] = None  # device idle gap between steps (data wait + host work)
    exposed_comm_s: Optional[float] = None
    tokens_per_sec: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    hfu: Optional[float] = None
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
    fsdp_blocks_per_unit: Optional[int] = None  # blocks per FSDP2 unit when a native ZeRO-2/3 strategy shards the model
    exposed_comm_per_rank: list[Optional[float]] = field(default_factory=list)  # exposed share of the step, per rank

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["breakdown"] = breakdown(self)
        out["recommendations"] = recommendations(self)
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


def _share(s: PerfSummary, bound: str, names: tuple[str, ...] = ()) -> float:
    return sum(g.get("time_share", 0.0) for g in s.roofline
               if g.get("bound") == bound and (not names or g.get("name") in names))


def recommendations(s: PerfSummary, *, top: int = 3) -> list[str]:
    """The ``top`` suggestions, ranked by the share of the step they address."""
    parts = breakdown(s)
    tips: list[tuple[float, str]] = []
    data = parts["data_wait"]["fraction"]
    if data > 0.05:
        first = s.dataloader_advice[0] if s.dataloader_advice else "use more DataLoader workers"
        tips.append((data, f"Input pipeline: {100 * data:.1f}% of each step waits for data; {first}."))
    comm = parts["exposed_comm"]["fraction"]
    if s.fsdp_blocks_per_unit == 1 and comm > 0.05:
        gc_advice = "" if s.gc_scheduled else (
            ", and attach lightning_perf.callbacks.GarbageCollection so the ranks do not pause at different moments")
        tips.append((comm, f"Communication: {100 * comm:.1f}% of each step is exposed; shard two blocks per FSDP2 unit "
                           "(ZeroStrategy(blocks_per_unit=2): half the collectives and FSDP2 hook work per step)"
                           f"{gc_advice}; then check FSDP prefetch and the link's bus bandwidth."))
    elif comm > 0.10:
        tips.append((comm, f"Communication: {100 * comm:.1f}% of each step is exposed; overlap it (DDP bucket size, "
                           "FSDP prefetch, larger micro-batches) and check the link's bus bandwidth."))
    ranks = [(r, x) for r, x in enumerate(s.exposed_comm_per_rank) if x is not None]
    if len(ranks) > 1:
        (low_rank, low), (high_rank, high) = min(ranks, key=lambda t: t[1]), max(ranks, key=lambda t: t[1])
        if high - low > 0.10:
            tips.append((high - low, f"Ranks wait for each other: exposed communication is {100 * high:.1f}% of the "
                                     f"step on rank {high_rank} but {100 * low:.1f}% on rank {low_rank}; the rank "
                                     "with the least is the slow one, its peers wait for it inside the collectives. "
                                     f"Look for pauses on rank {low_rank}'s host: automatic garbage collections "
                                     "(lightning_perf.callbacks.GarbageCollection), data-loading stalls, host work "
                                     "per step (fewer FSDP units, CUDA graphs)."))
    if s.user_sync_sites:
        sites = ", ".join(x.split(" in ")[0] for x in s.user_sync_sites[:3])
        tips.append((min(0.5, 0.1 * len(s.user_sync_sites)),
                     f"Host-device syncs in your code drain the GPU queue: {sites}. Keep values on the "
                     "device (log tensors, avoid .item()/nonzero/boolean masks in the step)."))
    host = parts["host_overhead"]["fraction"]
    if host > 0.05:
        tips.append((host, f"Host overhead: the device idles {100 * host:.1f}% of each step between steps "
                           "(hooks, logging, callbacks); log less often, or raise the batch size per step."))
    compute = parts["compute"]["fraction"]
    mem = _share(s, "memory", ("elementwise", "norm", "copy"))
    if mem > 0.2:
        tips.append((0.5 * mem * compute, f"Memory-bound elementwise/norm/copy ops take {100 * mem:.0f}% of kernel "
                                          "time; fuse them (torch.compile, fused kernels)."))
    over = _share(s, "overhead")
    if over > 0.2:
        tips.append((0.5 * over * compute, f"Overhead-bound ops take {100 * over:.0f}% of kernel time (launch "
                                           "latency); larger batches, torch.compile, CUDA graphs."))
    if s.gc_pause_s is not None and s.step_time_s > 0 and not s.gc_scheduled:
        frac = s.gc_pause_s / s.step_time_s
        longest = (s.gc_max_pause_s or 0.0) / s.step_time_s
        if frac > 0.01 or longest > 0.1:
            tips.append((max(frac, 0.1 * longest),
                         f"Python garbage collection paused the host {1e3 * s.gc_pause_s:.3g} ms per step "
                         f"({s.gc_collections} automatic collections, the longest {1e3 * (s.gc_max_pause_s or 0):.3g} "
                         "ms); with several ranks each pause also stalls the others in the next collective. "
                         "Attach lightning_perf.callbacks.GarbageCollection to collect at fixed steps on every "
                         "rank."))
    if s.mfu is not None and s.mfu < 0.3:
        tips.append((0.01, f"MFU is {100 * s.mfu:.1f}%: raise the micro-batch, use bf16 autocast, fused "
                           "AdamW and torch.compile."))
    tips.sort(key=lambda t: -t[0])
    return [t for _, t in tips[:top]]


def _fmt(v: Optional[float], scale: float = 1.0, unit: str = "", digits: int = 3) -> str:
    return "n/a" if v is None else f"{v * scale:.{digits}g}{unit}"


def render_markdown(s: PerfSummary) -> str:
    parts = breakdown(s)
    lines = ["## Performance report", "", f"Steps measured: {s.steps}; mean step time {_fmt(s.step_time_s, 1e3, ' ms')}",
             "", "| part | ms / step | share |", "| --- | --- | --- |"]
    for name, v in parts.items():
        lines.append(f"| {name.replace('_', ' ')} | {v['seconds'] * 1e3:.3f} | {100 * v['fraction']:.1f}% |")
    lines += ["", "| metric | value |", "| --- | --- |",
              f"| tokens/s (global) | {_fmt(s.tokens_per_sec, digits=4)} |",
              f"| TFLOP/s per GPU | {_fmt(s.tflops_per_gpu, digits=4)} |",
              f"| MFU | {_fmt(s.mfu, 100, '%')} |",
              f"| HFU | {_fmt(s.hfu, 100, '%')} |",
              f"| peak used | {s.peak or 'n/a'} |",
              f"| bound | {s.bound or 'n/a'} |"]
    if any(x is not None for x in s.exposed_comm_per_rank):
        per_rank = " / ".join("n/a" if x is None else f"{100 * x:.1f}%" for x in s.exposed_comm_per_rank)
        lines.append(f"| exposed comm per rank | {per_rank} |")
    if s.gc_pause_s is not None:
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
    recs = recommendations(s)
    lines += ["", "Top recommendations:"] + ([f"{i + 1}. {r}" for i, r in enumerate(recs)] or ["- none"])
    return "\n".join(lines) + "\n"
