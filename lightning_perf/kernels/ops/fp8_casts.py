"""FP8 casts of matmul operands in Triton: amax(|t|), and scale, cast and transpose in one pass.

An operand t becomes q(t) = cast_fp8(clamp(t * s, -fmax, fmax)) with one scale s per tensor: e4m3
(fmax 448) for activations and weights, e5m2 (fmax 57344) for gradients. A training step's matmuls
need most operands in both layouts (the weight gradient contracts over tokens), so the cast writes q
and q^T together:

    absmax(t)                          amax(|t|) in one streaming pass (current scaling: s = fmax / amax)
    cast_transpose_fp8(t, s)           q and q^T from one pass over t
    cast_transpose_amax_fp8(t, s)      the same pass also reduces amax(|t|) (delayed scaling, whose s
                                       comes from recorded amaxes: ``fp8_amax_history``)

Each is a ``torch.library.triton_op``: eager calls run the kernel, and torch.compile launches it from
its generated code. The kernels run on CUDA; elsewhere the PyTorch references below run (the tests
drive the interpreted kernels on CPU through the launch functions). With ``GELU=True`` the amax kernel
reads the FP8 GELU MLP's operand from its inputs instead of a stored tensor (``fp8_gelu_operand``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from lightning_perf.kernels._utils import can_launch, launch_device, cdiv
from lightning_perf.kernels.autotune import default_tuner, shape_bucket
from lightning_perf.kernels.ops.fp8_gelu_operand import _gelu_operand  # called by _absmax_kernel (GELU)

__all__ = [
    "E4M3",
    "E5M2",
    "absmax",
    "quantize_fp8",
    "cast_transpose_fp8",
    "cast_transpose_fp8_reference",
    "cast_transpose_amax_fp8",
    "cast_transpose_amax_fp8_reference",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
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
def _absmax_kernel(X, BIAS, DH, OUT, PRIOR, n, N, BLOCK: tl.constexpr, UNLESS_PRIOR: tl.constexpr,
                   GELU: tl.constexpr, HAS_BIAS: tl.constexpr, GRAD: tl.constexpr):
    # max |X| over n contiguous elements (BIAS, DH, N unused: every argument is passed, as torch.compile
    # launches kernels without their defaults). GELU: the operand is never materialised: max |gelu(u + b)|
    # (or of dL/dh * gelu'(u + b)) over contiguous (n / N, N) inputs X = u, BIAS, DH (see _gelu_operand)
    if UNLESS_PRIOR:  # delayed scaling: a recorded amax (PRIOR > 0) stands in, so nothing is read
        n = tl.where(tl.load(PRIOR) > 0, 0, n)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    best = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(start, n, step):
        offs = off + tl.arange(0, BLOCK)
        if GELU:
            x = _gelu_operand(X, BIAS, DH, offs // N, offs % N, offs < n, N, N, HAS_BIAS, GRAD)
        else:
            x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.abs(x).to(tl.int32, bitcast=True))
    tl.atomic_max(OUT.to(tl.pointer_type(tl.int32)), tl.max(best, 0))


_ABSMAX_BLOCK = 4096
_PLAIN = dict(GELU=False, HAS_BIAS=False, GRAD=False)  # _absmax_kernel on a stored tensor


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


def _absmax_launch(t: torch.Tensor, out: Optional[torch.Tensor] = None, prior: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
    """The kernel on ``t`` (any device it can launch on: tests drive the interpreted one on CPU); with
    ``prior`` (a 0-dim fp32 tensor), 0 without reading ``t`` when ``prior > 0``."""
    out = torch.zeros((), dtype=torch.float32, device=t.device) if out is None else out.zero_()
    _absmax_kernel[(_absmax_grid(t.numel(), t.device),)](t, t, t, out, out if prior is None else prior, t.numel(), 1,
                                                         BLOCK=_ABSMAX_BLOCK, UNLESS_PRIOR=prior is not None,
                                                         **_PLAIN, num_warps=8)
    return out


@torch.library.triton_op("lightning_perf::fp8_absmax", mutates_args=())
def _absmax_op(t: torch.Tensor) -> torch.Tensor:
    if not _absmax_ok(t):
        return t.abs().amax().float()
    out = t.new_zeros((), dtype=torch.float32)
    wrap_triton(_absmax_kernel)[(_absmax_grid(t.numel(), t.device),)](t, t, t, out, out, t.numel(), 1,
                                                                      BLOCK=_ABSMAX_BLOCK, UNLESS_PRIOR=False,
                                                                      **_PLAIN, num_warps=8)
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
def _cast_transpose_kernel(X, Q, QT, SCALE, AMAX, M, N, stride_xm, FMAX: tl.constexpr, ROUND_TO_2_BITS: tl.constexpr,
                           WITH_AMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    scale = tl.load(SCALE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(X + rm64[:, None] * stride_xm + rn64[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Q + rm64[:, None] * N + rn64[None, :], _scaled_fp8(x, scale, FMAX, ROUND_TO_2_BITS, Q), mask=mask)
    if WITH_AMAX:  # this tile's max |x| folded into one word, as in _absmax_kernel (NaN above inf)
        bits = tl.max(tl.max(tl.abs(x).to(tl.int32, bitcast=True), 1), 0)
        tl.atomic_max(AMAX.to(tl.pointer_type(tl.int32)), bits)
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
                           out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                           amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on ``t``; with ``amax`` (a zeroed 0-dim fp32 tensor) it also folds max |t| into it.
    Launching again on the same input leaves the same values (a max is idempotent), so tuning may."""
    M, N = t.shape
    if out is None:
        out = (torch.empty((M, N), dtype=dtype, device=t.device), torch.empty((N, M), dtype=dtype, device=t.device))
    q, qt = out
    fmax = float(torch.finfo(dtype).max)

    def run(cfg):
        grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]))
        _cast_transpose_kernel[grid](t, q, qt, scale, scale if amax is None else amax, M, N, t.stride(0), FMAX=fmax,
                                     ROUND_TO_2_BITS=dtype == E5M2, WITH_AMAX=amax is not None, **cfg)

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

    wrap_triton(_cast_transpose_tuned)[grid](t, q, qt, scale, scale, M, N, t.stride(0),
                                             FMAX=float(torch.finfo(dtype).max), ROUND_TO_2_BITS=dtype == E5M2,
                                             WITH_AMAX=False)
    return q, qt


