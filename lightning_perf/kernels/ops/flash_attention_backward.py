"""Flash attention's backward kernels in Triton: dQ, dK and dV from the forward's output and LSE.

The backward recomputes P = exp2(S * log2(e) - LSE) block by block (``flash_attention_forward``):
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta) with delta = rowsum(dO * O),
    dK = scale * dS^T Q,  dQ = scale * dS K,
in one of two ways, timed against each other on the GPU per shape (``flash_attention_launch``):
"split", two kernels (dQ per query block, which also writes delta; then dK/dV per key block, looping
over the query heads of its group), no atomics but S and dP computed twice (seven matmuls per block
pair); or "fused", a small delta kernel then one pass per key block that also adds dS K into an fp32
dQ buffer with atomics (five matmuls). Accumulation is fp32; blocks on the causal diagonal and the
sequence tail are masked, all others run unmasked. Packed documents (``HAS_DOCS``) take the split
backward on pointers; its dK/dV kernel also has a tensor-descriptor form.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_perf.kernels.ops.flash_attention_forward import _blocks_meet, _id_range


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

