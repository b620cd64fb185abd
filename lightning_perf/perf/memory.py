"""Device memory of a training step by category, and advice sized from it.

    peak allocated = parameters + gradients + optimizer state + activations + other

Parameters, gradients and optimizer state are summed over the tensors themselves (each storage
once; a DTensor counts the shard this rank holds, so ZeRO / FSDP / TP layouts read per GPU).
Activations are what the forward holds for the backward: on CUDA the allocator's bytes after the
forward less those before it; elsewhere the bytes autograd saved (``perf.saved_activations``).
"Other" is the rest of the peak: temporaries of the backward and the optimizer step, the batch,
workspaces. Reserved memory above the allocated peak is cache the allocator keeps; the part held
in split blocks no tensor uses (``inactive_split_bytes``) is fragmentation.

On a CPU the caching allocator's statistics do not exist: the peak, reserved and fragmentation
figures need a CUDA device; the categories and the saved activations do not.

Sizes are in bytes; reports print GB (10^9 bytes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Optional

import torch

from lightning_perf.perf.run_settings import RunSettings

__all__ = ["GB", "MemoryCategories", "AllocatorStats", "MemoryReport", "MemoryAdvice", "tensor_bytes",
           "count_categories", "optimizer_state_tensors", "memory_advice", "memory_markdown", "oom_markdown"]

GB = 1e9
ACTIVATION_SHARE = 0.25  # activations above this share of the peak: checkpointing / a smaller micro-batch pays
OPTIMIZER_SHARE = 0.10  # sharded state above this share of the peak: ZeRO pays
FRAGMENTATION_SHARE = 0.10  # reserved-but-unallocated above this share of the reserved peak


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: this rank's shard
    return to_local() if callable(to_local) and hasattr(t, "device_mesh") else t


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]], *, device: Optional[torch.device] = None,
                 seen: Optional[set[tuple[Any, int]]] = None) -> int:
    """Bytes of the storages behind ``tensors`` (each storage once, DTensors by their local shard),
    only those on ``device`` when given; ``seen`` carries storages already counted elsewhere."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = _local(t)
        if local.device.type == "meta" or (device is not None and not _same_device(local.device, device)):
            continue
        storage = local.untyped_storage()
        key = (local.device, storage.data_ptr())
        if storage.data_ptr() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state (a ZeroRedundancyOptimizer's local partition; wrappers
    that keep the real optimizer in ``_optimizer`` or ``optim`` are unwrapped)."""
    for attr in ("_optimizer", "optim"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            optimizer = inner
    out: list[torch.Tensor] = []
    for state in getattr(optimizer, "state", {}).values():
        values = state.values() if isinstance(state, Mapping) else [state]
        out += [v for v in values if isinstance(v, torch.Tensor)]
    return out


@dataclass(kw_only=True)
class MemoryCategories:
    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def count_categories(parameters: Iterable[torch.Tensor], optimizers: Iterable[Any] = (), *,
                     device: Optional[torch.device] = None) -> MemoryCategories:
    """Bytes of the parameters, their gradients and the optimizers' state on ``device``."""
    params = list(parameters)
    seen: set[tuple[Any, int]] = set()
    p = tensor_bytes(params, device=device, seen=seen)
    g = tensor_bytes((x.grad for x in params), device=device, seen=seen)
    o = tensor_bytes((t for opt in optimizers for t in optimizer_state_tensors(opt)), device=device, seen=seen)
    return MemoryCategories(parameters=p, gradients=g, optimizer_state=o)


