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

__all__ = ["GPU_TIME_RULES", "gpu_time_category", "gpu_time_breakdown", "kernel_label"]

GPU_TIME_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "symm_mem", "multimem", "cross_device")),
    ("pack_elementwise", ("_norm_fwd_kernel", "_norm_bwd_kernel", "_swiglu_", "_gelu_fwd", "_gelu_bwd",
                          "_rotary_kernel", "_cast_transpose_kernel")),
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


_NOISE = ("void ", "at::native::", "(anonymous namespace)::", "detail::", "c10::", "std::")


def kernel_label(name: str, width: int = 120) -> str:
    """A kernel's name shortened for a table: C++ namespaces and the argument list dropped, so the
    part that tells kernels apart (e.g. ``FusedAdamMathFunctor`` inside ``multi_tensor_apply_kernel<...>``)
    survives the cut to ``width`` characters."""
    for noise in _NOISE:
        name = name.replace(noise, "")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the argument list: the first "(" outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    return name[:cut].strip()[:width]


def gpu_time_breakdown(events: Iterable[dict[str, Any]], *, steps: int = 1, top: int = 25) -> dict[str, Any]:
    """Milliseconds per step by category, the busy and idle time of the window, and the top kernels
    (by :func:`kernel_label`, with their milliseconds and launches per step).

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
    launches: dict[str, float] = {}
    for e in kernels:
        ms = e["dur"] / 1e3 / steps
        cat = gpu_time_category(e["name"])
        per[cat] = per.get(cat, 0.0) + ms
        key = kernel_label(e["name"])
        names[key] = names.get(key, 0.0) + ms
        launches[key] = launches.get(key, 0) + 1 / steps
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
        "top_kernels_launches_per_step": {k: launches[k] for k, _ in sorted(names.items(), key=lambda kv: -kv[1])[:top]},
    }
