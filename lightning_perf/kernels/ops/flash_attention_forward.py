"""Flash attention's forward kernels in Triton: an online softmax over key blocks.

For one head, S = scale * Q K^T (T x T), P = softmax(S) row-wise (causal: S[i, j] = -inf for j > i),
O = P V. The forward streams K / V blocks through an online softmax (running max m, running sum l,
base-2 exponentials with scale * log2(e) folded in) and saves LSE = m + log2(l) per row for the
backward. Accumulation is fp32; blocks on the causal diagonal and the sequence tail are masked, all
others run unmasked. Grouped-query attention: query head h reads key / value head h // GROUP.

Packed documents (``HAS_DOCS``, a compile-time flag of this forward and of the backward's dQ and dK/dV
kernels): with d = doc_ids[b] (B, T), S[i, j] = -inf unless d[i] == d[j] and j <= i. The causal loops
are walked as above; a (query block, key block) pair whose id ranges [min, max] do not meet is skipped
without loading its tiles, every other tile is masked to same-document pairs. Every row sees itself,
so no row is empty. With the flag off the kernels compile to the plain causal / full ones (the
document branches are compile-time and the id pointer is None).

Two kernels: ``_fwd_kernel`` on pointers, and ``_fwd_tma_kernel`` with every tile through tensor
descriptors (no documents). ``flash_attention_launch`` launches them and times one against the other.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
