"""The GPT-2 MLP down(gelu_tanh(up(x))) on two delayed FP8 linears, the GELU fused into its casts.

As two delayed FP8 matmuls (``fp8_linear``) the MLP passes the hidden activation (M, F) through
memory four times per step: the forward writes h = gelu(u + b) in bf16 and the cast-transpose reads
it back to write q(h) and q(h)^T; the backward writes dL/du = dL/dh * gelu'(u + b) in bf16 and the
cast-transpose reads it back again. Since a delayed scale is known before its operand exists, the
kernel that computes h (or dL/du) can cast it with that scale and write both FP8 layouts at once
(reducing the amax and, backwards, the bias gradient on the way): F = 4d wide, this is the widest
operand of the block and the largest saving of bytes in it. The matmul output u is saved for the
backward, as the unfused composition saves it for GELU's.

Here: that kernel and its launchers (the operand's maths: ``fp8_gelu_operand``), the amax of the
operand for an empty history, and the autograd Function with its entry point :func:`fp8_gelu_mlp`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import wrap_triton

from lightning_perf.kernels._utils import can_launch, launch_device, cdiv
from lightning_perf.kernels.dtensor import is_dtensor
from lightning_perf.kernels.ops.fp8_amax_history import _scale_over, history_scale, push_amax
from lightning_perf.kernels.ops.fp8_casts import (
    E4M3,
    E5M2,
    _ABSMAX_BLOCK,
    _absmax_grid,
    _absmax_kernel,
    _scaled_fp8,
    cast_transpose_amax_fp8,
    cast_transpose_fp8_reference,
)
from lightning_perf.kernels.ops.fp8_gelu_operand import _gelu_operand, _gelu_operand_fp32
from lightning_perf.kernels.ops.fp8_linear import _ALIGN, _out_dtype, fp8_linear, fp8_linear_supported

__all__ = [
    "fp8_gelu_mlp",
    "fp8_gelu_mlp_supported",
    "gelu_cast_transpose_fp8",
    "gelu_cast_transpose_fp8_reference",
    "gelu_history_scale",
]


@triton.jit
def _gelu_cast_transpose_kernel(U, BIAS, DH, Q, QT, SCALE, AMAX, DBP, M, N, stride_um, stride_dm,
                                FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                                GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the operand tile is computed once, cast with the given scale and stored; the transposed copy is
    # read back from that FP8 tile (this program's own stores, from cache, after a barrier) in transposed
    # order. GELU costs enough arithmetic per element that evaluating it again for transposed loads of
    # the inputs, as _cast_transpose_kernel reloads its input, made this kernel slower than GELU and the
    # cast apart; and a tl.trans of the FP8 tile (as bytes) writes q^T wrongly with Triton 3.6. The
    # tile's max |.| is folded into AMAX; with GRAD, each program also stores its column sums (bias
    # gradient partials) in row program_id(0) of DBP (cdiv(M, BLOCK_M), N)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    h = _gelu_operand(U, BIAS, DH, rm[:, None], rn[None, :], mask, stride_um, stride_dm, HAS_BIAS, GRAD)
    tl.store(Q + rm.to(tl.int64)[:, None] * N + rn[None, :], _scaled_fp8(h, scale, FMAX, ROUND_TO_2_BITS, Q),
             mask=mask)
    bits = tl.max(tl.max(tl.abs(h).to(tl.int32, bitcast=True), 1), 0)
    tl.atomic_max(AMAX.to(tl.pointer_type(tl.int32)), bits)
    if GRAD:
        tl.store(DBP + tl.program_id(0).to(tl.int64) * N + rn, tl.sum(h, 0), mask=rn < N)
    tl.debug_barrier()  # every thread's stores of the tile are done before any thread reads them back
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    qt = tl.load(Q + rm.to(tl.int64)[None, :] * N + rn[:, None], mask=mask_t, cache_modifier=".cg")
    tl.store(QT + rn.to(tl.int64)[:, None] * M + rm[None, :], qt, mask=mask_t)


# BLOCK_M is fixed: the bias-gradient partials have one row per row of programs, whatever the tuner picks
_GELU_CT_BLOCK_M = 64
_GELU_CT_CONFIGS_GPU = [dict(BLOCK_N=bn, num_warps=w) for bn in (64, 128) for w in (4, 8)]

_gelu_cast_transpose_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": _GELU_CT_BLOCK_M, "BLOCK_N": c["BLOCK_N"]}, num_warps=c["num_warps"])
             for c in _GELU_CT_CONFIGS_GPU],
    key=["M", "N", "GRAD"],
)(_gelu_cast_transpose_kernel)

_GELU_CT_DEVICE = launch_device(_gelu_cast_transpose_kernel)


def gelu_cast_transpose_fp8_reference(u: torch.Tensor, bias: Optional[torch.Tensor], scale: torch.Tensor,
                                      dtype: torch.dtype, dh: Optional[torch.Tensor] = None
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, q^T contiguous, amax, column sums in fp32) of the operand, from PyTorch's fp32 GELU ops (what
    :func:`gelu_cast_transpose_fp8` runs where the kernel cannot; :func:`gelu_operand_reference` is the
    float64 maths the kernel is checked against)."""
    h = _gelu_operand_fp32(u, bias, dh)
    q, qt = cast_transpose_fp8_reference(h, scale, dtype)
    return q, qt, h.abs().amax(), h.sum(0)


