"""Row-wise LayerNorm / RMSNorm kernels (shared by ``layer_norm.py`` and ``rms_norm.py``).

Per row h = x (+ residual), N features, statistics in fp32:
    LayerNorm: mu = mean(h), rstd = 1 / sqrt(var(h) + eps), xhat = (h - mu) * rstd, y = xhat * w + b
    RMSNorm:   mu = 0,       rstd = 1 / sqrt(mean(h^2) + eps), xhat = h * rstd,    y = xhat * w
Backward with g = dy * w:
    dh = rstd * (g - xhat * mean(g * xhat) - mean(g))   (the last term LayerNorm only) (+ d residual_out)
    dw = sum_rows(dy * xhat), db = sum_rows(dy)
Backward: one program per SM (times PROGRAMS_PER_SM) walks a contiguous band of rows,
BLOCK_M rows per step, keeping dw / db as [BLOCK_M, N] fp32 tiles in registers; they are
reduced over rows once, after the loop, into an fp32 (programs, N) buffer, then summed over
programs (dw and db in one launch, stored at the weight's dtype).
With PREFETCH the next step's rows are loaded into registers before this step's reductions;
with STAGES > 0 the compiler pipelines the loads through shared memory instead (the tuner
times all three ways).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_perf.kernels._utils import kernel_dtypes, can_launch, launch_device, next_power_of_2, num_sms, cdiv
from lightning_perf.kernels.autotune import default_tuner, shape_bucket

__all__ = ["norm_fwd", "norm_bwd", "norm_supported", "norm_op", "NormFunction"]

_MAX_N = 65536


@triton.jit
def _norm_fwd_kernel(X, R, W, B, Y, H, MEAN, RSTD, M, N, eps,
                     IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        # normalise the stored (rounded) sum, so the fused op equals norm(x + residual) exactly
        hr = (h + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + offs, hr, mask=mask)
        h = hr.to(tl.float32)
    if IS_RMS:
        xc = h
    else:
        mean = tl.sum(h, axis=1) / N
        xc = tl.where(mask, h - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=row_mask)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _norm_bwd_tile(h, dy, w, rows, row_mask, mask, offs, MEAN, RSTD, DRES, DX, dw_acc, db_acc, N,
                   IS_RMS: tl.constexpr, HAS_DRES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """dx for one [BLOCK_M, BLOCK_N] tile of rows (stored) and the dw / db partial sums (returned)."""
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    if IS_RMS:
        xhat = h * rstd[:, None]
    else:
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
    g = dy * w[None, :]
    if IS_RMS:
        c1 = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * c1[:, None]) * rstd[:, None]
    else:
        # both row sums in one two-operand reduction: one cross-warp exchange instead of two
        s1, s2 = tl.reduce((g * xhat, g), 1, _add_pair)
        c1 = s1 / N
        c2 = s2 / N
        dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
    if HAS_DRES:
        dx += tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    dw_acc += dy * xhat
    if HAS_BIAS:
        db_acc += dy
    return dw_acc, db_acc


@triton.jit
def _norm_bwd_step(r0, row_end, cols, col_mask, H, DY, w, MEAN, RSTD, DRES, DX, dw_acc, db_acc, N,
                   IS_RMS: tl.constexpr, HAS_DRES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Load the BLOCK_M rows from ``r0`` (masked at ``row_end``) and run :func:`_norm_bwd_tile` on them."""
    rows = r0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    return _norm_bwd_tile(h, dy, w, rows, row_mask, mask, offs, MEAN, RSTD, DRES, DX, dw_acc, db_acc, N,
                          IS_RMS, HAS_DRES, HAS_BIAS)


