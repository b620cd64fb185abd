"""Counting FLOPs and bytes per aten op, and model FLOPs per token.

``OpCounter`` is a ``TorchDispatchMode``: every aten op that runs inside it is recorded
with its FLOPs (the formulas of ``torch.utils.flop_counter``, i.e. what ``FlopCounterMode``
counts), the bytes it moves (tensor inputs read + outputs written; views move nothing),
its category (matmul, attention, norm, elementwise, communication, copy) and the
module it ran in.

Two corrections over ``FlopCounterMode``:

* causal attention: the SDPA formulas count the full T x T score square; with
  ``is_causal`` only half of it is computed, so the attention FLOPs are halved;
* CPU attention (``_scaled_dot_product_flash_attention_for_cpu``) is counted (it is not
  in the registry, so ``FlopCounterMode`` reports 0 for attention on CPU).

Model FLOPs = 3 x forward FLOPs (a matmul's backward is two matmuls of its size), which
is the usual ``6N`` convention and never counts activation recomputation;
hardware FLOPs (HFU) add what the backward actually ran, recomputation included.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.utils.flop_counter as _fc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "CATEGORIES",
    "OpRecord",
    "OpCounter",
    "FlopCount",
    "count_flops",
    "op_category",
    "category_of_name",
]

CATEGORIES = ("matmul", "attention", "norm", "elementwise", "communication", "copy")

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_scaled_mm", "addbmm", "_int_mm"}
_COPY = {
    "copy_", "_to_copy", "clone", "cat", "stack", "embedding", "embedding_dense_backward", "index_select",
    "gather", "scatter", "scatter_add", "scatter_add_", "index_put_", "index_add_", "_foreach_copy_",
    "constant_pad_nd", "repeat", "index", "masked_select", "nonzero", "_local_scalar_dense", "roll", "flip",
}
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense"}
_ATTENTION_BASE = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention",
    "_efficient_attention",
)


def op_category(func: Any) -> str:
    """Category of an aten/c10d op (an ``OpOverload``)."""
    namespace = getattr(func, "namespace", "aten")
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    return _categorize(namespace, name)


def category_of_name(qualified: str) -> str:
    """Category from a profiler-style name (``"aten::_flash_attention_forward"``, ``"c10d::allreduce_"``)."""
    namespace, _, name = qualified.rpartition("::")
    return _categorize(namespace or "aten", name.split(".")[0])


def _categorize(namespace: str, name: str) -> str:
    if namespace in ("c10d", "_c10d_functional", "c10d_functional", "_dtensor"):
        return "communication"
    if name.startswith(_ATTENTION_BASE) or "flex_attention" in name or "cudnn_attention" in name:
        return "attention"
    if name in _MATMUL:
        return "matmul"
    if "norm" in name and not name.startswith(("linalg", "_foreach_norm", "norm")):
        return "norm"  # native_layer_norm(_backward), _fused_rms_norm, native_batch_norm, group_norm
    if name in _COPY:
        return "copy"
    return "elementwise"


def _is_view(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns:
        return False
    infos = [r.alias_info for r in schema.returns]
    return all(a is not None and not a.is_write for a in infos)


def _causal_flag(func: Any, args: tuple, kwargs: dict) -> bool:
    """True when an attention op runs with a causal mask (``is_causal`` or ``custom_mask_type`` != 0)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.name in ("is_causal", "custom_mask_type"):
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            return bool(value)
    return False


