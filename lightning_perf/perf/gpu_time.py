"""Where a step's GPU time goes: kernel time per category from a profiler's Chrome trace.

Categories come from kernel names as CUDA reports them (cuBLAS ``nvjet``/``gemm``, cuDNN and
flash attention, NCCL, Inductor's generated ``triton_*`` kernels, the pack's own Triton kernels,
the optimizer's multi-tensor kernels, copies and casts); the first matching rule wins. Idle is the
part of the traced window in which no kernel runs (host overhead, waits, pipeline bubbles).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_perf.perf.intervals import total, union

__all__ = ["GPU_TIME_RULES", "gpu_time_category", "gpu_time_breakdown"]

GPU_TIME_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "symm_mem", "multimem", "cross_device")),
    ("pack_elementwise", ("_norm_fwd_kernel", "_norm_bwd_kernel", "_swiglu_", "_gelu_fwd", "_gelu_bwd",
                          "_rotary_kernel")),
    ("pack_loss", ("_ce_rows_kernel",)),
    ("attention", ("flash", "fmha", "sdpa", "cudnn", "attn", "_fwd_kernel", "_fwd_tma", "_bwd_dq", "_bwd_dkdv",
                   "_bwd_fused", "_bwd_delta")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "triton_tem_")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("inductor", ("triton_",)),
    ("copy_cast", ("elementwise", "copy", "memcpy", "memset", "cat", "fill", "reduce_kernel")),
)


def gpu_time_category(name: str) -> str:
    """The category of a GPU kernel (or memcpy / memset) by its name; ``"other"`` if no rule matches."""
    low = name.lower()
    for category, keys in GPU_TIME_RULES:
        if any(k in low for k in keys):
            return category
    return "other"


def gpu_time_breakdown(events: Iterable[dict[str, Any]], *, steps: int = 1, top: int = 25) -> dict[str, Any]:
    """Milliseconds per step by category, the busy and idle time of the window, and the top kernels.

    ``events`` are Chrome-trace events (``ts``/``dur`` in microseconds) of ``steps`` whole steps;
    only GPU events count (``cat`` kernel, gpu_memcpy, gpu_memset). Communication kernels count as
    busy: idle means no kernel of any kind.
    """
    kernels = [e for e in events
               if e.get("ph") == "X" and "dur" in e and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels or steps < 1:
        return {}
    per: dict[str, float] = {}
    names: dict[str, float] = {}
    for e in kernels:
        ms = e["dur"] / 1e3 / steps
        cat = gpu_time_category(e["name"])
        per[cat] = per.get(cat, 0.0) + ms
        key = e["name"][:100]
        names[key] = names.get(key, 0.0) + ms
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    window = (end - start) / 1e3 / steps
    busy = total(union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])) / 1e3 / steps
    return {
        "window_ms_per_step": window,
        "busy_ms_per_step": busy,
        "idle_ms_per_step": window - busy,
        "ms_per_step": dict(sorted(per.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms_per_step": dict(sorted(names.items(), key=lambda kv: -kv[1])[:top]),
    }
