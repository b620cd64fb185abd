"""Flash attention (forward and backward) in Triton, causal or not, with grouped-query attention.

For one head, S = scale * Q K^T (T x T), P = softmax(S) row-wise (causal: S[i, j] = -inf for j > i),
O = P V. The forward streams K / V blocks through an online softmax (running max m, running sum l,
base-2 exponentials with scale * log2(e) folded in) and saves LSE = m + log2(l) per row. The
backward recomputes P = exp2(S * log2(e) - LSE) block by block:
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta) with delta = rowsum(dO * O),
    dK = scale * dS^T Q,  dQ = scale * dS K,
in one of two ways, timed against each other on the GPU per shape: "split", two kernels (dQ per
query block, which also writes delta; then dK/dV per key block, looping over the query heads of its
group), no atomics but S and dP computed twice (seven matmuls per block pair); or "fused", a small
delta kernel then one pass per key block that also adds dS K into an fp32 dQ buffer with atomics
(five matmuls). Accumulation is fp32; blocks on the causal diagonal and the sequence tail are
masked, all others run unmasked.

Packed documents (``HAS_DOCS``, a compile-time flag of the same forward, dQ and dK/dV kernels):
with d = doc_ids[b] (B, T), S[i, j] = -inf unless d[i] == d[j] and j <= i. The causal loops are
walked as above; a (query block, key block) pair whose id ranges [min, max] do not meet is skipped
without loading its tiles, every other tile is masked to same-document pairs. Every row sees itself,
so no row is empty. The backward is the two-kernel one. With the flag off the kernels compile to
the plain causal / full ones (the document branches are compile-time and the id pointer is None).

Shapes: q (B, H, T, D), k / v (B, Hkv, T, D) with H % Hkv == 0, D a power of two in [16, 256],
any T. The output is (B, H, T, D) laid out as (B, T, H, D) in memory, so the model's
``transpose(1, 2).reshape(B, T, H * D)`` is free.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_perf.kernels._utils import can_launch, launch_device, cdiv

try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernels only
    TensorDescriptor = None
from lightning_perf.kernels.autotune import default_tuner, shape_bucket

__all__ = ["flash_attention", "attention_reference", "FlashAttentionFunction", "flash_attention_supported"]

_LOG2E = 1.4426950408889634
_HEAD_DIMS = (16, 32, 64, 128, 256)


# ---- forward -----------------------------------------------------------------------------------


@triton.jit
def _id_range(DOC_base, offs, T):
    """(min, max) of the document ids at ``offs`` inside [0, T), and the ids (-1 past T)."""
    ids = tl.load(DOC_base + offs, mask=offs < T, other=-1)
    return tl.min(tl.where(offs < T, ids, 2147483647)), tl.max(ids), ids


@triton.jit
def _blocks_meet(lo_a, hi_a, lo_b, hi_b):
    """Whether two blocks' document id ranges overlap: a pair that does not is skipped unloaded."""
    return (hi_a >= lo_b) & (lo_a <= hi_b)


@triton.jit
def _online_softmax_step(acc, l_i, m_i, q, k, offs_m, start_n, T, qk_scale,
                         MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_DOCS: tl.constexpr = False, doc_q=None, doc_k=None):
    """Scores of q against one key tile, folded into the running max / sum; returns the rescaled
    accumulator, the new sum and max, and the tile's probabilities (for ``acc += p @ v``)."""
    qk = tl.dot(q, tl.trans(k))
    if HAS_DOCS:
        valid = doc_q[:, None] == doc_k[None, :]
        if MASK:  # the diagonal tile (documents imply causal)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            valid = valid & (offs_n[None, :] < T) & (offs_m[:, None] >= offs_n[None, :])
        qk = tl.where(valid, qk * qk_scale, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a row with no key of its document in this tile keeps m = -1e30: zero its p explicitly
        p = tl.where(valid, tl.exp2(qk - m_new[:, None]), 0.0)
    elif MASK:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        qk = tl.where(valid, qk * qk_scale, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
    else:
        # unmasked tiles: the row max of the raw scores times the (positive) scale is the max of the
        # scaled scores, so scaling and subtracting the max is one FMA per score, not a multiply and
        # a subtract
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.sum(p, 1), m_new, p


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, K_base, V_base, skt, svt, offs_m, offs_d, start_n, T, qk_scale,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_DOCS: tl.constexpr = False, doc_q=None, doc_k=None):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_ptrs = K_base + offs_n[:, None].to(tl.int64) * skt + offs_d[None, :]
    v_ptrs = V_base + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :]
    if MASK:
        k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
    else:
        k = tl.load(k_ptrs)
    acc, l_i, m_new, p = _online_softmax_step(acc, l_i, m_i, q, k, offs_m, start_n, T, qk_scale, MASK, CAUSAL,
                                              BLOCK_N, HAS_DOCS, doc_q, doc_k)
    if MASK:
        v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K_base, V_base, skt, svt, offs_m, offs_d, lo, hi, T, qk_scale,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_DOCS: tl.constexpr = False, DOC_base=None, q_lo=None, q_hi=None, doc_q=None):
    for start_n in range(lo, hi, BLOCK_N):
        if HAS_DOCS:
            k_lo, k_hi, doc_k = _id_range(DOC_base, start_n + tl.arange(0, BLOCK_N), T)
            if _blocks_meet(q_lo, q_hi, k_lo, k_hi):
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K_base, V_base, skt, svt, offs_m, offs_d, start_n, T,
                                          qk_scale, MASK, CAUSAL, BLOCK_N, HAS_DOCS, doc_q, doc_k)
        else:
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K_base, V_base, skt, svt, offs_m, offs_d, start_n, T,
                                      qk_scale, MASK, CAUSAL, BLOCK_N)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, DOC,
                sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                H, T, GROUP, qk_scale,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                HAS_DOCS: tl.constexpr = False):
    bh = tl.program_id(0)
    block = tl.program_id(1)
    if CAUSAL:  # the last query blocks see the most keys: launch them first
        block = tl.num_programs(1) - 1 - block
    start_m = block * BLOCK_M
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m[:, None] < T
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :], mask=row_mask,
                other=0.0)
    K_base = K + b * skb + hk * skh
    V_base = V + b * svb + hk * svh
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    DOC_base = DOC
    q_lo = None
    q_hi = None
    doc_q = None
    if HAS_DOCS:  # causal, and every tile masked to same-document pairs too (skipped where there are none)
        DOC_base = DOC + b * T
        q_lo, q_hi, doc_q = _id_range(DOC_base, offs_m, T)
    if CAUSAL:
        # blocks left of the diagonal need no mask; the diagonal block masks j > i and j >= T
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, skt, svt, offs_m, offs_d, 0, start_m, T,
                                   qk_scale, False, CAUSAL, BLOCK_N, HAS_DOCS, DOC_base, q_lo, q_hi, doc_q)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, skt, svt, offs_m, offs_d, start_m,
                                   tl.minimum(start_m + BLOCK_M, T), T, qk_scale, True, CAUSAL, BLOCK_N, HAS_DOCS,
                                   DOC_base, q_lo, q_hi, doc_q)
    else:
        full = (T // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, skt, svt, offs_m, offs_d, 0, full, T,
                                   qk_scale, False, CAUSAL, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, skt, svt, offs_m, offs_d, full, T, T,
                                   qk_scale, True, CAUSAL, BLOCK_N)
    if HAS_DOCS:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)  # rows past T may see no key of their id; every other row sees itself
    acc = acc / l_i[:, None]
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)
    tl.store(O + b * sob + h * soh + offs_m[:, None].to(tl.int64) * sot + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_mask)


