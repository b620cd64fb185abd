"""Advice that knows the run: concrete changes ranked by the step time they would save.

Inputs: the measured summary (``perf.report.PerfSummary``, or anything with the fields of
:class:`MeasuredRun`) and its step breakdown (compute, exposed communication, data wait, host
overhead), the roofline op groups, garbage-collection pauses, the run's settings (``RunSettings``)
and, when measured, its memory (``MemoryReport``).

Each piece of advice carries the share of the step it would save, an upper bound read off this
run's own measurements: all of the data wait, all of the exposed communication, half of the time
of the op groups a fusion or a compiler addresses, the recomputed share of the FLOPs (HFU against
MFU). Advice that cannot be sized from the run ranks after all that can. A change is suggested
only when the settings say it is off: unknown settings suggest nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

from lightning_perf.perf.memory import GB, MemoryReport
from lightning_perf.perf.run_settings import RunSettings

__all__ = ["Advice", "MeasuredRun", "advise"]

_ADAM = ("Adam", "AdamW")
# a forward pass is a third of a training step's FLOPs (backward: two matmuls per forward matmul), so
# recomputing it in backward adds a quarter to the step's work; the run's HFU / MFU says so when known
_FULL_RECOMPUTE_SHARE = 0.25


class MeasuredRun(Protocol):
    """The measurements the advice reads (``perf.report.PerfSummary`` has them all)."""

    step_time_s: float
    mfu: Optional[float]
    hfu: Optional[float]
    roofline: list[dict[str, Any]]
    dataloader_advice: list[str]
    user_sync_sites: list[str]
    exposed_comm_per_rank: list[Optional[float]]
    gc_pause_s: Optional[float]
    gc_max_pause_s: Optional[float]
    gc_collections: int
    gc_scheduled: bool
    fsdp_blocks_per_unit: Optional[int]


@dataclass(kw_only=True)
class Advice:
    text: str
    fraction: Optional[float]  # of the step it would save (None: not sized from this run)
    changes: tuple[str, ...] = ()  # what it switches on (RunSettings CHANGES)

    def seconds(self, step_time_s: float) -> Optional[float]:
        return None if self.fraction is None else self.fraction * step_time_s


def _share(summary: MeasuredRun, bound: Optional[str] = None, names: tuple[str, ...] = ()) -> float:
    """The share of kernel time of the roofline groups of this ``bound`` (any: None) and these ``names`` (any: ())."""
    return sum(g.get("time_share", 0.0) for g in summary.roofline
               if (bound is None or g.get("bound") == bound) and (not names or g.get("name") in names))


def _headroom(memory: Optional[MemoryReport], below: float) -> Optional[str]:
    """``"peak A of B GB"`` when the allocated peak is below ``below`` of the device's memory."""
    if memory is None or not memory.peak_allocated or not memory.device_total:
        return None
    if memory.peak_allocated >= below * memory.device_total:
        return None
    return f"peak {memory.peak_allocated / GB:.3g} of {memory.device_total / GB:.3g} GB"


def _loader_tips(summary: MeasuredRun, s: RunSettings) -> list[str]:
    tips = list(summary.dataloader_advice)
    if s.state("dataloader_workers"):
        tips = [t for t in tips if not t.startswith("num_workers=0")]
    if s.state("pin_memory"):
        tips = [t for t in tips if not t.startswith("pin_memory=False")]
    return tips