@dataclass(kw_only=True)
class AllocatorStats:
    """The caching allocator's figures of interest, from ``torch.cuda.memory_stats()``."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    inactive_split: int = 0
    peak_inactive_split: int = 0

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> "AllocatorStats":
        """From the flat ``torch.cuda.memory_stats()`` or the nested ``memory_stats_as_nested_dict()``
        (the cheaper one: no flattening)."""
        def get(key: str) -> int:
            if key in stats:
                return int(stats[key] or 0)
            node: Any = stats
            for part in key.split("."):
                node = node.get(part, {}) if isinstance(node, Mapping) else {}
            return int(node or 0) if not isinstance(node, Mapping) else 0

        return cls(allocated=get("allocated_bytes.all.current"), reserved=get("reserved_bytes.all.current"),
                   peak_allocated=get("allocated_bytes.all.peak"), peak_reserved=get("reserved_bytes.all.peak"),
                   inactive_split=get("inactive_split_bytes.all.current"),
                   peak_inactive_split=get("inactive_split_bytes.all.peak"))


@dataclass(kw_only=True)
class MemoryReport:
    """One run's memory figures (bytes; ``None`` where not measured on this device)."""

    device_type: str
    device_total: Optional[int] = None
    parameters: Optional[int] = None
    gradients: Optional[int] = None
    optimizer_state: Optional[int] = None
    activations: Optional[int] = None
    peak_allocated: Optional[int] = None
    peak_reserved: Optional[int] = None
    inactive_split: Optional[int] = None
    peak_step: Optional[int] = None
    micro_batch: Optional[int] = None
    saved_activations: Optional[int] = None  # bytes autograd saved for backward (perf.saved_activations)
    selective_saves: Optional[int] = None  # bytes activation_checkpointing="selective" would free
    full_saves: Optional[int] = None  # bytes activation_checkpointing="full" would free
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> Optional[int]:
        """Parameters + gradients + optimizer state (None until counted)."""
        parts = (self.parameters, self.gradients, self.optimizer_state)
        return None if any(x is None for x in parts) else sum(parts)  # type: ignore[arg-type]

    @property
    def fragmentation(self) -> Optional[int]:
        """Reserved but not allocated at the peak."""
        if self.peak_reserved is None or self.peak_allocated is None:
            return None
        return max(0, self.peak_reserved - self.peak_allocated)

    @property
    def other(self) -> Optional[int]:
        if self.peak_allocated is None or self.state is None or self.activations is None:
            return None
        return max(0, self.peak_allocated - self.state - self.activations)

    def reference(self) -> tuple[Optional[int], str]:
        """The bytes shares are taken of: the allocated peak, else what was counted."""
        if self.peak_allocated:
            return self.peak_allocated, "peak"
        known = [x for x in (self.parameters, self.gradients, self.optimizer_state, self.activations) if x]
        return (sum(known), "counted") if known else (None, "counted")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("fragmentation", "other", "state"):
            out[name] = getattr(self, name)
        for name in ("device_total", "parameters", "gradients", "optimizer_state", "activations", "peak_allocated",
                     "peak_reserved", "inactive_split", "saved_activations", "selective_saves", "full_saves",
                     "fragmentation", "other"):
            out[name + "_gb"] = None if out[name] is None else out[name] / GB
        return out


@dataclass(kw_only=True)
class MemoryAdvice:
    text: str
    saves_bytes: Optional[int]  # at the peak, per GPU
    changes: tuple[str, ...]  # what it switches on (RunSettings CHANGES)


def _gb(x: float) -> str:
    return f"{x / GB:.3g} GB"


def memory_advice(report: MemoryReport, settings: Optional[RunSettings] = None) -> list[MemoryAdvice]:
    """Changes that lower the peak, each sized from the report, largest saving first. A change is
    suggested only when the settings say it is off."""
    s = settings or RunSettings()
    ref, label = report.reference()
    tips: list[MemoryAdvice] = []
    acts = report.activations
    if ref and acts and acts >= ACTIVATION_SHARE * ref:
        share = f"activations are {100 * acts / ref:.0f}% of the {_gb(ref)} {label}"
        if s.off("activation_checkpointing"):
            where = "GPTLightningModule(activation_checkpointing=...)" if s.gpt else "per block"
            modes = []
            if report.selective_saves is not None:
                modes.append(f"mode 'selective' saves ~{_gb(report.selective_saves)}, recomputing norms and "
                             "elementwise ops")
            if report.full_saves is not None:
                modes.append(f"'full' ~{_gb(report.full_saves)}, recomputing the forward (~1/3 more compute)")
            detail = "; ".join(modes) or ("'selective' recomputes norms and elementwise ops, 'full' the whole "
                                          "forward (~1/3 more compute)")
            saves = report.selective_saves if report.selective_saves is not None else report.full_saves
            tips.append(MemoryAdvice(text=f"{share}: activation checkpointing ({where}: {detail}).",
                                     saves_bytes=saves, changes=("activation_checkpointing",)))
        mb = report.micro_batch or s.micro_batch
        if mb and mb >= 2:
            new = mb // 2
            saved = int(acts * (1 - new / mb))
            verb = "halves activations" if 2 * new == mb else f"cuts activations by {100 * (1 - new / mb):.0f}%"
            tips.append(MemoryAdvice(
                text=f"{share}: micro-batch {mb} -> {new} {verb} (~{_gb(saved)}); "
                     f"accumulate_grad_batches={s.accumulate_grad_batches * mb // new} keeps the global batch.",
                saves_bytes=saved, changes=()))
    opt, grads, params = report.optimizer_state, report.gradients, report.parameters
    n = s.data_parallel_size
    if ref and opt and n > 1 and opt >= OPTIMIZER_SHARE * ref:
        stages = []
        keep = 1 - 1 / n
        if s.off("zero1"):
            stages.append(("ZeRO-1 (strategy='zero1')", opt * keep, "zero1"))
        if s.off("zero2") and grads is not None:
            stages.append(("ZeRO-2 (strategy='zero2', the gradients too)", (opt + grads) * keep, "zero2"))
        if s.off("zero3") and grads is not None and params is not None:
            stages.append(("ZeRO-3 (strategy='zero3', the parameters too)", (opt + grads + params) * keep, "zero3"))
        if stages:
            text = (f"optimizer state {_gb(opt)} per GPU: " + "; ".join(f"{name} over {n} GPUs saves ~{_gb(b)}"
                                                                   for name, b, _ in stages) + ".")
            tips.append(MemoryAdvice(text=text, saves_bytes=int(stages[0][1]), changes=tuple(c for *_, c in stages)))
    frag = report.fragmentation
    if frag and report.peak_reserved and frag >= FRAGMENTATION_SHARE * report.peak_reserved and s.off(
            "expandable_segments"):
        split = f", {_gb(report.inactive_split)} of it in split blocks no tensor uses" if report.inactive_split else ""
        tips.append(MemoryAdvice(
            text=f"{_gb(frag)} ({100 * frag / report.peak_reserved:.0f}% of the {_gb(report.peak_reserved)} reserved) "
                 f"is cached but not allocated at the peak{split}: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                 "lets the allocator grow segments instead of splitting them.",
            saves_bytes=frag, changes=("expandable_segments",)))
    tips.sort(key=lambda t: -(t.saves_bytes or 0))
    return tips


