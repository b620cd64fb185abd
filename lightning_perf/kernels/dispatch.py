"""Where the GPT's entry points (``models.gpt.ops``) meet the kernels.

Each function returns the kernel's result, or ``None`` to mean "use the PyTorch
reference path": Triton missing, a CPU tensor without the interpreter, or a
dtype / shape a kernel does not take. Attention by name (``impl="flex"``, ``"fa3"``,
``"fa4"``, ``"triton"``) runs that backend of ``kernels.attention_backends``; with
``impl="auto"`` it is routed by an :class:`AttentionSelector`, which times each SDPA
backend (cuDNN, flash, efficient), FlexAttention and the installed flash-attention
packages once per (shape, dtype, device, causal), forward + backward, keeps the
fastest and logs the choice. Given an :class:`~lightning_perf.kernels.autotune.AutotuneCache`, the
selector keeps its choices on disk too (per GPU name, torch and Triton versions, shape, dtype, and the
flash-attention packages installed), so a restarted run times nothing it timed before.

Packed documents (``doc_ids``): only the backends that take a document mask run
(``AttentionBackends.DOCUMENT_MASKED``: FlexAttention, the Triton kernel, SDPA's memory-efficient
backend); ``"auto"`` times only those, and a named backend that cannot take the mask (FA3, FA4, or
any on a CPU tensor but the Triton kernel) is replaced by FlexAttention on CUDA, else SDPA with an
explicit mask, with one log line per (backend, device). The reference path never drops the mask:
with ``doc_ids`` the dispatcher always returns a result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from lightning_perf.kernels.attention_backends import (
    BACKENDS,
    LIBRARY_BACKENDS,
    SDPA_BACKENDS,
    AttentionBackends,
    missing_requirement,
    sdpa,
)
from lightning_perf.kernels.autotune import AutotuneCache
from lightning_perf.kernels.dtensor import is_dtensor as _is_dtensor

__all__ = [
    "attention",
    "norm",
    "mlp_activation",
    "lm_loss",
    "AttentionSelector",
    "KernelDispatcher",
    "default_dispatcher",
    "set_default_dispatcher",
    "SDPA_BACKENDS",
    "ATTENTION_IMPLS",
    "sdpa",
]

log = logging.getLogger(__name__)

_CANDIDATES = BACKENDS
#: the attention implementations a user can name (``GPTConfig.attention``, ``KernelDispatcher.attention``)
ATTENTION_IMPLS = ("auto", "sdpa") + LIBRARY_BACKENDS + ("triton",)


@dataclass(kw_only=True)
class AttentionSelector:
    """Fastest attention per (shape, dtype, device, causal), timed once with CUDA events and cached.

    Each of ``candidates`` that can take the tensors (installed, supported by the GPU, the shape
    accepted) is run forward + backward ``warmup`` times, then timed over ``repeat`` runs; the
    choice is the minimum. ``fallback`` (our Triton kernel) is timed only when every candidate
    refuses the shape. A candidate that is missing or raises is skipped, its reason kept in
    ``skipped``.

    Under ``torch.compile`` tracing nothing is timed: the cached choice among the candidates Dynamo
    can trace (``traced_choices``; FA4 is not one) is used, else SDPA's default.

    ``cache``: where choices persist between runs (None: in memory only). A choice read back is used
    without timing when its backend can still take the tensors; the disk is consulted only where the
    selector would otherwise time (never while tracing), so a compiled model's graph does not depend
    on what earlier runs left there.
    """

    candidates: tuple[str, ...] = SDPA_BACKENDS + LIBRARY_BACKENDS
    fallback: tuple[str, ...] = ("triton",)
    warmup: int = 2
    repeat: int = 10
    backends: AttentionBackends = field(default_factory=AttentionBackends)
    choices: dict[tuple, str] = field(default_factory=dict)
    traced_choices: dict[tuple, str] = field(default_factory=dict)
    timings: dict[tuple, dict[str, float]] = field(default_factory=dict)
    skipped: dict[tuple, dict[str, str]] = field(default_factory=dict)
    cache: Optional[AutotuneCache] = None

    def __post_init__(self) -> None:
        unknown = [c for c in self.candidates + self.fallback if c not in _CANDIDATES]
        if unknown or not self.candidates:
            raise ValueError(f"AttentionSelector candidates {self.candidates} (fallback {self.fallback}) must be a "
                             f"non-empty subset of {_CANDIDATES}")
        if self.warmup < 0 or self.repeat < 1:
            raise ValueError(f"warmup ({self.warmup}) must be >= 0 and repeat ({self.repeat}) >= 1")

    @staticmethod
    def key(q: torch.Tensor, k: torch.Tensor, causal: bool, documents: bool = False) -> tuple:
        return (tuple(q.shape), k.shape[1], q.dtype, str(q.device), "documents" if documents else causal)

    def run(self, choice: str, q, k, v, causal: bool, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if doc_ids is not None:
            return self.backends.documents(choice, q, k, v, doc_ids)
        return self.backends(choice, q, k, v, causal)

    def can_time(self, q: torch.Tensor) -> bool:
        """Timing needs CUDA events; elsewhere SDPA's default runs untimed."""
        return q.is_cuda

    def choose(self, q, k, v, causal: bool, doc_ids: Optional[torch.Tensor] = None) -> Optional[str]:
        """The backend to run, ``"sdpa"`` for SDPA's own dispatch, or None where nothing was timed.
        With ``doc_ids`` only backends that take document masks are candidates (timed on this batch's
        layout once per shape)."""
        key = self.key(q, k, causal, doc_ids is not None)
        if torch.compiler.is_compiling():
            return self.traced_choices.get(key)
        if key in self.choices:
            return self.choices[key]
        if not self.can_time(q):
            return None
        if self._load(key, q, k, v, causal, doc_ids):
            return self.choices[key]
        timings, skipped = self._time_all(self.candidates, q, k, v, causal, doc_ids)
        if not timings:
            timings, more = self._time_all(tuple(n for n in self.fallback if n not in self.candidates), q, k, v, causal,
                                           doc_ids)
            skipped.update(more)
        best = min(timings, key=timings.get) if timings else "sdpa"
        traced = [n for n in timings if n in AttentionBackends.TRACEABLE]
        self.choices[key] = best
        self.traced_choices[key] = min(traced, key=timings.get) if traced else "sdpa"
        self.timings[key], self.skipped[key] = timings, skipped
        log.info("attention='auto' for q%s kv_heads=%d %s %s: %s (fwd+bwd ms: %s)%s", tuple(q.shape),
                 k.shape[1], q.dtype, "document-causal" if doc_ids is not None else f"causal={causal}", best,
                 ", ".join(f"{n}={t:.3f}" for n, t in timings.items()) or "none ran",
                 "" if self.traced_choices[key] == best else f"; under torch.compile: {self.traced_choices[key]}")
        for name, reason in skipped.items():
            log.debug("attention candidate %s unavailable for %s: %s", name, key, reason)
        if self.cache is not None:
            self.cache.store("attention_auto", self.device_name(q), self._disk_key(q, k, causal, doc_ids),
                             {"choice": best, "traced": self.traced_choices[key], "timings": timings})
        return best

    def device_name(self, q: torch.Tensor) -> str:
        return torch.cuda.get_device_name(q.device)

    def _disk_key(self, q, k, causal: bool, doc_ids: Optional[torch.Tensor]) -> str:
        """What a stored choice depends on besides the GPU and the software versions (the file's name):
        the shape, kv heads, dtype, masking, the candidates asked for and the flash-attention packages
        installed now (one installed later is timed)."""
        installed = [n for n in LIBRARY_BACKENDS if missing_requirement(n) is None]
        masking = "documents" if doc_ids is not None else f"causal={causal}"
        return (f"q{tuple(q.shape)}|kv{k.shape[1]}|{q.dtype}|{masking}|candidates={','.join(self.candidates)}"
                f"|fallback={','.join(self.fallback)}|installed={','.join(installed)}")

    def _load(self, key: tuple, q, k, v, causal: bool, doc_ids: Optional[torch.Tensor]) -> bool:
        """Take the choice an earlier run stored for this key, if it can still run here; whether it did."""
        if self.cache is None:
            return False
        entry = self.cache.load("attention_auto", self.device_name(q), self._disk_key(q, k, causal, doc_ids))
        if not isinstance(entry, dict):
            return False
        best, traced = entry.get("choice"), entry.get("traced")
        extra = () if doc_ids is None else (doc_ids,)
        runnable = (best == "sdpa" or (best in self.candidates + self.fallback
                                       and self.backends.unsupported(best, q, k, v, *extra) is None))
        if not runnable or traced not in AttentionBackends.TRACEABLE + ("sdpa",):
            return False
        self.choices[key], self.traced_choices[key] = best, traced
        self.timings[key] = dict(entry.get("timings") or {})
        self.skipped[key] = {}
        log.info("attention='auto' for q%s kv_heads=%d %s: %s (timed by an earlier run, %s)", tuple(q.shape),
                 k.shape[1], q.dtype, best, self.cache.path("attention_auto", self.device_name(q)))
        return True

    def _time_all(self, names, q, k, v, causal: bool,
                  doc_ids: Optional[torch.Tensor] = None) -> tuple[dict[str, float], dict[str, str]]:
        timings, skipped = {}, {}
        extra = () if doc_ids is None else (doc_ids,)  # subclasses written for causal attention take no doc_ids
        for name in names:
            reason = self.backends.unsupported(name, q, k, v, *extra)
            if reason is not None:
                skipped[name] = reason
                continue
            try:
                timings[name] = self._time(name, q, k, v, causal, *extra)
            except Exception as err:  # the library refused the shape / GPU
                skipped[name] = f"{type(err).__name__}: {err}"
        return timings, skipped

    def _time(self, name: str, q, k, v, causal: bool, doc_ids: Optional[torch.Tensor] = None) -> float:
        """Milliseconds of one forward + backward of backend ``name`` on tensors shaped like q, k, v."""
        qs, ks, vs = (torch.randn_like(t).requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad():
            out = self.run(name, qs, ks, vs, causal, doc_ids)
            grad = torch.randn_like(out)

            def step():
                o = self.run(name, qs, ks, vs, causal, doc_ids)
                torch.autograd.grad(o, (qs, ks, vs), grad)

            for _ in range(self.warmup):
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(q.device)
            start.record()
            for _ in range(self.repeat):
                step()
            end.record()
            end.synchronize()
        return start.elapsed_time(end) / self.repeat


@dataclass(kw_only=True)
class KernelDispatcher:
    """The kernels behind ``models.gpt.ops`` plus the attention selector's cache."""

    attention_selector: AttentionSelector = field(default_factory=AttentionSelector)
    #: inside a ``torch.compile`` trace, norms and activations are left to Inductor ("inductor"), which
    #: fuses them with the neighbouring residual adds and casts; our kernels are opaque custom ops there,
    #: which it cannot fuse across, and each costs a dispatch on the host. "triton" keeps ours inside
    #: compiled graphs too.
    elementwise_under_compile: str = "inductor"
    _rerouted: set = field(default_factory=set, init=False, repr=False)  # (impl, device) already logged

    def __post_init__(self) -> None:
        if self.elementwise_under_compile not in ("inductor", "triton"):
            raise ValueError(f"elementwise_under_compile={self.elementwise_under_compile!r}: "
                             "expected 'inductor' or 'triton'")

    def _leave_to_inductor(self) -> bool:
        return self.elementwise_under_compile == "inductor" and torch.compiler.is_compiling()

    def attention(self, q, k, v, *, causal: bool = True, impl: str = "triton",
                  doc_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``impl`` one of ``ATTENTION_IMPLS``: a backend by name where it can take the tensors, the
        selector's choice for "auto"; None for SDPA's own dispatch (the reference path).
        With ``doc_ids`` (B, T): document-causal attention, never None (see the module docstring)."""
        if doc_ids is not None:
            return self._documents(q, k, v, impl, doc_ids)
        if _is_dtensor(q, k, v) or impl == "sdpa":
            return None
        selector = self.attention_selector
        if impl == "auto":
            choice = selector.choose(q, k, v, causal)
            if choice is None or choice == "sdpa":
                return None
            return selector.run(choice, q, k, v, causal)
        if impl not in _CANDIDATES:
            raise ValueError(f"attention impl {impl!r} is not one of {ATTENTION_IMPLS}")
        if q.device.type == "cpu" and impl != "triton":  # SDPA (FlexAttention has no CPU backward)
            return None
        if selector.backends.unsupported(impl, q, k, v) is not None:
            return None
        return selector.run(impl, q, k, v, causal)

    def _documents(self, q, k, v, impl: str, doc_ids: torch.Tensor) -> torch.Tensor:
        selector = self.attention_selector
        backends = selector.backends
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl {impl!r} is not one of {ATTENTION_IMPLS}")
        if _is_dtensor(q, k, v) or impl == "sdpa":
            return backends.documents("sdpa", q, k, v, doc_ids)
        if impl == "auto":
            choice = selector.choose(q, k, v, True, doc_ids)
            return backends.documents(choice or "sdpa", q, k, v, doc_ids)
        runs_here = q.device.type != "cpu" or impl == "triton"  # FlexAttention has no CPU backward
        if runs_here and backends.unsupported(impl, q, k, v, doc_ids) is None:
            return backends.documents(impl, q, k, v, doc_ids)
        instead = "flex" if q.is_cuda and backends.unsupported("flex", q, k, v, doc_ids) is None else "sdpa"
        if (impl, q.device.type) not in self._rerouted:
            self._rerouted.add((impl, q.device.type))
            reason = backends.unsupported(impl, q, k, v, doc_ids) or f"{impl} is not used on {q.device.type}"
            log.info("attention=%r cannot run packed documents here (%s): %s runs them with a document mask",
                     impl, reason, "FlexAttention" if instead == "flex" else "SDPA")
        return backends.documents(instead, q, k, v, doc_ids)

    def norm(self, x, weight, bias, *, kind: str, eps: float) -> Optional[torch.Tensor]:
        if self._leave_to_inductor() or _is_dtensor(x, weight, bias):
            return None
        try:
            from lightning_perf.kernels.ops._row_norm import apply_norm, norm_supported
        except ImportError:
            return None
        if kind not in ("layernorm", "rmsnorm") or not norm_supported(x, weight, bias):
            return None
        if kind == "rmsnorm" and bias is not None:
            return None
        return apply_norm(x, weight, bias, None, float(eps), kind == "rmsnorm")

    def rope(self, x, cos, sin) -> Optional[torch.Tensor]:
        if self._leave_to_inductor() or _is_dtensor(x, cos, sin):
            return None
        try:
            from lightning_perf.kernels.ops.rotary import rotary_embedding, rotary_supported
        except ImportError:
            return None
        return rotary_embedding(x, cos, sin) if rotary_supported(x, cos, sin) else None

    def mlp_activation(self, a, b, *, kind: str) -> Optional[torch.Tensor]:
        if self._leave_to_inductor() or _is_dtensor(a, b):
            return None
        try:
            from lightning_perf.kernels.ops import gelu, swiglu
        except ImportError:
            return None
        if kind == "swiglu":
            return swiglu.swiglu(a, b) if b is not None and swiglu.swiglu_supported(a, b) else None
        if kind == "gelu":
            if not gelu.gelu_supported(a, b):
                return None
            return gelu.gelu_tanh(a) if b is None else gelu.gelu_tanh_mul(a, b)
        return None

    def lm_loss(self, x, head_weight, targets, *, ignore_index: int = -100) -> Optional[torch.Tensor]:
        if _is_dtensor(x, head_weight, targets):
            return None
        try:
            from lightning_perf.kernels.ops import fused_linear_cross_entropy as flce
        except ImportError:
            return None
        if not flce.fused_linear_cross_entropy_supported(x, head_weight, targets):
            return None
        return flce.fused_linear_cross_entropy(x, head_weight, targets, ignore_index=ignore_index)


class _Default:
    # built at import (cheap: no Triton), so a compiled model never constructs it inside a traced frame
    dispatcher: KernelDispatcher = KernelDispatcher()


def default_dispatcher() -> KernelDispatcher:
    """The per-process dispatcher used by ``models.gpt.ops`` (holds the attention choices)."""
    return _Default.dispatcher


def set_default_dispatcher(dispatcher: KernelDispatcher) -> None:
    _Default.dispatcher = dispatcher


def _forward(method: str) -> Callable:
    def call(*args, **kwargs):
        return getattr(default_dispatcher(), method)(*args, **kwargs)

    call.__name__ = method
    call.__doc__ = f"``default_dispatcher().{method}(...)``: the kernel's result, or None for the reference path."
    return call


attention = _forward("attention")
rope = _forward("rope")
norm = _forward("norm")
mlp_activation = _forward("mlp_activation")
lm_loss = _forward("lm_loss")