# ---- forward with tensor descriptors (TMA on Hopper) --------------------------------------------
#
# The same online softmax, but every Q / K / V / O tile moves through a 4-D tensor descriptor over
# the (B, H, T, D) view: on sm90+ these are TMA bulk copies (no per-element address arithmetic, rows
# past T zero-filled on load and dropped on store). Timed against the pointer kernel per shape.


@triton.jit
def _fwd_tma_inner(acc, l_i, m_i, q, k_desc, v_desc, b, hk, offs_m, lo, hi, T, qk_scale,
                   MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k = k_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc, l_i, m_new, p = _online_softmax_step(acc, l_i, m_i, q, k, offs_m, start_n, T, qk_scale, MASK, CAUSAL,
                                                  BLOCK_N)
        v = v_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_tma_kernel(q_desc, k_desc, v_desc, o_desc, LSE, H, T, GROUP, qk_scale,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    bh = tl.program_id(0)
    block = tl.program_id(1)
    if CAUSAL:
        block = tl.num_programs(1) - 1 - block
    start_m = block * BLOCK_M
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if CAUSAL:
        acc, l_i, m_i = _fwd_tma_inner(acc, l_i, m_i, q, k_desc, v_desc, b, hk, offs_m, 0, start_m, T, qk_scale,
                                       False, CAUSAL, BLOCK_N, HEAD_DIM)
        acc, l_i, m_i = _fwd_tma_inner(acc, l_i, m_i, q, k_desc, v_desc, b, hk, offs_m, start_m,
                                       tl.minimum(start_m + BLOCK_M, T), T, qk_scale, True, CAUSAL, BLOCK_N, HEAD_DIM)
    else:
        full = (T // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_tma_inner(acc, l_i, m_i, q, k_desc, v_desc, b, hk, offs_m, 0, full, T, qk_scale,
                                       False, CAUSAL, BLOCK_N, HEAD_DIM)
        acc, l_i, m_i = _fwd_tma_inner(acc, l_i, m_i, q, k_desc, v_desc, b, hk, offs_m, full, T, T, qk_scale,
                                       True, CAUSAL, BLOCK_N, HEAD_DIM)
    acc = acc / l_i[:, None]
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)
    o_desc.store([b, h, start_m, 0], acc.to(q.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))


# ---- backward ----------------------------------------------------------------------------------


@triton.jit
def _dkdv_step(dk, dv, k, v, q, do, lse, delta, offs_m, offs_n, T, qk_scale,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr = False, doc_q=None, doc_k=None):
    """One query tile's contribution to a key tile's dK (unscaled) and dV; also dS^T (input dtype),
    from which the one-pass backward takes dQ (the two-kernel callers ignore it)."""
    pT = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
    if HAS_DOCS:
        valid = doc_k[:, None] == doc_q[None, :]
        if MASK:
            valid = valid & (offs_m[None, :] < T) & (offs_m[None, :] >= offs_n[:, None])
        pT = tl.where(valid, pT, 0.0)
    elif MASK:
        valid = offs_m[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        pT = tl.where(valid, pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
    dk = tl.dot(dsT, q, dk)
    return dk, dv, dsT


@triton.jit
def _load_row_stats(LSE_base, DELTA_base, offs_m, T, MASK: tl.constexpr):
    """The forward's log-sum-exp and the backward's ``delta`` for query rows ``offs_m``."""
    if MASK:
        lse = tl.load(LSE_base + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(DELTA_base + offs_m, mask=offs_m < T, other=0.0)
    else:
        lse = tl.load(LSE_base + offs_m)
        delta = tl.load(DELTA_base + offs_m)
    return lse, delta


@triton.jit
def _load_query_tile(q_ptrs, do_ptrs, LSE_base, DELTA_base, offs_m, T, MASK: tl.constexpr):
    """A backward step's query rows: ``q``, ``dO`` and the rows' statistics (rows past ``T`` read as zeros)."""
    if MASK:
        q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
        lse = tl.load(LSE_base + offs_m, mask=offs_m < T, other=0.0)
        do = tl.load(do_ptrs, mask=offs_m[:, None] < T, other=0.0)
        delta = tl.load(DELTA_base + offs_m, mask=offs_m < T, other=0.0)
    else:
        q = tl.load(q_ptrs)
        lse = tl.load(LSE_base + offs_m)
        do = tl.load(do_ptrs)
        delta = tl.load(DELTA_base + offs_m)
    return q, do, lse, delta


@triton.jit
def _dkdv_tile(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, sqt, sdot, offs_n, offs_d, start_m, T,
               qk_scale, MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               HAS_DOCS: tl.constexpr = False, doc_q=None, doc_k=None):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_ptrs = Q_base + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :]
    do_ptrs = DO_base + offs_m[:, None].to(tl.int64) * sdot + offs_d[None, :]
    q, do, lse, delta = _load_query_tile(q_ptrs, do_ptrs, LSE_base, DELTA_base, offs_m, T, MASK)
    dk, dv, _ = _dkdv_step(dk, dv, k, v, q, do, lse, delta, offs_m, offs_n, T, qk_scale, MASK, CAUSAL, HAS_DOCS,
                           doc_q, doc_k)
    return dk, dv


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, sqt, sdot, offs_n, offs_d, lo, hi, T,
                    qk_scale, MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    HAS_DOCS: tl.constexpr = False, DOC_base=None, k_lo=None, k_hi=None, doc_k=None):
    for start_m in range(lo, hi, BLOCK_M):
        if HAS_DOCS:
            q_lo, q_hi, doc_q = _id_range(DOC_base, start_m + tl.arange(0, BLOCK_M), T)
            if _blocks_meet(q_lo, q_hi, k_lo, k_hi):
                dk, dv = _dkdv_tile(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, sqt, sdot, offs_n, offs_d,
                                    start_m, T, qk_scale, MASK, CAUSAL, BLOCK_M, HAS_DOCS, doc_q, doc_k)
        else:
            dk, dv = _dkdv_tile(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, sqt, sdot, offs_n, offs_d,
                                start_m, T, qk_scale, MASK, CAUSAL, BLOCK_M)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DOC,
                     sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
                     sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                     H, HK, T, GROUP, qk_scale, sm_scale,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HAS_DOCS: tl.constexpr = False):
    bhk = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N  # the first key blocks are seen by the most queries (causal)
    b = (bhk // HK).to(tl.int64)
    hk = (bhk % HK).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_mask = offs_n[:, None] < T
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None].to(tl.int64) * skt + offs_d[None, :], mask=col_mask,
                other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :], mask=col_mask,
                other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    full = (T // BLOCK_M) * BLOCK_M
    DOC_base = DOC
    k_lo = None
    k_hi = None
    doc_k = None
    if HAS_DOCS:
        DOC_base = DOC + b * T
        k_lo, k_hi, doc_k = _id_range(DOC_base, offs_n, T)
    for g in range(GROUP):
        h = hk * GROUP + g
        Q_base = Q + b * sqb + h * sqh
        DO_base = DO + b * sdob + h * sdoh
        LSE_base = LSE + (b * H + h) * T
        DELTA_base = DELTA + (b * H + h) * T
        lo = 0
        if CAUSAL:
            # queries before start_n see none of these keys; the diagonal block is masked
            lo = start_n + BLOCK_N
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, sqt, sdot, offs_n,
                                     offs_d, start_n, tl.minimum(lo, T), T, qk_scale, True, CAUSAL, BLOCK_M, HAS_DOCS,
                                     DOC_base, k_lo, k_hi, doc_k)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, sqt, sdot, offs_n, offs_d,
                                 lo, full, T, qk_scale, False, CAUSAL, BLOCK_M, HAS_DOCS, DOC_base, k_lo, k_hi, doc_k)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, sqt, sdot, offs_n, offs_d,
                                 tl.maximum(lo, full), T, T, qk_scale, True, CAUSAL, BLOCK_M, HAS_DOCS, DOC_base, k_lo,
                                 k_hi, doc_k)
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None].to(tl.int64) * sdkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=col_mask)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None].to(tl.int64) * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_mask)


