"""The tensorwise FP8 matmul of a training step with the pack's Triton casts (``torch._scaled_mm``).

torchao's tensorwise ``Float8Linear`` (``kernels.torchao_fp8``) computes the same three matmuls, but
saves its bf16/fp32 operands and casts them to FP8 again in the backward; here the forward's FP8
copies (and the transposed one the weight gradient needs) are saved instead, so the backward neither
reads the operands in high precision again nor casts them twice (the gpt-1.3b FP8 recipe with either
path: benchmarks/RESULTS.md). ``kernels.torchao_fp8`` runs this path for weights that are plain
tensors when the layer runs (not DTensors, not FP8-gathered) and torchao's for everything else.

For y = x W^T (+ b), x (M, K), W (N, K), with per-tensor scales
    s_t = fmax / max(amax(|t|), tiny),   q(t) = cast_fp8(clamp(t * s_t, -fmax, fmax))
the three matmuls of a training step run on FP8 operands and accumulate in fp32:
    forward   y  = (q(x) q(W)^T) / (s_x s_W)                    x, W in e4m3 (fmax 448)
    backward  dx = (q(g) q(W)) / (s_g s_W)                      g = dL/dy in e5m2 (fmax 57344)
              dW = (q(g)^T q(x)) / (s_g s_x)
              db = sum over rows of g                          (fp32, exact)
e4m3 keeps precision for activations and weights, e5m2 keeps the range gradients need (the
"hybrid" format). By default scales are recomputed from the current tensor every call ("current"
scaling: each operand is read once for its amax, then again for its cast), so no state needs
checkpointing. The backward reuses the forward's FP8 copies of x and W: the activation saved for
backward is one byte per element instead of two.

Delayed scaling (``amax_history=``, what ``kernels.torchao_fp8``'s delayed layers pass) takes each
scale from the operand's recorded amaxes instead (``fp8_amax_history``),
    s_t = fmax / max(amax_{t-1}, ..., amax_{t-H})                    (H = 16 by default)
and the pass that casts t with s_t also reduces amax_t, which is recorded: one read per operand.
A row with nothing recorded yet (the first step) uses the current amax. An operand that grows past
its recorded maximum saturates at +-fmax for that step, and the next step's scale covers it.

Matmul operands must have both dimensions of each FP8 matrix divisible by 16 (the rows of x
become the inner dimension of dW); a call that breaks this, a device without FP8 tensor cores
(CUDA before compute capability 8.9) or a DTensor argument runs the plain ``F.linear``. Under current
scaling each amax is one streaming Triton pass (``absmax``, in eager mode and under ``torch.compile``);
x and g are then cast by ``cast_transpose_fp8``, which also writes the transposed copies the weight
gradient needs (both in ``fp8_casts``). Two delayed layers around a GELU fuse further:
``fp8_gelu_mlp``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lightning_perf.kernels.dtensor import is_dtensor
from lightning_perf.kernels.ops.fp8_amax_history import history_scale, push_amax
from lightning_perf.kernels.ops.fp8_casts import (
    E4M3,
    E5M2,
    _scale_of,
    cast_transpose_amax_fp8,
    cast_transpose_fp8,
    quantize_fp8,
)

__all__ = ["fp8_linear", "fp8_linear_reference", "fp8_linear_supported"]

_ALIGN = 16


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (the layout ``_scaled_mm`` needs for its second operand)."""
    return t.t().contiguous().t()


