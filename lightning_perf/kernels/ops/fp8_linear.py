"""The tensorwise FP8 matmul of a training step with the pack's Triton casts (``torch._scaled_mm``).

torchao's tensorwise ``Float8Linear`` (``kernels.float8``) computes the same three matmuls, but
saves its bf16/fp32 operands and casts them to FP8 again in the backward; here the forward's FP8
copies (and the transposed one the weight gradient needs) are saved instead, which measured
faster through the gpt-1.3b FP8 recipe. ``kernels.float8`` runs this path for weights that are plain
tensors when the layer runs (not DTensors, not FP8-gathered) and torchao's for everything else.

For y = x W^T (+ b), x (M, K), W (N, K), with per-tensor scales
    s_t = fmax / max(amax(|t|), tiny),   q(t) = cast_fp8(clamp(t * s_t, -fmax, fmax))
the three matmuls of a training step run on FP8 operands and accumulate in fp32:
    forward   y  = (q(x) q(W)^T) / (s_x s_W)                    x, W in e4m3 (fmax 448)
    backward  dx = (q(g) q(W)) / (s_g s_W)                      g = dL/dy in e5m2 (fmax 57344)
              dW = (q(g)^T q(x)) / (s_g s_x)
              db = sum over rows of g                          (fp32, exact)
e4m3 keeps precision for activations and weights, e5m2 keeps the range gradients need (the
"hybrid" format). Scales are recomputed from the current tensor every call (no amax history),
so no state needs checkpointing. The backward reuses the forward's FP8 copies of x and W: the
activation saved for backward is one byte per element instead of two.

Matmul operands must have both dimensions of each FP8 matrix divisible by 16 (the rows of x
become the inner dimension of dW); a call that breaks this, a device without FP8 tensor cores
(CUDA before compute capability 8.9) or a DTensor argument runs the plain ``F.linear``. Each amax is
one streaming Triton pass (:func:`absmax`, in eager mode and under ``torch.compile``); x and g are
then cast by :func:`cast_transpose_fp8`, which also writes the transposed copies the weight
gradient needs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import wrap_triton

from lightning_perf.kernels._utils import can_launch, launch_device, cdiv, is_dtensor
from lightning_perf.kernels.autotune import default_tuner, shape_bucket

__all__ = [
    "fp8_linear",
    "fp8_linear_reference",
    "fp8_linear_supported",
    "quantize_fp8",
    "cast_transpose_fp8",
    "cast_transpose_fp8_reference",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_ALIGN = 16
_TINY = 1e-12


def _scale_of(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fmax / amax(|t|)`` as a 0-dim fp32 tensor (amax clamped away from 0)."""
    # in float64, then fp32: the scale torchao's casts compute, so both paths round alike
    return (torch.finfo(dtype).max / torch.clamp(absmax(t.detach()).double(), min=_TINY)).float()


# ---- amax(|t|) ---------------------------------------------------------------------------------
# Every FP8 cast needs the amax of its whole operand first. Under torch.compile Inductor would fuse
# that reduction into the producer (GELU, the LayerNorm backward), and those fused kernels run far
# below the copy bandwidth; this kernel streams the operand once at full bandwidth and folds each
# program's maximum into one word with an atomic max on the bits: |x| as int32 orders like the float
# (NaN above inf), so a NaN anywhere gives NaN, as ``torch.amax`` does.


@triton.jit
def _absmax_kernel(X, OUT, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    best = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(start, n, step):
        offs = off + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.abs(x).to(tl.int32, bitcast=True))
    tl.atomic_max(OUT.to(tl.pointer_type(tl.int32)), tl.max(best, 0))


_ABSMAX_BLOCK = 4096