@triton.jit
def _bwd_dkdv_tma_inner(dk, dv, k, v, q_desc, do_desc, LSE_base, DELTA_base, b, h, offs_n, lo, hi, T, qk_scale,
                        MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # rows past T arrive as zeros
        do = do_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        lse, delta = _load_row_stats(LSE_base, DELTA_base, offs_m, T, MASK)
        dk, dv, _ = _dkdv_step(dk, dv, k, v, q, do, lse, delta, offs_m, offs_n, T, qk_scale, MASK, CAUSAL)
    return dk, dv


@triton.jit
def _bwd_dkdv_tma_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, H, HK, T, GROUP, qk_scale,
                         sm_scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    """:func:`_bwd_dkdv_kernel` with every tile through tensor descriptors."""
    bhk = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    b = bhk // HK
    hk = bhk % HK
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = k_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = v_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    full = (T // BLOCK_M) * BLOCK_M
    for g in range(GROUP):
        h = hk * GROUP + g
        LSE_base = LSE + (b * H + h).to(tl.int64) * T
        DELTA_base = DELTA + (b * H + h).to(tl.int64) * T
        lo = 0
        if CAUSAL:
            lo = start_n + BLOCK_N
            dk, dv = _bwd_dkdv_tma_inner(dk, dv, k, v, q_desc, do_desc, LSE_base, DELTA_base, b, h, offs_n, start_n,
                                         tl.minimum(lo, T), T, qk_scale, True, CAUSAL, BLOCK_M, HEAD_DIM)
        dk, dv = _bwd_dkdv_tma_inner(dk, dv, k, v, q_desc, do_desc, LSE_base, DELTA_base, b, h, offs_n, lo, full, T,
                                     qk_scale, False, CAUSAL, BLOCK_M, HEAD_DIM)
        dk, dv = _bwd_dkdv_tma_inner(dk, dv, k, v, q_desc, do_desc, LSE_base, DELTA_base, b, h, offs_n,
                                     tl.maximum(lo, full), T, T, qk_scale, True, CAUSAL, BLOCK_M, HEAD_DIM)
    dk_desc.store([b, hk, start_n, 0], (dk * sm_scale).to(k.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))
    dv_desc.store([b, hk, start_n, 0], dv.to(k.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))


@triton.jit
def _dq_tile(dq, q, do, lse, delta, K_base, V_base, skt, svt, offs_m, offs_d, start_n, T, qk_scale,
             MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_DOCS: tl.constexpr = False, doc_q=None, doc_k=None):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_ptrs = K_base + offs_n[:, None].to(tl.int64) * skt + offs_d[None, :]
    v_ptrs = V_base + offs_n[:, None].to(tl.int64) * svt + offs_d[None, :]
    if MASK:
        k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
        v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
    if HAS_DOCS:
        valid = doc_q[:, None] == doc_k[None, :]
        if MASK:
            valid = valid & (offs_n[None, :] < T) & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, p, 0.0)
    elif MASK:
        valid = offs_n[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K_base, V_base, skt, svt, offs_m, offs_d, lo, hi, T, qk_scale,
                  MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_DOCS: tl.constexpr = False, DOC_base=None, q_lo=None, q_hi=None, doc_q=None):
    for start_n in range(lo, hi, BLOCK_N):
        if HAS_DOCS:
            k_lo, k_hi, doc_k = _id_range(DOC_base, start_n + tl.arange(0, BLOCK_N), T)
            if _blocks_meet(q_lo, q_hi, k_lo, k_hi):
                dq = _dq_tile(dq, q, do, lse, delta, K_base, V_base, skt, svt, offs_m, offs_d, start_n, T, qk_scale,
                              MASK, CAUSAL, BLOCK_N, HAS_DOCS, doc_q, doc_k)
        else:
            dq = _dq_tile(dq, q, do, lse, delta, K_base, V_base, skt, svt, offs_m, offs_d, start_n, T, qk_scale,
                          MASK, CAUSAL, BLOCK_N)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, DOC,
                   sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, sdob, sdoh, sdot, sdqb, sdqh, sdqt,
                   H, T, GROUP, qk_scale, sm_scale,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HAS_DOCS: tl.constexpr = False):
    bh = tl.program_id(0)
    block = tl.program_id(1)
    if CAUSAL:
        block = tl.num_programs(1) - 1 - block
    start_m = block * BLOCK_M
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
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    # delta = rowsum(dO * O): computed here and stored for the dK/dV kernel, launched after this one
    o = tl.load(O + b * sob + h * soh + offs_m[:, None].to(tl.int64) * sot + offs_d[None, :], mask=row_mask,
                other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)
    K_base = K + b * skb + hk * skh
    V_base = V + b * svb + hk * svh
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    DOC_base = DOC
    q_lo = None
    q_hi = None
    doc_q = None
    if HAS_DOCS:
        DOC_base = DOC + b * T
        q_lo, q_hi, doc_q = _id_range(DOC_base, offs_m, T)
    if CAUSAL:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K_base, V_base, skt, svt, offs_m, offs_d, 0, start_m, T, qk_scale,
                           False, CAUSAL, BLOCK_N, HAS_DOCS, DOC_base, q_lo, q_hi, doc_q)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K_base, V_base, skt, svt, offs_m, offs_d, start_m,
                           tl.minimum(start_m + BLOCK_M, T), T, qk_scale, True, CAUSAL, BLOCK_N, HAS_DOCS, DOC_base,
                           q_lo, q_hi, doc_q)
    else:
        full = (T // BLOCK_N) * BLOCK_N
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K_base, V_base, skt, svt, offs_m, offs_d, 0, full, T, qk_scale,
                           False, CAUSAL, BLOCK_N)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K_base, V_base, skt, svt, offs_m, offs_d, full, T, T, qk_scale,
                           True, CAUSAL, BLOCK_N)
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None].to(tl.int64) * sdqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_mask)


