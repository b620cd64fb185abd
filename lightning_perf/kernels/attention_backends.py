"""Attention from well-kept libraries: the candidates behind ``attention="auto"`` and by name.

Every backend takes the GPT's layout, q (B, nh, T, hd) and k / v (B, nkv, T, hd) with nh % nkv == 0,
and returns (B, nh, T, hd):

    o[b, h, i] = sum_j softmax_j(q[b, h, i] . k[b, g, j] / sqrt(hd)) v[b, g, j],   g = h // (nh / nkv)

over j <= i when causal, over every j otherwise. The backends differ in who computes it:

- ``"cudnn"``, ``"flash"``, ``"efficient"``: ``F.scaled_dot_product_attention`` pinned to one
  SDPA backend. cuDNN and flash take grouped-query attention natively (``enable_gqa``); the
  memory-efficient backend refuses unequal head counts, so k / v are expanded to nh heads for it.
- ``"flex"``: FlexAttention with a causal ``BlockMask`` (built once per (T, device) and kept), run
  through ``torch.compile``: eagerly, ``flex_attention`` materialises the scores. GQA native.
- ``"fa3"``: FlashAttention 3 (the flash-attention repository's ``hopper/`` build, package
  ``flash-attn-3``), ``flash_attn_interface.flash_attn_func``; (B, T, nh, hd) layout, GQA native.
- ``"fa4"``: FlashAttention 4 (package ``flash-attn-4``, CuTe DSL), ``flash_attn.cute.flash_attn_func``;
  the same layout and GQA. Its kernels are compiled at run time by the CuTe DSL, which Dynamo cannot
  trace: inside ``torch.compile`` a call is a graph break (see :attr:`AttentionBackends.TRACEABLE`).
- ``"triton"``: lightning_perf's own kernel (``kernels.ops.flash_attention``).

Packed documents (``doc_ids`` (B, T), see ``kernels.document_mask``): token i attends to j iff both
lie in the same document and j <= i. :attr:`AttentionBackends.DOCUMENT_MASKED` are the backends that
take it: FlexAttention with a document ``mask_mod`` (one ``BlockMask`` per batch, shared by the
layers), the Triton kernel with per-token ids, and SDPA's memory-efficient backend with an explicit
(B, 1, T, T) boolean mask (:func:`sdpa_documents`, also the reference and CPU path). cuDNN, flash,
FA3 and FA4 here take only causal / full attention.

The GPT's q / k / v come from (B, T, nh, hd) projections transposed to (B, nh, T, hd), so the
(B, T, nh, hd) view the flash-attention packages take is a transpose back, not a copy.

The flash-attention packages are imported on first use; one that is missing or fails to load is
an unavailable candidate, never an error, except when it is asked for by name
(:func:`missing_requirement` is what ``GPTConfig`` checks).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionBackends",
    "SDPA_BACKENDS",
    "LIBRARY_BACKENDS",
    "BACKENDS",
    "missing_requirement",
    "sdpa",
    "sdpa_documents",
    "expand_kv",
]

SDPA_BACKENDS = ("cudnn", "flash", "efficient")
LIBRARY_BACKENDS = ("flex", "fa3", "fa4")
BACKENDS = SDPA_BACKENDS + LIBRARY_BACKENDS + ("triton",)

# SDPA backends that take nkv < nh key / value heads (``enable_gqa``) without expanding them
_SDPA_NATIVE_GQA = ("cudnn", "flash")

# where each flash-attention package lives, newest layout first, and what to install when none loads
_FA_MODULES = {
    "fa3": ("flash_attn_3.flash_attn_interface", "flash_attn_interface"),
    "fa4": ("flash_attn.cute",),
}
_FA_INSTALL = {
    "fa3": "FlashAttention 3 (package flash-attn-3: build the flash-attention repository's hopper/ directory, "
           "`cd hopper && pip install .`; Hopper GPUs)",
    "fa4": "FlashAttention 4 (`pip install flash-attn-4`, or the fa4 extra: `pip install lightning-perf[fa4]`; "
           "Hopper and Blackwell GPUs)",
}


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k / v (B, nkv, T, hd) repeated to q's nh heads, each kv head serving nh / nkv consecutive q heads."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def sdpa(q, k, v, causal: bool, backend: Optional[str] = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, optionally pinned to one backend; GQA through ``enable_gqa``
    where the backend takes it, else by expanding k / v."""
    if backend is not None and backend not in _SDPA_NATIVE_GQA:
        k, v = expand_kv(q, k, v)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend(backend)]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)


