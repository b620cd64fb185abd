"""Fused LM head + cross-entropy: the loss and its gradients without the full (tokens x vocab) logits.

For tokens x_i (rows of x, N x d), head W (V x d), targets t_i:
    z_i   = W x_i                         (logits, one chunk of rows at a time)
    lse_i = log sum_j exp(z_ij)
    l_i   = lse_i - z_{i, t_i} + z_loss * lse_i^2          (0 where t_i == ignore_index)
    dz_ij = s_i * (softmax_ij * (1 + 2 z_loss lse_i) - [j == t_i])
with s_i = 1 / n_valid for ``reduction="mean"``, 1 for ``"sum"``. Then dx = dz W and
dW = sum over chunks of dz^T x. The forward pass runs the head matmul per chunk of rows,
a Triton kernel turns the chunk's logits into losses and overwrites them with dz in place,
and two matmuls give the chunk's dx and its share of dW; the backward only scales the saved
gradients by the incoming scalar. Peak extra memory is one (chunk x V) logits buffer plus dx
and dW, against the (N x V) logits (and their fp32 copy) of the plain path.

Matmuls run in the autocast dtype when autocast is on (bf16 on the GPU), else in x's dtype;
softmax statistics are fp32. dW is accumulated across chunks in the matmul dtype (cuBLAS adds
in fp32 within a chunk). ``reduction="none"`` returns per-token losses and recomputes the
chunks in the backward (its gradient scales are only known then).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_perf.kernels._utils import can_launch, launch_device, next_power_of_2, cdiv
from lightning_perf.kernels.autotune import default_tuner, shape_bucket

__all__ = [
    "fused_linear_cross_entropy",
    "linear_cross_entropy_reference",
    "FusedLinearCrossEntropyFunction",
    "fused_linear_cross_entropy_supported",
]

_REDUCTIONS = ("mean", "sum", "none")
_CHUNK_BYTES = 256 * 2**20  # one chunk of logits in the matmul dtype...
# ...but at least this many rows: each chunk reads and writes all of dW (V x d) once in its addmm, so
# fewer, longer chunks amortise it
_MIN_CHUNK_ROWS = 2048
_TUNE_ROWS = 512  # rows of logits the tuner times the loss/gradient kernel on (a copy: the kernel works in place)


@triton.jit
def _ce_rows_kernel(LOGITS, stride_row, TARGET, LOSS, SCALE, R, V, ignore_index, z_loss,
                    COMPUTE_GRAD: tl.constexpr, SCALE_PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    ptrs = LOGITS + rows.to(tl.int64)[:, None] * stride_row
    target = tl.load(TARGET + rows, mask=row_mask, other=ignore_index)
    valid = (target != ignore_index) & row_mask
    # pass 1: online max and sum of exponentials per row
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (offs[None, :] < V)
        z = tl.load(ptrs + offs[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past R: no NaN from -inf - -inf
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe[:, None]), 1)
        m = m_new
    lse = tl.where(row_mask, m + tl.log(tl.where(row_mask, s, 1.0)), 0.0)
    z_t = tl.load(ptrs + target[:, None], mask=valid[:, None], other=0.0).to(tl.float32)
    z_t = tl.sum(z_t, 1)
    loss = tl.where(valid, lse - z_t + z_loss * lse * lse, 0.0)
    tl.store(LOSS + rows, loss, mask=row_mask)
    if COMPUTE_GRAD:
        # pass 2: overwrite the logits with d loss / d logits
        if SCALE_PER_ROW:
            scale = tl.load(SCALE + rows, mask=row_mask, other=0.0).to(tl.float32)
        else:
            scale = tl.load(SCALE + rows * 0).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        zfac = 1.0 + 2.0 * z_loss * lse
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = row_mask[:, None] & (offs[None, :] < V)
            z = tl.load(ptrs + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(z - lse[:, None]) * zfac[:, None]
            g = tl.where(offs[None, :] == target[:, None], g - 1.0, g) * scale[:, None]
            tl.store(ptrs + offs[None, :], g.to(LOGITS.dtype.element_ty), mask=mask)


_CE_CONFIGS_GPU = [dict(BLOCK_R=1, BLOCK_V=b, num_warps=w) for b in (2048, 4096, 8192) for w in (8, 16)]


def _ce_rows(logits, target, loss, scale, ignore_index: int, z_loss: float, compute_grad: bool,
             per_row: bool) -> None:
    C, V = logits.shape
    if logits.is_cuda:
        configs = _CE_CONFIGS_GPU
    else:  # interpreter: a handful of programs
        configs = [dict(BLOCK_R=min(16, max(1, next_power_of_2(C) // 4)),
                        BLOCK_V=min(256 if V <= 1024 else 4096, next_power_of_2(V)), num_warps=4)]

    def launch(cfg, z, t, out, sc, rows):
        _ce_rows_kernel[(cdiv(rows, cfg["BLOCK_R"]),)](
            z, z.stride(0), t, out, sc, rows, V, ignore_index, z_loss,
            COMPUTE_GRAD=compute_grad, SCALE_PER_ROW=per_row, **cfg)

    scratch: list = []

    def tune(cfg):
        # with compute_grad the kernel overwrites the logits with their gradient, and the tuner launches
        # every config several times: it times on a copy of the first rows (taken before any launch), never
        # on the chunk itself, or the loss and gradients of a key's first call would come from gradients
        if compute_grad and not scratch:
            rows = min(C, _TUNE_ROWS)
            scratch.extend((logits[:rows].clone(), target[:rows], torch.empty_like(loss[:rows]),
                            scale[:rows] if per_row else scale, rows))
        if compute_grad:
            launch(cfg, *scratch)
        else:
            launch(cfg, logits, target, loss, scale, C)

    key = (shape_bucket(V), logits.dtype, compute_grad)
    launch(default_tuner().pick("cross_entropy_rows", key, configs, tune, logits.device),
           logits, target, loss, scale, C)


def _chunk_rows(N: int, V: int, itemsize: int) -> int:
    rows = max(1, _CHUNK_BYTES // max(1, V * itemsize))
    rows = max(1 << (rows.bit_length() - 1), _MIN_CHUNK_ROWS)  # a power of two: fewer matmul shapes
    return max(1, min(N, rows))


def _chunked(x, weight, target, ignore_index, z_loss, compute_dtype, row_scale, need_dx, need_dw,
             chunk_rows: Optional[int] = None):
    """Per-token losses (N,) fp32 and, when a scale is given, dx (N, d) and dW (V, d).

    ``row_scale``: None (loss only), a 1-element tensor (same scale for every row) or (N,) per row.
    """
    N, d = x.shape
    V = weight.shape[0]
    losses = torch.empty(N, dtype=torch.float32, device=x.device)
    compute_grad = row_scale is not None
    per_row = compute_grad and row_scale.numel() == N and N != 1
    scale = row_scale.float().contiguous() if compute_grad else losses
    w = weight.to(compute_dtype)
    dx = torch.empty((N, d), dtype=x.dtype, device=x.device) if compute_grad and need_dx else None
    dw = torch.zeros((V, d), dtype=compute_dtype, device=x.device) if compute_grad and need_dw else None
    C = chunk_rows or _chunk_rows(N, V, torch.tensor([], dtype=compute_dtype).element_size())
    buf = torch.empty((min(C, N), V), dtype=compute_dtype, device=x.device)
    for s in range(0, N, C):
        e = min(s + C, N)
        xc = x[s:e].to(compute_dtype)
        logits = buf[: e - s]
        torch.mm(xc, w.t(), out=logits)
        _ce_rows(logits, target[s:e], losses[s:e], scale[s:e] if per_row else scale, ignore_index, z_loss,
                 compute_grad, per_row)
        if dx is not None:
            if dx.dtype == compute_dtype:
                torch.mm(logits, w, out=dx[s:e])
            else:
                dx[s:e] = torch.mm(logits, w)
        if dw is not None:
            dw.addmm_(logits.t(), xc)
    return losses, dx, dw


def _flatten(x, target):
    return x.reshape(-1, x.shape[-1]), target.reshape(-1).contiguous()


def flce_forward(x, weight, target, ignore_index: int, reduction: str, z_loss: float, compute_dtype,
                 need_dw: bool):
    """(loss, dx, dW) for mean / sum (gradients of the loss itself); (losses, empty, empty) for none."""
    x2, t = _flatten(x, target)
    with torch.autocast(x.device.type, enabled=False):
        if reduction == "none":
            losses, _, _ = _chunked(x2, weight, t, ignore_index, z_loss, compute_dtype, None, False, False)
            empty = x.new_empty(0)
            return losses.view(target.shape), empty, empty
        if reduction == "mean":
            scale = 1.0 / (t != ignore_index).sum().float().reshape(1)
        else:
            scale = torch.ones(1, dtype=torch.float32, device=x.device)
        losses, dx, dw = _chunked(x2, weight, t, ignore_index, z_loss, compute_dtype, scale, True, need_dw)
        loss = losses.sum() * scale[0] if reduction == "mean" else losses.sum()
        dw = dw.to(weight.dtype) if dw is not None else x.new_empty(0)
        return loss, dx.view(x.shape), dw


def flce_backward_none(x, weight, target, dlosses, ignore_index: int, z_loss: float, compute_dtype, need_dw: bool):
    """Gradients for ``reduction="none"``: the chunks again, each row scaled by its incoming gradient."""
    x2, t = _flatten(x, target)
    with torch.autocast(x.device.type, enabled=False):
        _, dx, dw = _chunked(x2, weight, t, ignore_index, z_loss, compute_dtype, dlosses.reshape(-1), True, need_dw)
    dw = dw.to(weight.dtype) if dw is not None else x.new_empty(0)
    return dx.view(x.shape), dw


# ---- torch.compile: custom ops -----------------------------------------------------------------


@torch.library.custom_op("lightning_perf::fused_linear_cross_entropy", mutates_args=())
def _flce_op(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
             z_loss: float, compute_dtype: torch.dtype,
             need_dw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flce_forward(x, weight, target, ignore_index, reduction, z_loss, compute_dtype, need_dw)


@_flce_op.register_fake
def _(x, weight, target, ignore_index, reduction, z_loss, compute_dtype, need_dw):
    if reduction == "none":
        return x.new_empty(target.shape, dtype=torch.float32), x.new_empty(0), x.new_empty(0)
    dw = torch.empty_like(weight) if need_dw else x.new_empty(0)
    return x.new_empty((), dtype=torch.float32), torch.empty_like(x, memory_format=torch.contiguous_format), dw


@torch.library.custom_op("lightning_perf::fused_linear_cross_entropy_bwd", mutates_args=())
def _flce_bwd_op(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, dlosses: torch.Tensor,
                 ignore_index: int, z_loss: float, compute_dtype: torch.dtype,
                 need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return flce_backward_none(x, weight, target, dlosses, ignore_index, z_loss, compute_dtype, need_dw)


@_flce_bwd_op.register_fake
def _(x, weight, target, dlosses, ignore_index, z_loss, compute_dtype, need_dw):
    dw = torch.empty_like(weight) if need_dw else x.new_empty(0)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dw


def _setup(ctx, inputs, output):
    x, weight, target, ignore_index, reduction, z_loss, compute_dtype, need_dw = inputs
    ctx.args = (ignore_index, reduction, z_loss, compute_dtype, need_dw)
    if reduction == "none":
        ctx.save_for_backward(x, weight, target)
    else:
        _, dx, dw = output
        ctx.save_for_backward(dx, dw)


def _backward(ctx, dloss, _ddx, _ddw):
    ignore_index, reduction, z_loss, compute_dtype, need_dw = ctx.args
    if reduction == "none":
        x, weight, target = ctx.saved_tensors
        dx, dw = _flce_bwd_op(x, weight, target, dloss, ignore_index, z_loss, compute_dtype, need_dw)
    else:
        dx, dw = ctx.saved_tensors
        dx, dw = dx * dloss.to(dx.dtype), dw * dloss.to(dw.dtype)
    return dx, (dw if need_dw else None), None, None, None, None, None, None


_flce_op.register_autograd(_backward, setup_context=_setup)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Eager path: gradients computed in the forward, scaled by the incoming gradient in the backward."""

    @staticmethod
    def forward(ctx, x, weight, target, ignore_index: int, reduction: str, z_loss: float, compute_dtype):
        need_dw = weight.requires_grad
        loss, dx, dw = flce_forward(x, weight, target, ignore_index, reduction, z_loss, compute_dtype, need_dw)
        ctx.args = (ignore_index, reduction, z_loss, compute_dtype, need_dw)
        if reduction == "none":
            ctx.save_for_backward(x, weight, target)
        else:
            ctx.save_for_backward(dx, dw)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        ignore_index, reduction, z_loss, compute_dtype, need_dw = ctx.args
        if reduction == "none":
            x, weight, target = ctx.saved_tensors
            dx, dw = flce_backward_none(x, weight, target, dloss, ignore_index, z_loss, compute_dtype, need_dw)
        else:
            dx, dw = ctx.saved_tensors
            # in place: these buffers are ours alone; a scale of exactly 1 still costs one pass
            dx, dw = dx.mul_(dloss.to(dx.dtype)), (dw.mul_(dloss.to(dw.dtype)) if need_dw else None)
        return dx, (dw if need_dw else None), None, None, None, None, None