# ---- backward, one pass: dK / dV per key block, dQ by fp32 atomic adds ---------------------------
#
# Five matmuls per (key block, query block) instead of seven: S and dP are computed once, for dK /
# dV and dQ together; the price is BLOCK_M x D fp32 atomic adds per pair and a zero-filled fp32 dQ
# buffer. Which of the two backwards is faster depends on the shape (the atomics grow with T / BLOCK_N),
# so the launcher times both on the GPU and keeps the faster.


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, sob, soh, sot, sdob, sdoh, sdot, H, T,
                      BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m[:, None] < T
    o = tl.load(O + b * sob + h * soh + offs_m[:, None].to(tl.int64) * sot + offs_d[None, :], mask=row_mask,
                other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None].to(tl.int64) * sdot + offs_d[None, :], mask=row_mask,
                 other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1),
             mask=offs_m < T)


@triton.jit
def _bwd_fused_inner(dk, dv, k, v, Q_base, DO_base, DQ_base, LSE_base, DELTA_base, sqt, sdot, sdqt, offs_n, offs_d,
                     lo, hi, T, qk_scale, MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = Q_base + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :]
        do_ptrs = DO_base + offs_m[:, None].to(tl.int64) * sdot + offs_d[None, :]
        dq_ptrs = DQ_base + offs_m[:, None].to(tl.int64) * sdqt + offs_d[None, :]
        q, do, lse, delta = _load_query_tile(q_ptrs, do_ptrs, LSE_base, DELTA_base, offs_m, T, MASK)
        dk, dv, dsT = _dkdv_step(dk, dv, k, v, q, do, lse, delta, offs_m, offs_n, T, qk_scale, MASK, CAUSAL)
        dq = tl.dot(tl.trans(dsT), k)  # (BLOCK_M, D), unscaled; fp32
        if MASK:
            tl.atomic_add(dq_ptrs, dq, mask=offs_m[:, None] < T, sem="relaxed")
        else:
            tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_fused_kernel(Q, K, V, DO, DQ, LSE, DELTA, DK, DV,
                      sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot, sdqb, sdqh, sdqt,
                      sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                      H, HK, T, GROUP, qk_scale, sm_scale,
                      CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
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
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    full = (T // BLOCK_M) * BLOCK_M
    for g in range(GROUP):
        h = hk * GROUP + g
        Q_base = Q + b * sqb + h * sqh
        DO_base = DO + b * sdob + h * sdoh
        DQ_base = DQ + b * sdqb + h * sdqh
        LSE_base = LSE + (b * H + h) * T
        DELTA_base = DELTA + (b * H + h) * T
        lo = 0
        if CAUSAL:
            lo = start_n + BLOCK_N
            dk, dv = _bwd_fused_inner(dk, dv, k, v, Q_base, DO_base, DQ_base, LSE_base, DELTA_base, sqt, sdot, sdqt,
                                      offs_n, offs_d, start_n, tl.minimum(lo, T), T, qk_scale, True, CAUSAL, BLOCK_M)
        dk, dv = _bwd_fused_inner(dk, dv, k, v, Q_base, DO_base, DQ_base, LSE_base, DELTA_base, sqt, sdot, sdqt,
                                  offs_n, offs_d, lo, full, T, qk_scale, False, CAUSAL, BLOCK_M)
        dk, dv = _bwd_fused_inner(dk, dv, k, v, Q_base, DO_base, DQ_base, LSE_base, DELTA_base, sqt, sdot, sdqt,
                                  offs_n, offs_d, tl.maximum(lo, full), T, T, qk_scale, True, CAUSAL, BLOCK_M)
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None].to(tl.int64) * sdkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=col_mask)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None].to(tl.int64) * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_mask)