def sdpa_documents(q, k, v, doc_ids: torch.Tensor, backend: Optional[str] = None,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Document-causal ``F.scaled_dot_product_attention`` with an explicit boolean mask (built from
    ``doc_ids`` unless ``mask``, (B, 1, T, T), is given), optionally pinned to one SDPA backend."""
    from lightning_perf.kernels.document_mask import check_doc_ids, document_mask

    check_doc_ids(doc_ids, q)
    mask = document_mask(doc_ids) if mask is None else mask
    if backend is not None and backend not in _SDPA_NATIVE_GQA:
        k, v = expand_kv(q, k, v)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend(backend)]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


@torch.compiler.disable  # importing inside a traced model: a graph break, not a trace of importlib
def _import_first(names: tuple[str, ...]) -> Any:
    """The first of ``names`` that imports, else raise the last error (any error: a wheel built for
    another torch fails with OSError or an undefined symbol, not only ImportError)."""
    error: Optional[BaseException] = None
    for name in names:
        try:
            return importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - see the docstring
            error = err
    raise ImportError(f"none of {', '.join(names)} could be imported: {error}") from error


def _spec_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # noqa: BLE001 - a parent package that fails to import
        return False


def missing_requirement(name: str) -> Optional[str]:
    """Why backend ``name`` cannot be used in this environment (what to install), or None.

    Checks that the package is installed without importing it (the flash-attention packages load
    CUDA libraries at import); whether the GPU takes it is known only when it runs.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
    if name == "flex":
        if not _spec_exists("torch.nn.attention.flex_attention"):
            return f"attention='flex' needs torch.nn.attention.flex_attention, absent from torch {torch.__version__}"
        return None
    if name in _FA_MODULES:
        if not any(_spec_exists(module) for module in _FA_MODULES[name]):
            return f"attention={name!r} needs {_FA_INSTALL[name]}; none of {', '.join(_FA_MODULES[name])} is installed"
    return None


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@dataclass(kw_only=True)
class AttentionBackends:
    """Runs each backend by name on the GPT's (B, nh, T, hd) layout; holds what the backends keep
    between calls (FlexAttention's compiled function and its block masks, the imported packages).

    :meth:`unsupported` answers, without running anything, why a backend cannot take these tensors
    (None when it may: the library can still refuse a shape when called, which the selector treats
    as unsupported too).
    """

    #: backends Dynamo traces into a graph (custom ops, higher-order ops or SDPA itself)
    TRACEABLE = ("cudnn", "flash", "efficient", "flex", "fa3", "triton")
    #: backends that take packed-document masks (``doc_ids``)
    DOCUMENT_MASKED = ("efficient", "flex", "triton")

    compile_flex: bool = True
    _flex_fn: Optional[Callable] = field(default=None, init=False, repr=False)
    _block_masks: dict[tuple, Any] = field(default_factory=dict, init=False, repr=False)
    _modules: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    # one batch's document masks, kept while the layers of one forward (and its recomputation) reuse them
    _doc_masks: dict[str, tuple] = field(default_factory=dict, init=False, repr=False)

    # ---- what can run ------------------------------------------------------------------------

    def module(self, name: str) -> Any:
        """The imported flash-attention package for "fa3" / "fa4" (ImportError when absent)."""
        if name not in self._modules:
            self._modules[name] = _import_first(_FA_MODULES[name])
        return self._modules[name]

    def unsupported(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    doc_ids: Optional[torch.Tensor] = None) -> Optional[str]:
        if doc_ids is not None and name not in self.DOCUMENT_MASKED:
            return f"{name} does not take document masks (doc_ids); those that do: {self.DOCUMENT_MASKED}"
        if name in SDPA_BACKENDS:
            return None
        if name == "triton":
            try:
                from lightning_perf.kernels.ops.flash_attention import flash_attention_supported
            except ImportError:
                return "Triton is not installed"
            return None if flash_attention_supported(q, k, v) else "flash_attention does not take this shape / dtype"
        if name == "flex":  # part of torch >= 2.5
            return None
        # fa3 / fa4: CUDA, half precision, head dims the kernels are built for
        if not q.is_cuda:
            return f"{name} runs on CUDA tensors only"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"{name} takes fp16 / bf16, not {q.dtype}"
        if q.shape[-1] % 8 or q.shape[-1] > 256:
            return f"{name} takes head dims that are multiples of 8 up to 256, not {q.shape[-1]}"
        try:
            self.module(name)
        except ImportError as err:
            return f"{_FA_INSTALL[name]} is not available: {err}"
        return None

    # ---- running ------------------------------------------------------------------------------

    def __call__(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd) [causal]) v by backend ``name``; q (B, nh, T, hd) -> (B, nh, T, hd).
        With ``doc_ids`` (B, T): document-causal (``causal`` is implied), by one of :attr:`DOCUMENT_MASKED`."""
        if doc_ids is not None:
            return self.documents(name, q, k, v, doc_ids)
        if name in SDPA_BACKENDS:
            return sdpa(q, k, v, causal, name)
        if name == "flex":
            return self.flex(q, k, v, causal)
        if name == "fa3":
            return self.fa3(q, k, v, causal)
        if name == "fa4":
            return _fa4(self.module("fa4"), q, k, v, causal)
        if name == "triton":
            from lightning_perf.kernels.ops.flash_attention import flash_attention

            return flash_attention(q, k, v, causal=causal)
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")

    def documents(self, name: str, q, k, v, doc_ids: torch.Tensor) -> torch.Tensor:
        """Document-causal attention by ``name`` (one of :attr:`DOCUMENT_MASKED`, or ``"sdpa"`` for SDPA's
        own choice with the explicit mask)."""
        if name == "sdpa":
            return sdpa_documents(q, k, v, doc_ids, mask=self._doc_mask("sdpa", doc_ids))
        if name == "efficient":
            return sdpa_documents(q, k, v, doc_ids, "efficient", mask=self._doc_mask("sdpa", doc_ids))
        if name == "flex":
            return self.flex(q, k, v, True, block_mask=self._doc_mask("flex", doc_ids))
        if name == "triton":
            from lightning_perf.kernels.ops.flash_attention import flash_attention

            return flash_attention(q, k, v, causal=True, doc_ids=doc_ids)
        raise ValueError(f"attention backend {name!r} does not take document masks; use one of "
                         f"{self.DOCUMENT_MASKED} or 'sdpa'")

    def _doc_mask(self, kind: str, doc_ids: torch.Tensor) -> Any:
        """The SDPA boolean mask or the Flex ``BlockMask`` of ``doc_ids``, built once per batch: kept
        while the same, unmodified ``doc_ids`` tensor comes back (every layer of a forward)."""
        from lightning_perf.kernels.document_mask import document_block_mask, document_mask

        build = document_mask if kind == "sdpa" else document_block_mask
        if torch.compiler.is_compiling():
            return build(doc_ids)
        held = self._doc_masks.get(kind)
        if held is not None and held[0] is doc_ids and held[1] == doc_ids._version:
            return held[2]
        mask = build(doc_ids)
        self._doc_masks[kind] = (doc_ids, doc_ids._version, mask)
        return mask

    def block_mask(self, T: int, device: torch.device) -> Any:
        """The causal ``BlockMask`` for T queries and T keys on ``device``, built once and kept
        (B and H broadcast: one mask serves every batch and head)."""
        key = (T, str(device))
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            self._block_masks[key] = create_block_mask(_causal, None, None, T, T, device=device)
        return self._block_masks[key]

    def flex(self, q, k, v, causal: bool, block_mask: Any = None) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        mask = block_mask
        if mask is None and causal:
            mask = self.block_mask(q.shape[-2], q.device)
        gqa = k.shape[1] != q.shape[1]
        if torch.compiler.is_compiling() or not self.compile_flex:
            # inside a traced model the enclosing compile lowers it
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        if self._flex_fn is None:
            self._flex_fn = torch.compile(flex_attention, dynamic=False)
        return self._flex_fn(q, k, v, block_mask=mask, enable_gqa=gqa)

    def fa3(self, q, k, v, causal: bool) -> torch.Tensor:
        # (B, nh, T, hd) -> (B, T, nh, hd) and back: transposes only
        out = self.module("fa3").flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 causal=causal)
        if isinstance(out, tuple):  # older builds return (out, softmax_lse)
            out = out[0]
        return out.transpose(1, 2)


@torch.compiler.disable
def _fa4(module: Any, q, k, v, causal: bool) -> torch.Tensor:
    # FA4's autograd Function compiles CuTe DSL kernels on the host: run eagerly, a graph break under compile
    out = module.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    if isinstance(out, tuple):  # (out, lse)
        out = out[0]
    return out.transpose(1, 2)