def _device_ok(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":  # get_device_properties: torch.compile folds it to a constant (no graph break)
        props = torch.cuda.get_device_properties(device)
        return (props.major, props.minor) >= (8, 9)
    return False


def fp8_linear_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` takes the FP8 path for these arguments (else it runs ``F.linear``)."""
    if is_dtensor(x, weight) or weight.dim() != 2 or x.dim() < 1:
        return False
    N, K = weight.shape
    M = x.numel() // max(1, x.shape[-1])
    return (x.shape[-1] == K and x.device == weight.device and _device_ok(x.device)
            and x.is_floating_point() and weight.is_floating_point()
            and K % _ALIGN == 0 and N % _ALIGN == 0 and M % _ALIGN == 0 and M > 0)


def _weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, inverse scale)."""
    return quantize_fp8(weight, E4M3)


class _Float8Matmul(torch.autograd.Function):
    """x (M, K) @ W (N, K)^T on FP8 operands; see the module docstring for the maths.

    ``history`` None: current scaling (each operand's amax, then its cast). ``history`` (3, H): delayed
    scaling from its rows (x, W, dL/dy; see :func:`history_scale`), each operand cast by one pass that
    also yields its amax. The forward returns (y, amax(|x|), amax(|W|)) then, for the caller to record
    (the dL/dy row is recorded here, in the backward, when ``record``); the weight is cast with its
    transpose, which the input-gradient matmul takes as it is.
    """

    @staticmethod
    def forward(ctx, x, weight, history, record, out_dtype, fast_accum):
        x = x.contiguous()
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.history = history  # not saved for backward: its rows change in place after this forward
        ctx.record = record
        if history is None:
            x_scale = _scale_of(x, E4M3)
            xq, xq_t = cast_transpose_fp8(x, x_scale, E4M3)  # xq_t (K, M): the wgrad operand
            wq, w_inv = _weight_fp8(weight)
            x_inv = x_scale.reciprocal()
            y = torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype,
                                 use_fast_accum=fast_accum)
            ctx.save_for_backward(xq_t, x_inv, wq, w_inv)
            return y
        x_scale = history_scale(x, history[0], E4M3)
        xq, xq_t, x_amax = cast_transpose_amax_fp8(x, x_scale, E4M3)
        w_scale = history_scale(weight, history[1], E4M3)
        wq, wq_t, w_amax = cast_transpose_amax_fp8(weight.detach(), w_scale, E4M3)
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
        ctx.save_for_backward(xq_t, x_inv, wq_t, w_inv)
        ctx.mark_non_differentiable(x_amax, w_amax)
        return y, x_amax, w_amax

    @staticmethod
    def backward(ctx, grad, *amax_grads):
        xq_t, x_inv, w_saved, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        history = ctx.history
        grad = grad.contiguous()
        if history is None:
            g_scale = _scale_of(grad, E5M2)
            gq, gq_t = cast_transpose_fp8(grad, g_scale, E5M2)
            w_col = _col_major(w_saved)
        else:
            g_scale = history_scale(grad, history[2], E5M2)
            gq, gq_t, g_amax = cast_transpose_amax_fp8(grad, g_scale, E5M2)
            if ctx.record:
                push_amax(history[2], g_amax)
            w_col = w_saved.t()  # q(W)^T (K, N) row-major: q(W) column-major
        g_inv = g_scale.reciprocal()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch._scaled_mm(gq, w_col, scale_a=g_inv, scale_b=w_inv, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            # q(g)^T (N, M) row-major times q(x) (M, K) column-major (= xq_t viewed transposed)
            dw = torch._scaled_mm(gq_t, xq_t.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=w_dtype)
        return dx, dw, None, None, None, None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               fast_accum: bool = True, amax_history: Optional[torch.Tensor] = None,
               record: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and both gradient matmuls in FP8.

    x (..., K), weight (N, K), bias (N,) or None. The output dtype is the autocast dtype when
    autocast is on, else x's. Falls back to ``F.linear`` where :func:`fp8_linear_supported` is False.
    ``fast_accum``: the forward matmul accumulates in the tensor cores' native FP8 precision, without
    cuBLAS's periodic promotion to fp32 (Hopper; faster); the gradient matmuls always promote.

    ``amax_history``: delayed scaling. A (3, H) fp32 tensor, zeros at first, whose rows hold the last
    H amaxes of x, of the weight and of dL/dy, newest first; each scale is ``fmax / max(row)`` (the
    current amax while a row is all zeros), and each cast records its operand's amax in its row, in
    place (x and W in the forward, dL/dy in the backward; nothing when ``record`` is False). Values
    beyond the range the history scale allows saturate at the FP8 maximum.
    """
    if not fp8_linear_supported(x, weight):
        return F.linear(x, weight, bias)
    out_dtype = _out_dtype(x)
    lead = x.shape[:-1]
    with torch.autocast(x.device.type, enabled=False):
        if amax_history is None:
            y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, None, False, out_dtype, bool(fast_accum))
        else:
            y, x_amax, w_amax = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, amax_history, bool(record),
                                                    out_dtype, bool(fast_accum))
            if record:
                push_amax(amax_history[0], x_amax)
                push_amax(amax_history[1], w_amax)
        y = y.view(*lead, weight.shape[0])
        if bias is not None:
            y = y + bias.to(out_dtype)
    return y



def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The FP8 forward in fp32 arithmetic: dequantised operands, an fp32 matmul (for tests)."""
    xq, x_inv = quantize_fp8(x.reshape(-1, x.shape[-1]), E4M3)
    wq, w_inv = quantize_fp8(weight, E4M3)
    y = (xq.float() * x_inv) @ (wq.float() * w_inv).t()
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y + bias.float() if bias is not None else y