# ---- reference and public function -------------------------------------------------------------


def linear_cross_entropy_reference(x, weight, target, ignore_index: int = -100, reduction: str = "mean",
                                   z_loss: float = 0.0) -> torch.Tensor:
    """Full fp32 logits, cross-entropy (+ z_loss * lse^2 per valid token), reduced like ``F.cross_entropy``."""
    logits = torch.nn.functional.linear(x, weight).float().reshape(-1, weight.shape[0])
    t = target.reshape(-1)
    ce = torch.nn.functional.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none")
    if z_loss:
        ce = ce + z_loss * torch.logsumexp(logits, -1).pow(2) * (t != ignore_index)
    if reduction == "none":
        return ce.view(target.shape)
    if reduction == "sum":
        return ce.sum()
    return ce.sum() / (t != ignore_index).sum()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


_CE_ROWS_DEVICE = launch_device(_ce_rows_kernel)  # decided at import: see launch_device


def fused_linear_cross_entropy_supported(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> bool:
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if x.is_cuda else (torch.float32, torch.float16)
    return (
        x.shape[-1] == weight.shape[-1] and weight.dim() == 2 and x.shape[:-1] == target.shape
        and x.dtype in dtypes and weight.dtype in dtypes and x.numel() > 0
        and not target.is_floating_point() and can_launch(_CE_ROWS_DEVICE, x, weight, target)
    )


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean",
                               z_loss: float = 0.0) -> torch.Tensor:
    """Cross-entropy of ``x @ weight.T`` against ``target`` without materialising the logits.

    x (..., d), weight (V, d), target (...) int. ``z_loss`` adds ``z_loss * logsumexp^2`` per token.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {_REDUCTIONS}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.shape[:-1] != target.shape:
        raise ValueError(f"expected x (..., d), weight (V, d), target (...): got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, target {tuple(target.shape)}")
    compute_dtype = _compute_dtype(x)
    if torch.compiler.is_compiling():
        return _flce_op(x, weight, target, int(ignore_index), reduction, float(z_loss), compute_dtype,
                        weight.requires_grad)[0]
    return FusedLinearCrossEntropyFunction.apply(x, weight, target, int(ignore_index), reduction, float(z_loss),
                                                 compute_dtype)