def _tensors(tree: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


_SDPA_OPS = (  # the (B, H, T, D) entry points: q, k, v first; backward: grad_out, q, k, v
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def _sdpa_flops(name: str, args: tuple) -> int:
    """SDPA FLOPs with grouped-query attention counted as the query-head count of attention.

    k / v with fewer heads are broadcast by the kernel, so the work is that of k / v expanded to
    the query's heads. Torch's own formula accepts fewer k / v heads only from 2.13 (2.11 raises),
    so the shapes are expanded here and the count is the same on every supported torch.
    """
    backward = name.endswith("_backward")
    grad_out, q, k, v = args[:4] if backward else (None, *args[:3])
    hq = q.shape[1]

    def expand(shape: torch.Size) -> tuple[int, ...]:
        return (shape[0], hq, *shape[2:])

    if backward:
        return int(_fc.sdpa_backward_flop_count(grad_out.shape, q.shape, expand(k.shape), expand(v.shape)))
    return int(_fc.sdpa_flop_count(q.shape, expand(k.shape), expand(v.shape)))


def _flops(func: Any, category: str, args: tuple, kwargs: dict, out: Any) -> int:
    packet = getattr(func, "overloadpacket", None)
    formula = _fc.flop_registry.get(packet)
    name = packet.__name__ if packet is not None else ""
    if name in _SDPA_OPS or (name.endswith("_backward") and name[: -len("_backward")] in _SDPA_OPS):
        return _sdpa_flops(name, args)
    if formula is not None:
        try:
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not accept this overload's arguments
            pass
    outs = [t for t in _tensors(out) if t.is_floating_point()]
    if category == "elementwise":
        ins = [t for t in _tensors(args) if t.is_floating_point()]
        out_numel = sum(t.numel() for t in outs)
        in_numel = max((t.numel() for t in ins), default=0)
        return max(out_numel, in_numel)  # one FLOP per element (a reduction reads more than it writes)
    if category == "norm":
        return 5 * sum(t.numel() for t in _tensors(args)[:1])  # mean, var, normalise, scale, shift
    return 0


@dataclass(kw_only=True)
class OpRecord:
    """Totals of one (op, module) pair over a counted region."""

    op: str
    category: str
    module: str
    calls: int = 0
    flops: int = 0
    bytes: int = 0
    causal_attention: bool = False


class OpCounter(TorchDispatchMode):
    """Record FLOPs, bytes, category and module of every aten op run inside it.

    ``module_depth`` truncates module names (``"GPT.blocks.0.attn"`` at depth 3 -> the
    same, at depth 2 -> ``"GPT.blocks"``); with ``root`` every submodule is named by its path
    from the root, also when called directly. Attention FLOPs are halved for causal masks.
    """

    def __init__(self, *, module_depth: int = 3, track_modules: bool = True,
                 root: Optional[torch.nn.Module] = None) -> None:
        super().__init__()
        if module_depth < 1:
            raise ValueError(f"module_depth must be >= 1, got {module_depth}")
        self.module_depth = module_depth
        self.records: dict[tuple[str, str], OpRecord] = {}
        self._tracker = None
        if track_modules:
            from torch.utils.module_tracker import ModuleTracker

            self._tracker = ModuleTracker()
            known = getattr(self._tracker, "_known_modules", None)
            if root is not None and known is not None:  # name modules from the root even when called directly
                prefix = type(root).__name__
                for name, mod in root.named_modules():
                    known[mod] = f"{prefix}.{name}" if name else prefix

    def __enter__(self) -> "OpCounter":
        if self._tracker is not None:
            self._tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._tracker is not None:
            self._tracker.__exit__(*exc)

    def _module(self) -> str:
        if self._tracker is None:
            return "Global"
        parents = [p for p in self._tracker.parents if p != "Global"]
        if not parents:
            return "Global"
        deepest = max(parents, key=lambda p: p.count("."))
        return ".".join(deepest.split(".")[: self.module_depth])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_view(func):
            return out
        category = op_category(func)
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        flops = _flops(func, category, args, kwargs, out)
        causal = category == "attention" and _causal_flag(func, args, kwargs)
        if causal:
            flops //= 2
        traffic = 0 if name in _NO_TRAFFIC else _nbytes(_tensors(args) + _tensors(kwargs)) + _nbytes(_tensors(out))
        key = (f"{getattr(func, 'namespace', 'aten')}::{name}", self._module())
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = OpRecord(op=key[0], category=category, module=key[1], causal_attention=causal)
        rec.calls += 1
        rec.flops += flops
        rec.bytes += traffic
        return out

    # ---- summaries ---------------------------------------------------------------------------

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.records.values())

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records.values())

    def by(self, key: str) -> dict[str, dict[str, int]]:
        """Totals grouped by ``"category"``, ``"module"`` or ``"op"``: {name: {flops, bytes, calls}}."""
        if key not in ("category", "module", "op"):
            raise ValueError(f"group key must be 'category', 'module' or 'op', got {key!r}")
        out: dict[str, dict[str, int]] = defaultdict(lambda: {"flops": 0, "bytes": 0, "calls": 0})
        for rec in self.records.values():
            g = out[getattr(rec, key)]
            g["flops"] += rec.flops
            g["bytes"] += rec.bytes
            g["calls"] += rec.calls
        return dict(out)


_MODEL_CATEGORIES = ("matmul", "attention")


@dataclass(kw_only=True)
class FlopCount:
    """FLOPs of one training step on a sample batch.

    ``forward`` / ``backward`` count matmuls and attention only (what ``FlopCounterMode``
    and the ``6N`` convention count); ``by_category`` has every category of the forward.
    """

    forward: int
    backward: Optional[int] = None  # as run (recomputation included); None when not measured
    causal_attention_forward: int = 0  # attention FLOPs after the causal halving
    by_category: dict[str, int] = field(default_factory=dict)

    @property
    def model(self) -> int:
        """Model FLOPs: 3 x forward (no recomputation)."""
        return 3 * self.forward

    @property
    def hardware(self) -> Optional[int]:
        """FLOPs actually executed: forward + measured backward (with recomputation)."""
        return None if self.backward is None else self.forward + self.backward

    @property
    def recomputed(self) -> Optional[int]:
        """Backward FLOPs beyond the 2 x forward of a backward without recomputation."""
        return None if self.backward is None else max(0, self.backward - 2 * self.forward)


def _model_flops(counter: OpCounter) -> int:
    return sum(r.flops for r in counter.records.values() if r.category in _MODEL_CATEGORIES)


def count_flops(forward: Callable[[], Any], backward: Optional[Callable[[Any], None]] = None) -> FlopCount:
    """Count one step: ``out = forward()``, then ``backward(out)``, under one counter.

    One counter for both phases: a non-reentrant checkpoint recomputes under the dispatch
    modes that were active in the forward, so the recomputation lands in the same counter,
    after the forward's snapshot (i.e. in the backward). Without ``backward`` only the
    forward is counted (enough for model FLOPs / MFU).
    """
    with OpCounter(track_modules=False) as counter:
        out = forward()
        fwd_flops = _model_flops(counter)
        cats = {k: v["flops"] for k, v in counter.by("category").items()}
        causal = sum(r.flops for r in counter.records.values() if r.causal_attention)
        if backward is not None:
            backward(out)
    bwd_flops = _model_flops(counter) - fwd_flops if backward is not None else None
    return FlopCount(forward=fwd_flops, backward=bwd_flops, causal_attention_forward=causal, by_category=cats)
