"""Document-causal flash attention in Triton: packed sequences, one document id per token.

For one head and one row of the batch, with d = doc_ids[b] (B, T) int32:

    S = scale * Q K^T,  S[i, j] = -inf unless d[i] == d[j] and j <= i,
    P = softmax(S) row-wise,  O = P V,

computed as in :mod:`lightning_perf.kernels.ops.flash_attention` (online softmax in base 2, LSE
saved; the backward recomputes P and forms dV = P^T dO, dS = P * (dP - delta), dK = scale dS^T Q,
dQ = scale dS K with delta = rowsum(dO * O)). A (query block, key block) pair whose id ranges
[min, max] do not meet is skipped without loading K / V (or Q / dO); every other pair is masked
element-wise. Every row attends at least to itself, so no row is empty. Split backward only: a dQ
kernel (which writes delta), then a dK / dV kernel per key block looping over its group's heads.

Shapes and dtypes as :func:`flash_attention` (GQA, head dims 16-256, any T).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_perf.kernels._utils import cdiv
from lightning_perf.kernels.autotune import default_tuner, shape_bucket
from lightning_perf.kernels.ops.flash_attention import (
    _LOG2E,
    _configs,
    _last_contiguous,
    _new_output,
    _strides,
)

__all__ = ["DocumentFlashAttentionFunction", "flash_attn_documents_fwd", "flash_attn_documents_bwd"]

_BIG = 2147483647


@triton.jit
def _id_range(DOC_base, offs, T):
    """(min, max) of the ids at ``offs`` inside [0, T)."""
    ids = tl.load(DOC_base + offs, mask=offs < T, other=-1)
    return tl.min(tl.where(offs < T, ids, 2147483647)), tl.max(ids), ids


@triton.jit
def _doc_fwd_kernel(Q, K, V, O, LSE, DOC,
                    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sdb,
                    H, T, GROUP, qk_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # the longest rows first
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m[:, None] < T
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :], mask=row_mask,
                other=0.0)
    DOC_base = DOC + b * sdb
    q_lo, q_hi, doc_q = _id_range(DOC_base, offs_m, T)
    K_base = K + b * skb + hk * skh
    V_base = V + b * svb + hk * svh
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for start_n in range(0, tl.minimum(start_m + BLOCK_M, T), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_lo, k_hi, doc_k = _id_range(DOC_base, offs_n, T)
        if (k_hi >= q_lo) & (k_lo <= q_hi):
            col = offs_n[:, None] < T
            k = tl.load(K_base + offs_n[:, None].to(tl.int64) * skt + offs_d[None, :], mask=col, other=0.0)
            v = tl.load(V_base + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :], mask=col, other=0.0)
            valid = (offs_n[None, :] < T) & (offs_m[:, None] >= offs_n[None, :]) & (doc_q[:, None] == doc_k[None, :])
            qk = tl.where(valid, tl.dot(q, tl.trans(k)) * qk_scale, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # a row with no key of its document in this tile keeps m = -1e30: zero its p explicitly
            p = tl.where(valid, tl.exp2(qk - m_new[:, None]), 0.0)
            alpha = tl.exp2(m_i - m_new)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # rows past T only
    acc = acc / l_i[:, None]
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)
    tl.store(O + b * sob + h * soh + offs_m[:, None].to(tl.int64) * sot + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_mask)


@triton.jit
def _doc_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, DOC,
                   sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sdob, sdoh, sdot, sdqb, sdqh, sdqt,
                   sdb, H, T, GROUP, qk_scale, sm_scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m[:, None] < T
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :], mask=row_mask,
                other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None].to(tl.int64) * sdot + offs_d[None, :], mask=row_mask,
                 other=0.0)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None].to(tl.int64) * sot + offs_d[None, :], mask=row_mask,
                other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # stored for the dK / dV kernel, launched after
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)
    DOC_base = DOC + b * sdb
    q_lo, q_hi, doc_q = _id_range(DOC_base, offs_m, T)
    K_base = K + b * skb + hk * skh
    V_base = V + b * svb + hk * svh
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for start_n in range(0, tl.minimum(start_m + BLOCK_M, T), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_lo, k_hi, doc_k = _id_range(DOC_base, offs_n, T)
        if (k_hi >= q_lo) & (k_lo <= q_hi):
            col = offs_n[:, None] < T
            k = tl.load(K_base + offs_n[:, None].to(tl.int64) * skt + offs_d[None, :], mask=col, other=0.0)
            v = tl.load(V_base + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :], mask=col, other=0.0)
            valid = (offs_n[None, :] < T) & (offs_m[:, None] >= offs_n[None, :]) & (doc_q[:, None] == doc_k[None, :])
            p = tl.where(valid, tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq)
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None].to(tl.int64) * sdqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_mask)


@triton.jit
def _doc_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DOC,
                     sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
                     sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, sdb,
                     H, HK, T, GROUP, qk_scale, sm_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    bhk = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    b = (bhk // HK).to(tl.int64)
    hk = (bhk % HK).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_mask = offs_n[:, None] < T
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None].to(tl.int64) * skt + offs_d[None, :], mask=col_mask,
                other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :], mask=col_mask,
                other=0.0)
    DOC_base = DOC + b * sdb
    k_lo, k_hi, doc_k = _id_range(DOC_base, offs_n, T)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    lo = (start_n // BLOCK_M) * BLOCK_M  # queries before the key block see none of it
    for g in range(GROUP):
        h = hk * GROUP + g
        Q_base = Q + b * sqb + h * sqh
        DO_base = DO + b * sdob + h * sdoh
        LSE_base = LSE + (b * H + h) * T
        DELTA_base = DELTA + (b * H + h) * T
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_lo, q_hi, doc_q = _id_range(DOC_base, offs_m, T)
            if (k_hi >= q_lo) & (k_lo <= q_hi):
                rows = offs_m[:, None] < T
                q = tl.load(Q_base + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :], mask=rows, other=0.0)
                do = tl.load(DO_base + offs_m[:, None].to(tl.int64) * sdot + offs_d[None, :], mask=rows, other=0.0)
                lse = tl.load(LSE_base + offs_m, mask=offs_m < T, other=0.0)
                delta = tl.load(DELTA_base + offs_m, mask=offs_m < T, other=0.0)
                valid = ((offs_m[None, :] < T) & (offs_m[None, :] >= offs_n[:, None])
                         & (doc_q[None, :] == doc_k[:, None]))
                pT = tl.where(valid, tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :]), 0.0)
                dv = tl.dot(pT.to(do.dtype), do, dv)
                dpT = tl.dot(v, tl.trans(do))
                dsT = pT * (dpT - delta[None, :])
                dk = tl.dot(dsT.to(q.dtype), q, dk)
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None].to(tl.int64) * sdkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=col_mask)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None].to(tl.int64) * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_mask)


def _doc_ids_int32(doc_ids: torch.Tensor) -> torch.Tensor:
    doc = doc_ids if doc_ids.dtype == torch.int32 else doc_ids.to(torch.int32)
    return doc if doc.stride(-1) == 1 else doc.contiguous()


def flash_attn_documents_fwd(q, k, v, doc_ids, scale: float, config=None):
    """(o, lse) of document-causal attention; lse (B, H, T) fp32, base 2."""
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    doc = _doc_ids_int32(doc_ids)
    B, H, T, D = q.shape
    group = H // k.shape[1]
    o = _new_output(q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    qk_scale = scale * _LOG2E

    def run(cfg):
        grid = (B * H, cdiv(T, cfg["BLOCK_M"]))
        _doc_fwd_kernel[grid](q, k, v, o, lse, doc, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                              doc.stride(0), H, T, group, qk_scale, HEAD_DIM=D, **cfg)

    if config is None:
        config = default_tuner().pick("flash_attn_documents_fwd", (D, shape_bucket(T), q.dtype),
                                      _configs("fwd", D, q.is_cuda, False), run, q.device)
    run(dict(config))
    return o, lse


def flash_attn_documents_bwd(q, k, v, o, lse, do, doc_ids, scale: float):
    """(dq, dk, dv) for the forward that produced ``o`` and ``lse``."""
    q, k, v, do, o = (_last_contiguous(t) for t in (q, k, v, do, o))
    doc = _doc_ids_int32(doc_ids)
    B, H, T, D = q.shape
    HK = k.shape[1]
    group = H // HK
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qk_scale = scale * _LOG2E

    def run_dq(cfg):
        _doc_dq_kernel[(B * H, cdiv(T, cfg["BLOCK_M"]))](
            q, k, v, o, do, lse, delta, dq, doc, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            *_strides(do), *_strides(dq), doc.stride(0), H, T, group, qk_scale, scale, HEAD_DIM=D, **cfg)

    def run_dkdv(cfg):
        _doc_dkdv_kernel[(B * HK, cdiv(T, cfg["BLOCK_N"]))](
            q, k, v, do, lse, delta, dk, dv, doc, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            *_strides(dk), *_strides(dv), doc.stride(0), H, HK, T, group, qk_scale, scale, HEAD_DIM=D, **cfg)

    tuner = default_tuner()
    key = (D, shape_bucket(T), q.dtype, group > 1)
    run_dq(dict(tuner.pick("flash_attn_documents_dq", key, _configs("dq", D, q.is_cuda, False), run_dq, q.device)))
    run_dkdv(dict(tuner.pick("flash_attn_documents_dkdv", key, _configs("dkdv", D, q.is_cuda, False), run_dkdv,
                             q.device)))
    return dq, dk, dv


# ---- torch.compile: custom ops -----------------------------------------------------------------


@torch.library.custom_op("lightning_perf::flash_attn_documents", mutates_args=())
def _doc_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_documents_fwd(q, k, v, doc_ids, scale)


@_doc_op.register_fake
def _(q, k, v, doc_ids, scale):
    B, H, T, D = q.shape
    return _new_output(q), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("lightning_perf::flash_attn_documents_bwd", mutates_args=())
def _doc_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                do: torch.Tensor, doc_ids: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attn_documents_bwd(q, k, v, o, lse, do, doc_ids, scale)


@_doc_bwd_op.register_fake
def _(q, k, v, o, lse, do, doc_ids, scale):
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, doc_ids, scale = inputs
    o, lse = output
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, o, lse, doc_ids)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, doc_ids = ctx.saved_tensors
    dq, dk, dv = _doc_bwd_op(q, k, v, o, lse, do, doc_ids, ctx.scale)
    return dq, dk, dv, None, None


_doc_op.register_autograd(_backward, setup_context=_setup)


class DocumentFlashAttentionFunction(torch.autograd.Function):
    """Eager path; saves q, k, v, o, the fp32 LSE and the document ids."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, scale: float):
        o, lse = flash_attn_documents_fwd(q, k, v, doc_ids, scale)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, o, lse, doc_ids)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, doc_ids = ctx.saved_tensors
        dq, dk, dv = flash_attn_documents_bwd(q, k, v, o, lse, do, doc_ids, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention_documents(q, k, v, doc_ids, scale: float) -> torch.Tensor:
    """Document-causal attention; :func:`flash_attention` checks the arguments before calling it."""
    if torch.compiler.is_compiling():
        return _doc_op(q, k, v, doc_ids, scale)[0]
    return DocumentFlashAttentionFunction.apply(q, k, v, doc_ids, scale)
