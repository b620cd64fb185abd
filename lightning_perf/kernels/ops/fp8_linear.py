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
"hybrid" format). By default scales are recomputed from the current tensor every call ("current"
scaling: each operand is read once for its amax, then again for its cast), so no state needs
checkpointing. The backward reuses the forward's FP8 copies of x and W: the activation saved for
backward is one byte per element instead of two.

Delayed scaling (``amax_history=``, what ``kernels.float8``'s delayed layers pass) takes each scale
from the operand's recorded amaxes instead,
    s_t = fmax / max(amax_{t-1}, ..., amax_{t-H})                    (H = 16 by default)
and the pass that casts t with s_t also reduces amax_t, which is recorded: one read per operand.
A row with nothing recorded yet (the first step) uses the current amax. An operand that grows past
its recorded maximum saturates at +-fmax for that step, and the next step's scale covers it.

Matmul operands must have both dimensions of each FP8 matrix divisible by 16 (the rows of x
become the inner dimension of dW); a call that breaks this, a device without FP8 tensor cores
(CUDA before compute capability 8.9) or a DTensor argument runs the plain ``F.linear``. Under current
scaling each amax is one streaming Triton pass (:func:`absmax`, in eager mode and under ``torch.compile``); x and g are
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
    "cast_transpose_amax_fp8",
    "cast_transpose_amax_fp8_reference",
    "history_scale",
    "push_amax",
    "new_amax_history",
    "AMAX_HISTORY",
    "fp8_gelu_mlp",
    "fp8_gelu_mlp_supported",
    "gelu_cast_transpose_fp8",
    "gelu_cast_transpose_fp8_reference",
    "gelu_operand_reference",
    "gelu_history_scale",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_ALIGN = 16
_TINY = 1e-12
AMAX_HISTORY = 16  # delayed scaling: steps of amax each scale is taken over


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


# ---- delayed scaling: scales from an amax history, the amax from the cast itself ------------------
# A layer keeps amax_history (3, H) fp32, one row per operand (x, W, dL/dy), newest amax first, zeros
# where nothing was recorded. The step's scale is fmax / max(row); the kernel that casts with it
# also folds max |t| into one word, which is pushed onto the row. So each operand is read once, not
# twice (amax, then cast). An empty row (the first call, or after a load) falls back to the current
# amax; that pass is launched every call but reads nothing once the row holds a value, so eager and
# compiled graphs take one path whatever the history holds (no host sync, no recompile).


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


def new_amax_history(length: int = AMAX_HISTORY, device: Optional[torch.device] = None) -> torch.Tensor:
    """An empty history for :func:`fp8_linear`'s ``amax_history``: zeros (3, ``length``) fp32."""
    if length < 1:
        raise ValueError(f"an amax history needs at least one entry, got length={length}")
    return torch.zeros(3, length, dtype=torch.float32, device=device)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The FP8 forward in fp32 arithmetic: dequantised operands, an fp32 matmul (for tests)."""
    xq, x_inv = quantize_fp8(x.reshape(-1, x.shape[-1]), E4M3)
    wq, w_inv = quantize_fp8(weight, E4M3)
    y = (xq.float() * x_inv) @ (wq.float() * w_inv).t()
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y + bias.float() if bias is not None else y


# ---- the GPT-2 MLP with delayed scaling: the activation's casts fused into their producers ------
# down(gelu(up(x))) as two delayed FP8 matmuls passes the hidden activation (M, F) through memory
# four times per step: the forward writes h = gelu(u + b) in bf16 and the cast-transpose reads it
# back to write q(h) and q(h)^T; the backward writes dL/du = dL/dh * gelu'(u + b) in bf16 and the
# cast-transpose reads it back again. Since a delayed scale is known before its operand exists, the
# kernel that computes h (or dL/du) can cast it with that scale and write both FP8 layouts at once
# (reducing the amax and, backwards, the bias gradient on the way): F = 4d wide, this is the widest
# operand of the block and the largest saving of bytes in it. The matmul output u is saved for the
# backward, as the unfused composition saves it for GELU's.

_C = 0.7978845608028654  # sqrt(2 / pi)


@triton.jit
def _gelu_parts(a):
    """(gelu_tanh(a), gelu_tanh'(a)) in fp32. With t = tanh(z), z = c (a + 0.044715 a^3), the factors 1 + t
    and 1 - t come from e = exp(2z) as 2e / (1 + e) and 2 / (1 + e): no cancellation where t is near -1
    or 1, so both stay accurate relative to their own size in the tails."""
    z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    e = tl.exp(tl.minimum(2.0 * z, 60.0))  # below: underflows to 0 (h, gelu' -> 0); above: keeps e finite
    r = 1.0 / (1.0 + e)
    p = 2.0 * e * r  # 1 + t
    m = 2.0 * r  # 1 - t
    d = 0.5 * p + 0.5 * a * p * m * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * a * a)
    return 0.5 * a * p, d


@triton.jit
def _gelu_operand(U, BIAS, DH, rows, cols, mask, stride_um, stride_dm, HAS_BIAS: tl.constexpr, GRAD: tl.constexpr):
    """One tile of gelu(u + b) (forward) or dL/dh * gelu'(u + b) (GRAD), fp32, zero outside ``mask``;
    ``rows`` and ``cols`` broadcast to the tile (either may be the transposed index)."""
    a = tl.load(U + rows.to(tl.int64) * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    h, d = _gelu_parts(a)
    if GRAD:
        h = d * tl.load(DH + rows.to(tl.int64) * stride_dm + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, h, 0.0)


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


def _gelu_parts_reference(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = a.double()  # float64: the fp32 kernel is checked against these to its own rounding
    e = torch.exp(torch.clamp(2 * _C * (a + 0.044715 * a * a * a), max=600.0))  # 1 +- tanh as the kernel forms them
    p, m = 2.0 * e / (1.0 + e), 2.0 / (1.0 + e)
    return 0.5 * a * p, 0.5 * p + 0.5 * a * p * m * _C * (1.0 + 3.0 * 0.044715 * a * a)


def gelu_operand_reference(u: torch.Tensor, bias: Optional[torch.Tensor], dh: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """``gelu_tanh(u + b)`` or, with ``dh``, ``dh * gelu_tanh'(u + b)``: u + b in fp32, the rest in float64,
    returned in fp32."""
    a = u.float() if bias is None else u.float() + bias.float()
    h, d = _gelu_parts_reference(a)
    return (h if dh is None else dh.double() * d).float()


def _gelu_operand_fp32(u: torch.Tensor, bias: Optional[torch.Tensor], dh: Optional[torch.Tensor]) -> torch.Tensor:
    """The operand as PyTorch's fp32 GELU ops compute it (what the unfused layers compute off the GPU)."""
    a = u.float() if bias is None else u.float() + bias.float()
    if dh is None:
        return F.gelu(a, approximate="tanh")
    return torch.ops.aten.gelu_backward(dh.float(), a, approximate="tanh")


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