def advise(summary: MeasuredRun, parts: Mapping[str, Mapping[str, float]], settings: Optional[RunSettings] = None,
           memory: Optional[MemoryReport] = None) -> list[Advice]:
    """Every applicable change, ranked by the share of the step it would save (unsized ones last)."""
    s = settings or RunSettings()
    gc_on = bool(summary.gc_scheduled or s.gc_scheduled)
    tips: list[Advice] = []
    compute = parts["compute"]["fraction"]
    cuda = s.device_type == "cuda"

    data = parts["data_wait"]["fraction"]
    if data > 0.05:
        loader = _loader_tips(summary, s)
        if loader:
            first = loader[0]
        elif s.state("dataloader_workers"):
            first = "the loader has workers: the dataset itself is slow (decode/tokenise offline)"
        else:
            first = "use more DataLoader workers"
        changes = tuple(c for c, key in (("dataloader_workers", "num_workers=0"), ("pin_memory", "pin_memory=False"))
                        if first.startswith(key) and s.off(c))
        tips.append(Advice(text=f"Input pipeline: {100 * data:.1f}% of each step waits for data; {first}.",
                           fraction=data, changes=changes))

    comm = parts["exposed_comm"]["fraction"]
    units = summary.fsdp_blocks_per_unit if summary.fsdp_blocks_per_unit is not None else s.fsdp_blocks_per_unit
    if units == 1 and comm > 0.05:
        gc_advice = "" if gc_on else (
            ", and attach lightning_perf.callbacks.GarbageCollection so the ranks do not pause at different moments")
        tips.append(Advice(
            text=f"Communication: {100 * comm:.1f}% of each step is exposed; shard two blocks per FSDP2 unit "
                 "(ZeroStrategy(blocks_per_unit=2): half the collectives and FSDP2 hook work per step)"
                 f"{gc_advice}; then check FSDP prefetch and the link's bus bandwidth.",
            fraction=comm, changes=("fsdp_larger_units",) + (() if gc_on else ("gc_schedule",))))
    elif comm > 0.10:
        tips.append(Advice(text=f"Communication: {100 * comm:.1f}% of each step is exposed; overlap it (DDP bucket "
                                "size, FSDP prefetch, larger micro-batches) and check the link's bus bandwidth.",
                           fraction=comm))

    ranks = [(r, x) for r, x in enumerate(summary.exposed_comm_per_rank) if x is not None]
    if len(ranks) > 1:
        (low_rank, low), (high_rank, high) = min(ranks, key=lambda t: t[1]), max(ranks, key=lambda t: t[1])
        if high - low > 0.10:
            gc_hint = "" if gc_on else "automatic garbage collections (lightning_perf.callbacks.GarbageCollection), "
            fewer = [x for x, on in (("fewer FSDP units", units is not None and units > 1),
                                     ("CUDA graphs", s.state("cuda_graphs"))) if not on]
            host_work = f"host work per step ({', '.join(fewer)})" if fewer else "host work per step"
            tips.append(Advice(
                text=f"Ranks wait for each other: exposed communication is {100 * high:.1f}% of the step on rank "
                     f"{high_rank} but {100 * low:.1f}% on rank {low_rank}; the rank with the least is the slow one, "
                     f"its peers wait for it inside the collectives. Look for pauses on rank {low_rank}'s host: "
                     f"{gc_hint}data-loading stalls, {host_work}.",
                fraction=high - low, changes=() if gc_on else ("gc_schedule",)))

    if summary.user_sync_sites:
        sites = ", ".join(x.split(" in ")[0] for x in summary.user_sync_sites[:3])
        tips.append(Advice(text=f"Host-device syncs in your code drain the GPU queue: {sites}. Keep values on the "
                                "device (log tensors, avoid .item()/nonzero/boolean masks in the step).",
                           fraction=min(0.5, 0.1 * len(summary.user_sync_sites))))

    host = parts["host_overhead"]["fraction"]
    if host > 0.05:
        room = _headroom(memory, 0.5)
        bigger = (f"raise the micro-batch ({room}: memory allows it)" if room else "raise the batch size per step")
        tips.append(Advice(text=f"Host overhead: the device idles {100 * host:.1f}% of each step between steps "
                                f"(hooks, logging, callbacks); log less often, or {bigger}.", fraction=host))

    mem = _share(summary, "memory", ("elementwise", "norm", "copy"))
    if mem > 0.2:
        if s.off("compile"):
            how, changes = "torch.compile fuses them", ("compile",)
        elif s.state("compile") and s.gpt and s.off("triton_kernels") and s.compile_scope != "model":
            how, changes = "the pack's fused norm and MLP kernels (config_overrides={'kernels': 'triton'})", (
                "triton_kernels",)
        else:
            how, changes = "", ()
        if how:
            tips.append(Advice(text=f"Memory-bound elementwise/norm/copy ops take {100 * mem:.0f}% of kernel time; "
                                    f"{how}.", fraction=0.5 * mem * compute, changes=changes))

    over = _share(summary, "overhead")
    if over > 0.2:
        fixes, changes = [], []
        if s.off("compile"):
            fixes.append("torch.compile (fewer, larger kernels)")
            changes.append("compile")
        elif s.state("compile") and cuda and s.off("cuda_graphs") and not s.sharded_per_block:
            fixes.append("CUDA graphs (compile mode 'reduce-overhead': one launch per graph)")
            changes.append("cuda_graphs")
        room = _headroom(memory, 0.5)
        if room:
            fixes.append(f"a larger micro-batch ({room})")
        if fixes:
            tips.append(Advice(text=f"Overhead-bound ops take {100 * over:.0f}% of kernel time (launch latency); "
                                    + ", ".join(fixes) + ".", fraction=0.5 * over * compute, changes=tuple(changes)))

    if cuda and s.off("compile") and not any("compile" in t.changes for t in tips):
        tips.append(Advice(text="Compile: no part of the model runs under torch.compile, which fuses elementwise "
                                "and norm ops into the matmuls' neighbours and cuts kernel launches.",
                           fraction=None, changes=("compile",)))

    if summary.gc_pause_s is not None and summary.step_time_s > 0 and not gc_on:
        frac = summary.gc_pause_s / summary.step_time_s
        longest = (summary.gc_max_pause_s or 0.0) / summary.step_time_s
        if frac > 0.01 or longest > 0.1:
            tips.append(Advice(
                text=f"Python garbage collection paused the host {1e3 * summary.gc_pause_s:.3g} ms per step "
                     f"({summary.gc_collections} automatic collections, the longest "
                     f"{1e3 * (summary.gc_max_pause_s or 0):.3g} ms); with several ranks each pause also stalls the "
                     "others in the next collective. Attach lightning_perf.callbacks.GarbageCollection to collect at "
                     "fixed steps on every rank.",
                fraction=max(frac, 0.1 * longest), changes=("gc_schedule",)))

    if s.gpt and s.state("compile") and s.compile_scope == "block" and not s.sharded_per_block and over > 0.05:
        # one graph per block leaves a launch and a guard check per block, and the code between the
        # blocks (embedding, head, loss) eager: what the overhead-bound groups measure
        tips.append(Advice(
            text=f"Compile scope: the blocks are compiled one by one and overhead-bound ops take {100 * over:.0f}% "
                 "of kernel time (launch latency); whole-model compile (GPTLightningModule(compile_scope='model')) "
                 "runs the model as one graph: fewer launches and guard checks per step.",
            fraction=0.5 * over * compute, changes=("compile_model_scope",)))

    matmuls = _share(summary, "compute", ("matmul",))
    if s.gpt and cuda and s.fp8_capable and s.off("fp8") and matmuls > 0.2:
        # FP8 tensor cores run at twice the 16-bit rate: at most half of the compute-bound matmuls' time
        tips.append(Advice(
            text=f"FP8 linears: compute-bound matmuls take {100 * matmuls:.0f}% of kernel time; "
                 "config_overrides={'fp8': 'tensorwise', 'fused_qkv': True} runs the linear layers' matmuls on "
                 "the FP8 tensor cores (twice the 16-bit rate; the larger the matmuls, the closer the gain to it).",
            fraction=0.5 * matmuls * compute, changes=("fp8",)))

    if cuda and s.off("bf16"):
        mm = _share(summary, None, ("matmul", "attention"))
        tips.append(Advice(
            text=f"Precision: {s.precision} runs matmuls at the fp32 / TF32 rate; precision='bf16-mixed' (bf16 "
                 "autocast) doubles the tensor-core peak"
                 + (f" for the matmuls and attention ({100 * mm:.0f}% of kernel time)." if mm else "."),
            fraction=0.5 * mm * compute if mm else None, changes=("bf16",)))

    if cuda and s.optimizer in _ADAM and s.off("fused_optimizer"):
        where = "GPTLightningModule(fused_adam=True)" if s.gpt else f"{s.optimizer}(..., fused=True)"
        tips.append(Advice(text=f"Optimizer: {s.optimizer} runs unfused; {where} updates every parameter in one "
                                "kernel launch per group (fused AdamW).", fraction=None, changes=("fused_optimizer",)))

    if s.activation_checkpointing == "full":
        room = _headroom(memory, 0.5)
        if room:
            recomputed = _FULL_RECOMPUTE_SHARE
            if summary.mfu and summary.hfu and summary.hfu > summary.mfu:
                recomputed = 1 - summary.mfu / summary.hfu  # the executed FLOPs the model FLOPs do not count
            tips.append(Advice(
                text=f"Activation checkpointing 'full' recomputes the whole forward (~{100 * recomputed:.0f}% of "
                     f"the step's compute) with the {room}: mode 'selective' recomputes only norms and elementwise "
                     "ops, 'none' nothing.",
                fraction=recomputed * compute))

    if summary.mfu is not None and summary.mfu < 0.3:
        room = _headroom(memory, 0.7)
        if room:
            tips.append(Advice(text=f"MFU is {100 * summary.mfu:.1f}% with the {room}: raise the micro-batch.",
                               fraction=None))

    sized = sorted((t for t in tips if t.fraction is not None), key=lambda t: -t.fraction)  # type: ignore[operator]
    return sized + [t for t in tips if t.fraction is None]
