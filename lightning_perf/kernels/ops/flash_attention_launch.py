"""Flash attention's launchers: :func:`flash_attn_fwd` and :func:`flash_attn_bwd` pick and launch the kernels.

Each allocates the outputs ((B, H, T, D) output laid out as (B, T, H, D) in memory, fp32 LSE and
delta), asks the tuner (``kernels.autotune``) for a launch configuration per shape among
``flash_attention_configs``' candidates, and launches the forward (``flash_attention_forward``: on
pointers, or through tensor descriptors where the input allows) or the backward
(``flash_attention_backward``: split or fused, timed against each other on the GPU). Called by the
autograd Function and the custom ops of ``flash_attention``, and by ring attention per block.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_perf.kernels._utils import cdiv
from lightning_perf.kernels.autotune import default_tuner, shape_bucket
from lightning_perf.kernels.ops.flash_attention_backward import (
    _bwd_delta_kernel,
    _bwd_dkdv_kernel,
    _bwd_dkdv_tma_kernel,
    _bwd_dq_kernel,
    _bwd_fused_kernel,
)
from lightning_perf.kernels.ops.flash_attention_configs import _bwd_impls, _configs
from lightning_perf.kernels.ops.flash_attention_forward import _fwd_kernel, _fwd_tma_kernel

try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernels only
    TensorDescriptor = None

__all__ = ["flash_attn_fwd", "flash_attn_bwd"]

_LOG2E = 1.4426950408889634


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

