"""Where the GPT's entry points (``models.gpt.ops``) meet the kernels.

Each function returns the kernel's result, or ``None`` to mean "use the PyTorch
reference path": Triton missing, a CPU tensor without the interpreter, or a
dtype / shape a kernel does not take. With ``impl="auto"`` attention is routed
by an :class:`AttentionSelector`, which times our Triton kernel and each SDPA
backend (cuDNN, flash, efficient) once per (shape, dtype, device, causal),
forward + backward, keeps the fastest and logs the choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from lightning_perf.kernels._utils import is_dtensor as _is_dtensor

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
]

log = logging.getLogger(__name__)

SDPA_BACKENDS = ("cudnn", "flash", "efficient")
_CANDIDATES = ("triton",) + SDPA_BACKENDS




def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def sdpa(q, k, v, causal: bool, backend: Optional[str] = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, GQA through ``enable_gqa``, optionally pinned to one backend."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend(backend)]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)


def _triton_attention(q, k, v, causal: bool) -> Optional[torch.Tensor]:
    try:
        from lightning_perf.kernels.ops.flash_attention import flash_attention, flash_attention_supported
    except ImportError:
        return None
    if not flash_attention_supported(q, k, v):
        return None
    return flash_attention(q, k, v, causal=causal)


@dataclass(kw_only=True)
class AttentionSelector:
    """Fastest attention per (shape, dtype, device, causal), timed once with CUDA events and cached.

    ``candidates`` are tried in order; one that raises (unsupported head dim, GQA, ...) is skipped.
    Under ``torch.compile`` tracing nothing is timed: a cached choice is used, else SDPA's default.
    """

    candidates: tuple[str, ...] = _CANDIDATES
    warmup: int = 2
    repeat: int = 10
    choices: dict[tuple, str] = field(default_factory=dict)
    timings: dict[tuple, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [c for c in self.candidates if c not in _CANDIDATES]
        if unknown or not self.candidates:
            raise ValueError(f"AttentionSelector candidates {self.candidates} must be a non-empty subset of "
                             f"{_CANDIDATES}")
        if self.warmup < 0 or self.repeat < 1:
            raise ValueError(f"warmup ({self.warmup}) must be >= 0 and repeat ({self.repeat}) >= 1")

    @staticmethod
    def key(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple:
        return (tuple(q.shape), k.shape[1], q.dtype, str(q.device), causal)

    def run(self, choice: str, q, k, v, causal: bool) -> Optional[torch.Tensor]:
        if choice == "triton":
            return _triton_attention(q, k, v, causal)
        return sdpa(q, k, v, causal, choice)

    def choose(self, q, k, v, causal: bool) -> Optional[str]:
        key = self.key(q, k, causal)
        if key in self.choices:
            return self.choices[key]
        if torch.compiler.is_compiling() or not q.is_cuda:
            return None
        timings = {}
        for name in self.candidates:
            try:
                timings[name] = self._time(name, q, k, v, causal)
            except Exception as err:  # unsupported by this backend / kernel
                log.debug("attention candidate %s unavailable for %s: %s", name, key, err)
        if not timings:
            self.choices[key] = "sdpa"
            return "sdpa"
        best = min(timings, key=timings.get)
        self.choices[key], self.timings[key] = best, timings
        log.info("attention='auto' for q%s kv_heads=%d %s causal=%s: %s (fwd+bwd ms: %s)", tuple(q.shape), k.shape[1],
                 q.dtype, causal, best, ", ".join(f"{n}={t:.3f}" for n, t in timings.items()))
        return best

    def _time(self, name: str, q, k, v, causal: bool) -> float:
        if name == "triton":
            from lightning_perf.kernels.ops.flash_attention import flash_attention_supported

            if not flash_attention_supported(q, k, v):
                raise ValueError("flash_attention does not take this shape / dtype")
        qs, ks, vs = (torch.randn_like(t).requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad():
            out = self.run(name, qs, ks, vs, causal)
            grad = torch.randn_like(out)

            def step():
                o = self.run(name, qs, ks, vs, causal)
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

    def __post_init__(self) -> None:
        if self.elementwise_under_compile not in ("inductor", "triton"):
            raise ValueError(f"elementwise_under_compile={self.elementwise_under_compile!r}: "
                             "expected 'inductor' or 'triton'")

    def _leave_to_inductor(self) -> bool:
        return self.elementwise_under_compile == "inductor" and torch.compiler.is_compiling()

    def attention(self, q, k, v, *, causal: bool = True, impl: str = "triton") -> Optional[torch.Tensor]:
        if _is_dtensor(q, k, v):
            return None
        if impl == "triton":
            return _triton_attention(q, k, v, causal)
        if impl == "auto":
            choice = self.attention_selector.choose(q, k, v, causal)
            if choice is None or choice == "sdpa":
                return None
            return self.attention_selector.run(choice, q, k, v, causal)
        return None

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