# ---- launch configurations ---------------------------------------------------------------------


def _cfg(bm, bn, w, s):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def _fwd_configs(D: int, cuda: bool) -> list[dict]:
    if not cuda:
        return [_cfg(16, 16, 4, 1)]
    if D <= 64:
        return [_cfg(128, 64, 4, 3), _cfg(128, 128, 8, 3), _cfg(128, 64, 4, 4), _cfg(128, 128, 4, 3),
                _cfg(64, 64, 4, 3), _cfg(128, 32, 4, 4)]
    if D <= 128:
        return [_cfg(128, 64, 8, 3), _cfg(128, 128, 8, 2), _cfg(128, 64, 4, 3), _cfg(128, 128, 8, 3),
                _cfg(64, 64, 4, 3), _cfg(128, 32, 4, 3), _cfg(64, 32, 4, 4), _cfg(128, 64, 8, 4), _cfg(64, 64, 4, 4),
                _cfg(64, 128, 4, 3)]
    return [_cfg(64, 32, 4, 2), _cfg(64, 64, 8, 2), _cfg(128, 32, 8, 2), _cfg(32, 32, 4, 2)]


def _dkdv_configs(D: int, cuda: bool) -> list[dict]:
    if not cuda:
        return [_cfg(16, 16, 4, 1)]
    if D <= 64:
        return [_cfg(32, 128, 4, 3), _cfg(64, 128, 8, 3), _cfg(32, 128, 8, 2), _cfg(64, 64, 4, 3),
                _cfg(32, 64, 4, 4)]
    if D <= 128:
        return [_cfg(64, 128, 8, 2), _cfg(32, 128, 8, 2), _cfg(64, 128, 8, 3), _cfg(32, 128, 4, 3),
                _cfg(64, 64, 4, 2), _cfg(32, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(64, 64, 8, 2), _cfg(32, 128, 8, 3),
                _cfg(16, 128, 4, 3)]
    return [_cfg(32, 64, 8, 2), _cfg(16, 64, 4, 2), _cfg(32, 32, 4, 2), _cfg(16, 32, 4, 2)]


def _dq_configs(D: int, cuda: bool) -> list[dict]:
    if not cuda:
        return [_cfg(16, 16, 4, 1)]
    if D <= 64:
        return [_cfg(128, 32, 4, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(128, 64, 4, 4),
                _cfg(64, 32, 4, 4)]
    if D <= 128:
        return [_cfg(128, 64, 8, 2), _cfg(128, 32, 8, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3),
                _cfg(128, 32, 4, 3), _cfg(64, 32, 4, 3), _cfg(128, 64, 4, 3), _cfg(64, 64, 4, 2), _cfg(128, 128, 8, 2)]
    return [_cfg(64, 32, 8, 2), _cfg(64, 16, 4, 2), _cfg(32, 32, 4, 2), _cfg(32, 16, 4, 2)]


# deeper software pipelines for the head dims of real models (Hopper has the shared memory for them):
# the tuner times these beside the lists above
_DEEP_STAGES_D128 = {
    "fwd": [_cfg(64, 64, 4, 5), _cfg(128, 64, 8, 4), _cfg(64, 64, 8, 4), _cfg(128, 64, 8, 5)],
    "dq": [_cfg(128, 32, 4, 5), _cfg(64, 32, 4, 5), _cfg(128, 64, 8, 4)],
    "dkdv": [_cfg(32, 128, 4, 4), _cfg(32, 128, 4, 5), _cfg(32, 64, 4, 5), _cfg(64, 128, 8, 4)],
    "fused": [_cfg(32, 128, 4, 4), _cfg(32, 128, 4, 5), _cfg(64, 128, 8, 4)],
}


def usable_configs(kernel: str, configs, causal: bool) -> list[dict]:
    """The configs whose block sizes the kernel's loops can walk.

    With causal masking the query-block kernels (forward, dQ) run unmasked up to the diagonal
    block in steps of BLOCK_N, so BLOCK_N must divide BLOCK_M; the dK/dV kernel steps over
    query blocks from its key block's start, so BLOCK_M must divide BLOCK_N. A config breaking
    this would skip or double-count keys next to the diagonal (silently wrong, not slower).
    """
    if not causal:
        return list(configs)
    if kernel in ("dkdv", "fused"):
        return [c for c in configs if c["BLOCK_N"] % c["BLOCK_M"] == 0]
    return [c for c in configs if c["BLOCK_M"] % c["BLOCK_N"] == 0]


_CONFIG_LISTS = {"fwd": lambda D, cuda: _fwd_configs(D, cuda), "dq": lambda D, cuda: _dq_configs(D, cuda),
                 "dkdv": lambda D, cuda: _dkdv_configs(D, cuda), "fused": lambda D, cuda: _fused_configs(D, cuda)}
_config_cache: dict[tuple, list[dict]] = {}


def _configs(kernel: str, D: int, cuda: bool, causal: bool) -> list[dict]:
    """Candidate configs per (kernel, head dim, device kind, causal), built once."""
    key = (kernel, D, cuda, causal)
    if key not in _config_cache:
        configs = list(_CONFIG_LISTS[kernel](D, cuda))
        if cuda and 64 <= D <= 128:
            configs += [c for c in _DEEP_STAGES_D128[kernel] if c not in configs]
        _config_cache[key] = usable_configs(kernel, configs, causal)
    return _config_cache[key]


def _fused_configs(D: int, cuda: bool) -> list[dict]:
    if not cuda:  # key blocks twice the query blocks, as on the GPU
        return [_cfg(16, 32, 4, 1)]
    if D <= 64:
        return [_cfg(32, 128, 4, 3), _cfg(64, 128, 8, 3), _cfg(32, 128, 8, 2), _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3)]
    if D <= 128:
        return [_cfg(64, 128, 8, 2), _cfg(32, 128, 8, 2), _cfg(32, 128, 4, 3), _cfg(64, 128, 8, 3), _cfg(64, 64, 4, 3),
                _cfg(32, 64, 4, 3)]
    return [_cfg(32, 64, 8, 2), _cfg(16, 64, 4, 2), _cfg(16, 32, 4, 2)]


def _bwd_impls(cuda: bool) -> list[dict]:
    """Backward strategies the launcher chooses between: the GPU times both."""
    return [dict(impl="split"), dict(impl="fused")] if cuda else [dict(impl="split")]


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _new_output(q: torch.Tensor) -> torch.Tensor:
    B, H, T, D = q.shape
    return torch.empty((B, T, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)


def _doc_ids_int32(doc_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The kernels read row b's ids at ``DOC + b * T``: contiguous int32, or None without documents."""
    if doc_ids is None:
        return None
    return doc_ids.to(torch.int32).contiguous()


# ---- launchers ---------------------------------------------------------------------------------


def _tma_usable(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need Triton's host descriptor class, sm90+ (or the CPU interpreter), a
    16-byte aligned base and 16-byte multiples for every stride but the last (which must be 1)."""
    if TensorDescriptor is None:
        return False
    t0 = tensors[0]
    if t0.is_cuda and torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _descriptor(t: torch.Tensor, rows: int):
    """A (1, 1, rows, D) tile descriptor over the (B, H, T, D) view ``t``."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])


def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   config: Optional[dict] = None, doc_ids: Optional[torch.Tensor] = None):
    """(o, lse): o (B, H, T, D) in q's dtype, lse (B, H, T) fp32 in base 2 (log2 of the softmax sums).

    ``config`` forces one launch configuration (tests); by default the tuner picks per shape among
    the pointer kernel's and, where usable, the tensor-descriptor kernel's configurations.
    ``doc_ids`` (B, T): document-causal attention (``causal`` must be True), pointer kernel only.
    """
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    B, H, T, D = q.shape
    group = H // k.shape[1]
    o = _new_output(q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    qk_scale = scale * _LOG2E
    doc = _doc_ids_int32(doc_ids)
    docs = doc is not None

    use_tma = not docs and _tma_usable(q, k, v, o)

    def run(cfg):
        cfg = dict(cfg)
        tma = cfg.pop("TMA", False)
        grid = (B * H, cdiv(T, cfg["BLOCK_M"]))
        if tma:
            bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
            _fwd_tma_kernel[grid](_descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(o, bm), lse,
                                  H, T, group, qk_scale, CAUSAL=causal, HEAD_DIM=D, **cfg)
        else:
            _fwd_kernel[grid](q, k, v, o, lse, doc, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                              H, T, group, qk_scale, CAUSAL=causal, HEAD_DIM=D, HAS_DOCS=docs, **cfg)

    if config is None:
        configs = _configs("fwd", D, q.is_cuda, causal)
        if use_tma:
            configs = configs + [dict(c, TMA=True) for c in configs]
        name = "flash_attn_documents_fwd" if docs else "flash_attn_fwd"
        config = default_tuner().pick(name, (D, causal, shape_bucket(T), q.dtype, use_tma), configs, run, q.device)
    elif config.get("TMA") and not use_tma:
        raise ValueError("this input cannot use tensor descriptors (strides or pointer not 16-byte aligned)")
    run(config)
    return o, lse


def flash_attn_bwd(q, k, v, o, lse, do, causal: bool, scale: float, dkdv_config: Optional[dict] = None,
                   doc_ids: Optional[torch.Tensor] = None):
    """(dq, dk, dv) for the forward that produced ``o`` and ``lse``.

    ``dkdv_config`` forces the two-kernel backward with that dK/dV launch configuration (tests).
    With ``doc_ids`` the backward is the two-kernel one on pointers.
    """
    q, k, v, do = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v), _last_contiguous(do)
    B, H, T, D = q.shape
    HK = k.shape[1]
    group = H // HK
    o = _last_contiguous(o)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)  # written by the dQ kernel
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qk_scale = scale * _LOG2E
    doc = _doc_ids_int32(doc_ids)
    docs = doc is not None

    use_tma = not docs and _tma_usable(q, k, v, do, dk, dv)

    def run_dkdv(cfg):
        cfg = dict(cfg)
        grid = (B * HK, cdiv(T, cfg["BLOCK_N"]))
        if cfg.pop("TMA", False):
            bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
            _bwd_dkdv_tma_kernel[grid](_descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(do, bm),
                                       _descriptor(dk, bn), _descriptor(dv, bn), lse, delta, H, HK, T, group,
                                       qk_scale, scale, CAUSAL=causal, HEAD_DIM=D, **cfg)
            return
        _bwd_dkdv_kernel[grid](q, k, v, do, lse, delta, dk, dv, doc, *_strides(q), *_strides(k), *_strides(v),
                               *_strides(do), *_strides(dk), *_strides(dv), H, HK, T, group, qk_scale, scale,
                               CAUSAL=causal, HEAD_DIM=D, HAS_DOCS=docs, **cfg)

    def run_dq(cfg):
        grid = (B * H, cdiv(T, cfg["BLOCK_M"]))
        _bwd_dq_kernel[grid](q, k, v, o, do, lse, delta, dq, doc, *_strides(q), *_strides(k), *_strides(v),
                             *_strides(o), *_strides(do), *_strides(dq), H, T, group, qk_scale, scale,
                             CAUSAL=causal, HEAD_DIM=D, HAS_DOCS=docs, **cfg)

    tuner = default_tuner()
    key = (D, causal, shape_bucket(T), q.dtype, group > 1)
    prefix = "flash_attn_documents" if docs else "flash_attn_bwd"
    result = {}

    def split():
        run_dq(tuner.pick(f"{prefix}_dq", key, _configs("dq", D, q.is_cuda, causal), run_dq, q.device))
        if dkdv_config is not None:
            run_dkdv(dkdv_config)
        else:
            configs = _configs("dkdv", D, q.is_cuda, causal)
            if use_tma:
                configs = configs + [dict(c, TMA=True) for c in configs]
            run_dkdv(tuner.pick(f"{prefix}_dkdv", key + (use_tma,), configs, run_dkdv, q.device))
        result["dq"] = dq

    def fused():
        block = min(128, 8192 // D) if q.is_cuda else 16  # 8192-element tiles: 64 values per thread each
        _bwd_delta_kernel[(B * H, cdiv(T, block))](o, do, delta, *_strides(o), *_strides(do), H, T,
                                                   BLOCK_M=block, HEAD_DIM=D)
        dq_acc = torch.empty_like(q, dtype=torch.float32)  # q's layout, so the cast below keeps it

        def run_fused(cfg):
            dq_acc.zero_()  # atomics add into it: every launch (the tuner's too) starts from zero
            grid = (B * HK, cdiv(T, cfg["BLOCK_N"]))
            _bwd_fused_kernel[grid](q, k, v, do, dq_acc, lse, delta, dk, dv, *_strides(q), *_strides(k),
                                    *_strides(v), *_strides(do), *_strides(dq_acc), *_strides(dk), *_strides(dv),
                                    H, HK, T, group, qk_scale, scale, CAUSAL=causal, HEAD_DIM=D, **cfg)

        run_fused(tuner.pick("flash_attn_bwd_fused", key, _configs("fused", D, q.is_cuda, causal), run_fused,
                             q.device))
        result["dq"] = dq_acc.mul_(scale).to(q.dtype)

    impls = {"split": split, "fused": fused}
    if docs:  # the one-pass backward has no document mask
        split()
        return result["dq"], dk, dv
    if dkdv_config is not None:
        if dkdv_config.get("TMA") and not use_tma:
            raise ValueError("this input cannot use tensor descriptors (strides or pointer not 16-byte aligned)")
        split()
        return result["dq"], dk, dv
    impl = tuner.pick("flash_attn_bwd_impl", key, _bwd_impls(q.is_cuda), lambda cfg: impls[cfg["impl"]](),
                      q.device)
    impls[impl["impl"]]()
    return result["dq"], dk, dv


# ---- torch.compile: custom ops -----------------------------------------------------------------


@torch.library.custom_op("lightning_perf::flash_attn", mutates_args=())
def _flash_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
              doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_fwd(q, k, v, causal, scale, doc_ids=doc_ids)


@_flash_op.register_fake
def _(q, k, v, causal, scale, doc_ids=None):
    B, H, T, D = q.shape
    return _new_output(q), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("lightning_perf::flash_attn_bwd", mutates_args=())
def _flash_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  do: torch.Tensor, causal: bool, scale: float,
                  doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attn_bwd(q, k, v, o, lse, do, causal, scale, doc_ids=doc_ids)


@_flash_bwd_op.register_fake
def _(q, k, v, o, lse, do, causal, scale, doc_ids=None):
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, causal, scale, doc_ids = inputs
    o, lse = output
    ctx.causal, ctx.scale = causal, scale
    ctx.save_for_backward(q, k, v, o, lse, doc_ids)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, doc_ids = ctx.saved_tensors
    dq, dk, dv = _flash_bwd_op(q, k, v, o, lse, do, ctx.causal, ctx.scale, doc_ids)
    return dq, dk, dv, None, None, None


_flash_op.register_autograd(_backward, setup_context=_setup)


class FlashAttentionFunction(torch.autograd.Function):
    """Eager path; saves q, k, v, o, the fp32 LSE (B, H, T) and the document ids (or None)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, doc_ids: Optional[torch.Tensor] = None):
        o, lse = flash_attn_fwd(q, k, v, causal, scale, doc_ids=doc_ids)
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, o, lse, doc_ids)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, doc_ids = ctx.saved_tensors
        dq, dk, dv = flash_attn_bwd(q, k, v, o, lse, do, ctx.causal, ctx.scale, doc_ids=doc_ids)
        return dq, dk, dv, None, None, None


# ---- reference and public function -------------------------------------------------------------


def attention_reference(q, k, v, causal: bool = True, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Plain softmax(scale * Q K^T) V in fp32 with k / v heads repeated for GQA; cast back to q's dtype."""
    H, HK, T = q.shape[1], k.shape[1], q.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kf = k.float().repeat_interleave(H // HK, dim=1)
    vf = v.float().repeat_interleave(H // HK, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vf).to(q.dtype)


def _check(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention needs (B, H, T, D) tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B={B}, Hkv, T={T}, D={D})")
    if H % k.shape[1]:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({k.shape[1]})")
    if D not in _HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported; flash_attention takes {_HEAD_DIMS}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


_FWD_DEVICE = launch_device(_fwd_kernel)  # decided at import: see launch_device


def flash_attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    try:
        _check(q, k, v)
    except ValueError:
        return False
    dtypes = (torch.float16, torch.bfloat16) if q.is_cuda else (torch.float32, torch.float16)
    return q.dtype in dtypes and q.shape[2] > 0 and can_launch(_FWD_DEVICE, q, k, v)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    softmax_scale: Optional[float] = None, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(scale * q k^T [causal mask]) v for q (B, H, T, D), k / v (B, Hkv, T, D); scale 1/sqrt(D) by default.

    ``doc_ids`` (B, T) integer: document-causal attention over packed documents (token i sees j iff
    ``doc_ids[b, i] == doc_ids[b, j]`` and j <= i; see ``kernels.document_mask``); it implies
    ``causal``. The same kernels run with the document mask compiled in (``HAS_DOCS``).
    """
    _check(q, k, v)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not (scale > 0 and math.isfinite(scale)):  # the kernels scale row maxima: a positive scale keeps them maxima
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    if doc_ids is not None:
        from lightning_perf.kernels.document_mask import check_doc_ids

        if not causal:
            raise ValueError("doc_ids gives document-causal attention; causal=False cannot be combined with it")
        check_doc_ids(doc_ids, q)
    if torch.compiler.is_compiling():
        return _flash_op(q, k, v, causal, scale, doc_ids)[0]
    return FlashAttentionFunction.apply(q, k, v, causal, scale, doc_ids)
