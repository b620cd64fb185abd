"""Document-causal attention over packed documents: every backend that takes ``doc_ids`` against
attention run on each document alone (outputs and gradients), the positions, and the routing."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_perf.kernels import dispatch
from lightning_perf.kernels.attention_backends import AttentionBackends, sdpa_documents
from lightning_perf.kernels.document_mask import (
    document_attention_reference,
    document_mask,
    document_positions,
)
from lightning_perf.kernels.ops.flash_attention import attention_reference, flash_attention

# (B, nh, nkv, hd, document lengths per row): one-token documents, documents longer than a block,
# a row of one document, T no multiple of a block, GQA 4:2 and 3:1
CASES = [
    (2, 2, 2, 16, [[5, 1, 14, 4], [24]]),
    (1, 4, 2, 16, [[17, 3, 1, 1, 15]]),
    (1, 3, 1, 32, [[1, 21, 11]]),
]


def _doc_ids(lengths: list[list[int]], device) -> torch.Tensor:
    rows = [torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)]) for row in lengths]
    return torch.stack(rows).to(device)


def _qkv(B, nh, nkv, T, hd, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, hd, generator=gen).to(device).requires_grad_() for n in (nh, nkv, nkv)]


def _per_document(q, k, v, lengths):
    """Causal attention of each document on its own (float64), put back in place."""
    rows = []
    for b, row in enumerate(lengths):
        parts, start = [], 0
        for n in row:
            s = slice(start, start + n)
            parts.append(attention_reference(q[b:b + 1, :, s].double(), k[b:b + 1, :, s].double(),
                                             v[b:b + 1, :, s].double(), causal=True))
            start += n
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).to(q.dtype)


def _check_against_documents(run, case, device, close, what):
    B, nh, nkv, hd, lengths = case
    T = sum(lengths[0])
    q, k, v = _qkv(B, nh, nkv, T, hd, device)
    doc_ids = _doc_ids(lengths, device)
    out = run(q, k, v, doc_ids)
    ref = _per_document(q, k, v, lengths)
    tol = 5e-3 if q.is_cuda else 1e-5  # on a GPU, fp32 tiles multiply in tf32 (10-bit mantissa)
    close(out, ref, tol, tol, f"{what} output")
    dy = torch.randn_like(out)
    for name, g, r in zip("qkv", torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        close(g, r, tol, tol, f"{what} grad of {name}")


def _ids(case):
    return "B{}_h{}_kv{}_d{}_docs{}".format(*case[:4], "-".join(str(len(r)) for r in case[4]))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_sdpa_mask_matches_each_document_alone(case, close, device):
    _check_against_documents(lambda q, k, v, d: sdpa_documents(q, k, v, d), case, device, close, "sdpa mask")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_triton_kernel_matches_each_document_alone(case, close, device, poison):
    if device == "cpu":
        import os

        assert os.environ.get("TRITON_INTERPRET") == "1"
    _check_against_documents(lambda q, k, v, d: flash_attention(q, k, v, doc_ids=d), case, device, close,
                             "triton documents")


@pytest.mark.parametrize("case", CASES[:2], ids=_ids)
def test_flex_matches_each_document_alone(case, close, device, flex_backward_on_cpu):
    """Eager FlexAttention with the document ``mask_mod`` (its backward runs on CPU only past torch's
    entry check, see the fixture); the compiled one on a GPU below."""
    backends = AttentionBackends(compile_flex=False)
    _check_against_documents(lambda q, k, v, d: backends("flex", q, k, v, True, doc_ids=d), case, device, close,
                             "flex documents")


@pytest.mark.gpu  # compiled FlexAttention backward needs a GPU
def test_compiled_flex_documents_on_gpu(close):
    backends = AttentionBackends()
    _check_against_documents(lambda q, k, v, d: backends("flex", q, k, v, True, doc_ids=d), CASES[1], "cuda",
                             close, "compiled flex documents")


def test_one_document_is_plain_causal_attention(close, device):
    q, k, v = (t.detach() for t in _qkv(1, 2, 1, 21, 16, device))
    doc_ids = torch.zeros(1, 21, dtype=torch.int32, device=device)
    close(flash_attention(q, k, v, doc_ids=doc_ids), flash_attention(q, k, v), 1e-6, 1e-6, "triton, one document")
    close(document_attention_reference(q, k, v, doc_ids), attention_reference(q, k, v), 1e-6, 1e-6, "reference")


def test_positions_and_mask_by_hand():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    assert document_positions(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    mask = document_mask(doc_ids)[0, 0].int()
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def test_doc_ids_shape_is_checked(device):
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 8, 16, device))
    with pytest.raises(ValueError, match=r"doc_ids must be \(B=1, T=8\)"):
        flash_attention(q, k, v, doc_ids=torch.zeros(1, 7, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="causal=False"):
        flash_attention(q, k, v, causal=False, doc_ids=torch.zeros(1, 8, dtype=torch.int32, device=device))


def test_flex_block_mask_is_built_once_per_batch(device):
    backends = AttentionBackends(compile_flex=False)
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 24, 16, device))
    doc_ids = _doc_ids([[10, 14]], device)
    backends("flex", q, k, v, True, doc_ids=doc_ids)
    mask = backends._doc_masks["flex"][2]
    backends("flex", q, k, v, True, doc_ids=doc_ids)  # the next layer of the same forward
    assert backends._doc_masks["flex"][2] is mask
    backends("flex", q, k, v, True, doc_ids=_doc_ids([[3, 21]], device))  # the next batch
    assert backends._doc_masks["flex"][2] is not mask


def test_backends_without_document_masks_are_refused_and_rerouted(caplog, close, device):
    """FA3 / FA4 / cuDNN / flash cannot take the mask: ``unsupported`` says so (the selector skips
    them) and a named one is replaced by a backend that can, with one log line."""
    backends = AttentionBackends()
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 19, 16, device))
    doc_ids = _doc_ids([[4, 15]], device)
    for name in ("cudnn", "flash", "fa3", "fa4"):
        assert "does not take document masks" in backends.unsupported(name, q, k, v, doc_ids)
    with pytest.raises(ValueError, match="does not take document masks"):
        backends("fa3", q, k, v, True, doc_ids=doc_ids)
    disp = dispatch.KernelDispatcher()
    ref = document_attention_reference(q, k, v, doc_ids)
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        close(disp.attention(q, k, v, impl="fa3", doc_ids=doc_ids), ref, 1e-5, 1e-5, "fa3 rerouted")
        close(disp.attention(q, k, v, impl="fa3", doc_ids=doc_ids), ref, 1e-5, 1e-5, "fa3 rerouted again")
    lines = [r.getMessage() for r in caplog.records if "packed documents" in r.getMessage()]
    assert len(lines) == 1 and "'fa3'" in lines[0]
    for impl in ("sdpa", "auto", "flex", "triton"):
        close(disp.attention(q, k, v, impl=impl, doc_ids=doc_ids), ref, 1e-5, 1e-5, f"impl={impl}")


def test_auto_times_only_backends_that_take_document_masks(monkeypatch, device):
    """With ``doc_ids`` the selector's candidates are narrowed to FlexAttention, the Triton kernel and
    SDPA's memory-efficient backend, and the choice is cached apart from plain causal attention."""
    selector = dispatch.AttentionSelector(candidates=dispatch.SDPA_BACKENDS + ("flex", "fa3", "fa4"))
    timed: list[str] = []
    costs = {"efficient": 3.0, "flex": 2.0, "cudnn": 1.0, "flash": 1.0}
    monkeypatch.setattr(selector, "can_time", lambda q: True)

    def fake_time(name, q, k, v, causal, doc_ids=None):
        timed.append(name)
        if name in ("fa3", "fa4"):
            raise RuntimeError("not installed here")
        return costs[name]

    monkeypatch.setattr(selector, "_time", fake_time)
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 16, 16, device))
    assert selector.choose(q, k, v, True, _doc_ids([[6, 10]], device)) == "flex"
    assert timed == ["efficient", "flex"]
    timed.clear()
    assert selector.choose(q, k, v, True) == "cudnn"  # plain causal: its own key, every candidate
    assert "cudnn" in timed and "flash" in timed


def test_triton_documents_with_unequal_blocks(monkeypatch, close, device, poison):
    """Query and key blocks of different sizes (as on the GPU): the document path walks the causal
    loops of the one kernel, below-diagonal tiles unmasked but for the ids, the diagonal masked."""
    from lightning_perf.kernels.ops import flash_attention_configs as fc

    cfg, table = fc._cfg, fc._base_configs
    forced = {"fwd": [cfg(32, 16, 4, 1)], "dq": [cfg(32, 16, 4, 1)], "dkdv": [cfg(16, 32, 4, 1)]}
    monkeypatch.setattr(fc, "_config_cache", {})
    monkeypatch.setattr(fc, "_base_configs", lambda kernel, D, cuda: forced.get(kernel) or table(kernel, D, cuda))
    case = (1, 4, 2, 16, [[3, 30, 1, 19, 2]])  # T = 55: a document across three key blocks, a ragged tail
    _check_against_documents(lambda q, k, v, d: flash_attention(q, k, v, doc_ids=d), case, device, close,
                             "triton documents, 32x16 blocks")