def _gelu_ct_ok(*tensors: torch.Tensor) -> bool:
    return all(t.dim() == 2 and t.stride(1) == 1 and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
               and t.is_cuda for t in tensors) and can_launch(_GELU_CT_DEVICE, *tensors)


def _gelu_cast_transpose_launch(u: torch.Tensor, bias: Optional[torch.Tensor], scale: torch.Tensor,
                                dtype: torch.dtype, dh: Optional[torch.Tensor] = None, *, tuned: bool = True
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel (``tuned``: Triton's autotuned form, through ``wrap_triton``; else one configuration,
    which the interpreter runs in tests): (q, q^T, amax, bias gradient in fp32 (or an empty tensor))."""
    M, N = u.shape
    q = u.new_empty((M, N), dtype=dtype)
    qt = u.new_empty((N, M), dtype=dtype)
    amax = u.new_zeros((), dtype=torch.float32)
    grad = dh is not None
    dbp = u.new_empty((cdiv(M, _GELU_CT_BLOCK_M) if grad else 0, N), dtype=torch.float32)
    args = (u, u if bias is None else bias, u if dh is None else dh, q, qt, scale, amax, dbp, M, N, u.stride(0),
            u.stride(0) if dh is None else dh.stride(0))
    consts = dict(FMAX=float(torch.finfo(dtype).max), ROUND_TO_2_BITS=dtype == E5M2, HAS_BIAS=bias is not None,
                  GRAD=grad)
    if tuned:
        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))

        wrap_triton(_gelu_cast_transpose_tuned)[grid](*args, **consts)
    else:
        block_n = 16 if not u.is_cuda else 64
        _gelu_cast_transpose_kernel[(cdiv(M, _GELU_CT_BLOCK_M), cdiv(N, block_n))](
            *args, **consts, BLOCK_M=_GELU_CT_BLOCK_M, BLOCK_N=block_n)
    return q, qt, amax, dbp.sum(0) if grad else dbp.new_empty(0)


@torch.library.triton_op("lightning_perf::fp8_gelu_cast_transpose", mutates_args=())
def _gelu_cast_transpose_op(u: torch.Tensor, bias: Optional[torch.Tensor], scale: torch.Tensor, dtype: torch.dtype,
                            dh: Optional[torch.Tensor]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _gelu_ct_ok(u, *(t for t in (dh,) if t is not None)):
        q, qt, amax, db = gelu_cast_transpose_fp8_reference(u, bias, scale, dtype, dh)
        return q, qt, amax, db if dh is not None else db.new_empty(0)
    return _gelu_cast_transpose_launch(u, bias, scale, dtype, dh)


def gelu_cast_transpose_fp8(u: torch.Tensor, bias: Optional[torch.Tensor], scale: torch.Tensor, dtype: torch.dtype,
                            dh: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass over u (M, N) (and dh): the operand h = gelu_tanh(u + b), or with ``dh`` its gradient
    dh * gelu_tanh'(u + b), cast with ``scale`` and written in both layouts, never stored otherwise.

    Returns (q, q^T contiguous, amax(|h|) as a 0-dim fp32 tensor, column sums of h in fp32 when ``dh`` is
    given (the bias gradient), else an empty tensor). The Triton kernel on the GPU;
    :func:`gelu_cast_transpose_fp8_reference` elsewhere.
    """
    return _gelu_cast_transpose_op(u, bias, scale, dtype, dh)


def _gelu_absmax_launch(u: torch.Tensor, bias: Optional[torch.Tensor], prior: torch.Tensor,
                        dh: Optional[torch.Tensor] = None, *, wrap: bool = True) -> torch.Tensor:
    out = u.new_zeros((), dtype=torch.float32)
    M, N = u.shape
    kernel = wrap_triton(_absmax_kernel) if wrap else _absmax_kernel
    kernel[(_absmax_grid(u.numel(), u.device),)](u, u if bias is None else bias, u if dh is None else dh, out, prior,
                                                 u.numel(), N, BLOCK=_ABSMAX_BLOCK, UNLESS_PRIOR=True, GELU=True,
                                                 HAS_BIAS=bias is not None, GRAD=dh is not None, num_warps=8)
    return out


@torch.library.triton_op("lightning_perf::fp8_gelu_absmax_unless", mutates_args=())
def _gelu_absmax_unless_op(u: torch.Tensor, bias: Optional[torch.Tensor], prior: torch.Tensor,
                           dh: Optional[torch.Tensor]) -> torch.Tensor:
    tensors = (u,) if dh is None else (u, dh)
    if not (_gelu_ct_ok(*tensors) and all(t.is_contiguous() for t in tensors)):
        amax = _gelu_operand_fp32(u, bias, dh).abs().amax()
        return torch.where(prior > 0, torch.zeros_like(prior), amax)
    return _gelu_absmax_launch(u, bias, prior, dh)


def gelu_history_scale(u: torch.Tensor, bias: Optional[torch.Tensor], history: torch.Tensor, dtype: torch.dtype,
                       dh: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`history_scale` of the operand :func:`gelu_cast_transpose_fp8` computes from (u, b, dh): an
    empty history takes its current amax from one pass over the inputs (read only then)."""
    prior = history.amax().float()
    return _scale_over(prior, _gelu_absmax_unless_op(u, bias, prior, dh), dtype)


class _Float8GeluMLP(torch.autograd.Function):
    """gelu_tanh(x W_up^T + b_up) W_down^T on delayed FP8 operands (see :func:`fp8_gelu_mlp`): two FP8
    matmuls forward, four backward. The histories h_up, h_down (3, H) hold the amaxes of (x, W_up, dL/du)
    and (h, W_down, dL/dy); the forward returns y and the four forward amaxes for the caller to record."""

    @staticmethod
    def forward(ctx, x, w_up, b_up, w_down, h_up, h_down, record, out_dtype, fast_accum):
        x = x.contiguous()
        ctx.dtypes = (x.dtype, w_up.dtype, w_down.dtype, None if b_up is None else b_up.dtype, out_dtype)
        ctx.histories = (h_up, h_down)  # not saved: their rows change in place after this forward
        ctx.record = record
        x_scale = history_scale(x, h_up[0], E4M3)
        xq, xq_t, x_amax = cast_transpose_amax_fp8(x, x_scale, E4M3)
        w1_scale = history_scale(w_up, h_up[1], E4M3)
        w1q, w1q_t, w1_amax = cast_transpose_amax_fp8(w_up.detach(), w1_scale, E4M3)
        x_inv, w1_inv = x_scale.reciprocal(), w1_scale.reciprocal()
        u = torch._scaled_mm(xq, w1q.t(), scale_a=x_inv, scale_b=w1_inv, out_dtype=out_dtype,
                             use_fast_accum=fast_accum)
        b = None if b_up is None else b_up.detach()
        h_scale = gelu_history_scale(u, b, h_down[0], E4M3)
        hq, hq_t, h_amax, _ = gelu_cast_transpose_fp8(u, b, h_scale, E4M3)
        w2_scale = history_scale(w_down, h_down[1], E4M3)
        w2q, w2q_t, w2_amax = cast_transpose_amax_fp8(w_down.detach(), w2_scale, E4M3)
        h_inv, w2_inv = h_scale.reciprocal(), w2_scale.reciprocal()
        y = torch._scaled_mm(hq, w2q.t(), scale_a=h_inv, scale_b=w2_inv, out_dtype=out_dtype,
                             use_fast_accum=fast_accum)
        ctx.has_bias = b is not None
        ctx.save_for_backward(xq_t, x_inv, w1q_t, w1_inv, u, b if b is not None else u, hq_t, h_inv, w2q_t, w2_inv)
        ctx.mark_non_differentiable(x_amax, w1_amax, h_amax, w2_amax)
        return y, x_amax, w1_amax, h_amax, w2_amax

    @staticmethod
    def backward(ctx, grad, *amax_grads):
        xq_t, x_inv, w1q_t, w1_inv, u, b, hq_t, h_inv, w2q_t, w2_inv = ctx.saved_tensors
        b = b if ctx.has_bias else None
        x_dtype, w1_dtype, w2_dtype, b_dtype, out_dtype = ctx.dtypes
        h_up, h_down = ctx.histories
        grad = grad.contiguous()
        gy_scale = history_scale(grad, h_down[2], E5M2)
        gyq, gyq_t, gy_amax = cast_transpose_amax_fp8(grad, gy_scale, E5M2)
        gy_inv = gy_scale.reciprocal()
        dw_down = torch._scaled_mm(gyq_t, hq_t.t(), scale_a=gy_inv, scale_b=h_inv, out_dtype=w2_dtype)
        dh = torch._scaled_mm(gyq, w2q_t.t(), scale_a=gy_inv, scale_b=w2_inv, out_dtype=out_dtype)
        gu_scale = gelu_history_scale(u, b, h_up[2], E5M2, dh)
        guq, guq_t, gu_amax, db_up = gelu_cast_transpose_fp8(u, b, gu_scale, E5M2, dh)
        if ctx.record:
            push_amax(h_down[2], gy_amax)
            push_amax(h_up[2], gu_amax)
        gu_inv = gu_scale.reciprocal()
        dx = dw_up = None
        if ctx.needs_input_grad[0]:
            dx = torch._scaled_mm(guq, w1q_t.t(), scale_a=gu_inv, scale_b=w1_inv, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            dw_up = torch._scaled_mm(guq_t, xq_t.t(), scale_a=gu_inv, scale_b=x_inv, out_dtype=w1_dtype)
        db = db_up.to(b_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dw2 = dw_down if ctx.needs_input_grad[3] else None
        return dx, dw_up, db, dw2, None, None, None, None, None


def fp8_gelu_mlp_supported(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether :func:`fp8_gelu_mlp` runs fused for these arguments (else it composes :func:`fp8_linear`)."""
    return (fp8_linear_supported(x, w_up) and w_down.dim() == 2 and w_down.shape[1] == w_up.shape[0]
            and not is_dtensor(w_down) and w_down.device == x.device and w_down.is_floating_point()
            and w_down.shape[0] % _ALIGN == 0)


def fp8_gelu_mlp(x: torch.Tensor, w_up: torch.Tensor, b_up: Optional[torch.Tensor], w_down: torch.Tensor,
                 b_down: Optional[torch.Tensor], *, up_history: torch.Tensor, down_history: torch.Tensor,
                 record: bool = True, fast_accum: bool = True) -> torch.Tensor:
    """``fp8_linear(gelu_tanh(fp8_linear(x, w_up, b_up)), w_down, b_down)`` with delayed scaling, the
    GELU and both of its FP8 casts in one kernel each way.

    x (..., K), w_up (F, K), w_down (D, F); ``up_history`` / ``down_history`` the two layers' (3, H)
    amax histories (rows: input, weight, output gradient), read and recorded as :func:`fp8_linear`
    does. The hidden activation gelu(u + b_up) exists only in FP8 (its amax from the fp32 values, not
    from a bf16 copy); its gradient likewise, the bias gradient summed from the fp32 values. Shapes
    :func:`fp8_gelu_mlp_supported` refuses run the unfused composition.
    """
    if not fp8_gelu_mlp_supported(x, w_up, w_down):
        h = fp8_linear(x, w_up, b_up, fast_accum=fast_accum, amax_history=up_history, record=record)
        return fp8_linear(F.gelu(h, approximate="tanh"), w_down, b_down, fast_accum=fast_accum,
                          amax_history=down_history, record=record)
    out_dtype = _out_dtype(x)
    lead = x.shape[:-1]
    with torch.autocast(x.device.type, enabled=False):
        y, x_amax, w1_amax, h_amax, w2_amax = _Float8GeluMLP.apply(
            x.reshape(-1, x.shape[-1]), w_up, b_up, w_down, up_history, down_history, bool(record), out_dtype,
            bool(fast_accum))
        if record:
            push_amax(up_history[0], x_amax)
            push_amax(up_history[1], w1_amax)
            push_amax(down_history[0], h_amax)
            push_amax(down_history[1], w2_amax)
        y = y.view(*lead, w_down.shape[0])
        if b_down is not None:
            y = y + b_down.to(out_dtype)
    return y
