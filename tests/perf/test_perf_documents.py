"""Attention FLOPs of packed documents against hand counts (lightning_perf.perf.documents)."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.models import GPTConfig
from lightning_perf.perf.documents import (
    DocumentWorkReader,
    document_attention_flops,
    document_lengths,
    document_work,
    packed_batch_flops,
)

CFG = GPTConfig.from_name("tiny", block_size=16)  # L = 4 layers, d = 256
L, D = 4, 256


def test_gpt_attention_flops_per_token_by_hand():
    """Per token of a causal sequence of T: 2 matmuls x 2 FLOPs x d x T / 2 (causal) per layer = 2LdT
    forward, twice that backward; the rest of flops_per_token is 6 x non-embedding parameters."""
    assert CFG.attention_flops_per_token(16) == 6 * L * D * 16 == 98_304
    assert CFG.flops_per_token(16) == 6 * CFG.num_params(include_embedding=False) + 98_304
    assert CFG.attention_flops_per_token(16, "full") == 8 * L * D * 16  # the forward runs again
    down_proj = CFG.intermediate_size * D + D  # tiny has biases
    recomputed = CFG.num_params("blocks") - L * down_proj
    assert CFG.hardware_flops_per_token(16, "full") == CFG.flops_per_token(16) + 2 * recomputed + 2 * L * D * 16


def test_documents_of_4_4_8_by_hand():
    """T = 16 split 4 + 4 + 8: forward 2Ld x (16 + 16 + 64) = 196,608; backward twice that."""
    flops = document_attention_flops([4, 4, 8], attention_flops_per_token=CFG.attention_flops_per_token)
    assert flops.forward == 2 * L * D * (4 * 4 + 4 * 4 + 8 * 8) == 196_608
    assert flops.backward == 2 * flops.forward == 393_216
    assert flops.model == 6 * L * D * 96
    # against one causal sequence of 16 tokens: 96 / 256 of its attention work
    whole = 16 * CFG.attention_flops_per_token(16)
    assert flops.model / whole == pytest.approx(96 / 256)


def test_one_document_is_the_unpacked_count():
    one = document_attention_flops([16], attention_flops_per_token=CFG.attention_flops_per_token)
    assert one.model == 16 * CFG.attention_flops_per_token(16)
    batch = packed_batch_flops(tokens=2 * 16, seq_len=16, flops_per_token=CFG.flops_per_token(16),
                               attention_flops_per_token=CFG.attention_flops_per_token(16), square_sum=2 * 16**2)
    assert batch == 2 * 16 * CFG.flops_per_token(16)


def test_eight_documents_do_an_eighth_of_the_attention():
    T = 64
    eighth = document_attention_flops([T // 8] * 8, attention_flops_per_token=CFG.attention_flops_per_token)
    assert eighth.model * 8 == T * CFG.attention_flops_per_token(T)


def test_packed_batch_flops_equal_the_per_document_sum():
    rows = [[4, 4, 8], [16], [1] * 16]
    T, fpt, attn = 16, CFG.flops_per_token(16), CFG.attention_flops_per_token(16)
    dense = (fpt - attn) * 16 * len(rows)
    by_document = sum(document_attention_flops(r, attention_flops_per_token=CFG.attention_flops_per_token).model
                      for r in rows)
    square_sum = sum(n * n for r in rows for n in r)  # 96 + 256 + 16
    assert square_sum == 368
    got = packed_batch_flops(tokens=16 * len(rows), seq_len=T, flops_per_token=fpt, attention_flops_per_token=attn,
                             square_sum=square_sum)
    assert got == dense + by_document
    with pytest.raises(ValueError, match="seq_len"):
        packed_batch_flops(tokens=16, seq_len=0, flops_per_token=fpt, attention_flops_per_token=attn, square_sum=1)


def test_document_work_and_lengths_from_doc_ids():
    doc_ids = torch.tensor([[0] * 4 + [1] * 4 + [2] * 8,
                            [7] * 16,
                            [0, 1] * 8],  # ids need not be adjacent: the mask is "same id, j <= i"
                           dtype=torch.int32)
    assert document_lengths(doc_ids) == [[4, 4, 8], [16], [8, 8]]
    work = document_work(doc_ids)
    assert work.dtype == torch.int64 and work.tolist() == [96 + 256 + 128, 3 + 1 + 2]
    reader = DocumentWorkReader()
    read = reader.read(reader.issue(doc_ids))
    assert (read.square_sum, read.documents) == (480, 6)


def test_document_work_counts_the_document_causal_mask():
    """sum L**2 is twice the allowed (i, j) pairs of the mask less the diagonal: the causal-half convention."""
    from lightning_perf.kernels.document_mask import document_mask

    g = torch.Generator().manual_seed(0)
    doc_ids = torch.randint(0, 3, (3, 24), generator=g).sort(dim=1).values
    allowed = int(document_mask(doc_ids).sum())
    square_sum = int(document_work(doc_ids)[0])
    assert 2 * allowed - doc_ids.numel() == square_sum