@triton.jit
def _norm_bwd_kernel(H, W, DY, DRES, MEAN, RSTD, DX, DW_PART, DB_PART, M, N, rows_per_program,
                     IS_RMS: tl.constexpr, HAS_DRES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                     STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    # per-element partial sums: the cross-row reduction happens once after the loop, not every step
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    if PREFETCH:
        # software pipelining by hand: the next tile's h / dy loads are in flight while this tile's
        # two row reductions (cross-warp, through shared memory) run
        rows = row_start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        h_next = tl.load(H + offs, mask=mask, other=0.0)
        dy_next = tl.load(DY + offs, mask=mask, other=0.0)
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            mask = row_mask[:, None] & col_mask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            h = h_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            nxt = rows + BLOCK_M
            nmask = (nxt < row_end)[:, None] & col_mask[None, :]
            noffs = nxt.to(tl.int64)[:, None] * N + cols[None, :]
            h_next = tl.load(H + noffs, mask=nmask, other=0.0)
            dy_next = tl.load(DY + noffs, mask=nmask, other=0.0)
            dw_acc, db_acc = _norm_bwd_tile(h, dy, w, rows, row_mask, mask, offs, MEAN, RSTD, DRES, DX, dw_acc,
                                            db_acc, N, IS_RMS, HAS_DRES, HAS_BIAS)
    elif STAGES > 0:
        # the compiler's software pipeline: with num_stages on the loop, Triton pipelines loads that
        # feed no dot too, copying the next STAGES - 1 tiles of h / dy asynchronously into shared
        # memory (no registers held for them) while this tile computes
        for r0 in tl.range(row_start, row_end, BLOCK_M, num_stages=STAGES):
            dw_acc, db_acc = _norm_bwd_step(r0, row_end, cols, col_mask, H, DY, w, MEAN, RSTD, DRES, DX, dw_acc,
                                            db_acc, N, IS_RMS, HAS_DRES, HAS_BIAS, BLOCK_M)
    else:
        for r0 in range(row_start, row_end, BLOCK_M):
            dw_acc, db_acc = _norm_bwd_step(r0, row_end, cols, col_mask, H, DY, w, MEAN, RSTD, DRES, DX, dw_acc,
                                            db_acc, N, IS_RMS, HAS_DRES, HAS_BIAS, BLOCK_M)
    tl.store(DW_PART + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _part_sum_kernel(DW_PART, DB_PART, DW, DB, P, N, HAS_BIAS: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw (and db) = the (P, N) fp32 partial sums summed over P, stored at the weight's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc_w = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        mask = (rows < P)[:, None] & col_mask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        acc_w += tl.sum(tl.load(DW_PART + offs, mask=mask, other=0.0), axis=0)
        if HAS_BIAS:
            acc_b += tl.sum(tl.load(DB_PART + offs, mask=mask, other=0.0), axis=0)
    tl.store(DW + cols, acc_w.to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, acc_b.to(DB.dtype.element_ty), mask=col_mask)


# Elements of one [BLOCK_M, BLOCK_N] tile per thread. The backward keeps about eight fp32 tiles
# live (h, dy, xhat, g, dx and the dw / db accumulators): above 16 per thread that passes the
# 255-register limit and spills to local memory, which costs more traffic than the rows themselves.
_FWD_MAX_PER_THREAD = 32
_BWD_MAX_PER_THREAD = 16
# shared memory the pipelined backward may plan on per SM (Hopper has 228 KB; leave the compiler room)
_SMEM_PER_SM = 160 * 1024


@functools.lru_cache(maxsize=None)
def _fwd_configs(block_n: int, cuda: bool, rows_bucket: int) -> tuple[dict, ...]:
    if not cuda:  # interpreter: few programs, but several of them on small test inputs
        return (dict(BLOCK_M=min(32, max(2, rows_bucket // 4)), num_warps=4),)
    out = []
    for bm in (1, 2, 4, 8, 16):
        tile = bm * block_n
        if tile > 32768 or (bm > 1 and block_n >= 8192):
            continue
        for w in (4, 8, 16, 32):
            per_thread = tile // (32 * w)
            if per_thread <= _FWD_MAX_PER_THREAD and (per_thread >= 2 or w == 4):
                out.append(dict(BLOCK_M=bm, num_warps=w))
    return tuple(out) or (dict(BLOCK_M=1, num_warps=32),)  # the widest rows: one row, every thread


@functools.lru_cache(maxsize=None)
def _bwd_configs(block_n: int, cuda: bool, rows_bucket: int) -> tuple[dict, ...]:
    if not cuda:
        return (dict(BLOCK_M=min(32, max(2, rows_bucket // 8)), num_warps=4, PROGRAMS_PER_SM=1, PREFETCH=False,
                     STAGES=0),)
    out = []
    for bm in (1, 2, 4, 8, 16):
        tile = bm * block_n
        if tile > 16384 or (bm > 1 and block_n >= 8192):
            continue
        for w in (4, 8, 16, 32):
            per_thread = tile // (32 * w)
            if per_thread > _BWD_MAX_PER_THREAD or (per_thread < 2 and w > 4):
                continue
            for p in (1, 2, 4):
                if w * p <= 64:  # at most 64 resident warps per SM
                    out.append(dict(BLOCK_M=bm, num_warps=w, PROGRAMS_PER_SM=p, PREFETCH=False, STAGES=0))
                    if per_thread <= _BWD_MAX_PER_THREAD // 2:  # the prefetched tiles double h / dy
                        out.append(dict(BLOCK_M=bm, num_warps=w, PROGRAMS_PER_SM=p, PREFETCH=True, STAGES=0))
                    for stages in (2, 3):  # h and dy tiles (2 bytes each at bf16) in shared memory per stage
                        if p * stages * tile * 4 <= _SMEM_PER_SM:
                            out.append(dict(BLOCK_M=bm, num_warps=w, PROGRAMS_PER_SM=p, PREFETCH=False,
                                            STAGES=stages))
    return tuple(out) or (dict(BLOCK_M=1, num_warps=32, PROGRAMS_PER_SM=1, PREFETCH=False, STAGES=0),)


def norm_fwd(x, weight, bias, residual, eps: float, is_rms: bool):
    """x (..., N) -> y, new residual (x + residual, or an empty tensor), mean (empty for RMS), rstd; all (M, ...)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    M = x2.shape[0]
    y = torch.empty_like(x2)
    has_res = residual is not None
    r2 = residual.reshape(-1, N).contiguous() if has_res else x2
    h = torch.empty_like(x2) if has_res else x2.new_empty(0)
    mean = torch.empty(M if not is_rms else 0, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    block_n = next_power_of_2(N)
    w = weight.contiguous()
    b = bias.contiguous() if bias is not None else w

    def run(cfg):
        _norm_fwd_kernel[(cdiv(M, cfg["BLOCK_M"]),)](
            x2, r2, w, b, y, h if has_res else y, mean if not is_rms else rstd, rstd, M, N, eps,
            IS_RMS=is_rms, HAS_RES=has_res, HAS_BIAS=bias is not None, BLOCK_N=block_n, **cfg)

    rows_bucket = shape_bucket(M)
    cfg = default_tuner().pick("norm_fwd", (block_n, rows_bucket, x.dtype, is_rms, has_res),
                               _fwd_configs(block_n, x.is_cuda, rows_bucket), run, x.device)
    run(cfg)
    return y.view(x.shape), (h.view(x.shape) if has_res else h), mean, rstd


def norm_bwd(h, weight, bias, mean, rstd, dy, dres, is_rms: bool):
    """Gradients (dx, dw, db-or-empty) of :func:`norm_fwd`; ``h`` is the normalised input (x + residual)."""
    N = h.shape[-1]
    h2 = h.reshape(-1, N).contiguous()
    dy2 = dy.reshape(-1, N).contiguous()
    M = h2.shape[0]
    has_dres = dres is not None
    dres2 = dres.reshape(-1, N).contiguous() if has_dres else dy2
    dx = torch.empty_like(h2)
    block_n = next_power_of_2(N)
    has_bias = bias is not None
    w = weight.contiguous()
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(cfg):
        programs = max(1, min(M, num_sms(h.device) * cfg["PROGRAMS_PER_SM"]))
        rows_per_program = cdiv(M, programs)
        programs = cdiv(M, rows_per_program)
        dw_part = torch.empty((programs, N), dtype=torch.float32, device=h.device)
        db_part = torch.empty((programs, N), dtype=torch.float32, device=h.device) if has_bias else dw_part
        kw = {k: v for k, v in cfg.items() if k != "PROGRAMS_PER_SM"}
        _norm_bwd_kernel[(programs,)](
            h2, w, dy2, dres2, mean if not is_rms else rstd, rstd, dx, dw_part, db_part, M, N, rows_per_program,
            IS_RMS=is_rms, HAS_DRES=has_dres, HAS_BIAS=has_bias, BLOCK_N=block_n, **kw)
        parts[0] = (dw_part, db_part)

    rows_bucket = shape_bucket(M)
    cfg = default_tuner().pick("norm_bwd", (block_n, rows_bucket, h.dtype, is_rms, has_dres, has_bias),
                               _bwd_configs(block_n, h.is_cuda, rows_bucket), run, h.device)
    run(cfg)
    dw_part, db_part = parts[0]
    # one launch sums both partial buffers and casts (instead of a sum and a cast per gradient)
    dw = torch.empty(N, dtype=weight.dtype, device=h.device)
    db = torch.empty(N, dtype=bias.dtype, device=h.device) if has_bias else dw.new_empty(0)
    P = dw_part.shape[0]
    # narrow column blocks: N / 64 programs (64 for N = 4096) share the (P, N) read
    _part_sum_kernel[(cdiv(N, 64),)](dw_part, db_part, dw, db if has_bias else dw, P, N, HAS_BIAS=has_bias,
                                     BLOCK_P=64 if h.is_cuda else 32, BLOCK_N=64, num_warps=4)
    return dx.view(h.shape), dw, db


_NORM_FWD_DEVICE = launch_device(_norm_fwd_kernel)  # decided at import: see launch_device


def norm_supported(x, weight, bias=None, residual=None) -> bool:
    N = x.shape[-1]
    if weight.shape != (N,) or (bias is not None and bias.shape != (N,)) or N > _MAX_N or x.numel() == 0:
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return False
    return x.dtype in kernel_dtypes(x.device) and can_launch(_NORM_FWD_DEVICE, x, weight)


# ---- torch.compile: custom ops -----------------------------------------------------------------


@torch.library.custom_op("lightning_perf::row_norm", mutates_args=())
def norm_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
            eps: float, is_rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, mean, rstd = norm_fwd(x, weight, bias, residual, eps, is_rms)
    return y, h, mean, rstd


@norm_op.register_fake
def _(x, weight, bias, residual, eps, is_rms):
    M = x.numel() // x.shape[-1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = torch.empty_like(y) if residual is not None else x.new_empty(0)
    mean = x.new_empty(0 if is_rms else M, dtype=torch.float32)
    return y, h, mean, x.new_empty(M, dtype=torch.float32)


@torch.library.custom_op("lightning_perf::row_norm_bwd", mutates_args=())
def _norm_bwd_op(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mean: torch.Tensor,
                 rstd: torch.Tensor, dy: torch.Tensor, dres: Optional[torch.Tensor],
                 is_rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_bwd(h, weight, bias, mean, rstd, dy, dres, is_rms)


@_norm_bwd_op.register_fake
def _(h, weight, bias, mean, rstd, dy, dres, is_rms):
    db = torch.empty_like(bias) if bias is not None else weight.new_empty(0)
    return torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(weight), db


def _setup(ctx, inputs, output):
    x, weight, bias, residual, eps, is_rms = inputs
    _, h, mean, rstd = output
    ctx.is_rms, ctx.has_bias, ctx.has_res = is_rms, bias is not None, residual is not None
    ctx.save_for_backward(h if residual is not None else x, weight, bias, mean, rstd)


def _backward(ctx, dy, dh, dmean, drstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    dres = dh if (ctx.has_res and dh is not None) else None
    dx, dw, db = _norm_bwd_op(h, weight, bias if ctx.has_bias else None, mean, rstd, dy, dres, ctx.is_rms)
    return dx, dw, (db if ctx.has_bias else None), (dx if ctx.has_res else None), None, None


norm_op.register_autograd(_backward, setup_context=_setup)


# ---- eager autograd ----------------------------------------------------------------------------


class NormFunction(torch.autograd.Function):
    """Eager path of LayerNorm / RMSNorm with optional fused residual add."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps: float, is_rms: bool):
        y, h, mean, rstd = norm_fwd(x, weight, bias, residual, eps, is_rms)
        ctx.is_rms, ctx.has_bias, ctx.has_res = is_rms, bias is not None, residual is not None
        ctx.save_for_backward(h if residual is not None else x, weight, bias, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)
        return y, h, mean, rstd

    @staticmethod
    def backward(ctx, dy, dh, dmean, drstd):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        dres = dh if ctx.has_res else None
        dx, dw, db = norm_bwd(h, weight, bias, mean, rstd, dy, dres, ctx.is_rms)
        return dx, dw, (db if ctx.has_bias else None), (dx if ctx.has_res else None), None, None


def apply_norm(x, weight, bias, residual, eps: float, is_rms: bool):
    if torch.compiler.is_compiling():
        y, h, _, _ = norm_op(x, weight, bias, residual, eps, is_rms)
    else:
        y, h, _, _ = NormFunction.apply(x, weight, bias, residual, eps, is_rms)
    return y if residual is None else (y, h)