def _absmax_grid(n: int, device: torch.device) -> int:
    programs = triton.cdiv(n, _ABSMAX_BLOCK)
    if device.type == "cuda":  # a few waves of programs, each walking its share in a loop
        programs = min(programs, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return max(1, programs)


_ABSMAX_DEVICE = launch_device(_absmax_kernel)  # decided at import: see launch_device


def _absmax_ok(t: torch.Tensor) -> bool:
    return (t.is_cuda and t.is_contiguous() and t.numel() > 0 and t.dtype in (torch.float32, torch.float16,
                                                                               torch.bfloat16)
            and can_launch(_ABSMAX_DEVICE, t))


def _absmax_launch(t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel on ``t`` (any device it can launch on: tests drive the interpreted one on CPU)."""
    out = torch.zeros((), dtype=torch.float32, device=t.device) if out is None else out.zero_()
    _absmax_kernel[(_absmax_grid(t.numel(), t.device),)](t, out, t.numel(), BLOCK=_ABSMAX_BLOCK, num_warps=8)
    return out


@torch.library.triton_op("lightning_perf::fp8_absmax", mutates_args=())
def _absmax_op(t: torch.Tensor) -> torch.Tensor:
    if not _absmax_ok(t):
        return t.abs().amax().float()
    out = t.new_zeros((), dtype=torch.float32)
    wrap_triton(_absmax_kernel)[(_absmax_grid(t.numel(), t.device),)](t, out, t.numel(), BLOCK=_ABSMAX_BLOCK,
                                                                      num_warps=8)
    return out


def absmax(t: torch.Tensor) -> torch.Tensor:
    """``t.abs().amax()`` as a 0-dim fp32 tensor: one streaming Triton pass for a contiguous CUDA tensor
    (also inside torch.compile graphs), the PyTorch reduction elsewhere. NaN if ``t`` holds a NaN."""
    if t.numel() == 0:
        raise ValueError("amax of an empty tensor")
    return _absmax_op(t)


def quantize_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, inverse scale): ``q = fp8(clamp(t * s))`` with ``s = fmax / amax(|t|)``; ``q / s`` approximates ``t``.

    The inverse scale is a 0-dim fp32 tensor (what ``torch._scaled_mm`` multiplies the product by).
    """
    fmax = torch.finfo(dtype).max
    scale = _scale_of(t, dtype)
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


# ---- scale, cast and transpose in one pass ------------------------------------------------------
# The wgrad matmul contracts over tokens, and Hopper's FP8 tensor cores take only "TN" operands
# (both contiguous along the contracted dimension), so dW = q(g)^T q(x) needs q(g) and q(x)
# transposed. A pointwise kernel that writes a transposed copy strides its stores by the row
# length; this kernel loads a tile, casts it once and stores the tile and its transpose, both
# coalesced (the transposed copy from a second, transposed load of the same tile, an L2 hit).


@triton.jit
def _cast_transpose_kernel(X, Q, QT, SCALE, M, N, stride_xm, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(X + rm64[:, None] * stride_xm + rn64[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Q + rm64[:, None] * N + rn64[None, :], _scaled_fp8(x, scale, FMAX, ROUND_TO_2_BITS, Q), mask=mask)
    # the transposed tile is loaded again (from L2) in transposed order rather than transposed on chip:
    # with Triton 3.6 an in-kernel tl.trans of a tile from an fp32 source (or of the FP8 tile as bytes)
    # can write q^T wrongly, while this form is exact and as fast for bf16 sources
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    xt = tl.load(X + rm64[None, :] * stride_xm + rn64[:, None], mask=mask_t, other=0.0).to(tl.float32)
    tl.store(QT + rn64[:, None] * M + rm64[None, :], _scaled_fp8(xt, scale, FMAX, ROUND_TO_2_BITS, QT), mask=mask_t)


@triton.jit
def _scaled_fp8(x, scale, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr, OUT):
    y = tl.clamp(x * scale, -FMAX, FMAX)
    if ROUND_TO_2_BITS:
        # e5m2: round to nearest even at 2 mantissa bits in fp32 first, so the conversion below is exact
        # (the compiler converts fp32 -> e5m2 through fp16, rounding twice)
        b = y.to(tl.uint32, bitcast=True)
        b = (b + 0xFFFFF + ((b >> 21) & 1)) & 0xFFE00000
        y = b.to(tl.float32, bitcast=True)
    return y.to(OUT.dtype.element_ty)


_CT_CONFIGS_GPU = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w) for bm, bn in ((64, 64), (128, 64), (64, 128), (128, 128))
                   for w in (4, 8)]


def cast_transpose_fp8_reference(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, q^T contiguous) with ``q = fp8(clamp(t * scale, -fmax, fmax))``; t (M, N), scale a 0-dim fp32 tensor."""
    fmax = torch.finfo(dtype).max
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, q.t().contiguous()


def _cast_transpose_launch(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                           out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    M, N = t.shape
    if out is None:
        out = (torch.empty((M, N), dtype=dtype, device=t.device), torch.empty((N, M), dtype=dtype, device=t.device))
    q, qt = out
    fmax = float(torch.finfo(dtype).max)

    def run(cfg):
        grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]))
        _cast_transpose_kernel[grid](t, q, qt, scale, M, N, t.stride(0), FMAX=fmax,
                                     ROUND_TO_2_BITS=dtype == E5M2, **cfg)

    configs = _CT_CONFIGS_GPU if t.is_cuda else [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4)]
    key = (shape_bucket(M), shape_bucket(N), t.dtype, dtype)
    run(default_tuner().pick("fp8_cast_transpose", key, configs, run, t.device))
    return q, qt


_CAST_TRANSPOSE_DEVICE = launch_device(_cast_transpose_kernel)  # decided at import: see launch_device


def _cast_transpose_ok(t: torch.Tensor) -> bool:
    # CUDA only: Triton's CPU interpreter rounds fp32 -> fp8 wrongly (a carry out of the mantissa is
    # dropped), so on CPU the reference runs; tests drive the interpreted kernel with values already
    # on the fp8 grid, where no rounding happens
    return (t.dim() == 2 and t.stride(1) == 1 and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and t.is_cuda and can_launch(_CAST_TRANSPOSE_DEVICE, t))


# the same kernel autotuned by Triton (GPU only): the form torch.compile launches from its own generated
# code (through ``wrap_triton``), without a Python op dispatch or our tuner's lookup per call
_cast_transpose_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"]}, num_warps=c["num_warps"])
             for c in _CT_CONFIGS_GPU],
    key=["M", "N"],
)(_cast_transpose_kernel)


@torch.library.triton_op("lightning_perf::fp8_cast_transpose", mutates_args=())
def _cast_transpose_op(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # a triton_op: torch.compile traces this function and launches the kernel from its generated code
    # (an opaque custom op adds a Python dispatch and a tuner lookup per call: enough host time to make
    # FP8 steps host-bound)
    if not _cast_transpose_ok(t):
        return cast_transpose_fp8_reference(t, scale, dtype)
    M, N = t.shape
    q = t.new_empty((M, N), dtype=dtype)
    qt = t.new_empty((N, M), dtype=dtype)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))

    wrap_triton(_cast_transpose_tuned)[grid](t, q, qt, scale, M, N, t.stride(0), FMAX=float(torch.finfo(dtype).max),
                                             ROUND_TO_2_BITS=dtype == E5M2)
    return q, qt


def cast_transpose_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, q^T contiguous), ``q = fp8(clamp(t * scale))``: one Triton pass on the GPU, the reference elsewhere.

    Meant to equal :func:`cast_transpose_fp8_reference` bit for bit (the same fp32 product, rounded to
    nearest-even after the clamp; for e5m2 values below its normal range, 2^-14, a tie may round
    differently). The transposed copy comes from a second, transposed load of the tile (see the kernel).
    t (M, N) with unit stride along N; scale a 0-dim fp32 tensor.
    """
    return _cast_transpose_op(t, scale, dtype)


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
    """x (M, K) @ W (N, K)^T on FP8 operands; see the module docstring for the maths."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype, fast_accum):
        x = x.contiguous()
        x_scale = _scale_of(x, E4M3)
        xq, xq_t = cast_transpose_fp8(x, x_scale, E4M3)  # xq_t (K, M): the wgrad operand
        wq, w_inv = _weight_fp8(weight)
        x_inv = x_scale.reciprocal()
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype,
                             use_fast_accum=fast_accum)
        ctx.save_for_backward(xq_t, x_inv, wq, w_inv)
        ctx.dtypes = (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        xq_t, x_inv, wq, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        grad = grad.contiguous()
        g_scale = _scale_of(grad, E5M2)
        gq, gq_t = cast_transpose_fp8(grad, g_scale, E5M2)
        g_inv = g_scale.reciprocal()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch._scaled_mm(gq, _col_major(wq), scale_a=g_inv, scale_b=w_inv, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            # q(g)^T (N, M) row-major times q(x) (M, K) column-major (= xq_t viewed transposed)
            dw = torch._scaled_mm(gq_t, xq_t.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=w_dtype)
        return dx, dw, None, None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               fast_accum: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and both gradient matmuls in FP8.

    x (..., K), weight (N, K), bias (N,) or None. The output dtype is the autocast dtype when
    autocast is on, else x's. Falls back to ``F.linear`` where :func:`fp8_linear_supported` is False.
    ``fast_accum``: the forward matmul accumulates in the tensor cores' native FP8 precision, without
    cuBLAS's periodic promotion to fp32 (Hopper; faster); the gradient matmuls always promote.
    """
    if not fp8_linear_supported(x, weight):
        return F.linear(x, weight, bias)
    out_dtype = _out_dtype(x)
    lead = x.shape[:-1]
    with torch.autocast(x.device.type, enabled=False):
        y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, out_dtype, bool(fast_accum))
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