def memory_markdown(report: MemoryReport, settings: Optional[RunSettings] = None) -> str:
    """The memory section of the performance report."""
    def cell(x: Optional[int]) -> str:
        return "n/a" if x is None else f"{x / GB:.3g}"

    ref, label = report.reference()

    def share(x: Optional[int]) -> str:
        return f"{100 * x / ref:.0f}%" if ref and x is not None else ""

    rows = [("parameters", report.parameters), ("gradients", report.gradients),
            ("optimizer state", report.optimizer_state), ("activations", report.activations),
            ("other (temporaries, batch, workspaces)", report.other), ("peak allocated", report.peak_allocated),
            ("peak reserved", report.peak_reserved), ("reserved - allocated at peak", report.fragmentation),
            ("inactive split blocks", report.inactive_split), ("device total", report.device_total)]
    step = f" (step {report.peak_step})" if report.peak_step is not None else ""
    per = "GPU" if report.device_type == "cuda" else report.device_type
    lines = ["", f"Memory per {per}{step}:", "", f"| category | GB | share of {label} |", "| --- | --- | --- |"]
    lines += [f"| {name} | {cell(v)} | {share(v) if name not in ('peak reserved', 'device total') else ''} |"
              for name, v in rows if v is not None or name in ("parameters", "activations", "peak allocated")]
    lines += [f"- {note}" for note in report.notes]
    tips = memory_advice(report, settings)
    if tips:
        lines += ["", "Memory advice:"] + [f"{i + 1}. {t.text}" for i, t in enumerate(tips)]
    if report.files:
        lines += ["", "Memory files:"] + [f"- {f}" for f in report.files]
    return "\n".join(lines) + "\n"


def oom_markdown(report: MemoryReport, tips: list[MemoryAdvice], *, requested: Optional[int] = None,
                 device_free: Optional[int] = None) -> str:
    """The categories, the failed request and the advice, written beside an out-of-memory snapshot."""
    def gb(x: Optional[int]) -> str:
        return "n/a" if x is None else _gb(x)

    lines = ["## Memory by category", ""]
    lines += [f"- {name}: {gb(v)}" for name, v in (
        ("parameters", report.parameters), ("gradients", report.gradients), ("optimizer state", report.optimizer_state),
        ("peak allocated", report.peak_allocated), ("peak reserved", report.peak_reserved))]
    if requested is not None:
        lines.append(f"- the failed allocation: {gb(requested)} with {gb(device_free)} free")
    if tips:
        lines += ["", "## Advice", ""] + [f"{i + 1}. {t.text}" for i, t in enumerate(tips)]
    return "\n".join(lines) + "\n"