def cast_transpose_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, q^T contiguous), ``q = fp8(clamp(t * scale))``: one Triton pass on the GPU, the reference elsewhere.

    Meant to equal :func:`cast_transpose_fp8_reference` bit for bit (the same fp32 product, rounded to
    nearest-even after the clamp; for e5m2 values below its normal range, 2^-14, a tie may round
    differently). The transposed copy comes from a second, transposed load of the tile (see the kernel).
    t (M, N) with unit stride along N; scale a 0-dim fp32 tensor.
    """
    return _cast_transpose_op(t, scale, dtype)


# ---- the same cast that also reduces amax(|t|): delayed scaling, whose scale exists before t is read --


def cast_transpose_amax_fp8_reference(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, q^T contiguous, amax(|t|) as a 0-dim fp32 tensor): :func:`cast_transpose_fp8_reference` and the amax."""
    q, qt = cast_transpose_fp8_reference(t, scale, dtype)
    return q, qt, t.detach().abs().amax().float()


@torch.library.triton_op("lightning_perf::fp8_cast_transpose_amax", mutates_args=())
def _cast_transpose_amax_op(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _cast_transpose_ok(t):
        return cast_transpose_amax_fp8_reference(t, scale, dtype)
    M, N = t.shape
    q = t.new_empty((M, N), dtype=dtype)
    qt = t.new_empty((N, M), dtype=dtype)
    amax = t.new_zeros((), dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))

    wrap_triton(_cast_transpose_tuned)[grid](t, q, qt, scale, amax, M, N, t.stride(0),
                                             FMAX=float(torch.finfo(dtype).max), ROUND_TO_2_BITS=dtype == E5M2,
                                             WITH_AMAX=True)
    return q, qt, amax


def cast_transpose_amax_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, q^T contiguous, amax(|t|)) from one pass over ``t``: :func:`cast_transpose_fp8` whose kernel also
    reduces each tile's max |t| and folds it into one fp32 word (an atomic max on its bits: NaN wins, as
    in ``torch.amax``). The reference elsewhere (:func:`cast_transpose_amax_fp8_reference`)."""
    return _cast_transpose_amax_op(t, scale, dtype)
