"""Delayed FP8 scaling state: the amax history a layer keeps, the scales taken from it, its updates.

A layer keeps amax_history (3, H) fp32, one row per operand (x, W, dL/dy), newest amax first, zeros
where nothing was recorded. The step's scale is

    s_t = fmax / max(amax_{t-1}, ..., amax_{t-H})                    (H = AMAX_HISTORY by default)

and the kernel that casts with it also folds max |t| into one word (``cast_transpose_amax_fp8`` in
``fp8_casts``), which is pushed onto the row. So each operand is read once, not twice (amax, then
cast). An empty row (the first call, or after a load) falls back to the current amax; that pass is
launched every call but reads nothing once the row holds a value, so eager and compiled graphs take
one path whatever the history holds (no host sync, no recompile). An operand that grows past its
recorded maximum saturates at +-fmax for that step, and the next step's scale covers it. A NaN or inf
amax is recorded as 0 (nothing seen).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import wrap_triton

from lightning_perf.kernels.ops.fp8_casts import _ABSMAX_BLOCK, _PLAIN, _TINY, _absmax_grid, _absmax_kernel, _absmax_ok

__all__ = ["AMAX_HISTORY", "new_amax_history", "push_amax", "history_scale"]

AMAX_HISTORY = 16  # delayed scaling: steps of amax each scale is taken over


def new_amax_history(length: int = AMAX_HISTORY, device: Optional[torch.device] = None) -> torch.Tensor:
    """An empty history for :func:`fp8_linear`'s ``amax_history``: zeros (3, ``length``) fp32."""
    if length < 1:
        raise ValueError(f"an amax history needs at least one entry, got length={length}")
    return torch.zeros(3, length, dtype=torch.float32, device=device)


@torch.library.triton_op("lightning_perf::fp8_absmax_unless", mutates_args=())
def _absmax_unless_op(t: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    if not _absmax_ok(t):
        return torch.where(prior > 0, torch.zeros_like(prior), t.detach().abs().amax().float())
    out = t.new_zeros((), dtype=torch.float32)
    wrap_triton(_absmax_kernel)[(_absmax_grid(t.numel(), t.device),)](t, t, t, out, prior, t.numel(), 1,
                                                                      BLOCK=_ABSMAX_BLOCK, UNLESS_PRIOR=True,
                                                                      **_PLAIN, num_warps=8)
    return out


@torch.library.triton_op("lightning_perf::fp8_amax_push", mutates_args=("history",))
def _amax_push_op(history: torch.Tensor, amax: torch.Tensor) -> None:
    # torch ops only: torch.compile traces them into its own kernels (a mutation it accepts in the
    # forward and in the backward graph); a non-finite amax is recorded as "nothing seen"
    new = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax)).to(history.dtype).reshape(1)
    history.copy_(torch.cat([new, history[:-1]]))


def push_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Record ``amax`` (0-dim) as the newest entry of ``history`` (H,), in place; the oldest drops out.
    A NaN or inf amax is recorded as 0 (nothing seen), so one bad step does not spoil the next H."""
    _amax_push_op(history, amax)


def history_scale(t: torch.Tensor, history: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fmax / max(history)`` as a 0-dim fp32 tensor; ``fmax / amax(|t|)`` where ``history`` is all zeros."""
    prior = history.amax().float()
    return _scale_over(prior, _absmax_unless_op(t.detach(), prior), dtype)


def _scale_over(prior: torch.Tensor, current: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fmax / max(prior, current)`` as a 0-dim fp32 tensor, in float64 first (``current`` is 0 unless
    ``prior`` is: an "unless prior" amax)."""
    amax = torch.maximum(prior, current)
    return (torch.finfo(dtype).max / torch.clamp(amax.double(), min=_TINY)).float()
